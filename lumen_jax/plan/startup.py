"""What the trainer asks the planner when a run starts, in one call (`at_start`): whether the kept
weights of `mesh.fsdp_regather=per_step` fit the device, and the bytes per device the start-up
memory line prints next to what the device reports."""

from __future__ import annotations

import dataclasses

from lumen_jax.config import Config, ConfigError
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
      plan_bytes: also predict the bytes per device (False: only the fit of the kept weights).

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


# The planner's bytes are an estimate (it may overestimate by tens of percent): only a run planned at
# more than this many times the memory is refused before compiling; one nearer the limit compiles and
# the compiled program's own size decides (runtime.process.check_fits).
OVER_MEMORY = 2.0


def refuse_oversized(planned: AtStart, capacity: tuple[float, str] | None, check: str) -> None:
    """ConfigError when `planned` puts the run over OVER_MEMORY x `capacity` (bytes per device, what they
    are: runtime.process.device_memory(host="physical")) and `check` (runtime.memory_check) is refuse."""
    if check != "refuse" or planned.bytes_per_device is None or capacity is None:
        return
    b = planned.bytes_per_device
    if b["total"] <= OVER_MEMORY * capacity[0]:
        return
    state = sum(v for k, v in b.items() if k not in ("activations", "total"))
    raise ConfigError(f"the planner puts this run at {b['total'] / 2**30:.3g} GiB per device (state "
                      f"{state / 2**30:.3g} + activations {b['activations'] / 2**30:.3g}), over {OVER_MEMORY:g}x "
                      f"{capacity[1]} ({capacity[0] / 2**30:.3g} GiB): it cannot run here; make the model "
                      "(model.num_layers, model.d_model, ...) or the activations (data.seq_len, "
                      "data.global_batch_size, train.micro_batches) smaller, or add devices; "
                      "runtime.memory_check=off compiles it anyway")
