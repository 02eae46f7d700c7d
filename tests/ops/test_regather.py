"""`Ops.regather` (issue 45 part 1): under sequence parallelism with `remat: none`, the column-parallel
projections keep their input's own rows for the backward and gather them again there, and the
row-parallel ones gather their output cotangent once (`ops.projection.project_columns`, `project_rows`).

The gradients equal plain einsums on one device; the compiled step keeps 2 inputs per layer split
instead of gathered (the planner's `memory.regathered_inputs`, to the byte) and gathers 6 rows per
layer over `tensor`, as the planner counts them.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from helpers.run import BASE, with_mesh
from helpers.tolerances import FP32_RTOL, assert_tree_close
from lumen_jax.compiler import hlo
from lumen_jax.compiler.compiled import compile_step
from lumen_jax.config import MeshConfig
from lumen_jax.ops import projection
from lumen_jax.ops.choice import Ops
from lumen_jax.parallel import rules as rules_lib
from lumen_jax.parallel.mesh import make_mesh
from lumen_jax.plan import memory
from lumen_jax.plan.hardware import layout_from_config

B, T, D, F = 4, 16, 8, 12


def _loss(x, wq, wk, wo, ops):
    q, k = projection.project_columns(("btd,df->btf", "btd,df->btf"), x, (wq, wk), ops)
    return jnp.sum(projection.project_rows("btf,fd->btd", jnp.tanh(q) * k, wo, ops) ** 2)


def test_regathered_projections_match_plain_einsums():
    """data=4 x tensor=2 with sequence parallelism: the custom VJPs run (planted: `regathers` always
    False -> the jaxpr check fails) and the input and weight gradients equal plain einsums' on one
    device, fp32 (planted: the weight gradient from the local rows alone -> shape error; the input
    gradient not summed over the projections -> fails)."""
    rng = np.random.default_rng(0)
    args = [rng.standard_normal(s).astype(np.float32) for s in ((B, T, D), (D, F), (D, F), (F, D))]
    want = jax.grad(lambda *a: _loss(*a, Ops()), argnums=(0, 1, 2, 3))(*args)

    mesh = make_mesh({**{a: 1 for a in MeshConfig.AXES}, "data": 4, "tensor": 2}, jax.devices()[:8])
    ops = Ops(regather=True)
    with rules_lib.activate(mesh, rules_lib.Rules(sequence_parallel=True)):
        assert projection.regathers()
        split = NamedSharding(mesh, rules_lib.Rules(sequence_parallel=True).spec(("batch", "act_seq", "act_embed")))
        x = jax.device_put(args[0], split)

        def loss(x, *ws):
            return _loss(rules_lib.constrain(x, ("batch", "proj_seq", "act_embed")), *ws, ops)
        jaxpr = str(jax.make_jaxpr(loss)(x, *args[1:]))
        got = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, *args[1:])
    assert jaxpr.count("custom_vjp_call") == 2, jaxpr
    assert_tree_close(got, want, rtol=FP32_RTOL, what="regathered projections vs plain einsums")
    with rules_lib.activate(mesh, rules_lib.Rules(sequence_parallel=False)):
        assert not projection.regathers()  # nothing to gather: the plain einsums


def _compiled(monkeypatch, regather: bool):
    cfg = with_mesh(BASE, fsdp=4, tensor=2, sequence_parallel=True)
    layout = layout_from_config(cfg, 8)
    with monkeypatch.context() as patch:
        if not regather:
            patch.setattr(projection, "regathers", lambda ndim=3: False)
        compiled = compile_step(cfg, layout)
    return cfg, layout, compiled


@pytest.mark.heavy
def test_the_step_keeps_the_local_rows_and_gathers_them_again(monkeypatch):
    """fsdp=4 x tensor=2, sequence parallelism, remat none: the compiled step's temporaries fall by
    exactly the gathered inputs' other half (2 per layer, [4, 32, 64] fp32 of which t - 1 = 1 of 2
    rows), the planner's `saved` by the same bytes; the layers gather 6 rows each over `tensor`
    (2 forward, 2 cotangents, 2 own rows again; measured 4 without regather at one micro-batch).
    Planted: `_regathered_fwd` keeping the gathered x -> the temporaries do not fall; the row
    projections' backward without its one gather of the cotangent -> 8 per layer at 4 micro-batches
    (tests/parallel/test_communication.py's sp cases)."""
    cfg, layout, new = _compiled(monkeypatch, True)
    _, _, old = _compiled(monkeypatch, False)
    model, tp = cfg.model, cfg.mesh.tensor
    tokens = cfg.data.global_batch_size // cfg.mesh.fsdp * cfg.data.seq_len
    design = 2 * model.num_layers * tokens * model.d_model * (tp - 1) // tp * 4
    fell = old.memory_analysis().temp_size_in_bytes - new.memory_analysis().temp_size_in_bytes
    assert fell == design, (fell, design)
    assert memory.regathered_inputs(model, layout, "none") == 2
    planned = [memory.activation_bytes(model, layout, cfg.data.seq_len,
                                       cfg.data.global_batch_size // cfg.mesh.fsdp).saved]
    with monkeypatch.context() as patch:
        patch.setattr(memory, "regathered_inputs", lambda *a: 0)
        planned.append(memory.activation_bytes(model, layout, cfg.data.seq_len,
                                               cfg.data.global_batch_size // cfg.mesh.fsdp).saved)
    assert planned[1] - planned[0] == design, planned

    shape = {a: getattr(cfg.mesh, a) for a in MeshConfig.AXES}
    row = tokens * model.d_model * 4
    def gathered_rows(compiled):
        found = hlo.on_mesh(hlo.parse(compiled.as_text()), shape)
        return sum(c.count for c in found if c.axes == ("tensor",) and c.kind == "all-gather" and c.bytes == row)
    # per layer 6 (4 before); outside the layers one more gather of a [tokens, D] row (measured)
    assert (gathered_rows(new), gathered_rows(old)) == (6 * model.num_layers + 1, 4 * model.num_layers + 1)
