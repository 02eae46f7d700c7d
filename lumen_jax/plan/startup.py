"""What the trainer asks the planner when a run starts, in one call (`at_start`): whether the kept
weights of `mesh.fsdp_regather=per_step` fit the device, and the bytes per device the start-up
memory line prints next to what the device reports."""

from __future__ import annotations

import dataclasses

from lumen_jax.config import Config
from lumen_jax.ops.choice import Ops
from lumen_jax.plan.hardware import Hardware, Layout
from lumen_jax.plan.memory import check_kept_weights_fit
from lumen_jax.plan.predict import predict


@dataclasses.dataclass(frozen=True)
class AtStart:
    """The planner's answer for a run about to start."""

    bytes_per_device: dict[str, float] | None  # `Plan.bytes_per_device`; None when it could not plan
    error: str = ""  # why it could not plan (one line): a diagnostic never stops a run


def moe_backend(ops: Ops) -> str:
    """The planner's MoE backend (`plan.moe.BACKENDS`) for the exchange `ops` chose."""
    return "gpu" if ops.moe_exchange == "ragged" else "cpu"


def at_start(cfg: Config, mesh_shape: dict[str, int], ops: Ops, device_bytes: float | None,
             plan_bytes: bool = True) -> AtStart:
    """The planner's checks and figures for `cfg` on a mesh of `mesh_shape` running `ops`.

    Args:
      device_bytes: the device's memory (None: unknown, e.g. on CPU; the fit is not checked).
      plan_bytes: also predict the bytes per device (the process that prints the start-up line).

    Raises:
      ConfigError: `mesh.fsdp_regather=per_step` keeps more gathered weights than the device holds.
    """
    layout = Layout(dataclasses.replace(cfg.mesh, **mesh_shape), pipeline=mesh_shape["pipeline"],
                    micro_batches=cfg.train.micro_batches)
    if cfg.mesh.fsdp_regather == "per_step":
        check_kept_weights_fit(cfg.model, layout, device_bytes)
    if not plan_bytes:
        return AtStart(None)
    try:  # the device's memory and peak do not change the bytes: any values do
        plan = predict(cfg, layout, Hardware("this device", 0.0, peak_flops=1.0), attention=ops.attention,
                       moe_backend=moe_backend(ops))
    except Exception as e:  # noqa: BLE001 - a planner limitation is reported in the line, training goes on
        return AtStart(None, f"{type(e).__name__}: {' '.join(str(e).split())[:200]}")
    return AtStart(plan.bytes_per_device)
