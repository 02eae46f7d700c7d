"""The mixture-of-experts MLP: a float32 router, `num_experts` SwiGLU experts, optional shared experts.

Single-device math in logical axes: the experts' weights are stacked on an `experts` axis
([E, D, F], [E, F, D]); how tokens reach them (sorting, grouped matmuls, all-to-all across devices)
is `ops.moe`, and so is the routing (`ops.moe.route`: scores, choice, weights, balancing). Shared
experts (DeepSeek, Qwen2-MoE) are one dense SwiGLU MLP of width shared_experts * F that every token
goes through, equal to that many separate experts summed; with `shared_gate` (Qwen2-MoE) its output
is scaled per token by sigmoid(x . w_shared_gate). `balance: bias` keeps the router's bias and load
as model state (`ops.moe.balance_state`), not parameters.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from lumen_jax.config import ModelConfig
from lumen_jax.model.layers import MLP, _param
from lumen_jax.ops import moe as moe_ops
from lumen_jax.ops.choice import Ops
from lumen_jax.ops.projection import Tape


class MoE(nnx.Module):
    """`__call__(x_btd, ops) -> (y_btd, aux)`: routed (+ shared) experts; `aux` as `ops.moe.moe`."""

    def __init__(self, cfg: ModelConfig, ops: Ops, *, rngs: nnx.Rngs):
        self.moe = cfg.moe
        d, f, e = cfg.d_model, cfg.expert_ffn_dim, cfg.moe.num_experts
        self.router = _param(rngs, (d, e), ("embed", None), cfg.init_std)
        self.w_gate = _param(rngs, (e, d, f), ("experts", "embed", "mlp"), cfg.init_std)
        self.w_up = _param(rngs, (e, d, f), ("experts", "embed", "mlp"), cfg.init_std)
        self.w_down = _param(rngs, (e, f, d), ("experts", "mlp", "embed"), cfg.init_std / math.sqrt(2 * cfg.num_layers))
        if cfg.moe.shared_experts:
            self.shared = MLP(dataclasses.replace(cfg, ffn_dim=cfg.moe.shared_experts * f), ops, rngs=rngs)
        if cfg.moe.shared_gate:
            self.shared_gate = _param(rngs, (d,), ("embed",), cfg.init_std)
        self.balance = moe_ops.balance_state(cfg.moe)

    def __call__(self, x_btd: jax.Array, ops: Ops, tape: Tape | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        state = None if self.balance is None else {k: v[...] for k, v in self.balance.items()}
        y_btd, aux = moe_ops.moe(x_btd, self.router[...], self.w_gate[...], self.w_up[...], self.w_down[...],
                                 self.moe, ops, state, tape)
        if self.moe.shared_experts:
            shared_btd = self.shared(x_btd, ops, None if tape is None else tape.scope("shared"))
            if self.moe.shared_gate:
                gate_bt = jax.nn.sigmoid(jnp.einsum("btd,d->bt", x_btd.astype(jnp.float32), self.shared_gate[...]))
                shared_btd = (gate_bt[..., None] * shared_btd.astype(jnp.float32)).astype(x_btd.dtype)
            y_btd = y_btd + shared_btd
        return y_btd, aux
