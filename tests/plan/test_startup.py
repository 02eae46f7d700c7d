"""`plan.startup.at_start`: the one call the trainer makes to the planner when a run starts."""

from __future__ import annotations

import os

import pytest

from lumen_jax.config import ConfigError
from lumen_jax.config.files import load_config
from lumen_jax.ops.choice import Ops
from lumen_jax.plan import startup
from lumen_jax.plan.hardware import DEVICES, layout_from_config
from lumen_jax.plan.predict import predict

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_MOE = os.path.join(REPO, "configs", "tiny_moe.yaml")


def test_the_bytes_are_the_plans_of_the_backend_the_ops_chose():
    """An MoE run: the padded exchange (CPU) and the ragged one (GPU) plan different dispatch buffers;
    `at_start` plans the one its `Ops` runs, as `predict` does given that backend by hand."""
    cfg = load_config(TINY_MOE, ["mesh.expert=4", "mesh.fsdp=2"])
    shape = {"data": 1, "fsdp": 2, "pipeline": 1, "expert": 4, "context": 1, "tensor": 1}
    layout = layout_from_config(cfg, 8)
    for ops, backend in ((Ops(), "cpu"), (Ops(moe_exchange="ragged", moe_matmul="ragged"), "gpu")):
        got = startup.at_start(cfg, shape, ops, device_bytes=None)
        want = predict(cfg, layout, DEVICES["h100"], attention="xla", moe_backend=backend).bytes_per_device
        assert got.error == "" and got.bytes_per_device == want, backend
    cpu, gpu = (startup.at_start(cfg, shape, ops, None).bytes_per_device["activations"]
                for ops in (Ops(), Ops(moe_exchange="ragged")))
    assert cpu != gpu
    assert startup.at_start(cfg, shape, Ops(), None, plan_bytes=False).bytes_per_device is None


def test_kept_weights_beyond_the_device_are_refused_and_a_planner_failure_is_reported(monkeypatch):
    cfg = load_config(os.path.join(REPO, "configs", "llama3_70b.yaml"), ["mesh.fsdp_regather=per_step"])
    shape = {"data": 1, "fsdp": 128, "pipeline": 1, "expert": 1, "context": 1, "tensor": 8}
    with pytest.raises(ConfigError, match=r"mesh.fsdp_regather=per_step keeps .* device's 10.0 GB"):
        startup.at_start(cfg, shape, Ops(), device_bytes=10e9, plan_bytes=False)
    assert startup.at_start(cfg, shape, Ops(), device_bytes=80e9, plan_bytes=False).bytes_per_device is None
    # A planner limitation does not stop the run: the start-up line says why, in one line.
    def limited(*_, **__):
        raise NotImplementedError("no model of\nthis layout")

    monkeypatch.setattr(startup, "predict", limited)
    got = startup.at_start(cfg, shape, Ops(), device_bytes=None)
    assert got == startup.AtStart(None, "NotImplementedError: no model of this layout")


def test_a_run_planned_far_past_the_memory_is_refused_unless_the_check_is_off():
    planned = startup.AtStart({"params": 3 * 2**30, "activations": 2**30, "total": 4 * 2**30})
    gpu = (1.5 * 2**30, "the H100 memory")
    with pytest.raises(ConfigError, match=r"puts this run at 4 GiB per device \(state 3 \+ activations 1\), over "
                                          r"2x the H100 memory \(1.5 GiB\).*runtime.memory_check=off"):
        startup.refuse_oversized(planned, gpu, "refuse")
    startup.refuse_oversized(planned, gpu, "off")
    startup.refuse_oversized(planned, (2 * 2**30, "the H100 memory"), "refuse")  # within 2x: the compile decides
    startup.refuse_oversized(startup.AtStart(None, "no plan"), gpu, "refuse")
    startup.refuse_oversized(planned, None, "refuse")  # memory unknown
