"""Accelerators, their links, and the parallel layout of a candidate run."""

from __future__ import annotations

import dataclasses
import math

from lumen_jax.metrics import mfu as metrics
from lumen_jax.config import Config, ConfigError, MeshConfig, ModelConfig
from lumen_jax.config.checks import validate
from lumen_jax.parallel.pipeline import schedule as pipeline_lib

# Outermost -> innermost (innermost: in a node), the trainer's mesh order (`MeshConfig.AXES`): planned
# pipeline stages (`--pipeline`) sit where `mesh.pipeline` does, inside data and fsdp.
AXES = MeshConfig.AXES


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator and its links. Bandwidths are bytes/s per device, one direction."""

    kind: str  # a `device_kind` string that `metrics.device_peak_flops` knows
    memory_bytes: float
    nvlink_bytes_per_s: float = 900e9  # inside a node
    ib_bytes_per_s: float = 50e9  # across nodes (400 Gb/s NIC per GPU)
    devices_per_node: int = 8
    peak_flops: float | None = None  # None: the datasheet peak for the compute dtype
    hbm_bytes_per_s: float = 3.35e12  # device memory bandwidth (H100 SXM)

    def peak(self, dtype: str) -> float:
        peak = self.peak_flops or metrics.device_peak_flops(self.kind, dtype)
        if not peak:
            raise ConfigError(f"no peak FLOP/s known for {self.kind} {dtype}; pass --peak-tflops")
        return peak


DEVICES = {
    "h100": Hardware("NVIDIA H100 80GB HBM3", 80e9),
    "h200": Hardware("NVIDIA H200", 141e9, hbm_bytes_per_s=4.8e12),
    "a100": Hardware("NVIDIA A100-SXM4-80GB", 80e9, nvlink_bytes_per_s=600e9, ib_bytes_per_s=25e9,
                     hbm_bytes_per_s=2.0e12),
}


@dataclasses.dataclass(frozen=True)
class Layout:
    """One candidate run: the config's `mesh` section, resolved (every axis a size, no -1), plus what
    the planner derives: pipeline stages (planned only) and micro-batches per step."""

    mesh: MeshConfig = MeshConfig(fsdp=1)  # the parallelism plan: axis sizes, ZeRO, SP, context strategy
    pipeline: int = 1
    micro_batches: int = 1  # sequential micro-batches per step (accumulation; the pipeline's m)

    def __post_init__(self) -> None:
        if any(self.size(a) < 1 for a in AXES):
            raise ValueError(f"a Layout needs resolved axis sizes (>= 1); got {self.describe()}")

    @property
    def num_devices(self) -> int:
        return math.prod(self.size(a) for a in AXES)

    def size(self, axis: str) -> int:
        return self.pipeline if axis == "pipeline" else getattr(self.mesh, axis)

    @property
    def schedule(self) -> tuple[str, int]:
        """(name, V) of the pipeline schedule this layout runs: `mesh.pipeline_schedule` (V =
        `mesh.pipeline_virtual_stages` for interleaved), or gpipe where that schedule cannot run these
        P and m (planned `--pipeline` stages around a config with fewer micro-batches than stages)."""
        mesh = self.mesh
        v = mesh.pipeline_virtual_stages if mesh.pipeline_schedule == "interleaved" else 1
        if pipeline_lib.check_shape(mesh.pipeline_schedule, self.pipeline, self.micro_batches, v) is None:
            return mesh.pipeline_schedule, v
        return "gpipe", 1

    def uneven_max(self, num_layers: int) -> int | None:
        """max(mesh.pipeline_layers) when it splits `num_layers` into this layout's virtual stages, else None."""
        split = self.mesh.pipeline_layers
        if self.pipeline > 1 and len(split) == self.pipeline * self.schedule[1] and sum(split) == num_layers:
            return max(split)
        return None

    def chunk_layers(self, num_layers: int) -> int:
        """Layers one virtual stage computes per tick: ceil(L / (P V)), or max(mesh.pipeline_layers)
        with uneven stages (every chunk holds that many slots, the padding computed in lock step)."""
        lmax = self.uneven_max(num_layers)
        return lmax if lmax is not None else -(-num_layers // (self.pipeline * self.schedule[1]))

    def stage_layers(self, num_layers: int) -> int:
        """Layers one device holds and computes per micro-batch (all its chunks): ceil(L / P), or
        V max(mesh.pipeline_layers) with uneven stages (the dearest stage, as the lock step runs it)."""
        lmax = self.uneven_max(num_layers)
        return self.schedule[1] * lmax if lmax is not None else -(-num_layers // self.pipeline)

    def describe(self) -> str:
        parts = [f"{a}={self.size(a)}" for a in AXES if self.size(a) > 1 or a in ("data", "fsdp")]
        comm = [v for v in (self.mesh.fsdp_grad_reduce, self.mesh.fsdp_regather) if v in ("once", "per_step")]
        comm += ["bf16-reduce"] if self.mesh.reduce_dtype == "bfloat16" else []
        name, v = self.schedule
        stages = [f"{name}" + (f" V={v}" if v > 1 else "")] if self.pipeline > 1 else []
        if self.pipeline > 1 and len(set(self.mesh.pipeline_layers)) > 1:
            stages.append("layers=" + ",".join(map(str, self.mesh.pipeline_layers)))
        sp = "sp+cm" if self.mesh.tensor_overlap == "collective_matmul" else "sp"  # cm: collective matmul
        return " ".join(parts + ([sp] if self.mesh.sequence_parallel else []) + comm + stages)


def uneven_split(num_layers: int, chunks: int, group: int = 1) -> tuple[int, ...]:
    """`mesh.pipeline_layers` for `num_layers` not divisible into `chunks` virtual stages, as Llama 3
    cut 126 layers into 16 stages: ceil(L / chunks) layers each but one fewer on the first and the
    last stages, then the second and the second-to-last, ... (they carry the embedding and the loss
    in schedules that put them there); in whole groups of `group` layers (MoE: every_n_layers)."""
    groups = num_layers // group
    per = -(-groups // chunks)
    split = [per] * chunks
    ends = [i for pair in zip(range(chunks), range(chunks - 1, -1, -1)) for i in pair]
    for i in ends[:per * chunks - groups]:
        split[i] -= 1
    return tuple(n * group for n in split)


def layout_from_config(cfg: Config, num_devices: int, pipeline: int = 1,
                       pipeline_microbatches: int | None = None) -> Layout:
    """Validates `cfg` on `num_devices // pipeline` devices per stage and returns the layout. With
    `pipeline` 1 the stages are the config's `mesh.pipeline` (validated on all the devices)."""
    if pipeline < 1 or num_devices % pipeline:
        raise ConfigError(f"--pipeline {pipeline} must be >= 1 and divide --devices {num_devices}")
    m = pipeline_microbatches or cfg.train.micro_batches
    cfg = cfg.replace(train=dataclasses.replace(cfg.train, micro_batches=m))
    if pipeline == 1:
        shape = validate(cfg, num_devices)
        return Layout(dataclasses.replace(cfg.mesh, **shape), pipeline=shape["pipeline"], micro_batches=m)
    shape = validate(cfg, num_devices // pipeline)
    return Layout(dataclasses.replace(cfg.mesh, **shape), pipeline=pipeline, micro_batches=m)


def compute_bytes(model: ModelConfig) -> int:
    return 4 if model.compute_dtype == "float32" else 2
