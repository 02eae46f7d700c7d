"""`python -m lumen_jax.lower --config X.yaml --platform cuda [--json] [overrides]`: the trainer's real
step lowered for a GPU on any machine, and what the lowered program holds.

The step is built for the config's mesh on emulated CPU devices (this process starts JAX on the
CPU, whatever the machine has), with the ops `ops.choice.choose` picks for the target GPU
(`--compute-capability`, default 9.0 = Hopper: compiled flash kernels and their Hopper tiles), and
lowered with `jax.stages.Traced.lower(lowering_platforms=(platform,))`, the lowering `jax.export`
runs: nothing is compiled or allocated. The report (`--json` for a machine):

- custom calls: the Pallas/Triton kernels by name (`flash_fwd`, `flash_bwd_dkv`, `flash_bwd_dq`;
  `flash_bwd_fused` for both)
  and any other target, with how often each runs per step (the layer scan counted);
- fp8 dots (dots with fp8 operands, which the GPU compiler turns into cuBLASLt fp8 GEMMs);
- collectives by kind, count and bytes per step: the ones the program states (its per-device regions, parallel/); the
  SPMD partitioner adds the rest when compiling (`--partitioned` compiles the same step for
  XLA:CPU on the same mesh and counts those);
- the largest arrays, and those shaped [.., T, T] (attention scores) for the sequence length T;
- `--compile-kernels`: the flash kernels' Triton IR compiled for the target with the `triton`
  package (`lumen_jax.compiler.kernels`): shared memory, registers, spills against Hopper's limits.

`--against-xla` instead compiles the step for XLA:CPU on the emulated devices and prints the
planner's per-device FLOPs, bytes and collectives next to the compiled program's (`compiled.py`).

A config that cannot lower prints one line naming the op and the layer, exit 2 (like any bad input).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import sys
import traceback
import types
from typing import Any, Sequence

from lumen_jax.config import Config, ConfigError, MeshConfig, RuntimeConfig
from lumen_jax.config.checks import validate
from lumen_jax.config.commands import CommandParser
from lumen_jax.config.files import load_config
from lumen_jax.compiler import hlo

EXIT_BAD_INPUT = 2
PLATFORMS = ("cuda", "cpu")
TOP_ARRAYS = 8


@dataclasses.dataclass(frozen=True)
class TargetGpu:
    """What `ops.choice.choose` and `BlockSizes.default` read of a device, for a GPU not present."""

    compute_capability: str = "9.0"
    platform: str = "gpu"


def devices_needed(cfg: Config) -> int:
    """The mesh's device count when every axis is fixed; 8 when one is -1 (the remaining devices)."""
    sizes = [getattr(cfg.mesh, a) for a in MeshConfig.AXES]
    return math.prod(sizes) if min(sizes) > 0 else 8


@contextlib.contextmanager
def mosaic_without_cuda():
    """JAX's Mosaic GPU attention asks the CUDA runtime for its version while tracing (it refuses
    causal masking on CUDA 12.8.0-12.9.0); without a CUDA plugin that module is None. Lowering needs
    no runtime: answer 12.9.1 (a version with no such restriction) for the time of the lowering."""
    try:
        from jax.experimental.pallas.ops.gpu import attention_mgpu
    except ImportError:  # this JAX has no Mosaic GPU attention: nothing to stand in for
        yield
        return
    if attention_mgpu.cuda_versions is not None:
        yield
        return
    attention_mgpu.cuda_versions = types.SimpleNamespace(cuda_runtime_get_version=lambda: 12091)
    try:
        yield
    finally:
        attention_mgpu.cuda_versions = None


def emulate_cpu_devices(n: int) -> None:
    """`n` emulated CPU devices, set before the JAX backend starts (`runtime.configure`). When a caller
    has started JAX already, its CPU devices must suffice."""
    from lumen_jax.runtime import process as runtime

    try:
        runtime.configure(RuntimeConfig(cpu_devices=n, platform="cpu", compilation_cache_dir="", malloc="default"))
    except RuntimeError:  # the backend runs with another device count; checked below
        pass
    import jax

    if jax.default_backend() != "cpu" or jax.device_count() < n:
        raise ConfigError(f"python -m lumen_jax.lower --devices {n} needs {n} CPU devices, but JAX started with "
                          f"{jax.device_count()} {jax.default_backend()} device(s); run it in a fresh process")


def lower_step(cfg: Config, platform: str, devices: Sequence[Any], compute_capability: str = "9.0",
               flash_forward: str = "") -> tuple[Any, Any]:
    """(the trainer's step lowered for `platform`, its `Ops`), built on `devices` for `cfg`'s mesh.

    `platform="cuda"`: the ops a GPU of `compute_capability` gets; `"cpu"`: the ops these CPU devices
    get. `flash_forward`: override `BlockSizes.forward` (triton | mosaic) of the flash kernels.
    """
    from lumen_jax.train.build import build
    from lumen_jax.ops import cudnn as cudnn_lib
    from lumen_jax.ops.choice import choose
    from lumen_jax.parallel.mesh import make_mesh
    from lumen_jax.compiler.compiled import abstract_step_args

    shape = validate(cfg, len(devices))
    target = [TargetGpu(compute_capability)] * len(devices) if platform == "cuda" else list(devices)
    ops = choose(cfg.model, target, shape["context"])
    if flash_forward:
        if ops.flash_blocks is None:
            raise ConfigError(f"--flash-forward {flash_forward} needs the flash kernels, but the step runs "
                              f"attention={ops.attention}; set model.attention=flash")
        ops = dataclasses.replace(ops, flash_blocks=dataclasses.replace(ops.flash_blocks, forward=flash_forward))
    trainer = build(cfg, make_mesh(shape, devices), ops=ops)
    with mosaic_without_cuda(), cudnn_lib.lowering_without_gpu(compute_capability):
        lowered = trainer.step.trace(*abstract_step_args(trainer, cfg)).lower(lowering_platforms=(platform,))
    return lowered, ops


def partitioned_collectives(cfg: Config, devices: Sequence[Any], lowered_for_cpu: Any = None) -> list[hlo.Collective]:
    """Collectives of the step compiled for XLA:CPU on `devices` (per device, after the SPMD
    partitioner; flash kernels run in Pallas's interpreter there, the shardings are the same).
    `lowered_for_cpu`: the step already lowered for "cpu" (None: lowered here)."""
    lowered = lowered_for_cpu or lower_step(cfg, "cpu", devices)[0]
    return hlo.collectives(hlo.parse(lowered.compile().as_text()))


def fp8_dots(text: str) -> tuple[hlo.Module, list[hlo.Instr]]:
    """(the module, its fp8 GEMMs or dots that run after the first step): of a conditional between
    the first step's layers and the warm ones (fp8 delayed, `ops.choice.Ops.by_state`) only the
    warm branch's, which every later step runs. The branch is found by its op names: compiled
    text, or lowered text with them (`lowered.as_text(dialect="hlo", debug_info=True)`)."""
    from lumen_jax.ops.fp8 import WARM_SCOPE, fp8_gemms

    module = hlo.parse(text, prefer=WARM_SCOPE)
    names = {line.split(" = ")[0].removeprefix("ROOT ").lstrip("%") for line in fp8_gemms(text)}
    return module, [i for i in module.instrs if i.name in names and module.executions(i)]


def summarize(text: str, seq_len: int) -> dict:
    """What the report shows of one HLO module (`lowered.as_text(dialect="hlo")` or compiled text)."""
    module, fp8 = fp8_dots(text)
    squares = hlo.square_arrays(module, seq_len)
    return {
        "custom_calls": [dataclasses.asdict(c) for c in hlo.custom_calls(module)],
        "fp8_dots": {"instructions": len(fp8), "per_step": sum(module.executions(i) for i in fp8)},
        "collectives": [dataclasses.asdict(c) for c in hlo.collectives(module)],
        "largest_arrays": [{"shape": " ".join(map(str, i.arrays)), "bytes": i.nbytes, "instructions": n,
                            "example": f"{i.op} {i.name}"} for i, n in hlo.largest_arrays(module, TOP_ARRAYS)],
        "score_arrays": sorted({str(a) for _, a in squares}),
        "loops": [{"body": b, "trip_count": n} for b, n in module.loops],
    }


def failure_line(exc: BaseException, platform: str) -> str:
    """One line for a step that cannot lower: the message, the op (the innermost lumen_jax op or kernel
    function) and the layer (the innermost model function) the traceback passes through."""
    frames = [(f.f_code.co_filename, line, f.f_code.co_qualname) for f, line in traceback.walk_tb(exc.__traceback__)]
    cause = exc
    while cause.__cause__ is not None:
        cause = cause.__cause__
        frames += [(f.f_code.co_filename, line, f.f_code.co_qualname)
                   for f, line in traceback.walk_tb(cause.__traceback__)]

    def innermost(*parts: str) -> str:
        hits = [f"{qual} ({path.rsplit('/', 2)[-2]}/{path.rsplit('/', 1)[-1]}:{line})"
                for path, line, qual in frames if any(f"/{p}/" in path for p in parts)]
        return hits[-1] if hits else "?"

    message = " ".join(str(cause).split()) or type(cause).__name__
    if len(message) > 300:
        message = message[:297] + "..."
    return (f"cannot lower the step for {platform}: {type(cause).__name__}: {message} "
            f"[op: {innermost('ops', 'kernels', 'parallel')}; layer: {innermost('model')}]")


def format_report(report: dict) -> str:
    lines = [f"{report['config']}: the train step lowered for {report['platform']}"
             f"{' (compute capability ' + report['compute_capability'] + ')' if report['platform'] == 'cuda' else ''}"
             f" on {report['devices']} device(s), mesh {report['mesh']}, attention={report['attention']}"
             + (f", flash tiles {report['flash_blocks']}" if report["flash_blocks"] else ""),
             "", "custom calls (per step: executions, loops counted)"]
    for c in report["custom_calls"]:
        lines.append(f"  {c['target']:32s} {c['kernel'] or '-':16s} {c['instructions']:4d} in the module"
                     f" {c['per_step']:6d} per step")
    if not report["custom_calls"]:
        lines.append("  none")
    f8 = report["fp8_dots"]
    lines += ["", f"fp8 dots: {f8['instructions']} in the module, {f8['per_step']} per step", ""]
    for title, key in (("collectives the program states (per-device regions)", "collectives"),
                       ("collectives after the SPMD partitioner (the step compiled for XLA:CPU, per device)",
                        "collectives_partitioned")):
        if key not in report:
            continue
        lines.append(title)
        for c in report[key]:
            lines.append(f"  {c['kind']:22s} {c['instructions']:4d} in the module {c['per_step']:6d} per step "
                         f"{c['bytes_per_step'] / 2**20:12.2f} MiB per step")
        if not report[key]:
            lines.append("  none")
        lines.append("")
    lines.append("largest arrays (global shapes outside per-device regions, per shard inside them)")
    for a in report["largest_arrays"]:
        lines.append(f"  {a['bytes'] / 2**20:10.2f} MiB  {a['shape']:40s} x{a['instructions']:<4d} e.g. {a['example']}")
    t = report["seq_len"]
    scores = report["score_arrays"]
    lines.append(f"[.., {t}, {t}] arrays (attention scores): " + (", ".join(scores[:6]) if scores else "none"))
    for k in report.get("kernel_resources", []):
        lines.append(f"  kernel {k['kernel']}: {k['shared_bytes']} B shared, {k['registers']} registers x "
                     f"{k['threads']} threads, {k['spill_bytes']} B spilled, "
                     f"{k['wgmma']} wgmma / {k['mma_sync']} mma.sync: {'fits' if k['fits'] else 'DOES NOT FIT'}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = CommandParser(prog="python -m lumen_jax.lower", description=__doc__.splitlines()[0])
    p.add_argument("--config", help="YAML or gin file (configs/*.yaml)")
    p.add_argument("--platform", choices=PLATFORMS, help="lower for this platform (default cuda)")
    p.add_argument("--devices", type=int, default=0,
                   help="emulated devices for the mesh (default: the mesh's product, 8 when an axis is -1)")
    p.add_argument("--compute-capability", default="9.0", help="target GPU (9.0 Hopper, 8.0 Ampere)")
    p.add_argument("--flash-forward", choices=("triton", "mosaic"), default="",
                   help="the flash forward kernel (default: the tuned choice, triton)")
    p.add_argument("--partitioned", action="store_true",
                   help="also compile the step for XLA:CPU and count the collectives the partitioner inserts")
    p.add_argument("--compile-kernels", action="store_true",
                   help="compile the flash kernels' Triton IR for the target with the triton package")
    p.add_argument("--against-xla", action="store_true",
                   help="instead: compile the step for XLA:CPU on --devices emulated devices and print XLA's "
                        "per-device FLOPs, bytes and collectives next to the planner's (choose small shapes)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a report")
    p.add_argument("--traceback", action="store_true", help="a step that cannot lower: also print the traceback")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. mesh.tensor=8 model.attention=flash")
    args = p.parse_args(argv)
    if args.devices < 0:
        raise ConfigError(f"--devices {args.devices} must be >= 1 (0: the mesh's product)")
    major, _, minor = args.compute_capability.partition(".")
    if not (major.isdigit() and minor.isdigit()):
        raise ConfigError(f"--compute-capability {args.compute_capability!r} must be MAJOR.MINOR, e.g. 9.0 (Hopper) "
                          "or 8.0 (Ampere)")
    if args.against_xla:
        given = [f for f, on in (("--platform", args.platform), ("--partitioned", args.partitioned),
                                 ("--compile-kernels", args.compile_kernels),
                                 ("--flash-forward", args.flash_forward)) if on]
        if given:
            raise ConfigError(f"--against-xla compiles the step for XLA:CPU; drop {' '.join(given)}")
    args.platform = args.platform or "cuda"
    return args


def against_xla_report(cfg: Config, n: int) -> tuple[dict, str]:
    """(JSON, text) of the planner next to the step compiled for XLA:CPU on `n` emulated devices."""
    import jax

    from lumen_jax.compiler.compiled import against_xla, format_against_xla
    from lumen_jax.ops.choice import choose
    from lumen_jax.plan.hardware import DEVICES, layout_from_config
    from lumen_jax.plan.predict import predict
    from lumen_jax.plan.startup import moe_backend

    ops = choose(cfg.model, jax.devices()[:n])  # what the step compiled here runs (attention, MoE exchange)
    plan = predict(cfg, layout_from_config(cfg, n), DEVICES["h100"], attention=ops.attention,
                   moe_backend=moe_backend(ops))
    check = against_xla(cfg, plan)
    head = (f"{cfg.name}: the planner's per-device figures ({plan.layout.describe()}, remat={plan.remat}, "
            f"attention={plan.attention}) against the compiled step")
    return {**plan.to_json(), "against_xla": check.to_json()}, head + "\n" + format_against_xla(check, n)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        cfg = load_config(args.config, args.overrides)
        n = args.devices or devices_needed(cfg)
        emulate_cpu_devices(n)
        if args.against_xla:
            out, text = against_xla_report(cfg, n)
            print(json.dumps(out, indent=2) if args.json else text)
            return 0
        import jax

        devices = jax.devices()[:n]
        try:
            lowered, ops = lower_step(cfg, args.platform, devices, args.compute_capability, args.flash_forward)
        except (ConfigError, MemoryError, KeyboardInterrupt):
            raise
        except Exception as e:  # noqa: BLE001 - any lowering failure is reported as one line
            if args.traceback:
                traceback.print_exc()
            print(f"error: {failure_line(e, args.platform)}", file=sys.stderr)
            return EXIT_BAD_INPUT
        mesh = {a: s for a, s in validate(cfg, n).items() if s > 1} or {"devices": 1}
        report = {"config": cfg.name, "platform": args.platform, "compute_capability": args.compute_capability,
                  "devices": n, "mesh": ",".join(f"{a}={s}" for a, s in mesh.items()),
                  "attention": ops.attention, "flash_blocks": str(ops.flash_blocks) if ops.flash_blocks else "",
                  "seq_len": cfg.data.seq_len,
                  **summarize(lowered.as_text(dialect="hlo", debug_info=True), cfg.data.seq_len)}
        if args.partitioned:
            report["collectives_partitioned"] = [dataclasses.asdict(c) for c in partitioned_collectives(
                cfg, devices, lowered if args.platform == "cpu" else None)]
        if args.compile_kernels:
            from lumen_jax.compiler import kernels

            report["kernel_resources"] = [dataclasses.asdict(r) for r in kernels.compile_lowered(
                lowered, kernels.arch_of(args.compute_capability))]
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0
