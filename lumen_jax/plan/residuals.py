"""What one layer saves for its backward pass, read off the model itself.

The planner never hard-codes a layer's residuals: it traces a small bf16 probe of the real model
(`PROBE`, widths all distinct) under `jax.ad_checkpoint.print_saved_residuals` and names each saved
tensor by its width class, so a change to a layer, the attention or a remat policy changes the
counts with it (`layer_residuals`). `recomputes` reads off the same probe which forward work a remat
policy makes the backward pass re-run. `plan/memory.py` turns the counts into bytes.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import io
import math
import re

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import print_saved_residuals

from lumen_jax.config import PROJECTION_NAMES, REMAT_SAVES, MeshConfig, ModelConfig
from lumen_jax.metrics import flops
from lumen_jax.model import apply, param_shapes_and_names
from lumen_jax.ops.choice import Ops
from lumen_jax.parallel import rules as rules_lib
from lumen_jax.parallel.rules import Rules


@functools.lru_cache(maxsize=16)
def param_leaves(model: ModelConfig) -> tuple[tuple[str, tuple[int, ...], tuple[str, ...]], ...]:
    """(path, shape, logical axis names) of every parameter, traced without allocating."""
    _, shapes, names = param_shapes_and_names(model)
    flat_shapes = jax.tree_util.tree_flatten_with_path(shapes)[0]
    flat_names = jax.tree.leaves(names, is_leaf=lambda x: isinstance(x, tuple))
    return tuple((jax.tree_util.keystr(p), tuple(s.shape), n) for (p, s), n in zip(flat_shapes, flat_names))


# Width classes, in elements per token on one device: D d_model (split by sequence parallelism),
# G d_model gathered for a matmul, Q = N*H, KV = K*H, F ffn, S = N*seq (one row of attention
# scores per head), N heads (softmax statistics), V vocab. Dtype classes: c the compute dtype,
# f fp32, b bool.
PROBE = ModelConfig(d_model=40, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=6, ffn_dim=28,
                    vocab_size=64, compute_dtype="bfloat16")
_PROBE_WIDTHS = {40: "D", 24: "Q", 12: "KV", 28: "F", 4: "N"}  # all distinct on purpose
_KV_WIDTH = 12
_PROBE_MIN_SEQ = 48  # a residual whose last axis is longer than every width above holds scores
_DTYPES = {"bf16": "c", "f32": "f", "bool": "b"}
_RESIDUAL = re.compile(r"(\w+)(<host>)?\[([\d,]*)\] (.*)")


@dataclasses.dataclass(frozen=True)
class Residuals:
    """What one layer saves for its backward pass under a remat policy, read off the model."""

    rows: tuple[tuple[str, str, float], ...]  # (width class, dtype class, count): per layer, per token;
    # S counts rows of the whole S x S square (a causal implementation that skips blocks keeps < 1)
    weight_copies: float  # the layer's matmul weights kept again in the compute dtype, in copies
    hoisted: tuple[tuple[str, str, float], ...]  # per token, once per step (loop-invariant, e.g. masks)
    score_block: float  # the largest single score tensor, as a fraction of the S x S square
    host: tuple[tuple[str, str, float], ...] = ()  # like `rows`, offloaded to host memory

    def counts(self, host: bool = False) -> collections.Counter:
        """`rows` by (width class, dtype class); with `host`, the offloaded rows too."""
        counts = collections.Counter()
        for k, d, n in self.rows + (self.host if host else ()):
            counts[k, d] += n
        return counts


def _probe_mesh(context: int):
    """An abstract mesh (no devices) with `context` devices on the context axis, for tracing only."""
    axes = MeshConfig.AXES
    return jax.sharding.AbstractMesh(tuple(context if a == "context" else 1 for a in axes), axes,
                                     axis_types=(jax.sharding.AxisType.Auto,) * len(axes))


def layer_residuals(remat: str, seq_len: int = _PROBE_MIN_SEQ, attention: str = "xla", context: int = 1,
                    context_parallel: str = "ring") -> Residuals:
    """The residuals of the model's layer under `remat` at sequence length `seq_len`, with the
    model's `attention` implementation (xla or flash), on `context` devices of context parallelism.

    Read off `jax.ad_checkpoint.print_saved_residuals` of a two-layer bf16 probe of the real model
    (traced, nothing allocated) whose widths are all distinct, so each residual's elements per token
    name its width class; a residual larger per token than every width holds attention scores. The
    planner therefore follows the model code: change a layer, the attention or a remat policy and
    the counts change with it. With `context` > 1 and xla attention the probe runs under an abstract
    mesh with that context axis, through the trainer's ring or all-gather attention
    (`lumen_jax.parallel.context`: a custom VJP that saves the local q, k, v, o and log-sum-exp; a
    remat policy may save the chunk kernels' dots on top). With flash attention inside context
    parallelism the chunk kernel is the flash kernel, whose residuals are the same as without it.
    """
    if context > 1 and attention == "flash":
        context = 1
    # Under context parallelism one saved score block per token is seq/context elements: longer
    # than every width from 48 * context tokens on (the ring's counts do not depend on seq_len).
    seq = 64 * context if context > 1 else max(seq_len, _PROBE_MIN_SEQ)
    return _probe(remat, seq, attention, context, context_parallel if context > 1 else "ring")


@functools.lru_cache(maxsize=64)  # one trace per distinct probe, however its callers spell the arguments
def _probe(remat: str, seq: int, attention: str, context: int, context_parallel: str) -> Residuals:
    """`layer_residuals` of a probe of `seq` tokens (its arguments as the probe uses them)."""
    model = dataclasses.replace(PROBE, remat=remat, attention=attention)
    # Traced, never run: Pallas's interpreter takes the probe's head_dim of 6, which the compiled
    # kernel refuses; its custom VJP saves the same residuals.
    graphdef, shapes, _ = param_shapes_and_names(model, Ops.plain(model, interpret=True, context=context > 1))
    weight_shapes = {shape[1:] for _, shape, names in param_leaves(model) if names[0] == "layers"}
    tokens = jnp.zeros((1, seq), jnp.int32)
    positions = jnp.arange(seq, dtype=jnp.int32)[None]
    text = io.StringIO()
    with contextlib.ExitStack() as stack:
        stack.enter_context(contextlib.redirect_stdout(text))
        if context > 1:
            mesh = _probe_mesh(context)
            stack.enter_context(jax.sharding.use_abstract_mesh(mesh))
            stack.enter_context(rules_lib.activate(mesh, Rules(context_parallel=context_parallel)))
        print_saved_residuals(lambda p: apply(graphdef, p, tokens, positions, jnp.ones_like(tokens)).sum(),
                              shapes)
    rows, hoisted, host, weights, block = (collections.Counter(), collections.Counter(), collections.Counter(),
                                           0.0, 0.0)
    square = model.num_heads * seq * seq
    layer_matmul = flops.param_counts(model)["layer_matmul"]
    for line in text.getvalue().splitlines():
        match = _RESIDUAL.match(line)
        if not match:
            continue
        dtype, on_host, dims, source = match.groups()
        shape = tuple(int(d) for d in dims.split(",") if d)
        if dtype not in _DTYPES or len(shape) < 3:
            continue
        saved = host if on_host else rows
        in_scan = "output of scan" in source and shape[0] == model.num_layers
        if in_scan and shape[1:] in weight_shapes:  # a weight, [L, ...], cast to the compute dtype for its matmul
            weights += math.prod(shape[1:]) / layer_matmul if dtype == "bf16" else 0.0
            continue
        # An activation of the batch (of one sequence): [L, 1, ...] from the layer scan; under context
        # parallelism a residual of the per-device attention is [L, context x ..., ...] (stacked over
        # the devices, and over the hops of the ring's loop).
        stacked = in_scan and context > 1 and shape[1] > 1 and shape[1] % context == 0
        if shape[1 if in_scan else 0] != 1 and not stacked:
            continue
        size = math.prod(shape[1 if in_scan else 0:])
        if in_scan and size / seq in _PROBE_WIDTHS:  # N: softmax statistics (flash: log-sum-exp)
            saved[_PROBE_WIDTHS[size / seq], _DTYPES[dtype]] += 1
        elif size / seq > max(_PROBE_WIDTHS):  # attention scores (or their mask), in any axis order
            (saved if in_scan else hoisted)["S", _DTYPES[dtype]] += size / square
            block = max(block, size / square)
        elif in_scan and (shape[-1] == model.head_dim or stacked):
            # a per-block piece of a per-head tensor (queries, or the keys/values up to the block's
            # diagonal), or a context-parallel chunk kernel's partial output in any axis order:
            # counted by its elements as K/V-wide rows (both split by tensor parallelism)
            saved["KV", _DTYPES[dtype]] += size / seq / _KV_WIDTH
    as_rows = lambda c: tuple((k, d, n) for (k, d), n in sorted(c.items()))  # noqa: E731
    return Residuals(rows=as_rows(rows), weight_copies=weights, hoisted=as_rows(hoisted), score_block=block,
                     host=as_rows(host))


def computed_score_fraction(seq_len: int) -> float:
    """The part of the S x S score square the model's attention computes and keeps (1: all of it;
    (1 + 1/blocks) / 2 for an attention that skips the query blocks above the diagonal)."""
    return layer_residuals("none", seq_len).counts()[("S", "f")] or 1.0


def recomputes(remat: str, context: int = 1, context_parallel: str = "ring",
               attention: str = "xla") -> dict[str, tuple[str, ...] | bool]:
    """Which forward work the backward pass re-runs: `projections`, the re-run projections' names
    (`config.PROJECTION_NAMES`): all of them unless the policy saves a projection (an F- or KV-wide
    row), none if it does; a selective policy's (`config.REMAT_SAVES`) from `flops.RECOMPUTES`, as the
    probe's rows carry no names (tests/plan/test_plan.py checks its F-wide rows against it);
    `attention` (QK^T, PV) unless it saves scores (under context parallelism: unless it keeps the
    ring's residuals, whose log-sum-exp is the N-wide row, or the chunk kernels' scores; with the
    flash kernel outside context parallelism: unless it keeps the kernel's log-sum-exp, the N-wide
    row, beside its output)."""
    return dict(_recomputes(remat, context, context_parallel, attention))


@functools.lru_cache(maxsize=256)  # the search asks it several times for every candidate
def _recomputes(remat: str, context: int, context_parallel: str, attention: str) -> dict[str, tuple[str, ...] | bool]:
    kinds = {k for k, _ in layer_residuals(remat, context=context, context_parallel=context_parallel).counts(host=True)}
    again = "S" not in kinds and (context == 1 or "N" not in kinds)
    if attention == "flash" and context == 1:
        again = "N" not in {k for k, _ in layer_residuals(remat, attention="flash").counts(host=True)}
    projections = () if kinds & {"F", "KV"} else PROJECTION_NAMES
    if remat in REMAT_SAVES:
        projections = flops.RECOMPUTES[remat]["projections"]
    return {"projections": projections, "attention": again}
