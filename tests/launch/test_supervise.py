"""launch/supervise.py: its accounting of steps and time lost (goodput), the exit code it trusts, its
restart loop over a child that exits with given codes, SIGTERM/SIGINT passed to a real trainer (which
checkpoints; then the summary and exit 75), no orphan when it is killed, its bad arguments. (More runs
under the supervisor: tests/checkpoint/test_checkpoint.py and tests/runtime/test_multihost.py.)"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers.paths import REPO, load_script

# The supervisor starts its child with a preexec_fn (own process group, PR_SET_PDEATHSIG): a fork, which
# JAX, imported by conftest, warns about; the child execs at once.
pytestmark = pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")


def supervisor():
    """launch/supervise.py, imported afresh (a test may patch its module globals)."""
    return load_script("launch/supervise.py")


def test_supervisor_accounting():
    sup = supervisor()
    attempts = [sup.Attempt(pid=1, started=0.0, ended=10.0, returncode=-9),
                sup.Attempt(pid=2, started=11.0, ended=21.0, returncode=0)]
    events = ([{"pid": 1, "event": "start", "resume_step": 0, "time": 0.0}]
              + [{"pid": 1, "event": "step", "step": s, "time": 2.0 + s} for s in range(1, 7)]
              + [{"pid": 2, "event": "start", "resume_step": 4, "time": 11.0}]
              + [{"pid": 2, "event": "step", "step": s, "time": 9.0 + s} for s in range(5, 11)])
    interruptions, goodput = sup.account(attempts, events)
    assert [(i.cause, i.steps_lost) for i in interruptions] == [("killed by SIGKILL", 2)]
    assert interruptions[0].time_lost_s == pytest.approx(10.0 - 4 * 1.0)
    assert goodput == pytest.approx((4 * 1.0 + 6 * 1.0) / 21.0)


_CHILD = ("import os, sys; path, codes = sys.argv[1], sys.argv[2].split(','); "
          "n = os.path.getsize(path) if os.path.exists(path) else 0; open(path, 'a').write('x'); "
          "c = int(codes[n]); os.kill(os.getpid(), 9) if c < 0 else sys.exit(c)")


@pytest.mark.parametrize("codes, max_restarts, want_delays", [
    ([1, 75, 0], 5, [0.5, 1.0]),  # a crash and a preemption are restarted, with a doubling backoff
    ([2], 5, []), ([3], 5, []), ([4], 5, []),  # bad input, diverged, corruption: running again won't help
    ([1, -9, 75, 75, 0], 5, [0.5, 1.0, 2.0, 2.5]),  # the backoff stops doubling at max_backoff_s
    ([1, 1, 1, 1], 2, [0.5, 1.0]),  # --max-restarts
], ids=["1-75-0", "2", "3", "4", "capped", "max-restarts"])
def test_supervisor_restarts_on_1_and_75_and_stops_on_2_3_4(codes, max_restarts, want_delays, tmp_path,
                                                            monkeypatch, capsys):
    """The real `supervise` loop over a child that exits with `codes` in turn (-9: SIGKILLs itself);
    its sleeps are recorded, not slept."""
    sup = supervisor()
    delays = []
    monkeypatch.setattr(sup, "time", type("Clock", (), {"time": staticmethod(time.time),
                                                        "sleep": staticmethod(delays.append)}))
    counter = str(tmp_path / "attempts")
    rc = sup.supervise([sys.executable, "-c", _CHILD, counter, ",".join(map(str, codes))], str(tmp_path),
                       max_restarts=max_restarts, backoff_s=0.5, max_backoff_s=2.5)
    attempts = 1 + len(want_delays)
    assert os.path.getsize(counter) == attempts
    assert delays == want_delays
    last = codes[attempts - 1]
    assert rc == (last if last >= 0 else 1)
    out = capsys.readouterr()
    assert f"supervise: {attempts} attempt(s), {attempts - (last in (0, 2, 3, 4))} interruption(s)" in out.out, out
    if 75 in codes[:attempts - 1]:
        assert "ended (preempted (exit 75, checkpoint written)); restarting" in out.err
    report = json.load(open(tmp_path / "goodput.json"))  # what python -m lumen_jax.report shows
    assert [a["returncode"] for a in report["attempts"]] == codes[:attempts]
    assert len(report["interruptions"]) == attempts - (last in (0, 2, 3, 4))
    assert report["wall_s"] > 0 and 0 <= report["goodput"] <= 1


def _attempt_events(pid, resume, steps, t0, compile_s=10.0):
    """A trainer's events: start, `compile_s` of start-up and compilation, then one step a second."""
    return ([{"pid": pid, "event": "start", "resume_step": resume, "time": t0},
             {"pid": pid, "event": "compiled", "time": t0 + compile_s}]
            + [{"pid": pid, "event": "step", "step": s, "time": t0 + compile_s + i + 1}
               for i, s in enumerate(steps)])


@pytest.mark.parametrize("resumed_from, lost", [(5, 2), (0, 7)], ids=["step-5-committed", "step-5-not-committed"])
def test_supervisor_counts_steps_really_taken_and_compile_as_overhead(resumed_from, lost):
    # The case: killed after step 7, checkpoints every 5, metrics logged every 10.
    sup = supervisor()
    attempts = [sup.Attempt(pid=1, started=0.0, ended=18.0, returncode=-9, committed=resumed_from),
                sup.Attempt(pid=2, started=20.0, ended=20.0 + 10 + (10 - resumed_from), returncode=0)]
    events = (_attempt_events(1, 0, range(1, 8), 0.0)
              + _attempt_events(2, resumed_from, range(resumed_from + 1, 11), 20.0))
    interruptions, goodput = sup.account(attempts, events)
    assert [(i.cause, i.steps_lost) for i in interruptions] == [("killed by SIGKILL", lost)]
    assert interruptions[0].time_lost_s == pytest.approx(18.0 - (7 - lost) * 1.0)  # compile counts as lost
    assert goodput == pytest.approx(10 * 1.0 / attempts[-1].ended)  # 10 kept steps of 1 s


def test_supervisor_last_attempt_keeps_only_what_was_committed():
    sup = supervisor()
    attempts = [sup.Attempt(pid=1, started=0.0, ended=18.0, returncode=-9, committed=5)]
    interruptions, goodput = sup.account(attempts, _attempt_events(1, 0, range(1, 8), 0.0))
    assert [i.steps_lost for i in interruptions] == [2]
    assert goodput == pytest.approx(5 / 18.0)


def test_supervisor_trusts_process_0s_final_code_over_the_launchers():
    sup = supervisor()
    events = [{"event": "exit", "code": 2, "attempt": "7.1", "pid": 1, "time": 0.0}]
    assert sup.reported_exit(events, "7.1", 137) == 2  # srun: the worst code, a killed peer
    assert sup.reported_exit(events, "7.2", 137) == 137  # another attempt's event
    crash = [{**events[0], "code": 1}]
    assert sup.reported_exit(crash, "7.1", -9) == -9  # the launcher names the death


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.heavy
def test_sigterm_to_the_supervisor_reaches_the_trainer_which_checkpoints_then_the_summary_and_75(tmp_path):
    """What a person sees: `kill <supervisor>` while it runs a trainer."""
    from helpers.faults import IN_PROCESS, SMALL

    run = str(tmp_path / "run")
    train = [sys.executable, "-m", "lumen_jax.train", "--config", "configs/tiny.yaml", f"train.run_dir={run}",
             *SMALL, *[o for o in IN_PROCESS if not o.startswith("runtime.")], "train.steps=100000",
             "checkpoint.every_steps=0"]
    sup = subprocess.Popen([sys.executable, "launch/supervise.py", "--run-dir", run, "--", *train], cwd=REPO,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    events = os.path.join(run, "events.jsonl")
    _wait_for(lambda: os.path.exists(events) and '"step"' in open(events).read(), 300, "the trainer's first step")
    trainer = next(e["pid"] for e in supervisor().read_events(run) if e["event"] == "start")
    sup.send_signal(signal.SIGTERM)
    out, err = sup.communicate(timeout=120)
    assert sup.returncode == 75, err[-3000:]
    assert "supervise: 1 attempt(s), 1 interruption(s), final: preempted (exit 75, checkpoint written)" in out, out
    assert "supervise: goodput" in out
    assert "supervise: stopped by SIGTERM; attempt 1 ended (preempted" in err, err[-3000:]
    assert not _alive(trainer), "the trainer outlived its supervisor"
    steps = supervisor().committed_steps(run)
    assert steps and steps[-1] > 0, "no preemption checkpoint"


# A child that, on SIGTERM, writes its pid's marker and exits 75 (as the trainer does); it writes `ready` first.
_TRAPS = ("import os, signal, sys, time; d = sys.argv[1]; "
          "signal.signal(signal.SIGTERM, lambda *a: (open(os.path.join(d, 'got-sigterm'), 'w').write(str(os.getppid())), "
          "sys.exit(75))); open(os.path.join(d, 'ready'), 'w').write(str(os.getpid())); time.sleep(120); sys.exit(1)")


def _supervised(tmp_path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "launch/supervise.py", "--run-dir", str(tmp_path), *extra, "--",
                             sys.executable, "-c", _TRAPS, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_a_killed_supervisor_leaves_no_orphan(tmp_path):
    sup = _supervised(tmp_path)
    _wait_for(lambda: os.path.exists(tmp_path / "ready"), 60, "the child")
    child = int((tmp_path / "ready").read_text())
    sup.kill()  # SIGKILL: no handler runs; the child learns it from PR_SET_PDEATHSIG
    sup.communicate(timeout=30)
    _wait_for(lambda: not _alive(child), 30, "the orphan to stop")
    assert (tmp_path / "got-sigterm").exists(), "the child was not told to stop (SIGTERM) when its supervisor died"


def test_sigint_during_the_backoff_ends_supervision_with_75(tmp_path):
    crashed = tmp_path / "crashed"
    sup = subprocess.Popen([sys.executable, "launch/supervise.py", "--run-dir", str(tmp_path), "--backoff", "300",
                            "--", sys.executable, "-c", "import sys; open(sys.argv[1], 'w'); sys.exit(1)",
                            str(crashed)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(crashed.exists, 60, "the child's crash")
    time.sleep(1)  # the child has exited 1 and the 300 s backoff runs
    t0 = time.monotonic()
    sup.send_signal(signal.SIGINT)
    out, err = sup.communicate(timeout=60)
    assert time.monotonic() - t0 < 30, "the backoff was slept to its end"
    assert sup.returncode == 75, err
    assert "restarting in 60.0s" in err and "supervise: stopped by SIGINT" in err, err
    assert "supervise: 1 attempt(s), 1 interruption(s), final: exit code 1" in out, out


@pytest.mark.parametrize("bad, expected", [(["--max-restarts", "-1"], "--max-restarts=-1 must be >= 0"),
                                           (["--backoff", "-5"], "--backoff=-5.0 must be >= 0"),
                                           ([], "give the training command after --"),
                                           (["train.run_dir=elsewhere"], "the command trains in train.run_dir=elsewhere")])
def test_bad_arguments_are_one_line_exit_2(tmp_path, bad, expected):
    command = ["--", sys.executable, "-c", "pass"] if bad else []
    if bad[:1] == ["train.run_dir=elsewhere"]:  # goodput 0.0% of a run it did not watch, before
        bad, command = [], [*command, bad[0]]
    proc = subprocess.run([sys.executable, "launch/supervise.py", "--run-dir", str(tmp_path), *bad, *command],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and expected in lines[0], proc.stderr
    assert os.listdir(tmp_path) == []  # nothing ran
