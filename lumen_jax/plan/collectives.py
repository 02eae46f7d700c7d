"""The collectives of a step on each mesh axis: what each counter (`counts_collectives`) says the
step sends, per call and per step, as the compiled program runs it (docs/PLANNING.md,
docs/COMMUNICATION.md); `--against-xla` compares them with the compiled step's."""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

from lumen_jax.config import PROJECTION_NAMES, MeshConfig, ModelConfig
from lumen_jax.metrics import flops
from lumen_jax.parallel.pipeline import schedule as pipeline_lib
from lumen_jax.plan import moe as moe_plan
from lumen_jax.plan.cost import unit_ticks
from lumen_jax.plan.hardware import AXES, Hardware, Layout, compute_bytes, first_layers
from lumen_jax.plan.memory import F32 as F32_BYTES
from lumen_jax.plan.memory import regathered_inputs, split_backward, state_bytes
from lumen_jax.plan.residuals import recomputes

_QKV, _GATE_UP = ("query_proj", "key_proj", "value_proj"), ("mlpwi_0", "mlpwi_1")  # one gathered input each

DTYPE_NAMES = {2: "bf16", 4: "fp32"}  # by bytes, in a collective's description

_WIRE = {"all-reduce": lambda g: 2 * (g - 1) / g, "all-gather": lambda g: (g - 1) / g,
         "reduce-scatter": lambda g: (g - 1) / g, "send/recv": lambda g: 1.0,
         "all-to-all": lambda g: (g - 1) / g}  # the rows bound for the other G-1 devices


@dataclasses.dataclass(frozen=True)
class Collective:
    """One kind of collective on one mesh axis, summed over a step, for one device."""

    axis: str
    size: int
    link: str  # nvlink | ib
    kind: str  # all-reduce | all-gather | reduce-scatter | send/recv
    what: str
    payload_bytes: float  # the full tensor of one call, per device
    calls: float  # per optimizer step
    overlapped: bool  # can run under compute (prefetch / async reduction)
    bandwidth: float  # bytes/s of the link

    @property
    def wire_bytes(self) -> float:
        """Bytes each device sends: ring all-reduce 2(G-1)/G, all-gather/reduce-scatter (G-1)/G."""
        return _WIRE[self.kind](self.size) * self.payload_bytes * self.calls

    @property
    def seconds(self) -> float:
        return self.wire_bytes / self.bandwidth


def link_of(axis: str, layout: Layout, hw: Hardware) -> tuple[str, float]:
    """NVLink when the axis and every axis inside it fit in one node, else InfiniBand."""
    inner = math.prod(layout.size(a) for a in AXES[AXES.index(axis) + 1:])
    if inner * layout.size(axis) <= hw.devices_per_node:
        return "nvlink", hw.nvlink_bytes_per_s
    return "ib", hw.ib_bytes_per_s


@dataclasses.dataclass(frozen=True)
class StepShape:
    """What every axis's collectives are counted from: one step of one layout."""

    model: ModelConfig
    layout: Layout
    seq_len: int
    micro_batch: int
    remat: str
    moe_backend: str = "gpu"  # plan.moe.BACKENDS
    # how the gradients cross `context`: "per_unit", as our step runs it (`_context`), or "once" per
    # step with the data-parallel reduction, as Megatron does (the calibration's published runs)
    context_grads: str = "per_unit"

    @property
    def m(self) -> int:  # micro-batches per step
        return self.layout.micro_batches

    @property
    def c(self) -> int:  # bytes of the compute dtype
        return compute_bytes(self.model)

    @property
    def tokens(self) -> float:  # one micro-batch's tokens on one device along context
        return self.micro_batch * self.seq_len / self.layout.mesh.context

    @property
    def layers(self) -> int:  # layers per pipeline stage
        return self.layout.stage_layers(self.model.num_layers, first_layers(self.model))

    @property
    def row(self) -> float:  # one micro-batch's activations [tokens, D] in the compute dtype
        return self.tokens * self.model.d_model * self.c

    @property
    def weights(self) -> float:  # one device's fp32 parameter bytes unsharded over data and fsdp (/tp, /pp)
        mesh = self.layout.mesh
        return state_bytes(self.model, dataclasses.replace(self.layout, mesh=dataclasses.replace(
            mesh, data=1, fsdp=1, zero_axes="fsdp")))[
            "params"]

    @property
    def grads(self) -> float:  # one device's gradient bytes in mesh.reduce_dtype
        return state_bytes(self.model, self.layout)["grads"] * _reduce_bytes(self.layout) / F32_BYTES

    @property
    def context_replicas(self) -> bool:
        """Our step keeps each context device's partial gradients unreduced and reduces them once,
        with the data axis's (`parallel/communication.py`): with context > 1 in a step that
        accumulates (micro-batches or a pipeline), unless a pipeline's ticks split activations over
        tensor (sequence parallelism: no replica vmap)."""
        mesh, pipelined = self.layout.mesh, self.layout.pipeline > 1
        accumulates = self.m > 1 or pipelined
        sp_ticks = pipelined and mesh.sequence_parallel and mesh.tensor > 1
        return self.context_grads == "per_unit" and mesh.context > 1 and accumulates and not sp_ticks

    @property
    def context_manual(self) -> bool:
        """A pipeline whose ticks split activations over tensor (sequence parallelism) runs them
        without the replica vmap, `data` and `context` manual in its stages (`parallel/pipeline/
        executor.py`): each device's sums are reduced once, after the last tick, over data x context
        in one all-reduce (with data's, as `context_replicas` has them)."""
        mesh = self.layout.mesh
        return (self.context_grads == "per_unit" and mesh.context > 1 and self.layout.pipeline > 1
                and mesh.sequence_parallel and mesh.tensor > 1)

    @property
    def zero_context(self) -> bool:
        """`mesh.zero_axes=fsdp+context` with context > 1: the ZeRO collectives span fsdp x context,
        and the context devices' partial gradients are reduce-scattered with fsdp's."""
        return "context" in self.layout.mesh.zero_mesh_axes and self.layout.mesh.context > 1

    @property
    def zero_group(self) -> str:
        """The mesh axes ZeRO gathers weights and reduce-scatters gradients over (`mesh.zero_axes`)."""
        return "+".join(a for a in self.layout.mesh.zero_mesh_axes if self.layout.size(a) > 1) or "fsdp"

    def replica_group(self, *axes: str) -> str:
        """The mesh axes of the step's one gradient reduction: `axes`, with `context` when it is a
        replica axis (`context_replicas`) whose sums no ZeRO reduce-scatter takes (`zero_context`), as
        the compiled program names them (axes of one device left out)."""
        axes += ("context",) if (self.context_replicas or self.context_manual) and not self.zero_context else ()
        return "+".join(a for a in axes if self.layout.size(a) > 1) or axes[0]

    @property
    def redone(self) -> tuple[str, ...]:  # the projections the backward recomputes (`residuals.recomputes`)
        return recomputes(self.remat, self.layout.mesh.context, self.layout.mesh.context_parallel)["projections"]

    @property
    def redo(self) -> bool:  # the backward recomputes every projection (the layer)
        return set(self.redone) == set(PROJECTION_NAMES)

    @property
    def redo_inputs(self) -> int:
        """A selective policy's recompute (`config.REMAT_SAVES`): the gathered norm outputs it reads
        again, one per sublayer whose column-parallel projections it re-runs (a whole layer's: 2), as
        full's count has it. (The compiled CPU step of fsdp=4 x tensor=2 sp gathers the same bytes
        under every policy, full's too, at 1 and 2 micro-batches; its re-reduced o and the collective
        matmul's permutes match: `compiler.compiled.collective_bytes`, 2026-12-06.)"""
        return sum(any(n in self.redone for n in group) for group in (_QKV, _GATE_UP))

    @property
    def redo_outputs(self) -> int:
        """... and the row-parallel outputs it reduces again: the attention's o (down's output no
        gradient reads, so no policy re-runs it but full and save_attention_out, counted as measured)."""
        return int("out_proj" in self.redone)


def _fsdp_shards(mesh: MeshConfig) -> int:
    """What the gradients a unit makes are split into when another axis reduces them: fsdp under
    ZeRO-3 reducing every micro-batch (with `fsdp_grad_reduce=once` fsdp is a replica axis: full size)."""
    return mesh.fsdp if mesh.zero_stage >= 3 and mesh.fsdp_grad_reduce != "once" else 1


def _reduce_bytes(layout: Layout) -> int:
    return F32_BYTES if layout.mesh.reduce_dtype == "float32" else 2


# Each mesh axis (or feature) registers the function that counts its collectives; `collectives`
# runs them in order. Add = (axis, kind, what, payload bytes, calls per step, overlapped).
Add = Callable[[str, str, str, float, float, bool], None]
AXIS_COLLECTIVES: list[Callable[[StepShape, Add], None]] = []


def counts_collectives(fn: Callable[[StepShape, Add], None]) -> Callable[[StepShape, Add], None]:
    AXIS_COLLECTIVES.append(fn)
    return fn


def collectives(model: ModelConfig, layout: Layout, hw: Hardware, seq_len: int, micro_batch: int,
                remat: str, moe_backend: str = "gpu", context_grads: str = "per_unit") -> list[Collective]:
    """The collectives of one step per mesh axis (see docs/PLANNING.md for each count), from every
    registered counter (`counts_collectives`): fsdp and data, tensor, context, pipeline, expert."""
    out: list[Collective] = []

    def add(axis: str, kind: str, what: str, payload: float, calls: float, overlapped: bool) -> None:
        size = math.prod(layout.size(a) for a in axis.split("+"))  # "data+fsdp": one group over both
        if size > 1 and calls > 0:
            link, bw = link_of(axis.split("+")[0], layout, hw)
            out.append(Collective(axis, size, link, kind, what, payload, calls, overlapped, bw))

    step = StepShape(model, layout, seq_len, micro_batch, remat, moe_backend, context_grads)
    for count in AXIS_COLLECTIVES:
        count(step, add)
    return out


@counts_collectives
def _weights_and_gradients(s: StepShape, add: Add) -> None:
    """fsdp and data (docs/COMMUNICATION.md): ZeRO-3 gathers the weights in the compute dtype (float32
    where fp8 runs: it quantizes from the master copy); with `fsdp_regather=per_micro_batch` each
    layer's weights are gathered in every micro-batch's forward and again in its backward, while the
    embedding and logits weights (outside the layer loop, loop-invariant) are gathered once per step
    as XLA hoists them; `per_step` gathers everything once. Gradients are reduce-scattered (ZeRO-2/3)
    or all-reduced (ZeRO-1) in `mesh.reduce_dtype`, every micro-batch or, with
    `fsdp_grad_reduce=once`, once per step. ZeRO-1/2 gather the updated fp32 weights once.
    data: one all-reduce of the (ZeRO-sharded) gradients per step, whatever the micro-batches."""
    model, layout, m, c = s.model, s.layout, s.m, s.c
    mesh, tp = layout.mesh, layout.mesh.tensor
    weights = s.weights
    layer_weights = flops.param_counts(model)["layer_matmul"] * s.layers * F32_BYTES / tp  # the layer scan's
    if model.moe.enabled:  # a layer holds its local experts, not its active ones: all but the embedding and output
        outside = model.vocab_size * model.d_model * (1 if model.tie_embeddings else 2) / tp + model.d_model
        layer_weights = weights - outside * F32_BYTES
    gather = c if model.fp8.recipe == "none" else F32_BYTES
    dt = DTYPE_NAMES[gather]
    red = _reduce_bytes(layout)
    red_dt = DTYPE_NAMES[red]
    grad_calls = 1 if mesh.fsdp_grad_reduce == "once" else m
    if mesh.zero_stage >= 3:
        if layout.pipeline > 1:
            _pipelined_embedding_gradient(s, add)
        if mesh.fsdp_regather == "per_step":
            # Also in a pipelined step: gathered before the first tick (`step.loss_grads_and_state`).
            add(s.zero_group, "all-gather", f"{dt} weights, once per step (kept)", weights * gather / F32_BYTES, 1, True)
        elif layout.pipeline > 1:
            # As the compiled step runs them (measured, V = 1 and 2): every tick's forward and
            # backward gather the weights of the chunk they run (1/V of the stage's) in its layer
            # scan, not hoisted out of the segment's loop; a split backward's W unit gathers none
            # (its vjp is linear in the weights: XLA drops their cast and its gather).
            prog = _lockstep(s)
            ticks = unit_ticks(prog)
            add("fsdp", "all-gather", f"{dt} layer weights, per tick and unit (forward, backward)",
                layer_weights * gather / F32_BYTES / layout.schedule[1], ticks["forward"] + ticks["backward"], True)
            _pipelined_head_gathers(s, prog, gather, add)
        else:
            add(s.zero_group, "all-gather", f"{dt} layer weights, forward and backward",
                layer_weights * gather / F32_BYTES, 2 * m, True)
            add(s.zero_group, "all-gather", f"{dt} embedding and logits weights (hoisted)",
                (weights - layer_weights) * gather / F32_BYTES, 1, True)
    joint = mesh.fsdp_grad_reduce == "once" and m > 1 and mesh.data > 1 and mesh.fsdp > 1
    if joint:  # the step's one reduction spans both batch axes: full-size sums over data x fsdp
        add(s.replica_group("data", "fsdp"), "all-reduce", f"{red_dt} gradients, once per step", weights * red / F32_BYTES, 1, True)
    elif mesh.zero_stage >= 3 and layout.pipeline > 1 and grad_calls > 1:
        _pipelined_gradients(s, add, weights, red)
    elif mesh.zero_stage >= 3 and s.zero_context and grad_calls > 1:
        # every micro-batch reduce-scatters over fsdp into the context group's sum; the sums are
        # reduce-scattered over context once, after the last micro-batch
        add("fsdp", "reduce-scatter", f"{red_dt} gradients", weights * red / F32_BYTES, grad_calls, True)
        add("context", "reduce-scatter", f"{red_dt} gradient sums, once per step", weights * red / F32_BYTES / mesh.fsdp,
            1, True)
    elif mesh.zero_stage >= 3:
        add(s.zero_group, "reduce-scatter", f"{red_dt} gradients", weights * red / F32_BYTES, grad_calls, True)
    if mesh.zero_stage < 3:
        kind = "reduce-scatter" if mesh.zero_stage == 2 or s.zero_context else "all-reduce"
        if not joint:
            add(s.zero_group, kind, f"{red_dt} gradients", weights * red / F32_BYTES, grad_calls, True)
        add(s.zero_group, "all-gather", "updated fp32 weights", weights, 1, True)
    if not joint:
        add(s.replica_group("data"), "all-reduce", f"{red_dt} gradients, once per step", s.grads, 1, True)


def _pipelined_gradients(s: StepShape, add: Add, weights: float, red: int, axis: str = "fsdp",
                         kind: str = "reduce-scatter", experts: bool = True, shards: int = 1) -> None:
    """Gradients of a pipelined step that `axis` reduces in every tick (ZeRO-3's over fsdp; context
    parallelism's over context): as the compiled step sums them (measured), each unit reduces the
    gradients it makes, in its tick: a backward its chunk's layers' (split: all but the tapped
    projections'), a split backward's W unit the tapped projections', a loss tick the logits matrix
    and the final norm. `weights`: the stage's fp32 parameter bytes on one fsdp shard group
    (unsharded over data and fsdp); `experts=False`: without the routed experts' (reduced elsewhere);
    `shards`: the layers' gradients reduced at 1/shards of their size (after ZeRO-3's reduce-scatter
    over fsdp: measured on context=2 fsdp=2 without a pipeline), the head's at full size."""
    model, layout = s.model, s.layout
    prog, tp, v = _lockstep(s), layout.mesh.tensor, layout.schedule[1]
    ticks = unit_ticks(prog)
    head = (model.vocab_size * model.d_model / tp + model.d_model) * F32_BYTES
    outside = head + (0 if model.tie_embeddings else model.vocab_size * model.d_model / tp * F32_BYTES)
    layers = weights - outside  # the stage's layer stack, norms (and experts) included
    split = split_backward(model)
    routed = split.experts / layout.mesh.expert if experts else 0.0
    tapped = (split.params + routed) * s.layers * F32_BYTES / tp if prog.split else 0.0
    dt = DTYPE_NAMES[red]
    add(axis, kind, f"{dt} layer gradients of a backward, per backward tick",
        (layers - tapped) * red / F32_BYTES / v / shards, ticks["backward"], True)
    add(axis, kind, f"{dt} tapped projections' gradients of a W unit, per W tick",
        tapped * red / F32_BYTES / v / shards, ticks["weight"], True)
    add(axis, kind, f"{dt} logits matrix and final norm gradients, per loss tick",
        head * red / F32_BYTES, ticks["head"], True)


@counts_collectives
def _tensor(s: StepShape, add: Add) -> None:
    """tensor: Megatron's two all-reduces of [tokens, D] per layer forward and the backward's
    (sequence parallelism turns each into an all-gather + reduce-scatter of the same bytes), plus
    the vocab-parallel embedding and logits."""
    model, m, layers, row = s.model, s.m, s.layers, s.row
    # Per layer, as the compiled program runs them: the two row-parallel outputs in the forward, and
    # in the backward the input gradient of every column-parallel projection reduced on its own
    # (q, k, v: 3; gate, up: 2) as XLA does not add them before the reduction (+2 when the backward
    # recomputes the projections).
    if s.layout.pipeline > 1:
        _pipelined_tensor(s, add)
        return
    reductions = 2 + 5 + (2 if s.redo else s.redo_outputs)
    if _collective_matmul(s, add, m * layers, m * layers):
        # outside the layers as without it: the final norm's output and the embedding's gradient
        # gathered, the head's input gradient scattered, the vocab table gathered once
        add("tensor", "all-gather", "final norm output and embedding gradient (sequence parallel)", row, m * 2, False)
        add("tensor", "all-gather", "vocab table for the embedding lookup (sequence parallel; hoisted)",
            model.vocab_size * model.d_model * s.c, 1, False)
        add("tensor", "reduce-scatter", "the head's input gradient (sequence parallel)", row, m, False)
        return
    if s.layout.mesh.sequence_parallel:
        # all-gathers: the two norm outputs in the forward; in the backward the two row-parallel
        # outputs' cotangents (the reduce-scatters' transposes) and the two norm outputs again for
        # the weight gradients: from the layer's own rows (`memory.regathered_inputs`, remat none;
        # measured on fsdp=4 x tensor=2 at 1 and data=2 x fsdp=2 x tensor=2 at 4 micro-batches: 6
        # per layer), or, with a policy, as the partitioner gathers the cotangents a second time for
        # the weight gradients (two device-group spellings of one all-gather, which CSE leaves
        # apart; with one micro-batch it did not: 4); outside the layers the final norm's output,
        # the embedding's gradient and (once: loop-invariant) the vocab table for the lookup.
        gathers = 2 + 4 + (2 if s.redo else s.redo_inputs)
        add("tensor", "all-gather", f"activations, {gathers}/layer (sequence parallel)", row,
            m * (gathers * layers + 2), False)
        add("tensor", "all-gather", "vocab table for the embedding lookup (sequence parallel; hoisted)",
            model.vocab_size * model.d_model * s.c, 1, False)
        add("tensor", "reduce-scatter", f"activations, {reductions}/layer (sequence parallel)", row,
            m * (reductions * layers + 1), False)
    else:  # + the vocab-parallel embedding lookup and the gradient into the logits
        add("tensor", "all-reduce", f"activations, {reductions}/layer", row, m * (reductions * layers + 2), False)


@counts_collectives
def _context(s: StepShape, add: Add) -> None:
    """context (`mesh.context_parallel`), each device holding S/C of every sequence: `ring`, K/V chunks
    hop C-1 times around the axis per layer forward, again in the backward (measured with remat none
    as with full: the backward re-runs the exchange), and in the backward K/V travel with the fp32
    dK/dV accumulators, overlapping the chunk computations; `allgather`: K/V all-gathered per layer
    (again in the backward) and dK/dV reduce-scattered, exposed. Under a pipeline
    per layer of each tick that runs it (fill and drain included), as `_pipelined_tensor` counts.
    The weights are replicated over context and each device's gradients are partial sums of its
    tokens: where the step accumulates (`StepShape.context_replicas`) they are summed per device and
    reduced once per step with `data`'s; in a pipeline whose ticks run sequence parallelism (no
    replica vmap) `context` is manual in the stages with `data` (`StepShape.context_manual`) and they
    are reduced once, after the last tick, with data's too; with one micro-batch XLA all-reduces them
    (float32, measured) where they are made, once."""
    model, layout, m, layers, c = s.model, s.layout, s.m, s.layers, s.c
    mesh = layout.mesh
    cp, hops = mesh.context_parallel, mesh.context - 1
    kv_chunk = (2 * s.micro_batch * s.seq_len / mesh.context * model.num_kv_heads * model.resolved_head_dim
                / mesh.tensor * c)
    if layout.pipeline > 1:
        prog = _lockstep(s)
        ticks, chunk = unit_ticks(prog), layers / prog.virtual
        forwards, backwards = ticks["forward"] * chunk, ticks["backward"] * chunk
    else:
        forwards = backwards = m * layers
    if cp == "ring":  # K/V chunks hop C-1 times per layer forward; dK/dV (fp32) travel back with them
        add("context", "send/recv", "K/V chunks, C-1 ring hops per layer (forward, again in the backward)", kv_chunk,
            (forwards + backwards) * hops, True)
        add("context", "send/recv", "K/V and fp32 dK/dV chunks, C-1 ring hops per layer (backward)",
            kv_chunk * (1 + F32_BYTES / c), backwards * hops, True)
    else:  # all-gather K, V over the context axis; reduce-scatter dK/dV
        kv = kv_chunk * mesh.context
        add("context", "all-gather", "K/V per layer (again in the backward: measured with remat none as with full)",
            kv, forwards + backwards, False)
        add("context", "reduce-scatter", "dK/dV per layer", kv, backwards, False)
    if s.context_replicas or s.context_manual or s.zero_context:  # once per step with data's or fsdp's
        return  # (`_weights_and_gradients`)
    weights = s.weights
    shards = _fsdp_shards(mesh)
    if s.context_grads == "once":
        add("context", "all-reduce", "gradients, once per step (with the data-parallel reduction)", s.grads, 1, True)
    else:
        add("context", "all-reduce", "fp32 gradients of each micro-batch (partial sums of its tokens)",
            weights / shards, m, True)


@counts_collectives
def _pipeline(s: StepShape, add: Add) -> None:
    """pipeline, as the lock-step program sends (`schedule.lockstep`, `schedule.sends`): one activation
    forward per forward tick and one cotangent back per backward tick (gpipe: one fewer,
    `Lockstep.alone`) ([tokens, D]), overlapped where a forward, backward or weight unit of the same tick
    runs beside it (steady ticks; not the fill's activations nor a drain's cotangents, which the
    next unit waits for), the last stage's output summed over the stages for the shared loss and
    its cotangent (two all-reduces per loss tick), and the replicated embedding, norm and output
    gradients summed once."""
    layout, model = s.layout, s.model
    if layout.pipeline == 1:
        return
    prog = _lockstep(s)
    ticks = unit_ticks(prog)
    # Under sequence parallelism a device holds and sends its 1/t of the tokens of [tokens, D].
    row = s.row / (layout.mesh.tensor if layout.mesh.sequence_parallel else 1)
    counts = {(what, hidden): 0 for what in ("activation", "cotangent") for hidden in (True, False)}
    for _, row_sends in pipeline_lib.sends(prog):
        for send in row_sends:
            counts[(send.what, send.hidden)] += send.ticks
    whats = {"activation": "stage activations, one per forward tick", "cotangent": "cotangents, one per backward tick"}
    for (what, hidden), n in counts.items():
        if n:
            where = ("beside the tick's other units" if hidden else
                     "waited for by the next tick (" + ("fill" if what == "activation" else "drain") + ")")
            add("pipeline", "send/recv", f"{whats[what]}, {where}", row, n, hidden)
    add("pipeline", "all-reduce", "the last stage's output for the shared loss, and its cotangent", row,
        2 * ticks["head"], False)
    # the embedding, the final norm and the untied output: the parameters not cut into stages
    outside = flops.param_counts(model)["embedding"] + model.d_model * (1 + model.vocab_size * (not model.tie_embeddings))
    # summed as they are held: over `fsdp` too under ZeRO-3
    shards = layout.mesh.tensor * (layout.mesh.fsdp if layout.mesh.zero_stage >= 3 else 1)
    add("pipeline", "all-reduce", "fp32 gradients of the replicated embedding, norm and output",
        outside * F32_BYTES / shards, 1, True)


def _lockstep(s: StepShape) -> pipeline_lib.Lockstep:
    name, v = s.layout.schedule
    return pipeline_lib.lockstep(name, s.layout.pipeline, s.m, v)



def _pipelined_head_gathers(s: StepShape, prog: pipeline_lib.Lockstep, gather: int, add: Add) -> None:
    """fsdp collectives of the embedding and the logits under ZeRO-3 in a pipelined step, as the
    compiled program runs them (measured on pipeline=2 with fsdp 2 and 4, tensor 1 and 2, sequence
    parallel or not, 1f1b and zero_bubble): the executor gathers the embedding table once, before
    the first tick (its loss reads it again when tied); the logits matrix is loop-invariant, so XLA
    hoists its gather out of each segment's scan over ticks: once per segment with the loss (its
    forward's and its backward's apart when the vocabulary is split over `tensor`). Each device sums
    the embedding gradient of its own rows of every micro-batch: `_pipelined_embedding_gradient`."""
    model, mesh = s.model, s.layout.mesh
    dt = DTYPE_NAMES[gather]
    table = model.vocab_size * model.d_model / mesh.tensor * gather
    heads = sum(1 for g in prog.segments if g.head)
    logits = 0 if model.tie_embeddings else heads * (2 if mesh.tensor > 1 else 1)
    add("fsdp", "all-gather", f"{dt} embedding table, once before the ticks", table,
        1 + (heads if model.tie_embeddings else 0), True)
    add("fsdp", "all-gather", f"{dt} logits matrix, once per segment with the loss", table, logits, True)


def _pipelined_embedding_gradient(s: StepShape, add: Add) -> None:
    """Each device of a pipelined step sums the embedding gradient of its own rows of every
    micro-batch (`units.Device.embedding_grad`) in float32; the fsdp row groups' sums are
    all-reduced once, after the last tick, whatever `fsdp_regather` (with `fsdp_grad_reduce=once`
    the replica groups' one reduction carries them; context replica groups add theirs before)."""
    model, mesh = s.model, s.layout.mesh
    if mesh.fsdp_grad_reduce != "once":
        table = model.vocab_size * model.d_model / mesh.tensor * F32_BYTES
        add("fsdp", "all-reduce", "fp32 embedding table gradient of the fsdp row groups, once per step", table, 1, True)
        if s.context_replicas and mesh.fsdp > 1:  # measured on pipeline=2 context=2 fsdp=2: context's groups
            # add theirs first (with fsdp=1 the step's one reduction carries them)
            add("context", "all-reduce", "fp32 embedding table gradient of the context groups (1/fsdp), once per step",
                table / mesh.fsdp, 1, True)


def _collective_matmul(s: StepShape, add: Add, forwards: float, backwards: float) -> bool:
    """`mesh.tensor_overlap=collective_matmul` (`parallel/collective_matmul.py`): per layer forward
    the gathers before Q/K/V and gate/up and the scatters after O and down, each n - 1 ring steps
    of 1/n of a row; per layer backward their four mirrors and the two inputs gathered again for
    the weight gradients (each device keeps its 1/n, as without the option). A backward that
    recomputes its projections (remat) runs three of the forward's four again instead (the down
    projection's scatter feeds only the layer's output, which the backward does not read), whose
    gathers XLA shares with the weight gradients' (measured, remat full: 11 per layer, 10 with
    remat none). Each step runs under a partial matmul of its projection (`overlapped`:
    `predict.exposed_seconds` hides them under those matmuls). `forwards`/`backwards`: layer
    forwards and backwards per step. False (nothing added) when the option is off."""
    mesh = s.layout.mesh
    if mesh.tensor_overlap != "collective_matmul" or not mesh.sequence_parallel or mesh.tensor == 1:
        return False
    n, again = mesh.tensor, 3 if s.redo or s.redo_outputs else 2
    add("tensor", "send/recv", f"activations, collective matmul: 4/layer forward, {4 + again}/layer backward"
        f" ({'3 recomputed' if again == 3 else '2 gathered again'}), {n - 1} steps of 1/{n} of a row each", s.row / n,
        (4 * forwards + (4 + again) * backwards) * (n - 1), True)
    return True


def _pipelined_tensor(s: StepShape, add: Add) -> None:
    """tensor in a pipelined step, as the compiled program runs it (measured on pipeline=2 fsdp=2
    tensor=2, m=4: 1f1b with and without sequence parallelism, zero_bubble with it): every tick runs its
    chunk's layers, fill and drain included, so the per-layer collectives count executed ticks, not
    micro-batches. Per layer, a forward reduces its two row-parallel outputs and a backward the input
    gradients of the five column-parallel projections (+1 when it recomputes them, remat full: measured). Under sequence
    parallelism each reduction is a reduce-scatter and a layer gathers two norm outputs per forward
    and two cotangents per backward (+2 when the backward recomputes, or gathers its stashed own
    rows of the norm outputs again: `memory.regathered_inputs`); every backward tick gathers the embedding gradient's
    rows and ids (split over tokens by tensor, the table over the vocabulary: `executor`), every
    loss tick its 1/P of the final norm's output, a split backward's W unit two stashed rows per
    layer (zero_bubble, measured), and the vocab table is gathered twice (three times when split).
    Without it, all-reduces: the same per-layer counts, and per loss tick the head's input
    gradient (a full [tokens, D] row) and its 1/P share; once, the embedding lookup's."""
    model, prog = s.model, _lockstep(s)
    ticks, chunk = unit_ticks(prog), s.layers / prog.virtual
    regather, rereduce = (2, 1) if s.redo else (s.redo_inputs, s.redo_outputs)  # a backward that recomputes
    # ... or gathers the layer's own rows of its two norm outputs again (`memory.regathered_inputs`:
    # remat none; measured on pipeline=2 x fsdp=2 x tensor=2, 1f1b, m=4: +2 rows per layer of each
    # backward tick, the stash holding the local rows)
    regather += 2 if regathered_inputs(model, s.layout, s.remat) else 0
    reduces = chunk * (2 * ticks["forward"] + (5 + rereduce) * ticks["backward"])
    share = s.row / prog.stages  # a loss tick's tokens
    overlapped = _collective_matmul(s, add, chunk * ticks["forward"], chunk * ticks["backward"])
    if s.layout.mesh.sequence_parallel:
        gathers = chunk * (2 * ticks["forward"] + (2 + regather) * ticks["backward"])
        ids = s.row * 4 / (model.d_model * s.c)
        if not overlapped:
            add("tensor", "all-gather", f"activations, 2/layer forward, {2 + regather}/layer backward (sequence parallel)",
                s.row, gathers, False)
        add("tensor", "all-gather", "embedding gradient rows and ids, per backward tick", s.row + ids,
            ticks["backward"], False)
        add("tensor", "all-gather", "final norm output of a loss tick's tokens", share, ticks["head"], False)
        if prog.split:
            add("tensor", "all-gather", "a W unit's stashed rows, 2/layer", s.row, chunk * 2 * ticks["weight"], False)
        add("tensor", "all-gather", "vocab table (sequence parallel; hoisted)", model.vocab_size * model.d_model * s.c,
            3 if prog.split else 2, False)
        if not overlapped:
            add("tensor", "reduce-scatter", "activations, 2/layer forward, 5/layer backward (sequence parallel)",
                s.row, reduces, False)
        add("tensor", "reduce-scatter", "a loss tick's input gradient", share, ticks["head"], False)
    else:
        add("tensor", "all-reduce", "activations, 2/layer forward, 5/layer backward", s.row, reduces, False)
        add("tensor", "all-reduce", "a loss tick's input gradient, its tokens and the full row", s.row + share,
            ticks["head"], False)
        add("tensor", "all-reduce", "the embedding lookup", s.row, 1, False)


@counts_collectives
def _expert(s: StepShape, add: Add) -> None:
    """expert (model.moe): each MoE layer sends its token rows to the experts' devices and back in
    the forward, their cotangents both ways in the backward (and the forward's again when the
    backward recomputes the layer): `plan.moe.all_to_alls` (gpu: the routed rows, balanced
    routing assumed; cpu: the padded exchange's buffers). The batch is split over `expert` too, so
    the gradients of the weights outside the experts are all-reduced over it, every micro-batch.
    Under a pipeline (measured, pipeline=2 expert=2): each tick's units exchange their MoE layers'
    rows, half of the calls in forward ticks and half in backward ticks (fill and drain included);
    each unit all-reduces the gradients it makes outside the experts in its tick
    (`_pipelined_gradients`), and the embedding gradient, summed per device, once."""
    model, layout = s.model, s.layout
    if not model.moe.enabled:
        return
    layers = moe_plan.moe_layers(model, layout)
    units = s.m
    if layout.pipeline > 1:
        ticks = unit_ticks(_lockstep(s))
        units = (ticks["forward"] + ticks["backward"]) / 2 / layout.schedule[1]
    for what, payload, calls in moe_plan.all_to_alls(model, layout, s.tokens, s.moe_backend, s.redo):
        add("expert", "all-to-all", f"{what}, {calls}/MoE layer", payload, units * layers * calls, False)
    counts = flops.param_counts(model)
    if layout.pipeline == 1:
        add("expert", "all-reduce", "fp32 gradients outside the experts",
            s.grads * (1 - counts["experts"] / counts["total"]), s.m, True)
        return
    mesh = layout.mesh
    weights = s.weights
    experts = counts["experts"] / layout.pipeline / mesh.expert / mesh.tensor * F32_BYTES
    _pipelined_gradients(s, add, weights - experts, F32_BYTES, "expert", "all-reduce", experts=False,
                         shards=_fsdp_shards(mesh))
    add("expert", "all-reduce", "fp32 embedding table gradient of the expert row groups, once per step",
        model.vocab_size * model.d_model / mesh.tensor * F32_BYTES, 1, True)
