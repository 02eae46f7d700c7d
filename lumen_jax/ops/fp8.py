"""fp8 matmuls: E4M3 operands forward, E5M2 gradients backward, fp32 accumulation, three scaling recipes.

`ops.projection.project` calls `einsum(spec, x, w, recipe, history)` for a projection whose layer
type runs in fp8 (`ops.choice.Ops` says which, from `model.fp8`); everything else keeps its plain
einsum. Each operand is multiplied by
a scale, clipped to the format's largest finite value (never inf) and cast to fp8; the product is
accumulated in fp32 and divided by the scales; the output has the activation's dtype. Weights are
quantized from the fp32 master copy, and their gradient is returned in fp32.

Recipes (`model.fp8.recipe`):

- `current`: per-tensor scale `fp8_max / amax` from this step's amax of each operand.
- `delayed` (Transformer Engine): per-tensor scale from the max of an amax history of the previous
  `amax_history` steps (most recent first). The first step, with an empty history, scales by the
  current amax. The histories are inputs of the custom VJP, and its backward pass emits the updated
  histories as their "gradients" (flax's overwrite-with-gradient): the train step stores these as
  the new state instead of applying them. A global `jnp.max` over a sharded tensor is a reduction
  over the mesh, so every device computes the same scales and histories.
  Projections that read one input (Q/K/V, gate/up: `einsum`'s `peers`) scale it from the max of
  their x histories, which hold the same values (each records the amax of that input): one scale,
  so XLA quantizes the input once and merges their GEMMs, as under `current`. The state keeps a
  history per projection and operand (checkpoints unchanged).
- `blockwise` (DeepSeek-V3): a scale per 1x128 tile of activations and gradients (along the
  contraction) and per 128x128 block of weights; for the weight gradient the tiles run along the
  sequence (128x1). Per-block scales along the contraction cannot be factored out of one GEMM, so
  the quantized operands are dequantized and multiplied in the compute dtype: fp8 numerics, not
  fp8 speed (that needs a block-scaled GEMM kernel).

The forward's quantized operands, scales and amaxes are named `RESIDUAL_NAME`: the remat
policies that save the projections' products keep them (`ops.projection.SAVED_WITH_DOTS`), so the
backward does not quantize the f32 master weights and the activations again.

On GPUs with fp8 tensor cores (sm_89+), the per-tensor recipes' `dot_general(fp8, fp8) -> bf16`
times a scalar is what XLA's GEMM rewriter turns into one cuBLASLt fp8 GEMM
(`__cublas$lt$matmul$f8`) that scales in fp32 and writes bf16 (`_scaled_dot`; the compiled program:
`benchmarks/gpu_aot.py`); `fp8_gemms(hlo_text)` finds them. On CPU XLA upcasts the operands:
numerics only.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from lumen_jax.config import Fp8Config
from lumen_jax.ops.state import ModelState

E4M3 = jnp.float8_e4m3fn  # activations and weights: 3 mantissa bits, max 448
E5M2 = jnp.float8_e5m2  # gradients: 2 mantissa bits, max 57344, wider range
TILE = 128  # blockwise recipe: 1 x TILE activation tiles, TILE x TILE weight blocks
_AMAX_FLOOR = 2.0 ** -100  # keeps fp8_max / amax finite in fp32 for denormal amaxes

RESIDUAL_NAME = "fp8_operand"  # the forward's quantized operands, scales and amaxes, kept for the backward
HISTORY_KEYS = ("x", "w", "g")  # the operands of one projection: input, weight, output gradient
WARM_SCOPE = "fp8_warm"  # the named scope of the branch that runs with warm histories (`ops.choice.Ops.by_state`)


def fp8_max(dtype: Any) -> float:
    """The largest finite value of an fp8 format (a Python float: ml_dtypes gives an fp8 scalar)."""
    return float(ml_dtypes.finfo(dtype).max)


def amax(x: jax.Array) -> jax.Array:
    """max |x| as an fp32 scalar (over the whole mesh when `x` is sharded)."""
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def compute_scale(amax_: jax.Array, dtype: Any) -> jax.Array:
    """`fp8_max / amax`, so the largest magnitude lands on the format's max; 1 where amax is 0 or not finite."""
    amax_ = jnp.asarray(amax_, jnp.float32)
    ok = (amax_ > 0) & jnp.isfinite(amax_)
    return jnp.where(ok, fp8_max(dtype) / jnp.maximum(amax_, _AMAX_FLOOR), 1.0).astype(jnp.float32)


def quantize(x: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """`x * scale` saturated to +-fp8_max (never inf; NaN stays NaN) and cast to `dtype`."""
    m = fp8_max(dtype)
    return jnp.clip(x.astype(jnp.float32) * scale, -m, m).astype(dtype)


def dequantize(q: jax.Array, scale: jax.Array, dtype: Any = jnp.float32) -> jax.Array:
    return (q.astype(jnp.float32) / scale).astype(dtype)


def delayed_scale(history: jax.Array, current_amax: jax.Array, dtype: Any, warm: bool = False) -> jax.Array:
    """Scale from the max of the amax history; the current amax while the history is still empty.
    `warm` (static): the caller knows the history is not empty (`warm`), so the scale is the
    history's alone and does not wait for the current amax (the same value when the history is not
    empty): the quantization can then fuse into the pass that produces its operand."""
    past = jnp.max(history)
    if warm:
        return compute_scale(past, dtype)
    return compute_scale(jnp.where(past > 0, past, current_amax), dtype)


def warm(histories: Any) -> jax.Array:
    """Whether every amax history [..., H] in the pytree `histories` (a run of layers' `Fp8History`
    stacks) holds a recorded amax: then every delayed scale of those layers is the history's alone
    (`delayed_scale(..., warm=True)` gives what `warm=False` gives). False before the first step."""
    leaves = jax.tree.leaves(histories)
    return jnp.all(jnp.stack([jnp.all(jnp.max(h, axis=-1) > 0) for h in leaves])) if leaves else jnp.asarray(False)


def update_history(history: jax.Array, current_amax: jax.Array) -> jax.Array:
    """The history [H] shifted by one step, `current_amax` first (the oldest value drops out)."""
    return jnp.roll(history, 1).at[0].set(current_amax)


# --------------------------------------------------------------------------------------------------
# Blockwise quantization
# --------------------------------------------------------------------------------------------------


def quantize_blocks(x: jax.Array, block: tuple[int, ...], dtype: Any) -> tuple[jax.Array, jax.Array]:
    """Quantizes `x` with one scale per block of shape `block` (1 along untiled axes).

    Axes whose length is not a multiple of the block are zero-padded for the amax (zeros do not
    change it). Returns (fp8 values shaped like x, scales [ceil(n_i / b_i) ...]).
    """
    pads = [(0, -n % b) for n, b in zip(x.shape, block)]
    xp = jnp.pad(x.astype(jnp.float32), pads)
    split = [d for n, b in zip(xp.shape, block) for d in (n // b, b)]
    tiles = xp.reshape(split)
    within = tuple(range(1, 2 * x.ndim, 2))
    scale = compute_scale(jnp.max(jnp.abs(tiles), axis=within, keepdims=True), dtype)
    q = quantize(tiles, scale, dtype).reshape(xp.shape)
    q = q[tuple(slice(0, n) for n in x.shape)]
    return q, jnp.squeeze(scale, within)


def dequantize_blocks(q: jax.Array, scale: jax.Array, block: tuple[int, ...], dtype: Any) -> jax.Array:
    """Inverse of `quantize_blocks`: every element divided by its block's scale, cast to `dtype`."""
    full = scale
    for axis, b in enumerate(block):
        full = jnp.repeat(full, b, axis=axis)
    full = full[tuple(slice(0, n) for n in q.shape)]
    return (q.astype(jnp.float32) / full).astype(dtype)


def fake_quantize_blocks(x: jax.Array, block: tuple[int, ...], fmt: Any, dtype: Any) -> jax.Array:
    """`x` rounded through `fmt` with per-block scales, as `dtype` (the values an fp8 GEMM would see)."""
    q, s = quantize_blocks(x, block, fmt)
    return dequantize_blocks(q, s, block, dtype)


# --------------------------------------------------------------------------------------------------
# The quantized dot: x [*B, K] . w [K, N] -> [*B, N], with a custom VJP
# --------------------------------------------------------------------------------------------------


def _dims_xw(x: jax.Array) -> Any:  # x's last axis with w's first
    return (((x.ndim - 1,), (0,)), ((), ()))


def _dims_gw(g: jax.Array) -> Any:  # dx = g . w^T: g's last axis with w's last
    return (((g.ndim - 1,), (1,)), ((), ()))


def _dims_xg(x: jax.Array) -> Any:  # dw = x^T . g: every batch axis of x with g's
    batch = tuple(range(x.ndim - 1))
    return ((batch, batch), ((), ()))


def _scaled_dot(a: jax.Array, b: jax.Array, dims: Any, inv_scale: jax.Array, dtype: Any) -> jax.Array:
    """fp8 x fp8 GEMM accumulated in fp32, its result written in `dtype` times one scalar: XLA's GPU
    GEMM rewriter makes this one cuBLASLt fp8 GEMM whose epilogue applies the scale (in fp32) and
    writes `dtype`. (A dot to fp32 followed by the rescale and the cast is not fused: the GEMM then
    writes an fp32 [tokens, N] array that a separate pass converts, and the remat policy saves
    that fp32 product for the backward pass: twice the bytes of the bf16 step's.)"""
    out = jax.lax.dot_general(a, b, dims, preferred_element_type=dtype)
    return out * inv_scale.astype(dtype)


def _tensor_scales(recipe: str, hist: dict, x: jax.Array, w: jax.Array) -> tuple[jax.Array, ...]:
    ax, aw = amax(x), amax(w)
    if recipe in ("delayed", "delayed_warm"):
        hot = recipe == "delayed_warm"
        return ax, aw, delayed_scale(hist["xs"], ax, E4M3, hot), delayed_scale(hist["w"], aw, E4M3, hot)
    return ax, aw, compute_scale(ax, E4M3), compute_scale(aw, E4M3)


def _operand(a: jax.Array, scale: jax.Array, fmt: Any, keep: jax.Array | None, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """(a quantized to `fmt` with `scale`, the scale): without `keep`, the fp8 operand; with `keep`
    (a traced bool, `dot`), the compute-dtype `a` and scale 1 where it holds, else the fp8 values as
    `dtype` (exact: every e4m3 and e5m2 value is a bf16 one), so one GEMM in the compute dtype
    computes either."""
    if keep is None:
        return quantize(a, scale, fmt), scale
    return (jnp.where(keep, a.astype(dtype), quantize(a, scale, fmt).astype(dtype)),
            jnp.where(keep, jnp.float32(1.0), scale))


def _saved(a: jax.Array) -> jax.Array:
    """`a` named `RESIDUAL_NAME` for the remat policies (`ops.projection.SAVED_WITH_DOTS`). An fp8
    array is named as its bits (uint8; the bitcasts are free): named as fp8 under a policy that
    saves it, the model's scanned layers computed NaN from finite values (jax 0.10.2)."""
    if a.dtype not in (E4M3, E5M2):
        return checkpoint_name(a, RESIDUAL_NAME)
    bits = checkpoint_name(jax.lax.bitcast_convert_type(a, jnp.uint8), RESIDUAL_NAME)
    return jax.lax.bitcast_convert_type(bits, a.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _tensor_dot(x: jax.Array, w: jax.Array, hist: dict, keep: jax.Array | None, recipe: str) -> jax.Array:
    return _tensor_dot_fwd(x, w, hist, keep, recipe)[0]


def _tensor_dot_fwd(x, w, hist, keep, recipe):
    ax, aw, sx, sw = _tensor_scales(recipe, hist, x, w)
    (qx, sx), (qw, sw) = _operand(x, sx, E4M3, keep, x.dtype), _operand(w, sw, E4M3, keep, x.dtype)
    # the scalars as one saved vector: one stacked residual per projection, not four (a scan over
    # the layers writes each residual into its stack in a pass of its own)
    qx, qw = _saved(qx), _saved(qw)
    sx, sw, ax, aw = _saved(jnp.stack([sx, sw, ax, aw]))
    y = _scaled_dot(qx, qw, _dims_xw(x), 1.0 / (sx * sw), x.dtype)
    # fp8 residuals: the backward GEMMs reuse the forward's quantized operands (as Transformer Engine).
    # (Empty arrays carry the operands' dtypes: residuals must be arrays.)
    return y, (qx, qw, sx, sw, ax, aw, hist, keep, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


def _tensor_dot_bwd(recipe, res, g):
    qx, qw, sx, sw, ax, aw, hist, keep, x_like, w_like = res
    x_dtype, w_dtype = x_like.dtype, w_like.dtype
    ag = amax(g)
    delayed = recipe in ("delayed", "delayed_warm")
    sg = delayed_scale(hist["g"], ag, E5M2, recipe == "delayed_warm") if delayed else compute_scale(ag, E5M2)
    qg, sg = _operand(g, sg, E5M2, keep, x_dtype)
    dx = _scaled_dot(qg, qw, _dims_gw(g), 1.0 / (sg * sw), x_dtype)
    dw = _scaled_dot(qx, qg, _dims_xg(qx), 1.0 / (sx * sg), w_dtype)
    # Overwrite-with-gradient: the "cotangent" of each history is its next value (a kept layer's
    # stays 0, as without `keep`, where the layer's einsum never reads it).
    new_hist = ({"x": update_history(hist["x"], ax), "w": update_history(hist["w"], aw),
                 "g": update_history(hist["g"], ag), "xs": jnp.zeros_like(hist["xs"])}  # xs: no gradient
                if delayed else hist)
    if keep is not None and delayed:
        new_hist = jax.tree.map(lambda h: jnp.where(keep, jnp.zeros_like(h), h), new_hist)
    return dx, dw, new_hist, None  # None: `keep` (a bool) has no cotangent


_tensor_dot.defvjp(_tensor_dot_fwd, _tensor_dot_bwd)


def _tiles_last(ndim: int) -> tuple[int, ...]:  # 1 x TILE along the last axis
    return (1,) * (ndim - 1) + (TILE,)


def _tiles_seq(ndim: int) -> tuple[int, ...]:  # TILE x 1: along the sequence (the last batch axis)
    return (1,) * (ndim - 2) + (TILE, 1)


def _fake(a: jax.Array, block: tuple[int, ...], fmt: Any, keep: jax.Array | None, dtype: Any) -> jax.Array:
    """`fake_quantize_blocks`, or `a` itself where the traced `keep` holds (see `_operand`)."""
    q = fake_quantize_blocks(a, block, fmt, dtype)
    return q if keep is None else jnp.where(keep, a.astype(dtype), q)


@jax.custom_vjp
def _block_dot(x: jax.Array, w: jax.Array, keep: jax.Array | None) -> jax.Array:
    dx = _fake(x, _tiles_last(x.ndim), E4M3, keep, x.dtype)
    dw = _fake(w, (TILE, TILE), E4M3, keep, x.dtype)
    return jax.lax.dot_general(dx, dw, _dims_xw(x), preferred_element_type=jnp.float32).astype(x.dtype)


def _block_dot_fwd(x, w, keep):
    return _block_dot(x, w, keep), (x, w, keep)


def _block_dot_bwd(res, g):
    x, w, keep = res
    cd = x.dtype
    g_rows = _fake(g, _tiles_last(g.ndim), E5M2, keep, cd)  # dgrad contracts over N
    w_blocks = _fake(w, (TILE, TILE), E4M3, keep, cd)
    dx = jax.lax.dot_general(g_rows, w_blocks, _dims_gw(g), preferred_element_type=jnp.float32)
    g_seq = _fake(g, _tiles_seq(g.ndim), E5M2, keep, cd)  # wgrad contracts over tokens
    x_seq = _fake(x, _tiles_seq(x.ndim), E4M3, keep, cd)
    dw = jax.lax.dot_general(x_seq, g_seq, _dims_xg(x), preferred_element_type=jnp.float32)
    return dx.astype(x.dtype), dw.astype(w.dtype), None


_block_dot.defvjp(_block_dot_fwd, _block_dot_bwd)


def dot(x: jax.Array, w: jax.Array, recipe: str, history: dict | None = None,
        keep: jax.Array | None = None, input_history: jax.Array | None = None, warm: bool = False) -> jax.Array:
    """x [*B, K] . w [K, N] -> [*B, N] in x.dtype with fp8 operands (see the module docstring).

    Args:
      x: activations in the compute dtype.
      w: weights, best the fp32 master copy (quantized from it; its gradient comes back in w.dtype).
      recipe: current | delayed | blockwise.
      history: delayed only: {"x", "w", "g"} amax histories [H]; their gradients are the updated
        histories.
      keep: None, or a traced bool: where it holds, the product of `x` and `w` in the compute dtype
        (a layer kept in bf16, `recipe: none`'s numbers) and the histories' next values 0; else fp8.
        Both run as one GEMM in the compute dtype on the fp8 values (a pipeline stage whose layer
        slot holds a kept layer on some stages only: `ops.choice.Ops.stage_runs`).
      input_history: delayed only: the amax history [H] that scales `x` (default `history["x"]`),
        one shared by the projections that read `x`; it has no gradient (`history["x"]` still
        records this `x`'s amax).
      warm: delayed only (static): every history is known not empty (`warm`): the scales are the
        histories' alone, not waiting for the current amaxes (same values).
    """
    if recipe == "blockwise":
        return _block_dot(x, w, keep)
    if recipe not in ("current", "delayed"):
        raise ValueError(f"fp8 recipe {recipe!r} is not one of current, delayed, blockwise")
    if recipe != "delayed":
        return _tensor_dot(x, w, {}, keep, recipe)
    scales_x = history["x"] if input_history is None else jax.lax.stop_gradient(input_history)
    return _tensor_dot(x, w, {**history, "xs": scales_x}, keep, "delayed_warm" if warm else recipe)


# --------------------------------------------------------------------------------------------------
# Per-layer state and the einsum `ops.projection.project` calls
# --------------------------------------------------------------------------------------------------


class Fp8History(ModelState):
    """An amax history [H] of one operand of one projection (delayed recipe): model state, not a
    parameter. Micro-batches' next histories differ only in their newest slot: keep the max."""

    combine = staticmethod(jnp.maximum)


def _kept(cfg: Fp8Config, num_layers: int) -> set[int]:
    """The layers `keep_bf16` holds in the compute dtype (first and/or last)."""
    return ({0} if "first" in cfg.keep_bf16 else set()) | ({num_layers - 1} if "last" in cfg.keep_bf16 else set())


def layer_mask(cfg: Fp8Config, num_layers: int) -> tuple[bool, ...]:
    """Per layer, whether its chosen matmuls run in fp8 (`keep_bf16` holds first and/or last)."""
    if cfg.recipe == "none":
        return (False,) * num_layers
    kept = _kept(cfg, num_layers)
    return tuple(i not in kept for i in range(num_layers))


def layer_runs(cfg: Fp8Config, num_layers: int) -> list[tuple[int, int, bool]]:
    """The layers as runs [start, stop) of equal `layer_mask` value: (0, 1, False), (1, L-1, True),
    (L-1, L, False) with the first and last layers kept in bf16. The model scans each run with its
    setting fixed (`ops.choice.Ops.layer_runs`), so no layer needs a per-layer `lax.cond`. Computed
    from the kept layers' edges, not layer by layer (a user's layer count is not a loop bound)."""
    kept = _kept(cfg, num_layers)
    edges = sorted({0, num_layers} | {e for k in kept for e in (k, k + 1) if 0 <= e <= num_layers})
    runs: list[tuple[int, int, bool]] = []
    for a, b in zip(edges, edges[1:]):
        on = cfg.recipe != "none" and a not in kept
        if runs and runs[-1][2] == on:
            runs[-1] = (runs[-1][0], b, on)
        else:
            runs.append((a, b, on))
    return runs


def runs_fp8(cfg: Fp8Config, num_layers: int, layer_type: str) -> bool:
    """Whether any layer runs the projections of `layer_type` (attention | mlp) in fp8."""
    return layer_type in cfg.layers and cfg.recipe != "none" and num_layers > len(_kept(cfg, num_layers))


def histories(cfg: Fp8Config, projections: tuple[str, ...]) -> nnx.Dict:
    """The delayed recipe's state of one layer: {projection: {x, w, g: Fp8History [H]}}."""
    return nnx.Dict({p: nnx.Dict({k: Fp8History(jnp.zeros((cfg.amax_history,), jnp.float32), out_sharding=(None,))
                                  for k in HISTORY_KEYS}) for p in projections})


def _split_spec(spec: str, x_ndim: int, w_ndim: int) -> int:
    """Number of contracted axes of a projection einsum `x..., w... -> out`; checks its form."""
    inputs, out = spec.split("->")
    xs, ws = inputs.split(",")
    c = len(set(xs) & set(ws))
    ok = (len(xs) == x_ndim and len(ws) == w_ndim and xs[x_ndim - c:] == ws[:c]
          and out == xs[:x_ndim - c] + ws[c:])
    if not ok:
        raise ValueError(f"fp8 einsum {spec!r} must contract x's trailing axes with w's leading ones")
    return c


def einsum(spec: str, x: jax.Array, w: jax.Array, recipe: str, history: dict | None = None,
           keep: jax.Array | None = None, peers: tuple[dict, ...] | None = None, warm: bool = False) -> jax.Array:
    """`jnp.einsum(spec, x, w)` with fp8 operands (recipe current | delayed | blockwise), or in the
    compute dtype with recipe `none` (a layer kept in bf16 among fp8 layers).

    The contracted axes (x's trailing, w's leading) and w's output axes are merged so the GEMM is
    x [*B, K] . w [K, N]; the merges keep the sharded axis major (heads before head_dim).
    `history`: delayed only, this projection's {x, w, g} `Fp8History` variables; `keep`: see `dot`.
    `peers`: delayed only, the histories of every projection reading this `x` (Q/K/V, gate/up; this
    one's included): x is scaled from the max of their x histories (`dot`'s `input_history`), the
    same scale for each, so XLA quantizes x once for them all and may merge their GEMMs.
    `warm`: see `dot`.
    """
    c = _split_spec(spec, x.ndim, w.ndim)
    batch, out_dims = x.shape[:x.ndim - c], w.shape[c:]
    k = int(np.prod(w.shape[:c]))
    x2, w2 = x.reshape(*batch, k), w.reshape(k, int(np.prod(out_dims)))
    if recipe == "none":  # a layer kept in bf16: the plain matmul, exactly as without fp8
        y = jnp.einsum("...k,kn->...n", x2, w2.astype(x2.dtype))
    else:
        hist = None if history is None else {key: history[key][...] for key in HISTORY_KEYS}
        shared = None if history is None or not peers else jnp.max(jnp.stack([p["x"][...] for p in peers]), axis=0)
        y = dot(x2, w2, recipe, hist, keep, shared, warm)
    return y.reshape(*batch, *out_dims)


# --------------------------------------------------------------------------------------------------
# HLO check
# --------------------------------------------------------------------------------------------------


def fp8_gemms(hlo_text: str) -> list[str]:
    """The instructions of an HLO module that are fp8 GEMMs: cuBLASLt fp8 custom calls or dots on f8 operands.

    Works on `compiled.as_text()` (GPU: `__cublas$lt$matmul$f8` custom calls) and on pre-optimization
    HLO (`lowered.as_text(dialect="hlo")`: `dot(f8e4m3fn[...] %a, f8e5m2[...] %b)`). An f8 operand
    converted to f16/bf16/f32 before the dot (what XLA:CPU does) is not an fp8 GEMM and is not listed.
    """
    types = dict(_DEF.findall(hlo_text))  # instruction name -> element type
    found = []
    for line in hlo_text.splitlines():
        s = line.strip()
        if "__cublas$lt$matmul$f8" in s:
            found.append(s)
            continue
        m = re.search(r"\bdot\((.*?)\)", s)
        if m:
            operands = re.findall(r"(?:(\w+)\[[^\]]*\]\S*\s+)?(%?[\w.\-]+)", m.group(1))
            kinds = [t or types.get(name, "") for t, name in operands]
            if len(kinds) == 2 and all(k.startswith("f8") for k in kinds):
                found.append(s)
    return found


_DEF = re.compile(r"(%?[\w.\-]+) = (\w+)\[")


__all__ = ["E4M3", "E5M2", "TILE", "Fp8History", "amax", "compute_scale", "delayed_scale",
           "dequantize", "dequantize_blocks", "dot", "einsum", "fake_quantize_blocks", "fp8_gemms", "fp8_max",
           "histories", "layer_mask", "layer_runs", "quantize", "quantize_blocks", "runs_fp8",
           "update_history", "warm"]
