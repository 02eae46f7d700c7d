"""Collective matmuls: sequence parallelism's all-gather and reduce-scatter over `tensor` decomposed
into ppermute steps, each running under a partial matmul (`mesh.tensor_overlap=collective_matmul`).

Under Megatron sequence parallelism the residual stream is split along the sequence over `tensor`
(logical `act_seq`). A column-parallel projection (Q/K/V, gate/up: weight split over its output
features) needs every token, so GSPMD all-gathers its input first; a row-parallel one (O, down:
weight split over its input features) makes partial sums of every token, which GSPMD reduce-scatters
along the sequence. Both collectives sit on the critical path. Here they become n - 1 steps
(n = the `tensor` size; Wang et al. 2023, "Overlap communication with dependent computation via
decomposition"; the JAX shard_map documentation's collective matmul; torchtitan's async TP):

- `all_gather_matmul(specs, x, ws)`: each device holds a block of the tokens; step i multiplies the
  block it holds now by its weights (several weights of one input: Q, K and V, or gate and up,
  share the transfers) while `ppermute` passes that block on to the device before it. After n
  steps every device has multiplied every block. Each step's transfer reads the block the step's
  dots read, not their result, so they run side by side; the last step's dots have no transfer
  beside them (n - 1 transfers under n steps of dots).
- `reduce_scatter_matmul(spec, x, w)`: step i computes the partial sum of one block of tokens
  (the block that arrives home after the remaining steps) and adds it to the accumulator received
  from the device before; the accumulator's transfer reads the previous step's sum, so it runs
  under this step's dot (the first step's dot has no transfer beside it).

The backward is each one's mirror, written out (`custom_vjp`): the all-gather matmul's input
gradient is reduce-scattered in steps under the dots dy_k w_k^T while the input's blocks travel
again (each device keeps only its own, as the plain program does, and gathers it again for the
weight gradients); the reduce-scatter matmul's output gradient is all-gathered in steps under the
dots that give its input gradient. Each weight gradient is then one dot over all the tokens.
Autodiff through the loop gave one weight-gradient dot per step, and the partitioner reduced each
over `data` separately (n times the bytes).

Only the axes of the sequence are manual (`tensor`, and `context` where it splits the sequence
outside the replica vmap), and the replica vmap's axes where the step accumulates micro-batches: a
partial-manual `shard_map` (`axis_names=`). The batch stays automatic
over `data`/`fsdp`/`expert`, and the weights arrive as GSPMD places them: under ZeRO-3 gathered
over `fsdp` before the `shard_map` (as the plain program gathers them before its einsum), their
gradients reduced over `fsdp` and `data` by the partitioner as without this option. Inside a
pipeline stage's `shard_map` (manual over `pipeline`, and `context` where it ticks per token run)
the sequence's remaining axes are made manual on the stage's abstract mesh.

Shape letters: B batch, T sequence (this device's block: Tl), D model, F a projection's features.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from lumen_jax.parallel import rules as rules_lib

AXIS = "tensor"
COLLECTIVE_MATMUL = "collective_matmul"
# The outputs of a collective matmul carry this `checkpoint_name`: its custom VJP is opaque to the
# dot-based remat policies, which would recompute it (transfers and all) in the backward;
# `ops.projection.remat_policy` shows them each named output as a projection's dot.
REMAT_NAME = "collective_matmul"


def active() -> bool:
    """Whether the enclosing `rules.activate` runs the tensor-parallel projections as collective
    matmuls (`Rules.tensor_overlap`, with sequence parallelism over a `tensor` axis of more than one
    device); False outside `activate` (single-device code)."""
    got = rules_lib.active()
    if got is None:
        return False
    mesh, rules = got
    return (rules.tensor_overlap == COLLECTIVE_MATMUL and rules.sequence_parallel
            and dict(mesh.shape).get(AXIS, 1) > 1)


def _mesh():
    """(the mesh to run on: the active one, or a pipeline stage's abstract mesh inside its
    shard_map; the rules)."""
    mesh, rules = rules_lib.active()
    inner = jax.sharding.get_abstract_mesh()
    if not inner.empty and inner.manual_axes:  # inside a pipeline stage's shard_map
        mesh = inner
    return mesh, rules


def _seq_axes() -> tuple[str, ...]:
    """The mesh axes of the residual stream's sequence (`act_seq`) of more than one device,
    outermost first: (context,) tensor. An axis of one device is left automatic: manual, a weight
    unmentioned over it would have its gradient summed over it, an all-reduce over groups of one
    device that XLA:CPU fails on in bfloat16 (a check failure, "Invalid binary instruction opcode
    copy", jaxlib 0.10.2)."""
    mesh, rules = _mesh()
    axes = rules.spec(("act_seq",))[0]
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    return tuple(a for a in axes if dict(mesh.shape).get(a, 1) > 1)


def _run(local, args: Sequence[jax.Array], in_specs: Sequence[P], out_specs) -> jax.Array:
    """`local` per device, manual over the sequence's mesh axes only (module docstring)."""
    mesh, rules = _mesh()
    # the replica axes too: under the step's replica vmap (`spmd_axis_name`) the batching rule puts
    # them into the specs of the batched operands, which only manual axes may appear in. The
    # weights are not batched there; their gradients are per replica, summed once per step.
    manual = (set(_seq_axes()) | set(rules.replica_axes)) - set(getattr(mesh, "manual_axes", ()))
    return jax.shard_map(local, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs,
                         axis_names=manual, check_vma=False)(*args)


def _token_spec(spec: str) -> tuple[str, str, str]:
    """(x's letters, w's letters, out's letters) of `spec`, checking that x and the output start
    with the same two token axes (batch, sequence)."""
    ins, out = spec.replace(" ", "").split("->")
    xs, ws = ins.split(",")
    if len(xs) < 2 or xs[:2] != out[:2]:
        raise ValueError(f"collective matmul of {spec!r}: x and the output must begin with the token axes (b, t)")
    return xs, ws, out


def _left(n: int) -> list[tuple[int, int]]:
    return [(j, (j - 1) % n) for j in range(n)]  # device j receives j + 1's block


def _right(n: int) -> list[tuple[int, int]]:
    return [(j, (j + 1) % n) for j in range(n)]  # device j receives j - 1's accumulator


def _transpose_x(spec: str, w: jax.Array, x_shape: tuple[int, ...], dtype) -> Callable:
    """dy -> the cotangent of x in `einsum(spec, x, w)` (linear in x)."""
    return jax.linear_transpose(lambda x: jnp.einsum(spec, x, w), jax.ShapeDtypeStruct(x_shape, dtype))


def _weight_grad(spec: str, x: jax.Array, w: jax.Array, dy: jax.Array) -> jax.Array:
    """The cotangent of w in `einsum(spec, x, w)` at output cotangent dy: one dot over all of x's tokens
    (the partitioner then reduces it over the batch's axes once, as the plain einsum's)."""
    return jax.linear_transpose(lambda v: jnp.einsum(spec, x, v), jax.ShapeDtypeStruct(w.shape, w.dtype))(dy)[0]


def _gather(specs: tuple[str, ...], x: jax.Array, ws: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """Per device: the einsums of the blocks of x ([B, Tl, ...], one per `tensor` device) gathered
    in n steps, each block passed on while its dots run."""
    n, me, tl = jax.lax.axis_size(AXIS), jax.lax.axis_index(AXIS), x.shape[1]
    outs: list = [None] * len(ws)
    block = x
    for i in range(n):
        # pass the block on before multiplying it: the transfer reads the block, not a dot's
        # result, and the dots do not read the transfer's: they run side by side
        nxt = jax.lax.ppermute(block, AXIS, _left(n)) if i < n - 1 else None
        src = (me + i) % n  # whose tokens `block` holds at step i
        for k, (spec, w) in enumerate(zip(specs, ws)):
            y = jnp.einsum(spec, block, w)
            if outs[k] is None:
                outs[k] = jnp.zeros((y.shape[0], tl * n, *y.shape[2:]), y.dtype)
            outs[k] = jax.lax.dynamic_update_slice_in_dim(outs[k], y, src * tl, axis=1)
        block = nxt
    return tuple(outs)


def _scatter(parts: Callable, n: int) -> jax.Array:
    """Per device: sum over the `tensor` devices of `parts(blk)` (this device's partial sum for the
    tokens of block `blk`), each device ending with its own block's: n steps, the accumulator
    passed on under the next block's dots (its transfer reads the previous step's sum)."""
    me = jax.lax.axis_index(AXIS)
    acc = parts((me - 1) % n)
    for i in range(1, n):
        acc = jax.lax.ppermute(acc, AXIS, _right(n)) + parts((me - i - 1) % n)
    return acc


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _all_gather_matmul_local(specs: tuple[str, ...], x: jax.Array, ws: tuple[jax.Array, ...]) -> tuple:
    return _gather(specs, x, ws)


def _ag_fwd(specs, x, ws):
    return _gather(specs, x, ws), (x, ws)


def _ag_bwd(specs, res, dys):
    """The mirror: x's cotangent reduce-scattered in steps under the dots dy_k[block] w_k^T, while
    x's blocks travel the other way again (kept 1/n per device, as the plain program keeps the
    sequence-parallel input and gathers it again for the weight gradients); each weight's gradient
    is then one dot of the gathered x and dy_k."""
    x, ws = res
    n, me, tl = jax.lax.axis_size(AXIS), jax.lax.axis_index(AXIS), x.shape[1]
    transposes = [_transpose_x(spec, w, x.shape, x.dtype) for spec, w in zip(specs, ws)]

    def parts(blk):  # this device's share of block blk's input gradient
        return sum(t(jax.lax.dynamic_slice_in_dim(dy, blk * tl, tl, axis=1))[0] for t, dy in zip(transposes, dys))

    full = jnp.zeros((x.shape[0], tl * n, *x.shape[2:]), x.dtype)
    block, acc = x, None
    for i in range(n):
        # x's block on around the ring (its transfer reads the block) and the accumulator the other
        # way (its transfer reads the previous step's sum); this step's dots read neither transfer
        nxt = jax.lax.ppermute(block, AXIS, _left(n)) if i < n - 1 else None
        full = jax.lax.dynamic_update_slice_in_dim(full, block, ((me + i) % n) * tl, axis=1)
        part = parts((me - i - 1) % n)
        acc = part if acc is None else jax.lax.ppermute(acc, AXIS, _right(n)) + part
        block = nxt
    dws = tuple(_weight_grad(spec, full, w, dy) for spec, w, dy in zip(specs, ws, dys))
    return acc, dws


_all_gather_matmul_local.defvjp(_ag_fwd, _ag_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _reduce_scatter_matmul_local(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    n = jax.lax.axis_size(AXIS)
    tl = x.shape[1] // n
    return _scatter(lambda blk: jnp.einsum(spec, jax.lax.dynamic_slice_in_dim(x, blk * tl, tl, axis=1), w), n)


def _rs_fwd(spec, x, w):
    return _reduce_scatter_matmul_local(spec, x, w), (x, w)


def _rs_bwd(spec, res, dy):
    """The mirror: dy's blocks gathered in steps, each under its dot dy[block] w^T (x's cotangent
    for those tokens); w's gradient one dot of x and the gathered dy."""
    x, w = res
    n = jax.lax.axis_size(AXIS)
    tl = dy.shape[1]
    # x = einsum^T: the gather of dy with, per block, the transpose in x (einsum(spec_t, dy, w))
    tx = _transpose_x(spec, w, (x.shape[0], tl, *x.shape[2:]), x.dtype)
    me = jax.lax.axis_index(AXIS)
    dx = jnp.zeros_like(x)
    dy_full = jnp.zeros((dy.shape[0], tl * n, *dy.shape[2:]), dy.dtype)
    block = dy
    for i in range(n):
        nxt = jax.lax.ppermute(block, AXIS, _left(n)) if i < n - 1 else None
        src = (me + i) % n
        dx = jax.lax.dynamic_update_slice_in_dim(dx, tx(block)[0], src * tl, axis=1)
        dy_full = jax.lax.dynamic_update_slice_in_dim(dy_full, block, src * tl, axis=1)
        block = nxt
    return dx, _weight_grad(spec, x, w, dy_full)


_reduce_scatter_matmul_local.defvjp(_rs_fwd, _rs_bwd)


def all_gather_matmul(specs: Sequence[str], x_btd: jax.Array, ws: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
    """`tuple(jnp.einsum(spec, x, w) for spec, w in zip(specs, ws))` of a sequence-parallel `x`
    ([B, T, D], T split over the residual stream's axes `act_seq`) and column-parallel weights
    (output features split over `tensor`, e.g. [D, N, H] over N), the gather of x over `tensor`
    decomposed into ppermute steps under the partial matmuls (module docstring).

    Returns each einsum's value, its sequence split as `seq` (over `context` only) and its weight's
    split features over `tensor`.
    """
    seq = _seq_axes()
    outer = seq[0] if len(seq) > 1 else None  # `context` (or nothing): the sequence's split that stays
    letters = [_token_spec(s) for s in specs]

    def split(ws_letters: str, out_letters: str) -> str:  # the weight's axis split over `tensor`
        return next(c for c in ws_letters if c in out_letters[2:])

    in_specs = [P(None, seq if len(seq) > 1 else seq[0], *([None] * (x_btd.ndim - 2)))]
    in_specs += [P(*(AXIS if c == split(wl, ol) else None for c in wl)) for _, wl, ol in letters]
    out_specs = tuple(P(None, outer, *(AXIS if c == split(wl, ol) else None for c in ol[2:])) for _, wl, ol in letters)
    def local(x, *w):
        return tuple(checkpoint_name(y, REMAT_NAME) for y in _all_gather_matmul_local(tuple(specs), x, w))
    return _run(local, (x_btd, *ws), in_specs, out_specs)


def reduce_scatter_matmul(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """`jnp.einsum(spec, x, w)` of a row-parallel projection: `x` [B, T, ...] with its contracted
    features split over `tensor` (e.g. [B, T, N, H] over N) and T as `seq`, `w` split over the same
    features ([N, H, D] over N); the result [B, T, D] split along T as the residual stream
    (`act_seq`), the reduce-scatter over `tensor` decomposed into ppermute steps under the partial
    matmuls (module docstring)."""
    seq = _seq_axes()
    outer = seq[0] if len(seq) > 1 else None
    xs, ws_letters, out = _token_spec(spec)
    split = next(c for c in ws_letters if c in xs[2:])  # the contracted feature axis split over `tensor`
    in_specs = (P(None, outer, *(AXIS if c == split else None for c in xs[2:])),
                P(*(AXIS if c == split else None for c in ws_letters)))
    out_specs = P(None, seq if len(seq) > 1 else seq[0], *([None] * (len(out) - 2)))
    return _run(lambda x, w: checkpoint_name(_reduce_scatter_matmul_local(spec, x, w), REMAT_NAME), (x, w),
                in_specs, out_specs)
