"""Silent-data-corruption check: replicas of the same parameter shard must hold the same bits.

Every parameter shard lives on several devices (its replicas: the devices that differ only along
the mesh axes the parameter is not sharded over, e.g. `data`). A device whose arithmetic or memory
went bad produces a replica whose bits differ from the others'. `find_divergent_replicas` computes
a checksum of every shard on the device holding it (one `shard_map` over the whole mesh), gathers
the checksums, and names each device that disagrees with the majority of its replica group.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from lumen_jax.runtime.checksums import checksums


def _local_checksums(mesh: Mesh, tree: Any) -> list[np.ndarray]:
    """Per leaf, [num_devices, 2] uint32 checksums of each device's shard, in mesh device order."""
    leaves = jax.tree.leaves(tree)
    specs = [x.sharding.spec for x in leaves]
    all_axes = tuple(mesh.axis_names)

    def per_device(*shards: jax.Array) -> list[jax.Array]:
        sums = checksums(list(shards))
        return [s[None] for s in sums]  # [1, 2] per device -> [num_devices, 2] outside

    fn = jax.shard_map(per_device, mesh=mesh, in_specs=tuple(specs),
                       out_specs=[P(all_axes)] * len(leaves), check_vma=False)
    out = jax.jit(fn)(*leaves)
    return [np.asarray(multihost_utils.process_allgather(o, tiled=True)) for o in out]


def find_divergent_replicas(mesh: Mesh, params: Any) -> list[str]:
    """Descriptions of devices whose parameter shard differs from its replicas' (empty: all agree)."""
    flat = jax.tree_util.tree_leaves_with_path(params)
    sums = _local_checksums(mesh, params)
    devices = list(mesh.devices.flat)
    coords = {d.id: dict(zip(mesh.axis_names, idx)) for idx, d in np.ndenumerate(mesh.devices)}
    problems: list[str] = []
    for (path, leaf), leaf_sums in zip(flat, sums):
        index_of = leaf.sharding.devices_indices_map(leaf.shape)  # device -> slices of its shard
        groups: dict[str, list[int]] = defaultdict(list)
        for i, d in enumerate(devices):
            groups[repr(index_of[d])].append(i)
        for members in groups.values():
            votes = Counter(tuple(leaf_sums[i]) for i in members)
            if len(votes) == 1:
                continue
            (majority, top), *rest = votes.most_common()
            if rest and rest[0][1] == top:  # e.g. 2 replicas: no majority says which one is bad
                names = ", ".join(str(devices[i].id) for i in members)
                problems.append(f"replicas of {jax.tree_util.keystr(path)} on devices {names} "
                                "disagree and no majority tells which is wrong")
                continue
            for i in members:
                if tuple(leaf_sums[i]) != majority:
                    d = devices[i]
                    where = ",".join(f"{a}={c}" for a, c in coords[d.id].items())
                    problems.append(f"device {d.id} (mesh {where}) holds a replica of "
                                    f"{jax.tree_util.keystr(path)} that differs from its "
                                    f"{len(members) - 1} peer(s)")
    return problems
