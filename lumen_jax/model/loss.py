"""The training objective of one micro-batch's logits: token cross-entropy plus PaLM's z-loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def token_objective(logits_btv: jax.Array, targets_bt: jax.Array, loss_mask_bt: jax.Array,
                    z_loss: float) -> tuple[jax.Array, jax.Array]:
    """(summed objective, summed cross-entropy) over the tokens the mask keeps; the objective adds
    `z_loss * log(Z)^2` per token when `z_loss` is set. Callers divide by the batch's token count."""
    mask = loss_mask_bt.astype(jnp.float32)
    ce_sum = (optax.softmax_cross_entropy_with_integer_labels(logits_btv, targets_bt) * mask).sum()
    if not z_loss:
        return ce_sum, ce_sum
    log_z = jax.nn.logsumexp(logits_btv, axis=-1)
    return ce_sum + z_loss * (jnp.square(log_z) * mask).sum(), ce_sum
