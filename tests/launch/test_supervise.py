"""launch/supervise.py without a trainer: its accounting of steps and time lost (goodput), the exit
code it trusts, and its restart loop over a child that exits with given codes. (A real run under the
supervisor: tests/checkpoint/test_checkpoint.py and tests/runtime/test_multihost.py.)"""

import json
import os
import sys
import time

import pytest

from helpers.paths import load_script


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
