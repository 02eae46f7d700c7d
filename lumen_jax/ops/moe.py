"""Mixture-of-experts dispatch: `moe(x, weights, cfg, ops)`, router in float32 and routed experts.

The router is a linear gate computed in float32 on the whole (global) batch:

- `softmax`: probabilities softmax(logits); each token takes its top-k, weights renormalised to sum 1.
- `sigmoid` (DeepSeek-V3): scores sigmoid(logits); top-k, weights normalised to sum 1.

Its auxiliary losses (returned, and added to the objective by the train step like any auxiliary
term of the model's output):

- load balancing (Switch Transformer) `num_experts * sum_i f_i * P_i`, with f_i the fraction of the
  token-expert assignments routed to expert i (before capacity drops; sum_i f_i = 1) and P_i the
  mean router probability of expert i (sigmoid: the scores normalised per token); 1 when uniform.
- router z-loss (ST-MoE) `mean(logsumexp(logits)^2)`.

The routed tokens go through `lumen_jax.parallel.expert.dispatch` (sorted by expert, grouped
matmuls, all-to-all over the `expert` mesh axis); `Ops.moe_exchange` says how rows cross devices,
`Ops.moe_matmul` how the experts' grouped matmuls run (`ops.grouped`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lumen_jax.config import MoeConfig
from lumen_jax.ops.choice import Ops
from lumen_jax.parallel import expert


def route(x_btd: jax.Array, w_router_de: jax.Array, cfg: MoeConfig) -> tuple[jax.Array, jax.Array, dict]:
    """(expert ids [B, T, K] int32, weights [B, T, K] float32, {balance_loss, router_z_loss, fraction [E]})."""
    logits = jnp.einsum("btd,de->bte", x_btd.astype(jnp.float32), w_router_de.astype(jnp.float32))
    if cfg.router == "softmax":
        scores = probs = jax.nn.softmax(logits, axis=-1)
    else:
        scores = jax.nn.sigmoid(logits)
        probs = scores / scores.sum(-1, keepdims=True)
    top_v, ids = jax.lax.top_k(scores, cfg.top_k)
    weights = top_v / top_v.sum(-1, keepdims=True)
    e = cfg.num_experts
    fraction = jax.nn.one_hot(ids, e, dtype=jnp.float32).sum(-2).mean((0, 1)) / cfg.top_k  # f_i
    balance = e * jnp.sum(jax.lax.stop_gradient(fraction) * probs.mean((0, 1)))
    z = jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
    return ids.astype(jnp.int32), weights, {"balance_loss": balance, "router_z_loss": z, "fraction": fraction}


def moe(x_btd: jax.Array, w_router_de: jax.Array, w_gate_edf: jax.Array, w_up_edf: jax.Array,
        w_down_efd: jax.Array, cfg: MoeConfig, ops: Ops) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The routed experts' output [B, T, D] and the layer's auxiliary terms.

    Returns:
      (y_btd in x's dtype, aux): aux["loss"] is the weighted sum of the auxiliary losses (what the
      objective adds), the other entries are metrics (`moe/...`, scalars).
    """
    ids, weights, stats = route(x_btd, w_router_de, cfg)
    y_btd, kept = expert.dispatch(x_btd, ids, weights, w_gate_edf, w_up_edf, w_down_efd,
                                  capacity_factor=cfg.capacity_factor, exchange=ops.moe_exchange,
                                  matmul=ops.moe_matmul)
    aux = {
        "loss": cfg.aux_loss_weight * stats["balance_loss"] + cfg.router_z_loss_weight * stats["router_z_loss"],
        "moe/balance_loss": stats["balance_loss"],
        "moe/router_z_loss": stats["router_z_loss"],
        "moe/expert_fraction_min": stats["fraction"].min(),
        "moe/expert_fraction_max": stats["fraction"].max(),
        "moe/dropped_fraction": 1.0 - kept.astype(jnp.float32).mean(),
    }
    return y_btd, aux
