"""Context parallelism: attention over sequences split along the `context` mesh axis.

Every sequence of length L is cut into chunks and each of the C devices of the `context` axis holds
L/C of its tokens (queries, keys and values alike). Two strategies (`mesh.context_parallel`):

- `ring` (Liu et al. 2023, Ring Attention): each device keeps its queries; the K/V chunks (with
  their segment ids) travel around the ring with `ppermute`, C-1 hops. Each hop's partial output
  and log-sum-exp are merged with the online-softmax rule
  `lse = logaddexp(lse_a, lse_b)`, `o = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b`.
  The transfer for hop s+1 is issued before hop s is computed, so it can overlap. The backward is a
  ring too (`custom_vjp`): K/V travel again and their gradient accumulators travel with them, C
  hops, arriving home at the end. No device ever holds more than two K/V chunks.
- `allgather` (as Llama 3 did for its long-context stage): all-gather K/V (small next to Q under
  GQA), attend to all of them locally, and reduce-scatter dK/dV in the backward.

Causal load balance (`mesh.context_balance`): with plain contiguous chunks device C-1 does C
times the causal work of device 0. `zigzag` cuts the sequence into 2C chunks and gives device i
chunks i and 2C-1-i, so every device does the same work. The tokens are permuted once on the host
(`permute_tokens`, called by `Trainer.shard_batch`); positions travel with the tokens, so RoPE
needs no change, and the loss is a sum over tokens, so it does not notice the order. Causal masking
inside attention uses the layout's global chunk ids: a (query chunk, key chunk) pair is skipped
when the keys are all later, computed unmasked when they are all earlier, and with the causal mask
on the diagonal. A sliding window (query t sees keys s with t - s < window) compares global
positions the same way (`pair_kind`): a pair wholly outside the window is skipped (the ring still
carries its K/V on), one wholly inside runs unmasked, and one the window's edge crosses runs masked
with the queries' global offset against the keys' (`BlockKernel`'s `offset`).

The per-pair attention is a `BlockKernel` supplied by `lumen_jax.ops.attention.block_kernel` (the
Pallas flash kernel, cuDNN's through jax's private forward and backward, or the jnp reference, as
`ops.choice` chose): forward -> (o, lse), backward from
the merged (o, lse). `context_attention` is the entry point; it runs the schedule per device through
`parallel.shard.per_device`.
Shape letters: B batch, T local sequence, N query heads, K kv heads, H head dim, C context size.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lumen_jax.parallel import rules as rules_lib
from lumen_jax.parallel import shard

AXIS = "context"
SKIP, FULL, DIAGONAL, WINDOW = 0, 1, 2, 3  # how one query chunk attends to one key chunk


@dataclasses.dataclass(frozen=True)
class BlockKernel:
    """Attention of one query chunk to one key chunk, forward and backward (local, no collectives).

    fwd(q, k, v, q_seg, kv_seg, causal, window, offset) -> (o [B, T, N, H] float32, lse [B, N, T]
      float32); a row with no visible key has lse -inf (or a very negative finite value) and
      contributes nothing. `window`: a sliding window (0: none); `offset`: the queries' global
      position minus the keys' at index 0 (0, or a traced int32), for the causal mask and the window.
    bwd(q, k, v, q_seg, kv_seg, o, lse, do, dlse, causal, window, offset) -> (dq, dk, dv): this
      pair's share of the gradients given the *merged* output and log-sum-exp (FlashAttention-2's
      backward).
    lse_grad: False where `bwd` takes no log-sum-exp cotangent (cuDNN's): `context_attention` then
      returns the log-sum-exp with its gradient stopped, so `dlse` is zero.
    """

    fwd: Callable
    bwd: Callable
    lse_grad: bool = True


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which chunks of the sequence each context device holds."""

    size: int  # C: devices on the context axis
    balance: str = "zigzag"  # zigzag | contiguous

    @property
    def chunks_per_device(self) -> int:
        return 2 if self.balance == "zigzag" else 1

    def chunk_ids(self, device):
        """Global chunk index of each local chunk of `device` (an int, or a traced int)."""
        if self.balance == "zigzag":
            return (device, 2 * self.size - 1 - device)
        return (device,)

    def order(self, seq_len: int) -> np.ndarray:
        """Token permutation: position p of the permuted sequence holds original token order[p]."""
        n_chunks = self.size * self.chunks_per_device
        if seq_len % n_chunks:
            raise ValueError(f"seq_len={seq_len} must be a multiple of {n_chunks} chunks "
                             f"(context={self.size}, balance={self.balance})")
        chunk = seq_len // n_chunks
        ids = [c for d in range(self.size) for c in self.chunk_ids(d)]
        return np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in ids])


def permute_tokens(x: np.ndarray, layout: Layout, axis: int = 1) -> np.ndarray:
    """Reorder the sequence axis of a host array into `layout`'s order (identity when contiguous)."""
    if layout.balance == "contiguous" or layout.size == 1:
        return x
    return np.take(x, layout.order(x.shape[axis]), axis=axis)


def unpermute_tokens(x, layout: Layout, axis: int = 1):
    """Inverse of `permute_tokens` (numpy or jax arrays)."""
    if layout.balance == "contiguous" or layout.size == 1:
        return x
    return jnp.take(x, np.argsort(layout.order(x.shape[axis])), axis=axis)


def shift_tokens(x_bt: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """x [B, T] (a global array, the sequence over `context` in the active layout's order) at the token
    k later in the original order (the last k wrap around), and [B, T] whether that token lies in the
    row, both in the layout's order (`ops.sequence.shift_left`).

    Per device: each device gathers its rows' ids over `context` (int32 [B, T], cheap next to the
    activations), takes every token's k-th successor by a static index over the whole row and keeps
    its own chunk. So it holds inside the step's replica `vmap` too (several micro-batches, `context`
    a replica axis), where the array a step sees is one context device's chunk of every row: a
    gather over that chunk alone wrapped around inside the chunk."""
    mesh, rules = rules_lib.active()
    layout = Layout(mesh.shape[AXIS], rules.context_balance)

    def local(x):
        length = x.shape[1]
        t = length * layout.size
        order = np.arange(t) if layout.balance == "contiguous" else layout.order(t)
        source = np.argsort(order)[(order + k) % t]  # the held position of each token's k-th successor
        start = lax.axis_index(AXIS) * length  # this device's chunk of the held order
        mine = lax.dynamic_slice_in_dim(jnp.asarray(source, jnp.int32), start, length)
        in_row = lax.dynamic_slice_in_dim(jnp.asarray(order < t - k), start, length)
        whole = lax.all_gather(x, AXIS, axis=1, tiled=True)
        return jnp.take(whole, mine, axis=1), jnp.broadcast_to(in_row[None], x.shape)

    return shard.per_device(local, in_axes=(SEQ_AXES,), out_axes=(SEQ_AXES, SEQ_AXES))(x_bt)


def pair_kind(q_chunk, k_chunk, causal: bool, window: int = 0, chunk_len: int = 1):
    """How a (query chunk, key chunk) pair of global chunk ids (ints or traced) of `chunk_len` tokens
    each attends: SKIP (no query sees a key: the keys all later, or all beyond the sliding `window`),
    FULL (every query sees every key), DIAGONAL (the same chunk: masked, no offset) or WINDOW (the
    window's edge crosses the pair: masked with the queries' offset `(q_chunk - k_chunk) * chunk_len`)."""
    if not causal and not window:
        return FULL
    gap = (q_chunk - k_chunk) * chunk_len  # the queries' global offset against the keys'
    near, far = gap - (chunk_len - 1), gap + chunk_len - 1  # the pair's least and greatest distance
    none_seen, all_seen = False, True
    if causal:  # the diagonal pair stays masked, even of one-token chunks (`work_per_device` counts it half)
        none_seen, all_seen = far < 0, (near >= 0) & (gap != 0)
    if window:
        none_seen, all_seen = none_seen | (near >= window), all_seen & (far < window)
    return jnp.where(none_seen, SKIP, jnp.where(all_seen, FULL, jnp.where(gap == 0, DIAGONAL, WINDOW)))


def work_per_device(layout: Layout, causal: bool = True) -> list[float]:
    """Attention blocks each device computes (a diagonal block counts half: its upper half is
    skipped by the kernel). What the ring and all-gather schedules below execute."""
    weight = {SKIP: 0.0, FULL: 1.0, DIAGONAL: 0.5}
    return [sum(weight[int(pair_kind(q, k, causal))]
                for j in range(layout.size) for q in layout.chunk_ids(i) for k in layout.chunk_ids(j))
            for i in range(layout.size)]


# --------------------------------------------------------------------------------------------------
# The schedule: local shards in, local shards out (runs inside shard_map)
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Spec:
    layout: Layout
    strategy: str  # ring | allgather
    causal: bool
    kernel: BlockKernel
    window: int = 0  # a sliding window over global positions; 0: none


def _split(x, parts: int, axis: int):
    return (x,) if parts == 1 else tuple(jnp.split(x, parts, axis=axis))


def _join(xs, axis: int):
    return xs[0] if len(xs) == 1 else jnp.concatenate(xs, axis=axis)


def _merge(acc, part):
    """Online-softmax merge of two partial results (o float32 [B, T, N, H], lse [B, N, T])."""
    (o_a, lse_a), (o_b, lse_b) = acc, part
    lse = jnp.logaddexp(lse_a, lse_b)
    safe = jnp.where(jnp.isneginf(lse), 0.0, lse)  # rows no key has reached yet stay (0, -inf)
    w_a = jnp.exp(lse_a - safe).transpose(0, 2, 1)[..., None]
    w_b = jnp.exp(lse_b - safe).transpose(0, 2, 1)[..., None]
    return o_a * w_a + o_b * w_b, lse


def _segs(seg, parts):
    return (None,) * parts if seg is None else _split(seg, parts, 1)


def _attend(spec: _Spec, acc, q_ids, qs, q_segs, kv, kv_device):
    """Merge into `acc` the attention of every local query chunk to `kv` (device `kv_device`'s)."""
    k, v, kv_seg = kv
    p = spec.layout.chunks_per_device
    ks, vs, k_segs = _split(k, p, 1), _split(v, p, 1), _segs(kv_seg, p)
    k_ids = spec.layout.chunk_ids(kv_device)

    def skip(q, k, v, qs_, ks_, offset):
        b, t, n, _ = q.shape
        return jnp.zeros(q.shape, jnp.float32), jnp.full((b, n, t), -jnp.inf, jnp.float32)

    branches = (skip, *_masks(spec, spec.kernel.fwd, qs[0].shape[1]))
    acc = list(acc)
    for a in range(p):
        for b in range(p):
            args = (qs[a], ks[b], vs[b], q_segs[a], k_segs[b])
            acc[a] = _merge(acc[a], _pair(spec, branches, q_ids[a], k_ids[b], qs[0].shape[1], args))
    return acc


def _masks(spec: _Spec, fn: Callable, chunk_len: int) -> tuple[Callable, ...]:
    """The kernel `fn` (a BlockKernel's fwd or bwd) as the FULL, DIAGONAL and, with a window,
    WINDOW branches of `pair_kind`: each takes (*args, offset)."""
    # Inside the diagonal pair the distances stay below chunk_len: a window that long binds nowhere.
    diagonal_window = spec.window if spec.window < chunk_len else 0
    full = lambda *args: fn(*args[:-1], False, 0, 0)  # noqa: E731
    diagonal = lambda *args: fn(*args[:-1], spec.causal, diagonal_window, 0)  # noqa: E731
    edge = lambda *args: fn(*args[:-1], spec.causal, spec.window, args[-1])  # noqa: E731
    return (full, diagonal, edge) if spec.window else (full, diagonal)


def _pair(spec: _Spec, branches, q_id, k_id, chunk_len: int, args):
    """`branches` (SKIP first, then `_masks`) run on the pair of global chunk ids (q_id, k_id)."""
    if not spec.causal and not spec.window:
        return branches[FULL](*args, 0)
    offset = (q_id - k_id) * chunk_len
    return lax.switch(pair_kind(q_id, k_id, spec.causal, spec.window, chunk_len), branches, *args, offset)


def _attend_grads(spec: _Spec, dq, q_ids, res, kv, kv_device):
    """(dq, dk, dv) contributions of `kv` (device `kv_device`'s chunks) to every local query chunk."""
    qs, q_segs, os_, lses, dos, dlses = res
    k, v, kv_seg = kv
    p = spec.layout.chunks_per_device
    ks, vs, k_segs = _split(k, p, 1), _split(v, p, 1), _segs(kv_seg, p)
    k_ids = spec.layout.chunk_ids(kv_device)

    def skip(*args):
        q, k = args[0], args[1]
        return jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32)

    def grads(*args):
        return tuple(g.astype(jnp.float32) for g in spec.kernel.bwd(*args))

    branches = (skip, *_masks(spec, grads, qs[0].shape[1]))
    dq = list(dq)
    dks = [jnp.zeros(x.shape, jnp.float32) for x in ks]
    dvs = [jnp.zeros(x.shape, jnp.float32) for x in vs]
    for a in range(p):
        for b in range(p):
            args = (qs[a], ks[b], vs[b], q_segs[a], k_segs[b], os_[a], lses[a], dos[a], dlses[a])
            g = _pair(spec, branches, q_ids[a], k_ids[b], qs[0].shape[1], args)
            dq[a] = dq[a] + g[0]
            dks[b], dvs[b] = dks[b] + g[1], dvs[b] + g[2]
    return dq, _join(dks, 1), _join(dvs, 1)


def _shift(x, size: int):
    """Send to the next device on the context ring (device i receives device i-1's)."""
    return jax.tree.map(lambda a: lax.ppermute(a, AXIS, [(d, (d + 1) % size) for d in range(size)]), x)


def _gather(x):
    return None if x is None else lax.all_gather(x, AXIS, axis=1, tiled=True)


def _device_slice(x, device, length: int):
    return None if x is None else lax.dynamic_slice_in_dim(x, device * length, length, axis=1)


# _UNROLL: the ring's hops are unrolled (C copies of the hop, C is small) rather than a loop.
# With the ppermutes inside a nested while loop, XLA:CPU ran a device's hop permute concurrently
# with an FSDP all-gather outside the loop; with 8 emulated devices the blocked collectives used
# up the runtime's threads and the step aborted ("Expected 8 threads to join the rendezvous") in 2
# of 2 warm-cache runs of test_parallel's context=4,fsdp=2 case; unrolled, 0 of 7. Unrolled hops
# also give a GPU scheduler the whole ring to overlap transfers with compute.
def _forward(q, k, v, q_seg, kv_seg, spec: _Spec):
    c, p = spec.layout.size, spec.layout.chunks_per_device
    i = lax.axis_index(AXIS)
    q_ids = spec.layout.chunk_ids(i)
    qs, q_segs = _split(q, p, 1), _segs(q_seg, p)
    b, t, n, _ = qs[0].shape
    acc = [(jnp.zeros(x.shape, jnp.float32), jnp.full((b, n, t), -jnp.inf, jnp.float32)) for x in qs]
    attend = functools.partial(_attend, spec, q_ids=q_ids, qs=qs, q_segs=q_segs)

    if spec.strategy == "allgather":
        k_all, v_all, seg_all = _gather(k), _gather(v), _gather(kv_seg)
        length = k.shape[1]

        def step(acc, j):
            kv = tuple(_device_slice(x, j, length) for x in (k_all, v_all, seg_all))
            return attend(acc, kv=kv, kv_device=j), None

        acc, _ = lax.scan(step, acc, jnp.arange(c))
    else:
        kv = (k, v, kv_seg)
        for s in range(c):  # unrolled: see _UNROLL
            # The next hop's transfer is issued before this hop's compute, so it can overlap it;
            # the last hop sends nothing on.
            incoming = _shift(kv, c) if s < c - 1 else None
            acc = attend(acc, kv=kv, kv_device=(i - s) % c)
            kv = incoming
    o = _join([o for o, _ in acc], 1)
    lse = _join([lse for _, lse in acc], 2)
    return o.astype(q.dtype), lse


def _backward(q, k, v, q_seg, kv_seg, o, lse, do, dlse, spec: _Spec):
    c, p = spec.layout.size, spec.layout.chunks_per_device
    i = lax.axis_index(AXIS)
    q_ids = spec.layout.chunk_ids(i)
    res = (_split(q, p, 1), _segs(q_seg, p), _split(o, p, 1), _split(lse, p, 2), _split(do, p, 1),
           _split(dlse, p, 2))
    dq = [jnp.zeros(x.shape, jnp.float32) for x in res[0]]
    grads = functools.partial(_attend_grads, spec, q_ids=q_ids, res=res)

    if spec.strategy == "allgather":
        k_all, v_all, seg_all = _gather(k), _gather(v), _gather(kv_seg)
        length = k.shape[1]

        def step(carry, j):
            dq, dk_all, dv_all = carry
            kv = tuple(_device_slice(x, j, length) for x in (k_all, v_all, seg_all))
            dq, dk, dv = grads(dq, kv=kv, kv_device=j)
            dk_all = lax.dynamic_update_slice_in_dim(dk_all, dk, j * length, axis=1)
            dv_all = lax.dynamic_update_slice_in_dim(dv_all, dv, j * length, axis=1)
            return (dq, dk_all, dv_all), None

        zeros = jnp.zeros(k_all.shape, jnp.float32)
        (dq, dk_all, dv_all), _ = lax.scan(step, (dq, zeros, zeros), jnp.arange(c))
        dk = lax.psum_scatter(dk_all, AXIS, scatter_dimension=1, tiled=True)
        dv = lax.psum_scatter(dv_all, AXIS, scatter_dimension=1, tiled=True)
    else:
        kv = (k, v, kv_seg)
        dk, dv = jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
        for s in range(c):  # unrolled: see _UNROLL
            incoming = _shift(kv, c) if s < c - 1 else None  # next hop's K/V, issued before the compute
            dq, dk_s, dv_s = grads(dq, kv=kv, kv_device=(i - s) % c)
            # The accumulators travel with their K/V: after C shifts they are back at their owner.
            dk, dv = _shift((dk + dk_s, dv + dv_s), c)
            kv = incoming
    return _join(dq, 1).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _local(q, k, v, q_seg, kv_seg, spec: _Spec):
    return _forward(q, k, v, q_seg, kv_seg, spec)


def _local_fwd(q, k, v, q_seg, kv_seg, spec):
    o, lse = _forward(q, k, v, q_seg, kv_seg, spec)
    return (o, lse), (q, k, v, q_seg, kv_seg, o, lse)


def _local_bwd(spec, residuals, cotangents):
    q, k, v, q_seg, kv_seg, o, lse = residuals
    do, dlse = cotangents
    dq, dk, dv = _backward(q, k, v, q_seg, kv_seg, o, lse, do, dlse, spec)
    return dq, dk, dv, None, None


_local.defvjp(_local_fwd, _local_bwd)


Q_AXES = ("batch", "seq", "act_heads", None)
KV_AXES = ("batch", "seq", "act_kv_heads", None)
SEQ_AXES = ("batch", "seq")
LSE_AXES = ("batch", "act_heads", "seq")


def context_attention(q_btnh: jax.Array, k_bskh: jax.Array, v_bskh: jax.Array, *,
                      segment_ids_bt: jax.Array | None, causal: bool,
                      kernel: BlockKernel, window: int = 0) -> tuple[jax.Array, jax.Array]:
    """Attention over sequences sharded along the active mesh's `context` axis.

    Runs under `rules.activate` with `context` > 1 (`ops.Ops.context`); the strategy and the load
    balance are the rules' (`mesh.context_parallel`, `mesh.context_balance`), and the tokens are in
    that layout's order (`permute_tokens`, done by `Trainer.shard_batch`).

    Args:
      q_btnh, k_bskh, v_bskh: global arrays, sequence axis sharded over `context`; GQA as in
        `ops.reference.reference`.
      segment_ids_bt: [B, T] document ids (same order), or None.
      causal: causal masking by original token position.
      kernel: the local attention of one chunk pair (`ops.attention.block_kernel`).
      window: a sliding window over the original positions (query t sees keys s with
        t - s < window); 0: none.

    Returns:
      (out [B, T, N, H] in q's dtype, lse [B, N, T] float32), in the same token order.
    """
    mesh, rules = rules_lib.active()
    spec = _Spec(Layout(mesh.shape[AXIS], rules.context_balance), rules.context_parallel, bool(causal), kernel,
                 int(window))
    fn = lambda q, k, v, seg: _local(q, k, v, seg, seg, spec)  # noqa: E731
    out, lse = shard.per_device(fn, in_axes=(Q_AXES, KV_AXES, KV_AXES, SEQ_AXES),
                                out_axes=(Q_AXES, LSE_AXES))(q_btnh, k_bskh, v_bskh, segment_ids_bt)
    return out, lse if kernel.lse_grad else lax.stop_gradient(lse)
