"""A global batch cut into micro-batches, and the token count every micro-batch's objective is
divided by: the same for the plain step (`train/step.py`) and the pipelined one
(`parallel/pipeline/executor.py`), so that the summed gradients equal those of one big batch.

Shape letters: B rows of the global batch, M micro-batches, R replica groups.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def split_micro_batches(batch: dict, micro_batches: int, replicas: int = 1) -> dict:
    """[B, ...] -> [M, B/M, ...] (R = 1) or [R, M, B/(R M), ...]: micro-batch i takes rows i, i+M,
    ... of each replica group's rows, so each device's slice of the batch stays on that device."""
    m, r = micro_batches, replicas
    if r == 1:
        return jax.tree.map(lambda x: jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1), batch)
    return jax.tree.map(lambda x: jnp.swapaxes(x.reshape(r, x.shape[0] // (r * m), m, *x.shape[1:]), 1, 2), batch)


def total_tokens(batch: dict) -> jax.Array:
    """The token count every micro-batch's objective is divided by (at least 1)."""
    return jnp.maximum(batch["loss_mask"].astype(jnp.float32).sum(), 1.0)
