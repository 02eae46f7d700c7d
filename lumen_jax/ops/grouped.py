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
    j = -(-a // block) + experts  # sum_e ceil(n_e / block) <= A / block + X
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


@jax.custom_batching.sequential_vmap
def _blocks_bwd(x_pd, group_j, used, w_gate, w_up, w_down, gate_pf, up_pf, dy_pd):
    b = x_pd.shape[0] // group_j.shape[0]

    def add(acc, e, value):
        return jax.lax.dynamic_update_index_in_dim(acc, _expert(acc, e) + value, e, 0)

    def body(j, carry):
        dx, dwg, dwu, dwd = carry
        e, xb, dyb = group_j[j], _block(x_pd, j, b), _block(dy_pd, j, b)
        gate, up = _block(gate_pf, j, b), _block(up_pf, j, b)
        h = (_silu_parts(gate)[0] * up.astype(jnp.float32)).astype(x_pd.dtype)
        dgate, dup = _swiglu_bwd_parts(gate, up, dyb @ _expert(w_down, e).T)
        dxb = dgate @ _expert(w_gate, e).T + dup @ _expert(w_up, e).T
        dx = jax.lax.dynamic_update_slice_in_dim(dx, dxb, j * b, 0)
        f32 = functools.partial(jnp.matmul, preferred_element_type=jnp.float32)
        return (dx, add(dwg, e, f32(xb.T, dgate)), add(dwu, e, f32(xb.T, dup)), add(dwd, e, f32(h.T, dyb)))

    zeros = lambda w: jnp.zeros(w.shape, jnp.float32)  # noqa: E731
    init = (jnp.zeros_like(x_pd), zeros(w_gate), zeros(w_up), zeros(w_down))
    dx, dwg, dwu, dwd = jax.lax.fori_loop(0, used, body, init)
    return dx, dwg.astype(w_gate.dtype), dwu.astype(w_up.dtype), dwd.astype(w_down.dtype)


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


# --- ragged -------------------------------------------------------------------------------------

_CONTRACT_ROWS = jax.lax.RaggedDotDimensionNumbers(  # [R, D] x [R, F] -> [X, D, F], summed per group
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


@jax.custom_batching.sequential_vmap
def _ragged_fwd(x_rd, sizes, w_gate, w_up, w_down):
    gate = jax.lax.ragged_dot(x_rd, w_gate, sizes)
    up = jax.lax.ragged_dot(x_rd, w_up, sizes)
    h = (_silu_parts(gate)[0] * up.astype(jnp.float32)).astype(x_rd.dtype)
    return jax.lax.ragged_dot(h, w_down, sizes), gate, up


@jax.custom_batching.sequential_vmap
def _ragged_bwd(x_rd, sizes, w_gate, w_up, w_down, gate, up, dy_rd):
    t = lambda w: jnp.swapaxes(w, 1, 2)  # noqa: E731
    dgate, dup = _swiglu_bwd_parts(gate, up, jax.lax.ragged_dot(dy_rd, t(w_down), sizes))
    dx = jax.lax.ragged_dot(dgate, t(w_gate), sizes) + jax.lax.ragged_dot(dup, t(w_up), sizes)
    h = (_silu_parts(gate)[0] * up.astype(jnp.float32)).astype(x_rd.dtype)
    dw = lambda lhs, rhs, w: jax.lax.ragged_dot_general(  # noqa: E731
        lhs, rhs, sizes, _CONTRACT_ROWS, preferred_element_type=jnp.float32).astype(w.dtype)
    return dx, dw(x_rd, dgate, w_gate), dw(x_rd, dup, w_up), dw(h, dy_rd, w_down)


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


def swiglu(x_rd: jax.Array, row_a: jax.Array, group_a: jax.Array, weights: tuple[jax.Array, ...],
           form: str = "blocks", expected_rows: int | None = None) -> jax.Array:
    """Each assignment's expert SwiGLU of its row (see the module docstring).

    Args:
      x_rd: the rows [R, D] in the compute dtype.
      row_a: each assignment's row of `x_rd` [A] (int32).
      group_a: each assignment's local expert [A] (int32); X (the experts held here) marks an
        assignment to skip, whose result is 0.
      weights: (w_gate [X, D, F], w_up [X, D, F], w_down [X, F, D]), cast to x's dtype here.
      form: blocks | ragged.
      expected_rows: the assignments expected to arrive (sets the block size; default A).

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
        y = _ragged_mlp(x_rd[row_a[order]], sizes, w_gate, w_up, w_down)
        return jnp.zeros_like(y).at[order].set(y)
    plan = plan_blocks(group_a, experts, block_rows(expected_rows or a, experts))
    src_row = jnp.where(plan.src_p < a, row_a[jnp.minimum(plan.src_p, a - 1)], x_rd.shape[0])
    x_pd = x_rd.at[src_row].get(mode="fill", fill_value=0)
    y_pd = _blocks_mlp(x_pd, plan.group_j, plan.used, w_gate, w_up, w_down)
    return y_pd.at[plan.slot_a].get(mode="fill", fill_value=0)
