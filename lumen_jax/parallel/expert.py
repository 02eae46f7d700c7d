"""Expert parallelism: every token to its experts' devices over the `expert` mesh axis and back.

`dispatch` runs per device (`shard.per_device`): each device holds a slice of the tokens (the batch
is split over `data`, `fsdp` and `expert`, the sequence over `context`) and `num_experts / E` of
the experts (E = the `expert` axis; each expert's hidden width split over `tensor`). Per device:

1. The token-expert assignments [n*k] are sorted by expert, stably, so within an expert the
   earliest tokens of this device's slice (its *dispatch group*) come first. With a capacity C an
   expert keeps the first C assignments of the group and drops the rest (they add nothing: the
   token passes through the residual). Dropless: C = n*k, nothing is dropped.
2. The rows go to the device of their expert. `padded` (any backend; XLA:CPU has no ragged
   collective) sends each token once to every device holding one of its kept experts, with its
   local experts and router weights there, in fixed-size [E, n, ...] buffers (`all_to_all`; a
   token goes to at most E devices, so n slots per device hold the worst case, not n*k);
   `ragged` (GPU) sends one row per kept assignment with `jax.lax.ragged_all_to_all`, after an
   all-gather of the row counts.
3. The receiving device runs the SwiGLU experts on what it got, grouped by its local expert
   (the `experts` function `ops.moe` passes: `ops.grouped`'s row blocks on CPU, `jax.lax.ragged_dot`
   on GPU). `padded` adds each token's
   outputs there with the router weights (float32) and sends the sums back (compute dtype); `ragged` sends the
   rows back the same way. With one `expert` device nothing moves: each assignment reads its
   token's row.
4. Each token adds its experts' outputs (the devices' sums) with the router weights (float32);
   under `tensor` the partial sums of the row-split down projections are summed over `tensor`.

Both exchanges give the same result up to the order of the sums; dropless results do not depend
on the mesh, capacity drops do (C is counted per device's slice).
Shape letters: B batch, T sequence, D d_model, F expert ffn dim (local), K top-k, X experts (local),
N = B*T tokens, A = N*K assignments, R rows received.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from lumen_jax.parallel import shard

EXCHANGES = ("padded", "ragged")
_TOKENS = ("batch", "seq", "act_embed")
_CHOICES = ("batch", "seq", None)
_W_IN = ("experts", "embed", "mlp")
_W_OUT = ("experts", "mlp", "embed")
DEVICE = ("devices",)  # a split backward's recorded rows: one block per device ([devices, ...])
# What a device's experts compute on the rows it received (`ops.moe` passes the grouped SwiGLU):
# (rows [R, D], each row's assignment [R], its local expert [R] (X: none), the local weights
# (w_gate, w_up [X, D, F], w_down [X, F, D]), A (the rows the dispatch group expects), this device's
# taps or None) -> the experts' outputs [R, D].
LocalExperts = Callable[[jax.Array, jax.Array, jax.Array, tuple, int, Any], jax.Array]


def capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float | None) -> int:
    """Assignments one expert keeps out of a dispatch group of `tokens` tokens (None: all of them)."""
    if capacity_factor is None:
        return tokens * top_k
    return max(1, math.ceil(capacity_factor * tokens * top_k / num_experts))


def _kept(ids_a: jax.Array, num_experts: int, cap: int) -> jax.Array:
    """Which assignments [A] their expert keeps: the first `cap` of each expert, in token order."""
    if cap >= ids_a.shape[0]:  # dropless
        return jnp.ones(ids_a.shape, bool)
    return _sort_by_expert(ids_a, num_experts, cap)[1]


def _sort_by_expert(ids_a: jax.Array, num_experts: int, cap: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(order [A]: kept assignments grouped by expert in token order, dropped ones last; kept [A];
    kept rows per expert [E])."""
    a = ids_a.shape[0]
    first = jnp.argsort(ids_a, stable=True)
    counts = jnp.zeros((num_experts,), jnp.int32).at[ids_a].add(1)
    starts = jnp.cumsum(counts) - counts
    rank = jnp.arange(a, dtype=jnp.int32) - starts[ids_a[first]]  # place within its expert, by token order
    kept = jnp.zeros((a,), bool).at[first].set(rank < cap)
    order = jnp.argsort(jnp.where(kept, ids_a, num_experts), stable=True)
    return order, kept, jnp.minimum(counts, cap)


def _padded(x_nd: jax.Array, key_nk: jax.Array, gate_nk: jax.Array, ep: int, x_local: int,
            experts: Callable[[jax.Array, jax.Array, jax.Array], jax.Array]) -> jax.Array:
    """Each token once to every device holding one of its kept experts, with its experts there and
    their router weights, through fixed-size `all_to_all` buffers [E, n, ...]; the receiving device
    runs its experts and adds their outputs with the weights, and the sums come back the same way.
    Returns the tokens' combined outputs [n, D] (float32)."""
    n, d = x_nd.shape
    devices = jnp.arange(ep, dtype=jnp.int32)
    present = (key_nk[:, :, None] // x_local == devices).any(1)  # [n, E]: a kept expert of token n on e
    slot = jnp.where(present, jnp.cumsum(present, axis=0) - 1, n)  # its place in the buffer for e (n: none)
    dest = jnp.broadcast_to(devices, (n, ep))
    src = jnp.full((ep, n), n, jnp.int32).at[dest, slot].set(
        jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[:, None], (n, ep)), mode="drop")  # [E, slot] -> token
    tok = jnp.minimum(src, n - 1)
    key = key_nk[tok]  # [E, slot, K]
    here = (key // x_local == devices[:, None, None]) & (src < n)[..., None]
    send_e = jnp.where(here, key - devices[:, None, None] * x_local, x_local)
    send_w = jnp.where(here, gate_nk[tok], 0.0)
    send = x_nd.at[src].get(mode="fill", fill_value=0)  # [E, slot, D]
    # Rows, experts (exact in float32) and weights in one exchange, so its transpose is one too:
    # XLA:CPU runs independent collectives concurrently, and emulated devices that run them in
    # different orders abort the rendezvous (docs/PLATFORM.md). float32 costs nothing there
    # (XLA:CPU runs bf16 collectives in float32); GPUs take the ragged exchange.
    k = key_nk.shape[1]
    packed = jnp.concatenate([send.astype(jnp.float32), send_e.astype(jnp.float32), send_w], -1)
    packed = jax.lax.all_to_all(packed, "expert", 0, 0)
    recv = packed[..., :d].astype(x_nd.dtype)
    recv_e, recv_w = packed[..., d:d + k].astype(jnp.int32), packed[..., d + k:]
    y_a = experts(recv.reshape(ep * n, d), jnp.arange(ep * n * k, dtype=jnp.int32) // k, recv_e.reshape(-1))
    partial = jnp.einsum("rk,rkd->rd", recv_w.reshape(ep * n, k), y_a.reshape(ep * n, k, d).astype(jnp.float32))
    back = jax.lax.all_to_all(partial.astype(x_nd.dtype).reshape(ep, n, d), "expert", 0, 0)
    return back.at[dest, slot].get(mode="fill", fill_value=0).astype(jnp.float32).sum(1)


def _ragged(rows_ad: jax.Array, key_a: jax.Array, dev_counts: jax.Array, ep: int, x_local: int, slots: int,
            experts: Callable[[jax.Array, jax.Array, jax.Array], jax.Array]) -> jax.Array:
    """Rows (sorted, grouped by device) -> experts -> back, sending only the rows
    (`jax.lax.ragged_all_to_all`; not on XLA:CPU): one row per kept assignment."""
    a, d = rows_ad.shape
    me = jax.lax.axis_index("expert")
    dev_starts = jnp.cumsum(dev_counts) - dev_counts
    counts = jax.lax.all_gather(dev_counts, "expert")  # [source, destination]
    starts = jax.lax.all_gather(dev_starts, "expert")
    recv_sizes = counts[:, me]
    at_receiver = (jnp.cumsum(counts, axis=0) - counts)[me]  # where my rows start in each receiver's buffer
    recv_starts = jnp.cumsum(recv_sizes) - recv_sizes
    local_e = key_a - jnp.minimum(key_a // x_local, ep - 1) * x_local
    exchange = lambda x, out: jax.lax.ragged_all_to_all(  # noqa: E731
        x, out, dev_starts, dev_counts, at_receiver, recv_sizes, axis_name="expert")
    recv = exchange(rows_ad, jnp.zeros((ep * slots, d), rows_ad.dtype))
    recv_e = exchange(local_e, jnp.full((ep * slots,), x_local, jnp.int32))
    out = experts(recv, jnp.arange(recv.shape[0], dtype=jnp.int32), recv_e)
    return jax.lax.ragged_all_to_all(out, jnp.zeros((a, d), out.dtype), recv_starts, recv_sizes,
                                     starts[:, me], dev_counts, axis_name="expert")


def dispatch(x_btd: jax.Array, ids_btk: jax.Array, weights_btk: jax.Array, w_gate_xdf: jax.Array,
             w_up_xdf: jax.Array, w_down_xfd: jax.Array, *, capacity_factor: float | None, experts: LocalExperts,
             exchange: str = "padded", taps: Any = None) -> tuple[jax.Array, jax.Array]:
    """The routed experts' combined output for each token (see the module docstring).

    Args:
      x_btd: the (normed) tokens [B, T, D] in the compute dtype.
      ids_btk: each token's experts [B, T, K] (int32, global expert ids, distinct per token).
      weights_btk: their router weights [B, T, K] (float32).
      w_gate_xdf, w_up_xdf, w_down_xfd: the experts' SwiGLU weights [E, D, F], [E, D, F], [E, F, D].
      capacity_factor: None (dropless) or the factor of `capacity`.
      experts: what each device's experts compute on its rows (`LocalExperts`; `ops.moe`'s grouped SwiGLU).
      exchange: padded | ragged (how rows cross the `expert` axis).
      taps: a split backward's taps of the layer, one block per device ([devices, ...] leaves, or
        None): each device's block reaches `experts` (the grouped matmuls record their rows there).

    Returns:
      (y [B, T, D] in x's dtype, kept [B, T, K]: which assignments an expert took).
    """
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange={exchange!r}; expected one of {EXCHANGES}")
    num_experts = w_gate_xdf.shape[0]

    def local(x_btd, ids_btk, weights_btk, w_gate, w_up, w_down, taps):
        b, t, d = x_btd.shape
        k = ids_btk.shape[-1]
        ep, tp = shard.mesh_axis_size("expert"), shard.mesh_axis_size("tensor")
        x_local, n, a = w_gate.shape[0], b * t, b * t * k
        cap = capacity(n, k, num_experts, capacity_factor)
        ids_a = ids_btk.reshape(-1).astype(jnp.int32)
        x_nd = x_btd.reshape(n, d)
        weights = (w_gate, w_up, w_down)

        tap = None if taps is None else jax.tree.map(lambda t: t[0], taps)  # this device's block
        experts_here = lambda rows, row_a, group_a: experts(rows, row_a, group_a, weights, a, tap)  # noqa: E731

        if ep > 1 and exchange == "padded":
            kept_a = _kept(ids_a, num_experts, cap)
            key = jnp.where(kept_a, ids_a, num_experts).reshape(n, k)
            gate = (weights_btk.reshape(n, k) * kept_a.reshape(n, k)).astype(jnp.float32)
            y_nd = _padded(x_nd, key, gate, ep, x_local, experts_here)
        else:
            if ep == 1:  # no exchange: each assignment's row is its token's
                kept_a = _kept(ids_a, num_experts, cap)
                y_a = experts_here(x_nd, jnp.arange(a, dtype=jnp.int32) // k, jnp.where(kept_a, ids_a, num_experts))
            else:
                order, kept_a, kept_counts = _sort_by_expert(ids_a, num_experts, cap)
                key = jnp.where(kept_a, ids_a, num_experts)[order]
                slots = min(a, x_local * cap)  # the most rows one device can be sent by one other
                y_sorted = _ragged(x_nd[order // k], key, kept_counts.reshape(ep, x_local).sum(1), ep, x_local,
                                   slots, experts_here)
                y_a = jnp.zeros_like(y_sorted).at[order].set(y_sorted)
            gate = (weights_btk.reshape(n, k) * kept_a.reshape(n, k)).astype(jnp.float32)
            y_nd = jnp.einsum("nk,nkd->nd", gate, y_a.reshape(n, k, d).astype(jnp.float32))
        if tp > 1:
            y_nd = jax.lax.psum(y_nd, "tensor")
        return y_nd.reshape(b, t, d).astype(x_btd.dtype), kept_a.reshape(b, t, k)

    return shard.per_device(local, in_axes=(_TOKENS, _CHOICES, _CHOICES, _W_IN, _W_IN, _W_OUT, DEVICE),
                            out_axes=(_TOKENS, _CHOICES))(x_btd, ids_btk, weights_btk, w_gate_xdf, w_up_xdf,
                                                           w_down_xfd, taps)


def replay(weights: tuple[jax.Array, ...], recorded: dict,
           local_replay: Callable[[tuple, dict], tuple]) -> tuple[jax.Array, ...]:
    """`local_replay` (`ops.grouped.replay`) on each device's recorded rows ({name: [devices, ...]},
    `dispatch`'s taps' cotangents): a split backward's weight unit differentiates it with respect to
    the experts' weights (w_gate, w_up [E, D, F], w_down [E, F, D]), whose gradients, like the whole
    backward's, are summed over the devices that hold the same experts."""
    def local(w_gate, w_up, w_down, recorded):
        out = local_replay((w_gate, w_up, w_down), jax.tree.map(lambda a: a[0], recorded))
        return tuple(o[None] for o in out)
    return shard.per_device(local, in_axes=(_W_IN, _W_IN, _W_OUT, DEVICE), out_axes=(DEVICE,) * 3)(
        *weights, recorded)
