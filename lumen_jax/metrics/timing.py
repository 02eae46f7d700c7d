"""Where a training step's time goes, measured without adding a device sync to the loop.

Three clocks, each a running total that readers difference between two `LoopTimes.now()`:

- `TimedData` wraps the data iterator and times each `next`: the seconds the loop waited for a batch.
- `StepClock` wraps the compiled step. It notes when each step was dispatched and hands the step's
  metrics to a watcher thread, which waits for them to be ready (`block_until_ready`, off the
  loop's thread) and notes that time: a step's device time runs from when it could start (it was
  dispatched and the step before it was done) to when its outputs were ready. The loop itself
  already waits for each step once, one step late (the non-finite guard reads the previous step's
  flag); `StepClock.wait` is that wait, timed: the seconds the loop was blocked on the device. The
  dispatch counts as blocked too: a GPU returns at once, while XLA:CPU with several devices runs
  the step before the call returns.
- `LoopTimes` adds what hooks report: checkpoint stalls, and host work that is not a step's
  (evaluation), which the loop's time per step leaves out.

Over an interval of k steps (train/hooks.py, `Logging`):

    loop_time_s        = (wall - excluded) / k               the pace: tokens/s and MFU derive from it
    step_time_s        = min(device, wall - excluded) / k    the device's time per step
    data_wait_s        = data / k
    checkpoint_stall_s = stall / k
    host_overhead_s    = (wall - excluded - blocked - data - stall) / k   the rest of the loop

The loop's own time, data_wait_s + checkpoint_stall_s + host_overhead_s, overlaps the device's: the
next batch is fetched while the step runs. While it stays below step_time_s the device sets the pace
(loop_time_s ~ step_time_s); above it, the device waits for the host.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any, Callable, Iterator

import jax


class TimedData:
    """The data iterator, its `next` timed (`wait_s`: total seconds); everything else passed through
    (`get_state`, `set_state`, ...)."""

    def __init__(self, data: Iterator):
        self._data = data
        self.wait_s = 0.0

    def __iter__(self) -> "TimedData":
        return self

    def __next__(self) -> Any:
        t0 = time.perf_counter()
        try:
            return next(self._data)
        finally:
            self.wait_s += time.perf_counter() - t0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._data, name)


class StepClock:
    """The compiled step, called as before, with its dispatch and device times noted.

    Args:
      step_fn: the compiled step, `(state, batch) -> (state, metrics)`.
      first_step: the number of the step the first call runs.
      now: the time source (seconds; tests pass a fake one).
    """

    def __init__(self, step_fn: Callable[[Any, Any], tuple[Any, Any]], first_step: int,
                 now: Callable[[], float] = time.perf_counter):
        self._fn = step_fn
        self._now = now
        self._next = first_step
        self.annotate = False  # set while a profile is captured: each dispatch is a StepTraceAnnotation
        self.device_s = 0.0  # total device seconds of the steps ready so far
        self.blocked_s = 0.0  # total seconds the loop waited in `wait` (and for other processes: `add_blocked`)
        self._ready_step = first_step - 1  # the newest step whose metrics are ready
        self._ready_at = -float("inf")
        self._recent: dict[int, float] = {}  # step -> when its metrics were ready (the last few steps)
        self._cond = threading.Condition()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._watch, name="lumen-step-clock", daemon=True)
        self._thread.start()

    def __call__(self, state: Any, batch: Any) -> tuple[Any, Any]:
        step, self._next = self._next, self._next + 1
        t0 = self._now()
        if self.annotate:
            with jax.profiler.StepTraceAnnotation("train_step", step_num=step):
                out = self._fn(state, batch)
        else:
            out = self._fn(state, batch)
        self.blocked_s += self._now() - t0  # the runtime may run the step before it returns
        self._queue.put((step, t0, out[1]))
        return out

    @property
    def dispatched(self) -> int:
        """The newest step dispatched."""
        return self._next - 1

    def _watch(self) -> None:
        while (item := self._queue.get()) is not None:
            step, dispatched, metrics = item
            try:
                jax.block_until_ready(metrics)
            except BaseException as e:  # noqa: BLE001 - the loop's own read of the metrics raises it
                self._error = e
            ready = self._now()
            with self._cond:
                self.device_s += ready - max(dispatched, self._ready_at)
                self._ready_step, self._ready_at = step, ready
                self._recent[step] = ready
                self._recent.pop(step - 8, None)
                self._cond.notify_all()

    def wait(self, step: int) -> None:
        """Blocks until step `step`'s metrics are ready; the seconds waited count as blocked."""
        t0 = self._now()
        with self._cond:
            while self._ready_step < step and self._error is None and self._thread.is_alive():
                self._cond.wait(timeout=1.0)
        self.blocked_s += self._now() - t0

    def between(self, step: int) -> float | None:
        """Seconds from step `step - 1`'s outputs being ready to step `step`'s (its device time and any
        wait of the device for the host before it), or None if either is unknown (not ready yet)."""
        with self._cond:
            if step - 1 in self._recent and step in self._recent:
                return self._recent[step] - self._recent[step - 1]
        return None

    def add_blocked(self, seconds: float) -> None:
        """Time the loop spent waiting for something other than its own work (other processes)."""
        self.blocked_s += seconds

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5.0)


@dataclasses.dataclass(frozen=True)
class Totals:
    """Running totals at one moment (seconds); the difference of two is an interval's."""

    wall: float
    excluded: float  # host work that is not the steps' (evaluation)
    blocked: float
    data: float
    stall: float
    device: float

    def __sub__(self, other: "Totals") -> "Totals":
        return Totals(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in dataclasses.fields(self)})

    def per_step(self, steps: int) -> dict[str, float]:
        """This interval's figures per step, as metrics.jsonl has them (see the module docstring)."""
        loop = self.wall - self.excluded
        # The steps' device times run between their readiness, which straddles the interval's ends
        # (by less than a step): an interval's device time is at most its wall time.
        return {"loop_time_s": loop / steps, "step_time_s": min(self.device, loop) / steps,
                "data_wait_s": self.data / steps,
                "checkpoint_stall_s": self.stall / steps,
                "host_overhead_s": max(0.0, loop - self.blocked - self.data - self.stall) / steps}

    def own_per_step(self, steps: int) -> float:
        """The loop's own seconds per step: its time but the waits for the device and other processes."""
        return max(0.0, self.wall - self.excluded - self.blocked) / steps


class LoopTimes:
    """The loop's clocks together: `now()` reads them all."""

    def __init__(self, data: TimedData, clock: StepClock, now: Callable[[], float] = time.perf_counter):
        self.data = data
        self.clock = clock
        self._now = now
        self.stall_s = 0.0  # checkpoint saves (Checkpointing)
        self.excluded_s = 0.0  # evaluation (Evaluation)

    def now(self) -> Totals:
        return Totals(wall=self._now(), excluded=self.excluded_s, blocked=self.clock.blocked_s,
                      data=self.data.wait_s, stall=self.stall_s, device=self.clock.device_s)
