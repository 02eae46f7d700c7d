"""The building blocks of the FlashAttention kernels (`flash_attention.py`): tile sizes, the static
configuration a kernel specialises on, tile masks and loop bounds, and the `pallas_call` wrapper.

Shared by the forward and both backward kernels; nothing here is a kernel itself.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu  # CompilerParams only; safe to import on CPU

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# Finite, so a fully masked row gives exp2(MASK - MASK) = 1 instead of NaN (its output is the mean of
# V, as softmax over equal scores in the reference), and far below any real score.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
MIN_BLOCK = 16  # Triton's tl.dot needs every tile dimension >= 16
FORWARD_IMPLS = ("triton", "mosaic")
BACKWARD_IMPLS = ("split", "fused")


# --------------------------------------------------------------------------------------------------
# Block sizes
# --------------------------------------------------------------------------------------------------

def is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes (powers of two >= 16) and Triton launch parameters.

    Forward: programs own `block_q` query rows and stream `block_kv` keys. dK/dV: programs own
    `block_kv_dkv` keys and stream `block_q_dkv` query rows. dQ: programs own `block_q_dq` rows and
    stream `block_kv_dq` keys. Tiles larger than the (padded) sequence shrink to fit it.
    """

    block_q: int = 128
    block_kv: int = 64
    block_q_dkv: int = 32
    block_kv_dkv: int = 128
    block_q_dq: int = 128
    block_kv_dq: int = 32
    num_warps: int = 8
    num_stages: int = 3
    num_warps_bwd: int = 8
    num_stages_bwd: int = 2
    forward: str = "triton"  # triton | mosaic (Hopper only; see the module docstring)
    backward: str = "split"  # split: dK/dV and dQ kernels | fused: one kernel, dQ by f32 atomic adds

    def __post_init__(self):
        for f in ("block_q", "block_kv", "block_q_dkv", "block_kv_dkv", "block_q_dq", "block_kv_dq"):
            v = getattr(self, f)
            if not (is_pow2(v) and v >= MIN_BLOCK):
                raise ValueError(f"BlockSizes.{f}={v} must be a power of two >= {MIN_BLOCK}")
        if self.forward not in FORWARD_IMPLS:
            raise ValueError(f"BlockSizes.forward={self.forward!r} is not one of {FORWARD_IMPLS}")
        if self.backward not in BACKWARD_IMPLS:
            raise ValueError(f"BlockSizes.backward={self.backward!r} is not one of {BACKWARD_IMPLS}")

    @classmethod
    def default(cls, head_dim: int, device: jax.Device | None = None) -> BlockSizes:
        """Starting points per GPU generation (from the Triton fused-attention tutorial's settings
        for A100/H100; `benchmarks/attention_gpu.py --sweep` measures alternatives).

        On CPU (interpreter) the largest tiles are the fastest to interpret.
        """
        device = device or jax.devices()[0]
        if device.platform == "cpu":
            return cls(block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128,
                       block_q_dq=128, block_kv_dq=128)
        cc = getattr(device, "compute_capability", "0.0")
        major = int(str(cc).split(".")[0]) if str(cc)[:1].isdigit() else 0
        if head_dim > 128:  # 256: shared memory limits the tiles
            return cls(block_q=64, block_kv=32, block_q_dkv=32, block_kv_dkv=64, block_q_dq=64,
                       block_kv_dq=32, num_warps=8, num_stages=2, num_warps_bwd=8, num_stages_bwd=1)
        if major >= 9:  # Hopper (H100/H200) and later
            # Every tile at least 64 rows, 8 warps in the backward: each dot is a wgmma (the sm_90
            # compile in docs/PERFORMANCE.md counts them: no mma.sync, no spills, at most 255
            # registers with two warpgroups sharing the 128-key or 128-query tile).
            return cls(block_q=128, block_kv=64 if head_dim > 64 else 128, block_q_dkv=64,
                       block_kv_dkv=128, block_q_dq=128, block_kv_dq=64,
                       num_warps=8 if head_dim > 64 else 4, num_stages=3,
                       num_warps_bwd=8, num_stages_bwd=2)
        # Ampere (A100) and anything else
        return cls(block_q=128, block_kv=64 if head_dim > 64 else 128,
                   num_warps=8 if head_dim > 64 else 4, num_stages=2,
                   num_warps_bwd=4, num_stages_bwd=2)

    def with_overrides(self, block_q: int = 0, block_kv: int = 0) -> BlockSizes:
        """Config overrides (0 keeps the default): `block_q` is the row tile a program owns in the
        forward and dQ kernels, `block_kv` the key tile streamed by the forward and owned by dK/dV."""
        changes = {}
        if block_q:
            changes.update(block_q=block_q, block_q_dq=block_q)
        if block_kv:
            changes.update(block_kv=block_kv, block_kv_dkv=block_kv)
        return dataclasses.replace(self, **changes)


def fit(block: int, length: int) -> int:
    """The tile shrunk to the sequence (rounded up to a power of two, at least MIN_BLOCK)."""
    return min(block, max(MIN_BLOCK, pl.next_power_of_2(length)))


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclasses.dataclass(frozen=True)
class Static:
    """Everything the kernels specialise on (hashable: a nondiff argument of the custom_vjp)."""

    scale: float
    causal: bool
    blocks: BlockSizes  # already fitted to the sequence lengths
    q_len: int
    kv_len: int
    q_pad: int  # padded lengths: multiples of every q-side (kv-side) tile
    kv_pad: int
    interpret: bool
    poison: bool
    window: int = 0  # a sliding window: query t sees keys s with t - s < window; 0: none
    offset: bool = False  # an offset input: query i sits at position i + offset against key j at j

    def classified(self, has_seg: bool) -> bool:
        """Whether the loops run over bounds from the tile classes (`tile_classes`, in XLA) rather
        than the causal diagonal's, computed in the kernel: with segment ids, a window or an offset."""
        return has_seg or self.window > 0 or self.offset


def make_static(q_len, kv_len, *, scale, causal, blocks, interpret, poison, window: int = 0,
                offset: bool = False) -> Static:
    fq = functools.partial(fit, length=q_len)
    fk = functools.partial(fit, length=kv_len)
    b = dataclasses.replace(blocks, block_q=fq(blocks.block_q), block_kv=fk(blocks.block_kv),
                            block_q_dkv=fq(blocks.block_q_dkv), block_kv_dkv=fk(blocks.block_kv_dkv),
                            block_q_dq=fq(blocks.block_q_dq), block_kv_dq=fk(blocks.block_kv_dq))
    q_pad = round_up(q_len, max(b.block_q, b.block_q_dkv, b.block_q_dq))  # powers of two: max = lcm
    kv_pad = round_up(kv_len, max(b.block_kv, b.block_kv_dkv, b.block_kv_dq))
    return Static(scale=scale, causal=causal, blocks=b, q_len=q_len, kv_len=kv_len, q_pad=q_pad,
                   kv_pad=kv_pad, interpret=interpret, poison=poison, window=window, offset=offset)


# --------------------------------------------------------------------------------------------------
# Pieces shared by the kernels
# --------------------------------------------------------------------------------------------------

def dot_nt(a, b):
    """a [M, C] . b [N, C]^T -> [M, N] float32."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def dot_nn(a, b):
    """a [M, C] . b [C, N] -> [M, N] float32."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def dot_tn(a, b):
    """a [C, M]^T . b [C, N] -> [M, N] float32."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def tile_mask(row0, col0, shape, *, causal: bool, kv_len: int | None, q_seg, kv_seg,
              keys_first: bool = False, window: int = 0):
    """Which (row, col) of a [rows, cols] tile of queries from position row0 and keys from col0 may
    attend (row0 includes the offset, if any); with `keys_first` the tile is [keys, queries] (the
    dK/dV kernel's transposed scores)."""
    q_axis, kv_axis = (1, 0) if keys_first else (0, 1)
    rows = row0 + lax.broadcasted_iota(jnp.int32, shape, q_axis)
    cols = col0 + lax.broadcasted_iota(jnp.int32, shape, kv_axis)
    mask = jnp.ones(shape, jnp.bool_)
    if kv_len is not None:
        mask = mask & (cols < kv_len)
    if causal:
        mask = mask & (rows >= cols)
    if window:
        mask = mask & (rows - cols < window)
    if q_seg is not None:
        mask = mask & ((kv_seg[:, None] == q_seg[None, :]) if keys_first else (q_seg[:, None] == kv_seg[None, :]))
    return mask


def kv_tail(st: Static) -> int | None:
    """The key length to mask beyond, when the keys were padded."""
    return st.kv_len if st.kv_pad != st.kv_len else None


def kv_loop_bounds(row0, *, st: Static, block_rows: int, block_cols: int):
    """For a row tile starting at row0 without segment ids: (n_plain, n_total) K/V blocks; blocks
    [0, n_plain) need no mask at all, blocks [n_plain, n_total) need one, blocks >= n_total are fully
    masked (skipped)."""
    n_kv = st.kv_pad // block_cols
    n_real = st.kv_len // block_cols  # blocks with no padded key
    if st.causal:
        n_total = lax.min(lax.div(row0 + block_rows + block_cols - 1, block_cols), n_kv)
        n_plain = lax.min(lax.div(row0, block_cols), n_real)  # every key < row0 <= every row
    else:
        n_total, n_plain = n_kv, n_real
    return n_plain, n_total


def q_loop_bounds(col0, *, st: Static, block_rows: int, block_cols: int):
    """For a key tile starting at col0 without segment ids: (first, plain) query blocks; blocks <
    first see none of these keys (skipped), [first, plain) need a mask, blocks >= plain need none."""
    n_q = st.q_pad // block_rows
    if not st.causal:
        return 0, 0
    first = lax.div(col0, block_rows)
    # From `plain` on, a query block's first row is beyond the tile's last key.
    return first, lax.min(lax.div(col0 + block_cols + block_rows - 1, block_rows), n_q)


def heavy_first(i, n: int, causal: bool):
    """The query block that program i of the forward or dQ kernel owns, of n: under causal masking
    block r streams about r + 1 key blocks, so the last is the heaviest, and it goes first.

    The kernels' grids put the streamed-over blocks' axis last, (heads, batch, blocks): Pallas's
    Triton lowering makes the first axis CUDA's x, which the GPU starts fastest, so every head's
    block-0 program starts before any head's block 1. With the order reversed here, the heaviest
    programs of every head start first and the launch ends on the lightest (longest job first),
    rather than ending on a wave of the heaviest with the rest of the GPU idle. (In the dK/dV kernel
    key block j streams the query blocks from j on: its heaviest, j = 0, come first as they are.)"""
    return n - 1 - i if causal else i


def stream(step, carry, bounds_ref, row0, *, st: Static, block_rows: int, block_cols: int):
    """Run `step(j, carry, masked)` over the K/V blocks a row tile streams (forward and dQ): with
    segment ids, a window or an offset over the bounds `stream_bounds` gave it (`bounds_ref`: empty
    blocks skipped, the run of full ones unmasked), without them over the causal bounds
    (`kv_loop_bounds`)."""
    if bounds_ref is None:
        n_plain, n_total = kv_loop_bounds(row0, st=st, block_rows=block_rows, block_cols=block_cols)
        carry = lax.fori_loop(0, n_plain, functools.partial(step, masked=False), carry)
        return lax.fori_loop(n_plain, n_total, functools.partial(step, masked=True), carry)
    lo, full_lo, full_hi, hi = (bounds_ref[x] for x in range(4))
    carry = lax.fori_loop(lo, full_lo, functools.partial(step, masked=True), carry)
    carry = lax.fori_loop(full_lo, full_hi, functools.partial(step, masked=False), carry)
    return lax.fori_loop(full_hi, hi, functools.partial(step, masked=True), carry)


# --------------------------------------------------------------------------------------------------
# Tile classes from the segment ids (packed documents)
# --------------------------------------------------------------------------------------------------

EMPTY, PARTIAL, FULL = 0, 1, 2


def block_ranges(seg_bt, block: int):
    """Each block's (min, max) segment id: [B, T] -> two [B, T // block]."""
    b, t = seg_bt.shape
    blocks = seg_bt.reshape(b, t // block, block)
    return jnp.min(blocks, axis=-1), jnp.max(blocks, axis=-1)


def tile_classes(q_seg, kv_seg, *, st: Static, block_q: int, block_kv: int, offset=0, batch: int = 1):
    """[B, Tp // block_q, Sp // block_kv] int32: EMPTY (no query of the tile sees a key of it: the
    blocks' segment ranges do not meet, the tile lies above the causal diagonal or wholly outside
    the window, or it holds only padding), FULL (every query sees every key: both blocks hold one
    and the same segment, the tile lies below the diagonal and inside the window, no padded key) or
    PARTIAL (needs the element mask). Without segment ids (None) the batch is `batch`, alike.

    From each block's (min, max) segment id and the tile's least and greatest query-key distance
    (`offset` shifts the queries' positions: a traced scalar under context parallelism): a few
    [B, blocks] reductions, no [T, S] array. Disjoint ranges prove a tile empty for any ids; a tile
    inside one document (the usual case of packed rows, whose documents are contiguous runs) is full.
    """
    row0 = (jnp.arange(st.q_pad // block_q) * block_q)[None, :, None]
    col0 = (jnp.arange(st.kv_pad // block_kv) * block_kv)[None, None, :]
    meet = (row0 < st.q_len) & (col0 < st.kv_len)
    full = col0 + block_kv <= st.kv_len
    if q_seg is not None:
        q_min, q_max = block_ranges(q_seg, block_q)
        kv_min, kv_max = block_ranges(kv_seg, block_kv)
        q_min, q_max = q_min[:, :, None], q_max[:, :, None]
        kv_min, kv_max = kv_min[:, None, :], kv_max[:, None, :]
        meet = meet & (q_max >= kv_min) & (kv_max >= q_min)
        full = full & (q_min == q_max) & (kv_min == kv_max) & (q_min == kv_min)
    # The query-key distances (query position - key position) the tile spans.
    near = row0 + offset - (col0 + block_kv - 1)
    far = row0 + block_q - 1 + offset - col0
    if st.causal:
        meet = meet & (far >= 0)
        full = full & (near >= 0)
    if st.window:
        meet = meet & (near < st.window)
        full = full & (far < st.window)
    classes = jnp.where(meet, jnp.where(full, FULL, PARTIAL), EMPTY).astype(jnp.int32)
    return jnp.broadcast_to(classes, (classes.shape[0] if q_seg is not None else batch, *classes.shape[1:]))


def stream_bounds(classes):
    """Loop bounds of each program over the blocks it streams: classes [B, owned, streamed] ->
    [B, owned, 4] int32 (lo, full_lo, full_hi, hi). Blocks outside [lo, hi) are empty (skipped: no
    loads, no dots), [full_lo, full_hi) is the first run of full blocks (no mask), the rest of
    [lo, hi) is masked. An empty block between two others (a document whose ids recur further on)
    is masked, not skipped: correct, and the loops stay free of branches that would stop Triton
    from pipelining their loads."""
    n = classes.shape[-1]
    idx = jnp.arange(n, dtype=jnp.int32)
    nonempty = classes != EMPTY
    any_ = jnp.any(nonempty, axis=-1)
    lo = jnp.where(any_, jnp.argmax(nonempty, axis=-1), 0).astype(jnp.int32)
    hi = jnp.where(any_, n - jnp.argmax(nonempty[..., ::-1], axis=-1), 0).astype(jnp.int32)
    full = classes == FULL
    full_lo = jnp.minimum(jnp.min(jnp.where(full, idx, n), axis=-1), hi).astype(jnp.int32)
    after = jnp.where((idx >= full_lo[..., None]) & ~full, idx, n)
    full_hi = jnp.minimum(jnp.min(after, axis=-1), hi).astype(jnp.int32)
    return jnp.stack([lo, full_lo, full_hi, hi], axis=-1)


def optional_refs(refs, st: Static, has_seg: bool):
    """(q_seg ref, kv_seg ref, bounds ref, offset) from a kernel's optional inputs, in the order
    `optional_inputs` passes them: None (the offset 0) where absent."""
    refs = list(refs)
    qseg_ref, kvseg_ref = (refs.pop(0), refs.pop(0)) if has_seg else (None, None)
    bounds_ref = refs.pop(0) if st.classified(has_seg) else None
    offset = refs.pop(0)[0] if st.offset else 0
    return qseg_ref, kvseg_ref, bounds_ref, offset


def optional_inputs(q_seg, kv_seg, offset, st: Static, *, seg_specs, bounds_spec, bounds):
    """(in_specs, args) of a kernel's optional inputs: the segment ids, the loop bounds (`loop_bounds`)
    and the offset (one int32; every program reads it)."""
    specs, args = [], []
    if q_seg is not None:
        specs += seg_specs
        args += [q_seg, kv_seg]
    if bounds is not None:
        specs.append(bounds_spec)
        args.append(bounds)
    if st.offset:
        specs.append(pl.BlockSpec((1,), lambda *_: (0,)))
        args.append(jnp.reshape(offset, (1,)).astype(jnp.int32))
    return specs, args


def loop_bounds(q_seg, kv_seg, offset, st: Static, *, batch: int, block_q: int, block_kv: int,
            keys_own: bool = False):
    """Each program's loop bounds from the tile classes (`stream_bounds`), or None where the kernel
    derives them from the causal diagonal; `keys_own`: the dK/dV kernel (owns keys, streams queries)."""
    if not st.classified(q_seg is not None):
        return None
    classes = tile_classes(q_seg, kv_seg, st=st, block_q=block_q, block_kv=block_kv,
                           offset=0 if offset is None else offset, batch=batch)
    return stream_bounds(classes.transpose(0, 2, 1) if keys_own else classes)


def compiler_params(num_warps: int, num_stages: int):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def run_pallas(kernel, *, args, grid, in_specs, out_specs, out_shape, st: Static, name: str,
               num_warps: int, num_stages: int, accumulate: tuple[int, ...] = ()):
    """pallas_call. Outputs listed in `accumulate` start zero-filled (an aliased input buffer): the
    kernel adds into them. With `st.poison` every other output starts NaN-filled, so a tile the
    kernel never writes shows up as NaN, in the interpreter and on GPU alike."""
    n_in = len(args)
    init = {i: jnp.zeros(out_shape[i].shape, out_shape[i].dtype) for i in accumulate}
    if st.poison:
        init = {i: init.get(i, jnp.full(o.shape, jnp.nan, o.dtype)) for i, o in enumerate(out_shape)}
    order = sorted(init)
    aliases = {n_in + k: i for k, i in enumerate(order)}
    if order:
        args = [*args, *(init[i] for i in order)]
        in_specs = [*in_specs, *(out_specs[i] for i in order)]
        inner = kernel

        def kernel(*refs):  # drop the aliased input refs: the kernel writes only its outputs
            inner(*refs[:n_in], *refs[n_in + len(order):])
    return pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        input_output_aliases=aliases, interpret=st.interpret, name=name,
        compiler_params=None if st.interpret else compiler_params(num_warps, num_stages),
    )(*args)


def pad_axis(x, axis: int, size: int, value=0):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)
