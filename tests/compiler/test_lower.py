"""`python -m lumen_jax.lower`: the trainer's step lowered for CUDA on the 8 emulated CPU devices, and
what the lowered program holds (kernels per layer, score arrays, fp8 dots, collectives); the flash
kernels' Triton IR compiled for Hopper (sm_90) with the triton package."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest

from helpers.run import BASE, with_mesh
from lumen_jax.metrics import flops
from lumen_jax.compiler import kernels as kernel_compile
from lumen_jax.compiler import lower
from lumen_jax.config import MeshConfig
from lumen_jax.kernels.flash_attention import BlockSizes, flash_attention
from lumen_jax.compiler import hlo

LAYERS = 3
SEQ = 48  # no model dimension is 48 (d_model 64, ffn 128, head_dim 16, vocab 256): [.., 48, 48] is scores
KERNELS = ("flash_bwd_dkv", "flash_bwd_dq", "flash_fwd")


def config(attention: str, fp8: dict | None = None, **mesh):
    cfg = with_mesh(BASE, **mesh)
    model = dataclasses.replace(cfg.model, attention=attention, num_layers=LAYERS)
    if fp8:
        model = dataclasses.replace(model, fp8=dataclasses.replace(model.fp8, **fp8))
    return cfg.replace(model=model, data=dataclasses.replace(cfg.data, seq_len=SEQ))


def lowered_text(cfg) -> str:
    n = 1
    for a in MeshConfig.AXES:
        n *= getattr(cfg.mesh, a)
    lowered, _ = lower.lower_step(cfg, "cuda", jax.devices()[:n])
    return lowered.as_text(dialect="hlo", debug_info=True)


def lowered_summary(cfg) -> dict:
    return lower.summarize(lowered_text(cfg), cfg.data.seq_len)


def kernels(summary: dict) -> dict[str, tuple[int, int]]:
    """{kernel name: (instructions in the module, executions per step)} of the Triton custom calls."""
    return {c["kernel"]: (c["instructions"], c["per_step"]) for c in summary["custom_calls"]
            if c["target"] == kernel_compile.TRITON_TARGET}


@pytest.mark.parametrize("mesh", [{}, {"fsdp": 4, "tensor": 2}], ids=["1 device", "fsdp=4,tensor=2"])
def test_flash_step_runs_three_kernels_per_layer_and_holds_no_scores(mesh):
    s = lowered_summary(config("flash", **mesh))
    # One instruction each, inside the layer scan: forward in the forward scan, dK/dV and dQ in the backward.
    assert kernels(s) == {k: (1, LAYERS) for k in KERNELS}, s["custom_calls"]
    assert s["score_arrays"] == []
    assert [loop["trip_count"] for loop in s["loops"]] == [LAYERS, LAYERS]
    # The kernel runs per shard (shard_map): the program states no collective for it (the cotangent
    # sums over mesh axes of size 1 that shard_map's transpose adds move nothing).
    assert s["collectives"] == []


def test_a_chunked_loss_runs_per_shard():
    """With chunks the loss runs per shard (ops/loss.py): the program states over the vocabulary's
    devices the max, the exponentials' sum and the target's logit, in the chunks' loop, and in the
    transpose the sums of its input's gradient (over the vocabulary's devices) and its weight's
    (over the tokens'), once."""
    cfg = config("flash", fsdp=4, tensor=2)
    s = lowered_summary(cfg.replace(model=dataclasses.replace(cfg.model, loss_chunk_tokens=SEQ // 4)))
    stated = [(c["kind"], c["instructions"], c["per_step"]) for c in s["collectives"]]
    assert stated == [("all-reduce", 5, 3 * 4 + 2)], s["collectives"]


@pytest.mark.parametrize("remat, forwards", [("dots_with_no_batch_dims_saveable", LAYERS), ("save_attention_out", LAYERS),
                                             ("dots_saveable", LAYERS), ("offload_dots", LAYERS),
                                             ("full", 2 * LAYERS)])
def test_no_policy_but_full_runs_the_attention_forward_again(remat, forwards):
    """The policies keep the flash kernel's output and log-sum-exp (named residuals): one forward
    kernel per layer and step, as without remat (llama3_1b's preset ran 32 for its 16 layers);
    `full` keeps nothing and runs it again in the backward."""
    cfg = config("flash")
    s = lowered_summary(cfg.replace(model=dataclasses.replace(cfg.model, remat=remat)))
    assert kernels(s) == {"flash_fwd": (1 if forwards == LAYERS else 2, forwards), "flash_bwd_dkv": (1, LAYERS),
                          "flash_bwd_dq": (1, LAYERS)}, s["custom_calls"]


@pytest.mark.heavy
def test_partitioned_collectives_of_fsdp_count_every_layer():
    """fsdp=8, ZeRO-3: the compiled step gathers every layer's fp32 weights in the forward and again in
    the backward (the layer scan's trip count times each gather), and sums every fp32 gradient."""
    cfg = config("xla", fsdp=8)
    found = {c.kind: c for c in lower.partitioned_collectives(cfg, jax.devices()[:8])}
    counts = flops.param_counts(cfg.model)
    layer_bytes = 4 * counts["layer_matmul"] * LAYERS
    assert 2 * layer_bytes <= found["all-gather"].bytes_per_step <= 2 * 4 * counts["total"]
    assert found["all-gather"].per_step > found["all-gather"].instructions  # gathers inside the layer loops
    reduced = found["all-reduce"].bytes_per_step if "all-reduce" in found else 0
    if "reduce-scatter" in found:  # its result is one shard of the sum
        reduced += 8 * found["reduce-scatter"].bytes_per_step
    assert reduced >= 4 * counts["total"]


def test_auto_step_for_hopper_runs_cudnn_per_layer_with_our_kernel_as_fallback():
    """bfloat16 on sm_90: `auto` is cuDNN's fused attention (forward and backward once per layer, the
    packed layout for the batch's segment ids), our kernels only in the branch for rows with more
    documents than that layout holds; no score arrays."""
    cfg = config("auto")
    lowered, ops = lower.lower_step(cfg.replace(model=dataclasses.replace(cfg.model, compute_dtype="bfloat16")),
                                    "cuda", jax.devices()[:1])
    s = lower.summarize(lowered.as_text(dialect="hlo", debug_info=True), SEQ)
    calls = {c["target"]: (c["instructions"], c["per_step"]) for c in s["custom_calls"]
             if c["target"].startswith("__cudnn")}
    assert ops.attention == "cudnn" and ops.note.startswith("attention=auto: cudnn")
    assert calls == {"__cudnn$fmhaSoftmax": (1, LAYERS), "__cudnn$fmhaSoftmaxBackward": (1, LAYERS)}, s["custom_calls"]
    assert set(kernels(s)) == set(KERNELS) and s["score_arrays"] == []


def test_xla_step_holds_the_scores_and_no_kernel():
    s = lowered_summary(config("xla"))
    assert kernels(s) == {} and s["fp8_dots"] == {"instructions": 0, "per_step": 0}
    assert any(a.endswith(f",{SEQ},{SEQ}]") for a in s["score_arrays"]), s["score_arrays"]


def test_context_parallel_flash_runs_the_kernels_per_chunk_pair():
    text = lowered_text(config("flash", context=2))
    s = lower.summarize(text, SEQ)
    found = kernels(s)
    assert set(found) == set(KERNELS)
    for name, (instructions, per_step) in found.items():
        assert instructions > 1 and per_step == instructions * LAYERS, (name, found)  # chunk pairs, every layer
    chunk = SEQ // 4  # zigzag: 2C chunks of T / 2C
    assert s["score_arrays"] == [] and hlo.square_arrays(hlo.parse(text), chunk) == []


@pytest.mark.parametrize("keep_bf16,per_step", [((), 21 * LAYERS), (("first", "last"), 21)],
                         ids=["every layer", "first and last kept bf16"])
def test_fp8_delayed_step_has_fp8_operand_dots_in_the_projections(keep_bf16, per_step):
    """7 projections (q, k, v, o, gate, up, down), each an fp8 dot forward and two backward."""
    s = lowered_summary(config("xla", fp8={"recipe": "delayed", "keep_bf16": keep_bf16}))
    assert s["fp8_dots"] == {"instructions": 21, "per_step": per_step}


@pytest.mark.heavy
def test_pipelined_fp8_runs_the_kept_layers_slots_in_the_compute_dtype():
    """pipeline=2, 6 layers, 1f1b, m = 2: each stage's slots 0 (the first layer on stage 0) and 2 (the
    last on stage 1) run one compute-dtype GEMM per projection on both stages (`Ops.stage_runs`), slot 1
    fp8: one layer's fp8 dots (7 projections, each a dot forward and two backward), 21 instructions: the
    stage is one jitted function (`pipeline.units._jitted`), its forward and its backward each lowered
    once and called by every segment of the lock-step program that runs them (the fill's forward, the
    steady ticks' both, the drain's backward; XLA inlines the calls), each forward and backward run
    in m + P - 1 = 3 ticks: 63 per step, a third of the same step with every layer in fp8 (measured
    189; the step with every layer in fp8 trains in stages in tests/parallel/test_pipeline_uneven.py)."""
    cfg = config("xla", fp8={"recipe": "delayed", "keep_bf16": ("first", "last")}, pipeline=2,
                 pipeline_schedule="1f1b")
    cfg = cfg.replace(model=dataclasses.replace(cfg.model, num_layers=6),
                      train=dataclasses.replace(cfg.train, micro_batches=2))
    ticks = cfg.train.micro_batches + cfg.mesh.pipeline - 1
    kept = lowered_summary(cfg)["fp8_dots"]
    assert kept == {"instructions": 7 + 14, "per_step": 21 * ticks}, kept


def mosaic_lowered(dtype):
    blocks = BlockSizes(block_q=64, block_kv=64, forward="mosaic")
    x = jax.ShapeDtypeStruct((1, 256, 2, 64), dtype)

    def fwd_bwd(q, k, v):
        out, vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v, block_sizes=blocks), q, k, v)
        return vjp(out)

    with lower.mosaic_without_cuda():
        return jax.jit(fwd_bwd).trace(x, x, x).lower(lowering_platforms=("cuda",))


def test_mosaic_forward_lowers_for_cuda():
    """The Hopper forward (JAX's Mosaic GPU kernel) with our Triton backward. float16 only: JAX 0.10.2's
    kernel keeps its shared-memory tiles in float16, so bfloat16 inputs fail to lower (docs/PLATFORM.md)."""
    calls = hlo.custom_calls(hlo.parse(mosaic_lowered(jnp.float16).as_text(dialect="hlo")))
    assert {(c.target, c.kernel) for c in calls} == {
        ("mosaic_gpu_v2", ""), (kernel_compile.TRITON_TARGET, "flash_bwd_dkv"),
        (kernel_compile.TRITON_TARGET, "flash_bwd_dq")}
    try:
        mosaic_lowered(jnp.bfloat16)
    except ValueError as e:
        assert "Mixed input dtypes" in str(e), e
    else:
        pytest.fail("JAX's Mosaic attention lowers bfloat16 now: update docs/PLATFORM.md and this test")


def test_cli_reports_json_and_one_line_exit_2(capsys):
    args = ["--config", "configs/tiny.yaml", "model.attention=flash", "data.seq_len=48", "model.num_layers=2"]
    assert lower.main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mesh"] == "fsdp=8" and report["attention"] == "flash" and report["score_arrays"] == []
    assert {c["kernel"]: c["per_step"] for c in report["custom_calls"]} == {k: 2 for k in KERNELS}
    # The trainer packs documents (segment ids): the Mosaic forward cannot run its step.
    assert lower.main([*args, "--flash-forward", "mosaic"]) == lower.EXIT_BAD_INPUT
    out = capsys.readouterr()
    assert out.out == "" and len(out.err.strip().splitlines()) == 1, out.err
    assert "segment ids are not supported" in out.err
    assert "op: _forward_mosaic (kernels/flash_attention.py" in out.err
    assert "layer: Attention." in out.err and "(model/layers.py" in out.err  # the model's line, named
    assert lower.main([*args[:2], "--flash-forward", "mosaic"]) == lower.EXIT_BAD_INPUT  # tiny.yaml: xla
    assert "needs the flash kernels" in capsys.readouterr().err



@pytest.mark.parametrize("argv, message", [
    (["--against-xla", "--platform", "cuda"], "--against-xla compiles the step for XLA:CPU; drop --platform"),
    (["--against-xla", "--partitioned"], "drop --partitioned"),
    (["--devices", "-4"], "--devices -4 must be >= 1"),
    (["--platform", "tpu"], "argument --platform: invalid choice: 'tpu'"),
    (["--compute-capability", "banana"], "--compute-capability 'banana' must be MAJOR.MINOR"),
])
def test_cli_bad_flags_exit_2_in_one_line(capsys, argv, message):
    assert lower.main(["--config", "configs/tiny.yaml", *argv]) == lower.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1, err


def test_cli_against_xla_prints_both_sides(capsys):
    """`--against-xla` (moved here from the planner's command): the planner's figures next to the
    compiled step's, as a table."""
    assert lower.main(["--config", "configs/tiny.yaml", "--against-xla", "mesh.fsdp=8", "model.num_layers=2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("tiny: the planner's per-device figures (") and "against the compiled step" in lines[0]
    rows = {line.split()[0]: line.split() for line in lines if line.startswith("  ") and line.split()}
    assert {"FLOPs", "matmuls", "bytes"} <= set(rows), lines
    assert any(k.startswith("fsdp") for k in rows), lines  # the fsdp gathers, both sides

@pytest.mark.heavy
@pytest.mark.parametrize("backward", ["split", "fused"])
@pytest.mark.parametrize("head_dim, window", [(64, 0), (128, 0), (64, 256), (128, 256)])
def test_default_hopper_tiles_compile_for_sm90_and_fit(head_dim, window, backward):
    """The trainer's kernels (causal, segment ids, GQA) with Hopper's default tiles, compiled to sm_90
    by the triton package: shared memory per block and registers within Hopper's limits, no spills,
    and every dot a wgmma (none falls back to Ampere's mma.sync); also with the one-kernel backward,
    and with a sliding window and a chunk pair's position offset (context parallelism's kernels)."""
    blocks = dataclasses.replace(BlockSizes.default(head_dim, lower.TargetGpu("9.0")), backward=backward)
    tiles = (blocks.block_q, blocks.block_kv, blocks.block_q_dkv, blocks.block_kv_dkv, blocks.block_q_dq,
             blocks.block_kv_dq)
    assert min(tiles) >= 64, blocks
    found = {r.kernel: r for r in kernel_compile.compile_flash(head_dim, blocks, segments=True, window=window,
                                                               offset=window > 0)}
    assert set(found) == (set(KERNELS) if backward == "split" else {"flash_fwd", "flash_bwd_fused"})
    for r in found.values():
        assert r.fits, r
        assert r.num_warps == (blocks.num_warps if r.kernel == "flash_fwd" else blocks.num_warps_bwd)
        assert 0 < r.shared_bytes <= kernel_compile.LIMITS[90].shared_bytes and r.registers > 0
        assert r.spill_bytes == 0, r
        assert r.wgmma > 0 and r.mma_sync == 0, r
