"""Config -> `jax.sharding.Mesh` with axes (data, fsdp, pipeline, expert, context, tensor),
outermost to innermost.

Axis types are **Auto** on purpose: parameters and batches get explicit `NamedSharding`s at the jit
boundary and activations are pinned with `with_sharding_constraint` (see `rules.constrain`); the
GSPMD partitioner derives every collective in between. Explicit axes (this JAX's default) would
make model code carry `out_sharding=` on every ambiguous op (embedding lookup, row-parallel
matmuls), which is mesh knowledge the model must not have.

Across nodes each axis is split into an across-node and an in-node part (`across_nodes`, chosen by
`lumen_jax.runtime.distributed.across_nodes`); `create_hybrid_device_mesh` keeps the in-node parts on NVLink.
`jax.make_mesh` refuses devices from several slices (nodes), so a multi-node mesh is always hybrid.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from lumen_jax.config import MeshConfig

AXES = MeshConfig.AXES


def make_mesh(shape: dict[str, int], devices: Sequence[jax.Device] | None = None,
              across_nodes: dict[str, int] | None = None) -> Mesh:
    """Mesh over `devices` (default: all) with the resolved axis sizes `shape` (see MeshConfig.shape).

    `across_nodes` {axis: k}: k slices of the axis lie across nodes, shape[axis] / k inside a node
    (see `hybrid_device_grid`); None or all 1: one node.
    """
    sizes = tuple(shape.get(a, 1) for a in AXES)  # an axis left out has size 1
    types = (AxisType.Auto,) * len(AXES)
    if not across_nodes or all(across_nodes.get(a, 1) == 1 for a in AXES):
        return jax.make_mesh(sizes, AXES, axis_types=types, devices=devices)
    grid = hybrid_device_grid(shape, list(jax.devices() if devices is None else devices), across_nodes)
    return Mesh(grid, AXES, axis_types=types)


def hybrid_device_grid(shape: dict[str, int], devices: Sequence[Any], across_nodes: dict[str, int]) -> np.ndarray:
    """Devices arranged along AXES (data, fsdp, pipeline, expert, context, tensor); along each axis
    the across-node index is the outer part (index = node_part * in_node + in_node_part), so the
    in-node part stays on one node's links.

    A node is a device's slice_index (GPUs: the host or NVLink domain); on CPU, a process.
    """
    in_node = tuple(shape.get(a, 1) // across_nodes.get(a, 1) for a in AXES)  # an axis left out has size 1
    return mesh_utils.create_hybrid_device_mesh(in_node, tuple(across_nodes.get(a, 1) for a in AXES), devices,
                                                process_is_granule=devices[0].platform == "cpu")
