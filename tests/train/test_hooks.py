"""The loop's hooks, one at a time, on fake steps (no compile): when each runs, what it adds to a
step's row and when it stops the run. The whole loop over them runs in tests/train/test_loop.py."""

import io
import json
import os
import types

import jax
import numpy as np
import pytest

from lumen_jax.config import LogConfig
from lumen_jax.metrics import timing, writers
from lumen_jax.metrics.mfu import Peaks, Throughput
from lumen_jax.metrics.timing import LoopTimes, TimedData
from lumen_jax.train import hooks as hooks_lib
from lumen_jax.train.hooks import (Checkpointing, CorruptionDetected, DeviceMemory, Diverged, Evaluation, Events, Hooks,
                                   Logging, NonFiniteGuard, Preempted, Preemption, SdcCheck, SlowSteps, StepInfo,
                                   Stragglers)


def info(step: int, last: bool = False, loss: float = 1.0) -> StepInfo:
    return StepInfo(step=step, last=last, state=types.SimpleNamespace(params={"w": 0}), metrics={"loss": np.float32(loss), "skipped": np.int32(0)},
                    data_state={"position": step})


class FakeClock:
    """The step clock's side the hooks read: totals, waits (recorded), the time between two steps."""

    def __init__(self):
        self.blocked_s = self.device_s = 0.0
        self.waited, self.intervals, self.annotate = [], {}, False

    def wait(self, step):
        self.waited.append(step)

    def add_blocked(self, seconds):
        self.blocked_s += seconds

    def between(self, step):
        return self.intervals.get(step)


class FakeTime:
    def __init__(self, t=100.0):
        self.t = t

    def __call__(self):
        return self.t


def loop_times(now=None) -> LoopTimes:
    return LoopTimes(TimedData(iter(())), FakeClock(), now=now or FakeTime())


def test_hooks_run_every_n_steps_and_at_the_last_in_the_order_added():
    calls = []
    hooks = Hooks()
    hooks.add(lambda i: calls.append(("each", i.step)))
    hooks.add(lambda i: calls.append(("third", i.step)), every=3, at_last=True)
    hooks.add(lambda i: calls.append(("never", i.step)), every=0)
    for step in range(1, 6):
        hooks(info(step, last=step == 5))
    assert calls == [("each", 1), ("each", 2), ("each", 3), ("third", 3), ("each", 4), ("each", 5), ("third", 5)]


def test_events_hook_writes_a_step_event(tmp_path):
    events = Events(str(tmp_path), enabled=True)
    events(info(7))
    [row] = [json.loads(line) for line in open(tmp_path / "events.jsonl")]
    assert (row["event"], row["step"]) == ("step", 7)
    assert events.count("step") == 1
    Events(str(tmp_path / "other"), enabled=False)(info(1))  # another process: writes nothing
    assert not (tmp_path / "other").exists()


def test_sdc_check_raises_naming_the_step_and_the_array(monkeypatch):
    monkeypatch.setattr(hooks_lib, "find_divergent_replicas", lambda mesh, params: [])
    SdcCheck(mesh=None)(info(4))  # replicas agree: nothing happens
    monkeypatch.setattr(hooks_lib, "find_divergent_replicas", lambda mesh, params: ["params/w: device 3", "b"])
    with pytest.raises(CorruptionDetected, match=r"at step 4: params/w: device 3 \(and 1 more\)"):
        SdcCheck(mesh=None)(info(4))


def test_evaluation_adds_its_values_and_its_time_is_not_the_steps(monkeypatch):
    clock = FakeTime()
    monkeypatch.setattr(hooks_lib.time, "perf_counter", clock)
    times = loop_times()

    def evaluate(state):
        clock.t += 3.0
        return {"eval_loss": 2.5}

    i = info(10)
    Evaluation(evaluate, times)(i)
    assert i.row == {"eval_loss": 2.5} and times.excluded_s == pytest.approx(3.0)


class FakeCheckpointer:
    directory = "/ckpts"

    def __init__(self, saves_at=()):
        self.saves_at, self.saved, self.waited, self.forced = set(saves_at), [], 0, []

    def maybe_save(self, step, state, meta, *, last, force=False):
        self.forced.append(force)
        if step in self.saves_at or force:
            self.saved.append((step, meta()))
            return 0.25
        return None

    def wait(self):
        self.waited += 1


def test_checkpointing_saves_when_due_and_adds_the_stall_to_the_loops_times():
    ckpt, times = FakeCheckpointer(saves_at={2}), loop_times()
    hook = Checkpointing(ckpt, lambda data_state: {"data": data_state}, times)
    hook(info(1))
    assert times.stall_s == 0.0
    hook(info(2))
    assert ckpt.saved == [(2, {"data": {"position": 2}})]  # the meta of the step's data position
    assert times.stall_s == 0.25


class FakeSignal:
    name = "SIGTERM"

    def __init__(self, at: int):
        self.at = at

    def requested(self, step):
        return step >= self.at


def test_preemption_forces_the_save_then_stops_after_it(tmp_path):
    ckpt = FakeCheckpointer()
    preemption = Preemption(FakeSignal(at=3), ckpt)
    hooks = Hooks()
    hooks.add(preemption.check)
    hooks.add(Checkpointing(ckpt, lambda d: {}, loop_times()))
    hooks.add(preemption.stop)
    hooks(info(2))
    assert ckpt.saved == [] and ckpt.forced == [False]
    with pytest.raises(Preempted, match=r"signal SIGTERM after step 3; checkpoint written to /ckpts"):
        hooks(info(3))
    assert [s for s, _ in ckpt.saved] == [3] and ckpt.waited == 1  # saved, and the write waited for


def throughput() -> Throughput:
    return Throughput(tokens_per_step=1000, num_devices=2, flops_per_token=6.0, hw_flops_per_token=8.0,
                      peaks=Peaks(per_device=1e4, source="test", bf16_per_device=None))


def test_logging_writes_every_n_the_last_and_evaluated_steps(tmp_path):
    times = loop_times()
    log = LogConfig(every_steps=3, tensorboard=False, progress=False)
    logging = Logging(log, str(tmp_path), throughput(), total_steps=7, start=0, attempt=1, enabled=True,
                      skipped_total=lambda: 0, times=times)
    for step in range(1, 8):
        times._now.t += 1.0  # a second per step
        i = info(step, last=step == 7, loss=float(step))
        if step == 5:
            i.row["eval_loss"] = 9.0
        if step == 2:
            times.stall_s += 0.5  # a save after step 2: counted in the next logged row
        logging(i)
    logging.close()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [3, 5, 6, 7]
    assert [r["loss"] for r in rows] == [3.0, 5.0, 6.0, 7.0]
    assert rows[1]["eval_loss"] == 9.0 and "eval_loss" not in rows[0]
    assert [r["checkpoint_stall_s"] for r in rows] == pytest.approx([0.5 / 3, 0.0, 0.0, 0.0])  # per step
    assert times.clock.waited == [3, 5, 6, 7]  # each logged step's read of its metrics, timed
    for r in rows:  # the figures derive from one step time
        assert r["loop_time_s"] == pytest.approx(1.0)
        assert r["tokens_per_sec"] == pytest.approx(1000 / r["loop_time_s"])
        assert r["mfu"] == pytest.approx(r["tokens_per_sec"] / 2 * 6.0 / 1e4)
        assert r["hfu"] == pytest.approx(r["mfu"] * 8.0 / 6.0)
    assert logging.last["loop_time_s"] == rows[-1]["loop_time_s"]


def test_logging_says_where_the_time_went_per_step(tmp_path):
    """Two steps in 5 s, 1 s of it an evaluation: 2 s per step; the device worked 1.5 s per step, the
    loop waited 2 s for it, 1 s for data and 0.4 s for a checkpoint: 0.6 s of other host work in all."""
    times = loop_times()
    logging = Logging(LogConfig(every_steps=2, jsonl=False, tensorboard=False, progress=False), str(tmp_path),
                      throughput(), total_steps=4, start=0, attempt=1, enabled=True, skipped_total=lambda: 0,
                      times=times)
    logging(info(1))
    times._now.t += 5.0
    times.excluded_s += 1.0
    times.clock.device_s, times.clock.blocked_s, times.data.wait_s, times.stall_s = 3.0, 2.0, 1.0, 0.4
    logging(info(2))
    assert {k: logging.last[k] for k in ("loop_time_s", "step_time_s", "data_wait_s", "checkpoint_stall_s",
                                         "host_overhead_s")} == pytest.approx(
        {"loop_time_s": 2.0, "step_time_s": 1.5, "data_wait_s": 0.5, "checkpoint_stall_s": 0.2,
         "host_overhead_s": 0.3})
    assert logging.last["tokens_per_sec"] == pytest.approx(1000 / 2.0)  # from the loop's time, not the device's


def test_the_progress_bar_shows_the_data_wait_above_5_percent_and_the_straggler():
    def drawn(row: dict) -> str:
        out = io.StringIO()
        with writers.Progress(10, file=out) as bar:
            bar.update(2, row)
        return out.getvalue().split("\r")[-1]  # closing draws the bar's final state

    assert "data wait" not in drawn({"loss": 2.0, "loop_time_s": 1.0, "data_wait_s": 0.04})
    shown = drawn({"loss": 2.0, "loop_time_s": 1.0, "data_wait_s": 0.25, "straggler": 1})
    assert "data wait 25%" in shown and "straggler: process 1" in shown, shown


def test_slow_steps_are_events_with_their_time_and_the_median(tmp_path):
    """Steps of 1 s, one of 5 s and one of 3.5 s of which 2 s were a checkpoint save in the hooks
    before it (expected: left out): only the 5 s step is slow, judged one step late."""
    times, events = loop_times(), Events(str(tmp_path), enabled=True)
    slow = SlowSteps(2.0, events, times, min_history=3)
    seconds = {2: 1.0, 3: 1.0, 4: 1.0, 5: 5.0, 6: 1.0, 7: 3.5, 8: 1.0}
    times.clock.intervals = seconds
    for step in range(1, 10):
        slow(info(step))
        if step == 5:
            times.stall_s += 2.0  # the checkpoint after step 6 (its hooks run before step 7 starts)
    rows = [json.loads(line) for line in open(tmp_path / "events.jsonl")]
    assert [(r["event"], r["step"], r["step_time_s"], r["median_s"]) for r in rows] == [("slow_step", 5, 5.0, 1.0)]
    assert list(slow.history) == [1.0, 1.0, 1.0, 5.0, 1.0, 1.5, 1.0]


def test_a_straggler_is_named_when_its_own_time_is_the_step(tmp_path, monkeypatch):
    """Own seconds per step of 3 processes: 0.05, 0.9 and 0.06 of a 1 s step: process 1 is named; when
    every process's own time is small (all wait for the device), none is, whatever the ratio."""
    gathered = {}
    monkeypatch.setattr(hooks_lib.distributed, "gather_json", lambda value, to_all: gathered["next"])
    times, events = loop_times(), Events(str(tmp_path), enabled=True)
    stragglers = Stragglers(2.0, events, times, start=0)
    gathered["next"] = [[0.05, 1.0], [0.9, 1.0], [0.06, 1.0]]
    i = info(10)
    stragglers(i)
    gathered["next"] = [[0.005, 1.0], [0.03, 1.0]]  # 6x, but 3% of the step: the devices set the pace
    j = info(20)
    stragglers(j)
    rows = [json.loads(line) for line in open(tmp_path / "events.jsonl")]
    assert [(r["event"], r["step"], r["process"], r["own_s"], r["others_s"]) for r in rows] == [
        ("straggler", 10, 1, 0.9, pytest.approx(0.055))]
    assert i.row == {"straggler": 1} and j.row == {}


def test_device_memory_reports_the_largest_peak_where_devices_report_memory():
    class Device:
        def __init__(self, peak):
            self.peak = peak

        def memory_stats(self):
            return None if self.peak is None else {"peak_bytes_in_use": self.peak, "bytes_in_use": 1}

    assert not DeviceMemory.reported([Device(None)])  # XLA:CPU: no hook
    devices = [Device(3 << 20), Device(5 << 20)]
    assert DeviceMemory.reported(devices)
    i = info(10)
    DeviceMemory(devices)(i)
    assert i.row == {"peak_bytes_in_use": 5 << 20}


def test_hooks_close_each_object_once_the_last_added_first():
    closed = []

    class Closing:
        def __init__(self, name):
            self.name = name

        def __call__(self, info):
            pass

        def check(self, info):
            pass

        def close(self):
            closed.append(self.name)

    a, b = Closing("a"), Closing("b")
    hooks = Hooks().add(a).add(a.check).add(lambda i: None).add(b)
    hooks.close()
    assert closed == ["b", "a"]


def test_nonfinite_guard_counts_one_step_late_and_raises_in_a_row():
    guard = NonFiniteGuard(3, "/ckpts")
    for step, skipped in enumerate([0, 1, 1, 0, 1, 1], start=1):
        guard.after_step(step, {"skipped": np.int32(skipped)})
    assert (guard.skipped_total, guard.in_a_row) == (3, 1)  # step 6 is checked with step 7's metrics
    guard.after_step(7, {"skipped": np.int32(1)})
    assert (guard.skipped_total, guard.in_a_row) == (4, 2)
    with pytest.raises(Diverged, match=r"3 steps in a row \(up to step 7\).*max_nonfinite_steps=3.*/ckpts"):
        guard.after_step(8, {"skipped": np.int32(0)})


def test_nonfinite_guard_refuses_a_run_whose_every_step_was_skipped():
    """Fewer steps than max_nonfinite_steps, all skipped: the last step is checked at once and the run is
    not "done" (nor its state saved: the guard runs before the checkpoint hook)."""
    def run(skips: list[int]) -> NonFiniteGuard:
        guard = NonFiniteGuard(20, "/ckpts")
        for step, skipped in enumerate(skips, start=1):
            guard(StepInfo(step=step, last=step == len(skips), state=None, metrics={"skipped": np.int32(skipped)},
                           data_state={}))
        return guard

    with pytest.raises(Diverged, match=r"every step of this run \(3, up to step 3\).*nothing was trained"):
        run([1, 1, 1])
    assert run([1, 1, 0]).skipped_total == 2  # one update is enough to be a run
    assert run([0, 1, 1]).skipped_total == 2


def test_fault_hooks_only_with_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv("LUMEN_FAULT_SIGKILL_AFTER_STEPS", raising=False)
    monkeypatch.delenv("LUMEN_FAULT_PROCESS", raising=False)
    assert hooks_lib.fault_hooks(str(tmp_path)) == []
    monkeypatch.setenv("LUMEN_FAULT_SIGKILL_AFTER_STEPS", "5,8")
    [kill] = hooks_lib.fault_hooks(str(tmp_path))
    kill(4)  # not a listed step: nothing happens
    assert not os.listdir(tmp_path)
    monkeypatch.setenv("LUMEN_FAULT_PROCESS", str(jax.process_index() + 1))  # another process's
    assert hooks_lib.fault_hooks(str(tmp_path)) == []
