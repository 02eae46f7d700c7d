"""A small fp32 config, meshes over it, and a 3-step run to compare (shared by the mesh, model and
flash-attention tests); the small MoE and an fp8 run of it for the pipeline compositions; FAST_RUN,
how a long-running program compiles."""

import dataclasses
import math

import jax
import numpy as np
import optax

from helpers.data import packed_batch
from helpers.meshes import mesh_config
from helpers.tolerances import FP32_RTOL, assert_tree_close
from lumen_jax.train.build import build
from lumen_jax.config import Config, DataConfig, MeshConfig, ModelConfig, MoeConfig, OptimConfig, TrainConfig
from lumen_jax.parallel.mesh import make_mesh

# conftest.py compiles the tests' programs at -O0 (they are tiny); a test that runs hundreds of steps
# passes this as `compiler_options` instead.
FAST_RUN = {"xla_backend_optimization_level": 3}
STEPS = 3
BASE = Config(
    model=ModelConfig(d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=128,
                      vocab_size=256, compute_dtype="float32"),
    data=DataConfig(seq_len=32, global_batch_size=16),
    optim=OptimConfig(lr=1e-2, warmup_steps=0, z_loss=1e-4),
    train=TrainConfig(steps=STEPS),
)


def with_mesh(cfg: Config, micro_batches: int = 1, **mesh) -> Config:
    """`cfg` on a mesh whose axes are 1 unless given; `mesh` may set any mesh field (zero_stage,
    sequence_parallel, context_parallel, ...)."""
    return cfg.replace(mesh=mesh_config(**mesh),
                       train=dataclasses.replace(cfg.train, micro_batches=micro_batches))


def devices_for(cfg: Config) -> list:
    """The first devices, as many as `cfg`'s mesh has."""
    return jax.devices()[:math.prod(getattr(cfg.mesh, a) for a in MeshConfig.AXES)]


def moe_config(num_layers: int, every_n: int) -> Config:
    """BASE with 4 experts, top-2, an MoE layer every `every_n`; every_n=1 balances with the
    selection bias (model state: the bias and the step's expert load), else with the aux loss."""
    return BASE.replace(model=dataclasses.replace(BASE.model, num_layers=num_layers, moe=MoeConfig(
        num_experts=4, top_k=2, every_n_layers=every_n, balance="bias" if every_n == 1 else "aux_loss",
        bias_update_rate=0.01)))


def batches(cfg: Config) -> list[dict]:
    # The same batch each step, so the loss must fall (a check that the optimizer is doing work).
    return [packed_batch(cfg.data.global_batch_size, cfg.data.seq_len, cfg.model.vocab_size, seed=0)] * STEPS


def run(cfg: Config, devices=None) -> dict:
    """Loss, grad norm and metrics per step, the full gradients of the first step and of a step after
    the last one (on the last batch, not applied), the model state after the last step, the trainer
    and the last state. One program (`Trainer.step_and_grads`) gives all of them.

    Parameters themselves are not compared: Adam divides by sqrt(v), so an element whose gradient
    is ~0 turns reduction-order noise into an lr-sized difference. The gradients after 3 steps
    carry any real divergence of the parameters; they are compared as one vector (relative norm),
    because the Q/K gradients are ~1000x smaller than the rest and inherit that Adam noise.
    """
    shape = {a: getattr(cfg.mesh, a) for a in MeshConfig.AXES}
    trainer = build(cfg, make_mesh(shape, devices))
    state = trainer.init()
    data = [trainer.shard_batch(b) for b in batches(cfg)]
    losses, norms, metrics, grads0 = [], [], [], None
    for b in data:
        state, m, g = trainer.step_and_grads(state, b)
        grads0 = jax.device_get(g) if grads0 is None else grads0
        losses.append(float(m["loss"]))
        norms.append(float(m["grad_norm"]))
        metrics.append(jax.device_get(m))
    grads_end = jax.device_get(trainer.step_and_grads(state, data[-1])[2])
    real = trainer.real_layers  # uneven or interleaved stages hold their layers in another order
    return {"losses": np.array(losses), "grad_norms": np.array(norms), "metrics": metrics,
            "grads": real(grads0), "grads_end": real(grads_end),
            "held": {"grads": grads0, "grads_end": grads_end},  # as the stages hold them
            "model_state": jax.device_get(real(state.model_state)), "trainer": trainer, "state": state}


def assert_same_run(got: dict, ref: dict, name: str, grads_end_rtol: float = FP32_RTOL) -> None:
    """Losses, grad norms and the first gradients to FP32_RTOL; the gradients after 3 steps (one vector)
    to `grads_end_rtol`, for a model whose Adam steps amplify reduction-order rounding (each caller
    measures it)."""
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=FP32_RTOL, err_msg=f"{name} losses")
    np.testing.assert_allclose(got["grad_norms"], ref["grad_norms"], rtol=FP32_RTOL,
                               err_msg=f"{name} grad norms")
    assert_tree_close(got["grads"], ref["grads"], FP32_RTOL, what=f"{name} first grads ")
    diff = optax.tree.norm(jax.tree.map(lambda a, b: a - b, got["grads_end"], ref["grads_end"]))
    assert diff <= grads_end_rtol * optax.tree.norm(ref["grads_end"]), f"{name} grads after 3 steps: {diff}"


def assert_same_mtp_run(got: dict, ref: dict, name: str, grads_end_rtol: float = FP32_RTOL) -> None:
    """`assert_same_run`, and for multi-token prediction: the MTP modules learn and `mtp_loss` per step
    equals the reference's (to FP32_RTOL)."""
    assert_same_run(got, ref, name, grads_end_rtol)
    assert all(0 < float(m["mtp_loss"]) < 10 for m in ref["metrics"])
    assert float(np.abs(ref["grads"]["mtp"]["eh_proj"]).max()) > 0
    np.testing.assert_allclose([float(m["mtp_loss"]) for m in got["metrics"]],
                               [float(m["mtp_loss"]) for m in ref["metrics"]], rtol=FP32_RTOL, err_msg=name)


def fp8_run(cfg: Config) -> dict:
    """An fp8 run of `cfg` on `devices_for(cfg)`: the first step's gradients, (loss, grad norm) per
    step and the model state (amax histories) after each step, the stacks' layers in the model's
    order (`Trainer.real_layers`; "held_states": as the stages hold them)."""
    trainer = build(cfg, make_mesh({a: getattr(cfg.mesh, a) for a in MeshConfig.AXES}, devices_for(cfg)))
    data = [trainer.shard_batch(b) for b in batches(cfg)]
    state = trainer.init()
    losses, held, grads = [], [], None
    for b in data:
        state, m, g = trainer.step_and_grads(state, b)
        grads = jax.device_get(trainer.real_layers(g)) if grads is None else grads
        losses.append((float(m["loss"]), float(m["grad_norm"])))
        held.append(jax.device_get(state.model_state))
    return {"grads": grads, "losses": np.array(losses), "held_states": held,
            "states": [jax.device_get(trainer.real_layers(s)) for s in held]}
