"""Context parallelism: per-device memory and step time as the sequence is split over more devices.

    .venv/bin/python benchmarks/context_parallel.py [--seq-lens 4096 16384 32768] [--contexts 1 2 4 8]
        [--strategy ring|allgather] [--steps 2] [--max-run-gib 6]

For every sequence length L and context size C it builds the train step as `lumen_jax.train` does
on a mesh of C devices (`context=C`, batch 1, so the only split is the sequence), compiles it and
reads XLA's per-device memory (arguments + outputs + temporaries - aliases), then times `--steps`
steps when the C devices together need less than `--max-run-gib` (on the CPU the emulated devices
share the host's memory; a 32k sequence on one device needs whole [T, T] score matrices: it is
compiled and sized, not run). C=1 is the plain model without context
parallelism. The model is the tiny one (d_model 64, 4 heads, 2 kv heads, 2 layers, fp32).

On the CPU the C emulated devices share the host's cores, so step time measures total work (it
shows the ring's overhead, not a speed-up); memory per device is the figure that transfers.
On GPUs (`--platform gpu`, as many GPUs as the largest C, `--attention flash`) the same script
measures both. Results and commands: docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import dataclasses

from cpu_throughput import compile_step, median_step_ms

from lumen_jax.config import (CONTEXT_PARALLEL, Config, DataConfig, MeshConfig, ModelConfig, RuntimeConfig,
                              TrainConfig)
from lumen_jax.config.checks import validate

MODEL = ModelConfig(d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=172, vocab_size=512,
                    compute_dtype="float32")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 16384, 32768])
    p.add_argument("--contexts", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--strategy", default="ring", choices=CONTEXT_PARALLEL)
    p.add_argument("--balance", default="zigzag", choices=("zigzag", "contiguous"))
    p.add_argument("--attention", default="xla", help="model.attention (flash on GPU)")
    p.add_argument("--dtype", default="float32", help="model.compute_dtype")
    p.add_argument("--steps", type=int, default=2, help="timed steps (after one warm-up step)")
    p.add_argument("--max-run-gib", type=float, default=12.0,
                   help="run (time) only configurations whose devices need less than this in all")
    p.add_argument("--platform", default="cpu", help="cpu (8 emulated devices) or gpu")
    return p.parse_args(argv)


def config(a: argparse.Namespace, seq_len: int, c: int) -> Config:
    model = dataclasses.replace(MODEL, attention=a.attention, compute_dtype=a.dtype)
    return Config(model=model, mesh=MeshConfig(data=1, fsdp=1, context=c, tensor=1, context_parallel=a.strategy,
                                               context_balance=a.balance),
                  data=DataConfig(seq_len=seq_len, global_batch_size=1),
                  train=TrainConfig(steps=a.steps + 1),
                  runtime=RuntimeConfig(cpu_devices=8 if a.platform == "cpu" else 0,
                                        compilation_cache_dir="", platform=a.platform),
                  name="context_parallel")


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from lumen_jax.runtime import process as runtime
    runtime.configure(config(a, a.seq_lens[0], 1).runtime)
    import jax
    from lumen_jax.train.build import build
    from lumen_jax.parallel.mesh import make_mesh

    print(f"{jax.devices()[0].device_kind} x{jax.device_count()}; strategy={a.strategy} "
          f"balance={a.balance} attention={a.attention} {a.dtype}; tiny model, batch 1")
    print(f"{'seq':>7} {'C':>3} {'GiB/device':>11} {'args':>8} {'temp':>8} {'compile s':>10} "
          f"{'step ms':>10} {'tokens/s':>10}")
    for seq_len in a.seq_lens:
        for c in a.contexts:
            cfg = config(a, seq_len, c)
            shape = validate(cfg, c)
            trainer = build(cfg, make_mesh(shape, jax.devices()[:c]))
            compiled, state, batch, compile_s = compile_step(trainer, cfg)
            mem = compiled.memory_analysis()
            total = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
                     - mem.alias_size_in_bytes)
            step_ms = tokens_s = float("nan")
            if total * c < a.max_run_gib * 2**30:
                step_ms = median_step_ms(compiled, state, batch, a.steps)
                tokens_s = seq_len / (step_ms / 1e3)
            print(f"{seq_len:>7} {c:>3} {total / 2**30:>11.3f} {mem.argument_size_in_bytes / 2**20:>7.1f}M "
                  f"{mem.temp_size_in_bytes / 2**20:>7.1f}M {compile_s:>10.1f} {step_ms:>10.0f} "
                  f"{tokens_s:>10.0f}", flush=True)
            del state, batch, compiled, trainer
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
