"""The memory of SOMEONE ELSE's program: what a published recipe (Megatron/NeMo, Llama 3's 4D stack,
torchtitan, MaxText) holds per device, term by term, so a calibration row that ran is checked
against the memory of the program that ran it (`plan.memory` is the memory of OUR program).

Every term is bytes on the worst device (the pipeline's first or last stage). The formulas and
their sources are in each function's docstring and in docs/PLANNING.md, section 5 ("Memory of a
recipe"); `B` below is the compute dtype's 2 bytes (every recipe here trains in bf16).
"""

from __future__ import annotations

import dataclasses

from lumen_jax.config import MeshConfig, ModelConfig
from lumen_jax.metrics import flops

B = 2  # bf16
F32 = 4


@dataclasses.dataclass(frozen=True)
class RecipeLayout:
    """A published layout in the recipe's own terms."""

    tensor: int  # TP
    pipeline: int  # PP
    virtual: int  # V (interleaved 1F1B's model chunks per stage; 1: plain 1F1B)
    context: int  # CP
    data: int  # the data-parallel replicas the optimizer shards over (DP, or FSDP's shard group)
    micro_batches: int  # m, per step
    micro_batch_size: int  # sequences per micro-batch per replica
    seq_len: int
    sequence_parallel: bool

    @classmethod
    def of(cls, mesh: MeshConfig, global_batch: int, micro_batches: int, seq_len: int) -> "RecipeLayout":
        replicas = mesh.data * mesh.fsdp
        return cls(tensor=mesh.tensor, pipeline=mesh.pipeline, virtual=mesh.pipeline_virtual_stages or 1,
                   context=mesh.context, data=replicas, micro_batches=micro_batches,
                   micro_batch_size=global_batch // (replicas * micro_batches), seq_len=seq_len,
                   sequence_parallel=mesh.sequence_parallel)


@dataclasses.dataclass(frozen=True)
class RecipeMemory:
    """Bytes per device of a recipe, by term (the worst stage), and what each term is."""

    family: str
    stage: str  # "first", "last" or "only": the stage the terms are for
    terms: dict[str, float]
    formulas: dict[str, str]

    @property
    def total(self) -> float:
        return sum(self.terms.values())


def megatron_layer_widths(model: ModelConfig, remat: str) -> dict[str, float]:
    """The tensors one Llama layer saves for its backward under Megatron-Core with Transformer
    Engine and flash attention, in elements per token, split into `D` (d_model wide: divided by t
    only under sequence parallelism) and `T` (head- or ffn-split: always divided by t).

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
    section 4.1) count a GPT layer's saved tensors as 34 s b h + 5 a s^2 b bytes: the two
    layer-norm inputs (4sbh), the QKV input (2sbh), Q and K (4sbh), V (2sbh), the projection input
    (2sbh), the MLP input (2sbh), the GeLU input and output (8sbh each), three dropout masks
    (3sbh) and the attention scores (5as^2b). The same count for a Llama layer: no dropout, flash
    attention (no s^2 term: it saves O and the log-sum-exp; so Korthikanti's selective recompute,
    which recomputes exactly the s^2 part, saves nothing more), grouped K and V (K*hd wide each),
    and SwiGLU (the fc1 output, gate and up: 2F; the fc2 input: F). Full recompute saves the
    layer input only (Table 2's 2sbhL).
    """
    hd = model.resolved_head_dim
    if remat == "full":
        return {"D": 1.0, "T": 0.0}
    # D-wide: attention norm input, QKV input (norm output), MLP norm input, fc1 input (norm output)
    # T-wide: Q, K, V, O (the projection input), fc1 output (gate, up), fc2 input; LSE (fp32, N wide)
    t_wide = (model.num_heads * hd * 2 + 2 * model.num_kv_heads * hd + 3 * model.ffn_dim
              + model.num_heads * F32 / B)
    return {"D": 4.0, "T": float(t_wide)}


def _stage_layers(model: ModelConfig, pipeline: int, balanced_ends: bool) -> int:
    """Layers on the first (and last) stage: ceil(L / P); Llama 3 takes one layer off each end
    stage to make room for the embedding and the logits (Dubey et al. 2024, section 3.3.2)."""
    per = -(-model.num_layers // pipeline)
    if balanced_ends and pipeline > 2:
        return (model.num_layers - (pipeline - 2) * per) // 2
    return per


def in_flight_chunks(layout: RecipeLayout, rank: int) -> int:
    """Forward chunks whose activations a pipeline rank holds at its peak under Megatron's 1F1B
    (megatron/core/pipeline_parallel/schedules.py): the warm-up forwards + the steady state's one,
    P - r for plain 1F1B, 2 (P - r - 1) + (V - 1) P + 1 for the interleaved schedule, never more
    than the step's m V chunks. On rank 0 that is Korthikanti's P micro-batches of L/P layers
    (section 4.2.3: L layers' worth) and, interleaved, L (1 + (P - 1) / (P V)) layers' worth.
    Without a pipeline one micro-batch (gradient accumulation frees each before the next)."""
    p, v, m = layout.pipeline, layout.virtual, layout.micro_batches
    if p == 1:
        return 1
    if v == 1:
        return min(p - rank, m)
    return min(2 * (p - rank - 1) + (v - 1) * p + 1, m * v)


def megatron(model: ModelConfig, layout: RecipeLayout, remat: str, *, balanced_ends: bool = False,
             family: str = "megatron") -> RecipeMemory:
    """Megatron-Core / NeMo (and Llama 3's 4D stack, which keeps the same state): per device,

    - `params`: bf16 weights, 2 bytes / parameter of the stage (split by TP, and by PP);
    - `grads`: fp32 main gradients (grad_reduce_in_fp32 / accumulate_allreduce_grads_in_fp32), 4;
    - `optimizer`: the distributed optimizer's fp32 master weights and Adam m, v, 12 bytes sharded
      over the data-parallel group with context parallelism (DP x CP ranks): Megatron-LM's
      docs/source/api-guide/dist_optimizer.md, "6 + 12/d bytes per parameter" for bf16 + fp32 grads;
    - `activations`: the in-flight chunks (`in_flight_chunks`) x their layers x
      `megatron_layer_widths` x tokens (s b / CP) x 2 bytes, D-wide terms / t under SP;
    - `embedding` (first stage): the embedding output, 2 s b h / t (SP);
    - `logits` (last stage): Korthikanti's section 4.3 output layer: the final norm and output
      projection inputs (4 s b h / t) and the fp32 logits for the cross entropy (4 s b v / t).
    The worst of the first and last stage (the first holds the most in flight).
    """
    t, p, cp = layout.tensor, layout.pipeline, layout.context
    counts = flops.param_counts(model)
    layer = counts["layer_matmul"] + 2 * model.d_model
    ends = model.vocab_size * model.d_model
    tokens = layout.micro_batch_size * layout.seq_len / cp
    widths = megatron_layer_widths(model, remat)
    per_layer = B * tokens * (widths["D"] * model.d_model / (t if layout.sequence_parallel else 1) + widths["T"] / t)
    d_tok = B * tokens * model.d_model / (t if layout.sequence_parallel else 1)
    stage_layers = _stage_layers(model, p, balanced_ends)
    best: RecipeMemory | None = None
    for stage, rank in (("first", 0), ("last", p - 1)) if p > 1 else (("only", 0),):
        n = (stage_layers * layer + (ends if stage in ("first", "only") else 0)
             + (ends + model.d_model if stage in ("last", "only") else 0)) / t
        layers_in_flight = in_flight_chunks(layout, rank) * stage_layers / layout.virtual
        terms = {"params": B * n, "grads": F32 * n, "optimizer": 12 * n / (layout.data * cp),
                 "activations": layers_in_flight * per_layer,
                 "embedding": d_tok if stage in ("first", "only") else 0.0,
                 "logits": (2 * d_tok + F32 * tokens * model.vocab_size / t) if stage in ("last", "only") else 0.0}
        found = RecipeMemory(family, stage, terms, MEGATRON_FORMULAS)
        if best is None or found.total > best.total:
            best = found
    return best


MEGATRON_FORMULAS = {
    "params": "2 x N/(t p) (bf16)", "grads": "4 x N/(t p) (fp32 main grads)",
    "optimizer": "12 x N/(t p) / (DP x CP) (distributed optimizer: fp32 master, Adam m, v)",
    "activations": "in-flight chunks x L/(p V) x s b/CP x 2 (4h [/t with SP] + (2Nhd + 2Khd + 3F)/t)",
    "embedding": "2 s b h / t", "logits": "4 s b h / t + 4 s b v / t",
}


def torchtitan_layer_widths(model: ModelConfig, remat: str) -> dict[str, float]:
    """What a torchtitan Llama layer keeps per token under its activation checkpointing
    (torchtitan/models/llama3/infra/parallelize.py, `apply_ac`): `full` keeps the block input;
    `op` selective AC saves the outputs of the ops in its save list (flash SDPA: O and the
    log-sum-exp; the reduce-scatters) and of every other matmul (wq, wv, w1, w2 of the seven), the
    rest recomputed; plus the block input. `D`: d_model wide (/t under SP), `T`: split by TP."""
    hd = model.resolved_head_dim
    if remat == "full":
        return {"D": 1.0, "T": 0.0}
    return {"D": 2.0, "T": float(2 * model.num_heads * hd + model.num_kv_heads * hd + model.ffn_dim
                                 + model.num_heads * F32 / B)}


def torchtitan(model: ModelConfig, layout: RecipeLayout, remat: str) -> RecipeMemory:
    """torchtitan with FSDP2 (fully_shard per block, then the root; mixed precision bf16 params,
    fp32 reduce) and TP: per device,

    - `params`, `grads`, `optimizer`: fp32 sharded over the FSDP group (4 + 4 + 8 bytes / (t F));
    - `gathered`: the bf16 all-gathered weights of the running block and the one prefetched
      (2 x 2 x block / t) and the fp32 unsharded gradient of one block before its reduce-scatter
      (4 x block / t), and the output projection gathered for the loss (2 v h / t);
    - `activations`: L x `torchtitan_layer_widths` x tokens x 2 bytes, plus one block's
      recompute working set in the backward (`megatron_layer_widths`' full set, once);
    - `logits`: the loss's bf16 logits, their fp32 copy and the fp32 log-softmax (10 s b v / t).
    """
    t, f = layout.tensor, layout.data * layout.context
    counts = flops.param_counts(model)
    n = counts["total"] / t
    block = (counts["layer_matmul"] + 2 * model.d_model) / t
    tokens = layout.micro_batch_size * layout.seq_len / layout.context
    sp = t if layout.sequence_parallel else 1
    kept = torchtitan_layer_widths(model, remat)
    every = megatron_layer_widths(model, "none")
    layer = lambda w: B * tokens * (w["D"] * model.d_model / sp + w["T"] / t)  # noqa: E731
    terms = {"params": F32 * n / f, "grads": F32 * n / f, "optimizer": 8 * n / f,
             "gathered": 2 * B * block + F32 * block + B * model.vocab_size * model.d_model / t,
             "activations": model.num_layers * layer(kept) + (layer(every) if remat != "none" else 0.0),
             "logits": (B + F32 + F32) * tokens * model.vocab_size / t}
    formulas = {"params": "4 N / (t F)", "grads": "4 N / (t F)", "optimizer": "8 N / (t F)",
                "gathered": "2 x 2 block/t + 4 block/t + 2 v h / t",
                "activations": "L x s b x 2 (kept widths) + one block's recompute",
                "logits": "10 s b v / t"}
    return RecipeMemory("torchtitan", "only", terms, formulas)


FAMILIES = ("megatron", "llama3", "torchtitan", "maxtext")


def recipe_memory(family: str, model: ModelConfig, layout: RecipeLayout, remat: str) -> RecipeMemory:
    """The memory of the recipe `family` runs for `model` on `layout` with its recompute `remat`
    (our policy name standing for it: none, dots_saveable for selective, full). `maxtext` is a JAX
    program like ours: its memory is our program's (`plan.memory`), planned by the caller."""
    if family == "megatron":
        return megatron(model, layout, remat)
    if family == "llama3":
        return megatron(model, layout, remat, balanced_ends=True, family="llama3")
    if family == "torchtitan":
        return torchtitan(model, layout, remat)
    raise ValueError(f"no recipe memory model for family {family!r}: one of megatron, llama3, torchtitan "
                     "(maxtext is planned as our program)")
