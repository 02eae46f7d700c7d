"""`python -m lumen_jax.report` on hand-written run directories: what it reads (the newest row of a
step, a torn last line, restarts and interruptions), and bad input in one line with exit 2 and
nothing written. Real runs drawn, one and two overlaid: tests/train/test_diagnostics.py."""

import json
import os
import subprocess
import sys

import pytest

from helpers.faults import snapshot
from helpers.paths import REPO
from lumen_jax import report


ROWS = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]


def write_run(path, rows, events=(), goodput=None, torn=False):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
        if torn:
            f.write('{"step": 9, "loss": 1.')  # a kill mid-write
    with open(os.path.join(path, "events.jsonl"), "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in events)
    if goodput is not None:
        with open(os.path.join(path, "goodput.json"), "w") as f:
            json.dump(goodput, f)
    return str(path)


def attempt(key, resume, steps):
    return ([{"event": "start", "attempt": key, "resume_step": resume, "time": 0}]
            + [{"event": "step", "attempt": key, "step": s, "time": s} for s in steps])


def command(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lumen_jax.report", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60)


def test_the_reader_keeps_a_steps_newest_row_and_skips_a_torn_last_line(tmp_path):
    rows = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.5}, {"step": 2, "loss": 2.4, "attempt": 2},
            {"step": 3, "loss": 2.0, "attempt": 2}]
    run = report.read_run(write_run(tmp_path / "a", rows, torn=True))
    assert [(r["step"], r["loss"]) for r in run.rows] == [(1, 3.0), (2, 2.4), (3, 2.0)]
    assert run.series("loss") == ([1, 2, 3], [3.0, 2.4, 2.0])
    assert run.notes == ["metrics.jsonl: its last line is incomplete (skipped)"]


def test_restarts_and_interruptions_come_from_the_events_and_the_supervisor(tmp_path):
    events = attempt("a.1", 0, range(1, 8)) + attempt("a.2", 5, range(6, 13)) + attempt("a.3", 10, range(11, 15))
    rows = [{"step": s, "loss": 1.0} for s in range(1, 15)]
    plain = report.read_run(write_run(tmp_path / "plain", rows, events))
    assert plain.restarts() == [5, 10]
    assert plain.interruptions() == [(7, "interrupted"), (12, "interrupted")]  # the last step each reached
    goodput = {"goodput": 0.8, "wall_s": 100.0, "attempts": [{}, {}, {}],
               "interruptions": [{"attempt": 0, "cause": "killed by SIGKILL", "steps_lost": 2, "time_lost_s": 9.0},
                                 {"attempt": 1, "cause": "preempted (exit 75, checkpoint written)", "steps_lost": 2,
                                  "time_lost_s": 4.0}]}
    supervised = report.read_run(write_run(tmp_path / "supervised", rows, events, goodput))
    assert supervised.interruptions() == [(7, "killed by SIGKILL"), (12, "preempted (exit 75, checkpoint written)")]
    lines = report.summary(supervised)
    assert "goodput 80.0% of 100 s, 3 attempt(s)" in lines
    assert "  attempt 1: killed by SIGKILL, 2 steps and 9 s lost" in lines


def test_runs_are_named_by_folder_or_by_path_where_folders_share_a_name():
    assert report.labels(["runs/a", "runs/b/"]) == ["a", "b"]
    assert report.labels(["x/run", "y/run", "z"]) == ["x/run", "y/run", "z"]


def test_an_older_run_without_the_timing_keys_is_drawn(tmp_path):
    """metrics.jsonl of an earlier version: loss, lr and tokens/s only, no events: the panels it has."""
    run = write_run(tmp_path / "old", [{"step": s, "loss": 5.0 / s, "lr": 1e-3, "tokens_per_sec": 100.0}
                                       for s in range(1, 6)])
    os.remove(os.path.join(run, "events.jsonl"))
    out = str(tmp_path / "old.png")
    assert report.main([run, "--out", out]) == 0
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("case", ["no directory", "no metrics", "corrupt line", "no folder for --out",
                                  "not a png", "unknown option", "html over the config", "step event without step",
                                  "resume step not a number", "slow step without its time", "goodput without wall_s"])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, case):
    good = write_run(tmp_path / "good", [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}])
    out = str(tmp_path / "report.png")
    with open(out, "wb") as f:
        f.write(b"an earlier report")
    args, named = {
        "no directory": ([str(tmp_path / "missing"), "--out", out], str(tmp_path / "missing")),
        "no metrics": ([str(tmp_path), "--out", out], "has no metrics.jsonl"),
        "corrupt line": ([write_run(tmp_path / "bad", [{"step": 1}]), "--out", out], "line 1"),
        "no folder for --out": ([good, "--out", str(tmp_path / "nope" / "r.png")], "nope"),
        "not a png": ([good, "--out", str(tmp_path / "r.pdf")], "must end in .png"),
        "unknown option": ([good, "--outt", out], "unrecognized arguments: --outt"),
        # the run's config.json was replaced by the page
        "html over the config": ([good, "--out", out, "--html", os.path.join(good, "config.json")],
                                 "must end in .html"),
        "step event without step": ([write_run(tmp_path / "ev1", ROWS, [*attempt(0, 0, [1]), {"event": "step"}]),
                                     "--out", out], "events.jsonl line 3: a 'step' event has no 'step'"),
        "resume step not a number": ([write_run(tmp_path / "ev2", ROWS, [{"event": "start", "resume_step": "abc"}]),
                                      "--out", out], "line 1: a 'start' event has resume_step='abc', not a int"),
        "slow step without its time": ([write_run(tmp_path / "ev3", ROWS, [{"event": "slow_step", "step": 2}]),
                                        "--out", out], "a 'slow_step' event has no 'step_time_s'"),
        "goodput without wall_s": ([write_run(tmp_path / "ev4", ROWS, attempt(0, 0, [1, 2]), goodput={
            "goodput": 0.9, "attempts": [], "interruptions": []}), "--out", out], "goodput.json: has no 'wall_s'"),
    }[case]
    with open(os.path.join(good, "config.json"), "w") as f:
        f.write("{}")
    if case == "corrupt line":  # a line in the middle that is not JSON: not a torn write
        path = os.path.join(tmp_path, "bad", "metrics.jsonl")
        lines = open(path).read()
        open(path, "w").write("{not json\n" + lines)
    before = snapshot(str(tmp_path))
    proc = command(*args)
    assert proc.returncode == 2, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], proc.stderr
    assert snapshot(str(tmp_path)) == before  # the earlier report and the runs untouched, nothing new
