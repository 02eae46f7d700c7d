"""SwiGLU gating dispatch: `swiglu(gate, up) = silu(gate) * up`.

- `autodiff`: `jax.nn.silu(gate) * up`, differentiated by JAX, which saves gate, up, sigmoid(gate)
  and silu(gate) for the backward pass: four [B, T, F] tensors per layer (five with the output,
  which the down projection saves). What runs everywhere except in the trainer's step on one CPU
  device.
- `recompute`: the same forward with a custom VJP that saves only gate and up and recomputes the
  sigmoid in the backward pass. Used where `ops.target.one_cpu_device()`, like the other CPU
  formulations: on the CPU benchmark the layer scan's residual stacks (zero fill,
  dynamic-update-slice, dynamic-slice) cost more than the recomputed sigmoid (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import jax

from lumen_jax.ops.target import one_cpu_device


def swiglu(gate_btf: jax.Array, up_btf: jax.Array) -> jax.Array:
    """`silu(gate) * up` ([B, T, F] each); gradients equal autodiff's to float32 rounding."""
    if one_cpu_device():
        return _swiglu_recompute(gate_btf, up_btf)
    return jax.nn.silu(gate_btf) * up_btf


@jax.custom_vjp
def _swiglu_recompute(gate_btf: jax.Array, up_btf: jax.Array) -> jax.Array:
    return jax.nn.silu(gate_btf) * up_btf


def _swiglu_fwd(gate_btf, up_btf):
    return _swiglu_recompute(gate_btf, up_btf), (gate_btf, up_btf)


def _swiglu_bwd(residuals, dh_btf):
    gate, up = residuals
    sig = jax.nn.sigmoid(gate)
    # d silu / d gate = sig + gate * sig * (1 - sig)
    dgate = dh_btf * up * (sig * (1 + gate * (1 - sig)))
    dup = dh_btf * (gate * sig)
    return dgate.astype(gate.dtype), dup.astype(up.dtype)


_swiglu_recompute.defvjp(_swiglu_fwd, _swiglu_bwd)
