"""Run a training command and restart it from the latest good checkpoint when it dies.

    python launch/supervise.py --run-dir runs/tiny --max-restarts 5 -- \\
        python -m lumen_jax.train --config configs/tiny.yaml train.run_dir=runs/tiny checkpoint.every_steps=50

The command resumes by itself (lumen_jax.train restores the latest good checkpoint of its run
directory), so a restart is just running it again, after a backoff that doubles each time. Exit
codes 0 (done), 2 (bad input), 3 (diverged) and 4 (silent data corruption) end supervision:
running again would not help. Anything else (a crash, SIGKILL, 75 = preempted) is an interruption.

At the end it prints each interruption (cause, steps lost, time lost) and the goodput: the share
of wall time spent on training steps that were kept, and writes the same into
`<run-dir>/goodput.json` (`python -m lumen_jax.report` shows it). It reads `<run-dir>/events.jsonl`, which the
trainer writes at start, when compilation ends, after every step and at each checkpoint, and the
checkpoints committed on disk: steps lost are those taken after the checkpoint the next attempt
resumed from (or, for the last attempt, after the newest committed one); start-up, restore and
compilation count as lost time, not useful work.

SIGTERM or SIGINT to the supervisor stops supervision: it is passed on to the command as one SIGTERM
(the trainer finishes its step, writes a checkpoint and exits 75; a second signal kills it), the
supervisor waits for it, prints its summary and exits 75. The command runs in its own process group,
so a Ctrl-C on the terminal reaches it once, through the supervisor, and it gets SIGTERM if the
supervisor itself dies (PR_SET_PDEATHSIG on Linux): no trainer outlives its supervisor.

The command may start several processes (srun, launch/local.py): the whole job is one attempt, and
it is restarted as a whole. Each attempt gets LUMEN_ATTEMPT_ID in its environment, which the trainer
copies into its events, so they are matched to the attempt whatever process wrote them.

    python launch/supervise.py --run-dir runs/tiny -- \\
        python launch/local.py --num-processes 2 --devices-per-process 4 -- \\
        --config configs/tiny.yaml train.run_dir=runs/tiny checkpoint.every_steps=20
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from typing import Sequence

FINAL_CODES = {0: "done", 2: "bad input", 3: "diverged", 4: "silent data corruption"}
EXIT_PREEMPTED = 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


# Looked up before any fork: the child only calls it.
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def _own_group_and_die_with_parent() -> None:
    """In the child, before exec: its own process group (a terminal's Ctrl-C reaches the supervisor only,
    which passes it on once) and SIGTERM when the supervisor dies (Linux), so it never runs orphaned."""
    os.setpgid(0, 0)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # blocked by the supervisor around the start
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class _Woken(Exception):
    """Raised by the signal handler to end the backoff sleep early."""


class StopRequest:
    """SIGTERM/SIGINT to the supervisor: the first is passed to the running command as SIGTERM, a second
    as SIGKILL; supervision ends after the command exits (and a backoff in progress is cut short)."""

    def __init__(self) -> None:
        self.signals: list[int] = []
        self.child: subprocess.Popen | None = None
        self._sleeping = False
        self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}

    def _handle(self, signum: int, frame: object) -> None:
        self.signals.append(signum)
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM if len(self.signals) == 1 else signal.SIGKILL)
        if self._sleeping:
            raise _Woken

    def sleep(self, seconds: float) -> None:
        """`time.sleep(seconds)`, ended by a signal."""
        try:
            try:
                self._sleeping = True
                if not self.signals:
                    time.sleep(seconds)
            finally:
                self._sleeping = False
        except _Woken:
            pass

    @property
    def name(self) -> str:
        return signal.Signals(self.signals[0]).name if self.signals else ""

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


@dataclasses.dataclass
class Attempt:
    pid: int
    started: float
    ended: float
    returncode: int
    attempt_id: str = ""  # LUMEN_ATTEMPT_ID given to the command; its events carry it
    committed: int | None = None  # the newest checkpoint step on disk when it ended (None: unknown)

    @property
    def cause(self) -> str:
        if self.returncode < 0:
            return f"killed by {signal.Signals(-self.returncode).name}"
        if self.returncode == 75:
            return "preempted (exit 75, checkpoint written)"
        return FINAL_CODES.get(self.returncode, f"exit code {self.returncode}")


@dataclasses.dataclass
class Interruption:
    attempt: int
    cause: str
    steps_lost: int
    time_lost_s: float


def read_events(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "events.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def reported_exit(events: Sequence[dict], attempt_id: str, returncode: int) -> int:
    """The attempt's exit code as process 0 of a multi-process job recorded it, when it is final or 75.

    A launcher of several processes (srun) returns the worst code of all of them: when one stops on
    bad input the others are stopped by the coordination service (SIGABRT) or by srun (SIGKILL), which
    would hide the 2 that should end supervision. A reported 1 is not trusted over the launcher's code:
    it is usually a peer's death seen from process 0, and the launcher names the death.
    """
    reported = [e["code"] for e in events if e.get("attempt") == attempt_id and e["event"] == "exit"]
    if reported and (reported[-1] in FINAL_CODES or reported[-1] == 75):
        return reported[-1]
    return returncode


def committed_steps(run_dir: str) -> list[int]:
    """The checkpoint steps committed on disk (Orbax renames a step's folder once it is whole, with its
    `_CHECKPOINT_METADATA` written: lumen_jax/checkpoint/layout.py's `committed_steps`)."""
    folder = os.path.join(run_dir, "checkpoints")
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return sorted(int(n) for n in names if n.isdigit() and os.path.isfile(os.path.join(folder, n, "_CHECKPOINT_METADATA")))


def account(attempts: Sequence[Attempt], events: Sequence[dict]) -> tuple[list[Interruption], float]:
    """Interruptions and goodput (useful step time / total wall time) from attempts and trainer events.

    Steps come from the trainer's per-step events; an attempt kept the steps up to where the next one
    resumed (its `start` event), the last one all it reached if it finished, else up to the newest
    checkpoint committed when it ended (`Attempt.committed`). Useful time is the kept steps' share of
    the time from the end of compilation (the `compiled` event) to the last step: start-up,
    restore and compilation are overhead.
    """
    per_attempt: dict[int | str, list[dict]] = {}
    for e in events:
        per_attempt.setdefault(e.get("attempt") or e["pid"], []).append(e)
    mine = [per_attempt.get(a.attempt_id or a.pid, []) for a in attempts]
    resume = [next((e["resume_step"] for e in m if e["event"] == "start"), None) for m in mine]
    useful_s, interruptions = 0.0, []
    for i, a in enumerate(attempts):
        steps = sorted((e["step"], e["time"]) for e in mine[i] if e["event"] == "step")
        start = resume[i] if resume[i] is not None else 0
        reached = max([s for s, _ in steps], default=start)
        later = next((r for r in resume[i + 1:] if r is not None), None)
        if later is not None:
            kept = min(reached, later)
        elif a.returncode == 0:
            kept = reached
        else:  # the last attempt failed: what a rerun would resume from
            kept = min(reached, max(a.committed if a.committed is not None else reached, start))
        compiled = next((e["time"] for e in mine[i] if e["event"] == "compiled"), None)
        origin = (start, compiled) if compiled is not None else (steps[0] if steps else None)
        step_time = 0.0  # no step seen after compilation: no evidence of useful work
        if steps and origin is not None and steps[-1][0] > origin[0]:
            step_time = (steps[-1][1] - origin[1]) / (steps[-1][0] - origin[0])
        useful = max(kept - start, 0) * step_time
        useful_s += useful
        if i < len(attempts) - 1 or a.returncode not in FINAL_CODES:
            interruptions.append(Interruption(i, a.cause, max(reached - kept, 0),
                                              (a.ended - a.started) - useful))
    wall = (attempts[-1].ended - attempts[0].started) if attempts else 0.0
    return interruptions, (useful_s / wall if wall > 0 else 0.0)


def write_goodput(run_dir: str, attempts: Sequence[Attempt], interruptions: Sequence[Interruption],
                  goodput: float) -> None:
    """`<run_dir>/goodput.json`: the attempts, the interruptions and the goodput (written whole, through
    a temporary file; a failed write is a warning: the run's exit code stands)."""
    path = os.path.join(run_dir, "goodput.json")
    report = {"goodput": goodput, "wall_s": attempts[-1].ended - attempts[0].started if attempts else 0.0,
              "attempts": [{"attempt": i, "cause": a.cause, "returncode": a.returncode, "started": a.started,
                            "ended": a.ended} for i, a in enumerate(attempts)],
              "interruptions": [dataclasses.asdict(it) for it in interruptions]}
    try:
        os.makedirs(run_dir, exist_ok=True)
        with open(f"{path}.tmp", "w") as f:
            json.dump(report, f, indent=2)
        os.replace(f"{path}.tmp", path)
    except OSError as e:
        print(f"supervise: warning: cannot write {path} ({e.strerror})", file=sys.stderr, flush=True)


def supervise(command: Sequence[str], run_dir: str, max_restarts: int, backoff_s: float,
              max_backoff_s: float = 60.0) -> int:
    """Runs `command` until it finishes or fails for good, or the supervisor is told to stop (SIGTERM,
    SIGINT: passed on, then 75); returns its last exit code."""
    stop = StopRequest()
    try:
        attempts = _attempts(command, run_dir, max_restarts, backoff_s, max_backoff_s, stop)
    finally:
        stop.restore()
    if stop.signals:
        ended = f"; attempt {len(attempts)} ended ({attempts[-1].cause})" if attempts else ""
        print(f"supervise: stopped by {stop.name}{ended}", file=sys.stderr, flush=True)
    if not attempts:
        return EXIT_PREEMPTED
    _summary(attempts, run_dir)
    last = attempts[-1].returncode
    if stop.signals and last not in FINAL_CODES:
        return EXIT_PREEMPTED
    return last if last >= 0 else 1


def _attempts(command: Sequence[str], run_dir: str, max_restarts: int, backoff_s: float, max_backoff_s: float,
              stop: StopRequest) -> list[Attempt]:
    attempts: list[Attempt] = []
    while True:
        started = time.time()
        attempt_id = f"{os.getpid()}.{len(attempts) + 1}"
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # a signal now is handled once the child is known
        try:
            if stop.signals:
                break
            stop.child = proc = subprocess.Popen(command, env={**os.environ, "LUMEN_ATTEMPT_ID": attempt_id},
                                                 preexec_fn=_own_group_and_die_with_parent)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        returncode = proc.wait()
        stop.child = None
        returncode = reported_exit(read_events(run_dir), attempt_id, returncode)
        committed = committed_steps(run_dir)
        attempts.append(Attempt(proc.pid, started, time.time(), returncode, attempt_id,
                                committed[-1] if committed else 0))
        restarts = len(attempts) - 1
        if returncode in FINAL_CODES or restarts >= max_restarts or stop.signals:
            break
        delay = min(backoff_s * 2 ** restarts, max_backoff_s)
        print(f"supervise: attempt {len(attempts)} ended ({attempts[-1].cause}); restarting in {delay:.1f}s "
              f"({restarts + 1}/{max_restarts})", file=sys.stderr, flush=True)
        stop.sleep(delay)
    return attempts


def _summary(attempts: Sequence[Attempt], run_dir: str) -> None:
    interruptions, goodput = account(attempts, read_events(run_dir))
    write_goodput(run_dir, attempts, interruptions, goodput)
    print(f"supervise: {len(attempts)} attempt(s), {len(interruptions)} interruption(s), "
          f"final: {attempts[-1].cause}")
    for it in interruptions:
        print(f"  attempt {it.attempt + 1}: {it.cause}; steps lost {it.steps_lost}, "
              f"time lost {it.time_lost_s:.1f}s")
    print(f"supervise: goodput {100 * goodput:.1f}% of {attempts[-1].ended - attempts[0].started:.1f}s wall time",
          flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", required=True, help="the run directory the command trains in")
    p.add_argument("--max-restarts", type=int, default=10)
    p.add_argument("--backoff", type=float, default=5.0, help="seconds before the first restart; doubles")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the training command")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    # the events and checkpoints it reads are the run directory's: another one would count nothing
    trains_in = [a.split("=", 1)[1] for a in command if a.startswith("train.run_dir=")]
    elsewhere = [d for d in trains_in if os.path.realpath(d) != os.path.realpath(args.run_dir)]
    for bad, message in ((not command, "give the training command after --"),
                         (elsewhere, f"--run-dir {args.run_dir} but the command trains in train.run_dir="
                                     f"{elsewhere[0] if elsewhere else ''}; give both the same directory"),
                         (args.max_restarts < 0, f"--max-restarts={args.max_restarts} must be >= 0 (0: never restart)"),
                         (not args.backoff >= 0, f"--backoff={args.backoff} must be >= 0 seconds")):
        if bad:
            print(f"error: {message}; usage: python launch/supervise.py --run-dir DIR [--max-restarts N] "
                  "[--backoff S] -- COMMAND", file=sys.stderr, flush=True)
            return 2
    return supervise(command, args.run_dir, args.max_restarts, args.backoff)


if __name__ == "__main__":
    sys.exit(main())
