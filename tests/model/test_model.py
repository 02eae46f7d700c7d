"""Model numerics: attention vs a naive reference, RoPE, document masking, remat, tied embeddings,
float16 dynamic loss scaling, bfloat16 training and z-loss."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers.data import packed_batch
from helpers.meshes import one_device_mesh
from helpers.run import BASE, assert_same_run, run, with_mesh
from helpers.tolerances import BF16_RTOL, FP32_RTOL, assert_tree_close
from lumen_jax.train import step as step_lib
from lumen_jax.train.build import build
from lumen_jax.config import Config, ModelConfig, OptimConfig
from lumen_jax.metrics.flops import param_counts
from lumen_jax.model import apply, init_params, param_shapes_and_names
from lumen_jax.model.layers import apply_rope, rope_frequencies
from lumen_jax.ops.reference import reference
from lumen_jax.train.optim import make_optimizer, schedule


TINY = ModelConfig(d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=64, vocab_size=64,
                   compute_dtype="float32")


def batch_for(cfg: Config, seed: int = 0) -> dict:
    return packed_batch(cfg.data.global_batch_size, cfg.data.seq_len, cfg.model.vocab_size, seed=seed)


# --------------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------------

def naive_attention(q, k, v, segment_ids, causal, return_lse=False):
    """float64 numpy attention that repeats each K/V head for its group of query heads
    (with `return_lse`, also each row's log-sum-exp of the scaled scores, [B, N, T])."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, n, h = q.shape
    k = np.repeat(k, n // k.shape[2], axis=2)  # head i uses kv head i // (n // K)
    v = np.repeat(v, n // v.shape[2], axis=2)
    scores = np.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(h)
    mask = np.ones((b, t, t), bool)
    if causal:
        mask &= np.tril(np.ones((t, t), bool))[None]
    if segment_ids is not None:
        mask &= segment_ids[:, :, None] == segment_ids[:, None, :]
    scores = np.where(mask[:, None], scores, -np.inf)
    top = scores.max(-1, keepdims=True)
    probs = np.exp(scores - top)
    total = probs.sum(-1, keepdims=True)
    out = np.einsum("bnts,bsnh->btnh", probs / total, v)
    return (out, (top + np.log(total))[..., 0]) if return_lse else out


def attention_inputs(num_kv_heads: int, seed: int = 0, b: int = 2, t: int = 16, n: int = 4, h: int = 8):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, t, n, h)).astype(np.float32)
    k = rng.standard_normal((b, t, num_kv_heads, h)).astype(np.float32)
    v = rng.standard_normal((b, t, num_kv_heads, h)).astype(np.float32)
    seg = packed_batch(b, t, 16, seed=seed + 1)["segment_ids"]
    return q, k, v, seg


@pytest.mark.parametrize("ratio", [1, 2, 4])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("segments", [False, True])
def test_reference_attention_matches_naive_fp32(ratio, causal, segments):
    n = 4
    q, k, v, seg = attention_inputs(n // ratio, seed=ratio)
    seg = seg if segments else None
    got, lse = jax.jit(reference, static_argnames="causal")(q, k, v, segment_ids_bt=seg, causal=causal)
    assert got.dtype == jnp.float32 and got.shape == q.shape and lse.shape == (2, n, 16)
    want, want_lse = naive_attention(q, k, v, seg, causal, return_lse=True)
    assert_tree_close(got, want, FP32_RTOL)
    assert_tree_close(lse, want_lse, FP32_RTOL)


def test_segments_actually_mask():
    # Guard for the test above: the packed rows really have several documents, so masking matters.
    q, k, v, seg = attention_inputs(2, seed=2)
    assert max(len(np.unique(row)) for row in seg) >= 2
    with_seg = naive_attention(q, k, v, seg, True)
    without = naive_attention(q, k, v, None, True)
    assert np.abs(with_seg - without).max() > 0.1


@pytest.mark.parametrize("ratio", [1, 4])
@pytest.mark.parametrize("segments", [False, True])
def test_reference_attention_bf16(ratio, segments):
    q, k, v, seg = attention_inputs(4 // ratio, seed=10 + ratio)
    seg = seg if segments else None
    qb, kb, vb = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    got = jax.jit(lambda *a, **kw: reference(*a, **kw)[0])(qb, kb, vb, segment_ids_bt=seg)
    assert got.dtype == jnp.bfloat16
    # Reference in float64 from the same (bf16-rounded) inputs: only the kernel's rounding is measured.
    ref = naive_attention(*(np.asarray(x, np.float32) for x in (qb, kb, vb)), seg, True)
    assert_tree_close(np.asarray(got, np.float32), ref, BF16_RTOL)


# --------------------------------------------------------------------------------------------------
# RoPE
# --------------------------------------------------------------------------------------------------

def test_apply_rope_preserves_norms():
    cfg = dataclasses.replace(TINY, head_dim=16)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 40, 3, 16)).astype(np.float32)
    pos = np.tile(np.arange(40, dtype=np.int32), (2, 1))
    y = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(pos), rope_frequencies(cfg)))
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=FP32_RTOL)
    # Position 0 is the identity; later positions really rotate.
    np.testing.assert_allclose(y[:, 0], x[:, 0], rtol=FP32_RTOL, atol=FP32_RTOL)
    assert np.abs(y[:, 1:] - x[:, 1:]).max() > 0.1


@pytest.mark.parametrize("scaling", ["none", "llama3"])
def test_apply_rope_relative_positions(scaling):
    # Small rope_original_max_len so llama3 scaling touches some of the 8 frequencies of head_dim 16.
    cfg = dataclasses.replace(TINY, head_dim=16, rope_theta=10_000.0, rope_scaling=scaling,
                              rope_original_max_len=64)
    inv_freq = rope_frequencies(cfg)
    rng = np.random.default_rng(1)
    q = rng.standard_normal(16).astype(np.float32)
    k = rng.standard_normal(16).astype(np.float32)

    def dot(m: int, n: int) -> float:  # rope(q at m) . rope(k at n)
        x = jnp.asarray(np.stack([q, k]))[None, :, None, :]  # [1, 2, 1, H]
        y = np.asarray(apply_rope(x, jnp.asarray([[m, n]], jnp.int32), inv_freq), np.float64)
        return float(y[0, 0, 0] @ y[0, 1, 0])

    atol = FP32_RTOL * float(np.linalg.norm(q) * np.linalg.norm(k))
    for offset in (0, 1, 5, 17):
        base = dot(offset, 0)
        for m in (offset + 3, offset + 20, offset + 41):
            assert abs(dot(m, m - offset) - base) <= atol, (offset, m)
    # ... and it does depend on the offset (else the check above proves nothing).
    assert abs(dot(5, 0) - dot(0, 0)) > 100 * atol


def llama31_scaled_frequencies(head_dim, theta, factor, low_freq_factor, high_freq_factor, old_len):
    """Meta's `apply_scaling` (llama3.1 reference code), in float64 Python."""
    freqs = [1.0 / theta ** (i / head_dim) for i in range(0, head_dim, 2)]
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            out.append(freq)
        elif wavelen > low_freq_wavelen:
            out.append(freq / factor)
        else:
            smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(freqs), np.array(out)


def test_rope_frequencies_llama3_scaling():
    # Llama 3.1 8B's numbers: head_dim 128, theta 5e5, factor 8, low 1, high 4, original length 8192.
    cfg = dataclasses.replace(TINY, d_model=512, num_heads=4, head_dim=128, rope_theta=500_000.0,
                              rope_scaling="llama3", rope_scaling_factor=8.0, rope_low_freq_factor=1.0,
                              rope_high_freq_factor=4.0, rope_original_max_len=8192)
    base, expected = llama31_scaled_frequencies(128, 500_000.0, 8.0, 1.0, 4.0, 8192)
    got = np.asarray(rope_frequencies(cfg), np.float64)
    np.testing.assert_allclose(got, expected, rtol=FP32_RTOL)
    unscaled = np.asarray(rope_frequencies(dataclasses.replace(cfg, rope_scaling="none")), np.float64)
    np.testing.assert_allclose(unscaled, base, rtol=FP32_RTOL)

    wavelen = 2 * math.pi / base
    high, low = wavelen < 8192 / 4.0, wavelen > 8192 / 1.0
    mid = ~high & ~low
    assert high.sum() and low.sum() and mid.sum(), "all three regimes must be exercised"
    np.testing.assert_allclose(got[high], base[high], rtol=FP32_RTOL)  # high frequencies unchanged
    np.testing.assert_allclose(got[low], base[low] / 8.0, rtol=FP32_RTOL)  # low frequencies / factor
    # In between: strictly between the two, and the scaled frequencies still fall monotonically.
    assert np.all(got[mid] < base[mid]) and np.all(got[mid] > base[mid] / 8.0)
    assert np.all(np.diff(got) < 0)


# --------------------------------------------------------------------------------------------------
# Document masking through the whole model
# --------------------------------------------------------------------------------------------------

def test_packed_document_logits_equal_document_alone():
    graphdef, _, _ = param_shapes_and_names(TINY)
    params = jax.jit(init_params, static_argnums=(0, 1))(TINY, 3)  # eager: each op compiled alone
    forward = jax.jit(lambda p, t, pos, seg: apply(graphdef, p, t, pos, seg))
    rng = np.random.default_rng(0)
    lengths = (7, 11, 6)  # three documents packed in one row of 24
    tokens = rng.integers(0, TINY.vocab_size, sum(lengths)).astype(np.int32)
    seg = np.concatenate([np.full(n, i + 1, np.int32) for i, n in enumerate(lengths)])
    pos = np.concatenate([np.arange(n, dtype=np.int32) for n in lengths])
    packed = np.asarray(forward(params, tokens[None], pos[None], seg[None]))[0]
    for i, n in enumerate(lengths):
        lo = sum(lengths[:i])
        alone = np.asarray(forward(params, tokens[None, lo:lo + n], pos[None, :n],
                                   np.ones((1, n), np.int32)))[0]
        assert_tree_close(packed[lo:lo + n], alone, FP32_RTOL, what=f"document {i + 1} ")
    # Without segment ids document 2 sees document 1, and its logits change.
    lo, n = lengths[0], lengths[1]
    leaky = np.asarray(forward(params, tokens[None], pos[None], None))[0]
    assert np.abs(leaky[lo:lo + n] - packed[lo:lo + n]).max() > 1e-3


# --------------------------------------------------------------------------------------------------
# Remat, tied embeddings (through the builder, one device)
# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def remat_reference():
    return run(with_mesh(BASE), devices=jax.devices()[:1])


# dots_with_no_batch_dims_saveable: with the flash kernel, tests/ops/test_sliding_window.py's
# test_a_window_trains_with_our_kernel_as_with_the_reference (the same policy, the kernel's residuals kept
# too; was this file's test_flash_kept_by_the_remat_policy_gives_the_same_losses_and_grads).
# The selective policies (named projections): save_qkv_proj recomputes o, gate and up, save_dot_except_mlpwi_1
# up alone; save_dot_except_mlpwi (gate and up) runs on tensor=2 with sequence parallelism below.
@pytest.mark.parametrize("policy", ["full", "dots_saveable", "save_attention_out", "offload_dots", "save_qkv_proj",
                                    "save_dot_except_mlpwi_1"])
def test_remat_policies_same_losses_and_grads(policy, remat_reference):
    assert BASE.model.remat == "none"
    cfg = BASE.replace(model=dataclasses.replace(BASE.model, remat=policy))
    got = run(with_mesh(cfg), devices=jax.devices()[:1])
    assert np.all(np.diff(remat_reference["losses"]) < 0), remat_reference["losses"]
    assert_same_run(got, remat_reference, f"remat={policy}")


@pytest.mark.heavy
def test_selective_remat_with_sequence_parallel_tensor_matches_one_device(remat_reference):
    """remat=save_dot_except_mlpwi on fsdp=4 x tensor=2 with sequence parallelism (its named projections
    sharded, the recomputed gate and up behind the gathered MLP input) gives one device's remat=none run."""
    cfg = BASE.replace(model=dataclasses.replace(BASE.model, remat="save_dot_except_mlpwi"))
    got = run(with_mesh(cfg, fsdp=4, tensor=2, sequence_parallel=True))
    assert_same_run(got, remat_reference, "remat=save_dot_except_mlpwi fsdp=4,tensor=2,sp")


def test_tied_embeddings_have_no_lm_head_and_train():
    cfg = BASE.replace(model=dataclasses.replace(BASE.model, tie_embeddings=True))
    _, shapes, _ = param_shapes_and_names(cfg.model)
    assert "lm_head" not in shapes and "embed" in shapes
    untied = param_shapes_and_names(BASE.model)[1]
    assert "lm_head" in untied
    count = lambda tree: sum(math.prod(x.shape) for x in jax.tree.leaves(tree))  # noqa: E731
    assert count(shapes) == param_counts(cfg.model)["total"]
    assert count(untied) - count(shapes) == cfg.model.d_model * cfg.model.vocab_size

    trainer = build(with_mesh(cfg), one_device_mesh())
    state = trainer.init()
    assert "lm_head" not in state.params
    batch = trainer.shard_batch(batch_for(cfg))
    losses = []
    for i in range(4):  # one program: the step that also returns its gradients
        state, m, grads = trainer.step_and_grads(state, batch)
        losses.append(float(m["loss"]))
        assert int(m["skipped"]) == 0
        if i == 0:  # the embedding gets gradients from both the lookup and the logits
            assert float(jnp.abs(grads["embed"]).max()) > 0
    # Tied, the table is the output projection too: at init the loss is near ln(V), as untied (an
    # N(0, 1) table gives logits of std sqrt(d_model): a loss of 56 here, 1,300 for llama3_1b).
    loss0 = losses[0]
    assert abs(loss0 - math.log(cfg.model.vocab_size)) < 0.05 * math.log(cfg.model.vocab_size), loss0
    assert np.all(np.diff(losses) < 0), losses


# --------------------------------------------------------------------------------------------------
# float16 dynamic loss scaling, bfloat16
# --------------------------------------------------------------------------------------------------

GROWTH_INTERVAL = 2


@pytest.fixture(scope="module")
def fp16_trainer():
    cfg = BASE.replace(model=dataclasses.replace(BASE.model, compute_dtype="float16"),
                       optim=dataclasses.replace(BASE.optim, loss_scale_init=2.0 ** 10,
                                                 loss_scale_growth_interval=GROWTH_INTERVAL))
    trainer = build(with_mesh(cfg), one_device_mesh())
    assert trainer.step_cfg.dynamic_loss_scale
    return trainer, trainer.shard_batch(batch_for(cfg))


def with_loss_scale(trainer, state, scale: float):
    return state.replace(loss_scale=jax.device_put(jnp.float32(scale),
                                                   trainer.state_shardings.loss_scale))


def test_fp16_overflow_skips_update_and_halves_scale(fp16_trainer):
    trainer, batch = fp16_trainer
    state = trainer.init()
    assert float(state.loss_scale) == 2.0 ** 10  # optim.loss_scale_init
    state = with_loss_scale(trainer, state, 1e30)  # the float16 backward overflows
    copy = lambda tree: jax.tree.map(lambda x: np.array(x, copy=True), tree)  # noqa: E731
    before = copy(state)  # the step donates its state: keep a host copy, not a view
    state, m = trainer.step(state, batch)
    after = copy(state)
    assert int(m["skipped"]) == 1
    assert not np.isfinite(float(m["grad_norm"]))
    assert float(m["loss_scale"]) == np.float32(1e30)
    assert float(after.loss_scale) == np.float32(1e30) / 2
    assert int(after.good_steps) == 0
    assert int(after.step) == int(before.step) + 1
    for what in ("params", "opt_state"):
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(getattr(after, what)),
                                jax.tree.leaves(getattr(before, what))):
            np.testing.assert_array_equal(a, b, err_msg=f"{what}{jax.tree_util.keystr(path)} changed")


def test_fp16_scale_grows_after_interval_and_trains(fp16_trainer):
    trainer, batch = fp16_trainer
    state = trainer.init()
    scales, goods, losses, norms = [], [], [], []
    for _ in range(5):
        state, m = trainer.step(state, batch)
        assert int(m["skipped"]) == 0
        scales.append(float(m["loss_scale"]))  # the scale the step ran with
        goods.append(int(state.good_steps))
        losses.append(float(m["loss"]))
        norms.append(float(m["grad_norm"]))
    s = 2.0 ** 10
    assert scales == [s, s, 2 * s, 2 * s, 4 * s]
    assert goods == [1, 0, 1, 0, 1]
    assert float(state.loss_scale) == 4 * s
    assert np.all(np.diff(losses) < 0), losses

    # Gradients are unscaled: another scale (not a power of two, so scaling is not exact in float16)
    # gives the same first-step gradient norm to float16 precision, and the same loss exactly: the
    # forward never sees the scale.
    state = with_loss_scale(trainer, trainer.init(), 3000.0)
    _, m = trainer.step(state, batch)
    assert float(m["loss"]) == losses[0]
    # measured: 1.3e-5 relative; bound: float16's epsilon (the rounding of each scaled gradient)
    np.testing.assert_allclose(float(m["grad_norm"]), norms[0], rtol=float(np.finfo(np.float16).eps))


def test_bfloat16_trains():
    cfg = BASE.replace(model=dataclasses.replace(BASE.model, compute_dtype="bfloat16"))
    trainer = build(with_mesh(cfg), one_device_mesh())
    assert not trainer.step_cfg.dynamic_loss_scale
    state = trainer.init()
    assert float(state.loss_scale) == 1.0
    batch = trainer.shard_batch(batch_for(cfg))
    losses = []
    for _ in range(5):
        state, m = trainer.step(state, batch)
        assert int(m["skipped"]) == 0
        losses.append(float(m["loss"]))
    assert float(state.loss_scale) == 1.0
    assert np.all(np.diff(losses) < 0), losses
    assert losses[-1] < 0.95 * losses[0], losses
    # Parameters stay float32 master weights.
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))


# --------------------------------------------------------------------------------------------------
# z-loss
# --------------------------------------------------------------------------------------------------

def test_z_loss_gradients():
    graphdef, _, names = param_shapes_and_names(TINY)
    params = jax.jit(init_params, static_argnums=(0, 1))(TINY, 0)  # eager: each op compiled alone
    batch = {k: jnp.asarray(v) for k, v in packed_batch(4, 16, TINY.vocab_size, seed=5).items()}
    opt = OptimConfig()
    tx = make_optimizer(opt, 10, names)

    def step_grads(z: float):
        sc = step_lib.StepConfig(graphdef=graphdef, tx=tx, lr_schedule=schedule(opt, 10), z_loss=z)
        return jax.jit(lambda p, b: step_lib.loss_and_grads(p, b, jnp.float32(1.0), sc))(params, batch)

    @jax.jit  # z traced: one program for both
    def manual(params: dict, z: jax.Array):
        def objective(p):
            logits = apply(graphdef, p, batch["inputs"], batch["positions"], batch["segment_ids"])
            mask = batch["loss_mask"]
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
            log_z = jax.nn.logsumexp(logits, axis=-1)
            return ((ce + z * log_z ** 2) * mask).sum() / mask.sum(), (ce * mask).sum() / mask.sum()
        return jax.grad(objective, has_aux=True)(params)

    z = 1e-2
    loss0, grads0 = step_grads(0.0)
    loss_z, grads_z = step_grads(z)
    ref_grads0, ref_ce = manual(params, jnp.float32(0.0))
    ref_grads_z, _ = manual(params, jnp.float32(z))
    # z_loss=0 is plain cross-entropy; z_loss>0 adds exactly z*log(Z)^2 per token.
    assert_tree_close(grads0, ref_grads0, FP32_RTOL, what="z_loss=0 ")
    assert_tree_close(grads_z, ref_grads_z, FP32_RTOL, what=f"z_loss={z} ")
    # The reported loss is the cross-entropy alone, with or without z-loss.
    np.testing.assert_allclose(float(loss0), float(ref_ce), rtol=FP32_RTOL)
    np.testing.assert_allclose(float(loss_z), float(ref_ce), rtol=FP32_RTOL)
    # And the z-loss term really moves the gradients.
    diff = optax.tree.norm(jax.tree.map(jnp.subtract, grads_z, grads0))
    assert diff > 1e-3 * optax.tree.norm(grads0), diff
