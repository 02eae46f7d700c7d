"""`python -m lumen_jax.train --config configs/tiny.yaml [section.key=value ...]`: parse, build, loop.

A run directory with checkpoints resumes from its latest good one. Exit codes:

====  ==========================================================================================
0     trained to `train.steps`
1     a bug in lumen_jax (with a traceback)
2     bad input: config, data file, checkpoint write failure (disk full); nothing was damaged
3     diverged: `train.max_nonfinite_steps` non-finite steps in a row, or a non-finite state
      (never saved); the message names the last checkpoint, which is finite
4     silent data corruption: parameter replicas disagree (`train.sdc_check_every`)
75    preempted: SIGTERM/SIGINT, the current step finished and a checkpoint was written
====  ==========================================================================================

With several processes (docs/CLUSTERS.md) every process runs this same command; a process that
stops with an error leaves at once and the others stop within `distributed.heartbeat_timeout_s`.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
import traceback
from typing import Sequence

from lumen_jax.config import Config, ConfigError, suggest_key, to_dict
from lumen_jax.config.checks import validate, warnings
from lumen_jax.config.commands import CommandParser
from lumen_jax.runtime.signals import EXIT_PREEMPTED
from lumen_jax.config.files import load_config

EXIT_OK, EXIT_BUG, EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_CORRUPTION = 0, 1, 2, 3, 4


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line; an option other than --config is a ConfigError that suggests the override."""
    p = CommandParser(prog="python -m lumen_jax.train", description=__doc__.splitlines()[0],
                      hint="usage: python -m lumen_jax.train --config FILE [section.key=value ...]")
    p.add_argument("--config", help="YAML or gin file (configs/*.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=3e-4 mesh.tensor=2")
    args, unknown = p.parse_known_args(argv)
    if unknown:
        argv = list(sys.argv[1:] if argv is None else argv)
        option = unknown[0]
        name, eq, value = option.lstrip("-").partition("=")
        if not eq:  # `--steps 20`: the value is the next word
            at = argv.index(option)
            value = argv[at + 1] if at + 1 < len(argv) and not argv[at + 1].startswith("-") else "..."
        key = name if "." in name else suggest_key("", name)
        hint = f"; overrides are dotted without dashes: {key}={value}" if key else ""
        raise ConfigError(f"unknown option {option}{hint} (the only option is --config FILE)")
    return args


def run_dir_for(cfg: Config) -> str:
    return cfg.train.run_dir or os.path.join("runs", cfg.name)


def train(cfg: Config, stop=None) -> dict:
    """Train `cfg` to `train.steps` (resuming from its run directory); returns the last metrics.

    `stop`: the `runtime.signals.StopSignal` installed at start-up (None: the loop installs its own)."""
    from lumen_jax.runtime import distributed
    from lumen_jax.runtime import process as runtime
    runtime.configure(cfg.runtime)
    distributed.initialize(cfg.distributed)  # several processes: before anything touches a device

    import jax
    from lumen_jax.checkpoint import resume
    from lumen_jax.data import TrainData
    from lumen_jax.metrics.flops import param_counts
    from lumen_jax.metrics.mfu import Throughput
    from lumen_jax.parallel.mesh import make_mesh
    from lumen_jax.plan import startup
    from lumen_jax.runtime import rundir
    from lumen_jax.train import loop
    from lumen_jax.train.build import build
    from lumen_jax.train.evaluate import during_training

    num_devices = runtime.device_count(cfg.runtime)  # a platform this machine lacks: exit 2
    if jax.process_count() > 1:  # every process's devices, before any mesh or compile
        distributed.check_devices(distributed.gather_json(distributed.describe_local_devices()))
    mesh_shape = validate(cfg, num_devices)
    run_dir = run_dir_for(cfg)
    notes = []
    if cfg.train.init_from:  # the tokenizer, RoPE, norm epsilon, ... of the weights it starts from
        from lumen_jax.train.init_from import defined_by_init_from
        cfg, notes = defined_by_init_from(cfg, run_dir)
    if jax.process_index() == 0:
        for line in [*notes, *(f"warning: {w}" for w in warnings(cfg))]:
            print(line, file=sys.stderr, flush=True)
    # one trainer per run directory; a file in its place, read-only, full: exit 2 before compiling
    with rundir.claimed(run_dir):
        trainer = build(cfg, make_mesh(mesh_shape, across_nodes=distributed.across_nodes(
            cfg.distributed, mesh_shape, jax.devices())))
        local = [d for d in trainer.mesh.devices.flat if d.process_index == jax.process_index()]  # addressable only
        planned = startup.at_start(cfg, dict(trainer.mesh.shape), trainer.ops, (local[0].memory_stats() or {}).get(
            "bytes_limit"))  # memory_stats: None on CPU
        # far past the memory: one line now, not a compile that allocates until it dies
        startup.refuse_oversized(planned, runtime.device_memory(local, host="physical"), cfg.runtime.memory_check)
        share, shares = distributed.batch_share(trainer.batch_sharding, cfg.data.global_batch_size, cfg.data.seq_len)
        data = TrainData(cfg.data, seed=cfg.train.seed, process_index=share, process_count=shares)
        if data.tokenizer.vocab_size > cfg.model.vocab_size:
            raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                              f"vocabulary ({data.tokenizer.vocab_size}, data.tokenizer={cfg.data.tokenizer!r}); "
                              f"set model.vocab_size>={data.tokenizer.vocab_size}")
        # Before anything in the run directory changes: does its checkpoint fit this config? (The loop
        # writes config.json once the first batch is read.)
        config = to_dict(cfg)
        resume.check(config, os.path.join(run_dir, "checkpoints"), trainer.stored_abstract_state(), run_dir,
                     data.check_state)
        spec = loop.RunSpec(train=cfg.train, checkpoint=cfg.checkpoint, log=cfg.log, config=config,
                            param_count=param_counts(cfg.model)["total"],
                            throughput=Throughput.of(cfg.model, cfg.data.seq_len, cfg.data.global_batch_size,
                                                     jax.devices()),
                            planned_bytes=planned.bytes_per_device, planned_error=planned.error)
        return loop.run(trainer, data, run_dir, spec, stop, during_training(cfg.data, cfg.train, trainer, share, shares))


def _leave(cfg: Config | None, code: int) -> int:
    """The end of a failed multi-process run: process 0 records `code` in events.jsonl (a launcher such
    as srun reports the worst code of all processes; launch/supervise.py reads this one instead), then
    every process leaves without JAX's shutdown barrier (distributed.leave). One process: returns `code`."""
    from lumen_jax.runtime import distributed
    if not distributed.is_multiprocess():
        return code
    import jax
    from lumen_jax.train.hooks import Events
    if cfg is not None and jax.process_index() == 0:
        try:
            os.makedirs(run_dir_for(cfg), exist_ok=True)
            Events(run_dir_for(cfg), enabled=True).write("exit", code=code)
        except OSError:  # the exit code still reaches the launcher
            pass
    distributed.leave(code)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        cfg = load_config(args.config, args.overrides)
        from lumen_jax.runtime import distributed  # no JAX import yet
        single = distributed.resolve(cfg.distributed) is None
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    from lumen_jax.runtime.signals import StopSignal
    stop = StopSignal() if single else None  # from here on, SIGTERM during start-up exits 75 too
    try:
        return _main(cfg, args.config is None, stop)
    finally:
        if stop is not None:
            stop.restore()


def _main(cfg: Config, no_config_file: bool, stop) -> int:
    from lumen_jax.checkpoint.manager import CheckpointError, NonFiniteState
    from lumen_jax.data import DataError
    from lumen_jax.train.hooks import CorruptionDetected, Diverged, Preempted
    codes = {ConfigError: EXIT_BAD_INPUT, DataError: EXIT_BAD_INPUT, CheckpointError: EXIT_BAD_INPUT,
             Diverged: EXIT_DIVERGED, NonFiniteState: EXIT_DIVERGED, CorruptionDetected: EXIT_CORRUPTION,
             Preempted: EXIT_PREEMPTED}
    try:
        if no_config_file:
            print(f"lumen_jax: no --config given: training with the defaults of lumen_jax/config/schema.py (every one "
                  f"listed in configs/base.yaml) and your overrides, in {run_dir_for(cfg)}", flush=True)
        last = train(cfg, stop)
    except tuple(codes) as e:
        print(f"{'stopped' if isinstance(e, Preempted) else 'error'}: {e}", file=sys.stderr, flush=True)
        from lumen_jax.runtime.rundir import RunDirBusy  # another trainer's run directory: no event written there
        return _leave(None if isinstance(e, RunDirBusy) else cfg, next(code for kind, code in codes.items() if isinstance(e, kind)))
    except OSError as e:  # a metrics or events write on a full disk: the environment, not a bug
        from lumen_jax.runtime.rundir import ENVIRONMENT_ERRNOS
        if e.errno == errno.ENOENT and not os.path.isdir(run_dir_for(cfg)):
            print(f"error: train.run_dir={run_dir_for(cfg)} was removed while the run wrote to it "
                  f"({e.filename}); the run stopped: rerun to start again, or restore the folder to resume",
                  file=sys.stderr, flush=True)
            return EXIT_BAD_INPUT  # no event: the folder to record it in is gone
        if e.errno not in ENVIRONMENT_ERRNOS:
            raise
        print(f"error: writing {e.filename or 'the run directory'} failed ({e.strerror}); free disk space or "
              "fix permissions, then rerun to resume from the last checkpoint", file=sys.stderr, flush=True)
        return _leave(cfg, EXIT_BAD_INPUT)
    except Exception:
        from lumen_jax.runtime import distributed
        if not distributed.is_multiprocess():
            raise
        traceback.print_exc()
        _leave(cfg, EXIT_BUG)
    if "loss" not in last:  # nothing left to train: the run directory had reached train.steps
        print(f"done: step {cfg.train.steps} (already reached in {run_dir_for(cfg)}; nothing to train)")
    else:
        from lumen_jax.checkpoint.layout import checkpoints_dir, committed_steps
        kept = "" if committed_steps(checkpoints_dir(run_dir_for(cfg))) else (
            "; no checkpoint was saved (checkpoint.every_steps=0): add checkpoint.every_steps=N to keep the "
            "weights for generate, evaluate and to-hf")
        print(f"done: step {cfg.train.steps} loss {last['loss']:.4f}{kept}")
    return EXIT_OK
