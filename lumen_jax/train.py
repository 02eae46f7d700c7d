"""`python -m lumen_jax.train --config configs/tiny.yaml [section.key=value ...]`: parse, build, loop.

Exit codes: 0 done, 2 bad input (config, data), 1 our own bug (with a traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Sequence

from lumen_jax.config import Config, ConfigError, load_config, to_dict, validate

EXIT_BAD_INPUT = 2


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lumen_jax.train", description=__doc__.splitlines()[0])
    p.add_argument("--config", help="YAML or gin file (configs/*.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=3e-4 mesh.tensor=2")
    return p.parse_args(argv)


def run_dir_for(cfg: Config) -> str:
    return cfg.train.run_dir or os.path.join("runs", cfg.name)


def train(cfg: Config) -> dict:
    """Train `cfg` to `train.steps`; returns the last logged metrics."""
    from lumen_jax import runtime
    runtime.configure(cfg.runtime)

    import jax
    from lumen_jax import metrics as metrics_lib
    from lumen_jax.build import build
    from lumen_jax.data import TrainData
    from lumen_jax.parallel.mesh import make_mesh

    mesh_shape = validate(cfg, jax.device_count())
    data = TrainData(cfg.data, seed=cfg.train.seed, process_index=jax.process_index(),
                     process_count=jax.process_count())
    if data.tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                          f"vocabulary ({data.tokenizer.vocab_size}, data.tokenizer={cfg.data.tokenizer!r}); "
                          f"set model.vocab_size>={data.tokenizer.vocab_size}")
    trainer = build(cfg, make_mesh(mesh_shape))

    is_main = jax.process_index() == 0
    run_dir = run_dir_for(cfg)
    if is_main:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            json.dump(to_dict(cfg), f, indent=2)

    tokens_per_step = cfg.data.global_batch_size * cfg.data.seq_len
    flops = metrics_lib.flops_per_token(cfg.model, cfg.data.seq_len)
    hw_flops = metrics_lib.hardware_flops_per_token(cfg.model, cfg.data.seq_len)
    peak, peak_source = metrics_lib.peak_flops_per_device(jax.devices(), cfg.model.compute_dtype)

    t0 = time.perf_counter()
    state = trainer.init()
    batch = trainer.shard_batch(next(data))
    step_fn = trainer.step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    if is_main:
        print(f"lumen_jax: {jax.device_count()} {jax.devices()[0].platform} devices, mesh "
              + " ".join(f"{k}={v}" for k, v in mesh_shape.items())
              + f", {metrics_lib.param_counts(cfg.model)['total'] / 1e6:.2f}M params, "
              f"compiled in {compile_s:.1f}s, peak {peak_source}, run dir {run_dir}", flush=True)

    last: dict = {}
    log_every = cfg.log.every_steps
    with metrics_lib.MetricsWriter(run_dir, jsonl=cfg.log.jsonl, tensorboard=cfg.log.tensorboard,
                                   enabled=is_main) as writer, \
            metrics_lib.Progress(cfg.train.steps, enabled=is_main and cfg.log.progress) as progress:
        t_last, steps_since = time.perf_counter(), 0
        for step in range(1, cfg.train.steps + 1):
            state, step_metrics = step_fn(state, batch)
            steps_since += 1
            if step < cfg.train.steps:
                batch = trainer.shard_batch(next(data))  # host work overlaps the running step
            if step % log_every == 0 or step == cfg.train.steps:
                values = {k: float(v) for k, v in jax.device_get(step_metrics).items()}
                now = time.perf_counter()
                perf = metrics_lib.StepMetrics.compute(
                    step_time_s=(now - t_last) / steps_since, tokens_per_step=tokens_per_step,
                    num_devices=jax.device_count(), flops_per_token=flops,
                    hw_flops_per_token=hw_flops, peak_flops_per_device=peak)
                last = {**values, **perf.as_dict()}
                writer.write(step, last)
                progress.update(step, last)
                t_last, steps_since = time.perf_counter(), 0
    return last


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from lumen_jax.data import DataError
    try:
        cfg = load_config(args.config, args.overrides)
        last = train(cfg)
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"done: step {cfg.train.steps} loss {last.get('loss', float('nan')):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
