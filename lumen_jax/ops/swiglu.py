"""SwiGLU gating dispatch: `swiglu(gate, up, ops) = silu(gate) * up`.

`jax.nn.silu(gate) * up`, differentiated by JAX, saves gate, up, sigmoid(gate) and silu(gate) for
the backward pass: four [B, T, F] tensors per layer (five with the output, which the down
projection saves). In the trainer's step on one CPU device (`Ops.cpu`) `ops.cpu.swiglu_recompute`
saves only gate and up and recomputes the sigmoid.
"""

from __future__ import annotations

import jax

from lumen_jax.ops import cpu
from lumen_jax.ops.choice import Ops


def swiglu(gate_btf: jax.Array, up_btf: jax.Array, ops: Ops) -> jax.Array:
    """`silu(gate) * up` ([B, T, F] each); gradients equal autodiff's to float32 rounding."""
    if ops.cpu:
        return cpu.swiglu_recompute(gate_btf, up_btf)
    return jax.nn.silu(gate_btf) * up_btf
