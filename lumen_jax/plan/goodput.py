"""Goodput under failures: the Young-Daly checkpoint interval and the share of wall time that trains.

Llama 3's pre-training saw 419 unexpected interruptions in 54 days on 16,384 H100s (Dubey et al.
2024, section 3.3.4, Table 5); the planner scales that rate to the run's device count.
"""

from __future__ import annotations

import dataclasses
import math

from lumen_jax.config import ModelConfig
from lumen_jax.metrics import flops
from lumen_jax.plan.memory import STATE_BYTES
from lumen_jax.plan.predict import Plan

LLAMA3_INTERRUPTIONS = 419
LLAMA3_DAYS = 54
LLAMA3_GPUS = 16384
FAILURES_PER_GPU_S = LLAMA3_INTERRUPTIONS / (LLAMA3_DAYS * 86400 * LLAMA3_GPUS)
STORAGE_GBPS = 100.0  # aggregate checkpoint write bandwidth, GB/s (--storage-gbps)
RESTART_S = 600.0  # from a failure to training again: detection, rescheduling, start-up, restore (--restart-s)


@dataclasses.dataclass(frozen=True)
class Goodput:
    """Checkpointing a run of `devices` devices whose state takes `checkpoint_s` to write."""

    devices: int
    checkpoint_bytes: float  # the whole run's checkpoint (parameters + optimizer state, every shard once)
    checkpoint_s: float  # delta: one checkpoint's write time
    restart_s: float  # R
    step_s: float

    @property
    def mtbf_s(self) -> float:
        """M: the mean time between failures of the whole run."""
        return 1.0 / (FAILURES_PER_GPU_S * self.devices)

    @property
    def interval_s(self) -> float:
        """Young-Daly: tau = sqrt(2 delta M), the compute time between checkpoints that minimises the
        expected waste (Young 1974; Daly 2006's first order)."""
        return math.sqrt(2.0 * self.checkpoint_s * self.mtbf_s)

    @property
    def every_steps(self) -> int:
        """`checkpoint.every_steps` for the interval."""
        return max(1, round(self.interval_s / self.step_s))

    @property
    def goodput(self) -> float:
        """The expected share of wall time that trains: each interval of tau also writes a checkpoint
        (tau / (tau + delta)), and each failure (one per M) costs the restart and, on average, half an
        interval of lost work: x (1 - (R + (tau + delta) / 2) / M)."""
        tau, delta = self.interval_s, self.checkpoint_s
        return tau / (tau + delta) * max(0.0, 1.0 - (self.restart_s + (tau + delta) / 2) / self.mtbf_s)


def goodput(devices: int, checkpoint_bytes: float, step_s: float, *, storage_gbps: float = STORAGE_GBPS,
            restart_s: float = RESTART_S) -> Goodput:
    return Goodput(devices=devices, checkpoint_bytes=checkpoint_bytes,
                   checkpoint_s=checkpoint_bytes / (storage_gbps * 1e9), restart_s=restart_s, step_s=step_s)


def checkpoint_bytes(model: ModelConfig) -> float:
    """What a checkpoint writes: the fp32 parameters and Adam's two moments, every shard once."""
    return flops.param_counts(model)["total"] * (STATE_BYTES["params"] + STATE_BYTES["optimizer"])


def of_plan(plan: Plan, model: ModelConfig, *, storage_gbps: float = STORAGE_GBPS,
            restart_s: float = RESTART_S) -> Goodput:
    return goodput(plan.layout.num_devices, checkpoint_bytes(model), plan.step_time_s, storage_gbps=storage_gbps,
                   restart_s=restart_s)
