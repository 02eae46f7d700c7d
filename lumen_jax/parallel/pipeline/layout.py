"""A pipeline's static layout: the mesh, the lock-step program of its schedule, and how the layer
stacks are cut into stages and held in memory (uneven stages padded with zero layers, interleaved
stages ordered device by device). `executor.py` runs the program over it."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from lumen_jax.parallel.pipeline.schedule import Lockstep, lockstep

AXIS = "pipeline"


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """What the pipelined step needs besides the step's own config (hashable: closed over by jit)."""

    mesh: Mesh
    program: Lockstep
    d_model: int
    compute_dtype: str
    stacks: tuple[str, ...] = ("blocks",)  # the top-level parameters stacked along `layers` (cut into stages)
    # Layers per virtual stage when they differ (`mesh.pipeline_layers`); (): even stages. See `pad`.
    layers: tuple[int, ...] = ()

    @classmethod
    def create(cls, mesh: Mesh, d_model: int, compute_dtype: str, schedule: str, micro_batches: int,
               virtual: int = 1, stacks: tuple[str, ...] = ("blocks",), layers: tuple[int, ...] = ()) -> "Pipeline":
        return cls(mesh=mesh, program=lockstep(schedule, mesh.shape[AXIS], micro_batches, virtual),
                   d_model=d_model, compute_dtype=compute_dtype, stacks=stacks,
                   layers=tuple(layers) if len(set(layers)) > 1 else ())

    def stage_layers(self, num_layers: int) -> list[int]:
        """The real layers of each virtual stage, of a model of `num_layers` (even stages: equal)."""
        chunks = self.program.stages * self.program.virtual
        return list(self.layers) or [num_layers // chunks] * chunks

    def split(self, length: int | None = None) -> list[int]:
        """Entries per virtual stage of a stack of `length` (None: the model's layers). A stack holds
        a fixed share of the layers (an MoE model's `moe_blocks` one in `every_n_layers`, its
        `blocks` the rest), and each stage the same share of its own (the config checks they divide)."""
        total = sum(self.layers)
        length = total if length is None else length
        return [n * length // total for n in self.layers]

    def slots(self, length: int | None = None) -> np.ndarray:
        """[length]: the padded slot of each real entry, w * Lmax + j for entry j of virtual stage w."""
        split = self.split(length)
        lmax = max(split)
        return np.concatenate([w * lmax + np.arange(n) for w, n in enumerate(split)])

    def real_slots(self, padded: int) -> np.ndarray:
        """`slots` of a padded stack of `padded` entries: P*V*Lmax_k, the share Lmax_k / Lmax of the layers."""
        return self.slots(padded * sum(self.layers) // (len(self.layers) * max(self.layers)))

    @property
    def reorders(self) -> bool:
        """Whether the stacks in memory differ from the real layers in order (`pad`): uneven stages
        or interleaved (V > 1). Such a run stores and reads the real layers (`train.build`)."""
        return bool(self.layers) or self.program.virtual > 1

    def pad(self, stacks: Any) -> Any:
        """The real layers [L, ...] in order -> the stacks as held in memory, as the stages read them:
        uneven stages (`layers`) padded to [P*V*Lmax, ...], every virtual stage w owning Lmax =
        max(layers) slots from w * Lmax, its layers first, zeros in the rest; then, interleaved,
        ordered device-major (`to_stages`), so that the step moves no layer between devices
        (identity with even stages and V = 1). A stack with a share of the layers (MoE: `split`)
        is padded in the same share.

        A slot of zeros is exactly the identity of the pre-norm residual block (zero norm scales give a
        zero input; Gemma's norms, times 1 + w, do not, but its zero projections then give zero queries,
        keys, values and MLP, and a post-norm of zero is zero; zero output projections add 0, a zero MoE
        layer's experts add 0) and its gradients
        are exactly 0, so AdamW keeps it zero: it is computed in lock step (a tick lasts as long as the
        dearest stage anyway) and adds nothing. A zero router still routes: its balance loss and
        metrics are left out (`real_layers`).
        """
        def one(a):
            split = self.split(a.shape[0])
            return jnp.zeros((len(split) * max(split), *a.shape[1:]), a.dtype).at[self.slots(a.shape[0])].set(a)
        return self.to_stages(jax.tree.map(one, stacks) if self.layers else stacks)

    def unpad(self, stacks: Any) -> Any:
        """The inverse of `pad`: the stacks in memory -> the real layers [L, ...] in order."""
        stacks = self.from_stages(stacks)
        if not self.layers:
            return stacks
        return jax.tree.map(lambda a: a[self.real_slots(a.shape[0])], stacks)

    def bubble(self) -> float:
        """The share of the executed work that is the fill and the drain (the `pipeline_bubble` metric)."""
        return self.program.bubble()

    def to_stages(self, blocks: Any) -> Any:
        """[P*V*Lc, ...] in virtual-stage order -> ordered device by device: device s holds chunks
        c = 0..V-1, the layers of virtual stages c*P + s (identity unless interleaved). Part of `pad`."""
        p, v = self.program.stages, self.program.virtual
        if v == 1:
            return blocks
        return jax.tree.map(lambda a: a.reshape(v, p, -1, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape), blocks)

    def from_stages(self, blocks: Any) -> Any:
        p, v = self.program.stages, self.program.virtual
        if v == 1:
            return blocks
        return jax.tree.map(lambda a: a.reshape(p, v, -1, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape), blocks)
