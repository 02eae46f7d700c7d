"""Any pipeline depth with any sequence length (issue 44 part 3): the stages share the last stage's
loss by tokens, every P-th token of each context device's run, padded to a multiple of P (the padded
positions carry no loss), so `data.seq_len` need not divide by `mesh.pipeline` (NeMo's 405B recipe
runs PP 9 at 8k). Losses, grad norms and gradients against one device; the train CLI's bubble and
HFU/MFU of a pipelined run."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from helpers.paths import REPO
from helpers.run import BASE, assert_same_run, run, with_mesh
from helpers.tolerances import FP32_RTOL
from lumen_jax.config import from_dict
from lumen_jax.metrics import flops


def _cfg(seq_len: int, layers: int, micro_batches: int, **mesh):
    cfg = BASE.replace(model=dataclasses.replace(BASE.model, num_layers=layers),
                       data=dataclasses.replace(BASE.data, seq_len=seq_len))
    return with_mesh(cfg, micro_batches=micro_batches, **mesh)


# Without context, 1f1b: the nine-stage run below (40 tokens over 9 stages, 5 positions of the loss
# on the first 4, 4 on the others; losses and grad norms); the padded positions' gradients: this case.
CASES = {
    # 44 tokens over context 2 (zigzag): 22 per device, not a multiple of 3
    "pipeline3-context2-seq44-zero_bubble": (44, dict(pipeline=3, context=2, pipeline_schedule="zero_bubble")),
}


@pytest.mark.heavy
@pytest.mark.parametrize("name", list(CASES))
def test_pipeline_depth_that_does_not_divide_the_sequence(name):
    seq_len, mesh = CASES[name]
    devices = int(np.prod(list(v for v in mesh.values() if isinstance(v, int))))
    got = run(_cfg(seq_len, 3, 4, **mesh), jax.devices()[:devices])
    ref = run(_cfg(seq_len, 3, 4), jax.devices()[:1])
    assert_same_run(got, ref, name)


def _train(tmp_path, name: str, *overrides: str) -> list[dict]:
    run_dir = tmp_path / name
    cmd = [sys.executable, "-m", "lumen_jax.train", "--config", "configs/tiny.yaml", "mesh.fsdp=1",
           "model.num_layers=9", "data.seq_len=40", "data.global_batch_size=9", "train.micro_batches=9",
           "train.steps=3", "log.every_steps=1", "checkpoint.every_steps=0", f"train.run_dir={run_dir}", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "loss" in r]


@pytest.mark.heavy
def test_nine_stages_at_a_sequence_length_nine_does_not_divide(tmp_path):
    """pipeline=9 (9 emulated devices, as a user types it) on 40 tokens: the losses and grad norms
    of 3 steps equal one device's. The train CLI reports the bubble, and no stage forward is
    recomputed: HFU/MFU is the remat policy's ratio, as without a pipeline."""
    nine = _train(tmp_path, "nine", "runtime.cpu_devices=9", "mesh.pipeline=9")
    one = _train(tmp_path, "one", "runtime.cpu_devices=1")
    assert len(nine) == len(one) == 3
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in nine], [r[key] for r in one], rtol=FP32_RTOL, err_msg=key)
    assert [r["pipeline_bubble"] for r in nine] == [pytest.approx(8 / 17)] * 3  # 1f1b's (P-1)/(m+P-1), P=m=9
    with open(os.path.join(tmp_path, "nine", "config.json"), encoding="utf-8") as f:
        cfg = from_dict(json.load(f))
    model, seq = cfg.model, cfg.data.seq_len
    ratio = flops.hardware_flops_per_token(model, seq) / flops.flops_per_token(model, seq)
    assert [r["hfu"] / r["mfu"] for r in nine] == [pytest.approx(ratio, rel=1e-6)] * 3
