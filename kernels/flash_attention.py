"""FlashAttention-2 in Pallas: forward, backward (dQ and dK/dV kernels), `custom_vjp`.

`flash_attention(q, k, v, ...)` computes `softmax(q k^T * scale, masked) v` without ever holding
the [T, S] score matrix: each program owns a tile of rows, streams the other side's blocks through
an online softmax (running max `m` and sum `l`, the running output rescaled by `exp(m_old - m_new)`)
and writes its tile of the output once, with the per-row log-sum-exp. The backward recomputes the
scores from Q, K and that log-sum-exp:

- `D = rowsum(dO * O) - dLSE` (an elementwise product and a row sum: left to XLA, which fuses it);
- the dK/dV kernel: one program per (K/V block, batch, kv head) holds its K/V tile and streams the
  Q/dO blocks of every query head of its group (GQA without repeating K/V anywhere);
- the dQ kernel: one program per (Q block, batch, head) streams the K/V blocks.

`BlockSizes(backward="fused")` runs one backward kernel instead: the dK/dV kernel also multiplies
each dS tile by K and adds it into a float32 dQ with atomic adds (as FlashAttention-2's first
version and FlashAttention-3 do), so the scores and exponentials are computed once, not twice;
opt-in until a GPU measures it (`benchmarks/attention_gpu.py --sweep`).

Semantics are those of `lumen_jax.ops.reference.reference` (same argument names and masks):
causal masking is top-left aligned (query t sees keys s <= t), segment ids mask attention across
packed documents, query head n uses kv head n // (N // K). Scores, softmax and every accumulator
are float32 whatever the input dtype; the probabilities are cast to V's dtype for the P.V matmul
and dS to Q/K's dtype for the gradient matmuls (as FlashAttention-2 does). The log-sum-exp is
returned in natural-log units, [B, N, T] float32, and is differentiable (its cotangent enters the
backward through `D`), so partial results from several devices can be merged by context parallelism:
`o = sum_i exp(lse_i - lse) o_i` with `lse = logaddexp_i lse_i`.

Lengths need not be multiples of the blocks: Q/K/V are padded up to one (a no-op when they already
are), padded keys are masked inside the kernels and padded query rows are sliced off (their
log-sum-exp is set to +inf in the backward, so they contribute exactly zero). Causal attention
skips the K/V blocks above the diagonal, and only the blocks crossing the diagonal (or the padded
tail) pay for building a mask. With segment ids each (query block, key block) tile is classified
before the kernels run (`flash_tiles.tile_classes`, from each block's min and max segment id and its
position): empty tiles are skipped (no loads, no dots), full ones (one document on both sides, below
the diagonal) run without a mask, partial ones with it; each program's loops run over the bounds
`flash_tiles.stream_bounds` derives from those classes. A sliding `window` (query t sees keys s with
t - s < window) classifies the tiles by position too: tiles wholly outside it are empty, tiles wholly
inside full, those its edge crosses partial. `q_offset` (a traced int32 scalar) shifts the queries'
positions against the keys' for the causal mask and the window, so context parallelism runs a chunk
pair by its global positions (a query block that then sees no key writes zeros and a finite, very
negative log-sum-exp, which merging discards).

On GPU the kernels lower through Pallas's Triton backend (`interpret=False`); on CPU they run in
Pallas's interpreter (`interpret=True`): the caller says which (the trainer: `lumen_jax.ops.choice`). `BlockSizes(forward="mosaic")`
runs the forward through JAX's Mosaic GPU (Hopper wgmma/TMA) attention kernel instead, keeping our
Triton backward; it supports fewer cases (no segment ids, bf16/fp16, head dim a multiple of 64) and
is opt-in until the benchmark (`benchmarks/attention_gpu.py`) shows it faster.

Shape letters: B batch, T query length, S key length, N query heads, K kv heads, G = N // K,
H head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# BlockSizes is part of this module's public API (ops/choice.py uses it).
from lumen_jax.kernels.flash_tiles import (
    LN2, LOG2E, MASK_VALUE, MIN_BLOCK, BlockSizes, Static, dot_nn, dot_nt, dot_tn, heavy_first, is_pow2, kv_tail,
    loop_bounds, make_static, optional_inputs, optional_refs, pad_axis, q_loop_bounds, run_pallas, stream,
    tile_mask)


# --------------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------------

def _fwd_kernel(*refs, st: Static, has_seg: bool):
    q_ref, k_ref, v_ref, *optional, o_ref, lse_ref = refs
    qseg_ref, kvseg_ref, bounds_ref, offset = optional_refs(optional, st, has_seg)
    bq, bk = st.blocks.block_q, st.blocks.block_kv
    row0 = heavy_first(pl.program_id(2), n=st.q_pad // bq, causal=st.causal) * bq
    q = q_ref[...]  # [bq, H]
    q_seg = qseg_ref[...] if has_seg else None
    qk_scale = st.scale * LOG2E  # scores in base 2: exp(x) = exp2(x * log2 e)

    def step(j, carry, masked: bool):
        acc, m, l = carry
        col0 = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(col0, bk), :]
        v = v_ref[pl.ds(col0, bk), :]
        s = dot_nt(q, k) * qk_scale  # [bq, bk]
        if masked:
            kv_seg = kvseg_ref[pl.ds(col0, bk)] if has_seg else None
            s = jnp.where(tile_mask(row0 + offset, col0, s.shape, causal=st.causal, kv_len=kv_tail(st),
                                    q_seg=q_seg, kv_seg=kv_seg, window=st.window), s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp2(m - m_new)  # rescales what was accumulated under the old max
        p = jnp.exp2(s - m_new[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + dot_nn(p.astype(v.dtype), v)
        return acc, m_new, l

    carry = (jnp.zeros(q.shape, jnp.float32), jnp.full((bq,), -jnp.inf, jnp.float32),
             jnp.zeros((bq,), jnp.float32))
    acc, m, l = stream(step, carry, bounds_ref, row0, st=st, block_rows=bq, block_cols=bk)
    if bounds_ref is not None:  # every tile of the row block empty: l = 0; its rows see no key (out 0, lse ~ -inf)
        o_ref[...] = (acc / jnp.where(l == 0, 1.0, l)[:, None]).astype(o_ref.dtype)
        # MASK_VALUE in base 2, as a row that sees no key in a masked tile: finite once scaled back by log2(e)
        lse_ref[...] = jnp.where(l == 0, MASK_VALUE * LN2, m * LN2 + jnp.log(l))
    else:
        o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
        lse_ref[...] = m * LN2 + jnp.log(l)


def _forward_triton(q, k, v, q_seg, kv_seg, offset, st: Static):
    """Padded inputs -> (o [B, Tp, N, H], lse [B, N, Tp] f32)."""
    b, tp, n, h = q.shape
    kh = k.shape[2]
    g = n // kh
    bq = st.blocks.block_q
    has_seg = q_seg is not None
    grid = (n, b, tp // bq)  # query blocks slowest: see `heavy_first`
    own = functools.partial(heavy_first, n=tp // bq, causal=st.causal)  # the query block of program i
    in_specs = [
        pl.BlockSpec((None, bq, None, h), lambda ni, bi, i: (bi, own(i), ni, 0)),
        pl.BlockSpec((None, st.kv_pad, None, h), lambda ni, bi, i: (bi, 0, lax.div(ni, g), 0)),
        pl.BlockSpec((None, st.kv_pad, None, h), lambda ni, bi, i: (bi, 0, lax.div(ni, g), 0)),
    ]
    specs, args = optional_inputs(
        q_seg, kv_seg, offset, st,
        seg_specs=[pl.BlockSpec((None, bq), lambda ni, bi, i: (bi, own(i))),
                   pl.BlockSpec((None, st.kv_pad), lambda ni, bi, i: (bi, 0))],
        bounds_spec=pl.BlockSpec((None, None, 4), lambda ni, bi, i: (bi, own(i), 0)),
        bounds=loop_bounds(q_seg, kv_seg, offset, st, batch=b, block_q=bq, block_kv=st.blocks.block_kv))
    in_specs, args = in_specs + specs, [q, k, v, *args]
    out_specs = [pl.BlockSpec((None, bq, None, h), lambda ni, bi, i: (bi, own(i), ni, 0)),
                 pl.BlockSpec((None, None, bq), lambda ni, bi, i: (bi, ni, own(i)))]
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((b, n, tp), jnp.float32)]
    o, lse = run_pallas(functools.partial(_fwd_kernel, st=st, has_seg=has_seg), args=args, grid=grid,
                     in_specs=in_specs, out_specs=out_specs, out_shape=out_shape, st=st,
                     name="flash_fwd", num_warps=st.blocks.num_warps,
                     num_stages=st.blocks.num_stages)
    return o, lse


def _forward_mosaic(q, k, v, q_seg, st: Static):
    """JAX's Mosaic GPU (Hopper) forward on unpadded inputs -> (o, lse [B, N, T] natural log).

    Its kernel has no softmax scale (it uses 1): q is scaled beforehand, in q's dtype.
    """
    from jax.experimental.pallas.ops.gpu import attention_mgpu  # GPU-only module: import lazily

    t, s, h = q.shape[1], k.shape[1], q.shape[-1]
    bq, bk = st.blocks.block_q, st.blocks.block_kv
    problems = [
        (q_seg is None, "segment ids are not supported"),
        (not st.window and not st.offset, "no sliding window or position offset"),
        (q.dtype in (jnp.bfloat16, jnp.float16), f"dtype {q.dtype} is not bfloat16/float16"),
        (h % 64 == 0, f"head_dim={h} is not a multiple of 64"),
        (t == s, f"q length {t} != kv length {s}"),
        (bq % 64 == 0 and bk % 64 == 0, f"block_q={bq} and block_kv={bk} must be multiples of 64"),
        (t % (2 * bq) == 0, f"seq_len={t} must be a multiple of 2*block_q={2 * bq}"),
        (s % bk == 0, f"seq_len={s} must be a multiple of block_kv={bk}"),
    ]
    bad = [msg for ok, msg in problems if not ok]
    if bad:
        raise ValueError("BlockSizes(forward='mosaic') cannot run this call: " + "; ".join(bad)
                         + "; use forward='triton'")
    cfg = attention_mgpu.TuningConfig(block_q=bq, block_kv=bk, max_concurrent_steps=2,
                                      causal=st.causal)
    o, (lse2,) = attention_mgpu.attention((q * st.scale).astype(q.dtype), k, v, cfg,
                                          save_residuals=True)
    return o, lse2 * LN2  # its log-sum-exp is in base 2


def _forward(q, k, v, q_seg, kv_seg, offset, st: Static):
    """Unpadded inputs -> (o [B, T, N, H], lse [B, N, T] float32)."""
    if st.blocks.forward == "mosaic":
        if st.interpret:
            raise ValueError("BlockSizes(forward='mosaic') needs a Hopper GPU (the interpreter runs "
                             "only the Triton kernels); use forward='triton'")
        return _forward_mosaic(q, k, v, q_seg, st)
    qp, kp, vp = pad_axis(q, 1, st.q_pad), pad_axis(k, 1, st.kv_pad), pad_axis(v, 1, st.kv_pad)
    if q_seg is not None:
        q_seg, kv_seg = pad_axis(q_seg, 1, st.q_pad), pad_axis(kv_seg, 1, st.kv_pad)
    o, lse = _forward_triton(qp, kp, vp, q_seg, kv_seg, offset, st)
    return o[:, :st.q_len], lse[:, :, :st.q_len]


# --------------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------------

def _dkv_kernel(*refs, st: Static, has_seg: bool, groups: int, fused: bool):
    ins, (dk_ref, dv_ref, *dq_ref) = (refs[:-3], refs[-3:]) if fused else (refs[:-2], refs[-2:])
    q_ref, k_ref, v_ref, do_ref, lse_ref, d_ref, *optional = ins
    qseg_ref, kvseg_ref, bounds_ref, offset = optional_refs(optional, st, has_seg)
    bq, bk = st.blocks.block_q_dkv, st.blocks.block_kv_dkv
    col0 = pl.program_id(2) * bk  # key blocks slowest, the heaviest (j = 0) first
    k = k_ref[...]  # [bk, H]
    v = v_ref[...]
    kv_seg = kvseg_ref[...] if has_seg else None
    qk_scale = st.scale * LOG2E

    def step(i, carry, g, masked: bool):
        # Keys are the rows of every tile here ([bk, bq], scores transposed): each dot then has the
        # block_kv_dkv keys as its M dimension, which Hopper's wgmma needs to be a multiple of 64
        # (the query tile, 32 or 64, is N or K), and no operand is transposed in registers.
        dk, dv = carry
        row0 = pl.multiple_of(i * bq, bq)
        q = q_ref[pl.ds(row0, bq), g, :]  # [bq, H]
        do = do_ref[pl.ds(row0, bq), g, :]
        lse2 = lse_ref[g, pl.ds(row0, bq)] * LOG2E  # +inf on padded rows: p = 0 there
        delta = d_ref[g, pl.ds(row0, bq)]
        s = dot_nt(k, q) * qk_scale  # [bk, bq]
        if masked:
            q_seg = qseg_ref[pl.ds(row0, bq)] if has_seg else None
            # Padded keys need no mask for dK/dV (their rows are sliced off and do not enter the
            # real keys' gradients), but they would enter dQ.
            s = jnp.where(tile_mask(row0 + offset, col0, s.shape, causal=st.causal,
                                    kv_len=kv_tail(st) if fused else None, q_seg=q_seg, kv_seg=kv_seg,
                                    keys_first=True, window=st.window), s, MASK_VALUE)
        p = jnp.exp2(s - lse2[None, :])
        dv = dv + dot_nn(p.astype(do.dtype), do)
        dp = dot_nt(v, do)  # [bk, bq]
        ds = p * (dp - delta[None, :])
        dk = dk + dot_nn(ds.astype(q.dtype), q)
        if fused:  # this key block's share of dQ, added in float32 to what other programs add
            plgpu.atomic_add(dq_ref[0], (pl.ds(row0, bq), g, slice(None)),
                             dot_tn(ds.astype(k.dtype), k) * st.scale)
        return dk, dv

    if bounds_ref is not None:
        lo, full_lo, full_hi, hi = (bounds_ref[x] for x in range(4))
    else:
        lo, full_lo = q_loop_bounds(col0, st=st, block_rows=bq, block_cols=bk)
        full_hi = hi = st.q_pad // bq
        if fused and kv_tail(st) is not None:  # the block holding padded keys is masked throughout
            full_lo = jnp.where(col0 + bk > st.kv_len, hi, full_lo)

    def head(g, carry):
        carry = lax.fori_loop(lo, full_lo, functools.partial(step, g=g, masked=True), carry)
        carry = lax.fori_loop(full_lo, full_hi, functools.partial(step, g=g, masked=False), carry)
        return lax.fori_loop(full_hi, hi, functools.partial(step, g=g, masked=True), carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, groups, head, (zeros, zeros))
    dk_ref[...] = (dk * st.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(*refs, st: Static, has_seg: bool):
    q_ref, k_ref, v_ref, do_ref, lse_ref, d_ref, *optional, dq_ref = refs
    qseg_ref, kvseg_ref, bounds_ref, offset = optional_refs(optional, st, has_seg)
    bq, bk = st.blocks.block_q_dq, st.blocks.block_kv_dq
    row0 = heavy_first(pl.program_id(2), n=st.q_pad // bq, causal=st.causal) * bq
    q = q_ref[...]  # [bq, H]
    do = do_ref[...]
    lse2 = lse_ref[...] * LOG2E
    delta = d_ref[...]
    q_seg = qseg_ref[...] if has_seg else None
    qk_scale = st.scale * LOG2E

    def step(j, dq, masked: bool):
        col0 = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(col0, bk), :]
        v = v_ref[pl.ds(col0, bk), :]
        s = dot_nt(q, k) * qk_scale
        if masked:
            kv_seg = kvseg_ref[pl.ds(col0, bk)] if has_seg else None
            s = jnp.where(tile_mask(row0 + offset, col0, s.shape, causal=st.causal, kv_len=kv_tail(st),
                                    q_seg=q_seg, kv_seg=kv_seg, window=st.window), s, MASK_VALUE)
        p = jnp.exp2(s - lse2[:, None])
        ds = p * (dot_nt(do, v) - delta[:, None])
        return dq + dot_nn(ds.astype(k.dtype), k)

    dq = stream(step, jnp.zeros(q.shape, jnp.float32), bounds_ref, row0, st=st, block_rows=bq, block_cols=bk)
    dq_ref[...] = (dq * st.scale).astype(dq_ref.dtype)


def _backward(q, k, v, q_seg, kv_seg, offset, o, lse, do, dlse, st: Static):
    """(dq, dk, dv) from unpadded residuals and cotangents."""
    b, t, n, h = q.shape
    kh = k.shape[2]
    g = n // kh
    # D_i = sum_h dO_ih O_ih - dLSE_i: with it, dS = P * (dP - D) covers both cotangents.
    delta = jnp.einsum("btnh,btnh->bnt", do.astype(jnp.float32), o.astype(jnp.float32)) - dlse
    qp, dop = pad_axis(q, 1, st.q_pad), pad_axis(do, 1, st.q_pad)
    kp, vp = pad_axis(k, 1, st.kv_pad), pad_axis(v, 1, st.kv_pad)
    lse = pad_axis(lse, 2, st.q_pad, value=jnp.inf)  # padded rows: P = exp(s - inf) = 0
    delta = pad_axis(delta, 2, st.q_pad)
    has_seg = q_seg is not None
    if has_seg:
        q_seg, kv_seg = pad_axis(q_seg, 1, st.q_pad), pad_axis(kv_seg, 1, st.kv_pad)
    bl = st.blocks
    tp, sp = st.q_pad, st.kv_pad

    # dK, dV: grid over (kv head, batch, key block); each program sees the G query heads of its group.
    bk = bl.block_kv_dkv
    in_specs = [
        pl.BlockSpec((None, tp, g, h), lambda ki, bi, j: (bi, 0, ki, 0)),  # q
        pl.BlockSpec((None, bk, None, h), lambda ki, bi, j: (bi, j, ki, 0)),  # k
        pl.BlockSpec((None, bk, None, h), lambda ki, bi, j: (bi, j, ki, 0)),  # v
        pl.BlockSpec((None, tp, g, h), lambda ki, bi, j: (bi, 0, ki, 0)),  # do
        pl.BlockSpec((None, g, tp), lambda ki, bi, j: (bi, ki, 0)),  # lse
        pl.BlockSpec((None, g, tp), lambda ki, bi, j: (bi, ki, 0)),  # delta
    ]
    specs, args = optional_inputs(
        q_seg, kv_seg, offset, st,
        seg_specs=[pl.BlockSpec((None, tp), lambda ki, bi, j: (bi, 0)),
                   pl.BlockSpec((None, bk), lambda ki, bi, j: (bi, j))],
        bounds_spec=pl.BlockSpec((None, None, 4), lambda ki, bi, j: (bi, j, 0)),
        bounds=loop_bounds(q_seg, kv_seg, offset, st, batch=b, block_q=bl.block_q_dkv, block_kv=bk, keys_own=True))
    in_specs, args = in_specs + specs, [qp, kp, vp, dop, lse, delta, *args]
    kv_spec = pl.BlockSpec((None, bk, None, h), lambda ki, bi, j: (bi, j, ki, 0))
    out_specs = [kv_spec, kv_spec]
    out_shape = [jax.ShapeDtypeStruct(kp.shape, k.dtype), jax.ShapeDtypeStruct(vp.shape, v.dtype)]
    fused = bl.backward == "fused"
    if fused:  # dQ [B, Tp, N, H] float32, every key block of the kv head adding its share
        out_specs.append(pl.BlockSpec((None, tp, g, h), lambda ki, bi, j: (bi, 0, ki, 0)))
        out_shape.append(jax.ShapeDtypeStruct(qp.shape, jnp.float32))
    dk, dv, *dq = run_pallas(
        functools.partial(_dkv_kernel, st=st, has_seg=has_seg, groups=g, fused=fused), args=args,
        grid=(kh, b, sp // bk), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        st=st, name="flash_bwd_fused" if fused else "flash_bwd_dkv", num_warps=bl.num_warps_bwd,
        num_stages=bl.num_stages_bwd, accumulate=(2,) if fused else ())
    if fused:
        return dq[0][:, :t].astype(q.dtype), dk[:, :k.shape[1]], dv[:, :v.shape[1]]

    # dQ: grid over (head, batch, query block), streaming K/V of the head's kv head.
    bq = bl.block_q_dq
    own = functools.partial(heavy_first, n=tp // bq, causal=st.causal)
    q_spec = pl.BlockSpec((None, bq, None, h), lambda ni, bi, i: (bi, own(i), ni, 0))
    kv_full = pl.BlockSpec((None, sp, None, h), lambda ni, bi, i: (bi, 0, lax.div(ni, g), 0))
    row_spec = pl.BlockSpec((None, None, bq), lambda ni, bi, i: (bi, ni, own(i)))
    specs, args = optional_inputs(
        q_seg, kv_seg, offset, st,
        seg_specs=[pl.BlockSpec((None, bq), lambda ni, bi, i: (bi, own(i))),
                   pl.BlockSpec((None, sp), lambda ni, bi, i: (bi, 0))],
        bounds_spec=pl.BlockSpec((None, None, 4), lambda ni, bi, i: (bi, own(i), 0)),
        bounds=loop_bounds(q_seg, kv_seg, offset, st, batch=b, block_q=bq, block_kv=bl.block_kv_dq))
    in_specs = [q_spec, kv_full, kv_full, q_spec, row_spec, row_spec, *specs]
    args = [qp, kp, vp, dop, lse, delta, *args]
    (dq,) = run_pallas(
        functools.partial(_dq_kernel, st=st, has_seg=has_seg), args=args, grid=(n, b, tp // bq),
        in_specs=in_specs, out_specs=[q_spec], out_shape=[jax.ShapeDtypeStruct(qp.shape, q.dtype)],
        st=st, name="flash_bwd_dq", num_warps=bl.num_warps_bwd, num_stages=bl.num_stages_bwd)
    return dq[:, :t], dk[:, :k.shape[1]], dv[:, :v.shape[1]]


# --------------------------------------------------------------------------------------------------
# custom_vjp and the public function
# --------------------------------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _flash(q, k, v, q_seg, kv_seg, offset, st: Static):
    return _forward(q, k, v, q_seg, kv_seg, offset, st)


# The name of the forward's output and log-sum-exp under `jax.checkpoint`: a remat policy that saves
# it (`save_only_these_names(RESIDUAL_NAME)`) keeps the backward from running the forward kernel again
# (the other residuals, q, k, v and the segment ids, are the kernel's inputs).
RESIDUAL_NAME = "flash_attention_residual"


def _flash_fwd(q, k, v, q_seg, kv_seg, offset, st):
    o, lse = _forward(q, k, v, q_seg, kv_seg, offset, st)
    o, lse = checkpoint_name(o, RESIDUAL_NAME), checkpoint_name(lse, RESIDUAL_NAME)
    return (o, lse), (q, k, v, q_seg, kv_seg, offset, o, lse)


def _flash_bwd(st, residuals, cotangents):
    q, k, v, q_seg, kv_seg, offset, o, lse = residuals
    do, dlse = cotangents
    dq, dk, dv = _backward(q, k, v, q_seg, kv_seg, offset, o, lse, do, dlse, st)
    return dq, dk, dv, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def check_supported(q_shape, k_shape, *, interpret: bool) -> str | None:
    """Why the kernel cannot run these shapes (None when it can)."""
    b, t, n, h = q_shape
    if len(k_shape) != 4 or k_shape[0] != b or k_shape[3] != h:
        return f"q {tuple(q_shape)} and k/v {tuple(k_shape)} must be [B, T, N, H] and [B, S, K, H]"
    if n % k_shape[2]:
        return f"num_heads={n} must be a multiple of num_kv_heads={k_shape[2]}"
    if not interpret and not (is_pow2(h) and h >= MIN_BLOCK):
        return (f"head_dim={h} must be a power of two >= {MIN_BLOCK} for the compiled kernel "
                "(64, 128 and 256 have tuned block sizes)")
    return None


def _offset_input(q_offset):
    """The offset as the kernels' input (None: none, a Python 0)."""
    if isinstance(q_offset, int) and q_offset == 0:
        return None
    return jnp.asarray(q_offset, jnp.int32)


def _static(q_btnh, k_bskh, *, causal, scale, block_sizes, interpret, poison, window, offset) -> Static:
    t, s, h = q_btnh.shape[1], k_bskh.shape[1], q_btnh.shape[3]
    if window < 0:
        raise ValueError(f"flash_attention: window={window} must be >= 0 (0: none)")
    return make_static(t, s, scale=float(h ** -0.5 if scale is None else scale), causal=bool(causal),
                       blocks=block_sizes or BlockSizes.default(h), interpret=bool(interpret),
                       poison=bool(poison), window=int(window), offset=offset is not None)


def flash_attention(q_btnh: jax.Array, k_bskh: jax.Array, v_bskh: jax.Array, *,
                    segment_ids_bt: jax.Array | None = None,
                    kv_segment_ids_bs: jax.Array | None = None,
                    causal: bool = True, scale: float | None = None,
                    block_sizes: BlockSizes | None = None, interpret: bool = False,
                    return_lse: bool = False, poison_outputs: bool = False,
                    window: int = 0, q_offset: int | jax.Array = 0):
    """FlashAttention with grouped-query heads; differentiable (custom_vjp with Pallas kernels).

    Args:
      q_btnh: queries [B, T, N, H] (bfloat16, float16 or float32).
      k_bskh, v_bskh: keys/values [B, S, K, H], N % K == 0; query head n uses kv head n // (N//K).
      segment_ids_bt: [B, T] int document ids of packed sequences: tokens attend only within
        their document. None: one document per row.
      kv_segment_ids_bs: [B, S] the keys' document ids; default `segment_ids_bt` (needs T == S).
      causal: mask keys after the query (top-left aligned: query t sees keys s <= t).
      scale: softmax scale; default 1/sqrt(H).
      block_sizes: tiles and launch parameters; default `BlockSizes.default(H)` for the device.
      interpret: run in Pallas's interpreter (required on CPU, its only mode there); False: compiled.
      return_lse: also return the log-sum-exp of each row's (scaled, masked) scores.
      poison_outputs: testing aid: NaN-fill every output buffer before the kernels run, so a tile
        that is never written fails a comparison.
      window: a sliding window: query t sees keys s with t - s < window (the `window` latest,
        itself included, under causal masking; `ops.reference.mask`); 0: none. Tiles wholly
        outside it are skipped, tiles wholly inside run unmasked.
      q_offset: int32 scalar (may be traced): query i sits at position i + q_offset against key j
        at position j, for the causal mask and the window (a chunk pair under context parallelism:
        the chunks' global start positions' difference); 0: aligned.

    Returns:
      out [B, T, N, H] in q's dtype, and with `return_lse` also lse [B, N, T] float32 (natural log).
    """
    problem = check_supported(q_btnh.shape, k_bskh.shape, interpret=interpret)
    if problem is None and v_bskh.shape != k_bskh.shape:
        problem = f"v {tuple(v_bskh.shape)} must have k's shape {tuple(k_bskh.shape)}"
    if problem:
        raise ValueError(f"flash_attention: {problem}")
    t, s = q_btnh.shape[1], k_bskh.shape[1]
    if segment_ids_bt is not None and kv_segment_ids_bs is None:
        if t != s:
            raise ValueError(f"flash_attention: segment_ids_bt alone needs T == S (got T={t}, S={s});"
                             " pass kv_segment_ids_bs too")
        kv_segment_ids_bs = segment_ids_bt
    if (segment_ids_bt is None) != (kv_segment_ids_bs is None):
        raise ValueError("flash_attention: kv_segment_ids_bs needs segment_ids_bt")
    if segment_ids_bt is not None:
        segment_ids_bt = segment_ids_bt.astype(jnp.int32)
        kv_segment_ids_bs = kv_segment_ids_bs.astype(jnp.int32)
    offset = _offset_input(q_offset)
    st = _static(q_btnh, k_bskh, causal=causal, scale=scale, block_sizes=block_sizes, interpret=interpret,
                 poison=poison_outputs, window=window, offset=offset)
    out, lse = _flash(q_btnh, k_bskh, v_bskh, segment_ids_bt, kv_segment_ids_bs, offset, st)
    return (out, lse) if return_lse else out


def flash_attention_bwd(q_btnh, k_bskh, v_bskh, o_btnh, lse_bnt, do_btnh, dlse_bnt=None, *,
                        segment_ids_bt=None, kv_segment_ids_bs=None, causal: bool = True,
                        scale: float | None = None, block_sizes: BlockSizes | None = None,
                        interpret: bool = False, window: int = 0, q_offset: int | jax.Array = 0):
    """The backward kernels alone: (dq, dk, dv) of this (Q, K/V) pair given an output `o_btnh` and
    log-sum-exp `lse_bnt` that may come from a larger attention (context parallelism merges several
    K/V chunks: with the merged o and lse, FlashAttention-2's backward gives each chunk's share).
    `window` and `q_offset` as in `flash_attention`."""
    if segment_ids_bt is not None:
        segment_ids_bt = segment_ids_bt.astype(jnp.int32)
        kv_segment_ids_bs = (segment_ids_bt if kv_segment_ids_bs is None else kv_segment_ids_bs).astype(jnp.int32)
    offset = _offset_input(q_offset)
    st = _static(q_btnh, k_bskh, causal=causal, scale=scale, block_sizes=block_sizes, interpret=interpret,
                 poison=False, window=window, offset=offset)
    dlse_bnt = jnp.zeros_like(lse_bnt) if dlse_bnt is None else dlse_bnt
    return _backward(q_btnh, k_bskh, v_bskh, segment_ids_bt, kv_segment_ids_bs, offset, o_btnh, lse_bnt,
                     do_btnh, dlse_bnt, st)
