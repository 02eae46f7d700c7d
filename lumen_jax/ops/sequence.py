"""Token shifts along the sequence in the order the step holds the tokens (multi-token prediction's
inputs and targets k tokens ahead, `model/mtp.py`).

Without context parallelism a row holds its tokens in order: the shift is a `roll`. Under context
parallelism (`Ops.context`) the sequence axis is split over `context` and, with `mesh.context_balance=
zigzag`, permuted (`parallel.context.permute_tokens`): the shift is a gather of the token ids by a
static index over the whole row, per device (`parallel.context.shift_tokens`: the row's ids gathered
over `context`), exact in either layout, inside the step's replica vmap too, and cheap (int32 ids and
masks, [B, T], against the [B, T, D] activations).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lumen_jax.ops.choice import Ops
from lumen_jax.parallel import context as context_lib


def shift_left(x_bt: jax.Array, k: int, ops: Ops) -> tuple[jax.Array, jax.Array | np.ndarray]:
    """(x [B, T] at the token k later in the original order (the last k wrap around), bool [B, T]
    (or [1, T]): whether that token lies within the row), both in the order the step holds the tokens."""
    t = x_bt.shape[1]
    if ops.context:
        return context_lib.shift_tokens(x_bt, k)
    return jnp.roll(x_bt, -k, axis=1), (np.arange(t) < t - k)[None]
