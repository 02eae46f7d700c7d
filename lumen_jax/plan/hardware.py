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

    def uneven_max(self, num_layers: int, first: int = 0) -> int | None:
        """Layer slots one virtual stage holds and computes per tick when they differ from ceil(L / (P V)):
        max(mesh.pipeline_layers) when it splits `num_layers` into this layout's virtual stages; with
        `first` > 0 first layers of their own kind (MoE's first dense layers, `first_layers`), every
        stage's slots of them (the most any stage holds) plus the most other layers any stage holds
        (parallel/pipeline/layout.Pipeline.pad), on `mesh.pipeline_layers` or else `first_split`'s;
        else None."""
        split = self.mesh.pipeline_layers
        chunks = self.pipeline * self.schedule[1]
        valid = self.pipeline > 1 and len(split) == chunks and sum(split) == num_layers
        if first and self.pipeline > 1:
            firsts, rest = first_parts(split if valid else first_split(num_layers, chunks, first), first)
            return max(firsts) + max(rest)
        return max(split) if valid else None

    def chunk_layers(self, num_layers: int, first: int = 0) -> int:
        """Layers one virtual stage computes per tick: ceil(L / (P V)), or `uneven_max` (every chunk
        holds that many slots, the padding computed in lock step)."""
        lmax = self.uneven_max(num_layers, first)
        return lmax if lmax is not None else -(-num_layers // (self.pipeline * self.schedule[1]))

    def stage_layers(self, num_layers: int, first: int = 0) -> int:
        """Layers one device holds and computes per micro-batch (all its chunks): ceil(L / P), or
        V `uneven_max` (the dearest stage, as the lock step runs it)."""
        lmax = self.uneven_max(num_layers, first)
        return self.schedule[1] * lmax if lmax is not None else -(-num_layers // self.pipeline)

    def describe(self) -> str:
        parts = [f"{a}={self.size(a)}" for a in AXES if self.size(a) > 1 or a in ("data", "fsdp")]
        comm = [v for v in (self.mesh.fsdp_grad_reduce, self.mesh.fsdp_regather) if v in ("once", "per_step")]
        comm += ["bf16-reduce"] if self.mesh.reduce_dtype == "bfloat16" else []
        comm += [f"zero{self.mesh.zero_stage}"] if self.mesh.zero_stage != 3 else []  # ZeRO-3 the default
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


def first_layers(model: ModelConfig) -> int:
    """The model's first layers of their own kind a pipeline places (MoE's `model.moe.first_dense_layers`)."""
    return model.moe.first_dense_layers if model.moe.enabled else 0


def first_parts(split: tuple[int, ...], first: int) -> tuple[list[int], list[int]]:
    """(first layers, other layers) of each virtual stage of `split`: the first layers fill the stages in order."""
    firsts = [min(n, max(0, first - sum(split[:w]))) for w, n in enumerate(split)]
    return firsts, [n - f for n, f in zip(split, firsts)]


def first_split(num_layers: int, chunks: int, first: int, group: int = 1) -> tuple[int, ...]:
    """`mesh.pipeline_layers` for a model whose `first` layers are of their own kind (DeepSeek-V3's dense
    ones): every virtual stage computes F slots of them and R of the others (lock step), so this picks
    the F <= first minimising F + R: ceil(first / F) stages take F first layers each (the last of them
    the rest, then other layers), the other layers (whole groups of `group`) spread evenly after them."""
    best = None
    for f in range(1, first + 1):
        dense_stages = -(-first // f)
        if dense_stages > chunks:
            continue
        groups = (num_layers - first) // group
        # stages that can take other layers: the last one with first layers, and every one after it
        takers = chunks - dense_stages + 1
        per = -(-groups // takers)
        if best is None or f + per * group < best[0]:
            counts = [per] * takers
            for i in range(per * takers - groups):  # the fewer from the end
                counts[-1 - i] -= 1
            firsts = [f] * (dense_stages - 1) + [first - f * (dense_stages - 1)]
            split = firsts[:-1] + [firsts[-1] + counts[0] * group] + [c * group for c in counts[1:]]
            best = (f + per * group, tuple(split))
    return best[1]


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
