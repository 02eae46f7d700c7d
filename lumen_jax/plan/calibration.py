"""The planner against published runs (`published.TABLE`): predicted vs measured tokens/s per GPU,
and the statistics `python -m lumen_jax.plan --calibration` prints (docs/PLANNING.md, section 5)."""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable

from lumen_jax.config import Config, DataConfig, MeshConfig, ModelConfig, TrainConfig
from lumen_jax.metrics import flops
from lumen_jax.plan.efficiency import Efficiency, Overlap
from lumen_jax.plan.hardware import DEVICES, Hardware, Layout
from lumen_jax.plan.predict import Plan, predict
from lumen_jax.plan.published import HARDWARE, TABLE, Published

# The overlap a published recipe reaches on its tensor axis when it decomposes the layer's
# collectives into its matmuls (Megatron's TP communication overlap, torchtitan's async TP) and on
# its pipeline axis when it sends under the next micro-batch: fitted (docs/PLANNING.md, section 5).
# Our program has neither (`Overlap().tensor` = `Overlap().pipeline` = 0).
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
                recipe_overlap: dict[str, float] | None = None, hardware: dict[str, dict] | None = None) -> Plan:
    """Our program's plan for the row's model, layout and hardware, with the recipe's overlap."""
    recipe = dataclasses.replace(overlap, **(RECIPE_OVERLAP if recipe_overlap is None else recipe_overlap)) \
        if row.comm_overlap else overlap
    return predict(config_of(row), layout_of(row), hardware_of(row, hardware), attention="flash", terms=terms,
                   overlap=recipe)


@dataclasses.dataclass(frozen=True)
class Row:
    published: Published
    plan: Plan
    measured: float  # tokens/s per GPU

    @property
    def predicted(self) -> float:
        return self.plan.tokens_per_s / self.plan.layout.num_devices

    @property
    def ratio(self) -> float:
        return self.predicted / self.measured


def rows(table: Iterable[Published] = TABLE, **kwargs) -> list[Row]:
    return [Row(r, predict_row(r, **kwargs), measured_tokens_per_gpu(r)) for r in table]


def statistics(found: list[Row]) -> dict[str, float]:
    """`mean_ratio`: the geometric mean of predicted / measured; `typical_error`: exp of the mean
    |log ratio| (x1.15 = within 15% on a typical row); `worst`: the largest |log ratio| as a factor."""
    logs = [math.log(r.ratio) for r in found]
    return {"mean_ratio": math.exp(sum(logs) / len(logs)),
            "typical_error": math.exp(sum(abs(x) for x in logs) / len(logs)),
            "worst": math.exp(max(abs(x) for x in logs)), "rows": len(logs)}


def format_calibration(found: list[Row]) -> str:
    """The table `--calibration` prints: measured vs predicted tokens/s per GPU, the ratio, whether
    the plan fits, and the statistics."""
    head = f"{'run':42s}{'layout':36s}{'measured':>10s}{'predicted':>11s}{'ratio':>7s}{'GB':>7s}  fits"
    lines = [head]
    for r in found:
        lines.append(f"{r.published.name:42s}{r.published.layout:36s}{r.measured:10,.0f}{r.predicted:11,.0f}"
                     f"{r.ratio:7.2f}{r.plan.bytes_per_device['total'] / 1e9:7.1f}  {'yes' if r.plan.fits else 'NO'}")
    s = statistics(found)
    lines += ["", f"{s['rows']} published runs: geometric-mean ratio {s['mean_ratio']:.3f}, typical error "
              f"x{s['typical_error']:.3f}, worst x{s['worst']:.3f}; every row fits: "
              f"{all(r.plan.fits for r in found)}",
              "sources, FLOP conventions and assumptions: lumen_jax/plan/published.py"]
    return "\n".join(lines)


def to_json(found: list[Row]) -> dict:
    return {"rows": [{"name": r.published.name, "layout": r.published.layout, "source": r.published.source,
                      "convention": r.published.convention, "notes": r.published.notes, "measured_tokens_per_gpu":
                      r.measured, "predicted_tokens_per_gpu": r.predicted, "ratio": r.ratio, "fits": r.plan.fits,
                      "bytes_per_device": r.plan.bytes_per_device["total"]} for r in found],
            "statistics": statistics(found)}
