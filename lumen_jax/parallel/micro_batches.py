"""A global batch cut into micro-batches, and the token count every micro-batch's objective is
divided by: the same for the plain step (`train/step.py`) and the pipelined one
(`parallel/pipeline/executor.py`), so that the summed gradients equal those of one big batch.

Shape letters: B rows of the global batch, T tokens per row, M micro-batches, R replica groups,
C of them splitting each row's tokens (context parallelism's groups; R / C split the rows).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def split_micro_batches(batch: dict, micro_batches: int, replicas: int = 1, seq_chunks: int = 1) -> dict:
    """[B, T, ...] -> [M, B/M, T, ...] (R = 1) or [R, M, B/(R/C M), T/C, ...]: micro-batch i takes
    rows i, i+M, ... of each replica group's rows; with C = `seq_chunks` > 1 replica group
    r = g C + c takes chunk c of the tokens of row group g's rows. The groups are ordered as the mesh
    holds the batch (rows over the row axes, tokens over `context`), so each device's slice of the
    batch stays on that device."""
    m, r, c = micro_batches, replicas, seq_chunks
    if r == 1:
        return jax.tree.map(lambda x: jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1), batch)

    def split(x: jax.Array) -> jax.Array:  # [B, T, ...] -> [R/C, B/(R/C M), M, C, T/C, ...] -> [R, M, ...]
        b, t = x.shape[:2]
        x = x.reshape(r // c, b // (r // c * m), m, c, t // c, *x.shape[2:])
        return jnp.moveaxis(x, (3, 2), (1, 2)).reshape(r, m, b // (r // c * m), t // c, *x.shape[5:])
    return jax.tree.map(split, batch)


def total_tokens(batch: dict) -> jax.Array:
    """The token count every micro-batch's objective is divided by (at least 1)."""
    return jnp.maximum(batch["loss_mask"].astype(jnp.float32).sum(), 1.0)
