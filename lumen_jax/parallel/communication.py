"""How the train step's gradients and weights cross the mesh (`mesh.fsdp_grad_reduce`,
`mesh.fsdp_regather`, `mesh.reduce_dtype`; docs/COMMUNICATION.md).

With gradient accumulation the step keeps one gradient sum per replica group, unreduced, and
reduces the sums once after the last micro-batch. A replica group is the set of devices with one
index along the replica axes: always `data` (its gradients need nothing before the optimizer),
`fsdp` too under `fsdp_grad_reduce=once` (then each device accumulates full-size gradients; under
`every_micro_batch` each micro-batch's gradients are reduce-scattered over `fsdp` into a sharded
accumulator), and `context`, whose devices hold the weights whole and each make partial gradients
of their chunk of the sequence (Megatron reduces them with `data`'s, once). `data` and `fsdp` groups
take rows of the batch; `context` groups take chunks of every row's tokens (`replica_seq`). The step computes with weights cast to the compute dtype while still sharded, so the
FSDP all-gathers carry compute-dtype bytes; `fsdp_regather=per_step` gathers them once per step,
before the first micro-batch, and keeps them for the others and for every backward.

`gradient_plan` turns those settings into the sharding of each intermediate tree; `build` pins
them with `with_sharding_constraint` (`step.Placement`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec as P

from lumen_jax.config import MeshConfig
from lumen_jax.parallel.rules import Rules


@dataclasses.dataclass(frozen=True)
class GradientPlan:
    """The shardings of the step's intermediate trees for one run."""

    replica_axes: tuple[str, ...]  # mesh axes of the replica dimension (empty: no accumulation)
    replicas: int  # R, their product
    replica_seq: int  # C: the groups among the R that split each row's tokens (`context`'s size, or 1)
    weight_specs: Any  # {path: PartitionSpec} of the compute-dtype weights the micro-batches use
    accumulator_specs: Any  # {path: PartitionSpec} of the [R, ...] gradient sums


def _without(spec: P, axes: tuple[str, ...]) -> tuple:
    """The entries of `spec` with the mesh axes `axes` removed."""
    out = []
    for entry in spec:
        kept = tuple(a for a in (entry if isinstance(entry, tuple) else (entry,)) if a is not None and a not in axes)
        out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return tuple(out)


def gradient_plan(cfg: MeshConfig, micro_batches: int, mesh: Mesh, rules: Rules, names: Any,
                  pipelined: bool = False, per_replica: bool = True) -> GradientPlan:
    """The shardings for `cfg` on `mesh` (see the module docstring).

    Args:
      cfg: the mesh section (fsdp_grad_reduce, fsdp_regather).
      micro_batches: train.micro_batches; with 1 there is nothing to accumulate (no replica axes).
      mesh: the trainer's mesh.
      rules: the run's logical -> mesh axis rules.
      names: {path: logical axis names} of the parameters.
      pipelined: the step runs a pipeline schedule (parallel/pipeline/executor.py), whose stages sum
        their gradients over the schedule's ticks even with one micro-batch.
      per_replica: whether the step may run under the replica vmap (not a pipelined step with
        sequence parallelism, `train/build.py`); if not, there are no replica axes (that step's
        stages make `data` and `context` manual and reduce them once: parallel/pipeline/executor.py).
    """
    candidates = ("data", "fsdp", "context") if cfg.fsdp_grad_reduce == "once" else ("data", "context")
    accumulates = micro_batches > 1 or pipelined
    axes = tuple(a for a in candidates if mesh.shape[a] > 1) if accumulates and per_replica else ()
    is_names = lambda x: isinstance(x, tuple)  # noqa: E731
    gathered = cfg.zero_mesh_axes if cfg.fsdp_regather == "per_step" else ()
    weights = jax.tree.map(lambda n: P(*_without(rules.spec(n, "params"), gathered)), names, is_leaf=is_names)
    accumulators = jax.tree.map(lambda n: P(axes or None, *_without(rules.spec(n, "grads"), axes)), names,
                                is_leaf=is_names)
    return GradientPlan(replica_axes=axes, replicas=math.prod(mesh.shape[a] for a in axes),
                        replica_seq=mesh.shape["context"] if "context" in axes else 1,
                        weight_specs=weights, accumulator_specs=accumulators)
