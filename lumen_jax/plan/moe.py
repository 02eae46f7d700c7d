"""The mixture-of-experts terms of a plan: the dispatch's buffers, the bytes an MoE layer saves and
works in, its all-to-all bytes, and the FLOPs XLA's `cost_analysis` counts for it.

The dispatch's arrays have static shapes (`parallel/expert.py`, `ops/grouped.py`), sized for the
worst case a dropless exchange must hold (every assignment of the expert group landing on one
device), so they follow from the config and the layout alone. Two backends:

- `gpu`: `ragged_all_to_all` sends only the routed rows (balanced routing assumed for the bytes on
  the wire), into a receive buffer of the worst case; the experts are `ragged_dot` over the rows.
- `cpu` (what `--against-xla` compiles): the padded exchange sends each token once to each device
  [E, n, D] each way (in f32: XLA:CPU promotes bf16 collectives), and the experts run as row
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
# has read), and under remat the recomputed layer's buffers, in copies of what it would save: fitted
# to XLA:CPU's buffer assignment of 6 compiled steps (docs/PLANNING.md, "Mixture of experts").
BACKWARD_COPIES = 0.15
RECOMPUTE_COPIES = 0.9
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
    rows: int  # assignments a device's experts may receive: ep * slots (gpu), ep * A (cpu) or A (ep = 1)
    padded: int  # rows the experts compute over: `rows` (gpu); whole blocks per expert (cpu)


def moe_layers(model: ModelConfig, layout: Layout) -> int:
    """MoE layers on one pipeline stage."""
    if not model.moe.enabled:
        return 0
    return -(-model.num_moe_layers // layout.pipeline)


def dispatch(model: ModelConfig, layout: Layout, tokens: float, backend: str = "gpu") -> Dispatch:
    """The dispatch of `tokens` tokens per device (one micro-batch) on `layout`."""
    moe, ep = model.moe, layout.mesh.expert
    n = int(tokens)
    a, x = n * moe.top_k, moe.num_experts // ep
    cap = capacity(n, moe.top_k, moe.num_experts, moe.capacity_factor)
    slots = min(a, x * cap)
    rows = ep * slots if ep > 1 else a
    padded = rows
    if backend == "cpu":  # the padded exchange sends tokens: every one of the group's assignments may arrive
        rows = ep * a
        block = block_rows(a, x)
        padded = (-(-rows // block) + x) * block
    return Dispatch(n, a, x, ep, slots, rows, padded)


def layer_bytes(model: ModelConfig, layout: Layout, tokens: float, backend: str = "gpu") -> dict[str, float]:
    """Bytes one MoE layer keeps on one device: `saved` for its backward (remat none), `working`
    while its backward runs, `recomputed` the working set under remat, `router` the router's fp32
    rows (saved like the layer's others).

    saved: the experts' input rows [P, D] and their gate and up outputs [P, F] (the grouped
    SwiGLU's custom VJP) and int32 row indices; the experts' outputs per assignment in the compute
    dtype. With expert parallelism, gpu: the received rows [rows, D], and the outputs combined on
    the sending device in fp32 with their fill masks [A, D]; cpu: the tokens received and their sums
    sent back [E, n, D], the outputs combined on the receiving device [E x n x K, D] (and in fp32).
    Without: the outputs [A, D] combined in fp32 with their fill masks.
    """
    d = dispatch(model, layout, tokens, backend)
    c, dim = compute_bytes(model), model.d_model
    f = model.expert_ffn_dim / layout.mesh.tensor
    saved = c * (d.padded * dim + 2 * d.padded * f) + I32 * (d.padded + 3 * d.assignments + d.rows)
    if d.ep > 1 and backend == "cpu":
        saved += 2 * c * d.ep * d.tokens * dim + (c + F32) * d.rows * dim
    else:
        saved += (c * d.rows * dim if d.ep > 1 else 0) + d.assignments * dim * (F32 + c + 2)
    router = d.tokens * model.moe.num_experts * 3 * F32  # logits, probabilities, their one-hot counts
    return {"saved": saved, "working": BACKWARD_COPIES * saved, "recomputed": RECOMPUTE_COPIES * saved,
            "router": router}


def all_to_alls(model: ModelConfig, layout: Layout, tokens: float, backend: str = "gpu",
                recompute: bool = False) -> list[tuple[str, float, int]]:
    """(what, payload bytes of one call on one device, calls per MoE layer) of the exchanges.

    gpu (`ragged_all_to_all`): the routed rows [A, D] (balanced) out and back, forward and backward,
    and once more each way when the backward recomputes the layer. cpu (the padded exchange):
    each token once per device with its local experts and router weights, one f32 array
    [E, n, D + 2K] (XLA:CPU runs bf16 collectives in f32 anyway), and the devices' sums back
    [E, n, D]; the backward sends both cotangents; a recomputed forward sends the tokens again
    but not the sums (nothing reads them).
    """
    d = dispatch(model, layout, tokens, backend)
    if backend == "gpu":
        return [("token rows to the experts and back", d.assignments * model.d_model * compute_bytes(model),
                 4 + 2 * recompute)]
    tokens_bytes = d.ep * d.tokens * F32
    return [("tokens with their local experts and router weights, f32", tokens_bytes * (model.d_model + 2 * model.moe.top_k),
             2 + recompute),
            ("the experts' weighted sums back, f32", tokens_bytes * model.d_model, 2)]


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
