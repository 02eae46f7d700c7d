"""Training throughput and MFU of a small Llama on one CPU device, against the measured f32 matmul peak.

    .venv/bin/python benchmarks/cpu_throughput.py [--steps 30] [--remat none] [--attention xla] ...

Builds the run as `lumen_jax.train` does (`validate` -> `make_mesh` -> `build`) on a 1x1x1x1 mesh of
one CPU device, compiles the step ahead of time (`.lower().compile()`), warms it up and times
`--steps` steps, each ended with `block_until_ready`. Data is synthetic: uniform random tokens, one
document per row (segment_ids 1, positions 0..T-1, loss_mask 1), the same batch every step, so no
host data work is timed.

Model FLOPs are `lumen_jax.metrics.flops.flops_per_token`: 6 x matmul parameters + 3 x the causal half of
the attention forward; the embedding lookup, norms, softmax, loss and optimizer count nothing (see
docs/FLOPS.md). The peak is `lumen_jax.metrics.mfu.measure_cpu_matmul_peak`: the best FLOP/s of a
jitted n x n float32 matmul, n = --peak-n.

The machine is shared: another process on one of the two cores halves both the step and the peak.
The timed steps are split into rounds with a peak measurement after each, and MFU is reported from
the best step and the best peak (both quiet-machine figures), next to the medians. The process CPU
time per step is printed too: it barely moves with the load, so it is the figure to compare
changes by.

`--malloc reuse` (the default) sets glibc's allocator, before JAX starts, to keep freed memory:
XLA:CPU allocates the step's temporary buffer (~360 MB here) afresh on every call, and with
glibc's defaults that is an mmap/munmap pair per step, so every page of it faults in again
(~93k page faults, ~0.18 s of kernel time per step). `--malloc default` shows the difference.

Results and commands: docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import statistics
import sys
import time

from lumen_jax.config import (ATTENTION_IMPLS, REMAT_POLICIES, Config, DataConfig, MeshConfig, ModelConfig,
                              OptimConfig, RuntimeConfig, TrainConfig)
from lumen_jax.config.checks import validate

# The named shape: d_model 256, 4 layers, 4 heads, 2 kv heads, ffn 688, vocab 4096, fp32.
SHAPE = ModelConfig(d_model=256, num_layers=4, num_heads=4, num_kv_heads=2, ffn_dim=688, vocab_size=4096,
                    compute_dtype="float32")
SEQ_LEN, BATCH = 256, 8

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="timed steps")
    p.add_argument("--rounds", type=int, default=6,
                   help="rounds the timed steps are split into, each followed by a peak measurement")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after compiling")
    p.add_argument("--d-model", type=int, default=SHAPE.d_model)
    p.add_argument("--layers", type=int, default=SHAPE.num_layers)
    p.add_argument("--heads", type=int, default=SHAPE.num_heads)
    p.add_argument("--kv-heads", type=int, default=SHAPE.num_kv_heads)
    p.add_argument("--ffn", type=int, default=SHAPE.ffn_dim)
    p.add_argument("--vocab", type=int, default=SHAPE.vocab_size)
    p.add_argument("--seq", type=int, default=SEQ_LEN)
    p.add_argument("--batch", type=int, default=BATCH)
    p.add_argument("--dtype", default=SHAPE.compute_dtype, help="model.compute_dtype")
    p.add_argument("--remat", default="none", choices=REMAT_POLICIES)
    p.add_argument("--attention", default="xla", choices=ATTENTION_IMPLS)
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--peak-n", type=int, default=2048,
                   help="side of the square f32 matmul timed for the peak (1024 and 2048 agree here; 512 and "
                        "4096 read lower)")
    p.add_argument("--malloc", default="reuse", choices=("reuse", "default"),
                   help="reuse: glibc keeps freed memory (see the module docstring); default: glibc as is")
    p.add_argument("--breakdown", action="store_true",
                   help="also time the forward (loss) alone, and forward + backward without the optimizer")
    return p.parse_args(argv)


def make_config(a: argparse.Namespace) -> Config:
    model = dataclasses.replace(SHAPE, d_model=a.d_model, num_layers=a.layers, num_heads=a.heads,
                                num_kv_heads=a.kv_heads, ffn_dim=a.ffn, vocab_size=a.vocab,
                                compute_dtype=a.dtype, remat=a.remat, attention=a.attention)
    return Config(model=model,
                  mesh=MeshConfig(data=1, fsdp=1, context=1, tensor=1),
                  optim=OptimConfig(),
                  data=DataConfig(seq_len=a.seq, global_batch_size=a.batch),
                  train=TrainConfig(steps=a.warmup + a.steps, micro_batches=a.micro_batches),
                  runtime=RuntimeConfig(cpu_devices=1, compilation_cache_dir="", platform="cpu", malloc=a.malloc),
                  name="cpu_throughput")


def synthetic_batch(cfg: Config, seed: int = 0) -> dict:
    import numpy as np

    b, t, v = cfg.data.global_batch_size, cfg.data.seq_len, cfg.model.vocab_size
    tokens = np.random.default_rng(seed).integers(0, v, (b, t + 1), dtype=np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
            "segment_ids": np.ones((b, t), np.int32),
            "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(),
            "loss_mask": np.ones((b, t), np.float32)}


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed(fn, *args) -> tuple[float, float, object]:
    """(wall seconds, process CPU seconds, result) of one call, waited for."""
    import jax

    wall, cpu = time.perf_counter(), cpu_seconds()
    out = jax.block_until_ready(fn(*args))
    return time.perf_counter() - wall, cpu_seconds() - cpu, out


def compile_step(trainer, cfg: Config) -> tuple[object, object, dict, float]:
    """(compiled train step, fresh state, a synthetic sharded batch, seconds to init and compile)."""
    t0 = time.perf_counter()
    state = trainer.init()
    batch = trainer.shard_batch(synthetic_batch(cfg))
    compiled = trainer.step.lower(state, batch).compile()
    return compiled, state, batch, time.perf_counter() - t0


def median_step_ms(compiled, state, batch: dict, steps: int) -> float:
    """Median wall milliseconds of `steps` steps after one warm-up step."""
    import jax

    state, _ = jax.block_until_ready(compiled(state, batch))
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        state, _ = jax.block_until_ready(compiled(state, batch))
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def xla_flops(compiled) -> float:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost.get("flops", float("nan")))


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    cfg = make_config(a)
    from lumen_jax.runtime import process as runtime
    runtime.configure(cfg.runtime)  # runtime.malloc=reuse applies keep_freed_memory

    import jax
    from lumen_jax.metrics import flops
    from lumen_jax.metrics import mfu as metrics_lib
    from lumen_jax.train import step as step_lib
    from lumen_jax.train.build import build
    from lumen_jax.parallel.mesh import make_mesh

    mesh_shape = validate(cfg, jax.device_count())
    trainer = build(cfg, make_mesh(mesh_shape))
    tokens = cfg.data.global_batch_size * cfg.data.seq_len
    flops_tok = flops.flops_per_token(cfg.model, cfg.data.seq_len)

    def peak() -> float:
        metrics_lib.measure_cpu_matmul_peak.cache_clear()
        return metrics_lib.measure_cpu_matmul_peak("float32", n=a.peak_n)

    peaks = [peak()]
    t0 = time.perf_counter()
    state = trainer.init()
    batch = trainer.shard_batch(synthetic_batch(cfg))
    compiled = trainer.step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0

    for _ in range(a.warmup):
        state, m = compiled(state, batch)
    loss_first = float(m["loss"]) if a.warmup else float("nan")
    walls, cpus, round_mfus = [], [], []
    for r in range(a.rounds):
        round_walls = []
        for _ in range(a.steps // a.rounds + (r < a.steps % a.rounds)):
            wall, cpu, (state, m) = timed(compiled, state, batch)
            round_walls.append(wall)
            cpus.append(cpu)
        walls += round_walls
        peaks.append(peak())
        round_mfus.append(tokens / statistics.median(round_walls) * flops_tok / peaks[-1])
    loss_last = float(m["loss"])

    breakdown = {}
    if a.breakdown:
        loss_fn = jax.jit(lambda p, b: step_lib._micro_loss(p, b, 1.0, 1.0, trainer.step_cfg)[0])
        for name, fn in (("forward (loss)", loss_fn.lower(state.params, batch).compile()),
                         ("forward + backward", trainer.grads.lower(state.params, batch).compile())):
            runs = [timed(fn, state.params, batch)[:2] for _ in range(max(a.steps // 2, 3))]
            breakdown[name] = (min(w for w, _ in runs), statistics.median(c for _, c in runs))

    # XLA counts a while loop's body once, so the scanned layers appear once in the step's count;
    # a 1-layer model has no loop and gets a complete count, comparable with the formula.
    one = cfg.replace(model=dataclasses.replace(cfg.model, num_layers=1))
    trainer1 = build(one, make_mesh(mesh_shape))
    state1, batch1 = trainer1.init(), trainer1.shard_batch(synthetic_batch(one))
    xla_one = xla_flops(trainer1.step.lower(state1, batch1).compile()) / tokens
    xla_step = xla_flops(compiled) / tokens

    m_, best_peak, best_s = cfg.model, max(peaks), min(walls)
    tps = tokens / best_s
    one_formula = flops.flops_per_token(one.model, cfg.data.seq_len)
    one_square = flops.flops_per_token(one.model, cfg.data.seq_len, causal=False)
    rows = [
        ("shape", f"d_model={m_.d_model} layers={m_.num_layers} heads={m_.num_heads} "
                  f"kv_heads={m_.num_kv_heads} ffn={m_.ffn_dim} vocab={m_.vocab_size} seq={cfg.data.seq_len} "
                  f"batch={cfg.data.global_batch_size} {m_.compute_dtype} remat={m_.remat} "
                  f"attention={m_.attention} micro_batches={a.micro_batches}"),
        ("device", f"{jax.devices()[0].device_kind} x{jax.device_count()} on {len(os.sched_getaffinity(0))} "
                   "host cores, mesh " + " ".join(f"{k}={v}" for k, v in mesh_shape.items())),
        ("data", "synthetic: uniform random tokens, one document per row, same batch each step"),
        ("malloc", a.malloc),
        ("parameters", f"{flops.param_counts(m_)['total'] / 1e6:.2f}M"),
        ("compile (init + lower + compile)", f"{compile_s:.1f} s"),
        ("loss (after warmup -> last step)", f"{loss_first:.4f} -> {loss_last:.4f}"),
        ("step time best / median / worst", f"{best_s * 1e3:.1f} / {statistics.median(walls) * 1e3:.1f} / "
                                            f"{max(walls) * 1e3:.1f} ms ({a.steps} steps)"),
        ("process CPU time per step (median)", f"{statistics.median(cpus) * 1e3:.1f} ms"),
        ("tokens/s (best step)", f"{tps:,.0f}"),
        ("model FLOPs/token", f"{flops_tok:,.0f}"),
        ("model TFLOP/s (best step)", f"{tps * flops_tok / 1e12:.4f}"),
        (f"f32 matmul peak, n={a.peak_n} (best / median of {len(peaks)})",
         f"{best_peak / 1e9:.1f} / {statistics.median(peaks) / 1e9:.1f} GFLOP/s"),
        ("MFU (best step / best peak)", f"{tps * flops_tok / best_peak:.1%}"),
        ("MFU (median over rounds: round step / round peak)", f"{statistics.median(round_mfus):.1%}"),
        ("XLA cost_analysis FLOPs/token, this step", f"{xla_step:,.0f} (the scanned layers counted once)"),
        ("XLA cost_analysis FLOPs/token, 1 layer",
         f"{xla_one:,.0f} = {xla_one / one_formula:.3f} x the formula, {xla_one / one_square:.3f} x the "
         "formula with the full score square"),
    ]
    for name, (wall, cpu) in breakdown.items():
        rows.append((f"{name}: best wall / median CPU",
                     f"{wall * 1e3:.1f} ms ({wall / best_s:.0%} of the best step) / {cpu * 1e3:.1f} ms"))
    width = max(len(name) for name, _ in rows)
    print(f"| {'metric':<{width}} | value |")
    print(f"|{'-' * (width + 2)}|-------|")
    for name, value in rows:
        print(f"| {name:<{width}} | {value} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
