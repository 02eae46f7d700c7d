"""SIGTERM/SIGINT become a flag the loop checks after each step and at the end of start-up.

A single process installs the handlers as soon as its config is read, before JAX is imported, so a
signal during start-up or compilation stops the run with exit code 75 too (before the first step:
nothing to save, the last checkpoint is where the rerun resumes). With several processes they must
stop at the same step: JAX's preemption service owns SIGTERM (delivered to any one process, it
agrees on a step for all), SIGINT keeps Python's default, and `requested` asks the service.
"""

from __future__ import annotations

import os
import signal
from typing import Any


class StopSignal:
    """The first SIGTERM/SIGINT sets `received`; a second one stops the process at once."""

    def __init__(self, multi: bool = False) -> None:
        self.received: int | None = None
        self._multi = multi
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
        return not self._multi and self.received is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else ""

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is not None:  # a second signal: stop now, the checkpoint is not waited for
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.received = signum

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
