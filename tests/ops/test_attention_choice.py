"""`model.attention`: which implementation `ops.choice.choose` picks (xla, flash or cuDNN's fused
attention) for a device, a dtype, a head dim and context parallelism, and what the start-up note
says; and the cuDNN path's own pieces that run without a GPU: the segment ids turned into cuDNN's
packed layout, the fallback for rows of many documents, and the program lowered for CUDA."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.meshes import mesh_shape
from helpers.tolerances import SAME_MATH_FP32_RTOL
from lumen_jax.compiler.lower import TargetGpu
from lumen_jax.config import ATTENTION_IMPLS, ConfigError, ModelConfig
from lumen_jax.ops import cudnn
from lumen_jax.ops.attention import attention
from lumen_jax.ops.choice import Ops, choose
from lumen_jax.ops.reference import reference
from lumen_jax.parallel.mesh import make_mesh
from lumen_jax.parallel.rules import Rules, activate

HOPPER, AMPERE = [TargetGpu("9.0")], [TargetGpu("8.0")]
BF16 = dict(d_model=256, num_heads=4, num_kv_heads=2, compute_dtype="bfloat16")  # head_dim 64


def model(attention: str, **changes) -> ModelConfig:
    return ModelConfig(attention=attention, **{**BF16, **changes})


def test_auto_on_a_gpu_takes_cudnn_where_it_takes_the_case_and_says_why():
    ops = choose(model("auto"), HOPPER)
    assert ops.attention == "cudnn" and ops.note.startswith("attention=auto: cudnn (")
    assert ops.flash_blocks is not None  # cuDNN's fallback for rows of many documents is our kernel
    # Each case cuDNN cannot take goes to our flash kernel, and the note names cuDNN's reason.
    for changes, devices, why in [
            (dict(compute_dtype="float32"), HOPPER, "model.compute_dtype=float32: cuDNN's fused attention takes"),
            ({}, AMPERE, "packed documents (segment ids) need cuDNN's packed layout: Hopper (sm_90)"),
            (dict(d_model=1024), AMPERE, "head_dim=256 must be <= 128 and a multiple of 8")]:
        ops = choose(model("auto", **changes), devices)
        assert ops.attention == "flash" and ops.note.startswith(f"attention=auto: flash (cuDNN: {why}"), ops.note
    assert choose(model("auto", d_model=1024), HOPPER).attention == "cudnn"  # 256 on Hopper
    # Neither takes head_dim 12: the reference, with both reasons.
    ops = choose(model("auto", d_model=48), HOPPER)
    assert ops.attention == "xla" and "head_dim=12 must be <= 256" in ops.note and "the flash kernel: head_dim=12" in ops.note
    # cuDNN takes head_dim 40 (a multiple of 8), our compiled kernel does not (a power of two).
    assert choose(model("auto", d_model=160), HOPPER).attention == "cudnn"
    # Off GPU: the reference.
    cpu = choose(model("auto"), jax.devices("cpu")[:1])
    assert cpu.attention == "xla" and cpu.note == "attention=auto: xla (cudnn and flash run on GPU; this is cpu)"


def test_context_parallelism_runs_cudnn_only_when_asked_and_says_so():
    """`auto` keeps our kernel on the chunk pairs until cuDNN's pair path has run on a GPU; an
    explicit cudnn runs it (`ops.cudnn.pair_forward`), with flash beside it for windows and rows
    of many documents."""
    ops = choose(model("auto"), HOPPER, context=2)
    assert ops.attention == "flash" and ops.context, ops
    assert ops.note.startswith("attention=auto: flash (cuDNN: under context parallelism cuDNN runs only when asked"), ops.note
    ops = choose(model("cudnn"), HOPPER, context=2)
    assert ops.attention == "cudnn" and ops.context and ops.flash_blocks is not None, ops
    assert ops.note.startswith("attention=cudnn: cuDNN on each chunk pair of context parallelism"), ops.note


def test_the_cuda_ring_calls_cudnn_on_every_chunk_pair():
    """Under context parallelism (ring, context=2 zigzag: 2 hops x 4 chunk pairs, each pair a switch
    of skip / unmasked / diagonal) an explicit cudnn lowers for CUDA to cuDNN's forward and backward
    in every unmasked and diagonal branch: causal and unmasked without documents, the packed
    layout's masks with them; no flash kernel where nothing falls back (no window)."""
    mesh = make_mesh(mesh_shape(data=4, context=2))
    ops = dataclasses.replace(choose(model("cudnn", d_model=128), HOPPER, context=2), interpret=False)
    q, k, v = (jax.ShapeDtypeStruct((4, 64, n, 32), jnp.bfloat16) for n in (4, 2, 2))

    def loss(q, k, v, seg):
        with activate(mesh, Rules(context_parallel="ring")):
            return jnp.sum(attention(q, k, v, segment_ids_bt=seg, ops=ops).astype(jnp.float32))

    def lowered(seg) -> str:
        with cudnn.lowering_without_gpu("9.0"):
            fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
            return fn.trace(q, k, v, seg).lower(lowering_platforms=("cuda",)).as_text(dialect="hlo")

    for seg, masks in [(None, {"CAUSAL", "NO_MASK"}), (jax.ShapeDtypeStruct((4, 64), jnp.int32), {"PADDING", "PADDING_CAUSAL"})]:
        text = lowered(seg)
        targets = re.findall(r'custom_call_target="(__cudnn\$[^"]+)"', text)
        assert {t: targets.count(t) for t in set(targets)} == {"__cudnn$fmhaSoftmax": 16, "__cudnn$fmhaSoftmaxBackward": 16}
        assert set(re.findall(r'mask_type\W+(\w+)', text)) == masks
        assert ("flash_fwd" in text) == (seg is not None)  # the diagonal's fallback for rows of many documents


def test_an_explicit_cudnn_it_cannot_take_is_one_config_error():
    assert "cudnn" in ATTENTION_IMPLS
    ops = choose(model("cudnn"), HOPPER)
    assert ops.attention == "cudnn" and ops.note == ""
    for changes, devices, message in [
            ({}, jax.devices("cpu")[:1], "cuDNN runs on GPU; this is cpu"),
            (dict(compute_dtype="float32"), HOPPER, "model.compute_dtype=float32"),
            ({}, AMPERE, "packed documents (segment ids) need cuDNN's packed layout")]:
        with pytest.raises(ConfigError, match=rf"^model.attention=cudnn: {re.escape(message)}") as e:
            choose(model("cudnn", **changes), devices)
        assert "\n" not in str(e.value) and "model.attention=flash" in str(e.value)
    assert choose(model("flash"), HOPPER).attention == "flash"  # ours stays selectable by name
    assert Ops.plain(model("cudnn")).attention == "cudnn"


def test_segment_ids_become_the_packed_layout():
    seg = jnp.array([[1, 1, 1, 2, 2, 3, 3, 3], [5, 5, 5, 5, 5, 5, 5, 5], [1, 2, 3, 4, 5, 6, 7, 0]], jnp.int32)
    seqlen, offsets, count = cudnn.packed_documents(seg, max_documents=4)
    np.testing.assert_array_equal(count, [3, 1, 8])
    np.testing.assert_array_equal(seqlen[:2], [[3, 2, 3, -1], [8, -1, -1, -1]])
    np.testing.assert_array_equal(offsets[:2], [[0, 3, 5, 8, -1], [0, 8, -1, -1, -1]])
    assert int(count[2]) > 4  # more documents than the layout holds: the caller's fallback runs


def emulated_packed(q, k, v, *, q_seqlen, kv_seqlen, q_offsets, kv_offsets, scale, mask_type):
    """What cuDNN's packed layout computes, as we read its documentation: each (offset, length) a
    sequence of its own, causal from its first token (the reference per document)."""
    assert mask_type == cudnn._fused.MaskType.PADDING_CAUSAL
    doc = jnp.sum(jnp.arange(q.shape[1])[None, :, None] >= jnp.where(q_seqlen >= 0, q_offsets[:, :-1], 1 << 30)[:, None],
                  axis=-1)  # [B, T]: which document each token is in
    return reference(q, k, v, segment_ids_bt=doc, causal=True, scale=scale)[0]


def qkv(dtype, b=2, t=32, n=4, kh=2, h=16, seed=0):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kq, (b, t, n, h), dtype), jax.random.normal(kk, (b, t, kh, h), dtype),
            jax.random.normal(kv, (b, t, kh, h), dtype))


@pytest.mark.parametrize("documents", [3, 9], ids=["packed layout", "more than it holds: fallback"])
def test_cudnn_path_with_segment_ids_matches_the_reference(monkeypatch, documents):
    """The glue around cuDNN (offsets, lengths, the fallback's condition), with cuDNN's packed call
    emulated on CPU; at 9 documents per row (over a bound of 4) the fallback runs instead."""
    monkeypatch.setattr(cudnn._fused, "dot_product_attention", emulated_packed)
    q, k, v = qkv(jnp.float32)
    seg = jnp.cumsum(jnp.zeros((2, 32), jnp.int32).at[:, jnp.linspace(0, 31, documents + 1)[:-1].astype(int)].set(1), axis=1)
    fallback = lambda q, k, v, s: jnp.zeros_like(q)  # noqa: E731 - tells the branches apart
    got = cudnn.attention(q, k, v, segment_ids_bt=seg, causal=True, scale=None, fallback=fallback,
                          max_documents=4)
    if documents > 4:
        np.testing.assert_array_equal(got, 0.0)
    else:
        want = reference(q, k, v, segment_ids_bt=seg, causal=True)[0]
        np.testing.assert_allclose(got, want, rtol=SAME_MATH_FP32_RTOL, atol=1e-6)


def test_the_cuda_program_calls_cudnn_forward_and_backward_in_the_packed_layout():
    """`jax.nn.dot_product_attention(implementation="cudnn")` and the packed call lower for CUDA on
    this CPU host once jax is told a cuDNN version (`cudnn.lowering_without_gpu`); without it the
    trace stops at "cuDNN is not detected"."""
    q, k, v = (jax.ShapeDtypeStruct(x.shape, jnp.bfloat16) for x in qkv(jnp.bfloat16))
    seg = jax.ShapeDtypeStruct((2, 32), jnp.int32)
    ops = dataclasses.replace(choose(model("cudnn", d_model=64), HOPPER), interpret=False)

    def loss(q, k, v, seg):
        return jnp.sum(attention(q, k, v, segment_ids_bt=seg, ops=ops).astype(jnp.float32))

    def lowered(segments: bool) -> str:
        fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        return fn.trace(q, k, v, seg if segments else None).lower(lowering_platforms=("cuda",)).as_text(dialect="hlo")

    if cudnn._fused.cuda_versions is None:
        with pytest.raises(RuntimeError, match="cuDNN is not detected"):
            lowered(False)
    with cudnn.lowering_without_gpu("9.0"):
        whole, packed = lowered(False), lowered(True)
    for text in (whole, packed):
        targets = re.findall(r'custom_call_target="(__cudnn\$[^"]+)"', text)
        assert sorted(targets) == ["__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"], targets
    assert set(re.findall(r'mask_type\W+(\w+)', whole)) == {"CAUSAL"}
    assert set(re.findall(r'mask_type\W+(\w+)', packed)) == {"PADDING_CAUSAL"}
    assert set(re.findall(r'max_seg_per_batch\W+(\d+)', packed)) == {"32"}  # min(MAX_DOCUMENTS, T)
    assert "flash_fwd" in packed and "flash_fwd" not in whole  # the fallback's branch


def test_a_jax_without_the_packed_layout_runs_packed_documents_through_flash(monkeypatch):
    """The packed layout is reached through jax's private module; where its call differs, auto says so
    and takes our kernel (an explicit cudnn is a config error) rather than failing at trace time."""
    monkeypatch.setattr(cudnn._fused, "dot_product_attention", lambda q, k, v, bias=None, mask=None: q)
    ops = choose(model("auto"), HOPPER)
    assert ops.attention == "flash" and "does not expose cuDNN's packed layout" in ops.note
    with pytest.raises(ConfigError, match="does not expose cuDNN's packed layout"):
        choose(model("cudnn"), HOPPER)
