"""Every mesh gives the single-device run's losses and gradients (fp32, 3 optimizer steps)."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from helpers.meshes import mesh_shape
from helpers.run import BASE, assert_same_run, run, with_mesh
from lumen_jax.train.build import build
from lumen_jax.parallel.mesh import make_mesh


@pytest.fixture(scope="module")
def reference():
    return run(with_mesh(BASE), devices=jax.devices()[:1])


# data and fsdp alone: inside data=2,fsdp=2,tensor=2 (and fsdp=8 at 4 micro-batches below); context with
# tensor: data=2,context=2,tensor=2 (the ring has no branch on C: context=2 with fsdp is context=4's
# code). ZeRO-1: tests/parallel/test_communication.py's zero1,data=2,fsdp=4 at 4 micro-batches (at one
# micro-batch its gradients reduce as plain data parallelism's) and the golden specs below.
MESHES = {
    "data=2,fsdp=2,tensor=2": dict(data=2, fsdp=2, tensor=2),
    "fsdp=4,tensor=2,sp": dict(fsdp=4, tensor=2, sequence_parallel=True),
    "zero2,data=2,fsdp=4": dict(data=2, fsdp=4, zero_stage=2),
    "context=4,fsdp=2": dict(context=4, fsdp=2),  # ring attention, zigzag layout
    "data=2,context=2,tensor=2": dict(data=2, context=2, tensor=2),
    "allgather,fsdp=2,context=2,tensor=2,sp": dict(fsdp=2, context=2, tensor=2, sequence_parallel=True,
                                                   context_parallel="allgather"),
}


@pytest.mark.heavy
@pytest.mark.parametrize("name", list(MESHES))
def test_mesh_matches_single_device(name, reference):
    got = run(with_mesh(BASE, **MESHES[name]))
    assert np.all(np.diff(reference["losses"]) < 0), reference["losses"]  # the optimizer is doing work
    assert_same_run(got, reference, name)


@pytest.mark.heavy
def test_micro_batches_equal_one_big_batch(reference):
    got = run(with_mesh(BASE, micro_batches=4, fsdp=8))
    assert_same_run(got, reference, "micro_batches=4")


# Golden table: the exact PartitionSpec of every parameter (leading axis = stacked layers).
# The stacked `layers` axis is split over `pipeline` (size 1 here: the stages of a pipelined run).
GOLDEN_FSDP4_TP2 = {
    "embed": P("tensor", "fsdp"),
    "lm_head": P("fsdp", "tensor"),
    "final_norm/scale": P(None),
    "blocks/attn/wq": P("pipeline", "fsdp", "tensor", None),
    "blocks/attn/wk": P("pipeline", "fsdp", "tensor", None),
    "blocks/attn/wv": P("pipeline", "fsdp", "tensor", None),
    "blocks/attn/wo": P("pipeline", "tensor", None, "fsdp"),
    "blocks/attn_norm/scale": P("pipeline", None),
    "blocks/mlp/w_gate": P("pipeline", "fsdp", "tensor"),
    "blocks/mlp/w_up": P("pipeline", "fsdp", "tensor"),
    "blocks/mlp/w_down": P("pipeline", "tensor", "fsdp"),
    "blocks/mlp_norm/scale": P("pipeline", None),
}
# ZeRO-1: parameters replicated over fsdp (only tensor splits remain); optimizer state as ZeRO-3.
GOLDEN_ZERO1_PARAMS = {k: P(*(None if a == "fsdp" else a for a in v)) for k, v in GOLDEN_FSDP4_TP2.items()}


def _flat(tree) -> dict:
    return {"/".join(str(k.key) for k in path): v
            for path, v in jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: isinstance(x, P))}


@pytest.mark.parametrize("zero_stage,params_golden", [(3, GOLDEN_FSDP4_TP2), (1, GOLDEN_ZERO1_PARAMS)])
def test_partition_specs_golden(zero_stage, params_golden):
    cfg = with_mesh(BASE, zero_stage=zero_stage, fsdp=4, tensor=2)
    trainer = build(cfg, make_mesh(mesh_shape(fsdp=4, tensor=2)))
    assert _flat(trainer.param_specs("params")) == params_golden
    assert _flat(trainer.param_specs("optimizer")) == GOLDEN_FSDP4_TP2
    placed = _flat(jax.tree.map(lambda s: s.spec, trainer.state_shardings.params,
                                is_leaf=lambda x: hasattr(x, "spec")))
    assert placed == params_golden
