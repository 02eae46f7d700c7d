"""benchmarks/gpu_check.py without a GPU: its arguments, the overlap-flags hook, the verdict and the
tables, and one pass through every part with a zero budget (everything skipped, files written)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from helpers.paths import load_script
from lumen_jax.config import Config, RuntimeConfig

gpu_check = load_script("benchmarks/gpu_check.py")


def test_arguments():
    a = gpu_check.parse_args([])
    assert (a.lengths, a.head_dim, a.steps, a.impls) == ("2048,8192", 128, 30, "flash,cudnn,xla")
    dry = gpu_check.parse_args(["--dry-run"])
    assert dry.lengths == "64" and dry.steps == 2
    with pytest.raises(SystemExit) as e:
        gpu_check.parse_args(["--steps", "3", "--warmup", "3"])
    assert e.value.code == 2


def test_overlap_flags_hook():
    from lumen_jax.runtime.process import parse_flags
    assert parse_flags("--xla_a=true --xla_b=false --xla_c=4 --xla_d=x") == {
        "xla_a": True, "xla_b": False, "xla_c": 4, "xla_d": "x"}
    assert parse_flags(["--xla_a", "--xla_c=4"]) == {"xla_a": True, "xla_c": 4}

    none = gpu_check.parse_args([])
    default = gpu_check.overlap_flags(none, Config())  # runtime.xla_gpu_flags=overlap
    assert default["xla_gpu_enable_latency_hiding_scheduler"] is True
    assert default["xla_gpu_all_reduce_combine_threshold_bytes"] == 32 * 2**20
    off = Config().replace(runtime=dataclasses.replace(RuntimeConfig(), xla_gpu_flags="none"))
    assert gpu_check.overlap_flags(none, off) is None
    given = gpu_check.parse_args(["--overlap-flags=--xla_x=1"])
    assert gpu_check.overlap_flags(given, Config()) == {"xla_x": 1}


def rows(flash_ms, cudnn_ms, mfu, bf16_tps, fp8_tps):
    attention = [{"L": 8192, "B": 2, "causal": True, "impl": "flash", "mode": "fwd+bwd", "ms": flash_ms},
                 {"L": 8192, "B": 2, "causal": True, "impl": "cudnn", "mode": "fwd+bwd", "ms": cudnn_ms},
                 {"L": 2048, "B": 8, "causal": True, "impl": "cudnn", "mode": "fwd+bwd", "ms": 1.0}]
    model = [{"recipe": "none", "overlap": False, "tokens_per_s": bf16_tps, "mfu": mfu, "gemms": (0, 0)},
             {"recipe": "delayed", "overlap": False, "tokens_per_s": fp8_tps, "mfu": mfu, "gemms": (84, 84)},
             {"recipe": "current", "overlap": False, "note": "skipped (budget)"}]
    return attention, model


def test_verdict_against_the_targets():
    met = gpu_check.verdict(*rows(flash_ms=9.0, cudnn_ms=10.0, mfu=0.52, bf16_tps=1000, fp8_tps=1400))
    assert len(met) == 2
    assert "1.11x (target >= 1.0x): met" in met[0] and "52.0% (target >= 50%): met" in met[0]
    assert "1.40x (target >= 1.3x): met" in met[0] and "delayed 84 compiled" in met[1]
    missed = gpu_check.verdict(*rows(flash_ms=11.0, cudnn_ms=10.0, mfu=0.41, bf16_tps=1000, fp8_tps=1200))
    assert missed[0].count("NOT met") == 3
    assert gpu_check.verdict([], [])[0].count("not measured") == 3


def test_zero_budget_pass_writes_the_json_and_the_tables(tmp_path, capsys):
    out = str(tmp_path / "check")
    assert gpu_check.main(["--dry-run", "--budget-s", "0", "--out", out]) == 0
    result = json.load(open(out + ".json"))
    notes = {r.get("note") for r in result["attention"]} | {r.get("note") for r in result["model"]}
    assert notes == {"skipped (budget)", "n/a (GPU only)"}  # cuDNN: GPU only; the rest: no time left
    assert [r["recipe"] for r in result["model"]] == ["none", "none", "delayed", "current"]  # bf16 without and with the overlap flags
    md = open(out + ".md").read()
    assert "| L | B | causal | impl | mode |" in md and "| recipe | overlap flags |" in md and "(d) verdict" in md
    assert all(v.startswith("dry run on CPU, not a measurement") for v in result["verdict"])
