"""`python -m lumen_jax.plan`: parse, plan (or search, or list the calibration), print a table or JSON.
No math here."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from typing import Sequence

from lumen_jax.metrics import flops
from lumen_jax.config import Config, ConfigError
from lumen_jax.config.checks import validate
from lumen_jax.config.commands import CommandParser
from lumen_jax.config.files import load_config
from lumen_jax.plan import goodput as goodput_lib
from lumen_jax.plan.goodput import Goodput
from lumen_jax.plan.hardware import DEVICES, Hardware, layout_from_config
from lumen_jax.plan.predict import MEMORY_FRACTION, Plan, predict, search, settings

EXIT_BAD_INPUT = 2
USAGE = "count the bytes, FLOPs and collectives of a run before launch (docs/PLANNING.md)"


def _gb(x: float) -> str:
    return f"{x / 1e9:10.2f} GB"


def format_goodput(g: Goodput) -> str:
    return (f"failures: one every {g.mtbf_s / 3600:.1f} h on {g.devices} devices (Llama 3's rate); checkpoint "
            f"{g.checkpoint_bytes / 1e12:.2f} TB in {g.checkpoint_s:.1f} s, restart {g.restart_s:.0f} s; Young-Daly "
            f"interval {g.interval_s / 60:.1f} min: checkpoint.every_steps={g.every_steps}; expected goodput "
            f"{g.goodput:.1%}")


def format_plan(plan: Plan, cfg: Config, g: Goodput | None = None) -> str:
    """The human-readable report of one plan."""
    b, a, lay = plan.bytes_per_device, plan.activations, plan.layout
    n_params = flops.param_counts(cfg.model)["total"]
    lines = [
        f"{cfg.name}: {n_params / 1e9:.2f}B parameters, {lay.num_devices} devices ({lay.describe()}), "
        f"zero_stage={lay.mesh.zero_stage}, zero_axes={lay.mesh.zero_axes}, fsdp_grad_reduce={lay.mesh.fsdp_grad_reduce}, "
        f"fsdp_regather={lay.mesh.fsdp_regather}, remat={plan.remat}, attention={plan.attention}, "
        f"{plan.micro_batch} x {cfg.data.seq_len} tokens per device per micro-batch, "
        f"{lay.micro_batches} micro-batches per step",
        "",
        "memory per device",
        f"  parameters      {_gb(b['params'])}   fp32 master weights",
        f"  gradients       {_gb(b['grads'])}   fp32",
        f"  optimizer       {_gb(b['optimizer'])}   Adam mu + nu, fp32",
        f"  activations     {_gb(b['activations'])}   saved {a.saved / 1e9:.2f} + working {a.working / 1e9:.2f}"
        f" (largest part: {a.phase}) + gradient accumulation {a.buffers / 1e9:.2f} + batch {a.inputs / 1e9:.2f}"
        + (f" (+ {a.host / 1e9:.2f} GB on host)" if a.host else ""),
        f"  fp8 scaling     {_gb(b['fp8'])}   fp8 recipe: {cfg.model.fp8.recipe}",
        *([f"  gathered        {_gb(b['gathered_weights'])}   weights kept gathered (mesh.fsdp_regather=per_step)"]
          if b["gathered_weights"] else []),
        *([f"  accumulator     {_gb(b['grad_accumulator'])}   full-size gradient sums (mesh.fsdp_grad_reduce=once)"]
          if b["grad_accumulator"] else []),
        f"  total           {_gb(b['total'])}   of {plan.usable_memory_bytes / 1e9:.1f} GB usable "
        f"({plan.device_memory_bytes / 1e9:.0f} GB device)",
        "",
        f"FLOPs per token  {plan.flops_per_token:.4g} model (6N + attention), "
        f"{plan.hardware_flops_per_token:.4g} with recompute",
        f"FLOPs per step   {plan.flops_per_step:.4g} ({plan.tokens_per_step:,} tokens)",
        "",
        "communication per step, per device",
        f"  {'axis':9s}{'size':>5s}  {'link':6s} {'collective':15s}{'on the wire':>14s}{'time':>10s}"
        "  overlaps  what",
    ]
    for c in plan.collectives:
        lines.append(f"  {c.axis:9s}{c.size:5d}  {c.link:6s} {c.kind:15s}{c.wire_bytes / 1e9:11.2f} GB"
                     f"{c.seconds * 1e3:8.1f}ms  {'yes' if c.overlapped else 'no':8s}  {c.what}")
    if not plan.collectives:
        lines.append("  none (one device)")
    lines += [
        "",
        f"compute {plan.compute_s:.3f} s, communication {plan.overlapped_comm_s:.3f} s overlapped + "
        f"{plan.exposed_comm_s:.3f} s exposed"
        + (f", pipeline bubble {plan.bubble:.1%} (p={lay.pipeline}, m={lay.micro_batches})"
           if lay.pipeline > 1 else ""),
        f"predicted step {plan.step_time_s:.3f} s, {plan.tokens_per_s:,.0f} tokens/s, MFU {plan.mfu:.1%}"
        + ("" if plan.overlapped_comm_s <= plan.compute_s else
           f" (communication-bound: overlapped collectives take {plan.overlapped_comm_s / plan.compute_s:.1f}x"
           " the compute)"),
        *([format_goodput(g)] if g is not None else []),
        "",
        plan.verdict(),
    ]
    return "\n".join(lines)


def format_search(plans: Sequence[Plan]) -> str:
    """One line per candidate, best first: mesh (with the pipeline schedule), remat, sequences per
    micro-batch (b), micro-batches (m)."""
    head = (f"{'rank':>4s}  {'mesh':62s}{'remat':34s}{'b':>3s}{'m':>5s}{'GB':>8s}{'step s':>9s}"
            f"{'tokens/s':>12s}{'MFU':>7s}")
    rows = [f"{i + 1:4d}  {p.layout.describe():61s} {p.remat:34s}{p.micro_batch:3d}{p.layout.micro_batches:5d}"
            f"{p.bytes_per_device['total'] / 1e9:8.1f}{p.step_time_s:9.3f}{p.tokens_per_s:12,.0f}{p.mfu:7.1%}"
            for i, p in enumerate(plans)]
    return "\n".join([head, *rows]) if rows else "no candidate fits"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = CommandParser(prog="python -m lumen_jax.plan", description=USAGE)
    p.add_argument("--config", help="YAML or gin file (configs/*.yaml)")
    p.add_argument("--devices", type=int, help="devices the run will use (required but with --calibration)")
    p.add_argument("--device", default="h100", choices=sorted(DEVICES), help="accelerator (default h100)")
    p.add_argument("--pipeline", type=int, default=1, help="plan this many pipeline stages around the config's mesh "
                   "(the trainer's stages are mesh.pipeline)")
    p.add_argument("--pipeline-microbatches", type=int, default=0,
                   help="micro-batches per step through the pipeline (default train.micro_batches)")
    p.add_argument("--attention", choices=("xla", "flash", "cudnn", "auto"),
                   help="xla keeps the S x S scores in memory; flash (ours) and cudnn do not, each at its measured "
                        "rate (default: model.attention; auto as the trainer picks on a GPU: cudnn where cuDNN takes "
                        "the case, else flash)")
    p.add_argument("--efficiency", type=float, help="one fraction of peak FLOP/s for every matmul (default: "
                   "each GEMM's efficiency by its shape, fitted to published runs: --calibration)")
    p.add_argument("--memory-fraction", type=float, default=MEMORY_FRACTION,
                   help=f"fraction of device memory the allocator can use (default {MEMORY_FRACTION})")
    p.add_argument("--memory-gb", type=float, help="device memory in GB (default: the device's)")
    p.add_argument("--peak-tflops", type=float, help="peak TFLOP/s per device (default: datasheet)")
    p.add_argument("--nvlink-gbps", type=float, help="GB/s per device inside a node (default 900)")
    p.add_argument("--ib-gbps", type=float, help="GB/s per device across nodes (default 50)")
    p.add_argument("--devices-per-node", type=int, help="devices per node (default 8)")
    p.add_argument("--storage-gbps", type=float, default=goodput_lib.STORAGE_GBPS,
                   help=f"aggregate checkpoint write bandwidth in GB/s (default {goodput_lib.STORAGE_GBPS:g})")
    p.add_argument("--restart-s", type=float, default=goodput_lib.RESTART_S,
                   help=f"seconds from a failure to training again (default {goodput_lib.RESTART_S:g})")
    p.add_argument("--calibration", nargs="?", const="", default=None, metavar="FILE",
                   help="print published H100 runs next to the planner's predictions and our program's in the "
                        "same layout, and the statistics (no --config or --devices needed): those of "
                        "lumen_jax/plan/published.py, or of FILE (YAML or CSV, docs/PLANNING.md)")
    p.add_argument("--search", action="store_true", help="rank fitting meshes x remat x micro-batch sizes")
    p.add_argument("--search-options", action="store_true",
                   help="rank our options on the config's own mesh: remat, train.micro_batches (no pipeline), "
                        "mesh.fsdp_grad_reduce, mesh.fsdp_regather, mesh.reduce_dtype")
    p.add_argument("--top", type=int, default=5, help="candidates --search lists")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. mesh.tensor=8 model.remat=full")
    return p.parse_args(argv)


def hardware_from_args(args: argparse.Namespace) -> Hardware:
    hw = DEVICES[args.device]
    changes = {"memory_bytes": args.memory_gb and args.memory_gb * 1e9,
               "peak_flops": args.peak_tflops and args.peak_tflops * 1e12,
               "nvlink_bytes_per_s": args.nvlink_gbps and args.nvlink_gbps * 1e9,
               "ib_bytes_per_s": args.ib_gbps and args.ib_gbps * 1e9,
               "devices_per_node": args.devices_per_node}
    return dataclasses.replace(hw, **{k: v for k, v in changes.items() if v})


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        if args.calibration is not None:
            from lumen_jax.plan import calibration, published_file

            found = calibration.rows(published_file.read_table(args.calibration) if args.calibration
                                     else published_file.TABLE)
            print(json.dumps(calibration.to_json(found), indent=2) if args.json
                  else calibration.format_calibration(found, args.calibration or "lumen_jax/plan/published.py"))
            return 0
        if args.devices is None:
            raise ConfigError("--devices is required: the devices the run will use (or --calibration)")
        positive = (("--storage-gbps", args.storage_gbps), ("--restart-s", args.restart_s),
                    ("--memory-gb", args.memory_gb), ("--peak-tflops", args.peak_tflops),
                    ("--nvlink-gbps", args.nvlink_gbps), ("--ib-gbps", args.ib_gbps),
                    ("--devices-per-node", args.devices_per_node), ("--top", args.top),
                    ("--pipeline", args.pipeline), ("--pipeline-microbatches", args.pipeline_microbatches or None))
        for name, value in positive:  # NaN and inf fail too: `not value > 0`, `math.isfinite`
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"{name}={value} must be a positive finite number")
        if args.devices < 1:
            raise ConfigError(f"--devices {args.devices} must be >= 1: the devices the run will use")
        cfg = load_config(args.config, args.overrides)
        hw = hardware_from_args(args)
        for name, value, low, high in (("--efficiency", args.efficiency, 0, 1),
                                       ("--memory-fraction", args.memory_fraction, 0, 1)):
            if value is not None and not low < value <= high:
                raise ConfigError(f"{name}={value} must be in ({low}, {high}]")
        kwargs = {"attention": args.attention, "efficiency": args.efficiency, "memory_fraction": args.memory_fraction}
        if args.search and args.search_options:
            raise ConfigError("--search and --search-options: give one (--search changes the mesh, "
                              "--search-options keeps the config's)")
        if args.search_options:
            layout = layout_from_config(cfg, args.devices, args.pipeline, args.pipeline_microbatches or None)
            plans = settings(cfg, layout, hw, top=args.top, **kwargs)
            text = (json.dumps([p.to_json() for p in plans], indent=2) if args.json else format_search(plans))
        elif args.search:  # the search picks the mesh (but `expert`) and the schedule: check everything else
            one = dataclasses.replace(cfg.mesh, data=1, fsdp=1, context=1, tensor=1, pipeline=1)
            validate(cfg.replace(mesh=one, train=dataclasses.replace(cfg.train, micro_batches=1)), max(one.expert, 1))
            if args.pipeline < 1 or args.devices % args.pipeline:
                raise ConfigError(f"--pipeline {args.pipeline} must be >= 1 and divide "
                                  f"--devices {args.devices}")
            stages = args.pipeline if args.pipeline > 1 else cfg.mesh.pipeline
            if args.devices % stages or cfg.model.num_layers < stages:
                raise ConfigError(f"mesh.pipeline={stages} must divide --devices {args.devices} and be at most "
                                  f"model.num_layers={cfg.model.num_layers} (a stage holds at least one layer)")
            from tqdm import tqdm
            with tqdm(desc="search", unit=" plans", leave=False, disable=None, file=sys.stderr) as bar:  # a terminal
                plans = search(cfg, args.devices, hw, pipeline=args.pipeline, top=args.top, on_plan=bar.update,
                               **kwargs)
            text = (json.dumps([p.to_json() for p in plans], indent=2) if args.json else format_search(plans))
        else:
            layout = layout_from_config(cfg, args.devices, args.pipeline, args.pipeline_microbatches or None)
            plan = predict(cfg, layout, hw, **kwargs)
            g = goodput_lib.of_plan(plan, cfg.model, storage_gbps=args.storage_gbps, restart_s=args.restart_s)
            if args.json:
                out = plan.to_json()
                out["goodput"] = {"mtbf_s": g.mtbf_s, "checkpoint_bytes": g.checkpoint_bytes,
                                  "checkpoint_s": g.checkpoint_s, "restart_s": g.restart_s,
                                  "interval_s": g.interval_s, "every_steps": g.every_steps, "goodput": g.goodput}
                text = json.dumps(out, indent=2)
            else:
                text = format_plan(plan, cfg, g)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(text)
    return 0
