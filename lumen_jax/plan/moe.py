"""The mixture-of-experts terms of a plan: the dispatch's buffers, the bytes an MoE layer saves and
works in, its all-to-all bytes, and the FLOPs XLA's `cost_analysis` counts for it.

The dispatch's arrays have static shapes (`parallel/expert.py`, `ops/grouped.py`), sized for the
worst case a dropless exchange must hold (every assignment of the expert group landing on one
device), so they follow from the config and the layout alone. Two backends:

- `gpu`: `ragged_all_to_all` sends only the routed rows (balanced routing assumed for the bytes on
  the wire), into a receive buffer of the worst case; the experts are `ragged_dot` over the rows.
- `cpu` (what `--against-xla` compiles): the padded exchange sends the worst-case buffers
  [E, slots, D] each way (in f32: XLA:CPU promotes bf16 collectives), and the experts run as row
  blocks (`ops.grouped`), each expert's rows padded to whole blocks.

Shape letters as in `parallel/expert.py`: n a device's tokens in one micro-batch, K top-k, A = n*K,
E = mesh.expert, X local experts, D d_model, F the expert's hidden width over `tensor`.
"""

from __future__ import annotations

import dataclasses

from lumen_jax.config import ModelConfig
from lumen_jax.ops.grouped import block_rows
from lumen_jax.parallel.expert import capacity
from lumen_jax.plan.hardware import Layout, compute_bytes

BACKENDS = ("gpu", "cpu")
F32 = 4
I32 = 4
# Transient bytes of an MoE layer's backward beyond what it saved, in copies of its saved bytes
# (the cotangents of the rows and of the exchange's buffers, partly written over what the backward
# has read): fitted to XLA:CPU's buffer assignment of 6 compiled steps (docs/PLANNING.md, "Mixture
# of experts"). Under remat the recomputed layer's buffers are the working set (measured: 1.0 copy).
BACKWARD_COPIES = 0.25
# Elementwise work `cost_analysis` counts per element of the experts' padded rows [P, D] in one MoE
# layer's forward and backward (zero-filled buffers, the gathers' fill selects, the loops' updates):
# fitted to the same steps.
ROW_ELEMENTWISE_OPS = 30


@dataclasses.dataclass(frozen=True)
class Dispatch:
    """The static sizes of one MoE layer's dispatch on one device."""

    tokens: int  # n
    assignments: int  # A = n * K
    experts: int  # X, local
    ep: int  # mesh.expert
    slots: int  # rows one device may send to one other
    rows: int  # rows a device's experts may receive: ep * slots (ep > 1) or A
    padded: int  # rows the experts compute over: `rows` (gpu); whole blocks per expert (cpu)


def moe_layers(model: ModelConfig, layout: Layout) -> int:
    """MoE layers on one pipeline stage."""
    if not model.moe.enabled:
        return 0
    return -(-(model.num_layers // model.moe.every_n_layers) // layout.pipeline)


def dispatch(model: ModelConfig, layout: Layout, tokens: float, backend: str = "gpu") -> Dispatch:
    """The dispatch of `tokens` tokens per device (one micro-batch) on `layout`."""
    moe, ep = model.moe, layout.mesh.expert
    n = int(tokens)
    a, x = n * moe.top_k, moe.num_experts // ep
    cap = capacity(n, moe.top_k, moe.num_experts, moe.capacity_factor)
    slots = min(a, x * cap)
    rows = ep * slots if ep > 1 else a
    padded = rows
    if backend == "cpu":
        block = block_rows(a, x)
        padded = (-(-rows // block) + x) * block
    return Dispatch(n, a, x, ep, slots, rows, padded)


def layer_bytes(model: ModelConfig, layout: Layout, tokens: float, backend: str = "gpu") -> dict[str, float]:
    """Bytes one MoE layer keeps on one device: `saved` for its backward (remat none), `working`
    while its backward runs, `router` the router's fp32 rows (saved like the layer's others).

    saved: the experts' input rows [P, D] and their gate and up outputs [P, F] (the grouped
    SwiGLU's custom VJP), the received rows' buffer [rows, D] (the padded exchange also keeps the
    rows coming back [E, slots, D]), the expert outputs per assignment [A, D] in fp32 and in the
    compute dtype with the fill masks of their gathers [A, D] (bool), and the int32 row indices.
    """
    d = dispatch(model, layout, tokens, backend)
    c, dim = compute_bytes(model), model.d_model
    f = model.expert_ffn_dim / layout.mesh.tensor
    saved = c * (d.padded * dim + 2 * d.padded * f)
    saved += I32 * (d.padded + 3 * d.assignments + d.rows)
    if d.ep > 1:
        saved += c * d.rows * dim  # the received rows (and, padded, the rows coming back)
        if backend == "cpu":
            saved += c * d.ep * d.slots * dim
    saved += d.assignments * dim * (F32 + c + 2)
    router = d.tokens * model.moe.num_experts * 3 * F32  # logits, probabilities, their one-hot counts
    return {"saved": saved, "working": BACKWARD_COPIES * saved, "router": router}


def all_to_all_bytes(model: ModelConfig, layout: Layout, tokens: float, backend: str = "gpu") -> dict[str, float]:
    """Payload of one exchange of one MoE layer on one device: `rows` (token rows, compute dtype)
    and `ids` (the padded exchange's int32 local expert per slot; the ragged one sends counts)."""
    d = dispatch(model, layout, tokens, backend)
    if backend == "gpu":  # only the routed rows, balanced
        return {"rows": d.assignments * model.d_model * compute_bytes(model), "ids": 0.0}
    # XLA:CPU runs bf16 collectives in f32 (docs/PLATFORM.md)
    return {"rows": d.ep * d.slots * model.d_model * F32, "ids": d.ep * d.slots * I32}


def counted_expert_flops(model: ModelConfig, layout: Layout, tokens: float, remat: str) -> tuple[float, float]:
    """(what the plan counts, what `cost_analysis` counts) for the routed experts of one MoE layer
    on one device: the plan 6 x K x 3DF per token (+2 with full remat); the compiler counts the
    body of each experts' loop once (`ops.grouped`, a loop over the blocks in use): one block of
    three matmuls forward, six backward (three more when remat recomputes the layer), and
    `ROW_ELEMENTWISE_OPS` per element of the padded rows."""
    d = dispatch(model, layout, tokens, "cpu")
    per_row = 2 * 3 * model.d_model * model.expert_ffn_dim / layout.mesh.tensor
    passes = 4 if remat == "full" else 3
    block = block_rows(d.assignments, d.experts)
    counted = (block * per_row + ROW_ELEMENTWISE_OPS / 3 * d.padded * model.d_model) * passes
    return d.tokens * model.moe.top_k * per_row * passes, counted
