"""Inference with a KV cache: `prefill` runs the prompt and fills the cache, `decode` adds one token.

The cache holds every layer's rotated keys and values, [L, B, S, K, H] each (K kv heads: grouped-query
sized), S = the longest prompt plus the tokens to generate. When every layer has the sliding window
(`model.sliding_window` without `model.global_every`: Mistral) and that is shorter, S is the window and
the cache is a ring: slot s (a position, see below) lives at index s mod S, a new token overwrites the
one that just left the window, and prefill keeps only a prompt's last S keys. A pattern of local and
global layers (Gemma 3) keeps the whole length for every layer. Prompts of different lengths are
left-padded: slot s of row b holds a real token when `valid_bs[b, s]`; a padded slot is never attended
to, and positions count from each row's first real token, so a row's result does not depend on its
padding. Prefill is the training forward (causal attention, padding as its own document) that also
returns K/V; decode attends one query per row to the filled, valid slots of the cache. Mixture-of-experts
layers route each token as in training (dropless; with a capacity factor the groups are the decoded rows).
Single-device math; the caller jits these under the sharding rules (lumen_jax/generate.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from lumen_jax.config import ModelConfig
from lumen_jax.model.layers import layer_rope, local_layers
from lumen_jax.model.transformer import Transformer, embedding_lookup
from lumen_jax.ops.attention import attention, cached_attention
from lumen_jax.ops.projection import project
from lumen_jax.parallel.rules import constrain

CACHE_AXES = ("batch", "seq", "act_kv_heads", None)  # of one layer's [B, S, K, H]
LATENT_AXES = ("batch", "seq", None)  # of one layer's MLA latent cache [B, S, R] (or its rope key [B, S, Hr])


def _cache_axes(c: jax.Array) -> tuple:
    return CACHE_AXES if c.ndim == 4 else LATENT_AXES


def cache_length(cfg: ModelConfig, length: int) -> int:
    """Slots of the cache for `length` tokens: the window when every layer has one shorter (a ring)."""
    return min(length, cfg.sliding_window) if cfg.sliding_window and not cfg.global_every else length


def init_cache(model: Transformer, batch: int, length: int) -> dict[str, jax.Array]:
    """Zero K/V cache {"k", "v"}: [L, B, S, K, H] in the compute dtype, S = `cache_length(model.cfg,
    length)`; with latent attention (MLA) the
    absorbed form's: the latent [L, B, S, R] as "k" and the rotated shared key [L, B, S, Hr] as "v"
    (R + Hr numbers per token and layer instead of N (Hn + Hr + Hv))."""
    cfg = model.cfg
    dt = jnp.dtype(cfg.compute_dtype)
    length = cache_length(cfg, length)  # S: the window's slots when the cache is a ring
    if cfg.mla:  # the absorbed form: "k" the latent, "v" the rotated shared key
        shape = (cfg.num_layers, batch, length)
        return {"k": jnp.zeros((*shape, cfg.kv_lora_rank), dt), "v": jnp.zeros((*shape, cfg.qk_rope_head_dim), dt)}
    shape = (cfg.num_layers, batch, length, cfg.num_kv_heads)
    return {"k": jnp.zeros((*shape, cfg.resolved_head_dim), dt), "v": jnp.zeros((*shape, cfg.value_head_dim), dt)}


def _embed(model: Transformer, tokens_bt: jax.Array) -> jax.Array:
    return constrain(embedding_lookup(model.embed_table(), tokens_bt), ("batch", "seq", "act_embed"))


def _logits(model: Transformer, x_btd: jax.Array) -> jax.Array:
    cfg = model.cfg
    x_btd = model.final_norm(x_btd)
    w_dv = model.embed[...].T if cfg.tie_embeddings else model.lm_head[...]
    logits = project("btd,dv->btv", x_btd, w_dv.astype(jnp.dtype(cfg.compute_dtype)), model.ops,
                     out_dtype=jnp.float32)
    return constrain(logits, ("batch", "seq", "act_vocab"))


def _layers(model: Transformer, x_btd: jax.Array, cache: dict, attend) -> tuple[jax.Array, dict]:
    """Runs the blocks (a scan); `attend(attn_module, h_btd, k_cache, v_cache, local) -> (o, k_cache,
    v_cache)`, `local` whether the layer has the window (`layers.local_layers`; None: every layer alike).

    With mixture-of-experts layers the stack is, as in training, the first `moe.first_dense_layers`
    dense blocks, then groups of `moe.every_n_layers`: n-1 dense blocks, then an MoE block (its routing
    losses are dropped); the cache's layer l is layer l."""
    def scan(stack: nnx.Module, x_btd: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
             local: jax.Array | None = None):
        graphdef, layer_state = nnx.split(stack)

        def body(x_btd: jax.Array, xs: tuple) -> tuple[jax.Array, tuple]:
            state, k_cache, v_cache, local = xs
            block = nnx.merge(graphdef, state)
            o, k_cache, v_cache = attend(block.attn, block.attn_norm(x_btd), k_cache, v_cache, local)
            x_btd = x_btd + block.after_attention(block.attn.out(o, model.ops))
            x_btd = x_btd + block.feed_forward(block.mlp_norm(x_btd), model.ops)[0]  # MoE's aux dropped
            return x_btd, (constrain(k_cache, _cache_axes(k_cache)), constrain(v_cache, _cache_axes(v_cache)))

        return jax.lax.scan(body, x_btd, (layer_state, k_cache, v_cache, local))

    if not model.cfg.moe.enabled:
        local = local_layers(model.cfg, 0, model.cfg.num_layers)
        x_btd, (k, v) = scan(model.blocks, x_btd, cache["k"], cache["v"], local)
        return x_btd, {"k": k, "v": v}
    n, first = model.cfg.moe.every_n_layers, model.cfg.moe.first_dense_layers
    dense = head = None
    if n > 1 or first:
        dense_graph, dense_state = nnx.split(model.blocks)
        if first:  # the first dense layers, then the groups
            head = nnx.merge(dense_graph, jax.tree.map(lambda v: v[:first], dense_state))
            dense_state = jax.tree.map(lambda v: v[first:], dense_state)
        if n > 1:
            dense = jax.tree.map(lambda v: v.reshape(-1, n - 1, *v.shape[1:]), dense_state)
    heads = {}
    if head is not None:
        x_btd, (k, v) = scan(head, x_btd, cache["k"][:first], cache["v"][:first])
        heads = {"k": k, "v": v}
    grouped = {name: c[first:].reshape(-1, n, *c.shape[1:]) for name, c in cache.items()}  # [L'/n, n, B, S, K, H]
    moe_graph, moe_state = nnx.split(model.moe_blocks)

    def group(x_btd: jax.Array, xs: tuple) -> tuple[jax.Array, tuple]:
        dense_g, moe_g, k_g, v_g = xs
        ks, vs = [], []
        if dense_g is not None:
            x_btd, (k, v) = scan(nnx.merge(dense_graph, dense_g), x_btd, k_g[:n - 1], v_g[:n - 1])
            ks, vs = [k], [v]
        moe_one = jax.tree.map(lambda v: v[None], moe_g)  # the group's MoE block as a stack of one
        x_btd, (k, v) = scan(nnx.merge(moe_graph, moe_one), x_btd, k_g[n - 1:], v_g[n - 1:])
        return x_btd, (jnp.concatenate([*ks, k]), jnp.concatenate([*vs, v]))

    x_btd, (k, v) = jax.lax.scan(group, x_btd, (dense, moe_state, grouped["k"], grouped["v"]))
    out = {"k": k.reshape(-1, *cache["k"].shape[1:]), "v": v.reshape(-1, *cache["v"].shape[1:])}
    if heads:
        out = {name: jnp.concatenate([heads[name], out[name]]) for name in out}
    return x_btd, out


def prefill(model: Transformer, tokens_bt: jax.Array, valid_bt: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
    """Logits [B, V] float32 of each row's last prompt token, and the cache with slots [0, T) filled.

    Args:
      tokens_bt: left-padded prompts [B, T]; valid_bt: [B, T] bool, False on the padding.
      cache: `init_cache(model, B, S)` with S >= T, or a ring of the window's S slots.
    """
    positions = jnp.maximum(jnp.cumsum(valid_bt, axis=1) - 1, 0).astype(jnp.int32)
    segments = valid_bt.astype(jnp.int32)  # padding is its own document: real tokens never see it
    t, s = tokens_bt.shape[1], cache["k"].shape[2]

    def keep(x_btkh: jax.Array, x_cache: jax.Array) -> jax.Array:
        """The cache with slots [0, T) written; a ring of S < T slots keeps the last S at slot mod S."""
        x_btkh = x_btkh.astype(x_cache.dtype)
        if t > s:
            return jnp.roll(x_btkh[:, t - s:], (t - s) % s, axis=1)
        return jax.lax.dynamic_update_slice(x_cache, x_btkh, (jnp.zeros((), jnp.int32),) * x_cache.ndim)

    def attend(attn, h_btd, k_cache, v_cache, local):
        q, k, v = attn.qkv(h_btd, positions, layer_rope(model.cfg, local), model.ops)
        o = attn.attend(q, k, v, segments, model.ops, local)
        if model.cfg.mla:  # the cache holds the latent and the rotated shared key
            k, v = attn.latent(h_btd, positions, layer_rope(model.cfg, local), model.ops)
        return o, keep(k, k_cache), keep(v, v_cache)

    x_btd, cache = _layers(model, _embed(model, tokens_bt), cache, attend)
    return _logits(model, x_btd[:, -1:])[:, 0], cache


def decode(model: Transformer, tokens_b: jax.Array, positions_b: jax.Array, slot: jax.Array,
           valid_bs: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
    """Logits [B, V] float32 after one new token per row, written to cache slot `slot`.

    Args:
      tokens_b, positions_b: the new tokens [B] and their positions [B] (int32).
      slot: int32 scalar, the cache slot of the new tokens (the same for every row: rows are left-padded).
      valid_bs: [B, N] bool over every slot of the generation, False on the prompts' padding; slots
        after `slot` are ignored.
      cache: the cache after `prefill` and earlier `decode`s (a ring when it has fewer than N slots).
    """
    s = cache["k"].shape[2]
    held = jnp.arange(s)  # the slot each cache index holds: itself, or in a ring the latest one = index mod S
    if s < valid_bs.shape[1]:
        held = slot - (slot - held) % s
    filled = (held >= 0) & (held <= slot)
    visible = jnp.take_along_axis(valid_bs, jnp.broadcast_to(jnp.maximum(held, 0), valid_bs.shape[:1] + (s,)),
                                  axis=1) & filled[None]  # [B, S]: filled, and not a prompt's padding
    windowed = visible  # the latest `window` slots: rows are left-padded alike, so slots are positions
    if model.cfg.sliding_window:
        windowed = visible & (held > slot - model.cfg.sliding_window)[None]

    def write(x_cache: jax.Array, x_bt: jax.Array) -> jax.Array:
        """The cache with the new tokens' entries at `slot` (in a ring, slot mod S)."""
        zero = jnp.zeros((), jnp.int32)
        return jax.lax.dynamic_update_slice(x_cache, x_bt.astype(x_cache.dtype),
                                            (zero, slot % s) + (zero,) * (x_cache.ndim - 2))

    def attend(attn, h_btd, k_cache, v_cache, local):
        rope = layer_rope(model.cfg, local)
        if model.cfg.mla:  # the absorbed form over the latent cache
            c, k_rope = attn.latent(h_btd, positions_b[:, None], rope, model.ops)
            k_cache, v_cache = write(k_cache, c), write(v_cache, k_rope)
            q = attn.queries(h_btd, positions_b[:, None], rope, model.ops)
            return attn.absorbed(q, k_cache, v_cache, visible), k_cache, v_cache
        q, k, v = attn.qkv(h_btd, positions_b[:, None], rope, model.ops)
        k_cache, v_cache = write(k_cache, k), write(v_cache, v)
        seen = windowed if local is None else jnp.where(local, windowed, visible)  # a global layer: every slot
        return cached_attention(q, k_cache, v_cache, seen, scale=attn.scale), k_cache, v_cache

    x_btd, cache = _layers(model, _embed(model, tokens_b[:, None]), cache, attend)
    return _logits(model, x_btd)[:, 0], cache
