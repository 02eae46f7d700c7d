"""The pipelined loss and gradients: one `shard_map` over the `pipeline` axis walks a schedule table.

Each of the P devices along `pipeline` holds a stage: its slice of the stacked blocks (the
`layers` axis of every block parameter is sharded over `pipeline`, `rules.py`), and, replicated,
the embedding, final norm and output projection, which only the first and the last stage use.
Every device runs the same program (SPMD): a `lax.scan` over the ticks of
`schedule.program(...)`; in each tick a device reads its row (by `axis_index`) and
`lax.switch`es to idle, forward, backward or weight-gradient of one micro-batch, then the
activations move one stage on and the cotangents one stage back with `ppermute`.

- Forward of micro-batch i on virtual stage v: the stage input (the embedded tokens on v = 0, else
  the activation that arrived from v-1, kept in a stash slot) through the stage's blocks; the last
  virtual stage adds the final norm, logits and the loss.
- Backward: its own `jax.vjp` of the stage from the stashed input (the stage's forward is
  recomputed), with the cotangent that arrived from v+1 (the loss's on the last stage). So a
  stage holds only the inputs of the micro-batches in flight, the schedule's bound (`program`
  sizes the stash), not one autodiff over the whole schedule.
- `zero_bubble` splits it: B is the vjp with respect to the stage input only (its cotangent goes
  on at once), W the vjp with respect to the weights, run later in ticks that would idle.

Gradients of a stage's blocks add up locally over micro-batches; those of the replicated
parameters are summed over `pipeline` once at the end. With replica groups (`data`, and `fsdp`
under `fsdp_grad_reduce=once`: `communication.gradient_plan`) the tick loop runs once per group
under a `vmap`, so the data-parallel reduction also happens once, after the last tick. The other
mesh axes (data, fsdp, context, tensor) stay automatic inside the `shard_map`, so the model's
sharding constraints work as without a pipeline. The loss equals one big batch: every
micro-batch's objective is divided by the token count of the whole batch, as in
`step.loss_grads_and_state`.
Shape letters: M micro-batches, B rows per micro-batch, T sequence, D d_model, S stash slots.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from lumen_jax.config import ModelConfig
from lumen_jax.model.loss import token_objective
from lumen_jax.model.transformer import merge
from lumen_jax.parallel.pipeline import schedule as tables
from lumen_jax.parallel.rules import constrain

AXIS = "pipeline"
BLOCKS = "blocks"  # the parameters stacked along `layers`, cut into stages
_ACT = (None, "batch", "act_seq", "act_embed")  # a stash [S, B, T, D]


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """What the pipelined step needs besides the step's own config (hashable: closed over by jit)."""

    mesh: Mesh
    model: ModelConfig
    program: tables.Program

    @classmethod
    def create(cls, mesh: Mesh, model: ModelConfig, schedule: str, micro_batches: int,
               virtual: int = 1) -> "Pipeline":
        return cls(mesh=mesh, model=model, program=tables.program(
            tables.build(schedule, mesh.shape[AXIS], micro_batches, virtual)))

    @property
    def uniform(self) -> bool:
        """Whether every stage computes every branch of a tick and selects its own (True when another
        mesh axis is > 1). Stages take different branches in the same tick; the collectives GSPMD
        puts inside a branch (tensor, fsdp, data, context) then run on some devices only, and
        XLA:CPU's collectives wait for every device of the program (a rendezvous timeout, seen
        with fsdp=2 tensor=2). Selecting costs a forward and a backward per tick on every stage."""
        return any(size > 1 for axis, size in self.mesh.shape.items() if axis != AXIS)

    @property
    def schedule(self) -> tables.Schedule:
        return self.program.schedule

    def to_stages(self, blocks: Any) -> Any:
        """[L, ...] -> [P*V*Lc, ...] ordered device by device: device s holds chunks c = 0..V-1,
        the layers of virtual stages c*P + s (identity unless interleaved)."""
        p, v = self.schedule.stages, self.schedule.virtual
        if v == 1:
            return blocks
        return jax.tree.map(lambda a: a.reshape(v, p, -1, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape), blocks)

    def from_stages(self, blocks: Any) -> Any:
        p, v = self.schedule.stages, self.schedule.virtual
        if v == 1:
            return blocks
        return jax.tree.map(lambda a: a.reshape(p, v, -1, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape), blocks)


def _cond(pred: jax.Array, true_fn, false_fn, uniform: bool):
    """`lax.cond`, or with `uniform` both sides computed and one selected: every device then runs
    the same collectives (see `Pipeline.uniform`)."""
    if not uniform:
        return jax.lax.cond(pred, true_fn, false_fn)
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), true_fn(), false_fn())


def _switch(index: jax.Array, branches, uniform: bool):
    if not uniform:
        return jax.lax.switch(index, branches)
    outs = [b() for b in branches]
    return jax.tree.map(lambda *xs: jnp.select([index == i for i in range(len(xs))], xs), *outs)


def _objective(logits_btv: jax.Array, mb: dict, z_loss: float) -> tuple[jax.Array, jax.Array]:
    """(summed objective, summed cross-entropy) of one micro-batch, as `step._micro_loss`."""
    # The whole vocabulary on each device for the loss: XLA's SPMD partitioner (jaxlib 0.10.2) fails
    # a check on the cross-entropy of vocab-sharded logits inside this shard_map when the batch is
    # sharded too (data or fsdp with tensor); the last stage holds [B, T, V] of one micro-batch.
    logits_btv = constrain(logits_btv, ("batch", "seq", None))
    return token_objective(logits_btv, mb["targets"], mb["loss_mask"], z_loss)


def loss_and_grads(pipe: Pipeline, graphdef: Any, params: dict, batch: dict, scale: jax.Array,
                   z_loss: float, cast: Callable[[dict], dict] = lambda w: w, replicas: int = 1,
                   replica_axes: tuple[str, ...] = ()) -> tuple[jax.Array, dict]:
    """(mean token cross-entropy of `batch`, float32 gradients of the scaled objective), pipelined.

    Micro-batch i takes rows i, i+M, i+2M, ... of the batch (of each replica group's rows when
    `replicas` > 1), as the non-pipelined accumulation.
    `cast`: the parameters -> the weights the model computes with (`step.compute_weights`), applied
    to a stage's float32 slice where it is used, so the gradients stay float32.
    `replicas`, `replica_axes`: the replica groups of the communication plan (`step.Placement`).
    With R > 1 the tick loop runs under `jax.vmap` over R (`spmd_axis_name=replica_axes`): each
    group keeps its own stash and gradient sums ([R, ...]; the vmap's constraints put R on the
    replica axes) and the R sums are added once, after the last tick, instead of a reduction over
    the replica axes in every tick's backward (docs/COMMUNICATION.md).
    """
    prog, sched = pipe.program, pipe.schedule
    p, v_count, m, r = sched.stages, sched.virtual, sched.micro_batches, replicas
    last_v = p * v_count - 1
    uniform = pipe.uniform
    total_tokens = jnp.maximum(batch["loss_mask"].astype(jnp.float32).sum(), 1.0)
    if r == 1:  # [B, ...] -> [M, B/M, ...]
        mbs = jax.tree.map(lambda x: jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1), batch)
    else:  # [B, ...] -> [R, M, B/(R M), ...]: each group's micro-batches from its own rows
        mbs = jax.tree.map(lambda x: jnp.swapaxes(x.reshape(r, x.shape[0] // (r * m), m, *x.shape[1:]), 1, 2), batch)
    rows = np.asarray(prog.rows, np.int32)  # [ticks, P, columns]
    dt = jnp.dtype(pipe.model.compute_dtype)
    b, t = batch["inputs"].shape[0] // (m * r), batch["inputs"].shape[1]
    act_shape = (b, t, pipe.model.d_model)
    others = {k: val for k, val in params.items() if k != BLOCKS}

    def stage_fn(chunk: dict, other: dict, x_btd: jax.Array, mb: dict, v: jax.Array, total_tokens: jax.Array,
                 scale: jax.Array):
        """Virtual stage v on one micro-batch: (output activation, scaled objective, cross-entropy)."""
        model = merge(graphdef, cast({**other, BLOCKS: chunk}))
        x_btd = _cond(v == 0, lambda: model.embed_tokens(mb["inputs"]).astype(dt), lambda: x_btd, uniform)
        y_btd = model.run_layers(x_btd, mb["positions"], mb["segment_ids"])[0].astype(dt)

        def loss():
            obj, ce = _objective(model.logits(y_btd), mb, z_loss)
            return obj * scale / total_tokens, ce
        obj, ce = _cond(v == last_v, loss, lambda: (jnp.zeros((), jnp.float32),) * 2, uniform)
        return y_btd, obj, ce

    def local(blocks: dict, other: dict, mbs: dict, total_tokens: jax.Array,
              scale: jax.Array) -> tuple[jax.Array, dict, dict]:
        stage = jax.lax.axis_index(AXIS)
        blocks = jax.tree.map(lambda a: a.reshape(v_count, -1, *a.shape[1:]), blocks)  # [V, Lc, ...]
        zeros_act = jnp.zeros(act_shape, dt)
        x_buf = constrain(jnp.zeros((prog.x_slots + 1, *act_shape), dt), _ACT)
        g_buf = constrain(jnp.zeros((prog.g_slots + 1, *act_shape), dt), _ACT)
        acc0 = (jax.tree.map(jnp.zeros_like, blocks), jax.tree.map(jnp.zeros_like, other))

        def tick(carry, rows_t, mbs):
            x_buf, g_buf, acc, ce_acc = carry
            kind, mb_i, chunk_i, x_slot, g_slot, rx_slot, rg_slot = (rows_t[stage, c] for c in range(7))
            v = chunk_i * p + stage
            mb = jax.tree.map(lambda a: a[mb_i], mbs)
            chunk = jax.tree.map(lambda a: a[chunk_i], blocks)
            x_in, g_in = x_buf[x_slot], g_buf[g_slot]
            is_last = v == last_v
            g_out = jnp.where(is_last, jnp.zeros_like(g_in), g_in)
            g_obj = jnp.where(is_last, 1.0, 0.0).astype(jnp.float32)

            def add(acc, d_chunk, d_other):
                a_blocks, a_other = acc
                a_blocks = jax.tree.map(lambda a, d: a.at[chunk_i].add(d), a_blocks, d_chunk)
                return a_blocks, jax.tree.map(jnp.add, a_other, d_other)

            def idle():
                return zeros_act, zeros_act, acc, ce_acc

            def forward():
                y, _, ce = stage_fn(chunk, other, x_in, mb, v, total_tokens, scale)
                return y, zeros_act, acc, ce_acc + ce

            def backward():  # the whole backward (gpipe, 1f1b, interleaved)
                _, vjp = jax.vjp(lambda c, o, x: stage_fn(c, o, x, mb, v, total_tokens, scale)[:2], chunk, other, x_in)
                d_chunk, d_other, dx = vjp((g_out, g_obj))
                return zeros_act, dx, add(acc, d_chunk, d_other), ce_acc

            def input_grad():  # zero_bubble B: the cotangent of the stage input only
                _, vjp = jax.vjp(lambda x: stage_fn(chunk, other, x, mb, v, total_tokens, scale)[:2], x_in)
                return zeros_act, vjp((g_out, g_obj))[0], acc, ce_acc

            def weight_grad():  # zero_bubble W: the weights' share, deferred
                _, vjp = jax.vjp(lambda c, o: stage_fn(c, o, x_in, mb, v, total_tokens, scale)[:2], chunk, other)
                return zeros_act, zeros_act, add(acc, *vjp((g_out, g_obj))), ce_acc

            branches = (idle, forward, input_grad, weight_grad) if sched.split_backward else (idle, forward, backward)
            y, dx, acc, ce_acc = _switch(kind, branches, uniform)
            y = jax.lax.ppermute(y, AXIS, [(i, (i + 1) % p) for i in range(p)])
            dx = jax.lax.ppermute(dx, AXIS, [(i, (i - 1) % p) for i in range(p)])
            x_buf = constrain(x_buf.at[rx_slot].set(y), _ACT)
            g_buf = constrain(g_buf.at[rg_slot].set(dx), _ACT)
            return (x_buf, g_buf, acc, ce_acc), None

        carry = (x_buf, g_buf, acc0, jnp.zeros((), jnp.float32))
        if r == 1:
            body = lambda carry, rows_t: tick(carry, rows_t, mbs)  # noqa: E731
        else:  # one stash and one gradient sum per replica group (carry [R, ...]), see the docstring
            per_replica = jax.vmap(tick, in_axes=(0, None, 0), spmd_axis_name=replica_axes)
            body = lambda carry, rows_t: per_replica(carry, rows_t, mbs)  # noqa: E731
            carry = jax.tree.map(lambda a: jnp.zeros((r, *a.shape), a.dtype), carry)
        (_, _, (d_blocks, d_other), ce), _ = jax.lax.scan(body, carry, jnp.asarray(rows))
        if r > 1:  # the replica groups' sums added: the step's one reduction over the replica axes
            d_blocks, d_other, ce = jax.tree.map(lambda a: a.sum(0), (d_blocks, d_other, ce))
        d_blocks = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), d_blocks)
        return jax.lax.psum(ce, AXIS), d_blocks, jax.lax.psum(d_other, AXIS)

    blocks_spec = jax.tree.map(lambda _: P(AXIS), params[BLOCKS])
    other_spec = jax.tree.map(lambda _: P(), others)
    mbs_spec = jax.tree.map(lambda _: P(), mbs)
    run = jax.shard_map(local, mesh=pipe.mesh, in_specs=(blocks_spec, other_spec, mbs_spec, P(), P()),
                        out_specs=(P(), blocks_spec, other_spec), axis_names={AXIS}, check_vma=False)
    ce, d_blocks, d_other = run(pipe.to_stages(params[BLOCKS]), others, mbs, total_tokens,
                                jnp.asarray(scale, jnp.float32))
    return ce / total_tokens, {**d_other, BLOCKS: pipe.from_stages(d_blocks)}
