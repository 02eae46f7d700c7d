"""The reference attention: one mask, the forward (output and log-sum-exp), and its backward from a
merged output and log-sum-exp. Plain jnp; the numerical reference of every other implementation.

- `mask`: causal (top-left aligned: query t sees keys s <= t), sliding-window (query t sees keys
  s > t - window) and document (segment id) masking; the kernel tests build their expectations
  with it too.
- `reference`: grouped-query attention with float32 scores and softmax, returning the output and
  the per-row log-sum-exp. `model.attention=xla` runs it (its log-sum-exp unused, so XLA drops it);
  context parallelism runs it on each (query chunk, key chunk) pair and merges the pairs with
  their log-sum-exps (`lumen_jax.parallel.context`).
- `reference_bwd`: FlashAttention-2's backward of one (query, key) pair given the *merged* output
  and log-sum-exp, which is what each chunk pair contributes to the gradients under context
  parallelism (autodiff of `reference` would use the pair's own softmax instead).

Shape letters: B batch, T queries, S keys, N query heads, K kv heads (N % K == 0, G = N // K), H head dim.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

_MASKED = jnp.finfo(jnp.float32).min  # finite: a row with no visible key gives uniform weights, not NaN


def mask(t: int, s: int, causal: bool, q_seg: jax.Array | None, kv_seg: jax.Array | None,
         window: int = 0, q_offset: int | jax.Array = 0) -> jax.Array:
    """Which of [T] queries see which of [S] keys: [B|1, 1, 1, T, S] bool, against scores [B, K, G, T, S].

    Args:
      t, s: query and key lengths.
      causal: query t sees keys s <= t (top-left aligned).
      q_seg, kv_seg: [B, T] and [B, S] document ids (both or neither): tokens see their own document only.
      window: query t sees keys s > t - window (the `window` latest, itself included; Mistral's
        sliding window, as transformers masks it); 0: no window.
      q_offset: query t sits at position t + q_offset against key s at s, for causal and window (a
        chunk pair under context parallelism; may be traced); 0: aligned.
    """
    keep = jnp.ones((1, t, s), dtype=bool)
    distance = (jnp.arange(t) + q_offset)[:, None] - jnp.arange(s)[None, :]
    if causal:
        keep = keep & (distance >= 0)[None]
    if window:
        keep = keep & (distance < window)[None]
    if q_seg is not None:
        keep = keep & (q_seg[:, :, None] == kv_seg[:, None, :])
    return keep[:, None, None]


def reference(q_btnh: jax.Array, k_bskh: jax.Array, v_bskh: jax.Array, *,
              segment_ids_bt: jax.Array | None = None, kv_segment_ids_bs: jax.Array | None = None,
              causal: bool = True, scale: float | None = None,
              out_dtype: Any = None, window: int = 0,
              q_offset: int | jax.Array = 0) -> tuple[jax.Array, jax.Array]:
    """Attention with grouped-query heads: (out [B, T, N, H], lse [B, N, T] float32).

    Args:
      q_btnh: queries [B, T, N, H].
      k_bskh, v_bskh: keys/values [B, S, K, H] with N % K == 0 (each K/V head serves N//K queries); the
        values' head dim may differ from the queries' and keys' (MLA): the output has the values'.
      segment_ids_bt: [B, T] document ids of packed sequences; tokens attend only within their own
        document. None: one document per row.
      kv_segment_ids_bs: [B, S] the keys' document ids; default `segment_ids_bt` (T == S).
      causal: mask future positions.
      scale: softmax scale; default 1/sqrt(H).
      out_dtype: the output's dtype; default q's.
      window: a sliding window (`mask`); 0: none.
      q_offset: the queries' positions against the keys' (`mask`); 0: aligned.

    Returns:
      The output and the natural-log log-sum-exp of each row's scaled, masked scores. Scores and
      softmax are float32; the probabilities meet V in V's dtype. A row that sees no key (possible
      only for a chunk pair under context parallelism) has weights uniform and lse ~ float32 min, so
      it adds nothing when merged.
    """
    b, t, n, h = q_btnh.shape
    s, kh = k_bskh.shape[1], k_bskh.shape[2]
    if n % kh:
        raise ValueError(f"num_heads={n} must be a multiple of num_kv_heads={kh}")
    scale = h ** -0.5 if scale is None else scale
    kv_seg = segment_ids_bt if kv_segment_ids_bs is None else kv_segment_ids_bs
    q_btkgh = q_btnh.reshape(b, t, kh, n // kh, h)
    scores = jnp.einsum("btkgh,bskh->bkgts", q_btkgh, k_bskh, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask(t, s, causal, segment_ids_bt, kv_seg, window, q_offset), scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_bskh.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v_bskh, preferred_element_type=jnp.float32)
    lse = jax.nn.logsumexp(scores, axis=-1).reshape(b, n, t)
    return out.reshape(b, t, n, v_bskh.shape[-1]).astype(q_btnh.dtype if out_dtype is None else out_dtype), lse


def reference_bwd(q, k, v, q_seg, kv_seg, o, lse, do, dlse, causal: bool, window: int = 0,
                  q_offset: int | jax.Array = 0, *, scale: float):
    """(dq, dk, dv) float32 of one (query, key) pair from the merged `o` [B, T, N, H] and `lse`
    [B, N, T] and their cotangents `do`, `dlse` (FlashAttention-2's backward, in jnp); `window`
    and `q_offset` as in `mask`."""
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    g = n // kh
    f32 = jnp.float32
    q_g = q.astype(f32).reshape(b, t, kh, g, h)
    do_g = do.astype(f32).reshape(b, t, kh, g, h)
    k, v = k.astype(f32), v.astype(f32)
    delta = (jnp.einsum("btnh,btnh->bnt", do_g.reshape(b, t, n, h), o.astype(f32)) - dlse).reshape(b, kh, g, t)
    scores = jnp.einsum("btkgh,bskh->bkgts", q_g, k) * scale
    probs = jnp.where(mask(t, s, causal, q_seg, kv_seg, window, q_offset),
                      jnp.exp(scores - lse.reshape(b, kh, g, t)[..., None]), 0.0)
    dv = jnp.einsum("bkgts,btkgh->bskh", probs, do_g)
    ds = probs * (jnp.einsum("btkgh,bskh->bkgts", do_g, v) - delta[..., None])
    dq = jnp.einsum("bkgts,bskh->btkgh", ds, k).reshape(b, t, n, h) * scale
    dk = jnp.einsum("bkgts,btkgh->bskh", ds, q_g) * scale
    return dq, dk, dv
