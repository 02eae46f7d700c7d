"""The two custom VJPs a layer runs so that it saves what Korthikanti et al. count: RMSNorm keeps
its input in the compute dtype and 1 / rms (not two float32 copies), SwiGLU keeps gate and up (not
the sigmoid and silu). Their gradients against autodiff of the plain formulas, which they share
nothing with, and what each saves, read off `print_saved_residuals`."""

import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

from helpers.tolerances import SAME_MATH_FP32_RTOL
from lumen_jax.model.layers import rms_norm
from lumen_jax.ops.swiglu import swiglu


def plain_rms_norm(x, scale, eps):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps) * scale).astype(x.dtype)


def _vjp(fn, *args):
    out, vjp = jax.vjp(fn, *args)
    return out, vjp(jax.random.normal(jax.random.key(7), out.shape, out.dtype))


def _saved(fn, *args) -> str:
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        print_saved_residuals(lambda *a: fn(*a).astype(jnp.float32).sum(), *args)
    return text.getvalue()


@pytest.mark.parametrize("shape", [(2, 8, 16), (2, 8, 4, 6)], ids=["btd", "btnh (q/k norms)"])
def test_rms_norm_gradients_are_autodiffs(shape):
    kx, ks = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, shape, jnp.float32) * 3
    scale = 1 + 0.3 * jax.random.normal(ks, shape[-1:], jnp.float32)
    (o1, g1), (o2, g2) = _vjp(lambda x, s: rms_norm(x, s, 1e-6), x, scale), _vjp(
        lambda x, s: plain_rms_norm(x, s, 1e-6), x, scale)
    np.testing.assert_array_equal(o1, o2)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(a, b, rtol=SAME_MATH_FP32_RTOL, atol=1e-6)


def test_rms_norm_saves_its_input_in_the_compute_dtype_and_one_float_per_row():
    x = jnp.ones((2, 8, 16), jnp.bfloat16)
    scale = jnp.ones((16,), jnp.float32)
    ours = _saved(lambda x: rms_norm(x, scale, 1e-6), x)
    plain = _saved(lambda x: plain_rms_norm(x, scale, 1e-6), x)
    assert "f32[2,8,16]" not in ours and "f32[2,8,1]" in ours, ours
    assert "f32[2,8,16]" in plain, plain  # what autodiff keeps: the float32 copies


def test_swiglu_gradients_are_autodiffs_and_it_saves_gate_and_up_only():
    kg, ku = jax.random.split(jax.random.key(1))
    gate, up = jax.random.normal(kg, (2, 8, 24)) * 2, jax.random.normal(ku, (2, 8, 24))
    (o1, g1), (o2, g2) = _vjp(swiglu, gate, up), _vjp(lambda g, u: jax.nn.silu(g) * u, gate, up)
    np.testing.assert_allclose(o1, o2, rtol=SAME_MATH_FP32_RTOL)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(a, b, rtol=SAME_MATH_FP32_RTOL, atol=1e-6)
    assert _saved(swiglu, gate, up).count("f32[2,8,24]") == 2  # gate and up
    assert _saved(lambda g, u: jax.nn.silu(g) * u, gate, up).count("f32[2,8,24]") > 2
