"""Multi-head latent attention (DeepSeek-V2/V3, `model.kv_lora_rank` > 0) in Flax NNX.

Keys and values come from a per-token latent c = norm(x @ wkv_a) [R] (R = kv_lora_rank), expanded per
head by wk_b [R, N, Hn] (the keys' unrotated part) and wv_b [R, N, Hv] (the values); the keys' rotated
part is one [Hr] vector per token, x @ wk_rope, rotated and shared by every head. Queries are
[N, Hn + Hr]: from x through a normed latent [Rq] (`q_lora_rank` > 0: wq_a, q_norm, wq_b) or straight
(wq). Scores are scaled by (Hn + Hr)**-0.5. The attention itself is `ops.attention.attention` with
q/k heads Hn + Hr wide and value heads Hv wide (`ops.attention` says how each implementation takes
that); the output projection wo [N, Hv, D].

Sharding (logical axes): heads over `tensor` (wq/wq_b, wk_b, wv_b column-split, wo row-split, as
Megatron's and MaxText's MLA); the compressed projections wkv_a, wk_rope, wq_a and the latents' norms
replicated over `tensor` (each tensor rank computes the whole latent, R + Hr wide per token, and
expands its own heads); the latent axis (`latent`) of the up-projections sharded over `fsdp` with
ZeRO-3 like `embed`. Under context parallelism the latent is per token: the expanded K/V of each
chunk travel the ring as any K/V. Shape letters as layers.py, plus R kv_lora_rank, Q q_lora_rank,
A Hn (unrotated), E Hr (rotated), U Hv (value).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from lumen_jax.config import ModelConfig
from lumen_jax.model.layers import _param, _projector, apply_rope, norm, rope_attention_factor, yarn_mscale
from lumen_jax.ops.attention import attention
from lumen_jax.ops.choice import Ops
from lumen_jax.ops.projection import Tape, projection_state
from lumen_jax.parallel.rules import constrain

PROJECTIONS = ("q", "q_a", "q_b", "kv_a", "k_rope", "k_b", "v_b", "o")


class LatentAttention(nnx.Module):
    """Multi-head latent attention with `Attention`'s interface (`qkv`, `attend`, `out`): the K/V of
    `qkv` are expanded per head, [B, T, N, Hn + Hr] and [B, T, N, Hv] (the KV cache's entries)."""

    def __init__(self, cfg: ModelConfig, ops: Ops, *, rngs: nnx.Rngs):
        d, n, std = cfg.d_model, cfg.num_heads, cfg.init_std
        r, a, e, u = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        if cfg.q_lora_rank:
            self.wq_a = _param(rngs, (d, cfg.q_lora_rank), ("embed", None), std)
            self.q_norm = norm(cfg, cfg.q_lora_rank)
            self.wq_b = _param(rngs, (cfg.q_lora_rank, n, a + e), ("latent", "heads", "head_dim"), std)
        else:
            self.wq = _param(rngs, (d, n, a + e), ("embed", "heads", "head_dim"), std)
        self.wkv_a = _param(rngs, (d, r), ("embed", None), std)
        self.wk_rope = _param(rngs, (d, e), ("embed", None), std)
        self.kv_norm = norm(cfg, r)
        self.wk_b = _param(rngs, (r, n, a), ("latent", "heads", "head_dim"), std)
        self.wv_b = _param(rngs, (r, n, u), ("latent", "heads", "head_dim"), std)
        self.wo = _param(rngs, (n, u, d), ("heads", "head_dim", "embed"), std / math.sqrt(2 * cfg.num_layers))
        self.projections = projection_state(ops, "attention", PROJECTIONS)
        self.window = 0
        self.scale = (a + e) ** -0.5
        self.rope_factor = rope_attention_factor(cfg)  # YaRN: the rotated dims scaled, and the scores
        if cfg.rope_scaling == "yarn" and cfg.rope_yarn_mscale_all_dim:
            self.scale *= yarn_mscale(cfg.rope_scaling_factor, cfg.rope_yarn_mscale_all_dim) ** 2
        self.nope = a

    def __call__(self, x_btd: jax.Array, positions_bt: jax.Array, segment_ids_bt: jax.Array | None,
                 inv_freq: jax.Array, ops: Ops, tape: Tape | None = None, local: jax.Array | None = None) -> jax.Array:
        q, k, v = self.qkv(x_btd, positions_bt, inv_freq, ops, tape)
        return self.out(self.attend(q, k, v, segment_ids_bt, ops, local), ops, tape)

    def attend(self, q_btnh: jax.Array, k_btnh: jax.Array, v_btnu: jax.Array, segment_ids_bt: jax.Array | None,
               ops: Ops, local: jax.Array | None = None) -> jax.Array:
        """Causal attention [B, T, N, Hv] of the rotated q, k and v (no window: MLA models have none)."""
        return attention(q_btnh, k_btnh, v_btnu, segment_ids_bt=segment_ids_bt, causal=True, scale=self.scale,
                         ops=ops)

    def latent(self, x_btd: jax.Array, positions_bt: jax.Array, inv_freq: jax.Array, ops: Ops,
               tape: Tape | None = None) -> tuple[jax.Array, jax.Array]:
        """The per-token latent norm(x @ wkv_a) [B, T, R] and the rotated shared key part [B, T, Hr]."""
        proj = _projector(self, ops, "attention", self.projections, tape)
        c_btr = self.kv_norm(proj("btd,dr->btr", x_btd, "wkv_a", "kv_a"))
        k_rope = proj("btd,de->bte", x_btd, "wk_rope", "k_rope")
        k_rope = apply_rope(k_rope[:, :, None], positions_bt, inv_freq)[:, :, 0]
        if self.rope_factor != 1.0:
            k_rope = k_rope * jnp.asarray(self.rope_factor, k_rope.dtype)
        return constrain(c_btr, ("batch", "seq", None)), constrain(k_rope, ("batch", "seq", None))

    def queries(self, x_btd: jax.Array, positions_bt: jax.Array, inv_freq: jax.Array, ops: Ops,
                tape: Tape | None = None) -> jax.Array:
        """Queries [B, T, N, Hn + Hr], the last Hr dims rotated."""
        proj = _projector(self, ops, "attention", self.projections, tape)
        if hasattr(self, "wq_a"):
            cq = self.q_norm(proj("btd,dq->btq", x_btd, "wq_a", "q_a"))
            q = proj("btq,qnh->btnh", constrain(cq, ("batch", "seq", None)), "wq_b", "q_b")
        else:
            q = proj("btd,dnh->btnh", x_btd, "wq", "q")
        q_rope = apply_rope(q[..., self.nope:], positions_bt, inv_freq)
        if self.rope_factor != 1.0:
            q_rope = q_rope * jnp.asarray(self.rope_factor, q_rope.dtype)
        q = jnp.concatenate([q[..., :self.nope], q_rope], axis=-1)
        return constrain(q, ("batch", "seq", "act_heads", None))

    def qkv(self, x_btd: jax.Array, positions_bt: jax.Array, inv_freq: jax.Array,
            ops: Ops, tape: Tape | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Rotated queries and keys [B, T, N, Hn + Hr], values [B, T, N, Hv]: K/V expanded from the latent."""
        proj = _projector(self, ops, "attention", self.projections, tape)
        c_btr, k_rope = self.latent(x_btd, positions_bt, inv_freq, ops, tape)
        k_nope = proj("btr,rna->btna", c_btr, "wk_b", "k_b")
        v = proj("btr,rnu->btnu", c_btr, "wv_b", "v_b")
        k_rope = jnp.broadcast_to(k_rope[:, :, None].astype(k_nope.dtype), (*k_nope.shape[:3], k_rope.shape[-1]))
        k = constrain(jnp.concatenate([k_nope, k_rope], axis=-1), ("batch", "seq", "act_heads", None))
        v = constrain(v, ("batch", "seq", "act_heads", None))
        return self.queries(x_btd, positions_bt, inv_freq, ops, tape), k, v

    def absorbed(self, q_btnh: jax.Array, c_bsr: jax.Array, k_rope_bse: jax.Array, visible_bs: jax.Array) -> jax.Array:
        """Attention [B, T, N, Hv] of rotated queries to a latent cache (decoding): wk_b absorbed into the
        queries (q_nope . (c wk_b) = (q_nope wk_b^T) . c) and wv_b applied after the weighted sum of the
        latents, so the cache holds c [B, S, R] and the rotated shared key [B, S, Hr] per token, not
        K/V per head. Every query of row b sees the slots where `visible_bs[b]` is set; float32 scores
        and softmax, as `ops.attention.cached_attention`."""
        f32 = jnp.float32
        q_nope, q_rope = q_btnh[..., :self.nope], q_btnh[..., self.nope:]
        q_lat = jnp.einsum("btna,rna->btnr", q_nope, self.wk_b[...].astype(q_nope.dtype), preferred_element_type=f32)
        scores = (jnp.einsum("btnr,bsr->bnts", q_lat, c_bsr.astype(f32))
                  + jnp.einsum("btne,bse->bnts", q_rope, k_rope_bse, preferred_element_type=f32)) * self.scale
        scores = jnp.where(visible_bs[:, None, None, :], scores, jnp.finfo(f32).min)
        probs = jax.nn.softmax(scores, axis=-1)
        o_lat = jnp.einsum("bnts,bsr->btnr", probs, c_bsr.astype(f32))
        return jnp.einsum("btnr,rnu->btnu", o_lat, self.wv_b[...].astype(f32)).astype(q_btnh.dtype)

    def out(self, o_btnu: jax.Array, ops: Ops, tape: Tape | None = None) -> jax.Array:
        """The output projection of the attention result [B, T, N, Hv] -> [B, T, D]."""
        o = checkpoint_name(constrain(o_btnu, ("batch", "seq", "act_heads", None)), "attention_out")
        return _projector(self, ops, "attention", self.projections, tape)("btnu,nud->btd", o, "wo", "o")
