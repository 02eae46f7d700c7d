"""A plan for one layout (bytes, FLOPs, collectives, step time, verdict) and the search over layouts."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Any, Callable

from lumen_jax.metrics import flops
from lumen_jax.config import REMAT_SAVES, Config, ConfigError, MeshConfig, ModelConfig
from lumen_jax.config.checks import validate
from lumen_jax.parallel.pipeline import schedule as pipeline_lib
from lumen_jax.plan.collectives import Collective, collectives
from lumen_jax.plan.cost import planned_flops_per_token, planned_score_fraction
from lumen_jax.plan.efficiency import Compute, Efficiency, Overlap, compute_seconds
from lumen_jax.plan.hardware import Hardware, Layout, first_layers, first_split, uneven_split
from lumen_jax.plan.memory import (Activations, activation_bytes, communication_bytes, fp8_bytes, split_backward,
                                   state_bytes)
from lumen_jax.plan.residuals import recomputes


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything `python -m lumen_jax.plan` reports for one layout."""

    layout: Layout
    remat: str
    micro_batch: int  # sequences per device per micro-batch
    attention: str
    state: dict[str, int]  # params, grads, optimizer
    fp8: float  # fp8 scaling state (amax histories, scales)
    activations: Activations
    device_memory_bytes: float
    usable_memory_bytes: float
    flops_per_token: float  # model FLOPs (6N + causal attention), the MFU numerator
    hardware_flops_per_token: float  # + the remat recompute
    tokens_per_step: int
    collectives: tuple[Collective, ...]
    exposed: tuple[float, ...]  # per collective, the seconds that do not hide under compute
    bubble: float
    compute_s: float
    step_time_s: float
    peak_flops: float
    compute: Compute | None = None  # by part; None with one --efficiency for every matmul

    @property
    def bytes_per_device(self) -> dict[str, float]:
        b = {**self.state, "activations": self.activations.total, "fp8": self.fp8}
        return {**b, "total": sum(b.values())}

    @property
    def fits(self) -> bool:
        return self.bytes_per_device["total"] <= self.usable_memory_bytes

    @property
    def flops_per_step(self) -> float:
        return self.flops_per_token * self.tokens_per_step

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time_s

    @property
    def mfu(self) -> float:
        return self.flops_per_step / (self.step_time_s * self.layout.num_devices * self.peak_flops)

    @property
    def exposed_comm_s(self) -> float:
        return sum(self.exposed)

    @property
    def overlapped_comm_s(self) -> float:
        return sum(c.seconds for c in self.collectives) - self.exposed_comm_s

    def exposed_by_axis(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for c, e in zip(self.collectives, self.exposed):
            out[c.axis] = out.get(c.axis, 0.0) + e
        return out

    def verdict(self) -> str:
        b, gb = self.bytes_per_device, lambda x: f"{x / 1e9:.1f} GB"
        budget = f"{gb(self.usable_memory_bytes)} usable of {gb(self.device_memory_bytes)}"
        if self.fits:
            return f"fits: {gb(b['total'])} per device, {budget}"
        state = b["params"] + b["grads"] + b["optimizer"]
        if state >= b["activations"]:
            why = (f"parameters + gradients + optimizer state take {gb(state)}: shard them further "
                   "(mesh.zero_stage=3 with a larger mesh.fsdp, mesh.tensor, or --pipeline)")
        else:
            a, lay = self.activations, self.layout
            fixes = [fix for fix, useful in (
                ("model.remat=full", self.remat not in ("full", "save_attention_out")),
                ("fewer sequences per micro-batch (raise train.micro_batches)", self.micro_batch > 1),
                ("mesh.tensor with mesh.sequence_parallel=true", not lay.mesh.sequence_parallel),
                ("flash attention (--attention flash shows its effect)",
                 self.attention == "xla" and a.working > a.saved),
                ("--pipeline", True)) if useful]
            why = (f"activations take {gb(b['activations'])} (saved {gb(a.saved)}, working {gb(a.working)} "
                   f"in the {a.phase}); try {', '.join(fixes)}")
        return f"does not fit: {gb(b['total'])} per device > {budget}; {why}"

    def to_json(self) -> dict[str, Any]:
        return {
            "layout": dataclasses.asdict(self.layout), "num_devices": self.layout.num_devices,
            "remat": self.remat, "micro_batch": self.micro_batch, "attention": self.attention,
            "bytes_per_device": self.bytes_per_device,
            "activations": {**dataclasses.asdict(self.activations), "total": self.activations.total},
            "device_memory_bytes": self.device_memory_bytes, "usable_memory_bytes": self.usable_memory_bytes,
            "fits": self.fits, "verdict": self.verdict(),
            "flops_per_token": self.flops_per_token, "hardware_flops_per_token": self.hardware_flops_per_token,
            "tokens_per_step": self.tokens_per_step, "flops_per_step": self.flops_per_step,
            "communication": [{**dataclasses.asdict(c), "wire_bytes": c.wire_bytes, "seconds": c.seconds,
                               "exposed_s": e} for c, e in zip(self.collectives, self.exposed)],
            "pipeline_bubble": self.bubble, "compute_s": self.compute_s,
            "exposed_comm_s": self.exposed_comm_s, "overlapped_comm_s": self.overlapped_comm_s,
            "predicted_step_time_s": self.step_time_s, "predicted_tokens_per_s": self.tokens_per_s,
            "predicted_mfu": self.mfu, "peak_flops_per_device": self.peak_flops,
        }


def planned_attention(attention: str, model: ModelConfig, context: int = 1, hopper: bool = True) -> str:
    """The attention a GPU runs for `model.attention` (or `Ops.attention`): `xla` (S x S scores in
    memory), `flash` (our kernel) or `cudnn`, as `ops.choice` picks it for the trainer's packed
    rows: `auto` is cudnn where cuDNN takes the case (bfloat16/float16, a head dim that is a
    multiple of 8 up to 256, a `hopper` (sm_90) or later GPU for the packed layout) and no context
    parallelism (there `auto` keeps our kernel until cuDNN's chunk-pair path has run on a GPU), else
    flash; an explicit cudnn runs cuDNN on the chunk pairs under context parallelism too."""
    if attention not in ("auto", "cudnn"):
        return "flash" if attention == "flash" else "xla"
    head_dim = model.resolved_head_dim
    takes = attention == "cudnn" or (hopper and model.compute_dtype in ("bfloat16", "float16")
                                     and head_dim % 8 == 0 and head_dim <= 256)
    return "cudnn" if takes and (context == 1 or attention == "cudnn") else "flash"


def _hopper(hw: Hardware) -> bool:
    """Whether cuDNN's packed layout runs on `hw`: of the planner's devices, all but the A100."""
    return "A100" not in hw.kind


def _scores(kernel: str) -> str:
    """The memory and FLOP side's attention: `xla` keeps scores; ours and cuDNN's kernels do not
    and keep the same residuals (the output and its log-sum-exp): both plan as `flash`."""
    return "xla" if kernel == "xla" else "flash"


MEMORY_FRACTION = 0.94  # of device memory the allocator can hand out (docs/PLANNING.md, "Headroom")


def _windows(compute: Compute, m: int) -> dict[str, float]:
    """The compute each kind of collective can run under: weight gathers the whole step (prefetched
    a layer ahead), gradient reductions the backward (the once-per-step sums the last micro-batch's
    backward), the tensor and expert axes the matmuls, the ring the attention."""
    backward = compute.total_s * compute.backward_share
    return {"gather": compute.total_s, "reduce": backward, "step": backward / m, "tensor": compute.matmul_s,
            "expert": compute.matmul_s, "context": compute.attention_s, "pipeline": compute.total_s,
            "pipeline_beside": compute.total_s}


def _window_of(c: Collective) -> str:
    axis = c.axis.split("+")[0]
    if axis == "tensor" and c.overlapped:  # collective matmul's steps (`collectives._collective_matmul`)
        return "collective_matmul"
    if axis == "pipeline" and c.kind == "send/recv" and c.overlapped:  # beside a unit of its tick (`schedule.sends`)
        return "pipeline_beside"
    if axis in ("tensor", "context") or (axis in ("expert", "pipeline") and not c.overlapped):
        return axis
    if c.kind == "all-gather":
        return "gather"
    return "step" if c.calls == 1 else "reduce"  # a reduction once per step runs behind one backward


def exposed_seconds(comms: tuple[Collective, ...], compute: Compute, m: int, overlap: Overlap) -> tuple[float, ...]:
    """Per collective, the seconds the step waits for it: the collectives of one axis that share a
    window of compute (`_windows`) hide `overlap.of(axis)` of min(their transfer, the window); the
    rest shows. A collective the program cannot overlap (`Collective.overlapped` false: the
    all-gather attention's K/V) is all exposed; the tensor, pipeline and expert axes' collectives
    hide as far as `overlap` says (0 for our program's tensor axis), except collective matmul's
    steps (`mesh.tensor_overlap`), which hide under (tensor-1)/tensor of the matmuls, and the
    pipeline sends our program runs beside a unit of their tick (`schedule.sends`), which hide whole
    up to the step's compute (a tick's unit outlasts its send by far: on Llama 3's 405B layout a chunk's
    forward of 4 layers on 8k tokens against one 34 MB send)."""
    windows = _windows(compute, m)
    # collective matmul: n - 1 of a projection's n partial matmuls have a step's transfer beside
    # them (a gather's last dot and a scatter's first have none), so its steps hide, whole, under
    # (n - 1)/n of the matmuls, whatever `overlap.tensor` says of the recipes' programs
    steps = [c for c in comms if _window_of(c) == "collective_matmul"]
    windows["collective_matmul"] = compute.matmul_s * (1 - 1 / steps[0].size) if steps else 0.0
    keys = [(_window_of(c), c.axis.split("+")[0]) for c in comms]
    groups: dict[tuple[str, str], float] = {}
    for c, key in zip(comms, keys):
        groups[key] = groups.get(key, 0.0) + c.seconds
    out = []
    for c, key in zip(comms, keys):
        share = (1.0 if key[0] in ("collective_matmul", "pipeline_beside") else
                 overlap.of(key[1]) if c.overlapped or key[1] in ("tensor", "pipeline", "expert") else 0.0)
        total = groups[key]
        hidden = share * min(total, windows[key[0]])
        out.append(c.seconds * (1 - hidden / total) if total else 0.0)
    return tuple(out)


def predict(cfg: Config, layout: Layout, hw: Hardware, *, remat: str | None = None,
            attention: str | None = None, efficiency: float | None = None, memory_fraction: float = MEMORY_FRACTION,
            terms: Efficiency = Efficiency(), overlap: Overlap = Overlap(), moe_backend: str = "gpu",
            context_grads: str = "per_unit", kernel_kept: bool = True, loss: str = "chunked",
            kernel: str | None = None) -> Plan:
    """Bytes, FLOPs, collectives and a step time for `cfg` on `layout`. `moe_backend`: the MoE
    dispatch's exchange and grouped matmuls as on GPU or as XLA:CPU compiles them (`plan.moe`);
    `context_grads`: the gradients' reduction over context as our step runs it, or "once" per step
    (`collectives.StepShape.context_grads`); `kernel_kept`: the remat policy keeps the flash
    kernel's output and log-sum-exp, so the backward runs no attention forward again (our flash
    kernel, every policy but full; cuDNN's runs its forward again under every policy but none); False plans the forward run again under a policy that saves no scores (the
    published recipes' programs, as the calibration assumes); `loss`: `chunked` (ours) or `float32`
    (the whole [tokens, vocab] logits in float32: our program as measured on 2026-12-04,
    `plan.measured.STEPS`). `attention` (default `model.attention`) as `planned_attention` resolves
    it: a fused kernel runs at its measured rates (`plan.measured.kernel_rates`); `kernel` names
    the fused kernel instead (a published program's: cudnn under context parallelism too).

    Step time = compute + the communication that does not hide under it (`exposed_seconds`, per
    axis: `overlap`), stretched by the pipeline bubble (`_stretch`: zero_bubble's B and W ticks at
    their units' cost; `Plan.bubble` stays the trainer's `pipeline_bubble`, every unit one forward). Compute is each GEMM's time by its shape,
    the attention core's and the memory-bound work's (`efficiency.compute_seconds` with `terms`);
    with `efficiency` (a fraction of the datasheet peak) every FLOP runs at that one rate instead.
    """
    model, seq = cfg.model, cfg.data.seq_len
    remat = model.remat if remat is None else remat
    chosen = planned_attention(model.attention if attention is None else attention, model, layout.mesh.context,
                               _hopper(hw))
    kernel = kernel if kernel and chosen != "xla" else chosen
    attention = _scores(kernel)
    micro_batch, state, fp8, activations = _memory(cfg, layout, remat, attention, moe_backend)
    tokens = cfg.data.global_batch_size * seq
    peak = hw.peak(model.compute_dtype)
    # Under context parallelism the step waits for the busiest device's share of the score square;
    # a sliding window leaves its share of it.
    fraction = planned_score_fraction(model, layout.mesh, seq, attention)
    redo_as = attention if kernel_kept else "xla"  # the reference attention keeps no kernel residuals
    redo = recomputes(remat, layout.mesh.context, layout.mesh.context_parallel, redo_as)
    if kernel == "cudnn" and kernel_kept and remat != "none" and layout.mesh.context == 1:
        # Our cuDNN call's residuals are out of reach of the remat names (ops/cudnn.py); a published
        # program's are not, nor the context ring's (its custom VJP keeps the merged o and lse).
        redo = {**redo, "attention": True}
    hw_per_token = planned_flops_per_token(model, layout, seq, remat, score_fraction=fraction, redo=redo)
    comms = tuple(collectives(model, layout, hw, seq, micro_batch, remat, moe_backend, context_grads))
    if efficiency is None:
        update = 2 * state["params"] + state["grads"] + 2 * state["optimizer"]  # read and write, the gradient read
        parts = compute_seconds(model, layout, seq, micro_batch, redo, attention, hw, terms, score_fraction=fraction,
                                kernel=kernel, loss=loss, update_bytes=update)
    else:  # one rate for every FLOP; the backward is 2/3 of them
        total = hw_per_token * tokens / layout.num_devices / (peak * efficiency)
        parts = Compute(matmul_s=total, attention_s=0.0, elementwise_s=0.0, backward_share=2 / 3)
    compute_s = parts.total_s
    exposed = exposed_seconds(comms, parts, layout.micro_batches, overlap)
    busy = compute_s + sum(exposed)
    bubble = _bubble(layout)
    stretch = _stretch(model, layout, parts, hw_per_token)
    return Plan(layout=layout, remat=remat, micro_batch=micro_batch, attention=kernel,
                state=state, fp8=fp8, activations=activations,
                device_memory_bytes=hw.memory_bytes, usable_memory_bytes=hw.memory_bytes * memory_fraction,
                flops_per_token=flops.flops_per_token(model, seq), hardware_flops_per_token=hw_per_token,
                tokens_per_step=tokens, collectives=comms, exposed=exposed, bubble=bubble, compute_s=compute_s,
                step_time_s=busy * stretch, peak_flops=peak, compute=parts if efficiency is None else None)


def _memory(cfg: Config, layout: Layout, remat: str, attention: str,
            moe_backend: str) -> tuple[int, dict[str, float], float, Activations]:
    """`predict`'s memory side: (sequences per device per micro-batch, the state and communication
    buffers, the fp8 scaling state, the activations), per device."""
    micro_batch, state, fp8 = _fixed_memory(cfg.model, layout, cfg.data.seq_len, cfg.data.global_batch_size)
    return (micro_batch, dict(state), fp8,
            activation_bytes(cfg.model, layout, cfg.data.seq_len, micro_batch, remat, attention, moe_backend))


@functools.lru_cache(maxsize=16)  # the search asks it for one layout under every remat policy in a row
def _fixed_memory(model: ModelConfig, layout: Layout, seq_len: int,
                  global_batch: int) -> tuple[int, tuple[tuple[str, float], ...], float]:
    """`_memory`'s part that no remat policy moves: (sequences per device per micro-batch, the state
    and communication buffers as (name, bytes) pairs, the fp8 scaling state)."""
    micro_batch = global_batch // (layout.mesh.data * layout.mesh.fsdp * layout.mesh.expert * layout.micro_batches)
    state = {**state_bytes(model, layout), **communication_bytes(model, layout)}
    return micro_batch, tuple(state.items()), fp8_bytes(model, layout, micro_batch * seq_len / layout.mesh.context)


def _fits(cfg: Config, layout: Layout, hw: Hardware, remat: str, attention: str | None = None,
          memory_fraction: float = MEMORY_FRACTION, moe_backend: str = "gpu", **_: Any) -> bool:
    """Whether `predict(cfg, layout, hw, remat=remat, ...)` would fit (its `Plan.fits`), from the
    memory side alone: the search skips the time of the nine in ten candidates that do not."""
    attention = _scores(planned_attention(cfg.model.attention if attention is None else attention, cfg.model,
                                          layout.mesh.context, _hopper(hw)))
    _, state, fp8, activations = _memory(cfg, layout, remat, attention, moe_backend)
    return sum(state.values()) + activations.total + fp8 <= hw.memory_bytes * memory_fraction


def _may_fit(cfg: Config, layout: Layout, hw: Hardware, memory_fraction: float = MEMORY_FRACTION,
             **_: Any) -> bool:
    """False where `_fits` is false under every remat policy: the state, the communication buffers and
    the fp8 state alone exceed the budget (activations add bytes, never take them: floating-point
    sums grow with their terms). The search skips two in three layouts of Llama 3 405B this way."""
    _, state, fp8 = _fixed_memory(cfg.model, layout, cfg.data.seq_len, cfg.data.global_batch_size)
    return sum(n for _, n in state) + fp8 <= hw.memory_bytes * memory_fraction


# the selective two recompute the MLP's up (save_dot_except_mlpwi_1) or gate and up (save_dot_except_mlpwi):
# between dots_with_no_batch_dims_saveable and full in bytes and in time (`search_remats`)
SEARCH_REMATS = ("none", "dots_saveable", "dots_with_no_batch_dims_saveable", "save_dot_except_mlpwi_1",
                 "save_dot_except_mlpwi", "full")
SEARCH_DEPTHS = (1, 2, 4, 8, 16)  # pipeline stages --search tries when the config and --pipeline set none
REDUCE_DTYPES = ("float32", "bfloat16")  # mesh.reduce_dtype, tried wherever gradients cross devices
SEARCH_VIRTUAL = (2, 4, 8)  # interleaved virtual stages --search tries (each chunk at least one layer or MoE group)
ZERO_STAGES = (1, 2, 3)  # mesh.zero_stage, which `settings` tries over fsdp
COMM_OPTIONS = {"fsdp_grad_reduce": ("every_micro_batch", "once"), "fsdp_regather": ("per_micro_batch", "per_step")}


def search_remats(model: ModelConfig) -> tuple[str, ...]:
    """`SEARCH_REMATS` that `model` takes: without the selective ones (`config.REMAT_SAVES`) where
    latent attention or MoE layers name no projections (`config.checks` refuses them)."""
    return tuple(r for r in SEARCH_REMATS if r not in REMAT_SAVES or not (model.mla or model.moe.enabled))


def _divisors(n: int) -> list[int]:
    """The divisors of `n`, ascending (pairs up to sqrt(n): 2**40 devices take a second, not hours)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _bubble(layout: Layout) -> float:
    """The fill and drain's share of the lock-step program the trainer runs (`Layout.schedule`), as
    its `pipeline_bubble` metric reports it (parallel/pipeline/schedule.py)."""
    if layout.pipeline == 1:
        return 0.0
    name, v = layout.schedule
    return pipeline_lib.lockstep_bubble(name, layout.pipeline, layout.micro_batches, v)


def _stretch(model: ModelConfig, layout: Layout, parts: Compute, hw_per_token: float) -> float:
    """The step's busy time stretched by the lock-step program: 1 / (1 - bubble), where a tick lasts
    as long as the units it runs. `Lockstep.bubble` counts each unit (F, B, W) as one forward; a
    split backward's B and W are not (with remat B recomputes the forward, the attention core's
    backward is all B's, W is one pass of the tapped projections' GEMMs), so for zero_bubble each
    segment's ticks cost their units' shares of the step's compute: the forward 1 - backward_share,
    W the tapped projections' weight-gradient FLOPs, B the rest of the backward."""
    if layout.pipeline == 1:
        return 1.0
    name, v = layout.schedule
    prog = pipeline_lib.lockstep(name, layout.pipeline, layout.micro_batches, v)
    if not prog.split:
        return 1 / (1 - prog.bubble())
    w = split_backward(model).flops * model.num_layers / hw_per_token
    f, b = 1 - parts.backward_share, parts.backward_share - w
    executed = sum((g.stop - g.start) * (f * g.forward + b * g.backward + w * g.weight) for g in prog.segments)
    return executed / (prog.micro_batches * prog.virtual)


def _schedules(model: ModelConfig, mesh: MeshConfig, stages: int, micro_batches: int) -> list[MeshConfig]:
    """`mesh` with each pipeline schedule that can run `stages` x `micro_batches` (interleaved with
    each V of `SEARCH_VIRTUAL` that leaves every chunk a layer: the bubble falls as (P-1)/(V m),
    the stash holds chunks of L/(P V) layers); layers that do not divide into the stages get `uneven_split`'s `mesh.pipeline_layers`;
    `mesh` alone without a pipeline."""
    if stages == 1:
        return [mesh]
    group = model.moe.every_n_layers if model.moe.enabled else 1
    out = []
    kinds = [("gpipe", 1), ("1f1b", 1), *(("interleaved", v) for v in SEARCH_VIRTUAL), ("zero_bubble", 1)]
    for name, v in kinds:
        if model.num_layers // group < stages * v or pipeline_lib.check_shape(name, stages, micro_batches, v):
            continue
        first = first_layers(model)  # placed on the first stages: every stage computes slots of them
        split = (first_split(model.num_layers, stages * v, first, group) if first
                 else () if model.num_layers % (stages * v * group) == 0
                 else uneven_split(model.num_layers, stages * v, group))
        out.append(dataclasses.replace(mesh, pipeline=stages, pipeline_schedule=name, pipeline_virtual_stages=v,
                                       pipeline_layers=split))
    return out


def search(cfg: Config, num_devices: int, hw: Hardware, *, pipeline: int = 1, top: int = 5,
           on_plan: Callable[[int], Any] | None = None, **predict_kwargs: Any) -> list[Plan]:
    """The `top` fitting (mesh x remat x micro-batch) candidates, best predicted MFU first; `on_plan(1)`
    is called after each candidate is planned (a progress bar).

    Tries tensor sizes that fit in a node and divide the heads, kv heads, ffn and vocab; context
    sizes that divide the sequence; every fsdp x data split of the rest; sequence parallelism on
    and off; the remat policies in `SEARCH_REMATS`; and per-device micro-batches of 1, 2, 4, ...
    sequences (with sequence parallelism, `mesh.tensor_overlap` as the config has it, except under
    zero_bubble, which refuses it); over fsdp, (ZeRO-3) `mesh.fsdp_regather` both ways and, with several micro-batches,
    `mesh.fsdp_grad_reduce` both ways; the pipeline depths of `SEARCH_DEPTHS` that divide the devices (uneven
    stages where they do not divide the layers: `hardware.uneven_split`) (or the
    one given: `pipeline`, else `mesh.pipeline`), each with every schedule that can run it
    (`_schedules`: its bubble and stash from its table); a candidate that does not fit with float32
    gradient sums is tried with bfloat16 ones (`_bf16_reductions`); then, for the `top` leaders, `mesh.reduce_dtype`
    the other way (`REDUCE_DTYPES`: it changes only the gradient bytes). The ZeRO stage and `mesh.expert`
    stay as given.
    """
    m = cfg.model
    pipeline = pipeline if pipeline > 1 else cfg.mesh.pipeline
    depths = [pipeline] if pipeline > 1 else [p for p in SEARCH_DEPTHS if num_devices % p == 0
                                              and m.num_layers >= p]  # uneven stages where p does not divide
    rank = lambda p: (-round(p.mfu, 4), p.bytes_per_device["total"])  # noqa: E731
    found, leaders = [], []
    for depth in depths:
        at_depth = sorted(_search_depth(cfg, num_devices, hw, depth, on_plan, **predict_kwargs), key=rank)
        found += at_depth
        leaders += at_depth[:top]  # each depth's own: another depth's leaders must not hide them
    # mesh.reduce_dtype changes only the gradient bytes: the other way tried on the leaders, each kept as
    # its own candidate (a float32 plan ranks below its bfloat16 twin, so the top holds it only beside it)
    for plan in leaders:
        for dtype in REDUCE_DTYPES:
            mesh = plan.layout.mesh
            if dtype != mesh.reduce_dtype and mesh.data * mesh.fsdp * mesh.pipeline > 1:
                layout = dataclasses.replace(plan.layout, mesh=dataclasses.replace(mesh, reduce_dtype=dtype))
                other = predict(cfg, layout, hw, remat=plan.remat, **predict_kwargs)
                if other.fits:
                    found.append(other)
    found.sort(key=rank)
    return found[:top]


def _search_depth(cfg: Config, num_devices: int, hw: Hardware, pipeline: int,
                  on_plan: Callable[[int], Any] | None, **predict_kwargs: Any) -> list[Plan]:
    m, seq, batch = cfg.model, cfg.data.seq_len, cfg.data.global_batch_size
    ep = max(cfg.mesh.expert, 1)  # the expert axis splits the batch like data: in `rest`'s batch split
    per_stage = num_devices // pipeline // ep
    found = []
    for tp in _divisors(per_stage):
        if tp > hw.devices_per_node or any(x % tp for x in (m.num_heads, m.num_kv_heads, m.ffn_dim,
                                                            m.vocab_size)):
            continue
        for cp in _divisors(per_stage // tp):
            if seq % cp or cp > 16:
                continue
            rest = per_stage // (tp * cp)
            for fsdp in _divisors(rest):
                if m.d_model % fsdp or batch % (rest * ep):
                    continue
                for sp in ((False, True) if tp > 1 and seq % (cp * tp) == 0 else (False,)):
                    for mb in (2 ** i for i in range(12)):
                        if batch % (rest * ep * mb):
                            break
                        mesh = dataclasses.replace(cfg.mesh, data=rest // fsdp, fsdp=fsdp, context=cp,
                                                   tensor=tp, sequence_parallel=sp,
                                                   tensor_overlap=cfg.mesh.tensor_overlap if sp else "none")
                        accumulate = batch // (rest * ep * mb) > 1 and fsdp > 1
                        for reduce, regather in itertools.product(
                                COMM_OPTIONS["fsdp_grad_reduce"] if accumulate else (mesh.fsdp_grad_reduce,),
                                COMM_OPTIONS["fsdp_regather"] if fsdp > 1 and mesh.zero_stage == 3
                                else (mesh.fsdp_regather,)):
                            steps = batch // (rest * ep * mb)
                            comm = dataclasses.replace(mesh, fsdp_grad_reduce=reduce, fsdp_regather=regather)
                            for staged in _schedules(m, comm, pipeline, steps):
                                if staged.pipeline_schedule == "zero_bubble" and staged.pipeline > 1:
                                    staged = dataclasses.replace(staged, tensor_overlap="none")  # refused with it
                                layout = Layout(staged, pipeline=pipeline, micro_batches=steps)
                                # bfloat16 sums where gradients cross devices in float32: they rank
                                # at least as high (no slower, fewer bytes), so `search` tries float32
                                # on the leaders alone and still finds every plan of the top
                                tried = _bf16_reductions(layout) or layout
                                if not _may_fit(cfg, tried, hw, **predict_kwargs):
                                    continue  # under no remat policy
                                for remat in search_remats(m):
                                    if on_plan is not None:
                                        on_plan(1)
                                    if _fits(cfg, tried, hw, remat, **predict_kwargs):
                                        found.append(predict(cfg, tried, hw, remat=remat, **predict_kwargs))
    return found


def _bf16_reductions(layout: Layout) -> Layout | None:
    """`layout` with `mesh.reduce_dtype=bfloat16` where it sums gradients over devices in float32 (it
    halves the gradient sums' bytes, which can make a candidate fit: 405B on Llama 3's layout with
    V = 4 and a selective remat policy needs 75.3 GB in float32), else None."""
    mesh = layout.mesh
    if mesh.reduce_dtype == "bfloat16" or mesh.data * mesh.fsdp * mesh.pipeline == 1:
        return None
    return dataclasses.replace(layout, mesh=dataclasses.replace(mesh, reduce_dtype="bfloat16"))



def settings(cfg: Config, layout: Layout, hw: Hardware, *, top: int = 5, **predict_kwargs: Any) -> list[Plan]:
    """The `top` fitting settings of our program's own options on `layout`'s mesh, best first (as
    `search` ranks: MFU, then bytes; `--search-options`): the axes and the pipeline schedule stay;
    tried are the remat policies of `SEARCH_REMATS`, without a pipeline the micro-batch counts that
    split the device's sequences (`train.micro_batches`), over fsdp the ZeRO stages of
    `ZERO_STAGES`, `mesh.fsdp_grad_reduce` (with several micro-batches) and (ZeRO-3)
    `mesh.fsdp_regather` both ways, `mesh.reduce_dtype` both ways where gradients cross devices,
    and under context parallelism with `auto` attention cuDNN on the chunk pairs
    (`model.attention=cudnn`, which `auto` does not pick there) where cuDNN takes the model."""
    mesh = layout.mesh
    sequences = cfg.data.global_batch_size // (mesh.data * mesh.fsdp * mesh.expert)
    counts = [layout.micro_batches] if layout.pipeline > 1 else _divisors(sequences)
    asked = predict_kwargs.pop("attention", None) or cfg.model.attention
    kernels = [asked]
    if mesh.context > 1 and asked == "auto" and planned_attention(asked, cfg.model, 1, _hopper(hw)) == "cudnn":
        kernels.append("cudnn")
    found, taken = [], {}
    for m, remat, zero, reduce, regather, dtype, attention in itertools.product(
            counts, search_remats(cfg.model), ZERO_STAGES, COMM_OPTIONS["fsdp_grad_reduce"],
            COMM_OPTIONS["fsdp_regather"], REDUCE_DTYPES, kernels):
        if (zero != mesh.zero_stage and mesh.fsdp == 1) or \
                (reduce != mesh.fsdp_grad_reduce and (m == 1 or mesh.fsdp == 1)) or \
                (regather != mesh.fsdp_regather and (mesh.fsdp == 1 or zero < 3)) or \
                (dtype != mesh.reduce_dtype and mesh.data * mesh.fsdp * layout.pipeline == 1):
            continue
        tried = dataclasses.replace(layout, micro_batches=m, mesh=dataclasses.replace(
            mesh, zero_stage=zero, fsdp_grad_reduce=reduce, fsdp_regather=regather, reduce_dtype=dtype))
        c = cfg.replace(mesh=tried.mesh, train=dataclasses.replace(cfg.train, micro_batches=m))
        if _trainer_takes(c, tried, taken) and _fits(c, tried, hw, remat, attention=attention, **predict_kwargs):
            found.append(predict(c, tried, hw, remat=remat, attention=attention, **predict_kwargs))
    return sorted(found, key=lambda p: (-round(p.mfu, 4), p.bytes_per_device["total"]))[:top]


def _trainer_takes(cfg: Config, layout: Layout, taken: dict[tuple[MeshConfig, int], bool]) -> bool:
    """Whether the trainer's own checks (`config.checks.validate`) take `cfg` on `layout`'s devices, as
    `layout` runs it (its stages and the schedule it plans), so `settings` offers only what a user can
    launch; `taken` remembers each mesh and micro-batch count's answer (the remat policies share it)."""
    name, v = layout.schedule
    mesh = dataclasses.replace(layout.mesh, pipeline=layout.pipeline, pipeline_schedule=name,
                               pipeline_virtual_stages=v)
    key = (mesh, layout.micro_batches)
    if key not in taken:
        try:
            validate(cfg.replace(mesh=mesh), layout.num_devices)
            taken[key] = True
        except ConfigError:
            taken[key] = False
    return taken[key]


def best_setting(cfg: Config, layout: Layout, hw: Hardware, **predict_kwargs: Any) -> Plan:
    """Our program's best fitting setting of its options on `layout`'s mesh, as a user would pick it
    (`settings`' first); where nothing fits, the plan of `cfg` as given (its verdict says why)."""
    best = settings(cfg, layout, hw, top=1, **predict_kwargs)
    return best[0] if best else predict(cfg, layout, hw, **predict_kwargs)
