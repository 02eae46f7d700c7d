"""FLOPs and the pipeline bubble of a step (its collectives: `plan.collectives`)."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from lumen_jax.metrics import flops
from lumen_jax.config import ModelConfig
from lumen_jax.parallel import context as context_lib
from lumen_jax.parallel.pipeline import schedule as pipeline_lib
from lumen_jax.plan import moe as moe_plan
from lumen_jax.plan.hardware import Layout, first_layers
from lumen_jax.plan.memory import STATE_BYTES, loss_chunks, split_backward, state_bytes
from lumen_jax.plan.residuals import computed_score_fraction, recomputes

# Elementwise work XLA's cost_analysis counts besides the matmuls (ops per element, a non-negative
# least-squares fit to XLA's CPU counts of our step): softmax and masking per computed score, norms,
# residuals, RoPE and SwiGLU per d_model element of each layer, cross-entropy per logit, clipping +
# AdamW per local parameter; under context parallelism, per element of a query chunk's output
# (N*H/t per query token) for each chunk pair the compiler counts: the online-softmax merge of the
# pair's output and log-sum-exp and, in the backward, the sums of its dq, dk, dv (fitted to the
# compiled ring and all-gather steps at C = 2, 4, 8). Used only for the compiler comparison; MFU
# counts matmuls alone.
ELEMENTWISE_OPS = {"score": 19, "embed": 58, "logit": 9, "param": 36, "pair": 16}


def window_pair_share(gap: int, chunk_len: int, window: int) -> float:
    """The part of a (query chunk, key chunk) pair's chunk_len^2 (query, key) pairs a causal sliding
    `window` shows (0 <= query position - key position < window), the queries `gap` positions after
    the keys: 1 inside the window, 0 outside, between on its edge."""
    delta = np.arange(1 - chunk_len, chunk_len)  # query index - key index, on chunk_len - |delta| pairs each
    distance = gap + delta
    seen = (distance >= 0) & (distance < window)
    return float(np.sum((chunk_len - np.abs(delta)) * seen)) / chunk_len ** 2


@functools.lru_cache(maxsize=256)  # the search asks it for every candidate
def context_score_fraction(context: int, balance: str = "zigzag", attention: str = "flash", seq_len: int = 0,
                           window: int = 0) -> float:
    """The part of the S x S score square the busiest context device computes, times C: 1/2 for
    balanced causal work (zigzag with a kernel that skips the upper half of a diagonal block).

    Counts the (query chunk, key chunk) pairs `lumen_jax.parallel.context` does not skip: a pair
    below the diagonal in full, a diagonal pair half with the flash kernel and whole with the xla
    one (which masks it). Contiguous chunks leave device C-1 with C - 1/2 blocks against C/2 on average.
    With a sliding `window` shorter than `seq_len` a pair outside it is skipped too, and the flash
    kernel computes the window's share of the others (`window_pair_share`: it skips the tiles
    outside), the xla one each pair it does not skip whole.
    """
    layout = context_lib.Layout(context, balance)
    n_chunks = context * layout.chunks_per_device
    if window:
        chunk = seq_len // n_chunks
        shares = {gap: window_pair_share(gap * chunk, chunk, window) for gap in range(1 - n_chunks, n_chunks)}
        weight = {gap: share if attention == "flash" else float(share > 0) for gap, share in shares.items()}
    else:
        diagonal = 0.5 if attention == "flash" else 1.0
        weight = {gap: 1.0 if gap > 0 else diagonal if gap == 0 else 0.0 for gap in range(1 - n_chunks, n_chunks)}
    work = [sum(weight[q - k] for j in range(context) for q in layout.chunk_ids(i) for k in layout.chunk_ids(j))
            for i in range(context)]
    return max(work) * context / n_chunks ** 2


def planned_score_fraction(model: ModelConfig, mesh, seq_len: int, attention: str) -> float:
    """The part of the S x S score square the step's busiest device computes, times C: the causal
    half on one device (the MFU convention), or with a sliding window shorter than the sequence and
    a fused kernel (`attention` flash: ours or cuDNN's, which skip what lies outside) the window's
    share, as `metrics.flops` counts it (W/S - W^2/2S^2); under context parallelism
    `context_score_fraction`, with the window."""
    window = model.sliding_window if 0 < model.sliding_window < seq_len else 0
    if mesh.context > 1:
        return context_score_fraction(mesh.context, mesh.context_balance, attention, seq_len if window else 0, window)
    if window and attention == "flash":
        return (flops.attention_forward_flops_per_token(model, seq_len)
                / flops.attention_forward_flops_per_token(model, seq_len, causal=False))
    return 0.5


def planned_flops_per_token(model: ModelConfig, layout: Layout, seq_len: int, remat: str, *,
                            score_fraction: float = 0.5, attention: str = "xla",
                            redo: dict[str, bool] | None = None) -> float:
    """`flops.hardware_flops_per_token` of a run on `layout`, with what the backward pass re-runs
    read off the model's residuals (`residuals.recomputes`: the projections unless the policy saves
    one, the attention core unless it saves scores or, under context parallelism, the ring's
    residuals; with `attention` flash, the kernel's) instead of assumed per policy, or `redo` where the
    caller knows it. `score_fraction` as there."""
    mesh = layout.mesh
    redo = redo or recomputes(remat, mesh.context, mesh.context_parallel, attention)
    return flops.hardware_flops_per_token(model, seq_len, remat, score_fraction=score_fraction, context=mesh.context,
                                          recomputes=redo)


def flops_per_device(model: ModelConfig, layout: Layout, seq_len: int, global_batch: int, *,
                     remat: str | None = None, causal: bool = True, layers: int | None = None,
                     elementwise: bool = False, score_fraction: float | None = None) -> float:
    """Hardware FLOPs (matmuls, with the remat recompute) one device runs per optimizer step.

    Args:
      model, layout, seq_len, global_batch: the run.
      remat: the activation-checkpointing policy (default `model.remat`).
      causal: count half of the S x S scores (the MFU convention). False: the part of the square
        the model's attention actually computes (`residuals.computed_score_fraction`: all of it, or
        the blocks on and below the diagonal), which is what the compiler counts.
      layers: count this many layers instead of `model.num_layers`. XLA's `cost_analysis` counts
        the body of the scan over layers once: pass 1 to compare with it.
      elementwise: add the elementwise work XLA also counts (`ELEMENTWISE_OPS`).
      score_fraction: overrides the part of the square counted (`causal`).
    """
    m = model if layers is None else dataclasses.replace(model, num_layers=layers)
    remat = model.remat if remat is None else remat
    fraction = 0.5 if causal else computed_score_fraction(seq_len)
    fraction = fraction if score_fraction is None else score_fraction
    total = planned_flops_per_token(m, layout, seq_len, remat, score_fraction=fraction) * global_batch * seq_len
    total /= layout.num_devices
    if elementwise:
        tp, sp = layout.mesh.tensor, layout.mesh.sequence_parallel
        local_tokens = global_batch * seq_len / (layout.mesh.data * layout.mesh.fsdp * layout.mesh.expert
                                                 * layout.mesh.context)
        layers = m.num_layers / layout.pipeline
        per_token = (layers * (ELEMENTWISE_OPS["score"] * m.num_heads * seq_len * fraction / tp
                               + ELEMENTWISE_OPS["embed"] * m.d_model / (tp if sp else 1))
                     + ELEMENTWISE_OPS["logit"] * m.vocab_size / tp)
        local_params = state_bytes(m, layout)["optimizer"] / STATE_BYTES["optimizer"]
        total += per_token * local_tokens + ELEMENTWISE_OPS["param"] * local_params
    return total


@dataclasses.dataclass(frozen=True)
class _TickUnits:
    """A pipelined step's work per token of one micro-batch on one device: each layer's forward, its
    whole (forward, backward and recompute), the weight-gradient matmuls of a split backward's W (0
    unsplit), and the loss's logits with multi-token prediction's modules (forward and backward, split
    over the P stages in its ticks)."""

    forward: float
    layer: float
    wgrad: float
    head: float
    tokens: float  # one micro-batch's tokens per device of the flat layout


def _tick_units(model: ModelConfig, layout: Layout, seq_len: int, global_batch: int, split: bool) -> _TickUnits:
    flat = dataclasses.replace(layout, pipeline=1, mesh=dataclasses.replace(layout.mesh, pipeline=1))
    one = dataclasses.replace(model, num_layers=1, mtp_depth=0)
    fraction = computed_score_fraction(seq_len)
    planned = lambda m: planned_flops_per_token(m, flat, seq_len, model.remat, score_fraction=fraction)  # noqa: E731
    head = 6.0 * model.d_model * model.vocab_size  # logits forward and backward, per token
    layer = planned(one) - head
    if model.mtp_depth:  # multi-token prediction runs with the head (its blocks, merges and logits)
        head += planned(dataclasses.replace(one, mtp_depth=model.mtp_depth)) - planned(one)
    forward = 2.0 * flops.param_counts(one)["layer_matmul"] + flops.attention_forward_flops_per_token(
        one, seq_len, causal=False) * fraction
    return _TickUnits(forward, layer, split_backward(model).flops if split else 0.0, head,
                      global_batch // layout.micro_batches * seq_len / flat.num_devices)


def critical_path_matmul_flops(model: ModelConfig, layout: Layout, seq_len: int, global_batch: int) -> float:
    """Matmul FLOPs one device runs per step, every loop times its trip count (what `hlo.matmul_flops`
    counts in the compiled step): the model's hardware FLOPs with the recompute and the part of the
    score square the attention computes, on this device's share. With pipeline stages, every tick of
    the lock-step program (`schedule.lockstep`: every stage runs every tick, the bubble on zeros):
    per tick a chunk's forward, its backward (a split program's B: less the tapped projections'
    weight-gradient matmuls), a split program's W (those matmuls) and 1/P of a micro-batch's logits,
    as the tick's segment runs them. Under context parallelism the compiled ring's hop conditionals
    count at their dearest branch, a full chunk pair: the device's share of the computed square."""
    if layout.pipeline == 1:
        return flops_per_device(model, layout, seq_len, global_batch, causal=False)
    name, v = layout.schedule
    prog = pipeline_lib.lockstep(name, layout.pipeline, layout.micro_batches, v)
    u = _tick_units(model, layout, seq_len, global_batch, prog.split)
    chunk = layout.chunk_layers(model.num_layers, first_layers(model))
    ticks = unit_ticks(prog)
    per_token = (ticks["forward"] * chunk * u.forward + ticks["backward"] * chunk * (u.layer - u.forward - u.wgrad)
                 + ticks["weight"] * chunk * u.wgrad + ticks["head"] * u.head / layout.pipeline)
    return per_token * u.tokens


def compiled_flops_per_device(model: ModelConfig, layout: Layout, seq_len: int, global_batch: int) -> float:
    """What XLA's `cost_analysis()` reports for the compiled step, to check `flops_per_device` against.

    The compiler counts the body of a loop once: the scan over layers (one layer) and the
    gradient-accumulation scan (one micro-batch of global_batch / micro_batches sequences); it
    counts the part of the score square the attention computes, and elementwise work. Under context
    parallelism (`lumen_jax.parallel.context`) it counts every chunk pair of a hop in full (a
    `lax.switch` over skip/full/diagonal counts its largest branch) and every hop the program
    unrolls: the ring's C hops are unrolled Python loops in the forward and in the backward (C of C
    counted: the whole square), the all-gather attention is a `lax.scan` over the C devices' chunks
    (its body once: 1 of C). Each counted pair adds `ELEMENTWISE_OPS["pair"]` ops per element of its
    query chunk's output.

    With pipeline stages the compiler counts each segment's scan over ticks once, and a first
    tick run on its own once more (`schedule.lockstep`, `Lockstep.alone`): its forward of one chunk (one layer counted, as above) on the
    micro-batch's local rows (not 1/P of them), its share of the loss (1/P of the tokens), its
    backward (a split program's B: less the tapped projections' weight-gradient matmuls) and a
    split program's W unit (those matmuls, for every layer of the chunk); the layer's elementwise
    work a third in the forward, two thirds in the backward.
    """
    micro_batch = global_batch // layout.micro_batches
    if layout.pipeline > 1:
        flat = dataclasses.replace(layout, pipeline=1, mesh=dataclasses.replace(layout.mesh, pipeline=1))
        fraction = computed_score_fraction(seq_len)
        name, v = layout.schedule
        prog = pipeline_lib.lockstep(name, layout.pipeline, layout.micro_batches, v)
        u = _tick_units(model, layout, seq_len, global_batch, prog.split)
        # The layer's elementwise work (softmax, norms, residuals: a third forward, two thirds backward).
        mesh = flat.mesh
        elementwise = (ELEMENTWISE_OPS["score"] * model.num_heads * seq_len * fraction / mesh.tensor
                       + ELEMENTWISE_OPS["embed"] * model.d_model / (mesh.tensor if mesh.sequence_parallel else 1))
        layer, forward, head, wgrad = u.layer + elementwise, u.forward + elementwise / 3, u.head, u.wgrad
        # A split backward (zero_bubble): B is the layer's backward less the tapped projections'
        # weight-gradient matmuls; W runs those for the chunk's layers at once (`Taps.replay` maps
        # over the layers, it does not scan them), so the compiler counts every layer of the chunk.
        weight = wgrad * layout.chunk_layers(model.num_layers, first_layers(model))
        # Each segment's scan body counted once: its forward, its share of the loss, its backward
        # (B when split), its weight-gradient unit (split); a first tick run on its own
        # (`Lockstep.alone`: gpipe's first backward) once more, unless it is the segment's only tick.
        segments = sum(((forward if g.forward else 0.0) + (head / layout.pipeline if g.head else 0.0)
                        + (layer - forward - wgrad if g.backward else 0.0) + (weight if g.weight else 0.0))
                       * (1 + (alone and g.stop - g.start > 1))
                       for g, alone in zip(prog.segments, prog.alone()))
        return compiled_flops_per_device(model, flat, seq_len, global_batch) + (segments - layer - head) * u.tokens
    mesh = layout.mesh
    if mesh.context == 1:
        # An MoE stack scans groups of every_n_layers layers (dense ones, then the MoE one): one group counted.
        body = model.moe.every_n_layers if model.moe.enabled else 1
        return (flops_per_device(model, layout, seq_len, micro_batch, causal=False, layers=body, elementwise=True)
                + _counted_experts(model, layout, micro_batch * seq_len / (mesh.data * mesh.fsdp * mesh.expert))
                - _uncounted_loss_chunks(model, layout, seq_len, micro_batch))
    hops = mesh.context if mesh.context_parallel == "ring" else 1
    total = flops_per_device(model, layout, seq_len, micro_batch, causal=False, layers=1, elementwise=True,
                             score_fraction=hops / mesh.context)
    # Per local query token, each hop pairs it with the key chunks of one device.
    pairs = hops * context_lib.Layout(mesh.context, mesh.context_balance).chunks_per_device
    local_tokens = micro_batch * seq_len / (mesh.data * mesh.fsdp * mesh.context)
    out_width = model.num_heads * model.resolved_head_dim / mesh.tensor
    return (total + ELEMENTWISE_OPS["pair"] * pairs * out_width * local_tokens
            - _uncounted_loss_chunks(model, layout, seq_len, micro_batch))


def _uncounted_loss_chunks(model: ModelConfig, layout: Layout, seq_len: int, micro_batch: int) -> float:
    """The output layer's matmul FLOPs `cost_analysis` leaves out when the loss runs in C chunks
    (`ops.loss`: a loop whose body, one chunk, it counts once): (1 - 1/C) of them."""
    mesh = layout.mesh
    rows = max(1, micro_batch // (mesh.data * mesh.fsdp * mesh.expert))
    chunks = loss_chunks(model, layout, rows, seq_len)
    return (1 - 1 / chunks) * 6 * model.d_model * model.vocab_size / mesh.tensor * rows * seq_len / mesh.context


def _counted_experts(model: ModelConfig, layout: Layout, tokens: float) -> float:
    """What `cost_analysis` counts for one MoE layer's routed experts minus what the plan counts
    (`plan.moe.counted_expert_flops`: the experts' loops' bodies once); 0 without MoE."""
    if not model.moe.enabled:
        return 0.0
    planned, counted = moe_plan.counted_expert_flops(model, layout, tokens, model.remat)
    return counted - planned


def bubble_fraction(stages: int, microbatches: int, interleave: int = 1) -> float:
    """Idle fraction of a 1F1B pipeline: (p - 1) / (v*m + p - 1) (Narayanan et al. 2021)."""
    return (stages - 1) / (interleave * microbatches + stages - 1)


def unit_ticks(prog: pipeline_lib.Lockstep) -> dict[str, int]:
    """Ticks of `prog` with a forward, a backward, the loss, a weight-gradient unit (split backward),
    fill and drain included."""
    return {k: sum(g.stop - g.start for g in prog.segments if getattr(g, k))
            for k in ("forward", "backward", "head", "weight")}


