"""fp8 training: quantization error and saturation per format, the scale logic of each recipe, the
custom VJP against fp32/bf16 dots, the model and train step with each recipe (loss against bf16,
first/last layers kept), delayed-scaling state across a checkpoint and a reshard, the HLO check.

Tolerances come from the formats: round-to-nearest loses at most half an ulp, a relative
u = 2**-(mantissa bits + 1), plus half the smallest subnormal (divided by the scale) for values that
land below the normal range."""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from helpers.run import FAST_RUN
from lumen_jax.ops import fp8

FORMATS = [fp8.E4M3, fp8.E5M2]


def _u(dtype) -> float:
    return 2.0 ** -(ml_dtypes.finfo(dtype).nmant + 1)


def _sub(dtype) -> float:
    return float(ml_dtypes.finfo(dtype).smallest_subnormal)


# --------------------------------------------------------------------------------------------------
# Quantization
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FORMATS, ids=["e4m3", "e5m2"])
def test_round_trip_error_within_the_format_bound_over_many_magnitudes(dtype):
    rng = np.random.default_rng(0)
    for exponent in range(-12, 13, 2):
        x = (rng.standard_normal((64, 96)) * 10.0 ** exponent).astype(np.float32)
        scale = fp8.compute_scale(fp8.amax(x), dtype)
        q = fp8.quantize(x, scale, dtype)
        assert q.dtype == dtype
        back = np.asarray(fp8.dequantize(q, scale))
        bound = _u(dtype) * np.abs(x) * (1 + 1e-6) + 0.5 * _sub(dtype) / float(scale)
        assert np.all(np.abs(back - x) <= bound), f"magnitude 1e{exponent}"
        assert np.max(np.abs(back)) == pytest.approx(np.max(np.abs(x)), rel=_u(dtype))  # amax -> fp8 max


@pytest.mark.parametrize("dtype", FORMATS, ids=["e4m3", "e5m2"])
def test_out_of_range_values_saturate_instead_of_inf(dtype):
    big = fp8.fp8_max(dtype)
    x = jnp.array([0.5, -1.0, 3.0, -1e30, 1e30, np.inf, -np.inf, 2 * big, -3 * big], jnp.float32)
    q = np.asarray(fp8.quantize(x, jnp.float32(big), dtype).astype(jnp.float32))  # scale for amax 1
    assert np.all(np.isfinite(q))
    np.testing.assert_array_equal(q[2:], [big, -big, big, big, -big, big, -big])
    assert np.isnan(np.asarray(fp8.quantize(jnp.array([np.nan]), 1.0, dtype).astype(jnp.float32)))[0]


def test_compute_scale():
    m4, m5 = fp8.fp8_max(fp8.E4M3), fp8.fp8_max(fp8.E5M2)
    assert (m4, m5) == (448.0, 57344.0)
    got = np.asarray(fp8.compute_scale(jnp.array([2.0, m4, 0.0, np.inf, np.nan, 1e-37]), fp8.E4M3))
    np.testing.assert_array_equal(got[:5], [m4 / 2, 1.0, 1.0, 1.0, 1.0])
    assert np.isfinite(got[5]) and got[5] > 1e30  # not inf: amax is floored
    assert float(fp8.compute_scale(4.0, fp8.E5M2)) == m5 / 4


def test_delayed_scale_and_history():
    h = jnp.zeros((4,), jnp.float32)
    # First step: the history is empty, so the current amax sets the scale.
    assert float(fp8.delayed_scale(h, jnp.float32(2.0), fp8.E4M3)) == np.float32(448.0) / np.float32(2)
    h = fp8.update_history(h, jnp.float32(2.0))
    np.testing.assert_array_equal(h, [2, 0, 0, 0])
    for a in (5.0, 1.0, 3.0):
        h = fp8.update_history(h, jnp.float32(a))
    np.testing.assert_array_equal(h, [3, 1, 5, 2])
    # Later steps: the max of the history, whatever the current amax (delayed).
    assert float(fp8.delayed_scale(h, jnp.float32(100.0), fp8.E4M3)) == np.float32(448.0) / np.float32(5)
    h = fp8.update_history(h, jnp.float32(0.5))
    np.testing.assert_array_equal(h, [0.5, 3, 1, 5])  # the oldest (2) dropped out
    np.testing.assert_array_equal(fp8.update_history(h, 4.0), [4, 0.5, 3, 1])  # 5 dropped: scale grows
    assert float(fp8.delayed_scale(fp8.update_history(h, 4.0), 0.0, fp8.E4M3)) == np.float32(448.0) / np.float32(4)


def test_blockwise_scales_per_tile_and_block():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 300)).astype(np.float32)  # 300: two full tiles and a padded one
    x[1, 128:256] *= 1000.0
    q, s = fp8.quantize_blocks(jnp.asarray(x), (1, 128), fp8.E4M3)
    assert q.shape == x.shape and q.dtype == fp8.E4M3 and s.shape == (3, 3)
    tiles = [np.abs(x[:, i:i + 128]).max(axis=1) for i in (0, 128, 256)]
    np.testing.assert_allclose(s, 448.0 / np.stack(tiles, axis=1), rtol=1e-6)
    back = np.asarray(fp8.dequantize_blocks(q, s, (1, 128), jnp.float32))
    assert np.all(np.abs(back - x) <= _u(fp8.E4M3) * np.abs(x) * (1 + 1e-6) + 0.5 * _sub(fp8.E4M3) / s.min())
    w = rng.standard_normal((256, 172)).astype(np.float32)
    w[128:, :128] *= 1e-3
    _, sw = fp8.quantize_blocks(jnp.asarray(w), (128, 128), fp8.E4M3)
    assert sw.shape == (2, 2)
    np.testing.assert_allclose(sw[1, 0], 448.0 / np.abs(w[128:, :128]).max(), rtol=1e-6)


# --------------------------------------------------------------------------------------------------
# The quantized dot and its VJP
# --------------------------------------------------------------------------------------------------

def _operands(seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k[0], (4, 32, 64), jnp.float32)
    w = 0.05 * jax.random.normal(k[1], (64, 96), jnp.float32)
    r = jax.random.normal(k[2], (4, 32, 96), jnp.float32) * 1e-3  # upstream gradient, small like a loss's
    return x, w, r


def _bound(a, b, fa, fb, contract):
    """Elementwise error bound of contract(a, b) with a quantized to format fa and b to fb (per-tensor
    scales fp8_max / amax; block scales are only finer): half an ulp of each operand, relative, plus
    half a subnormal step for the operands' smallest values, plus fp32 accumulation."""
    step_a = 0.5 * _sub(fa) * fp8.amax(a) / fp8.fp8_max(fa)
    step_b = 0.5 * _sub(fb) * fp8.amax(b) / fp8.fp8_max(fb)
    return ((_u(fa) + _u(fb) + _u(fa) * _u(fb) + 1e-5) * contract(jnp.abs(a), jnp.abs(b))
            + step_a * contract(jnp.ones_like(a), jnp.abs(b)) + step_b * contract(jnp.abs(a), jnp.ones_like(b)))


@pytest.mark.parametrize("recipe", ["current", "delayed", "blockwise"])
def test_forward_and_gradients_within_the_format_bounds(recipe):
    x, w, r = _operands()
    hist = {k: jnp.zeros((8,), jnp.float32) for k in fp8.HISTORY_KEYS}

    def loss(fn, x, w):
        return jnp.sum(fn(x, w) * r)

    fp8_fn = lambda x, w: fp8.dot(x, w, recipe, hist)  # noqa: E731
    ref_fn = lambda x, w: jnp.einsum("btk,kn->btn", x, w, precision="highest")  # noqa: E731
    y, y_ref = fp8_fn(x, w), ref_fn(x, w)
    (dx, dw), (dx_ref, dw_ref) = (jax.grad(loss, argnums=(1, 2))(f, x, w) for f in (fp8_fn, ref_fn))
    e4, e5, u4, u5 = fp8.E4M3, fp8.E5M2, _u(fp8.E4M3), _u(fp8.E5M2)
    hi = dict(precision="highest")
    fwd = lambda a, b: jnp.einsum("btk,kn->btn", a, b, **hi)  # noqa: E731
    dgrad = lambda g, b: jnp.einsum("btn,kn->btk", g, b, **hi)  # noqa: E731
    wgrad = lambda a, g: jnp.einsum("btk,btn->kn", a, g, **hi)  # noqa: E731
    assert jnp.all(jnp.abs(y - y_ref) <= _bound(x, w, e4, e4, fwd))
    assert jnp.all(jnp.abs(dx - dx_ref) <= _bound(r, w, e5, e4, dgrad))
    assert jnp.all(jnp.abs(dw - dw_ref) <= _bound(x, r, e4, e5, wgrad))
    # And against the bf16 dot the model would otherwise run: relative (Frobenius) error below the
    # two operands' half-ulps.
    bf = lambda x, w: jnp.einsum("btk,kn->btn", x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),  # noqa: E731
                                 preferred_element_type=jnp.float32)
    dx_bf, dw_bf = jax.grad(loss, argnums=(1, 2))(bf, x, w)
    rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))  # noqa: E731
    assert rel(y, bf(x, w)) < 2 * u4
    assert rel(dx, dx_bf) < u4 + u5 and rel(dw, dw_bf) < u4 + u5


def test_delayed_dot_emits_updated_histories_as_their_gradient():
    x, w, r = _operands(1)
    hist = {"x": jnp.array([7.0, 0, 0]), "w": jnp.zeros(3), "g": jnp.array([1e-9, 2e-9, 0])}
    y, vjp = jax.vjp(lambda x, w, h: fp8.dot(x, w, "delayed", h), x, w, hist)
    _, _, new = vjp(r)
    np.testing.assert_allclose(new["x"], [fp8.amax(x), 7.0, 0.0])
    np.testing.assert_allclose(new["w"], [fp8.amax(w), 0.0, 0.0])
    np.testing.assert_allclose(new["g"], [fp8.amax(r), 1e-9, 2e-9])
    # The forward used the history's scale for x (7 > amax: coarser than current scaling), the
    # current amax for w (empty history): it equals quantizing with those scales by hand.
    sx, sw = 448.0 / 7.0, fp8.compute_scale(fp8.amax(w), fp8.E4M3)
    by_hand = jnp.einsum("btk,kn->btn", fp8.quantize(x, sx, fp8.E4M3).astype(jnp.float32),
                         fp8.quantize(w, sw, fp8.E4M3).astype(jnp.float32)) / (sx * sw)
    np.testing.assert_allclose(y, by_hand, rtol=1e-5, atol=1e-5 * float(jnp.abs(by_hand).max()))


def test_projections_reading_one_input_share_its_delayed_scale():
    """`einsum(..., peers=)`: q, k and v (gate and up) scale their common input from the max of
    their x histories, one scale, so the compiled program quantizes it once (without peers, three
    times); each projection's next x history still records its own (rolled) history and this x's
    amax, with no gradient into its peers'. Checked against the quantized dot written by hand."""
    x = jax.random.normal(jax.random.key(0), (4, 16, 32), jnp.float32)
    ws = [jax.random.normal(jax.random.key(i), (32, 24), jnp.float32) for i in (1, 2, 3)]
    h = lambda *v: jnp.array(v + (0.0,) * (4 - len(v)), jnp.float32)  # noqa: E731
    states = [{"x": h(2.0), "w": h(3.0), "g": h(1.0)}, {"x": h(0.0, 5.0), "w": h(4.0), "g": h(1.0)},
              {"x": h(1.0, 1.0, 1.0), "w": h(5.0), "g": h(1.0)}]

    def run(x, states, share=True):
        return [fp8.einsum("btd,dn->btn", x, w, "delayed", s, None, tuple(states) if share else None)
                for w, s in zip(ws, states)]

    ys, back = jax.vjp(run, x, states)
    m = fp8.fp8_max(fp8.E4M3)
    e4m3 = lambda a: np.clip(a, -m, m).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)  # noqa: E731
    sx = np.float32(m / 5.0)  # the max of the three x histories
    for y, w, st in zip(ys, ws, states):
        sw = np.float32(m) / np.float32(np.max(st["w"]))
        want = e4m3(np.asarray(x) * sx) @ e4m3(np.asarray(w) * sw) / (sx * sw)
        np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    new = back([jnp.ones_like(y) for y in ys])[1]
    ax = float(jnp.max(jnp.abs(x)))
    for got, st in zip(new, states):
        np.testing.assert_array_equal(got["x"], np.concatenate([[ax], np.asarray(st["x"])[:-1]]))
    count = lambda share: len(re.findall(r"= f8e4m3fn\[4,16,32\]\S* convert", jax.jit(  # noqa: E731
        lambda x, s: run(x, s, share)).lower(x, states).compile().as_text()))
    assert (count(True), count(False)) == (1, 3)


def _after_amax(jaxpr: Any, tainted: list[bool] | None = None) -> tuple[int, list[bool]]:
    """(fp8 casts of `jaxpr` that depend on an amax (a max of `abs`): quantizations that wait for a
    pass over their operand before they can run, whether each output depends on one), through the
    jaxprs nested in call-like equations (jit, custom VJP, remat, scan)."""
    from jax.extend.core import Literal, jaxprs_in_params
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    flags = dict(zip(jaxpr.invars, tainted or [False] * len(jaxpr.invars)))
    count, magnitudes = 0, set()  # magnitudes: `abs` results, whose max is an amax (a history's max is not)
    for eqn in jaxpr.eqns:
        ins = [False if isinstance(v, Literal) else flags.get(v, False) for v in eqn.invars]
        subs = list(jaxprs_in_params(eqn.params))
        amax_here = eqn.primitive.name == "reduce_max" and eqn.invars[0] in magnitudes
        if eqn.primitive.name == "abs":
            magnitudes.update(eqn.outvars)
        outs = [any(ins) or amax_here] * len(eqn.outvars)
        for sub in subs:
            inner = getattr(sub, "jaxpr", sub)
            c, sub_outs = _after_amax(inner, ins if len(inner.invars) == len(ins) else [any(ins)] * len(inner.invars))
            count += c
            outs = sub_outs if len(sub_outs) == len(eqn.outvars) else [any(sub_outs)] * len(eqn.outvars)
        if not subs and eqn.primitive.name == "convert_element_type" and any(ins) \
                and jnp.dtype(eqn.params["new_dtype"]).itemsize == 1:
            count += 1
        flags.update(zip(eqn.outvars, outs))
    return count, [flags.get(v, False) for v in jaxpr.outvars]


def test_warm_delayed_scales_do_not_wait_for_the_amax():
    """With warm histories (`warm=True`, `Ops.by_state`'s branch after the first step) the delayed
    scales come from the histories alone: no fp8 cast of the forward and backward depends on an
    amax (3 do with `warm=False`: x, w, g), and the values, gradients and next histories are
    those of `warm=False` bit for bit while every history holds an amax; `fp8.warm` says when."""
    x, w, r = _operands(5)
    hist = {"x": jnp.array([3.0, 0, 0, 0]), "w": jnp.array([0.0, 0.2, 0, 0]), "g": jnp.array([1e-3, 0, 0, 5e-3])}

    def run(warm):
        y, back = jax.vjp(lambda x, w, h: fp8.dot(x, w, "delayed", h, warm=warm), x, w, hist)
        return y, back(r)

    cold, hot = run(False), run(True)
    for a, b in zip(jax.tree.leaves(hot), jax.tree.leaves(cold)):
        np.testing.assert_array_equal(a, b)
    after = lambda warm: _after_amax(jax.make_jaxpr(lambda: run(warm))())[0]  # noqa: E731
    assert (after(False), after(True)) == (3, 0)
    stack = {k: jnp.zeros((3, 4)).at[:, 1].set(1.0) for k in "xwg"}  # [layers, H]
    assert bool(fp8.warm(stack)) and not bool(fp8.warm({**stack, "g": stack["g"].at[2].set(0.0)}))
    assert not bool(fp8.warm({k: jnp.zeros((3, 4)) for k in "xwg"}))


def test_the_step_switches_to_the_warm_branch_with_the_same_numbers(monkeypatch):
    """The delayed recipe's step: one conditional per fp8 run in the compiled CPU program, forward
    and backward (`Ops.by_state`; none under `current`: the test of the policies saving the products,
    below); after a first step (histories recorded) its warm branch gives the loss, gradients and next
    histories of the first step's branch (forced with `fp8.warm` false) to float32 rounding."""
    from helpers.data import packed_batch
    batch = packed_batch(4, 64, 512, seed=2)
    tr = _trainer(Fp8Config(recipe="delayed", amax_history=4), num_layers=3, compute_dtype="float32",
                  batch=4, steps=10, remat="dots_with_no_batch_dims_saveable")
    sc = tr.step_cfg
    grads = lambda s, b: step_lib.loss_grads_and_state(s.params, s.model_state, b, 1.0, sc)[:3]  # noqa: E731
    state = tr.init()
    conds = len(re.findall(r" conditional\(", jax.jit(grads).lower(state, batch).compile().as_text()))
    assert conds == 2, conds
    state, _ = tr.step(state, tr.shard_batch(batch))  # the first step records every history
    histories = state.model_state["blocks"]
    assert bool(fp8.warm(jax.tree.map(lambda h: h[1:2], histories)))  # the fp8 layer's (first, last: kept)
    assert not bool(fp8.warm(histories))
    hot = jax.device_get(jax.jit(grads)(state, batch))
    monkeypatch.setattr(fp8, "warm", lambda histories: jnp.asarray(False))
    cold = jax.device_get(jax.jit(grads)(state, batch))
    for a, b in zip(jax.tree.leaves(hot), jax.tree.leaves(cold)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7 * float(np.abs(b).max()))


def test_current_dot_uses_this_steps_amax():
    x, w, _ = _operands(2)
    sx, sw = (fp8.compute_scale(fp8.amax(a), fp8.E4M3) for a in (x, w))
    by_hand = jnp.einsum("btk,kn->btn", fp8.quantize(x, sx, fp8.E4M3).astype(jnp.float32),
                         fp8.quantize(w, sw, fp8.E4M3).astype(jnp.float32)) / (sx * sw)
    y = fp8.dot(x, w, "current")
    np.testing.assert_allclose(y, by_hand, rtol=1e-5, atol=1e-5 * float(jnp.abs(by_hand).max()))
    assert y.dtype == x.dtype and fp8.dot(x.astype(jnp.bfloat16), w, "current").dtype == jnp.bfloat16


def test_hlo_check_finds_fp8_dots():
    x, w, _ = _operands()
    lowered = jax.jit(lambda x, w: fp8.dot(x, w, "current")).lower(x, w)
    pre = lowered.as_text(dialect="hlo")
    assert len(fp8.fp8_gemms(pre)) == 1
    grads = jax.jit(jax.value_and_grad(lambda x, w: fp8.dot(x, w, "current").sum(), argnums=(0, 1))).lower(x, w)
    assert len(fp8.fp8_gemms(grads.as_text(dialect="hlo"))) == 3  # forward, dgrad, wgrad
    plain = jax.jit(lambda x, w: x @ w).lower(x, w).as_text(dialect="hlo")
    assert fp8.fp8_gemms(plain) == []
    cublas = ('%cublas-gemm.1 = (f32[16,16]{1,0}, s8[33554432]{0}) custom-call(f8e4m3fn[16,32]{1,0} %p0, '
              'f8e4m3fn[16,32]{1,0} %t, f32[] %c, f32[] %c), custom_call_target="__cublas$lt$matmul$f8"')
    upcast = ("%p = f8e4m3fn[4,4]{1,0} parameter(0)\n%c = f32[4,4]{1,0} convert(%p)\n"
              "%d = f32[4,4]{1,0} dot(%c, %c), lhs_contracting_dims={1}, rhs_contracting_dims={0}")
    untyped = ("%p = f8e4m3fn[4,4]{1,0} parameter(0)\n%q = f8e5m2[4,4]{1,0} parameter(1)\n"
               "%d = f32[4,4]{1,0} dot(%p, %q), lhs_contracting_dims={1}, rhs_contracting_dims={0}")
    assert len(fp8.fp8_gemms(cublas)) == 1 and fp8.fp8_gemms(upcast) == [] and len(fp8.fp8_gemms(untyped)) == 1


def test_fp8_dots_produce_the_compute_dtype_and_the_weight_gradient_fp32():
    """The forward and dgrad fp8 dots produce bf16 (XLA's GPU rewriter then makes one cuBLASLt GEMM
    that scales in fp32 and writes bf16); a dot to f32 would make the GEMM write f32 [tokens, N] and
    the remat policy save it (docs/PERFORMANCE.md, where fp8's saving went). The weight gradient, for
    the f32 master weight, stays f32."""
    x, w, _ = _operands()
    x = x.astype(jnp.bfloat16)
    for recipe in ("current", "delayed"):
        hist = {k: jnp.zeros((8,), jnp.float32) for k in fp8.HISTORY_KEYS}
        loss = lambda x, w: fp8.dot(x, w, recipe, hist).astype(jnp.float32).sum()  # noqa: E731
        text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(x, w).as_text(dialect="hlo")
        results = sorted(line.split(" = ")[1].split("[")[0] for line in fp8.fp8_gemms(text))
        assert results == ["bf16", "bf16", "f32"], (recipe, results)  # forward, dgrad; wgrad


# --------------------------------------------------------------------------------------------------
# The model: per-layer flags, the train step, checkpoints
# --------------------------------------------------------------------------------------------------

from lumen_jax.train import step as step_lib  # noqa: E402
from lumen_jax.train.build import build  # noqa: E402
from lumen_jax.checkpoint.manager import Checkpointer  # noqa: E402
from lumen_jax.config import (CheckpointConfig, Config, DataConfig, Fp8Config, MeshConfig,  # noqa: E402
                              ModelConfig, OptimConfig, TrainConfig)
from lumen_jax.ops.choice import Ops  # noqa: E402
from lumen_jax.ops.projection import project  # noqa: E402
from helpers.meshes import mesh_shape, small_mesh  # noqa: E402


def _trainer(fp8_cfg: Fp8Config, num_layers: int = 3, compute_dtype: str = "bfloat16", steps: int = 300,
             seq_len: int = 64, batch: int = 8, remat: str = "none", **axes):
    shape = mesh_shape(**axes)
    cfg = Config(model=ModelConfig(num_layers=num_layers, compute_dtype=compute_dtype, fp8=fp8_cfg, remat=remat),
                 mesh=MeshConfig(**shape), data=DataConfig(seq_len=seq_len, global_batch_size=batch),
                 optim=OptimConfig(lr=3e-3, warmup_steps=10), train=TrainConfig(steps=steps))
    return build(cfg, small_mesh(**shape))


def test_layer_mask_and_runs():
    assert fp8.layer_mask(Fp8Config(recipe="delayed"), 4) == (False, True, True, False)
    assert fp8.layer_mask(Fp8Config(recipe="current", keep_bf16=("last",)), 3) == (True, True, False)
    assert fp8.layer_mask(Fp8Config(recipe="current", keep_bf16=()), 2) == (True, True)
    assert fp8.layer_mask(Fp8Config(), 3) == (False,) * 3
    # Two layers, first and last kept: nothing runs fp8, and the model has no fp8 state at all.
    assert not fp8.runs_fp8(Fp8Config(recipe="delayed"), 2, "mlp")
    assert not fp8.runs_fp8(Fp8Config(recipe="delayed", layers=("mlp",)), 4, "attention")
    assert Ops.plain(ModelConfig(num_layers=2, fp8=Fp8Config(recipe="delayed"))).fp8_types == ()
    tr = _trainer(Fp8Config(recipe="delayed", amax_history=4, layers=("mlp",)), num_layers=4)
    hist = tr.step_cfg.fresh_state["blocks"]
    assert set(hist) == {"mlp"} and set(hist["mlp"]["projections"]) == {"gate", "up", "down"}
    assert hist["mlp"]["projections"]["up"]["g"].shape == (4, 4)  # [layers, amax_history]
    assert fp8.layer_runs(tr.cfg.model.fp8, 4) == [(0, 1, False), (1, 3, True), (3, 4, False)]
    assert [(a, b, o.fp8_on) for a, b, o in tr.ops.layer_runs(4)] == [(0, 1, False), (1, 3, True), (3, 4, False)]
    assert fp8.layer_runs(Fp8Config(recipe="current", keep_bf16=()), 3) == [(0, 3, True)]
    assert "projections" not in tr.param_names["blocks"]["mlp"]  # not a parameter: no optimizer state


def test_einsum_run_setting_picks_fp8_or_the_plain_matmul():
    ops = Ops.plain(ModelConfig(num_layers=3, fp8=Fp8Config(recipe="current", keep_bf16=("first",))))
    x, w, _ = _operands(3)
    w3 = w.reshape(64, 4, 24)
    plain = jnp.einsum("btd,dnh->btnh", x, w3)
    kept, on = (o for _, _, o in ops.layer_runs(3))
    np.testing.assert_array_equal(project("btd,dnh->btnh", x, w3, kept, "attention"), plain)
    np.testing.assert_array_equal(project("btd,dnh->btnh", x, w3, on, "attention"),
                                  fp8.dot(x, w, "current").reshape(plain.shape))
    np.testing.assert_array_equal(project("btd,dnh->btnh", x, w3, on, None), plain)  # the logits: never fp8
    with pytest.raises(ValueError, match="trailing axes"):
        fp8.einsum("btd,ndh->btnh", x, w3.transpose(1, 0, 2), "current")


def test_stage_runs_mark_the_slots_of_the_kept_layers():
    """A pipeline stage's slots (`Ops.stage_runs`): fp8 where no stage holds a kept layer, else a
    run whose traced `fp8_keep` holds on the stages that do (uneven (2, 1): slot 0 holds the first
    layer on stage 0 and the last on stage 1)."""
    def runs(keep, split, stages):
        ops = Ops.plain(ModelConfig(num_layers=sum(split), fp8=Fp8Config(recipe="current", keep_bf16=keep)))
        return [[(a, b, None if o.fp8_keep is None else bool(ops.stage_runs(split, jnp.int32(s))[i][2].fp8_keep))
                 for i, (a, b, o) in enumerate(ops.stage_runs(split, jnp.int32(s)))] for s in stages]
    assert runs(("first", "last"), (2, 2), [0, 1]) == [[(0, 1, True), (1, 2, False)], [(0, 1, False), (1, 2, True)]]
    assert runs(("first", "last"), (2, 1), [0, 1]) == [[(0, 1, True), (1, 2, None)], [(0, 1, True), (1, 2, None)]]
    assert runs(("last",), (3, 3, 3), [1, 2]) == [[(0, 2, None), (2, 3, False)], [(0, 2, None), (2, 3, True)]]
    assert runs((), (2, 2), [0]) == [[(0, 2, None)]]


@pytest.mark.parametrize("recipe", ["current", "delayed", "blockwise"])
def test_a_kept_slot_computes_the_compute_dtype_or_fp8(recipe):
    """`fp8.dot(..., keep)`: value and gradients of the plain matmul where `keep` holds (and the
    histories' next values 0), of the fp8 dot where it does not."""
    x, w, r = _operands(4)
    hist = {k: jnp.zeros((4,), jnp.float32).at[0].set(3.0) for k in fp8.HISTORY_KEYS}

    def vjp(f):
        y, back = jax.vjp(f, x, w, hist)
        return y, back(r)

    plain = vjp(lambda x, w, h: jnp.einsum("btk,kn->btn", x, w))
    quantized = vjp(lambda x, w, h: fp8.dot(x, w, recipe, h))
    for keep, want in ((True, plain), (False, quantized)):
        got = vjp(lambda x, w, h: fp8.dot(x, w, recipe, h, jnp.asarray(keep)))
        # fp32 sums of 64 (value, dx) or 128 (dw) products in another order: 1e-6 of the largest
        for name, a, b in (("value", got[0], want[0]), ("dx", got[1][0], want[1][0]), ("dw", got[1][1], want[1][1])):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * float(np.abs(b).max()), err_msg=f"{name} keep={keep}")
        if recipe == "delayed":
            for k in fp8.HISTORY_KEYS:
                np.testing.assert_array_equal(got[1][2][k], 0.0 if keep else quantized[1][2][k])


_QUANTIZE = {fmt: re.compile(rf"= {fmt}\[[^\]]*\]\S* convert\(") for fmt in ("f8e4m3fn", "f8e5m2")}


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_policies_saving_the_products_keep_the_fp8_operands_for_the_backward(recipe):
    """Under a remat policy that saves the projections' products the backward reuses the forward's
    quantized operands (saved, `fp8.RESIDUAL_NAME`) instead of quantizing x and the float32 master
    weight again: one E4M3 quantization per operand per layer body, as without remat (`full`
    recomputes the forward, so quantizes twice); the loss and gradients are those without remat.
    `current` builds no conditional (`Ops.by_state`; delayed's: the warm-branch test above). Delayed
    skips dots_saveable: the fp8 residuals are named the same for every policy saving the products
    (`current` runs both such policies, delayed the one its warm-branch test runs)."""
    from helpers.data import packed_batch
    batch = packed_batch(4, 64, 512, seed=0)
    counts, results = {}, {}
    saving = ("dots_with_no_batch_dims_saveable",) + (("dots_saveable",) if recipe == "current" else ())
    for remat in ("none", *saving, "full"):
        tr = _trainer(Fp8Config(recipe=recipe, keep_bf16=()), num_layers=2, compute_dtype="float32",
                      batch=4, steps=10, remat=remat)
        state, sc = tr.init(), tr.step_cfg
        grads = jax.jit(lambda s, b: step_lib.loss_grads_and_state(s.params, s.model_state, b, 1.0, sc)[:2])
        text = grads.lower(state, batch).as_text(dialect="hlo")
        counts[remat] = {fmt: len(p.findall(text)) for fmt, p in _QUANTIZE.items()}
        if recipe == "current":
            assert " conditional(" not in text, remat
        results[remat] = jax.device_get(grads(state, batch))
    # one scanned layer body: 7 projections, each quantizing x and w (E4M3) and its output gradient
    # (E5M2); delayed: twice, the body of the first step's branch and the warm one (`Ops.by_state`)
    n = 2 if recipe == "delayed" else 1
    assert counts["none"] == {"f8e4m3fn": 14 * n, "f8e5m2": 7 * n}, counts
    assert all(counts[remat] == counts["none"] for remat in saving), counts
    assert counts["full"] == {"f8e4m3fn": 28 * n, "f8e5m2": 7 * n}, counts
    for remat in (*saving, "full"):
        for a, b in zip(jax.tree.leaves(results[remat]), jax.tree.leaves(results["none"])):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(np.abs(b).max()), err_msg=remat)


def test_a_projections_saved_scalars_are_one_residual():
    """A projection saves its scales and amaxes for the backward as one vector: under a policy that
    saves them, the compiled CPU program of 2 scanned layers stacks 7 [layers, 4] vectors (one per
    projection) and no [layers] scalar stacks (each stack is a pass of its own in the loop; on a
    GPU, 196 fusions per step of llama3_1b, docs/PERFORMANCE.md)."""
    from helpers.data import packed_batch
    batch = packed_batch(4, 64, 512, seed=0)
    tr = _trainer(Fp8Config(recipe="current", keep_bf16=()), num_layers=2, compute_dtype="float32",
                  batch=4, steps=10, remat="dots_saveable")
    state, sc = tr.init(), tr.step_cfg
    grads = jax.jit(lambda s, b: step_lib.loss_grads_and_state(s.params, s.model_state, b, 1.0, sc)[:2])
    text = grads.lower(state, batch).compile().as_text()
    stacks = lambda shape: len(re.findall(rf"= f32\[{shape}\]\{{\S*\}} dynamic-update-slice\(", text))  # noqa: E731
    assert (stacks("2"), stacks("2,4")) == (0, 7)


@pytest.fixture(scope="module")
def text_batches():
    """300 batches [8, 64] of the builtin corpus (real text: a loss curve worth comparing)."""
    from lumen_jax.data import TrainData
    data = TrainData(DataConfig(seq_len=64, global_batch_size=8, builtin_max_bytes=400_000), seed=0)
    batches = [next(data) for _ in range(300)]
    return {k: np.stack([b[k] for b in batches]) for k in batches[0]}


def _train(fp8_cfg: Fp8Config, batches: dict) -> tuple[np.ndarray, step_lib.TrainState, str]:
    """300 steps of a 2-layer model in one jitted scan on one device; the per-step losses, the final
    state and the program's HLO (before XLA's passes: the dots as the trainer wrote them)."""
    tr = _trainer(fp8_cfg, num_layers=2)
    sc = tr.step_cfg
    run = jax.jit(lambda state, bs: jax.lax.scan(lambda s, b: step_lib.train_step(s, b, sc), state, bs))
    state = tr.init()
    lowered = run.lower(state, batches)
    state, metrics = lowered.compile(compiler_options=FAST_RUN)(state, batches)  # 1,200 steps: optimized code
    return np.asarray(metrics["loss"]), state, lowered.as_text(dialect="hlo", debug_info=True)


@pytest.mark.heavy
def test_300_steps_with_each_recipe_end_within_2_percent_of_bf16(text_batches):
    ref, _, ref_hlo = _train(Fp8Config(), text_batches)
    final = lambda losses: float(losses[-20:].mean())  # noqa: E731  the last 20 steps: less noise
    assert final(ref) < 0.6 * ref[0]  # it learned
    assert "f8e4m3fn" not in ref_hlo and "f8e5m2" not in ref_hlo
    for recipe in ("current", "delayed", "blockwise"):
        losses, state, hlo = _train(Fp8Config(recipe=recipe, amax_history=16, keep_bf16=()), text_batches)
        assert np.all(np.isfinite(losses)), recipe
        assert abs(final(losses) - final(ref)) <= 0.02 * final(ref), (recipe, final(losses), final(ref))
        # fp8 really ran: E4M3 forward and E5M2 gradient operands in the program.
        assert "f8e4m3fn" in hlo and "f8e5m2" in hlo, recipe
        if recipe == "blockwise":  # quantized per block, multiplied dequantized (docs/KERNELS.md): no fp8 dot
            assert fp8.fp8_gemms(hlo) == [], recipe
        else:  # the layer body (scanned: once) has 7 projections, each a forward, dgrad and wgrad dot
            # (delayed: in the warm branch every step after the first runs; the text holds both)
            from lumen_jax.compiler.lower import fp8_dots
            steady = len(fp8_dots(hlo)[1])
            assert (steady, len(fp8.fp8_gemms(hlo))) == (7 * 3, 7 * 3 * (2 if recipe == "delayed" else 1)), recipe
        if recipe == "delayed":
            x = np.asarray(state.model_state["blocks"]["attn"]["projections"]["q"]["x"])
            assert x.shape == (2, 16) and np.all(x > 0)  # every layer ran fp8 and recorded 16 steps


def _history_leaves(state):
    return jax.tree_util.tree_leaves_with_path(state.model_state)


def test_delayed_state_is_replicated_and_survives_a_checkpoint_and_a_reshard(tmp_path):
    from helpers.data import packed_batch
    # 3 layers: the middle one runs fp8. The model, shapes and remat policy of the warm-branch test's
    # trainer: restored on one device, the next step is that test's program (one compile for both).
    fp8_cfg, shapes = Fp8Config(recipe="delayed", amax_history=4), dict(batch=4, seq_len=64, steps=10)
    tr = _trainer(fp8_cfg, compute_dtype="float32", remat="dots_with_no_batch_dims_saveable", fsdp=4, tensor=2,
                  **shapes)
    batch = packed_batch(4, 64, 512, seed=0)
    state = tr.init()
    for _ in range(3):
        state, _ = tr.step(state, tr.shard_batch(batch))
    leaves = _history_leaves(state)
    assert len(leaves) == 7 * 3  # 7 projections x (x, w, g)
    for path, leaf in leaves:
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        assert len(shards) == 8 and all(np.array_equal(s, shards[0]) for s in shards[1:]), path
        full = shards[0]
        assert np.all(full[[0, 2]] == 0) and np.all(full[1, :3] > 0) and np.all(full[1, 3:] == 0), path
    ckpt = Checkpointer(str(tmp_path / "ckpt"), CheckpointConfig())
    ckpt.save(3, state, {"data": {}})
    ckpt.wait()
    ckpt.close()
    expected = jax.device_get(state)
    # Resharded from fsdp=4 x tensor=2 onto one device. (Data replicas stepping fp8 state:
    # tests/parallel/test_pipeline_compose.py's unpipelined references.)
    other = _trainer(fp8_cfg, compute_dtype="float32", remat="dots_with_no_batch_dims_saveable", **shapes)
    restored = Checkpointer(str(tmp_path / "ckpt"), CheckpointConfig()).restore_latest(other.abstract_state())
    assert restored.step == 3
    for (path, got), want in zip(_history_leaves(restored.state), jax.tree.leaves(expected.model_state)):
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=str(path))
        assert got.sharding.is_fully_replicated
    after, metrics = other.step(restored.state, other.shard_batch(batch))
    assert int(metrics["skipped"]) == 0
    for (path, new), old in zip(_history_leaves(after), jax.tree.leaves(expected.model_state)):
        np.testing.assert_array_equal(np.asarray(new)[:, 1:], old[:, :-1], err_msg=str(path))  # one step on


def test_micro_batches_combine_histories_by_max():
    from helpers.data import packed_batch
    fp8_cfg = Fp8Config(recipe="delayed", amax_history=4, keep_bf16=())
    one = _trainer(fp8_cfg, num_layers=2, compute_dtype="float32", batch=8, steps=10)
    batch = packed_batch(8, 64, 512, seed=1)
    sc1 = one.step_cfg
    sc2 = step_lib.StepConfig(**{**sc1.__dict__, "micro_batches": 2})
    halves = [{k: v[m::2] for k, v in batch.items()} for m in range(2)]  # the step's row split
    fresh, params = sc1.fresh_state, one.init().params
    _, _, whole, _ = jax.jit(lambda b: step_lib.loss_grads_and_state(params, fresh, b, 1.0, sc2))(batch)
    tokens = batch["loss_mask"].sum()  # each micro-batch's loss is divided by the whole batch's tokens
    micro = jax.jit(lambda h: jax.grad(step_lib._micro_loss, argnums=1, has_aux=True)(params, fresh, h, tokens,
                                                                                     1.0, sc1, 2)[0])
    parts = [micro(h) for h in halves]
    for w, a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(parts[0]), jax.tree.leaves(parts[1])):
        np.testing.assert_allclose(np.asarray(w), np.maximum(a, b), rtol=1e-6)
        assert np.all(np.asarray(w)[:, 0] > 0) and np.all(np.asarray(w)[:, 1:] == 0)


def test_mfu_against_the_fp8_and_the_bf16_peak():
    from lumen_jax.metrics import mfu as metrics
    h100 = metrics.device_peak_flops("NVIDIA H100 80GB HBM3", "fp8")
    assert h100 == 1979e12 and metrics.device_peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == 989e12
    m = metrics.StepMetrics.compute(1.0, 1000, 1, 1e12, 1e12, h100, 989e12)
    assert m.mfu == pytest.approx(1e15 / h100) and m.mfu_bf16 == pytest.approx(1e15 / 989e12)
    assert "mfu_bf16" in m.as_dict() and "mfu_bf16" not in metrics.StepMetrics.compute(1.0, 1, 1, 1, 1, 1.0).as_dict()
    peak, source = metrics.peak_flops_per_device(jax.devices("cpu")[:1], "fp8")  # CPU: measured, upcast
    assert peak > 0 and "float32" in source


def test_benchmark_script_imports_and_its_hlo_check_runs_on_cpu():
    from helpers.paths import load_script
    bench = load_script("benchmarks/fp8_gpu.py")
    assert bench.parse_args([]).recipes == "none,delayed,current"
    # The trainer and batch shapes of test_the_step_switches_to_the_warm_branch_with_the_same_numbers: the
    # step it runs is the program compiled here (one compile for both).
    tr = _trainer(Fp8Config(recipe="delayed", amax_history=4), num_layers=3, compute_dtype="float32",
                  batch=4, steps=10, remat="dots_with_no_batch_dims_saveable")
    from helpers.data import packed_batch
    compiled, pre = bench.hlo_fp8_gemms(tr, tr.init(), tr.shard_batch(packed_batch(4, 64, 512, seed=2)))
    assert compiled == 0  # XLA:CPU upcasts fp8 operands before its dots
    assert pre == 7 * 3  # the middle layer's 7 projections: forward, dgrad and wgrad each
