"""`python -m lumen_jax.train --config configs/tiny.yaml [section.key=value ...]`: parse, build, loop.

A run directory with checkpoints resumes from its latest good one. Exit codes:

====  ==========================================================================================
0     trained to `train.steps`
1     a bug in lumen_jax (with a traceback)
2     bad input: config, data file, checkpoint write failure (disk full); nothing was damaged
3     diverged: `train.max_nonfinite_steps` non-finite steps in a row; last checkpoint intact
4     silent data corruption: parameter replicas disagree (`train.sdc_check_every`)
75    preempted: SIGTERM/SIGINT, the current step finished and a checkpoint was written
====  ==========================================================================================

With several processes (README, "Multi-host") every process runs this same command; a process that
stops with an error leaves at once and the others stop within `distributed.heartbeat_timeout_s`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from typing import Sequence

from lumen_jax.config import Config, ConfigError, to_dict, validate
from lumen_jax.config_files import load_config

EXIT_OK, EXIT_BUG, EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_CORRUPTION, EXIT_PREEMPTED = 0, 1, 2, 3, 4, 75


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lumen_jax.train", description=__doc__.splitlines()[0])
    p.add_argument("--config", help="YAML or gin file (configs/*.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=3e-4 mesh.tensor=2")
    return p.parse_args(argv)


def run_dir_for(cfg: Config) -> str:
    return cfg.train.run_dir or os.path.join("runs", cfg.name)


def train(cfg: Config) -> dict:
    """Train `cfg` to `train.steps` (resuming from its run directory); returns the last metrics."""
    from lumen_jax import distributed, runtime
    runtime.configure(cfg.runtime)
    distributed.initialize(cfg.distributed)  # several processes: before anything touches a device

    import jax
    from lumen_jax import loop
    from lumen_jax.build import build
    from lumen_jax.data import TrainData
    from lumen_jax.evaluate import during_training
    from lumen_jax.parallel.mesh import make_mesh

    if jax.process_count() > 1:  # every process's devices, before any mesh or compile
        distributed.check_devices(distributed.gather_json(distributed.describe_local_devices()))
    mesh_shape = validate(cfg, jax.device_count())
    trainer = build(cfg, make_mesh(mesh_shape, across_nodes=distributed.across_nodes(
        cfg.distributed, mesh_shape, jax.devices())))
    share, shares = distributed.batch_share(trainer.batch_sharding, cfg.data.global_batch_size, cfg.data.seq_len)
    data = TrainData(cfg.data, seed=cfg.train.seed, process_index=share, process_count=shares)
    if data.tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                          f"vocabulary ({data.tokenizer.vocab_size}, data.tokenizer={cfg.data.tokenizer!r}); "
                          f"set model.vocab_size>={data.tokenizer.vocab_size}")
    run_dir = run_dir_for(cfg)
    if jax.process_index() == 0:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            json.dump(to_dict(cfg), f, indent=2)
    return loop.run(cfg, trainer, data, run_dir, during_training(cfg, trainer, share, shares))


def _leave(cfg: Config | None, code: int) -> int:
    """The end of a failed multi-process run: process 0 records `code` in events.jsonl (a launcher such
    as srun reports the worst code of all processes; launch/supervise.py reads this one instead), then
    every process leaves without JAX's shutdown barrier (distributed.leave). One process: returns `code`."""
    from lumen_jax import distributed
    if not distributed.is_multiprocess():
        return code
    import jax
    from lumen_jax.loop import Events
    if cfg is not None and jax.process_index() == 0:
        try:
            os.makedirs(run_dir_for(cfg), exist_ok=True)
            Events(run_dir_for(cfg), enabled=True).write("exit", code=code)
        except OSError:  # the exit code still reaches the launcher
            pass
    distributed.leave(code)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from lumen_jax.checkpoint import CheckpointError
    from lumen_jax.data import DataError
    from lumen_jax.loop import CorruptionDetected, Diverged, Preempted
    codes = {ConfigError: EXIT_BAD_INPUT, DataError: EXIT_BAD_INPUT, CheckpointError: EXIT_BAD_INPUT,
             Diverged: EXIT_DIVERGED, CorruptionDetected: EXIT_CORRUPTION, Preempted: EXIT_PREEMPTED}
    cfg = None
    try:
        cfg = load_config(args.config, args.overrides)
        last = train(cfg)
    except tuple(codes) as e:
        print(f"{'stopped' if isinstance(e, Preempted) else 'error'}: {e}", file=sys.stderr, flush=True)
        return _leave(cfg, codes[type(e)])
    except Exception:
        from lumen_jax import distributed
        if not distributed.is_multiprocess():
            raise
        traceback.print_exc()
        _leave(cfg, EXIT_BUG)
    print(f"done: step {cfg.train.steps} loss {last.get('loss', float('nan')):.4f}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
