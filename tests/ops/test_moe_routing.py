"""The MoE layer's routing variants against a per-token float64 reference written from the formulas
(router, group-limited choice, selection bias, renormalisation, scaling, shared experts with and
without their gate), dropless and with capacity; the balance losses on a hand-made routing."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers.tolerances import FP32_RTOL
from lumen_jax.config import ModelConfig, MoeConfig
from lumen_jax.model.moe import MoE
from lumen_jax.ops import moe as moe_ops
from lumen_jax.ops.choice import Ops
from lumen_jax.parallel import expert

E, K, D, F, B, T = 8, 2, 16, 8, 2, 8

# Each released model's routing, and mixtures of the options the released models do not combine.
VARIANTS = {
    "mixtral": dict(router="softmax"),
    "qwen2_moe": dict(router="softmax", normalize_top_k=False, shared_experts=1, shared_gate=True),
    "deepseek_v3": dict(router="sigmoid", routed_scaling=2.5, groups=4, top_groups=2, shared_experts=1,
                        balance="bias"),
    "softmax_groups_bias": dict(router="softmax", groups=2, top_groups=1, balance="bias"),
    "sigmoid_plain_scaled": dict(router="sigmoid", normalize_top_k=False, routed_scaling=1.5),
}


def _swiglu(x, w_gate, w_up, w_down):
    gate, up = x @ w_gate, x @ w_up
    return (gate / (1 + np.exp(-gate)) * up) @ w_down


def _reference(x_nd, p: dict, moe: MoeConfig, bias_e, cap: int):
    """Token by token in float64: scores, the choice (score + bias, from the best groups), the weights
    (scores, renormalised or not, scaled), the chosen experts while they have room, the shared expert."""
    x_nd = np.asarray(x_nd, np.float64)
    f64 = {k: np.asarray(v, np.float64) for k, v in p.items()}
    used = np.zeros(E, int)
    y = np.zeros_like(x_nd)
    per = E // moe.groups
    for n, x in enumerate(x_nd):
        logits = x @ f64["router"]
        if moe.router == "softmax":
            s = np.exp(logits - logits.max())
            s = s / s.sum()
        else:
            s = 1 / (1 + np.exp(-logits))
        c = s + bias_e
        if moe.groups > 1:
            group_score = [np.sort(c[g * per:(g + 1) * per])[-2:].sum() for g in range(moe.groups)]
            allowed = np.argsort(group_score)[::-1][:moe.top_groups]
            c = np.where(np.isin(np.arange(E) // per, allowed), c, -np.inf)
        ids = np.argsort(c)[::-1][:K]
        w = s[ids]
        if moe.normalize_top_k:
            w = w / w.sum()
        w = w * moe.routed_scaling
        for e, weight in zip(ids, w):
            if used[e] < cap:
                used[e] += 1
                y[n] += weight * _swiglu(x, f64["w_gate"][e], f64["w_up"][e], f64["w_down"][e])
        if moe.shared_experts:
            shared = _swiglu(x, f64["shared_gate_w"], f64["shared_up"], f64["shared_down"])
            gate = 1 / (1 + np.exp(-(x @ f64["shared_gate"]))) if moe.shared_gate else 1.0
            y[n] += gate * shared
    return y


def _layer(moe: MoeConfig, seed: int = 0):
    """An MoE layer (fp32) with random weights (a router spread enough that the choice matters), a
    random selection bias when balance=bias; its params as numpy for the reference."""
    cfg = ModelConfig(d_model=D, ffn_dim=F, num_layers=1, compute_dtype="float32", moe=moe)
    with nnx.use_eager_sharding(False):
        layer = MoE(cfg, Ops.plain(cfg), rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    layer.router[...] = jnp.asarray(rng.normal(size=(D, E)) * 2 / math.sqrt(D), jnp.float32)
    for w in (layer.w_gate, layer.w_up, layer.w_down):  # outputs of order 1, so a wrong choice shows
        w[...] = jnp.asarray(rng.normal(size=w.shape) / math.sqrt(w.shape[1]), jnp.float32)
    bias = np.zeros(E)
    if moe.balance == "bias":  # of the size of the score differences, so it changes choices
        bias = rng.normal(size=E) * (0.1 if moe.router == "softmax" else 0.3)
        layer.balance["bias"][...] = jnp.asarray(bias, jnp.float32)
    if moe.shared_gate:
        layer.shared_gate[...] = jnp.asarray(rng.normal(size=D), jnp.float32)
    p = {"router": layer.router[...], "w_gate": layer.w_gate[...], "w_up": layer.w_up[...],
         "w_down": layer.w_down[...]}
    if moe.shared_experts:
        p.update(shared_gate_w=layer.shared.w_gate[...], shared_up=layer.shared.w_up[...],
                 shared_down=layer.shared.w_down[...])
    if moe.shared_gate:
        p["shared_gate"] = layer.shared_gate[...]
    return layer, p, np.asarray(bias, np.float32).astype(np.float64)


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_moe_layer_matches_the_formulas(name, capacity_factor):
    moe = MoeConfig(num_experts=E, top_k=K, expert_ffn_dim=F, capacity_factor=capacity_factor, **VARIANTS[name])
    layer, p, bias = _layer(moe)
    x = jax.random.normal(jax.random.key(1), (B, T, D), jnp.float32)
    graphdef, state = nnx.split(layer)
    y, _ = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x, Ops.plain(ModelConfig(compute_dtype="float32"))))(state, x)
    cap = expert.capacity(B * T, K, E, capacity_factor)
    want = _reference(np.asarray(x).reshape(-1, D), p, moe, bias, cap)
    got = np.asarray(y, np.float64).reshape(-1, D)
    np.testing.assert_allclose(got, want, rtol=FP32_RTOL, atol=FP32_RTOL * np.abs(want).max())
    if moe.balance == "bias":  # the bias changed the choice of some token: the reference without it differs
        assert np.abs(_reference(np.asarray(x).reshape(-1, D), p, moe, 0 * bias, cap) - want).max() > 0.1 * np.abs(want).max()


# Logits of 4 tokens x 4 experts, top-2: tokens choose {0, 1}, {0, 2}, {0, 1}, {3, 0}.
LOGITS = np.array([[4.0, 3, 0, 0], [3, 0, 2, 1], [2, 1, 0, -1], [1, 0, 0, 3]], np.float32)


def _route(logits: np.ndarray, **moe):
    cfg = MoeConfig(num_experts=4, top_k=2, router_z_loss_weight=0.0, **moe)
    return moe_ops.route(jnp.asarray(logits), jnp.eye(4), cfg)


def test_balance_loss_on_a_hand_made_routing_with_top_2():
    """f_i = assignments of expert i / (tokens * top_k): (4, 2, 1, 1) / 8; P_i the mean softmax."""
    ids, _, stats = _route(LOGITS[None])
    assert [set(r) for r in np.asarray(ids)[0].tolist()] == [{0, 1}, {0, 2}, {0, 1}, {3, 0}]
    f = np.array([4, 2, 1, 1]) / 8
    probs = np.exp(LOGITS) / np.exp(LOGITS).sum(-1, keepdims=True)
    np.testing.assert_allclose(stats["fraction"], f)
    np.testing.assert_allclose(stats["load"], [4, 2, 1, 1])
    np.testing.assert_allclose(stats["balance_loss"], 4 * (f * probs.mean(0)).sum(), rtol=FP32_RTOL)
    # uniform probabilities: the loss is sum_i f_i = 1 whatever the (tie-broken) choice
    _, _, uniform = _route(np.zeros((1, 4, 4), np.float32))
    np.testing.assert_allclose(uniform["balance_loss"], 1.0, rtol=FP32_RTOL)


def test_sequence_balance_loss_is_the_mean_of_each_sequence_loss():
    """DeepSeek-V3's sequence-wise loss: f and P of each row, E * sum_i f_i P_i per row, averaged."""
    rows = np.stack([LOGITS, LOGITS[::-1] * np.array([1, -1, 2, 1], np.float32)])  # two different routings
    ids, _, stats = _route(rows)
    want = []
    for r in range(2):
        f = np.zeros(4)
        for e in np.asarray(ids)[r].reshape(-1):
            f[e] += 1 / 8
        p = np.exp(rows[r]) / np.exp(rows[r]).sum(-1, keepdims=True)
        want.append(4 * (f * p.mean(0)).sum())
    assert abs(want[0] - want[1]) > 1e-2  # the rows differ, so the mean of per-row losses is not the batch loss
    np.testing.assert_allclose(stats["sequence_balance_loss"], np.mean(want), rtol=FP32_RTOL)
    _, _, uniform = _route(np.zeros((2, 4, 4), np.float32))
    np.testing.assert_allclose(uniform["sequence_balance_loss"], 1.0, rtol=FP32_RTOL)


def test_aux_loss_weight_enters_the_layer_loss():
    cfg = dict(aux_loss_weight=0.3, sequence_aux_loss_weight=0.7)
    moe = MoeConfig(num_experts=4, top_k=2, router_z_loss_weight=0.0, **cfg)
    _, _, stats = moe_ops.route(jnp.asarray(LOGITS[None]), jnp.eye(4), moe)
    layer_cfg = ModelConfig(d_model=4, ffn_dim=4, compute_dtype="float32", moe=dataclasses.replace(moe, expert_ffn_dim=4))
    w = jnp.ones((4, 4, 4)) * 0.1
    _, aux = moe_ops.moe(jnp.asarray(LOGITS[None]), jnp.eye(4), w, w, w, layer_cfg.moe, Ops.plain(layer_cfg))
    np.testing.assert_allclose(aux["loss"], 0.3 * stats["balance_loss"] + 0.7 * stats["sequence_balance_loss"],
                               rtol=FP32_RTOL)


@pytest.mark.parametrize("name", ["qwen2_moe", "deepseek_v3"])
def test_router_and_shared_gate_gradients_match_the_reference(name):
    """d(sum(y * r))/d(router) (and /d(shared gate)) against central differences of the float64
    reference: the weights' gradient flows through the chosen scores, their normalisation and
    scaling (and the bias's state path leaves it alone)."""
    moe = MoeConfig(num_experts=E, top_k=K, expert_ffn_dim=F, **VARIANTS[name])
    layer, p, bias = _layer(moe)
    x = jax.random.normal(jax.random.key(1), (B, T, D), jnp.float32)
    r = np.asarray(jax.random.normal(jax.random.key(2), (B, T, D)), np.float64)
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    ops = Ops.plain(ModelConfig(compute_dtype="float32"))

    def objective(params):
        y, _ = nnx.merge(graphdef, params, rest)(x, ops)
        return jnp.sum(y * r.astype(np.float32))

    grads = jax.jit(jax.grad(objective))(params)
    x_nd, cap = np.asarray(x).reshape(-1, D), B * T * K
    names = ["router"] + (["shared_gate"] if moe.shared_gate else [])
    for key in names:
        want = np.zeros(p[key].shape)
        for i in np.ndindex(*want.shape):
            values = []
            for step in (1e-4, -1e-4):
                moved = {k: np.asarray(v, np.float64) for k, v in p.items()}
                moved[key][i] += step
                values.append((_reference(x_nd, moved, moe, bias, cap) * r.reshape(-1, D)).sum())
            want[i] = (values[0] - values[1]) / 2e-4
        got = np.asarray(grads[key][...], np.float64)
        np.testing.assert_allclose(got, want, rtol=FP32_RTOL, atol=FP32_RTOL * np.abs(want).max(), err_msg=key)


def test_deepseek_v3_layer_matches_transformers():
    """transformers' DeepseekV3MoE (sigmoid, e_score_correction_bias for the choice, 4 groups keep 2,
    routed_scaling 2.5, one shared expert) against our layer with the same weights and the bias as
    the balance state: equal in float32."""
    import torch
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    e, k = 16, 4
    hf_cfg = DeepseekV3Config(hidden_size=D, moe_intermediate_size=F, n_routed_experts=e, num_experts_per_tok=k,
                              n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                              n_shared_experts=1)
    torch.manual_seed(0)
    theirs = DeepseekV3MoE(hf_cfg).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p) / math.sqrt(D))
        theirs.gate.e_score_correction_bias.copy_(torch.randn(e) * 0.3)
    moe = MoeConfig(num_experts=e, top_k=k, expert_ffn_dim=F, router="sigmoid", groups=4, top_groups=2,
                    routed_scaling=2.5, shared_experts=1, balance="bias")
    cfg = ModelConfig(d_model=D, ffn_dim=F, num_layers=1, compute_dtype="float32", moe=moe)
    with nnx.use_eager_sharding(False):
        ours = MoE(cfg, Ops.plain(cfg), rngs=nnx.Rngs(0))
    t = {n: v.detach().numpy() for n, v in theirs.state_dict().items()}
    gate_up = t["experts.gate_up_proj"]  # [E, 2F, D]: gate rows, then up rows
    ours.router[...] = jnp.asarray(t["gate.weight"].T)
    ours.w_gate[...] = jnp.asarray(gate_up[:, :F].transpose(0, 2, 1))
    ours.w_up[...] = jnp.asarray(gate_up[:, F:].transpose(0, 2, 1))
    ours.w_down[...] = jnp.asarray(t["experts.down_proj"].transpose(0, 2, 1))
    for name in ("gate", "up", "down"):
        getattr(ours.shared, f"w_{name}")[...] = jnp.asarray(t[f"shared_experts.{name}_proj.weight"].T)
    ours.balance["bias"][...] = jnp.asarray(t["gate.e_score_correction_bias"])
    x = np.asarray(jax.random.normal(jax.random.key(3), (B, T, D)), np.float32)
    with torch.no_grad():
        want = theirs(torch.from_numpy(x.copy())).numpy()
    got, _ = ours(jnp.asarray(x), Ops.plain(cfg))
    np.testing.assert_allclose(np.asarray(got), want, rtol=FP32_RTOL, atol=FP32_RTOL * np.abs(want).max())
