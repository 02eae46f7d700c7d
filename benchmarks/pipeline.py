"""Pipeline schedules on the 8-device CPU mesh: work, step time, compiled temporary bytes, and the bubble.

    .venv/bin/python benchmarks/pipeline.py [--stages 4] [--micro-batches 4 8 16] [--rows 2]
        [--schedules gpipe 1f1b interleaved zero_bubble] [--steps 2]

For each schedule and each m it builds the train step as `lumen_jax.train` does on a mesh of
`pipeline=P` x `data=8/P` (8 layers, tiny widths, fp32, `--rows` rows per micro-batch, so the batch
grows with m), compiles it, reads XLA's per-device temporary bytes, times `--steps` steps after a
warm-up, and prints the bubble of the executed program next to the papers' formula, and `work`: the
matmul FLOPs of the compiled step (every dot times its loops' trip counts, all devices) over those
of the same model and batch without a pipeline (on the 8/P data-parallel devices), whose step time
is printed as `flat ms`. `--no-time` compiles only.
On the CPU the emulated devices share the host's cores and every tick runs in lock-step, so the
step time measures total work (recompute included), not a pipeline's speed-up; the bytes and the
bubble are the figures that transfer. Results and commands: docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import dataclasses

from cpu_throughput import compile_step, median_step_ms

from lumen_jax.config import (PIPELINE_SCHEDULES, Config, DataConfig, MeshConfig, ModelConfig, RuntimeConfig,
                              TrainConfig)
from lumen_jax.config.checks import validate

MODEL = ModelConfig(d_model=64, num_layers=8, num_heads=4, num_kv_heads=2, ffn_dim=172, vocab_size=512,
                    compute_dtype="float32")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--rows", type=int, default=2, help="rows per micro-batch and data shard")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--schedules", nargs="+", default=list(PIPELINE_SCHEDULES), choices=PIPELINE_SCHEDULES)
    p.add_argument("--virtual", type=int, default=2, help="mesh.pipeline_virtual_stages for interleaved")
    p.add_argument("--steps", type=int, default=2, help="timed steps (after one warm-up step)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--no-time", action="store_true", help="compile only: work, bytes and bubble")
    return p.parse_args(argv)


def config(a: argparse.Namespace, schedule: str, m: int, stages: int | None = None) -> Config:
    data = 8 // a.stages
    stages = a.stages if stages is None else stages
    return Config(model=dataclasses.replace(MODEL, num_layers=a.layers),
                  mesh=MeshConfig(data=data, fsdp=1, pipeline=stages, pipeline_schedule=schedule,
                                  pipeline_virtual_stages=a.virtual if schedule == "interleaved" else 1),
                  data=DataConfig(seq_len=a.seq_len, global_batch_size=a.rows * m * data),
                  train=TrainConfig(steps=a.steps + 1, micro_batches=m),
                  runtime=RuntimeConfig(cpu_devices=8, compilation_cache_dir=""), name="pipeline")


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from lumen_jax.runtime import process as runtime
    runtime.configure(config(a, a.schedules[0], a.micro_batches[0]).runtime)
    import jax
    from lumen_jax.train.build import build
    from lumen_jax.parallel.pipeline import schedule as pipeline
    from lumen_jax.parallel.mesh import make_mesh

    from lumen_jax.compiler import hlo

    data = 8 // a.stages
    print(f"{jax.devices()[0].device_kind} x{jax.device_count()}; pipeline={a.stages} data={data}; "
          f"{a.layers} layers, d_model 64, fp32, {a.rows} rows x {a.seq_len} tokens per micro-batch and data shard")
    print(f"{'schedule':>12} {'m':>3} {'work':>6} {'temp MiB':>9} {'slots':>6} {'compile s':>10} {'step ms':>9} "
          f"{'flat ms':>8} {'bubble':>7} {'formula':>8}")

    def total_flops(compiled, devices: int) -> int:
        return hlo.matmul_flops(hlo.parse(compiled.as_text())) * devices

    flat = {}
    for m in a.micro_batches:  # the same model and batch without a pipeline, on the data devices
        cfg = config(a, "1f1b", m, stages=1)
        trainer = build(cfg, make_mesh(validate(cfg, data), jax.devices()[:data]))
        compiled, state, batch, _ = compile_step(trainer, cfg)
        flat[m] = (total_flops(compiled, data), None if a.no_time else median_step_ms(compiled, state, batch, a.steps))
        del state, batch, compiled, trainer
    for schedule in a.schedules:
        for m in a.micro_batches:
            cfg = config(a, schedule, m)
            try:
                shape = validate(cfg, 8)
            except Exception as e:  # noqa: BLE001  (a combination the schedule refuses: say so, go on)
                print(f"{schedule:>12} {m:>3}  skipped: {e}")
                continue
            trainer = build(cfg, make_mesh(shape))
            compiled, state, batch, compile_s = compile_step(trainer, cfg)
            temp = compiled.memory_analysis().temp_size_in_bytes
            work = total_flops(compiled, 8) / flat[m][0]
            step_ms = "-" if a.no_time else f"{median_step_ms(compiled, state, batch, a.steps):.0f}"
            flat_ms = "-" if a.no_time else f"{flat[m][1]:.0f}"
            prog = trainer.step_cfg.pipeline.program
            print(f"{schedule:>12} {m:>3} {work:>6.3f} {temp / 2**20:>9.2f} {prog.slots:>6} {compile_s:>10.1f} "
                  f"{step_ms:>9} {flat_ms:>8} {prog.bubble():>7.3f} "
                  f"{pipeline.bubble_formula(schedule, a.stages, m, prog.virtual):>8.3f}", flush=True)
            del state, batch, compiled, trainer
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
