"""Bytes per device: parameters, gradients and optimizer state (exact), activations (a model).

The activation model, its calibration against XLA and a worked example are in docs/PLANNING.md.
Width letters: D d_model, Q = N*H, KV = K*H, F ffn, S = N*seq (one row of attention scores), V vocab.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math

from lumen_jax.metrics import flops
from lumen_jax.config import REMAT_SAVES, ConfigError, MeshConfig, ModelConfig
from lumen_jax.ops.choice import Ops
from lumen_jax.ops.loss import chunk_count
from lumen_jax.parallel.pipeline import schedule as pipeline_lib
from lumen_jax.parallel.rules import Rules
from lumen_jax.plan import moe as moe_plan
from lumen_jax.plan.hardware import AXES, Layout, compute_bytes, first_layers, first_parts, first_split
from lumen_jax.plan.residuals import Residuals, layer_residuals, param_leaves

F32 = 4
# Our step keeps fp32 master parameters, fp32 gradients and Adam's two fp32 moments: 4 + 4 + 8 bytes
# per parameter (the textbook bf16 recipe splits the same 16 bytes as 2 + 2 + 12).
STATE_BYTES = {"params": 4, "grads": 4, "optimizer": 8}
TEXTBOOK_BYTES_PER_PARAM = 2 + 2 + 12


@functools.lru_cache(maxsize=16)  # a ModelConfig replace costs more than the state's cache lookup
def _shape_key(model: ModelConfig) -> ModelConfig:
    # Only the shape fields matter; one trace serves every remat/dtype/attention variant.
    return dataclasses.replace(model, remat="none", compute_dtype="bfloat16", attention="xla")


def state_bytes(model: ModelConfig, layout: Layout) -> dict[str, int]:
    """Per-device bytes of `params`, `grads` and `optimizer` (Adam mu + nu), exactly as sharded.

    Each leaf's `PartitionSpec` comes from `Rules(zero_stage, sequence_parallel).tree_specs` of the
    layout's mesh section (the table the trainer uses); a dim split over mesh axes of total size g holds ceil(dim / g) per device.
    With a pipeline, the stacked `layers` axis is split over stages (ceil(L / p) per stage, or the
    padded V * max(mesh.pipeline_layers) with uneven stages); the
    embedding, final norm and logits weights are replicated over the stages (every stage of the
    pipelined step holds them, `parallel/pipeline/executor.py`), so each device holds them all.
    """
    mesh = layout.mesh
    # keyed on what `_state_bytes` reads: the communication options, the reduce dtype, the collective
    # matmul and the micro-batches do not move the state (a search tries them all on each mesh)
    return dict(_state_bytes_of(model, tuple(layout.size(a) for a in AXES), mesh.zero_stage, mesh.sequence_parallel,
                                mesh.zero_axes, mesh.pipeline_schedule, mesh.pipeline_virtual_stages,
                                mesh.pipeline_layers))


@functools.lru_cache(maxsize=4096)  # the search asks it several times for every candidate
def _state_bytes_of(model: ModelConfig, sizes: tuple[int, ...], zero_stage: int, sequence_parallel: bool,
                    zero_axes: str, pipeline_schedule: str, pipeline_virtual_stages: int,
                    pipeline_layers: tuple[int, ...]) -> tuple[tuple[str, int], ...]:
    axes = dict(zip(AXES, sizes))
    mesh = MeshConfig(**axes, zero_stage=zero_stage, sequence_parallel=sequence_parallel, zero_axes=zero_axes,
                      pipeline_schedule=pipeline_schedule, pipeline_virtual_stages=pipeline_virtual_stages,
                      pipeline_layers=pipeline_layers)
    return _state_bytes(_shape_key(model), Layout(mesh, pipeline=axes["pipeline"], micro_batches=1))


def communication_bytes(model: ModelConfig, layout: Layout) -> dict[str, int]:
    """Per-device bytes the communication options keep (docs/COMMUNICATION.md), beside `state_bytes`.

    `gathered_weights`: `mesh.fsdp_regather=per_step` keeps the step's weights gathered over fsdp in
    the compute dtype (float32 where fp8 runs). `grad_accumulator`: with several micro-batches the
    step sums gradients in `mesh.reduce_dtype` per replica group; under `fsdp_grad_reduce=once` the
    sums are full-size over fsdp (else sharded like the gradients, which `state_bytes` counts).
    """
    mesh, out = layout.mesh, {"gathered_weights": 0, "grad_accumulator": 0}
    if math.prod(layout.size(a) for a in mesh.zero_mesh_axes) == 1:
        return out
    unsharded = state_bytes(model, dataclasses.replace(layout, mesh=dataclasses.replace(mesh, fsdp=1, zero_axes="fsdp")))
    if mesh.fsdp_regather == "per_step" and mesh.zero_stage == 3:
        dtype = 4 if model.fp8.recipe != "none" or model.compute_dtype == "float32" else 2
        out["gathered_weights"] = unsharded["params"] * dtype // F32
    red = F32 if mesh.reduce_dtype == "float32" else 2
    if mesh.fsdp_grad_reduce == "once" and layout.micro_batches > 1 and layout.pipeline == 1:
        # the loop's carry: every replica group's full-size sums, beside the reduced gradients they
        # are reduce-scattered into after the last micro-batch (`state_bytes`' grads)
        out["grad_accumulator"] = unsharded["grads"] * red // F32
    elif mesh.fsdp_grad_reduce == "once" and layout.micro_batches > 1:
        out["grad_accumulator"] = unsharded["grads"] * red // F32 - (state_bytes(model, layout)["grads"]
                                                                       if mesh.zero_stage >= 2 else 0)
    return out


def check_kept_weights_fit(model: ModelConfig, layout: Layout, device_bytes: float | None) -> None:
    """Raises ConfigError when `mesh.fsdp_regather=per_step` cannot hold the step's gathered weights
    beside the training state in `device_bytes` (None: unknown, e.g. on CPU; nothing is checked)."""
    kept = communication_bytes(model, layout)["gathered_weights"]
    if not kept or device_bytes is None:
        return
    state = sum(state_bytes(model, layout).values())
    if kept + state > device_bytes:
        raise ConfigError(
            f"mesh.fsdp_regather=per_step keeps {kept / 1e9:.1f} GB of gathered weights per device beside "
            f"{state / 1e9:.1f} GB of training state, more than the device's {device_bytes / 1e9:.1f} GB; use "
            "mesh.fsdp_regather=per_micro_batch, or more mesh.tensor (python -m lumen_jax.plan shows the cost)")


def _state_bytes(model: ModelConfig, layout: Layout) -> tuple[tuple[str, int], ...]:
    rules = Rules(zero_stage=layout.mesh.zero_stage, sequence_parallel=layout.mesh.sequence_parallel,
                  zero_axes=layout.mesh.zero_mesh_axes)
    leaves = param_leaves(model)
    # uneven stages: a device holds V * max(mesh.pipeline_layers) slots of every stack (zero padding
    # included), a stack with a share of the layers (MoE) that share of them
    first = first_layers(model)
    held = layout.stage_layers(model.num_layers, first) if layout.uneven_max(model.num_layers, first) else None
    out = {}
    for kind, nbytes in STATE_BYTES.items():
        total = 0
        for path, shape, names in leaves:
            count = 1
            for dim, axes, name in zip(shape, rules.spec(names, kind), names):
                # `layers` maps to `pipeline` in the rules: each stage holds ceil(L / p) layers
                group = math.prod(layout.size(a) for a in ((axes,) if isinstance(axes, str) else axes or ()))
                if held and name == "layers" and first:  # the first dense layers' slots: `blocks` only
                    count *= _first_stack_slots(layout, model, dim, path.startswith("['blocks']"))
                else:
                    count *= held * dim // model.num_layers if held and name == "layers" else -(-dim // group)
            total += count
        out[kind] = nbytes * total
    return tuple(out.items())


def _first_stack_slots(layout: Layout, model: ModelConfig, length: int, holds_first: bool) -> int:
    """Entries of a stack of `length` one device holds with the model's first dense layers placed
    (parallel/pipeline/layout.Pipeline.pad): V * (F + the most of the stack's share any stage holds),
    F only in the stack that holds them (`blocks`)."""
    first = first_layers(model)
    chunks = layout.pipeline * layout.schedule[1]
    split = layout.mesh.pipeline_layers
    if not (len(split) == chunks and sum(split) == model.num_layers):
        split = first_split(model.num_layers, chunks, first, model.moe.every_n_layers)
    firsts, rest = first_parts(split, first)
    share = length - (first if holds_first else 0)
    return layout.schedule[1] * ((max(firsts) if holds_first else 0) + max(n * share // sum(rest) for n in rest))


# --------------------------------------------------------------------------------------------------
# Activations
# --------------------------------------------------------------------------------------------------

# The transient working set of a layer's backward pass, fitted to XLA's buffer assignment of the
# compiled CPU step (docs/PLANNING.md, section 2): per remat policy, (score rows, share of the
# layer's unsaved tensors) live on top of everything saved. A score row is one query's fp32 scores
# over every key of every local head (N*S/t elements); it counts only where the attention
# materialises scores (xla). The other unsaved tensors are those the policy does not keep (read off
# the probe): recomputing them is what the backward pass does first. Structure, not fit: what each
# policy saves, the widths, the dtypes; fit: these ten numbers.
BACKWARD_ROWS: dict[str, tuple[float, float]] = {
    # no recompute: the saved probabilities + dP and dS (and the mask's fp32 select)
    "none": (2.58, 0.0),
    # everything recomputed: masked scores, probabilities, dP, dS + part of the rest
    "full": (3.19, 0.42),
    # the raw scores are saved (counted as saved), the backward re-derives the masked scores and
    # probabilities from them
    "dots_saveable": (2.77, 0.62),
    "dots_with_no_batch_dims_saveable": (3.25, 0.55),
    # the attention output is saved, so the recompute runs the attention core and the projections
    "save_attention_out": (6.06, 0.0),
}
BACKWARD_ROWS["offload_dots"] = BACKWARD_ROWS["dots_with_no_batch_dims_saveable"]  # same on the device
# The selective policies (`config.REMAT_SAVES`) save projections and, with the reference attention, no
# scores: the backward re-derives the scores as under dots_with_no_batch_dims_saveable, whose score
# rows they take. The share: save_qkv_proj's as there (the compiled CPU step against the plan,
# tests/plan/test_plan.py's XLA_CASES meshes: data=8 +2.2%, fsdp=4 x tensor=2 sp -5.3%); the two that
# recompute gate and/or up hold the MLP's F-wide rows (recomputed, and SwiGLU's rebuilt ones) live
# together: at 0.55 data=8 gave -9.0% and -10.4%; 0.85 gives -4.5% and -5.0% there, -3.4% and -4.0% on
# the sp mesh (save_dot_except_mlpwi_1, save_dot_except_mlpwi; 2026-12-06).
BACKWARD_ROWS.update(dict.fromkeys(REMAT_SAVES, BACKWARD_ROWS["dots_with_no_batch_dims_saveable"]))
BACKWARD_ROWS.update(dict.fromkeys(("save_dot_except_mlpwi", "save_dot_except_mlpwi_1"), (3.25, 0.85)))
# The same under context parallelism (mesh.context > 1, xla chunk kernel), fitted to 14 compiled
# CPU steps (docs/PLANNING.md, section 2). XLA:CPU keeps the score blocks of all the chunk pairs
# of the unrolled ring hops live together, so the rows still span the whole sequence; with
# recompute the layer's recomputed tensors dominate and no score rows show.
CONTEXT_BACKWARD_ROWS: dict[str, tuple[float, float]] = {
    "none": (1.64, 0.0), "full": (0.0, 0.34), "dots_saveable": (2.93, 0.62),
    "dots_with_no_batch_dims_saveable": (0.0, 0.55), "save_attention_out": (1.64, 0.0),
}
CONTEXT_BACKWARD_ROWS["offload_dots"] = CONTEXT_BACKWARD_ROWS["dots_with_no_batch_dims_saveable"]
# (not refitted: the compiled steps of fsdp=4 x context=2 ring and fsdp=2 x context=4 all-gather gave
# +0.1% to +4.9% for save_dot_except_mlpwi_1 and save_qkv_proj, 2026-12-06)
CONTEXT_BACKWARD_ROWS.update(dict.fromkeys(REMAT_SAVES, CONTEXT_BACKWARD_ROWS["dots_with_no_batch_dims_saveable"]))
LOGIT_ROWS = 1.74  # fp32 logits (and their gradient) per token, V/t wide, in one chunk of the loss
HEAD_WEIGHT_COPIES = 2  # with chunks: float32 D x V/t copies of the output layer beside them (its gradient's sum, ...)
TP_PARTIAL_SUMS = 3  # row-parallel matmul outputs: full-width partial sums before the all-reduce
GRAD_ACCUMULATION_COPIES = 2  # micro-batches > 1: the gradient sum carried through the loop + this micro-batch's
BATCH_ARRAYS = 5  # inputs, targets, segment_ids, positions, loss_mask: 4 bytes each per token


@dataclasses.dataclass(frozen=True)
class Activations:
    """Per-device activation bytes of one step (worst pipeline stage)."""

    saved: float  # residuals kept for the backward pass: every local layer, every in-flight micro-batch
    # (pipeline: the stashed stage inputs and cotangents + one chunk's residuals of one micro-batch)
    working: float  # the largest transient working set (`phase`)
    phase: str  # the largest part of the working set (scores, recompute, partial_sums, kv, logits)
    buffers: float  # gradient-accumulation buffers (micro-batches > 1)
    inputs: float  # the step's batch arrays
    host: float  # offloaded to host memory (offload_dots), not counted on the device

    @property
    def total(self) -> float:
        return self.saved + self.working + self.buffers + self.inputs


def _widths(model: ModelConfig, layout: Layout, seq_len: int) -> dict[str, float]:
    """Elements per token of each width class on one device."""
    tp, sp = layout.mesh.tensor, layout.mesh.sequence_parallel
    h = model.resolved_head_dim
    return {"D": model.d_model / (tp if sp else 1), "G": model.d_model, "Q": model.num_heads * h / tp,
            "KV": model.num_kv_heads * h / tp, "F": model.ffn_dim / tp,
            "S": model.num_heads * seq_len / tp,
            "N": model.num_heads / tp, "V": model.vocab_size / tp}


def _bytes(rows: collections.Counter, widths: dict[str, float], c: int) -> float:
    return sum(n * widths[k] * {"c": c, "f": F32, "b": 1}[d] for (k, d), n in rows.items())


def regathered_inputs(model: ModelConfig, layout: Layout, remat: str) -> int:
    """The projection inputs per layer kept as the device's own rows and gathered again in the
    backward for the weight gradients (`ops.projection.project_columns`): the attention's and the
    MLP's normed inputs, where the policy saves them (`remat: none`), sequence parallelism splits
    them over `tensor` > 1, the layer type's projections are plain einsums (not fp8) and the
    backward is not split (zero_bubble's taps record the gathered input themselves). Both ways of
    gathering keep the own rows: plain GSPMD collectives through `Ops.regather`'s custom VJP, and
    `mesh.tensor_overlap=collective_matmul`, whose all-gather matmul's residual is the device's
    block (`parallel.collective_matmul`; measured on fsdp=4 x tensor=2: the layers' forward loop
    stacks the same four [B, T/t, D] rows either way)."""
    mesh = layout.mesh
    if not (mesh.sequence_parallel and mesh.tensor > 1):
        return 0
    if layout.pipeline > 1 and layout.schedule[0] == "zero_bubble":
        return 0
    return _regathered_projections(model, remat)


@functools.lru_cache(maxsize=64)  # the search asks it for every candidate; a ModelConfig replace is dear
def _regathered_projections(model: ModelConfig, remat: str) -> int:
    """`regathered_inputs` where sequence parallelism over `tensor` gathers them: by the model alone."""
    if not Ops.plain(dataclasses.replace(model, remat=remat)).regather:
        return 0
    return sum(Ops.plain(model).projection(t) == "einsum" for t in ("attention", "mlp"))


def _as_gathered(rows: collections.Counter, remat: str, regathered: int = 0) -> collections.Counter:
    # Without checkpointing, two of the compute-dtype D rows a layer saves are its norm outputs (the
    # attention's and the MLP's inputs), which a matmul gathers under sequence parallelism; the others
    # (the norms' inputs, which their VJP keeps) stay split, as the layer input does under a policy.
    # The `regathered` ones of the two stay split too (`regathered_inputs`).
    if remat != "none":
        return rows
    out = collections.Counter(rows)
    gathered = max(min(out[("D", "c")], 2) - regathered, 0)
    out[("D", "c")] -= gathered
    out[("G", "c")] += gathered
    return +out


def _residuals(model: ModelConfig, layout: Layout, remat: str, seq_len: int, attention: str) -> Residuals:
    return layer_residuals(remat, seq_len, attention, layout.mesh.context, layout.mesh.context_parallel)


def saved_bytes_per_token(model: ModelConfig, layout: Layout, seq_len: int, remat: str,
                          attention: str = "xla") -> float:
    """Bytes one layer saves per local token under `remat` with `attention` (xla or flash)."""
    rows = _rows(model, layout, seq_len, remat, attention).saved
    return _bytes(dict(rows), _widths(model, layout, seq_len), compute_bytes(model))


@dataclasses.dataclass(frozen=True)
class _Rows:
    """A layer's rows per token by (width class, dtype class), as (key, count) pairs in the order
    the counters that `_bytes` sums hold them."""

    saved: tuple  # kept for the backward (`saved_bytes_per_token`)
    unsaved: tuple  # recomputed in the backward, with the custom VJPs' rebuilt rows (`working_bytes_per_token`)
    host: tuple  # offloaded to host memory (`activation_bytes`)


def _rows(model: ModelConfig, layout: Layout, seq_len: int, remat: str, attention: str) -> _Rows:
    """`_layer_rows` on `layout`'s context, with the projection inputs `regathered_inputs` keeps."""
    return _layer_rows(remat, seq_len, attention, layout.mesh.context, layout.mesh.context_parallel,
                       regathered_inputs(model, layout, remat))


@functools.lru_cache(maxsize=256)  # a search asks for every candidate: the Counter sums cost more than the bytes
def _layer_rows(remat: str, seq_len: int, attention: str, context: int, context_parallel: str,
                regathered: int) -> _Rows:
    """The rows of the probe's residuals (`layer_residuals` of these arguments) under `remat`, with
    `regathered` projection inputs kept as the device's own rows (`regathered_inputs`)."""
    residuals = layer_residuals(remat, seq_len, attention, context, context_parallel)
    every = _as_gathered(layer_residuals("none", seq_len, attention, context, context_parallel).counts(), "none")
    every.update(REBUILT)
    unsaved = every - _as_gathered(residuals.counts(host=True), remat, regathered)
    unsaved = collections.Counter({key: n for key, n in unsaved.items() if key[0] != "S" and n > 0})
    return _Rows(saved=tuple(_as_gathered(residuals.counts(), remat, regathered).items()),
                 unsaved=tuple(unsaved.items()),
                 host=tuple((residuals.counts(host=True) - residuals.counts()).items()))


# What the custom VJP of SwiGLU (`ops.swiglu`) rebuilds in the backward of a layer instead of saving
# it: sigmoid(gate) and the two gradients' factors, 3 F-wide rows per token, transient in the working
# set of the layer the backward reruns. (RMSNorm's VJP, `model.layers.rms_norm`, rebuilds x / rms(x)
# in float32 too, which XLA fuses into its consumers.) With them the compiled step's bytes are within
# 10% on every mesh and policy of tests/plan/test_plan.py (2026-12-05: -8.6% to +9.4%; without them
# down to -12%; counting the norms' float32 rows too, up to +14.5%).
REBUILT = collections.Counter({("F", "c"): 3})


def working_bytes_per_token(model: ModelConfig, layout: Layout, seq_len: int, remat: str,
                            attention: str = "xla") -> dict[str, float]:
    """Bytes per local token of the largest transient working set under `remat`, by part:
    `scores` (score rows, xla attention only), `recompute` (the unsaved tensors of the layer),
    `partial_sums` (tensor parallelism), `kv` (context parallelism), `logits`."""
    c, w = compute_bytes(model), _widths(model, layout, seq_len)
    cp = layout.mesh.context > 1
    scores, share = (CONTEXT_BACKWARD_ROWS if cp else BACKWARD_ROWS)[remat]
    unsaved = dict(_rows(model, layout, seq_len, remat, attention).unsaved)
    row = model.num_heads * seq_len / layout.mesh.tensor * F32  # one query's fp32 scores, every local head
    # Context parallelism: all-gather holds the whole K and V and the fp32 dK/dV of the whole
    # sequence, C times the local K/V. So, on XLA:CPU, does the ring: its C hops are unrolled and
    # the compiled step keeps every hop's K/V chunk and dK/dV accumulator live (measured: the
    # working set grows by about 2 K/V-wide rows of (c + 4) bytes per token per extra hop; counting
    # two chunks left C=8 10-18% low). A GPU schedule may free them earlier: then this overcounts.
    held = layout.mesh.context
    kv = 2 * w["KV"] * (c + F32) * held if cp else 0.0
    return {"scores": scores * row if attention == "xla" else 0.0,
            "recompute": share * _bytes(unsaved, w, c),
            "partial_sums": TP_PARTIAL_SUMS * w["G"] * c if layout.mesh.tensor > 1 else 0.0,
            "kv": kv, "logits": LOGIT_ROWS * w["V"] * F32}


@dataclasses.dataclass(frozen=True)
class SplitBackward:
    """One layer's share of a split backward (zero_bubble, `ops.projection.Taps`), averaged over
    the layers: what its weight-gradient unit W computes and what W's stash keeps for it."""

    params: float  # weights of the tapped (plain-einsum) projections: W's matmuls, 2 FLOPs each per token
    rows: collections.Counter  # per token, compute dtype: each tapped projection's output cotangent and
    # each distinct input once (Q/K/V share the attention's normed input, gate/up the MLP's); an MoE
    # layer's routed rows are the dispatch's (`activation_bytes`)
    experts: float = 0.0  # the routed experts' weights (all experts'; W differentiates each device's)
    routed: float = 0.0  # the routed experts' weights one token meets (its top_k experts')

    @property
    def flops(self) -> float:
        """W's matmul FLOPs per token: 2 per weight the token's rows meet."""
        return 2.0 * (self.params + self.routed)


def split_backward(model: ModelConfig) -> SplitBackward:
    """What `ops.projection.Taps` taps per layer: the projections that run as a plain einsum (fp8
    ones keep their own backward, whose weight gradients stay in B) and an MoE layer's routed
    experts. Attention: input, q, k, v, the core's output (wo's input) and wo's output; an MLP:
    input, gate, up, the SwiGLU output (w_down's input) and w_down's output; the routed experts:
    per row of the dispatch its input, SwiGLU output and the gate, up and down cotangents (counted
    by `activation_bytes` from the dispatch's rows). The D-wide rows are the matmuls' (gathered
    under sequence parallelism: `G`)."""
    plain = {t for t in ("attention", "mlp") if Ops.plain(model).projection(t) in ("einsum", "token_grad")}
    d, h = model.d_model, model.resolved_head_dim
    n_moe = model.num_moe_layers
    # MLPs per layer on average: the dense layers' and the MoE layers' shared experts (one MLP of
    # shared_experts * expert_ffn_dim), each tapped when plain
    mlps = [(model.num_layers - n_moe, model.ffn_dim)] + (
        [(n_moe, model.moe.shared_experts * model.expert_ffn_dim)] if n_moe and model.moe.shared_experts else [])
    params, rows = 0.0, collections.Counter()
    if "attention" in plain:
        params += 2 * d * h * (model.num_heads + model.num_kv_heads)
        rows.update({("G", "c"): 2, ("Q", "c"): 2, ("KV", "c"): 2})
    if "mlp" in plain:
        for layers, ffn in mlps:
            share = layers / model.num_layers
            params += share * 3 * d * ffn
            rows.update({("G", "c"): 2 * share, ("F", "c"): 3 * share * ffn / model.ffn_dim})
    experts = routed = 0.0
    if n_moe:
        share, k = n_moe / model.num_layers, model.moe.top_k
        expert = 3 * d * model.expert_ffn_dim
        experts, routed = share * model.moe.num_experts * expert, share * k * expert
    return SplitBackward(params=params, rows=rows, experts=experts, routed=routed)


def loss_chunks(model: ModelConfig, layout: Layout, rows: int, seq_len: int) -> int:
    """The chunks `ops.loss` cuts a device's [rows, positions] of the loss into: the positions are the
    sequence over `context` (and, with a pipeline, every P-th token on each stage), the vocabulary
    over `tensor`."""
    positions = -(-seq_len // layout.mesh.context // layout.pipeline)  # padded to a multiple of P (`units._strided`)
    return _chunk_count(max(rows, 1), max(positions, 1), max(model.vocab_size // layout.mesh.tensor, 1),
                        model.loss_chunk_tokens)


_chunk_count = functools.lru_cache(maxsize=1024)(chunk_count)  # a search asks it for every candidate


def activation_bytes(model: ModelConfig, layout: Layout, seq_len: int, micro_batch: int,
                     remat: str | None = None, attention: str = "xla", moe_backend: str = "gpu") -> Activations:
    """Activation memory of one device for micro-batches of `micro_batch` sequences per device.

    `saved` = layers x (tokens x `saved_bytes_per_token` + the weight copies a layer keeps).
    Without a pipeline the layers are all of them. With one (`parallel/pipeline/executor.py`), a
    stage keeps the residuals of each forward whose backward has not run: one chunk (L / (P*V)
    layers) of one micro-batch per slot of the lock-step program (`schedule.lockstep(...).slots`
    + 1 scratch: m for GPipe, 2PV - 1 or fewer for the fused schedules) and one more, the copy the
    backward reads out; the loss's cotangents in as many slots, and the arriving activation and
    cotangent, [tokens, D] in the compute dtype;
    `working` = tokens x the sum of
    `working_bytes_per_token`'s parts (`phase` names the largest; the logits those of one of the
    loss's chunks, `ops.loss`). `buffers` = the gradient-accumulation loop's copies of
    the (sharded) gradients when micro-batches > 1 (none with a pipeline, whose gradients sum in the
    carry; there, the float32 sums of the embedding table's gradient).
    `inputs` = the batch arrays of the whole step.
    An MoE layer (`plan.moe`, `moe_backend` gpu or cpu) saves the layer's other residuals (its
    shared experts as its MLP) and, without remat, its dispatch's buffers; its backward adds the
    `moe` part of the working set (the buffers again, with remat recomputed first).
    """
    remat = model.remat if remat is None else remat
    c = compute_bytes(model)
    tokens = micro_batch * seq_len / layout.mesh.context
    pipelined = layout.pipeline > 1
    name, virtual = layout.schedule
    layers = layout.chunk_layers(model.num_layers, first_layers(model))
    parts = working_bytes_per_token(model, layout, seq_len, remat, attention)
    widths = _widths(model, layout, seq_len)
    slots = wslots = 0
    if pipelined:
        prog = pipeline_lib.lockstep(name, layout.pipeline, layout.micro_batches, virtual)
        slots, wslots = prog.slots, prog.split and prog.wslots
    # The loss runs in chunks of the positions (`ops.loss`; a pipeline's head: every P-th token on each
    # stage): with several, one chunk's logits at a time, V / t wide, beside float32 copies of the
    # output layer, D x V / t (its gradient's sum over the chunks, ...).
    vocab = model.vocab_size / layout.mesh.tensor
    chunks = loss_chunks(model, layout, micro_batch, seq_len)
    if chunks > 1:
        parts["logits"] = parts["logits"] / chunks + HEAD_WEIGHT_COPIES * model.d_model * vocab * F32 / tokens
    counts = flops.param_counts(model)
    # A layer casts its fp32 weights to the compute dtype and may keep the casts for the backward,
    # split by tensor parallelism. In fp32 the cast is the weight itself. Under ZeRO-3 the step casts
    # the weights while sharded and gathers them where each layer uses them: the backward gathers them
    # again (the compiled bfloat16 step's layer loops carry no gathered weight, fsdp=8 on 8 CPU
    # devices), so a layer keeps its shard of the casts; with fsdp_regather=per_step the gathered
    # casts are `communication_bytes`' gathered_weights, which the layers read in place.
    residuals = _residuals(model, layout, remat, seq_len, attention)
    mesh = layout.mesh
    shards = math.prod(layout.size(a) for a in mesh.zero_mesh_axes) if mesh.zero_stage >= 3 else 1
    kept = 0.0 if mesh.zero_stage >= 3 and mesh.fsdp_regather == "per_step" and shards > 1 else 1 / shards
    copies = (residuals.weight_copies * counts["layer_matmul"] * c / mesh.tensor * kept
              if model.compute_dtype != "float32" else 0.0)
    per_layer = tokens * saved_bytes_per_token(model, layout, seq_len, remat, attention) + copies
    host = _bytes(dict(_rows(model, layout, seq_len, remat, attention).host), widths, c)
    # The pipelined step sums gradients in the scan carry over ticks, in place of the accumulation
    # loop's copies (measured: no copy beyond the gradients themselves). Interleaved stages hold
    # their blocks device-major (`Pipeline.pad`): no reordered copy.
    # The accumulation loop (micro-batches > 1, no pipeline) holds the sums it carries and the
    # micro-batch's gradients that it adds into them. Under fsdp_grad_reduce=once both are full-size:
    # the sums in `communication_bytes` (reduce dtype), the micro-batch's here, in the compute dtype
    # of the weights they are taken for (measured on the buffer assignment of a float32 step,
    # fsdp=4 x context=2 on 8 CPU devices: one full-size buffer per weight for the carried sums and
    # one for the micro-batch's). Else both are sharded over fsdp (the carried sums of each context
    # group, over fsdp alone, also with mesh.zero_axes=fsdp+context).
    buffers = 0.0
    if layout.micro_batches > 1 and not pipelined:
        unsharded = state_bytes(model, dataclasses.replace(layout, mesh=dataclasses.replace(
            layout.mesh, fsdp=1, zero_axes="fsdp")))["grads"]
        if layout.mesh.fsdp_grad_reduce == "once":
            buffers = unsharded * c / F32
        elif layout.mesh.zero_stage >= 2:
            buffers = GRAD_ACCUMULATION_COPIES * unsharded / layout.mesh.fsdp
        else:
            buffers = GRAD_ACCUMULATION_COPIES * state_bytes(model, layout)["grads"]
    if pipelined:  # each row group's float32 sum of the embedding table's gradient (`units.Device.embedding_grad`)
        buffers += model.vocab_size * model.d_model / layout.mesh.tensor * F32
    # A pipelined stage keeps each stashed forward's residuals (its chunk's layers, as the policy
    # saves them) in `slots` + 1 slots (the lock-step program's, one scratch), the loss's cotangents
    # in as many, and the activation and cotangent that arrived: [tokens, D] each.
    # The backward reads one slot's residuals out of the stash: one more chunk's worth, working.
    saved = (slots + 2) * layers * per_layer + (slots + 3) * tokens * widths["D"] * c if pipelined else layers * per_layer
    if wslots:
        # A split backward (zero_bubble) keeps, from each B to its W, the chunk's tapped projection
        # inputs and output cotangents: `wslots` + 1 slots (one scratch) and B's output before it
        # is written into its slot. Its residual slots hold what 1f1b's do (the tapped weights are
        # stopped outside the layers' scan, `Taps.stop`, so they are not stashed).
        split = split_backward(model)
        saved += (wslots + 2) * layers * tokens * _bytes(split.rows, widths, c)
    if moe_plan.moe_layers(model, layout):
        # A pipelined stage keeps its chunk's MoE layers' residuals in each of its (slots + 2) sets,
        # a split backward's W stash (wslots + 2 sets) their dispatched rows.
        moe_saved, moe_w_stash, moe_working = _moe_layers(
            model, layout, seq_len, tokens, remat, attention, moe_backend, per_layer, copies,
            sets=(slots + 2) / virtual if pipelined else 1, w_sets=(wslots + 2) / virtual if wslots else 0)
        saved = saved + moe_saved + moe_w_stash
        parts["moe"] = moe_working / tokens
    return Activations(
        saved=saved, working=tokens * sum(parts.values()),
        phase=max(parts, key=parts.get), buffers=buffers,
        inputs=BATCH_ARRAYS * 4 * tokens * layout.micro_batches, host=layers * tokens * host)


def _moe_layers(model: ModelConfig, layout: Layout, seq_len: int, tokens: float, remat: str, attention: str,
                moe_backend: str, per_layer: float, copies: float, sets: float,
                w_sets: float) -> tuple[float, float, float]:
    """The MoE layers' part of `activation_bytes` (`plan.moe`): (what their residuals add to the
    dense layers' counted for them, in each of `sets` sets; their dispatched rows in each of `w_sets`
    sets of a split backward's W stash; the working bytes of their backward). An MoE layer saves the
    layer's other residuals (its shared experts as its MLP), the router's and, without remat, its
    dispatch's buffers; its backward works on those buffers (with remat, recomputed first). The W
    stash holds per dispatched row its input and output cotangent D wide, its SwiGLU output and
    gate and up cotangents F/t wide (`ops.grouped.TAP_INPUTS`, ...)."""
    c, n_moe = compute_bytes(model), moe_plan.moe_layers(model, layout)
    shared = dataclasses.replace(model, ffn_dim=model.moe.shared_experts * model.expert_ffn_dim)
    moe = moe_plan.layer_bytes(model, layout, tokens, moe_backend)
    kept = moe["saved"] if remat == "none" else 0.0
    moe_layer = tokens * saved_bytes_per_token(shared, layout, seq_len, remat, attention) + copies + kept
    residuals = sets * n_moe * (moe_layer + moe["router"] - per_layer)
    w_stash = 0.0
    if w_sets:
        rows = moe_plan.dispatch(model, layout, tokens, moe_backend).padded
        width = 2 * model.d_model + 3 * model.expert_ffn_dim / layout.mesh.tensor
        w_stash = w_sets * n_moe * rows * width * c
    return residuals, w_stash, moe["working"] if remat == "none" else moe["recomputed"]


FP8_OPERANDS_PER_MATMUL = 3  # the input, the weight and the output gradient each get a scale
FP8_MATMULS = {"attention": 4, "mlp": 3}  # wq, wk, wv, wo; gate, up, down
FP8_BLOCK = 128  # blockwise: one scale per 128 x 128 weight tile and per 1 x 128 activation tile


def fp8_bytes(model: ModelConfig, layout: Layout, tokens: float = 0.0) -> float:
    """Per-device bytes of fp8 scaling state (`model.fp8`; 0 with `recipe: none`).

    delayed: every quantized operand keeps `amax_history` fp32 amaxes and one fp32 scale, i.e.
    (amax_history + 1) x 4 bytes x 3 operands per matmul x the fp8 matmuls of each layer (7 for
    attention + mlp) x the layers on the device: the histories are stacked with the layers, so a
    layer `keep_bf16` keeps in the compute dtype holds its (idle) histories too. current: one fp32
    scale per operand, recomputed every step. blockwise: one fp32 scale per 128 x 128 weight tile
    (split like the weights by tensor parallelism) of the layers that quantize (without a pipeline
    the kept ones do not; in stages every slot does: `ops.choice.Ops.stage_runs`) and per 128
    elements of each quantized activation row (`tokens` local tokens, transient).
    """
    fp8 = model.fp8
    recipe = fp8.recipe
    if recipe == "none":
        return 0.0
    layers = -(-model.num_layers // layout.pipeline)
    matmuls = sum(FP8_MATMULS[kind] for kind in fp8.layers)
    operands = layers * matmuls * FP8_OPERANDS_PER_MATMUL
    if recipe == "delayed":
        return operands * (fp8.amax_history + 1) * F32
    if recipe == "current":
        return operands * F32
    if recipe == "blockwise":
        h = model.resolved_head_dim
        widths = {"attention": 2 * (model.num_heads + model.num_kv_heads) * h, "mlp": 2 * model.ffn_dim + model.d_model}
        per_layer = flops.param_counts(model)["layer_matmul"]
        weight_tiles = per_layer / (FP8_BLOCK * FP8_BLOCK) / layout.mesh.tensor
        act = sum(w for kind, w in widths.items() if kind in fp8.layers)
        kept = len(set(fp8.keep_bf16) & {"first", "last"}) if layout.pipeline == 1 else 0
        return max(layers - kept, 0) * (weight_tiles * F32) + tokens * act / layout.mesh.tensor / FP8_BLOCK * F32
    raise ValueError(f"model.fp8.recipe={recipe!r} is not one of none, current, delayed, blockwise")
