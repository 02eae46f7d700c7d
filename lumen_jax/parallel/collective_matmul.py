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
  dot reads, not the dot's result, so the two can run at once; the first step's dot has no
  transfer under it and the last transfer none after it... (n - 1 transfers under n dots).
- `reduce_scatter_matmul(spec, x, w)`: step i computes the partial sum of one block of tokens
  (the block that arrives home after the remaining steps) and adds it to the accumulator received
  from the device before; the accumulator's transfer reads the previous step's sum, so it runs
  under this step's dot.

JAX's autodiff transposes the loop: the backward of the all-gather matmul is a reduce-scatter
matmul of the input gradient (ppermute in the other direction, each step under the dot of the
output gradient by the weight) with the weight gradient summed over the steps' blocks; the backward
of the reduce-scatter matmul is an all-gather matmul of the output gradient.

Only the axes of the sequence are manual (`tensor`, and `context` where it splits the sequence
outside the replica vmap): a partial-manual `shard_map` (`axis_names=`). The batch stays automatic
over `data`/`fsdp`/`expert`, and the weights arrive as GSPMD places them: under ZeRO-3 gathered
over `fsdp` before the `shard_map` (as the plain program gathers them before its einsum), their
gradients reduced over `fsdp` and `data` by the partitioner as without this option. Inside a
pipeline stage's `shard_map` (manual over `pipeline`, and `context` where it ticks per token run)
the sequence's remaining axes are made manual on the stage's abstract mesh.

Shape letters: B batch, T sequence (this device's block: Tl), D model, F a projection's features.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from lumen_jax.parallel import rules as rules_lib

AXIS = "tensor"
COLLECTIVE_MATMUL = "collective_matmul"


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


def _seq_axes(rules: rules_lib.Rules) -> tuple[str, ...]:
    """The mesh axes of the residual stream's sequence (`act_seq`), outermost first: (context,) tensor."""
    axes = rules.spec(("act_seq",))[0]
    return (axes,) if isinstance(axes, str) else tuple(axes or ())


def _run(local, args: Sequence[jax.Array], in_specs: Sequence[P], out_specs) -> jax.Array:
    """`local` per device, manual over the sequence's mesh axes only (module docstring)."""
    mesh, rules = rules_lib.active()
    inner = jax.sharding.get_abstract_mesh()
    if not inner.empty and inner.manual_axes:  # inside a pipeline stage's shard_map
        mesh = inner
    manual = set(_seq_axes(rules)) - set(getattr(mesh, "manual_axes", ()))
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


def all_gather_matmul(specs: Sequence[str], x_btd: jax.Array, ws: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
    """`tuple(jnp.einsum(spec, x, w) for spec, w in zip(specs, ws))` of a sequence-parallel `x`
    ([B, T, D], T split over the residual stream's axes `act_seq`) and column-parallel weights
    (output features split over `tensor`, e.g. [D, N, H] over N), the gather of x over `tensor`
    decomposed into ppermute steps under the partial matmuls (module docstring).

    Returns each einsum's value, its sequence split as `seq` (over `context` only) and its weight's
    split features over `tensor`.
    """
    _, rules = rules_lib.active()
    seq = _seq_axes(rules)
    outer = seq[:-1] or None  # `context` (or nothing): the sequence's split that stays
    seq_spec = seq if len(seq) > 1 else seq[0]
    letters = [_token_spec(s) for s in specs]

    def w_spec(ws_letters: str, out_letters: str, w: jax.Array) -> P:
        # the weight's axis split over `tensor`: its first letter kept in the output past the tokens
        split = next(c for c in ws_letters if c in out_letters[2:])
        return P(*(AXIS if c == split else None for c in ws_letters))

    def out_spec(ws_letters: str, out_letters: str) -> P:
        split = next(c for c in ws_letters if c in out_letters[2:])
        return P(None, outer[0] if outer else None, *(AXIS if c == split else None for c in out_letters[2:]))

    in_specs = [P(None, seq_spec, *([None] * (x_btd.ndim - 2)))]
    in_specs += [w_spec(wl, ol, w) for (_, wl, ol), w in zip(letters, ws)]
    out_specs = tuple(out_spec(wl, ol) for _, wl, ol in letters)

    def local(x, *ws_local):
        n = jax.lax.axis_size(AXIS)
        me = jax.lax.axis_index(AXIS)
        tl = x.shape[1]
        outs = [None] * len(ws_local)
        block = x
        for i in range(n):
            # pass the block on (device j gets j + 1's) before multiplying it: the transfer reads
            # the block, not the dot's result, and runs under the dot
            nxt = jax.lax.ppermute(block, AXIS, [(j, (j - 1) % n) for j in range(n)]) if i < n - 1 else None
            src = (me + i) % n  # whose tokens `block` holds at step i
            for k, (spec, w) in enumerate(zip(specs, ws_local)):
                y = jnp.einsum(spec, block, w)
                if outs[k] is None:
                    outs[k] = jnp.zeros((y.shape[0], tl * n, *y.shape[2:]), y.dtype)
                outs[k] = jax.lax.dynamic_update_slice_in_dim(outs[k], y, src * tl, axis=1)
            block = nxt
        return tuple(outs)

    return _run(local, (x_btd, *ws), in_specs, out_specs)


def reduce_scatter_matmul(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """`jnp.einsum(spec, x, w)` of a row-parallel projection: `x` [B, T, ...] with its contracted
    features split over `tensor` (e.g. [B, T, N, H] over N) and T as `seq`, `w` split over the same
    features ([N, H, D] over N); the result [B, T, D] split along T as the residual stream
    (`act_seq`), the reduce-scatter over `tensor` decomposed into ppermute steps under the partial
    matmuls (module docstring)."""
    _, rules = rules_lib.active()
    seq = _seq_axes(rules)
    outer = seq[:-1] or None
    seq_spec = seq if len(seq) > 1 else seq[0]
    xs, ws_letters, out = _token_spec(spec)
    split = next(c for c in ws_letters if c in xs[2:])  # the contracted feature axis split over `tensor`
    in_specs = (P(None, outer[0] if outer else None, *(AXIS if c == split else None for c in xs[2:])),
                P(*(AXIS if c == split else None for c in ws_letters)))
    out_specs = P(None, seq_spec, *([None] * (len(out) - 2)))

    def local(x_local, w_local):
        n = jax.lax.axis_size(AXIS)
        me = jax.lax.axis_index(AXIS)
        tl = x_local.shape[1] // n

        def partial(i):  # the partial sum of the block that reaches its home after n - 1 - i more hops
            blk = (me - i - 1) % n
            return jnp.einsum(spec, jax.lax.dynamic_slice_in_dim(x_local, blk * tl, tl, axis=1), w_local)

        acc = partial(0)
        for i in range(1, n):
            # the accumulator travels to the next device while this step's dot runs: its operand is
            # the previous step's sum, not this step's dot
            acc = jax.lax.ppermute(acc, AXIS, [(j, (j + 1) % n) for j in range(n)]) + partial(i)
        return acc

    return _run(local, (x, w), in_specs, out_specs)
