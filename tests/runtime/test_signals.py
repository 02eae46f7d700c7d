"""runtime/signals.py: a signal during start-up ends the process in bounded time."""

import signal
import subprocess
import sys
import time

from helpers.paths import REPO

# A start-up that never reaches its check of the flag: a sleep (Python resumes it after the handler).
HUNG_START_UP = ("import time; from lumen_jax.runtime import signals; signals.STARTUP_GRACE_S = 0.5; "
                 "stop = signals.StopSignal(); print('started', flush=True); {after}; time.sleep(60)")


def _start(after: str = "pass") -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HUNG_START_UP.format(after=after)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "started"
    return proc


def test_sigterm_during_a_hung_start_up_exits_75_within_the_grace():
    """Before: the flag waited for the end of start-up (17 minutes of a hang, then the OOM killer)."""
    proc = _start()
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 75, err
    [line] = err.strip().splitlines()
    assert line.startswith("stopped: SIGTERM during start-up, which had not ended 0.5 s later; exiting now"), line
    assert time.monotonic() - t0 < 10


def test_after_start_up_the_flag_waits_for_the_step():
    proc = _start("stop.before_first_step()")  # start-up over: the loop stops at its next step
    proc.send_signal(signal.SIGTERM)
    time.sleep(1.5)  # three times the grace
    assert proc.poll() is None
    proc.kill()
    proc.wait()
