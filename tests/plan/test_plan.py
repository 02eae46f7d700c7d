"""The planner against XLA's accounting of the compiled step, textbook figures and its own CLI."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import print_saved_residuals
from jax.sharding import NamedSharding, PartitionSpec

from helpers.run import BASE, with_mesh
from lumen_jax.metrics import flops
from lumen_jax import plan
from lumen_jax.train.build import build
from lumen_jax.config import PROJECTION_NAMES, REMAT_SAVES, Fp8Config, MeshConfig, ModelConfig
from lumen_jax.config.files import load_config
from lumen_jax.parallel.mesh import make_mesh
from lumen_jax.plan import memory as plan_memory, recipe_memory
from lumen_jax.plan.hardware import DEVICES, layout_from_config
from lumen_jax.plan.predict import MEMORY_FRACTION, SEARCH_REMATS, predict, search as search_plans
from lumen_jax.plan.cli import main
from lumen_jax.compiler import hlo
from lumen_jax.compiler.compiled import against_xla, compile_step
from lumen_jax.compiler.lower import main as lower_main

BYTES_RTOL = 0.10  # the issue's bound for bytes per device against memory_analysis()
FLOPS_RTOL = 0.05  # ... and for FLOPs against cost_analysis()
# Pipelined steps: the pipeline issue's bound on FLOPs (measured -0.9% to -7.6% on the tiny CPU steps:
# the segments' elementwise work beyond the model's fit, docs/PLANNING.md "Pipeline stages").
PIPELINE_FLOPS_RTOL = 0.10
H100 = plan.DEVICES["h100"]
YEAR_S = 365 * 24 * 3600

# The tiny model (configs/tiny.yaml: fp32, 2 layers, d_model 64, seq 128, batch 16) on 8 CPU devices:
# the meshes and remat policies of the issue (no recompute, full, and dots in between; ZeRO-1;
# tensor + sequence parallelism; gradient accumulation). remat=full over fsdp is held by the
# fsdp x tensor and fsdp x context cells under full; accumulating micro-batches under ZeRO-3 by the
# zero_axes=fsdp+context cells (m = 2 every micro-batch, m = 4 once).
XLA_CASES = {
    "fsdp=8 none": ["mesh.fsdp=8", "model.remat=none"],
    "data=8 dots_with_no_batch_dims_saveable":
        ["mesh.data=8", "mesh.fsdp=1", "model.remat=dots_with_no_batch_dims_saveable"],
    "fsdp=4,tensor=2,sp full": ["mesh.fsdp=4", "mesh.tensor=2", "mesh.sequence_parallel=true", "model.remat=full"],
    "fsdp=4,tensor=2,sp dots_saveable":
        ["mesh.fsdp=4", "mesh.tensor=2", "mesh.sequence_parallel=true", "model.remat=dots_saveable"],
    "fsdp=8 zero_stage=1 none": ["mesh.fsdp=8", "mesh.zero_stage=1", "model.remat=none"],
    # the selective policies (named projections, `config.REMAT_SAVES`): each recomputes other projections,
    # their matmul FLOPs held exactly (`SELECTIVE_MATMUL_RTOL`)
    "fsdp=4,tensor=2,sp save_dot_except_mlpwi_1":
        ["mesh.fsdp=4", "mesh.tensor=2", "mesh.sequence_parallel=true", "model.remat=save_dot_except_mlpwi_1"],
    "data=8 save_dot_except_mlpwi": ["mesh.data=8", "mesh.fsdp=1", "model.remat=save_dot_except_mlpwi"],
    "data=8 save_qkv_proj": ["mesh.data=8", "mesh.fsdp=1", "model.remat=save_qkv_proj"],
    # context parallelism: the ring (C unrolled hops) and the all-gather attention (a scan over C)
    # under shard_map, zigzag chunks, C = 2 and 4 (the planner's terms are formulas in C: C = 8 added
    # no branch, and its ring unrolled 8 hops, the dearest compile here)
    "fsdp=4,context=2 ring none": ["mesh.fsdp=4", "mesh.context=2", "model.remat=none"],
    "fsdp=4,context=2 allgather full":
        ["mesh.fsdp=4", "mesh.context=2", "mesh.context_parallel=allgather", "model.remat=full"],
    "fsdp=2,context=4 ring full": ["mesh.fsdp=2", "mesh.context=4", "model.remat=full"],
    "fsdp=2,context=4 allgather none":
        ["mesh.fsdp=2", "mesh.context=4", "mesh.context_parallel=allgather", "model.remat=none"],
    # the ZeRO state over fsdp x context (mesh.zero_axes), accumulating per context group over fsdp
    # or full-size (fsdp_grad_reduce=once: the carried sums and the micro-batch's gradients)
    "fsdp=4,context=2 zero_axes=fsdp+context micro_batches=2 none":
        ["mesh.fsdp=4", "mesh.context=2", "mesh.zero_axes=fsdp+context", "train.micro_batches=2", "model.remat=none"],
    "fsdp=4,context=2 zero_axes=fsdp+context once micro_batches=4 none":
        ["mesh.fsdp=4", "mesh.context=2", "mesh.zero_axes=fsdp+context", "mesh.fsdp_grad_reduce=once",
         "train.micro_batches=4", "model.remat=none"],
}


@pytest.mark.heavy
@pytest.mark.parametrize("name", list(XLA_CASES))
def test_bytes_and_flops_match_the_compiled_step(name):
    """The same check as `python -m lumen_jax.lower --against-xla` (`compiler.compiled`)."""
    cfg = load_config("configs/tiny.yaml", XLA_CASES[name])
    layout = plan.layout_from_config(cfg, jax.device_count())
    p = plan.predict(cfg, layout, H100)
    compiled = compile_step(cfg, layout)
    check = against_xla(cfg, p, compiled)
    assert check.bytes_predicted == pytest.approx(check.bytes_compiled, rel=BYTES_RTOL), (
        f"{name}: predicted {check.bytes_predicted:,.0f} B, XLA {check.bytes_compiled:,.0f} B "
        f"({check.bytes_predicted / check.bytes_compiled - 1:+.1%})")
    # The arguments are the state and the batch: exact, up to the optimizer's scalar step counts.
    args = p.state["params"] + p.state["optimizer"] + p.activations.inputs
    assert 0 <= compiled.memory_analysis().argument_size_in_bytes - args <= 64
    # cost_analysis counts a loop body once (one layer, one micro-batch), the whole score square the
    # xla attention computes (masked, not skipped) and elementwise work: count the same things.
    assert check.flops_predicted == pytest.approx(check.flops_compiled, rel=FLOPS_RTOL), (
        f"{name}: predicted {check.flops_predicted:,.0f} FLOPs, XLA {check.flops_compiled:,.0f} "
        f"({check.flops_predicted / check.flops_compiled - 1:+.1%})")
    selective = cfg.model.remat in REMAT_SAVES
    _assert_matmuls(name, check, SELECTIVE_MATMUL_RTOL if selective else CRITICAL_PATH_RTOL)


# The selective policies recompute some projections (`flops.RECOMPUTES`), one projection of the
# tiny model 2-4% of the step's matmuls: counted per projection, the critical path's matmuls are
# the compiled step's exactly (measured 0.00% on the three cases; planted, down's forward counted
# as recomputed: save_qkv_proj +4.0%, fails).
SELECTIVE_MATMUL_RTOL = 1e-6


# The step's matmul FLOPs with every loop's trip count (`hlo.matmul_flops`) against the planner's
# (`cost.critical_path_matmul_flops`). Measured: 0.0% but +3.9% for remat=full (the recompute the
# planner counts for the logits' input; +3.8% with context parallelism, whose hop conditionals count
# at their dearest branch); every pipeline schedule 0.0%. The issue's bound is 10%.
CRITICAL_PATH_RTOL = 0.10


def _assert_matmuls(name, check, rtol):
    assert check.matmul_predicted == pytest.approx(check.matmul_compiled, rel=rtol), (
        f"{name}: predicted {check.matmul_predicted:,.0f} matmul FLOPs on the critical path, XLA "
        f"{check.matmul_compiled:,.0f} ({check.matmul_predicted / check.matmul_compiled - 1:+.1%})")


# Pipeline stages (compile only): 4 layers on pipeline=2 x data=2, 1 row x 128 tokens per micro-batch
# per device at m=8. The stash differs by schedule (1F1B 2P - 1 = 3 residual sets, GPipe m = 8;
# zero_bubble 1F1B's and its W units' stash). ZeRO-3 in stages (weights and gradients crossing fsdp
# in every tick) is held by `test_pipeline_sequence_parallel_sends_its_share` (pipeline=2 x fsdp=2 x
# tensor=2, both schedules: its fsdp gathers, reductions and temporaries).
PIPELINE = ["mesh.fsdp=1", "mesh.data=2", "mesh.pipeline=2", "model.num_layers=4"]
# helpers.run.BASE at batch 32: tests/parallel/test_communication.py's pipelined steps, whose programs
# the persistent compilation cache compiles once for both files
BASE32 = BASE.replace(data=dataclasses.replace(BASE.data, global_batch_size=32))
PIPELINE_XLA_CASES = {
    **{f"data=2 {s}": load_config("configs/tiny.yaml", [*PIPELINE, "train.micro_batches=8", f"mesh.pipeline_schedule={s}"])
       for s in ("1f1b", "gpipe", "zero_bubble")},
    "data=2 interleaved": load_config("configs/tiny.yaml", [*PIPELINE, "train.micro_batches=8",
                                                           "mesh.pipeline_schedule=interleaved",
                                                           "mesh.pipeline_virtual_stages=2"]),
    # context parallelism in stages, under zero_bubble (its split backward: B and W units): the ring's
    # hops, and the context devices' partial gradients reduced once with data's (`context_replicas`;
    # 1F1B's context in stages, with sequence parallelism: `test_pipeline_sequence_parallel_reduces_context_once`).
    # test_communication's `context2-zero_bubble` cell (BASE32, 2 layers, m = 4)
    "data=2,context=2 zero_bubble": with_mesh(BASE32, 4, pipeline=2, pipeline_schedule="zero_bubble", data=2,
                                              context=2),
}


def test_pipelined_mtp_matmuls_match_the_compiled_step():
    """Multi-token prediction in a pipeline runs with the head, each stage on 1/P of the rows: the
    planner counts its blocks and logits in the head ticks (critical-path matmuls measured 0.0%;
    counted in every layer slot before, +92.5%)."""
    cfg = load_config("configs/tiny.yaml", [*PIPELINE, "train.micro_batches=4", "model.mtp_depth=1"])
    layout = plan.layout_from_config(cfg, 4)
    check = against_xla(cfg, plan.predict(cfg, layout, H100), compile_step(cfg, layout))
    _assert_matmuls("pipeline=2 data=2 mtp_depth=1", check, CRITICAL_PATH_RTOL)
    # cost_analysis's count: measured -4.6% (-4.3% without MTP), +69% before
    assert check.flops_predicted == pytest.approx(check.flops_compiled, rel=FLOPS_RTOL)


class _PipelineSteps(dict):
    """{case: (plan, `against_xla` check, the compiled step's temporaries in bytes)} of
    `PIPELINE_XLA_CASES`, each compiled when a test first reads it."""

    def __missing__(self, name: str):
        cfg = PIPELINE_XLA_CASES[name]
        layout = plan.layout_from_config(cfg, math.prod(getattr(cfg.mesh, a) for a in MeshConfig.AXES))
        p = plan.predict(cfg, layout, H100)
        compiled = compile_step(cfg, layout)
        self[name] = p, against_xla(cfg, p, compiled), compiled.memory_analysis().temp_size_in_bytes
        return self[name]


@pytest.fixture(scope="module")
def pipeline_steps():
    return _PipelineSteps()


def _planned_temporaries(p) -> float:
    """What of the plan's bytes the compiled step holds as temporaries: all but the arguments (the
    parameters, the optimizer state and the batch arrays; the updated state aliases them): the
    gradients summed over the ticks and the activations (stash, working set, buffers)."""
    return p.bytes_per_device["total"] - p.state["params"] - p.state["optimizer"] - p.activations.inputs


@pytest.mark.heavy
@pytest.mark.parametrize("name", list(PIPELINE_XLA_CASES))
def test_pipeline_bytes_match_the_compiled_step(pipeline_steps, name):
    """The planner's bytes of a pipelined step (`memory.activation_bytes`: the lock-step program's
    residual slots, zero_bubble's W stash) against XLA's, and its FLOPs (the compiler counts each
    segment's scan over ticks once: a forward, the loss's share, a backward or B, a W unit over the
    chunk's layers, as the segment runs them). Measured: bytes -4.5% to +3.3%, FLOPs -3.7% to -6.5%."""
    p, check, temporaries = pipeline_steps[name]
    predicted, compiled = p.bytes_per_device["total"], check.bytes_compiled
    assert predicted == pytest.approx(compiled, rel=BYTES_RTOL), (
        f"{name}: predicted {predicted:,.0f} B, XLA {compiled:,.0f} B ({predicted / compiled - 1:+.1%})")
    assert check.flops_predicted == pytest.approx(check.flops_compiled, rel=PIPELINE_FLOPS_RTOL), (
        f"{name}: predicted {check.flops_predicted:,.0f} FLOPs, XLA {check.flops_compiled:,.0f} "
        f"({check.flops_predicted / check.flops_compiled - 1:+.1%})")
    # The critical path: every tick of the lock-step program, fill and drain on zeros included
    # (measured 0.0% for every schedule; planted: each segment counted once -> fails).
    _assert_matmuls(name, check, CRITICAL_PATH_RTOL)
    # Issue 45 part 1: the temporaries alone (the stash of each schedule's lock-step program, its
    # working set and the summed gradients) within 10% of the plan's (measured on data=2 at m=8:
    # 1f1b -4.1%, gpipe -3.7%, zero_bubble -2.9%, interleaved V=2 -3.9%; planted: the stash one
    # residual set short, `activation_bytes`' slots + 1 -> -20.0%, -12.4%, -15.1%, -14.4%: fails)
    assert _planned_temporaries(p) == pytest.approx(temporaries, rel=BYTES_RTOL), (
        f"{name}: planned temporaries {_planned_temporaries(p):,.0f} B, XLA {temporaries:,.0f} B "
        f"({_planned_temporaries(p) / temporaries - 1:+.1%})")


# The issue's bound on each kind of collective, by mesh axes (`compiler.compiled.collective_bytes`).
COLLECTIVES_RTOL = 0.10


@pytest.mark.heavy
@pytest.mark.parametrize("name", list(PIPELINE_XLA_CASES))
def test_pipeline_collectives_match_the_compiled_step(pipeline_steps, name):
    """Every kind of collective of a pipelined step within 10% of the compiled program's bytes: the
    stage sends and the shared loss over `pipeline`, the gradients' sum over `data`, the ring's hops
    and reductions over `context`. Entries under 1% of the largest are left out (a few scalars: the
    token count, the loss). Measured: everything within 0.2%. (ZeRO-3's fsdp gathers and reductions
    in stages: `test_pipeline_sequence_parallel_sends_its_share`.)"""
    _, check, _ = pipeline_steps[name]
    largest = max(c for _, c in check.collectives.values())
    compared = {k: v for k, v in check.collectives.items() if max(v) > 0.01 * largest}
    assert "fsdp gather" not in compared and "pipeline permute" in compared, compared
    for key, (predicted, compiled) in compared.items():
        assert predicted == pytest.approx(compiled, rel=COLLECTIVES_RTOL), (
            f"{name} {key}: predicted {predicted:,.0f} B, compiled {compiled:,.0f} B")


@pytest.mark.heavy
def test_pipeline_stash_is_the_schedules(pipeline_steps):
    """GPipe stashes the residuals of all m forwards, 1F1B's lock-step program 2P - 1: the planned
    difference is the compiled one (5 slots of one chunk's residuals of one micro-batch at m=8)."""
    (p1, c1), (pg, cg) = ((p, c.bytes_compiled) for p, c, _ in (pipeline_steps["data=2 1f1b"],
                                                               pipeline_steps["data=2 gpipe"]))
    planned = pg.bytes_per_device["total"] - p1.bytes_per_device["total"]
    assert planned == pytest.approx(cg - c1, rel=BYTES_RTOL), f"planned +{planned:,.0f} B, XLA +{cg - c1:,.0f} B"
    assert cg - c1 >= 5 * 2 * 128 * 64 * 4  # at least 5 more slots of two layers' [1, 128, 64] fp32 inputs


@pytest.mark.heavy
@pytest.mark.parametrize("schedule,regather", [("1f1b", "per_step"), ("zero_bubble", "per_micro_batch")])
def test_pipeline_sequence_parallel_sends_its_share(schedule, regather):
    """Under sequence parallelism a stage sends, and sums for the shared loss, its 1/t of each
    [tokens, D] activation: the pipeline's collectives and the fsdp gradient reductions within 10% of
    the compiled step's (measured: within 0.2%). The fsdp gathers within 1%. Gathered per micro-batch
    (zero_bubble; measured 0.0%; -14.5% for 1f1b, zero_bubble -20.3%, with the embedding and logits
    gathered once per loss tick): the chunk's weights in every tick's forward and backward, the
    embedding table once, the logits once per segment with the loss, its forward and backward apart
    (the vocabulary is split over tensor), and no row of the embedding gradient
    (`collectives._pipelined_head_gathers`). `mesh.fsdp_regather=per_step` (1f1b): the compute-dtype
    weights are gathered once, before the first tick, and every tick computes with them (measured
    +0.4%; when the pipelined step ignored the setting it gathered each chunk's weights every tick,
    2.74 MB against 0.31 MB). The tensor axis within 10% (measured +0.0% gathers, -0.3%
    reductions; +13.6% / -16.9% while it was planned as the unpipelined step's, per micro-batch
    rather than per executed tick: `collectives._pipelined_tensor`)."""
    cfg = load_config("configs/tiny.yaml", ["mesh.fsdp=2", "mesh.tensor=2", "mesh.sequence_parallel=true",
                                            "mesh.pipeline=2", "model.num_layers=4", "train.micro_batches=4",
                                            f"mesh.pipeline_schedule={schedule}", f"mesh.fsdp_regather={regather}"])
    layout = plan.layout_from_config(cfg, 8)
    p, compiled = plan.predict(cfg, layout, H100), compile_step(cfg, layout)
    check = against_xla(cfg, p, compiled)
    for key, rtol in (("pipeline permute", COLLECTIVES_RTOL), ("pipeline reduce", COLLECTIVES_RTOL),
                      ("fsdp reduce", COLLECTIVES_RTOL), ("fsdp gather", 0.01),
                      ("tensor gather", COLLECTIVES_RTOL), ("tensor reduce", COLLECTIVES_RTOL)):
        predicted, compiled_bytes = check.collectives[key]
        assert predicted == pytest.approx(compiled_bytes, rel=rtol), (
            f"{schedule} {key}: predicted {predicted:,.0f} B, compiled {compiled_bytes:,.0f} B")
    # The temporaries within 10% with the stash as each schedule keeps it under sequence parallelism:
    # 1f1b the norm outputs' own rows (`memory.regathered_inputs`), zero_bubble the gathered ones its
    # taps record (measured: 1f1b -6.6% with per_step, -6.9% per micro-batch, -5.5% before the
    # regather; zero_bubble -2.9%)
    temporaries = compiled.memory_analysis().temp_size_in_bytes
    assert _planned_temporaries(p) == pytest.approx(temporaries, rel=BYTES_RTOL), (
        f"{schedule}: planned temporaries {_planned_temporaries(p):,.0f} B, XLA {temporaries:,.0f} B")


@pytest.mark.heavy
def test_pipeline_sequence_parallel_reduces_context_once():
    """pipeline=2 x context=2 x tensor=2 with sequence parallelism, 1f1b, m = 4: `context` (and `data`,
    where > 1) manual in the stages, the gradients reduced over them once after the last tick
    (`StepShape.context_manual`; with data too one all-reduce over data x context: planned 313,600 B,
    compiled 313,604 on 16 devices, measured by hand). Here the context reduction, the stage sends and
    the shared loss's sums within 10% of the compiled step's (measured: 140,032 B against 140,044;
    0.0%, -0.1%). The config and mesh are
    tests/parallel/test_communication.py's `context2-tensor2-sp` cell (helpers.run.BASE, 2 layers,
    batch 32): the persistent compilation cache compiles the step once for both."""
    cfg = with_mesh(BASE32, 4, pipeline=2, pipeline_schedule="1f1b", context=2, tensor=2, sequence_parallel=True)
    layout = plan.layout_from_config(cfg, 8)
    check = against_xla(cfg, plan.predict(cfg, layout, H100), compile_step(cfg, layout))
    for key in ("context reduce", "pipeline permute", "pipeline reduce"):
        predicted, compiled = check.collectives[key]
        assert predicted == pytest.approx(compiled, rel=COLLECTIVES_RTOL), (
            f"{key}: predicted {predicted:,.0f} B, compiled {compiled:,.0f} B")


@pytest.mark.heavy
def test_zero_bubble_stash_is_its_weight_units(pipeline_steps):
    """zero_bubble runs 1F1B's forwards and slots and keeps, besides, what its W units read (the
    tapped projections' inputs and output cotangents, `wslots` + 2 slots; its residual slots hold
    1F1B's, `memory.activation_bytes`): the planned difference (3.95 MB) is the compiled one. (When the
    executor also stashed the tapped weights with every residual slot, the compiled difference was
    5.72 MB.)"""
    (p1, c1), (pz, cz) = ((p, c.bytes_compiled) for p, c, _ in (pipeline_steps["data=2 1f1b"],
                                                               pipeline_steps["data=2 zero_bubble"]))
    planned = pz.bytes_per_device["total"] - p1.bytes_per_device["total"]
    assert planned == pytest.approx(cz - c1, rel=BYTES_RTOL), f"planned +{planned:,.0f} B, XLA +{cz - c1:,.0f} B"


def test_pipeline_plan_follows_the_lockstep_program():
    """Slots, bubble and layout come from the program the trainer runs (`schedule.lockstep`): each slot
    holds one chunk's residuals of one micro-batch; the embedding and logits weights are on every
    stage; HFU counts no stage recompute."""
    from lumen_jax.parallel.pipeline import schedule as pipeline

    slot = 1 * 128 * 64 * 4  # one [1, 128, 64] fp32 activation at m=8 (16 rows / data=2 / 8)
    plans = {}
    model = load_config("configs/tiny.yaml", PIPELINE).model
    n = flops.param_counts(model)
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero_bubble", 1)):
        cfg = load_config("configs/tiny.yaml", [*PIPELINE, "train.micro_batches=8", f"mesh.pipeline_schedule={name}",
                                                f"mesh.pipeline_virtual_stages={v}"])
        layout = plan.layout_from_config(cfg, 4)
        assert layout.schedule == (name, v) and name in layout.describe()
        plans[name] = p = plan.predict(cfg, layout, H100)
        prog = pipeline.lockstep(name, 2, 8, v)
        assert p.bubble == prog.bubble()
        if name != "zero_bubble":
            chunk = 4 // (2 * v) * 128 * plan.saved_bytes_per_token(model, layout, 128, "none")
            assert p.activations.saved == (prog.slots + 2) * chunk + (prog.slots + 3) * slot
    assert pipeline.lockstep("gpipe", 2, 8).slots == 8 and pipeline.lockstep("1f1b", 2, 8).slots == 3
    # zero_bubble: 1F1B's slots, and (wslots + 2) slots of its W units' stash: per layer and token the
    # tapped projections' inputs (attention's, wo's, the MLP's, w_down's) and output cotangents
    # (q, k, v, o, gate, up, down), [tokens, width] fp32.
    zb, f1 = pipeline.lockstep("zero_bubble", 2, 8), pipeline.lockstep("1f1b", 2, 8)
    assert (zb.slots, zb.wslots, f1.slots) == (3, 2, 3)
    widths = 64 + 64 + 2 * 32 + 64 + 64 + 64 + 3 * 172 + 64  # x, q, k, v, o in, o out, x, gate, up, down in, down out
    w_stash = (zb.wslots + 2) * 2 * 128 * widths * 4
    assert plans["zero_bubble"].activations.saved == plans["1f1b"].activations.saved + w_stash
    # gradient sums in the carry; beside them, the float32 sum of the embedding table's gradient
    table = model.vocab_size * model.d_model * 4
    # (interleaved holds its blocks device-major: no reordered copy)
    assert plans["gpipe"].activations.buffers == plans["1f1b"].activations.buffers == table
    assert plans["interleaved"].activations.buffers == table
    assert plans["1f1b"].state["params"] == 4 * (n["total"] - 2 * (n["layer_matmul"] + 2 * 64))  # 2 of 4 layers
    for name in ("1f1b", "zero_bubble"):
        assert plans[name].hardware_flops_per_token == flops.hardware_flops_per_token(model, 128, "none",
                                                                                      score_fraction=0.5)


def test_zero_bubble_step_time_weighs_its_units():
    """The predicted step time stretches the busy time by the lock-step program's executed work, a
    zero_bubble tick costing its units' shares of the compute (`predict._stretch`): W the tapped
    projections' weight-gradient FLOPs, under a third of the layer's work here (the logits and the
    attention core have no W), so zero_bubble's stretch lies between 1F1B's and the equal-unit
    (3m + 2(P-1)) / 3m of `Lockstep.bubble`. With one rate for every FLOP (`efficiency`) the
    backward is 2/3 of the compute."""
    from lumen_jax.parallel.pipeline import schedule as pipeline

    stretch = {}
    for name in ("1f1b", "zero_bubble"):
        cfg = load_config("configs/tiny.yaml", [*PIPELINE, "train.micro_batches=8", f"mesh.pipeline_schedule={name}"])
        p = plan.predict(cfg, plan.layout_from_config(cfg, 4), H100, efficiency=0.5)
        stretch[name] = p.step_time_s / (p.compute_s + sum(p.exposed))
    w = 2 * flops.param_counts(cfg.model)["layer_matmul"] * 4 / p.hardware_flops_per_token  # all 7 tapped
    assert 0.1 < w < 1 / 3
    # 10 ticks: F in 9, B in 9, W in 8 (P = 2, m = 8)
    assert stretch["zero_bubble"] == pytest.approx((9 / 3 + 9 * (2 / 3 - w) + 8 * w) / 8, rel=1e-12)
    assert 1 / (1 - pipeline.lockstep("zero_bubble", 2, 8).bubble()) < stretch["zero_bubble"] < stretch["1f1b"]
    assert stretch["1f1b"] == pytest.approx(1 / (1 - pipeline.lockstep("1f1b", 2, 8).bubble()), rel=1e-12)


def test_search_ranks_pipeline_schedules(capsys):
    """--search with stages tries every schedule that can run them (interleaved with V=2 and V=4 where
    every chunk keeps a layer: 8 layers on 2 stages, not V=8), each with its executed bubble; the
    schedule is in the JSON layout."""
    from lumen_jax.parallel.pipeline import schedule as pipeline

    assert main(["--config", "configs/tiny.yaml", "--devices", "2", "--search", "--top", "400", "--json",
                 "mesh.pipeline=2", "model.num_layers=8"]) == 0
    ranked = json.loads(capsys.readouterr().out)
    seen = set()
    for r in ranked:
        mesh, m = r["layout"]["mesh"], r["layout"]["micro_batches"]
        assert mesh["pipeline"] == r["layout"]["pipeline"] == 2
        seen.add((mesh["pipeline_schedule"], mesh["pipeline_virtual_stages"]))
        assert r["pipeline_bubble"] == pipeline.lockstep_bubble(mesh["pipeline_schedule"], 2, m,
                                                                mesh["pipeline_virtual_stages"])
    assert seen == {("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 4), ("zero_bubble", 1)}, seen


def test_search_tries_bf16_reductions_where_float32_does_not_fit():
    """A candidate whose float32 gradient sums do not fit is tried with bfloat16 ones (405B on Llama 3's
    layout with V = 4 and a selective policy: 75.3 GB in float32, 67.9 GB in bfloat16): on a device
    sized between the two, the search returns the bfloat16 form, and nothing in float32."""
    cfg = load_config("configs/tiny.yaml", ["mesh.fsdp=2", "train.micro_batches=4", "mesh.fsdp_grad_reduce=once"])
    layout = plan.Layout(cfg.mesh, micro_batches=4)
    f32, b16 = (plan.predict(cfg, dataclasses.replace(layout, mesh=dataclasses.replace(cfg.mesh, reduce_dtype=d)),
                             H100, remat="none") for d in ("float32", "bfloat16"))
    total = lambda p: p.bytes_per_device["total"]  # noqa: E731
    assert total(b16) < total(f32)
    hw = dataclasses.replace(H100, memory_bytes=(total(b16) + total(f32)) / 2 / MEMORY_FRACTION)
    found = search_plans(cfg, 2, hw, top=10000)
    same = [p for p in found if p.remat == "none" and p.layout.micro_batches == 4 and p.layout.mesh.fsdp == 2
            and p.layout.mesh.fsdp_grad_reduce == "once" and p.layout.mesh.fsdp_regather == cfg.mesh.fsdp_regather]
    assert [p.layout.mesh.reduce_dtype for p in same] == ["bfloat16"], same
    assert all(p.fits for p in found)


def test_search_plans_bf16_sums_first_and_their_float32_twins_rank_no_higher():
    """`_search_depth` plans each candidate with bfloat16 gradient sums where they cross devices, and
    `search` tries float32 on its leaders alone: exact only while a float32 twin never ranks above
    its bfloat16 one (no faster, more bytes). Before, float32 candidates slowed by their sums fell out of
    the leaders, and the bfloat16 twins that ranked first were never planned (405B, collective matmul:
    the top's remat none at 62.5% MFU was missing from --search's five)."""
    from lumen_jax.plan.predict import _search_depth

    cfg = load_config("configs/tiny.yaml", ["mesh.sequence_parallel=true", "mesh.tensor_overlap=collective_matmul"])
    rank = lambda p: (-round(p.mfu, 4), p.bytes_per_device["total"])  # noqa: E731
    twins = 0
    for depth in (1, 2):
        for p in _search_depth(cfg, 4, H100, depth, None):
            mesh = p.layout.mesh
            if mesh.data * mesh.fsdp * mesh.pipeline > 1:
                assert mesh.reduce_dtype == "bfloat16", mesh
                f32 = predict(cfg, dataclasses.replace(p.layout, mesh=dataclasses.replace(mesh, reduce_dtype="float32")),
                              H100, remat=p.remat)
                assert rank(f32) >= rank(p), (p.remat, mesh)
                twins += 1
    assert twins > 50, twins


def test_search_tries_depths_the_layers_do_not_divide(capsys):
    """--search on 6 layers tries 4 stages too, as uneven stages: `uneven_split`'s [1, 2, 2, 1] (the
    first and last stages one layer fewer), printed in the table so the run can be typed; the trainer's
    config check accepts the candidate. Without stages in the config or --pipeline, it tries every
    depth of SEARCH_DEPTHS that divides the devices and the layers, every remat policy, and the
    leaders get mesh.reduce_dtype the other way too."""
    from lumen_jax.config.checks import validate
    from lumen_jax.plan.hardware import uneven_split

    assert uneven_split(126, 16) == (7,) + (8,) * 14 + (7,)
    assert uneven_split(14, 4, group=2) == (2, 4, 4, 4)  # whole MoE groups of 2 layers
    assert main(["--config", "configs/tiny.yaml", "--devices", "4", "--search", "--top", "100000", "--json",
                 "model.num_layers=6"]) == 0
    ranked = json.loads(capsys.readouterr().out)
    assert {r["layout"]["pipeline"] for r in ranked} >= {1, 2}
    assert {r["layout"]["mesh"]["reduce_dtype"] for r in ranked} == {"float32", "bfloat16"}
    assert {r["remat"] for r in ranked} == set(SEARCH_REMATS)
    four = [r for r in ranked if r["layout"]["pipeline"] == 4]
    assert four and all(r["layout"]["mesh"]["pipeline_layers"] == [1, 2, 2, 1] for r in four)
    two = {(r["layout"]["mesh"]["pipeline_virtual_stages"], tuple(r["layout"]["mesh"]["pipeline_layers"]))
           for r in ranked if r["layout"]["pipeline"] == 2}
    assert two == {(1, ()), (2, (1, 2, 2, 1))}, two  # 6 layers split evenly in 2, unevenly in 2 x 2 chunks
    mesh = four[0]["layout"]["mesh"]
    cfg = load_config("configs/tiny.yaml", ["model.num_layers=6", *(f"mesh.{k}={json.dumps(v)}" for k, v in mesh.items()
                                                                     if k != "axis_types"),
                                            f"train.micro_batches={four[0]['layout']['micro_batches']}"])
    assert validate(cfg, 4)["pipeline"] == 4
    assert main(["--config", "configs/tiny.yaml", "--devices", "4", "--search", "--top", "3",
                 "model.num_layers=6", "mesh.pipeline=4"]) == 0
    assert "layers=1,2,2,1" in capsys.readouterr().out


@pytest.mark.parametrize("axes", [dict(fsdp=8), dict(data=2, fsdp=2, tensor=2), dict(data=8)])
@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_state_bytes_are_the_shards_the_trainer_creates(axes, zero_stage):
    cfg = load_config("configs/tiny.yaml", [f"mesh.zero_stage={zero_stage}", "mesh.fsdp=1",
                                            *(f"mesh.{k}={v}" for k, v in axes.items())])
    layout = plan.layout_from_config(cfg, 8)
    trainer = build(cfg, make_mesh({a: layout.size(a) for a in MeshConfig.AXES}))
    state = jax.eval_shape(trainer.init)

    def shard_bytes(tree) -> int:
        return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))

    adam = state.opt_state[1][0]  # chain(clip, adamw), adamw = chain(scale_by_adam, ...)
    grad_specs = jax.tree.leaves(trainer.param_specs("grads"), is_leaf=lambda x: isinstance(x, PartitionSpec))
    grads = sum(math.prod(NamedSharding(trainer.mesh, spec).shard_shape(x.shape)) * x.dtype.itemsize
                for x, spec in zip(jax.tree.leaves(state.params), grad_specs))
    assert plan.state_bytes(cfg.model, layout) == {
        "params": shard_bytes(state.params), "grads": grads, "optimizer": shard_bytes((adam.mu, adam.nu))}


@pytest.mark.parametrize("split", [[], [1, 3]])
def test_state_bytes_with_first_dense_layers_in_stages_are_what_the_trainer_holds(split):
    """DeepSeek-V3's first dense layer on the first stage: every stage holds F slots of it in `blocks`
    (zeros but on the first) and R of the MoE stack (`memory._first_stack_slots`)."""
    cfg = load_config("configs/tiny_deepseek_v3.yaml", ["mesh.fsdp=4", "mesh.pipeline=2", "train.micro_batches=2",
                                                       f"mesh.pipeline_layers={split}".replace(" ", "")])
    layout = plan.layout_from_config(cfg, 8)
    trainer = build(cfg, make_mesh({a: layout.size(a) for a in MeshConfig.AXES}))
    params = jax.eval_shape(trainer.init).params
    held = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(params))
    assert plan.state_bytes(cfg.model, layout)["params"] == held


# The planner reads what each remat policy saves off the model (`residuals.layer_residuals`).


@pytest.mark.parametrize("remat", ["none", "full", "dots_saveable", "offload_dots"])
@pytest.mark.parametrize("seq", [128, 512])
def test_residual_probe_accounts_for_every_activation(remat, seq):
    """The probe's classes add up to every per-layer activation residual the model saves."""
    from lumen_jax.model import apply, param_shapes_and_names

    probe = dataclasses.replace(plan.residuals.PROBE, remat=remat)
    graphdef, shapes, _ = param_shapes_and_names(probe)
    tokens = jnp.zeros((1, seq), jnp.int32)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(
            lambda p: apply(graphdef, p, tokens, jnp.arange(seq)[None], tokens + 1).sum(), shapes)
    total = 0.0  # elements per token of the stacked [L, batch=1, ...] residuals, norm statistics left out
    for line in out.getvalue().splitlines():
        shape = [int(d) for d in re.match(r"\w+(?:<host>)?\[([\d,]*)\]", line).group(1).split(",") if d]
        if "output of scan" in line and shape[:2] == [probe.num_layers, 1] and math.prod(shape[2:]) > 2 * seq:
            total += math.prod(shape[2:]) / seq
    widths = {"D": 40, "Q": 24, "KV": 12, "F": 28, "N": 4, "S": 4 * seq}
    found = sum(n * widths[k] for (k, _), n in plan.layer_residuals(remat, seq).counts(host=True).items())
    assert found == pytest.approx(total, rel=0.05)


def test_residuals_of_the_policies():
    assert plan.layer_residuals("full").rows == (("D", "c", 1),)  # the layer input only: 2sbh
    none = plan.layer_residuals("none").counts()
    assert none[("F", "c")] >= 2 and none[("S", "f")] >= 1  # SwiGLU's F-wide rows, the probabilities
    assert plan.recomputes("none") == {"projections": (), "attention": False}
    assert plan.recomputes("full") == {"projections": PROJECTION_NAMES, "attention": True}
    assert plan.recomputes("dots_with_no_batch_dims_saveable") == {"projections": (), "attention": True}
    assert plan.layer_residuals("offload_dots").host and plan.recomputes("offload_dots")["projections"] == ()
    # The selective policies' recomputed projections come from `flops.RECOMPUTES` (the probe's rows
    # carry no names); the probe's F-wide rows hold them to the model: gate and up each saved or not
    # (planted: mlpwi_0 not named -> 0 F rows under save_dot_except_mlpwi_1, fails), q, k, v saved
    # (before RoPE: 1 Q-, 2 KV-wide rows with the xla attention), out_proj where saved (a D row with
    # the layer input), mlpwo never (no gradient reads it: not a residual where it is named).
    assert plan.recomputes("save_dot_except_mlpwi_1")["projections"] == ("mlpwi_1",)
    assert plan.recomputes("save_dot_except_mlpwi")["projections"] == ("mlpwi_0", "mlpwi_1")
    assert plan.recomputes("save_qkv_proj")["projections"] == ("out_proj", "mlpwi_0", "mlpwi_1")
    for remat, saved in REMAT_SAVES.items():
        rows = plan.layer_residuals(remat).counts()
        assert rows[("F", "c")] == sum(n in saved for n in ("mlpwi_0", "mlpwi_1")), remat
        assert (rows[("Q", "c")], rows[("KV", "c")], rows[("D", "c")]) == (1, 2, 1 + ("out_proj" in saved)), remat
        assert plan.recomputes(remat) == flops.RECOMPUTES[remat] and flops.RECOMPUTES[remat]["attention"]
    # The flash kernel keeps its output and log-sum-exp under every policy but full (its residual
    # names, model/transformer.py): the backward runs no attention forward again.
    for remat in ("none", "dots_saveable", "dots_with_no_batch_dims_saveable", "save_attention_out", "offload_dots",
                  *REMAT_SAVES):
        assert plan.recomputes(remat, attention="flash")["attention"] is False, remat
        assert ("N", "f") in plan.layer_residuals(remat, attention="flash").counts(host=True), remat
    assert plan.recomputes("full", attention="flash")["attention"] is True


def test_context_parallel_residuals_and_work():
    """The ring and all-gather attention save the local q, k, v, o and log-sum-exp, never the scores."""
    for strategy in ("ring", "allgather"):
        rows = plan.layer_residuals("none", 128, "xla", 4, strategy).counts()
        assert rows[("Q", "c")] == 3 and rows[("KV", "c")] == 2 and rows[("N", "f")] == 1
        assert not any(k == "S" for k, _ in rows)
    assert plan.recomputes("none", 2) == {"projections": (), "attention": False}
    assert plan.recomputes("full", 2) == {"projections": PROJECTION_NAMES, "attention": True}
    # zigzag balances causal work: the busiest device computes 1/2 of its share of the square with
    # flash (diagonal blocks halved), (2C+1)/(4C) with the masking xla kernel; contiguous: C - 1/2 blocks.
    assert plan.context_score_fraction(4, "zigzag", "flash") == 0.5
    assert plan.context_score_fraction(4, "zigzag", "xla") == 9 / 16
    assert plan.context_score_fraction(4, "contiguous", "flash") == 3.5 / 4


def test_a_sliding_window_plans_its_share_of_the_square():
    """With model.sliding_window the planner's attention core covers the window's share of the
    square: on one device W/S - W^2/2S^2 (metrics.flops' count) with a fused kernel, the causal half
    with the reference (which computes the whole square anyway); under context parallelism the
    busiest device's visible (query, key) pairs with flash, counted here from the element mask, and
    the pairs it does not skip whole with xla. Mistral-7B at 32k plans less attention time and fewer
    hardware FLOPs with its 4,096-key window than without."""
    import numpy as np

    from lumen_jax.ops.reference import mask
    from lumen_jax.parallel import context as context_lib

    s, w = 64, 20
    visible = np.asarray(mask(s, s, True, None, None, w))[0, 0, 0]
    for c, balance in ((4, "zigzag"), (2, "contiguous"), (4, "contiguous")):
        layout = context_lib.Layout(c, balance)
        rows = layout.order(s).reshape(c, s // c)  # each device's query positions
        busiest = max(int(visible[r].sum()) for r in rows)
        assert plan.context_score_fraction(c, balance, "flash", s, w) == pytest.approx(busiest * c / s ** 2)
        chunk = s // (c * layout.chunks_per_device)
        blocks = visible.reshape(s // chunk, chunk, s // chunk, chunk).any(axis=(1, 3))
        pairs = max(int(sum(blocks[q].sum() for q in layout.chunk_ids(i))) for i in range(c))
        assert plan.context_score_fraction(c, balance, "xla", s, w) == pytest.approx(pairs * chunk ** 2 * c / s ** 2)
    model = ModelConfig(sliding_window=1024)
    assert plan.planned_score_fraction(model, MeshConfig(), 4096, "flash") == (1024 - 1024 ** 2 / 8192) / 4096
    assert plan.planned_score_fraction(model, MeshConfig(), 4096, "xla") == 0.5
    assert plan.planned_score_fraction(model, MeshConfig(), 1024, "flash") == 0.5  # a window as long: none
    assert plan.planned_score_fraction(model, MeshConfig(context=2), 4096, "flash") < plan.context_score_fraction(2)
    cfg = load_config("configs/mistral_7b.yaml", ["data.seq_len=32768"])
    plain = cfg.replace(model=dataclasses.replace(cfg.model, sliding_window=0))
    layout = plan.layout_from_config(cfg, 64)
    windowed, full = plan.predict(cfg, layout, H100), plan.predict(plain, layout, H100)
    assert windowed.hardware_flops_per_token < full.hardware_flops_per_token
    assert windowed.compute_s < full.compute_s


# --------------------------------------------------------------------------------------------------
# Textbook figures
# --------------------------------------------------------------------------------------------------


def test_sixteen_bytes_per_parameter_and_fourteen_gpus_for_70b():
    cfg = load_config("configs/llama3_70b.yaml")
    n = flops.param_counts(cfg.model)["total"]
    one = plan.state_bytes(cfg.model, plan.Layout())  # one device
    assert one == {"params": 4 * n, "grads": 4 * n, "optimizer": 8 * n}  # our 4 + 4 + 8 split
    assert sum(one.values()) == plan.TEXTBOOK_BYTES_PER_PARAM * n  # the textbook's 2 + 2 + 12
    assert sum(one.values()) == pytest.approx(1.1e12, rel=0.05)  # "about 1.1 TB of state"
    assert sum(one.values()) / 80e9 == pytest.approx(14, rel=0.02)  # "fourteen 80 GB GPUs"
    sharded = plan.state_bytes(cfg.model, plan.Layout(MeshConfig(fsdp=16)))
    assert sum(sharded.values()) == pytest.approx(sum(one.values()) / 16, rel=1e-3)  # norms replicated


def test_six_n_d_for_70b_on_15t_tokens():
    """Llama 3 70B: ~70.6B parameters; the planner's FLOPs per token are 6N over the matmul weights
    (the embedding lookup is no matmul) plus attention, counted by hand: QK^T and AV are 2 * 2SHN
    forward FLOPs per token per layer, half of them under the causal mask, times 3 for the backward."""
    cfg = load_config("configs/llama3_70b.yaml")
    m, s = cfg.model, cfg.data.seq_len
    counts = flops.param_counts(m)
    assert counts["total"] == pytest.approx(70.55e9, rel=1e-3)
    assert counts["embedding"] == m.vocab_size * m.d_model  # looked up: no matmul FLOPs
    assert counts["total"] - counts["matmul"] - counts["embedding"] == (2 * m.num_layers + 1) * m.d_model  # norms
    per_token = plan.predict(cfg, plan.layout_from_config(cfg, 512), H100).flops_per_token
    attention = 3 * (2 * 2 * s * m.num_heads * m.resolved_head_dim) / 2 * m.num_layers
    assert per_token == pytest.approx(6 * counts["matmul"] + attention, rel=1e-12)
    assert 1.0 < per_token / (6 * counts["total"]) < 1.1  # "6N plus ~7% at 8k context"
    # 15T tokens: the predicted step FLOPs scale to 6.3e24-ish, ~200 GPU-years at 1 PFLOP/s.
    years = per_token * 15e12 / 1e15 / YEAR_S
    assert 200 < years < 220, years


def test_one_flop_count_for_the_trainer_and_the_planner():
    """The planner's hardware FLOPs are `flops.hardware_flops_per_token`, with the recompute read off
    the model; where the probe agrees with what the trainer's HFU assumes, the counts are equal."""
    cfg = load_config("configs/llama3_8b.yaml")
    layout = plan.layout_from_config(cfg, 64)
    for remat in ("none", "full", "dots_with_no_batch_dims_saveable", "save_dot_except_mlpwi_1"):
        assert plan.recomputes(remat) == flops.RECOMPUTES[remat]
        assert plan.planned_flops_per_token(cfg.model, layout, 8192, remat) == \
            flops.hardware_flops_per_token(cfg.model, 8192, remat)


def test_pipeline_bubble():
    assert plan.bubble_fraction(8, 8) == pytest.approx(7 / 15) == pytest.approx(0.47, abs=0.005)
    assert plan.bubble_fraction(8, 64) == pytest.approx(7 / 71) == pytest.approx(0.10, abs=0.005)
    assert plan.bubble_fraction(8, 8, interleave=4) == pytest.approx(7 / 39)


def test_llama3_405b_on_16k_h100():
    """TP 8, CP 1, PP 16, DP 128 at 8k context (Llama 3 paper, table 4): 16M tokens per step."""
    cfg = load_config("configs/llama3_405b.yaml", ["mesh.fsdp=128", "mesh.tensor=8", "mesh.context=1"])
    layout = plan.layout_from_config(cfg, 16384, pipeline=16, pipeline_microbatches=16)
    assert (layout.pipeline, layout.mesh.fsdp, layout.mesh.tensor, layout.mesh.context) == (16, 128, 8, 1)
    assert layout.num_devices == 16384
    p = plan.predict(cfg, layout, H100)
    assert p.tokens_per_step == 2048 * 8192
    assert p.micro_batch == 1 and p.bubble == pytest.approx(15 / 31)
    assert p.fits, p.verdict()
    # Per device: 8 of the 126 layers split 8 ways by tensor and 128 by fsdp (norms replicated), and,
    # replicated over the stages as the pipelined step holds them, the embedding, the logits matrix
    # (as large) and the final norm.
    n, d = flops.param_counts(cfg.model), cfg.model.d_model
    assert p.state["params"] == 4 * (8 * (n["layer_matmul"] // 1024 + 2 * d) + 2 * n["embedding"] // 1024 + d)
    assert p.flops_per_step == pytest.approx(6 * n["total"] * p.tokens_per_step, rel=0.1)
    links = {(c.axis, c.link) for c in p.collectives}
    assert links == {("fsdp", "ib"), ("tensor", "nvlink"), ("pipeline", "ib")}


# --------------------------------------------------------------------------------------------------
# Activations against Korthikanti et al. 2022
# --------------------------------------------------------------------------------------------------


LLAMA_7B = ModelConfig(d_model=4096, num_layers=32, num_heads=32, num_kv_heads=32, ffn_dim=11008,
                       vocab_size=32000, compute_dtype="bfloat16")


def test_our_layer_against_korthikanti():
    h, a, f, s, one = 4096, 32, LLAMA_7B.ffn_dim, 4096, plan.Layout()
    per_token = lambda remat, seq, attention: plan.saved_bytes_per_token(  # noqa: E731
        LLAMA_7B, one, seq, remat, attention)
    assert per_token("full", s, "xla") == per_token("full", s, "flash") == 2 * h  # the layer input: 2sbh
    # The xla attention keeps the probabilities in fp32 and cast to bf16: 6as^2b, times the part of
    # the square its causal query blocks cover (Korthikanti: 5as^2b = softmax output 2 + dropout
    # mask 1 + dropout output 2).
    rows = plan.layer_residuals("none", s).counts()
    assert (4 * rows[("S", "f")] + 2 * rows[("S", "c")]) * a * s == pytest.approx(
        6 * a * s * plan.residuals.computed_score_fraction(s))
    # Flash attention keeps no score rows: nothing grows with s.
    assert per_token("none", 2 * s, "flash") == per_token("none", s, "flash")
    # Its s*b*h terms: the norms' inputs and outputs 4 x 2h (their VJP keeps the compute-dtype input
    # and 1 / rms, where autodiff kept two float32 copies: 16h), q, o (the kernel's output, which is
    # the projection's input: named for remat=save_attention_out only, planted: named always -> 3 q-wide
    # rows), k, v 4 x 2h, SwiGLU's gate, up and product 3 x 2F (its VJP rebuilds the sigmoid: autodiff
    # kept six F-wide rows), and a log-sum-exp per head: 16h + 6F + 4a, Korthikanti's count for the
    # Llama layer (`recipe_memory.megatron_layer_widths`: 34h for a GPT layer, whose MLP is 4h wide).
    assert per_token("none", s, "flash") == 8 * h + 8 * h + 6 * f + 4 * a
    widths = recipe_memory.megatron_layer_widths(LLAMA_7B, "none")
    assert per_token("none", s, "flash") == 2 * (widths["D"] * h + widths["T"])
    # Tensor + sequence parallelism split everything t ways: the norm outputs a matmul gathers are
    # kept as the device's own rows and gathered again in the backward (`Ops.regather`; planted:
    # `memory.regathered_inputs` 0 -> fails), as Megatron keeps them (31.75 sbh / t for 405B); so
    # do the collective matmuls, which gather them in steps themselves (the all-gather matmul's
    # residual is the device's block: `test_sequence_parallel_layers_keep_their_own_rows`).
    for overlap in ("none", "collective_matmul"):
        tp = plan.Layout(MeshConfig(fsdp=1, tensor=8, sequence_parallel=True, tensor_overlap=overlap))
        assert plan.saved_bytes_per_token(LLAMA_7B, tp, s, "none", "flash") == pytest.approx(
            per_token("none", s, "flash") / 8)


@pytest.mark.parametrize("overlap", ["none", "collective_matmul"])
def test_sequence_parallel_layers_keep_their_own_rows(overlap):
    """Sequence parallelism with remat none, fsdp=4 x tensor=2 (configs/tiny.yaml): the layers'
    forward loop stacks for the backward the norms' inputs and outputs (the projections' inputs) as
    the device's own rows, [L, B, T/t, D], both with plain collectives (`Ops.regather`) and with
    collective matmuls (whose all-gather matmul keeps its block, `parallel.collective_matmul`); no
    gathered [L, B, T, D] row. The planner's D-wide rows are the compiled loop's, and its bytes
    within 10% (measured 2026-12-06: -8.4% plain, -3.9% collective matmul; the old count of the
    collective matmul's rows as gathered gave -0.3% but predicted two gathered rows the program
    does not keep: planted, `memory.regathered_inputs` 0 under collective_matmul -> fails)."""
    cfg = load_config("configs/tiny.yaml", ["mesh.fsdp=4", "mesh.tensor=2", "mesh.sequence_parallel=true",
                                            "model.remat=none", f"mesh.tensor_overlap={overlap}"])
    layout = plan.layout_from_config(cfg, jax.device_count())
    m, t = cfg.model, cfg.mesh.tensor
    rows = plan_memory._as_gathered(plan.layer_residuals("none", cfg.data.seq_len).counts(), "none",
                                   plan_memory.regathered_inputs(m, layout, "none"))
    p, compiled = plan.predict(cfg, layout, H100), compile_step(cfg, layout)
    module = hlo.parse(compiled.as_text())
    b = cfg.data.global_batch_size // cfg.mesh.fsdp
    stacked = [[a.dims for a in i.arrays if a.dims in {(m.num_layers, b, cfg.data.seq_len // k, m.d_model)
                                                         for k in (1, t)}]
               for i in module.instrs if i.op == "while" and i.computation == module.entry]
    forward = next(dims for dims in stacked if dims)  # the first loop of the layers: their forward
    own = forward.count((m.num_layers, b, cfg.data.seq_len // t, m.d_model))
    assert (own, len(forward) - own) == (rows[("D", "c")], rows[("G", "c")]) == (4, 0)
    check = against_xla(cfg, p, compiled)
    assert check.bytes_predicted == pytest.approx(check.bytes_compiled, rel=BYTES_RTOL)


def test_remat_policies_order_activation_memory():
    cfg = load_config("configs/llama3_8b.yaml")
    layout = plan.layout_from_config(cfg, 64)
    saved = {r: plan.activation_bytes(cfg.model, layout, 8192, 2, r).saved for r in plan.SEARCH_REMATS}
    assert saved["full"] <= saved["dots_with_no_batch_dims_saveable"] <= saved["dots_saveable"] < saved["none"]
    assert saved["full"] < saved["save_dot_except_mlpwi"] < saved["save_dot_except_mlpwi_1"] < \
        saved["dots_with_no_batch_dims_saveable"]
    assert saved["full"] == 32 * 2 * 8192 * 2 * 4096  # L x b x S x 2D bytes


# --------------------------------------------------------------------------------------------------
# Communication
# --------------------------------------------------------------------------------------------------


def test_ring_factors_and_links():
    c = plan.Collective("data", 8, "ib", "all-reduce", "", 1e9, 2, True, 50e9)
    assert c.wire_bytes == pytest.approx(2 * 7 / 8 * 1e9 * 2)
    assert c.seconds == pytest.approx(c.wire_bytes / 50e9)
    assert dataclasses.replace(c, kind="all-gather").wire_bytes == pytest.approx(7 / 8 * 2e9)
    assert dataclasses.replace(c, kind="reduce-scatter").wire_bytes == pytest.approx(7 / 8 * 2e9)
    node = plan.Layout(MeshConfig(data=2, fsdp=2, tensor=2))
    assert {a: plan.link_of(a, node, H100)[0] for a in ("data", "fsdp", "tensor")} == {
        "data": "nvlink", "fsdp": "nvlink", "tensor": "nvlink"}
    big = plan.Layout(MeshConfig(fsdp=64, tensor=8))
    assert plan.link_of("tensor", big, H100) == ("nvlink", 900e9)
    assert plan.link_of("fsdp", big, H100) == ("ib", 50e9)


def test_collectives_of_a_70b_step():
    cfg = load_config("configs/llama3_70b.yaml")  # fsdp 128 x tensor 8, 4 micro-batches, remat full
    layout = plan.layout_from_config(cfg, 1024)
    comms = {(c.axis, c.kind, c.what.split(",")[0]): c for c in plan.collectives(
        cfg.model, layout, H100, 8192, 1, "full")}
    counts = flops.param_counts(cfg.model)
    layers = 2 * counts["layer_matmul"] * cfg.model.num_layers / 8  # bf16 (gathered in the compute dtype), one tensor shard
    gather = comms[("fsdp", "all-gather", "bf16 layer weights")]
    assert gather.calls == 2 * 4 and gather.payload_bytes == pytest.approx(layers, rel=1e-3)  # fwd + bwd per micro-batch
    assert gather.overlapped and gather.link == "ib"
    hoisted = comms[("fsdp", "all-gather", "bf16 embedding and logits weights (hoisted)")]
    assert hoisted.calls == 1
    assert comms[("fsdp", "reduce-scatter", "fp32 gradients")].calls == 4  # every_micro_batch
    tensor = comms[("tensor", "all-reduce", "activations")]
    assert tensor.payload_bytes == 8192 * 8192 * 2  # [tokens, D] in bf16
    # per layer 2 fwd + 5 bwd (q, k, v; gate, up reduced separately, as XLA runs them) + 2 recompute;
    # embedding, logits
    assert tensor.calls == 4 * (9 * 80 + 2)
    assert not tensor.overlapped and tensor.link == "nvlink"


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------


def test_cli_json(capsys):
    assert main(["--config", "configs/llama3_70b.yaml", "--devices", "512", "--device", "h100", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["bytes_per_device"]) >= {"params", "grads", "optimizer", "activations", "total"}
    for key in ("device_memory_bytes", "fits", "flops_per_token", "flops_per_step",
                "predicted_step_time_s", "predicted_mfu"):
        assert key in out
    assert out["fits"] is True and 0 < out["predicted_mfu"] < 1
    assert out["device_memory_bytes"] == 80e9


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.heavy  # --search tries pipeline depths too: 28 s (89 s before the memory-first check)
def test_cli_table_and_search(capsys, monkeypatch):
    assert main(["--config", "configs/llama3_70b.yaml", "--devices", "512"]) == 0
    table = capsys.readouterr().out
    assert "memory per device" in table and table.splitlines()[-1].startswith("fits: ")
    # 70B on one node: 1.13 TB of state cannot fit in 8 x 80 GB.
    assert main(["--config", "configs/llama3_70b.yaml", "--devices", "8", "train.micro_batches=512"]) == 0
    verdict = capsys.readouterr().out.splitlines()[-1]
    assert verdict.startswith("does not fit: ") and "parameters + gradients + optimizer" in verdict
    # 8 devices: every axis still has splits to rank; 64 took twice as long (more context sizes to probe)
    terminal = _Terminal()  # the search's progress bar shows on a terminal
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(["--config", "configs/llama3_8b.yaml", "--devices", "8", "--search", "--top", "3",
                 "--json"]) == 0
    assert re.search(r"search: [1-9]\d* plans \[", terminal.getvalue()), terminal.getvalue()[-500:]
    ranked = json.loads(capsys.readouterr().out)
    assert len(ranked) == 3 and all(r["fits"] for r in ranked)
    mfus = [r["predicted_mfu"] for r in ranked]
    assert mfus == sorted(mfus, reverse=True)


def test_search_options_keeps_the_mesh_and_ranks_our_options(capsys):
    """`--search-options` (`predict.settings`) ranks our program's options on the config's own mesh:
    every candidate has its axes, fits and is ranked by MFU; the remat policies, the micro-batch
    counts that split the device's sequences (tiny: 16 / 8 devices = 2: 1 and 2) and, over
    fsdp, the ZeRO stages and the gather and reduction options are tried; the config's own setting
    is among them."""
    import json

    cfg = load_config("configs/tiny.yaml", [])
    layout = layout_from_config(cfg, 8)
    assert main(["--config", "configs/tiny.yaml", "--devices", "8", "--search-options", "--top", "400", "--json"]) == 0
    ranked = json.loads(capsys.readouterr().out)
    axes = ("data", "fsdp", "context", "tensor", "expert")
    assert all(r["fits"] for r in ranked)
    assert all(r["layout"]["mesh"][a] == getattr(layout.mesh, a) for r in ranked for a in axes)
    # ranked by MFU to 4 places, then by bytes (`predict.settings`): candidates 3e-6 apart (the selective
    # policies beside dots) rank by their bytes
    mfus = [round(r["predicted_mfu"], 4) for r in ranked]
    assert mfus == sorted(mfus, reverse=True)
    assert {r["remat"] for r in ranked} == set(SEARCH_REMATS)
    assert {r["layout"]["micro_batches"] for r in ranked} == {1, 2}
    assert {r["layout"]["mesh"]["zero_stage"] for r in ranked} == {1, 2, 3}
    assert {r["layout"]["mesh"]["fsdp_regather"] for r in ranked} == {"per_micro_batch", "per_step"}
    assert {r["layout"]["mesh"]["fsdp_grad_reduce"] for r in ranked} == {"every_micro_batch", "once"}
    own = predict(cfg, layout, DEVICES["h100"])
    assert any(r["predicted_step_time_s"] == pytest.approx(own.step_time_s, rel=1e-12) and r["remat"] == own.remat
               for r in ranked)


@pytest.mark.parametrize("argv, message", [
    (["--devices", "8", "mesh.fsdp=3"], "fsdp=3"),
    (["--devices", "8", "model.d_modle=64"], "did you mean model.d_model"),
    (["--devices", "8", "--pipeline", "3"], "--pipeline 3"),
    (["--devices", "8", "--efficiency", "1.5"], "--efficiency"),
    (["--devices", "8", "--against-xla"], "unrecognized arguments: --against-xla"),
    (["--devices", "8", "--device", "tpu9"], "argument --device: invalid choice: 'tpu9' (choose from"),
    (["--devices", "0"], "--devices 0 must be >= 1"),
    # numbers that planned nonsense before: a search for 0 candidates said "no candidate fits",
    # -1 GB planned "-0.9 GB usable", NaN bandwidth planned NaN seconds
    (["--devices", "8", "--search", "--top", "0"], "--top=0 must be a positive finite number"),
    (["--devices", "8", "--memory-gb", "-1"], "--memory-gb=-1.0 must be a positive finite number"),
    (["--devices", "8", "--ib-gbps", "nan"], "--ib-gbps=nan must be a positive finite number"),
    (["--devices", "8", "--devices-per-node", "0"], "--devices-per-node=0 must be a positive finite number"),
    (["--devices", "8", "--search", "--search-options"], "--search and --search-options: give one"),
])
def test_cli_bad_input_exits_2(capsys, argv, message):
    assert main(["--config", "configs/tiny.yaml", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.heavy
def test_cli_against_xla():
    """A fresh process: 8 emulated CPU devices set before JAX starts, the step compiled, both sides
    printed (JSON) and within the test's tolerances."""
    argv = ["--config", "configs/tiny.yaml", "--devices", "8", "--against-xla", "mesh.fsdp=8", "--json"]
    proc = subprocess.run([sys.executable, "-m", "lumen_jax.lower", *argv], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    check = json.loads(proc.stdout)["against_xla"]
    assert set(check) == {"flops_predicted", "flops_compiled", "matmul_predicted", "matmul_compiled",
                          "bytes_predicted", "bytes_compiled", "collectives"}
    assert check["bytes_predicted"] == pytest.approx(check["bytes_compiled"], rel=BYTES_RTOL)
    assert check["flops_predicted"] == pytest.approx(check["flops_compiled"], rel=FLOPS_RTOL)


@pytest.mark.heavy  # --search tries pipeline depths too: 57 s contended (2 min 4 s before the cheap-key memory checks)
def test_the_issue_commands(capsys):
    """The two commands of the issue: the 70B preset is valid at 1024 H100s and fits; the 405B search ranks."""
    assert main(["--config", "configs/llama3_70b.yaml", "--devices", "1024", "--device", "h100"]) == 0
    table = capsys.readouterr().out
    assert "fsdp=128 tensor=8" in table and table.splitlines()[-1].startswith("fits: ")
    assert main(["--config", "configs/llama3_405b.yaml", "--devices", "16384", "--device", "h100", "--search",
                 "--json"]) == 0
    ranked = json.loads(capsys.readouterr().out)
    assert ranked and all(r["fits"] and r["num_devices"] == 16384 for r in ranked)


def test_fp8_scaling_state_and_ring_hops():
    cfg = load_config("configs/llama3_70b.yaml")
    layout = plan.layout_from_config(cfg, 1024)
    assert plan.fp8_bytes(cfg.model, layout) == 0.0  # recipe none
    delayed = Fp8Config(recipe="delayed", amax_history=1024, layers=("attention", "mlp"), keep_bf16=())
    model = dataclasses.replace(cfg.model, fp8=delayed)
    # (amax_history + 1) fp32 per operand x 3 operands x 7 matmuls x 80 layers
    assert plan.fp8_bytes(model, layout) == 1025 * 4 * 3 * 7 * 80
    # The histories are stacked with the layers: the kept first and last layers hold theirs too
    # (idle), with or without a pipeline (every stage holds its 40 layers' at pipeline=2).
    kept = dataclasses.replace(model, fp8=dataclasses.replace(delayed, keep_bf16=("first", "last")))
    assert plan.fp8_bytes(kept, layout) == 1025 * 4 * 3 * 7 * 80
    staged = plan.layout_from_config(load_config("configs/llama3_70b.yaml", ["mesh.pipeline=2", "mesh.fsdp=64"]), 1024)
    assert plan.fp8_bytes(kept, staged) == 1025 * 4 * 3 * 7 * 40
    ring = load_config("configs/llama3_70b.yaml", ["mesh.context=4"])
    lay = plan.layout_from_config(ring, 1024)
    hops = [c for c in plan.collectives(ring.model, lay, H100, 8192, 1, "full")
            if c.axis == "context" and c.kind != "all-reduce"]  # not the gradients' (with data's: m > 1)
    kv_chunk = 2 * 8192 / 4 * 8 * 128 / 8 * 2  # K and V of one chunk, bf16, kv heads split by tensor
    assert hops[0].kind == "send/recv" and hops[0].payload_bytes == kv_chunk
    assert hops[0].calls == lay.micro_batches * 80 * 3 * 2  # C-1 hops, forward and its recompute


# --------------------------------------------------------------------------------------------------
# Mixture of experts
# --------------------------------------------------------------------------------------------------

MOE_RTOL = 0.10  # the issue's bound for --against-xla on MoE configs (bytes, FLOPs, all-to-all bytes)
# configs/tiny_moe.yaml (8 experts of width 64, top-2, dropless, fp32) and a fine-grained variant: expert
# parallelism with data under the replica vmap, with tensor and fsdp; no recompute and full (expert
# alone at 8: the fine-grained variant; under full, and expert x fsdp: the expert x tensor x fsdp case).
MOE_XLA_CASES = {
    "expert=4,data=2 micro_batches=2": ["mesh.expert=4", "mesh.data=2", "mesh.fsdp=1", "train.micro_batches=2"],
    "expert=2,tensor=2,fsdp=2 full": ["mesh.expert=2", "mesh.tensor=2", "mesh.fsdp=2", "model.remat=full"],
    "64 experts top-8 expert=8": ["mesh.expert=8", "mesh.fsdp=1", "model.moe.num_experts=64", "model.moe.top_k=8",
                                  "model.moe.expert_ffn_dim=16"],
}


@pytest.mark.heavy
@pytest.mark.parametrize("name", list(MOE_XLA_CASES))
def test_moe_against_xla(name, capsys):
    """`python -m lumen_jax.lower --against-xla` on MoE configs: bytes per device (the dispatch's
    worst-case buffers, plan/moe.py), FLOPs as cost_analysis counts them, and the all-to-all bytes
    of the padded exchange the CPU step runs, each within 10% of the compiled step's."""
    argv = ["--config", "configs/tiny_moe.yaml", "--devices", "8", "--against-xla", "--json", *MOE_XLA_CASES[name]]
    assert lower_main(argv) == 0
    check = json.loads(capsys.readouterr().out)["against_xla"]
    for what, predicted, compiled in [("bytes", check["bytes_predicted"], check["bytes_compiled"]),
                                      ("FLOPs", check["flops_predicted"], check["flops_compiled"]),
                                      ("all-to-all bytes", *check["collectives"]["expert all-to-all"])]:
        assert predicted == pytest.approx(compiled, rel=MOE_RTOL), (
            f"{name}: {what} predicted {predicted:,.0f}, XLA {compiled:,.0f} ({predicted / compiled - 1:+.1%})")


@pytest.mark.heavy
def test_moe_pipeline_collectives_against_xla(capsys):
    """MoE in pipeline stages (pipeline=2 expert=2, m=4): the exchanges of every tick's units (fill
    and drain included, not m micro-batches) and the gradients outside the experts each unit
    all-reduces over `expert` in its tick, within 10% of the compiled step's. Measured: all-to-all
    -3.0%, all-reduce -0.1% (were -22% and -41%/-35% when counted per micro-batch). Under zero_bubble
    only: the planner's terms (`collectives._expert`, `_pipelined_gradients`) are 1F1B's with the
    split backward's W units added, and 1F1B's ticks are held by the dense pipeline cases
    (`test_pipeline_collectives_match_the_compiled_step`). Entries under 5% of the largest are not
    compared: the router's top_k gathers its logits over `expert` in each backward tick (160 kB
    here), which the planner leaves out. The bytes and FLOPs are not held
    here: zero_bubble's bytes -15.8%, FLOPs +11%/+19% (docs/PLANNING.md)."""
    argv = ["--config", "configs/tiny_moe.yaml", "--devices", "4", "--against-xla", "--json", "model.num_layers=4",
            "mesh.fsdp=1", "mesh.expert=2", "mesh.pipeline=2", "train.micro_batches=4",
            "mesh.pipeline_schedule=zero_bubble"]
    assert lower_main(argv) == 0
    collectives = json.loads(capsys.readouterr().out)["against_xla"]["collectives"]
    largest = max(c for _, c in collectives.values())
    compared = {k: v for k, v in collectives.items() if max(v) > 0.05 * largest}
    assert {"expert all-to-all", "expert reduce"} <= set(compared), compared
    for key, (predicted, compiled) in compared.items():
        assert predicted == pytest.approx(compiled, rel=MOE_RTOL), f"{key}: {predicted:,.0f} vs {compiled:,.0f}"


@pytest.mark.parametrize("config,total,active", [("mixtral_8x7b", 46.7e9, 12.9e9), ("qwen3_30b_a3b", 30.5e9, 3.3e9)])
def test_moe_presets_plan_on_64_gpus(config, total, active, capsys):
    """The MoE presets on 64 H100s (8 nodes): the published parameter counts (active ones with the
    embedding), the experts' all-to-alls inside a node, the dispatch's buffers counted, and it fits."""
    cfg = load_config(f"configs/{config}.yaml")
    counts = flops.param_counts(cfg.model)
    assert counts["total"] == pytest.approx(total, rel=0.01)
    assert counts["matmul"] + counts["embedding"] == pytest.approx(active, rel=0.02)
    assert main(["--config", f"configs/{config}.yaml", "--devices", "64", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is True and out["layout"]["mesh"]["expert"] == 8, out["layout"]
    exchange = [c for c in out["communication"] if c["kind"] == "all-to-all"]
    assert exchange and all(c["axis"] == "expert" and c["link"] == "nvlink" for c in exchange)
    layout = plan.layout_from_config(cfg, 64)
    tokens = cfg.data.global_batch_size * cfg.data.seq_len / 64 / cfg.train.micro_batches
    buffers = plan.moe.layer_bytes(cfg.model, layout, tokens)["saved"]  # remat full: one layer's, recomputed
    assert out["activations"]["working"] >= buffers > 0


def test_uneven_stages_plan_the_dearest_stage():
    """mesh.pipeline_layers=[2, 6] on 8 layers: every tick lasts as long as the 6-layer stage, so the
    step's compute is that of even stages of 6 layers (12 layers), and the FLOPs counted (MFU) are
    the 8 real layers'."""
    def planned(layers: int, *split: str):
        cfg = load_config("configs/tiny.yaml", [f"model.num_layers={layers}", "mesh.fsdp=1", "mesh.pipeline=2",
                                                "train.micro_batches=4", *split])
        return plan.predict(cfg, plan.layout_from_config(cfg, 2), H100)

    uneven, deep, even = planned(8, "mesh.pipeline_layers=[2,6]"), planned(12), planned(8)
    assert uneven.compute_s == pytest.approx(deep.compute_s, rel=1e-9)
    assert uneven.compute_s > even.compute_s
    assert uneven.flops_per_token == even.flops_per_token  # the real layers only
    assert uneven.mfu == pytest.approx(even.mfu * even.step_time_s / uneven.step_time_s, rel=1e-6)
    # in memory each stage holds 6 layer slots (zero padding included): the 12-layer model's state
    assert uneven.state == deep.state and sum(uneven.state.values()) > sum(even.state.values())
