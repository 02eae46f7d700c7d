"""benchmarks/gpu_profile.py without a GPU: the per-op categories of HLO instructions, and the whole
script's `--dry-run` (every section on CPU at tiny shapes, everything under one folder)."""

from __future__ import annotations

import json
import os

import pytest

from helpers.paths import load_script
from lumen_jax.compiler import hlo

gpu_profile = load_script("benchmarks/gpu_profile.py")

# A compiled module's text, cut down: one instruction of each kind the table sorts, and the stack
# frame tables that say where an op came from (frame 2: ops/loss.py called from train/step.py).
HLO = """HloModule jit_step, is_scheduled=true

FileNames
1 "/x/lumen_jax/train/step.py"
2 "/x/lumen_jax/ops/loss.py"
3 "/x/site-packages/optax/_src/transform.py"

FileLocations
1 {file_name_id=1 function_name_id=1 line=1 end_line=1 column=1 end_column=2}
2 {file_name_id=2 function_name_id=1 line=1 end_line=1 column=1 end_column=2}
3 {file_name_id=3 function_name_id=1 line=1 end_line=1 column=1 end_column=2}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=1}
3 {file_location_id=3 parent_frame_id=1}

%gemm_fusion (p0: bf16[8,16], p1: bf16[16,4]) -> f32[8,4] {
  %p0 = bf16[8,16]{1,0} parameter(0)
  %p1 = bf16[16,4]{1,0} parameter(1)
  ROOT %dot.1 = f32[8,4]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%loss_fusion (q0: f32[8,4]) -> f32[8] {
  %q0 = f32[8,4]{1,0} parameter(0)
  ROOT %reduce.2 = f32[8]{0} reduce(%q0), dimensions={1}, metadata={op_name="x" stack_frame_id=2}
}

ENTRY %main (a: bf16[8,16], b: bf16[16,4], c: f8e4m3fn[8,16], d: f8e4m3fn[16,4]) -> f32[8] {
  %a = bf16[8,16]{1,0} parameter(0)
  %b = bf16[16,4]{1,0} parameter(1)
  %c = f8e4m3fn[8,16]{1,0} parameter(2)
  %d = f8e4m3fn[16,4]{1,0} parameter(3)
  %fusion.1 = f32[8,4]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm_fusion
  %dot.9 = f32[8,4]{1,0} dot(%c, %d), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %custom-call.1 = bf16[8,16]{1,0} custom-call(%a), custom_call_target="__gpu$xla.gpu.triton", backend_config={name = "flash_bwd_dq"}
  %custom-call.2 = (bf16[8,16]{1,0}) custom-call(%a), custom_call_target="__cudnn$fmhaSoftmaxBackward"
  %fusion.2 = f32[8]{0} fusion(%fusion.1), kind=kLoop, calls=%loss_fusion
  %add.3 = f32[8]{0} add(%fusion.2, %fusion.2), metadata={op_name="y" stack_frame_id=3}
  ROOT %multiply.4 = f32[8]{0} multiply(%add.3, %add.3)
}
"""


def test_instructions_are_sorted_into_the_table_categories():
    module = hlo.parse(HLO)
    by_key = {(i.computation, i.name): i for i in module.instrs}
    by_computation: dict = {}
    for i in module.instrs:
        by_computation.setdefault(i.computation, []).append(i)
    files = gpu_profile.stack_files(HLO)
    assert files["2"] == "/x/lumen_jax/ops/loss.py /x/lumen_jax/train/step.py"
    got = {i.name: gpu_profile.categorize(i, by_computation, by_key, files)
           for i in module.instrs if i.computation == "main" and i.op != "parameter"}
    assert got == {"fusion.1": "GEMM bf16", "dot.9": "GEMM fp8", "custom-call.1": "attention dQ",
                   "custom-call.2": "attention backward (cuDNN)", "fusion.2": "loss", "add.3": "optimizer",
                   "multiply.4": "elementwise"}
    assert set(got.values()) <= set(gpu_profile.CATEGORIES)


@pytest.mark.heavy  # 27 s cold on this 2-core machine (10 s warm): near the 30 s line, and the cores are shared
def test_dry_run_runs_every_section_and_writes_one_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    out = str(tmp_path / "profile")
    assert gpu_profile.main(["--dry-run", "--out", out, "--head-dims", "64"]) == 0
    with open(os.path.join(out, "profile.json")) as f:
        result = json.load(f)
    assert result["header"]["dry_run"] and result["nvidia_smi_before"] == {"skipped": "dry run"}
    steps = result["steps"]
    for variant in ("auto", "flash", "xla"):
        assert steps[variant]["tokens_per_s"] > 0, steps[variant]
    # cuDNN does not run on CPU: its rows hold the one-line config error, and the rest went on.
    assert steps["cudnn"]["error"].startswith("ConfigError: model.attention=cudnn: cuDNN runs on GPU")
    for name in ("auto", "fp8"):
        table = (steps["auto"] if name == "auto" else result["fp8"])["op_table"]
        found = {c["category"] for c in table["categories"]}
        assert {"loss", "optimizer", "elementwise"} <= found and any(c.startswith("GEMM") for c in found), table
    attention = {(r["segment_ids"], r["impl"]): r for r in result["attention"]}
    assert set(attention) == {(s, i) for s in (False, True) for i in ("flash", "cudnn")}
    assert all(attention[(s, "flash")]["error"] < 1e-2 and attention[(s, "flash")]["fwd+bwd_ms"] > 0 for s in (False, True))
    assert "ConfigError" in attention[(True, "cudnn")]["note"]
    pairs = {r["impl"]: r for r in result["ring_pairs"]}
    assert pairs["xla"]["fwd+bwd_ms"] > 0 and "ConfigError" in pairs["cudnn"]["note"]  # cuDNN's pairs: GPU only
    assert [r["tiles"] for r in result["sweep"]][0] == "default" and all("fwd+bwd_ms" in r for r in result["sweep"])
    for trace in ("trace-bf16", "trace-fp8-delayed"):
        files = [f for _, _, fs in os.walk(os.path.join(out, trace)) for f in fs]
        assert "step.hlo.txt" in files and any(f.endswith(".xplane.pb") for f in files), files
    with open(os.path.join(out, "profile.md")) as f:
        md = f.read()
    assert "## Per op, bf16 auto" in md and "## Attention alone" in md and "## Tile sweep" in md
    assert "## Context ring's chunk pairs" in md
