"""SIGTERM/SIGINT become a flag the loop checks after each step and at the end of start-up.

A single process installs the handlers as soon as its config is read, before JAX is imported, so a
signal during start-up or compilation stops the run with exit code 75 too (before the first step:
nothing to save, the last checkpoint is where the rerun resumes). A start-up that has not ended
STARTUP_GRACE_S after the signal (a hang, a compile of minutes) is not waited for: one line, exit 75. With several processes they must
stop at the same step: JAX's preemption service owns SIGTERM (delivered to any one process, it
agrees on a step for all), SIGINT keeps Python's default, and `requested` asks the service.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

# How long a signal during start-up waits for start-up to end (then the loop stops cleanly) before the
# process exits: under the 30 s that SLURM and Kubernetes give between SIGTERM and SIGKILL.
STARTUP_GRACE_S = 20.0
EXIT_PREEMPTED = 75


class StopSignal:
    """The first SIGTERM/SIGINT sets `received`; a second one stops the process at once."""

    def __init__(self, multi: bool = False) -> None:
        self.received: int | None = None
        self._multi = multi
        self._started = False  # start-up over: the loop checks the flag after each step
        self._deadline: threading.Timer | None = None
        signals = () if multi else (signal.SIGTERM, signal.SIGINT)
        self._previous = {s: signal.signal(s, self._handle) for s in signals}

    def requested(self, step: int) -> bool:
        """Whether to checkpoint and stop after `step` (call after every step, on every process)."""
        if self._multi:
            from jax.experimental import multihost_utils

            if multihost_utils.reached_preemption_sync_point(step):
                self.received = signal.SIGTERM
        return self.received is not None

    def before_first_step(self) -> bool:
        """Whether a signal arrived during start-up (a single process; several agree at a step)."""
        self._started = True
        self._cancel_deadline()
        return not self._multi and self.received is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else ""

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is not None:  # a second signal: stop now, the checkpoint is not waited for
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.received = signum
        if not self._started:  # start-up may never reach the check (a hang deaf to the flag): bound it
            self._deadline = threading.Timer(STARTUP_GRACE_S, self._give_up)
            self._deadline.daemon = True
            self._deadline.start()

    def _give_up(self) -> None:
        # fd 2, not sys.stderr: during the loop that is library.log (runtime/logs.py)
        os.write(2, f"stopped: {self.name} during start-up, which had not ended {STARTUP_GRACE_S:g} s later; "
                    "exiting now: nothing was lost (no step was taken), rerun to resume\n".encode())
        os._exit(EXIT_PREEMPTED)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def restore(self) -> None:
        self._cancel_deadline()
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
