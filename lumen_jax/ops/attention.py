"""Attention dispatch: one signature, the implementation `ops.choice` chose.

`attention(q, k, v, ..., ops=...)` is the only entry point the model calls. Implementations
(`Ops.attention`, chosen once when the step is built):

- `xla`: the reference (`ops.reference.reference`: fp32 softmax, GQA without repeating K/V, causal,
  sliding-window and document masking). In the trainer's step on one CPU device (`Ops.cpu`) the same output in the
  heads-first layout XLA:CPU runs faster (`ops.cpu.heads_first_attention`).
- `flash`: FlashAttention-2 Pallas kernels (`lumen_jax.kernels.flash_attention`): no [T, S] score
  matrix in memory, causal blocks above the diagonal and outside the window skipped, the same masks
  and GQA. Compiled
  through Triton on GPU; Pallas's interpreter on CPU (`Ops.interpret`: correct, slow, for tests).
  On a multi-device mesh the kernel runs per shard (`parallel.shard.per_device`: batch over
  data/fsdp, heads over tensor).
- `cudnn`: cuDNN's fused attention (`ops.cudnn`), per shard like flash; packed documents through
  cuDNN's packed layout, a row with more documents than it holds through flash (or the reference
  where flash cannot take the shape). All three take a sliding window (`window`).

When the trainer's mesh splits sequences (`Ops.context`) the call goes to context parallelism
(`lumen_jax.parallel.context`: ring or all-gather, load-balanced), which runs the chosen
implementation on each (query chunk, key chunk) pair through `block_kernel`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from lumen_jax.kernels import flash_attention as flash_lib
from lumen_jax.ops import cpu
from lumen_jax.ops import cudnn as cudnn_lib
from lumen_jax.ops.choice import Ops
from lumen_jax.ops.reference import reference, reference_bwd
from lumen_jax.parallel import context as context_lib
from lumen_jax.parallel import shard

# The flash kernel per shard: batch over data/fsdp, heads over tensor, the sequence whole.
_Q_AXES = ("batch", None, "act_heads", None)
_KV_AXES = ("batch", None, "act_kv_heads", None)
_SEG_AXES = ("batch", None)


def _flash_local(ops: Ops, causal: bool, scale: float | None, window: int):
    """The flash kernel on one shard: (q, k, v, segment ids) -> out, with the tiles and the mode
    `ops.choice.choose` picked (`ops.flash_blocks`, `ops.interpret`)."""
    fn = functools.partial(flash_lib.flash_attention, causal=causal, scale=scale, block_sizes=ops.flash_blocks,
                           interpret=ops.interpret, window=window)
    return lambda q, k, v, seg: fn(q, k, v, segment_ids_bt=seg)  # noqa: E731


def flash_attention(q_btnh: jax.Array, k_bskh: jax.Array, v_bskh: jax.Array, *,
                    segment_ids_bt: jax.Array | None = None, causal: bool = True,
                    scale: float | None = None, ops: Ops = Ops(attention="flash"), window: int = 0) -> jax.Array:
    """The Pallas FlashAttention kernel with the reference's signature, per shard of the mesh."""
    return shard.per_device(_flash_local(ops, causal, scale, window), in_axes=(_Q_AXES, _KV_AXES, _KV_AXES, _SEG_AXES),
                            out_axes=_Q_AXES)(q_btnh, k_bskh, v_bskh, segment_ids_bt)


def cudnn_attention(q_btnh: jax.Array, k_bskh: jax.Array, v_bskh: jax.Array, *,
                    segment_ids_bt: jax.Array | None = None, causal: bool = True,
                    scale: float | None = None, ops: Ops = Ops(attention="cudnn"), window: int = 0) -> jax.Array:
    """cuDNN's fused attention (`ops.cudnn.attention`) with the reference's signature, per shard of
    the mesh; its fallback for rows of many documents is flash (`ops.flash_blocks` set) or the
    reference."""
    if ops.flash_blocks is not None:
        fallback = _flash_local(ops, causal, scale, window)
    else:
        fallback = lambda q, k, v, seg: reference(q, k, v, segment_ids_bt=seg, causal=causal, scale=scale,  # noqa: E731
                                                  window=window)[0]
    local = functools.partial(_cudnn_local, causal=causal, scale=scale, fallback=fallback, window=window)
    return shard.per_device(local, in_axes=(_Q_AXES, _KV_AXES, _KV_AXES, _SEG_AXES),
                            out_axes=_Q_AXES)(q_btnh, k_bskh, v_bskh, segment_ids_bt)


def _cudnn_local(q, k, v, seg, *, causal, scale, fallback, window):
    return cudnn_lib.attention(q, k, v, segment_ids_bt=seg, causal=causal, scale=scale, fallback=fallback,
                               window=window)


def block_kernel(ops: Ops, head_dim: int, *, scale: float | None = None, causal: bool = True) -> context_lib.BlockKernel:
    """The chunk-pair attention that context parallelism runs: the reference, the flash kernels, or
    cuDNN's (`ops.cudnn.pair_forward`: its forward and backward from the merged output and
    log-sum-exp, for causal attention; a sliding window, a row of many documents and non-causal
    attention through flash, or the reference)."""
    scale = head_dim ** -0.5 if scale is None else scale
    if ops.attention == "cudnn":
        other = block_kernel(dataclasses.replace(ops, attention="flash" if ops.flash_blocks is not None else "xla"),
                             head_dim, scale=scale)
        if not causal:  # pair_forward reads an unmasked pair as one whose keys are all earlier
            return other
        return context_lib.BlockKernel(functools.partial(cudnn_lib.pair_forward, scale=scale, fallback=other.fwd),
                                       functools.partial(cudnn_lib.pair_backward, scale=scale, fallback=other.bwd),
                                       lse_grad=False)
    if ops.attention == "xla":
        def ref_fwd(q, k, v, q_seg, kv_seg, causal, window, offset):
            return reference(q, k, v, segment_ids_bt=q_seg, kv_segment_ids_bs=kv_seg, causal=causal,
                             scale=scale, out_dtype=jnp.float32, window=window, q_offset=offset)
        return context_lib.BlockKernel(ref_fwd, functools.partial(reference_bwd, scale=scale))
    kw = dict(scale=scale, block_sizes=ops.flash_blocks, interpret=ops.interpret)

    def fwd(q, k, v, q_seg, kv_seg, causal, window, offset):
        o, lse = flash_lib.flash_attention(q, k, v, segment_ids_bt=q_seg, kv_segment_ids_bs=kv_seg,
                                           causal=causal, return_lse=True, window=window, q_offset=offset, **kw)
        return o.astype(jnp.float32), lse

    def bwd(q, k, v, q_seg, kv_seg, o, lse, do, dlse, causal, window, offset):
        return flash_lib.flash_attention_bwd(q, k, v, o.astype(q.dtype), lse, do.astype(q.dtype), dlse,
                                             segment_ids_bt=q_seg, kv_segment_ids_bs=kv_seg,
                                             causal=causal, window=window, q_offset=offset, **kw)

    return context_lib.BlockKernel(fwd, bwd)


def attention(q_btnh: jax.Array, k_bskh: jax.Array, v_bskh: jax.Array, *,
              segment_ids_bt: jax.Array | None = None, causal: bool = True,
              scale: float | None = None, ops: Ops = Ops(), window: int = 0) -> jax.Array:
    """Grouped-query attention [B, T, N, H] by the implementation `ops` names (module docstring).

    Args:
      q_btnh: queries [B, T, N, H]; k_bskh, v_bskh: keys/values [B, S, K, H], N % K == 0; the values'
        head dim may be narrower (MLA): the reference takes it as it is, flash, cuDNN and context
        parallelism with the values zero-padded to H and the output sliced back (exact).
      segment_ids_bt: [B, T] document ids of packed sequences (None: one document per row).
      causal: mask future positions. scale: softmax scale; default 1/sqrt(H).
      ops: the implementation choice (`ops.choice.choose`).
      window: a sliding window (query t sees keys s > t - window, `ops.reference.mask`); 0, or a
        window as long as the keys, is none. Every implementation takes it, context parallelism too
        (over the original positions).
    """
    window = window if 0 < window < k_bskh.shape[1] else 0
    h, hv = q_btnh.shape[-1], v_bskh.shape[-1]
    if hv != h and (ops.context or ops.attention in ("flash", "cudnn")):
        # Values narrower than queries/keys (MLA): the kernels and the ring take one head dim, so the
        # values are padded with zero columns and the output's sliced back (exact; the PV matmul
        # costs h / hv of its own FLOPs).
        if hv > h:
            raise ValueError(f"value head dim {hv} > query head dim {h}: the kernels cannot pad the queries")
        v_pad = jnp.pad(v_bskh, ((0, 0), (0, 0), (0, 0), (0, h - hv)))
        return attention(q_btnh, k_bskh, v_pad, segment_ids_bt=segment_ids_bt, causal=causal, scale=scale,
                         ops=ops, window=window)[..., :hv]
    if ops.context:
        kernel = block_kernel(ops, q_btnh.shape[-1], scale=scale, causal=causal)
        return context_lib.context_attention(q_btnh, k_bskh, v_bskh, segment_ids_bt=segment_ids_bt,
                                             causal=causal, kernel=kernel, window=window)[0]
    if ops.attention == "cudnn":
        return cudnn_attention(q_btnh, k_bskh, v_bskh, segment_ids_bt=segment_ids_bt, causal=causal,
                               scale=scale, ops=ops, window=window)
    if ops.attention == "flash":
        return flash_attention(q_btnh, k_bskh, v_bskh, segment_ids_bt=segment_ids_bt, causal=causal,
                               scale=scale, ops=ops, window=window)
    if ops.cpu:
        h = q_btnh.shape[-1]
        return cpu.heads_first_attention(q_btnh, k_bskh, v_bskh, segment_ids_bt, causal,
                                         h ** -0.5 if scale is None else scale, window)
    return reference(q_btnh, k_bskh, v_bskh, segment_ids_bt=segment_ids_bt, causal=causal, scale=scale,
                     window=window)[0]


def cached_attention(q_btnh: jax.Array, k_bskh: jax.Array, v_bskh: jax.Array, visible_bs: jax.Array,
                     scale: float | None = None) -> jax.Array:
    """Attention of new queries to a KV cache (generation): every query of row b sees the keys where
    `visible_bs[b]` [B, S] bool is set; `scale` as `attention`'s. One implementation, the reference
    (decode reads the cache once per token: memory-bound, where a fused kernel would be chosen here)."""
    q_seg = jnp.ones(q_btnh.shape[:2], jnp.int32)
    return reference(q_btnh, k_bskh, v_bskh, segment_ids_bt=q_seg, kv_segment_ids_bs=visible_bs.astype(jnp.int32),
                     causal=False, scale=scale)[0]
