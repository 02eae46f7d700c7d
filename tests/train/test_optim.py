"""The optimizer: weight decay on the weight matrices only, chosen by the logical axis `norm`; the
schedules and global-norm clipping against hand-computed values."""

import math

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lumen_jax.config import ModelConfig, OptimConfig
from lumen_jax.model import init_params, param_shapes_and_names
from lumen_jax.train.optim import decay_mask, make_optimizer, schedule

MODEL = ModelConfig(d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=64, vocab_size=64,
                    compute_dtype="float32")


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_no_decay_exactly_on_the_norm_scales(tied):
    cfg = dataclasses.replace(MODEL, tie_embeddings=tied)
    _, _, names = param_shapes_and_names(cfg)
    mask = decay_mask(names)
    flat = {jax.tree_util.keystr(p): m for p, m in jax.tree_util.tree_leaves_with_path(mask)}
    # The rule before the logical names: no decay where a path key says "norm".
    assert flat == {k: "norm" not in k for k in flat}, flat
    assert sorted(k for k, m in flat.items() if not m) == [
        "['blocks']['attn_norm']['scale']", "['blocks']['mlp_norm']['scale']", "['final_norm']['scale']"]


def test_decay_moves_matrices_and_leaves_norms():
    _, _, names = param_shapes_and_names(MODEL)
    params = jax.jit(init_params, static_argnums=(0, 1))(MODEL, 0)  # eager: each op compiled alone
    opt = OptimConfig(lr=0.1, warmup_steps=0, weight_decay=0.5, grad_clip=0.0, schedule="constant")
    tx = make_optimizer(opt, 10, names)
    updates, _ = jax.jit(lambda p: tx.update(jax.tree.map(jnp.zeros_like, p), tx.init(p), p))(params)
    for (path, u), p, decays in zip(jax.tree_util.tree_leaves_with_path(updates), jax.tree.leaves(params),
                                    jax.tree.leaves(decay_mask(names))):
        want = -opt.lr * opt.weight_decay * np.asarray(p) if decays else np.zeros_like(p)
        np.testing.assert_allclose(np.asarray(u), want, rtol=1e-6, err_msg=jax.tree_util.keystr(path))


def _cosine(t: float, n: int, alpha: float) -> float:
    return alpha + (1 - alpha) * 0.5 * (1 + math.cos(math.pi * min(t, n) / n))


@pytest.mark.parametrize("kind, decay_steps", [("cosine", 0), ("linear", 0), ("cosine", 10), ("constant", 0)])
def test_warmup_then_decay_by_hand(kind, decay_steps):
    """lr 2, warmup 4 steps, 12 steps (or decay_steps=10): the decay runs over the steps after the
    warmup and ends at lr * min_lr_ratio, where it stays."""
    cfg = OptimConfig(lr=2.0, warmup_steps=4, min_lr_ratio=0.1, schedule=kind, decay_steps=decay_steps)
    n = (decay_steps or 12) - 4
    by_hand = {
        "cosine": lambda t: 2.0 * _cosine(t, n, 0.1),
        "linear": lambda t: 2.0 + (0.2 - 2.0) * min(t, n) / n,
        "constant": lambda t: 2.0,
    }[kind]
    want = [2.0 * s / 4 for s in range(4)] + [by_hand(s - 4) for s in range(4, 16)]
    got = [float(schedule(cfg, 12)(s)) for s in range(16)]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_no_warmup_starts_at_lr():
    cfg = OptimConfig(lr=2.0, warmup_steps=0, min_lr_ratio=0.1)
    np.testing.assert_allclose([float(schedule(cfg, 8)(s)) for s in (0, 4, 8)],
                               [2.0, 2.0 * _cosine(4, 8, 0.1), 0.2], rtol=1e-6)


def test_global_norm_clipping_then_adam_by_hand():
    """Two steps of clip(1.0) + Adam (no decay, constant lr): the first gradient's global norm is 5
    (over both leaves: a per-leaf clip would differ) and is scaled to 1, the second's (0.3) is kept.
    Adam's first step alone would hide a clip (it divides by |g|); its second does not."""
    cfg = OptimConfig(lr=0.1, warmup_steps=0, weight_decay=0.0, grad_clip=1.0, schedule="constant",
                      b1=0.9, b2=0.95, eps=1e-8)
    params = {"a": jnp.zeros(2), "b": jnp.zeros(1)}
    tx = make_optimizer(cfg, 10, {"a": ("embed",), "b": ("embed",)})
    g1 = {"a": np.array([3.0, 0.0]), "b": np.array([4.0])}
    g2 = {"a": np.array([0.1, 0.2]), "b": np.array([-0.2])}
    state = tx.init(params)
    _, state = tx.update(jax.tree.map(jnp.asarray, g1), state, params)
    u2, _ = tx.update(jax.tree.map(jnp.asarray, g2), state, params)
    for k in ("a", "b"):
        c1 = g1[k] / 5.0  # clipped to global norm 1
        m = 0.9 * 0.1 * c1 + 0.1 * g2[k]
        v = 0.95 * 0.05 * c1 ** 2 + 0.05 * g2[k] ** 2
        want = -0.1 * (m / (1 - 0.9 ** 2)) / (np.sqrt(v / (1 - 0.95 ** 2)) + 1e-8)
        np.testing.assert_allclose(np.asarray(u2[k]), want, rtol=1e-5, err_msg=k)
