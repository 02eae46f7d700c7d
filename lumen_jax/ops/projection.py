"""Projection dispatch: `project(spec, x, w, ops, ...)`, the einsum of activations and a weight.

The model computes every projection (Q/K/V/O, SwiGLU, logits) through `project`; `Ops.projection`
(chosen once when the step is built, `ops.choice`) says how it runs:

- `einsum`: `jnp.einsum(spec, x, w)` in the compute dtype, gradients by JAX's transpose rules.
- `token_grad`: the trainer's step on one CPU device: the same forward with the weight gradient
  written as one einsum over the token axes (`ops.cpu.token_grad_project`).
- `fp8`: the layer type runs fp8 matmuls (`ops.fp8.einsum` with the recipe of `model.fp8`; the
  delayed recipe's amax histories are the layer's model state, `ops.state`).
- `fp8_kept`: an fp8 layer type in a layer kept in the compute dtype (the first/last layer):
  the plain matmul in the form `ops.fp8.einsum` gives it.

A custom VJP reaches remat policies as one opaque `custom_vjp_call`: `remat_policy` wraps a
`jax.checkpoint_policies` policy so that it sees each `token_grad` projection as its dot.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.extend
import jax.numpy as jnp
from flax import nnx

from lumen_jax.ops import cpu, fp8
from lumen_jax.ops.choice import Ops


def project(spec: str, x: jax.Array, w: jax.Array, ops: Ops, layer_type: str | None = None,
            state: nnx.Dict | None = None, out_dtype: Any = None) -> jax.Array:
    """`jnp.einsum(spec, x, w)` of activations `x` (compute dtype) and a weight `w` (float32 master).

    Args:
      spec: an einsum whose second operand is the weight and whose output keeps x's leading
        (token) axes, e.g. `"btd,df->btf"`, `"btnh,nhd->btd"`.
      x: activations, e.g. [B, T, D].
      w: the weight, e.g. [D, F]; cast to x's dtype here (fp8 quantizes it from float32).
      ops: the implementation choice; `layer_type` (attention | mlp | None) selects fp8.
      state: this projection's model state (`projection_state`), or None.
      out_dtype: the einsum's `preferred_element_type` (float32 logits from bfloat16 inputs).

    Returns:
      The einsum's value; gradients equal the einsum's (float32: to rounding of the summation order).
    """
    how = ops.projection(layer_type)
    if how == "fp8":
        return fp8.einsum(spec, x, w, ops.fp8.recipe, state)
    if how == "fp8_kept":
        return fp8.einsum(spec, x, w, "none")
    w = w.astype(x.dtype)
    if how == "token_grad":
        return cpu.token_grad_project(spec, x, w, out_dtype)
    return jnp.einsum(spec, x, w, preferred_element_type=out_dtype)


def projection_state(ops: Ops, layer_type: str, projections: tuple[str, ...]) -> nnx.Dict | None:
    """The model state of a layer's projections `projections` (names), or None when they keep none
    (only fp8's delayed recipe does: an amax history per operand, `ops.fp8.histories`)."""
    if layer_type in ops.fp8_types and ops.fp8.recipe == "delayed":
        return fp8.histories(ops.fp8, projections)
    return None


def _only_dot(jaxpr: jax.extend.core.Jaxpr) -> jax.extend.core.JaxprEqn | None:
    """The dot_general of a jaxpr that computes one einsum and nothing else, else None."""
    dots, others = [], 0
    for eqn in jaxpr.eqns:
        subs = list(jax.extend.core.jaxprs_in_params(eqn.params))
        if eqn.primitive.name == "dot_general":
            dots.append(eqn)
        elif subs:
            found = [_only_dot(sub) for sub in subs]
            dots += [d for d in found if d is not None]
            others += sum(d is None for d in found)
        elif eqn.primitive.name not in ("convert_element_type", "transpose", "reshape"):
            others += 1
    return dots[0] if len(dots) == 1 and not others else None


def remat_policy(policy: Callable[..., Any]) -> Callable[..., Any]:
    """`policy` (a `jax.checkpoint_policies` policy) seeing each `token_grad` projection as its dot.

    Without this the dot-based policies (`dots_saveable`, ...) would save none of the projections
    and recompute them all. Other custom VJPs (fp8 dots, flash and context-parallel attention) are
    more than one dot and reach `policy` unchanged, so programs without `token_grad` see `policy`
    exactly.
    """
    def adapted(prim, *avals, **params):
        if prim.name == "custom_vjp_call":
            dot = _only_dot(params["call_jaxpr"].jaxpr)
            if dot is not None:
                return policy(dot.primitive, *avals, **dot.params)
        return policy(prim, *avals, **params)
    return adapted


def legacy_state_layout() -> tuple[str, Callable[[dict], dict], Callable[[dict], dict]]:
    """How checkpoints from before the generic model state stored it (b2eea75 and earlier): the
    TrainState field's old name and the conversions of its tree to and from that layout. They kept
    the delayed recipe's histories as `TrainState.fp8_state`, under `...attn.fp8.history.q.x` where
    the model now has `...attn.projections.q.x`."""
    key = "projections"  # the attribute `model.layers` keeps `projection_state` in
    return (fp8.LEGACY_FIELD, lambda tree: fp8.to_legacy(tree, key), lambda tree: fp8.from_legacy(tree, key))
