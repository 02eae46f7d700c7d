"""The pipelined loss and gradients: one `shard_map` over the `pipeline` axis runs a lock-step program.

Each of the P devices along `pipeline` holds a stage: its slice of the stacked blocks (the
`layers` axis of every block parameter is sharded over `pipeline`, `rules.py`), and, replicated,
the embedding, final norm and output projection. Every device runs the same program (SPMD): the
ticks of `schedule.lockstep(...)`, grouped in segments whose ticks run the same kinds of work on
every stage, so there is no conditional and no stage computes a branch it drops:

- forward (every tick of a segment with forwards): the stage's chunk on one micro-batch, from the
  activation that arrived in the previous tick (the embedded tokens on virtual stage 0, chosen by
  a select). Its `jax.vjp` residuals, as the model's remat policy saves them, go to a stash slot;
  the activation moves one stage on (`ppermute`).
  The embedding lookup (the table gathered once, before the first tick) is outside the stage's
  vjp; virtual stage 0's backward scatter-adds its input cotangent into the table's gradient, a
  float32 sum per group of devices the micro-batch's rows are split over (`embedding_grad`), so no
  row leaves its device in a tick; the groups' sums are reduced once, after the last tick.
- head (segments with the last virtual stage's output): the final norm, logits and loss of that
  output, split over the P stages by tokens (each computes every P-th token: the logits' work is
  done once, not on every stage); its cotangent goes to the last stage's stash slot.
- backward: the stashed residuals' vjp with the cotangent that arrived (the loss's on the last
  stage), giving the chunk's gradients (summed locally over micro-batches) and the input's
  cotangent, which moves one stage back. The forward is not recomputed: residuals that depend only
  on the weights (their compute-dtype casts) are not stashed but taken again from the weights.
- weight (zero_bubble, `Lockstep.split`): the backward above is B, the input gradient; the layers'
  plain projections run tapped (`StageFns.taps`, `ops.projection.Taps`), so B's vjp also returns
  each projection's input and output cotangent instead of its weight gradient (an MoE layer's
  routed experts: each device's dispatched rows and cotangents, `Tape.grouped`). They wait in the W
  stash until the weight unit, one einsum per projection (the replay's vjp; the experts' grouped
  matmuls' weight gradients), in the tick stage 0 runs the same micro-batch's B: the drain's ticks
  run B alone, one unit instead of two.

Uneven stages (`mesh.pipeline_layers`) keep the stacks padded in memory (`Pipeline.pad`): each
virtual stage holds max(pipeline_layers) layer slots, the ones past its own layers all zeros, which
is exactly the identity; they are computed like the others (in lock step a tick lasts as long as
the dearest stage, so a shorter stage would wait that long anyway: the padding costs FLOPs, not time).

A stage with nothing to do in the fill or the drain computes on zeros and adds zeros: that work is
the bubble (`Lockstep.bubble`, the schedule's formula). Gradients of the replicated parameters are
summed over `pipeline` once at the end. With replica groups (`data`, `context`, and `fsdp` under
`fsdp_grad_reduce=once`: `communication.gradient_plan`) the ticks run once per group under a
`vmap`, so the data-parallel reduction also happens once, after the last tick. Under sequence
parallelism XLA's SPMD partitioner stops on that vmap (docs/PLATFORM.md): there `data` and
`context` are manual in the `shard_map` instead (`manual`), each device ticking on its own rows and
its run of their tokens, and its sums are reduced over them once, after the last tick, the
gradients in `mesh.reduce_dtype`. The other mesh
axes stay automatic inside the `shard_map`. The loss equals one big batch: every micro-batch's
objective is divided by the token count of the whole batch.

The model enters as functions (`units.StageFns`, from `train/step.py`): this package never imports model/.
The units of a tick (forward, head, backward, weight) and a device's carry are in `units.py`.
Shape letters: M micro-batches, B rows per micro-batch, T sequence, D d_model, S stash slots.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from lumen_jax.parallel import rules as rules_lib
from lumen_jax.parallel.micro_batches import split_micro_batches, total_tokens
from lumen_jax.parallel.pipeline.layout import AXIS, Pipeline
from lumen_jax.parallel.pipeline.units import Carry, Device, StageFns, add_to, row_groups

CONTEXT, DATA = "context", "data"


def loss_and_grads(pipe: Pipeline, fns: StageFns, params: dict, batch: dict, scale: jax.Array,
                   cast: Callable[[dict], dict] = lambda w: w, replicas: int = 1,
                   replica_axes: tuple[str, ...] = (),
                   model_state: dict | None = None, replica_seq: int = 1,
                   reduce_dtype: str = "float32") -> tuple[jax.Array, dict, dict, dict]:
    """(mean token cross-entropy of `batch`, float32 gradients of the scaled objective, the model
    state's next value, the model's aux metrics averaged over layers and micro-batches), pipelined.

    `cast`: the parameters -> the weights the model computes with (`step.compute_weights`), applied
    to a stage's float32 slice where it is used; or the identity, when `params` are those weights
    already (cast and gathered once for the step: `mesh.fsdp_regather=per_step`). The gradient
    sums are float32 either way.
    `replicas`, `replica_axes`, `replica_seq`: the replica groups of the communication plan
    (`step.Placement`; `replica_seq` of them split each row's tokens: `context`). With R > 1 the
    ticks run under `jax.vmap` over R (`spmd_axis_name=replica_axes`): each group
    keeps its own stash and gradient sums and the R sums are added once, after the last tick.
    `model_state`: non-parameter model state (ops/state.py), stacked along `layers` like the blocks
    it belongs to and cut into the same stages; each micro-batch's next value is the backward's
    "gradient" of it, merged by `fns.combine_state` (micro-batches) and `fns.fold_state` (replicas).
    The model's auxiliary loss (a chunk's sum over its layers) enters the objective divided by
    the micro-batches times the replica groups, as in the unpipelined step.
    """
    prog, r = pipe.program, replicas
    tokens = total_tokens(batch)
    mbs = split_micro_batches(batch, prog.micro_batches, r, replica_seq)
    model_state = model_state or {}
    stacks = {k: params[k] for k in pipe.stacks}
    others = {k: val for k, val in params.items() if k not in pipe.stacks}
    head_keys = set(fns.mtp_keys) & set(others) if fns.mtp is not None else set()  # what runs with the head
    if set(model_state) - set(pipe.stacks) - head_keys:  # no such model: fp8's and MoE's state live in the layers
        raise ValueError(f"model state outside the layer stacks {sorted(set(model_state) - set(pipe.stacks))} "
                         "does not run in pipeline stages")
    # The data and context devices' partial gradients stay apart until the end: as replica groups
    # (the vmap), or, where the ticks cannot run under the replica vmap (sequence parallelism), with
    # `data` and `context` manual in the stages' shard_map, each device ticking on its own rows and
    # its own run of their tokens.
    manual = tuple(a for a in (DATA, CONTEXT) if pipe.mesh.shape[a] > 1 and a not in replica_axes)
    size = lambda axis: pipe.mesh.shape[axis] if axis in manual else 1  # noqa: E731
    b = batch["inputs"].shape[0] // (prog.micro_batches * r // replica_seq) // size(DATA)
    t = batch["inputs"].shape[1] // (replica_seq * size(CONTEXT))
    fns = fns if head_keys else dataclasses.replace(fns, mtp=None)
    stage = functools.partial(_stage, pipe, fns, cast, r, replica_axes, manual, reduce_dtype, (b, t))
    stage_spec = lambda tree: jax.tree.map(lambda _: P(AXIS), tree)  # noqa: E731
    same_spec = lambda tree: jax.tree.map(lambda _: P(), tree)  # noqa: E731
    # the stacks' model state cut into stages; the head's (multi-token prediction's) on every stage
    state_spec = {k: (stage_spec if k in pipe.stacks else same_spec)(v) for k, v in model_state.items()}
    # [M, (R,) B, T]: the rows over `data` and the tokens over `context` where they are manual
    named = lambda axis: axis if axis in manual else None  # noqa: E731
    mb_spec = jax.tree.map(lambda _: P(*([None] * (2 if r > 1 else 1)), named(DATA), named(CONTEXT)), mbs)
    # manual axes: each device's gradient sums [1, ...] out, stacked over them, reduced below
    by_device = lambda spec: P(manual, *spec) if manual else spec  # noqa: E731
    run = jax.shard_map(stage, mesh=pipe.mesh,
                        in_specs=(stage_spec(stacks), same_spec(others), state_spec, mb_spec, P(), P()),
                        out_specs=(P(), jax.tree.map(lambda _: by_device(P(AXIS)), stacks),
                                   jax.tree.map(lambda _: by_device(P()), others), state_spec, P()),
                        axis_names={AXIS, *manual}, check_vma=False)
    # The stacks are held device-major (`Pipeline.pad`), as the stages read them: nothing moves here.
    ce, d_stacked, d_other, state_new, metrics = run(stacks, others, model_state, mbs, tokens,
                                                     jnp.asarray(scale, jnp.float32))
    if manual:  # the step's one reduction over them, in reduce_dtype (float32 sums whatever it is)
        add = lambda a: jax.lax.reduce(a, jnp.zeros((), a.dtype), jax.lax.add, (0,)).astype(jnp.float32)  # noqa: E731
        d_stacked, d_other = jax.tree.map(add, (d_stacked, d_other))
    return ce / tokens, {**d_other, **d_stacked}, state_new, metrics


def _stage(pipe: Pipeline, fns: StageFns, cast: Callable[[dict], dict], r: int, replica_axes: tuple[str, ...],
           manual: tuple[str, ...], reduce_dtype: str, rows_tokens: tuple[int, int], stacked: dict, other: dict,
           state: dict, mbs: dict, tokens: jax.Array, scale: jax.Array) -> tuple[jax.Array, dict, dict, dict, dict]:
    """What each device along `pipeline` runs inside the `shard_map` (`loss_and_grads`), with its
    stage's slice of the stacks and of the model state: the lock-step program's ticks, then its sums
    reduced (`_reduced`). `rows_tokens`: (B, T) of a micro-batch on this device; `manual`: the
    replica axes manual here (`data`, `context`; the model's `batch` and `seq` then map to the other
    axes: each device holds its own rows and its run of their tokens), whose sums are reduced once,
    after the last tick; the gradient sums come out [1, ...] in `reduce_dtype`, unreduced over them."""
    if not manual:
        return _ticks(pipe, fns, cast, r, replica_axes, rows_tokens, stacked, other, state, mbs, tokens, scale)
    mesh, rules = rules_lib.active()
    devices = math.prod(pipe.mesh.shape[a] for a in manual)
    with rules_lib.activate(mesh, dataclasses.replace(rules, replica_axes=(*rules.replica_axes, *manual))):
        ce, d_stacked, d_other, state_new, metrics = _ticks(pipe, fns, cast, r, replica_axes, rows_tokens, stacked,
                                                            other, state, mbs, tokens, scale, runs=devices)
    # The gradient sums leave as they are, in reduce_dtype, for the step's one reduction over the
    # manual axes (`loss_and_grads`: a psum of bfloat16 here aborts XLA:CPU, docs/PLATFORM.md); the
    # scalars are summed here and the model state's next values folded.
    d_stacked, d_other = jax.tree.map(lambda a: a.astype(reduce_dtype)[None], (d_stacked, d_other))
    ce, metrics = jax.lax.psum((ce, metrics), manual)
    metrics = jax.tree.map(lambda a: a / devices, metrics)
    return ce, d_stacked, d_other, _fold_over(fns, state_new, manual), metrics


def _fold_over(fns: StageFns, state: dict, axis: str | tuple[str, ...]) -> dict:
    """The model state's next values of the devices along `axis` (or axes), merged by their rules."""
    if not state:
        return state
    return fns.fold_state(jax.lax.all_gather(state, axis))


def _ticks(pipe: Pipeline, fns: StageFns, cast: Callable[[dict], dict], r: int, replica_axes: tuple[str, ...],
           rows_tokens: tuple[int, int], stacked: dict, other: dict, state: dict,
           mbs: dict, tokens: jax.Array, scale: jax.Array, runs: int = 1) -> tuple[jax.Array, dict, dict, dict, dict]:
    """`_stage`'s ticks and their sums, reduced over the replica groups and `pipeline`. `runs`: the
    devices a micro-batch is cut into outside the model's view (manual `data` and `context`: rows,
    tokens), each computing the auxiliary loss of its own share: like replica groups, a share of it each."""
    groups = row_groups(*rows_tokens)
    prog = pipe.program
    dt = jnp.dtype(pipe.compute_dtype)
    by_chunk = lambda tree: jax.tree.map(lambda a: a.reshape(prog.virtual, -1, *a.shape[1:]), tree)  # noqa: E731
    chunk0 = jax.tree.map(lambda a: a[0], by_chunk(stacked))
    # gathered once, for every tick (chunk 0 only completes the tree `cast` reads)
    table, table_vjp = jax.vjp(lambda o: fns.table(cast({**o, **jax.lax.stop_gradient(chunk0)})), other)
    dev = Device(pipe=pipe, fns=fns, cast=cast, s=jax.lax.axis_index(AXIS), stacked=by_chunk(stacked),
                  other=other, state=by_chunk({k: v for k, v in state.items() if k in pipe.stacks}),
                  head_state={k: v for k, v in state.items() if k not in pipe.stacks}, mtp=fns.mtp is not None,
                  tokens=tokens, scale=scale,
                  aux_share=1.0 / (prog.micro_batches * r * runs), table=table, groups=groups)
    zeros_act = jnp.zeros((*rows_tokens, pipe.d_model), dt)
    zero_mb = jax.tree.map(jnp.zeros_like, jax.tree.map(lambda a: a[0, 0] if r > 1 else a[0], mbs))
    dev, carry = dev.start(chunk0, zeros_act, zero_mb, r, replica_axes)
    # Every device runs the token count's all-reduce (over the batch axes) before the first tick:
    # the first activation received is zeros times it (XLA keeps a float product with 0, which
    # is not 0 for inf or NaN). Else an emulated CPU device could run the fill's collectives
    # while another runs the all-reduce, and each would wait for the other forever
    # (docs/PLATFORM.md, rendezvous).
    carry = carry._replace(x_recv=carry.x_recv * tokens.astype(dt))
    carry = dev.run(carry, mbs, zeros_act, zero_mb, r, replica_axes)
    return _reduced(pipe, fns, carry, table, table_vjp, r)


def _reduced(pipe: Pipeline, fns: StageFns, carry: Carry, table: jax.Array, table_vjp: Callable,
             r: int) -> tuple[jax.Array, dict, dict, dict, dict]:
    """A device's sums after the last tick, each reduced once: over the R replica groups, over the
    row groups (the table's gradient, through its cast and gather into the embedding's), over
    `pipeline` (the replicated parameters', the cross-entropy, the metrics' mean): (cross-entropy,
    d_stacked [V*Lc, ...], d_other, the model state's next value [V*Lc, ...], metrics)."""
    prog = pipe.program
    d_stacked, d_other, ce, state_new, metrics = carry.d_stacked, carry.d_other, carry.ce, carry.state, carry.metrics
    head_state = carry.head_state
    d_table = carry.d_table
    if r > 1:  # the replica groups' sums added: the step's one reduction over the replica axes
        d_stacked, d_other, d_table, ce, metrics = jax.tree.map(lambda a: a.sum(0),
                                                                (d_stacked, d_other, d_table, ce, metrics))
        state_new = fns.fold_state(state_new)
        head_state = fns.fold_state(head_state)
    # The row groups' table gradients added (the step's one reduction of them), through the
    # table's cast and gather into the embedding's gradient.
    d_other = jax.tree.map(add_to, d_other, table_vjp(d_table.sum((0, 1)).astype(table.dtype))[0])
    flat = lambda tree: jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), tree)  # noqa: E731
    metrics = jax.tree.map(lambda a: jax.lax.psum(a, AXIS) / (prog.stages * prog.virtual * prog.micro_batches * r),
                           metrics)
    # the head's model state: each stage's next value of its rows, merged over the stages
    head_state = _fold_over(fns, head_state, AXIS)
    return jax.lax.psum(ce, AXIS), flat(d_stacked), jax.lax.psum(d_other, AXIS), {**flat(state_new), **head_state}, metrics
