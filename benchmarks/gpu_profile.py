"""A profile of one GPU in one command, under 8 minutes on an H200: every session with a device runs this first.

    python benchmarks/gpu_profile.py --out gpu_profile          # on the device (--budget-s 360 by default)
    python benchmarks/gpu_profile.py --dry-run --out /tmp/gp     # CPU, tiny shapes: every section, measures nothing

Everything goes under `--out`: profile.json (each section's figures, or its error and traceback),
profile.md (the tables), nvidia-smi-{before,after}.txt, and trace-bf16/, trace-fp8-delayed/ (the
jax.profiler trace of two steps, for TensorBoard / XProf, and the compiled step's HLO, step.hlo.txt).
Sections, in this order, each guarded (a failure is recorded and the next runs) and each skipped
once `--budget-s` is spent (profile.json is rewritten after every section, so a killed run keeps
what it finished):

1. `nvidia_smi`: clocks, power, temperature and throttle reasons (skipped in a dry run).
2. `steps`: `--steps` timed steps of llama3_1b (`fp8_gpu.run_recipe`: one device, `--batch` x 8192
   tokens, bf16) for `model.attention` = auto (here), then flash, cudnn, xla (after 4); the auto
   step is traced for two more steps, and the trace becomes a per-op table (`op_table`): each device event's HLO
   instruction, found in the compiled step, sorted into attention forward / dK-dV / dQ (ours) or
   cuDNN's forward / backward, GEMMs by operand dtype (f32 GEMMs run as TF32 on a GPU), the loss
   (ops/loss.py), the optimizer (optax), elementwise fusions, collectives, other.
3. `attention`: the attention alone (`lumen_jax.ops.attention`, what the trainer runs) at the real
   shapes, B=2, T=8192, 32 query and 8 kv heads, head dim 64 (llama3_1b) and 128 (llama3_8b),
   causal, with and without segment ids (~8 documents a row), ours (flash) and cuDNN: forward and
   forward+backward ms, TFLOP/s (causal counted as half), and the forward's max error against the
   float32 reference on the same inputs (cuDNN's packed layout checked here).
4. `ring_pairs`: cuDNN on the chunk pairs of context parallelism (`model.attention=cudnn` under
   `mesh.context` > 1: jax's private forward and backward, the backward from the merged output and
   log-sum-exp) against our kernel on the same two pairs of a ring device (the reference in a dry
   run), at half `--length`, with documents: the errors of o, lse and the gradients, and each one's fwd+bwd ms. The first run on
   a GPU of that path: `auto` takes it there once this holds.
5. `fp8`: the same step with `model.fp8.recipe=delayed` (first and last layers bf16) against the
   bf16 auto step of section 2, traced and tabled like it.
6. `sweep`: a few of our kernel's tiles (`attention_gpu.sweep_variants`) at head dim 64 and 128, T=8192,
   causal, with segment ids, forward+backward.

`--dry-run` runs every section on CPU at tiny shapes (the kernels in Pallas's interpreter; cuDNN
and nvidia-smi are recorded as not available): the script end to end, not a measurement.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
from typing import Any, Callable, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT]  # attention_gpu.py, fp8_gpu.py and lumen_jax

VARIANTS = ("auto", "flash", "cudnn", "xla")  # model.attention of the timed steps
SMI_QUERY = ("name,clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,power.draw,power.limit,"
             "temperature.gpu,clocks_throttle_reasons.active,utilization.gpu,memory.used,memory.total")
CATEGORIES = ("attention forward", "attention dK/dV", "attention dQ", "attention backward (cuDNN)",
              "GEMM bf16", "GEMM f16", "GEMM fp8", "GEMM f32 (TF32 on GPU)", "GEMM other", "loss", "optimizer",
              "elementwise", "collective", "other", "not in the step's HLO")
_CONTAINERS = ("while", "conditional", "call")  # their events enclose their bodies' (XLA:CPU thunks)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gpu_profile", help="the folder everything is written under")
    p.add_argument("--budget-s", type=float, default=360.0, help="skip the sections that start after this many seconds")
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "llama3_1b.yaml"))
    p.add_argument("--batch", type=int, default=2, help="sequences per step")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant (after --warmup)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--length", type=int, default=8192, help="the attention section's sequence length")
    p.add_argument("--heads", default="32,8", help="the attention section's query,kv heads")
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--documents", type=int, default=8, help="documents per row where segment ids are given")
    p.add_argument("--sweep", type=int, default=4, help="forward and backward tile variants tried per head dim")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: every section runs, measures nothing")
    a = p.parse_args(argv)
    if a.dry_run:
        a.batch, a.steps, a.warmup, a.length, a.heads, a.documents, a.sweep = 1, 2, 1, 128, "4,2", 3, 1
    return a


def step_args(a: argparse.Namespace, attention: str) -> argparse.Namespace:
    """fp8_gpu.py's arguments for the llama3_1b step with `model.attention=attention`."""
    import fp8_gpu

    argv = ["--config", a.config, "--batch", str(a.batch), "--steps", str(a.steps), "--warmup", str(a.warmup)]
    if a.dry_run:  # fp8_gpu's smoke shapes, smaller still
        argv += ["--smoke", "--keep-bf16=", "model.num_layers=2", "data.seq_len=64", "model.vocab_size=256"]
    return fp8_gpu.parse_args(argv + [f"model.attention={attention}"])


# --------------------------------------------------------------------------------------------------
# The per-op table: trace events -> HLO instructions -> categories
# --------------------------------------------------------------------------------------------------

_SOURCE = re.compile(r'source_file="([^"]+)"')
_FRAME = re.compile(r"\bstack_frame_id=(\d+)")
_OPERAND = re.compile(r"%([\w.\-]+)")
_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")
_TABLE_ROW = re.compile(r'^(\d+) (?:"(.*)"|\{(.*)\})$')


def stack_files(text: str) -> dict[str, str]:
    """{stack frame id: the source files of the frame and its callers} from the tables a compiled
    module's text carries (FileNames, FileLocations, StackFrames): where each op came from."""
    tables: dict[str, dict[str, str]] = collections.defaultdict(dict)
    current = None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = line
        elif not line.strip():
            current = None
        elif current and (m := _TABLE_ROW.match(line)):
            tables[current][m.group(1)] = m.group(2) if m.group(2) is not None else m.group(3)
    field = lambda row, key: (re.search(rf"\b{key}=(\d+)", row) or [None, ""])[1]  # noqa: E731
    files = {}
    for frame in tables["StackFrames"]:
        seen, names, f = set(), [], frame
        while f and f not in seen and f in tables["StackFrames"]:
            seen.add(f)
            row = tables["StackFrames"][f]
            location = tables["FileLocations"].get(field(row, "file_location_id"), "")
            names.append(tables["FileNames"].get(field(location, "file_name_id"), ""))
            f = field(row, "parent_frame_id")
        files[frame] = " ".join(names)
    return files


def _operand_dtypes(instr: Any, by_key: dict[tuple[str, str], Any]) -> set[str]:
    from lumen_jax.compiler import hlo

    args = instr.line.split("(", 1)[1] if "(" in instr.line else ""
    typed = hlo.dtypes_in(args)
    found = {by_key[(instr.computation, n)].arrays[0].dtype for n in _OPERAND.findall(args)
             if (instr.computation, n) in by_key and by_key[(instr.computation, n)].arrays}
    return typed | found


def categorize(instr: Any, by_computation: dict[str, list[Any]], by_key: dict[tuple[str, str], Any],
               files: dict[str, str]) -> str:
    """The `CATEGORIES` entry of one compiled HLO instruction (`lumen_jax.compiler.hlo.Instr`);
    `by_key` the module's instructions by (computation, name), `files` from `stack_files`."""
    from lumen_jax.compiler import hlo

    target, kernel = hlo.target_of(instr.line), hlo.kernel_of(instr.line)
    if "flash_fwd" in kernel or (target.startswith("__cudnn$fmha") and "Backward" not in target):
        return "attention forward"
    if "flash_bwd_dkv" in kernel or "flash_bwd_fused" in kernel:  # fused: dK/dV with dQ's atomic adds
        return "attention dK/dV"
    if "flash_bwd_dq" in kernel:
        return "attention dQ"
    if target.startswith("__cudnn$fmha"):
        return "attention backward (cuDNN)"
    inner = [i for c in _CALLS.findall(instr.line) for i in by_computation.get(c, [])]
    texts = [instr.line] + [i.line for i in inner]
    sources = " ".join([s for t in texts for s in _SOURCE.findall(t)] +
                       [files.get(f, "") for t in texts for f in _FRAME.findall(t)])
    gemms = [i for i in [instr, *inner] if i.op == "dot" or any(
        w in hlo.target_of(i.line).lower() for w in ("gemm", "matmul"))]
    if gemms:
        kinds = _operand_dtypes(gemms[0], by_key)
        dtype = ("fp8" if any(d.startswith("f8") for d in kinds) else "bf16" if "bf16" in kinds
                 else "f16" if "f16" in kinds else "f32 (TF32 on GPU)" if "f32" in kinds else "other")
        return f"GEMM {dtype}" if "ops/loss.py" not in sources else "loss"
    if "ops/loss.py" in sources:
        return "loss"
    if "optax" in sources or "train/optim.py" in sources:
        return "optimizer"
    if any(instr.op.startswith(c) for c in hlo.COLLECTIVES):
        return "collective"
    if instr.op == "fusion" or instr.op in ("add", "multiply", "convert", "exponential", "select", "subtract"):
        return "elementwise"
    return "other"


def device_events(profile_dir: str) -> list[tuple[str, str, float, str]]:
    """(HLO module, HLO instruction, seconds, event name) of every op event in the trace under
    `profile_dir`: a GPU's kernel events (its "Stream" lines; a kernel without an `hlo_op` stat as
    "kernel:NAME", which the table shows as not in the step's HLO), else XLA:CPU's thunks (host
    events carrying an `hlo_op` stat, containers left out: they enclose their bodies)."""
    import jax

    paths = [os.path.join(d, f) for d, _, files in os.walk(profile_dir) for f in files if f.endswith(".xplane.pb")]
    if not paths:
        raise FileNotFoundError(f"no .xplane.pb under {profile_dir}")
    data = jax.profiler.ProfileData.from_file(paths[0])
    devices = [p for p in data.planes if p.name.startswith("/device:")]
    events = []
    for plane in devices or [p for p in data.planes if p.name.startswith("/host:CPU")]:
        lines = list(plane.lines)
        streams = [ln for ln in lines if ln.name.startswith("Stream")] if devices else lines
        for line in streams or lines:
            for e in line.events:
                stats = dict(e.stats)
                op = str(stats.get("hlo_op", "")) or (f"kernel:{e.name}" if devices else "")
                if op and op.split(".")[0] not in _CONTAINERS:
                    events.append((str(stats.get("hlo_module", "")), op, e.duration_ns * 1e-9, e.name))
    return events


def op_table(profile_dir: str, steps: int) -> dict[str, Any]:
    """The trace of `steps` steps under `profile_dir` (with the compiled step's step.hlo.txt) as
    {"categories": [{category, ms_per_step, share, events}], "top": the 25 dearest instructions}."""
    from lumen_jax.compiler import hlo

    with open(os.path.join(profile_dir, "step.hlo.txt")) as f:
        text = f.read()
    module_name = text.split(None, 2)[1].rstrip(",") if text.startswith("HloModule") else ""
    module = hlo.parse(text)
    by_name = {i.name: i for i in module.instrs}
    by_key = {(i.computation, i.name): i for i in module.instrs}
    by_computation: dict[str, list[Any]] = collections.defaultdict(list)
    for i in module.instrs:
        by_computation[i.computation].append(i)
    files = stack_files(text)
    seconds: dict[str, float] = collections.defaultdict(float)
    count: dict[str, int] = collections.Counter()
    kernels: dict[str, set] = collections.defaultdict(set)
    for mod, op, sec, name in device_events(profile_dir):
        key = op if (mod in ("", module_name) and op in by_name) else f"{mod}/{op}"
        seconds[key] += sec
        count[key] += 1
        kernels[key].add(name)
    category = {k: categorize(by_name[k], by_computation, by_key, files) if k in by_name else "not in the step's HLO" for k in seconds}
    total = sum(seconds.values()) or 1.0
    rows = []
    for c in CATEGORIES:
        sec = sum(s for k, s in seconds.items() if category[k] == c)
        if sec:
            rows.append({"category": c, "ms_per_step": 1e3 * sec / steps, "share": sec / total,
                         "events": sum(n for k, n in count.items() if category[k] == c)})
    top = sorted(seconds, key=seconds.get, reverse=True)[:25]
    return {"module": module_name, "ms_per_step": 1e3 * total / steps, "categories": rows,
            "top": [{"op": k, "category": category[k], "ms_per_step": 1e3 * seconds[k] / steps,
                     "events": count[k], "kernels": sorted(kernels[k])[:3]} for k in top]}


# --------------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------------

def nvidia_smi(a: argparse.Namespace, when: str) -> dict[str, Any]:
    if a.dry_run:
        return {"skipped": "dry run"}
    if shutil.which("nvidia-smi") is None:
        raise FileNotFoundError("nvidia-smi is not on PATH")
    query = subprocess.run(["nvidia-smi", f"--query-gpu={SMI_QUERY}", "--format=csv"], capture_output=True,
                           text=True, timeout=30)
    full = subprocess.run(["nvidia-smi", "-q", "-d", "CLOCK,POWER,PERFORMANCE,TEMPERATURE"], capture_output=True,
                          text=True, timeout=30)
    with open(os.path.join(a.out, f"nvidia-smi-{when}.txt"), "w") as f:
        f.write(query.stdout + "\n" + full.stdout + full.stderr)
    head, *rows = [ln.split(", ") for ln in query.stdout.strip().splitlines()]
    return {"gpus": [dict(zip(head, r)) for r in rows]}


def model_steps(a: argparse.Namespace, attention: str, recipe: str = "none", trace: str = "") -> dict[str, Any]:
    """`--steps` timed steps (fp8_gpu.run_recipe); with `trace`, two more traced under OUT/`trace`
    and tabled."""
    import fp8_gpu

    profile_dir = os.path.join(a.out, trace) if trace else None
    row = fp8_gpu.run_recipe(step_args(a, attention), recipe, profile_dir=profile_dir)
    row["gemms"] = list(row["gemms"])
    if profile_dir:
        row["op_table"] = guarded(lambda: op_table(profile_dir, 2))
    return row


def documents(b: int, t: int, per_row: int, seed: int = 0):
    """[B, T] int32 segment ids: `per_row` contiguous documents of random lengths a row."""
    import numpy as np

    rng = np.random.default_rng(seed)
    seg = np.ones((b, t), np.int32)
    for r in range(b):
        cuts = np.sort(rng.choice(np.arange(1, t), size=per_row - 1, replace=False))
        seg[r] = 1 + np.searchsorted(cuts, np.arange(t), side="right")
    return seg


def attention_case(impl: str, head_dim: int, heads: tuple[int, int], blocks: Any = None) -> Callable:
    """The trainer's attention (`lumen_jax.ops.attention.attention`) as `model.attention=impl`
    chooses it for this device (a ConfigError where it cannot run: cuDNN on CPU)."""
    import jax

    from lumen_jax.config import ModelConfig
    from lumen_jax.ops.attention import attention
    from lumen_jax.ops.choice import choose

    n, kh = heads
    ops = choose(ModelConfig(attention=impl, d_model=n * head_dim, num_heads=n, num_kv_heads=kh,
                             compute_dtype="bfloat16"), jax.devices()[:1])
    if blocks is not None:
        ops = dataclasses.replace(ops, flash_blocks=blocks)
    return lambda q, k, v, seg: attention(q, k, v, segment_ids_bt=seg, causal=True, ops=ops)


def time_attention(fn: Callable, mode: str, q, k, v, seg, do) -> float:
    import jax

    import attention_gpu

    if mode == "fwd":
        return attention_gpu.timed(jax.jit(fn), (q, k, v, seg))[0]
    fwd_bwd = jax.jit(lambda q, k, v, seg, do: jax.vjp(lambda q, k, v: fn(q, k, v, seg), q, k, v)[1](do))
    return attention_gpu.timed(fwd_bwd, (q, k, v, seg, do))[0]


def attention_alone(a: argparse.Namespace, deadline: float) -> list[dict]:
    import jax
    import jax.numpy as jnp

    import attention_gpu
    from lumen_jax.ops.reference import reference

    heads = tuple(int(x) for x in a.heads.split(","))
    rows = []
    for h in (int(x) for x in a.head_dims.split(",")):
        q, k, v, do = attention_gpu.inputs(a.batch, a.length, heads[0], heads[1], h, jnp.bfloat16)
        for segmented in (False, True):
            seg = jnp.asarray(documents(a.batch, a.length, a.documents)) if segmented else None
            ref = None
            for impl in ("flash", "cudnn"):
                row = {"head_dim": h, "segment_ids": segmented, "impl": impl}
                if time.perf_counter() > deadline:
                    rows.append({**row, "note": "skipped (budget)"})
                    continue
                try:
                    fn = attention_case(impl, h, heads)
                    if ref is None:
                        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
                        ref = jax.jit(lambda q, k, v, s: reference(q, k, v, segment_ids_bt=s, causal=True)[0])(*f32, seg)
                    out = jax.jit(fn)(q, k, v, seg).astype(jnp.float32)
                    row["error"] = float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))
                    for mode in ("fwd", "fwd+bwd"):
                        sec = time_attention(fn, mode, q, k, v, seg, do)
                        row[f"{mode}_ms"] = sec * 1e3
                        row[f"{mode}_tflops"] = attention_gpu.flops(mode, a.batch, heads[0], a.length, h, True) / sec / 1e12
                except Exception as e:  # noqa: BLE001 - a benchmark records and goes on
                    row["note"] = attention_gpu.short_error(e)
                rows.append(row)
                print(f"attention {row}", flush=True)
            del ref
    return rows


def ring_pairs(a: argparse.Namespace) -> list[dict]:
    """cuDNN on the chunk pairs of context parallelism (`model.attention=cudnn` there), against our
    kernel on one GPU: a query chunk with the key chunk before it (unmasked but for the document
    spanning the two) and its own (the diagonal), merged by log-sum-exp, both backwards from the
    merged output, as a device of the ring runs them (`parallel.context`). Per head dim: each
    implementation's max error in o, lse, dq, dk, dv against our kernel's (relative to its
    largest value), and fwd+bwd ms of the two pairs."""
    import jax
    import jax.numpy as jnp

    import attention_gpu
    from lumen_jax.config import ModelConfig
    from lumen_jax.ops.attention import block_kernel
    from lumen_jax.ops.choice import choose
    from lumen_jax.parallel.context import _merge

    n, kh = (int(x) for x in a.heads.split(","))
    t = a.length // 2  # a chunk: context=2 zigzag cuts a sequence of --length into 4; two chunks here
    rows = []
    for h in (int(x) for x in a.head_dims.split(",")):
        q, k, v, do = attention_gpu.inputs(a.batch, 2 * t, n, kh, h, jnp.bfloat16)
        seg = jnp.asarray(documents(a.batch, 2 * t, a.documents))
        q1, do1, s0, s1 = q[:, t:], do[:, t:].astype(jnp.float32), seg[:, :t], seg[:, t:]
        chunks = (k[:, :t], v[:, :t], k[:, t:], v[:, t:])

        def pairs(kernel, q1, k0, v0, k1, v1, do1):
            o, lse = _merge(kernel.fwd(q1, k0, v0, s1, s0, False, 0, 0), kernel.fwd(q1, k1, v1, s1, s1, True, 0, 0))
            no_dlse = jnp.zeros_like(lse)
            dq0, dk0, dv0 = kernel.bwd(q1, k0, v0, s1, s0, o, lse, do1, no_dlse, False, 0, 0)
            dq1, dk1, dv1 = kernel.bwd(q1, k1, v1, s1, s1, o, lse, do1, no_dlse, True, 0, 0)
            return tuple(x.astype(jnp.float32) for x in (o, lse, dq0 + dq1, dk0, dv0, dk1, dv1))

        results = {}
        for impl in ("xla" if a.dry_run else "flash", "cudnn"):  # a dry run: the reference (cheap to compile)
            row = {"head_dim": h, "impl": impl, "chunk": t}
            try:
                ops = choose(ModelConfig(attention=impl, d_model=n * h, num_heads=n, num_kv_heads=kh,
                                         compute_dtype="bfloat16"), jax.devices()[:1], context=2)
                fn = jax.jit(lambda *x, kernel=block_kernel(ops, h): pairs(kernel, *x))
                results[impl] = fn(q1, *chunks, do1)
                if len(results) == 2:  # against the first implementation's
                    for name, got, want in zip(("o", "lse", "dq", "dk0", "dv0", "dk1", "dv1"), results[impl],
                                               next(iter(results.values()))):
                        row[f"{name}_error"] = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
                row["fwd+bwd_ms"] = attention_gpu.timed(fn, (q1, *chunks, do1))[0] * 1e3
            except Exception as e:  # noqa: BLE001 - a benchmark records and goes on
                row["note"] = attention_gpu.short_error(e)
            rows.append(row)
            print(f"ring pairs {row}", flush=True)
    return rows


def sweep(a: argparse.Namespace, deadline: float) -> list[dict]:
    import jax.numpy as jnp

    import attention_gpu
    from lumen_jax.kernels import flash_attention as fa

    heads = tuple(int(x) for x in a.heads.split(","))
    fwd, bwd = attention_gpu.sweep_variants()
    rows = []
    for h in (int(x) for x in a.head_dims.split(",")):
        q, k, v, do = attention_gpu.inputs(a.batch, a.length, heads[0], heads[1], h, jnp.bfloat16)
        seg = jnp.asarray(documents(a.batch, a.length, a.documents))
        default = fa.BlockSizes.default(h)
        step_f, step_b = max(1, len(fwd) // a.sweep), max(1, len(bwd) // a.sweep)
        for changes in [{}, {"backward": "fused"}] + fwd[::step_f][:a.sweep] + bwd[::step_b][:a.sweep]:
            row = {"head_dim": h, "tiles": changes or "default"}
            if time.perf_counter() > deadline:
                rows.append({**row, "note": "skipped (budget)"})
                continue
            try:
                fn = attention_case("flash", h, heads, dataclasses.replace(default, **changes))
                row["fwd+bwd_ms"] = time_attention(fn, "fwd+bwd", q, k, v, seg, do) * 1e3
            except Exception as e:  # noqa: BLE001
                row["note"] = attention_gpu.short_error(e)
            rows.append(row)
            print(f"sweep {row}", flush=True)
    return rows


# --------------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------------

def guarded(fn: Callable[[], Any]) -> Any:
    """fn(), or {"error": ..., "traceback": ...}: one section's failure does not lose the others."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}",
                "traceback": traceback.format_exc()[-3000:]}


def markdown(result: dict) -> str:
    head = result["header"]
    lines = [f"# gpu_profile: {head['device']} ({head['backend']}), jax {head['jax']}, {head['date']}, "
             f"{head.get('seconds', 0):.0f} s" + (" (dry run on CPU: not a measurement)" if head["dry_run"] else ""), ""]
    steps = result.get("steps", {})
    lines += ["## Steps (llama3_1b)", "", "| variant | step ms | tokens/s | MFU | GiB | note |", "|---|---|---|---|---|---|"]
    for name, r in [*steps.items(), ("fp8 delayed (auto)", result.get("fp8", {}))]:
        if isinstance(r, dict) and r:
            lines.append(f"| {name} | {_f(r.get('step_ms'), '.1f')} | {_f(r.get('tokens_per_s'), ',.0f')} | "
                         f"{_f(r.get('mfu'), '.1%')} | {_f(r.get('memory_gib'), '.2f')} | {r.get('error', r.get('note', ''))} |")
    for name, r in (("bf16 auto", steps.get("auto", {})), ("fp8 delayed", result.get("fp8", {}))):
        table = r.get("op_table", {}) if isinstance(r, dict) else {}
        if "categories" in table:
            lines += ["", f"## Per op, {name} ({table['ms_per_step']:.1f} ms of device time per step)", "",
                      "| category | ms/step | share | events |", "|---|---|---|---|"]
            lines += [f"| {c['category']} | {c['ms_per_step']:.2f} | {c['share']:.1%} | {c['events']} |"
                      for c in table["categories"]]
    lines += ["", "## Attention alone", "", "| head dim | segment ids | impl | fwd ms | fwd+bwd ms | fwd+bwd TFLOP/s "
              "| max err vs f32 | note |", "|---|---|---|---|---|---|---|---|"]
    for r in result.get("attention", []) if isinstance(result.get("attention"), list) else []:
        lines.append(f"| {r['head_dim']} | {'yes' if r['segment_ids'] else 'no'} | {r['impl']} | "
                     f"{_f(r.get('fwd_ms'), '.3f')} | {_f(r.get('fwd+bwd_ms'), '.3f')} | "
                     f"{_f(r.get('fwd+bwd_tflops'), '.1f')} | {_f(r.get('error'), '.1e')} | {r.get('note', '')} |")
    lines += ["", "## Context ring's chunk pairs (cuDNN against our kernel)", "",
              "| head dim | impl | chunk | fwd+bwd ms | max err o / lse / dq / dk / dv | note |", "|---|---|---|---|---|---|"]
    for r in result.get("ring_pairs", []) if isinstance(result.get("ring_pairs"), list) else []:
        errors = " / ".join(_f(r.get(f"{x}_error"), ".1e") for x in ("o", "lse", "dq", "dk1", "dv1"))
        lines.append(f"| {r['head_dim']} | {r['impl']} | {r['chunk']} | {_f(r.get('fwd+bwd_ms'), '.3f')} | {errors} | "
                     f"{r.get('note', '')} |")
    lines += ["", "## Tile sweep (flash, segment ids, fwd+bwd)", "", "| head dim | tiles | ms | note |", "|---|---|---|---|"]
    for r in result.get("sweep", []) if isinstance(result.get("sweep"), list) else []:
        lines.append(f"| {r['head_dim']} | {r['tiles']} | {_f(r.get('fwd+bwd_ms'), '.3f')} | {r.get('note', '')} |")
    errors = [f"- {k}: {v['error']}" for k, v in result.items() if isinstance(v, dict) and "error" in v]
    return "\n".join(lines + (["", "## Errors", "", *errors] if errors else [])) + "\n"


def _f(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    if a.dry_run:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.makedirs(a.out, exist_ok=True)
    import jax

    start = time.perf_counter()
    deadline = start + a.budget_s
    dev = jax.devices()[0]
    result: dict[str, Any] = {"header": {"device": dev.device_kind, "backend": jax.default_backend(),
                                         "jax": jax.__version__, "date": time.strftime("%Y-%m-%d %H:%M"),
                                         "dry_run": a.dry_run, "args": vars(a)}}

    def section(name: str, fn: Callable[[], Any]) -> None:
        result[name] = {"note": "skipped (budget)"} if time.perf_counter() > deadline else guarded(fn)
        result["header"]["seconds"] = time.perf_counter() - start
        with open(os.path.join(a.out, "profile.json"), "w") as f:
            json.dump(result, f, indent=2, default=str)
        with open(os.path.join(a.out, "profile.md"), "w") as f:
            f.write(markdown(result))
        print(f"[{time.perf_counter() - start:.0f} s] {name}: "
              f"{result[name].get('error', 'done') if isinstance(result[name], dict) else 'done'}", flush=True)

    print(f"device: {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}, out {a.out}", flush=True)
    section("nvidia_smi_before", lambda: nvidia_smi(a, "before"))
    steps: dict[str, Any] = {}
    result["steps"] = steps

    def timed_steps(variant: str) -> None:
        if time.perf_counter() > deadline:
            steps[variant] = {"note": "skipped (budget)"}
        else:
            steps[variant] = guarded(lambda: model_steps(a, variant, trace="trace-bf16" if variant == "auto" else ""))
        print(f"steps {variant}: {steps[variant].get('step_ms', steps[variant].get('error'))}", flush=True)

    timed_steps("auto")  # first: it carries the trace
    section("attention", lambda: attention_alone(a, deadline))
    section("ring_pairs", lambda: ring_pairs(a))
    section("fp8", lambda: model_steps(a, "auto", "delayed", trace="trace-fp8-delayed"))
    for variant in VARIANTS[1:]:  # xla last: at 8k its scores may not fit
        timed_steps(variant)
    section("sweep", lambda: sweep(a, deadline))
    section("nvidia_smi_after", lambda: nvidia_smi(a, "after"))
    print(f"wrote {a.out}/profile.json and profile.md in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
