"""The pipeline's sends run beside compute (issue 45 part 3): in the compiled CPU step (8 devices),
every collective-permute over `pipeline` that `schedule.sends` says has a forward, a backward or a
weight unit beside it has matmuls that neither feed it nor read its result, at least a forward's
(the fill's tick, a forward alone, is the measure); the ones it says wait (the fill's activations, a
drain's cotangents) have less (gpipe's activations the loss's share of the logits; zero_bubble's
sends at the ends of the ticks had its W unit beside them, about 0.9 of a forward here). Per step the program sends one
activation per forward tick and one cotangent per backward tick (the last backward's is not sent,
the first tick with a backward sends the fill's zeros; gpipe's, run on its own, sends none): as
many as before the sends moved (gpipe one fewer), except where the drain is a single tick
(pipeline=2), whose unread send XLA dropped before: one more there. The
numbers are the same as before: tests/parallel/test_pipeline*.py against one device, and the
baseline's bit-identical losses and gradient norms (CHANGELOG, 2026-12-06)."""

import collections
import dataclasses

import jax
import numpy as np
import pytest

from helpers.run import BASE, batches, with_mesh
from lumen_jax.compiler import hlo
from lumen_jax.config import MeshConfig
from lumen_jax.parallel.mesh import make_mesh
from lumen_jax.parallel.pipeline import schedule as pipeline_lib
from lumen_jax.train.build import build


def _compiled(cfg) -> hlo.Module:
    trainer = build(cfg, make_mesh({a: getattr(cfg.mesh, a) for a in MeshConfig.AXES}, jax.devices()))
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=trainer.batch_sharding)
             for k, v in batches(cfg)[0].items()}
    return hlo.parse(trainer.step.lower(trainer.abstract_state(), batch).compile().as_text())


def _direction(line: str, shape: dict[str, int]) -> str:
    """"activation" for a send one stage on (the interleaved wrap from the last stage to the
    first included), "cotangent" for one stage back."""
    p, axis = shape["pipeline"], list(shape).index("pipeline")
    steps = {int(np.unravel_index(b, list(shape.values()))[axis] - np.unravel_index(a, list(shape.values()))[axis]) % p
             for a, b in hlo.device_groups(line)}
    assert len(steps) == 1 and steps <= {1, p - 1}, (steps, line[:200])
    return "activation" if steps == {1} else "cotangent"


# (schedule, P, V, m): 2 layers per chunk, data = 2 (the replica vmap); P = 4, where one stage on
# and one back are two permutations
CASES = [("1f1b", 4, 1, 8), ("interleaved", 4, 2, 4), ("zero_bubble", 4, 1, 8), ("gpipe", 4, 1, 4)]


@pytest.mark.heavy
@pytest.mark.parametrize("name,stages,virtual,m", CASES, ids=[c[0] for c in CASES])
def test_sends_run_beside_compute_where_the_schedule_says(name, stages, virtual, m):
    cfg = with_mesh(BASE, micro_batches=m, pipeline=stages, data=8 // stages, pipeline_schedule=name,
                    pipeline_virtual_stages=virtual)
    cfg = cfg.replace(model=dataclasses.replace(cfg.model, num_layers=2 * stages * virtual),
                      data=dataclasses.replace(cfg.data, global_batch_size=m * 8 // stages))
    shape = {a: getattr(cfg.mesh, a) for a in MeshConfig.AXES}
    module = _compiled(cfg)
    prog = pipeline_lib.lockstep(name, stages, m, virtual)
    sends = [b for b in hlo.beside(module) if hlo._axes(hlo.device_groups(b.instr.line), shape) == ("pipeline",)]
    fill = pipeline_lib.sends(prog)[0]
    assert not fill[0].backward and fill[1][0].beside == ""
    # the fill's tick, a forward alone (its loop body's matmuls): a forward's matmuls
    forward = {b.computation_flops for b in sends if module.executions(b.instr) == fill[0].stop - fill[0].start
               and _direction(b.instr.line, shape) == "activation" and b.flops == 0}
    assert len(forward) == 1, forward
    forward = forward.pop()

    compiled: collections.Counter = collections.Counter()
    for b in sends:
        compiled[(_direction(b.instr.line, shape), b.flops >= forward)] += module.executions(b.instr)
    planned: collections.Counter = collections.Counter()
    for _, row in pipeline_lib.sends(prog):
        for send in row:
            planned[(send.what, send.hidden)] += send.ticks
    assert compiled == planned, f"{name}: compiled (what, beside compute): {dict(compiled)}, planned {dict(planned)}"
    # ticks with a forward and a backward: both sends beside compute (gpipe has none: its sends all wait)
    assert name == "gpipe" or (planned[("activation", True)] and planned[("cotangent", True)]), planned
    # one per forward and one per backward tick (gpipe: one fewer), as many as the sends at the ends of
    # the ticks were (where the drain is longer than one tick, whose last send XLA did not drop)
    ticks = {k: sum(g.stop - g.start for g in prog.segments if getattr(g, k)) for k in ("forward", "backward")}
    assert sum(compiled.values()) == ticks["forward"] + ticks["backward"] - sum(prog.alone()), (dict(compiled), ticks)
