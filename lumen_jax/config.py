"""Typed, frozen configuration: one dataclass per component, strict conversion, validation.

No JAX import here: a config can be checked on any machine before a backend starts.

A run is described by `Config` (model, mesh, optim, data, train, checkpoint, log, runtime,
distributed). Every parallelism setting lives in `mesh`. Files in `configs/` are YAML mappings of
the same shape; gin files bind the same dataclasses; command-line overrides are dotted
(`optim.lr=3e-4`). Reading them is `lumen_jax.config_files.load_config` (that module imports this
one, never the other way round).
Every problem is a `ConfigError` whose message names the key, the value and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import re
import types
import typing
from typing import Any, Mapping, Sequence


class ConfigError(ValueError):
    """A user-fixable problem with the configuration (the CLI prints it in one line, exit code 2)."""


# --------------------------------------------------------------------------------------------------
# Components
# --------------------------------------------------------------------------------------------------

ATTENTION_IMPLS = ("xla", "flash", "auto")
CONTEXT_PARALLEL = ("ring", "allgather")  # how attention crosses the `context` axis
CONTEXT_BALANCE = ("zigzag", "contiguous")  # which sequence chunks each context device holds
REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable",
                  "save_attention_out", "offload_dots")
COMPUTE_DTYPES = ("bfloat16", "float32", "float16")
ROPE_SCALINGS = ("none", "llama3")
FP8_RECIPES = ("none", "current", "delayed", "blockwise")
FP8_LAYERS = ("attention", "mlp")
FP8_KEEP_BF16 = ("first", "last")
MOE_ROUTERS = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class Fp8Config:
    """fp8 matmuls (lumen_jax/ops/fp8.py): E4M3 forward, E5M2 gradients, fp32 accumulation."""

    recipe: str = "none"  # none (compute dtype) | current | delayed | blockwise
    amax_history: int = 1024  # delayed: steps of amax history the scale is taken from
    layers: tuple[str, ...] = ("attention", "mlp")  # layer types whose projections run in fp8
    keep_bf16: tuple[str, ...] = ("first", "last")  # layers kept in the compute dtype


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """Mixture of experts (lumen_jax/model/moe.py, dispatch in lumen_jax/ops/moe.py). `num_experts: 0`
    (the default) turns it off: every layer keeps its dense MLP."""

    num_experts: int = 0  # routed experts per MoE layer; 0: no MoE
    top_k: int = 2  # experts each token goes to
    every_n_layers: int = 1  # layers n-1, 2n-1, ... are MoE (1: every layer); must divide num_layers
    capacity_factor: float | None = None  # None: dropless; c: an expert takes ceil(c*tokens*top_k/E) per group
    shared_experts: int = 0  # dense experts every token also goes through (DeepSeek)
    router: str = "softmax"  # softmax (top-k, renormalised) | sigmoid (DeepSeek-V3: sigmoid, top-k, normalised)
    aux_loss_weight: float = 0.01  # Switch load-balancing loss num_experts * sum_i f_i P_i
    router_z_loss_weight: float = 0.001  # mean logsumexp(router logits)^2 (ST-MoE)
    expert_ffn_dim: int = 0  # each expert's (and shared expert's) hidden width; 0: model.ffn_dim

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Llama-family decoder shape and numerics."""

    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 0  # 0: derived as d_model // num_heads
    ffn_dim: int = 172
    vocab_size: int = 512
    norm_eps: float = 1e-5
    rope_theta: float = 500_000.0
    rope_scaling: str = "none"  # none | llama3 (Llama 3.1 frequency scaling)
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    tie_embeddings: bool = False
    init_std: float = 0.02
    attention: str = "xla"  # xla | flash | auto (auto: flash on GPU, xla on CPU)
    flash_block_q: int = 0  # flash kernel's query tile (forward, dQ); 0: tuned default
    flash_block_kv: int = 0  # flash kernel's key tile (forward, dK/dV); 0: tuned default
    remat: str = "none"  # one of REMAT_POLICIES
    compute_dtype: str = "bfloat16"  # bfloat16 | float32 | float16; params stay float32
    fp8: Fp8Config = dataclasses.field(default_factory=Fp8Config)
    moe: MoeConfig = dataclasses.field(default_factory=MoeConfig)

    @property
    def expert_ffn_dim(self) -> int:
        return self.moe.expert_ffn_dim or self.ffn_dim

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.num_heads


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """The parallelism plan: the device mesh (axes outermost to innermost; one axis may be -1: it
    takes the remaining devices) and how each axis is used."""

    data: int = 1
    fsdp: int = -1
    pipeline: int = 1  # stages: the layer stack cut into `pipeline` parts of equal depth
    expert: int = 1  # expert parallelism: groups of model.moe experts on different devices (shards the batch too)
    context: int = 1
    tensor: int = 1
    sequence_parallel: bool = False  # Megatron SP: norms/residual sharded along sequence over `tensor`
    zero_stage: int = 3  # over fsdp: 1 optimizer state sharded; 2: + gradients; 3: + parameters (FSDP)
    # context > 1: ring (K/V hop around the context ring) | allgather (gather K/V, Llama 3)
    context_parallel: str = "ring"
    # zigzag: context device i holds chunks i and 2C-1-i (equal causal work) | contiguous: chunk i
    context_balance: str = "zigzag"
    # Gradient accumulation over train.micro_batches (docs/COMMUNICATION.md). Over `data` the micro-batch
    # gradients are always summed locally and reduced once per step. Over `fsdp`: every_micro_batch
    # reduce-scatters each micro-batch's gradients (the accumulator stays sharded) | once (the
    # accumulator is full-size, one reduction per step).
    fsdp_grad_reduce: str = "every_micro_batch"
    # ZeRO-3 weights: per_micro_batch gathers them where each micro-batch needs them | per_step gathers
    # the step's compute-dtype weights once and keeps them for every micro-batch and the backward.
    fsdp_regather: str = "per_micro_batch"
    reduce_dtype: str = "float32"  # dtype of the gradient reductions (float32 | bfloat16)

    # pipeline > 1: gpipe | 1f1b | interleaved | zero_bubble (lumen_jax/parallel/pipeline.py); its
    # micro-batches are train.micro_batches
    pipeline_schedule: str = "1f1b"
    pipeline_virtual_stages: int = 1  # interleaved: chunks of layers per device

    # The mesh axes, the one list of their names, outermost to innermost (Llama 3's order: see README).
    AXES: typing.ClassVar[tuple[str, ...]] = ("data", "fsdp", "pipeline", "expert", "context", "tensor")

    def shape(self, num_devices: int) -> dict[str, int]:
        """Resolve -1 against `num_devices`; raises ConfigError when the product does not match."""
        sizes = {a: getattr(self, a) for a in self.AXES}
        for a, s in sizes.items():
            if s == 0 or s < -1:
                raise ConfigError(f"mesh.{a}={s} is not a valid axis size; use a positive integer or -1")
        free = [a for a, s in sizes.items() if s == -1]
        if len(free) > 1:
            raise ConfigError(f"mesh axes {', '.join('mesh.' + a for a in free)} are all -1; "
                              "at most one axis may be -1 (it takes the remaining devices)")
        fixed = 1
        for s in sizes.values():
            fixed *= max(s, 1)
        if free:
            if num_devices % fixed:
                set_axes = {f"mesh.{a}": s for a, s in sizes.items() if s > 1}
                product = ("*".join(set_axes) + "=" + "*".join(map(str, set_axes.values())) + f"={fixed}"
                           if len(set_axes) > 1 else f"{next(iter(set_axes))}={fixed}")
                raise ConfigError(
                    f"mesh.{free[0]}=-1 cannot fill {num_devices} devices: {product} does not "
                    f"divide {num_devices}; choose mesh axes whose product divides {num_devices}")
            sizes[free[0]] = num_devices // fixed
        elif fixed != num_devices:
            desc = "x".join(f"{a}={s}" for a, s in sizes.items())
            raise ConfigError(
                f"mesh {desc} has {fixed} devices but {num_devices} are available; make the product "
                f"of {'*'.join('mesh.' + a for a in self.AXES)} equal {num_devices} or set one axis to -1")
        return sizes


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with warmup + cosine decay, global-norm clipping, optional z-loss (ZeRO: `mesh.zero_stage`)."""

    lr: float = 3e-4
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 10
    decay_steps: int = 0  # 0: train.steps
    schedule: str = "cosine"  # cosine | linear | constant
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0 disables clipping
    z_loss: float = 0.0  # coefficient of log(Z)^2 (PaLM)
    loss_scale_init: float = 2.0 ** 15  # float16 only: dynamic loss scaling
    loss_scale_growth_interval: int = 2000


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Token source, tokenizer and packing."""

    source: str = "builtin"  # builtin (Python stdlib text, no download) | files
    paths: tuple[str, ...] = ()  # globs of .txt / .jsonl / .parquet files when source=files
    text_field: str = "text"  # field holding the text in jsonl / parquet rows
    tokenizer: str = "byte"  # byte | path to a Hugging Face tokenizers JSON file
    seq_len: int = 128
    global_batch_size: int = 16
    builtin_max_bytes: int = 4_000_000  # cap on the builtin corpus (bytes of source text)
    shuffle: bool = True
    num_workers: int = 0  # grain worker processes (0: in-process)
    eval_paths: tuple[str, ...] = ()  # globs of held-out files for evaluation (same formats as paths)
    eval_share: float = 0.0  # without eval_paths: this share of the documents is held out of training


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Loop length, seeds, micro-batching and where the run writes."""

    steps: int = 100
    seed: int = 0
    micro_batches: int = 1  # gradient accumulation inside the jitted step
    run_dir: str = ""  # "": runs/<config name>
    max_nonfinite_steps: int = 20  # this many non-finite steps in a row stop the run (exit 3)
    sdc_check_every: int = 0  # compare parameter replicas' checksums every N steps (0: off)
    init_from: str = ""  # a new run starts from these weights: a run directory or a Hugging Face directory
    eval_every: int = 0  # evaluate on the held-out data (data.eval_paths / data.eval_share) every N steps
    eval_batches: int = 10  # batches of global_batch_size per evaluation


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints under <run_dir>/checkpoints."""

    every_steps: int = 0  # 0: off
    every_minutes: float = 0.0  # 0: off
    keep: int = 3
    keep_every: int = 0  # 0: none kept permanently
    async_save: bool = True


@dataclasses.dataclass(frozen=True)
class LogConfig:
    """Metrics writers and the console."""

    every_steps: int = 10
    jsonl: bool = True
    tensorboard: bool = True
    progress: bool = True


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """Process-level settings applied before JAX starts."""

    cpu_devices: int = 0  # emulated CPU devices when no accelerator is present (0: leave JAX's default)
    compilation_cache_dir: str = ".cache/jax"  # persistent compilation cache ("" disables)
    platform: str = ""  # "" lets JAX choose; cpu | gpu forces one
    # CPU runs: reuse makes glibc keep freed memory, so XLA:CPU's per-step temporary buffer is not
    # unmapped and page-faulted in again every step (-15% CPU time); default leaves glibc as is.
    malloc: str = "reuse"
    # XLA flags for GPUs, set before the backend starts (lumen_jax/runtime.py GPU_XLA_FLAGS): overlap
    # (latency-hiding scheduler, async and pipelined collectives, combine thresholds from the config) |
    # none (XLA's defaults) | any other string: literal flags. CPU runs ignore it.
    xla_gpu_flags: str = "overlap"


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Several processes (one per node or per GPU) in one job: how they find each other, which devices
    each uses, and which mesh axes cross nodes. Unset fields come from the environment (SLURM,
    JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID); see lumen_jax/distributed.py."""

    coordinator: str = ""  # host:port of process 0 ("": from the environment; none: a single process)
    num_processes: int = 0  # 0: from the environment, else 1
    process_id: int = -1  # -1: from the environment
    local_device_ids: tuple[int, ...] = ()  # this process's devices; (): all, or one when several share a node
    heartbeat_timeout_s: int = 100  # a process silent this long counts as dead: the others stop
    initialization_timeout_s: int = 300  # how long processes wait for each other at start-up
    # How many slices of each mesh axis lie across nodes (the rest stays inside a node). All 1: the
    # nodes go to the outermost axes they divide (data, then fsdp, ...).
    across_nodes_data: int = 1
    across_nodes_fsdp: int = 1
    across_nodes_pipeline: int = 1
    across_nodes_expert: int = 1
    across_nodes_context: int = 1
    across_nodes_tensor: int = 1

    def across_nodes(self) -> dict[str, int]:
        return {a: getattr(self, f"across_nodes_{a}") for a in MeshConfig.AXES}


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = ModelConfig()
    mesh: MeshConfig = MeshConfig()
    optim: OptimConfig = OptimConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    log: LogConfig = LogConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    distributed: DistributedConfig = DistributedConfig()
    name: str = "default"  # the config file's stem; names the default run directory

    def replace(self, **sections: Any) -> "Config":
        return dataclasses.replace(self, **sections)


# --------------------------------------------------------------------------------------------------
# dict <-> dataclasses, with strict types
# --------------------------------------------------------------------------------------------------

SCHEDULES = ("cosine", "linear", "constant")
ZERO_STAGES = (1, 2, 3)
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")  # lumen_jax.parallel.pipeline.SCHEDULES
DATA_SOURCES = ("builtin", "files")
PLATFORMS = ("", "cpu", "gpu", "cuda", "rocm", "tpu")

# Enum-like fields: the allowed values, checked on load and in `validate`.
CHOICES: dict[str, tuple[Any, ...]] = {
    "model.attention": ATTENTION_IMPLS,
    "model.remat": REMAT_POLICIES,
    "model.compute_dtype": COMPUTE_DTYPES,
    "model.rope_scaling": ROPE_SCALINGS,
    "model.fp8.recipe": FP8_RECIPES,
    "model.fp8.layers": FP8_LAYERS,  # list fields: every item
    "model.fp8.keep_bf16": FP8_KEEP_BF16,
    "model.moe.router": MOE_ROUTERS,
    "optim.schedule": SCHEDULES,
    "mesh.zero_stage": ZERO_STAGES,
    "mesh.context_parallel": CONTEXT_PARALLEL,
    "mesh.context_balance": CONTEXT_BALANCE,
    "mesh.fsdp_grad_reduce": ("every_micro_batch", "once"),
    "mesh.fsdp_regather": ("per_micro_batch", "per_step"),
    "mesh.reduce_dtype": ("float32", "bfloat16"),
    "mesh.pipeline_schedule": PIPELINE_SCHEDULES,
    "data.source": DATA_SOURCES,
    "runtime.platform": PLATFORMS,
    "runtime.malloc": ("reuse", "default"),
}

SECTIONS: dict[str, type] = {
    "model": ModelConfig, "mesh": MeshConfig, "optim": OptimConfig, "data": DataConfig,
    "train": TrainConfig, "checkpoint": CheckpointConfig, "log": LogConfig, "runtime": RuntimeConfig,
    "distributed": DistributedConfig,
}


def _field_types(cls: type) -> dict[str, Any]:
    """Field name -> resolved annotation (annotations are strings under `from __future__`)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


# Sub-sections one level down (`model.fp8.recipe`): a field whose type is a dataclass.
NESTED: dict[str, type] = {"model.fp8": Fp8Config, "model.moe": MoeConfig}

_TYPES = {section: _field_types(cls) for section, cls in {**SECTIONS, **NESTED}.items()}

# Keys that moved to another section: the old spelling is an error naming the new one.
MOVED: dict[str, str] = {
    "optim.zero_stage": "mesh.zero_stage",
    "model.context_parallel": "mesh.context_parallel",
    "model.context_balance": "mesh.context_balance",
}


def show(value: Any) -> str:
    """A value as the user would write it back in a message (`'abc'`, `64`, `[1, 2]`)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        value = list(value)
    return repr(value)


def _close(word: Any, candidates: Sequence[str], cutoff: float = 0.6) -> str | None:
    close = difflib.get_close_matches(str(word), list(candidates), n=1, cutoff=cutoff)
    return close[0] if close else None


def suggest_key(section: Any, key: Any) -> str | None:
    """`model.d_modle` -> `model.d_model`; `modle.d_model` -> `model.d_model`; `model.seq_len` -> `data.seq_len`."""
    s = section if section in _TYPES else _close(section, _TYPES)
    k = _close(key, _TYPES[s]) if s else None
    if k:
        return f"{s}.{k}"
    k = _close(key, [k for fields in _TYPES.values() for k in fields], cutoff=0.8)
    return next((f"{s}.{k}" for s, fields in _TYPES.items() if k in fields), None)


def unknown_section(section: Any) -> ConfigError:
    """The error for a section that does not exist, with a did-you-mean."""
    close = _close(section, SECTIONS)
    hint = f"; did you mean {close}?" if close else ""
    return ConfigError(f"unknown config section {section!r}{hint}"
                       f" (sections: {', '.join(SECTIONS)})")


def check_key(section: Any, key: Any, shown: str | None = None, where: str = "") -> Any:
    """The type of `section.key`, or a ConfigError (showing `section.key=shown`) with a did-you-mean.

    A key listed in `MOVED` gives the one-line error `optim.zero_stage moved to mesh.zero_stage`
    whichever format names it (YAML, gin, a dotted override): old keys are not aliases.
    """
    if section in _TYPES and key in _TYPES[section]:
        return _TYPES[section][key]
    dotted = f"{section}.{key}"
    if dotted in MOVED:
        raise ConfigError(f"{dotted} moved to {MOVED[dotted]}")
    close = suggest_key(section, key)
    hint = f"; did you mean {close}?" if close else ""
    if not close and section in _TYPES:
        hint = f"; keys of {section}: {', '.join(_TYPES[section])}"
    value = "" if shown is None else f"={shown}"
    raise ConfigError(f"{where}unknown config key {dotted}{value}{hint}")


def _convert(key: str, value: Any, typ: Any) -> Any:
    """Checks `value` against the field type: ints widen to floats, lists become tuples, nothing else."""
    def wrong(what: str) -> ConfigError:
        return ConfigError(f"{key}={show(value)} must be {what}; got {type(value).__name__}")

    if typing.get_origin(typ) in (typing.Union, types.UnionType):  # `float | None`: null allowed
        if value is None:
            return None
        typ = next(t for t in typing.get_args(typ) if t is not type(None))
    if typ is bool:
        if not isinstance(value, bool):
            raise wrong("a bool (true or false)")
    elif typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise wrong("an int")
    elif typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise wrong("a float")
        value = float(value)
    elif typ is str:
        if not isinstance(value, str):
            raise wrong("a str")
    elif typing.get_origin(typ) is tuple:  # tuple[str, ...] or tuple[int, ...]
        item = typing.get_args(typ)[0]
        if not isinstance(value, (list, tuple)) or not all(
                isinstance(v, item) and not isinstance(v, bool) for v in value):
            raise wrong(f"a list of {item.__name__}")
        value = tuple(value)
    elif key in NESTED:  # a sub-section (model.fp8): a mapping of its own keys
        if isinstance(value, typ):
            value = dataclasses.asdict(value)
        if not isinstance(value, Mapping):
            raise wrong(f"a mapping of keys ({', '.join(_TYPES[key])}), e.g. {key}: "
                        f"{{{next(iter(_TYPES[key]))}: ...}}")
        return typ(**{k: _convert(f"{key}.{k}", v, check_key(key, k, show(v))) for k, v in value.items()})
    else:  # a field type this function was not taught: our bug, not the user's
        raise TypeError(f"config field {key} has unsupported type {typ!r}")
    allowed = CHOICES.get(key)
    if allowed is not None and isinstance(value, tuple):  # a list field: every item must be allowed
        bad = [v for v in value if v not in allowed]
        if bad:
            raise ConfigError(f"{key}={show(value)} has {', '.join(show(v) for v in bad)}, not among the "
                              f"allowed values; choose the items of {key} from "
                              f"{', '.join(show(a) for a in allowed)}")
    elif allowed is not None and value not in allowed:
        raise ConfigError(f"{key}={show(value)} is not one of the allowed values; "
                          f"choose {key} from {', '.join(show(a) for a in allowed)}")
    return value


def from_dict(d: Mapping[str, Any]) -> Config:
    """Builds a `Config` from a nested mapping `{model: {...}, mesh: {...}, ..., name: str}`.

    Missing sections and keys keep their defaults. Unknown sections or keys, wrong types and values
    outside an enum raise ConfigError.
    """
    if not isinstance(d, Mapping):
        raise ConfigError(f"a config must be a mapping of sections ({', '.join(SECTIONS)}); "
                          f"got {type(d).__name__}")
    kwargs: dict[str, Any] = {}
    for section, body in d.items():
        if section == "name":
            if not isinstance(body, str):
                raise ConfigError(f"name={show(body)} must be a str; got {type(body).__name__}")
            kwargs["name"] = body
            continue
        if section not in SECTIONS:
            raise unknown_section(section)
        if body is None:  # `model:` with nothing under it
            body = {}
        if not isinstance(body, Mapping):
            raise ConfigError(f"config section {section}={show(body)} must be a mapping of keys "
                              f"(e.g. {section}: {{{next(iter(_TYPES[section]))}: ...}}); "
                              f"got {type(body).__name__}")
        fields = {k: _convert(f"{section}.{k}", v, check_key(section, k, show(v))) for k, v in body.items()}
        kwargs[section] = SECTIONS[section](**fields)
    return Config(**kwargs)


def to_dict(cfg: Config) -> dict[str, Any]:
    """Plain nested dict of `cfg` (tuples as lists), ready for yaml.safe_dump / json.dumps."""
    def plain(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        return x

    return plain(dataclasses.asdict(cfg))


# --------------------------------------------------------------------------------------------------
# Validation against a device count
# --------------------------------------------------------------------------------------------------

# (key, comparison, bound): the range each number must lie in, checked before anything divides by it.
_BOUNDS: tuple[tuple[str, str, float], ...] = (
    ("model.d_model", ">=", 1), ("model.num_layers", ">=", 1), ("model.num_heads", ">=", 1),
    ("model.num_kv_heads", ">=", 1), ("model.head_dim", ">=", 0), ("model.ffn_dim", ">=", 1),
    ("model.vocab_size", ">=", 1), ("model.norm_eps", ">", 0), ("model.rope_theta", ">", 0),
    ("model.rope_scaling_factor", ">", 0), ("model.rope_original_max_len", ">=", 1),
    ("model.init_std", ">", 0), ("model.fp8.amax_history", ">=", 1),
    ("model.moe.num_experts", ">=", 0), ("model.moe.top_k", ">=", 1), ("model.moe.every_n_layers", ">=", 1),
    ("model.moe.shared_experts", ">=", 0), ("model.moe.aux_loss_weight", ">=", 0),
    ("model.moe.router_z_loss_weight", ">=", 0), ("model.moe.expert_ffn_dim", ">=", 0),
    ("optim.lr", ">", 0), ("optim.min_lr_ratio", ">=", 0), ("optim.min_lr_ratio", "<=", 1),
    ("optim.warmup_steps", ">=", 0), ("optim.decay_steps", ">=", 0),
    ("optim.b1", ">=", 0), ("optim.b1", "<", 1), ("optim.b2", ">=", 0), ("optim.b2", "<", 1),
    ("optim.eps", ">", 0), ("optim.weight_decay", ">=", 0), ("optim.grad_clip", ">=", 0),
    ("optim.z_loss", ">=", 0), ("optim.loss_scale_init", ">", 0),
    ("optim.loss_scale_growth_interval", ">=", 1),
    ("data.seq_len", ">=", 1), ("data.global_batch_size", ">=", 1), ("data.builtin_max_bytes", ">=", 1),
    ("data.num_workers", ">=", 0), ("data.eval_share", ">=", 0), ("data.eval_share", "<", 1),
    ("train.eval_every", ">=", 0), ("train.eval_batches", ">=", 1),
    ("train.steps", ">=", 1), ("train.micro_batches", ">=", 1), ("train.max_nonfinite_steps", ">=", 1),
    ("train.sdc_check_every", ">=", 0), ("mesh.pipeline_virtual_stages", ">=", 1),
    ("checkpoint.every_steps", ">=", 0), ("checkpoint.every_minutes", ">=", 0), ("checkpoint.keep", ">=", 1),
    ("checkpoint.keep_every", ">=", 0),
    ("log.every_steps", ">=", 1),
    ("runtime.cpu_devices", ">=", 0),
    ("distributed.num_processes", ">=", 0), ("distributed.process_id", ">=", -1),
    ("distributed.heartbeat_timeout_s", ">=", 1), ("distributed.initialization_timeout_s", ">=", 1),
    *((f"distributed.across_nodes_{a}", ">=", 1) for a in MeshConfig.AXES),
)
_COMPARE = {">=": lambda a, b: a >= b, ">": lambda a, b: a > b, "<=": lambda a, b: a <= b,
            "<": lambda a, b: a < b}


def _floats(cfg: Any, prefix: str = "") -> list[tuple[str, float]]:
    """(dotted key, value) of every float field of `cfg`, sub-sections included."""
    out = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            out += _floats(value, f"{prefix}{f.name}.")
        elif isinstance(value, float):
            out.append((f"{prefix}{f.name}", value))
    return out


def _divisors(n: int, limit: int) -> str:
    return ", ".join(str(d) for d in range(1, min(n, limit) + 1) if n % d == 0)


def _moe_checks(m: ModelConfig, shape: dict[str, int]) -> list[tuple[bool, str]]:
    """model.moe against the model and the mesh (an `expert` axis needs experts to place)."""
    moe, ep, tp = m.moe, shape["expert"], shape["tensor"]
    if not moe.enabled:
        return [(ep == 1, f"mesh.expert={ep} needs a mixture of experts but model.moe.num_experts=0; "
                          "set model.moe.num_experts to a multiple of mesh.expert or mesh.expert=1")]
    return [
        (moe.top_k <= moe.num_experts,
         f"model.moe.top_k={moe.top_k} exceeds model.moe.num_experts={moe.num_experts}; "
         f"choose top_k between 1 and {moe.num_experts}"),
        (moe.num_experts % ep == 0,
         f"mesh.expert={ep} does not divide model.moe.num_experts={moe.num_experts}; choose mesh.expert "
         f"among the divisors of {moe.num_experts} ({_divisors(moe.num_experts, moe.num_experts)})"),
        (moe.capacity_factor is None or moe.capacity_factor > 0,
         f"model.moe.capacity_factor={show(moe.capacity_factor)} must be > 0; "
         "use e.g. 1.25, or null for dropless"),
        (m.num_layers % moe.every_n_layers == 0,
         f"model.moe.every_n_layers={moe.every_n_layers} does not divide model.num_layers={m.num_layers}; "
         f"choose it among the divisors of {m.num_layers} ({_divisors(m.num_layers, m.num_layers)})"),
        (m.expert_ffn_dim % tp == 0,
         f"mesh.tensor={tp} does not divide the experts' ffn dim {m.expert_ffn_dim} (model.moe.expert_ffn_dim, "
         "0: model.ffn_dim); choose an expert_ffn_dim that is a multiple of mesh.tensor"),
        (m.fp8.recipe == "none",
         f"model.fp8.recipe={m.fp8.recipe!r} is not supported with model.moe (the experts' grouped "
         "matmuls have no fp8 form); set model.fp8.recipe=none or model.moe.num_experts=0"),
    ]


def _pipeline_checks(cfg: Config, shape: dict[str, int]) -> list[tuple[bool, str]]:
    """mesh.pipeline with its schedule (lumen_jax/parallel/pipeline.py). With one stage every
    schedule is the same m forward-backward passes in a row (gradient accumulation): ignored."""
    mesh, m, layers = cfg.mesh, cfg.train.micro_batches, cfg.model.num_layers
    p, v = shape["pipeline"], mesh.pipeline_virtual_stages
    chunks = p * v
    return [
        (v == 1 or mesh.pipeline_schedule == "interleaved",
         f"mesh.pipeline_virtual_stages={v} is for mesh.pipeline_schedule=interleaved, not "
         f"{mesh.pipeline_schedule}; set mesh.pipeline_virtual_stages=1 or mesh.pipeline_schedule=interleaved"),
        (p == 1 or layers % chunks == 0,
         f"model.num_layers={layers} is not divisible by mesh.pipeline={p}"
         + (f"*mesh.pipeline_virtual_stages={v}={chunks}" if v > 1 else "")
         + f"; every stage holds the same number of layers, so use a multiple of {chunks} layers "
         f"or a mesh.pipeline among the divisors of {layers}"),
        (p == 1 or mesh.pipeline_schedule == "gpipe" or m >= p,
         f"mesh.pipeline_schedule={mesh.pipeline_schedule} needs train.micro_batches={m} >= mesh.pipeline={p} "
         f"(each stage keeps up to {p} micro-batches in flight); raise train.micro_batches to {p} or more "
         "or use mesh.pipeline_schedule=gpipe"),
        (p == 1 or mesh.pipeline_schedule != "interleaved" or m % p == 0,
         f"mesh.pipeline_schedule=interleaved needs train.micro_batches={m} divisible by mesh.pipeline={p} "
         f"(micro-batches go through the chunks in groups of {p}); use a multiple of {p}"),
        (p == 1 or cfg.model.fp8.recipe == "none",
         f"model.fp8.recipe={cfg.model.fp8.recipe} with mesh.pipeline={p}: fp8 scaling state does not travel "
         "through pipeline stages yet; set model.fp8.recipe=none or mesh.pipeline=1"),
        (p == 1 or not cfg.model.moe.enabled,
         f"model.moe.num_experts={cfg.model.moe.num_experts} with mesh.pipeline={p}: mixture-of-experts layers "
         "do not run in pipeline stages yet; set mesh.pipeline=1 or model.moe.num_experts=0"),
    ]


def validate(cfg: Config, num_devices: int) -> dict[str, int]:
    """Checks `cfg` against itself and `num_devices` before any mesh or array exists.

    Args:
      cfg: the run's configuration (types and enum values are re-checked, so configs built in code
        with `dataclasses.replace` get the same checks as loaded ones).
      num_devices: devices the mesh will span (all processes together).

    Returns:
      The resolved mesh shape {data, fsdp, pipeline, context, tensor} (a -1 axis filled in).

    Raises:
      ConfigError: the first problem found, in one line naming the key, the value, the rule and a fix.
    """
    from_dict(to_dict(cfg))
    for key, value in _floats(cfg):  # inf or NaN can only train to NaN (optim.lr=1e999 reads as inf)
        if not math.isfinite(value):
            raise ConfigError(f"{key}={show(value)} is not a finite number; set {key} to a finite value")
    for key, op, bound in _BOUNDS:
        value = functools.reduce(getattr, key.split("."), cfg)  # model.fp8.amax_history: two levels
        if not _COMPARE[op](value, bound):
            raise ConfigError(f"{key}={show(value)} must be {op} {show(bound)}; "
                              f"set {key} to a value {op} {show(bound)}")
    if num_devices < 1:
        raise ConfigError(f"num_devices={num_devices} must be >= 1; no devices were found")

    shape = cfg.mesh.shape(num_devices)
    m, d, mesh, dist = cfg.model, cfg.data, cfg.mesh, cfg.distributed
    tp, cp, ep = shape["tensor"], shape["context"], shape["expert"]
    batch_shards = shape["data"] * shape["fsdp"] * ep * cfg.train.micro_batches
    checks: list[tuple[bool, str]] = [
        *((getattr(m, k) % tp == 0,
           f"mesh.tensor={tp} does not divide model.{k}={getattr(m, k)}; "
           f"choose mesh.tensor among the divisors of {getattr(m, k)} ({_divisors(getattr(m, k), num_devices)})")
          for k in ("num_heads", "num_kv_heads", "ffn_dim", "vocab_size")),
        (m.num_heads % m.num_kv_heads == 0,
         f"model.num_kv_heads={m.num_kv_heads} does not divide model.num_heads={m.num_heads}; grouped-query "
         f"attention needs num_kv_heads among the divisors of {m.num_heads} "
         f"({_divisors(m.num_heads, m.num_heads)})"),
        (m.head_dim > 0 or m.d_model % m.num_heads == 0,
         f"model.d_model={m.d_model} is not divisible by model.num_heads={m.num_heads}, so model.head_dim=0 "
         "cannot be derived; set model.head_dim explicitly or make d_model a multiple of num_heads"),
        (m.resolved_head_dim % 2 == 0 or (m.head_dim == 0 and m.d_model % m.num_heads),
         (f"model.head_dim={m.head_dim}" if m.head_dim else
          f"model.head_dim=0 derives d_model/num_heads={m.d_model}/{m.num_heads}={m.resolved_head_dim}, which")
         + " must be even: RoPE rotates pairs of dimensions; set model.head_dim to an even value"),
        (m.d_model % shape["fsdp"] == 0,
         f"mesh.fsdp={shape['fsdp']} does not divide model.d_model={m.d_model} (parameters and optimizer "
         f"state are sharded along d_model over fsdp); choose mesh.fsdp among the divisors of {m.d_model} "
         f"({_divisors(m.d_model, num_devices)})"),
        *((getattr(m, k) == 0 or (getattr(m, k) >= 16 and getattr(m, k) & (getattr(m, k) - 1) == 0),
           f"model.{k}={getattr(m, k)} must be 0 (tuned default) or a power of two >= 16; "
           f"set model.{k} to 0, 16, 32, 64 or 128")
          for k in ("flash_block_q", "flash_block_kv")),
        (m.rope_scaling != "llama3" or m.rope_high_freq_factor > m.rope_low_freq_factor,
         f"model.rope_high_freq_factor={m.rope_high_freq_factor} must be > model.rope_low_freq_factor="
         f"{m.rope_low_freq_factor} for rope_scaling=llama3; raise the high or lower the low factor"),
        *_moe_checks(m, shape),
        *_pipeline_checks(cfg, shape),
        (d.global_batch_size % batch_shards == 0,
         f"data.global_batch_size={d.global_batch_size} is not divisible by mesh.data*mesh.fsdp*mesh.expert*"
         f"train.micro_batches={shape['data']}*{shape['fsdp']}*{ep}*{cfg.train.micro_batches}={batch_shards}; "
         f"use a multiple of {batch_shards} or change the mesh or train.micro_batches"),
        (d.seq_len % cp == 0,
         f"data.seq_len={d.seq_len} is not divisible by mesh.context={cp}; use a multiple of {cp}"),
        (not mesh.sequence_parallel or d.seq_len % (cp * tp) == 0,
         f"mesh.sequence_parallel=true needs data.seq_len={d.seq_len} divisible by mesh.context*mesh.tensor="
         f"{cp * tp}; use a multiple of {cp * tp} or set mesh.sequence_parallel=false"),
        (cp == 1 or mesh.context_balance != "zigzag" or d.seq_len % (2 * cp) == 0,
         f"mesh.context_balance=zigzag cuts data.seq_len={d.seq_len} into 2*mesh.context={2 * cp} chunks; "
         f"use a multiple of {2 * cp} or mesh.context_balance=contiguous"),
        (cfg.optim.decay_steps == 0 or cfg.optim.schedule == "constant"
         or cfg.optim.decay_steps > cfg.optim.warmup_steps,
         f"optim.decay_steps={cfg.optim.decay_steps} ends the decay before optim.warmup_steps="
         f"{cfg.optim.warmup_steps} ends the warmup (both count from step 0); set optim.decay_steps above "
         f"{cfg.optim.warmup_steps}, or 0 to decay until train.steps"),
        (d.source == "files" or not d.paths,
         f"data.paths={show(d.paths)} is set but data.source={d.source!r} ignores it; set data.source=files "
         "to train on those files, or remove data.paths"),
        (d.source != "files" or bool(d.paths),
         "data.source='files' but data.paths=[] is empty; set data.paths=[glob, ...] "
         "or data.source=builtin"),
        (not dist.coordinator or re.fullmatch(r"[^\s:]+:\d+|\[[0-9a-fA-F:]+\]:\d+", dist.coordinator),
         f"distributed.coordinator={dist.coordinator!r} must be host:port of process 0 (e.g. node001:61234)"),
        (dist.process_id < 0 or dist.num_processes == 0 or dist.process_id < dist.num_processes,
         f"distributed.process_id={dist.process_id} must be below distributed.num_processes="
         f"{dist.num_processes}; number processes 0..{dist.num_processes - 1}"),
        *((shape[a] % n == 0,
           f"distributed.across_nodes_{a}={n} does not divide mesh.{a}={shape[a]}; the axis is split into "
           f"across-node and in-node parts, so choose distributed.across_nodes_{a} among the divisors of "
           f"{shape[a]} ({_divisors(shape[a], shape[a])})")
          for a, n in cfg.distributed.across_nodes().items()),
        (not cfg.train.eval_every or bool(d.eval_paths) or d.eval_share > 0,
         f"train.eval_every={cfg.train.eval_every} needs held-out data: set data.eval_paths=[glob, ...] or "
         "data.eval_share (e.g. 0.01), or train.eval_every=0"),
        (not cfg.train.init_from or os.path.isdir(cfg.train.init_from),
         f"train.init_from={cfg.train.init_from!r} is not a directory; give a run directory or a Hugging Face "
         "model directory"),
        (d.tokenizer == "byte" or os.path.isfile(d.tokenizer),
         f"data.tokenizer={d.tokenizer!r} does not exist; give the path of a Hugging Face tokenizer.json "
         "or use data.tokenizer=byte"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    return shape


def warnings(cfg: Config) -> list[str]:
    """Settings that are legal but probably not meant: one line each, printed before training."""
    o, t = cfg.optim, cfg.train
    out = []
    if o.warmup_steps >= t.steps:
        out.append(f"optim.warmup_steps={o.warmup_steps} >= train.steps={t.steps}: the learning rate never "
                   f"reaches optim.lr={show(o.lr)}; lower optim.warmup_steps unless this is a smoke test")
    return out
