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
- head (segments with the last virtual stage's output): the final norm, logits and loss of that
  output, split over the P stages by tokens (each computes every P-th token: the logits' work is
  done once, not on every stage); its cotangent goes to the last stage's stash slot.
- backward: the stashed residuals' vjp with the cotangent that arrived (the loss's on the last
  stage), giving the chunk's gradients (summed locally over micro-batches) and the input's
  cotangent, which moves one stage back. The forward is not recomputed: residuals that depend only
  on the weights (their compute-dtype casts) are not stashed but taken again from the weights.

Uneven stages (`mesh.pipeline_layers`) keep the stacks padded in memory (`Pipeline.pad`): each
virtual stage holds max(pipeline_layers) layer slots, the ones past its own layers all zeros, which
is exactly the identity; they are computed like the others (in lock step a tick lasts as long as
the dearest stage, so a shorter stage would wait that long anyway: the padding costs FLOPs, not time).

A stage with nothing to do in the fill or the drain computes on zeros and adds zeros: that work is
the bubble (`Lockstep.bubble`, the schedule's formula). Gradients of the replicated parameters are
summed over `pipeline` once at the end. With replica groups (`data`, and `fsdp` under
`fsdp_grad_reduce=once`: `communication.gradient_plan`) the ticks run once per group under a
`vmap`, so the data-parallel reduction also happens once, after the last tick. The other mesh
axes stay automatic inside the `shard_map`. The loss equals one big batch: every micro-batch's
objective is divided by the token count of the whole batch.

The model enters as functions (`StageFns`, from `train/step.py`): this module never imports model/.
Shape letters: M micro-batches, B rows per micro-batch, T sequence, D d_model, S stash slots.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from lumen_jax.parallel.pipeline import schedule as tables

AXIS = "pipeline"
BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


@dataclasses.dataclass(frozen=True)
class StageFns:
    """The model's parts, each a function of the full parameter tree (stacks: one chunk's slice)."""

    embed: Callable[[dict, jax.Array], jax.Array]  # (params, tokens [B, T]) -> [B, T, D]
    # layers: (params, model state, x [B, T, D], micro-batch) -> (y [B, T, D], the chunk's auxiliary
    # loss (a scalar added to the objective; 0 without one), its metrics {name: scalar})
    layers: Callable[[dict, dict, jax.Array, dict], tuple[jax.Array, jax.Array, dict]]
    head: Callable[[dict, jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]
    # head: (params, y [B, T', D], targets [B, T'], mask [B, T']) -> (summed objective, summed cross-entropy)
    # The model state's next values: two micro-batches' merged (earlier, later), and [R, ...] -> one.
    combine_state: Callable[[dict, dict], dict] = lambda earlier, later: later
    fold_state: Callable[[dict], dict] = lambda state_r: jax.tree.map(lambda a: a[-1], state_r)


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """What the pipelined step needs besides the step's own config (hashable: closed over by jit)."""

    mesh: Mesh
    program: tables.Lockstep
    d_model: int
    compute_dtype: str
    stacks: tuple[str, ...] = ("blocks",)  # the top-level parameters stacked along `layers` (cut into stages)
    # Layers per virtual stage when they differ (`mesh.pipeline_layers`); (): even stages. See `pad`.
    layers: tuple[int, ...] = ()

    @classmethod
    def create(cls, mesh: Mesh, d_model: int, compute_dtype: str, schedule: str, micro_batches: int,
               virtual: int = 1, stacks: tuple[str, ...] = ("blocks",), layers: tuple[int, ...] = ()) -> "Pipeline":
        return cls(mesh=mesh, program=tables.lockstep(schedule, mesh.shape[AXIS], micro_batches, virtual),
                   d_model=d_model, compute_dtype=compute_dtype, stacks=stacks,
                   layers=tuple(layers) if len(set(layers)) > 1 else ())

    def _slots(self) -> np.ndarray:
        """[L]: the padded slot of each real layer, w * Lmax + j for layer j of virtual stage w."""
        lmax = max(self.layers)
        return np.concatenate([w * lmax + np.arange(n) for w, n in enumerate(self.layers)])

    def pad(self, stacks: Any) -> Any:
        """Uneven stages (`layers`): [L, ...] (the real layers in order) -> [P*V*Lmax, ...], the layout
        the stacks have in memory: every virtual stage w owns Lmax = max(layers) slots from w * Lmax,
        its layers first, zeros in the rest (identity with even stages).

        A slot of zeros is exactly the identity of the pre-norm residual block (zero norm scales give a
        zero input, zero output projections add 0) and its gradients are exactly 0, so AdamW keeps it
        zero: it is computed in lock step (a tick lasts as long as the dearest stage anyway) and adds nothing.
        """
        if not self.layers:
            return stacks
        slots, n = self._slots(), len(self.layers) * max(self.layers)
        return jax.tree.map(lambda a: jnp.zeros((n, *a.shape[1:]), a.dtype).at[slots].set(a), stacks)

    def unpad(self, stacks: Any) -> Any:
        """The inverse of `pad`: [P*V*Lmax, ...] -> the real layers [L, ...] in order."""
        if not self.layers:
            return stacks
        return jax.tree.map(lambda a: a[self._slots()], stacks)

    def bubble(self) -> float:
        """The share of the executed work that is the fill and the drain (the `pipeline_bubble` metric)."""
        return self.program.bubble()

    def to_stages(self, blocks: Any) -> Any:
        """[L, ...] (padded with uneven stages: `pad`) -> [P*V*Lc, ...] ordered device by device: device s holds chunks c = 0..V-1,
        the layers of virtual stages c*P + s (identity unless interleaved)."""
        p, v = self.program.stages, self.program.virtual
        if v == 1:
            return blocks
        return jax.tree.map(lambda a: a.reshape(v, p, -1, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape), blocks)

    def from_stages(self, blocks: Any) -> Any:
        p, v = self.program.stages, self.program.virtual
        if v == 1:
            return blocks
        return jax.tree.map(lambda a: a.reshape(p, v, -1, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape), blocks)


def split_micro_batches(batch: dict, micro_batches: int, replicas: int = 1) -> dict:
    """[B, ...] -> [M, B/M, ...] (R = 1) or [R, M, B/(R M), ...]: micro-batch i takes rows i, i+M,
    ... of each replica group's rows, so each device's slice of the batch stays on that device."""
    m, r = micro_batches, replicas
    if r == 1:
        return jax.tree.map(lambda x: jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1), batch)
    return jax.tree.map(lambda x: jnp.swapaxes(x.reshape(r, x.shape[0] // (r * m), m, *x.shape[1:]), 1, 2), batch)


def total_tokens(batch: dict) -> jax.Array:
    """The token count every micro-batch's objective is divided by (at least 1)."""
    return jnp.maximum(batch["loss_mask"].astype(jnp.float32).sum(), 1.0)


def _varying(fn: Callable, weights: tuple, varying: tuple) -> tuple[list[bool], list[Any]]:
    """Per output leaf of `fn(*weights, *varying)`: whether it depends on `varying` (a walk of the
    jaxpr: an equation's outputs depend on what any of its inputs depends on), and its shape and dtype."""
    jaxpr = jax.make_jaxpr(fn)(*weights, *varying).jaxpr
    n_weights = len(jax.tree.leaves(weights))
    dep = set(jaxpr.invars[n_weights:])
    for eqn in jaxpr.eqns:
        if any(not hasattr(v, "val") and v in dep for v in eqn.invars):
            dep.update(eqn.outvars)
    return [not hasattr(v, "val") and v in dep for v in jaxpr.outvars], [v.aval for v in jaxpr.outvars]


def _strided(x: jax.Array, p: int, s: jax.Array) -> jax.Array:
    """Tokens s, s+P, s+2P, ... of [B, T, ...] (T a multiple of P)."""
    b, t = x.shape[:2]
    return jax.lax.dynamic_index_in_dim(x.reshape(b, t // p, p, *x.shape[2:]), s, axis=2, keepdims=False)


def loss_and_grads(pipe: Pipeline, fns: StageFns, params: dict, batch: dict, scale: jax.Array,
                   cast: Callable[[dict], dict] = lambda w: w, replicas: int = 1,
                   replica_axes: tuple[str, ...] = (),
                   model_state: dict | None = None) -> tuple[jax.Array, dict, dict, dict]:
    """(mean token cross-entropy of `batch`, float32 gradients of the scaled objective, the model
    state's next value, the model's aux metrics averaged over layers and micro-batches), pipelined.

    `cast`: the parameters -> the weights the model computes with (`step.compute_weights`), applied
    to a stage's float32 slice where it is used, so the gradients stay float32.
    `replicas`, `replica_axes`: the replica groups of the communication plan (`step.Placement`).
    With R > 1 the ticks run under `jax.vmap` over R (`spmd_axis_name=replica_axes`): each group
    keeps its own stash and gradient sums and the R sums are added once, after the last tick.
    `model_state`: non-parameter model state (ops/state.py), stacked along `layers` like the blocks
    it belongs to and cut into the same stages; each micro-batch's next value is the backward's
    "gradient" of it, merged by `fns.combine_state` (micro-batches) and `fns.fold_state` (replicas).
    The model's auxiliary loss (a chunk's sum over its layers) enters the objective divided by
    the micro-batches times the replica groups, as in the unpipelined step.
    """
    prog = pipe.program
    p, v_count, m, r = prog.stages, prog.virtual, prog.micro_batches, replicas
    last_v = p * v_count - 1
    tokens = total_tokens(batch)
    mbs = split_micro_batches(batch, m, r)
    dt = jnp.dtype(pipe.compute_dtype)
    b, t = batch["inputs"].shape[0] // (m * r), batch["inputs"].shape[1]
    act_shape = (b, t, pipe.d_model)
    model_state = model_state or {}
    stacks = {k: params[k] for k in pipe.stacks}
    others = {k: val for k, val in params.items() if k not in pipe.stacks}
    if set(model_state) - set(pipe.stacks):  # the config refuses such ops (config/checks.py)
        raise ValueError(f"model state outside the layer stacks {sorted(set(model_state) - set(pipe.stacks))} "
                         "does not run in pipeline stages")
    fwd, bwd = np.asarray(prog.fwd, np.int32), np.asarray(prog.bwd, np.int32)  # [ticks, P, 4]
    head_rows = np.asarray(prog.head, np.int32)  # [ticks, 2]
    aux_share = 1.0 / (m * r)  # the auxiliary loss of one micro-batch of one replica group

    def stage(chunk: dict, other: dict, state: dict, x_recv: jax.Array, mb: dict, v: jax.Array):
        """Virtual stage v's forward of one micro-batch: ((y [B, T, D] in the compute dtype, aux loss), metrics)."""
        w = cast({**other, **chunk})
        x = jnp.where(v == 0, fns.embed(w, mb["inputs"]).astype(dt), x_recv)
        y, aux_loss, metrics = fns.layers(w, state, x, mb)
        return (y.astype(dt), jnp.asarray(aux_loss, jnp.float32)), metrics

    def residuals(chunk: dict, other: dict, state: dict, x_recv: jax.Array, mb: dict, v: jax.Array):
        (y, _), vjp, metrics = jax.vjp(lambda c, o, st, x: stage(c, o, st, x, mb, v), chunk, other, state, x_recv,
                                       has_aux=True)
        return y, vjp, metrics

    def local(stacked: dict, other: dict, state: dict, mbs: dict, tokens: jax.Array, scale: jax.Array):
        s = jax.lax.axis_index(AXIS)
        by_chunk = lambda tree: jax.tree.map(lambda a: a.reshape(v_count, -1, *a.shape[1:]), tree)  # noqa: E731
        stacked, state = by_chunk(stacked), by_chunk(state)  # [V, Lc, ...]
        one_mb = jax.tree.map(lambda a: a[0, 0] if r > 1 else a[0], mbs)
        zeros_act = jnp.zeros(act_shape, dt)
        zero_mb = jax.tree.map(jnp.zeros_like, one_mb)
        at = lambda tree, c: jax.tree.map(lambda a: a[c], tree)  # noqa: E731
        chunk0, state0 = at(stacked, 0), at(state, 0)
        # Which residuals depend on the micro-batch (stashed) and which on the weights alone (taken
        # again in the backward: XLA drops the rest of that second trace, whose outputs go unused).
        leaves_fn = lambda c, o, st, x, mb, v: jax.tree.leaves(residuals(c, o, st, x, mb, v)[1])  # noqa: E731
        stashed, shapes = _varying(leaves_fn, (chunk0, other, state0), (zeros_act, zero_mb, jnp.int32(0)))
        stash0 = [jnp.zeros((prog.slots + 1, *a.shape), a.dtype) for a, keep in zip(shapes, stashed) if keep]
        metrics0 = jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32),
                                jax.eval_shape(lambda: residuals(chunk0, other, state0, zeros_act, zero_mb,
                                                                 jnp.int32(0))[2]))

        def head_loss(other: dict, y_last: jax.Array, mb: dict) -> tuple[jax.Array, jax.Array]:
            """The loss of the last virtual stage's output (zeros elsewhere), each stage taking every
            P-th token: (scaled objective, cross-entropy) of this stage's tokens."""
            y_all = jax.lax.psum(y_last, AXIS)
            w = cast({**other, **jax.lax.stop_gradient(chunk0)})
            obj, ce = fns.head(w, _strided(y_all, p, s), _strided(mb["targets"], p, s),
                               _strided(mb["loss_mask"], p, s))
            return obj * scale / tokens, ce

        def tick(seg: tables.Segment, carry, rows, mbs):
            stash, g_stash, x_recv, g_recv, acc, ce_acc, state_acc, metrics_acc = carry
            f_row, b_row, h_row = rows
            a_stacked, a_other = acc
            y = dx = None
            if seg.forward:
                f_valid, f_mb, f_chunk, f_slot = (f_row[s, c] for c in range(4))
                v = f_chunk * p + s
                mb = jax.tree.map(lambda a: a[f_mb], mbs)
                y, vjp, metrics = residuals(at(stacked, f_chunk), other, at(state, f_chunk), x_recv, mb, v)
                kept = iter([leaf for leaf, keep in zip(jax.tree.leaves(vjp), stashed) if keep])
                stash = [buf.at[f_slot].set(next(kept)) for buf in stash]
                metrics_acc = jax.tree.map(lambda a, x: a + f_valid.astype(jnp.float32) * x, metrics_acc, metrics)
            if seg.head:
                h_valid, h_mb = h_row[0], h_row[1]
                mb = jax.tree.map(lambda a: a[h_mb], mbs)
                y_last = jnp.where((s == p - 1) & (f_chunk == v_count - 1), y, jnp.zeros_like(y))
                (_, ce), head_vjp = jax.vjp(lambda o, yl: head_loss(o, yl, mb), other, y_last)
                h = h_valid.astype(jnp.float32)
                d_other, dy = head_vjp((h, jnp.zeros((), jnp.float32)))
                a_other = jax.tree.map(jnp.add, a_other, d_other)
                ce_acc = ce_acc + h * ce
                g_stash = g_stash.at[f_slot].set(dy.astype(dt))  # read by the last stage's backward
            if seg.backward:
                b_valid, b_mb, b_chunk, b_slot = (b_row[s, c] for c in range(4))
                v = b_chunk * p + s
                chunk_state = at(state, b_chunk)
                # its structure and weight residuals
                _, vjp, _ = residuals(at(stacked, b_chunk), other, chunk_state, zeros_act, zero_mb, v)
                leaves, treedef = jax.tree.flatten(vjp)
                kept = iter([buf[b_slot] for buf in stash])
                vjp = jax.tree.unflatten(treedef, [next(kept) if keep else leaf for leaf, keep in zip(leaves, stashed)])
                g = jnp.where(v == last_v, g_stash[b_slot], g_recv) * b_valid.astype(dt)
                d_aux = b_valid.astype(jnp.float32) * scale * aux_share
                # A bubble tick's backward runs on an empty slot, whose zero residuals can make inf and
                # NaN (a router's weights divided by their zero sum): it adds nothing, selected away.
                d_chunk, d_other, d_state, dx = jax.tree.map(lambda d: jnp.where(b_valid > 0, d, jnp.zeros_like(d)),
                                                             vjp((g, d_aux)))
                a_stacked = jax.tree.map(lambda a, d: a.at[b_chunk].add(d), a_stacked, d_chunk)
                a_other = jax.tree.map(jnp.add, a_other, d_other)
                merged = fns.combine_state(at(state_acc, b_chunk), d_state)
                state_acc = jax.tree.map(lambda a, new: a.at[b_chunk].set(jnp.where(b_valid > 0, new, a[b_chunk])),
                                         state_acc, merged)
            if y is not None:
                x_recv = jax.lax.ppermute(y, AXIS, [(i, (i + 1) % p) for i in range(p)])
            if dx is not None:
                g_recv = jax.lax.ppermute(dx.astype(dt), AXIS, [(i, (i - 1) % p) for i in range(p)])
            return (stash, g_stash, x_recv, g_recv, (a_stacked, a_other), ce_acc, state_acc, metrics_acc), None

        acc0 = (jax.tree.map(jnp.zeros_like, stacked), jax.tree.map(jnp.zeros_like, other))
        carry = (stash0, jnp.zeros((prog.slots + 1, *act_shape), dt), zeros_act, zeros_act, acc0,
                 jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, state), metrics0)
        if r > 1:  # one stash and one gradient sum per replica group (carry [R, ...]), see the docstring
            carry = jax.tree.map(lambda a: jnp.zeros((r, *a.shape), a.dtype), carry)
        # Every device runs the token count's all-reduce (over the batch axes) before the first tick:
        # the first activation received is zeros times it (XLA keeps a float product with 0, which
        # is not 0 for inf or NaN). Else an emulated CPU device could run the fill's collectives
        # while another runs the all-reduce, and each would wait for the other forever
        # (docs/PLATFORM.md, rendezvous).
        carry = (*carry[:2], carry[2] * tokens.astype(dt), *carry[3:])
        for seg in prog.segments:
            rows = tuple(jnp.asarray(a[seg.start:seg.stop]) for a in (fwd, bwd, head_rows))
            if r == 1:
                body = lambda c, rw, seg=seg: tick(seg, c, rw, mbs)  # noqa: E731
            else:
                per_replica = jax.vmap(lambda c, rw, mb, seg=seg: tick(seg, c, rw, mb), in_axes=(0, None, 0),
                                       spmd_axis_name=replica_axes)
                body = lambda c, rw, per_replica=per_replica: per_replica(c, rw, mbs)  # noqa: E731
            carry, _ = jax.lax.scan(body, carry, rows)
        (_, _, _, _, (d_stacked, d_other), ce, state_new, metrics) = carry
        if r > 1:  # the replica groups' sums added: the step's one reduction over the replica axes
            d_stacked, d_other, ce, metrics = jax.tree.map(lambda a: a.sum(0), (d_stacked, d_other, ce, metrics))
            state_new = fns.fold_state(state_new)
        flat = lambda tree: jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), tree)  # noqa: E731
        metrics = jax.tree.map(lambda a: jax.lax.psum(a, AXIS) / (p * v_count * m * r), metrics)
        return jax.lax.psum(ce, AXIS), flat(d_stacked), jax.lax.psum(d_other, AXIS), flat(state_new), metrics

    stage_spec = lambda tree: jax.tree.map(lambda _: P(AXIS), tree)  # noqa: E731
    same_spec = lambda tree: jax.tree.map(lambda _: P(), tree)  # noqa: E731
    run = jax.shard_map(local, mesh=pipe.mesh,
                        in_specs=(stage_spec(stacks), same_spec(others), stage_spec(model_state), same_spec(mbs),
                                  P(), P()),
                        out_specs=(P(), stage_spec(stacks), same_spec(others), stage_spec(model_state), P()),
                        axis_names={AXIS}, check_vma=False)
    ce, d_stacked, d_other, state_new, metrics = run(pipe.to_stages(stacks), others, pipe.to_stages(model_state),
                                                     mbs, tokens, jnp.asarray(scale, jnp.float32))
    return ce / tokens, {**d_other, **pipe.from_stages(d_stacked)}, pipe.from_stages(state_new), metrics
