"""fp8 training: quantization error and saturation per format, the scale logic of each recipe, the
custom VJP against fp32/bf16 dots, the model and train step with each recipe (loss against bf16,
first/last layers kept), delayed-scaling state across a checkpoint and a reshard, the HLO check.

Tolerances come from the formats: round-to-nearest loses at most half an ulp, a relative
u = 2**-(mantissa bits + 1), plus half the smallest subnormal (divided by the scale) for values that
land below the normal range."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

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
