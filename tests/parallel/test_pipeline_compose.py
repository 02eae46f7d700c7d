"""Pipeline stages with mixture-of-experts layers (expert, tensor, fsdp and data parallelism inside
the stages) and with fp8's delayed-scaling state: losses, gradients, metrics and model state against
the same model without a pipeline."""

import dataclasses

import jax
import numpy as np
import pytest

from helpers.run import BASE, STEPS, assert_same_run, batches, devices_for, fp8_run, moe_config, run, with_mesh
from helpers.tolerances import FP32_RTOL, FP8_STEPS_RTOL, assert_tree_close
from lumen_jax.config import ConfigError, Fp8Config, MeshConfig, MoeConfig
from lumen_jax.config.checks import validate
from lumen_jax.parallel.mesh import make_mesh
from lumen_jax.train.build import build

M = 4  # micro-batches


@pytest.fixture(scope="module")
def moe_reference():
    return {n: run(with_mesh(moe_config(4, n), micro_batches=M), jax.devices()[:1]) for n in (1, 2)}


@pytest.mark.heavy
@pytest.mark.parametrize("every_n,mesh", [
    (2, dict(pipeline=2, expert=2, tensor=2)),  # two stacks (dense, MoE) cut into stages; EP and TP in a stage
    (1, dict(pipeline=2, expert=2, fsdp=2, pipeline_schedule="zero_bubble")),
    (1, dict(pipeline=2, expert=2, pipeline_schedule="interleaved", pipeline_virtual_stages=2)),
], ids=["n2-pp2-ep2-tp2", "n1-pp2-ep2-fsdp2-zero_bubble", "n1-pp2-ep2-interleaved"])
def test_moe_in_stages_matches_one_device(moe_reference, every_n, mesh):
    """Losses, grad norms, the gradients before and after 3 steps, and the `moe/...` metrics (the aux
    loss's share of the gradient flows back with the stage's cotangent). An MoE stage's cotangent
    takes the dense stages' ppermute: four stages are test_pipeline.py's (and, MoE, the compiled
    program of test_pipeline_work's moe-pipeline4-expert2); gpipe's table is the stages' own."""
    cfg = with_mesh(moe_config(4, every_n), micro_batches=M, **{"pipeline_schedule": "1f1b", **mesh})
    validate(cfg, len(devices_for(cfg)))
    got, ref = run(cfg, devices_for(cfg)), moe_reference[every_n]
    assert_same_run(got, ref, f"MoE every {every_n} {mesh}")
    assert_tree_close(got["model_state"], ref["model_state"], FP32_RTOL, what="MoE model state ")
    assert bool(ref["model_state"]) == (every_n == 1)
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


@pytest.mark.heavy
def test_last_stage_loss_keeps_the_logits_sharded_over_vocab():
    """With tensor parallelism the logits are split over `vocab`; the stages' cross-entropy reduces
    each device's slice and adds the partial sums, so no [rows, tokens, vocab] array is gathered."""
    import re

    cfg = with_mesh(BASE.replace(model=dataclasses.replace(BASE.model, num_layers=2)), micro_batches=2,
                    pipeline=2, fsdp=2, tensor=2, pipeline_schedule="1f1b")
    trainer = build(cfg, make_mesh({a: getattr(cfg.mesh, a) for a in MeshConfig.AXES}, devices_for(cfg)))
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=trainer.batch_sharding)
             for k, v in batches(cfg)[0].items()}
    hlo = trainer.step.lower(trainer.abstract_state(), batch).compile().as_text()
    vocab = cfg.model.vocab_size
    gathered = [m for m in re.findall(r"= f32\[([\d,]+)\][^=]*? all-gather\(", hlo)
                if len(m.split(",")) >= 3 and int(m.split(",")[-1]) == vocab]
    assert not gathered, f"all-gathers of logits over the vocabulary: {gathered}"
    assert re.search(r"all-gather\(", hlo)  # the regex sees the step's gathers (FSDP's weights)


@pytest.fixture(scope="module")
def four_layers_reference():
    cfg = BASE.replace(model=dataclasses.replace(BASE.model, num_layers=4))
    return cfg, run(with_mesh(cfg, micro_batches=M), jax.devices()[:1])


@pytest.mark.heavy
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "zero_bubble"])
def test_sequence_parallel_with_replica_groups_equals_one_device(four_layers_reference, schedule):
    """Sequence parallelism with data replica groups under a pipeline: XLA's SPMD partitioner stops the
    process (a check failure) on the replica vmap's ticks, so these stages run with `data` manual in
    their shard_map instead, each device ticking on its own rows (executor.py); losses, grad norms and
    gradients are one device's. (tests/parallel/test_communication.py: the gradients cross `data` once.)"""
    cfg, ref = four_layers_reference
    extra = {"pipeline_virtual_stages": 2} if schedule == "interleaved" else {}
    got = run(with_mesh(cfg, micro_batches=M, pipeline=2, tensor=2, sequence_parallel=True, data=2,
                        pipeline_schedule=schedule, **extra), jax.devices())
    assert_same_run(got, ref, f"pipeline=2 data=2 tensor=2 SP {schedule}")
