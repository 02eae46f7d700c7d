"""Multi-token prediction (`model.mtp_depth`) against the DeepSeek-V3 paper's formula written by hand
(section 2.2): objective and gradients; its parameter count and what a pipeline refuses. Trained on meshes
as on one device, `mtp_loss` reported: tests/model/test_deepseek.py (two MoE depths under context
parallelism, ring and all-gather, and on a pipeline)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers.data import packed_batch
from helpers.run import BASE, with_mesh
from helpers.tolerances import FP32_RTOL
from lumen_jax.config import ConfigError
from lumen_jax.config.checks import validate
from lumen_jax.metrics import flops
from lumen_jax.model import abstract_model, init
from lumen_jax.model.transformer import merge
from lumen_jax.model.layers import rope_frequencies

# Latent attention, 2 layers, 2 MTP depths, lambda 0.3.
MTP = BASE.replace(model=dataclasses.replace(
    BASE.model, num_kv_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
    mtp_depth=2, mtp_loss_weight=0.3))


def _ce(x_btd, w_dv, targets_bt):
    logp = jax.nn.log_softmax(jnp.einsum("btd,dv->btv", x_btd, w_dv), axis=-1)
    return -jnp.take_along_axis(logp, targets_bt[..., None], axis=-1)[..., 0]


def paper_objective(model, batch, weight):
    """The main objective plus lambda / D * sum_k L^k, by the paper: depth k runs on the T - k positions
    whose token t_{i+k+1} exists; its input is h^{k-1} there and the embedding of t_{i+k}; a position
    counts when that target is real and in its own document."""
    cfg = model.cfg
    t = batch["inputs"].shape[1]
    seg, mask, targets = batch["segment_ids"], batch["loss_mask"], batch["targets"]
    h = model.run_layers(model.embed[...][batch["inputs"]], batch["positions"], seg)[0]
    w_dv = model.lm_head[...]
    total = jnp.sum(_ce(model.final_norm(h), w_dv, targets) * mask) * weight
    graphdef, state = nnx.split(model.mtp)
    for k in range(1, cfg.mtp_depth + 1):
        mod = nnx.merge(graphdef, jax.tree.map(lambda v: v[k - 1], state))  # noqa: B023
        n = t - k
        emb = model.embed[...][targets[:, k - 1:t - 1]]  # t_{i+k} for i < T - k
        x = jnp.concatenate([mod.hnorm(h[:, :n]), mod.enorm(emb)], axis=-1) @ mod.eh_proj[...]
        h = mod.block(x, batch["positions"][:, :n], seg[:, :n], rope_frequencies(cfg), model.ops)[0]
        counts = mask[:, k:] * (seg[:, k:] == seg[:, :n])
        total = total + cfg.mtp_loss_weight / cfg.mtp_depth * jnp.sum(
            _ce(mod.norm(h), w_dv, targets[:, k:]) * counts) * weight
    return total


_init = jax.jit(init, static_argnums=(0, 1))  # one program (eager, each of its ops compiles on its own)


@pytest.fixture(scope="module")
def setup():
    params, state = _init(MTP.model, 0)
    params = jax.jit(lambda ps: jax.tree.map(  # norms off 1
        lambda p: p + 0.05 * jax.random.normal(jax.random.key(1), p.shape), ps))(params)
    batch = {k: jnp.asarray(v) for k, v in packed_batch(4, 32, MTP.model.vocab_size, seed=3).items()}
    return abstract_model(MTP.model).graphdef, params, state, batch


def test_mtp_objective_and_gradients_equal_the_papers_formula(setup):
    graphdef, params, state, batch = setup
    weight = 1.0 / float(batch["loss_mask"].sum())

    def ours(p):
        return merge(graphdef, p, state).forward_objective(batch, jnp.float32(weight), 0.0)[0]

    def theirs(p):
        return paper_objective(merge(graphdef, p, state), batch, weight)

    # jitted: eager, each of the many small ops compiles on its own (~40 s); one program each is far cheaper
    (got, g_got), (want, g_want) = (jax.jit(jax.value_and_grad(f))(params) for f in (ours, theirs))
    np.testing.assert_allclose(got, want, rtol=FP32_RTOL)
    flat_got, flat_want = jax.tree.leaves(g_got), jax.tree.leaves(g_want)
    for a, b in zip(flat_got, flat_want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=FP32_RTOL * float(jnp.abs(b).max()) + 1e-12)
    assert float(jnp.abs(g_got["mtp"]["eh_proj"]).max()) > 0  # the modules learn


def test_mtp_counts_in_flops_and_what_a_pipeline_refuses():
    m = MTP.model
    off = dataclasses.replace(m, mtp_depth=0)
    params = _init(m, 0)[0]
    assert sum(x.size for x in jax.tree.leaves(params)) == flops.param_counts(m)["total"]
    d, v = m.d_model, m.vocab_size
    layer = flops.param_counts(off)["layer_matmul"]
    assert flops.param_counts(m)["matmul"] - flops.param_counts(off)["matmul"] == 2 * (2 * d * d + layer + d * v)
    with pytest.raises(ConfigError) as e:
        validate(with_mesh(MTP, micro_batches=2, pipeline=2, context=2), 4)
    assert "model.mtp_depth=2 with mesh.pipeline=2 and mesh.context=2" in str(e.value)
    with pytest.raises(ConfigError) as e:  # 16 rows / 2 micro-batches / 8 shards: 1 row, not split over 2 stages
        validate(with_mesh(MTP, micro_batches=2, pipeline=2, fsdp=8), 16)
    assert "each stage runs multi-token prediction on 1/2 of a micro-batch's 1 rows" in str(e.value)
