"""Config -> `jax.sharding.Mesh` with axes (data, fsdp, context, tensor), outermost to innermost.

Axis types are **Auto** on purpose: parameters and batches get explicit `NamedSharding`s at the jit
boundary and activations are pinned with `with_sharding_constraint` (see `rules.constrain`); the
GSPMD partitioner derives every collective in between. Explicit axes (this JAX's default) would
make model code carry `out_sharding=` on every ambiguous op (embedding lookup, row-parallel
matmuls), which is mesh knowledge the model must not have.
"""

from __future__ import annotations

from typing import Sequence

import jax
from jax.sharding import AxisType, Mesh

from lumen_jax.config import MeshConfig

AXES = MeshConfig.AXES


def make_mesh(shape: dict[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Mesh over `devices` (default: all) with the resolved axis sizes `shape` (see MeshConfig.shape)."""
    sizes = tuple(shape[a] for a in AXES)
    return jax.make_mesh(sizes, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)
