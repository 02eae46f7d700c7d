"""The planner against published runs (`published.TABLE`): predicted vs measured tokens/s per GPU,
and the statistics `python -m lumen_jax.plan --calibration` prints (docs/PLANNING.md, section 5)."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Iterable

from lumen_jax.config import Config, DataConfig, MeshConfig, ModelConfig, TrainConfig
from lumen_jax.metrics import flops
from lumen_jax.plan.efficiency import Efficiency, Overlap
from lumen_jax.plan.hardware import DEVICES, Hardware, Layout
from lumen_jax.plan.predict import Plan, best_setting, predict
from lumen_jax.plan import recipe_memory
from lumen_jax.plan.published import HARDWARE, TABLE, Published

# The overlap a published recipe reaches on its tensor axis when it decomposes the layer's
# collectives into its matmuls (Megatron's TP communication overlap, torchtitan's async TP) and on
# its pipeline axis when it sends under the next micro-batch: fitted (docs/PLANNING.md, section 5).
# Our program has neither (`Overlap().tensor` = `Overlap().pipeline` = 0) but for the collective matmul
# and the pipeline sends it runs beside a unit of their tick (`schedule.sends`), which hide whole.
RECIPE_OVERLAP = {"tensor": 0.31, "pipeline": 1.0}


def model_of(row: Published) -> ModelConfig:
    return ModelConfig(**row.model, remat=row.remat, attention="flash", compute_dtype="bfloat16")


def config_of(row: Published) -> Config:
    """A config of our program with the row's model, batch and sequence (the mesh is `layout_of`'s)."""
    return Config(model=model_of(row), data=DataConfig(seq_len=row.seq_len, global_batch_size=row.global_batch),
                  train=TrainConfig(micro_batches=row.micro_batches), mesh=MeshConfig(**{"fsdp": 1, **row.ours}),
                  name=row.name)


def layout_of(row: Published) -> Layout:
    mesh = MeshConfig(**{"fsdp": 1, **row.ours})
    layout = Layout(mesh, pipeline=mesh.pipeline, micro_batches=row.micro_batches)
    if layout.num_devices != row.gpus:
        raise ValueError(f"{row.name}: our mesh {layout.describe()} has {layout.num_devices} devices, not {row.gpus}")
    return layout


def hardware_of(row: Published, table: dict[str, dict] | None = None) -> Hardware:
    return dataclasses.replace(DEVICES["h100"], **(HARDWARE if table is None else table)[row.hardware])


def measured_tokens_per_gpu(row: Published) -> float:
    """The row's throughput in tokens/s per GPU (FLOP/s turned back with the source's convention)."""
    if row.unit == "tokens/s":
        return row.measured
    causal = {"6N+causal": True, "6N+full": False}[row.convention]
    return row.measured * 1e12 / flops.flops_per_token(model_of(row), row.seq_len, causal=causal)


def predict_row(row: Published, terms: Efficiency = Efficiency(), overlap: Overlap = Overlap(),
                recipe_overlap: dict[str, float] | None = None, hardware: dict[str, dict] | None = None,
                efficiency: float | None = None) -> Plan:
    """Our program's plan for the row's model, layout and hardware, with the recipe's overlap and its
    gradients' reduction over context (once per step: Megatron folds context into the data-parallel
    group, as our step does too, `collectives._context`) and its fused attention (cuDNN's: Transformer
    Engine, MaxText's cudnn_flash_te; torchtitan's SDPA taken as the same rate), the forward run again
    in the backward; `efficiency`: one fraction of the peak for every FLOP instead of `terms` (`predict`)."""
    recipe = dataclasses.replace(overlap, **(RECIPE_OVERLAP if recipe_overlap is None else recipe_overlap)) \
        if row.comm_overlap else overlap
    return predict(config_of(row), layout_of(row), hardware_of(row, hardware), attention="flash", terms=terms,
                   overlap=recipe, efficiency=efficiency, context_grads="once", kernel_kept=False, kernel="cudnn")


# A published run's device holds what its framework's allocator hands out: the capacity CUDA
# reports (an "80 GB" H100 has 80 GiB of HBM3: 81,559 MiB in nvidia-smi, of which ~0.5 GiB is the
# CUDA context) times the same 0.94 for the caching allocator's fragmentation as our program's
# `predict.MEMORY_FRACTION` (docs/PLANNING.md, section 5, "Memory of a recipe").
GIB = 2 ** 30
CUDA_CONTEXT_BYTES = 0.5 * GIB
RECIPE_MEMORY_FRACTION = 0.94


def recipe_usable_bytes(row: Published) -> float:
    """Bytes a recipe's allocator can hold on one of the row's devices: the nominal GB read as GiB
    (HBM stacks are sized in GiB), less the CUDA context, times `RECIPE_MEMORY_FRACTION`."""
    nominal = hardware_of(row).memory_bytes / 1e9 * GIB
    return (nominal - CUDA_CONTEXT_BYTES) * RECIPE_MEMORY_FRACTION


def recipe_memory_of(row: Published, plan: Plan) -> recipe_memory.RecipeMemory:
    """The memory of the program that ran the row, by term; MaxText's is our program's plan (a JAX
    program of the same structure: fp32 parameters, gradients and Adam sharded over its fsdp)."""
    if row.family == "maxtext":
        b = plan.bytes_per_device
        terms = {k: float(v) for k, v in b.items() if k != "total"}
        return recipe_memory.RecipeMemory("maxtext", "only", terms, {k: "as our program (plan.memory)" for k in terms})
    mesh = MeshConfig(**{"fsdp": 1, **row.ours})
    layout = recipe_memory.RecipeLayout.of(mesh, row.global_batch, row.micro_batches, row.seq_len)
    return recipe_memory.recipe_memory(row.family, model_of(row), layout, row.remat)


def plan_ours(row: Published, terms: Efficiency = Efficiency(), best: bool = True) -> Plan:
    """Our program as it runs, in the row's layout, model, batch and hardware: our overlap (none on
    pipeline; on tensor, under sequence parallelism, the collective matmul's steps hidden under the
    projections' matmuls, `mesh.tensor_overlap=collective_matmul`), our gradients' reduction over
    context, the attention `auto` picks on a GPU (cuDNN's, or our flash kernel under context
    parallelism) with its residuals kept; with `best`, the best fitting setting of our program's own
    options on the row's mesh (`predict.best_setting`: remat, micro-batches without a pipeline, the
    ZeRO stage, the fsdp gradient and gather options, the reduction dtype), else the row's remat,
    micro-batches and mesh options.
    "What would lumen_jax do here", beside what the row's own program did (`predict_row`)."""
    cfg, layout = config_of(row), layout_of(row)
    if cfg.mesh.sequence_parallel and cfg.mesh.tensor > 1:
        mesh = dataclasses.replace(cfg.mesh, tensor_overlap="collective_matmul")
        cfg, layout = cfg.replace(mesh=mesh), dataclasses.replace(layout, mesh=mesh)
    if best:
        return best_setting(cfg, layout, hardware_of(row), attention="auto", terms=terms)
    return predict(cfg, layout, hardware_of(row), attention="auto", terms=terms)


@dataclasses.dataclass(frozen=True)
class Row:
    published: Published
    plan: Plan  # the row's program, planned (throughput; memory at the recipe's recompute)
    measured: float  # tokens/s per GPU
    memory: recipe_memory.RecipeMemory  # the recipe's own memory, by term
    usable: float  # bytes its allocator can hold
    terms: Efficiency = Efficiency()  # the hardware terms `ours` is planned with

    @functools.cached_property
    def ours(self) -> Plan:
        """Our program in the row's layout, its best fitting setting (`plan_ours`); planned when read."""
        return plan_ours(self.published, self.terms)

    @functools.cached_property
    def ours_as_published(self) -> Plan:
        """Our program in the row's layout at the row's remat and micro-batches (`plan_ours(best=False)`)."""
        return plan_ours(self.published, self.terms, best=False)

    @property
    def fits(self) -> bool:
        """The recipe that ran fits in its prediction."""
        return self.memory.total <= self.usable

    @property
    def predicted(self) -> float:
        return self.plan.tokens_per_s / self.plan.layout.num_devices

    @property
    def ratio(self) -> float:
        return self.predicted / self.measured

    @property
    def ours_per_gpu(self) -> float:
        return self.ours.tokens_per_s / self.ours.layout.num_devices

    @property
    def ours_ratio(self) -> float:
        """Our program's planned tokens/s over the row's measured: >= 1 where we would be as fast."""
        return self.ours_per_gpu / self.measured

    @property
    def as_published_ratio(self) -> float:
        """`ours_ratio` at the row's remat and micro-batches (`ours_as_published`)."""
        return self.ours_as_published.tokens_per_s / self.ours_as_published.layout.num_devices / self.measured


def setting_of(plan: Plan) -> str:
    """The options `predict.best_setting` chooses, in one short cell: remat, micro-batches, the
    mesh options that differ from their defaults (ZeRO-3, every micro-batch, per micro-batch,
    float32), and cuDNN on the chunk pairs where context parallelism runs it (`auto` does not)."""
    mesh, defaults = plan.layout.mesh, MeshConfig()
    changed = [f"{k}={getattr(mesh, k)}" for k in ("zero_stage", "fsdp_grad_reduce", "fsdp_regather", "reduce_dtype")
               if getattr(mesh, k) != getattr(defaults, k)]
    changed += ["attention=cudnn"] * (mesh.context > 1 and plan.attention == "cudnn")
    return " ".join([plan.remat, f"m={plan.layout.micro_batches}", *changed])


def row_of(r: Published, **kwargs) -> Row:
    plan = predict_row(r, **kwargs)
    return Row(r, plan, measured_tokens_per_gpu(r), recipe_memory_of(r, plan), recipe_usable_bytes(r),
               kwargs.get("terms", Efficiency()))


def rows(table: Iterable[Published] = TABLE, **kwargs) -> list[Row]:
    return [row_of(r, **kwargs) for r in table]


def statistics(found: list[Row]) -> dict[str, float]:
    """`mean_ratio`: the geometric mean of predicted / measured; `typical_error`: exp of the mean
    |log ratio| (x1.15 = within 15% on a typical row); `worst`: the largest |log ratio| as a factor."""
    logs = [math.log(r.ratio) for r in found]
    return {"mean_ratio": math.exp(sum(logs) / len(logs)),
            "typical_error": math.exp(sum(abs(x) for x in logs) / len(logs)),
            "worst": math.exp(max(abs(x) for x in logs)), "rows": len(logs)}


def format_calibration(found: list[Row], source: str = "lumen_jax/plan/published.py") -> str:
    """The table `--calibration` prints: measured vs predicted tokens/s per GPU, the ratio, the
    recipe's predicted memory per device (its framework's, `recipe_memory`) against what its
    allocator can hold, whether it fits; then our program in the same layout (`plan_ours`): its
    tokens/s per GPU, that over the measured, its memory per device; and the statistics."""
    head = (f"{'run':42s}{'layout':36s}{'measured':>10s}{'predicted':>11s}{'ratio':>7s}{'recipe GB':>11s}"
            f"{'usable':>8s}  fits  {'ours':>8s}{'ours/meas':>10s}{'ours GB':>9s}  {'ours fits':9s} {'our setting':92s}"
            f"{'as pub.':>8s}{'GB':>7s}")
    lines = [head]
    for r in found:
        lines.append(f"{r.published.name:42s}{r.published.layout:36s}{r.measured:10,.0f}{r.predicted:11,.0f}"
                     f"{r.ratio:7.2f}{r.memory.total / 1e9:11.1f}{r.usable / 1e9:8.1f}  {'yes ' if r.fits else 'NO  '}"
                     f"{r.ours_per_gpu:8,.0f}{r.ours_ratio:10.2f}{r.ours.bytes_per_device['total'] / 1e9:9.1f}  "
                     f"{'yes' if r.ours.fits else 'NO':9s} {setting_of(r.ours):92s}{r.as_published_ratio:8.2f}"
                     f"{r.ours_as_published.bytes_per_device['total'] / 1e9:7.1f}")
    s = statistics(found)
    lines += ["", f"{s['rows']} published runs: geometric-mean ratio {s['mean_ratio']:.3f}, typical error "
              f"x{s['typical_error']:.3f}, worst x{s['worst']:.3f}; every row fits: "
              f"{all(r.fits for r in found)} (recipe memory: {', '.join(sorted({r.memory.family for r in found}))}; "
              "lumen_jax/plan/recipe_memory.py)",
              f"sources, FLOP conventions and assumptions: {source}"]
    return "\n".join(lines)


def to_json(found: list[Row]) -> dict:
    return {"rows": [{"name": r.published.name, "layout": r.published.layout, "source": r.published.source,
                      "convention": r.published.convention, "notes": r.published.notes, "measured_tokens_per_gpu":
                      r.measured, "predicted_tokens_per_gpu": r.predicted, "ratio": r.ratio, "fits": r.fits,
                      "family": r.memory.family, "recipe_bytes_per_device": r.memory.total,
                      "recipe_bytes_by_term": r.memory.terms, "recipe_stage": r.memory.stage,
                      "usable_bytes": r.usable, "our_bytes_per_device": r.ours.bytes_per_device["total"],
                      "our_plan_fits": r.ours.fits, "our_tokens_per_gpu": r.ours_per_gpu,
                      "our_ratio": r.ours_ratio, "our_setting": setting_of(r.ours),
                      "our_ratio_as_published": r.as_published_ratio,
                      "our_bytes_as_published": r.ours_as_published.bytes_per_device["total"]} for r in found],
            "statistics": statistics(found)}
