"""What runs after each step: small objects the loop calls in order (`loop.Hooks`), each with one job.

    hooks = Hooks()
    hooks.add(NonFiniteGuard(...))                   # every step: skipped updates, Diverged
    hooks.add(SdcCheck(mesh), every=N)               # replicas' checksums, CorruptionDetected
    hooks.add(Logging(...))                          # metrics.jsonl, TensorBoard, the progress bar
    ...

A hook is a callable `hook(info: StepInfo) -> None`; it may add values to the step's metrics row
(`info.row`) or raise to stop the run. `Hooks.add(hook, every=N, at_last=True)` calls it after
steps N, 2N, ... (and after the last step). A new loop feature is a new hook, never an edit of the
loop. `standard_hooks` (train/cli.py calls it) assembles the trainer's own, each from its config
section.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from typing import Any, Callable

import jax

from lumen_jax.checkpoint.manager import Checkpointer
from lumen_jax.config import LogConfig
from lumen_jax.metrics import writers
from lumen_jax.metrics.mfu import Throughput
from lumen_jax.parallel.sdc import find_divergent_replicas
from lumen_jax.runtime import logs
from lumen_jax.runtime.signals import StopSignal


class Preempted(Exception):
    """SIGTERM/SIGINT arrived: the current step finished and a checkpoint was written."""


class Diverged(Exception):
    """Too many non-finite steps in a row; the last good checkpoint is intact."""


class CorruptionDetected(Exception):
    """Parameter replicas disagree (silent data corruption)."""


@dataclasses.dataclass
class StepInfo:
    """One finished step, as the hooks see it."""

    step: int
    last: bool  # the run's final step
    state: Any  # the TrainState after the step (device arrays; the step may still be running)
    metrics: Any  # the step's metrics on the device (read one step late: `NonFiniteGuard`)
    data_state: dict  # the data position after this step's batch (what a checkpoint records)
    row: dict = dataclasses.field(default_factory=dict)  # values hooks add to this step's metrics row
    host_s: float = 0.0  # host seconds hooks spent that are not the step's (evaluation)
    stop_requested: bool = False  # set by `Preemption.check`


Hook = Callable[[StepInfo], None]


class Hooks:
    """The after-step hooks, in the order they were added."""

    def __init__(self) -> None:
        self._hooks: list[tuple[Hook, int, bool]] = []

    def add(self, hook: Hook, every: int = 1, at_last: bool = False) -> "Hooks":
        """Calls `hook` after every `every`-th step (0: never by count) and, with `at_last`, the last."""
        self._hooks.append((hook, every, at_last))
        return self

    def __call__(self, info: StepInfo) -> None:
        for hook, every, at_last in self._hooks:
            if (every and info.step % every == 0) or (at_last and info.last):
                hook(info)

    def __iter__(self):
        return (hook for hook, _, _ in self._hooks)


class Events:
    """`<run_dir>/events.jsonl`: start, progress and checkpoint events for the supervisor.

    As a hook: a `step` event after every step (the supervisor counts lost steps from these)."""

    def __init__(self, run_dir: str, enabled: bool):
        self.path = os.path.join(run_dir, "events.jsonl") if enabled else None

    def count(self, event: str) -> int:
        """How many `event` records the file holds (0 on other processes)."""
        if not self.path or not os.path.exists(self.path):
            return 0
        with open(self.path, encoding="utf-8") as f:
            return sum(f'"event": "{event}"' in line for line in f)

    def write(self, event: str, **fields: Any) -> None:
        if self.path:
            # LUMEN_ATTEMPT_ID (set by launch/supervise.py) ties events to an attempt when the supervisor's
            # child is a launcher (srun, launch/local.py) rather than this process.
            attempt = os.environ.get("LUMEN_ATTEMPT_ID")
            with open(self.path, "a") as f:
                f.write(json.dumps({"event": event, "time": time.time(), "pid": os.getpid(),
                                    **({"attempt": attempt} if attempt else {}), **fields}) + "\n")

    def __call__(self, info: StepInfo) -> None:
        self.write("step", step=info.step)


class NonFiniteGuard:
    """Counts the steps whose update was skipped (non-finite loss, gradient norm or update) and raises
    Diverged after `max_in_a_row` of them in a row.

    Each step's metrics are checked one step late (`after_step`), when they are ready: the host
    never waits for the device for the guard.
    """

    def __init__(self, max_in_a_row: int, checkpoint_dir: str, last_checkpoint: Callable[[], str] | None = None):
        self.max_in_a_row = max_in_a_row
        self.checkpoint_dir = checkpoint_dir
        # Names the newest committed (finite) checkpoint for the message (Checkpointer.last_committed).
        self.last_checkpoint = last_checkpoint or (lambda: f"the last checkpoint in {checkpoint_dir} is intact")
        self.in_a_row = 0
        self.skipped_total = 0  # skipped steps among those checked so far
        self._pending: tuple[int, Any] | None = None

    def after_step(self, step: int, step_metrics: Any) -> None:
        """Checks the previous step's metrics, then keeps `step`'s (with its `skipped` flag)."""
        if self._pending is not None:
            done_step, done_metrics = self._pending
            if int(done_metrics["skipped"]):
                self.in_a_row, self.skipped_total = self.in_a_row + 1, self.skipped_total + 1
                if self.in_a_row >= self.max_in_a_row:
                    raise Diverged(
                        f"{self.in_a_row} steps in a row (up to step {done_step}) had a non-finite "
                        f"loss, gradient norm or update (train.max_nonfinite_steps={self.max_in_a_row}); "
                        f"updates were skipped and {self.last_checkpoint()}; "
                        "lower optim.lr or check the data, then rerun to resume")
            else:
                self.in_a_row = 0
        self._pending = (step, step_metrics)

    def __call__(self, info: StepInfo) -> None:
        self.after_step(info.step, info.metrics)


class SdcCheck:
    """Compares the parameter replicas' checksums (`train.sdc_check_every`); CorruptionDetected."""

    def __init__(self, mesh: Any):
        self.mesh = mesh

    def __call__(self, info: StepInfo) -> None:
        bad = find_divergent_replicas(self.mesh, info.state.params)
        if bad:
            raise CorruptionDetected(f"silent data corruption at step {info.step}: {bad[0]}"
                                     + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
                                     + "; exclude that device and resume from the last checkpoint")


class Evaluation:
    """Held-out loss (`train.eval_every`): `evaluate(state)` -> {eval_loss, ...} into the step's row."""

    def __init__(self, evaluate: Callable[[Any], dict]):
        self.evaluate = evaluate

    def __call__(self, info: StepInfo) -> None:
        t0 = time.perf_counter()
        info.row.update(self.evaluate(info.state))
        info.host_s += time.perf_counter() - t0  # not part of the step time


class DataTokens:
    """A data mixture's tokens per source so far into the logged rows (`tokens_<name>`): the data state
    carries them (data/mixture.py), the same on every process."""

    def __call__(self, info: StepInfo) -> None:
        info.row.update({f"tokens_{name}": n for name, n in info.data_state.get("tokens", {}).items()})


class Stall:
    """Seconds the loop stalled for something other than steps (checkpoint saves), summed until the
    next logged row reads them (`take`)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def add(self, seconds: float) -> None:
        self.seconds += seconds

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


class Logging:
    """Every `log.every_steps` steps, the last step and any step with values in its row (evaluation):
    the step's metrics, tokens/s and MFU into metrics.jsonl, TensorBoard and the progress bar.

    The step time is the wall time since the previous logged row over the steps between (evaluation
    excluded): reading the metrics waits for the step, so the figure is the device's pace.
    """

    def __init__(self, log: LogConfig, run_dir: str, throughput: Throughput, total_steps: int, start: int,
                 attempt: int, enabled: bool, skipped_total: Callable[[], int], stall: Stall):
        self.every = log.every_steps
        self.throughput = throughput
        self.skipped_total = skipped_total
        self.stall = stall
        self.last: dict = {}  # the last row written (the run's result)
        # A resumed attempt's rows carry its number (steps after the checkpoint are logged again);
        # TensorBoard drops the earlier attempt's events from the first replayed step on.
        self.writer = writers.MetricsWriter(run_dir, jsonl=log.jsonl, tensorboard=log.tensorboard, enabled=enabled,
                                            attempt=attempt, purge_step=start + 1 if start else None)
        # The terminal's stderr: the loop sends libraries' stderr to library.log (runtime/logs.py).
        self.progress = writers.Progress(total_steps, enabled=enabled and log.progress, initial_step=start,
                                         file=logs.console())
        self._t_last, self._steps_since = time.perf_counter(), 0
        self._host_s = 0.0

    def __call__(self, info: StepInfo) -> None:
        self._steps_since += 1
        self._host_s += info.host_s
        if not (info.row or info.step % self.every == 0 or info.last):
            return
        values = {k: float(v) for k, v in jax.device_get(info.metrics).items()}
        now = time.perf_counter()
        perf = self.throughput.measure((now - self._t_last - self._host_s) / self._steps_since)
        self.last = {**values, **perf.as_dict(), "skipped_total": self.skipped_total(),
                     "checkpoint_stall_s": self.stall.take(), **info.row}
        self.writer.write(info.step, self.last)
        self.progress.update(info.step, self.last)
        self._t_last, self._steps_since, self._host_s = time.perf_counter(), 0, 0.0

    def close(self) -> None:
        self.progress.close()
        self.writer.close()


class Preemption:
    """SIGTERM/SIGINT: `check` (before the checkpoint hook) asks whether to stop after this step,
    so that the save is forced; `stop` (after it) waits for the write and raises Preempted."""

    def __init__(self, stop: StopSignal, checkpointer: Checkpointer):
        self.signal = stop
        self.checkpointer = checkpointer

    def check(self, info: StepInfo) -> None:
        info.stop_requested = self.signal.requested(info.step)  # every step, on every process

    def stop(self, info: StepInfo) -> None:
        if info.stop_requested:
            self.checkpointer.wait()
            raise Preempted(f"stopped by signal {self.signal.name} after step {info.step}; checkpoint "
                            f"written to {self.checkpointer.directory}; rerun to resume")


class Checkpointing:
    """`Checkpointer.maybe_save` after every step (it decides whether a save is due; forced when a
    stop was requested); the stall goes to the next logged row, the event to events.jsonl."""

    def __init__(self, checkpointer: Checkpointer, meta: Callable[[dict], dict], events: Events, stall: Stall):
        self.checkpointer = checkpointer
        self.meta = meta  # data position -> the JSON saved beside the state (called only when saving)
        self.events = events
        self.stall = stall

    def __call__(self, info: StepInfo) -> None:
        saved = self.checkpointer.maybe_save(info.step, info.state, lambda: self.meta(info.data_state),
                                             last=info.last, force=info.stop_requested)
        if saved is not None:
            self.stall.add(saved)
            self.events.write("checkpoint", step=info.step)


def fault_hooks(run_dir: str) -> list[Callable[[int], None]]:
    """Fault injection for tests, installed only when LUMEN_FAULT_SIGKILL_AFTER_STEPS is set.

    Returns the hooks the loop calls after each step (none without the variable): SIGKILL this
    process once after each step in LUMEN_FAULT_SIGKILL_AFTER_STEPS (comma-separated), after the
    step (and its checkpoint, if one was due) was issued: the async write may still be in flight.
    A marker file in `run_dir` makes each kill happen once across restarts. LUMEN_FAULT_PROCESS=i
    limits it to process i of a multi-process run.
    """
    steps = os.environ.get("LUMEN_FAULT_SIGKILL_AFTER_STEPS", "")
    only = os.environ.get("LUMEN_FAULT_PROCESS", "")
    if not steps or (only and int(only) != jax.process_index()):
        return []
    kill_after = {s.strip() for s in steps.split(",")}

    def kill(step: int) -> None:
        marker = os.path.join(run_dir, f".fault-killed-{step}")
        if str(step) in kill_after and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)

    return [kill]


def fault_sigterm_at_startup() -> None:
    """Fault injection for tests: with LUMEN_FAULT_SIGTERM_AT_STARTUP set, SIGTERM this process just
    before the step is compiled (deterministically during start-up)."""
    if os.environ.get("LUMEN_FAULT_SIGTERM_AT_STARTUP"):
        os.kill(os.getpid(), signal.SIGTERM)
