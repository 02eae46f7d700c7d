"""Run `python -m lumen_jax.train` as N processes on this machine, each with its own CPU devices.

    python launch/local.py --num-processes 2 --devices-per-process 4 -- \\
        --config configs/tiny.yaml mesh.fsdp=8 train.steps=20

For development and tests of multi-process runs without a cluster. Everything after `--` goes to
every process's `lumen_jax.train`; local.py appends `runtime.platform=cpu runtime.cpu_devices=D` and
sets JAX_COORDINATOR_ADDRESS (127.0.0.1 and a port free at start-up), JAX_NUM_PROCESSES and
JAX_PROCESS_ID. Each process is one emulated node (LUMEN_NODE=local-<i>).

Logs: `<run_dir>/logs/process-<i>.log` for each process (or --log-dir), appended to by each launch;
process 0 also on the console, without gloo's `[Gloo]` line per connection.

Failure: when a process fails, the others stop by themselves within `distributed.heartbeat_timeout_s`
(JAX's coordination service); local.py waits that long plus --grace seconds, then kills what is left.
Its exit code is the first failing process's, and a process killed by a signal makes local.py end by
the same signal, so `launch/supervise.py` restarts the whole job as it would one process. SIGTERM or
SIGINT to local.py is passed to every process as SIGTERM (they agree on a step, write a checkpoint and
exit 75); a second one kills them. The processes die with local.py (PR_SET_PDEATHSIG on Linux).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # run as a script from anywhere: lumen_jax.config (no JAX import) is needed

from lumen_jax.config import ConfigError  # noqa: E402
from lumen_jax.config.commands import CommandParser  # noqa: E402
from lumen_jax.config.checks import MAX_CPU_DEVICES  # noqa: E402
from lumen_jax.config.files import load_config  # noqa: E402
from lumen_jax.train.cli import parse_args as parse_train_args, run_dir_for  # noqa: E402

MAX_DEVICES_PER_PROCESS = MAX_CPU_DEVICES  # emulated CPU devices: XLA starts a thread pool per device


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when local.py dies, so no process outlives a killed launcher."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _describe(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


GLOO = b"[Gloo]"  # gloo prints a line per connection: kept in the log, not shown on the console


def _tee(src: IO[bytes], log: IO[bytes]) -> None:
    """Copies process 0's output to its log and the console, as it comes (progress bars included), all
    but gloo's lines on the console."""
    out = sys.stdout.buffer
    pending = b""  # a line so far that may still turn out to be gloo's
    while chunk := os.read(src.fileno(), 65536):
        log.write(chunk)
        log.flush()
        *lines, pending = (pending + chunk).split(b"\n")
        shown = b"".join(line + b"\n" for line in lines if not line.startswith(GLOO))
        if not (GLOO.startswith(pending[:len(GLOO)]) and (pending.startswith(GLOO) or len(pending) < len(GLOO))):
            shown, pending = shown + pending, b""  # a progress bar's line, written as it comes
        out.write(shown)
        out.flush()
    out.write(b"" if pending.startswith(GLOO) else pending)
    out.flush()


def launch(train_args: Sequence[str], num_processes: int, devices_per_process: int, log_dir: str,
           wait_s: float) -> int:
    """Starts the processes, waits for them, returns the job's exit code (negative: killed by a signal)."""
    os.makedirs(log_dir, exist_ok=True)
    port = free_port()
    procs, logs = [], []
    for i in range(num_processes):
        env = {**os.environ, "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
               "JAX_NUM_PROCESSES": str(num_processes), "JAX_PROCESS_ID": str(i), "LUMEN_NODE": f"local-{i}",
               "PYTHONUNBUFFERED": "1"}
        log = open(os.path.join(log_dir, f"process-{i}.log"), "ab")  # a restarted job appends
        log.write(f"=== launch/local.py: process {i} of {num_processes}, {time.ctime()} ===\n".encode())
        log.flush()
        cmd = [sys.executable, "-m", "lumen_jax.train", *train_args, "runtime.platform=cpu",
               f"runtime.cpu_devices={devices_per_process}"]
        procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE if i == 0 else log, stderr=subprocess.STDOUT,
                                      start_new_session=True, preexec_fn=_die_with_parent))
        logs.append(log)
    tee = threading.Thread(target=_tee, args=(procs[0].stdout, logs[0]), daemon=True)
    tee.start()

    signals = []

    def forward(signum: int, frame: object) -> None:
        signals.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM if len(signals) == 1 else signal.SIGKILL)

    ended: dict[int, tuple[float, int]] = {}  # process -> (when, exit code), noted the moment it ends

    def wait(i: int) -> None:
        code = procs[i].wait()
        ended[i] = (time.monotonic(), code)

    waiters = [threading.Thread(target=wait, args=(i,), daemon=True) for i in range(num_processes)]
    for w in waiters:
        w.start()
    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    first_failure: tuple[int, int, float] | None = None  # (process, code, time)
    reported, killed = set(), set()
    try:
        while len(reported) < num_processes:
            for i in sorted(set(ended) - reported, key=lambda i: ended[i]):
                reported.add(i)
                when, code = ended[i]
                after = (f", {when - first_failure[2]:.1f}s after process {first_failure[0]}"
                         if first_failure else "")
                print(f"local: process {i} ended ({_describe(code)}{after})", file=sys.stderr, flush=True)
                if code != 0 and first_failure is None:
                    first_failure = (i, code, when)
                    if i != 0:
                        _print_tail(os.path.join(log_dir, f"process-{i}.log"))
            if first_failure and time.monotonic() - first_failure[2] > wait_s:
                for i, p in enumerate(procs):
                    if i not in ended and i not in killed:
                        killed.add(i)
                        print(f"local: process {i} still running {wait_s:.0f}s after process {first_failure[0]} "
                              "failed; killing it", file=sys.stderr, flush=True)
                        p.kill()
            time.sleep(0.05)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        tee.join(timeout=5)
        for log in logs:
            log.close()
    return first_failure[1] if first_failure else 0


def _print_tail(path: str, lines: int = 15) -> None:
    with open(path, errors="replace") as f:
        tail = [line for line in f if not line.startswith(GLOO.decode())][-lines:]
    print(f"local: last lines of {path}:\n" + "".join("  | " + line for line in tail), file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    p = CommandParser(prog="python launch/local.py", description=__doc__.splitlines()[0])
    p.add_argument("--num-processes", type=int, default=2)
    p.add_argument("--devices-per-process", type=int, default=4)
    p.add_argument("--log-dir", help="default: <run_dir>/logs")
    p.add_argument("--grace", type=float, default=30.0,
                   help="seconds beyond distributed.heartbeat_timeout_s to wait for the other processes to stop "
                        "after one failed, before killing them")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then lumen_jax.train's arguments")
    try:
        args = p.parse_args(argv)
        train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
        if args.num_processes < 1 or args.devices_per_process < 1:
            raise ConfigError("--num-processes and --devices-per-process must be >= 1")
        most = max(8, 4 * (os.cpu_count() or 1))  # each process is a whole trainer on this machine's CPUs
        if args.num_processes > most:
            raise ConfigError(f"--num-processes {args.num_processes} would start that many trainers on this machine "
                              f"({os.cpu_count()} CPUs); at most {most} (across nodes, start one process per node: "
                              "SLURM or Kubernetes)")
        if args.devices_per_process > MAX_DEVICES_PER_PROCESS:
            raise ConfigError(f"--devices-per-process {args.devices_per_process} emulated CPU devices is more than "
                              f"{MAX_DEVICES_PER_PROCESS}; choose fewer")
        # the same config every process loads: for the run directory and the heartbeat timeout
        targs = parse_train_args(train_args)
        cfg = load_config(targs.config, targs.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    log_dir = args.log_dir or os.path.join(run_dir_for(cfg), "logs")
    code = launch(train_args, args.num_processes, args.devices_per_process, log_dir,
                  cfg.distributed.heartbeat_timeout_s + args.grace)
    if code < 0:  # end the way the process did, so a supervisor sees "killed by SIGKILL"
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # these two have no handler to reset
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    sys.exit(main())
