"""Per-device code over the trainer's mesh, by logical axis names: the one wrapper of `shard_map`
that ops use (flash attention's kernel per shard, the output layer and loss per shard of the
vocabulary, context parallelism's ring), and the collectives such code calls by logical names
(`psum_over`, `pmax_over`, `index_over`).

A Pallas call, or a schedule of collectives written per device, has no SPMD partitioning rule:
without `shard_map` XLA would gather its operands onto every device. `per_device(fn, in_axes,
out_axes)` runs `fn` on each device's shards of the mesh that `rules.activate` made active, its
arguments and results split along the mesh axes their logical names map to (`rules.Rules.spec`).
Outside `activate`, or on a mesh of one device, it is `fn` itself, so single-device code runs it
untouched.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from lumen_jax.parallel import rules as rules_lib

Names = tuple[str | None, ...]  # the logical axis names of one array, e.g. ("batch", "seq", "act_heads", None)


def _is_names(x: Any) -> bool:
    return isinstance(x, tuple) and all(isinstance(a, (str, type(None))) for a in x)


def per_device(fn: Callable[..., Any], in_axes: Sequence[Names], out_axes: Any) -> Callable[..., Any]:
    """`fn` run per device over the active mesh (see the module docstring).

    Args:
      fn: a function of local shards; it may call collectives over the mesh's axis names.
      in_axes: the logical names of each positional argument. An argument passed as None stays None
        (e.g. absent segment ids).
      out_axes: the logical names of the result, or a tuple of them for several results.

    Returns:
      A function of global arrays with `fn`'s signature.
    """
    def run(*args: Any) -> Any:
        active = rules_lib.active()
        if active is None or active[0].size == 1:
            return fn(*args)
        mesh, rules = active
        present = [i for i, a in enumerate(args) if a is not None]

        def local(*shards: Any) -> Any:
            full: list[Any] = [None] * len(args)
            for i, x in zip(present, shards):
                full[i] = x
            return fn(*full)

        out_specs = jax.tree.map(rules.spec, out_axes, is_leaf=_is_names)
        extra = {}
        inner = jax.sharding.get_abstract_mesh()
        if not inner.empty and inner.manual_axes:  # inside a pipeline stage: the other axes only
            mesh, extra = inner, {"axis_names": set(inner.axis_names) - set(inner.manual_axes)}
        return jax.shard_map(local, mesh=mesh, in_specs=tuple(rules.spec(in_axes[i]) for i in present),
                             out_specs=out_specs, check_vma=False, **extra)(*(args[i] for i in present))
    return run


def _mesh_axes(names: Names) -> tuple[str, ...]:
    """The mesh axes logical `names` map to in the active rules (none outside `rules.activate`)."""
    active = rules_lib.active()
    if active is None or active[0].size == 1:
        return ()
    out: list[str] = []
    for axes in active[1].spec(names):
        out += (axes,) if isinstance(axes, str) else list(axes or ())
    return tuple(out)


def psum_over(x: jax.Array, names: Names) -> jax.Array:
    """Inside `per_device`: `x` summed over the devices that hold the blocks of logical axes `names`
    (`x` itself when none are split)."""
    axes = _mesh_axes(names)
    return jax.lax.psum(x, axes) if axes else x


def pmax_over(x: jax.Array, names: Names) -> jax.Array:
    """Inside `per_device`: the maximum of `x` over the devices that hold the blocks of `names`."""
    axes = _mesh_axes(names)
    return jax.lax.pmax(x, axes) if axes else x


def index_over(names: Names) -> jax.Array:
    """Inside `per_device`: which block of logical axes `names` this device holds (0 when unsplit)."""
    axes = _mesh_axes(names)
    return jax.lax.axis_index(axes) if axes else jnp.zeros((), jnp.int32)


def mesh_axis_size(axis: str) -> int:
    """The size of mesh axis `axis` in the active mesh (1 outside `rules.activate`)."""
    active = rules_lib.active()
    return 1 if active is None else active[0].shape.get(axis, 1)


def axes_size(names: Names) -> int:
    """How many blocks an array whose axes carry logical `names` is split into over the active
    mesh (1 outside `rules.activate`)."""
    active = rules_lib.active()
    return math.prod(active[0].shape[a] for a in _mesh_axes(names)) if active else 1
