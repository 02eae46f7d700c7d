"""What our program measured on a GPU (docs/PERFORMANCE.md, "GPU figures"), kept as data: the fused
attention kernels alone (`KERNELS`) and whole training steps (`STEPS`), each with its device, date
and command. The planner runs a fused kernel at the rates measured here (`kernel_rates`), and
tests/plan/test_measured.py holds the planner's step time to every step recorded here.

A kernel's rate is a fraction of the measuring device's datasheet peak in the compute dtype
(causal attention counted as half the square, as the FLOP count does); the planner applies the
same fraction to the device it plans for. The backward's rate counts it as two forwards.
"""

from __future__ import annotations

import dataclasses
import math

from lumen_jax.metrics import mfu


@dataclasses.dataclass(frozen=True)
class KernelTiming:
    """One attention call timed alone: `tokens` per call (batch x `seq_len`), `heads` query heads."""

    kernel: str  # flash (ours) | cudnn
    device: str  # the device kind as jax reports it
    date: str
    seq_len: int
    head_dim: int
    heads: int
    causal: bool
    tokens: int
    forward_ms: float
    forward_backward_ms: float

    @property
    def forward_flops(self) -> float:
        """QK^T and PV: 4 x tokens x seq_len x heads x head_dim, half of it under the causal mask."""
        return 4.0 * self.tokens * self.seq_len * self.heads * self.head_dim * (0.5 if self.causal else 1.0)

    def rates(self, dtype: str = "bfloat16") -> tuple[float, float]:
        """(forward, backward) fractions of the device's peak in `dtype`."""
        peak = mfu.device_peak_flops(self.device, dtype)
        backward_ms = self.forward_backward_ms - self.forward_ms
        return (self.forward_flops / (self.forward_ms * 1e-3) / peak,
                2.0 * self.forward_flops / (backward_ms * 1e-3) / peak)


@dataclasses.dataclass(frozen=True)
class StepTiming:
    """One training step timed: `python -m lumen_jax.train --config <config> <overrides>` on
    `devices` devices, and how that program differed from today's (`predict`'s keywords)."""

    config: str
    overrides: tuple[str, ...]
    device: str  # a key of plan.hardware.DEVICES
    devices: int
    date: str
    command: str
    step_ms: float  # median of the timed steps
    program: dict[str, object]  # keywords of `predict` that plan the program as it was measured


H200 = "NVIDIA H200"
GPU_CHECK = "python benchmarks/gpu_check.py --budget-s 330 (jax 0.11.2, the device image's)"

# gpu_check.py (a), 2026-12-04: bf16, head dim 128, 16 heads, 16k tokens per call.
KERNELS = tuple(
    KernelTiming(kernel, H200, "2026-12-04", seq_len, 128, 16, causal, 16384, fwd, fwd_bwd)
    for kernel, seq_len, causal, fwd, fwd_bwd in (
        ("flash", 2048, True, 0.668, 2.669), ("cudnn", 2048, True, 0.527, 1.644),
        ("flash", 2048, False, 0.945, 4.411), ("cudnn", 2048, False, 0.735, 2.343),
        ("flash", 8192, True, 2.013, 8.778), ("cudnn", 8192, True, 1.265, 4.126),
        ("flash", 8192, False, 2.974, 16.085), ("cudnn", 8192, False, 2.010, 7.369),
    ))

# gpu_check.py (b), 2026-12-04: llama3_1b on one H200, 2 x 8192 tokens, median of 27 steps. The
# program then ran the attention forward again in the backward (the remat policy saved neither the
# kernel's output nor its log-sum-exp) and built the loss's float32 [tokens, vocab] logits.
STEPS = (
    StepTiming("configs/llama3_1b.yaml", ("data.global_batch_size=2",), "h200", 1, "2026-12-04", GPU_CHECK,
               452.0, {"attention": "flash", "kernel_kept": False, "loss": "float32"}),
)


def kernel_rates(kernel: str, seq_len: int, causal: bool = True,
                 table: tuple[KernelTiming, ...] = KERNELS) -> tuple[float, float]:
    """(forward, backward) fractions of the peak of `kernel` (flash | cudnn): the measured row of
    the same masking whose sequence length is nearest `seq_len` (in ratio)."""
    rows = [t for t in table if t.kernel == kernel and t.causal == causal]
    if not rows:
        raise ValueError(f"no measured rate of the {kernel!r} attention kernel (causal={causal})")
    return min(rows, key=lambda t: abs(math.log(t.seq_len / seq_len))).rates()
