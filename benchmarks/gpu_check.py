"""Every GPU figure at once: one process, under 8 minutes on one H100/H200, one JSON and the tables.

    python benchmarks/gpu_check.py                 # writes gpu_check.json and gpu_check.md
    python benchmarks/gpu_check.py --overlap-flags="--xla_gpu_enable_latency_hiding_scheduler=true"
    python benchmarks/gpu_check.py --dry-run       # CPU: tiny shapes through every part (not a measurement)

(a) attention (`attention_gpu.py`'s timing): bf16, head dim 128, causal and not, L in {2k, 8k},
    batch = 16k tokens / L, 16 heads; our flash kernels, cuDNN and XLA, forward and forward+backward,
    TFLOP/s (causal counted as half), and the forward's max error against the float32 reference
    (max |o - o_f32| / max |o_f32|, the reference on the same inputs upcast).
(b) llama3_1b on one GPU for `--steps` steps (`fp8_gpu.py`'s step: seq 8192, `--batch` sequences):
    tokens/s, MFU, HFU, the compiled program's memory (arguments + outputs + temporaries), without and
    with the overlap flags. The flags are XLA options for that compile only (XLA_FLAGS are read once
    per process): `--overlap-flags`, else the config's `runtime.xla_gpu_flags` (see `overlap_flags`);
    with `runtime.xla_gpu_flags=none` and no `--overlap-flags`, (b) runs once and says so.
(c) the same step with fp8 `delayed` and `current` (first and last layers in bf16; with the overlap
    flags when there are some), and whether the compiled HLO has cuBLASLt fp8 GEMMs.
(d) the verdict against the targets: flash forward+backward >= 1.0x cuDNN at 8k causal, llama3_1b
    MFU >= 50%, fp8 delayed >= 1.3x bf16 tokens/s.

A wall-clock budget (`--budget-s`) skips what it cannot reach rather than overrun; skipped rows
say so. docs/PERFORMANCE.md shows the markdown this writes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT]  # the parts (attention_gpu.py, fp8_gpu.py) and lumen_jax

TARGETS = {"flash_vs_cudnn": 1.0, "mfu": 0.50, "fp8_speedup": 1.3}
FP8_RECIPES = ("delayed", "current")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gpu_check", help="writes OUT.json and OUT.md")
    p.add_argument("--budget-s", type=float, default=450.0, help="skip what starts after this many seconds")
    p.add_argument("--lengths", default="2048,8192")
    p.add_argument("--tokens", type=int, default=16384, help="attention batch = tokens // L")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--impls", default="flash,cudnn,xla")
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "llama3_1b.yaml"))
    p.add_argument("--batch", type=int, default=2, help="sequences per step in (b) and (c)")
    p.add_argument("--steps", type=int, default=30, help="steps per run in (b) and (c), warm-up included")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--overlap-flags", default=None,
                   help='XLA options for (b) with overlap, e.g. --overlap-flags="--xla_gpu_enable_latency_hiding_scheduler=true"'
                        " (default: the config's runtime.xla_gpu_flags where it exists)")
    p.add_argument("--parts", default="attention,model", help="attention: (a); model: (b) and (c)")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: runs every part, measures nothing")
    a = p.parse_args(argv)
    if a.dry_run:  # tiny everything; flash runs in Pallas's interpreter, cuDNN is n/a
        a.lengths, a.tokens, a.heads, a.head_dim = "64", 64, 2, 16
        a.steps, a.warmup = 2, 1
    if a.steps <= a.warmup:
        p.error(f"--steps {a.steps} must be more than --warmup {a.warmup}")
    return a


def overlap_flags(a: argparse.Namespace, cfg: Any) -> dict[str, Any] | None:
    """The flags of (b)'s second run: `--overlap-flags` wins; else the config's `runtime.xla_gpu_flags`
    (default `overlap`) as the trainer's step on a GPU compiles with it (`step_compile_options`: those
    this XLA lacks left out, with a note); None: no second run (`runtime.xla_gpu_flags=none`)."""
    from lumen_jax.runtime import process as runtime
    if a.overlap_flags is not None:
        return runtime.parse_flags(a.overlap_flags) or None
    return runtime.step_compile_options(cfg.runtime, cfg.model, cfg.mesh, "gpu") or None


# --------------------------------------------------------------------------------------------------
# (a) attention
# --------------------------------------------------------------------------------------------------

def attention_part(a: argparse.Namespace, deadline: float) -> list[dict]:
    import jax
    import jax.numpy as jnp

    import attention_gpu as part
    from lumen_jax.ops.reference import reference

    rows = []
    gpu = jax.default_backend() == "gpu"
    for length in (int(x) for x in a.lengths.split(",")):
        b = max(1, a.tokens // length)
        q, k, v, do = part.inputs(b, length, a.heads, a.heads, a.head_dim, jnp.bfloat16)
        for causal in (True, False):
            ref = None
            for impl in a.impls.split(","):
                row = {"L": length, "B": b, "causal": causal, "impl": impl, "error": None}
                if not gpu and impl == "cudnn":
                    rows += [{**row, "mode": m, "note": "n/a (GPU only)"} for m in ("fwd", "fwd+bwd")]
                    continue
                if time.perf_counter() < deadline:
                    try:
                        if ref is None:  # the float32 reference on the same (bf16) inputs
                            f32 = [x.astype(jnp.float32) for x in (q, k, v)]
                            ref = jax.jit(lambda q, k, v: reference(q, k, v, causal=causal)[0])(*f32)
                        out = jax.jit(part.attention_fn(impl, causal, None))(q, k, v).astype(jnp.float32)
                        row["error"] = float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))
                    except Exception as e:  # noqa: BLE001 - a benchmark reports and goes on
                        row["note"] = part.short_error(e)
                for mode in ("fwd", "fwd+bwd"):
                    r = {**row, "mode": mode}
                    if time.perf_counter() > deadline:
                        r["note"] = "skipped (budget)"
                    else:
                        try:
                            sec, nbytes = part.measure(impl, mode, causal, q, k, v, do)
                            r.update(ms=sec * 1e3, gib=nbytes / 2**30,
                                     tflops=part.flops(mode, b, a.heads, length, a.head_dim, causal) / sec / 1e12)
                        except Exception as e:  # noqa: BLE001
                            r["note"] = part.short_error(e)
                    rows.append(r)
                    print(f"(a) {format_attention_row(r)}", flush=True)
            del ref
        del q, k, v, do
    return rows


# --------------------------------------------------------------------------------------------------
# (b), (c) llama3_1b
# --------------------------------------------------------------------------------------------------

def model_part(a: argparse.Namespace, deadline: float, flags: dict | None) -> list[dict]:
    import fp8_gpu as part

    argv = ["--config", a.config, "--batch", str(a.batch), "--steps", str(a.steps - a.warmup),
            "--warmup", str(a.warmup)]
    if a.dry_run:  # fp8_gpu's smoke shapes, smaller still; every layer fp8 (2 layers: none kept in bf16)
        argv += ["--smoke", "--keep-bf16=", "model.num_layers=2", "data.seq_len=64", "model.vocab_size=256"]
    args = part.parse_args(argv)
    runs = [("none", None)] + ([("none", flags)] if flags else []) + [(r, flags) for r in FP8_RECIPES]
    rows = []
    for recipe, opts in runs:
        row = {"recipe": recipe, "overlap": bool(opts)}
        if time.perf_counter() > deadline:
            row["note"] = "skipped (budget)"
        else:
            try:
                row.update(part.run_recipe(args, recipe, opts))
            except Exception as e:  # noqa: BLE001
                row["note"] = f"error: {type(e).__name__}: {str(e).strip().splitlines()[0][:80] if str(e).strip() else ''}"
        rows.append(row)
        print(f"(b/c) {row}", flush=True)
    return rows


# --------------------------------------------------------------------------------------------------
# (d) verdict and tables
# --------------------------------------------------------------------------------------------------

def _timed(rows: list[dict], **match) -> dict | None:
    """The first attention row with a time that matches `match`."""
    return next((r for r in rows if "ms" in r and all(r.get(k) == v for k, v in match.items())), None)


def verdict(attention: list[dict], model: list[dict]) -> list[str]:
    """Two lines: each target with its figure and met / NOT met / not measured; the fp8 GEMM check."""
    def judge(name: str, value: float | None, target: str, ok: bool, text: str) -> str:
        if value is None:
            return f"{name} not measured"
        return f"{name} {text} (target >= {target}): {'met' if ok else 'NOT met'}"

    longest = max((r["L"] for r in attention), default=0)
    flash = _timed(attention, L=longest, causal=True, impl="flash", mode="fwd+bwd")
    cudnn = _timed(attention, L=longest, causal=True, impl="cudnn", mode="fwd+bwd")
    ratio = cudnn["ms"] / flash["ms"] if flash and cudnn else None
    base = next((r for r in model if r["recipe"] == "none" and "tokens_per_s" in r), None)
    best_mfu = max((r["mfu"] for r in model if r["recipe"] == "none" and r.get("mfu") is not None), default=None)
    delayed = next((r for r in model if r["recipe"] == "delayed" and "tokens_per_s" in r), None)
    bf16_same = next((r for r in model if r["recipe"] == "none" and "tokens_per_s" in r
                      and delayed and r["overlap"] == delayed["overlap"]), base)
    speedup = delayed["tokens_per_s"] / bf16_same["tokens_per_s"] if delayed and bf16_same else None
    line1 = "; ".join([
        judge(f"flash fwd+bwd vs cuDNN at L={longest} causal", ratio, f"{TARGETS['flash_vs_cudnn']:.1f}x",
              bool(ratio and ratio >= TARGETS["flash_vs_cudnn"]), f"{ratio or 0:.2f}x"),
        judge("llama3_1b MFU", best_mfu, f"{TARGETS['mfu']:.0%}", bool(best_mfu and best_mfu >= TARGETS["mfu"]),
              f"{best_mfu or 0:.1%}"),
        judge("fp8 delayed vs bf16 tokens/s", speedup, f"{TARGETS['fp8_speedup']:.1f}x",
              bool(speedup and speedup >= TARGETS["fp8_speedup"]), f"{speedup or 0:.2f}x"),
    ])
    gemms = [f"{r['recipe']} {r['gemms'][0]} compiled / {r['gemms'][1]} pre-optimization"
             for r in model if r["recipe"] in FP8_RECIPES and "gemms" in r]
    line2 = "fp8 GEMMs (cuBLASLt custom calls or f8 dots) in the HLO: " + ("; ".join(gemms) if gemms else "not measured")
    return [line1, line2]


def _fmt(x: Any, spec: str, missing: str = "-") -> str:
    return missing if x is None else format(x, spec)


def format_attention_row(r: dict) -> str:
    return (f"| {r['L']} | {r['B']} | {'yes' if r['causal'] else 'no'} | {r['impl']} | {r['mode']} | "
            f"{_fmt(r.get('ms'), '.3f')} | {_fmt(r.get('tflops'), '.1f')} | {_fmt(r.get('gib'), '.2f')} | "
            f"{_fmt(r.get('error'), '.1e')} | {r.get('note', '')} |")


def markdown(result: dict) -> str:
    """The tables docs/PERFORMANCE.md shows."""
    head = result["header"]
    lines = [f"{head['device']} ({head['backend']}), jax {head['jax']}, {head['date']}, "
             f"{head['seconds']:.0f} s{' (dry run: tiny shapes on CPU, not a measurement)' if head['dry_run'] else ''}",
             "", "(a) attention, bf16, head dim " + str(head["head_dim"]) + ", " + str(head["heads"]) + " heads", "",
             "| L | B | causal | impl | mode | ms | TFLOP/s | GiB | max err vs f32 | note |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [format_attention_row(r) for r in result["attention"]]
    lines += ["", f"(b, c) {os.path.basename(head['config'])}, one device, {head['batch']} sequences per step, "
              f"{head['steps']} steps ({head['warmup']} warm-up); overlap flags: {head['overlap_flags'] or 'none'}", "",
              "| recipe | overlap flags | step ms | tokens/s | MFU | HFU | MFU (bf16 peak) | GiB | fp8 GEMMs compiled | note |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["model"]:
        pct = lambda k: _fmt(r.get(k), ".1%")  # noqa: E731
        lines.append(f"| {r['recipe']} | {'yes' if r['overlap'] else 'no'} | {_fmt(r.get('step_ms'), '.1f')} | "
                     f"{_fmt(r.get('tokens_per_s'), ',.0f')} | {pct('mfu')} | {pct('hfu')} | {pct('mfu_bf16')} | "
                     f"{_fmt(r.get('memory_gib'), '.2f')} | {r['gemms'][0] if 'gemms' in r else '-'} | "
                     f"{r.get('note', '')} |")
    lines += ["", "(d) verdict", "", *[f"- {v}" for v in result["verdict"]]]
    return "\n".join(lines) + "\n"


def write(result: dict, out: str) -> tuple[str, str]:
    paths = (f"{out}.json", f"{out}.md")
    with open(paths[0], "w") as f:
        json.dump(result, f, indent=2)
    with open(paths[1], "w") as f:
        f.write(markdown(result))
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    if a.dry_run:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    from lumen_jax.config.files import load_config

    start = time.perf_counter()
    deadline = start + a.budget_s
    flags = overlap_flags(a, load_config(a.config, []))
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}; overlap flags: {flags}",
          flush=True)
    parts = a.parts.split(",")
    attention = attention_part(a, deadline) if "attention" in parts else []
    model = model_part(a, deadline, flags) if "model" in parts else []
    result = {"header": {"device": dev.device_kind, "backend": jax.default_backend(), "jax": jax.__version__,
                         "date": time.strftime("%Y-%m-%d"), "dry_run": a.dry_run, "config": a.config,
                         "batch": a.batch, "steps": a.steps, "warmup": a.warmup, "heads": a.heads,
                         "head_dim": a.head_dim, "overlap_flags": flags, "targets": TARGETS,
                         "seconds": time.perf_counter() - start},
              "attention": attention, "model": model,
              "verdict": [("dry run on CPU, not a measurement: " if a.dry_run else "") + line
                          for line in verdict(attention, model)]}
    paths = write(result, a.out)
    print("\n".join(result["verdict"]))
    print(f"wrote {paths[0]} and {paths[1]} in {result['header']['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
