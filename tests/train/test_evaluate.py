"""train.init_from and evaluation: a run started from imported weights logs, at its first step, the loss
`evaluate` gives those weights on the same batch; `train.eval_every` logs what `evaluate` gives the
checkpoint of that step; the bad inputs are one line."""

import dataclasses
import math
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

import yaml

from helpers import hf
from helpers.faults import snapshot
from helpers.metrics import read_metrics
from helpers.paths import REPO
from helpers.tolerances import FP32_RTOL
from lumen_jax.checkpoint import weights
from lumen_jax.train import init_from as init_from_lib
from lumen_jax.config import ConfigError, to_dict
from lumen_jax.config.checks import validate
from lumen_jax.config.files import load_config
from lumen_jax.train.evaluate import evaluate, main as evaluate_cli
from lumen_jax.model import abstract_model

DATA = {"builtin_max_bytes": 300_000, "seq_len": 32, "global_batch_size": 8, "eval_share": 0.25}


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    return hf.imported(str(tmp_path_factory.mktemp("eval")), tied=True, name="imported")


@pytest.mark.heavy
def test_init_from_first_loss_and_eval_every_equal_evaluate(imported, tmp_path):
    hf_dir, source = imported
    raw = to_dict(weights.read_config(source, 0))
    run_dir = str(tmp_path / "run")
    raw["data"].update(DATA)
    raw["train"].update(steps=2, init_from=source, eval_every=2, eval_batches=2, run_dir=run_dir)
    raw["optim"].update(lr=1e-3, warmup_steps=0)
    raw["checkpoint"]["every_steps"] = 2
    raw["log"].update(every_steps=1, tensorboard=False, progress=False)
    raw["runtime"]["cpu_devices"] = 8
    config = tmp_path / "finetune.yaml"
    config.write_text(yaml.safe_dump({k: v for k, v in raw.items() if k != "name"}))
    proc = subprocess.run([sys.executable, "-m", "lumen_jax.train", "--config", str(config)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logged = {m["step"]: m for m in read_metrics(run_dir)}
    assert sorted(logged) == [1, 2] and "eval_loss" not in logged[1]

    overrides = [f"data.{k}={v}" for k, v in DATA.items()]
    first = evaluate(source, None, "train", 1, overrides)  # the imported weights on the first training batch
    np.testing.assert_allclose(logged[1]["loss"], first["eval_loss"], rtol=FP32_RTOL)
    held_out = evaluate(run_dir, 2, "eval", 2)
    np.testing.assert_allclose(logged[2]["eval_loss"], held_out["eval_loss"], rtol=FP32_RTOL)
    np.testing.assert_allclose(logged[2]["eval_ppl"], math.exp(logged[2]["eval_loss"]), rtol=FP32_RTOL)
    assert held_out["eval_tokens"] > 0

    # The Hugging Face directory itself, converted on the fly, gives the same first loss.
    abstract = weights.load_onto_mesh(source, None).params
    for x, y in zip(jax.tree.leaves(init_from_lib.init_from(hf_dir, abstract)),
                    jax.tree.leaves(init_from_lib.init_from(source, abstract))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_bad_inputs_are_one_line(imported, tmp_path, capsys):
    hf_dir, source = imported
    model = weights.read_config(source, 0).model
    wider = abstract_model(dataclasses.replace(model, ffn_dim=64)).params
    for path in (source, hf_dir):
        with pytest.raises(ConfigError, match=r"parameter blocks/mlp/w_down has shape \(2, 48, 32\), the config "
                                              r"needs \(2, 64, 32\)"):
            init_from_lib.init_from(path, wider)
    with pytest.raises(ConfigError, match="holds imported weights, not a training run"):
        weights.refuse_weights_only(source)
    for overrides, expected in (
            (["train.eval_every=5"], "train.eval_every=5 needs held-out data"),
            (["train.init_from=/nonexistent"], "train.init_from='/nonexistent' is not a directory")):
        with pytest.raises(ConfigError, match=expected):
            validate(load_config(None, overrides), 8)
    for args, expected in ((["--step", "3"], "--step=3"), (["optim.lr=1"], "only mesh.*, data.* and runtime.cpu_devices"),
                           (["--batches", "0"], "--batches=0"),
                           (["--data", str(tmp_path / "none*.txt")], "matches no files")):
        assert evaluate_cli(["--run-dir", source, *args]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and expected in err, (args, err)


def test_a_batch_too_big_for_memory_and_no_held_out_data_are_one_line(imported, capfd):
    _, source = imported
    before = snapshot(source)
    capfd.readouterr()
    # 1 x 300000 tokens: the reference attention's [heads, T, T] scores alone are 1.4 TB.
    assert evaluate_cli(["--run-dir", source, "--data", "train", "--batches", "1", "mesh.fsdp=1",
                         "data.global_batch_size=1", "data.seq_len=300000"]) == 2
    err = capfd.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert re.match(r"error: evaluating a batch of 1 x 300000 tokens needs \d+\.\d GiB per device, more than "
                    r"the host's available memory shared by 1 CPU device\(s\) \(\d+\.\d GiB\); lower data.seq_len", err), err
    assert evaluate_cli(["--run-dir", source, "--batches", "1"]) == 2  # it holds nothing out
    err = capfd.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "holds no documents out" in err and "--data train" in err, err
    assert snapshot(source) == before


def test_held_out_share_is_disjoint_from_training():
    from lumen_jax.data.sources import HeldOut

    docs = [f"document {i}" for i in range(400)]
    held, kept = HeldOut(docs, 0.25, held_out=True), HeldOut(docs, 0.25, held_out=False)
    held_docs, kept_docs = {held[i] for i in range(len(held))}, {kept[i] for i in range(len(kept))}
    assert not held_docs & kept_docs and held_docs | kept_docs == set(docs)
    assert 60 < len(held) < 140  # about a quarter
