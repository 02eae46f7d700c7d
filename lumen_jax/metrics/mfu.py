"""Peak FLOP/s, throughput, MFU/HFU of a measured step.

The FLOP counts that MFU and HFU divide are `lumen_jax.metrics.flops` (pure, shared with the planner); the
formulas and the remat approximations are written out with a worked example in docs/FLOPS.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from lumen_jax.config import ModelConfig
from lumen_jax.metrics import flops as flops_lib

# --------------------------------------------------------------------------------------------------
# Peak FLOP/s
# --------------------------------------------------------------------------------------------------

# Dense (no 2:4 sparsity) tensor-core peaks from NVIDIA datasheets, per GPU. `tf32` is also the
# peak for float32 matmuls: XLA's default precision on these GPUs runs f32 dots as TF32; float16
# shares the bf16 peak. The first pattern found in the lower-cased `device.device_kind` wins, so
# variants come before the family name.
_PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    ("h200 nvl", {"bf16": 835e12, "fp8": 1670e12, "tf32": 417e12}),
    ("h200", {"bf16": 989e12, "fp8": 1979e12, "tf32": 494.7e12}),  # also matches GH200
    ("h100 pcie", {"bf16": 756e12, "fp8": 1513e12, "tf32": 378e12}),
    ("h100 nvl", {"bf16": 835e12, "fp8": 1670e12, "tf32": 417e12}),
    ("h100", {"bf16": 989e12, "fp8": 1979e12, "tf32": 494.7e12}),  # SXM: "NVIDIA H100 80GB HBM3"
    ("a100", {"bf16": 312e12, "tf32": 156e12}),
)

_DTYPE_ALIASES = {
    "bfloat16": "bf16", "bf16": "bf16", "float16": "bf16", "fp16": "bf16", "half": "bf16",
    "float32": "tf32", "fp32": "tf32", "tf32": "tf32", "tfloat32": "tf32",
    "fp8": "fp8", "float8": "fp8", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8",
}


def device_peak_flops(device_kind: str, dtype: str) -> float | None:
    """Datasheet dense matmul peak FLOP/s of one device, or None when the kind or dtype is unknown.

    Args:
        device_kind: `jax.Device.device_kind`, e.g. "NVIDIA H100 80GB HBM3" or "NVIDIA H200".
        dtype: matmul input dtype: bfloat16 / float16, float32 (as TF32), fp8 (float8_e4m3fn ...).
    """
    key = _DTYPE_ALIASES.get(dtype.lower())
    kind = device_kind.lower()
    for pattern, peaks in _PEAKS:
        if pattern in kind:
            return peaks.get(key) if key else None
    return None


@functools.lru_cache(maxsize=None)
def measure_cpu_matmul_peak(dtype: str = "float32", n: int = 1024, repeats: int = 5) -> float:
    """Best observed FLOP/s of a jitted n x n matmul on the first CPU device (~0.1-0.5 s, cached).

    Args:
        dtype: a jnp dtype name, e.g. "float32" or "bfloat16".
        n: matrix side; 2 * n**3 FLOPs per matmul.
        repeats: timed calls after one warm-up call; stops early past 0.5 s.
    """
    device = jax.devices("cpu")[0]
    a = jax.device_put(jnp.ones((n, n), dtype), device)
    matmul = jax.jit(jnp.matmul)
    matmul(a, a).block_until_ready()  # compile
    best, spent = math.inf, 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, a).block_until_ready()
        elapsed = time.perf_counter() - start
        best, spent = min(best, elapsed), spent + elapsed
        if spent > 0.5:
            break
    return 2.0 * n**3 / best


def peak_flops_per_device(devices: Sequence[Any], dtype: str) -> tuple[float | None, str]:
    """Peak FLOP/s of one device from the datasheet table, or measured on CPU.

    Emulated CPU devices share one host's cores, so the measured host peak is divided among the
    process's CPU devices.

    Args:
        devices: the run's devices (`jax.devices()`); all are assumed to be of one kind.
        dtype: the compute dtype, as in `device_peak_flops`.

    Returns:
        (peak FLOP/s or None when unknown, a one-line description of where the number came from).
    """
    kind, platform = devices[0].device_kind, devices[0].platform
    peak = device_peak_flops(kind, dtype)
    if peak is not None:
        return peak, f"datasheet: {kind} {dtype} {peak / 1e12:.1f} TFLOP/s"
    if platform == "cpu":
        if _DTYPE_ALIASES.get(dtype.lower()) == "fp8":  # no fp8 units: XLA:CPU upcasts fp8 matmuls
            dtype = "float32"
        host = measure_cpu_matmul_peak(dtype)
        share = max(1, len(jax.local_devices(backend="cpu")))
        return host / share, (f"measured: cpu {dtype} matmul {host / 1e9:.1f} GFLOP/s per host, "
                              f"shared by {share} device(s)")
    return None, f"unknown peak for {kind!r} {dtype}; MFU/HFU not reported"


@dataclasses.dataclass(frozen=True)
class Peaks:
    """The peak FLOP/s of one device that a run's MFU and HFU are measured against."""

    per_device: float | None  # the matmuls' dtype: fp8 with fp8 matmuls, else the compute dtype
    source: str  # where `per_device` came from (`peak_flops_per_device`)
    bf16_per_device: float | None  # with fp8 matmuls, the bf16 peak (for `mfu_bf16`); else None


def model_peaks(cfg: ModelConfig, devices: Sequence[Any]) -> Peaks:
    """The peaks for a model: with fp8 matmuls MFU is against the fp8 peak (`mfu`) and against the
    bf16 one (`mfu_bf16`), otherwise against the compute dtype's peak.

    Args:
        cfg: the model (its `fp8.recipe` and `compute_dtype`).
        devices: the run's devices (`jax.devices()`), as in `peak_flops_per_device`.
    """
    fp8 = cfg.fp8.recipe != "none"
    peak, source = peak_flops_per_device(devices, "fp8" if fp8 else cfg.compute_dtype)
    bf16_peak = peak_flops_per_device(devices, "bfloat16")[0] if fp8 else None
    return Peaks(per_device=peak, source=source, bf16_per_device=bf16_peak)


# --------------------------------------------------------------------------------------------------
# Step metrics
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StepMetrics:
    """Throughput and utilisation of a training step; MFU and HFU are None without a peak."""

    step_time_s: float
    tokens_per_sec: float
    tokens_per_sec_per_device: float
    tflops_per_device: float  # achieved model TFLOP/s per device
    mfu: float | None
    hfu: float | None
    mfu_bf16: float | None = None  # with fp8 matmuls: MFU against the bf16 peak (`mfu` uses the fp8 one)

    @classmethod
    def compute(cls, step_time_s: float, tokens_per_step: int, num_devices: int,
                flops_per_token: float, hw_flops_per_token: float,
                peak_flops_per_device: float | None,
                bf16_peak_flops_per_device: float | None = None) -> "StepMetrics":
        """Derives the metrics from a measured step time.

        Args:
            step_time_s: wall-clock seconds per step (> 0).
            tokens_per_step: tokens in the global batch, all micro-batches included.
            num_devices: devices the step ran on.
            flops_per_token: model FLOPs per token (`flops_per_token`).
            hw_flops_per_token: hardware FLOPs per token (`hardware_flops_per_token`).
            peak_flops_per_device: peak FLOP/s of one device, or None.
            bf16_peak_flops_per_device: with fp8 matmuls (`peak_flops_per_device` is then the fp8
                peak), the bf16 peak for `mfu_bf16`; None otherwise.
        """
        if step_time_s <= 0 or num_devices <= 0:
            raise ValueError(f"{step_time_s=} and {num_devices=} must be positive")
        tps = tokens_per_step / step_time_s
        per_device = tps / num_devices
        peak = peak_flops_per_device
        return cls(step_time_s=step_time_s, tokens_per_sec=tps,
                   tokens_per_sec_per_device=per_device,
                   tflops_per_device=per_device * flops_per_token / 1e12,
                   mfu=per_device * flops_per_token / peak if peak else None,
                   hfu=per_device * hw_flops_per_token / peak if peak else None,
                   mfu_bf16=(per_device * flops_per_token / bf16_peak_flops_per_device
                             if bf16_peak_flops_per_device else None))

    def as_dict(self) -> dict[str, float]:
        """The non-None fields, for a writer."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclasses.dataclass(frozen=True)
class Throughput:
    """What turns a measured step time into tokens/s, MFU and HFU for one run."""

    tokens_per_step: int  # the global batch's tokens, all micro-batches included
    num_devices: int
    flops_per_token: float  # model FLOPs (`flops.flops_per_token`)
    hw_flops_per_token: float  # hardware FLOPs (`flops.hardware_flops_per_token`)
    peaks: Peaks

    @classmethod
    def of(cls, model: ModelConfig, seq_len: int, global_batch_size: int, devices: Sequence[Any]) -> "Throughput":
        """The run's counts."""
        return cls(tokens_per_step=global_batch_size * seq_len, num_devices=len(devices),
                   flops_per_token=flops_lib.flops_per_token(model, seq_len),
                   hw_flops_per_token=flops_lib.hardware_flops_per_token(model, seq_len),
                   peaks=model_peaks(model, devices))

    def measure(self, step_time_s: float) -> StepMetrics:
        """StepMetrics of a step that took `step_time_s` seconds."""
        return StepMetrics.compute(
            step_time_s=step_time_s, tokens_per_step=self.tokens_per_step, num_devices=self.num_devices,
            flops_per_token=self.flops_per_token, hw_flops_per_token=self.hw_flops_per_token,
            peak_flops_per_device=self.peaks.per_device, bf16_peak_flops_per_device=self.peaks.bf16_per_device)
