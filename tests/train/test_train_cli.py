"""`python -m lumen_jax.train` end to end: training runs and bad-input exits in subprocesses (the
command's own exit; the table of bad inputs in process: tests/train/test_bad_inputs.py)."""

import glob
import json
import math
import os
import subprocess
import sys

import pytest

from helpers.faults import IN_PROCESS
from helpers.metrics import read_metrics
from helpers.paths import REPO
from lumen_jax.config import ConfigError
from lumen_jax.config.checks import validate
from lumen_jax.config.files import load_config
from lumen_jax.train import cli as train_cli

TIMEOUT_S = 120
EXIT_BAD_INPUT = 2
METRIC_KEYS = ("step", "loss", "grad_norm", "lr", "tokens_per_sec", "tokens_per_sec_per_device",
               "tflops_per_device", "mfu", "hfu", "loop_time_s", "step_time_s", "data_wait_s", "checkpoint_stall_s",
               "host_overhead_s")


def train(config: str, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lumen_jax.train", "--config", config, *overrides],
                          cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.heavy
@pytest.mark.parametrize("mesh", [["mesh.fsdp=4", "mesh.tensor=2", "model.attention=auto"]],
                         ids=["fsdp=4,tensor=2,auto"])
def test_tiny_yaml_trains(tmp_path, mesh):
    """40 steps on a mesh with two axes: the loss falls, every metric is written. (tiny.yaml's own
    fsdp=8 is the run test_tiny_gin_trains starts.)"""
    run_dir = str(tmp_path / "run")
    proc = train("configs/tiny.yaml", "train.steps=40", "log.every_steps=10", f"train.run_dir={run_dir}", *mesh)
    assert_ok(proc)
    assert "done: step 40" in proc.stdout
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [10, 20, 30, 40]
    for r in rows:
        missing = [k for k in METRIC_KEYS if k not in r]
        assert not missing, f"step {r['step']} lacks {missing}"
        for k in METRIC_KEYS:
            assert isinstance(r[k], (int, float)) and math.isfinite(r[k]) and r[k] >= 0, (k, r[k])
        assert r["tokens_per_sec"] > 0 and r["step_time_s"] > 0 and 0 < r["mfu"] <= r["hfu"]
        assert r["tokens_per_sec_per_device"] * 8 == pytest.approx(r["tokens_per_sec"], rel=1e-9)
        assert r["skipped"] == 0
    assert rows[-1]["loss"] < 0.8 * rows[0]["loss"], [r["loss"] for r in rows]
    events = glob.glob(os.path.join(run_dir, "events.out.tfevents.*"))
    assert events, os.listdir(run_dir)
    with open(events[0], "rb") as f:
        content = f.read()
    assert b"loss" in content and b"mfu" in content  # scalar tags were written
    with open(os.path.join(run_dir, "config.json"), encoding="utf-8") as f:
        saved = json.load(f)
    assert saved["train"]["steps"] == 40 and saved["name"] == "tiny"
    assert "mesh data=1 fsdp=4 pipeline=1 expert=1 context=1 tensor=2" in proc.stdout
    # auto is resolved once, when the step is built, and the start-up line says how
    assert "attention=auto: xla (cudnn and flash run on GPU; this is cpu)" in proc.stdout, proc.stdout


@pytest.mark.heavy
def test_tiny_gin_trains(tmp_path):
    """configs/tiny.gin: tiny.yaml's run (fsdp=8, the attention asked for by name: no auto line)."""
    run_dir = str(tmp_path / "run")
    proc = train("configs/tiny.gin", "train.steps=3", "log.every_steps=1", "log.progress=false",
                 f"train.run_dir={run_dir}")
    assert_ok(proc)
    assert "done: step 3" in proc.stdout
    assert "mesh data=1 fsdp=8 pipeline=1 expert=1 context=1 tensor=1" in proc.stdout
    assert "attention=auto" not in proc.stdout
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in rows)
    with open(os.path.join(run_dir, "config.json"), encoding="utf-8") as f:
        assert json.load(f)["name"] == "tiny"


# The command itself (`python -m lumen_jax.train`: the exit status, one line, no traceback). Every other
# bad input, and these two, through `train.cli.main` in process: tests/train/test_bad_inputs.py (a corrupt
# data file below: it is found at the first read, before anything is written in the run directory).
BAD_INPUTS = {
    # name: (overrides, fragments the one-line message must contain)
    "unknown key": (["model.d_modle=1"], ["model.d_modle", "did you mean model.d_model"]),
    "wrong type": (["model.d_model=abc"], ["model.d_model", "must be an int"]),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_exits_2_with_one_line(tmp_path, name):
    overrides, fragments = BAD_INPUTS[name]
    proc = train("configs/tiny.yaml", f"train.run_dir={tmp_path / 'run'}", *overrides)
    assert proc.returncode == EXIT_BAD_INPUT, f"exit {proc.returncode}\nstderr:\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert not os.path.exists(os.path.join(tmp_path, "run", "metrics.jsonl"))


def test_a_corrupt_jsonl_line_exits_2_with_one_line_and_no_metrics(tmp_path, capsys):
    """In process (was a subprocess: the exit is the command's as above). The run directory it would have
    made is left absent."""
    path = tmp_path / "corpus.jsonl"
    path.write_text('{"text": "a fine document"}\n{"text": "a broken one\n{"text": "another"}\n')
    rc = train_cli.main(["--config", os.path.join(REPO, "configs/tiny.yaml"), f"train.run_dir={tmp_path / 'run'}",
                         "data.source=files", f"data.paths=[{path}]", *IN_PROCESS])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == EXIT_BAD_INPUT
    assert len(lines) == 1 and lines[0].startswith(f"error: data file {path} line 2: not valid JSON"), lines
    assert not os.path.exists(tmp_path / "run"), os.listdir(tmp_path / "run")  # no config.json, events, checkpoints/


def test_mesh_error_names_the_axis_that_was_set():
    # An actionable error names the key the user set (`mesh.tensor=3 ...`, docs/CONFIGURATION.md's example); in-process.
    cfg = load_config(os.path.join(REPO, "configs/tiny.yaml"), ["mesh.tensor=3"])
    with pytest.raises(ConfigError) as e:
        validate(cfg, 8)
    assert "mesh.tensor=3" in str(e.value), str(e.value)


def test_vocab_smaller_than_the_tokenizer_exits_2_before_anything_is_written(tmp_path, capsys):
    """In process: the check runs after the data is opened, before the run directory is made."""
    run_dir = tmp_path / "run"
    rc = train_cli.main(["--config", os.path.join(REPO, "configs/tiny.yaml"), f"train.run_dir={run_dir}",
                         "model.vocab_size=200", "train.steps=1", "optim.warmup_steps=0", "runtime.cpu_devices=0",
                         "runtime.compilation_cache_dir=", "log.progress=false"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == EXIT_BAD_INPUT
    assert err == ["error: model.vocab_size=200 is smaller than the tokenizer's vocabulary (259, "
                   "data.tokenizer='byte'); set model.vocab_size>=259"], err  # 256 bytes + 3 special
    assert not run_dir.exists() or not any(run_dir.iterdir())  # (rundir.prepare may have made it, empty)
