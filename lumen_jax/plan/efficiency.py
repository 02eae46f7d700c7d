"""Hardware terms of the step time: matmul efficiency by shape, attention, memory-bound work, and how
much of each axis's collectives hides under compute. Fitted to measured H100 runs (`calibration`).

Shape letters: M tokens of one micro-batch on one device, K the contracted width, N the output width,
D d_model, F ffn, N*H query width, K*H key/value width, V vocab, t tensor, c context, p pipeline.
"""

from __future__ import annotations

import dataclasses

from lumen_jax.config import ModelConfig
from lumen_jax.metrics import flops
from lumen_jax.plan import measured
from lumen_jax.plan.hardware import Hardware, Layout, compute_bytes, first_layers

# Bytes through HBM per logit (a token's score of one vocabulary entry), by the loss's program.
# chunked (ours, ops/loss.py): the float32 chunk written and read for its log-sum-exp, read again for
# the gradient, written in the compute dtype and read by the two backward GEMMs: 4 + 4 + 4 + 2 + 4.
# float32 (the program measured 2026-12-04): the whole float32 logits, log-softmax, a float32 one-hot
# written and read, the float32 gradient written and read by the two GEMMs: about twice as much.
LOGIT_BYTES = {"chunked": 18.0, "float32": 36.0}


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """What the GPU reaches of its datasheet, fitted to published runs (docs/PLANNING.md, section 5).

    A GEMM of [M, K] x [K, N] takes 2MKN / (peak x `matmul`) + its operand and result bytes /
    (HBM bandwidth x `matmul`): an additive roofline, so a large GEMM approaches `matmul` of the
    peak and a thin one (tensor parallelism splitting N or K, few tokens per micro-batch) runs at its
    memory speed. A fused attention kernel (ours or cuDNN's) runs at the forward and backward rates
    measured for it (`plan.measured.kernel_rates`). Memory-bound work moves through HBM: the layers'
    elementwise work (norms, residuals, RoPE, SwiGLU) `elementwise_bytes` bytes per d_model element
    of each layer per token; the loss `LOGIT_BYTES` per logit; the optimizer's update its state
    (`compute_seconds`' `update_bytes`).
    """

    # Fitted 2026-12-05 to the 19 runs of `published.TABLE` (benchmarks/calibrate_planner.py):
    matmul: float = 0.74
    elementwise_bytes: float = 88.0

    def gemm_seconds(self, m: float, k: float, n: float, hw: Hardware, peak: float, itemsize: int = 2) -> float:
        """One [m, k] x [k, n] GEMM in the compute dtype."""
        return (2.0 * m * k * n / peak + itemsize * (m * k + k * n + m * n) / hw.hbm_bytes_per_s) / self.matmul


# What a published run hides of each axis's collectives under compute (docs/PLANNING.md, section 5):
# the fraction of min(transfer, the compute it can run under) that does not show in the step.
@dataclasses.dataclass(frozen=True)
class Overlap:
    """Per axis, the share of a collective's transfer that runs under compute, up to the compute
    there is to hide under (the exposed remainder is the transfer beyond it, plus the unhidden share).

    `tensor`: the Megatron / async-TP decomposition of the layer's collectives into its matmuls
    (0: our program, whose tensor-parallel collectives sit between the matmuls). `fsdp`: weight
    gathers prefetched one layer ahead and gradient reduce-scatters behind the backward. `data`:
    the gradient all-reduce behind the backward (ours: behind the last micro-batch's backward: the
    sums cross `data` once per step). `context`: the ring's next hop under this hop's attention.
    `pipeline`: what a recipe hides of the sends our program waits for (the fill's activations, a
    drain's cotangents) and of the loss's shared sums (0: ours waits; the sends our program runs
    beside a unit of their tick hide whole whatever this says, `predict.exposed_seconds`).
    """

    tensor: float = 0.0
    fsdp: float = 1.0
    data: float = 0.0  # fitted: the published scale-outs show their data-parallel all-reduce whole
    context: float = 1.0
    pipeline: float = 0.0
    expert: float = 0.0

    def of(self, axis: str) -> float:
        return getattr(self, axis.split("+")[0])


@dataclasses.dataclass(frozen=True)
class Compute:
    """Seconds of one device's compute in one step, by part (forward, backward and recompute)."""

    matmul_s: float  # the layers' projections and the logits
    attention_s: float  # the attention core (QK^T, softmax, PV)
    elementwise_s: float
    backward_share: float  # of the total: the backward (and its recompute), where gradients reduce

    @property
    def total_s(self) -> float:
        return self.matmul_s + self.attention_s + self.elementwise_s


def layer_gemms(model: ModelConfig, tensor: int) -> list[tuple[float, float]]:
    """(K, N) of a layer's projections on one device: q, k, v, o, gate, up, down."""
    h, d, t = model.resolved_head_dim, model.d_model, tensor
    q, kv, ffn = model.num_heads * h / t, model.num_kv_heads * h / t, model.ffn_dim / t
    return [(d, q), (d, kv), (d, kv), (q, d), (d, ffn), (d, ffn), (ffn, d)]


def compute_seconds(model: ModelConfig, layout: Layout, seq_len: int, micro_batch: int, redo: dict[str, bool],
                    attention: str, hw: Hardware, eff: Efficiency, *, score_fraction: float = 0.5,
                    kernel: str = "cudnn", loss: str = "chunked", update_bytes: float = 0.0) -> Compute:
    """One device's compute per step: for each of the m micro-batches, the stage's layers' GEMMs
    (forward 1, backward 2, + the share of them the backward recomputes: `redo`), the attention
    core (forward 1, backward 2; the reference's 2.5 under context parallelism; +1 forward when recomputed) over
    `score_fraction` of the square, the logits GEMM (its share: 1/p of it per device) and the
    memory-bound work; once per step the optimizer's update, moving `update_bytes` through HBM.

    `attention`: `flash` runs the core in a fused `kernel` (flash: ours, cudnn: cuDNN's) at its
    measured rates, `xla` materialises the scores. `loss`: `chunked` (ours) or `float32` (the whole
    float32 logits, and the output layer's backward GEMMs on float32 operands: TF32)."""
    mesh, peak = layout.mesh, hw.peak(model.compute_dtype)
    c = compute_bytes(model)
    m_tokens = micro_batch * seq_len / mesh.context
    layers = layout.stage_layers(model.num_layers, first_layers(model))
    per_layer = sum(eff.gemm_seconds(m_tokens, k, n, hw, peak, c) for k, n in layer_gemms(model, mesh.tensor))
    # + the re-run projections' share of the layer's GEMMs, by their FLOPs (all of them: one forward)
    passes = 3.0 + flops.projection_params(model, redo["projections"]) / flops.param_counts(model)["layer_matmul"]
    vocab = model.vocab_size / mesh.tensor
    logit_gemm = eff.gemm_seconds(m_tokens, model.d_model, vocab, hw, peak, c)
    if loss == "float32":  # the backward's two GEMMs take the float32 gradient of the logits
        backward_gemms = 2.0 * eff.gemm_seconds(m_tokens, model.d_model, vocab, hw, hw.peak("float32"), 4)
    else:
        backward_gemms = 2.0 * logit_gemm
    logits = (logit_gemm + backward_gemms) / layout.pipeline
    one = dataclasses.replace(model, num_layers=1)
    core = flops.attention_forward_flops_per_token(one, seq_len, causal=False) * score_fraction / mesh.tensor
    # Under context parallelism the reference's chunk backward recomputes QK^T from the log-sum-exp
    # (2.5 forwards); a fused kernel's backward always does, with or without it (the ring runs the
    # same backward kernels per chunk pair), and its measured rate counts that backward as 2 forwards.
    backward = 2.0 if mesh.context == 1 or attention == "flash" else 2.5
    forwards = 1.0 + (1.0 if redo["attention"] else 0.0)
    if attention == "flash":
        forward_rate, backward_rate = measured.kernel_rates(kernel, seq_len // mesh.context)
        forward_s = core * m_tokens / (peak * forward_rate)
        backward_s = backward * core * m_tokens / (peak * backward_rate)
    else:  # scores materialised: the two batched GEMMs plus the fp32 score rows through HBM (a few passes)
        scores = model.num_heads / mesh.tensor * seq_len * score_fraction * m_tokens
        forward_s = core * m_tokens / (peak * eff.matmul) + 4 * 4 * scores / hw.hbm_bytes_per_s
        backward_s = backward * forward_s
    width = model.d_model / (mesh.tensor if mesh.sequence_parallel else 1)
    elementwise = layers * m_tokens * width * eff.elementwise_bytes / hw.hbm_bytes_per_s
    elementwise += LOGIT_BYTES[loss] * m_tokens * vocab / hw.hbm_bytes_per_s / layout.pipeline
    m = layout.micro_batches
    matmul_s = m * (layers * passes * per_layer + logits)
    attention_s = m * layers * (forwards * forward_s + backward_s)
    backward_share = (layers * (passes - 1) * per_layer + backward_gemms / layout.pipeline
                      + layers * ((forwards - 1) * forward_s + backward_s)) / (
        layers * passes * per_layer + logits + layers * (forwards * forward_s + backward_s))
    return Compute(matmul_s=matmul_s, attention_s=attention_s,
                   elementwise_s=m * elementwise + update_bytes / hw.hbm_bytes_per_s, backward_share=backward_share)
