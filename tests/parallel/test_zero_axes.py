"""`mesh.zero_axes=fsdp+context` (issue 44 part 4): the ZeRO state (fp32 parameters, gradients, Adam's
moments) sharded over fsdp x context, as Megatron's distributed optimizer shards over DP x CP, where
the context devices otherwise hold it whole. The numbers stay one device's; the compiled step's
state bytes per device fall by the context size."""

import dataclasses
import functools

import jax
import pytest

from helpers.run import BASE, assert_same_run, run, with_mesh
from lumen_jax import plan
from lumen_jax.compiler import hlo
from lumen_jax.compiler.compiled import compile_step
from lumen_jax.config import ConfigError
from lumen_jax.config.checks import validate
from lumen_jax.metrics import flops, memory
from lumen_jax.plan import residuals as residuals_lib
from lumen_jax.plan.hardware import layout_from_config
from lumen_jax.plan.memory import state_bytes


@pytest.fixture(scope="module")
def reference():
    return run(with_mesh(BASE), devices=jax.devices()[:1])


MESHES = {
    "fsdp=2,context=2,data=2 m=2 once": (2, dict(data=2, fsdp=2, context=2, fsdp_grad_reduce="once")),
    "fsdp=2,context=2,data=2 m=2 every_micro_batch": (2, dict(data=2, fsdp=2, context=2)),
    "fsdp=4,context=2 m=1 per_step": (1, dict(fsdp=4, context=2, fsdp_regather="per_step")),
    "fsdp=2,context=4 m=2 zero1": (2, dict(fsdp=2, context=4, zero_stage=1, fsdp_grad_reduce="once")),
}


@pytest.mark.heavy
@pytest.mark.parametrize("name", list(MESHES))
def test_state_over_context_equals_one_device(name, reference):
    """Losses, grad norms and gradients (first step and after 3) equal one device's."""
    m, mesh = MESHES[name]
    got = run(with_mesh(BASE, micro_batches=m, zero_axes="fsdp+context", **mesh))
    assert_same_run(got, reference, name)
    # and the state is where the option puts it: d_model split over fsdp x context
    specs = got["trainer"].param_specs("optimizer")
    assert specs["blocks"]["attn"]["wq"][1] == ("fsdp", "context"), specs["blocks"]["attn"]["wq"]


def _compiled_step(**mesh):
    """(config, layout, compiled step): bfloat16 compute, d_model 128, ZeRO-3 gathering per micro-batch;
    compiled once for the tests that read it."""
    return _compile(tuple(sorted(mesh.items())))


@functools.lru_cache(maxsize=None)
def _compile(mesh: tuple):
    cfg = with_mesh(BASE, **dict(mesh))
    cfg = cfg.replace(model=dataclasses.replace(cfg.model, compute_dtype="bfloat16", d_model=128, ffn_dim=256))
    layout = layout_from_config(cfg, 8)
    return cfg, layout, compile_step(cfg, layout)


def _compiled(**mesh) -> tuple[dict, dict]:
    """(memory_analysis of the step, the planner's exact state bytes) on fsdp=4 x context=2."""
    cfg, layout, compiled = _compiled_step(fsdp=4, context=2, **mesh)
    return memory.compiled_bytes(compiled), state_bytes(cfg.model, layout)


@pytest.mark.heavy
def test_compiled_state_falls_by_the_context_size():
    """The compiled step's arguments are the state as sharded by hand (every d_model-wide matrix
    over 8 devices, the norms' scales whole) and the batch; they hold half the state's bytes of the
    layout without the option (up to the norms, kept whole), and the step's bytes per device fall
    with them. (The step with the option is test_gathered_weights_are_not_kept_for_the_backward's.)"""
    old, old_state = _compiled()
    new, new_state = _compiled(zero_axes="fsdp+context")
    batch = 5 * 4 * BASE.data.global_batch_size * BASE.data.seq_len // 8
    m = _compiled_step(fsdp=4, context=2)[0].model
    norms = (2 * m.num_layers + 1) * m.d_model * 4
    matrices = (m.vocab_size * m.d_model * 2 + m.num_layers * (
        2 * m.d_model * (m.num_heads + m.num_kv_heads) * m.d_model // m.num_heads + 3 * m.d_model * m.ffn_dim)) * 4
    by_hand = 3 * (matrices / 8 + norms)  # fp32 parameters, Adam's two moments
    assert 0 <= new["arguments"] - batch - by_hand <= 64, (new["arguments"] - batch, by_hand)
    assert 0 <= old["arguments"] - batch - 3 * (matrices / 4 + norms) <= 64
    assert new_state["params"] + new_state["optimizer"] == by_hand
    # the state is donated (the outputs alias it): the step's bytes fall with the arguments
    assert old["total"] - new["total"] >= 0.99 * (old["arguments"] - new["arguments"]), (old["total"], new["total"])


def test_a_pipeline_is_refused():
    cfg = with_mesh(BASE, micro_batches=2, fsdp=2, context=2, pipeline=2, zero_axes="fsdp+context")
    with pytest.raises(ConfigError, match="mesh.zero_axes=fsdp\\+context with mesh.pipeline=2"):
        validate(cfg, 8)


@pytest.mark.heavy
@pytest.mark.parametrize("mesh", [dict(fsdp=8), dict(fsdp=4, context=2, zero_axes="fsdp+context")],
                         ids=["fsdp=8", "fsdp=4,context=2,zero_axes=fsdp+context"])
def test_gathered_weights_are_not_kept_for_the_backward(mesh):
    """bfloat16 compute, ZeRO-3 gathering per micro-batch: no layer loop of the compiled step (the
    forward's, whose results are the backward's residuals, or the backward's) carries a gathered
    layer weight, only the shards: the backward gathers them again. So the planner keeps a layer's
    cast weights at the shard's size (`plan.memory.activation_bytes`)."""
    cfg, layout, compiled = _compiled_step(**mesh)
    module = hlo.parse(compiled.as_text())
    m, layers = cfg.model, cfg.model.num_layers
    gathered = {(layers, m.d_model, m.ffn_dim), (layers, m.ffn_dim, m.d_model),
                (layers, m.d_model, m.num_heads, m.d_model // m.num_heads)}
    carried = {a.dims for i in module.where("while") for a in i.arrays}
    assert carried, "no loop in the compiled step"
    assert not carried & gathered, sorted(carried & gathered)
    shards = {(layers, m.d_model // 8, m.ffn_dim)}
    assert carried & shards, "the layer loops carry no weight shard: the test no longer sees the weights"
    residuals = residuals_lib.layer_residuals(m.remat)
    assert residuals.weight_copies > 0  # the probe keeps the casts: the planner divides them by the shards
    one = plan.predict(cfg, layout, plan.DEVICES["h100"]).activations.saved
    whole = plan.predict(cfg.replace(mesh=dataclasses.replace(cfg.mesh, zero_stage=2)), layout_from_config(
        cfg.replace(mesh=dataclasses.replace(cfg.mesh, zero_stage=2)), 8), plan.DEVICES["h100"]).activations.saved
    copies = residuals.weight_copies * flops.param_counts(m)["layer_matmul"] * layers * 2
    assert whole - one == pytest.approx(copies * 7 / 8)
