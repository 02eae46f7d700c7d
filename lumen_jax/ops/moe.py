"""Mixture-of-experts dispatch: `moe(x, weights, cfg, ops)`, router in float32 and routed experts.

The router is a linear gate computed in float32 on the whole (global) batch (`route`):

- scores: `softmax` over all experts (Mixtral, Qwen), or `sigmoid` per expert (DeepSeek-V3).
- the choice: each token's top-k experts by score + bias (`balance: bias`: a per-expert bias that
  steers the choice only, never the weights); with `groups` > 1 the experts form equal groups and a
  token chooses among the `top_groups` groups whose two best scores (+ bias) sum highest (DeepSeek-V3).
- the weights: the chosen experts' scores, divided by their sum when `normalize_top_k`, times
  `routed_scaling`.

Its auxiliary losses (returned, and added to the objective by the train step like any auxiliary
term of the model's output):

- load balancing (Switch Transformer) `num_experts * sum_i f_i * P_i`, with f_i the fraction of the
  token-expert assignments routed to expert i (before capacity drops; sum_i f_i = 1) and P_i the
  mean router probability of expert i (sigmoid: the scores normalised per token); 1 when uniform.
  The sequence-wise variant (DeepSeek-V3) takes f and P per sequence (a row of the batch) and
  averages the rows' losses.
- router z-loss (ST-MoE) `mean(logsumexp(logits)^2)`.

Aux-loss-free balancing (`balance: bias`, DeepSeek-V3): the layer keeps two `ModelState` vectors
[E], the bias and the load (token-expert assignments per expert) of the last step. The bias a step
chooses with is `bias + bias_update_rate * sign(mean(load) - load)`: DeepSeek-V3's update after each
step, applied when the next step reads it, so the counts are those of the whole global batch
(micro-batches and replica groups add their loads, `ExpertLoad.combine`) before the sign is
taken. Through the generic model-state path (ops/state.py) the step's "gradient" of the bias is
the bias it chose with, that of the load the assignments it counted.

The routed tokens go through `lumen_jax.parallel.expert.dispatch` (sorted by expert, grouped
matmuls, all-to-all over the `expert` mesh axis); `Ops.moe_exchange` says how rows cross devices,
`Ops.moe_matmul` how the experts' grouped matmuls run (`ops.grouped`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from lumen_jax.config import MoeConfig
from lumen_jax.ops import grouped
from lumen_jax.ops.choice import Ops
from lumen_jax.ops.state import ModelState
from lumen_jax.ops.projection import Tape
from lumen_jax.parallel import context as context_lib
from lumen_jax.parallel import expert, shard

WEIGHTS = ("w_gate", "w_up", "w_down")  # the MoE layer's attributes (`Tape.grouped`)


class RouterBias(ModelState):
    """balance=bias: the per-expert bias [E] added to the scores for the choice. Every micro-batch
    and replica emits the same next value (the bias the step chose with): the default rule keeps one."""


class ExpertLoad(ModelState):
    """balance=bias: the token-expert assignments per expert [E] of the last step (integer-valued
    float32, exact up to 2^24 per expert). Micro-batches and replicas each count their tokens: add."""

    combine = staticmethod(jnp.add)


def balance_state(cfg: MoeConfig) -> nnx.Dict | None:
    """The state one MoE layer keeps for `balance: bias` ({"bias", "load"}: [E] each), else None."""
    if cfg.balance != "bias":
        return None
    zeros = jnp.zeros((cfg.num_experts,), jnp.float32)
    return nnx.Dict({"bias": RouterBias(zeros, out_sharding=(None,)), "load": ExpertLoad(zeros, out_sharding=(None,))})


def choice_bias(bias_e: jax.Array, load_e: jax.Array, rate: float) -> jax.Array:
    """The bias a step chooses with: `bias + rate * sign(mean(load) - load)` (DeepSeek-V3's update of
    the last step's bias from the last step's load; a fresh load of zeros leaves the bias as it is)."""
    return bias_e + rate * jnp.sign(load_e.mean() - load_e)


@jax.custom_vjp
def _emit_state(weights_btk: jax.Array, bias_e: jax.Array, load_e: jax.Array, next_bias_e: jax.Array,
                next_load_e: jax.Array) -> jax.Array:
    """Identity on the router weights whose VJP gives the state's next values as its cotangents
    (overwrite-with-gradient, ops/state.py)."""
    return weights_btk


def _emit_fwd(weights_btk, bias_e, load_e, next_bias_e, next_load_e):
    return weights_btk, (next_bias_e, next_load_e)


def _emit_bwd(res, g_btk):
    next_bias_e, next_load_e = res
    return g_btk, next_bias_e, next_load_e, jnp.zeros_like(next_bias_e), jnp.zeros_like(next_load_e)


_emit_state.defvjp(_emit_fwd, _emit_bwd)


def _top_k_ids(choice_bte: jax.Array, cfg: MoeConfig) -> jax.Array:
    """Each token's `top_k` experts by `choice_bte`, from its `top_groups` best groups when `groups` > 1."""
    if cfg.groups > 1:
        b, t, e = choice_bte.shape
        per = e // cfg.groups
        grouped = choice_bte.reshape(b, t, cfg.groups, per)
        group_score = jax.lax.top_k(grouped, min(2, per))[0].sum(-1)  # [B, T, G]: the two best of each group
        _, keep = jax.lax.top_k(group_score, cfg.top_groups)
        kept = jax.nn.one_hot(keep, cfg.groups, dtype=jnp.bool_).any(-2)  # [B, T, G]
        choice_bte = jnp.where(jnp.repeat(kept, per, axis=-1), choice_bte, -jnp.inf)
    return jax.lax.top_k(choice_bte, cfg.top_k)[1]


def _balance_loss(ids_btk: jax.Array, probs_bte: jax.Array, num_experts: int, axes: tuple[int, ...]) -> jax.Array:
    """`num_experts * sum_i f_i P_i` with f and P averaged over `axes` (the rest: one loss each)."""
    k = ids_btk.shape[-1]
    f = jax.nn.one_hot(ids_btk, num_experts, dtype=jnp.float32).sum(-2).mean(axes) / k
    return num_experts * jnp.sum(jax.lax.stop_gradient(f) * probs_bte.mean(axes), axis=-1)


def _sequence_balance_loss(ids_btk: jax.Array, probs_bte: jax.Array, num_experts: int, context: bool) -> jax.Array:
    """`_balance_loss` per row, averaged over the rows. Under context parallelism (`context`) a row's
    tokens lie on several devices, and inside the step's replica vmap (several micro-batches,
    `context` a replica axis) the array a step sees holds one device's chunk of every row: each
    device sums its chunk's f and P and the sums are added over `context` (a mean over the chunk
    alone weighed each chunk as a sequence of its own: the router's gradients 0.24% off)."""
    if not context:
        return _balance_loss(ids_btk, probs_bte, num_experts, (1,)).mean()

    def per_row(ids, probs):  # over the mesh's `context` axis by name: inside the vmap `seq` maps to none
        add = lambda x: jax.lax.psum(x, context_lib.AXIS)  # noqa: E731
        t, k = add(jnp.asarray(ids.shape[1], jnp.float32)), ids.shape[-1]
        f = add(jax.nn.one_hot(ids, num_experts, dtype=jnp.float32).sum((1, 2))) / (t * k)
        return num_experts * jnp.sum(jax.lax.stop_gradient(f) * add(probs.sum(1)) / t, axis=-1)

    return shard.per_device(per_row, in_axes=(("batch", "seq", None), ("batch", "seq", None)),
                            out_axes=("batch",))(ids_btk, probs_bte).mean()


def route(x_btd: jax.Array, w_router_de: jax.Array, cfg: MoeConfig,
          state: dict[str, jax.Array] | None = None, context: bool = False) -> tuple[jax.Array, jax.Array, dict]:
    """Each token's experts and their weights (see the module docstring).

    Args:
      x_btd: the (normed) tokens [B, T, D]; w_router_de: the router [D, E].
      state: balance=bias only, the layer's {"bias", "load"} [E] (`balance_state`).
      context: the rows' tokens are split over `context` (`Ops.context`): the per-row statistics
        of `sequence_balance_loss` add up over its devices (`_sequence_balance_loss`).

    Returns:
      (expert ids [B, T, K] int32, weights [B, T, K] float32, stats): stats {balance_loss,
      sequence_balance_loss, router_z_loss: scalars, fraction [E]: f_i, load [E]: assignments per expert}.
    """
    logits = jnp.einsum("btd,de->bte", x_btd.astype(jnp.float32), w_router_de.astype(jnp.float32))
    if cfg.router == "softmax":
        scores = probs = jax.nn.softmax(logits, axis=-1)
    else:
        scores = jax.nn.sigmoid(logits)
        probs = scores / scores.sum(-1, keepdims=True)
    choice = jax.lax.stop_gradient(scores)
    if state is not None:
        bias = choice_bias(*(jax.lax.stop_gradient(state[k]) for k in ("bias", "load")), cfg.bias_update_rate)
        choice = choice + bias
    ids = _top_k_ids(choice, cfg)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.normalize_top_k:
        weights = weights / weights.sum(-1, keepdims=True)
    weights = weights * cfg.routed_scaling
    e = cfg.num_experts
    load = jax.nn.one_hot(ids, e, dtype=jnp.float32).sum((0, 1, 2))
    if state is not None:
        weights = _emit_state(weights, state["bias"], state["load"], bias, load)
    stats = {"balance_loss": _balance_loss(ids, probs, e, (0, 1)),
             "sequence_balance_loss": _sequence_balance_loss(ids, probs, e, context),
             "router_z_loss": jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1))),
             "fraction": load / load.sum(), "load": load}
    return ids.astype(jnp.int32), weights, stats


def moe(x_btd: jax.Array, w_router_de: jax.Array, w_gate_edf: jax.Array, w_up_edf: jax.Array,
        w_down_efd: jax.Array, cfg: MoeConfig, ops: Ops,
        state: dict[str, jax.Array] | None = None, tape: Tape | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The routed experts' output [B, T, D] and the layer's auxiliary terms.

    `state`: balance=bias only, the layer's {"bias", "load"} (`route`).
    `tape`: a split backward's tape of the layer (`ops.projection.Taps`), or None.

    Returns:
      (y_btd in x's dtype, aux): aux["loss"] is the weighted sum of the auxiliary losses (what the
      objective adds), the other entries are metrics (`moe/...`, scalars).
    """
    ids, weights, stats = route(x_btd, w_router_de, cfg, state, ops.context)
    y_btd, kept = routed_experts(x_btd, ids, weights, w_gate_edf, w_up_edf, w_down_efd,
                                 capacity_factor=cfg.capacity_factor, exchange=ops.moe_exchange,
                                 matmul=ops.moe_matmul, tape=tape)
    loss = cfg.aux_loss_weight * stats["balance_loss"] + cfg.router_z_loss_weight * stats["router_z_loss"]
    aux = {
        "moe/balance_loss": stats["balance_loss"],
        "moe/router_z_loss": stats["router_z_loss"],
        "moe/expert_fraction_min": stats["fraction"].min(),
        "moe/expert_fraction_max": stats["fraction"].max(),
        "moe/dropped_fraction": 1.0 - kept.astype(jnp.float32).mean(),
    }
    if cfg.sequence_aux_loss_weight:
        loss = loss + cfg.sequence_aux_loss_weight * stats["sequence_balance_loss"]
        aux["moe/sequence_balance_loss"] = stats["sequence_balance_loss"]
    return y_btd, {"loss": loss, **aux}


def routed_experts(x_btd: jax.Array, ids_btk: jax.Array, weights_btk: jax.Array, w_gate_edf: jax.Array,
                   w_up_edf: jax.Array, w_down_efd: jax.Array, *, capacity_factor: float | None,
                   exchange: str = "padded", matmul: str = "blocks",
                   tape: Tape | None = None) -> tuple[jax.Array, jax.Array]:
    """Each token's routed experts' combined output: `parallel.expert.dispatch` with the experts'
    SwiGLU as `ops.grouped` runs it (`matmul`: blocks | ragged).

    `tape`: a split backward's tape of the layer (`ops.projection.Tape.grouped`): the grouped matmuls'
    weight gradients wait for the weight unit (`expert.replay` of `grouped.replay`), their rows
    recorded on each device.

    Returns:
      (y [B, T, D] in x's dtype, kept [B, T, K]: which assignments an expert took).
    """
    taps = None if tape is None else tape.grouped("experts", WEIGHTS)  # [devices, ...]; None probing
    devices = shard.axes_size(expert.DEVICE)
    local_replay = functools.partial(grouped.replay, form=matmul)

    def experts(rows, row_a, group_a, local_weights, expected_rows, tap):
        if tape is not None and tape.probe:  # this device's taps, one block of [devices, ...]
            shapes = grouped.tap_shapes(rows, group_a.shape[0], local_weights, matmul, expected_rows=expected_rows)
            tape.grouped("experts", WEIGHTS, {k: jax.ShapeDtypeStruct((devices, *v.shape), v.dtype)
                                              for k, v in shapes.items()},
                         functools.partial(expert.replay, local_replay=local_replay))
        return grouped.swiglu(rows, row_a, group_a, local_weights, matmul, expected_rows=expected_rows, tap=tap)

    return expert.dispatch(x_btd, ids_btk, weights_btk, w_gate_edf, w_up_edf, w_down_efd,
                           capacity_factor=capacity_factor, experts=experts, exchange=exchange, taps=taps)
