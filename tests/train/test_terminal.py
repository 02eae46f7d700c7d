"""What a person sees: `python -m lumen_jax.train` under a pseudo-terminal draws the progress bar
(step, loss, tokens/s) on the terminal, and the library log holds none of it."""

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios

from helpers.paths import REPO



def run_in_pty(args: list[str], timeout_s: float = 300) -> tuple[int, str]:
    """(exit code, everything the process wrote to its terminal)."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # a 120-column terminal
    proc = subprocess.Popen(args, stdin=follower, stdout=follower, stderr=follower, cwd=REPO, close_fds=True)
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


def test_progress_bar_reaches_the_terminal_not_the_log(tmp_path):
    run_dir = tmp_path / "run"
    code, out = run_in_pty([sys.executable, "-m", "lumen_jax.train", "--config", "configs/tiny.yaml",
                            "train.steps=6", "optim.warmup_steps=2", "log.every_steps=3", "log.tensorboard=false", f"train.run_dir={run_dir}"])
    assert code == 0, out[-3000:]
    assert "6/6" in out and "tok/s" in out and "loss " in out, out[-3000:]
    assert "done: step 6 loss" in out
    log = run_dir / "library.log"
    logged = log.read_text() if log.exists() else ""
    assert "tok/s" not in logged and "step/s" not in logged, logged[-2000:]
