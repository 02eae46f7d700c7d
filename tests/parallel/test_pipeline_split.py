"""zero_bubble's split backward (ops/projection.Taps, the executor's weight unit): B's one vjp gives
the input gradient and each projection's input and output cotangent, W the projections' weight
gradients; together they are the whole gradient, under every remat policy and with the other axes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.data import packed_batch
from helpers.run import BASE, moe_config, with_mesh
from helpers.tolerances import FP32_RTOL, SAME_MATH_FP32_RTOL, assert_tree_close
from lumen_jax.config import MeshConfig, MoeConfig
from lumen_jax.model import transformer
from lumen_jax.ops.projection import Taps
from lumen_jax.parallel.mesh import make_mesh
from lumen_jax.train.build import build


def _split_grads(cfg):
    """(plain vjp, tapped vjp, replay's vjp) of a stack of layers: input and parameter gradients. Each
    jitted (eager, each op of the init and the backward compiled on its own)."""
    params, state = jax.jit(transformer.init, static_argnums=(0, 1))(cfg, 0)
    graphdef = transformer.abstract_model(cfg).graphdef
    x = jax.random.normal(jax.random.key(1), (2, 16, cfg.d_model), jnp.float32)
    g = jax.random.normal(jax.random.key(2), x.shape, jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(16), (2, 16))

    def layers(p, x, taps=None):
        return transformer.merge(graphdef, p, state).run_layers(x, positions, None, None, taps)[0]

    whole_dp, whole_dx = jax.jit(lambda p, x, g: jax.vjp(layers, p, x)[1](g))(params, x, g)
    probe = Taps()
    jax.eval_shape(lambda: layers(params, x, probe))
    b_dp, b_dx, cts = jax.jit(lambda p, x, g: jax.vjp(
        lambda p, x, t: layers(probe.stop(p), x, probe.tapping(t)), p, x, probe.zeros(p))[1](g))(params, x, g)
    w_dp = jax.jit(lambda p, cts: probe.weight_grads(lambda p: p, p, cts))(params, cts)
    w_dp = {k: w_dp.get(k, jax.tree.map(jnp.zeros_like, v)) for k, v in params.items()}  # untapped: nothing
    return probe, (whole_dp, whole_dx), (b_dp, b_dx), w_dp


@pytest.mark.parametrize("model", [
    dict(remat="none"), dict(remat="full", qkv_bias=True, qk_norm=True), dict(remat="dots_saveable"),
    dict(moe=MoeConfig(num_experts=4, top_k=2, every_n_layers=2, shared_experts=1, shared_gate=True)),
], ids=["none", "full-qkv_bias-qk_norm", "dots_saveable", "moe-shared"])
def test_b_and_w_are_the_whole_backward(model):
    """B's input gradient is the plain vjp's; B's parameter gradients plus W's are the plain ones; a
    tapped weight gets nothing from B (else W's share would be added twice) and everything from W."""
    cfg = dataclasses.replace(BASE.model, num_layers=4, **model)
    probe, (whole_dp, whole_dx), (b_dp, b_dx), w_dp = _split_grads(cfg)
    # the same chain of ops (bit for bit in the dense cases; MoE's cotangent sums reorder)
    np.testing.assert_allclose(b_dx, whole_dx, rtol=SAME_MATH_FP32_RTOL, atol=SAME_MATH_FP32_RTOL * np.abs(whole_dx).max())
    assert_tree_close(jax.tree.map(jnp.add, b_dp, w_dp), whole_dp, SAME_MATH_FP32_RTOL, what="B + W ")
    attn = {"attn.wq", "attn.wk", "attn.wv", "attn.wo"}
    dense = attn | {"mlp.w_gate", "mlp.w_up", "mlp.w_down"}
    shared = {"mlp.shared.w_gate", "mlp.shared.w_up", "mlp.shared.w_down"}
    expect = {"blocks": dense} | ({"moe_blocks": attn | shared | {"mlp.experts"}} if cfg.moe.enabled else {})
    assert {stack: set(found) for stack, found in probe.found.items()} == expect
    if cfg.moe.enabled:  # the routed experts' three weights, as one grouped matmul
        assert set(probe.weights()["moe_blocks"]) == attn | shared | {"mlp.w_gate", "mlp.w_up", "mlp.w_down"}
    keys = [(stack, key) for stack, found in probe.weights().items() for key in found]
    for stack, key in keys:
        path = key.split(".")
        b, w = b_dp[stack], w_dp[stack]
        for name in path:
            b, w = b[name], w[name]
        assert not np.any(np.asarray(b)), f"B computed {stack}.{key}'s weight gradient"
        assert np.any(np.asarray(w)), f"W left {stack}.{key} without a gradient"
    # the input Q/K/V (and gate/up) share is recorded once
    assert [probe.found["blocks"][k].source for k in ("attn.wk", "attn.wv", "mlp.w_up")] == [
        "attn.wq", "attn.wq", "mlp.w_gate"]


def _grads(cfg, devices):
    trainer = build(cfg, make_mesh({a: getattr(cfg.mesh, a) for a in MeshConfig.AXES}, devices))
    batch = packed_batch(cfg.data.global_batch_size, cfg.data.seq_len, cfg.model.vocab_size, seed=0)
    return jax.device_get(trainer.grads(trainer.init().params, trainer.shard_batch(batch)))


@pytest.mark.heavy
@pytest.mark.parametrize("remat,mesh", [
    ("full", dict(pipeline=2, fsdp=2, tensor=2, sequence_parallel=True)),
    ("dots_saveable", dict(pipeline=4, data=2)),
], ids=["full-pp2-fsdp2-tp2-sp", "dots_saveable-pp4-data2"])
def test_zero_bubble_gradients_under_remat_equal_one_device(remat, mesh):
    """The split under remat (B recomputes the forward and with it the recorded inputs) and with
    tensor, sequence and data parallelism: the step's loss and gradients are one device's."""
    cfg = BASE.replace(model=dataclasses.replace(BASE.model, num_layers=4, remat=remat))
    one = _grads(with_mesh(cfg, micro_batches=4), jax.devices()[:1])
    got = _grads(with_mesh(cfg, micro_batches=4, pipeline_schedule="zero_bubble", **mesh), jax.devices())
    np.testing.assert_allclose(got[0], one[0], rtol=FP32_RTOL)
    assert_tree_close(got[1], one[1], FP32_RTOL, what=f"zero_bubble {remat} {mesh} ")


def test_routed_experts_are_split_bit_for_bit():
    """The routed experts (grouped matmuls with their own backward) are tapped too: B gives them no
    weight gradient, W the whole backward's to the bit (the same float32 sums in the same order),
    and B's router gradient is the whole backward's."""
    cfg = dataclasses.replace(moe_config(2, 1).model, num_layers=2)
    probe, (whole_dp, _), (b_dp, _), w_dp = _split_grads(cfg)
    assert set(probe.found["moe_blocks"]) == {"attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.experts"}
    for name in ("w_gate", "w_up", "w_down"):
        assert not np.any(np.asarray(b_dp["moe_blocks"]["mlp"][name])), f"B computed {name}'s gradient"
        np.testing.assert_array_equal(w_dp["moe_blocks"]["mlp"][name], whole_dp["moe_blocks"]["mlp"][name])
    np.testing.assert_allclose(b_dp["moe_blocks"]["mlp"]["router"], whole_dp["moe_blocks"]["mlp"]["router"],
                               rtol=SAME_MATH_FP32_RTOL, atol=1e-12)
