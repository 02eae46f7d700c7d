"""The plan against the compiler: the real train step compiled on this machine's devices, and XLA's
own per-device bytes and FLOPs next to the predicted ones (`python -m lumen_jax.lower --against-xla`
and tests/plan/test_plan.py use the same functions).

Nothing is allocated: the step is lowered for abstract, sharded state and batch and compiled;
`memory_analysis()` and `cost_analysis()` of the compiled program are read. On CPU the devices are
emulated (`runtime.cpu_devices`), so the comparison runs on any machine; the working-set constants
of `memory` and the elementwise counts of `cost` are calibrated against XLA:CPU this way.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import jax
import numpy as np

from lumen_jax.train.build import Trainer, build
from lumen_jax.config import Config, ConfigError, MeshConfig
from lumen_jax.data import BATCH_KEYS
from lumen_jax.metrics import memory
from lumen_jax.metrics.memory import compiled_flops
from lumen_jax.parallel.mesh import make_mesh
from lumen_jax.compiler import hlo
from lumen_jax.plan.cost import compiled_flops_per_device, critical_path_matmul_flops
from lumen_jax.plan.hardware import Layout
from lumen_jax.plan.predict import Plan
from lumen_jax.train.step import TrainState


@dataclasses.dataclass(frozen=True)
class AgainstXla:
    """Per-device bytes and FLOPs of one step, predicted and as XLA compiled it."""

    flops_predicted: float  # `cost.compiled_flops_per_device`: counted the way cost_analysis counts
    flops_compiled: float  # cost_analysis()["flops"]
    # Matmul FLOPs of the critical path: every dot times its loops' trip counts (`hlo.matmul_flops`);
    # with pipeline stages every tick of the lock-step program, bubble included.
    matmul_predicted: float  # `cost.critical_path_matmul_flops`
    matmul_compiled: float
    bytes_predicted: float  # the plan's total bytes per device
    bytes_compiled: float  # memory_analysis(): arguments + outputs + temporaries - aliases
    # Collective bytes per step by "axes kind-group" (e.g. "fsdp gather", "data+fsdp reduce"):
    # (predicted, compiled), the compiled ones counted with loop trip counts (`hlo.on_mesh`).
    collectives: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Kinds compared together: XLA:CPU runs a reduce-scatter as an all-reduce (both counted at the
# full array), and the planner's send/recv are collective-permutes.
GROUP = {"all-gather": "gather", "all-reduce": "reduce", "reduce-scatter": "reduce", "send/recv": "permute",
         "collective-permute": "permute", "all-to-all": "all-to-all", "ragged-all-to-all": "all-to-all"}


def collective_bytes(plan: Plan, compiled: Any) -> dict[str, tuple[float, float]]:
    """{"axes group": (predicted, compiled) bytes per step}, for every key either side has."""
    predicted: dict[str, float] = collections.defaultdict(float)
    for c in plan.collectives:
        predicted[f"{c.axis} {GROUP[c.kind]}"] += c.payload_bytes * c.calls
    found: dict[str, float] = collections.defaultdict(float)
    shape = {a: plan.layout.size(a) for a in MeshConfig.AXES}
    for c in hlo.on_mesh(hlo.parse(compiled.as_text()), shape):
        found[f"{'+'.join(c.axes)} {GROUP[c.kind]}"] += c.total
    return {k: (predicted.get(k, 0.0), found.get(k, 0.0)) for k in sorted(set(predicted) | set(found))}


def compile_step(cfg: Config, layout: Layout) -> Any:
    """The trainer's step for `cfg` on the first `layout.num_devices` devices, compiled for abstract
    (sharded) state and batch. Returns the `jax.stages.Compiled`.

    Raises:
      ConfigError: the layout plans pipeline stages the config lacks (`--pipeline`) or more devices than JAX has.
    """
    if layout.pipeline != layout.mesh.pipeline:
        raise ConfigError(f"--pipeline {layout.pipeline} plans stages the config does not run; compile with "
                          f"mesh.pipeline={layout.pipeline} instead of --pipeline")
    devices = jax.devices()[:layout.num_devices]
    if len(devices) < layout.num_devices:
        raise ConfigError(f"the layout needs {layout.num_devices} devices but JAX has {jax.device_count()}")
    trainer = build(cfg, make_mesh({a: layout.size(a) for a in MeshConfig.AXES}, devices))
    return trainer.step.lower(*abstract_step_args(trainer, cfg)).compile()


def abstract_step_args(trainer: Trainer, cfg: Config) -> tuple[TrainState, dict]:
    """The step's arguments as shapes (state, batch; the batch with its sharding): nothing is allocated."""
    shape = (cfg.data.global_batch_size, cfg.data.seq_len)
    batch = {k: jax.ShapeDtypeStruct(shape, np.float32 if k == "loss_mask" else np.int32,
                                     sharding=trainer.batch_sharding) for k in BATCH_KEYS}
    return jax.eval_shape(trainer.init), batch


def compiled_bytes(compiled: Any) -> int:
    """Per-device bytes XLA allocates for the step: arguments + outputs + temporaries - aliases
    (on CPU `peak_memory_in_bytes` leaves the temporaries out)."""
    return memory.compiled_bytes(compiled)["total"]


def against_xla(cfg: Config, plan: Plan, compiled: Any = None) -> AgainstXla:
    """`plan` (from `predict(cfg, layout, ...)`) next to XLA's figures for the compiled step.

    Args:
      cfg: the run; its mesh resolves to `plan.layout`.
      plan: the prediction to check.
      compiled: the step from `compile_step(cfg, plan.layout)`; None compiles it here.
    """
    compiled = compile_step(cfg, plan.layout) if compiled is None else compiled
    shape = (cfg.model, plan.layout, cfg.data.seq_len, cfg.data.global_batch_size)
    return AgainstXla(flops_predicted=compiled_flops_per_device(*shape), flops_compiled=compiled_flops(compiled),
                      matmul_predicted=critical_path_matmul_flops(*shape),
                      matmul_compiled=float(hlo.matmul_flops(hlo.parse(compiled.as_text()))),
                      bytes_predicted=plan.bytes_per_device["total"], bytes_compiled=float(compiled_bytes(compiled)),
                      collectives=collective_bytes(plan, compiled))


def format_against_xla(check: AgainstXla, devices: int) -> str:
    """The predicted and the compiled per-device FLOPs and bytes side by side (`--against-xla`)."""
    error = lambda p, c: f"{p / c - 1:+.1%}" if c else "n/a"  # noqa: E731
    return "\n".join([
        f"against XLA: the step compiled on {devices} emulated CPU devices, per device",
        f"  {'':8s}{'predicted':>14s}{'compiled':>14s}{'error':>9s}",
        f"  {'FLOPs':8s}{check.flops_predicted:14.3e}{check.flops_compiled:14.3e}"
        f"{error(check.flops_predicted, check.flops_compiled):>9s}   as cost_analysis counts: a loop body once "
        "(one layer, one micro-batch), elementwise work included",
        f"  {'matmuls':8s}{check.matmul_predicted:14.3e}{check.matmul_compiled:14.3e}"
        f"{error(check.matmul_predicted, check.matmul_compiled):>9s}   the critical path: every dot times its "
        "loops' trip counts (with pipeline stages every tick, bubble included)",
        f"  {'bytes':8s}{check.bytes_predicted / 1e6:11.2f} MB{check.bytes_compiled / 1e6:11.2f} MB"
        f"{error(check.bytes_predicted, check.bytes_compiled):>9s}   memory_analysis: arguments + outputs + "
        "temporaries - aliases",
        "  collective bytes per step (compiled: every collective times its loops' trip counts)",
        *(f"  {key:24s}{p / 1e6:11.3f} MB{c / 1e6:11.3f} MB{error(p, c):>9s}"
          for key, (p, c) in check.collectives.items()),
    ])
