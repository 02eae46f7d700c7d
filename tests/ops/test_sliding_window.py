"""`model.sliding_window` (Mistral): each query sees the `window` latest keys, itself included. The
reference against jax's own windowed attention, the one-CPU formulation and the flash dispatch
against the reference, the choice (every implementation takes a window), cuDNN's window in the
program lowered for CUDA, the FLOP count by hand, and training on meshes (context parallelism among
them) against one device. The flash kernel's own window tests: tests/kernels/test_flash_attention.py;
context parallelism's: tests/parallel/test_context_parallel.py."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.run import BASE, assert_same_run, run, with_mesh
from helpers.tolerances import FP32_RTOL, SAME_MATH_FP32_RTOL, assert_tree_close
from lumen_jax.compiler.lower import TargetGpu
from lumen_jax.config import ConfigError, ModelConfig
from lumen_jax.config.checks import validate
from lumen_jax.metrics import flops
from lumen_jax.ops import cpu, cudnn
from lumen_jax.ops.attention import attention
from lumen_jax.ops.choice import Ops, choose
from lumen_jax.ops.reference import reference

HOPPER, AMPERE = [TargetGpu("9.0")], [TargetGpu("8.0")]


def qkv(dtype=jnp.float32, b=2, t=24, n=4, kh=2, h=16, seed=0):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kq, (b, t, n, h), dtype), jax.random.normal(kk, (b, t, kh, h), dtype),
            jax.random.normal(kv, (b, t, kh, h), dtype))


def _grads(fn, q, k, v):
    cot = jax.random.normal(jax.random.key(9), q.shape, q.dtype)

    @jax.jit  # one program (eager, each op compiled alone)
    def out_and_grads(q, k, v):
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(cot)
    return out_and_grads(q, k, v)


@pytest.mark.parametrize("window", [1, 5, 23])
def test_the_reference_window_is_jaxs_local_window(window):
    """jax.nn.dot_product_attention's (left, right) window (window - 1, 0) is transformers' sliding
    window: a query sees keys s > t - window. Output and the three gradients, float32."""
    q, k, v = qkv()
    ours = lambda q, k, v: reference(q, k, v, causal=True, window=window)[0]  # noqa: E731
    jaxs = lambda q, k, v: jax.nn.dot_product_attention(  # noqa: E731
        q, k, v, is_causal=True, local_window_size=(window - 1, 0), implementation="xla")
    (o1, g1), (o2, g2) = _grads(ours, q, k, v), _grads(jaxs, q, k, v)
    np.testing.assert_allclose(o1, o2, rtol=SAME_MATH_FP32_RTOL, atol=1e-6)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(a, b, rtol=SAME_MATH_FP32_RTOL, atol=1e-5)
    if window < 23:  # the window binds: not the plain causal attention
        assert not np.allclose(o1, reference(q, k, v, causal=True)[0], atol=1e-3)


def test_the_one_cpu_formulation_takes_the_window_and_documents():
    q, k, v = qkv()
    seg = jnp.array([[1] * 10 + [2] * 14, [3] * 24], jnp.int32)
    want = reference(q, k, v, segment_ids_bt=seg, causal=True, window=6)[0]
    got = cpu.heads_first_attention(q, k, v, seg, True, 16 ** -0.5, 6)
    np.testing.assert_allclose(got, want, rtol=SAME_MATH_FP32_RTOL, atol=1e-6)


def test_dispatch_a_window_as_long_as_the_keys_is_none_and_flash_takes_one_that_binds():
    q, k, v = qkv()
    plain = attention(q, k, v, ops=Ops())
    np.testing.assert_array_equal(attention(q, k, v, ops=Ops(), window=24), plain)
    np.testing.assert_array_equal(attention(q, k, v, ops=Ops(), window=0), plain)
    windowed = attention(q, k, v, ops=Ops(), window=8)
    assert not np.allclose(windowed, plain, atol=1e-3)
    flash = attention(q, k, v, ops=Ops(attention="flash", interpret=True), window=8)  # the interpreter
    np.testing.assert_allclose(flash, windowed, rtol=FP32_RTOL, atol=1e-6)


def test_the_choice_takes_any_implementation_under_a_window():
    window = ModelConfig(d_model=256, num_heads=4, num_kv_heads=2, compute_dtype="bfloat16", sliding_window=8)
    assert choose(dataclasses.replace(window, attention="auto"), HOPPER).attention == "cudnn"
    ops = choose(dataclasses.replace(window, attention="auto"), AMPERE)  # cuDNN lacks the packed layout there
    assert ops.attention == "flash" and "sliding" not in ops.note
    assert choose(dataclasses.replace(window, attention="flash"), HOPPER).attention == "flash"
    assert choose(dataclasses.replace(window, attention="cudnn"), HOPPER).flash_blocks is not None  # its fallback


def test_context_parallelism_takes_a_window_that_binds():
    validate(with_mesh(BASE.replace(model=dataclasses.replace(BASE.model, sliding_window=8)), context=2), 2)
    validate(with_mesh(BASE.replace(model=dataclasses.replace(BASE.model, sliding_window=32)), context=2), 2)
    with pytest.raises(ConfigError, match="model.sliding_window=-1"):
        validate(BASE.replace(model=dataclasses.replace(BASE.model, sliding_window=-1)), 1)


def test_the_cuda_program_passes_the_window_to_cudnn():
    """Both cuDNN calls (one document per row, and the packed layout) carry the window into the
    custom call's configuration, forward and backward."""
    q, k, v = (jax.ShapeDtypeStruct(x.shape, jnp.bfloat16) for x in qkv(jnp.bfloat16, t=32))
    seg = jax.ShapeDtypeStruct((2, 32), jnp.int32)
    model = ModelConfig(d_model=64, num_heads=4, num_kv_heads=2, compute_dtype="bfloat16", attention="cudnn",
                        sliding_window=6)
    ops = dataclasses.replace(choose(model, HOPPER), interpret=False)

    def loss(q, k, v, seg):
        return jnp.sum(attention(q, k, v, segment_ids_bt=seg, ops=ops, window=6).astype(jnp.float32))

    with cudnn.lowering_without_gpu("9.0"):
        for segments in (None, seg):
            text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, v, segments).lower(
                lowering_platforms=("cuda",)).as_text(dialect="hlo")
            windows = re.findall(r'sliding_window_length\W+(\d+)', text)
            assert windows and set(windows) == {"6"}, windows
            # The packed layout's fallback for rows of many documents is our kernel, with the window.
            assert ("flash_fwd" in text) is (segments is not None)


def test_flops_of_a_window_by_hand():
    """Per layer and head, causal over S = 4096 with W = 1024: the first 1024 queries see 1..1024
    keys, the rest 1024: (1024 x 1025 / 2 + 3072 x 1024) / 4096 = 896.125 keys a query, counted as
    W - W^2 / 2S = 896 (the half-square convention, S / 2 = 2048 without a window)."""
    m = ModelConfig(d_model=64, num_layers=3, num_heads=4, num_kv_heads=2)
    per_key = 2 * 2 * 4 * 16 * 3
    assert flops.attention_forward_flops_per_token(m, 4096) == per_key * 2048
    windowed = dataclasses.replace(m, sliding_window=1024)
    assert flops.attention_forward_flops_per_token(windowed, 4096) == per_key * 896
    assert flops.attention_forward_flops_per_token(dataclasses.replace(m, sliding_window=4096), 4096) == per_key * 2048
    assert flops.attention_forward_flops_per_token(windowed, 4096, causal=False) == per_key * 4096


WINDOW = BASE.replace(model=dataclasses.replace(BASE.model, sliding_window=8))
GRADS_END_RTOL = 1e-4


@pytest.fixture(scope="module")
def window_reference():
    return run(with_mesh(WINDOW), devices=jax.devices()[:1])


@pytest.mark.heavy
@pytest.mark.parametrize("mesh", [dict(context=4, fsdp=2, context_parallel="allgather"),
                                  dict(context=4, data=2, context_balance="contiguous")],
                         ids=["context4-allgather-fsdp2", "context4-ring-contiguous-data2"])
def test_a_window_trains_on_meshes_as_on_one_device(window_reference, mesh):
    """One device runs the one-CPU formulation, the meshes the reference: the window in both. The
    meshes whose attention the window changes split the sequence (context): the all-gather and the
    ring's contiguous layout here; the zigzag ring (context=2, fsdp=2, tensor=2), pipeline stages,
    and data, fsdp and tensor (with sequence parallelism too), each with a window of 8 over 32 tokens:
    tests/model/test_gemma3.py's local layers.
    Losses, grad norms and the first step's gradients to float32 (first gradients measured 5e-8 to
    4e-7 apart); the gradients after 3 Adam steps to GRADS_END_RTOL: with this window every leaf of
    every mesh drifts ~3e-5 from one device, and data=8 from data=2 x fsdp=2 x tensor=2 as much
    (1.8e-5; Adam's sqrt(v) turning reduction-order noise into lr-sized steps), where the model
    without a window stays within 5e-7."""
    got = run(with_mesh(WINDOW, **mesh))
    assert_same_run(got, window_reference, str(mesh), GRADS_END_RTOL)


@pytest.mark.heavy
def test_a_window_trains_with_our_kernel_as_with_the_reference(window_reference):
    """`model.attention=flash` (the interpreter) under the window, on one device, with the remat policy
    that keeps the kernel's output and log-sum-exp (dots_with_no_batch_dims_saveable: the backward no
    longer runs the forward kernel again, tests/compiler/test_lower.py counts it, and reads them as it
    read the recomputed ones). Losses, grad norms and the first step's gradients to float32 against
    the reference without remat, as the meshes above. Per chunk pair of the ring (the window-edge pairs
    through the kernel's `q_offset`): tests/parallel/test_context_parallel.py, and in training
    tests/model/test_gemma3.py's context2-ring-fsdp2-tensor2-sp (a window of 8 over 32 tokens)."""
    flash = WINDOW.replace(model=dataclasses.replace(WINDOW.model, attention="flash",
                                                     remat="dots_with_no_batch_dims_saveable"))
    got = run(with_mesh(flash), devices=jax.devices()[:1])
    np.testing.assert_allclose(got["losses"], window_reference["losses"], rtol=FP32_RTOL)
    np.testing.assert_allclose(got["grad_norms"], window_reference["grad_norms"], rtol=FP32_RTOL)
    assert_tree_close(got["grads"], window_reference["grads"], FP32_RTOL, what="flash first grads ")
    plain = run(with_mesh(BASE), devices=jax.devices()[:1])  # and the window is not a no-op at this length
    assert abs(plain["losses"][-1] - window_reference["losses"][-1]) > 100 * FP32_RTOL
