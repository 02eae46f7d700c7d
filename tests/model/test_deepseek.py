"""DeepSeek-V3's model: multi-head latent attention, the first layers dense then MoE and two multi-token
prediction depths, trained on every mesh axis but `data` as on one device (`data` adds only the step's
replica vmap, which the MoE tests cover: tests/model/test_moe.py, tests/ops/test_moe_balance.py); MLA's
narrower values through the flash kernel; its config refusals."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.run import BASE, assert_same_mtp_run, run, with_mesh
from helpers.tolerances import FP32_RTOL
from lumen_jax.config import ConfigError
from lumen_jax.config.checks import validate
from lumen_jax.config.schema import MoeConfig
from lumen_jax.metrics import flops

# BASE as a small DeepSeek-V3: latent attention (K/V rank 16, a query latent of 24, q/k heads 16 + 8 rotated,
# values 12 wide), 3 layers, the first dense, then MoE layers of 8 sigmoid experts in 4 groups (2 kept),
# top-2, a shared expert, routed scaling 2.5, the selection bias; lr 1e-3 (see GRADS_END_RTOL).
MLA = dict(num_kv_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
DS_MOE = MoeConfig(num_experts=8, top_k=2, first_dense_layers=1, shared_experts=1, router="sigmoid", groups=4,
                   top_groups=2, routed_scaling=2.5, balance="bias", bias_update_rate=0.01, expert_ffn_dim=32,
                   aux_loss_weight=0.0, sequence_aux_loss_weight=1e-4)
DEEPSEEK = BASE.replace(optim=dataclasses.replace(BASE.optim, lr=1e-3), model=dataclasses.replace(
    BASE.model, num_layers=3, **MLA, moe=DS_MOE))
# Measured after 3 Adam steps against one device: see the commit; losses, grad norms and first gradients
# within FP32_RTOL.
GRADS_END_RTOL = 1e-4


def test_mla_parameters_and_count():
    from lumen_jax.model import init_params

    params = jax.jit(init_params, static_argnums=(0, 1))(DEEPSEEK.model, 0)  # eager: each op compiled alone
    attn = params["moe_blocks"]["attn"]
    assert attn["wkv_a"].shape == (2, 64, 16) and attn["wk_rope"].shape == (2, 64, 8)
    assert attn["wk_b"].shape == (2, 16, 4, 16) and attn["wv_b"].shape == (2, 16, 4, 12)
    assert attn["wq_b"].shape == (2, 24, 4, 24) and attn["wo"].shape == (2, 4, 12, 64)
    assert params["blocks"]["mlp"]["w_gate"].shape == (1, 64, 128)  # the dense first layer: ffn_dim
    n = sum(x.size for x in jax.tree.leaves(params))
    assert n == flops.param_counts(DEEPSEEK.model)["total"]


# With two multi-token prediction depths (MoE blocks with the selection bias): the model of every training
# comparison below.
DEEPSEEK_MTP = DEEPSEEK.replace(model=dataclasses.replace(DEEPSEEK.model, mtp_depth=2, mtp_loss_weight=0.3))


@pytest.fixture(scope="module")
def reference():
    return run(with_mesh(DEEPSEEK_MTP), devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def reference_mtp():
    return run(with_mesh(DEEPSEEK_MTP, micro_batches=2), devices=jax.devices()[:1])


@pytest.mark.heavy
@pytest.mark.parametrize("micro_batches, mesh", [(2, dict(expert=2, context=2, tensor=2, sequence_parallel=True)),
                                                 (1, dict(context=2, tensor=2, context_parallel="allgather",
                                                          context_balance="contiguous"))],
                         ids=["expert2-context2-tensor2-sp-m2", "context2-tensor2-allgather-contiguous"])
def test_deepseek_trains_on_meshes_as_on_one_device(request, micro_batches, mesh):
    """Heads over tensor with the latent replicated, sequence parallel; the expanded K/V around the context
    ring (values padded to the q/k head dim); experts over expert: one program for the three (was
    fsdp2-tensor2-sp and expert2-context2-fsdp2; the latent over fsdp: the pipeline case below). (`data`
    adds only the replica vmap, test_moe.py's expert=2,fsdp=2,data=2.) The MTP depths' shifted ids cross
    the context devices, in zigzag's held order (the ring) and in contiguous order (all-gathered), and
    their blocks attend through context parallelism as the main layers do; `mtp_loss` as one device's
    (were test_mtp.py's context2-fsdp2-ring-zigzag and context2-tensor2-allgather-contiguous, MLA with 2
    dense depths). With 2 micro-batches `context` is a replica axis of the step's vmap, whose body holds
    one context device's chunk of every row: the shifts gather the row over `context` per device (a
    shift within the chunk wrapped the MTP targets inside each chunk: the MTP gradients up to 86% off,
    the grad norm 0.7%), and the sequence-wise balance loss adds its per-row statistics over `context`
    (a chunk's own statistics: the routers' gradients 0.24% off); with one, the step sees the whole row. Each against one device with as many micro-batches (2: the
    pipeline test's `reference_mtp`; `mtp_loss` is the micro-batches' mean, 2e-5 off one batch's)."""
    reference = request.getfixturevalue("reference_mtp" if micro_batches == 2 else "reference")
    got = run(with_mesh(DEEPSEEK_MTP, micro_batches, **mesh))
    assert_same_mtp_run(got, reference, str(mesh), GRADS_END_RTOL)
    assert reference["losses"][-1] < reference["losses"][0]


def test_flash_takes_narrower_values_by_padding():
    """The flash kernel (interpreted) on q/k heads of 24 and values of 12 equals the reference, forward
    and gradients."""
    from lumen_jax.ops.attention import attention
    from lumen_jax.ops.choice import Ops
    from lumen_jax.kernels import flash_attention as flash_lib

    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (1, 32, 2, 24))
    k = jax.random.normal(ks[1], (1, 32, 2, 24))
    v = jax.random.normal(ks[2], (1, 32, 2, 12))
    w = jax.random.normal(ks[3], (1, 32, 2, 12))
    flash = Ops(attention="flash", interpret=True, flash_blocks=flash_lib.BlockSizes())

    def loss(ops):
        return lambda q, k, v: jnp.sum(attention(q, k, v, ops=ops, scale=0.3) * w)

    want, want_g = jax.value_and_grad(loss(Ops()), argnums=(0, 1, 2))(q, k, v)
    got, got_g = jax.value_and_grad(loss(flash), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(got, want, rtol=FP32_RTOL)
    for a, b in zip(got_g, want_g):
        np.testing.assert_allclose(a, b, rtol=FP32_RTOL, atol=FP32_RTOL * float(jnp.abs(b).max()))


BAD = {
    "gqa": (dict(num_kv_heads=2), "model.num_kv_heads=2 with model.kv_lora_rank=16"),
    "rope odd": (dict(qk_rope_head_dim=7), "model.qk_rope_head_dim=7 must be even"),
    "window": (dict(sliding_window=8), "model.sliding_window=8 with model.kv_lora_rank=16"),
    "no rank": (dict(kv_lora_rank=0), "model.q_lora_rank=24 is a latent-attention key but model.kv_lora_rank=0"),
    "wide values": (dict(v_head_dim=32), "model.v_head_dim=32 exceeds qk_nope_head_dim+qk_rope_head_dim=24"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_what_mla_cannot_do_is_one_config_line(case):
    change, fragment = BAD[case]
    with pytest.raises(ConfigError) as e:
        validate(DEEPSEEK.replace(model=dataclasses.replace(DEEPSEEK.model, **change)), 1)
    assert fragment in str(e.value), str(e.value)


# On a pipeline, all three: the first dense layer, MoE layers, two multi-token prediction depths (MoE blocks
# with the selection bias) run with the head on half the rows each (`mtp_loss` the depths' mean);
# pipeline_layers=[1, 2] (stage 0 the dense layer alone, stage 1 the MoE layers: the dense stack padded to one
# slot per stage), experts over `expert` in the stages, zero-bubble's split backward (the latent attention's
# projections tapped). One compile (and one of its one-device reference, with the same 2 micro-batches)
# shared by the training comparison and the checkpoint's writer. MTP with the head is the same code on every
# schedule (`pipeline/units.py`'s head; test_mtp.py's 1F1B case went for this one); first dense layers on
# other splits and schedules: tests/parallel/test_pipeline_uneven.py and test_pipeline_compose.py (two stacks).
IN_STAGES = dict(pipeline=2, fsdp=2, expert=2, pipeline_schedule="zero_bubble", pipeline_layers=(1, 2))


@pytest.fixture(scope="module")
def in_stages():
    return run(with_mesh(DEEPSEEK_MTP, micro_batches=2, **IN_STAGES))


@pytest.mark.heavy
def test_first_dense_layers_and_mtp_train_on_a_pipeline_as_on_one_device(reference_mtp, in_stages):
    """The first dense layer in the first stage's dense slots (zeros on the other stages: the identity),
    then the MoE layers, then MTP with the head: losses, grad norms, gradients, `mtp_loss` and the model
    state after 3 steps (the MTP blocks' bias and expert load, summed over the stages' rows) equal one
    device's with the same 2 micro-batches; the padding slots' gradients are exactly 0."""
    got, ref = in_stages, reference_mtp
    assert_same_mtp_run(got, ref, "pipeline2-fsdp2-expert2-zero_bubble-1+2 mtp", GRADS_END_RTOL)
    pipe = got["trainer"].step_cfg.pipeline
    for k in pipe.stacks:
        for a in jax.tree.leaves(got["held"]["grads"][k]):
            a = np.asarray(pipe.from_stages(a))
            assert not np.any(np.delete(a, pipe.real_slots(a.shape[0], k), axis=0)), k
    assert float(np.abs(ref["model_state"]["mtp"]["block"]["mlp"]["balance"]["load"]).sum()) > 0
    for a, b in zip(jax.tree.leaves(got["model_state"]), jax.tree.leaves(ref["model_state"])):
        np.testing.assert_allclose(a, b, rtol=FP32_RTOL, atol=1e-6)


@pytest.mark.heavy
def test_a_checkpoint_with_first_dense_layers_in_stages_restores_without_a_pipeline(reference_mtp, in_stages,
                                                                                      tmp_path):
    """One step on pipeline_layers=[1, 2] (stage 0: the dense layer alone, stage 1: the MoE layers; the
    dense stack padded to one slot per stage), saved: on disk the real layers in order (one dense
    layer, then the MoE layers, as the slots say by hand); restored on one device, bit for bit, and its
    next step's loss is the uninterrupted run's (not sensitive to the layers' order at this init scale:
    the slots are checked by hand for that). The writer and the reader are the trainers (and programs)
    of the pipelined run and of its one-device reference."""
    from lumen_jax.checkpoint.manager import Checkpointer
    from lumen_jax.config import CheckpointConfig
    from helpers.run import batches
    from helpers.tolerances import assert_tree_close

    data, path = batches(DEEPSEEK_MTP), str(tmp_path / "ckpt")
    writer, reader = in_stages["trainer"], reference_mtp["trainer"]
    state, _, _ = writer.step_and_grads(writer.init(), writer.shard_batch(data[0]))
    assert jax.tree.leaves(state.params["blocks"])[0].shape[0] == 2  # one dense slot per stage
    ckpt = Checkpointer(path, CheckpointConfig(), layout=writer.stored)
    ckpt.save(1, state, {})
    ckpt.wait()
    ckpt.close()
    stored = jax.device_get(writer.stored.save(state))
    # by hand: stage 0 holds the dense layer in dense slot 0 and two zero MoE slots, stage 1 a zero dense
    # slot and the MoE layers in MoE slots 2 and 3 (the order held: no interleaving)
    held = jax.device_get(state.params)
    assert_tree_close(stored.params["blocks"], jax.tree.map(lambda a: a[:1], held["blocks"]), 0.0, what="dense ")
    assert_tree_close(stored.params["moe_blocks"], jax.tree.map(lambda a: a[2:], held["moe_blocks"]), 0.0, what="moe ")
    restored = Checkpointer(path, CheckpointConfig(), layout=reader.stored).restore_latest(reader.abstract_state())
    assert_tree_close(jax.device_get(reader.stored.save(restored.state)), stored, 0.0, what="restored ")
    _, m, _ = reader.step_and_grads(restored.state, reader.shard_batch(data[1]))
    np.testing.assert_allclose(float(m["loss"]), reference_mtp["losses"][1], rtol=FP32_RTOL)


def test_absorbed_decoding_equals_the_full_forward():
    """Prefill then decode over MLA's latent cache (wk_b absorbed into the queries, wv_b after the weighted
    latents: [B, S, R + Hr] per layer) gives, token after token, the logits the training forward gives
    each position of the whole sequence (K/V expanded per head), for left-padded rows of two lengths."""
    from lumen_jax.model import decode, init
    from lumen_jax.model.transformer import merge
    from lumen_jax.model import abstract_model

    cfg = DEEPSEEK.model
    params, state = jax.jit(init, static_argnums=(0, 1))(cfg, 0)
    graphdef = abstract_model(cfg).graphdef
    model = merge(graphdef, params, state)
    # jitted, as generate runs them (eager, each small op would compile on its own): one program each
    prefill = jax.jit(lambda p, *a: decode.prefill(merge(graphdef, p, state), *a))
    step = jax.jit(lambda p, *a: decode.decode(merge(graphdef, p, state), *a))
    forward = jax.jit(lambda p, *a: merge(graphdef, p, state)(*a))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (2, 12)).astype(np.int32)
    prompt, total = 5, 12
    valid = np.ones((2, prompt), bool)
    valid[1, :2] = False  # row 1: a 3-token prompt, left-padded
    cache = decode.init_cache(model, 2, total)
    assert cache["k"].shape == (3, 2, total, 16) and cache["v"].shape == (3, 2, total, 8)
    logits, cache = prefill(params, jnp.asarray(tokens[:, :prompt]), jnp.asarray(valid), cache)
    got = [np.asarray(logits)]
    valid_bs = np.concatenate([valid, np.ones((2, total - prompt), bool)], axis=1)
    for slot in range(prompt, total - 1):
        positions = np.asarray([slot, slot - 2], np.int32)
        logits, cache = step(params, jnp.asarray(tokens[:, slot]), jnp.asarray(positions), jnp.int32(slot),
                             jnp.asarray(valid_bs), cache)
        got.append(np.asarray(logits))
    for row, start in ((0, 0), (1, 2)):  # each row's own sequence through the forward
        seq = tokens[row:row + 1, start:total - 1]
        full = np.asarray(forward(params, jnp.asarray(seq), jnp.arange(seq.shape[1])[None]))[0]
        want = full[prompt - 1 - start:]
        np.testing.assert_allclose(np.stack([g[row] for g in got]), want, rtol=FP32_RTOL,
                                   atol=FP32_RTOL * float(np.abs(want).max()))
