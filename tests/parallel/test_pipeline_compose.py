"""Pipeline stages with mixture-of-experts layers (expert, tensor and data parallelism inside the
stages; with fsdp: tests/model/test_deepseek.py) and with fp8's delayed-scaling state: losses,
gradients, metrics and model state against the same model without a pipeline; sequence parallelism
with `data` manual in the stages."""

import dataclasses

import jax
import numpy as np
import pytest

from helpers.run import BASE, STEPS, assert_same_run, batches, devices_for, fp8_run, moe_config, run, with_mesh
from helpers.tolerances import FP32_RTOL, FP8_STEPS_RTOL, assert_tree_close
from lumen_jax.config import ConfigError, Fp8Config, MoeConfig
from lumen_jax.config.checks import validate

M = 4  # micro-batches


@pytest.mark.heavy
def test_moe_in_stages_matches_one_device():
    """pipeline=2 x expert=2 x tensor=2, an MoE layer every 2 (the aux loss): two stacks (dense, MoE)
    cut into stages, EP and TP in a stage. Losses, grad norms, the gradients before and after 3 steps,
    and the `moe/...` metrics (the aux loss's share of the gradient flows back with the stage's
    cotangent). An MoE stage's cotangent takes the dense stages' ppermute: four stages are
    test_pipeline.py's (and, MoE, the compiled program of test_pipeline_work's moe-pipeline4-expert2);
    gpipe's table is the stages' own. Every layer MoE with the selection bias (the model state) in
    stages: tests/model/test_deepseek.py on pipeline=2 x fsdp=2 x expert=2 under zero_bubble (the
    model state after 3 steps), test_pipeline_uneven.py's n1-[1,2]-ep2 (and the `moe/...` metrics),
    and the replica groups' case below; model state through interleaved's virtual stages: the fp8
    case below."""
    cfg = with_mesh(moe_config(4, 2), micro_batches=M, pipeline=2, expert=2, tensor=2, pipeline_schedule="1f1b")
    validate(cfg, len(devices_for(cfg)))
    got, ref = run(cfg, devices_for(cfg)), run(with_mesh(moe_config(4, 2), micro_batches=M), jax.devices()[:1])
    assert_same_run(got, ref, "MoE every 2 pp2 ep2 tp2")
    assert not ref["model_state"] and not got["model_state"]  # the aux loss: no model state
    for step in range(STEPS):
        for key in (k for k in ref["metrics"][step] if k.startswith("moe/")):
            np.testing.assert_allclose(got["metrics"][step][key], ref["metrics"][step][key], rtol=FP32_RTOL,
                                       atol=1e-7, err_msg=f"{key} step {step}")


@pytest.mark.heavy
@pytest.mark.parametrize("every_n,schedule", [(1, "zero_bubble")])
def test_moe_in_stages_with_replica_groups_matches_unpipelined(every_n, schedule):
    """pipeline=2 x expert=2 x data=2 under the replica vmap (one data reduction per step) against the
    unpipelined step on the same replica groups: each group routes and drops its own tokens (the
    experts' capacity is per group; one device differs from data=2 by 7e-5 in the loss of step 2,
    pipelined or not), so data=2 is compared with data=2. zero_bubble: the experts' split backward
    (their taps one block per device, the replica axes the vmap's) under the replica vmap, whose
    forward and B units are 1f1b's (1f1b's table under the replica vmap: test_pipeline.py)."""
    flat = with_mesh(moe_config(4, every_n), micro_batches=M, expert=2, data=2)
    ref = run(flat, devices_for(flat))
    cfg = with_mesh(moe_config(4, every_n), micro_batches=M, pipeline=2, expert=2, data=2, pipeline_schedule=schedule)
    got = run(cfg, devices_for(cfg))
    assert_same_run(got, ref, f"MoE every {every_n} pp2 ep2 dp2 {schedule}")
    assert_tree_close(got["model_state"], ref["model_state"], FP32_RTOL, what="MoE model state ")
    for step in range(STEPS):
        for key in (k for k in ref["metrics"][step] if k.startswith("moe/")):
            np.testing.assert_allclose(got["metrics"][step][key], ref["metrics"][step][key], rtol=FP32_RTOL,
                                       atol=1e-7, err_msg=f"{key} step {step}")


FP8 = BASE.replace(model=dataclasses.replace(BASE.model, num_layers=4, fp8=Fp8Config(
    recipe="delayed", amax_history=4, keep_bf16=("first", "last"))))


@pytest.fixture(scope="module")
def fp8_reference():
    return fp8_run(with_mesh(FP8, micro_batches=M, data=2))


@pytest.mark.heavy
@pytest.mark.parametrize("schedule", ["zero_bubble", "interleaved"], ids=["pp2-data2-zero_bubble", "pp2-data2-interleaved"])
def test_fp8_delayed_state_travels_through_stages(fp8_reference, schedule):
    """The amax histories after a step (every projection's x, w and g, each stage's layers, the max
    over micro-batches and replica groups) and the gradients equal the unpipelined run's on the same
    replica groups (each group's first-step scale is its own amax, so data=2 is compared with data=2).
    keep_bf16: the first layer (stage 0's slot 0) and the last (stage 1's slot 1) in the compute
    dtype, the other stage's layer in that slot in fp8 (`Ops.stage_runs`); their histories stay 0.
    (Every layer in fp8, 1f1b, one replica group: test_pipeline_uneven's fp8 test.)"""
    got = fp8_run(with_mesh(FP8, micro_batches=M, data=2, pipeline=2, pipeline_schedule=schedule,
                            pipeline_virtual_stages=2 if schedule == "interleaved" else 1))
    ref = fp8_reference
    assert_tree_close(got["grads"], ref["grads"], FP32_RTOL, what="fp8 first grads ")
    assert_tree_close(got["states"][0], ref["states"][0], FP32_RTOL, what="fp8 state after one step ")
    q_x = got["states"][-1]["blocks"]["attn"]["projections"]["q"]["x"]
    kept = [0, q_x.shape[0] - 1]
    assert np.abs(np.delete(q_x, kept, axis=0)[:, :STEPS]).min() > 0 and not q_x[kept].any()  # histories fill
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=FP8_STEPS_RTOL)


@pytest.mark.parametrize("changes,message", [
    (dict(moe=MoeConfig(num_experts=4, every_n_layers=2)),
     "model.num_layers=4 with model.moe.every_n_layers=2 makes 2 groups"),
])
def test_config_errors(changes, message):
    cfg = with_mesh(BASE.replace(model=dataclasses.replace(BASE.model, num_layers=4, **changes)), micro_batches=M,
                    pipeline=4 if "moe" in changes else 2, pipeline_schedule="1f1b")
    with pytest.raises(ConfigError) as e:
        validate(cfg, 4 if "moe" in changes else 2)
    assert str(e.value).startswith(message), str(e.value)


# 8 layers, 4 micro-batches: the one-device reference is test_pipeline.py's (the same program)
EIGHT_LAYERS = BASE.replace(model=dataclasses.replace(BASE.model, num_layers=8))


@pytest.fixture(scope="module")
def sp_data_manual():
    """pipeline=2 x data=2 x tensor=2 with sequence parallelism, interleaved: the run (its compiled step
    is read by the logits test too)."""
    cfg = with_mesh(EIGHT_LAYERS, micro_batches=M, pipeline=2, tensor=2, sequence_parallel=True, data=2,
                    pipeline_schedule="interleaved", pipeline_virtual_stages=2)
    return cfg, run(cfg, jax.devices())


@pytest.mark.heavy
def test_last_stage_loss_keeps_the_logits_sharded_over_vocab(sp_data_manual):
    """With tensor parallelism the logits are split over `vocab`; the stages' cross-entropy reduces
    each device's slice and adds the partial sums, so no [rows, tokens, vocab] array is gathered.
    Read off the compiled step of the sequence-parallel case below (one compile for both)."""
    import re

    cfg, got = sp_data_manual
    trainer = got["trainer"]
    hlo = trainer.step_and_grads.lower(got["state"], trainer.shard_batch(batches(cfg)[0])).compile().as_text()
    vocab = cfg.model.vocab_size
    gathered = [m for m in re.findall(r"= f32\[([\d,]+)\][^=]*? all-gather\(", hlo)
                if len(m.split(",")) >= 3 and int(m.split(",")[-1]) == vocab]
    assert not gathered, f"all-gathers of logits over the vocabulary: {gathered}"
    assert re.search(r"all-gather\(", hlo)  # the regex sees the step's gathers (sequence parallelism's)


@pytest.mark.heavy
def test_sequence_parallel_with_replica_groups_equals_one_device(sp_data_manual):
    """Sequence parallelism with data replica groups under a pipeline: XLA's SPMD partitioner stops the
    process (a check failure) on the replica vmap's ticks, so these stages run with `data` manual in
    their shard_map instead, each device ticking on its own rows (executor.py); losses, grad norms and
    gradients are one device's. Interleaved (virtual stages, the wrap); `data` manual is the same
    branch under every schedule, and the schedules' units with an axis manual in the stages are
    test_pipeline.py's context2-tensor2-sp-zero_bubble (zero_bubble) and its MoE test with context
    manual (1f1b). (tests/parallel/test_communication.py: the gradients cross `data` once.)"""
    cfg, got = sp_data_manual
    ref = run(with_mesh(EIGHT_LAYERS, micro_batches=M), jax.devices()[:1])
    assert_same_run(got, ref, "pipeline=2 data=2 tensor=2 SP interleaved")
