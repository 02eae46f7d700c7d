"""THE logical-axis -> mesh-axis table. The only place where model axis names meet mesh axis names.

Model code names every parameter and activation axis logically (`embed`, `heads`, `batch`, ...).
`Rules` turns those names into `PartitionSpec`s for one run, from the ZeRO stage and whether
Megatron sequence parallelism is on:

==============  =====================  ==========================================================
logical axis    mesh axes              why
==============  =====================  ==========================================================
batch           (data, fsdp, expert)   data parallelism; FSDP/ZeRO and expert parallelism shard the batch like DP
                                       (minus the step's replica axes inside its per-replica vmap)
seq             context                context parallelism splits every sequence
act_seq         (context, tensor)      residual stream between blocks under sequence parallelism
                context                ... and without it
proj_seq        context                a column-parallel projection's input: gathered over tensor ...
                as act_seq             ... unless mesh.tensor_overlap=collective_matmul gathers it in steps
vocab           tensor                 vocab-parallel embedding and logits (Megatron)
heads/kv_heads  tensor                 column split of Q/K/V, row split of the attention output
mlp             tensor                 column split of MLP-in, row split of MLP-out (each expert's too)
experts         expert                 MoE: each device of the `expert` axis holds num_experts/E experts
embed, latent   fsdp (params)          ZeRO-3: parameters sharded over `fsdp` (and `context` with
                                       mesh.zero_axes=fsdp+context, all three kinds; latent: MLA's compressed
                                       width, the input of its up-projections; replicated over tensor)
                fsdp (optimizer)       ZeRO-1/2/3: optimizer state always sharded
                fsdp (gradients)       ZeRO-2/3: gradients reduce-scattered
layers          pipeline               the stacked blocks cut into pipeline stages
devices         every axis but         one block per device: a split backward's recorded expert rows
                pipeline (and replica)
head_dim, norm, act_embed -> replicated
==============  =====================  ==========================================================

Activation constraints are applied with `constrain(x, names)`; it is a no-op outside `activate`,
so single-device model code runs untouched.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Iterator, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MeshAxes = str | tuple[str, ...] | None


@dataclasses.dataclass(frozen=True)
class Rules:
    """Logical -> mesh axis tables for params, gradients, optimizer state and activations."""

    zero_stage: int = 3
    sequence_parallel: bool = False
    # The mesh axes the ZeRO-sharded dims (`embed`, `latent`) of params, gradients and optimizer state
    # split over (mesh.zero_axes): fsdp, or fsdp and context (Megatron's distributed optimizer over DP x CP)
    zero_axes: tuple[str, ...] = ("fsdp",)
    # How attention crosses the `context` axis (lumen_jax/parallel/context.py): not a table entry,
    # but the same kind of decision, read by the attention dispatch under `activate`.
    context_parallel: str = "ring"  # ring | allgather
    context_balance: str = "zigzag"  # zigzag | contiguous
    # How the tensor-parallel projections cross `tensor` under sequence parallelism
    # (lumen_jax/parallel/collective_matmul.py), read by the projection dispatch under `activate`:
    # none (GSPMD's all-gather / reduce-scatter) | collective_matmul
    tensor_overlap: str = "none"
    # Batch axes taken by the train step's vmapped replica dimension (step.Placement: micro-batch
    # gradients summed per replica group, reduced once per step). Inside it `batch` maps to the rest,
    # and `seq` to nothing when `context` is among them (each group holds one chunk of the tokens).
    replica_axes: tuple[str, ...] = ()

    def _table(self, kind: str) -> dict[str, MeshAxes]:
        embed_sharded = {"params": self.zero_stage >= 3, "grads": self.zero_stage >= 2,
                         "optimizer": self.zero_stage >= 1, "activations": False}[kind]
        zero = (self.zero_axes[0] if len(self.zero_axes) == 1 else self.zero_axes) if embed_sharded else None
        context = None if "context" in self.replica_axes else "context"
        sp_seq = tuple(a for a in (context, "tensor") if a)
        act_seq = (sp_seq if len(sp_seq) > 1 else sp_seq[0]) if self.sequence_parallel else context
        return {
            # parameter axes
            "vocab": "tensor",
            "embed": zero,
            "latent": zero,
            "heads": "tensor",
            "kv_heads": "tensor",
            "mlp": "tensor",
            "experts": "expert",
            "head_dim": None,
            "norm": None,
            "layers": "pipeline",
            "depths": None,  # multi-token prediction's modules: with the head, on every pipeline stage
            # activation axes
            "batch": tuple(a for a in ("data", "fsdp", "expert") if a not in self.replica_axes) or None,
            "seq": context,
            "act_seq": act_seq,
            # the sequence of a column-parallel projection's input (Q/K/V, gate/up): gathered over
            # `tensor` before it (`seq`), or left split as the residual stream when the projection
            # gathers it itself in steps under its matmuls (`tensor_overlap`, parallel/collective_matmul.py)
            "proj_seq": act_seq if self.tensor_overlap == "collective_matmul" else context,
            "act_embed": None,
            "act_heads": "tensor",
            "act_kv_heads": "tensor",
            "act_mlp": "tensor",
            "act_vocab": "tensor",
            # one block per device of the axes `shard.per_device` splits over (inside a pipeline
            # stage, which holds `pipeline` itself): a device's own rows, e.g. a split backward's
            # recorded expert rows (`ops.projection.Tape.grouped`)
            "devices": tuple(a for a in ("data", "fsdp", "expert", "context", "tensor")
                             if a not in self.replica_axes),
        }

    def spec(self, names: Sequence[str | None], kind: str = "activations") -> P:
        """PartitionSpec for one array whose axes carry `names` (None: replicated axis)."""
        table = self._table(kind)
        axes = []
        for n in names:
            if n is not None and n not in table:
                raise KeyError(f"logical axis {n!r} has no rule in lumen_jax/parallel/rules.py")
            axes.append(None if n is None else table[n])
        return P(*axes)

    def tree_specs(self, names_tree: Any, kind: str) -> Any:
        """Map a pytree whose leaves are tuples of logical names to PartitionSpecs."""
        return jax.tree.map(lambda n: self.spec(n, kind), names_tree,
                            is_leaf=lambda x: isinstance(x, tuple))


_ACTIVE: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar(
    "lumen_rules", default=None)


@contextlib.contextmanager
def activate(mesh: Mesh, rules: Rules) -> Iterator[None]:
    """Within this context (while tracing), `constrain` pins activations to `mesh` via `rules`."""
    token = _ACTIVE.set((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active() -> tuple[Mesh, Rules] | None:
    """The (mesh, rules) of the enclosing `activate`, or None outside one (single-device code)."""
    return _ACTIVE.get()


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Sharding constraint on an activation by logical axis names; identity outside `activate`."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    inner = jax.sharding.get_abstract_mesh()
    if not inner.empty and inner.manual_axes:  # inside a shard_map over some axes (pipeline stages)
        mesh = inner
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, rules.spec(names)))
