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


def token_objective_vocab_sharded(logits_btv: jax.Array, targets_bt: jax.Array, loss_mask_bt: jax.Array,
                                  z_loss: float) -> tuple[jax.Array, jax.Array]:
    """`token_objective` written as reductions over the vocabulary only (logsumexp, and the target's
    logit as a sum of the logits times its one-hot), so logits sharded over `vocab` stay sharded: each
    device reduces its slice and the partial sums are added (Megatron's vocab-parallel cross-entropy;
    a lookup of the target's logit would gather the vocabulary)."""
    mask = loss_mask_bt.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits_btv, axis=-1)
    hit = jax.lax.broadcasted_iota(jnp.int32, logits_btv.shape, 2) == targets_bt[..., None]
    target_logit = jnp.where(hit, logits_btv, 0.0).sum(-1)
    ce_sum = ((log_z - target_logit) * mask).sum()
    if not z_loss:
        return ce_sum, ce_sum
    return ce_sum + z_loss * (jnp.square(log_z) * mask).sum(), ce_sum
