"""Attention dispatch: one signature, several implementations.

`attention(q, k, v, ...)` is the only entry point the model calls. Implementations:

- `xla`: the pure-jnp reference below (fp32 softmax, GQA without repeating K/V, causal and
  document masking). It is also the numerical reference for the kernels.
- `auto`: the best implementation for the backend (today `xla` everywhere; flash on GPU once
  the kernel lands).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def xla_attention(q_btnh: jax.Array, k_bskh: jax.Array, v_bskh: jax.Array, *,
                  segment_ids_bt: jax.Array | None = None, causal: bool = True,
                  scale: float | None = None) -> jax.Array:
    """Reference attention with grouped-query heads.

    Args:
      q_btnh: queries [B, T, N, H].
      k_bskh, v_bskh: keys/values [B, S, K, H] with N % K == 0 (each K/V head serves N//K queries).
      segment_ids_bt: [B, T] document ids of packed sequences (T == S); tokens attend only within
        their own document. None: one document per row.
      causal: mask future positions.
      scale: softmax scale; default 1/sqrt(H).

    Returns:
      [B, T, N, H] in q's dtype. Scores and softmax are computed in float32.
    """
    b, t, n, h = q_btnh.shape
    s, kh = k_bskh.shape[1], k_bskh.shape[2]
    if n % kh:
        raise ValueError(f"num_heads={n} must be a multiple of num_kv_heads={kh}")
    scale = h ** -0.5 if scale is None else scale
    q_btkgh = q_btnh.reshape(b, t, kh, n // kh, h)
    scores = jnp.einsum("btkgh,bskh->bkgts", q_btkgh, k_bskh,
                        preferred_element_type=jnp.float32) * scale
    mask_bts = jnp.ones((1, t, s), dtype=bool)
    if causal:
        mask_bts = mask_bts & (jnp.arange(t)[:, None] >= jnp.arange(s)[None, :])[None]
    if segment_ids_bt is not None:
        mask_bts = mask_bts & (segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :])
    scores = jnp.where(mask_bts[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_bskh.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v_bskh, preferred_element_type=jnp.float32)
    return out.reshape(b, t, n, h).astype(q_btnh.dtype)


_IMPLS = {"xla": xla_attention}


def resolve(impl: str) -> str:
    """The concrete implementation `impl` stands for on this backend."""
    if impl == "auto":
        return "xla"
    if impl not in _IMPLS:
        raise ValueError(f"model.attention={impl!r} is not one of {sorted(_IMPLS) + ['auto']}")
    return impl


def attention(q_btnh: jax.Array, k_bskh: jax.Array, v_bskh: jax.Array, *,
              segment_ids_bt: jax.Array | None = None, causal: bool = True,
              scale: float | None = None, impl: str = "xla") -> jax.Array:
    """Dispatch to the attention implementation named by `impl` (see module docstring)."""
    return _IMPLS[resolve(impl)](q_btnh, k_bskh, v_bskh, segment_ids_bt=segment_ids_bt,
                                 causal=causal, scale=scale)
