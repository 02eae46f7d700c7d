"""Mixture of experts on the CPU: tokens/s of `configs/tiny_moe.yaml` and a fine-grained variant
against the dense model with the same active parameters, on one CPU device and on the 8-device
mesh, against transformers' `MixtralForCausalLM` training step in torch on the same CPU, and where
the MoE step's time goes (from a profile).

    .venv/bin/python benchmarks/moe.py [--steps 5] [--rounds 3] [--no-torch]

Rows (all fp32, batch 16 x 128, AdamW):

- `dense`: `ffn_dim = top_k * expert_ffn_dim`, the active width of one MoE layer (the router's
  D x E weights aside);
- `tiny_moe`: 8 experts of width 64, top-2; `fine`: 64 experts of width 16, top-8 (the same active
  width, DeepSeekMoE / Qwen3-MoE style); `ragged_dot`: tiny_moe with the experts as
  `jax.lax.ragged_dot` (`Ops.moe_matmul=ragged`, the GPU form, which XLA:CPU runs as a dense
  matmul against every expert; the CPU form before `ops/grouped.py`);
- `torch Mixtral`: `transformers.MixtralForCausalLM` with tiny_moe's shape (its router aux loss on),
  loss, backward and `torch.optim.AdamW` step, torch's default threads.

Every trainer is built and warmed up first; then `--rounds` rounds each time `--steps` steps of
every row in turn (interleaved, so load from other processes spreads over all rows), and the table
shows the median step. On the mesh the 8 emulated devices share the host's cores, so tokens/s
there measures total work. `--profile` adds, per MoE row, the share of 2 profiled steps' device
time by kind of op (sort, gather/scatter, the experts' loops, all-to-all). Results and the
command: docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_throughput import synthetic_batch  # noqa: E402

from lumen_jax.config import MeshConfig, MoeConfig  # noqa: E402
from lumen_jax.config.checks import validate  # noqa: E402
from lumen_jax.config.files import load_config  # noqa: E402
from lumen_jax.metrics import flops  # noqa: E402
from lumen_jax.ops.choice import choose  # noqa: E402
from lumen_jax.parallel.mesh import make_mesh  # noqa: E402
from lumen_jax.train.build import build  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Profile events by kind: the first pattern an HLO op's name matches.
KINDS = (("all-to-all", r"all-to-all"), ("experts (while loops)", r"^while"), ("sort", r"^sort"),
         ("gather/scatter", r"gather|scatter"), ("other collectives", r"all-reduce|all-gather|reduce-scatter"))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5, help="timed steps per row and round")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (the median step over all)")
    p.add_argument("--no-torch", action="store_true", help="skip the transformers Mixtral row")
    p.add_argument("--profile", action="store_true", help="where each MoE row's time goes")
    return p.parse_args(argv)


def configs() -> list[tuple[str, object, str | None]]:
    """(name, config, matmul override) per row."""
    moe_cfg = load_config(os.path.join(REPO, "configs", "tiny_moe.yaml"), [])
    moe = moe_cfg.model.moe
    dense = moe_cfg.replace(model=dataclasses.replace(moe_cfg.model, ffn_dim=moe.top_k * moe_cfg.model.expert_ffn_dim,
                                                      moe=MoeConfig()))
    fine = moe_cfg.replace(model=dataclasses.replace(moe_cfg.model, moe=dataclasses.replace(
        moe, num_experts=64, top_k=8, expert_ffn_dim=16)))
    on = lambda cfg, **axes: cfg.replace(mesh=MeshConfig(**{"fsdp": 1, **axes}))  # noqa: E731
    return [("dense, 1 device", on(dense), None), ("tiny_moe, 1 device", on(moe_cfg), None),
            ("fine 64x top-8, 1 device", on(fine), None), ("ragged_dot, 1 device", on(moe_cfg), "ragged"),
            ("dense, fsdp=8", on(dense, fsdp=8), None), ("tiny_moe, expert=4,data=2", on(moe_cfg, expert=4, data=2), None),
            ("tiny_moe, expert=8", on(moe_cfg, expert=8), None), ("fine, expert=4,data=2", on(fine, expert=4, data=2), None),
            ("fine, expert=8", on(fine, expert=8), None)]


class JaxRow:
    def __init__(self, cfg, matmul: str | None):
        devices = jax.devices()[:cfg.mesh.expert * cfg.mesh.data * cfg.mesh.fsdp]
        shape = validate(cfg, len(devices))
        ops = choose(cfg.model, devices)
        if matmul:
            ops = dataclasses.replace(ops, moe_matmul=matmul)
        self.trainer = build(cfg, make_mesh(shape, devices), ops)
        self.state = self.trainer.init()
        self.batch = self.trainer.shard_batch(synthetic_batch(cfg))
        self.counts = flops.param_counts(cfg.model)
        self.time(1)  # compile and warm up

    def time(self, steps: int) -> list[float]:
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            self.state, metrics = self.trainer.step(self.state, self.batch)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - start)
        return times

    def profile(self) -> dict[str, float]:
        """Share of 2 profiled steps' device time per kind of op (KINDS)."""
        with tempfile.TemporaryDirectory() as log_dir:
            jax.profiler.start_trace(log_dir, create_perfetto_trace=True)
            start = time.perf_counter()
            self.time(2)
            wall = time.perf_counter() - start
            jax.profiler.stop_trace()
            with gzip.open(glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True)[0]) as f:
                trace = json.load(f)
        events = trace["traceEvents"] if isinstance(trace, dict) else trace
        spent: dict[str, float] = collections.defaultdict(float)
        for e in events:
            name = e.get("name", "")
            if e.get("ph") != "X" or name.startswith("end"):
                continue
            kind = next((k for k, pattern in KINDS if re.search(pattern, name)), None)
            if kind:
                spent[kind] += e.get("dur", 0) * 1e-6
        return {k: spent[k] / (self.trainer.mesh.size * wall) for k, _ in KINDS}


class TorchMixtral:
    """transformers' MixtralForCausalLM with tiny_moe's shape: one training step per call."""

    def __init__(self, cfg):
        import torch
        from transformers import MixtralConfig, MixtralForCausalLM

        m, moe = cfg.model, cfg.model.moe
        hf = MixtralConfig(vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.expert_ffn_dim,
                           num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
                           num_key_value_heads=m.num_kv_heads, num_local_experts=moe.num_experts,
                           num_experts_per_tok=moe.top_k, router_aux_loss_coef=moe.aux_loss_weight,
                           output_router_logits=True, max_position_embeddings=cfg.data.seq_len,
                           attn_implementation="sdpa")
        torch.manual_seed(0)
        self.torch, self.model = torch, MixtralForCausalLM(hf).train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.optim.lr)
        tokens = torch.randint(0, m.vocab_size, (cfg.data.global_batch_size, cfg.data.seq_len + 1))
        self.inputs, self.labels = tokens[:, :-1], tokens[:, 1:]
        self.counts = flops.param_counts(cfg.model)
        self.time(1)

    def time(self, steps: int) -> list[float]:
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            logits = self.model(input_ids=self.inputs).logits
            loss = self.torch.nn.functional.cross_entropy(logits.flatten(0, 1), self.labels.flatten())
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            times.append(time.perf_counter() - start)
        return times


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    rows = [(name, JaxRow(cfg, matmul), cfg) for name, cfg, matmul in configs()]
    if not a.no_torch:
        cfg = rows[1][2]
        rows.insert(4, ("torch Mixtral, 1 process", TorchMixtral(cfg), cfg))
    times: dict[str, list[float]] = {name: [] for name, _, _ in rows}
    for _ in range(a.rounds):
        for name, row, _ in rows:
            times[name] += row.time(a.steps)
    head = f"{'model, mesh':28s}{'params':>9s}{'active':>9s}{'step ms':>10s}{'tokens/s':>10s}"
    print(head + "  vs dense")
    dense = {}
    for name, row, cfg in rows:
        step = statistics.median(times[name])
        tokens_s = cfg.data.global_batch_size * cfg.data.seq_len / step
        where = "8" if "=" in name else "1"
        if name.startswith("dense"):
            dense[where] = tokens_s
        print(f"{name:28s}{row.counts['total'] / 1e6:8.2f}M{row.counts['matmul'] / 1e6:8.2f}M{step * 1e3:10.1f}"
              f"{tokens_s:10,.0f}{tokens_s / dense[where]:9.2f}x", flush=True)
    if a.profile:
        print(f"\n{'where the time goes':28s}" + "".join(f"{k:>22s}" for k, _ in KINDS))
        for name, row, cfg in rows:
            if isinstance(row, JaxRow) and cfg.model.moe.enabled:
                share = row.profile()
                print(f"{name:28s}" + "".join(f"{share[k]:22.1%}" for k, _ in KINDS), flush=True)


if __name__ == "__main__":
    main()
