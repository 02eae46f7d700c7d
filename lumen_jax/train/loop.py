"""The training loop: steps, logging, checkpoints, preemption and the guards.

The host never waits for the device inside a step: the next batch is prepared while the current
step runs, and the step's metrics are read one step late (they are ready by then). A save blocks
only for the device-to-host copy; Orbax writes in the background.

With several processes every process runs this loop in step: a checkpoint records every process's
data position (process 0 writes them all), and SIGTERM goes through JAX's preemption service, which
picks one step at which all processes save and stop.

After each step the loop hands over to small pieces that own their decision: `NonFiniteGuard`
(skipped steps, Diverged), `Checkpointer.maybe_save` (whether a save is due: schedule, last step,
preemption) and the after-step hooks (only `fault_hooks`, for tests, when its variable is set).
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any, Callable, Iterator

import jax

from lumen_jax.runtime import distributed
from lumen_jax.metrics import flops as flops_lib
from lumen_jax.metrics import mfu as metrics_lib, writers
from lumen_jax.checkpoint import resume
from lumen_jax.runtime import logs as runlog
from lumen_jax.checkpoint import weights
from lumen_jax.train.build import Trainer
from lumen_jax.checkpoint.manager import Checkpointer
from lumen_jax.config import Config, to_dict
from lumen_jax.data import DataError
from lumen_jax.parallel.sdc import find_divergent_replicas
from lumen_jax.runtime.signals import StopSignal


class Preempted(Exception):
    """SIGTERM/SIGINT arrived: the current step finished and a checkpoint was written."""


class Diverged(Exception):
    """Too many non-finite steps in a row; the last good checkpoint is intact."""


class CorruptionDetected(Exception):
    """Parameter replicas disagree (silent data corruption)."""


class Events:
    """`<run_dir>/events.jsonl`: start, progress and checkpoint events for the supervisor."""

    def __init__(self, run_dir: str, enabled: bool):
        self.path = os.path.join(run_dir, "events.jsonl") if enabled else None

    def count(self, event: str) -> int:
        """How many `event` records the file holds (0 on other processes)."""
        if not self.path or not os.path.exists(self.path):
            return 0
        with open(self.path, encoding="utf-8") as f:
            return sum(f'"event": "{event}"' in line for line in f)

    def write(self, event: str, **fields: Any) -> None:
        if self.path:
            # LUMEN_ATTEMPT_ID (set by launch/supervise.py) ties events to an attempt when the supervisor's
            # child is a launcher (srun, launch/local.py) rather than this process.
            attempt = os.environ.get("LUMEN_ATTEMPT_ID")
            with open(self.path, "a") as f:
                f.write(json.dumps({"event": event, "time": time.time(), "pid": os.getpid(),
                                    **({"attempt": attempt} if attempt else {}), **fields}) + "\n")


def fault_sigterm_at_startup() -> None:
    """Fault injection for tests: with LUMEN_FAULT_SIGTERM_AT_STARTUP set, SIGTERM this process just
    before the step is compiled (deterministically during start-up)."""
    if os.environ.get("LUMEN_FAULT_SIGTERM_AT_STARTUP"):
        os.kill(os.getpid(), signal.SIGTERM)


class NonFiniteGuard:
    """Counts the steps whose update was skipped (non-finite loss, gradient norm or update) and raises
    Diverged after `max_in_a_row` of them in a row.

    Each step's metrics are checked one step late (`after_step`), when they are ready: the host
    never waits for the device for the guard.
    """

    def __init__(self, max_in_a_row: int, checkpoint_dir: str, last_checkpoint: Callable[[], str] | None = None):
        self.max_in_a_row = max_in_a_row
        self.checkpoint_dir = checkpoint_dir
        # Names the newest committed (finite) checkpoint for the message (Checkpointer.last_committed).
        self.last_checkpoint = last_checkpoint or (lambda: f"the last checkpoint in {checkpoint_dir} is intact")
        self.in_a_row = 0
        self.skipped_total = 0  # skipped steps among those checked so far
        self._pending: tuple[int, Any] | None = None

    def after_step(self, step: int, step_metrics: Any) -> None:
        """Checks the previous step's metrics, then keeps `step`'s (with its `skipped` flag)."""
        if self._pending is not None:
            done_step, done_metrics = self._pending
            if int(done_metrics["skipped"]):
                self.in_a_row, self.skipped_total = self.in_a_row + 1, self.skipped_total + 1
                if self.in_a_row >= self.max_in_a_row:
                    raise Diverged(
                        f"{self.in_a_row} steps in a row (up to step {done_step}) had a non-finite "
                        f"loss, gradient norm or update (train.max_nonfinite_steps={self.max_in_a_row}); "
                        f"updates were skipped and {self.last_checkpoint()}; "
                        "lower optim.lr or check the data, then rerun to resume")
            else:
                self.in_a_row = 0
        self._pending = (step, step_metrics)


def fault_hooks(run_dir: str) -> list[Callable[[int], None]]:
    """Fault injection for tests, installed only when LUMEN_FAULT_SIGKILL_AFTER_STEPS is set.

    Returns the hooks the loop calls after each step (none without the variable): SIGKILL this
    process once after each step in LUMEN_FAULT_SIGKILL_AFTER_STEPS (comma-separated), after the
    step (and its checkpoint, if one was due) was issued: the async write may still be in flight.
    A marker file in `run_dir` makes each kill happen once across restarts. LUMEN_FAULT_PROCESS=i
    limits it to process i of a multi-process run.
    """
    steps = os.environ.get("LUMEN_FAULT_SIGKILL_AFTER_STEPS", "")
    only = os.environ.get("LUMEN_FAULT_PROCESS", "")
    if not steps or (only and int(only) != jax.process_index()):
        return []
    kill_after = {s.strip() for s in steps.split(",")}

    def kill(step: int) -> None:
        marker = os.path.join(run_dir, f".fault-killed-{step}")
        if str(step) in kill_after and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)

    return [kill]


def _all_data_states(state: dict) -> dict | None:
    """Every process's data position, merged (on process 0; None on the others).

    Stream states merge into one state that restores any process count (data/pipeline.py); grain
    worker states (data.num_workers > 0) only restore the same processes, so they are kept as a list.
    """
    states = distributed.gather_json(state, to_all=False)
    if states is None or len(states) == 1:
        return None if states is None else states[0]
    if all("streams" in s for s in states):
        return {**states[0], "streams": {r: s for st in states for r, s in st["streams"].items()}}
    return {"processes": states}


def _own_data_state(saved: dict) -> dict:
    """This process's part of a checkpoint's data state (see _all_data_states)."""
    if "processes" not in saved:
        return saved
    if len(saved["processes"]) != jax.process_count():
        raise DataError(f"the checkpoint's data state (data.num_workers>0) was written by "
                        f"{len(saved['processes'])} processes and restores only in as many, not "
                        f"{jax.process_count()}; resume with that many processes or data.num_workers=0")
    return saved["processes"][jax.process_index()]


def run(cfg: Config, trainer: Trainer, data: Iterator, run_dir: str, stop: StopSignal | None = None,
        evaluate: Callable[[Any], dict] | None = None) -> dict:
    """Train from the latest good checkpoint in `run_dir` (or from scratch, or from `train.init_from`)
    to `train.steps`; `evaluate(state)` (eval_loss, ...) is logged every `train.eval_every` steps.

    Returns the last logged metrics. Raises Preempted, Diverged or CorruptionDetected (after
    which the last committed checkpoint is intact), or CheckpointError.
    """
    log_name = "" if jax.process_index() == 0 else f"library-{jax.process_index()}.log"
    own = stop is None  # train.main installs one before start-up (a single process)
    stop = StopSignal(jax.process_count() > 1) if own else stop
    try:
        with runlog.library_output(run_dir, log_name):  # Orbax's and asyncio's tracebacks: not the terminal
            return _run(cfg, trainer, data, run_dir, stop, evaluate)
    finally:
        if own:
            stop.restore()


def _run(cfg: Config, trainer: Trainer, data: Iterator, run_dir: str, stop: StopSignal,
         evaluate: Callable[[Any], dict] | None) -> dict:
    is_main = jax.process_index() == 0
    events = Events(run_dir, is_main)
    weights.refuse_weights_only(run_dir)  # restoring would move the imported weights aside as unreadable
    ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"), cfg.checkpoint)
    restored = ckpt.restore_latest(trainer.abstract_state(), trainer.older_layouts)
    if restored is not None:
        state, start = restored.state, restored.step
        data.set_state(_own_data_state(restored.meta["data"]))
    else:
        state, start = trainer.init(), 0
        if cfg.train.init_from:  # fresh optimizer state, step 0, this run's schedule; only the weights
            state = state.replace(params=weights.init_from(cfg.train.init_from, trainer.abstract_state().params))
    attempt = events.count("start") + 1  # this run directory's attempt number (1: the first start)
    events.write("start", resume_step=start, run_attempt=attempt)

    tokens_per_step = cfg.data.global_batch_size * cfg.data.seq_len
    flops = flops_lib.flops_per_token(cfg.model, cfg.data.seq_len)
    staged = trainer.mesh.shape.get("pipeline", 1) > 1  # its backward recomputes each stage's forward
    hw_flops = flops_lib.hardware_flops_per_token(cfg.model, cfg.data.seq_len,
                                                  pipeline_schedule=cfg.mesh.pipeline_schedule if staged else None)
    peaks = metrics_lib.model_peaks(cfg.model, jax.devices())

    t0 = time.perf_counter()
    data_state = data.get_state()  # position after `start` batches: what a checkpoint records
    batch = trainer.shard_batch(next(data))
    fault_sigterm_at_startup()
    step_fn = trainer.step.lower(state, batch).compile()
    events.write("compiled")  # start-up and compilation end here: the supervisor counts them as overhead
    if stop.before_first_step():
        committed = ckpt.last_committed() if start else "no step had been taken"
        ckpt.close()
        raise Preempted(f"stopped by signal {stop.name} during start-up, before step {start + 1}; nothing was "
                        f"lost: {committed}; rerun to resume")
    if is_main:
        print(f"lumen_jax: {jax.device_count()} {jax.devices()[0].platform} devices, mesh "
              + " ".join(f"{k}={v}" for k, v in trainer.mesh.shape.items())
              + f", {flops_lib.param_counts(cfg.model)['total'] / 1e6:.2f}M params, "
              + (f"{trainer.ops.note}, " if trainer.ops.note else "")
              + f"compiled in {time.perf_counter() - t0:.1f}s, peak {peaks.source}, run dir {run_dir}"
              + (f", resumed from step {start}" if start else ""), flush=True)

    shapes = resume.state_shapes(state)  # what a resume under another config compares (resume.py)

    def meta() -> dict:  # only when saving: gathers every process's data position
        return {"data": _all_data_states(data_state), "config": to_dict(cfg), "state_shapes": shapes}

    guard = NonFiniteGuard(cfg.train.max_nonfinite_steps, ckpt.directory, ckpt.last_committed)
    after_step = fault_hooks(run_dir)
    last: dict = {}
    stall = 0.0
    log_every = cfg.log.every_steps
    try:
        # A resumed attempt's rows carry its number (steps after the checkpoint are logged again);
        # TensorBoard drops the earlier attempt's events from the first replayed step on.
        with writers.MetricsWriter(run_dir, jsonl=cfg.log.jsonl, tensorboard=cfg.log.tensorboard,
                                       enabled=is_main, attempt=attempt,
                                       purge_step=start + 1 if start else None) as writer, \
                writers.Progress(cfg.train.steps, enabled=is_main and cfg.log.progress,
                                     initial_step=start) as progress:
            t_last, steps_since = time.perf_counter(), 0
            for step in range(start + 1, cfg.train.steps + 1):
                state, step_metrics = step_fn(state, batch)
                steps_since += 1
                data_state = data.get_state()  # after `step` batches
                if step < cfg.train.steps:  # host work overlaps the running step
                    batch = trainer.shard_batch(next(data))

                guard.after_step(step, step_metrics)  # checks the previous step's (ready by now)
                events.write("step", step=step)  # every step: the supervisor counts steps lost from these

                if cfg.train.sdc_check_every and step % cfg.train.sdc_check_every == 0:
                    bad = find_divergent_replicas(trainer.mesh, state.params)
                    if bad:
                        raise CorruptionDetected(f"silent data corruption at step {step}: {bad[0]}"
                                                 + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
                                                 + "; exclude that device and resume from the last checkpoint")

                evaluated, eval_s = {}, 0.0
                if evaluate is not None and cfg.train.eval_every and (
                        step % cfg.train.eval_every == 0 or step == cfg.train.steps):
                    t_eval = time.perf_counter()
                    evaluated = evaluate(state)
                    eval_s = time.perf_counter() - t_eval  # not part of the step time
                if evaluated or step % log_every == 0 or step == cfg.train.steps:
                    values = {k: float(v) for k, v in jax.device_get(step_metrics).items()}
                    now = time.perf_counter()
                    perf = metrics_lib.StepMetrics.compute(
                        step_time_s=(now - t_last - eval_s) / steps_since, tokens_per_step=tokens_per_step,
                        num_devices=jax.device_count(), flops_per_token=flops,
                        hw_flops_per_token=hw_flops, peak_flops_per_device=peaks.per_device,
                        bf16_peak_flops_per_device=peaks.bf16_per_device)
                    last = {**values, **perf.as_dict(), "skipped_total": guard.skipped_total,
                            "checkpoint_stall_s": stall, **evaluated}
                    writer.write(step, last)
                    progress.update(step, last)
                    t_last, steps_since, stall = time.perf_counter(), 0, 0.0

                stopping = stop.requested(step)
                saved = ckpt.maybe_save(step, state, meta, last=step == cfg.train.steps, force=stopping)
                if saved is not None:
                    stall += saved
                    events.write("checkpoint", step=step)
                    if stopping:
                        ckpt.wait()
                        raise Preempted(f"stopped by signal {stop.name} after step "
                                        f"{step}; checkpoint written to {ckpt.directory}; rerun to resume")
                for hook in after_step:
                    hook(step)
        ckpt.wait()
    finally:
        ckpt.close()
    return last
