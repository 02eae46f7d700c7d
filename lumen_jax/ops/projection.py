"""Projection dispatch: `project(spec, x, w)`, the einsum of activations and a weight.

The model computes every projection (Q/K/V/O, SwiGLU, logits) through `project`. Implementations:

- `einsum`: `jnp.einsum(spec, x, w)`, gradients by JAX's transpose rules. What runs everywhere
  except in the trainer's step on one CPU device.
- `token_grad`: the same forward with a custom VJP whose weight gradient is one einsum over the
  token axes, `einsum("btd,btf->df", x, dy)`. JAX transposes the weight's einsum into
  `dot(dy, x)` followed by a transpose, which XLA:CPU compiles into a strided transposing copy of
  the (wide) output gradient feeding a slower matmul; written over the tokens, the only copy is of
  `x` and the matmul is a YNNPACK fusion (-19% CPU time of the CPU benchmark's step,
  docs/PERFORMANCE.md). Used where `ops.target.one_cpu_device()`: the trainer's step on a mesh of
  one CPU device (on an 8-device emulated CPU mesh it made XLA:CPU's collective-rendezvous abort
  far more frequent, 5819d50). Cost: the custom VJP's weight residual is a value of its own, so
  the layer scan stacks a copy of the layer weights for the backward pass (float32: +16 MB on the
  benchmark's model), where the plain einsum reads the scanned weights in place.

A custom VJP reaches remat policies as one opaque `custom_vjp_call`: `remat_policy` wraps a
`jax.checkpoint_policies` policy so that it sees each `token_grad` projection as its dot.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.extend
import jax.numpy as jnp

from lumen_jax.ops.target import one_cpu_device


def project(spec: str, x: jax.Array, w: jax.Array, out_dtype: Any = None) -> jax.Array:
    """`jnp.einsum(spec, x, w)` of activations `x` and a weight `w` already in the compute dtype.

    Args:
      spec: an einsum whose second operand is the weight and whose output keeps x's leading
        (token) axes, e.g. `"btd,df->btf"`, `"btnh,nhd->btd"`.
      x: activations, e.g. [B, T, D].
      w: the weight, e.g. [D, F].
      out_dtype: the einsum's `preferred_element_type` (float32 logits from bfloat16 inputs).

    Returns:
      The einsum's value; gradients equal the einsum's (float32: to rounding of the summation order).
    """
    if one_cpu_device():
        return token_grad_project(spec, x, w, out_dtype)
    return jnp.einsum(spec, x, w, preferred_element_type=out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def token_grad_project(spec: str, x: jax.Array, w: jax.Array, out_dtype: Any = None) -> jax.Array:
    """`jnp.einsum(spec, x, w)` with the weight gradient written as one einsum over the tokens."""
    return jnp.einsum(spec, x, w, preferred_element_type=out_dtype)


def _token_grad_fwd(spec, x, w, out_dtype):
    return token_grad_project(spec, x, w, out_dtype), (x, w)


def _token_grad_bwd(spec, out_dtype, residuals, dy):
    x, w = residuals
    inputs, out = spec.split("->")
    x_axes, w_axes = inputs.split(",")
    dx = jnp.einsum(f"{out},{w_axes}->{x_axes}", dy, w, preferred_element_type=x.dtype)
    dw = jnp.einsum(f"{x_axes},{out}->{w_axes}", x, dy, preferred_element_type=w.dtype)
    return dx.astype(x.dtype), dw.astype(w.dtype)


token_grad_project.defvjp(_token_grad_fwd, _token_grad_bwd)


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
