"""The training loop: start-up (restore or init, compile), then steps, each followed by the hooks.

The host never waits for the device inside a step: the next batch is prepared while the current
step runs, and the step's metrics are read one step late (they are ready by then). A save blocks
only for the device-to-host copy; Orbax writes in the background.

With several processes every process runs this loop in step: a checkpoint records every process's
data position (process 0 writes them all), and SIGTERM goes through JAX's preemption service, which
picks one step at which all processes save and stop.

Everything after a step is a hook (train/hooks.py: the device wait, the non-finite guard, events, SDC
checks, evaluation, device memory, stragglers, logging, preemption, checkpointing, the profiler, slow
steps); the loop body is the step, the next batch and `hooks(info)`. Start-up wraps the data iterator
and the compiled step in clocks (metrics/timing.py: where the step time goes) and writes compile.json
(the compiled step's bytes per device next to the planner's).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Iterator

import jax

from lumen_jax.checkpoint import resume, weights
from lumen_jax.checkpoint.manager import Checkpointer
from lumen_jax.config import CheckpointConfig, LogConfig, TrainConfig
from lumen_jax.data import DataError
from lumen_jax.metrics import memory, timing
from lumen_jax.metrics.mfu import Throughput
from lumen_jax.runtime import distributed, logs, rundir
from lumen_jax.runtime.signals import StopSignal
from lumen_jax.train import hooks as hooks_lib
from lumen_jax.train import init_from as init_from_lib
from lumen_jax.train.build import Trainer
from lumen_jax.train.hooks import Events, Preempted, StepInfo


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """What the loop needs of the run's config: its sections, not the whole."""

    train: TrainConfig
    checkpoint: CheckpointConfig
    log: LogConfig
    config: dict  # the resolved config as JSON, recorded in every checkpoint (resume.py compares it)
    throughput: Throughput
    param_count: int  # shown in the start-up line
    planned_bytes: dict | None = None  # the planner's bytes per device for this config (train/cli.py)
    planned_error: str = ""  # why there is no prediction


def _all_data_states(state: dict) -> dict | None:
    """Every process's data position, merged (on process 0; None on the others).

    Stream states merge into one state that restores any process count (data/pipeline.py; a
    data.order=windows state has no streams, only the batch count every process shares); grain
    worker states (data.num_workers > 0, documents order) only restore the same processes, so they
    are kept as a list.
    """
    states = distributed.gather_json(state, to_all=False)
    if states is None or len(states) == 1:
        return None if states is None else states[0]
    if all("workers" not in s for s in states):
        return {**states[0], "streams": {r: s for st in states for r, s in st.get("streams", {}).items()}}
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


def run(trainer: Trainer, data: Iterator, run_dir: str, spec: RunSpec, stop: StopSignal | None = None,
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
        with logs.library_output(run_dir, log_name):  # Orbax's and asyncio's tracebacks: not the terminal
            return _run(trainer, data, run_dir, spec, stop, evaluate)
    finally:
        if own:
            stop.restore()


def _start(trainer: Trainer, data: Iterator, ckpt: Checkpointer, init_from: str) -> tuple[Any, int]:
    """(state, step) to train from: the latest good checkpoint (and its data position), else a fresh
    state, with `train.init_from`'s weights (and the model state they come with) when set (fresh
    optimizer state, step 0)."""
    restored = ckpt.restore_latest(trainer.abstract_state())
    if restored is not None:
        data.set_state(_own_data_state(restored.meta["data"]))
        return restored.state, restored.step
    state = trainer.init()
    if init_from:  # the weights are read as checkpoints hold them (the real layers), then laid out
        stored = trainer.stored.save(state)
        abstract = trainer.stored_abstract_state()
        params, model_state = init_from_lib.init_from(init_from, abstract.params, abstract.model_state)
        state = trainer.stored.load(stored.replace(params=params, model_state=(
            stored.model_state if model_state is None else model_state)))  # None: the fresh one
    return state, 0


def _run(trainer: Trainer, data: Iterator, run_dir: str, spec: RunSpec, stop: StopSignal,
         evaluate: Callable[[Any], dict] | None) -> dict:
    is_main = jax.process_index() == 0
    events = Events(run_dir, is_main)
    weights.refuse_weights_only(run_dir)  # restoring would move the imported weights aside as unreadable
    ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"), spec.checkpoint, notify=events.write,
                        layout=trainer.stored)
    data = timing.TimedData(data)  # the seconds `next(data)` takes: data_wait_s
    state, start = _start(trainer, data, ckpt, spec.train.init_from)
    t0 = time.perf_counter()
    # The first batch is read before the run directory changes: a missing or corrupt data file met here
    # (DataError, exit 2) leaves a new run directory empty (removed) and a resumed one as it was.
    batch = trainer.shard_batch(next(data))
    if is_main:
        rundir.write_json(run_dir, "config.json", spec.config)
    attempt = events.count("start") + 1  # this run directory's attempt number (1: the first start)
    events.write("start", resume_step=start, run_attempt=attempt)

    hooks_lib.fault_sigterm_at_startup()
    compiled = trainer.step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    step_fn = timing.StepClock(compiled, first_step=start + 1)  # dispatch and device times: step_time_s
    events.write("compiled")  # start-up and compilation end here: the supervisor counts them as overhead
    if stop.before_first_step():
        committed = ckpt.last_committed() if start else "no step had been taken"
        step_fn.close()
        ckpt.close()
        raise Preempted(f"stopped by signal {stop.name} during start-up, before step {start + 1}; nothing was "
                        f"lost: {committed}; rerun to resume")
    if is_main:
        print(f"lumen_jax: {jax.device_count()} {jax.devices()[0].platform} devices, mesh "
              + " ".join(f"{k}={v}" for k, v in trainer.mesh.shape.items())
              + f", {spec.param_count / 1e6:.2f}M params, "
              + (f"{trainer.ops.note}, " if trainer.ops.note else "")
              + (f"pipeline schedule {spec.config['mesh']['pipeline_schedule']}, " if trainer.mesh.shape["pipeline"] > 1
                 else "")
              + f"compiled in {compile_s:.1f}s, peak {spec.throughput.peaks.source}, run dir {run_dir}"
              + (f", resumed from step {start}" if start else "")
              + (f", weights from train.init_from={spec.train.init_from}" if spec.train.init_from and not start
                 else ""), flush=True)
        rundir.write_json(run_dir, "compile.json", memory.report(
            compiled, spec.planned_bytes, spec.planned_error, devices=jax.device_count(),
            platform=jax.devices()[0].platform, mesh=trainer.mesh.shape, compile_s=compile_s))
        print("lumen_jax: " + memory.memory_line(memory.compiled_bytes(compiled), spec.planned_bytes,
                                                 spec.planned_error) + " (compile.json)", flush=True)

    shapes = resume.state_shapes(trainer.stored_abstract_state())  # what a resume under another config compares (resume.py)

    def meta(data_state: dict) -> dict:  # only when saving: gathers every process's data position
        return {"data": _all_data_states(data_state), "config": spec.config, "state_shapes": shapes}

    times = timing.LoopTimes(data, step_fn)
    hooks, logging = standard_hooks(spec, trainer, run_dir, ckpt, events, stop, meta, evaluate, start, attempt, times)
    steps = spec.train.steps
    try:
        for step in range(start + 1, steps + 1):
            state, step_metrics = step_fn(state, batch)
            data_state = data.get_state()  # after `step` batches
            if step < steps:  # host work overlaps the running step
                batch = trainer.shard_batch(next(data))
            hooks(StepInfo(step=step, last=step == steps, state=state, metrics=step_metrics, data_state=data_state))
        ckpt.wait()
    finally:
        hooks.close()
        ckpt.close()
    return logging.last


def standard_hooks(spec: RunSpec, trainer: Trainer, run_dir: str, ckpt: Checkpointer, events: Events,
                   stop: StopSignal, meta: Callable[[dict], dict], evaluate: Callable[[Any], dict] | None,
                   start: int, attempt: int, times: timing.LoopTimes) -> tuple[hooks_lib.Hooks, hooks_lib.Logging]:
    """The trainer's hooks in their order (each decides only its own job), and the logging hook
    (whose last row is the run's result). A profile whose window opens at the first step starts here."""
    is_main = jax.process_index() == 0
    t, every_log = spec.train, spec.log.every_steps
    guard = hooks_lib.NonFiniteGuard(t.max_nonfinite_steps, ckpt.directory, ckpt.last_committed)
    logging = hooks_lib.Logging(spec.log, run_dir, spec.throughput, t.steps, start, attempt, is_main,
                                lambda: guard.skipped_total, times)
    preemption = hooks_lib.Preemption(stop, ckpt)
    profiler = hooks_lib.Profiler(t.profile_steps, os.path.join(run_dir, "profile", f"process-{jax.process_index()}"),
                                  times, is_main)
    local = [d for d in trainer.mesh.devices.flat if d.process_index == jax.process_index()]
    hooks = hooks_lib.Hooks()
    hooks.add(hooks_lib.DeviceWait(times.clock))  # waits for the previous step (what the guard reads), timed
    hooks.add(guard)  # checks the previous step's metrics (ready by now)
    hooks.add(events)  # a `step` event every step: the supervisor counts steps lost from these
    hooks.add(hooks_lib.SdcCheck(trainer.mesh), every=t.sdc_check_every)
    if evaluate is not None:
        hooks.add(hooks_lib.Evaluation(evaluate, times), every=t.eval_every, at_last=bool(t.eval_every))
    if hooks_lib.DeviceMemory.reported(local):  # GPUs: the allocator's peak in every logged row
        hooks.add(hooks_lib.DeviceMemory(local), every=every_log, at_last=True)
    if jax.process_count() > 1:
        hooks.add(hooks_lib.Stragglers(t.slow_step_factor, events, times, start), every=every_log, at_last=True)
    hooks.add(hooks_lib.DataTokens(), every=every_log, at_last=True)  # the rows logging writes
    hooks.add(logging)
    hooks.add(preemption.check)
    hooks.add(hooks_lib.Checkpointing(ckpt, meta, times))
    hooks.add(preemption.stop)
    hooks.add(profiler)
    for fault in hooks_lib.fault_hooks(run_dir):
        hooks.add(lambda info, fault=fault: fault(info.step))
    hooks.add(hooks_lib.SlowSteps(t.slow_step_factor, events, times))  # last: after the step's own stalls
    profiler.begin_if_due(start + 1)
    return hooks, logging


