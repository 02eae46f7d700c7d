"""The llama3_1b train step compiled for an H100/H200 on a machine without a GPU: its GEMMs, the fp8
GEMMs' epilogues, the fusions around the fp8 operands and the bytes the other fusions move, per recipe.

    python benchmarks/gpu_aot.py                                   # llama3_1b, 2 x 8192 tokens, H200, bf16 vs fp8 delayed
    python benchmarks/gpu_aot.py --gpu h100 --recipes none,delayed,current
    python benchmarks/gpu_aot.py --dump /tmp/hlo model.fp8.keep_bf16=[]   # also write each compiled module's text

Deviceless ahead-of-time compilation (`lumen_jax/compiler/aot.py`): the trainer's step as
`python -m lumen_jax.lower` builds it, compiled by XLA's GPU compiler for a one-GPU topology
described in text; nothing runs, nothing is autotuned (cuBLAS's default algorithms; Triton GEMM
fusions off, as the GPU's autotuner chose). It needs the CUDA plugin (`pip install
"jax[cuda12]"`, see docs/GPU.md); without it the script exits 2. 15-50 s per recipe on 2 cores.

Columns, per step (loops counted): GEMMs in bf16 and in fp8 (cuBLAS(Lt) custom calls); the fp8
GEMMs whose epilogue writes f32 or bf16; GEMMs writing an f32 [tokens, N] array; fusions that
quantize (write fp8 from a wider type) and that copy fp8 (transposes for cuBLASLt's TN layout);
passes over the arrays that get quantized (instructions reading them, per array); non-GEMM
fusions; the bytes those fusions read and write and that traffic at the GPU's HBM bandwidth; the
compiled memory (arguments + outputs - aliases + temporaries). A second table splits the non-GEMM
fusions by role (`aot.fusion_role`: quantize, fp8 move, amax, small, other).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXIT_BAD_INPUT = 2


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "llama3_1b.yaml"))
    p.add_argument("--gpu", choices=("h100", "h200"), default="h200", help="the target (default h200: the measured GPU)")
    p.add_argument("--recipes", default="none,delayed", help="comma-separated model.fp8.recipe values")
    p.add_argument("--attention", default="cudnn", help="model.attention (cudnn: what auto runs on Hopper)")
    p.add_argument("--batch", type=int, default=2, help="sequences per step (data.global_batch_size)")
    p.add_argument("--dump", default="", help="write each recipe's compiled HLO text to DIR/<recipe>.hlo")
    p.add_argument("--json", action="store_true", help="print the reports as JSON")
    p.add_argument("overrides", nargs="*", help="more section.key=value overrides")
    return p.parse_args(argv)


def compile_recipe(args: argparse.Namespace, recipe: str) -> dict:
    from lumen_jax.compiler import aot
    from lumen_jax.config.files import load_config

    cfg = load_config(args.config, ["mesh.fsdp=1", "runtime.cpu_devices=0", f"data.global_batch_size={args.batch}",
                                    f"model.attention={args.attention}", f"model.fp8.recipe={recipe}",
                                    *args.overrides])
    t = time.perf_counter()
    compiled = aot.compile_step(cfg, args.gpu)
    seconds = time.perf_counter() - t
    text = compiled.as_text()
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
        with open(os.path.join(args.dump, f"{recipe}.hlo"), "w") as f:
            f.write(text)
    m = compiled.memory_analysis()
    report = aot.gemm_report(text, args.batch * cfg.data.seq_len)
    return {"recipe": recipe, "compile_s": round(seconds, 1),
            "memory_gib": (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
                           + m.temp_size_in_bytes) / 2**30,
            "fusion_ms": report.fusion_bytes / aot.BANDWIDTH[args.gpu] * 1e3, **report.to_json()}


def format_table(rows: list[dict], gpu: str) -> str:
    def n(r: dict, pred) -> int:
        return sum(v for k, v in r["gemms"].items() if pred(k))

    head = ("| recipe | bf16 GEMMs | fp8 GEMMs | fp8 out f32 / bf16 | f32 [T,N] outputs | quantize fusions "
            "| fp8 copies | reads per quantized array | fusions | fusion GB | at HBM ms | memory GiB |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        f8 = r["fp8_epilogues"]
        out32 = sum(v for k, v in f8.items() if k.startswith("out=f32"))
        lines.append(
            f"| {r['recipe']} | {n(r, lambda k: k.startswith('bf16 x bf16'))} | {n(r, lambda k: k.startswith('f8'))} "
            f"| {out32} / {sum(f8.values()) - out32} | {r['f32_outputs']} ({r['f32_output_bytes'] / 1e9:.1f} GB) "
            f"| {r['quantize_fusions']} | {r['fp8_copies']} "
            f"| {r['source_reads'] / r['sources'] if r['sources'] else 0:.1f} ({r['sources']} arrays) "
            f"| {r['fusions']} | {r['fusion_bytes'] / 1e9:.1f} | {r['fusion_ms']:.1f} | {r['memory_gib']:.2f} |")
    lines.append(f"\n(per step; {gpu}: HBM ms = fusion bytes / datasheet bandwidth)")
    roles = list(rows[0]["by_role"]) if rows else []
    lines += ["\nNon-GEMM fusions by role (`aot.fusion_role`), per step: fusions / GB\n",
              "| recipe | " + " | ".join(roles) + " |", "|" + "---|" * (len(roles) + 1)]
    for r in rows:
        lines.append(f"| {r['recipe']} | " + " | ".join(f"{n} / {b / 1e9:.1f}" for n, b in r["by_role"].values()) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    from lumen_jax.compiler import aot
    from lumen_jax.config import ConfigError

    if not aot.plugin_installed():
        print(f"error: benchmarks/gpu_aot.py compiles for a GPU and needs the CUDA plugin ({aot.PLUGIN}): "
              f"{aot.INSTALL}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        rows = [compile_recipe(args, r.strip()) for r in args.recipes.split(",") if r.strip()]
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(format_table(rows, args.gpu))
        for r in rows:
            print(f"\n{r['recipe']}: GEMMs {r['gemms']}; fp8 epilogues {r['fp8_epilogues']}; compiled in {r['compile_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
