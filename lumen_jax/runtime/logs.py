"""Libraries' diagnostics go to `<run_dir>/library.log`, the terminal keeps lumen_jax's own lines.

A failed checkpoint write makes Orbax log from several threads and asyncio print "Event loop is
closed" tracebacks, hundreds of lines around the one line that says what happened. While the loop
runs (`library_output`), Python's `sys.stderr`, the logging handlers that write to it, uncaught
thread exceptions and unraisable exceptions go to the log file; lumen_jax prints its own warnings
with `console()`, the stderr of before. A write to the log that fails (the disk is full) is dropped.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import traceback
from typing import IO, Any, Iterator

LOG_NAME = "library.log"
_console: list[IO[str]] = []  # the terminal's stderr while library_output is active


def console() -> IO[str]:
    """Where lumen_jax's own warnings go: the terminal's stderr, also while library_output is active."""
    return _console[-1] if _console else sys.stderr


class _Log:
    """A text stream to the log file that never raises (a full disk drops the text)."""

    def __init__(self, path: str):
        self.path, self._file = path, None

    def write(self, text: str) -> int:
        try:
            if self._file is None:
                self._file = open(self.path, "a", encoding="utf-8")
            self._file.write(text)
        except (OSError, ValueError):
            pass
        return len(text)

    def flush(self) -> None:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            self._file.flush()

    def isatty(self) -> bool:
        return False

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            self._file.close()


@contextlib.contextmanager
def library_output(run_dir: str, name: str = "") -> Iterator[None]:
    """Sends libraries' stderr output to `<run_dir>/<name or library.log>` until the block ends (inside
    another such block: to that block's log)."""
    if _console:
        yield
        return
    terminal = sys.stderr
    log = _Log(os.path.join(run_dir, name or LOG_NAME))
    handlers = [h for name in ("", "absl") for h in logging.getLogger(name).handlers
                if isinstance(h, logging.StreamHandler) and h.stream in (terminal, sys.__stderr__)]
    previous = [h.setStream(log) for h in handlers]
    _console.append(terminal)
    sys.stderr = log
    try:
        yield
    finally:
        sys.stderr = terminal
        _console.pop()
        for h, stream in zip(handlers, previous):
            h.setStream(stream)
        log.close()
        # Orbax's asyncio loops are collected later, often at interpreter exit ("Event loop is closed"):
        # those unraisable exceptions go to the same log, not after our one-line error on the terminal.
        sys.unraisablehook = functools.partial(_log_unraisable, log.path)
        late = logging.getLogger("asyncio")  # "Task exception was never retrieved", logged at collection
        handler = logging.FileHandler(log.path, delay=True)
        handler.handleError = lambda record: None  # the run dir removed: dropped, like every failed write here
        late.handlers = [handler]
        late.propagate = False


def _log_unraisable(path: str, unraisable: Any, _open: Any = open) -> None:
    # `_open` bound now: at interpreter exit, when Orbax's loops are collected, the name `open` may be gone.
    try:
        with _open(path, "a") as f:
            f.write(f"{unraisable.err_msg or 'Exception ignored in'}: {unraisable.object!r}\n")
            traceback.print_exception(unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback, file=f)
    except Exception:  # noqa: BLE001 - the disk is full, the run dir removed, a module torn down: dropped
        pass
