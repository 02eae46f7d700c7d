"""The CPU formulations: what the trainer's step on a mesh of one CPU device runs (`Ops.cpu`).

Each computes what the plain formulation computes (gradients to float32 rounding) in a form that
XLA:CPU runs faster on one device (docs/PERFORMANCE.md, CPU section). `ops.choice.choose` picks them
for that mesh only; everything else keeps the plain formulations, unchanged:

- programs partitioned over several devices: with these formulations, the graph of an 8-device
  emulated CPU mesh hit XLA:CPU's collective-rendezvous abort far more often (5819d50); their HLO
  stays exactly what it was;
- other backends (the formulations were measured on CPU only);
- the model traced outside the trainer, e.g. `lumen_jax.plan`'s residual probe, whose counts
  describe the plain formulation that the partitioned and GPU programs run.

The two:

- `token_grad_project` (`ops.projection`): the einsum with a custom VJP whose weight gradient is one
  einsum over the token axes, `einsum("btd,btf->df", x, dy)`. JAX transposes the weight's einsum
  into `dot(dy, x)` followed by a transpose, which XLA:CPU compiles into a strided transposing copy
  of the (wide) output gradient feeding a slower matmul; written over the tokens, the only copy is
  of `x` and the matmul is a YNNPACK fusion (-19% CPU time of the CPU benchmark's step). Cost: the
  custom VJP's weight residual is a value of its own, so the layer scan stacks a copy of the layer
  weights for the backward pass (float32: +16 MB on the benchmark's model), where the plain einsum
  reads the scanned weights in place. Remat policies see it as its dot (`ops.projection.remat_policy`).
- `heads_first_attention` (`ops.attention`): the reference attention's output in a heads-first
  layout with the closed-form softmax gradient.
(A third, SwiGLU saving only gate and up, is now every program's: `ops.swiglu`.)
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from lumen_jax.ops.reference import mask


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


def heads_first_attention(q_btnh: jax.Array, k_bskh: jax.Array, v_bskh: jax.Array,
                          segment_ids_bt: jax.Array | None, causal: bool, scale: float,
                          window: int = 0) -> jax.Array:
    """`ops.attention.reference`'s output in a heads-first layout that XLA:CPU runs faster.

    Keys/values [B, K, S, H] and queries [B, K, G*T, H] (the G query heads of one K/V head stacked
    along the rows): both matmuls and the softmax work on contiguous [G*T, S] blocks, so XLA:CPU
    needs no strided copies of the scores, forward or backward (the reference's einsums give
    [B, K, G, T, S] scores that it transposed). The softmax's gradient is its closed form
    `p * (dp - sum(p * dp))` (`jax.softmax_custom_jvp`), which saves only the probabilities for
    the backward pass; differentiated through exp, sum and divide it saved the unnormalised
    exponentials, 1/sum^2 and the probabilities. Same values; gradients to float32 rounding.
    """
    b, t, n, h = q_btnh.shape
    s, kh = k_bskh.shape[1], k_bskh.shape[2]
    g = n // kh
    q_bkrh = q_btnh.reshape(b, t, kh, g, h).transpose(0, 2, 3, 1, 4).reshape(b, kh, g * t, h)
    k_bksh, v_bksh = k_bskh.transpose(0, 2, 1, 3), v_bskh.transpose(0, 2, 1, 3)
    batch = ((0, 1), (0, 1))  # (batch, kv head)
    scores = jax.lax.dot_general(q_bkrh, k_bksh, (((3,), (3,)), batch),
                                 preferred_element_type=jnp.float32) * scale
    keep = mask(t, s, causal, segment_ids_bt, segment_ids_bt, window)  # [B|1, 1, 1, T, S]
    keep = jnp.broadcast_to(keep, (keep.shape[0], 1, g, t, s)).reshape(keep.shape[0], 1, g * t, s)
    scores = jnp.where(keep, scores, jnp.finfo(jnp.float32).min)
    with jax.softmax_custom_jvp(True):
        probs = jax.nn.softmax(scores, axis=-1).astype(v_bskh.dtype)
    out = jax.lax.dot_general(probs, v_bksh, (((3,), (2,)), batch), preferred_element_type=jnp.float32)
    hv = v_bskh.shape[-1]  # the values' head dim (MLA's may differ from the queries')
    return out.reshape(b, kh, g, t, hv).transpose(0, 3, 1, 2, 4).reshape(b, t, n, hv).astype(q_btnh.dtype)

