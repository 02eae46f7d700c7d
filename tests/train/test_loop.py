"""The loop end to end, in process: one tiny run preempted by SIGINT and resumed, checked for the
time-based checkpoint schedule, `keep` / `keep_every` retention and the metrics each row carries."""

import json
import os
import signal
import time
import types

import pytest

from helpers.faults import IN_PROCESS
from helpers.metrics import read_metrics
from lumen_jax.checkpoint import manager as checkpoint_lib
from lumen_jax.train import hooks
from lumen_jax.train import cli as train_cli

STEPS, SIGINT_AFTER = 8, 4


def committed_steps(run_dir: str) -> list[int]:
    return sorted(int(d) for d in os.listdir(os.path.join(run_dir, "checkpoints")) if d.isdigit())


@pytest.fixture(scope="module")
def preempted_run(tmp_path_factory):
    """tiny.yaml with 3 layers and fp8 (`current`: the middle layer runs it, so `mfu_bf16` is logged),
    checkpoints every minute of a fake clock that advances a minute after each step, keep=2,
    keep_every=3; SIGINT after step 4, then the same command again, to step 8.

    The clock makes saves due from step 2 on: attempt 1 saves 2, 3, 4 and 5 (the step the signal
    stops at), attempt 2 restarts its clock and saves 7 and 8 (the last step)."""
    run_dir = str(tmp_path_factory.mktemp("loop") / "run")
    mp = pytest.MonkeyPatch()
    clock = [0.0]
    mp.setattr(checkpoint_lib, "time", types.SimpleNamespace(monotonic=lambda: clock[0],
                                                             perf_counter=time.perf_counter))
    attempt = [1]

    def fault_hooks(_run_dir):
        def after_step(step: int) -> None:
            clock[0] += 60.0
            if attempt[0] == 1 and step == SIGINT_AFTER:
                os.kill(os.getpid(), signal.SIGINT)
        return [after_step]

    mp.setattr(hooks, "fault_hooks", fault_hooks)
    args = ["--config", "configs/tiny.yaml", f"train.run_dir={run_dir}", f"train.steps={STEPS}",
            "log.every_steps=1", "model.num_layers=3", "model.fp8.recipe=current",
            "checkpoint.every_minutes=1", "checkpoint.keep=2", "checkpoint.keep_every=3", *IN_PROCESS]
    try:
        rcs = [train_cli.main(args)]
        after_first = committed_steps(run_dir)
        attempt[0] = 2
        rcs.append(train_cli.main(args))
    finally:
        mp.undo()
    return run_dir, rcs, after_first


def test_sigint_preempts_with_a_checkpoint_and_the_rerun_resumes(preempted_run):
    run_dir, rcs, after_first = preempted_run
    assert rcs == [train_cli.EXIT_PREEMPTED, train_cli.EXIT_OK]
    assert after_first[-1] == SIGINT_AFTER + 1  # the step that was running when the signal came
    starts = [json.loads(line) for line in open(os.path.join(run_dir, "events.jsonl"))]
    assert [e["resume_step"] for e in starts if e["event"] == "start"] == [0, SIGINT_AFTER + 1]


def test_every_minutes_and_keep_and_keep_every(preempted_run):
    """Saved: 2, 3, 4, 5, 7, 8. Kept: the 2 newest (keep) and every 3rd (keep_every) for good;
    the older ones were deleted after the newer were committed."""
    run_dir, _, after_first = preempted_run
    assert after_first == [3, 4, 5]
    assert committed_steps(run_dir) == [3, 7, 8]


def test_metrics_rows_carry_stall_skipped_total_and_mfu_bf16(preempted_run):
    run_dir, _, _ = preempted_run
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    saved_before = {3, 4, 5, 8}  # a save after the previous step of the same attempt stalled this interval
    for r in rows:
        assert r["skipped_total"] == 0 and r["skipped"] == 0, r
        assert (r["checkpoint_stall_s"] > 0) == (r["step"] in saved_before), r
        assert r["checkpoint_stall_s"] < r["loop_time_s"], r  # a part of the loop's time
        assert r["mfu"] > 0 and r["mfu_bf16"] > 0, r
    # Both from the same step time and FLOPs: their ratio is the ratio of the two peaks, every row.
    ratios = [r["mfu"] / r["mfu_bf16"] for r in rows]
    assert max(ratios) == pytest.approx(min(ratios), rel=1e-9), ratios
