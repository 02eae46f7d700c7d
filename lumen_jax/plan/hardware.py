"""Accelerators, their links, and the parallel layout of a candidate run."""

from __future__ import annotations

import dataclasses

from lumen_jax import metrics
from lumen_jax.config import Config, ConfigError, ModelConfig, validate

AXES = ("pipeline", "data", "fsdp", "context", "tensor")  # outermost -> innermost (innermost: in a node)


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator and its links. Bandwidths are bytes/s per device, one direction."""

    kind: str  # a `device_kind` string that `metrics.device_peak_flops` knows
    memory_bytes: float
    nvlink_bytes_per_s: float = 900e9  # inside a node
    ib_bytes_per_s: float = 50e9  # across nodes (400 Gb/s NIC per GPU)
    devices_per_node: int = 8
    peak_flops: float | None = None  # None: the datasheet peak for the compute dtype

    def peak(self, dtype: str) -> float:
        peak = self.peak_flops or metrics.device_peak_flops(self.kind, dtype)
        if not peak:
            raise ConfigError(f"no peak FLOP/s known for {self.kind} {dtype}; pass --peak-tflops")
        return peak


DEVICES = {
    "h100": Hardware("NVIDIA H100 80GB HBM3", 80e9),
    "h200": Hardware("NVIDIA H200", 141e9),
    "a100": Hardware("NVIDIA A100-SXM4-80GB", 80e9, nvlink_bytes_per_s=600e9, ib_bytes_per_s=25e9),
}


@dataclasses.dataclass(frozen=True)
class Layout:
    """Mesh axis sizes, ZeRO stage and micro-batching of one candidate run."""

    data: int = 1
    fsdp: int = 1
    context: int = 1
    tensor: int = 1
    pipeline: int = 1
    sequence_parallel: bool = False
    zero_stage: int = 3
    micro_batches: int = 1  # sequential micro-batches per step (accumulation; the pipeline's m)

    @property
    def num_devices(self) -> int:
        return self.pipeline * self.data * self.fsdp * self.context * self.tensor

    def size(self, axis: str) -> int:
        return getattr(self, axis)

    def describe(self) -> str:
        parts = [f"{a}={self.size(a)}" for a in AXES if self.size(a) > 1 or a in ("data", "fsdp")]
        return " ".join(parts + (["sp"] if self.sequence_parallel else []))


def layout_from_config(cfg: Config, num_devices: int, pipeline: int = 1,
                       pipeline_microbatches: int | None = None) -> Layout:
    """Validates `cfg` on `num_devices // pipeline` devices per stage and returns the layout."""
    if pipeline < 1 or num_devices % pipeline:
        raise ConfigError(f"--pipeline {pipeline} must be >= 1 and divide --devices {num_devices}")
    m = pipeline_microbatches or cfg.train.micro_batches
    cfg = cfg.replace(train=dataclasses.replace(cfg.train, micro_batches=m))
    shape = validate(cfg, num_devices // pipeline)
    return Layout(pipeline=pipeline, sequence_parallel=cfg.mesh.sequence_parallel,
                  zero_stage=cfg.optim.zero_stage, micro_batches=m, **shape)


def compute_bytes(model: ModelConfig) -> int:
    return 4 if model.compute_dtype == "float32" else 2
