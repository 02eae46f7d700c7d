"""What runs after each step: small objects the loop calls in order (`Hooks`, below), each with one job.

    hooks = Hooks()
    hooks.add(DeviceWait(clock))                     # every step: the previous step's wait, timed
    hooks.add(NonFiniteGuard(...))                   # every step: skipped updates, Diverged
    hooks.add(SdcCheck(mesh), every=N)               # replicas' checksums, CorruptionDetected
    hooks.add(Logging(...))                          # metrics.jsonl, TensorBoard, the progress bar
    ...
    hooks.add(SlowSteps(...))                        # last: each step's time against the running median

A hook is a callable `hook(info: StepInfo) -> None`; it may add values to the step's metrics row
(`info.row`) or raise to stop the run. `Hooks.add(hook, every=N, at_last=True)` calls it after
steps N, 2N, ... (and after the last step). A new loop feature is a new hook, never an edit of the
loop. `loop.standard_hooks` (the loop calls it at start-up) assembles the trainer's own, each from
its config section.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import signal
import statistics
import time
from typing import Any, Callable, Sequence

import jax

from lumen_jax.checkpoint.manager import Checkpointer
from lumen_jax.config import LogConfig
from lumen_jax.metrics import writers
from lumen_jax.metrics.mfu import Throughput
from lumen_jax.metrics.timing import LoopTimes, StepClock
from lumen_jax.parallel.sdc import find_divergent_replicas
from lumen_jax.runtime import distributed, logs
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

    def close(self) -> None:
        """Closes every hook object that has a `close` (a trace in progress, the files, the progress bar,
        the step clock), each once, the last added first."""
        seen = set()
        for hook in reversed(list(self)):
            owner = getattr(hook, "__self__", hook)  # a bound method (`Preemption.check`): its object
            if id(owner) not in seen and hasattr(owner, "close"):
                seen.add(id(owner))
                owner.close()


class DeviceWait:
    """Waits for the previous step's metrics, which the non-finite guard reads next: the loop's one
    wait for the device per step (the host stays one step ahead), timed by the step clock. At the
    last step it waits for that step too (the guard checks it before the checkpoint is saved), so
    that wait is counted as the device's time, not the host's (`Stragglers` compares the host's)."""

    def __init__(self, clock: StepClock):
        self.clock = clock

    def __call__(self, info: StepInfo) -> None:
        self.clock.wait(info.step if info.last else info.step - 1)

    def close(self) -> None:
        self.clock.close()


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
    Diverged after `max_in_a_row` of them in a row, or at the last step when every step of the run was
    skipped (a run shorter than `max_in_a_row` would otherwise end "done" having trained nothing).

    Each step's metrics are checked one step late (`after_step`), when they are ready: the host
    never waits for the device for the guard; at the last step, checked before the checkpoint is
    saved, `DeviceWait` has waited for it.
    """

    def __init__(self, max_in_a_row: int, checkpoint_dir: str, last_checkpoint: Callable[[], str] | None = None):
        self.max_in_a_row = max_in_a_row
        self.checkpoint_dir = checkpoint_dir
        # Names the newest committed (finite) checkpoint for the message (Checkpointer.last_committed).
        self.last_checkpoint = last_checkpoint or (lambda: f"the last checkpoint in {checkpoint_dir} is intact")
        self.in_a_row = 0
        self.skipped_total = 0  # skipped steps among those checked so far
        self.checked = 0
        self._pending: tuple[int, Any] | None = None

    def after_step(self, step: int, step_metrics: Any) -> None:
        """Checks the previous step's metrics, then keeps `step`'s (with its `skipped` flag)."""
        if self._pending is not None:
            done_step, done_metrics = self._pending
            self.checked += 1
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
        if info.last:
            self.after_step(info.step, None)  # the last step's own metrics, now
            if self.skipped_total == self.checked:
                raise Diverged(
                    f"every step of this run ({self.checked}, up to step {info.step}) had a non-finite loss, "
                    f"gradient norm or update: updates were skipped, nothing was trained and "
                    f"{self.last_checkpoint()}; lower optim.lr or check the data, then rerun")


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
    """Held-out loss (`train.eval_every`): `evaluate(state)` -> {eval_loss, ...} into the step's row;
    its time is left out of the loop's time per step (`LoopTimes.excluded_s`)."""

    def __init__(self, evaluate: Callable[[Any], dict], times: LoopTimes):
        self.evaluate = evaluate
        self.times = times

    def __call__(self, info: StepInfo) -> None:
        t0 = time.perf_counter()
        info.row.update(self.evaluate(info.state))
        self.times.excluded_s += time.perf_counter() - t0


class DataTokens:
    """A data mixture's tokens per source so far into the logged rows (`tokens_<name>`): the data state
    carries them (data/mixture.py), the same on every process."""

    def __call__(self, info: StepInfo) -> None:
        info.row.update({f"tokens_{name}": n for name, n in info.data_state.get("tokens", {}).items()})


class Logging:
    """Every `log.every_steps` steps, the last step and any step with values in its row (evaluation):
    the step's metrics, where the time went (metrics/timing.py), tokens/s and MFU into metrics.jsonl,
    TensorBoard and the progress bar.

    The figures are per step over the steps since the previous logged row; reading the metrics waits
    for the step, so `loop_time_s` is the pace (evaluation excluded), and tokens/s and MFU derive from it.
    """

    def __init__(self, log: LogConfig, run_dir: str, throughput: Throughput, total_steps: int, start: int,
                 attempt: int, enabled: bool, skipped_total: Callable[[], int], times: LoopTimes):
        self.every = log.every_steps
        self.throughput = throughput
        self.skipped_total = skipped_total
        self.times = times
        self.last: dict = {}  # the last row written (the run's result)
        # A resumed attempt's rows carry its number (steps after the checkpoint are logged again);
        # TensorBoard drops the earlier attempt's events from the first replayed step on.
        self.writer = writers.MetricsWriter(run_dir, jsonl=log.jsonl, tensorboard=log.tensorboard, enabled=enabled,
                                            attempt=attempt, purge_step=start + 1 if start else None)
        # The terminal's stderr: the loop sends libraries' stderr to library.log (runtime/logs.py).
        self.progress = writers.Progress(total_steps, enabled=enabled and log.progress, initial_step=start,
                                         file=logs.console())
        self._since, self._steps_since = times.now(), 0

    def __call__(self, info: StepInfo) -> None:
        self._steps_since += 1
        if not (info.row or info.step % self.every == 0 or info.last):
            return
        self.times.clock.wait(info.step)  # the read below waits for the step: timed as the loop's wait
        values = {k: float(v) for k, v in jax.device_get(info.metrics).items()}
        now = self.times.now()
        times = (now - self._since).per_step(self._steps_since)
        perf = self.throughput.measure(times["loop_time_s"]).as_dict()
        del perf["step_time_s"]  # the loop's time per step: loop_time_s; step_time_s is the device's
        self.last = {**values, **perf, **times, "skipped_total": self.skipped_total(), **info.row}
        self.writer.write(info.step, self.last)
        self.progress.update(info.step, self.last)
        self._since, self._steps_since = self.times.now(), 0

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
    stop was requested); the stall goes to the loop's times (`checkpoint_stall_s`). The checkpointer
    writes the events: `checkpoint_start` when a save starts, `checkpoint` when it is committed."""

    def __init__(self, checkpointer: Checkpointer, meta: Callable[[dict], dict], times: LoopTimes):
        self.checkpointer = checkpointer
        self.meta = meta  # data position -> the JSON saved beside the state (called only when saving)
        self.times = times

    def __call__(self, info: StepInfo) -> None:
        saved = self.checkpointer.maybe_save(info.step, info.state, lambda: self.meta(info.data_state),
                                             last=info.last, force=info.stop_requested)
        if saved is not None:
            self.times.stall_s += saved


class Profiler:
    """`train.profile_steps=[start, stop]`: a `jax.profiler` trace of steps start..stop-1 into `folder`
    (each process its own: `<run_dir>/profile/process-<i>`), each step a `StepTraceAnnotation`.

    `begin_if_due(step)` before a step starts the trace when that step opens the window; as a hook
    after step stop-1 it waits for that step on the device and stops the trace. Outside the window it
    compares two integers per step.
    """

    def __init__(self, steps: Sequence[int], folder: str, times: LoopTimes, announce: bool):
        self.start, self.stop = (steps[0], steps[1]) if steps else (0, 0)
        self.folder = folder
        self.times = times
        self.clock = times.clock
        self.announce = announce  # process 0 prints where the trace went
        self.active = False
        self._first: int | None = None

    def begin_if_due(self, step: int) -> None:
        if not self.active and self.start <= step < self.stop:
            t0 = time.perf_counter()
            jax.profiler.start_trace(self.folder, create_perfetto_trace=True)
            self.active, self.clock.annotate, self._first = True, True, step
            self.times.excluded_s += time.perf_counter() - t0

    def __call__(self, info: StepInfo) -> None:
        if self.active and info.step >= self.stop - 1:
            self._end(info.step)
        elif not info.last:
            self.begin_if_due(info.step + 1)

    def _end(self, last: int) -> None:
        self.clock.wait(last)  # the trace holds the last step's device work
        t0 = time.perf_counter()
        jax.profiler.stop_trace()  # seconds: writing the trace is left out of the step figures
        self.times.excluded_s += time.perf_counter() - t0
        self.active = self.clock.annotate = False
        if self.announce:
            print(f"lumen_jax: profile of steps {self._first}-{last} in {self.folder} (TensorBoard: tensorboard "
                  f"--logdir {os.path.dirname(self.folder)}; Perfetto: its perfetto_trace.json.gz)", flush=True)

    def close(self) -> None:
        """A run that stops inside the window (preempted, failed) keeps what was traced."""
        if self.active:
            self._end(self.clock.dispatched)


class DeviceMemory:
    """The allocator's peak bytes in use (the largest over this process's devices) into the logged
    rows, `peak_bytes_in_use`; only where devices report memory (GPUs: not XLA:CPU)."""

    def __init__(self, devices: Sequence[Any]):
        self.devices = list(devices)

    @staticmethod
    def reported(devices: Sequence[Any]) -> bool:
        return bool(devices) and devices[0].memory_stats() is not None

    def __call__(self, info: StepInfo) -> None:
        stats = [d.memory_stats() or {} for d in self.devices]
        peaks = [s["peak_bytes_in_use"] for s in stats if "peak_bytes_in_use" in s]
        if peaks:
            info.row["peak_bytes_in_use"] = max(peaks)


class SlowSteps:
    """A step slower than `factor` times the running median of the steps before it (the last
    `window`, once `min_history` are known) is a `slow_step` event with its time and the median.

    A step's time runs from the previous step's outputs being ready to its own (`StepClock.between`:
    the device's time and any wait for the host before the step started, such as a slow hook after
    the previous step), less the evaluation, checkpoint stall and profiler time between them: those
    are expected and reported on their own. Each step is judged one step late, when it is known to be
    ready (`DeviceWait` waited for it), so no wait is added.
    """

    def __init__(self, factor: float, events: Events, times: LoopTimes, window: int = 100, min_history: int = 5):
        self.factor = factor
        self.events = events
        self.times = times
        self.min_history = min_history
        self.history: collections.deque[float] = collections.deque(maxlen=window)
        # excluded + stall seconds at the end of the last three steps' hooks: those of step N-1's hooks
        # fall between steps N-1 and N
        self._expected = collections.deque([self._expected_now()] * 3, maxlen=3)

    def _expected_now(self) -> float:
        return self.times.excluded_s + self.times.stall_s

    def __call__(self, info: StepInfo) -> None:
        step, between = info.step - 1, self.times.clock.between(info.step - 1)
        expected = self._expected[1] - self._expected[0]  # the hooks after step - 1
        self._expected.append(self._expected_now())
        if between is None:
            return
        seconds = max(0.0, between - expected)
        if len(self.history) >= self.min_history:
            median = statistics.median(self.history)
            if seconds > self.factor * median:
                self.events.write("slow_step", step=step, step_time_s=seconds, median_s=median)
        self.history.append(seconds)


class Stragglers:
    """With several processes, every logged step: each process's own time per step (its loop's time
    but the waits for the devices and for the others, `Totals.own_per_step`) is gathered, and the
    slowest process is named (a `straggler` event; `straggler` in the row, the progress bar) when its
    own time exceeds `factor` times the others' median and the excess is at least `MIN_SHARE` of the
    step. In SPMD every process steps at the pace of the slowest: the others wait for it in the
    collectives, so their own time stays small while the straggler's is what the step waits for; the
    share keeps milliseconds of host work (process 0 writes the metrics) from naming anyone."""

    MIN_SHARE = 0.25

    def __init__(self, factor: float, events: Events, times: LoopTimes, start: int):
        self.factor = factor
        self.events = events
        self.times = times
        self._since, self._step = times.now(), start

    def __call__(self, info: StepInfo) -> None:
        d, steps = self.times.now() - self._since, info.step - self._step
        t0 = time.perf_counter()
        gathered = distributed.gather_json([d.own_per_step(steps), (d.wall - d.excluded) / steps], to_all=False)
        self.times.clock.add_blocked(time.perf_counter() - t0)  # the exchange waits for the others
        self._since, self._step = self.times.now(), info.step
        if gathered is None or len(gathered) < 2:
            return
        own = [g[0] for g in gathered]
        slowest = max(range(len(own)), key=own.__getitem__)
        others = statistics.median(own[:slowest] + own[slowest + 1:])
        if own[slowest] > self.factor * others and own[slowest] - others >= self.MIN_SHARE * gathered[0][1]:
            self.events.write("straggler", step=info.step, process=slowest, own_s=own[slowest], others_s=others,
                              loop_time_s=gathered[0][1])
            info.row["straggler"] = slowest


def fault_hooks(run_dir: str) -> list[Callable[[int], None]]:
    """Fault injection for tests, installed only when one of its variables is set.

    Returns the hooks the loop calls after each step (none without the variables):

    - LUMEN_FAULT_SIGKILL_AFTER_STEPS=5,8: SIGKILL this process once after each listed step, after
      the step (and its checkpoint, if one was due) was issued: the async write may still be in
      flight. A marker file in `run_dir` makes each kill happen once across restarts.
    - LUMEN_FAULT_SLEEP_S=0.5: sleep that long after every step, or only after the steps listed in
      LUMEN_FAULT_SLEEP_AFTER_STEPS (a slow step; with several processes, a straggler).

    LUMEN_FAULT_PROCESS=i limits them to process i of a multi-process run.
    """
    env = os.environ.get
    only = env("LUMEN_FAULT_PROCESS", "")
    if only and int(only) != jax.process_index():
        return []
    out = []
    if env("LUMEN_FAULT_SIGKILL_AFTER_STEPS"):
        kill_after = {s.strip() for s in env("LUMEN_FAULT_SIGKILL_AFTER_STEPS").split(",")}

        def kill(step: int) -> None:
            marker = os.path.join(run_dir, f".fault-killed-{step}")
            if str(step) in kill_after and not os.path.exists(marker):
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)

        out.append(kill)
    if env("LUMEN_FAULT_SLEEP_S"):
        seconds, listed = float(env("LUMEN_FAULT_SLEEP_S")), env("LUMEN_FAULT_SLEEP_AFTER_STEPS", "")
        sleep_after = {int(s) for s in listed.split(",")} if listed else None

        def sleep(step: int) -> None:
            if sleep_after is None or step in sleep_after:
                time.sleep(seconds)

        out.append(sleep)
    return out


def fault_sigterm_at_startup() -> None:
    """Fault injection for tests: with LUMEN_FAULT_SIGTERM_AT_STARTUP set, SIGTERM this process just
    before the step is compiled (deterministically during start-up)."""
    if os.environ.get("LUMEN_FAULT_SIGTERM_AT_STARTUP"):
        os.kill(os.getpid(), signal.SIGTERM)
