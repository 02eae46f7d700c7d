"""TrainState, the loss, and the train step: pure functions, jitted with shardings by the caller.

The step takes a global batch `{inputs, targets, segment_ids, positions, loss_mask}` ([B, T] each)
and, inside one jitted function: splits it into `micro_batches` (a scan that accumulates
gradients, so the result equals one big batch: every micro-batch's loss is divided by the token
count of the whole batch), unscales gradients (float16 dynamic loss scaling), computes the global
norm, applies the optax update, and skips the update when the loss or gradients are not finite.

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

from lumen_jax.model import apply
from lumen_jax.ops import state as state_lib
from lumen_jax.parallel import pipeline_step

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
    # mesh.pipeline > 1: the stages and schedule (parallel/pipeline_step.py); None: no pipeline
    pipeline: pipeline_step.Pipeline | None = None


def init_state(params: dict, tx: optax.GradientTransformation, loss_scale: float,
               model_state: dict | None = None) -> TrainState:
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                      loss_scale=jnp.asarray(loss_scale, jnp.float32),
                      good_steps=jnp.zeros((), jnp.int32), model_state=model_state or {})


def _micro_loss(params: dict, model_state: dict, mb: Batch, total_tokens: jax.Array, scale: jax.Array,
                sc: StepConfig) -> tuple[jax.Array, jax.Array]:
    """(scaled objective / total_tokens, summed cross-entropy) of one micro-batch.

    Its gradient with respect to `model_state` is the state's next value (ops/state.py).
    """
    logits_btv = apply(sc.graphdef, params, mb["inputs"], mb["positions"], mb["segment_ids"], model_state)
    mask = mb["loss_mask"].astype(jnp.float32)
    ce_sum = (optax.softmax_cross_entropy_with_integer_labels(logits_btv, mb["targets"]) * mask).sum()
    objective = ce_sum
    if sc.z_loss:
        log_z = jax.nn.logsumexp(logits_btv, axis=-1)
        objective = objective + sc.z_loss * (jnp.square(log_z) * mask).sum()
    return objective * scale / total_tokens, ce_sum


def loss_and_grads(params: dict, batch: Batch, scale: jax.Array, sc: StepConfig,
                   constrain_grads: Callable[[Any], Any] = lambda g: g,
                   model_state: dict | None = None) -> tuple[jax.Array, dict]:
    """Mean token cross-entropy of the batch and the gradients of the (scaled) objective.

    `model_state`: the model state to use (None: the fresh one, as at step 0); its next value is
    dropped here (`train_step` keeps it).
    """
    model_state = sc.fresh_state if model_state is None else model_state
    loss, grads, _ = loss_grads_and_state(params, model_state, batch, scale, sc, constrain_grads)
    return loss, grads


def loss_grads_and_state(params: dict, model_state: dict, batch: Batch, scale: jax.Array, sc: StepConfig,
                         constrain_grads: Callable[[Any], Any] = lambda g: g) -> tuple[jax.Array, dict, dict]:
    """(mean token cross-entropy, gradients of the scaled objective, the model state's next value).

    Micro-batch m takes rows m, m+M, m+2M, ... so each device's contiguous slice of the batch
    stays on that device (no resharding before the scan). Gradients add up over micro-batches; the
    model state's next values combine by each variable's rule (`sc.state_combine`).
    """
    if sc.pipeline is not None:  # the model state's next value is the current one (no fp8 with a pipeline)
        loss, grads = pipeline_step.loss_and_grads(sc.pipeline, sc.graphdef, params, batch, scale, sc.z_loss)
        return loss, constrain_grads(grads), model_state
    total_tokens = jnp.maximum(batch["loss_mask"].astype(jnp.float32).sum(), 1.0)
    grad_fn = jax.grad(_micro_loss, argnums=(0, 1), has_aux=True)
    m = sc.micro_batches
    if m == 1:
        (grads, state_new), ce_sum = grad_fn(params, model_state, batch, total_tokens, scale, sc)
        return ce_sum / total_tokens, constrain_grads(grads), state_new

    def split(x: jax.Array) -> jax.Array:  # [B, ...] -> [M, B/M, ...]
        return jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1)

    def accumulate(carry: tuple[dict, jax.Array, dict], mb: Batch) -> tuple[tuple[dict, jax.Array, dict], None]:
        grads, ce, state_acc = carry
        (g, new), c = grad_fn(params, model_state, mb, total_tokens, scale, sc)
        return (constrain_grads(jax.tree.map(jnp.add, grads, g)), ce + c,
                state_lib.combine(sc.state_combine, state_acc, new)), None

    zeros = constrain_grads(jax.tree.map(jnp.zeros_like, params))
    carry = (zeros, jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, model_state))
    (grads, ce_sum, state_new), _ = jax.lax.scan(accumulate, carry, jax.tree.map(split, batch))
    return ce_sum / total_tokens, grads, state_new


def train_step(state: TrainState, batch: Batch, sc: StepConfig,
               constrain_grads: Callable[[Any], Any] = lambda g: g) -> tuple[TrainState, dict]:
    """One optimizer step on a global batch; returns the new state and scalar metrics."""
    loss, grads, model_state = loss_grads_and_state(state.params, state.model_state, batch, state.loss_scale,
                                                    sc, constrain_grads)
    grads = jax.tree.map(lambda g: g / state.loss_scale, grads)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

    updates, opt_state = sc.tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
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
    metrics = {"loss": loss, "grad_norm": grad_norm, "lr": sc.lr_schedule(state.step),
               "loss_scale": state.loss_scale, "skipped": (~finite).astype(jnp.int32),
               "tokens": batch["loss_mask"].astype(jnp.float32).sum()}
    if sc.pipeline is not None:  # the idle fraction of the schedule's table (parallel/pipeline.py)
        metrics["pipeline_bubble"] = jnp.asarray(sc.pipeline.schedule.bubble(), jnp.float32)
    return new_state, metrics
