"""Validation of a whole `Config` against a device count, before any mesh or array exists (every
rule that needs more than one field or the device count; single fields are checked on load).

`validate` raises `ConfigError` with one line naming the key, the value, the rule and a fix;
`warnings` lists settings that are legal but probably not meant. No JAX import.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import struct
from typing import Any, Callable, Iterator

from lumen_jax.config import REMAT_SAVES, Config, ConfigError, MeshConfig, from_dict, show, to_dict

# (key, comparison, bound): the range each number must lie in, checked before anything divides by it.
# Emulated CPU devices one process may start: XLA starts a thread pool per device (100,000 hung
# start-up, deaf to SIGTERM); launch/local.py holds --devices-per-process to it too.
MAX_CPU_DEVICES = 256
# Sequences of one step on one batch shard (data*fsdp*expert): the data pipeline builds a packed stream
# per row (10^12 rows hung start-up); 4096 is far past any batch a device computes.
MAX_ROWS_PER_SHARD = 4096
# data.mixture weights: each in this range, the largest at most MIXTURE_RATIO times the smallest (grain
# mixes integer proportions, the smallest scaled to 100: 1e-300 beside 1 overflowed).
MIXTURE_WEIGHTS = (1e-30, 1e30)
MIXTURE_RATIO = 10**6
# train.seed seeds JAX's PRNG, which takes a C long (int64): 2**63 and above overflow in its C code.
SEED_LIMIT = 2**63

_BOUNDS: tuple[tuple[str, str, float], ...] = (
    ("model.d_model", ">=", 1), ("model.num_layers", ">=", 1), ("model.num_heads", ">=", 1),
    ("model.num_kv_heads", ">=", 1), ("model.head_dim", ">=", 0), ("model.ffn_dim", ">=", 1),
    ("model.sliding_window", ">=", 0), ("model.global_every", ">=", 0), ("model.rope_local_theta", ">=", 0),
    ("model.query_scale_dim", ">=", 0), ("model.vocab_size", ">=", 1), ("model.norm_eps", ">", 0),
    ("model.rope_theta", ">", 0), ("model.rope_scaling_factor", ">", 0), ("model.rope_original_max_len", ">=", 1),
    ("model.init_std", ">", 0), ("model.fp8.amax_history", ">=", 1),
    ("model.moe.num_experts", ">=", 0), ("model.moe.top_k", ">=", 1), ("model.moe.every_n_layers", ">=", 1),
    ("model.moe.shared_experts", ">=", 0), ("model.moe.aux_loss_weight", ">=", 0),
    ("model.moe.router_z_loss_weight", ">=", 0), ("model.moe.expert_ffn_dim", ">=", 0),
    ("model.moe.routed_scaling", ">", 0), ("model.moe.groups", ">=", 1), ("model.moe.top_groups", ">=", 1),
    ("model.moe.bias_update_rate", ">=", 0), ("model.moe.sequence_aux_loss_weight", ">=", 0),
    ("model.rope_yarn_beta_fast", ">", 0), ("model.rope_yarn_beta_slow", ">", 0), ("model.rope_yarn_mscale", ">=", 0),
    ("model.rope_yarn_mscale_all_dim", ">=", 0), ("model.mtp_depth", ">=", 0), ("model.mtp_loss_weight", ">=", 0),
    ("model.moe.first_dense_layers", ">=", 0), ("model.kv_lora_rank", ">=", 0), ("model.q_lora_rank", ">=", 0),
    ("model.qk_nope_head_dim", ">=", 0), ("model.qk_rope_head_dim", ">=", 0), ("model.v_head_dim", ">=", 0),
    ("optim.lr", ">", 0), ("optim.min_lr_ratio", ">=", 0), ("optim.min_lr_ratio", "<=", 1),
    ("model.loss_chunk_tokens", ">=", 0), ("optim.warmup_steps", ">=", 0), ("optim.decay_steps", ">=", 0),
    ("optim.b1", ">=", 0), ("optim.b1", "<", 1), ("optim.b2", ">=", 0), ("optim.b2", "<", 1),
    ("optim.eps", ">", 0), ("optim.weight_decay", ">=", 0), ("optim.grad_clip", ">=", 0),
    ("optim.z_loss", ">=", 0), ("optim.loss_scale_init", ">", 0),
    ("optim.loss_scale_growth_interval", ">=", 1),
    ("data.seq_len", ">=", 1), ("data.global_batch_size", ">=", 1), ("data.builtin_max_bytes", ">=", 1),
    ("data.num_workers", ">=", 0), ("data.prefetch", ">=", 0), ("data.eval_share", ">=", 0), ("data.eval_share", "<", 1),
    ("train.eval_every", ">=", 0), ("train.eval_batches", ">=", 1), ("train.seed", ">=", 0),
    ("train.seed", "<", SEED_LIMIT),
    ("train.steps", ">=", 1), ("train.micro_batches", ">=", 1), ("train.max_nonfinite_steps", ">=", 1),
    ("train.sdc_check_every", ">=", 0), ("train.slow_step_factor", ">", 1), ("mesh.pipeline_virtual_stages", ">=", 1),
    ("checkpoint.every_steps", ">=", 0), ("checkpoint.every_minutes", ">=", 0), ("checkpoint.keep", ">=", 1),
    ("checkpoint.keep_every", ">=", 0),
    ("log.every_steps", ">=", 1),
    ("runtime.cpu_devices", ">=", 0), ("runtime.cpu_devices", "<=", MAX_CPU_DEVICES),
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


def _in_float32(value: float) -> float:
    """`value` as float32 holds it (the dtype the step computes in): rounded, or +-inf past its range."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def address_problem(address: str) -> str | None:
    """What is wrong with `address` as a coordinator's host:port (the rest of a one-line error), or None."""
    m = re.fullmatch(r"([^\s:\[\]]+|\[[0-9a-fA-F:.]+\]):(\d{1,5})", address)
    if m is None or not 1 <= int(m.group(2)) <= 65535:
        return "must be host:port of process 0, the port a number from 1 to 65535 (e.g. node001:61234)"
    return None


def _divisors(n: int, limit: int) -> str:
    return ", ".join(str(d) for d in range(1, min(n, limit) + 1) if n % d == 0)


# A rule: (cfg, resolved mesh shape) -> (holds, message) pairs, checked in order. Each feature
# registers its own with @rule; `validate` runs them in registration order, the first that fails
# raises. A new feature adds a rule here, beside the others, and edits nothing else.
Rule = Callable[[Config, dict[str, int]], Iterator[tuple[bool, str]]]
RULES: list[Rule] = []


def rule(fn: Rule) -> Rule:
    RULES.append(fn)
    return fn


@rule
def _model_shape(cfg: Config, shape: dict[str, int]) -> Iterator[tuple[bool, str]]:
    """The model's dimensions against each other and against tensor and fsdp."""
    m, tp, n = cfg.model, shape["tensor"], math.prod(shape.values())
    for k in ("num_heads", "num_kv_heads", "ffn_dim", "vocab_size"):
        yield (getattr(m, k) % tp == 0,
               f"mesh.tensor={tp} does not divide model.{k}={getattr(m, k)}; "
               f"choose mesh.tensor among the divisors of {getattr(m, k)} ({_divisors(getattr(m, k), n)})")
    yield (m.num_heads % m.num_kv_heads == 0,
           f"model.num_kv_heads={m.num_kv_heads} does not divide model.num_heads={m.num_heads}; grouped-query "
           f"attention needs num_kv_heads among the divisors of {m.num_heads} "
           f"({_divisors(m.num_heads, m.num_heads)})")
    yield (m.mla or m.head_dim > 0 or m.d_model % m.num_heads == 0,  # MLA: its own head dims, checked below
           f"model.d_model={m.d_model} is not divisible by model.num_heads={m.num_heads}, so model.head_dim=0 "
           "cannot be derived; set model.head_dim explicitly or make d_model a multiple of num_heads")
    yield (m.mla or m.resolved_head_dim % 2 == 0 or (m.head_dim == 0 and m.d_model % m.num_heads),
           (f"model.head_dim={m.head_dim}" if m.head_dim else
            f"model.head_dim=0 derives d_model/num_heads={m.d_model}/{m.num_heads}={m.resolved_head_dim}, which")
           + " must be even: RoPE rotates pairs of dimensions; set model.head_dim to an even value")
    zero = math.prod(shape[a] for a in cfg.mesh.zero_mesh_axes)
    yield (shape["fsdp"] == zero or m.d_model % zero == 0,
           f"mesh.zero_axes={cfg.mesh.zero_axes}: mesh.fsdp*mesh.context={zero} does not divide "
           f"model.d_model={m.d_model} (the ZeRO state is sharded along d_model over both); choose axes whose "
           f"product divides {m.d_model} or mesh.zero_axes=fsdp")
    yield (m.d_model % shape["fsdp"] == 0,
           f"mesh.fsdp={shape['fsdp']} does not divide model.d_model={m.d_model} (parameters and optimizer "
           f"state are sharded along d_model over fsdp); choose mesh.fsdp among the divisors of {m.d_model} "
           f"({_divisors(m.d_model, n)})")
    for k in ("flash_block_q", "flash_block_kv"):
        yield (getattr(m, k) == 0 or (getattr(m, k) >= 16 and getattr(m, k) & (getattr(m, k) - 1) == 0),
               f"model.{k}={getattr(m, k)} must be 0 (tuned default) or a power of two >= 16; "
               f"set model.{k} to 0, 16, 32, 64 or 128")
    yield (m.rope_scaling != "llama3" or m.rope_high_freq_factor > m.rope_low_freq_factor,
           f"model.rope_high_freq_factor={m.rope_high_freq_factor} must be > model.rope_low_freq_factor="
           f"{m.rope_low_freq_factor} for rope_scaling=llama3; raise the high or lower the low factor")
    yield (not m.global_every or m.sliding_window,
           f"model.global_every={m.global_every} alternates windowed and global layers but model.sliding_window=0; "
           "set the local layers' window or model.global_every=0")
    yield (not m.rope_local_theta or m.global_every,
           f"model.rope_local_theta={m.rope_local_theta} is the local layers' RoPE base but model.global_every=0 "
           "makes every layer alike; set model.global_every or model.rope_local_theta=0")
    if m.mla:
        for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            yield (getattr(m, k) > 0, f"model.{k}={getattr(m, k)} must be > 0 with model.kv_lora_rank="
                                      f"{m.kv_lora_rank} (multi-head latent attention); set it, e.g. DeepSeek-V3's "
                                      f"{dict(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)[k]}")
        yield (m.qk_rope_head_dim % 2 == 0,
               f"model.qk_rope_head_dim={m.qk_rope_head_dim} must be even: RoPE rotates pairs of dimensions")
        yield (m.num_kv_heads == m.num_heads,
               f"model.num_kv_heads={m.num_kv_heads} with model.kv_lora_rank={m.kv_lora_rank}: latent attention "
               f"expands keys and values per query head; set model.num_kv_heads={m.num_heads} (model.num_heads)")
        yield (m.v_head_dim <= m.resolved_head_dim,
               f"model.v_head_dim={m.v_head_dim} exceeds qk_nope_head_dim+qk_rope_head_dim={m.resolved_head_dim}: "
               "the kernels take narrower values only (zero-padded); lower model.v_head_dim")
        for k in ("sliding_window", "global_every", "qkv_bias", "qk_norm"):
            yield (not getattr(m, k), f"model.{k}={show(getattr(m, k))} with model.kv_lora_rank={m.kv_lora_rank}: "
                                      f"latent attention has none; set model.{k} to its default")
        for k in ("kv_lora_rank", "q_lora_rank"):
            yield (cfg.mesh.zero_axes == "fsdp" or getattr(m, k) % math.prod(shape[a] for a in cfg.mesh.zero_mesh_axes) == 0,
                   f"mesh.zero_axes={cfg.mesh.zero_axes} over {math.prod(shape[a] for a in cfg.mesh.zero_mesh_axes)} "
                   f"devices does not divide model.{k}={getattr(m, k)}; use mesh.zero_axes=fsdp")
            yield (getattr(m, k) % shape["fsdp"] == 0,
                   f"mesh.fsdp={shape['fsdp']} does not divide model.{k}={getattr(m, k)} (the latent axis of the "
                   f"up-projections is sharded over fsdp); choose mesh.fsdp among the divisors of {getattr(m, k)}")
    else:
        for k in ("q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            yield (not getattr(m, k), f"model.{k}={getattr(m, k)} is a latent-attention key but model.kv_lora_rank=0; "
                                      f"set model.kv_lora_rank > 0 (MLA) or model.{k}=0")
    pp, cp = shape["pipeline"], shape["context"]
    # A pipeline runs multi-token prediction with the head, each stage on 1/P of each micro-batch's
    # rows of each batch shard (parallel/pipeline/units.py, `_rows`): whole, in-order rows.
    yield (not m.mtp_depth or pp == 1 or cp == 1,
           f"model.mtp_depth={m.mtp_depth} with mesh.pipeline={pp} and mesh.context={cp}: a pipeline runs "
           "multi-token prediction on whole rows, which context parallelism splits inside the stages; "
           "use mesh.context=1 with the pipeline, mesh.pipeline=1, or model.mtp_depth=0")
    shards = shape["data"] * shape["fsdp"] * shape["expert"]
    rows = cfg.data.global_batch_size // max(cfg.train.micro_batches * shards, 1)
    yield (not m.mtp_depth or pp == 1 or rows % pp == 0,
           f"model.mtp_depth={m.mtp_depth} with mesh.pipeline={pp}: each stage runs multi-token prediction on "
           f"1/{pp} of a micro-batch's {rows} rows per batch shard (data.global_batch_size="
           f"{cfg.data.global_batch_size} / train.micro_batches={cfg.train.micro_batches} / {shards} shards); "
           f"make that a multiple of {pp} (e.g. data.global_batch_size={cfg.train.micro_batches * shards * pp})")
    yield (not m.mtp_depth or pp == 1 or not m.moe.enabled or not m.moe.aux_loss_weight,
           f"model.moe.aux_loss_weight={m.moe.aux_loss_weight} with model.mtp_depth={m.mtp_depth} and "
           f"mesh.pipeline={pp}: the stages split the MTP blocks' rows, and the batch-wide balance loss is not a "
           "sum over rows; use model.moe.sequence_aux_loss_weight (per row) or balance=bias, or mesh.pipeline=1")
    yield (not m.global_every or not m.moe.enabled,
           f"model.global_every={m.global_every} with model.moe.num_experts={m.moe.num_experts}: local and global "
           "layers are not yet grouped with MoE layers; use model.global_every=0 or a dense model")
    yield (m.remat not in REMAT_SAVES or not (m.mla or m.moe.enabled),
           f"model.remat={m.remat} saves named projections of dense attention and MLP layers, and "
           f"{'latent attention (model.kv_lora_rank)' if m.mla else 'MoE layers (model.moe.num_experts)'} name none; "
           "use dots_with_no_batch_dims_saveable, save_attention_out or full")


@rule
def _moe(cfg: Config, shape: dict[str, int]) -> Iterator[tuple[bool, str]]:
    """model.moe against the model and the mesh (an `expert` axis needs experts to place)."""
    m = cfg.model
    moe, ep, tp = m.moe, shape["expert"], shape["tensor"]
    if not moe.enabled:
        yield (ep == 1, f"mesh.expert={ep} needs a mixture of experts but model.moe.num_experts=0; "
                        "set model.moe.num_experts to a multiple of mesh.expert or mesh.expert=1")
        return
    yield (moe.top_k <= moe.num_experts,
           f"model.moe.top_k={moe.top_k} exceeds model.moe.num_experts={moe.num_experts}; "
           f"choose top_k between 1 and {moe.num_experts}")
    yield (moe.num_experts % ep == 0,
           f"mesh.expert={ep} does not divide model.moe.num_experts={moe.num_experts}; choose mesh.expert "
           f"among the divisors of {moe.num_experts} ({_divisors(moe.num_experts, moe.num_experts)})")
    yield (moe.num_experts % moe.groups == 0,
           f"model.moe.groups={moe.groups} does not divide model.moe.num_experts={moe.num_experts}; choose groups "
           f"among the divisors of {moe.num_experts} ({_divisors(moe.num_experts, moe.num_experts)})")
    yield (moe.top_groups <= moe.groups,
           f"model.moe.top_groups={moe.top_groups} exceeds model.moe.groups={moe.groups}; "
           f"choose top_groups between 1 and {moe.groups}")
    per_group = moe.num_experts // moe.groups if moe.num_experts % moe.groups == 0 else moe.num_experts
    yield (moe.top_k <= moe.top_groups * per_group,
           f"model.moe.top_k={moe.top_k} exceeds the {moe.top_groups * per_group} experts of model.moe.top_groups="
           f"{moe.top_groups} groups of {per_group}; raise top_groups or lower top_k")
    yield (not moe.shared_gate or moe.shared_experts > 0,
           "model.moe.shared_gate=true gates the shared experts but model.moe.shared_experts=0; "
           "set shared_experts >= 1 or shared_gate=false")
    yield (moe.capacity_factor is None or moe.capacity_factor > 0,
           f"model.moe.capacity_factor={show(moe.capacity_factor)} must be > 0; "
           "use e.g. 1.25, or null for dropless")
    first, rest = moe.first_dense_layers, m.num_layers - moe.first_dense_layers
    yield (0 <= first < m.num_layers,
           f"model.moe.first_dense_layers={first} must be between 0 and model.num_layers-1={m.num_layers - 1} "
           "(at least one layer after them is MoE); lower it or set model.moe.num_experts=0 for a dense model")
    yield (rest <= 0 or rest % moe.every_n_layers == 0,
           (f"model.moe.every_n_layers={moe.every_n_layers} does not divide model.num_layers={m.num_layers}; "
            f"choose it among the divisors of {m.num_layers} ({_divisors(m.num_layers, m.num_layers)})") if not first
           else (f"model.moe.every_n_layers={moe.every_n_layers} does not divide the {rest} layers after "
                 f"model.moe.first_dense_layers={first}; choose it among the divisors of {rest}"))
    yield (m.expert_ffn_dim % tp == 0,
           f"mesh.tensor={tp} does not divide the experts' ffn dim {m.expert_ffn_dim} (model.moe.expert_ffn_dim, "
           "0: model.ffn_dim); choose an expert_ffn_dim that is a multiple of mesh.tensor")
    yield (m.fp8.recipe == "none",
           f"model.fp8.recipe={m.fp8.recipe!r} is not supported with model.moe (the experts' grouped "
           "matmuls have no fp8 form); set model.fp8.recipe=none or model.moe.num_experts=0")


@rule
def _pipeline(cfg: Config, shape: dict[str, int]) -> Iterator[tuple[bool, str]]:
    """mesh.pipeline with its schedule (lumen_jax/parallel/pipeline/schedule.py). With one stage every
    schedule is the same m forward-backward passes in a row (gradient accumulation): ignored, and so
    is mesh.pipeline_layers (uneven stages)."""
    mesh, m, layers = cfg.mesh, cfg.train.micro_batches, cfg.model.num_layers
    p, v = shape["pipeline"], mesh.pipeline_virtual_stages
    chunks = p * v
    yield (v == 1 or mesh.pipeline_schedule == "interleaved",
           f"mesh.pipeline_virtual_stages={v} is for mesh.pipeline_schedule=interleaved, not "
           f"{mesh.pipeline_schedule}; set mesh.pipeline_virtual_stages=1 or mesh.pipeline_schedule=interleaved")
    uneven = p > 1 and bool(mesh.pipeline_layers)
    split = list(mesh.pipeline_layers)
    yield (not uneven or len(split) == chunks,
           f"mesh.pipeline_layers={split} has {len(split)} entries, not mesh.pipeline*mesh.pipeline_virtual_stages="
           f"{p}*{v}={chunks} (one per virtual stage); give {chunks} layer counts or [] for even stages")
    yield (not uneven or min(split) >= 1,
           f"mesh.pipeline_layers={split} gives a stage {min(split, default=1)} layers; every stage holds at "
           "least 1 layer")
    yield (not uneven or sum(split) == layers,
           f"mesh.pipeline_layers={split} sums to {sum(split)} layers, not model.num_layers={layers}; make "
           f"the counts add up to {layers}")
    fixes = f"use mesh.pipeline_layers (layers per stage, summing to {layers}), a multiple of {chunks} layers, or "
    yield (p == 1 or uneven or layers % chunks == 0,
           (f"model.num_layers={layers} is not divisible by mesh.pipeline*mesh.pipeline_virtual_stages={p}*{v}="
            f"{chunks}; {fixes}a mesh.pipeline and mesh.pipeline_virtual_stages whose product divides {layers}")
           if v > 1 else
           (f"model.num_layers={layers} is not divisible by mesh.pipeline={p}; {fixes}a mesh.pipeline among the "
            f"divisors of {layers}"))
    n = cfg.model.moe.every_n_layers if cfg.model.moe.enabled else 1
    first = cfg.model.moe.first_dense_layers if cfg.model.moe.enabled else 0
    # The first dense layers fill the first stages in order (parallel/pipeline/layout.Pipeline.firsts).
    per = split if uneven else [layers // chunks] * chunks
    rest = [a - min(a, max(0, first - sum(per[:w]))) for w, a in enumerate(per)]
    yield (not uneven or all(a % n == 0 for a in rest),
           f"mesh.pipeline_layers={split} with model.moe.every_n_layers={n}"
           + (f" and model.moe.first_dense_layers={first}" if first else "")
           + f": a stage holds whole groups of {n} layers (n-1 dense, then one MoE)"
           + (" after the first dense layers, which fill the first stages" if first else "")
           + f"; give every stage a multiple of {n} layers" + (" besides its first dense ones" if first else ""))
    yield (p == 1 or uneven or not first or layers % chunks or all(a % n == 0 for a in rest),
           f"model.num_layers={layers} in {chunks} even stages of {layers // max(chunks, 1)} with "
           f"model.moe.first_dense_layers={first} and model.moe.every_n_layers={n} leaves a stage a part of a "
           f"group of {n} layers; set mesh.pipeline_layers (the first dense layers fill the first stages, "
           f"every stage then holds whole groups of {n})")
    yield (p == 1 or mesh.pipeline_schedule == "gpipe" or m >= p,
           f"mesh.pipeline_schedule={mesh.pipeline_schedule} needs train.micro_batches={m} >= mesh.pipeline={p} "
           f"(each stage keeps up to {p} micro-batches in flight); raise train.micro_batches to {p} or more "
           "or use mesh.pipeline_schedule=gpipe")
    # Sequence parallelism's ticks run without the replica vmap (XLA's SPMD partitioner stops on it,
    # docs/PLATFORM.md): data and context are manual in the stages instead, which fsdp cannot be (its
    # weights are sharded), so its gradients would cross it in every tick, not once.
    yield (p == 1 or not mesh.sequence_parallel or shape["tensor"] == 1 or shape["fsdp"] == 1
           or mesh.fsdp_grad_reduce != "once",
           f"mesh.fsdp_grad_reduce=once with mesh.sequence_parallel=true, mesh.tensor={shape['tensor']} and "
           f"mesh.pipeline={p}: these stages reduce fsdp's gradients in every tick, not once; set "
           "mesh.fsdp_grad_reduce=every_micro_batch, or move mesh.fsdp to mesh.data")
    yield (p == 1 or mesh.pipeline_schedule != "interleaved" or m % p == 0,
           f"mesh.pipeline_schedule=interleaved needs train.micro_batches={m} divisible by mesh.pipeline={p} "
           f"(micro-batches go through the chunks in groups of {p}); use a multiple of {p}")
    moe = cfg.model.moe
    groups = layers // moe.every_n_layers if moe.enabled else chunks
    yield (p == 1 or uneven or first or groups % chunks == 0,  # uneven or first dense: whole groups, checked above
           f"model.num_layers={layers} with model.moe.every_n_layers={moe.every_n_layers} makes {groups} groups of "
           f"layers (n-1 dense, then one MoE), not divisible into mesh.pipeline*mesh.pipeline_virtual_stages={chunks} "
           f"stages of whole groups; use a multiple of {chunks * moe.every_n_layers} layers")


@rule
def _batch_and_sequence(cfg: Config, shape: dict[str, int]) -> Iterator[tuple[bool, str]]:
    """The global batch over the batch axes and micro-batches; the sequence over context (and tensor
    with sequence parallelism)."""
    d, mesh = cfg.data, cfg.mesh
    tp, cp, ep = shape["tensor"], shape["context"], shape["expert"]
    batch_shards = shape["data"] * shape["fsdp"] * ep * cfg.train.micro_batches
    yield (d.global_batch_size % batch_shards == 0,
           f"data.global_batch_size={d.global_batch_size} is not divisible by mesh.data*mesh.fsdp*mesh.expert*"
           f"train.micro_batches={shape['data']}*{shape['fsdp']}*{ep}*{cfg.train.micro_batches}={batch_shards}; "
           f"use a multiple of {batch_shards} or change the mesh or train.micro_batches")
    shards = batch_shards // cfg.train.micro_batches
    yield (d.global_batch_size // shards <= MAX_ROWS_PER_SHARD,
           f"data.global_batch_size={d.global_batch_size} puts {d.global_batch_size // shards} sequences per step on "
           f"each of the mesh.data*mesh.fsdp*mesh.expert={shards} batch shards, more than {MAX_ROWS_PER_SHARD} (the "
           f"data pipeline builds one packed stream per sequence); use at most {MAX_ROWS_PER_SHARD * shards} "
           "or add devices")
    zigzag = cp > 1 and mesh.context_balance == "zigzag"
    need = math.lcm(2 * cp if zigzag else cp, cp * tp if mesh.sequence_parallel else 1)  # every rule below at once
    yield (d.seq_len % cp == 0,
           f"data.seq_len={d.seq_len} is not divisible by mesh.context={cp}; use a multiple of {need}"
           + (f" (mesh.context_balance=zigzag cuts it into 2*mesh.context={2 * cp} chunks)" if need != cp else ""))
    yield (not mesh.sequence_parallel or d.seq_len % (cp * tp) == 0,
           f"mesh.sequence_parallel=true needs data.seq_len={d.seq_len} divisible by mesh.context*mesh.tensor="
           f"{cp * tp}; use a multiple of {need} or set mesh.sequence_parallel=false")
    yield (not zigzag or d.seq_len % (2 * cp) == 0,
           f"mesh.context_balance=zigzag cuts data.seq_len={d.seq_len} into 2*mesh.context={2 * cp} chunks; "
           f"use a multiple of {need} or mesh.context_balance=contiguous")


@rule
def _tensor_overlap(cfg: Config, shape: dict[str, int]) -> Iterator[tuple[bool, str]]:
    """mesh.tensor_overlap=collective_matmul decomposes sequence parallelism's collectives of the dense
    layers' projections (lumen_jax/parallel/collective_matmul.py): it needs them, and plain einsums."""
    mesh, m = cfg.mesh, cfg.model
    if mesh.tensor_overlap == "none":
        return
    yield (mesh.sequence_parallel,
           f"mesh.tensor_overlap={mesh.tensor_overlap} decomposes sequence parallelism's all-gather and "
           "reduce-scatter over `tensor`, but mesh.sequence_parallel=false; set mesh.sequence_parallel=true "
           "or mesh.tensor_overlap=none")
    yield (m.fp8.recipe == "none",
           f"mesh.tensor_overlap={mesh.tensor_overlap} with model.fp8.recipe={m.fp8.recipe!r}: fp8 projections "
           "scale each operand as a whole (amax over all tokens) and are not decomposed into steps; set "
           "mesh.tensor_overlap=none or model.fp8.recipe=none")
    yield (not m.moe.enabled,
           f"mesh.tensor_overlap={mesh.tensor_overlap} with model.moe.num_experts={m.moe.num_experts}: the "
           "routed experts' grouped matmuls are not decomposed; set mesh.tensor_overlap=none or "
           "model.moe.num_experts=0")
    yield (shape["pipeline"] == 1 or mesh.pipeline_schedule != "zero_bubble",
           f"mesh.tensor_overlap={mesh.tensor_overlap} with mesh.pipeline_schedule=zero_bubble: its W units "
           "replay each projection's weight gradient as one einsum of the gathered input; set "
           "mesh.tensor_overlap=none or another mesh.pipeline_schedule")


@rule
def _zero_axes(cfg: Config, shape: dict[str, int]) -> Iterator[tuple[bool, str]]:
    """mesh.zero_axes=fsdp+context shards the ZeRO state over context too; the pipelined step's stages
    take their weights whole over context (their manual partitioning over the stages), which this layout has not been built for."""
    mesh = cfg.mesh
    yield (mesh.zero_axes == "fsdp" or shape["pipeline"] == 1,
           f"mesh.zero_axes={mesh.zero_axes} with mesh.pipeline={shape['pipeline']}: the pipelined step does not "
           "shard its state over context yet; set mesh.zero_axes=fsdp or mesh.pipeline=1")


@rule
def _schedule(cfg: Config, shape: dict[str, int]) -> Iterator[tuple[bool, str]]:
    """The learning-rate schedule's phases."""
    o = cfg.optim
    yield (o.decay_steps == 0 or o.schedule == "constant" or o.decay_steps > o.warmup_steps,
           f"optim.decay_steps={o.decay_steps} ends the decay before optim.warmup_steps="
           f"{o.warmup_steps} ends the warmup (both count from step 0); set optim.decay_steps above "
           f"{o.warmup_steps}, or 0 to decay until train.steps")


@rule
def _data_source(cfg: Config, shape: dict[str, int]) -> Iterator[tuple[bool, str]]:
    d = cfg.data
    yield (d.source != "builtin" or not d.paths,
           f"data.paths={show(d.paths)} is set but data.source={d.source!r} ignores it; set data.source=files "
           "(or prepared) to train on those paths, or remove data.paths")
    yield (d.source == "builtin" or bool(d.paths) or bool(d.mixture),
           f"data.source={d.source!r} but data.paths=[] is empty; set data.paths=[...] (or data.mixture) "
           "or data.source=builtin")


@rule
def _data_mixture(cfg: Config, shape: dict[str, int]) -> Iterator[tuple[bool, str]]:
    """data.mixture: sources with weights, instead of data.paths; data.order=windows needs prepared data."""
    d = cfg.data
    yield (not d.mixture or not d.paths,
           f"data.mixture and data.paths={show(d.paths)} are both set; list every source in data.mixture "
           "(paths and weight each) and remove data.paths")
    yield (not d.mixture or d.source != "builtin",
           "data.mixture needs data.source=files or prepared (the builtin corpus is one source)")
    names = []
    for i, m in enumerate(d.mixture):
        yield (bool(m.paths), f"data.mixture[{i}].paths is empty; give the source's "
               + ("prepared directories" if d.source == "prepared" else "globs"))
        yield (MIXTURE_WEIGHTS[0] <= m.weight <= MIXTURE_WEIGHTS[1], f"data.mixture[{i}].weight={show(m.weight)} "
               f"must be a positive number from {MIXTURE_WEIGHTS[0]:g} to {MIXTURE_WEIGHTS[1]:g} (weights are "
               "relative: 0.7 and 0.3, or token counts); remove the source to leave it out")
        names.append(m.label)
    weights = [m.weight for m in d.mixture]
    yield (not weights or max(weights) <= min(weights) * MIXTURE_RATIO,
           f"data.mixture weights {show(min(weights, default=0))} and {show(max(weights, default=0))} differ by more "
           f"than {MIXTURE_RATIO:,}x: the mixing's period would be longer than any run; raise the smallest weight "
           "or remove that source")
    dup = sorted({n for n in names if names.count(n) > 1})
    yield (not dup, f"data.mixture has two sources named {dup[0] if dup else ''!r}; give each a "
           "distinct name (data.mixture[i].name)")
    yield (d.order == "documents" or d.source == "prepared",
           f"data.order=windows cuts the prepared token stream into windows; it needs data.source=prepared "
           f"(not {d.source!r}), or data.order=documents")
    yield (d.order == "documents" or not d.eval_share,
           f"data.order=windows cuts whole token streams and cannot hold out data.eval_share={d.eval_share} of "
           "their documents; hold out data with data.eval_paths, or use data.order=documents")
    for p in d.paths if d.source == "prepared" else ():
        yield (os.path.isdir(p), f"data.paths entry {p!r} is not a directory; data.source=prepared reads "
               "directories written by python -m lumen_jax.data.prepare --out DIR")


@rule
def _distributed(cfg: Config, shape: dict[str, int]) -> Iterator[tuple[bool, str]]:
    """The process layout and the node split of the mesh axes."""
    dist = cfg.distributed
    why = address_problem(dist.coordinator)
    yield (not dist.coordinator or why is None, f"distributed.coordinator={show(dist.coordinator)} {why}")
    yield (dist.process_id < 0 or dist.num_processes == 0 or dist.process_id < dist.num_processes,
           f"distributed.process_id={dist.process_id} must be below distributed.num_processes="
           f"{dist.num_processes}; number processes 0..{dist.num_processes - 1}")
    for a, n in dist.across_nodes().items():
        yield (shape[a] % n == 0,
               f"distributed.across_nodes_{a}={n} does not divide mesh.{a}={shape[a]}; the axis is split into "
               f"across-node and in-node parts, so choose distributed.across_nodes_{a} among the divisors of "
               f"{shape[a]} ({_divisors(shape[a], shape[a])})")


@rule
def _inputs(cfg: Config, shape: dict[str, int]) -> Iterator[tuple[bool, str]]:
    """What the run reads besides its config: held-out data, weights to start from, a tokenizer."""
    d, t = cfg.data, cfg.train
    yield (not t.eval_every or bool(d.eval_paths) or d.eval_share > 0,
           f"train.eval_every={t.eval_every} needs held-out data: set data.eval_paths=[glob, ...] or "
           "data.eval_share (e.g. 0.01), or train.eval_every=0")
    yield (not t.init_from or os.path.isdir(t.init_from),
           f"train.init_from={t.init_from!r} is not a directory; give a run directory or a Hugging Face "
           "model directory")
    yield (d.tokenizer == "byte" or os.path.isfile(d.tokenizer),
           f"data.tokenizer={d.tokenizer!r} does not exist; give the path of a Hugging Face tokenizer.json "
           "or use data.tokenizer=byte")


@rule
def _profile(cfg: Config, shape: dict[str, int]) -> Iterator[tuple[bool, str]]:
    """train.profile_steps: [start, stop], the steps start..stop-1 of this run."""
    t = cfg.train
    steps, start = list(t.profile_steps), min(20, t.steps)
    yield (not steps or (len(steps) == 2 and 1 <= steps[0] < steps[1] <= t.steps + 1),
           f"train.profile_steps={show(steps)} must be [start, stop] with 1 <= start < stop <= train.steps+1="
           f"{t.steps + 1} (a trace of steps start..stop-1), e.g. train.profile_steps=[{start}, "
           f"{min(start + 3, t.steps + 1)}], or [] for none")


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
        if not math.isfinite(_in_float32(value)):  # optim.lr=1e308: finite here, inf in the step
            raise ConfigError(f"{key}={show(value)} overflows float32 (largest 3.4e+38), the dtype the step uses; "
                              f"set {key} to a smaller value")
    for key, op, bound in _BOUNDS:
        value = functools.reduce(getattr, key.split("."), cfg)  # model.fp8.amax_history: two levels
        if not _COMPARE[op](value, bound):
            raise ConfigError(f"{key}={show(value)} must be {op} {show(bound)}; "
                              f"set {key} to a value {op} {show(bound)}")
        rounded = _in_float32(value) if isinstance(value, float) else value
        if not _COMPARE[op](rounded, bound):  # optim.eps=1e-50 is 0 in float32, optim.b2=1-1e-12 is 1
            raise ConfigError(f"{key}={show(value)} rounds to {show(rounded)} in float32, the dtype the step uses, "
                              f"and must be {op} {show(bound)}; set {key} to a value {op} {show(bound)} that "
                              "float32 holds")
    if num_devices < 1:
        raise ConfigError(f"num_devices={num_devices} must be >= 1; no devices were found")
    shape = cfg.mesh.shape(num_devices)
    for check in RULES:
        for ok, message in check(cfg, shape):
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
    if cfg.mesh.sequence_parallel and cfg.mesh.tensor == 1:
        out.append("mesh.sequence_parallel=true does nothing with mesh.tensor=1 (it splits the residual stream "
                   "over the tensor axis); set mesh.tensor>1 or mesh.sequence_parallel=false")
    if cfg.mesh.tensor_overlap != "none" and cfg.mesh.tensor == 1:
        out.append(f"mesh.tensor_overlap={cfg.mesh.tensor_overlap} does nothing with mesh.tensor=1 (no tensor "
                   "collectives to overlap); set mesh.tensor>1 or mesh.tensor_overlap=none")
    c = cfg.model.moe.capacity_factor
    if cfg.model.moe.enabled and c is not None and c < 1:
        out.append(f"model.moe.capacity_factor={show(c)} < 1 drops at least {100 * (1 - c):.0f}% of the tokens' "
                   "expert assignments even when the routing is balanced (moe/dropped_fraction); use >= 1, or "
                   "null for dropless")
    return out
