"""mesh.tensor_overlap=collective_matmul (issue 44 part 2): sequence parallelism's all-gather and
reduce-scatter over `tensor` decomposed into ppermute steps under the partial matmuls
(lumen_jax/parallel/collective_matmul.py).

The numbers equal one device's (and the same mesh's without the option); the compiled program's
layers hold no all-gather or reduce-scatter of activations over `tensor`, and every transfer step
(collective-permute) is independent of a matmul it can run under: neither reads the other's result.
"""

import dataclasses
import math
import re

import jax
import numpy as np
import pytest

from helpers.run import BASE, assert_same_run, run, with_mesh
from helpers.tolerances import BF16_RTOL, assert_tree_close
from lumen_jax.compiler import hlo
from lumen_jax.compiler.compiled import compile_step
from lumen_jax.config import ConfigError, Fp8Config, MeshConfig, MoeConfig
from lumen_jax.config.checks import validate
from lumen_jax.plan.hardware import layout_from_config

CM = "collective_matmul"
# tensor=4 splits the K/V heads four ways
KV4 = BASE.replace(model=dataclasses.replace(BASE.model, num_kv_heads=4))


@pytest.fixture(scope="module")
def one_device():
    return {"base": run(with_mesh(BASE), devices=jax.devices()[:1]),
            "kv4": run(with_mesh(KV4), devices=jax.devices()[:1])}


# name: (model, micro-batches, mesh); fsdp with tensor: the ring's and the pipeline's meshes; the replica
# vmap (data=2 with 2 micro-batches, tensor=4): test_overlap_matches_one_device_and_the_same_mesh_without_it
MESHES = {
    "fsdp=2,context=2,tensor=2 (ring)": ("base", 1, dict(fsdp=2, context=2, tensor=2)),
    "pipeline=2,fsdp=2,tensor=2,1f1b": ("base", 2, dict(pipeline=2, fsdp=2, tensor=2)),
}


@pytest.mark.heavy
@pytest.mark.parametrize("name", list(MESHES))
def test_overlap_matches_one_device(name, one_device):
    model, m, mesh = MESHES[name]
    cfg = with_mesh(KV4 if model == "kv4" else BASE, m, sequence_parallel=True, tensor_overlap=CM, **mesh)
    assert_same_run(run(cfg), one_device[model], name)


KV4_BF16 = KV4.replace(model=dataclasses.replace(KV4.model, compute_dtype="bfloat16"))


@pytest.fixture(scope="module")
def one_device_bf16():
    return run(with_mesh(KV4_BF16), devices=jax.devices()[:1])


@pytest.mark.heavy
def test_bfloat16_matches_one_device(one_device_bf16):
    """In bfloat16 (the training dtype): the ring's transfers and partial sums in bf16 (three steps
    per collective on tensor=4), beside context parallelism, with 2 micro-batches, equal one device to
    bf16's tolerance. (An axis of one device made manual had XLA:CPU fail on the bf16 all-reduce over
    groups of one device that the shard_map's transpose left: a check failure; data and fsdp are
    such axes here.) One program for what data=2 x tensor=4 (m=1) and fsdp=2 x context=2 x tensor=2
    (m=2) checked in two; data and fsdp with the option: the float32 cells."""
    ref = one_device_bf16
    got = run(with_mesh(KV4_BF16, 2, context=2, tensor=4, sequence_parallel=True, tensor_overlap=CM))
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=BF16_RTOL)
    np.testing.assert_allclose(got["grad_norms"], ref["grad_norms"], rtol=BF16_RTOL)
    assert_tree_close(got["grads"], ref["grads"], BF16_RTOL, what="bf16 first grads ")


@pytest.mark.heavy
def test_overlap_matches_one_device_and_the_same_mesh_without_it(one_device):
    """data=2 x tensor=4 (three steps per collective) with 2 micro-batches (the step's replica vmap):
    one device's numbers, and the same mesh's without the option."""
    cfg = with_mesh(KV4, 2, data=2, tensor=4, sequence_parallel=True)
    got = run(dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, tensor_overlap=CM)))
    assert_same_run(got, one_device["kv4"], "data=2,tensor=4,m=2")
    assert_same_run(got, run(cfg), "data=2,tensor=4,m=2 with and without tensor_overlap")


@pytest.mark.parametrize("change,words", [
    (dict(mesh=dict(sequence_parallel=False)), "mesh.sequence_parallel=false"),
    (dict(model=dict(fp8=Fp8Config(recipe="current"))), "model.fp8.recipe='current'"),
    (dict(model=dict(moe=MoeConfig(num_experts=4, top_k=2))), "model.moe.num_experts=4"),
    (dict(mesh=dict(pipeline=2, pipeline_schedule="zero_bubble", fsdp=2)), "zero_bubble"),
])
def test_refusals_name_the_key_and_the_fix(change, words):
    cfg = with_mesh(BASE, 2, tensor=2, sequence_parallel=True, tensor_overlap=CM)
    cfg = cfg.replace(**{section: dataclasses.replace(getattr(cfg, section), **fields)
                         for section, fields in change.items()})
    with pytest.raises(ConfigError, match=re.escape(words)) as e:
        validate(cfg, math.prod(getattr(cfg.mesh, a) for a in MeshConfig.AXES))
    assert "mesh.tensor_overlap=none" in str(e.value)


# --------------------------------------------------------------------------------------------------
# The compiled program
# --------------------------------------------------------------------------------------------------

def _operands(module: hlo.Module) -> dict[str, dict[str, list[str]]]:
    """{computation: {instruction: the names of its operands in that computation}}."""
    names: dict[str, set[str]] = {}
    for i in module.instrs:
        names.setdefault(i.computation, set()).add(i.name)
    return {comp: {i.name: [o for o in re.findall(r"%([\w.\-]+)", i.line.split(" = ", 1)[1]) if o in own]
                   for i in module.instrs if i.computation == comp}
            for comp, own in names.items()}


def _matmuls(module: hlo.Module) -> set[str]:
    """The instructions that run a matmul: dots, and fusions whose computation holds one."""
    with_dot = {i.computation for i in module.instrs if i.op == "dot"}
    called = re.compile(r"calls=%?([\w.\-]+)")
    return {i.name for i in module.instrs
            if i.op == "dot" or (i.op == "fusion" and set(called.findall(i.line)) & with_dot)}


def _over_tensor(i: hlo.Instr, mesh: dict[str, int]) -> bool:
    groups = hlo.device_groups(i.line)
    return bool(groups) and "tensor" in hlo._axes(groups, mesh)


def _layers(cfg) -> dict:
    """The layers' loop bodies of the compiled step of `cfg`: {body: (tensor collectives that are not
    collective-permutes, [(each collective-permute, the matmuls independent of it)])}."""
    mesh = {a: getattr(cfg.mesh, a) for a in MeshConfig.AXES}
    module = hlo.parse(compile_step(cfg, layout_from_config(cfg, jax.device_count())).as_text())
    graph, matmuls = _operands(module), _matmuls(module)
    out = {}
    for body, _ in module.loops:
        instrs = [i for i in module.instrs if i.computation == body]
        if not any(i.name in matmuls for i in instrs):
            continue
        edges = graph[body]
        users: dict[str, list[str]] = {}
        for n, ops in edges.items():
            for o in ops:
                users.setdefault(o, []).append(n)
        dots = {i.name for i in instrs if i.name in matmuls}
        collectives = [i for i in instrs if i.op in hlo.COLLECTIVES and i.op != "collective-permute"
                       and _over_tensor(i, mesh) and max(a.nbytes for a in i.arrays) > cfg.model.d_model * 4]
        steps = [(i.name, dots - hlo.reachable(i.name, edges) - hlo.reachable(i.name, users))
                 for i in instrs if i.op in ("collective-permute", "collective-permute-start")]
        out[body] = (collectives, steps)
    return out


def _cfg(overlap: str):
    return with_mesh(KV4, data=2, tensor=4, sequence_parallel=True, tensor_overlap=overlap)


@pytest.mark.heavy
def test_each_transfer_runs_beside_a_matmul_and_no_gather_or_scatter_is_left():
    """data=2 x tensor=4 (three steps per collective): in the layers' forward and backward loops,
    every collective-permute has matmuls that neither feed it nor wait on it (its operand is not their
    result, they do not read its result); no activation-sized all-gather, reduce-scatter or
    all-reduce over `tensor` is left (the backward's norm-scale sums, [D], are not activations).
    Without the option the same loops hold SP's gathers and scatters and no collective-permute."""
    plain = _layers(_cfg("none"))
    assert len(plain) == 2, plain.keys()  # the layers' forward and backward scans
    assert all(collectives and not steps for collectives, steps in plain.values()), plain

    layers = _layers(_cfg(CM))
    assert len(layers) == 2, layers.keys()
    for body, (collectives, steps) in layers.items():
        assert not collectives, (body, [c.line[:200] for c in collectives])
        # 4 projections groups (QKV, O, gate/up, down) x 3 steps, forward; their transposes, backward
        assert len(steps) >= 12, (body, len(steps))
        alone = [cp for cp, beside in steps if not beside]
        assert not alone, f"{body}: collective-permutes with no independent matmul: {alone}"


@pytest.mark.parametrize("m,mesh", [(1, dict(data=2)), (1, dict(fsdp=2)), (4, dict(data=2))])
@pytest.mark.heavy
def test_weight_gradients_cross_data_and_fsdp_as_without_it(m, mesh):
    """The weights' gradients cross `data` and `fsdp` with the bytes of the plain program: each is one
    dot over all the tokens (not one per step, which the partitioner reduced separately: 2.5x the
    bytes over data at m = 1), and under the step's replica vmap (m = 4) they stay per replica,
    reduced once per step."""
    def batch_bytes(overlap: str) -> dict:
        cfg = with_mesh(KV4, m, **mesh, tensor=4, sequence_parallel=True, tensor_overlap=overlap)
        module = hlo.parse(compile_step(cfg, layout_from_config(cfg, jax.device_count())).as_text())
        shape = {a: getattr(cfg.mesh, a) for a in MeshConfig.AXES}
        return {k: v for k, v in hlo.bytes_by_axes(hlo.on_mesh(module, shape)).items() if k[0] in ("data", "fsdp")}
    plain = batch_bytes("none")
    assert plain
    assert batch_bytes(CM) == plain


# --------------------------------------------------------------------------------------------------
# The planner
# --------------------------------------------------------------------------------------------------

@pytest.mark.heavy
@pytest.mark.parametrize("model,m,mesh,remat", [
    ("kv4", 1, dict(data=2, tensor=4), "none"),  # 4 forward + 4 mirrors + 2 gathered again, per layer
    ("kv4", 1, dict(data=2, tensor=4), "full"),  # 4 + 4 + 3 recomputed
    # the projections kept, as the plain program's dots (ops.projection.remat_policy): nothing recomputed
    ("kv4", 1, dict(data=2, tensor=4), "dots_with_no_batch_dims_saveable"),
    ("base", 2, dict(pipeline=2, fsdp=2, tensor=2), "none"),  # per executed tick
])
def test_planner_counts_the_steps_the_compiled_program_sends(model, m, mesh, remat):
    """The planner's collective-matmul steps (`collectives._collective_matmul`) are the compiled
    step's collective-permutes over `tensor`, byte for byte; under a dot-saving remat policy the
    compiled matmul FLOPs are the planner's too (no projection run again in the backward)."""
    from lumen_jax.compiler.compiled import against_xla
    from lumen_jax.plan.hardware import DEVICES
    from lumen_jax.plan.predict import predict
    base = KV4 if model == "kv4" else BASE
    cfg = with_mesh(base.replace(model=dataclasses.replace(base.model, remat=remat)), m, **mesh,
                    sequence_parallel=True, tensor_overlap=CM)
    plan = predict(cfg, layout_from_config(cfg, jax.device_count()), DEVICES["h100"], attention="xla")
    check = against_xla(cfg, plan)
    predicted, compiled = check.collectives["tensor permute"]
    assert compiled > 0
    assert predicted == pytest.approx(compiled, rel=1e-9)
    if remat.startswith("dots"):
        assert check.matmul_predicted == pytest.approx(check.matmul_compiled, rel=1e-9)


def test_planner_hides_the_steps_under_the_matmuls_and_no_more():
    """With the option the layers' tensor collectives hide under (n-1)/n of the matmuls: a step
    shorter than that shows nothing of them; a layout whose transfers outgrow the matmuls shows the
    rest. The option off, our program hides none (`Overlap().tensor` = 0)."""
    from lumen_jax.config import Config, DataConfig, ModelConfig, TrainConfig
    from lumen_jax.plan.hardware import DEVICES, Layout
    from lumen_jax.plan.predict import predict
    model = ModelConfig(d_model=8192, num_layers=80, num_heads=64, num_kv_heads=8, ffn_dim=28672,
                        vocab_size=128256, compute_dtype="bfloat16", remat="full")
    cfg = Config(model=model, data=DataConfig(seq_len=8192, global_batch_size=256), train=TrainConfig())

    def tensor_seconds(overlap: str, hw) -> tuple[float, float, float, float]:
        mesh = MeshConfig(fsdp=32, tensor=8, sequence_parallel=True, tensor_overlap=overlap)
        plan = predict(cfg.replace(mesh=mesh), Layout(mesh, pipeline=1, micro_batches=1), hw)
        sent = [(c, e) for c, e in zip(plan.collectives, plan.exposed) if c.axis == "tensor" and c.kind == "send/recv"]
        exposed = sum(e for c, e in zip(plan.collectives, plan.exposed) if c.axis == "tensor")
        return sum(c.seconds for c, _ in sent), sum(e for _, e in sent), exposed, plan.compute.matmul_s

    h100 = DEVICES["h100"]
    sent, shown, _, _ = tensor_seconds(CM, h100)
    assert sent > 0 and shown == 0  # NVLink: 7 steps of 1/8 row under the projections' dots
    plain_exposed = tensor_seconds("none", h100)[2]
    assert plain_exposed > 0 and tensor_seconds(CM, h100)[2] < 0.01 * plain_exposed
    slow = dataclasses.replace(h100, nvlink_bytes_per_s=h100.nvlink_bytes_per_s / 50)
    sent, shown, _, matmul = tensor_seconds(CM, slow)
    assert shown == pytest.approx(sent - matmul * 7 / 8, rel=1e-9)
