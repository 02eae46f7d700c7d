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
- No log-sum-exp cotangent: cuDNN's backward ignores it (`return_residual=True` returns the
  log-sum-exp, but its gradient is dropped) and takes no merged output, so context parallelism,
  which merges chunk pairs by their log-sum-exp, never runs cuDNN (`ops.choice`).

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
