"""Uneven pipeline stages (`mesh.pipeline_layers`): the stacks padded with zero layers in memory, the
real layers on disk. Losses, grad norms and gradients (real layers) against one device; the padding's
gradients exactly zero and its weights still zero after the optimizer steps; checkpoints that move
between stage splits; the config's refusals."""

import dataclasses
import subprocess
import sys

import jax
import numpy as np
import pytest

from helpers.paths import REPO
from helpers.run import BASE, assert_same_run, batches, devices_for, fp8_run, moe_config, run, with_mesh
from helpers.tolerances import FP32_RTOL, FP8_STEPS_RTOL, assert_tree_close
from lumen_jax.checkpoint.manager import Checkpointer
from lumen_jax.config import CheckpointConfig, ConfigError, Fp8Config, MeshConfig, MoeConfig
from lumen_jax.config.checks import validate
from lumen_jax.model import apply, init_params
from lumen_jax.model.transformer import param_shapes_and_names
from lumen_jax.parallel.mesh import make_mesh
from lumen_jax.train.build import build

M = 4  # micro-batches
L3 = BASE.replace(model=dataclasses.replace(BASE.model, num_layers=3))
L6 = BASE.replace(model=dataclasses.replace(BASE.model, num_layers=6))


def _trainer(cfg):
    shape = {a: getattr(cfg.mesh, a) for a in MeshConfig.AXES}
    return build(cfg, make_mesh(shape, jax.devices()[:int(np.prod(list(shape.values())))]))


@pytest.fixture(scope="module")
def reference():
    return {n: run(with_mesh(cfg, micro_batches=M), jax.devices()[:1]) for n, cfg in ((3, L3), (6, L6))}


@pytest.fixture(scope="module")
def uneven_run():
    """`run` of a config, once per module: test_checkpoint_moves_between_stage_splits steps the
    trainers test_uneven_stages_match_one_device built (their programs, traced and compiled once)."""
    runs = {}

    def get(cfg):
        if cfg not in runs:
            runs[cfg] = run(cfg, devices_for(cfg))
        return runs[cfg]
    return get


def _uneven(schedule, stages, virtual, layers, split, mesh=None):
    return with_mesh(L3 if layers == 3 else L6, micro_batches=M, pipeline=stages, pipeline_schedule=schedule,
                     pipeline_virtual_stages=virtual, pipeline_layers=tuple(split), **(mesh or {}))


def _padding_slots(got: dict, pipe) -> list:
    """The padding slots' leaves of `run`'s gradients (before and after) as the stages hold them
    (`run` compares the real layers)."""
    return [_padding(pipe, a) for key in ("grads", "grads_end") for k in pipe.stacks
            for a in jax.tree.leaves(got["held"][key][k])]


def _padding(pipe, a):
    """The padding slots of a held stack's leaf `a` (a stack may hold a share of the layers: MoE)."""
    a = np.asarray(pipe.from_stages(a))  # interleaved: device-major -> virtual-stage order
    return np.delete(a, pipe.real_slots(a.shape[0]), axis=0)


CASES = [
    ("1f1b", 2, 1, 3, [1, 2], {}),
    ("gpipe", 2, 1, 3, [2, 1], {}),
    pytest.param("interleaved", 2, 2, 6, [1, 2, 2, 1], {}, marks=pytest.mark.heavy),
    # zero_bubble's split backward (B and W units) over the padded stacks, under the replica vmap and
    # split over tensor, in one program
    pytest.param("zero_bubble", 2, 1, 3, [2, 1], dict(data=2, tensor=2), marks=pytest.mark.heavy),
]


@pytest.mark.parametrize("schedule,stages,virtual,layers,split,mesh", CASES)
def test_uneven_stages_match_one_device(reference, uneven_run, schedule, stages, virtual, layers, split, mesh):
    """3 steps: losses, grad norms, the real layers' gradients before and after them equal one
    device's; the padding slots' gradients are exactly 0 and their weights still exactly 0."""
    cfg = _uneven(schedule, stages, virtual, layers, split, mesh)
    validate(cfg, stages * int(np.prod(list(mesh.values()) or [1])))
    got = uneven_run(cfg)
    pipe = got["trainer"].step_cfg.pipeline
    assert pipe.layers == tuple(split)
    padding = _padding_slots(got, pipe)
    assert_same_run(got, reference[layers], f"pipeline_layers={split} {schedule} {mesh}")
    assert padding and all(not np.any(a) for a in padding), "padding slots with non-zero gradients"
    # In memory virtual stage w holds pipeline_layers[w] real layers, then zero slots (the weights
    # after 3 steps: the padding still exactly zero).
    lmax, params = max(split), jax.device_get(got["state"].params)
    for leaf in jax.tree.leaves({k: params[k] for k in pipe.stacks}):
        used = [[bool(np.any(leaf[w * lmax + j])) for j in range(lmax)] for w in range(len(split))]
        assert used == [[j < n for j in range(lmax)] for n in split], f"layer slots in use {used}, split {split}"


def test_zero_layer_is_the_identity():
    """The base of the padded layout: a block whose every weight is 0 (norm scales included) leaves
    the residual stream bit for bit as it was, and its gradients are exactly 0."""
    import jax.numpy as jnp

    cfg = dataclasses.replace(BASE.model, num_layers=2, qk_norm=True, qkv_bias=True)
    graphdef3, _, _ = param_shapes_and_names(dataclasses.replace(cfg, num_layers=3))
    params = jax.jit(init_params, static_argnums=(0, 1))(cfg, 0)  # jitted: eagerly each op compiles on its own
    padded = jax.jit(lambda p: {**p, "blocks": jax.tree.map(
        lambda a: jnp.concatenate([a[:1], jnp.zeros_like(a[:1]), a[1:]]), p["blocks"])})(params)
    graphdef2, _, _ = param_shapes_and_names(cfg)
    tokens = jnp.arange(64, dtype=jnp.int32).reshape(2, 32) % cfg.vocab_size
    positions = jnp.broadcast_to(jnp.arange(32), (2, 32))
    logits = jax.jit(apply, static_argnums=0)
    np.testing.assert_array_equal(logits(graphdef3, padded, tokens, positions), logits(graphdef2, params, tokens, positions))
    grads = jax.jit(jax.grad(lambda p: apply(graphdef3, p, tokens, positions).sum()))(padded)
    assert all(not np.any(a[1]) for a in jax.tree.leaves(grads["blocks"]))
    assert all(np.any(a[0]) for a in jax.tree.leaves(grads["blocks"]))  # the real layers do get gradients


@pytest.mark.heavy
def test_checkpoint_moves_between_stage_splits(reference, uneven_run, tmp_path):
    """A step at pipeline_layers=[1, 2] (1f1b), saved (the real layers [3, ...] on disk), restored with
    no pipeline and at [2, 1] (gpipe): the restored real weights and moments are bit-identical to what
    was saved (a copy), and the next two steps continue the uninterrupted one-device run (fp32
    tolerance: the stages add the gradients in another order). The trainers (and their compiled
    steps) are the one-device reference's and test_uneven_stages_match_one_device's."""
    data = batches(L3)
    path = str(tmp_path / "ckpt")
    writer = uneven_run(_uneven("1f1b", 2, 1, 3, [1, 2]))["trainer"]
    saved, _, _ = writer.step_and_grads(writer.init(), writer.shard_batch(data[0]))
    ckpt = Checkpointer(path, CheckpointConfig(), layout=writer.stored)
    ckpt.save(1, saved, {})
    ckpt.wait()
    ckpt.close()
    stored = jax.device_get(writer.stored.save(saved))
    assert jax.tree.leaves(stored.params["blocks"])[0].shape[0] == 3
    for reader in (reference[3]["trainer"], uneven_run(_uneven("gpipe", 2, 1, 3, [2, 1]))["trainer"]):
        restored = Checkpointer(path, CheckpointConfig(), layout=reader.stored).restore_latest(reader.abstract_state())
        state = restored.state
        for got, sh in zip(jax.tree.leaves(state), jax.tree.leaves(reader.state_shardings)):
            assert got.sharding == sh
        assert_tree_close(jax.device_get(reader.stored.save(state)), stored, 0.0, what="restored ")
        losses, norms = [], []
        for batch in data[1:]:
            state, m, _ = reader.step_and_grads(state, reader.shard_batch(batch))
            losses.append(float(m["loss"]))
            norms.append(float(m["grad_norm"]))
        np.testing.assert_allclose(losses, reference[3]["losses"][1:], rtol=FP32_RTOL)
        np.testing.assert_allclose(norms, reference[3]["grad_norms"][1:], rtol=FP32_RTOL)


def _check(layers=3, split=(1, 2), virtual=1, **model):
    cfg = with_mesh(BASE.replace(model=dataclasses.replace(BASE.model, num_layers=layers, **model)), micro_batches=M,
                    pipeline=2, pipeline_schedule="interleaved" if virtual > 1 else "1f1b",
                    pipeline_virtual_stages=virtual, pipeline_layers=tuple(split))
    return validate(cfg, 2)


@pytest.mark.parametrize("changes,message", [
    (dict(split=(1, 1, 1)), "mesh.pipeline_layers=[1, 1, 1] has 3 entries, not mesh.pipeline*"
                            "mesh.pipeline_virtual_stages=2*1=2"),
    (dict(split=(1, 2), virtual=2, layers=3), "mesh.pipeline_layers=[1, 2] has 2 entries, not "
                                              "mesh.pipeline*mesh.pipeline_virtual_stages=2*2=4"),
    (dict(split=(0, 3)), "mesh.pipeline_layers=[0, 3] gives a stage 0 layers"),
    (dict(split=(1, 3)), "mesh.pipeline_layers=[1, 3] sums to 4 layers, not model.num_layers=3"),
    (dict(layers=6, split=(2, 4), moe=MoeConfig(num_experts=4, every_n_layers=3)),
     "mesh.pipeline_layers=[2, 4] with model.moe.every_n_layers=3: a stage holds whole groups of 3 layers"),
])
def test_config_errors(changes, message):
    with pytest.raises(ConfigError) as e:
        _check(**changes)
    text = str(e.value)
    assert text.startswith(message) and "\n" not in text, text


def test_config_accepts():
    assert _check()["pipeline"] == 2
    assert _check(layers=6, split=(2, 4), moe=MoeConfig(num_experts=4, every_n_layers=2))["pipeline"] == 2
    assert _check(split=(1, 2), fp8=Fp8Config(recipe="delayed", keep_bf16=()))["pipeline"] == 2
    assert _check(split=(2, 2), layers=4, moe=MoeConfig(num_experts=4, every_n_layers=2))["pipeline"] == 2  # even


def _train(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lumen_jax.train", "--config", "configs/tiny.yaml", *overrides],
                          cwd=REPO, capture_output=True, text=True, timeout=600)


def test_train_cli_points_uneven_depths_to_pipeline_layers(tmp_path):
    """What the issue's user saw: 126 layers on 16 stages refused; now the line names the key that does it."""
    proc = _train("model.num_layers=3", "mesh.pipeline=2", f"train.run_dir={tmp_path / 'run'}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[0]
    assert line.startswith("error: model.num_layers=3 is not divisible by mesh.pipeline=2; use mesh.pipeline_layers"), line
    proc = _train("model.num_layers=3", "mesh.pipeline=2", "mesh.pipeline_layers=[1,3]", f"train.run_dir={tmp_path / 'run'}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[0].startswith(
        "error: mesh.pipeline_layers=[1, 3] sums to 4 layers, not model.num_layers=3"), proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()


@pytest.mark.heavy
@pytest.mark.parametrize("layers,every_n,split,mesh", [
    (6, 2, [4, 2], {}),  # two stacks (dense, MoE) padded in the same share; the aux loss of real groups only
], ids=["n2-[4,2]"])
def test_uneven_moe_stages_match_one_device(layers, every_n, split, mesh):
    """Losses, grad norms, gradients (real layers) of 3 steps, the `moe/...` metrics (each stage's
    mean weighted by its share of the layers) and the model state equal one device's. The bias
    balance (the model state: the padding's routing leaves no trace) with experts over `expert=2` on
    uneven stages: tests/model/test_deepseek.py::test_first_dense_layers_and_mtp_train_on_a_pipeline_as_on_one_device
    (pipeline_layers=[1, 2], the bias and expert load against one device, the padding's gradients 0)."""
    ref = run(with_mesh(moe_config(layers, every_n), micro_batches=M), jax.devices()[:1])
    cfg = with_mesh(moe_config(layers, every_n), micro_batches=M, pipeline=2, pipeline_schedule="1f1b",
                    pipeline_layers=tuple(split), **mesh)
    devices = jax.devices()[:2 * int(np.prod(list(mesh.values()) or [1]))]
    validate(cfg, len(devices))
    got = run(cfg, devices)
    pipe = got["trainer"].step_cfg.pipeline
    padding = _padding_slots(got, pipe)
    assert_same_run(got, ref, f"MoE every {every_n} pipeline_layers={split}")
    assert padding and all(not np.any(a) for a in padding), "padding slots with non-zero gradients"
    assert_tree_close(got["model_state"], ref["model_state"], FP32_RTOL, what="MoE model state ")
    assert bool(ref["model_state"]) == (every_n == 1)
    for step in range(len(ref["metrics"])):
        for key in (k for k in ref["metrics"][step] if k.startswith("moe/")):
            np.testing.assert_allclose(got["metrics"][step][key], ref["metrics"][step][key], rtol=FP32_RTOL,
                                       atol=1e-7, err_msg=f"{key} step {step}")


@pytest.mark.heavy
def test_uneven_fp8_delayed_stages_match_unpipelined():
    """fp8 delayed: a zero weight's or input's amax is 0 (scale 1), so the padding is the identity in
    fp8 too: the first gradients and the amax histories after one step equal the unpipelined run's
    (real layers), later losses at fp8's rounding tolerance (test_pipeline_compose)."""
    fp8 = BASE.replace(model=dataclasses.replace(BASE.model, num_layers=3, fp8=Fp8Config(
        recipe="delayed", amax_history=4, keep_bf16=())))
    ref = fp8_run(with_mesh(fp8, micro_batches=M))
    cfg = with_mesh(fp8, micro_batches=M, pipeline=2, pipeline_schedule="1f1b", pipeline_layers=(2, 1))
    pipe = _trainer(cfg).step_cfg.pipeline
    got = fp8_run(cfg)
    assert_tree_close(got["grads"], ref["grads"], FP32_RTOL, what="fp8 first grads ")
    assert_tree_close(got["states"][0], ref["states"][0], FP32_RTOL, what="fp8 state after one step ")
    # The padding's activations and weights are 0: their histories stay 0. Its output cotangents are
    # the residual stream's (g in every projection's backward), so the g histories fill, and only
    # scale what meets zero weights and inputs.
    kinds: dict[str, bool] = {}
    for path, a in jax.tree_util.tree_leaves_with_path(got["held_states"][-1]):
        kinds[path[-1].key] = kinds.get(path[-1].key, False) or bool(np.any(_padding(pipe, a)))
    assert kinds == {"x": False, "w": False, "g": True}, kinds
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=FP8_STEPS_RTOL)


@pytest.mark.heavy
def test_evaluate_reads_an_uneven_checkpoint_on_any_mesh(tmp_path):
    """`lumen_jax.evaluate` of an uneven run's checkpoint (the real layers on disk): on its default
    mesh (no pipeline) and with the run's split under `mesh.pipeline=2` (padded in memory), one loss."""
    from lumen_jax.train.evaluate import evaluate

    run_dir = str(tmp_path / "run")
    proc = _train("model.num_layers=3", "mesh.pipeline=2", "mesh.pipeline_layers=[1,2]", "mesh.fsdp=-1",
                  "train.micro_batches=2", "train.steps=1", "checkpoint.every_steps=1", "log.progress=false", "log.tensorboard=false",
                  f"train.run_dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    flat = evaluate(run_dir, None, "train", 1)  # fsdp over the 8 devices
    staged = evaluate(run_dir, None, "train", 1, ["mesh.pipeline=2", "mesh.pipeline_schedule=gpipe"])  # x fsdp 4
    assert flat["step"] == staged["step"] == 1
    np.testing.assert_allclose(staged["eval_loss"], flat["eval_loss"], rtol=FP32_RTOL)
