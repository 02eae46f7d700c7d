"""A tiny trained run directory shared by the bad-input and fault tests, and what they check on disk.

`trained_run(path)` trains configs/tiny.yaml in-process for RUN_STEPS steps with a checkpoint at the
end (small shapes, a constant schedule so that runs of other lengths reuse the compiled step).
"""

import contextlib
import errno
import hashlib
import os
import signal
import subprocess

import pytest

from helpers.paths import REPO
from lumen_jax.train import cli as train_cli

RUN_STEPS = 2
# `train.cli.main` in this process: the device count and compilation cache conftest.py set are left as
# they are; no progress bar, no TensorBoard.
IN_PROCESS = ["runtime.cpu_devices=0", "runtime.compilation_cache_dir=", "log.progress=false",
              "log.tensorboard=false"]
# tiny.yaml's schedule pinned to 8 steps with a warm-up of 4, as tests/runtime/test_multihost.py's COMMON:
# the training subprocesses of tiny.yaml that add it compile one init and one step between them (served
# by `runtime.compilation_cache_dir`'s persistent cache), whatever their train.steps.
SUBPROCESS_SCHEDULE = ["optim.decay_steps=8", "optim.warmup_steps=4"]
SMALL = ["data.seq_len=32", "data.global_batch_size=8", "optim.schedule=constant", "optim.warmup_steps=0",
         "log.every_steps=1", f"checkpoint.every_steps={RUN_STEPS}"]


def args(run_dir: str, *overrides: str, config: str | None = "configs/tiny.yaml") -> list[str]:
    """The CLI arguments of the shared run (`train.run_dir=run_dir`), then `overrides`."""
    head = ["--config", os.path.join(REPO, config)] if config else []
    return [*head, f"train.run_dir={run_dir}", *SMALL, f"train.steps={RUN_STEPS}", *IN_PROCESS, *overrides]


def trained_run(run_dir: str) -> str:
    rc = train_cli.main(args(run_dir))
    assert rc == 0, f"the shared run did not train: exit {rc}"
    return run_dir


def snapshot(path: str) -> dict[str, str]:
    """Every file and folder under `path` (or the file itself) with its bytes' hash."""
    if not os.path.exists(path):
        return {}
    if os.path.isfile(path):
        return {".": hashlib.sha256(open(path, "rb").read()).hexdigest()}
    out = {}
    for root, dirs, files in os.walk(path):
        for d in dirs:
            out[os.path.relpath(os.path.join(root, d), path) + "/"] = "dir"
        for f in files:
            full = os.path.join(root, f)
            out[os.path.relpath(full, path)] = hashlib.sha256(open(full, "rb").read()).hexdigest()
    return out


@contextlib.contextmanager
def tmpfs(path: str, size_bytes: int, read_only: bool = False):
    """Mounts a tmpfs of `size_bytes` at `path` (yields True), or yields False where mounting is not allowed."""
    os.makedirs(path, exist_ok=True)
    opts = f"size={size_bytes}" + (",ro" if read_only else "")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", path],
                             capture_output=True).returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", path], capture_output=True)


def fill(path: str) -> None:
    """Writes zeros into `path/fill` until the filesystem is full."""
    with open(os.path.join(path, "fill"), "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e


def run_group(cmd: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """Runs `cmd` in its own session; on timeout kills the whole group (launchers and their children)
    and fails the test."""
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout}s:\n{out[-2000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
