"""Mixture of experts: dispatch against a per-token reference, capacity drops, the router's losses,
the GPU exchange's lowering, and expert parallelism against one device (fp32)."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from helpers.data import packed_batch
from helpers.run import BASE, assert_same_run, run, with_mesh
from lumen_jax.metrics import flops
from lumen_jax.train.build import build
from lumen_jax.config import ConfigError, MoeConfig, from_dict, to_dict
from lumen_jax.config.checks import validate
from lumen_jax.model import param_shapes_and_names
from lumen_jax.ops import moe as moe_ops
from lumen_jax.parallel import expert
from lumen_jax.parallel.mesh import make_mesh
from lumen_jax.parallel.rules import Rules, activate

E, K, D, F = 4, 2, 16, 8


def _layer_inputs(b: int, t: int, seed: int = 0):
    ks = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(ks[0], (b, t, D), jnp.float32)
    scores = jax.random.normal(ks[1], (b, t, E))
    weights, ids = jax.lax.top_k(jax.nn.softmax(scores), K)  # distinct experts per token
    w_gate = jax.random.normal(ks[2], (E, D, F)) / math.sqrt(D)
    w_up = jax.random.normal(ks[3], (E, D, F)) / math.sqrt(D)
    w_down = jax.random.normal(ks[4], (E, F, D)) / math.sqrt(F)
    return x, ids.astype(jnp.int32), weights, w_gate, w_up, w_down


def _reference(x, ids, weights, w_gate, w_up, w_down, cap):
    """Token by token, in order: each chosen expert's SwiGLU times its weight, while the expert has room."""
    x, ids, weights = (np.asarray(a, np.float64).reshape(-1, a.shape[-1]) for a in (x, ids, weights))
    w_gate, w_up, w_down = (np.asarray(a, np.float64) for a in (w_gate, w_up, w_down))
    used = np.zeros(E, int)
    y, kept = np.zeros_like(x), np.zeros(ids.shape, bool)
    for n in range(x.shape[0]):
        for j in range(K):
            e = int(ids[n, j])
            if used[e] < cap:
                used[e] += 1
                kept[n, j] = True
                gate, up = x[n] @ w_gate[e], x[n] @ w_up[e]
                y[n] += weights[n, j] * ((gate / (1 + np.exp(-gate)) * up) @ w_down[e])
    return y, kept


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_dispatch_matches_per_token_reference(capacity_factor):
    args = _layer_inputs(2, 8)
    y, kept = jax.jit(lambda *a: moe_ops.routed_experts(*a, capacity_factor=capacity_factor))(*args)
    cap = expert.capacity(16, K, E, capacity_factor)
    y_ref, kept_ref = _reference(*args, cap)
    np.testing.assert_array_equal(np.asarray(kept).reshape(-1, K), kept_ref)
    if capacity_factor is not None:
        assert 0 < (~kept_ref).sum() and cap == 4  # some drops, each expert keeps 4 of 32 assignments
    np.testing.assert_allclose(np.asarray(y).reshape(-1, D), y_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("capacity_factor,mesh_shape", [(None, {"data": 2, "expert": 4}),
                                                        (1.0, {"data": 2, "expert": 4}),
                                                        (1.0, {"expert": 4, "tensor": 2})])
def test_expert_parallel_dispatch_per_device_groups(capacity_factor, mesh_shape):
    """Every device's slice of the batch is a dispatch group of its own (capacity counted per
    device), its rows reach the experts on other devices and come back (with `tensor`: each
    expert's hidden width split, partial sums added)."""
    mesh = make_mesh(mesh_shape)
    rows = 8 if "data" in mesh_shape else 4
    args = _layer_inputs(rows, 4, seed=1)
    rules = Rules()

    def f(*a):
        with activate(mesh, rules):
            return moe_ops.routed_experts(*a, capacity_factor=capacity_factor)

    shard = lambda names: NamedSharding(mesh, rules.spec(names))  # noqa: E731
    shardings = [shard(("batch", "seq", None))] * 3 + [shard(("experts", None, None))] * 3
    y, kept = jax.jit(f, in_shardings=shardings)(*args)
    cap = expert.capacity(4, K, E, capacity_factor)
    for row in range(rows):  # one row of 4 tokens per device (per group of `tensor` devices)
        y_ref, kept_ref = _reference(*(a[row:row + 1] for a in args[:3]), *args[3:], cap)
        np.testing.assert_array_equal(np.asarray(kept[row]), kept_ref)
        np.testing.assert_allclose(np.asarray(y[row]), y_ref, rtol=1e-5, atol=1e-6)
    if capacity_factor is not None:
        assert not np.asarray(kept).all()


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_router_losses_on_a_hand_made_routing(router):
    """Logits chosen so that 4 tokens go to experts 0, 0, 1, 2 (top-1): f = (1/2, 1/4, 1/4, 0)."""
    logits = np.array([[4.0, 1, 0, 0], [3, 0, 1, 0], [0, 2, 1, 0], [1, 0, 3, 2]], np.float32)
    cfg = MoeConfig(num_experts=4, top_k=1, router=router)
    ids, weights, stats = moe_ops.route(jnp.asarray(logits)[None], jnp.eye(4), cfg)
    np.testing.assert_array_equal(np.asarray(ids).reshape(-1), [0, 0, 1, 2])
    np.testing.assert_allclose(np.asarray(weights), 1.0)  # top-1, renormalised
    if router == "softmax":
        probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    else:
        scores = 1 / (1 + np.exp(-logits))
        probs = scores / scores.sum(-1, keepdims=True)
    f = np.array([0.5, 0.25, 0.25, 0.0])
    np.testing.assert_allclose(stats["fraction"], f)
    np.testing.assert_allclose(stats["balance_loss"], 4 * (f * probs.mean(0)).sum(), rtol=1e-6)
    lse = np.log(np.exp(logits).sum(-1))
    np.testing.assert_allclose(stats["router_z_loss"], np.mean(lse ** 2), rtol=1e-6)


def test_gpu_exchange_lowers_to_ragged_all_to_all():
    """XLA:CPU cannot run `ragged_all_to_all`; lowered for CUDA (forward and backward) the GPU
    exchange must contain it, and the CPU exchange must not."""
    mesh = make_mesh({"expert": 4, "data": 2})
    args = _layer_inputs(8, 4)
    rules = Rules()

    def lowered(exchange: str) -> str:
        def loss(x, w_gate, w_up, w_down):
            with activate(mesh, rules):
                y, _ = moe_ops.routed_experts(x, args[1], args[2], w_gate, w_up, w_down, capacity_factor=None,
                                             exchange=exchange)
            return (y ** 2).sum()

        fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
        exported = jax.export.export(fn, platforms=["cuda"], disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call("ragged_all_to_all")])(args[0], *args[3:])
        return exported.mlir_module()

    op = "stablehlo.custom_call @ragged_all_to_all("
    ragged, padded = lowered("ragged"), lowered("padded")
    assert ragged.count(op) >= 4, ragged.count(op)  # rows, expert ids, rows back; the transposes
    assert op not in padded and "stablehlo.all_to_all" in padded


MOE = BASE.replace(model=dataclasses.replace(
    BASE.model, moe=MoeConfig(num_experts=8, top_k=2, shared_experts=1, expert_ffn_dim=32)))


# Fine-grained (DeepSeekMoE, Qwen3-MoE): 64 experts of width 16, top-6, one shared expert. No balance
# loss: with micro-batches it is a mean over each micro-batch of each replica group (a product of two
# means, so not the whole batch's); every other term of the objective is a sum over tokens.
FINE = BASE.replace(model=dataclasses.replace(BASE.model, moe=MoeConfig(
    num_experts=64, top_k=6, shared_experts=1, expert_ffn_dim=16, aux_loss_weight=0.0)))
# (expert=4,data=2 with 2 micro-batches went: expert=2,fsdp=2,data=2 below takes the same replica vmap over
# `data` with the experts exchanged, and more. expert=8 went too: the padded exchange is the same code for
# any `expert` size (`parallel/expert.py`'s `_padded`; 4 devices against a per-token reference:
# test_expert_parallel_dispatch_per_device_groups; expert=8's compiled step: the test of its arrays below).
# Experts with context=2, ring attention over zigzag tokens: tests/model/test_deepseek.py's
# expert2-context2-tensor2-sp, the DeepSeek MoE with its shared expert.)
EP_MESHES = {  # (micro-batches, mesh); 2 micro-batches: the step's replica vmap over `data` (x fsdp)
    "fine expert=2,tensor=2,fsdp=2": (1, dict(expert=2, tensor=2, fsdp=2)),
    "fine expert=2,fsdp=2,data=2, 2 micro-batches": (2, dict(expert=2, fsdp=2, data=2, fsdp_grad_reduce="once")),
}


@pytest.fixture(scope="module")
def fine_reference():
    return run(with_mesh(FINE, expert=1), devices=jax.devices()[:1])


@pytest.mark.heavy
@pytest.mark.parametrize("name", list(EP_MESHES))
def test_dropless_expert_parallel_matches_one_device(name, fine_reference):
    micro_batches, mesh = EP_MESHES[name]
    ref = fine_reference
    got = run(with_mesh(FINE, micro_batches, **mesh))
    assert np.all(np.diff(ref["losses"]) < 0), ref["losses"]
    assert_same_run(got, ref, name)


@pytest.mark.heavy
@pytest.mark.parametrize("mesh", [dict(expert=8), dict(expert=4, data=2)])
def test_fine_grained_step_has_no_tokens_by_experts_by_d_array(mesh):
    """The compiled step of 64 experts, top-6, holds no array of a device's tokens x experts x D
    elements (XLA:CPU lowers `ragged_dot` with a [experts, rows, D] mask; the largest left are the
    experts' padded rows, up to E x tokens x top_k rows of D). The padded exchange sends each token
    once per device, [E, tokens, D + 2 top_k] with its experts and weights (not one row per
    assignment, top_k times that). One layer: the
    layer scan stacks each layer's residuals into [layers, ...] arrays."""
    from lumen_jax.compiler import hlo
    from lumen_jax.compiler.compiled import compile_step
    from lumen_jax.plan.hardware import layout_from_config

    cfg = with_mesh(FINE.replace(model=dataclasses.replace(FINE.model, num_layers=1)), 2 if "data" in mesh else 1,
                    **mesh)
    module = hlo.parse(compile_step(cfg, layout_from_config(cfg, 8)).as_text())
    tokens = cfg.data.global_batch_size * cfg.data.seq_len // 8 // cfg.train.micro_batches
    limit = tokens * cfg.model.moe.num_experts * cfg.model.d_model
    big = max((a for i in module.instrs for a in i.arrays), key=lambda a: math.prod(a.dims))
    assert math.prod(big.dims) < limit, f"{big} has >= {tokens} tokens x 64 experts x D elements"
    exchanged = [sum(math.prod(a.dims) for a in i.arrays) for i in module.where("all-to-all")]
    moe = cfg.model.moe  # each token with its experts and weights, [E, tokens, D + 2 top_k]
    assert max(exchanged) == mesh["expert"] * tokens * (cfg.model.d_model + 2 * moe.top_k), exchanged


def _train_router(aux_loss_weight: float, steps: int = 100) -> tuple[list[float], dict]:
    """A one-layer MoE (8 experts, top-2) trained `steps` steps on one batch: losses, last metrics."""
    cfg = dataclasses.replace(
        with_mesh(BASE), model=dataclasses.replace(
            BASE.model, d_model=32, num_layers=1, num_heads=2, num_kv_heads=1, vocab_size=128,
            moe=MoeConfig(num_experts=8, top_k=2, expert_ffn_dim=16, aux_loss_weight=aux_loss_weight,
                          router_z_loss_weight=0.0)),
        data=dataclasses.replace(BASE.data, global_batch_size=8),
        optim=dataclasses.replace(BASE.optim, lr=1e-2, schedule="constant", z_loss=0.0))
    trainer = build(cfg, make_mesh({}, jax.devices()[:1]))
    state = trainer.init()
    batch = trainer.shard_batch(packed_batch(8, cfg.data.seq_len, 128, seed=0))
    losses = []
    for _ in range(steps):
        state, metrics = trainer.step(state, batch)
        losses.append(metrics["loss"])
    return [float(x) for x in losses], {k: float(v) for k, v in jax.device_get(metrics).items()}


def test_balancing_loss_keeps_every_expert_in_use():
    """Same seed, 100 steps: with the balancing loss every expert keeps >= 1% of the assignments and
    the spread between the most and least used expert is smaller than without it."""
    with_loss, metrics = _train_router(0.1)
    without_loss, metrics_off = _train_router(0.0)
    assert with_loss[-1] < 0.5 * with_loss[0], with_loss[::10]
    assert metrics["moe/expert_fraction_min"] >= 0.01, metrics
    spread = lambda m: m["moe/expert_fraction_max"] - m["moe/expert_fraction_min"]  # noqa: E731
    assert spread(metrics) < spread(metrics_off), (metrics, metrics_off)
    assert metrics["moe/balance_loss"] < metrics_off["moe/balance_loss"]


BAD_MOE = {
    "top_k > num_experts": ({"top_k": 9}, {}, "model.moe.top_k=9 exceeds model.moe.num_experts=8"),
    "num_experts % mesh.expert": ({}, {"expert": 3, "fsdp": 1}, "mesh.expert=3 does not divide model.moe.num_experts=8"),
    "capacity_factor <= 0": ({"capacity_factor": 0.0}, {}, "model.moe.capacity_factor=0.0 must be > 0"),
    "unknown router": ({"router": "hash"}, {}, "model.moe.router='hash' is not one of the allowed values"),
    "every_n_layers": ({"every_n_layers": 3}, {}, "model.moe.every_n_layers=3 does not divide model.num_layers=2"),
    "expert axis without experts": ({"num_experts": 0}, {"expert": 2, "fsdp": 4},
                                    "mesh.expert=2 needs a mixture of experts"),
    "groups % num_experts": ({"groups": 3}, {}, "model.moe.groups=3 does not divide model.moe.num_experts=8"),
    "top_groups > groups": ({"groups": 2, "top_groups": 3}, {}, "model.moe.top_groups=3 exceeds model.moe.groups=2"),
    "top_k above the kept groups": ({"groups": 4, "top_groups": 1, "top_k": 3}, {},
                                    "model.moe.top_k=3 exceeds the 2 experts of model.moe.top_groups=1 groups of 2"),
    "shared_gate without shared": ({"shared_experts": 0, "shared_gate": True}, {},
                                   "model.moe.shared_gate=true gates the shared experts but model.moe.shared_experts=0"),
    "unknown balance": ({"balance": "none"}, {}, "model.moe.balance='none' is not one of the allowed values"),
    "routed_scaling <= 0": ({"routed_scaling": 0.0}, {}, "model.moe.routed_scaling=0.0"),
}


@pytest.mark.parametrize("name", list(BAD_MOE))
def test_moe_config_errors_are_one_line(name):
    moe, mesh, fragment = BAD_MOE[name]
    raw = to_dict(MOE)
    raw["model"]["moe"].update(moe)
    raw["mesh"].update({"fsdp": -1, **mesh})
    with pytest.raises(ConfigError) as e:
        validate(from_dict(raw), 3 if mesh.get("expert") == 3 else 8)
    assert fragment in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_param_counts_count_active_experts():
    cfg = dataclasses.replace(MOE.model, num_layers=4, moe=dataclasses.replace(MOE.model.moe, every_n_layers=2))
    _, shapes, _ = param_shapes_and_names(cfg)
    counts = flops.param_counts(cfg)
    assert counts["total"] == sum(math.prod(s.shape) for s in jax.tree.leaves(shapes))
    d, f, fe, attn = 64, 128, 32, 2 * 64 * 64 + 2 * 64 * 32
    moe_layer = attn + (2 + 1) * 3 * d * fe + d * 8  # top-2 + 1 shared expert + router
    assert counts["matmul"] == 2 * (attn + 3 * d * f) + 2 * moe_layer + d * 256
    assert counts["experts"] == 2 * 8 * 3 * d * fe


def test_checkpoint_reshards_across_expert_meshes(tmp_path):
    """Saved on expert=4,data=2, restored on expert=2,fsdp=2,tensor=2 and on one device: same values,
    the target shardings (expert weights split over the other `expert` axis size)."""
    from lumen_jax.checkpoint.manager import Checkpointer
    from lumen_jax.config import CheckpointConfig, MeshConfig

    def trainer(devices=None, **axes):
        cfg = MOE.replace(mesh=MeshConfig(**{"fsdp": 1, **axes}))
        return build(cfg, make_mesh(validate(cfg, len(devices or jax.devices())), devices))

    source = trainer(expert=4, data=2)
    state = source.init()
    state = state.replace(step=state.step + 1)  # a checkpoint's step is the state's (the restore checks)
    ckpt = Checkpointer(str(tmp_path), CheckpointConfig())
    ckpt.save(1, state, {})
    ckpt.wait()
    ckpt.close()
    expected = jax.device_get(state)
    for target in (trainer(expert=2, fsdp=2, tensor=2), trainer(jax.devices()[:1])):
        restored = Checkpointer(str(tmp_path), CheckpointConfig()).restore_latest(target.abstract_state())
        for got, want in zip(jax.tree.leaves(restored.state), jax.tree.leaves(expected)):
            np.testing.assert_array_equal(np.asarray(got), want)
        for got, sh in zip(jax.tree.leaves(restored.state.params), jax.tree.leaves(target.state_shardings.params)):
            assert got.sharding == sh
    assert "expert" in str(jax.tree.leaves(source.state_shardings.params["moe_blocks"]["mlp"]["w_gate"])[0].spec)


def test_every_n_layers_runs_dense_then_moe_layers_in_order():
    """every_n_layers=2 of 4 layers: the grouped scan equals layers 0..3 applied one by one, layers
    1 and 3 the MoE ones (`moe_blocks`), 0 and 2 dense (`blocks`)."""
    from flax import nnx
    from lumen_jax.model import init_params, param_shapes_and_names
    from lumen_jax.model.layers import rope_frequencies

    cfg = dataclasses.replace(MOE.model, num_layers=4, moe=dataclasses.replace(MOE.model.moe, every_n_layers=2))
    graphdef, _, _ = param_shapes_and_names(cfg)
    params = jax.jit(init_params, static_argnums=(0, 1))(cfg, 0)  # eager: each op compiled alone
    tokens = jnp.arange(32).reshape(2, 16) * 7 % cfg.vocab_size
    positions = jnp.broadcast_to(jnp.arange(16), (2, 16))

    @jax.jit
    def both(params):
        model = nnx.merge(graphdef, params)
        got, aux = model.forward(tokens, positions)
        stacks = {False: nnx.split(model.blocks), True: nnx.split(model.moe_blocks)}
        x, losses = params["embed"][tokens], []
        for i in range(4):
            g, state = stacks[i % 2 == 1]
            x, layer_aux = nnx.merge(g, jax.tree.map(lambda v: v[i // 2], state))(
                x, positions, None, rope_frequencies(cfg), model.ops)
            losses += [layer_aux["loss"]] if layer_aux else []
        return got, aux, model.final_norm(x) @ params["lm_head"], losses

    got, aux, want, losses = both(params)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(aux["loss"], sum(losses), rtol=1e-6)
    assert len(losses) == 2
