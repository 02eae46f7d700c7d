"""TrainState, the loss, and the train step: pure functions, jitted with shardings by the caller.

The step takes a global batch `{inputs, targets, segment_ids, positions, loss_mask}` ([B, T] each)
and, inside one jitted function: splits it into `micro_batches` (a scan that accumulates
gradients, so the result equals one big batch: every micro-batch's loss is divided by the token
count of the whole batch), unscales gradients (float16 dynamic loss scaling), computes the global
norm, applies the optax update, and skips the update when the loss, the gradients or the update are not
finite.

Model state that is not a parameter (`lumen_jax.ops.state`) travels in `TrainState.model_state`:
the step differentiates the loss with respect to it too and takes that "gradient" as its next value,
micro-batches combine their next values with the state's own rule, and a skipped step keeps it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from lumen_jax.model import apply_objective
from lumen_jax.model.transformer import embedding_lookup, merge
from lumen_jax.ops import state as state_lib
from lumen_jax.ops.projection import Taps
from lumen_jax.parallel.micro_batches import split_micro_batches, total_tokens
from lumen_jax.parallel.pipeline import executor as pipeline_step
from lumen_jax.parallel.pipeline.units import StageFns
from lumen_jax.parallel.pipeline.layout import Pipeline

Batch = dict[str, jax.Array]


class TrainState(struct.PyTreeNode):
    """Everything the step reads and writes. `loss_scale` is 1 except under float16."""

    step: jax.Array  # int32 scalar: optimizer steps applied so far (skipped steps included)
    params: dict  # float32 master weights
    opt_state: Any
    loss_scale: jax.Array  # float32 scalar
    good_steps: jax.Array  # int32 scalar: finite steps since the last loss-scale change
    # Non-parameter model state (ops/state.py), e.g. amax histories [L, H]; {} when the ops keep none.
    model_state: dict = struct.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """The static parts of the step (hashable, closed over by jit)."""

    graphdef: nnx.GraphDef
    tx: optax.GradientTransformation
    lr_schedule: optax.Schedule
    micro_batches: int = 1
    z_loss: float = 0.0
    dynamic_loss_scale: bool = False  # float16
    loss_scale_growth_interval: int = 2000
    # The model state at step 0 (a numpy tree; {} when the ops keep none) and, per leaf, how
    # micro-batches combine its next values (`ops.state.ModelState.combine`).
    fresh_state: dict = dataclasses.field(default_factory=dict, compare=False)
    state_combine: dict = dataclasses.field(default_factory=dict, compare=False)
    # Per parameter, the dtype its compute copy is cast to before the weights are gathered ("": kept).
    weight_dtypes: dict = dataclasses.field(default_factory=dict, compare=False)
    reduce_dtype: str = "float32"  # micro-batch gradient sums and their once-per-step reduction
    # mesh.pipeline > 1: the stages and schedule (parallel/pipeline/executor.py); None: no pipeline
    pipeline: Pipeline | None = None


def init_state(params: dict, tx: optax.GradientTransformation, loss_scale: float,
               model_state: dict | None = None) -> TrainState:
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                      loss_scale=jnp.asarray(loss_scale, jnp.float32),
                      good_steps=jnp.zeros((), jnp.int32), model_state=model_state or {})


def _micro_loss(params: dict, model_state: dict, mb: Batch, tokens: jax.Array, scale: jax.Array,
                sc: StepConfig, pieces: int) -> tuple[jax.Array, tuple[jax.Array, dict]]:
    """(scaled objective / tokens, (summed cross-entropy, the model's aux metrics)) of one micro-batch;
    `tokens`: the whole batch's count (`total_tokens`).

    The model's auxiliary loss (`model.apply_objective`: a mean over the micro-batch) enters the
    objective divided by `pieces`, the micro-batches times the replica groups that each compute one.
    Its gradient with respect to `model_state` is the state's next value (ops/state.py).
    """
    objective, ce_sum, aux = apply_objective(sc.graphdef, params, mb, scale / tokens, sc.z_loss, model_state)
    if "loss" in aux:
        objective = objective + aux["loss"] * scale / pieces
    return objective, (ce_sum, aux.get("metrics", {}))


def stage_fns(sc: StepConfig) -> StageFns:
    """The model's parts the pipelined step runs, each on the parameters of one stage's chunk."""
    def layers(params: dict, state: dict, x_btd: jax.Array, mb: Batch, real_layers: jax.Array | None = None,
               taps: Taps | None = None, *, stage: jax.Array) -> tuple[jax.Array, jax.Array, dict]:
        model = merge(sc.graphdef, params, {**sc.fresh_state, **state})  # the fresh head's state completes the graph
        split = sc.pipeline.stage_layers(model.cfg.num_layers)
        first = jnp.asarray([sum(split[:w]) for w in range(len(split))], jnp.int32)[stage]  # its first layer
        y_btd, aux = model.run_layers(x_btd, mb["positions"], mb["segment_ids"], real_layers, taps,
                                      model.ops.stage_runs(split, stage), first)
        return y_btd, aux.get("loss", jnp.zeros((), jnp.float32)), aux.get("metrics", {})

    def head(params: dict, y_btd: jax.Array, targets_bt: jax.Array, mask_bt: jax.Array, weight: jax.Array):
        return merge(sc.graphdef, params, sc.fresh_state).objective(y_btd, targets_bt, mask_bt, weight, sc.z_loss)

    def mtp(params: dict, state: dict, h_btd: jax.Array, mb: Batch, weight: jax.Array):
        model = merge(sc.graphdef, params, {**sc.fresh_state, **state})
        objective, ce_sums, counts, extra = model.mtp_terms(h_btd, mb, weight, sc.z_loss, jnp.zeros((), jnp.float32))
        return objective, extra, jnp.stack(ce_sums), jnp.stack(counts).astype(jnp.float32)

    # The embedding and the head keep no model state (fp8 and MoE state live in the layers: the
    # logits' projection is never fp8): the fresh state only completes the graph. Multi-token
    # prediction's modules (`mtp`, with the head) keep their MoE layers' state.
    rules = lambda tree: {k: sc.state_combine[k] for k in tree}  # noqa: E731  (a subset: stages', the head's)
    return StageFns(table=lambda params: merge(sc.graphdef, params, sc.fresh_state).embed_table(),
                                  embed=embedding_lookup,
                                  layers=layers, head=head, taps=Taps,
                                  combine_state=lambda a, b: state_lib.combine(rules(a), a, b),
                                  fold_state=lambda state_r: jax.tree.map(_fold, rules(state_r), state_r),
                                  mtp=mtp)


def _identity(tree: Any) -> Any:
    return tree


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the step's intermediate trees live on the mesh: sharding constraints from the caller
    (`lumen_jax.train.build`), identity on one device. See `loss_grads_and_state` for what each pins."""

    grads: Callable[[Any], Any] = _identity  # the step's reduced gradients (mesh.zero_stage)
    weights: Callable[[Any], Any] = _identity  # the compute-dtype weights the micro-batches use
    accumulator: Callable[[Any], Any] = _identity  # the [R, ...] gradient sums of the replica groups
    replicas: int = 1  # R: replica groups whose micro-batch gradients are summed without a reduction
    replica_axes: tuple[str, ...] = ()  # the mesh axes of R (`jax.vmap`'s spmd_axis_name)
    replica_seq: int = 1  # C: the groups among R that split each row's tokens (`context`), not its rows
    keep_weights: bool = False  # a pipelined step computes with `weights` made once (fsdp_regather=per_step)


def loss_and_grads(params: dict, batch: Batch, scale: jax.Array, sc: StepConfig,
                   placement: Placement = Placement(),
                   model_state: dict | None = None) -> tuple[jax.Array, dict]:
    """Mean token cross-entropy of the batch and the gradients of the (scaled) objective.

    `model_state`: the model state to use (None: the fresh one, as at step 0); its next value is
    dropped here (`train_step` keeps it).
    """
    model_state = sc.fresh_state if model_state is None else model_state
    loss, grads, _, _ = loss_grads_and_state(params, model_state, batch, scale, sc, placement)
    return loss, grads


def compute_weights(params: dict, sc: StepConfig) -> dict:
    """The parameters cast to the dtypes the model computes in (`sc.weight_dtypes`), while still
    sharded: the FSDP all-gathers that follow move compute-dtype bytes."""
    if not sc.weight_dtypes:
        return params
    return jax.tree.map(lambda p, dt: p.astype(dt) if dt else p, params, sc.weight_dtypes)


def _fold(rule: Callable[[jax.Array, jax.Array], jax.Array], x_r: jax.Array) -> jax.Array:
    """`rule` applied across the leading replica axis, earlier replicas first (pairwise halves)."""
    while x_r.shape[0] > 1:
        half = x_r.shape[0] // 2
        merged = rule(x_r[:half], x_r[half:2 * half])
        x_r = jnp.concatenate([merged, x_r[2 * half:]]) if x_r.shape[0] % 2 else merged
    return x_r[0]


def _sum_replicas(g_r: jax.Array) -> jax.Array:
    """The replica groups' gradient sums [R, ...] added in their own dtype (`sc.reduce_dtype`): this
    is the step's reduction over the replica axes. (`jnp.sum` would add bfloat16 in float32, and
    the reduction would cross the mesh in float32 whatever the setting.)"""
    return jax.lax.reduce(g_r, jnp.zeros((), g_r.dtype), jax.lax.add, (0,))


def loss_grads_and_state(params: dict, model_state: dict, batch: Batch, scale: jax.Array, sc: StepConfig,
                         placement: Placement = Placement()) -> tuple[jax.Array, dict, dict, dict]:
    """(mean token cross-entropy, gradients of the scaled objective, the model state's next value,
    the model's aux metrics averaged over micro-batches and replica groups).

    The gradients are taken with respect to the compute-dtype weights (`compute_weights`, pinned by
    `placement.weights`: sharded, gathered where each micro-batch uses them, or gathered once for
    the step) and returned in float32.

    One micro-batch: the gradients are reduced where XLA puts the reduction. Several
    (`sc.micro_batches` = M): the batch is cut into `placement.replicas` = R replica groups (the
    devices of one index along `placement.replica_axes`; `context`'s groups take chunks of the
    tokens, the others rows) and each group's micro-batch gradients are summed locally, in `sc.reduce_dtype`, in an [R, ...] accumulator (`placement.accumulator`);
    the R sums are reduced once, after the last micro-batch ("the all-reduce only needs to run
    once, at the end"). Micro-batch m of replica r takes rows m, m+M, ... of that replica's rows,
    so each device's slice of the batch stays on that device. The model state's next values
    combine by each variable's rule (`sc.state_combine`), across micro-batches and replicas.
    """
    if sc.pipeline is not None:
        # fsdp_regather=per_step: the compute-dtype weights are gathered once, before the first tick,
        # and the ticks' gradients taken with respect to them; else every tick casts its chunk's
        # weights and gathers them where it uses them.
        if placement.keep_weights:
            weights, cast = placement.weights(compute_weights(params, sc)), _identity
        else:
            weights, cast = params, lambda w: compute_weights(w, sc)
        loss, grads, state_new, aux = pipeline_step.loss_and_grads(
            sc.pipeline, stage_fns(sc), weights, batch, scale, cast, placement.replicas, placement.replica_axes,
            model_state, placement.replica_seq, sc.reduce_dtype)
        return loss, placement.grads(grads), state_new, aux
    tokens = total_tokens(batch)
    weights = placement.weights(compute_weights(params, sc))
    grad_fn = jax.grad(_micro_loss, argnums=(0, 1), has_aux=True)
    f32 = lambda tree: jax.tree.map(lambda g: g.astype(jnp.float32), tree)  # noqa: E731
    m, r = sc.micro_batches, placement.replicas
    if m == 1:
        (grads, state_new), (ce_sum, aux) = grad_fn(weights, model_state, batch, tokens, scale, sc, 1)
        return ce_sum / tokens, placement.grads(f32(grads)), state_new, aux

    reduce_dtype = jnp.dtype(sc.reduce_dtype)

    if r > 1:
        replica_grad = jax.vmap(grad_fn, in_axes=(None, None, 0, None, None, None, None),
                                spmd_axis_name=placement.replica_axes)
    else:  # one group: no vmap
        def replica_grad(*args: Any) -> Any:
            one = jax.tree.map(lambda x: x[0], args[2])
            return jax.tree.map(lambda x: x[None], grad_fn(*args[:2], one, *args[3:]))

    def accumulate(carry: tuple[dict, jax.Array, dict], mb: Batch) -> tuple[tuple[dict, jax.Array, dict], dict]:
        grads, ce, state_acc = carry
        (g, new), (c, aux) = replica_grad(weights, model_state, mb, tokens, scale, sc, m * r)
        grads = jax.tree.map(lambda a, b: a + b.astype(reduce_dtype), grads, g)
        return (placement.accumulator(grads), ce + c.sum(),
                state_lib.combine(sc.state_combine, state_acc, new)), jax.tree.map(lambda v: v.mean(0), aux)

    zeros = placement.accumulator(jax.tree.map(lambda w: jnp.zeros((r, *w.shape), reduce_dtype), weights))
    carry = (zeros, jnp.zeros((), jnp.float32), jax.tree.map(lambda s: jnp.zeros((r, *s.shape), s.dtype), model_state))
    micro = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1) if r > 1 else x[:, None],  # [M, R, B/(R M), ...]
                         split_micro_batches(batch, m, r, placement.replica_seq))
    (grads_r, ce_sum, state_r), aux = jax.lax.scan(accumulate, carry, micro)
    grads = placement.grads(f32(jax.tree.map(_sum_replicas, grads_r)))
    state_new = jax.tree.map(_fold, sc.state_combine, state_r)
    return ce_sum / tokens, grads, state_new, jax.tree.map(lambda v: v.mean(0), aux)


def train_step(state: TrainState, batch: Batch, sc: StepConfig,
               placement: Placement = Placement()) -> tuple[TrainState, dict]:
    """One optimizer step on a global batch; returns the new state and scalar metrics."""
    new_state, metrics, _ = train_step_and_grads(state, batch, sc, placement)
    return new_state, metrics


def train_step_and_grads(state: TrainState, batch: Batch, sc: StepConfig,
                         placement: Placement = Placement()) -> tuple[TrainState, dict, dict]:
    """`train_step`, and the (unscaled) gradients it applied: tests compare them without compiling
    a second program."""
    loss, grads, model_state, aux_metrics = loss_grads_and_state(state.params, state.model_state, batch,
                                                                 state.loss_scale, sc, placement)
    grads = jax.tree.map(lambda g: g / state.loss_scale, grads)
    grad_norm = optax.tree.norm(grads)

    updates, opt_state = sc.tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    # What is written must be finite, not only what was read: an update can overflow (a huge lr)
    # with a finite loss and gradient norm. One norm of the updates sees any inf/NaN among them (the
    # new parameters are old + update). It is taken from a second computation of the updates behind
    # an optimization barrier, so XLA neither stores the updates to select on them later (a
    # parameter-sized temporary) nor merges the two: the norm is a fused reduction and each update
    # is still written straight into its parameter.
    probe, _ = sc.tx.update(*jax.lax.optimization_barrier((grads, state.opt_state, state.params)))
    update_norm = optax.tree.norm(probe)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & jnp.isfinite(update_norm)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731

    loss_scale, good_steps = state.loss_scale, state.good_steps
    if sc.dynamic_loss_scale:
        grow = finite & (good_steps + 1 >= sc.loss_scale_growth_interval)
        loss_scale = jnp.where(finite, jnp.where(grow, loss_scale * 2, loss_scale),
                               jnp.maximum(loss_scale / 2, 1.0))
        good_steps = jnp.where(finite & ~grow, good_steps + 1, 0)

    new_state = TrainState(step=state.step + 1, params=keep(params, state.params),
                           opt_state=keep(opt_state, state.opt_state),
                           loss_scale=loss_scale, good_steps=good_steps,
                           model_state=keep(model_state, state.model_state))
    # The token count after the loss: nothing else waits for its all-reduce, and an emulated CPU device
    # that ran it beside the step's loops while another ran their collectives would wait forever
    # (docs/PLATFORM.md, rendezvous).
    mask, _ = jax.lax.optimization_barrier((batch["loss_mask"], loss))
    tokens = mask.astype(jnp.float32).sum()
    metrics = {"loss": loss, "grad_norm": grad_norm, "update_norm": update_norm, "lr": sc.lr_schedule(state.step),
               "loss_scale": state.loss_scale, "skipped": (~finite).astype(jnp.int32),
               "tokens": tokens, **aux_metrics}
    if sc.pipeline is not None:  # the fill and drain's share of the work (parallel/pipeline/schedule.py)
        metrics["pipeline_bubble"] = jnp.asarray(sc.pipeline.bubble(), jnp.float32)
    return new_state, metrics, grads


def eval_loss(params: dict, model_state: dict, batch: Batch, sc: StepConfig) -> tuple[jax.Array, jax.Array]:
    """(summed token cross-entropy, token count) of a batch: the loss `train_step` reports, without gradients."""
    one = jnp.ones((), jnp.float32)
    _, (ce_sum, _) = _micro_loss(params, model_state, batch, one, one, sc, 1)
    return ce_sum, batch["loss_mask"].astype(jnp.float32).sum()
