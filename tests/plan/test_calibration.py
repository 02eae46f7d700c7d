"""The planner against published H100 runs, its hardware terms one by one, and goodput."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import pytest

from lumen_jax.metrics import flops
from lumen_jax.plan import calibration, goodput
from lumen_jax.plan.collectives import Collective
from lumen_jax.plan.efficiency import Compute, Efficiency, Overlap
from lumen_jax.plan.hardware import DEVICES
from lumen_jax.plan.predict import exposed_seconds, predict
from lumen_jax.plan.published import CONVENTIONS, HARDWARE, TABLE
from helpers.paths import REPO

H100 = DEVICES["h100"]


@pytest.fixture(scope="module")
def found():
    return calibration.rows()


def by_name(found, name):
    return next(r for r in found if r.published.name == name)


def test_the_planner_predicts_the_published_runs(found):
    """The issue's bounds: typical error (exp of the mean |log ratio|) <= x1.15, geometric-mean ratio
    within 0.9-1.1, over at least 12 published runs, each with its source and FLOP convention."""
    assert len(found) >= 12
    for r in found:
        assert r.published.source and r.published.convention in CONVENTIONS and r.published.hardware in HARDWARE
    s = calibration.statistics(found)
    assert s["typical_error"] <= 1.15, calibration.format_calibration(found)
    assert 0.9 <= s["mean_ratio"] <= 1.1, calibration.format_calibration(found)


def test_flop_conventions_turn_back_into_tokens():
    """A TFLOP/s row is turned back with its source's convention: full attention counts the whole
    square, so the same TFLOP/s is fewer tokens than under the causal half."""
    row = next(r for r in TABLE if r.convention == "6N+full")
    model = calibration.model_of(row)
    assert calibration.measured_tokens_per_gpu(row) == pytest.approx(
        row.measured * 1e12 / flops.flops_per_token(model, row.seq_len, causal=False), rel=1e-12)
    causal = dataclasses.replace(row, convention="6N+causal")
    assert calibration.measured_tokens_per_gpu(causal) > calibration.measured_tokens_per_gpu(row)


def test_matmul_efficiency_follows_the_gemm_shape():
    """A square 8k GEMM runs near `matmul` of the peak; the same FLOPs as a thin GEMM (few tokens, or
    a width cut 8 ways by tensor parallelism) run slower per FLOP; with one constant they would not."""
    eff, peak = Efficiency(), H100.peak("bfloat16")
    rate = lambda m, k, n: 2 * m * k * n / eff.gemm_seconds(m, k, n, H100, peak) / peak  # noqa: E731
    assert 0.9 * eff.matmul < rate(8192, 8192, 8192) <= eff.matmul
    assert rate(8192, 8192, 8192 / 8) < 0.9 * rate(8192, 8192, 8192)
    assert rate(512, 4096, 4096) < 0.75 * rate(8192, 8192, 8192)


def test_efficiency_by_shape_is_what_the_table_measures(found):
    """No one constant efficiency for every FLOP (the planner before the table) fits the published
    runs as the table by shape does, with the same recipe overlaps: the best constant of 0.30-0.90
    cannot have the 8B's thin TP 8 GEMMs and the 405B's large ones both right. Measured: the best
    flat 0.54 has typical error x1.103 and ratios x0.84 (405B, 16,384 GPUs) to x1.33 (8B TP 8),
    spread x1.58; the table x1.072, spread x1.38."""
    def spread(rows):
        return max(r.ratio for r in rows) / min(r.ratio for r in rows)

    table = calibration.statistics(found)["typical_error"]
    flats = [calibration.rows(efficiency=e / 100) for e in range(30, 91, 2)]
    best = min(flats, key=lambda rows: calibration.statistics(rows)["typical_error"])
    flat = calibration.statistics(best)["typical_error"]
    assert math.log(flat) > 1.25 * math.log(table), (flat, table)
    assert spread(best) > 1.1 * spread(found), (spread(best), spread(found))


def test_tensor_overlap_is_the_async_tp_speedup(found):
    """torchtitan measured async TP 1.10x (8B, TP 8) and 1.09x (70B) faster than vanilla TP on the
    same layout; the recipes' tensor overlap predicts a speed-up of the same kind, ours none."""
    for vanilla, fused, measured in (("torchtitan llama3-8b 64 GPUs TP", "torchtitan llama3-8b 64 GPUs async TP",
                                      4809.4 / 4378),
                                     ("torchtitan llama3-70b 256 GPUs TP", "torchtitan llama3-70b 256 GPUs async TP",
                                      652.4 / 597.3)):
        speedup = by_name(found, fused).predicted / by_name(found, vanilla).predicted
        assert 1.02 < speedup < measured * 1.05, (vanilla, speedup)
    assert Overlap().tensor == 0.0  # our program's tensor collectives sit between its matmuls


def test_data_parallel_scale_out_costs_what_maxtext_measured(found):
    """MaxText's 7B falls 24% from 8 to 128 GPUs (data parallel across A3 VMs at 12.5 GB/s per GPU):
    the gradient all-reduce that shows beside the backward; the prediction falls too."""
    small, large = by_name(found, "MaxText llama2-7b 8 GPUs"), by_name(found, "MaxText llama2-7b 128 GPUs")
    assert large.measured / small.measured == pytest.approx(0.76, abs=0.01)
    assert large.predicted / small.predicted < 0.85
    assert large.plan.exposed_by_axis()["data"] > 0.2 * large.plan.compute_s


def test_exposed_remainder_by_hand():
    """Collectives of one axis share their window of compute: with overlap 1 the step waits only for
    the transfer beyond the window; with overlap 0 for all of it; a half overlap hides half of
    min(transfer, window)."""
    compute = Compute(matmul_s=3.0, attention_s=1.0, elementwise_s=0.0, backward_share=0.5)  # 4 s, backward 2 s

    def comm(axis, kind, seconds, calls=2, overlapped=True):  # a collective of `seconds` on the wire
        c = Collective(axis, 2, "ib", kind, "", 1e9, calls, overlapped, 1.0)
        return dataclasses.replace(c, bandwidth=c.wire_bytes / seconds)

    gather, reduce = comm("fsdp", "all-gather", 3.0), comm("fsdp", "reduce-scatter", 2.5)
    tensor = comm("tensor", "all-reduce", 1.0, overlapped=False)
    once = comm("data", "all-reduce", 1.5, calls=1)  # once per step: behind the last micro-batch's backward
    exposed = exposed_seconds((gather, reduce, tensor, once), compute, 2, Overlap(tensor=0.5, data=1.0))
    assert exposed == pytest.approx((0.0, 0.5, 0.5, 0.5))
    assert exposed_seconds((gather,), compute, 2, Overlap(fsdp=0.0)) == pytest.approx((3.0,))
    kv = comm("context", "all-gather", 1.0, overlapped=False)  # the all-gather attention cannot overlap
    assert exposed_seconds((kv,), compute, 2, Overlap()) == pytest.approx((1.0,))


def test_a_pipeline_without_recompute_is_charged_none(found):
    """The lock-step pipeline stashes its forwards' residuals: a recipe without recompute (Megatron's,
    Llama 3's) gets no stage forward in its hardware FLOPs (the same as the layout without stages,
    and 6N + attention's forward and backward and nothing more), and its matmuls run three passes."""
    rows = [r for r in found if r.plan.layout.pipeline > 1 and r.published.remat == "none"]
    assert len(rows) >= 4
    for r in rows:
        model, seq, lay = calibration.model_of(r.published), r.published.seq_len, r.plan.layout
        flat = dataclasses.replace(lay, pipeline=1, mesh=dataclasses.replace(lay.mesh, pipeline=1))
        plain = calibration.predict(calibration.config_of(r.published), flat, calibration.hardware_of(r.published),
                                    attention="flash")
        assert r.plan.hardware_flops_per_token == pytest.approx(plain.hardware_flops_per_token, rel=1e-12)
        attention = flops.attention_forward_flops_per_token(model, seq, causal=False) * 0.5
        backward = 2.0 if lay.mesh.context == 1 else 2.5
        assert r.plan.hardware_flops_per_token == pytest.approx(
            6 * flops.param_counts(model)["matmul"] + (1 + backward) * attention, rel=1e-12)
        # per device, a stage's share of the flat plan's matmul time (the logits are spread over stages)
        assert r.plan.compute.matmul_s == pytest.approx(plain.compute.matmul_s / lay.pipeline, rel=0.05)


def test_young_daly_is_its_formula():
    g = goodput.goodput(2048, 2e12, 10.0, storage_gbps=50.0, restart_s=300.0)
    assert g.checkpoint_s == 40.0
    assert g.interval_s == pytest.approx(math.sqrt(2 * 40.0 * g.mtbf_s), rel=1e-12)
    # it minimises the first-order waste delta/tau + tau/(2M)
    waste = lambda tau: g.checkpoint_s / tau + tau / (2 * g.mtbf_s)  # noqa: E731
    assert waste(g.interval_s) < min(waste(0.9 * g.interval_s), waste(1.1 * g.interval_s))


def test_goodput_by_hand():
    """Llama 3's scale: 16,384 GPUs fail every 54 days / 419 = 3.09 h; a 4.87 TB checkpoint at 100 GB/s
    takes 48.7 s; tau = sqrt(2 x 48.7 x 11135) = 1041.4 s; goodput = 1041.4 / 1090.1 x (1 - (600 +
    545.05) / 11135) = 0.857; at 6 s a step: checkpoint.every_steps = 174."""
    g = goodput.goodput(16384, 4.87e12, 6.0, storage_gbps=100.0, restart_s=600.0)
    assert g.mtbf_s == pytest.approx(54 * 86400 / 419, rel=1e-12)
    assert g.interval_s == pytest.approx(1041.4, abs=0.1)
    assert g.goodput == pytest.approx(0.857, abs=0.001)
    assert g.every_steps == 174


def run_plan(*argv):
    return subprocess.run([sys.executable, "-m", "lumen_jax.plan", *argv], capture_output=True, text=True,
                          cwd=REPO, timeout=300)


def test_cli_calibration_and_goodput(found, capsys):
    """The table `--calibration` prints (here from the module's rows: the command itself, planning
    every row again, runs in `test_a_table_file_plans_as_the_built_in_rows` on a file), the goodput
    lines of a plan, and `python -m lumen_jax.plan` exiting 2 in one line (the command in a fresh
    process)."""
    from lumen_jax.plan.cli import main

    table = calibration.format_calibration(found)
    assert "published runs: geometric-mean ratio" in table and len(table.splitlines()) >= 15
    assert main(["--config", "configs/llama3_405b.yaml", "--devices", "16384", "--storage-gbps", "100"]) == 0
    out = capsys.readouterr().out
    assert "Young-Daly interval" in out and "checkpoint.every_steps=" in out
    proc = run_plan("--config", "configs/llama3_405b.yaml", "--devices", "16384", "--storage-gbps", "0")
    assert proc.returncode == 2 and proc.stderr.startswith("error: --storage-gbps=0.0 must be a positive finite number")
    assert len(proc.stderr.strip().splitlines()) == 1


# --------------------------------------------------------------------------------------------------
# Our program in the published layouts, and published runs read from a file (issue 44 part 5)
# --------------------------------------------------------------------------------------------------

def test_our_program_beside_each_row(found):
    """`ours`: our program in the row's layout. Where the row's program is ours in every planned
    respect but one (torchtitan's FSDP rows: no overlap the recipe has and we lack, no context) the
    two plans differ by that one: our cuDNN call runs its forward again under the row's remat
    policy, one attention forward per layer and token (32 x 4 x 8192 x 32 x 128 / 2, by hand), the
    rest the same FLOPs. Where the row runs sequence parallelism over tensor, ours runs the
    collective matmul (`mesh.tensor_overlap`), whose steps hide whole under (n-1)/n of the matmuls:
    faster than the recipe planned without overlap and than its async TP (31% hidden in the fit)."""
    plain = by_name(found, "torchtitan llama3.1-8b 8 GPUs")
    as_published = plain.ours_as_published
    assert as_published.attention == "cudnn" and plain.published.remat != "none"
    extra = as_published.hardware_flops_per_token - plain.plan.hardware_flops_per_token
    assert extra == pytest.approx(32 * 4 * 8192 * 32 * 128 / 2, rel=1e-9)
    assert as_published.tokens_per_s / plain.published.gpus < plain.predicted
    sync, overlapped = by_name(found, "torchtitan llama3-8b 64 GPUs TP"), by_name(found, "torchtitan llama3-8b 64 GPUs async TP")
    assert overlapped.ours_per_gpu == pytest.approx(sync.ours_per_gpu, rel=1e-12)
    assert sync.predicted < overlapped.predicted < overlapped.ours_per_gpu
    assert sync.ours.layout.mesh.tensor_overlap == "collective_matmul"
    assert plain.ours.layout.mesh.tensor_overlap == "none"  # no tensor axis
    assert all(r.ours_ratio == pytest.approx(r.ours_per_gpu / r.measured) for r in found)


def test_ours_is_our_best_fitting_setting_in_the_rows_layout(found):
    """`ours` is our program's best fitting setting of its own options on the row's mesh
    (`predict.best_setting`): the axes and pipeline schedule are the row's; every row's
    fits the device; where the row's own remat and micro-batches fit, ours is at least as fast; and a
    row's remat is not kept where memory allows less recompute: torchtitan's 70B async-TP row (full
    AC, 16 sequences in one micro-batch, 39.9 GB of 96.4 usable) runs remat none over 8 micro-batches
    of 2 sequences in 54.8 GB, 1.19x the measured (0.91x at full remat: the issue's 0.95x target met on
    this row; 16 of one sequence, 49.8 GB, 1.17x, while the planner counted the collective matmul's
    projection inputs gathered, before 2026-12-06's `memory.regathered_inputs`)."""
    for r in found:
        ours, mesh = r.ours, r.published.ours
        assert ours.fits, (r.published.name, ours.bytes_per_device["total"] / 1e9)
        assert all(getattr(ours.layout.mesh, k) == v for k, v in mesh.items()
                   if k not in ("zero_stage", "fsdp_grad_reduce", "fsdp_regather", "reduce_dtype")), r.published.name
        assert ours.layout.num_devices == r.published.gpus
        if r.ours_as_published.fits:
            assert r.ours_per_gpu >= r.ours_as_published.tokens_per_s / r.published.gpus * (1 - 1e-9), r.published.name
    titan = by_name(found, "torchtitan llama3-70b 256 GPUs async TP")
    assert titan.published.remat == "full" and titan.ours_as_published.fits
    assert (titan.ours.remat, titan.ours.layout.micro_batches, titan.ours.micro_batch) == ("none", 8, 2)
    assert titan.ours_ratio >= 0.95 > titan.as_published_ratio
    # the pipelined rows' as-published plans (ZeRO-1, the row's remat none) hold the lock-step stash
    # (issue 45) and do not fit; ZeRO-2 over fsdp 4 saving the dots fits NeMo's 405B at 0.97x (its
    # stages under SP reduce fsdp's gradients in every tick: fsdp_grad_reduce=once is not ours to pick)
    nemo405 = by_name(found, "NeMo llama3.1-405b 576 GPUs")
    assert not nemo405.ours_as_published.fits and nemo405.published.ours["zero_stage"] == 1
    assert (nemo405.ours.remat, nemo405.ours.layout.mesh.zero_stage) == ("dots_with_no_batch_dims_saveable", 2)
    assert nemo405.ours.layout.mesh.fsdp_grad_reduce == "every_micro_batch"
    assert nemo405.ours_ratio >= 0.95
    assert "our setting" in calibration.format_calibration(found)
    # Every NeMo row runs context parallelism (CP2): our best setting there takes cuDNN on the ring's
    # chunk pairs (`model.attention=cudnn`; `auto` keeps our kernel), and reaches the 0.95x;
    # with our kernel the 8B rows plan at 0.85 / 0.86x (the attention alone, docs/PLANNING.md).
    nemo = [r for r in found if r.published.name.startswith("NeMo")]
    assert len(nemo) == 6 and all(r.ours.attention == "cudnn" and r.ours_ratio >= 0.95 for r in nemo)
    assert all("attention=cudnn" in calibration.setting_of(r.ours) for r in nemo)
    eight = by_name(found, "NeMo llama3.1-8b 8 GPUs")
    flash = predict(calibration.config_of(eight.published).replace(mesh=eight.ours.layout.mesh),
                            eight.ours.layout, calibration.hardware_of(eight.published), remat=eight.ours.remat,
                            attention="auto")
    assert flash.attention == "flash" and flash.tokens_per_s / eight.published.gpus < 0.9 * eight.measured
    # Llama 3's 8,192-GPU row (63 chunk slots of residuals in the lock step): saving every projection
    # but the MLP's up (recomputed: +8% of the step's FLOPs) fits at 1.02x, where dots_saveable needs
    # ~91 GB and full plans 0.85x; with it the target holds on every row
    llama = by_name(found, "Llama 3 405b 8,192 GPUs")
    assert llama.ours.remat == "save_dot_except_mlpwi_1" and llama.ours.fits and llama.ours_ratio >= 0.95
    assert all(r.ours_ratio >= 0.95 for r in found)


def test_our_setting_is_a_config_the_trainer_takes(found):
    """Each row's chosen setting, as a config (`train.micro_batches`, `model.remat`, the mesh), passes
    the trainer's checks (`config.checks.validate`) on the row's devices. Llama 3's rows cut 126 layers into 16 stages x V=2 with `mesh.pipeline_layers` (one
    layer fewer on the first and the last device, as the paper balances them): without it the trainer
    refuses our setting (126 is not a multiple of 32); the planner plans the dearest device's 8 layers
    (2 x 4 slots, the lock step) either way."""
    from lumen_jax.config import ConfigError
    from lumen_jax.config.checks import validate

    configs = {}
    for r in found:
        cfg, plan = calibration.config_of(r.published), r.ours
        attention = "cudnn" if plan.attention == "cudnn" else cfg.model.attention  # cuDNN on the context ring: asked by name
        cfg = cfg.replace(mesh=plan.layout.mesh, train=dataclasses.replace(cfg.train, micro_batches=plan.layout.micro_batches),
                          model=dataclasses.replace(cfg.model, remat=plan.remat, attention=attention))
        validate(cfg, r.published.gpus)
        configs[r.published.name] = cfg
    llama3 = [r for r in found if r.published.name.startswith("Llama 3")]
    assert len(llama3) == 2
    for r in llama3:
        mesh, lay = r.ours.layout.mesh, r.plan.layout
        p, v = mesh.pipeline, mesh.pipeline_virtual_stages
        # virtual stage c*P + s runs on device s: 7 layers on the first and last devices, 8 on the rest
        by_device = [sum(mesh.pipeline_layers[c * p + s] for c in range(v)) for s in range(p)]
        assert by_device == [7] + [8] * 14 + [7], by_device
        assert lay.stage_layers(126) == r.ours.layout.stage_layers(126) == 8 and lay.uneven_max(126) == 4
        even = configs[r.published.name]
        even = even.replace(mesh=dataclasses.replace(even.mesh, pipeline_layers=()))
        with pytest.raises(ConfigError, match="model.num_layers=126 is not divisible"):
            validate(even, r.published.gpus)


def test_our_program_fits_nemo_8b_within_a_tenth_of_its_recipe(found):
    """Issue 44 part 4: on NeMo's 8B layouts our program (the ZeRO state over fsdp x context,
    `mesh.zero_axes`) plans at most 1.1 x the recipe's bytes, and fits the device as the recipe's
    allocator counts it; its state terms are the shards over 8 of 16 bytes per parameter."""
    for name in ("NeMo llama3.1-8b 8 GPUs", "NeMo llama3.1-8b 128 GPUs"):
        row = by_name(found, name)
        ours = row.ours.bytes_per_device
        assert row.ours.layout.mesh.zero_axes == "fsdp+context"
        assert ours["total"] <= 1.1 * row.memory.total, (name, ours["total"] / 1e9, row.memory.total / 1e9)
        assert ours["total"] <= row.usable
        params = flops.param_counts(calibration.model_of(row.published))["total"]
        # the norms' scales (65 x 4096) stay whole
        assert ours["params"] + ours["optimizer"] == pytest.approx(12 * params / 8 + 12 * 65 * 4096 * 7 / 8, rel=1e-9)


def _as_file(rows, path, fmt: str) -> None:
    """`rows` written as a user would: YAML mappings, or CSV with model names and key=value meshes."""
    import csv

    import yaml

    from lumen_jax.plan.published import MODELS

    out = []
    for r in rows:
        d = dataclasses.asdict(r)
        d["program"] = r.family
        if fmt == "csv":
            d["model"] = next(k for k, v in MODELS.items() if v == r.model)
            d["ours"] = " ".join(f"{k}={v}" for k, v in r.ours.items())
        out.append(d)
    with open(path, "w", newline="") as f:
        if fmt == "csv":
            writer = csv.DictWriter(f, fieldnames=list(out[0]))
            writer.writeheader()
            writer.writerows(out)
        else:
            yaml.safe_dump({"runs": out}, f)


@pytest.mark.parametrize("fmt", ["yaml", "csv"])
def test_a_table_file_plans_as_the_built_in_rows(found, tmp_path, capsys, fmt):
    """Three built-in rows (NeMo's 405B pipeline, MaxText on A3, torchtitan on 500 W hosts) written to
    a file and read back plan exactly as the table's, and `--calibration FILE` lists them (in this
    process, whose probes the module's rows traced: a fresh one traced them all again)."""
    from lumen_jax.plan.cli import main
    from lumen_jax.plan.published_file import read_table

    names = ("NeMo llama3.1-405b 576 GPUs", "MaxText llama2-7b 16 GPUs", "torchtitan llama3-70b 256 GPUs async TP")
    path = tmp_path / f"runs.{fmt}"
    _as_file([by_name(found, n).published for n in names], path, fmt)
    got = calibration.rows(read_table(str(path)))
    for row, name in zip(got, names):
        want = by_name(found, name)
        assert (row.predicted, row.ours_per_gpu, row.memory.total) == (want.predicted, want.ours_per_gpu,
                                                                        want.memory.total), name
    assert main(["--calibration", str(path)]) == 0
    out = capsys.readouterr().out
    assert "3 published runs" in out and str(path) in out


GOOD = dict(name="mine", model="llama3_8b", gpus=8, hardware="dgx-h100", layout="FSDP8", seq_len=8192,
            global_batch=16, micro_batches=1, remat="dots_saveable", ours={"fsdp": 8}, measured=7000.0,
            unit="tokens/s", convention="tokens", source="my cluster", program="torchtitan")


@pytest.mark.parametrize("change,message", [
    (dict(colour="red"), "run 1 (mine): unknown field 'colour'"),
    (dict(gpus=None), "run 1 (mine): field 'gpus' is missing"),
    (dict(hardware="tpu"), "hardware='tpu'; use one of dgx-h100"),
    (dict(ours={"fsdp": 4}), "spans 4 devices, not gpus=8"),
    (dict(ours={"fsdq": 8}), "run 1 (mine): "),
    (dict(model="llama9"), "model='llama9' a model name must be one of llama3_8b"),
    (dict(measured=float("nan")), "measured=nan must be a positive number"),
    (dict(program="deepspeed"), "program='deepspeed'; name the framework"),
    (dict(seq_len="long"), "seq_len='long'"),
], ids=["unknown", "missing", "hardware", "devices", "mesh-field", "model", "nan", "program", "text"])
def test_a_bad_table_file_is_one_line(tmp_path, capsys, change, message):
    """In this process (the command's own exit path, `python -m lumen_jax.plan` exiting 2 in one
    line, is `test_cli_calibration_and_goodput`'s)."""
    import yaml

    from lumen_jax.plan.cli import main

    path = tmp_path / "runs.yaml"
    with open(path, "w") as f:
        yaml.safe_dump([{k: v for k, v in {**GOOD, **change}.items() if v is not None}], f)
    assert main(["--calibration", str(path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"--calibration {path}" in lines[0] and message in lines[0], lines


def test_a_table_file_that_is_not_one(tmp_path, capsys):
    from lumen_jax.plan.cli import main

    binary, empty, bomb = tmp_path / "runs.yaml", tmp_path / "empty.csv", tmp_path / "bomb.yaml"
    binary.write_bytes(b"\xff\xfe\x00runs")
    empty.write_text("")
    bomb.write_text("a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 9)) + "runs: *a8\n")
    for path, message in ((binary, "is not a YAML or CSV table"), (empty, "must hold a list of runs"),
                          (tmp_path / "absent.yaml", "cannot read it"), (bomb, "expands to more than 100,000")):
        assert main(["--calibration", str(path)]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and message in err, err
