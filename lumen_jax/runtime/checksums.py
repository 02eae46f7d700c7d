"""Exact checksums of arrays' bits, the same on any mesh: checkpoints record and verify them
(checkpoint/manager.py), the silent-data-corruption check compares replicas with them (parallel/sdc.py)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _words(x: jax.Array) -> jax.Array:
    """The array's bits as uint32 words (the checksum must see bits, not values: -0.0 != 0.0)."""
    x = jnp.ravel(x)
    if x.dtype.itemsize == 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    if x.dtype.itemsize == 2:
        return jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    if x.dtype.itemsize == 1:
        return jax.lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint32)
    raise TypeError(f"no checksum for dtype {x.dtype}")


@jax.jit
def checksums(tree: Any) -> Any:
    """Per array, two uint32 sums of its bits (plain and position-weighted), exact on any mesh.

    Integer sums wrap around and are associative, so the result does not depend on how the array
    is sharded or in which order devices add up their parts.
    """
    def one(x: jax.Array) -> jax.Array:
        w = _words(x)
        weight = (jnp.arange(w.shape[0], dtype=jnp.uint32) % jnp.uint32(65521)) + jnp.uint32(1)
        return jnp.stack([jnp.sum(w, dtype=jnp.uint32), jnp.sum(w * weight, dtype=jnp.uint32)])
    return jax.tree.map(one, tree)


def checksum_list(tree: Any) -> list[list[int]]:
    """`checksums` of every leaf as plain ints, in leaf order (JSON for a checkpoint's meta)."""
    return [[int(v) for v in np.asarray(c)] for c in jax.tree.leaves(jax.device_get(checksums(tree)))]


@jax.jit
def _nonfinite_counts(tree: Any) -> Any:
    return jax.tree.map(lambda x: jnp.sum(~jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact)
                        else jnp.zeros((), jnp.int32), tree)


def nonfinite_paths(tree: Any) -> list[str]:
    """The paths of the floating-point leaves of `tree` that hold an inf or a NaN (empty: all finite)."""
    counts = jax.device_get(_nonfinite_counts(tree))
    return [jax.tree_util.keystr(p) for p, c in jax.tree_util.tree_leaves_with_path(counts) if int(c)]
