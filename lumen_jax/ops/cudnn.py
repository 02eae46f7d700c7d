"""cuDNN's fused (flash) attention, with the reference's signature: what `model.attention=cudnn` runs.

- One document per row (no segment ids): `jax.nn.dot_product_attention(..., implementation="cudnn")`,
  causal through `is_causal` (cuDNN skips the masked tiles).
- Packed documents (segment ids): jax's public API offers only a dense [B, 1, T, S] boolean mask
  (an additive bias read from memory: not a flash-speed path) and per-row padding lengths. cuDNN's
  own handling is its packed ("THD", ragged-offset) layout, which jax reaches through
  `jax._src.cudnn.fused_attention_stablehlo.dot_product_attention(q_offsets=, q_seqlen=, ...)`:
  every document of a row is a sequence of its own, masked causally from its first token. That
  layout needs Hopper (sm_90) or later and a static bound on the documents per row
  (`MAX_DOCUMENTS`); a row with more documents (checked on the device, `lax.cond`) runs `fallback`
  instead (our flash kernel, or the reference where flash cannot take the shape). Segment ids must
  be contiguous runs (the data pipeline packs documents so); the reference would also join two
  runs of one id, this layout does not.
- Context parallelism (`pair_forward`, `pair_backward`): the public call's backward ignores the
  log-sum-exp's cotangent (`return_residual=True` returns it, its gradient is dropped) and takes no
  merged output, so each chunk pair of the ring calls jax's private forward and backward
  primitives instead, the backward from the merged output and log-sum-exp. Not yet run on a GPU:
  `auto` keeps the flash kernel there; `model.attention=cudnn` asks for this path (`ops.choice`).

- Under the remat policies the backward runs cuDNN's forward again (two forwards a layer under
  dots_with_no_batch_dims_saveable, the llama presets'): its residuals (output, log-sum-exp) are
  made inside jax's custom VJP, where no `checkpoint_name` reaches them. Naming the residuals of a
  `jax.vjp` taken inside our own custom VJP's forward did not stop the recomputation (tried: a
  scan of checkpointed layers still ran the forward twice); calling jax's private forward and
  backward rules directly would, at the price of more private API. cuDNN stays the faster choice
  with the extra forward (2.1x ours forward+backward at 8k; a forward is about a quarter of that).

`check_supported` is the rule `ops.choice` applies before anything is traced; it mirrors jax's own
checks (`check_layout`, `check_is_flash_attention`) so that a shape cuDNN refuses is a config error
or an `auto` fallback rather than a NotImplementedError at trace time.
Shape letters: B batch, T queries, S keys, N query heads, K kv heads, H head dim, M documents.
"""

from __future__ import annotations

import contextlib
import inspect
import types
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
from jax import lax

try:  # the packed layout lives in jax's private module (jax 0.10.x); its absence means: no packed
    from jax._src.cudnn import fused_attention_stablehlo as _fused
except ImportError:  # pragma: no cover - another jax
    _fused = None

DTYPES = ("bfloat16", "float16")
MAX_DOCUMENTS = 64  # documents per row the packed layout is built for (cuDNN launches B x M sequences)


def packed_layout_available() -> bool:
    """Whether this jax exposes cuDNN's packed (ragged-offset) layout as `attention` calls it (a
    private module: another jax may move it; then packed documents run flash, `ops.choice`)."""
    if _fused is None or not hasattr(_fused, "MaskType") or not hasattr(_fused, "dot_product_attention"):
        return False
    names = inspect.signature(_fused.dot_product_attention).parameters
    return {"q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets", "scale", "mask_type"} <= set(names)


@contextlib.contextmanager
def lowering_without_gpu(compute_capability: str = "9.0", version: int = 91000) -> Iterator[None]:
    """Lower cuDNN attention for a GPU not present (`python -m lumen_jax.lower`, tests): jax asks
    the cuDNN library for its version and the backend's GPU for its compute capability while
    tracing; without a CUDA plugin there is neither. Answer `version` (9.10) and `compute_capability`
    for the time of the lowering (nothing runs). A present cuDNN is left alone."""
    if _fused is None or _fused.cuda_versions is not None:
        yield
        return
    target = tuple(int(x) for x in compute_capability.split("."))
    saved = (_fused.cuda_versions, _fused.check_compute_capability, _fused.is_cuda_compute_capability_equal)
    _fused.cuda_versions = types.SimpleNamespace(cudnn_get_version=lambda: version)
    _fused.check_compute_capability = lambda c: target >= tuple(int(x) for x in c.split("."))
    _fused.is_cuda_compute_capability_equal = lambda c: target == tuple(int(x) for x in c.split("."))
    try:
        yield
    finally:
        _fused.cuda_versions, _fused.check_compute_capability, _fused.is_cuda_compute_capability_equal = saved


def check_supported(platform: str, compute_capability: str, dtype: str, head_dim: int,
                    segments: bool = True) -> str | None:
    """Why cuDNN's fused attention cannot run this case (None when it can).

    Args:
      platform: the device's platform (`gpu`, `cpu`, ...).
      compute_capability: the GPU's, e.g. "9.0" (Hopper); the packed layout and head dims above 128
        need 9.0 or later.
      dtype: the dtype of q, k and v (`model.compute_dtype`).
      head_dim: H.
      segments: whether calls carry segment ids (the trainer's packed rows do).
    """
    if platform != "gpu":
        return f"cuDNN runs on GPU; this is {platform}"
    if dtype not in DTYPES:
        return f"model.compute_dtype={dtype}: cuDNN's fused attention takes {' or '.join(DTYPES)}"
    hopper = _major(compute_capability) >= 9
    h_max = 256 if hopper else 128
    if head_dim > h_max or head_dim % 8:
        return f"head_dim={head_dim} must be <= {h_max} and a multiple of 8 for cuDNN on sm_{compute_capability}"
    if segments and not hopper:
        return (f"packed documents (segment ids) need cuDNN's packed layout: Hopper (sm_90) or later, "
                f"this GPU is sm_{compute_capability}")
    if segments and not packed_layout_available():
        return f"this jax ({jax.__version__}) does not expose cuDNN's packed layout for segment ids"
    return None


def _major(compute_capability: str) -> int:
    head = str(compute_capability).split(".")[0]
    return int(head) if head.isdigit() else 0


def packed_documents(segment_ids_bt: jax.Array, max_documents: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Segment ids as cuDNN's packed layout: each contiguous run of one id is one document.

    Args:
      segment_ids_bt: [B, T] int document ids, each document a contiguous run.
      max_documents: M, the static bound on documents per row.

    Returns:
      (seqlen [B, M], offsets [B, M + 1], count [B]): each document's length and first token
      (then T after the last), -1 past a row's `count`; `count` may exceed M (the caller checks).
    """
    b, t = segment_ids_bt.shape
    first = jnp.concatenate([jnp.ones((b, 1), bool), segment_ids_bt[:, 1:] != segment_ids_bt[:, :-1]], axis=1)
    count = jnp.sum(first, axis=1, dtype=jnp.int32)
    starts = jax.vmap(lambda row: jnp.nonzero(row, size=max_documents + 1, fill_value=t)[0])(first)
    starts = starts.astype(jnp.int32)  # [B, M + 1]: the first tokens, then T
    slot = jnp.arange(max_documents + 1, dtype=jnp.int32)[None]
    offsets = jnp.where(slot <= count[:, None], starts, -1)
    seqlen = jnp.where(slot[:, :-1] < count[:, None], starts[:, 1:] - starts[:, :-1], -1)
    return seqlen, offsets, count


def attention(q_btnh: jax.Array, k_bskh: jax.Array, v_bskh: jax.Array, *,
              segment_ids_bt: jax.Array | None, causal: bool, scale: float | None,
              fallback: Callable[..., jax.Array], max_documents: int = MAX_DOCUMENTS,
              window: int = 0) -> jax.Array:
    """cuDNN's fused attention [B, T, N, H] (module docstring); local arrays, no collectives.

    Args:
      q_btnh: queries [B, T, N, H]; k_bskh, v_bskh: [B, S, K, H], N % K == 0, bfloat16/float16.
      segment_ids_bt: [B, T] contiguous document ids, or None (one document per row).
      causal: mask future positions (within each document). scale: default 1/sqrt(H).
      fallback: `fallback(q, k, v, segment_ids_bt)` for rows with more than `max_documents` documents.
      max_documents: the packed layout's bound on documents per row (capped at T).
      window: a sliding window (query t sees keys s > t - window); 0: none.
    """
    h = q_btnh.shape[-1]
    scale = h ** -0.5 if scale is None else scale
    if segment_ids_bt is None:
        return jax.nn.dot_product_attention(q_btnh, k_bskh, v_bskh, scale=scale, is_causal=causal,
                                            local_window_size=(window - 1, 0) if window else None,
                                            implementation="cudnn")
    m = min(max_documents, q_btnh.shape[1])
    seqlen, offsets, count = packed_documents(segment_ids_bt, m)
    mask = _fused.MaskType.PADDING_CAUSAL if causal else _fused.MaskType.PADDING

    def packed(q, k, v, seg):
        return _fused.dot_product_attention(q, k, v, q_seqlen=seqlen, kv_seqlen=seqlen, q_offsets=offsets,
                                            kv_offsets=offsets, scale=scale, mask_type=mask,
                                            **({"sliding_window_length": window} if window else {}))

    return lax.cond(jnp.max(count) <= m, packed, fallback, q_btnh, k_bskh, v_bskh, segment_ids_bt)


# --------------------------------------------------------------------------------------------------
# One chunk pair of context parallelism (`parallel/context.py`'s BlockKernel) through cuDNN
# --------------------------------------------------------------------------------------------------
# jax's public call recomputes its residuals and drops the log-sum-exp's cotangent, and its backward
# derives D = rowsum(dO * O) from the pair's own output: a pair of the ring needs the merged output
# and log-sum-exp instead (FlashAttention-2's backward of one block). jax's private forward and
# backward primitives take exactly those: the forward returns (o, softmax statistics [B, N, T]
# float32, the natural-log log-sum-exp of the scaled scores), the backward takes the statistics and
# the output it is given. Transformer Engine's ring attention calls cuDNN the same way.


def _primitive_args(q: jax.Array, packed: tuple[jax.Array, ...] | None) -> tuple[jax.Array, ...]:
    """bias, q_seqlen, kv_seqlen, q_offsets, kv_offsets, page tables: absent ones as empty arrays."""
    none = jnp.zeros(0, q.dtype)
    return (none, *(packed or (none,) * 4), none, none)


def _static(mask_type, scale: float) -> dict:
    return dict(scale=scale, seed=42, dropout_rate=0.0, variadic_args=(False, False), mask_type=mask_type,
                layout=_fused.AttentionLayout.BTNH.value, sliding_window_length=None)


def _forward_primitive(q, k, v, packed, mask_type, scale: float) -> tuple[jax.Array, jax.Array]:
    """jax's private cuDNN training forward: (o, softmax statistics; [B * M, N, T] when packed)."""
    o, stats = _fused._dot_product_attention_fwd_p_wrapper.bind(q, k, v, *_primitive_args(q, packed),
                                                                 is_training=True, **_static(mask_type, scale))
    return o, stats


def _backward_primitive(q, k, v, packed, stats, o, do, mask_type, scale: float) -> tuple[jax.Array, ...]:
    """jax's private cuDNN backward from the given statistics and output: (dq, dk, dv)."""
    dq, dk, dv = _fused._dot_product_attention_bwd_p_wrapper.bind(q, k, v, *_primitive_args(q, packed), stats, o, do,
                                                                  **_static(mask_type, scale))
    return dq, dk, dv


def _statistics_index(packed: tuple[jax.Array, ...], t: int) -> tuple[jax.Array, jax.Array]:
    """Where each query token's softmax statistics sit in the packed layout: (sequence, position)
    [B, T]. In that layout cuDNN sees every document as a sequence of its own, numbered across the
    batch in order (jax moves the [B, M] lengths and offsets of the documents to the left), and its
    statistics are [B * M, N, T] by (sequence, head, position within the sequence)."""
    q_len, q_off = packed[0], packed[2][:, :-1]
    starts = jnp.where(q_len >= 0, q_off, t)  # [B, M]: each document's first token; T where none
    doc = jnp.sum(jnp.arange(t)[None, :, None] >= starts[:, None, :], axis=-1) - 1  # [B, T]
    count = jnp.sum(q_len >= 0, axis=1)
    first = jnp.cumsum(count) - count  # [B]: the batch's sequence number of the row's first document
    return first[:, None] + doc, jnp.arange(t)[None] - jnp.take_along_axis(q_off, jnp.maximum(doc, 0), axis=1)


def _cudnn_fwd(q, k, v, packed, mask_type, scale: float) -> tuple[jax.Array, jax.Array]:
    """(o [B, T, N, H] in q's dtype, lse [B, N, T] float32) of cuDNN's training forward."""
    o, stats = _forward_primitive(q, k, v, packed, mask_type, scale)
    if packed is None:
        return o, stats
    seq, pos = _statistics_index(packed, q.shape[1])
    return o, jnp.moveaxis(stats[seq, :, pos], -1, 1)  # [B, T, N] -> [B, N, T]


def _cudnn_bwd(q, k, v, packed, o, lse, do, mask_type, scale: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(dq, dk, dv) of cuDNN's backward from the given output `o` and log-sum-exp `lse` [B, N, T]."""
    if packed is not None:  # the statistics in the packed layout's order (`_statistics_index`)
        b, t, n, _ = q.shape
        seq, pos = _statistics_index(packed, t)
        lse = jnp.zeros((b * (packed[0].shape[1]), n, t), jnp.float32).at[seq, :, pos].set(jnp.moveaxis(lse, 1, -1))
    return _backward_primitive(q, k, v, packed, lse, o, do, mask_type, scale)


def _run_length(seg: jax.Array, reverse: bool = False) -> jax.Array:
    """[B] the length of each row's first (or, `reverse`, last) run of one segment id."""
    seg = seg[:, ::-1] if reverse else seg
    return jnp.sum(jnp.cumprod(seg == seg[:, :1], axis=1), axis=1, dtype=jnp.int32)


def _spanning_document(q_seg: jax.Array, kv_seg: jax.Array):
    """A pair whose keys are all earlier than its queries: only a document that runs from the keys'
    chunk into the queries' chunk (the keys' last run and the queries' first, one id) attends in it.
    Returns (packed layout of that one document per row, queries that attend [B, T], keys attended
    [B, S]); a row where none spans gets a one-token stand-in document, masked out by the caller."""
    t, s = q_seg.shape[1], kv_seg.shape[1]
    joined = q_seg[:, 0] == kv_seg[:, -1]
    lq, lk = _run_length(q_seg), _run_length(kv_seg, reverse=True)
    lq1, lk1 = jnp.where(joined, lq, 1), jnp.where(joined, lk, 1)
    unused = jnp.full_like(lq1, -1)
    packed = (jnp.stack([lq1, unused], 1), jnp.stack([lk1, unused], 1),
              jnp.stack([jnp.zeros_like(lq1), lq1, unused], 1), jnp.stack([s - lk1, jnp.full_like(lk1, s), unused], 1))
    queries = joined[:, None] & (jnp.arange(t)[None] < lq[:, None])
    keys = joined[:, None] & (jnp.arange(s)[None] >= s - lk[:, None])
    return packed, queries, keys


def _plain_mask(causal: bool):
    return _fused.MaskType.CAUSAL if causal else _fused.MaskType.NO_MASK


def _chunk_documents(seg: jax.Array, max_documents: int) -> tuple[tuple[jax.Array, ...], jax.Array]:
    """The diagonal pair's documents in the packed layout (queries and keys are one chunk, so one
    layout serves both), and whether every row's fit in `max_documents`."""
    m = min(max_documents, seg.shape[1])
    seqlen, offsets, count = packed_documents(seg, m)
    return (seqlen, seqlen, offsets, offsets), jnp.max(count) <= m


def pair_forward(q, k, v, q_seg, kv_seg, causal: bool, window: int, offset, *, scale: float, fallback: Callable,
                 max_documents: int = MAX_DOCUMENTS) -> tuple[jax.Array, jax.Array]:
    """A BlockKernel's forward (`parallel.context.BlockKernel`) through cuDNN: (o float32, lse).

    The ring calls it on two kinds of pair (`pair_kind`): keys all earlier (`causal` False, no mask
    but the documents') and the diagonal (`causal`, the queries' and keys' chunk one). Documents:
    on the diagonal every document of the chunk packed as on one device (PADDING_CAUSAL; a row of
    more than `max_documents` through `fallback`), off it the one document that spans the two
    chunks (`_spanning_document`). A sliding window runs `fallback` (the flash kernel, or the
    reference), as do the two chunks of a window's edge."""
    if window or (q_seg is None) != (kv_seg is None):
        return fallback(q, k, v, q_seg, kv_seg, causal, window, offset)
    if q_seg is None:
        o, lse = _cudnn_fwd(q, k, v, None, _plain_mask(causal), scale)
        return o.astype(jnp.float32), lse
    if causal:
        documents, fit = _chunk_documents(q_seg, max_documents)

        def packed(q, k, v, q_seg, kv_seg):
            o, lse = _cudnn_fwd(q, k, v, documents, _fused.MaskType.PADDING_CAUSAL, scale)
            return o.astype(jnp.float32), lse

        return lax.cond(fit, packed, lambda *a: fallback(*a, causal, window, offset), q, k, v, q_seg, kv_seg)
    packed_one, queries, _ = _spanning_document(q_seg, kv_seg)
    o, lse = _cudnn_fwd(q, k, v, packed_one, _fused.MaskType.PADDING, scale)
    o = jnp.where(queries[:, :, None, None], o.astype(jnp.float32), 0.0)
    return o, jnp.where(queries[:, None, :], lse, -jnp.inf)


def pair_backward(q, k, v, q_seg, kv_seg, o, lse, do, dlse, causal: bool, window: int, offset, *, scale: float,
                  fallback: Callable, max_documents: int = MAX_DOCUMENTS) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A BlockKernel's backward through cuDNN, from the merged `o` and `lse` (`pair_forward`'s
    cases). cuDNN's backward takes no log-sum-exp cotangent: `dlse` is zero, as
    `parallel.context.context_attention` stops the log-sum-exp's gradient for this kernel (the
    fallback gets it as it is)."""
    if window or (q_seg is None) != (kv_seg is None):
        return fallback(q, k, v, q_seg, kv_seg, o, lse, do, dlse, causal, window, offset)
    o, do = o.astype(q.dtype), do.astype(q.dtype)
    if q_seg is None:
        return _cudnn_bwd(q, k, v, None, o, lse, do, _plain_mask(causal), scale)
    if causal:
        documents, fit = _chunk_documents(q_seg, max_documents)

        def packed(q, k, v, q_seg, kv_seg, o, lse, do, dlse):
            return _cudnn_bwd(q, k, v, documents, o, lse, do, _fused.MaskType.PADDING_CAUSAL, scale)

        def other(q, k, v, q_seg, kv_seg, o, lse, do, dlse):
            return tuple(g.astype(q.dtype) for g in fallback(q, k, v, q_seg, kv_seg, o, lse, do, dlse,
                                                             causal, window, offset))

        return lax.cond(fit, packed, other, q, k, v, q_seg, kv_seg, o, lse, do, dlse)
    packed_one, queries, keys = _spanning_document(q_seg, kv_seg)
    do = jnp.where(queries[:, :, None, None], do, jnp.zeros((), do.dtype))  # the other queries see no key here
    dq, dk, dv = _cudnn_bwd(q, k, v, packed_one, o, lse, do, _fused.MaskType.PADDING, scale)
    zero = jnp.zeros((), dq.dtype)
    return (jnp.where(queries[:, :, None, None], dq, zero), jnp.where(keys[:, :, None, None], dk, zero),
            jnp.where(keys[:, :, None, None], dv, zero))
