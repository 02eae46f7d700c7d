"""What the step moves across the mesh (issue 13): gradients reduced once per step, weights cast to the
compute dtype while sharded, gathered once per step on request; the numbers stay those of one big batch.

Byte counts come from the compiled step's HLO, every collective weighted by the trip counts of the
loops around it (`lumen_jax.compiler.hlo`).
"""

import dataclasses
import os
import re

import jax
import numpy as np
import pytest

from helpers.paths import REPO
from helpers.run import BASE, assert_same_run, run, with_mesh
from lumen_jax.config import MeshConfig, MoeConfig
from lumen_jax.compiler import hlo
from lumen_jax.compiler.compiled import compile_step
from lumen_jax.plan.hardware import layout_from_config

# Batch 32 so that data=4 with 4 micro-batches gives every device two rows per micro-batch.
BASE32 = BASE.replace(data=dataclasses.replace(BASE.data, global_batch_size=32))


def _cfg(micro_batches: int, compute_dtype: str = "float32", **mesh):
    cfg = with_mesh(BASE32, micro_batches, **mesh)
    return cfg.replace(model=dataclasses.replace(cfg.model, compute_dtype=compute_dtype))


def _collectives(cfg) -> list[hlo.MeshCollective]:
    compiled = compile_step(cfg, layout_from_config(cfg, jax.device_count()))
    shape = {a: getattr(cfg.mesh, a) for a in MeshConfig.AXES}
    return hlo.on_mesh(hlo.parse(compiled.as_text()), shape)


def _bytes(collectives, axis: str, kinds=("all-reduce", "reduce-scatter")) -> int:
    return sum(c.total for c in collectives if axis in c.axes and c.kind in kinds)


def _collectives_and_grads(cfg):
    """The step of `cfg`: its collectives on the mesh (compiled, never run) and one device's
    gradient bytes (its shards of the parameters: what one reduction per step moves)."""
    from lumen_jax.train.build import build
    from lumen_jax.parallel.mesh import make_mesh
    from lumen_jax.compiler.compiled import abstract_step_args

    shape = {a: getattr(cfg.mesh, a) for a in MeshConfig.AXES}
    trainer = build(cfg, make_mesh(shape))
    compiled = trainer.step.lower(*abstract_step_args(trainer, cfg)).compile()
    params = jax.eval_shape(trainer.init).params
    grads = sum(int(np.prod(sh.shard_shape(p.shape))) * p.dtype.itemsize
                for p, sh in zip(jax.tree.leaves(params), jax.tree.leaves(trainer.state_shardings.params)))
    return hlo.on_mesh(hlo.parse(compiled.as_text()), shape), grads


@pytest.mark.heavy
def test_moe_gradients_cross_data_once_per_step():
    """8 experts, top-2 on expert=4 x data=2: with 4 micro-batches the gradients cross `data` once
    per step, one device's gradients (the experts' grouped matmuls run under the replica vmap,
    ops/grouped.py; before, 4 times). Over `expert`, which splits the tokens as `data` does, the other
    weights' gradients are still summed every micro-batch (as under fsdp_grad_reduce=every_micro_batch)."""
    cfg = dataclasses.replace(_cfg(4, expert=4, data=2), model=dataclasses.replace(
        BASE32.model, moe=MoeConfig(num_experts=8, top_k=2, expert_ffn_dim=32)))
    collectives, grads = _collectives_and_grads(cfg)
    four = _bytes(collectives, "data")
    assert abs(four - grads) <= 0.05 * grads, f"MoE: data reduction bytes per step {four}, gradients {grads}"


@pytest.mark.heavy
@pytest.mark.parametrize("schedule,moe,axis,mesh", [
    ("1f1b", True, "data", None), ("zero_bubble", False, "context", dict(data=2, context=2)),
    ("1f1b", False, "fsdp", dict(fsdp=4, zero_stage=1, fsdp_grad_reduce="once"))],
    ids=["moe-expert2-1f1b", "context2-zero_bubble", "fsdp4-zero1-once"])
def test_pipelined_data_parallel_gradients_cross_once_per_step(schedule, moe, axis, mesh):
    """pipeline=2 with data replicas, 4 micro-batches: the data-axis gradient reduction of the compiled
    step is one reduction of a device's gradients (its stage's blocks and the replicated embedding, norm
    and output), not one per tick (on pipeline=2 x data=4, before: 1f1b 7.7 times the gradient bytes
    per step, zero_bubble 10 times). MoE on pipeline=2 x expert=2 x data=2, 1f1b (before its stages ran
    without the replica vmap: every tick's gradients crossed `data`). pipeline=2 x data=2 x context=2,
    zero_bubble: the context devices' partial gradients too, in the same one reduction (before: every
    unit's, in its tick, 3.3 times the gradient bytes); with sequence parallelism over tensor (no replica
    vmap: `context` manual in the stages' shard_map) once too (before: 3.8 times):
    tests/plan/test_plan.py::test_pipeline_sequence_parallel_reduces_context_once holds that program's
    context reduction (pipeline=2 x context=2 x tensor=2, 1f1b, m=4) to the planner's one reduction
    per step. ZeRO-1 over fsdp=4 with
    `fsdp_grad_reduce=once` (Llama 3's "sharded but not re-sharded": the optimizer state sharded, the
    weights and gradients whole): one all-reduce of a device's gradients per step (with the default
    every_micro_batch they cross fsdp in every tick: 2.5 times at m=2, 4.2 times at m=4). (Dense
    pipeline=2 x data=4 under each schedule: the MoE and context cells run the same replica vmap.)"""
    if mesh:
        cfg = _cfg(4, pipeline=2, pipeline_schedule=schedule, **mesh)
    if moe:
        cfg = dataclasses.replace(_cfg(4, data=2, expert=2, pipeline=2, pipeline_schedule=schedule),
                                  model=dataclasses.replace(BASE32.model, moe=MoeConfig(num_experts=4, top_k=2,
                                                                                        expert_ffn_dim=32)))
    collectives, grads = _collectives_and_grads(cfg)
    got = _bytes(collectives, axis)
    assert abs(got - grads) <= 0.05 * grads, f"{schedule}: {axis} reduction bytes per step {got}, gradients {grads}"


@pytest.mark.heavy
@pytest.mark.parametrize("options,grows", [(dict(), True),
                                           (dict(fsdp_grad_reduce="once", fsdp_regather="per_step"), False)],
                         ids=["every_micro_batch,per_micro_batch", "once,per_step"])
def test_fsdp_gradient_reduction_and_weight_gathers(options, grows):
    """fsdp=8, 1 and 4 micro-batches. The defaults (every_micro_batch, per_micro_batch): the sharded
    gradient accumulator is reduced once per micro-batch and the weights gathered once per micro-batch,
    so both grow with m. `fsdp_grad_reduce=once` and `fsdp_regather=per_step` (independent choices,
    `communication.gradient_plan`): both once per step."""
    one, four = (_collectives(_cfg(m, fsdp=8, **options)) for m in (1, 4))
    reduced = [_bytes(c, "fsdp", ("all-reduce", "reduce-scatter")) for c in (one, four)]
    gathered = [_bytes(c, "fsdp", ("all-gather",)) for c in (one, four)]
    message = f"{options}: gradient reduction bytes m=1, m=4 {reduced}; weight all-gather bytes {gathered}"
    if grows:
        assert reduced[1] >= 3.5 * reduced[0] and gathered[1] >= 2 * gathered[0], message
    else:
        assert abs(reduced[1] - reduced[0]) <= 0.05 * reduced[0], message
        assert abs(gathered[1] - gathered[0]) <= 0.05 * gathered[0], message


def _constraints(text: str) -> list[tuple[str, tuple[int, ...], str]]:
    """(sharding, shape, element type) of every sharding constraint in a lowered (StableHLO) program."""
    found = re.findall(r"sdy\.sharding_constraint %\S+ <@mesh, (\[[^>]*\])> : tensor<([0-9x]*)x(\w+)>", text)
    return [(spec, tuple(int(d) for d in dims.split("x") if d), t) for spec, dims, t in found]


@pytest.mark.parametrize("regather", ["per_micro_batch", "per_step"])
def test_weights_are_cast_to_bf16_while_sharded(regather):
    """The program casts the weights to bfloat16 before any gather: every weight (norm scales aside)
    has a bfloat16 sharding constraint of its shape, fsdp-sharded (per_micro_batch) or gathered
    (per_step). (XLA:CPU then runs every bf16 collective in f32, so the compiled CPU program cannot
    show the bf16 bytes: docs/PLATFORM.md.)"""
    from lumen_jax.train.build import build
    from lumen_jax.compiler.compiled import abstract_step_args
    from lumen_jax.parallel.mesh import make_mesh

    cfg = _cfg(2, "bfloat16", fsdp=8, fsdp_regather=regather)
    trainer = build(cfg, make_mesh({a: getattr(cfg.mesh, a) for a in MeshConfig.AXES}))
    text = trainer.step.lower(*abstract_step_args(trainer, cfg)).as_text()
    want_sharded = regather == "per_micro_batch"
    bf16 = {shape for spec, shape, t in _constraints(text) if t == "bf16" and ('"fsdp"' in spec) == want_sharded}
    shapes = jax.eval_shape(trainer.init).params
    names = trainer.param_names
    weights = [(jax.tree_util.keystr(path), leaf.shape) for (path, leaf), n in zip(
        jax.tree_util.tree_leaves_with_path(shapes), jax.tree.leaves(names, is_leaf=lambda x: isinstance(x, tuple)))
        if "norm" not in n]
    missing = [name for name, shape in weights if tuple(shape) not in bf16]
    assert weights and not missing, f"{regather}: no bf16 constraint of the weight's shape for {missing}"


def _compiled_and_partitioned(cfg, tmp_path):
    """The trainer's step for `cfg` compiled (never run), and the HLO module right after SPMD
    partitioning: XLA:CPU then runs every bf16 collective in f32, so the dtype a GPU would move is
    read there (docs/PLATFORM.md)."""
    from lumen_jax.train.build import build
    from lumen_jax.compiler.compiled import abstract_step_args
    from lumen_jax.parallel.mesh import make_mesh

    shape = {a: getattr(cfg.mesh, a) for a in MeshConfig.AXES}
    trainer = build(cfg, make_mesh(shape, jax.devices()[:int(np.prod(list(shape.values())))]))
    lowered = trainer.step.lower(*abstract_step_args(trainer, cfg))
    from jax.experimental.compilation_cache import compilation_cache

    dump = str(tmp_path / "dump")
    # A program found in the persistent cache is not compiled, so nothing would be dumped: the cache
    # is off for this compile (reset_cache makes JAX read the setting again).
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        compiled = lowered.compile(compiler_options={"xla_dump_to": dump,
                                                     "xla_dump_hlo_pass_re": "spmd-partitioning"})
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
        compilation_cache.reset_cache()
    [after] = [f for f in os.listdir(dump) if "after_spmd-partitioning" in f and f.endswith(".txt")]
    with open(os.path.join(dump, after)) as f:
        partitioned = hlo.parse(f.read())
    return trainer, hlo.parse(compiled.as_text()), hlo.on_mesh(partitioned, shape)


@pytest.mark.parametrize("reduce_dtype,mesh", [("float32", dict(data=2)), ("bfloat16", dict(data=2, context=2))],
                         ids=["float32", "bfloat16-context2"])
def test_reduce_dtype_sets_the_accumulators_and_the_reduction(reduce_dtype, mesh, tmp_path):
    """bfloat16 compute, data=2, 2 micro-batches: the micro-batch loop carries one gradient sum per
    parameter in `mesh.reduce_dtype` (norm scales too), and the step's one gradient reduction over
    `data` moves 4 bytes per parameter in float32 (on data=2), 2 in bfloat16 (on data=2 x context=2,
    as partitioned for the mesh): one reduction per step, spanning data x context (the context devices'
    partial sums of their tokens are accumulated as `data`'s are; before, every micro-batch's crossed
    `context`). The data-only gradients crossing once per step: the float32 case."""
    cfg = _cfg(2, "bfloat16", reduce_dtype=reduce_dtype, **mesh)
    trainer, compiled, collectives = _compiled_and_partitioned(cfg, tmp_path)
    params = jax.tree.leaves(jax.eval_shape(trainer.init).params)
    carried = [a for i in compiled.where("while") for a in i.arrays]
    want = {"float32": "f32", "bfloat16": "bf16"}[reduce_dtype]
    for p in params:  # the accumulator of `p`: [R on this device = 1, *p.shape]
        found = {a.dtype for a in carried if a.dims == (1, *p.shape)}
        assert found == {want}, f"accumulator of a {p.shape} parameter: {found}, want {want}"
    count = sum(int(np.prod(p.shape)) for p in params)
    reduced = {}
    for c in collectives:
        if c.axes == tuple(mesh) and c.kind == "all-reduce" and c.bytes > 8:  # not the loss's scalars
            reduced[c.dtype] = reduced.get(c.dtype, 0) + c.total
    assert reduced == {want: count * {"f32": 4, "bf16": 2}[want]}, reduced


@pytest.mark.heavy
def test_sequence_parallel_pipeline_reduces_data_once_in_reduce_dtype(tmp_path):
    """pipeline=2 x data=2 x tensor=2 with sequence parallelism, 4 layers, interleaved (2 virtual
    stages), 4 micro-batches, `mesh.reduce_dtype=bfloat16`: the stages run with `data` manual in their
    shard_map (no replica vmap, on which XLA's partitioner stops), so the gradients cross `data` once,
    after the last tick: the all-reduce over data moves 2 bytes per parameter of a device's shard, in
    bfloat16 (as partitioned for the mesh; the ticks' gradient sums stay float32). Before: summed where
    XLA placed the sum, 4.2 times the gradient bytes at m=4 (interleaved), 2.5 times at m=2 (1f1b); the
    reduction over the manual axes is the executor's, after any schedule's ticks (each schedule on this
    mesh against one device: test_pipeline_compose.py). float32 compute: a bfloat16 pipelined step
    with sequence parallelism aborts XLA:CPU (docs/PLATFORM.md)."""
    cfg = dataclasses.replace(
        _cfg(4, reduce_dtype="bfloat16", data=2, pipeline=2, tensor=2, sequence_parallel=True,
             pipeline_schedule="interleaved", pipeline_virtual_stages=2),
        model=dataclasses.replace(BASE32.model, num_layers=4))
    trainer, _, collectives = _compiled_and_partitioned(cfg, tmp_path)
    shards = sum(int(np.prod(sh.shard_shape(p.shape))) for p, sh in zip(
        jax.tree.leaves(jax.eval_shape(trainer.init).params), jax.tree.leaves(trainer.state_shardings.params)))
    reduced = {}
    for c in collectives:
        if c.axes == ("data",) and c.kind == "all-reduce" and c.bytes > 8:  # not the loss's scalars
            reduced[c.dtype] = reduced.get(c.dtype, 0) + c.total
    assert reduced == {"bf16": shards * 2}, (reduced, shards)


@pytest.fixture(scope="module")
def reference32():
    return run(with_mesh(BASE32), devices=jax.devices()[:1])


OPTIONS = {
    "data=2,fsdp=2,tensor=2,sp,once,per_step": dict(data=2, fsdp=2, tensor=2, sequence_parallel=True,
                                                    fsdp_grad_reduce="once", fsdp_regather="per_step"),
    "zero1,data=2,fsdp=4,once": dict(data=2, fsdp=4, zero_stage=1, fsdp_grad_reduce="once"),
    "zero2,data=2,fsdp=4,per_step": dict(data=2, fsdp=4, zero_stage=2, fsdp_regather="per_step"),
    "data=2,context=2,fsdp=2": dict(data=2, context=2, fsdp=2),  # the ring's shard_map inside the replica vmap
    "data=4,context=2": dict(data=4, context=2),
}


@pytest.mark.heavy
@pytest.mark.parametrize("name", ["data=2,fsdp=2,tensor=2,sp,once,per_step", "zero1,data=2,fsdp=4,once",
                                  "zero2,data=2,fsdp=4,per_step", "data=2,context=2,fsdp=2"])
def test_four_micro_batches_equal_one_big_batch(name, reference32):
    """Every replica axis of the step's accumulators (`communication.gradient_plan`: data, context, and
    fsdp under `once`) and the weights gathered per step, under ZeRO-3, -2 and -1. (The defaults over
    fsdp at 4 micro-batches: tests/parallel/test_parallel.py's test_micro_batches_equal_one_big_batch.)"""
    got = run(with_mesh(BASE32, micro_batches=4, **OPTIONS[name]))
    assert_same_run(got, reference32, f"{name}, 4 micro-batches")


def test_gpu_overlap_flags_reach_xla(tmp_path):
    """`runtime.xla_gpu_flags=overlap` becomes the step's compile options on GPUs (none on CPUs) and
    XLA's debug options hold each of them (XLA's options are one set for every backend, so a CPU
    compile shows them). Not XLA_FLAGS: jaxlib 0.11.2 has no `xla_gpu_enable_pipelined_all_gather`
    option (its XLA_FLAGS parser ignores the name; 0.10.2's aborts on an unknown one)."""
    import glob

    from lumen_jax.config import Config
    from lumen_jax.runtime import process as runtime

    cfg = Config()
    assert runtime.step_compile_options(cfg.runtime, cfg.model, cfg.mesh, "cpu") == {}
    options = runtime.step_compile_options(cfg.runtime, cfg.model, cfg.mesh, "gpu")
    flags = runtime.parse_flags(runtime.gpu_xla_flags("overlap", cfg.model, cfg.mesh))
    assert len(flags) == len(runtime.GPU_OVERLAP_FLAGS) + 3 and flags["xla_gpu_enable_latency_hiding_scheduler"] is True
    assert set(options) <= set(flags) and "xla_gpu_enable_latency_hiding_scheduler" in options
    jax.jit(lambda x: x + 1).lower(1.0).compile({**options, "xla_dump_to": str(tmp_path)})
    debug = open(glob.glob(str(tmp_path) + "/*debug_options")[0]).read()
    for name, value in options.items():
        assert f"{name}: {str(value).lower()}" in debug, f"{name} did not reach XLA's debug options"
    assert runtime.gpu_xla_flags("none", cfg.model, cfg.mesh) == ()


def test_an_option_this_xla_lacks(monkeypatch, capsys):
    """An `overlap` flag this jaxlib has no option for is left out with a note (the run goes on); one
    the user wrote in runtime.xla_gpu_flags is a one-line ConfigError naming it."""
    import dataclasses

    from lumen_jax.config import Config, ConfigError
    from lumen_jax.runtime import process as runtime

    cfg = Config()
    monkeypatch.setattr(runtime, "GPU_OVERLAP_FLAGS", runtime.GPU_OVERLAP_FLAGS + ("--xla_gpu_no_such_option=true",))
    options = runtime.step_compile_options(cfg.runtime, cfg.model, cfg.mesh, "gpu")
    assert "xla_gpu_no_such_option" not in options and "xla_gpu_enable_latency_hiding_scheduler" in options
    assert "has no option xla_gpu_no_such_option; left out" in capsys.readouterr().err
    literal = dataclasses.replace(cfg.runtime, xla_gpu_flags="--xla_gpu_enable_latency_hiding_scheduler=true "
                                                            "--xla_gpu_no_such_option=1")
    with pytest.raises(ConfigError, match="no option xla_gpu_no_such_option; remove it"):
        runtime.step_compile_options(literal, cfg.model, cfg.mesh, "gpu")


@pytest.mark.heavy
@pytest.mark.parametrize("name", ["fsdp=8", "data=2,fsdp=2,tensor=2,sp,once,per_step",
                                  "zero1,data=2,fsdp=4,once", "zero2,data=2,fsdp=4,per_step", "data=4,context=2"])
def test_planned_collectives_match_the_compiled_step(name):
    """The planner's collective bytes per step, by mesh axes and kind, within 10% of the compiled
    program's (4 micro-batches); data's single reduction is checked by
    test_reduce_dtype_sets_the_accumulators_and_the_reduction. Entries under 5% of the largest are not
    compared: the planner leaves out one small reshard (with sequence parallelism XLA
    collective-permutes 33 KB over fsdp+tensor per step, 2.6% of the largest). data=4,context=2: the
    ring's hops and the gradients' all-reduce over context, every micro-batch (the weights are
    replicated over context; measured: both within 0.1%)."""
    from lumen_jax.plan import DEVICES, predict
    from lumen_jax.compiler.compiled import against_xla

    cfg = with_mesh(BASE32, micro_batches=4, **OPTIONS.get(name, {"fsdp": 8}))
    layout = layout_from_config(cfg, jax.device_count())
    check = against_xla(cfg, predict(cfg, layout, DEVICES["h100"]))
    compared = {k: v for k, v in check.collectives.items() if max(v) > 0.05 * max(c for _, c in check.collectives.values())}
    assert any(k.startswith("context" if "context" in name else "fsdp") for k in compared), compared
    for key, (predicted, compiled) in compared.items():
        assert abs(predicted - compiled) <= 0.10 * compiled, f"{name} {key}: predicted {predicted}, compiled {compiled}"


def test_kept_weights_that_do_not_fit_are_a_config_error():
    """per_step keeps llama3_70b's gathered bf16 weights (17.6 GB per device on fsdp=128, tensor=8):
    a device of 10 GB cannot hold them (one line, before anything compiles); 80 GB can."""
    from lumen_jax.config import ConfigError
    from lumen_jax.config.files import load_config
    from lumen_jax.plan.memory import check_kept_weights_fit

    path = os.path.join(REPO, "configs", "llama3_70b.yaml")
    cfg = load_config(path, ["mesh.fsdp_regather=per_step"])
    layout = layout_from_config(cfg, 1024)
    with pytest.raises(ConfigError, match=r"mesh.fsdp_regather=per_step keeps 17.6 GB .* device's 10.0 GB"):
        check_kept_weights_fit(cfg.model, layout, 10e9)
    check_kept_weights_fit(cfg.model, layout, 80e9)
    check_kept_weights_fit(cfg.model, layout_from_config(load_config(path), 1024), 10e9)
