"""SwiGLU gating: `swiglu(gate, up) = silu(gate) * up`, saving only gate and up for the backward pass.

`jax.nn.silu(gate) * up`, differentiated by JAX, saves gate, up, sigmoid(gate) and silu(gate): four
[B, T, F] tensors per layer (six F-wide rows in all with the product and the down projection's
input), where gate and up suffice: the backward recomputes the sigmoid (elementwise, memory-bound
work of one pass over gate), as Megatron's fused bias-SwiGLU does. Under the remat policies that
save the projections (dots) gate and up are saved anyway; under `none` this keeps a layer's saved
activations near Korthikanti's count. On the CPU benchmark the saved stacks cost more time than the
recomputed sigmoid too (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import jax


@jax.custom_vjp
def swiglu(gate_btf: jax.Array, up_btf: jax.Array) -> jax.Array:
    """`silu(gate) * up` ([B, T, F] each); gradients equal autodiff's to float32 rounding."""
    return jax.nn.silu(gate_btf) * up_btf


def _swiglu_fwd(gate_btf, up_btf):
    return swiglu(gate_btf, up_btf), (gate_btf, up_btf)


def _swiglu_bwd(residuals, dh_btf):
    gate, up = residuals
    sig = jax.nn.sigmoid(gate)
    # d silu / d gate = sig + gate * sig * (1 - sig)
    dgate = dh_btf * up * (sig * (1 + gate * (1 - sig)))
    dup = dh_btf * (gate * sig)
    return dgate.astype(gate.dtype), dup.astype(up.dtype)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)
