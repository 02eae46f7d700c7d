"""Typed, frozen configuration: one dataclass per component and the values each field allows
(reading a mapping into them is `conversion.py`).

No JAX import here: a config can be checked on any machine before a backend starts.

A run is described by `Config` (model, mesh, optim, data, train, checkpoint, log, runtime,
distributed). Every parallelism setting lives in `mesh`. Files in `configs/` are YAML mappings of
the same shape; gin files bind the same dataclasses; command-line overrides are dotted
(`optim.lr=3e-4`). Reading them is `lumen_jax.config.files.load_config` (that module imports this
one, never the other way round).
Every problem is a `ConfigError` whose message names the key, the value and the fix.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import typing
from typing import Any


class ConfigError(ValueError):
    """A user-fixable problem with the configuration (the CLI prints it in one line, exit code 2)."""


# --------------------------------------------------------------------------------------------------
# Components
# --------------------------------------------------------------------------------------------------

ATTENTION_IMPLS = ("xla", "flash", "cudnn", "auto")
CONTEXT_PARALLEL = ("ring", "allgather")  # how attention crosses the `context` axis
CONTEXT_BALANCE = ("zigzag", "contiguous")  # which sequence chunks each context device holds
# How sequence parallelism's tensor collectives run: GSPMD's all-gather / reduce-scatter on the critical
# path | decomposed into ppermute steps under the partial matmuls (lumen_jax/parallel/collective_matmul.py)
TENSOR_OVERLAP = ("none", "collective_matmul")
# The selective policies (MaxText's names) save only the named projection outputs of this table and
# recompute the rest (model/layers.py names them under these policies only): MaxText's query_proj,
# key_proj, value_proj (q, k, v before RoPE), out_proj (attention's o), mlpwi_0 (gate), mlpwi_1 (up),
# mlpwo (down). Dense attention and MLP only (model/mla.py and MoE experts name none: refused).
# No gradient reads down's output, so saving mlpwo saves nothing: MaxText's save_dot_except_mlp
# would be save_dot_except_mlpwi's program. save_dot_except_mlpwi_1 is ours: it recomputes up only.
PROJECTION_NAMES = ("query_proj", "key_proj", "value_proj", "out_proj", "mlpwi_0", "mlpwi_1", "mlpwo")
REMAT_SAVES = {
    "save_qkv_proj": ("query_proj", "key_proj", "value_proj"),
    "save_dot_except_mlpwi": ("query_proj", "key_proj", "value_proj", "out_proj", "mlpwo"),
    "save_dot_except_mlpwi_1": ("query_proj", "key_proj", "value_proj", "out_proj", "mlpwi_0", "mlpwo"),
}
REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable",
                  "save_attention_out", "offload_dots", *REMAT_SAVES)
COMPUTE_DTYPES = ("bfloat16", "float32", "float16")
ROPE_SCALINGS = ("none", "llama3", "linear", "yarn")
NORM_SCALES = ("weight", "one_plus_weight")  # RMSNorm times w (w from 1) | times 1 + w (w from 0: Gemma)
BLOCK_NORMS = ("pre", "sandwich")  # a norm before each sublayer | also one after it, before the residual add (Gemma)
MLP_ACTIVATIONS = ("silu", "gelu_tanh")  # the gated MLP's gate: SwiGLU (Llama) | GeGLU, tanh-approximated GELU (Gemma)
EMBED_SCALES = ("none", "sqrt_d_model")  # the embedding rows as stored | times sqrt(d_model) (Gemma; not the tied head)
FP8_RECIPES = ("none", "current", "delayed", "blockwise")
FP8_LAYERS = ("attention", "mlp")
FP8_KEEP_BF16 = ("first", "last")
MOE_ROUTERS = ("softmax", "sigmoid")
MOE_BALANCE = ("aux_loss", "bias")  # how the load is balanced: the loss alone | a selection bias (aux-loss-free)


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
    shared_experts: int = 0  # dense experts every token also goes through (DeepSeek, Qwen2-MoE)
    shared_gate: bool = False  # the shared experts' output times sigmoid(x . w) of a learned [D] vector (Qwen2-MoE)
    router: str = "softmax"  # softmax over all experts | sigmoid per expert (DeepSeek-V3)
    normalize_top_k: bool = True  # the chosen experts' weights divided by their sum (Mixtral; Qwen2-MoE: false)
    routed_scaling: float = 1.0  # the routed experts' weights times this (DeepSeek-V3: 2.5)
    groups: int = 1  # experts in `groups` equal groups; a token picks its experts from `top_groups` of them
    top_groups: int = 1  # groups kept per token, ranked by the sum of their two best scores (DeepSeek-V3: 8, 4)
    balance: str = "aux_loss"  # aux_loss | bias: a per-expert bias on the scores for the choice only (DeepSeek-V3)
    bias_update_rate: float = 0.001  # balance=bias: bias += rate * sign(mean load - load) after each step
    aux_loss_weight: float = 0.01  # Switch load-balancing loss num_experts * sum_i f_i P_i over the batch
    sequence_aux_loss_weight: float = 0.0  # the same loss per sequence, averaged (DeepSeek-V3: 0.0001)
    router_z_loss_weight: float = 0.001  # mean logsumexp(router logits)^2 (ST-MoE)
    expert_ffn_dim: int = 0  # each expert's (and shared expert's) hidden width; 0: model.ffn_dim
    # The first n layers dense (model.ffn_dim wide), then the every_n_layers pattern over the rest
    # (DeepSeek-V3's first_k_dense_replace: 3)
    first_dense_layers: int = 0

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
    # rope_scaling=yarn (YaRN, DeepSeek-V3's 128k extension): the ramp between extrapolated and
    # interpolated frequencies (beta_fast, beta_slow rotations over rope_original_max_len), the rotated
    # dims scaled by m(mscale) / m(mscale_all_dim) with m(s) = 0.1 s ln(factor) + 1 (by m(1) when
    # mscale_all_dim is 0), and latent attention's scores by m(mscale_all_dim)^2 (transformers'
    # yarn_get_mscale and yarn_apply_mscale).
    rope_yarn_beta_fast: float = 32.0
    rope_yarn_beta_slow: float = 1.0
    rope_yarn_mscale: float = 1.0
    rope_yarn_mscale_all_dim: float = 0.0
    tie_embeddings: bool = False
    qkv_bias: bool = False  # learned biases on the query, key and value projections (Qwen2, Qwen2-MoE)
    qk_norm: bool = False  # RMSNorm of each query and key head before the rotary embedding (Qwen3, Qwen3-MoE)
    sliding_window: int = 0  # keys a query sees, itself included (Mistral); 0: every earlier key
    # With sliding_window: layer i is global (every earlier key) when (i + 1) % global_every == 0, local
    # (the window) otherwise (Gemma 3: 6); 0: every layer has the window.
    global_every: int = 0
    rope_local_theta: float = 0.0  # global_every > 0: the local layers' plain RoPE base (Gemma 3: 10,000); 0: as global
    query_scale_dim: int = 0  # scores times query_scale_dim**-0.5 (Gemma's query_pre_attn_scalar); 0: head_dim
    norm_scale: str = "weight"  # one of NORM_SCALES
    block_norms: str = "pre"  # one of BLOCK_NORMS
    mlp_activation: str = "silu"  # one of MLP_ACTIVATIONS
    embed_scale: str = "none"  # one of EMBED_SCALES
    # Multi-head latent attention (DeepSeek-V2/V3) when kv_lora_rank > 0: keys and values expanded per head
    # from a normed [kv_lora_rank] latent, each query/key head qk_nope_head_dim unrotated dims then
    # qk_rope_head_dim rotated ones (the key's rotated part one per token, shared by the heads), value heads
    # v_head_dim wide; queries through a normed [q_lora_rank] latent (0: straight from x). num_kv_heads
    # equals num_heads and head_dim is unused (the q/k head is qk_nope_head_dim + qk_rope_head_dim).
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Multi-token prediction (DeepSeek-V3): mtp_depth modules after the model, module k predicting the token
    # k+1 ahead (model/mtp.py); its cross-entropy, times mtp_loss_weight / mtp_depth summed over the depths,
    # joins the objective (training only). 0: off.
    mtp_depth: int = 0
    mtp_loss_weight: float = 0.3
    init_std: float = 0.02
    attention: str = "xla"  # xla | flash | cudnn | auto (auto: cudnn or flash on GPU, xla on CPU)
    flash_block_q: int = 0  # flash kernel's query tile (forward, dQ); 0: tuned default
    flash_block_kv: int = 0  # flash kernel's key tile (forward, dK/dV); 0: tuned default
    remat: str = "none"  # one of REMAT_POLICIES
    loss_chunk_tokens: int = 0  # positions per chunk of the output layer and loss (ops/loss.py); 0: derived
    compute_dtype: str = "bfloat16"  # bfloat16 | float32 | float16; params stay float32
    fp8: Fp8Config = dataclasses.field(default_factory=Fp8Config)
    moe: MoeConfig = dataclasses.field(default_factory=MoeConfig)

    @property
    def expert_ffn_dim(self) -> int:
        return self.moe.expert_ffn_dim or self.ffn_dim

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (`kv_lora_rank` > 0)."""
        return self.kv_lora_rank > 0

    @property
    def resolved_head_dim(self) -> int:
        """Each query and key head's width (MLA: qk_nope_head_dim + qk_rope_head_dim)."""
        if self.mla:
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.head_dim or self.d_model // self.num_heads

    @property
    def value_head_dim(self) -> int:
        """Each value head's width (MLA: v_head_dim; else the query's)."""
        return self.v_head_dim if self.mla else self.resolved_head_dim

    @property
    def rope_dim(self) -> int:
        """The rotated dims of a query/key head (MLA: qk_rope_head_dim; else all of them)."""
        return self.qk_rope_head_dim if self.mla else self.resolved_head_dim

    @property
    def num_moe_layers(self) -> int:
        """MoE layers: one in every_n_layers after the first_dense_layers (0 without MoE)."""
        moe = self.moe
        return (self.num_layers - moe.first_dense_layers) // moe.every_n_layers if moe.enabled else 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer` (from 0) is an MoE layer."""
        j = layer - self.moe.first_dense_layers
        return self.moe.enabled and j >= 0 and (j + 1) % self.moe.every_n_layers == 0


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """The parallelism plan: the device mesh (axes outermost to innermost; one axis may be -1: it
    takes the remaining devices) and how each axis is used."""

    data: int = 1
    fsdp: int = -1
    pipeline: int = 1  # stages: the layer stack cut into `pipeline` parts (of equal depth unless pipeline_layers)
    expert: int = 1  # expert parallelism: groups of model.moe experts on different devices (shards the batch too)
    context: int = 1
    tensor: int = 1
    sequence_parallel: bool = False  # Megatron SP: norms/residual sharded along sequence over `tensor`
    # With sequence parallelism: none (the all-gather before Q/K/V and gate/up, the reduce-scatter after
    # O and down, on the critical path) | collective_matmul (each decomposed into tensor-1 ppermute
    # steps under the partial matmuls: parallel/collective_matmul.py)
    tensor_overlap: str = "none"
    zero_stage: int = 3  # over fsdp: 1 optimizer state sharded; 2: + gradients; 3: + parameters (FSDP)
    # The mesh axes ZeRO shards over (`zero_stage`'s state, along d_model): fsdp | fsdp+context, as
    # Megatron's distributed optimizer shards over DP x CP (the context devices hold the weights whole
    # otherwise; their gradients are reduce-scattered over both axes once per step).
    zero_axes: str = "fsdp"
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
    reduce_dtype: str = "float32"  # micro-batch gradient sums and their once-per-step reduction (float32 | bfloat16)

    # pipeline > 1: gpipe | 1f1b | interleaved | zero_bubble (lumen_jax/parallel/pipeline/schedule.py); its
    # micro-batches are train.micro_batches
    pipeline_schedule: str = "1f1b"
    pipeline_virtual_stages: int = 1  # interleaved: chunks of layers per device
    # Layers per virtual stage (pipeline * pipeline_virtual_stages numbers, in stage order, summing to
    # model.num_layers), e.g. Llama 3's 126 layers on 16 stages: [7, 8, ..., 8, 7]; (): even stages.
    # Every stage holds max(pipeline_layers) layer slots in memory; a stage with fewer layers fills its
    # slots with zero layers (the identity), computed in lock step, so they cost FLOPs (not counted in
    # the FLOPs/MFU metrics) but no step time. Ignored with one stage; checkpoints hold the real layers only.
    pipeline_layers: tuple[int, ...] = ()

    # The mesh axes, the one list of their names, outermost to innermost (Llama 3's order: docs/PARALLELISM.md).
    AXES: typing.ClassVar[tuple[str, ...]] = ("data", "fsdp", "pipeline", "expert", "context", "tensor")

    @property
    def zero_mesh_axes(self) -> tuple[str, ...]:
        """`zero_axes` as mesh axis names, outermost first."""
        return tuple(self.zero_axes.split("+"))

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
class MixtureSource:
    """One source of `data.mixture`: its paths (as data.paths for data.source), its share of the rows."""

    paths: tuple[str, ...] = ()
    weight: float = 1.0  # rows drawn in proportion to the weights (normalised over the mixture)
    name: str = ""  # in metrics (tokens_<name>); "": the first path's last name before any glob

    @property
    def label(self) -> str:
        """`name`, else the first path's last component before any glob: data/web -> web,
        corpus/code/*.jsonl -> code."""
        if self.name:
            return self.name
        parts = [p for p in re.split(r"[\\/]", self.paths[0]) if p] if self.paths else []
        fixed = list(itertools.takewhile(lambda p: not any(c in p for c in "*?["), parts))
        return fixed[-1] if fixed else "source"


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Token source, tokenizer and packing."""

    source: str = "builtin"  # builtin (Python stdlib text, no download) | files | prepared
    paths: tuple[str, ...] = ()  # source=files: globs of .txt / .jsonl / .parquet; prepared: directories
    mixture: tuple[MixtureSource, ...] = ()  # instead of paths: sources with weights (files or prepared)
    order: str = "documents"  # documents (shuffle documents, pack per row) | windows (prepared: shuffle windows)
    text_field: str = "text"  # field holding the text in jsonl / parquet rows
    tokenizer: str = "byte"  # byte | path to a Hugging Face tokenizers JSON file (made absolute on load)
    tokenizer_sha256: str = ""  # what that file must hold; "": taken from it on load (a run records both)
    seq_len: int = 128
    global_batch_size: int = 16
    builtin_max_bytes: int = 4_000_000  # cap on the builtin corpus (bytes of source text)
    shuffle: bool = True
    num_workers: int = 0  # grain worker processes (0: in-process)
    prefetch: int = 0  # batches made ahead in the background (a thread; with num_workers, per worker)
    eval_paths: tuple[str, ...] = ()  # globs of held-out files for evaluation (same formats as paths)
    eval_share: float = 0.0  # without eval_paths: this share of the documents is held out of training
    on_change: str = "refuse"  # resuming on other data than the checkpoint's: refuse | restart (the data from its start)


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
    profile_steps: tuple[int, ...] = ()  # [start, stop]: a jax.profiler trace of steps start..stop-1 (<run_dir>/profile/)
    slow_step_factor: float = 2.0  # a step this many times slower than the running median goes to events.jsonl


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
    # XLA options of the train step on GPUs (lumen_jax/runtime/process.py GPU_OVERLAP_FLAGS; those this
    # jaxlib lacks are left out): overlap
    # (latency-hiding scheduler, async and pipelined collectives, combine thresholds from the config) |
    # none (XLA's defaults) | any other string: literal flags. CPU runs ignore it.
    xla_gpu_flags: str = "overlap"
    # refuse: a run the planner puts over plan.startup.OVER_MEMORY times the device's (CPU: the host's)
    # memory stops in one line before compiling | off: compile it anyway
    memory_check: str = "refuse"


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Several processes (one per node or per GPU) in one job: how they find each other, which devices
    each uses, and which mesh axes cross nodes. Unset fields come from the environment (SLURM,
    JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID); see lumen_jax/runtime/distributed.py."""

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
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")  # lumen_jax.parallel.pipeline.schedule.SCHEDULES
DATA_SOURCES = ("builtin", "files", "prepared")
DATA_ORDERS = ("documents", "windows")
DATA_ON_CHANGE = ("refuse", "restart")
PLATFORMS = ("", "cpu", "gpu", "cuda", "rocm", "tpu")

# Enum-like fields: the allowed values, checked on load and in `validate`.
CHOICES: dict[str, tuple[Any, ...]] = {
    "model.attention": ATTENTION_IMPLS,
    "model.remat": REMAT_POLICIES,
    "model.compute_dtype": COMPUTE_DTYPES,
    "model.rope_scaling": ROPE_SCALINGS,
    "model.norm_scale": NORM_SCALES,
    "model.block_norms": BLOCK_NORMS,
    "model.mlp_activation": MLP_ACTIVATIONS,
    "model.embed_scale": EMBED_SCALES,
    "model.fp8.recipe": FP8_RECIPES,
    "model.fp8.layers": FP8_LAYERS,  # list fields: every item
    "model.fp8.keep_bf16": FP8_KEEP_BF16,
    "model.moe.router": MOE_ROUTERS,
    "model.moe.balance": MOE_BALANCE,
    "optim.schedule": SCHEDULES,
    "mesh.zero_stage": ZERO_STAGES,
    "mesh.zero_axes": ("fsdp", "fsdp+context"),
    "mesh.context_parallel": CONTEXT_PARALLEL,
    "mesh.context_balance": CONTEXT_BALANCE,
    "mesh.tensor_overlap": TENSOR_OVERLAP,
    "mesh.fsdp_grad_reduce": ("every_micro_batch", "once"),
    "mesh.fsdp_regather": ("per_micro_batch", "per_step"),
    "mesh.reduce_dtype": ("float32", "bfloat16"),
    "mesh.pipeline_schedule": PIPELINE_SCHEDULES,
    "data.source": DATA_SOURCES,
    "data.order": DATA_ORDERS,
    "data.on_change": DATA_ON_CHANGE,
    "runtime.platform": PLATFORMS,
    "runtime.malloc": ("reuse", "default"),
    "runtime.memory_check": ("refuse", "off"),
}

SECTIONS: dict[str, type] = {
    "model": ModelConfig, "mesh": MeshConfig, "optim": OptimConfig, "data": DataConfig,
    "train": TrainConfig, "checkpoint": CheckpointConfig, "log": LogConfig, "runtime": RuntimeConfig,
    "distributed": DistributedConfig,
}


# Sub-sections one level down (`model.fp8.recipe`): a field whose type is a dataclass.
NESTED: dict[str, type] = {"model.fp8": Fp8Config, "model.moe": MoeConfig}
# Lists of sub-sections (`data.mixture: [{paths: [...], weight: 0.7}, ...]`): each item a mapping.
ITEMS: dict[str, type] = {"data.mixture": MixtureSource}

# Keys that moved to another section: the old spelling is an error naming the new one.
MOVED: dict[str, str] = {
    "optim.zero_stage": "mesh.zero_stage",
    "model.context_parallel": "mesh.context_parallel",
    "model.context_balance": "mesh.context_balance",
}


__all__ = ["ConfigError", "ATTENTION_IMPLS", "CONTEXT_PARALLEL", "CONTEXT_BALANCE", "TENSOR_OVERLAP", "REMAT_POLICIES",
           "REMAT_SAVES", "PROJECTION_NAMES",
           "COMPUTE_DTYPES", "ROPE_SCALINGS", "NORM_SCALES", "BLOCK_NORMS", "MLP_ACTIVATIONS", "EMBED_SCALES",
           "FP8_RECIPES", "FP8_LAYERS", "FP8_KEEP_BF16",
           "MOE_ROUTERS", "MOE_BALANCE", "Fp8Config", "MoeConfig", "MixtureSource", "DATA_ORDERS", "ITEMS", "ModelConfig", "MeshConfig", "OptimConfig",
           "DataConfig", "TrainConfig", "CheckpointConfig", "LogConfig", "RuntimeConfig",
           "DistributedConfig", "Config", "SCHEDULES", "ZERO_STAGES", "PIPELINE_SCHEDULES",
           "DATA_SOURCES", "PLATFORMS", "CHOICES", "SECTIONS", "NESTED", "MOVED"]
