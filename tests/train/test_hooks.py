"""The loop's hooks, one at a time, on fake steps (no compile): when each runs, what it adds to a
step's row and when it stops the run. The whole loop over them runs in tests/train/test_loop.py."""

import json
import os
import types

import jax
import numpy as np
import pytest

from lumen_jax.config import LogConfig
from lumen_jax.metrics.mfu import Peaks, Throughput
from lumen_jax.train import hooks as hooks_lib
from lumen_jax.train.hooks import (Checkpointing, CorruptionDetected, Diverged, Evaluation, Events, Hooks, Logging,
                                   NonFiniteGuard, Preempted, Preemption, SdcCheck, Stall, StepInfo)


def info(step: int, last: bool = False, loss: float = 1.0) -> StepInfo:
    return StepInfo(step=step, last=last, state=types.SimpleNamespace(params={"w": 0}), metrics={"loss": np.float32(loss), "skipped": np.int32(0)},
                    data_state={"position": step})


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


def test_evaluation_adds_its_values_and_its_time_is_not_the_steps():
    i = info(10)
    Evaluation(lambda state: {"eval_loss": 2.5})(i)
    assert i.row == {"eval_loss": 2.5} and i.host_s >= 0


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


def test_checkpointing_saves_when_due_and_hands_the_stall_to_the_next_row(tmp_path):
    ckpt, stall, events = FakeCheckpointer(saves_at={2}), Stall(), Events(str(tmp_path), enabled=True)
    hook = Checkpointing(ckpt, lambda data_state: {"data": data_state}, events, stall)
    hook(info(1))
    hook(info(2))
    assert ckpt.saved == [(2, {"data": {"position": 2}})]  # the meta of the step's data position
    assert stall.take() == 0.25 and stall.take() == 0.0
    assert events.count("checkpoint") == 1


class FakeSignal:
    name = "SIGTERM"

    def __init__(self, at: int):
        self.at = at

    def requested(self, step):
        return step >= self.at


def test_preemption_forces_the_save_then_stops_after_it(tmp_path):
    ckpt, stall = FakeCheckpointer(), Stall()
    preemption = Preemption(FakeSignal(at=3), ckpt)
    hooks = Hooks()
    hooks.add(preemption.check)
    hooks.add(Checkpointing(ckpt, lambda d: {}, Events(str(tmp_path), enabled=False), stall))
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
    stall = Stall()
    log = LogConfig(every_steps=3, tensorboard=False, progress=False)
    logging = Logging(log, str(tmp_path), throughput(), total_steps=7, start=0, attempt=1, enabled=True,
                      skipped_total=lambda: 0, stall=stall)
    for step in range(1, 8):
        i = info(step, last=step == 7, loss=float(step))
        if step == 5:
            i.row["eval_loss"] = 9.0
        if step == 2:
            stall.add(0.5)  # a save after step 2: counted in the next logged row
        logging(i)
    logging.close()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [3, 5, 6, 7]
    assert [r["loss"] for r in rows] == [3.0, 5.0, 6.0, 7.0]
    assert rows[1]["eval_loss"] == 9.0 and "eval_loss" not in rows[0]
    assert [r["checkpoint_stall_s"] for r in rows] == [0.5, 0.0, 0.0, 0.0]
    for r in rows:  # the figures derive from one step time
        assert r["tokens_per_sec"] == pytest.approx(1000 / r["step_time_s"])
        assert r["mfu"] == pytest.approx(r["tokens_per_sec"] / 2 * 6.0 / 1e4)
        assert r["hfu"] == pytest.approx(r["mfu"] * 8.0 / 6.0)
    assert logging.last["step_time_s"] == rows[-1]["step_time_s"]


def test_logging_leaves_hook_time_out_of_the_step_time(tmp_path, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(hooks_lib.time, "perf_counter", lambda: clock[0])
    logging = Logging(LogConfig(every_steps=2, jsonl=False, tensorboard=False, progress=False), str(tmp_path),
                      throughput(), total_steps=4, start=0, attempt=1, enabled=True, skipped_total=lambda: 0,
                      stall=Stall())
    clock[0] += 1.0
    logging(info(1))
    clock[0] += 1.0 + 3.0  # step 2 took 1 s, and an evaluation after it 3 s
    i = info(2)
    i.host_s = 3.0
    logging(i)
    assert logging.last["step_time_s"] == pytest.approx(1.0)


def test_nonfinite_guard_counts_one_step_late_and_raises_in_a_row():
    guard = NonFiniteGuard(3, "/ckpts")
    for step, skipped in enumerate([0, 1, 1, 0, 1, 1], start=1):
        guard.after_step(step, {"skipped": np.int32(skipped)})
    assert (guard.skipped_total, guard.in_a_row) == (3, 1)  # step 6 is checked with step 7's metrics
    guard.after_step(7, {"skipped": np.int32(1)})
    assert (guard.skipped_total, guard.in_a_row) == (4, 2)
    with pytest.raises(Diverged, match=r"3 steps in a row \(up to step 7\).*max_nonfinite_steps=3.*/ckpts"):
        guard.after_step(8, {"skipped": np.int32(0)})


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
