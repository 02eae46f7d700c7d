"""A command run under a pseudo-terminal, as a person's terminal runs it: what it wrote there."""

import fcntl
import os
import pty
import select
import struct
import subprocess
import termios

from helpers.paths import REPO


def run_in_pty(args: list[str], timeout_s: float = 300, stdout=None, columns: int = 120) -> tuple[int, str]:
    """(exit code, everything the process wrote to its terminal); `stdout`: a file for its stdout instead;
    `columns`: the terminal's width (0: one that reports none, as some CI terminals do)."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    proc = subprocess.Popen(args, stdin=follower, stdout=stdout or follower, stderr=follower, cwd=REPO,
                            close_fds=True)
    os.close(follower)
    out = b""
    try:
        while True:
            ready, _, _ = select.select([leader], [], [], timeout_s)
            if not ready:
                proc.kill()
                raise AssertionError(f"no output for {timeout_s}s; so far: {out[-2000:]!r}")
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the terminal closed: the process ended
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(leader)
    return proc.wait(timeout=60), out.decode("utf-8", "replace")
