"""The experts' SwiGLU over rows grouped by expert: `swiglu(x, row_a, group_a, weights, form)`.

Each assignment a (a token-expert pair) names its row of `x` and its (local) expert; the result is
that expert's SwiGLU of that row, per assignment. Two forms, chosen once at build (`Ops.moe_matmul`):

- `blocks` (XLA:CPU): the assignments are laid out expert by expert in blocks of `block` rows, each
  block one expert's (its rows padded with zeros), and a `while` loop runs only the blocks in use,
  each three [block, D] x [D, F] matmuls with that expert's weights. Work and memory follow the
  rows that arrive, not the worst case the static shapes must hold (dropless, every row of an
  expert group could land on one device), and no [rows, experts, D] array exists: XLA:CPU lowers
  `jax.lax.ragged_dot` as a dense matmul against every group (a [groups, rows, D] mask), that many
  times the FLOPs.
- `ragged` (GPU): the rows sorted by expert and `jax.lax.ragged_dot` (a grouped GEMM).

Both are `custom_vjp` (the loop's trip count is data-dependent; the backward runs the same blocks)
and batch under `jax.vmap` by a loop over the vmapped axis (`jax.custom_batching.sequential_vmap`):
`ragged_dot` has no batching rule off axis 0 on jax 0.10.2. The train step's replica `vmap` puts
one replica per device (its axis is sharded over the replica mesh axes), so the loop runs once and
each replica's weight gradients stay its own until the step reduces them once.

A split backward (zero_bubble's B and W units, `ops.projection.Taps`) passes `tap`: zero arrays
whose cotangents, from the backward, are what the weight gradients need (`TAP_INPUTS`: the rows,
the SwiGLU outputs that w_down reads and the row layout, as exact floats; `TAP_COTANGENTS`: the
three matmuls' output cotangents). That backward gives the rows' gradient alone; `replay(weights,
recorded)`'s vjp at the recorded cotangents gives the weight gradients later, the same sums in the
same order as the whole backward (bit for bit).

Shape letters: A assignments, R rows of x, P = blocks x block padded rows, J blocks, X local experts,
D d_model, F the expert's (local) hidden width.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

FORMS = ("blocks", "ragged")


def block_rows(assignments: int, experts: int) -> int:
    """Rows per block: a power of two near the mean rows per expert, in [8, 128] (padding each expert
    to whole blocks costs at most experts x (block - 1) rows; small blocks cost loop iterations)."""
    mean = max(1, assignments // max(1, experts))
    return int(min(128, max(8, 1 << (mean.bit_length() - 1))))


class Blocks(NamedTuple):
    """Where each assignment sits in the block layout."""

    slot_a: jax.Array  # [A] its padded row (P: not laid out, a padding assignment)
    src_p: jax.Array  # [P] the assignment in each padded row (A: none)
    group_j: jax.Array  # [J] each block's expert
    used: jax.Array  # [] blocks that hold rows (the rest are never computed)


def plan_blocks(group_a: jax.Array, experts: int, block: int) -> Blocks:
    """The block layout of assignments whose expert is `group_a` ([A] int32; `experts`: padding)."""
    a = group_a.shape[0]
    j = _blocks_of(a, experts, block)
    sizes = jnp.zeros((experts,), jnp.int32).at[group_a].add(1, mode="drop")
    nblocks = (sizes + block - 1) // block
    block_end = jnp.cumsum(nblocks)
    order = jnp.argsort(group_a, stable=True)
    g_sorted = group_a[order]
    g_c = jnp.minimum(g_sorted, experts - 1)
    rank = jnp.arange(a, dtype=jnp.int32) - (jnp.cumsum(sizes) - sizes)[g_c]
    slot_sorted = jnp.where(g_sorted < experts, (block_end - nblocks)[g_c] * block + rank, j * block)
    slot_a = jnp.zeros((a,), jnp.int32).at[order].set(slot_sorted)
    src_p = jnp.full((j * block,), a, jnp.int32).at[slot_a].set(jnp.arange(a, dtype=jnp.int32), mode="drop")
    group_j = jnp.minimum(jnp.searchsorted(block_end, jnp.arange(j, dtype=jnp.int32), side="right"), experts - 1)
    return Blocks(slot_a, src_p, group_j.astype(jnp.int32), block_end[-1])


def _silu_parts(gate: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(silu(gate), its derivative), in float32."""
    g = gate.astype(jnp.float32)
    s = jax.nn.sigmoid(g)
    return g * s, s * (1 + g * (1 - s))


def _swiglu_bwd_parts(gate, up, dh):
    """(d gate, d up) from d(silu(gate) * up), in the compute dtype."""
    silu, dsilu = _silu_parts(gate)
    dh = dh.astype(jnp.float32)
    return (dh * up.astype(jnp.float32) * dsilu).astype(gate.dtype), (dh * silu).astype(up.dtype)


# --- blocks -------------------------------------------------------------------------------------


def _block(x, j, size):
    return jax.lax.dynamic_slice_in_dim(x, j * size, size)


def _expert(w, e):
    return jax.lax.dynamic_index_in_dim(w, e, keepdims=False)


@jax.custom_batching.sequential_vmap
def _blocks_fwd(x_pd, group_j, used, w_gate, w_up, w_down):
    b = x_pd.shape[0] // group_j.shape[0]
    f, d = w_down.shape[1:]

    def body(j, carry):
        y, g_all, u_all = carry
        e, xb = group_j[j], _block(x_pd, j, b)
        gate, up = xb @ _expert(w_gate, e), xb @ _expert(w_up, e)
        h = (_silu_parts(gate)[0] * up.astype(jnp.float32)).astype(x_pd.dtype)
        y = jax.lax.dynamic_update_slice_in_dim(y, h @ _expert(w_down, e), j * b, 0)
        g_all = jax.lax.dynamic_update_slice_in_dim(g_all, gate, j * b, 0)
        u_all = jax.lax.dynamic_update_slice_in_dim(u_all, up, j * b, 0)
        return y, g_all, u_all

    p = x_pd.shape[0]
    init = (jnp.zeros((p, d), x_pd.dtype), jnp.zeros((p, f), x_pd.dtype), jnp.zeros((p, f), x_pd.dtype))
    return jax.lax.fori_loop(0, used, body, init)


def _block_dx(j, x_pd, group_j, w_gate, w_up, w_down, gate_pf, up_pf, dy_pd):
    """Block j's backward to its rows: (expert, rows, dy rows, SwiGLU output h, d gate, d up, d rows)."""
    b = x_pd.shape[0] // group_j.shape[0]
    e, xb, dyb = group_j[j], _block(x_pd, j, b), _block(dy_pd, j, b)
    gate, up = _block(gate_pf, j, b), _block(up_pf, j, b)
    h = (_silu_parts(gate)[0] * up.astype(jnp.float32)).astype(x_pd.dtype)
    dgate, dup = _swiglu_bwd_parts(gate, up, dyb @ _expert(w_down, e).T)
    return e, xb, dyb, h, dgate, dup, dgate @ _expert(w_gate, e).T + dup @ _expert(w_up, e).T


def _block_dw(acc, e, xb, h, dgate, dup, dyb):
    """The weight gradients' float32 sums `acc` plus one block's (its expert e)."""
    def add(total, value):
        return jax.lax.dynamic_update_index_in_dim(total, _expert(total, e) + value, e, 0)
    f32 = functools.partial(jnp.matmul, preferred_element_type=jnp.float32)
    dwg, dwu, dwd = acc
    return add(dwg, f32(xb.T, dgate)), add(dwu, f32(xb.T, dup)), add(dwd, f32(h.T, dyb))


def _dw_zeros(*weights):
    return tuple(jnp.zeros(w.shape, jnp.float32) for w in weights)


def _dw_cast(dw, weights):
    return tuple(d.astype(w.dtype) for d, w in zip(dw, weights))


@jax.custom_batching.sequential_vmap
def _blocks_bwd(x_pd, group_j, used, w_gate, w_up, w_down, gate_pf, up_pf, dy_pd):
    b = x_pd.shape[0] // group_j.shape[0]

    def body(j, carry):
        dx, dw = carry
        e, xb, dyb, h, dgate, dup, dxb = _block_dx(j, x_pd, group_j, w_gate, w_up, w_down, gate_pf, up_pf, dy_pd)
        return jax.lax.dynamic_update_slice_in_dim(dx, dxb, j * b, 0), _block_dw(dw, e, xb, h, dgate, dup, dyb)

    weights = (w_gate, w_up, w_down)
    dx, dw = jax.lax.fori_loop(0, used, body, (jnp.zeros_like(x_pd), _dw_zeros(*weights)))
    return dx, *_dw_cast(dw, weights)


@jax.custom_batching.sequential_vmap
def _blocks_bwd_rows(x_pd, group_j, used, w_gate, w_up, w_down, gate_pf, up_pf, dy_pd):
    """A split backward's B: (d rows, h, d gate, d up), each [P, ...]; no weight gradient."""
    b = x_pd.shape[0] // group_j.shape[0]

    def body(j, carry):
        _, _, _, h, dgate, dup, dxb = _block_dx(j, x_pd, group_j, w_gate, w_up, w_down, gate_pf, up_pf, dy_pd)
        return tuple(jax.lax.dynamic_update_slice_in_dim(acc, v, j * b, 0)
                     for acc, v in zip(carry, (dxb, h, dgate, dup)))

    return jax.lax.fori_loop(0, used, body, (jnp.zeros_like(x_pd), *(jnp.zeros_like(gate_pf),) * 3))


@jax.custom_batching.sequential_vmap
def _blocks_dw(x_pd, h_pd, group_j, used, w_gate, w_up, w_down, dgate_pf, dup_pf, dy_pd):
    """A split backward's W: the weight gradients of the blocks B recorded."""
    b = x_pd.shape[0] // group_j.shape[0]

    def body(j, dw):
        blk = lambda a: _block(a, j, b)  # noqa: E731
        return _block_dw(dw, group_j[j], blk(x_pd), blk(h_pd), blk(dgate_pf), blk(dup_pf), blk(dy_pd))

    weights = (w_gate, w_up, w_down)
    return _dw_cast(jax.lax.fori_loop(0, used, body, _dw_zeros(*weights)), weights)


@jax.custom_vjp
def _blocks_mlp(x_pd, group_j, used, w_gate, w_up, w_down):
    return _blocks_fwd(x_pd, group_j, used, w_gate, w_up, w_down)[0]


def _blocks_mlp_fwd(x_pd, group_j, used, w_gate, w_up, w_down):
    y, gate, up = _blocks_fwd(x_pd, group_j, used, w_gate, w_up, w_down)
    return y, (x_pd, group_j, used, w_gate, w_up, w_down, gate, up)


def _blocks_mlp_bwd(res, dy_pd):
    x_pd, group_j, used, w_gate, w_up, w_down, gate, up = res
    dx, dwg, dwu, dwd = _blocks_bwd(x_pd, group_j, used, w_gate, w_up, w_down, gate, up, dy_pd)
    return dx, None, None, dwg, dwu, dwd


_blocks_mlp.defvjp(_blocks_mlp_fwd, _blocks_mlp_bwd)


@jax.custom_vjp
def _blocks_mlp_tapped(x_pd, group_j, used, w_gate, w_up, w_down, tap):
    return _blocks_fwd(x_pd, group_j, used, w_gate, w_up, w_down)[0]


def _blocks_mlp_tapped_fwd(x_pd, group_j, used, w_gate, w_up, w_down, tap):
    return _blocks_mlp_fwd(x_pd, group_j, used, w_gate, w_up, w_down)


def _blocks_mlp_tapped_bwd(res, dy_pd):
    x_pd, group_j, used, w_gate, w_up, w_down, gate, up = res
    dx, h, dgate, dup = _blocks_bwd_rows(x_pd, group_j, used, w_gate, w_up, w_down, gate, up, dy_pd)
    plan = jnp.concatenate([group_j, used[..., None]], -1).astype(jnp.float32)  # exact below 2**24
    return dx, None, None, None, None, None, _recorded(x_pd, h, plan, dgate, dup, dy_pd)


_blocks_mlp_tapped.defvjp(_blocks_mlp_tapped_fwd, _blocks_mlp_tapped_bwd)


@jax.custom_batching.sequential_vmap
def _blocks_linear(x_pd, h_pd, group_j, used, w_gate, w_up, w_down):
    """The three matmuls of the recorded rows: (x w_gate, x w_up, h w_down) block by block."""
    b = x_pd.shape[0] // group_j.shape[0]

    def body(j, carry):
        e, blk = group_j[j], lambda a: _block(a, j, b)  # noqa: E731
        values = (blk(x_pd) @ _expert(w_gate, e), blk(x_pd) @ _expert(w_up, e), blk(h_pd) @ _expert(w_down, e))
        return tuple(jax.lax.dynamic_update_slice_in_dim(acc, v, j * b, 0) for acc, v in zip(carry, values))

    init = (jnp.zeros_like(h_pd), jnp.zeros_like(h_pd), jnp.zeros_like(x_pd))
    return jax.lax.fori_loop(0, used, body, init)


def _blocks_plan(plan):
    """`_blocks_mlp_tapped`'s recorded layout -> (group_j, used)."""
    ints = plan.astype(jnp.int32)
    return ints[..., :-1], ints[..., -1]


@jax.custom_vjp
def _blocks_replay(w_gate, w_up, w_down, x_pd, h_pd, plan):
    return _blocks_linear(x_pd, h_pd, *_blocks_plan(plan), w_gate, w_up, w_down)


def _blocks_replay_fwd(w_gate, w_up, w_down, x_pd, h_pd, plan):
    return _blocks_replay(w_gate, w_up, w_down, x_pd, h_pd, plan), (w_gate, w_up, w_down, x_pd, h_pd, plan)


def _blocks_replay_bwd(res, cts):
    w_gate, w_up, w_down, x_pd, h_pd, plan = res
    dwg, dwu, dwd = _blocks_dw(x_pd, h_pd, *_blocks_plan(plan), w_gate, w_up, w_down, *cts)
    return dwg, dwu, dwd, None, None, None


_blocks_replay.defvjp(_blocks_replay_fwd, _blocks_replay_bwd)


# --- ragged -------------------------------------------------------------------------------------

_CONTRACT_ROWS = jax.lax.RaggedDotDimensionNumbers(  # [R, D] x [R, F] -> [X, D, F], summed per group
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


@jax.custom_batching.sequential_vmap
def _ragged_fwd(x_rd, sizes, w_gate, w_up, w_down):
    gate = jax.lax.ragged_dot(x_rd, w_gate, sizes)
    up = jax.lax.ragged_dot(x_rd, w_up, sizes)
    h = (_silu_parts(gate)[0] * up.astype(jnp.float32)).astype(x_rd.dtype)
    return jax.lax.ragged_dot(h, w_down, sizes), gate, up


def _ragged_dx(x_rd, sizes, w_gate, w_up, w_down, gate, up, dy_rd):
    """(d rows, h, d gate, d up)."""
    t = lambda w: jnp.swapaxes(w, 1, 2)  # noqa: E731
    dgate, dup = _swiglu_bwd_parts(gate, up, jax.lax.ragged_dot(dy_rd, t(w_down), sizes))
    dx = jax.lax.ragged_dot(dgate, t(w_gate), sizes) + jax.lax.ragged_dot(dup, t(w_up), sizes)
    h = (_silu_parts(gate)[0] * up.astype(jnp.float32)).astype(x_rd.dtype)
    return dx, h, dgate, dup


def _ragged_dw(x_rd, h, sizes, w_gate, w_up, w_down, dgate, dup, dy_rd):
    dw = lambda lhs, rhs, w: jax.lax.ragged_dot_general(  # noqa: E731
        lhs, rhs, sizes, _CONTRACT_ROWS, preferred_element_type=jnp.float32).astype(w.dtype)
    return dw(x_rd, dgate, w_gate), dw(x_rd, dup, w_up), dw(h, dy_rd, w_down)


@jax.custom_batching.sequential_vmap
def _ragged_bwd(x_rd, sizes, w_gate, w_up, w_down, gate, up, dy_rd):
    dx, h, dgate, dup = _ragged_dx(x_rd, sizes, w_gate, w_up, w_down, gate, up, dy_rd)
    return dx, *_ragged_dw(x_rd, h, sizes, w_gate, w_up, w_down, dgate, dup, dy_rd)


_ragged_bwd_rows = jax.custom_batching.sequential_vmap(_ragged_dx)
_ragged_dw_rows = jax.custom_batching.sequential_vmap(_ragged_dw)


@jax.custom_vjp
def _ragged_mlp(x_rd, sizes, w_gate, w_up, w_down):
    return _ragged_fwd(x_rd, sizes, w_gate, w_up, w_down)[0]


def _ragged_mlp_fwd(x_rd, sizes, w_gate, w_up, w_down):
    y, gate, up = _ragged_fwd(x_rd, sizes, w_gate, w_up, w_down)
    return y, (x_rd, sizes, w_gate, w_up, w_down, gate, up)


def _ragged_mlp_bwd(res, dy_rd):
    x_rd, sizes, w_gate, w_up, w_down, gate, up = res
    dx, dwg, dwu, dwd = _ragged_bwd(x_rd, sizes, w_gate, w_up, w_down, gate, up, dy_rd)
    return dx, None, dwg, dwu, dwd


_ragged_mlp.defvjp(_ragged_mlp_fwd, _ragged_mlp_bwd)


@jax.custom_vjp
def _ragged_mlp_tapped(x_rd, sizes, w_gate, w_up, w_down, tap):
    return _ragged_fwd(x_rd, sizes, w_gate, w_up, w_down)[0]


def _ragged_mlp_tapped_fwd(x_rd, sizes, w_gate, w_up, w_down, tap):
    return _ragged_mlp_fwd(x_rd, sizes, w_gate, w_up, w_down)


def _ragged_mlp_tapped_bwd(res, dy_rd):
    x_rd, sizes, w_gate, w_up, w_down, gate, up = res
    dx, h, dgate, dup = _ragged_bwd_rows(x_rd, sizes, w_gate, w_up, w_down, gate, up, dy_rd)
    return dx, None, None, None, None, _recorded(x_rd, h, sizes.astype(jnp.float32), dgate, dup, dy_rd)


_ragged_mlp_tapped.defvjp(_ragged_mlp_tapped_fwd, _ragged_mlp_tapped_bwd)


@jax.custom_batching.sequential_vmap
def _ragged_linear(x_rd, h_rd, sizes, w_gate, w_up, w_down):
    return (jax.lax.ragged_dot(x_rd, w_gate, sizes), jax.lax.ragged_dot(x_rd, w_up, sizes),
            jax.lax.ragged_dot(h_rd, w_down, sizes))


@jax.custom_vjp
def _ragged_replay(w_gate, w_up, w_down, x_rd, h_rd, plan):
    return _ragged_linear(x_rd, h_rd, plan.astype(jnp.int32), w_gate, w_up, w_down)


def _ragged_replay_fwd(w_gate, w_up, w_down, x_rd, h_rd, plan):
    return _ragged_replay(w_gate, w_up, w_down, x_rd, h_rd, plan), (w_gate, w_up, w_down, x_rd, h_rd, plan)


def _ragged_replay_bwd(res, cts):
    w_gate, w_up, w_down, x_rd, h_rd, plan = res
    dwg, dwu, dwd = _ragged_dw_rows(x_rd, h_rd, plan.astype(jnp.int32), w_gate, w_up, w_down, *cts)
    return dwg, dwu, dwd, None, None, None


_ragged_replay.defvjp(_ragged_replay_fwd, _ragged_replay_bwd)


# --- a split backward ---------------------------------------------------------------------------

TAP_INPUTS = ("x", "h", "plan")  # what the weight unit reads: the rows, w_down's input, the layout
TAP_COTANGENTS = ("dgate", "dup", "dy")  # the three matmuls' output cotangents, in `replay`'s order


def _recorded(x, h, plan, dgate, dup, dy) -> dict:
    return dict(zip(TAP_INPUTS + TAP_COTANGENTS, (x, h, plan, dgate, dup, dy)))


def _blocks_of(assignments: int, experts: int, block: int) -> int:
    """J, the blocks the layout has room for: sum_e ceil(n_e / block) <= A / block + X."""
    return -(-assignments // block) + experts


def tap_shapes(x_rd: jax.ShapeDtypeStruct, assignments: int, weights: tuple[jax.Array, ...], form: str = "blocks",
               expected_rows: int | None = None) -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes of `swiglu`'s `tap` for these arguments: the recorded rows [P, D] and [P, F] (P:
    the padded rows of the blocks, or A) and the layout (blocks: [J + 1], ragged: the sizes [X])."""
    experts, f = weights[0].shape[0], weights[0].shape[2]
    d, dt = x_rd.shape[1], x_rd.dtype
    if form == "blocks":
        block = block_rows(expected_rows or assignments, experts)
        j = _blocks_of(assignments, experts, block)
        rows, plan = j * block, j + 1
    else:
        rows, plan = assignments, experts
    sds = jax.ShapeDtypeStruct
    return _recorded(sds((rows, d), dt), sds((rows, f), dt), sds((plan,), jnp.float32), sds((rows, f), dt),
                     sds((rows, f), dt), sds((rows, d), dt))


def replay(weights: tuple[jax.Array, ...], recorded: dict, form: str = "blocks") -> tuple[jax.Array, ...]:
    """The three matmuls of the rows a split backward recorded (`swiglu(..., tap=)`'s cotangents):
    (x w_gate, x w_up, h w_down), linear in `weights` (compute dtype). Their vjp at the recorded
    cotangents (`TAP_COTANGENTS`) is the weight gradients, the whole backward's to the bit."""
    args = (*(w.astype(recorded["x"].dtype) for w in weights), *(recorded[k] for k in TAP_INPUTS))
    return (_blocks_replay if form == "blocks" else _ragged_replay)(*args)


def swiglu(x_rd: jax.Array, row_a: jax.Array, group_a: jax.Array, weights: tuple[jax.Array, ...],
           form: str = "blocks", expected_rows: int | None = None, tap: dict | None = None) -> jax.Array:
    """Each assignment's expert SwiGLU of its row (see the module docstring).

    Args:
      x_rd: the rows [R, D] in the compute dtype.
      row_a: each assignment's row of `x_rd` [A] (int32).
      group_a: each assignment's local expert [A] (int32); X (the experts held here) marks an
        assignment to skip, whose result is 0.
      weights: (w_gate [X, D, F], w_up [X, D, F], w_down [X, F, D]), cast to x's dtype here.
      form: blocks | ragged.
      expected_rows: the assignments expected to arrive (sets the block size; default A).
      tap: a split backward's zeros of `tap_shapes`: the backward gives no weight gradient, and
        the tap's cotangent is what `replay` needs for it; None: the whole backward.

    Returns:
      y [A, D] in x's dtype.
    """
    if form not in FORMS:
        raise ValueError(f"form={form!r}; expected one of {FORMS}")
    w_gate, w_up, w_down = (w.astype(x_rd.dtype) for w in weights)
    experts, a = w_gate.shape[0], group_a.shape[0]
    if form == "ragged":
        order = jnp.argsort(group_a, stable=True)
        sizes = jnp.zeros((experts,), jnp.int32).at[group_a].add(1, mode="drop")
        args = (x_rd[row_a[order]], sizes, w_gate, w_up, w_down)
        y = _ragged_mlp(*args) if tap is None else _ragged_mlp_tapped(*args, tap)
        return jnp.zeros_like(y).at[order].set(y)
    plan = plan_blocks(group_a, experts, block_rows(expected_rows or a, experts))
    src_row = jnp.where(plan.src_p < a, row_a[jnp.minimum(plan.src_p, a - 1)], x_rd.shape[0])
    x_pd = x_rd.at[src_row].get(mode="fill", fill_value=0)
    args = (x_pd, plan.group_j, plan.used, w_gate, w_up, w_down)
    y_pd = _blocks_mlp(*args) if tap is None else _blocks_mlp_tapped(*args, tap)
    return y_pd.at[plan.slot_a].get(mode="fill", fill_value=0)
