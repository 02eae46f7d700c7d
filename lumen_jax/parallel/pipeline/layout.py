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
    # Layers per virtual stage when they differ (`mesh.pipeline_layers`), or when the model's first layers
    # are of their own kind (`first`); (): even stages. See `pad`.
    layers: tuple[int, ...] = ()
    # The model's first layers of their own kind (MoE's `model.moe.first_dense_layers`): the first `first`
    # entries of the stack `first_stack`. They fill the first virtual stages in order (`firsts`); every
    # virtual stage holds max(firsts) slots of them, before its share of that stack (see `pad`).
    first: int = 0
    first_stack: str = "blocks"

    @classmethod
    def create(cls, mesh: Mesh, d_model: int, compute_dtype: str, schedule: str, micro_batches: int,
               virtual: int = 1, stacks: tuple[str, ...] = ("blocks",), layers: tuple[int, ...] = (),
               first: int = 0, num_layers: int = 0) -> "Pipeline":
        """`first`: the model's first layers of their own kind in `blocks` (0: none); `num_layers` the
        model's layers (needed with `first` and even stages)."""
        chunks = mesh.shape[AXIS] * virtual
        if first and len(set(layers)) <= 1:  # even stages: made explicit (the first ones are placed)
            layers = (num_layers // chunks,) * chunks
        return cls(mesh=mesh, program=lockstep(schedule, mesh.shape[AXIS], micro_batches, virtual),
                   d_model=d_model, compute_dtype=compute_dtype, stacks=stacks,
                   layers=tuple(layers) if len(set(layers)) > 1 or first else (), first=first)

    def stage_layers(self, num_layers: int) -> list[int]:
        """The real layers of each virtual stage, of a model of `num_layers` (even stages: equal)."""
        chunks = self.program.stages * self.program.virtual
        return list(self.layers) or [num_layers // chunks] * chunks

    def firsts(self) -> list[int]:
        """The model's first layers (`first`) each virtual stage holds: they fill the stages in order
        (stage 0 up to its `layers`, then stage 1, ...)."""
        out, left = [], self.first
        for n in self.layers:
            out.append(min(left, n))
            left -= out[-1]
        return out

    def stage_rest(self) -> list[int]:
        """The real layers of each virtual stage after the model's first ones (what a stage's share of
        every stack follows; its `layers` without `first`)."""
        return [n - f for n, f in zip(self.layers, self.firsts() or [0] * len(self.layers))]

    def _parts(self, length: int, stack: str | None) -> tuple[list[int], list[int]]:
        """(first entries, share entries) per virtual stage of a stack of `length` entries: `first_stack`
        holds the model's first layers (`firsts`) before its share; every stack holds a fixed share of
        the layers after them (an MoE model's `moe_blocks` one in `every_n_layers`, its `blocks` the
        rest), and each stage the same share of its own (the config checks they divide)."""
        firsts = self.firsts() if self.first and stack == self.first_stack else [0] * len(self.layers)
        rest = self.stage_rest()
        return firsts, [n * (length - sum(firsts)) // sum(rest) for n in rest]

    def split(self, length: int | None = None, stack: str | None = None) -> list[int]:
        """Entries per virtual stage of a stack of `length` (None: the model's layers)."""
        length = sum(self.layers) if length is None else length
        return [f + n for f, n in zip(*self._parts(length, stack))]

    def slots(self, length: int | None = None, stack: str | None = None) -> np.ndarray:
        """[length]: the padded slot of each real entry. Virtual stage w owns S = Fmax + Nmax slots
        from w * S: its first layers' (`firsts`, Fmax = their max; none but in `first_stack`) from
        w * S, its share's from w * S + Fmax. The real entries are the first ones, then the shares."""
        length = sum(self.layers) if length is None else length
        firsts, share = self._parts(length, stack)
        fmax, size = max(firsts), max(firsts) + max(share)
        return np.concatenate([w * size + np.arange(n) for w, n in enumerate(firsts)]
                              + [w * size + fmax + np.arange(n) for w, n in enumerate(share)]).astype(np.int64)

    def real_slots(self, padded: int, stack: str | None = None) -> np.ndarray:
        """`slots` of a padded stack of `padded` entries (P*V*S, `slots`), in `stack`."""
        firsts = self.firsts() if self.first and stack == self.first_stack else [0] * len(self.layers)
        rest = self.stage_rest()
        share_max = padded // len(self.layers) - max(firsts)
        return self.slots(sum(firsts) + share_max * sum(rest) // max(rest), stack)

    @property
    def reorders(self) -> bool:
        """Whether the stacks in memory differ from the real layers in order (`pad`): uneven stages,
        the model's first layers placed, or interleaved (V > 1). Such a run stores and reads the real
        layers (`train.build`)."""
        return bool(self.layers) or self.program.virtual > 1

    def pad(self, stacks: Any, stack: str | None = None) -> Any:
        """The real layers [L, ...] in order -> the stacks as held in memory, as the stages read them
        (`stack`: the stack's name, which says whether it holds the model's first layers):
        uneven stages (`layers`) padded to [P*V*S, ...], every virtual stage w owning S slots from
        w * S (`slots`), its layers first, zeros in the rest; then, interleaved,
        ordered device-major (`to_stages`), so that the step moves no layer between devices
        (identity with even stages and V = 1). A stack with a share of the layers (MoE: `split`)
        is padded in the same share. The model's first layers (`first`: DeepSeek-V3's dense ones)
        sit in the first Fmax slots of `first_stack` on the first stage(s) and are zeros elsewhere:
        every stage computes Fmax such slots (in lock step) and the first stage(s) real ones.

        A slot of zeros is exactly the identity of the pre-norm residual block (zero norm scales give a
        zero input; Gemma's norms, times 1 + w, do not, but its zero projections then give zero queries,
        keys, values and MLP, and a post-norm of zero is zero; zero output projections add 0, a zero MoE
        layer's experts add 0) and its gradients
        are exactly 0, so AdamW keeps it zero: it is computed in lock step (a tick lasts as long as the
        dearest stage anyway) and adds nothing. A zero router still routes: its balance loss and
        metrics are left out (`real_layers`).
        """
        def one(a):
            firsts, share = self._parts(a.shape[0], stack)
            size = len(share) * (max(firsts) + max(share))
            return jnp.zeros((size, *a.shape[1:]), a.dtype).at[self.slots(a.shape[0], stack)].set(a)
        return self.to_stages(jax.tree.map(one, stacks) if self.layers else stacks)

    def unpad(self, stacks: Any, stack: str | None = None) -> Any:
        """The inverse of `pad`: the stacks in memory -> the real layers [L, ...] in order."""
        stacks = self.from_stages(stacks)
        if not self.layers:
            return stacks
        return jax.tree.map(lambda a: a[self.real_slots(a.shape[0], stack)], stacks)

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
