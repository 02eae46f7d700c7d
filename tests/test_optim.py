"""The optimizer: weight decay on the weight matrices only, chosen by the logical axis `norm`."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lumen_jax.config import ModelConfig, OptimConfig
from lumen_jax.model import init_params, param_shapes_and_names
from lumen_jax.optim import decay_mask, make_optimizer

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
    params = init_params(MODEL, seed=0)
    opt = OptimConfig(lr=0.1, warmup_steps=0, weight_decay=0.5, grad_clip=0.0, schedule="constant")
    tx = make_optimizer(opt, 10, names)
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zeros, tx.init(params), params)
    for (path, u), p, decays in zip(jax.tree_util.tree_leaves_with_path(updates), jax.tree.leaves(params),
                                    jax.tree.leaves(decay_mask(names))):
        want = -opt.lr * opt.weight_decay * np.asarray(p) if decays else np.zeros_like(p)
        np.testing.assert_allclose(np.asarray(u), want, rtol=1e-6, err_msg=jax.tree_util.keystr(path))
