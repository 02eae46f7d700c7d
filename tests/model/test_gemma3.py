"""Gemma 3's layer in training: local and global layers in one scan (`model.global_every`), the layer
kinds through the pipeline's stages, the config lines that refuse what it cannot do yet. Its numerics
against transformers are tests/convert/test_convert_dense.py's."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.run import BASE, assert_same_run, run, with_mesh
from helpers.tolerances import FP32_RTOL
from lumen_jax.config import ConfigError
from lumen_jax.config.checks import validate
from lumen_jax.config.schema import MoeConfig
from lumen_jax.metrics import flops
from lumen_jax.model.layers import local_layers

# BASE as Gemma 3: 7 layers (5 local, 1 global, 1 local) with a window of 8 over 32 tokens, each kind
# its rope, sandwich norms times (1 + w), GeGLU, q/k norms, the scaled embedding, tied; lr 1e-3 (see
# GRADS_END_RTOL).
GEMMA = BASE.replace(optim=dataclasses.replace(BASE.optim, lr=1e-3), model=dataclasses.replace(
    BASE.model, num_layers=7, head_dim=32, sliding_window=8, global_every=6, rope_theta=1e6, rope_scaling="linear",
    rope_scaling_factor=8.0, rope_local_theta=1e4, query_scale_dim=24, qk_norm=True, norm_scale="one_plus_weight",
    block_norms="sandwich", mlp_activation="gelu_tanh", embed_scale="sqrt_d_model", tie_embeddings=True))


def test_local_layers_follow_the_pattern_from_any_first_layer():
    m = GEMMA.model
    assert local_layers(dataclasses.replace(m, global_every=0), 0, 7) is None
    assert np.asarray(local_layers(m, 0, 7)).tolist() == [True] * 5 + [False, True]
    assert np.asarray(local_layers(m, jnp.int32(4), 3)).tolist() == [True, False, True]  # a stage's layers 4..6


def test_gemma_layers_have_post_norms_from_zero():
    """Sandwich norms add two [D] scales per layer, stored as w of x * (1 + w): zero at init."""
    from lumen_jax.model import init_params

    params = init_params(GEMMA.model, 0)
    blocks = params["blocks"]
    assert {"attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm"} <= set(blocks)
    for name in ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm"):
        assert blocks[name]["scale"].shape == (7, 64) and not np.any(blocks[name]["scale"])
    n = sum(x.size for x in jax.tree.leaves(params))
    assert n == flops.param_counts(GEMMA.model)["total"]


# The gradients after 3 Adam steps drift from one device by reduction order alone: data=8 (the same math
# summed in another order) measured 9.9e-6 relative, data2-fsdp2-tensor2 2.4e-5, pipeline2-fsdp2 1.4e-5 (at
# BASE's lr 1e-2: 5e-4 and 1.2e-3, every leaf alike: Adam's sqrt(v) turning rounding into lr-sized steps,
# as Mistral's window does, tests/ops/test_sliding_window.py). Losses, grad norms and the first gradients
# stay within FP32_RTOL.
GRADS_END_RTOL = 1e-4


@pytest.fixture(scope="module")
def gemma_reference():
    return run(with_mesh(GEMMA), devices=jax.devices()[:1])


@pytest.mark.heavy
@pytest.mark.parametrize("mesh", [dict(pipeline=2, fsdp=2, pipeline_layers=(4, 3))], ids=["pipeline2-fsdp2-uneven"])
def test_gemma_trains_on_meshes_as_on_one_device(gemma_reference, mesh):
    """The pipeline's second stage holds layers 4, 5, 6: its slot 1 is global (the stage passes its first
    layer), and the stages are uneven (4 + 3: 7 layers). (Tensor with sequence parallelism: the context
    case below, context2-ring-fsdp2-tensor2-sp with flash. `data` adds only the replica vmap: the layer
    kinds do not see it.)"""
    got = run(with_mesh(GEMMA, micro_batches=2 if mesh.get("pipeline") else 1, **mesh))
    assert_same_run(got, gemma_reference, str(mesh), GRADS_END_RTOL)
    assert gemma_reference["losses"][-1] < gemma_reference["losses"][0]


@pytest.mark.heavy
def test_gemma_trains_with_context_parallelism_and_our_kernel_as_on_one_device(gemma_reference):
    """The ring takes each layer's kind (a window of 8 on the local layers, none on the global one) per
    chunk pair through our flash kernel (the interpreter), with heads over tensor and the sandwich norms
    under sequence parallelism: losses, grad norms, the gradients as the meshes above. One program for
    both (was context2-ring-fsdp2-tensor2-sp with the reference kernel and context2-ring-flash-fsdp2: the
    ring's pair branches are the same for either kernel; the reference's per pair with a window:
    tests/ops/test_sliding_window.py's context4-ring-contiguous-data2)."""
    mesh = dict(context=2, fsdp=2, tensor=2, sequence_parallel=True)
    cfg = GEMMA.replace(model=dataclasses.replace(GEMMA.model, attention="flash"))
    got = run(with_mesh(cfg, **mesh))
    assert_same_run(got, gemma_reference, f"{mesh} flash", GRADS_END_RTOL)


def test_the_global_layers_change_the_loss(gemma_reference):
    """Without its global layers (every layer windowed) the same model trains to another loss: the
    pattern is not a no-op at this length."""
    cfg = GEMMA.replace(model=dataclasses.replace(GEMMA.model, global_every=0, rope_local_theta=0.0))
    assert abs(run(with_mesh(cfg), devices=jax.devices()[:1])["losses"][0] - gemma_reference["losses"][0]) > (
        100 * FP32_RTOL)


@pytest.mark.parametrize("change, fragment", [
    (dict(sliding_window=0), "model.global_every=6 alternates windowed and global layers but model.sliding_window=0"),
    (dict(global_every=0), "model.rope_local_theta=10000.0 is the local layers' RoPE base but model.global_every=0"),
    (dict(moe=MoeConfig(num_experts=4)), "model.global_every=6 with model.moe.num_experts=4"),
])
def test_what_gemma_cannot_do_is_one_config_line(change, fragment):
    with pytest.raises(ConfigError, match="^" + fragment.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        validate(GEMMA.replace(model=dataclasses.replace(GEMMA.model, **change)), 1)
    validate(with_mesh(GEMMA, context=2), 2)  # context parallelism takes the windows (not trained here)


def test_flops_count_the_global_layers_whole():
    """One layer in six sees all S / 2 keys, the others W - W^2 / 2S (7 layers: 1 global, 6 local)."""
    m, s, w = GEMMA.model, 32, 8
    per_layer = 2 * 2 * m.num_heads * m.resolved_head_dim
    want = per_layer * (6 * (w - w * w / (2 * s)) + 1 * s / 2)
    assert abs(flops.attention_forward_flops_per_token(m, s) - want) <= 1e-9 * want


def test_the_cuda_program_runs_cudnn_with_and_without_the_window():
    """A layer whose kind is traced lowers (for CUDA, without a GPU) to cuDNN calls in both branches of
    its `lax.cond`: the local branch's carry the window (forward and backward), the global branch's none."""
    from flax import nnx

    from lumen_jax.compiler.lower import TargetGpu
    from lumen_jax.model.layers import Attention
    from lumen_jax.ops import cudnn
    from lumen_jax.ops.choice import choose

    model = dataclasses.replace(GEMMA.model, compute_dtype="bfloat16", attention="cudnn", sliding_window=6)
    ops = dataclasses.replace(choose(model, [TargetGpu("9.0")]), interpret=False)
    with nnx.use_eager_sharding(False):
        attn = Attention(model, ops, rngs=nnx.Rngs(0))
    q = jax.ShapeDtypeStruct((2, 32, model.num_heads, 32), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 32, model.num_kv_heads, 32), jnp.bfloat16)

    def loss(q, k, v, local):
        return jnp.sum(attn.attend(q, k, v, None, ops, local).astype(jnp.float32))

    with cudnn.lowering_without_gpu("9.0"):
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv, jax.ShapeDtypeStruct((), jnp.bool_)).lower(
            lowering_platforms=("cuda",)).as_text(dialect="hlo")
    calls = re.findall(r'custom_call_target="__cudnn\$fmha[^"]*"[^\n]*', text)
    windowed = [c for c in calls if re.search(r'sliding_window_length\W+6', c)]
    assert len(windowed) == 2 and len(calls) == 4, (len(windowed), len(calls))  # forward and backward, each branch
