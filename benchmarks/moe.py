"""Mixture of experts on the CPU mesh: tokens/s of `configs/tiny_moe.yaml` against a dense model with
the same active parameters, and the share of the step spent in the all-to-alls (from a profile).

    .venv/bin/python benchmarks/moe.py [--steps 10] [--meshes expert=4,data=2 expert=1,fsdp=8]

Each row builds the train step as `lumen_jax.train` does on 8 emulated CPU devices, runs one
warm-up step, times `--steps` steps (median), then records 2 steps with `jax.profiler` and sums
the `all-to-all` events of every device: the share is that sum / (devices x the profiled wall
time). The dense model has `ffn_dim = top_k * expert_ffn_dim`, the active width of one MoE layer
(the router's D x E weights aside). On the CPU the 8 devices share the host's cores, so tokens/s
measures total work. Results and the command: docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import gzip
import json
import os
import statistics
import sys
import tempfile
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_throughput import synthetic_batch  # noqa: E402

from lumen_jax.metrics import flops  # noqa: E402
from lumen_jax.train.build import build  # noqa: E402
from lumen_jax.config import MeshConfig, MoeConfig  # noqa: E402
from lumen_jax.config.checks import validate  # noqa: E402
from lumen_jax.config.files import load_config  # noqa: E402
from lumen_jax.parallel.mesh import make_mesh  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="timed steps (after one warm-up step)")
    p.add_argument("--meshes", nargs="+", default=["expert=4,data=2", "expert=2,fsdp=4", "expert=1,fsdp=8"],
                   help="MoE meshes to run (the dense model runs on fsdp=8)")
    return p.parse_args(argv)


def all_to_all_share(trainer, state, batch) -> tuple[float, object]:
    """Share of 2 profiled steps' device time spent in all-to-all events, and the state after them."""
    with tempfile.TemporaryDirectory() as log_dir:
        jax.profiler.start_trace(log_dir, create_perfetto_trace=True)
        start = time.perf_counter()
        for _ in range(2):
            state, metrics = trainer.step(state, batch)
        jax.block_until_ready(metrics)
        wall = time.perf_counter() - start
        jax.profiler.stop_trace()
        with gzip.open(glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True)[0]) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    spent = sum(e.get("dur", 0) for e in events if e.get("ph") == "X" and "all-to-all" in e.get("name", "")
                and not e["name"].startswith("end"))
    return spent * 1e-6 / (trainer.mesh.size * wall), state


def measure(cfg, steps: int) -> dict:
    shape = validate(cfg, 8)
    trainer = build(cfg, make_mesh(shape))
    state = trainer.init()
    batch = trainer.shard_batch(synthetic_batch(cfg))
    state, metrics = trainer.step(state, batch)
    jax.block_until_ready(metrics)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = trainer.step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    share, _ = all_to_all_share(trainer, state, batch)
    tokens = cfg.data.global_batch_size * cfg.data.seq_len
    step = statistics.median(times)
    return {"step_s": step, "tokens_per_s": tokens / step, "all_to_all": share,
            "active": flops.param_counts(cfg.model)["matmul"], "total": flops.param_counts(cfg.model)["total"]}


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    moe_cfg = load_config(os.path.join(REPO, "configs", "tiny_moe.yaml"), [])
    moe = moe_cfg.model.moe
    dense_model = dataclasses.replace(moe_cfg.model, ffn_dim=moe.top_k * moe_cfg.model.expert_ffn_dim,
                                      moe=MoeConfig())
    rows = [("dense, fsdp=8", moe_cfg.replace(model=dense_model, mesh=MeshConfig(fsdp=8)))]
    for spec in a.meshes:
        sizes = {k: int(v) for k, v in (kv.split("=") for kv in spec.split(","))}
        rows.append((f"tiny_moe, {spec}", moe_cfg.replace(mesh=MeshConfig(**{"fsdp": 1, **sizes}))))
    print(f"{'model, mesh':28s}{'params':>9s}{'active':>9s}{'step ms':>10s}{'tokens/s':>10s}{'all-to-all':>12s}")
    for name, cfg in rows:
        r = measure(cfg, a.steps)
        print(f"{name:28s}{r['total'] / 1e6:8.2f}M{r['active'] / 1e6:8.2f}M{r['step_s'] * 1e3:10.1f}"
              f"{r['tokens_per_s']:10,.0f}{r['all_to_all']:11.1%}", flush=True)


if __name__ == "__main__":
    main()
