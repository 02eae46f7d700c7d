"""Attention dispatch: one signature, several implementations.

`attention(q, k, v, ...)` is the only entry point the model calls. Implementations:

- `xla`: the pure-jnp reference below (fp32 softmax, GQA without repeating K/V, causal and
  document masking). It is also the numerical reference for the kernels. In the trainer's step on
  one CPU device (`ops.target.one_cpu_device`) it runs in a heads-first layout that XLA:CPU runs
  faster (`_heads_first_attention`); same values.
- `flash`: FlashAttention-2 Pallas kernels (`lumen_jax.kernels.flash_attention`): no [T, S] score
  matrix in memory, causal blocks above the diagonal skipped, the same masks and GQA. Compiled
  through Triton on GPU; Pallas's interpreter on CPU (correct, slow: for tests). On a multi-device
  mesh the kernel runs per shard under `shard_map` (batch over data/fsdp, heads over tensor).
- `auto`: `flash` on GPU when the kernel supports the shapes, else `xla`.

When the trainer's mesh has `context > 1` the call goes to context parallelism
(`lumen_jax.parallel.context`: ring or all-gather, load-balanced), which runs the chosen
implementation on each (query chunk, key chunk) pair through `block_kernel`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lumen_jax.kernels import flash_attention as flash_lib
from lumen_jax.ops.target import one_cpu_device
from lumen_jax.parallel import context as context_lib
from lumen_jax.parallel import rules as rules_lib


def xla_attention(q_btnh: jax.Array, k_bskh: jax.Array, v_bskh: jax.Array, *,
                  segment_ids_bt: jax.Array | None = None, causal: bool = True,
                  scale: float | None = None) -> jax.Array:
    """Reference attention with grouped-query heads.

    Args:
      q_btnh: queries [B, T, N, H].
      k_bskh, v_bskh: keys/values [B, S, K, H] with N % K == 0 (each K/V head serves N//K queries).
      segment_ids_bt: [B, T] document ids of packed sequences (T == S); tokens attend only within
        their own document. None: one document per row.
      causal: mask future positions.
      scale: softmax scale; default 1/sqrt(H).

    Returns:
      [B, T, N, H] in q's dtype. Scores and softmax are computed in float32.
    """
    b, t, n, h = q_btnh.shape
    s, kh = k_bskh.shape[1], k_bskh.shape[2]
    if n % kh:
        raise ValueError(f"num_heads={n} must be a multiple of num_kv_heads={kh}")
    scale = h ** -0.5 if scale is None else scale
    if one_cpu_device():
        return _heads_first_attention(q_btnh, k_bskh, v_bskh, segment_ids_bt, causal, scale)
    q_btkgh = q_btnh.reshape(b, t, kh, n // kh, h)
    scores = jnp.einsum("btkgh,bskh->bkgts", q_btkgh, k_bskh,
                        preferred_element_type=jnp.float32) * scale
    scores = jnp.where(_block_mask(t, s, causal, segment_ids_bt, segment_ids_bt), scores,
                       jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_bskh.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v_bskh, preferred_element_type=jnp.float32)
    return out.reshape(b, t, n, h).astype(q_btnh.dtype)


def _heads_first_attention(q_btnh: jax.Array, k_bskh: jax.Array, v_bskh: jax.Array,
                           segment_ids_bt: jax.Array | None, causal: bool, scale: float) -> jax.Array:
    """`xla_attention` in a heads-first layout: what it runs in the trainer's step on one CPU device.

    Keys/values [B, K, S, H] and queries [B, K, G*T, H] (the G query heads of one K/V head stacked
    along the rows): both matmuls and the softmax work on contiguous [G*T, S] blocks, so XLA:CPU
    needs no strided copies of the scores, forward or backward (`xla_attention`'s einsums give
    [B, K, G, T, S] scores that it transposed). The softmax's gradient is its closed form
    `p * (dp - sum(p * dp))` (`jax.softmax_custom_jvp`), which saves only the probabilities for
    the backward pass; differentiated through exp, sum and divide it saved the unnormalised
    exponentials, 1/sum^2 and the probabilities. Same values; gradients to float32 rounding.
    """
    b, t, n, h = q_btnh.shape
    s, kh = k_bskh.shape[1], k_bskh.shape[2]
    g = n // kh
    q_bkrh = q_btnh.reshape(b, t, kh, g, h).transpose(0, 2, 3, 1, 4).reshape(b, kh, g * t, h)
    k_bksh, v_bksh = k_bskh.transpose(0, 2, 1, 3), v_bskh.transpose(0, 2, 1, 3)
    batch = ((0, 1), (0, 1))  # (batch, kv head)
    scores = jax.lax.dot_general(q_bkrh, k_bksh, (((3,), (3,)), batch),
                                 preferred_element_type=jnp.float32) * scale
    mask = _block_mask(t, s, causal, segment_ids_bt, segment_ids_bt)  # [B|1, 1, 1, T, S]
    mask = jnp.broadcast_to(mask, (mask.shape[0], 1, g, t, s)).reshape(mask.shape[0], 1, g * t, s)
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    with jax.softmax_custom_jvp(True):
        probs = jax.nn.softmax(scores, axis=-1).astype(v_bskh.dtype)
    out = jax.lax.dot_general(probs, v_bksh, (((3,), (2,)), batch), preferred_element_type=jnp.float32)
    return out.reshape(b, kh, g, t, h).transpose(0, 3, 1, 2, 4).reshape(b, t, n, h).astype(q_btnh.dtype)


_IMPLS = ("xla", "flash")


def resolve(impl: str) -> str:
    """The implementation `impl` stands for on this backend: `auto` is `flash` on GPU, else `xla`.

    (`attention` still runs `auto` as `xla` where the kernel cannot: see `_flash_unsupported`.)
    """
    if impl == "auto":
        return "flash" if jax.default_backend() == "gpu" else "xla"
    if impl not in _IMPLS:
        raise ValueError(f"model.attention={impl!r} is not one of {sorted(_IMPLS) + ['auto']}")
    return impl


def _active_mesh() -> tuple[jax.sharding.Mesh, rules_lib.Rules] | None:
    """The trainer's (mesh, rules) while it traces the step under `rules.activate`, if > 1 device."""
    active = rules_lib.active()
    return active if active is not None and active[0].size > 1 else None


def _flash_unsupported(q_btnh: jax.Array, k_bskh: jax.Array) -> str | None:
    """Why the flash kernel cannot take this call on this backend (None: it can)."""
    return flash_lib.check_supported(q_btnh.shape, k_bskh.shape, interpret=flash_lib.default_interpret())


def flash_attention(q_btnh: jax.Array, k_bskh: jax.Array, v_bskh: jax.Array, *,
                    segment_ids_bt: jax.Array | None = None, causal: bool = True,
                    scale: float | None = None, block_q: int = 0, block_kv: int = 0) -> jax.Array:
    """The Pallas FlashAttention kernel with `xla_attention`'s signature.

    Under the trainer's mesh it runs per shard inside `shard_map` (batch over data/fsdp, heads
    over tensor, sequence whole): a Pallas call has no SPMD partitioning rule, so without this XLA
    would gather its operands onto every device. `block_q`/`block_kv` override the tuned tiles
    (0: default; `model.flash_block_q`/`model.flash_block_kv`).
    """
    problem = _flash_unsupported(q_btnh, k_bskh)
    if problem:
        raise ValueError(f"model.attention=flash: {problem}")
    blocks = flash_lib.BlockSizes.default(q_btnh.shape[-1]).with_overrides(block_q, block_kv)
    fn = functools.partial(flash_lib.flash_attention, causal=causal, scale=scale, block_sizes=blocks)
    active = _active_mesh()
    if active is None:
        return fn(q_btnh, k_bskh, v_bskh, segment_ids_bt=segment_ids_bt)
    mesh, rules = active
    q_spec = rules.spec(("batch", None, "act_heads", None))
    kv_spec = rules.spec(("batch", None, "act_kv_heads", None))
    if segment_ids_bt is None:
        return jax.shard_map(lambda q, k, v: fn(q, k, v), mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec),
                             out_specs=q_spec, check_vma=False)(q_btnh, k_bskh, v_bskh)
    return jax.shard_map(lambda q, k, v, seg: fn(q, k, v, segment_ids_bt=seg), mesh=mesh,
                         in_specs=(q_spec, kv_spec, kv_spec, rules.spec(("batch", None))),
                         out_specs=q_spec, check_vma=False)(q_btnh, k_bskh, v_bskh, segment_ids_bt)


def _block_mask(t: int, s: int, causal: bool, q_seg, kv_seg) -> jax.Array:
    """Causal (top-left aligned) and document mask of [T] queries against [S] keys."""
    mask = jnp.ones((1, t, s), dtype=bool)
    if causal:
        mask = mask & (jnp.arange(t)[:, None] >= jnp.arange(s)[None, :])[None]
    if q_seg is not None:
        mask = mask & (q_seg[:, :, None] == kv_seg[:, None, :])
    return mask[:, None, None]  # [B|1, 1, 1, T, S] against scores [B, K, G, T, S]


def _xla_block_fwd(q, k, v, q_seg, kv_seg, causal, *, scale):
    """(o float32 [B, T, N, H], lse [B, N, T]) of one chunk pair; lse -inf where no key is visible."""
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    scores = jnp.einsum("btkgh,bskh->bkgts", q.reshape(b, t, kh, n // kh, h), k,
                        preferred_element_type=jnp.float32) * scale
    scores = jnp.where(_block_mask(t, s, causal, q_seg, kv_seg), scores, -jnp.inf)
    lse = jax.nn.logsumexp(scores, axis=-1)  # [B, K, G, T]
    probs = jnp.exp(scores - jnp.where(jnp.isneginf(lse), 0.0, lse)[..., None])
    o = jnp.einsum("bkgts,bskh->btkgh", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(b, t, n, h), lse.reshape(b, n, t)


def _xla_block_bwd(q, k, v, q_seg, kv_seg, o, lse, do, dlse, causal, *, scale):
    """FlashAttention-2's backward for one chunk pair, from the merged o and lse (all float32)."""
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    g = n // kh
    f32 = jnp.float32
    q_g = q.astype(f32).reshape(b, t, kh, g, h)
    do_g = do.astype(f32).reshape(b, t, kh, g, h)
    k, v = k.astype(f32), v.astype(f32)
    delta = (jnp.einsum("btnh,btnh->bnt", do_g.reshape(b, t, n, h), o.astype(f32)) - dlse).reshape(b, kh, g, t)
    scores = jnp.einsum("btkgh,bskh->bkgts", q_g, k) * scale
    probs = jnp.where(_block_mask(t, s, causal, q_seg, kv_seg),
                      jnp.exp(scores - lse.reshape(b, kh, g, t)[..., None]), 0.0)
    dv = jnp.einsum("bkgts,btkgh->bskh", probs, do_g)
    ds = probs * (jnp.einsum("btkgh,bskh->bkgts", do_g, v) - delta[..., None])
    dq = jnp.einsum("bkgts,bskh->btkgh", ds, k).reshape(b, t, n, h) * scale
    dk = jnp.einsum("bkgts,btkgh->bskh", ds, q_g) * scale
    return dq, dk, dv


def block_kernel(impl: str, head_dim: int, *, scale: float | None = None, block_q: int = 0,
                 block_kv: int = 0) -> context_lib.BlockKernel:
    """The chunk-pair attention that context parallelism runs: `xla` (jnp) or `flash` (Pallas)."""
    scale = head_dim ** -0.5 if scale is None else scale
    if impl == "xla":
        return context_lib.BlockKernel(functools.partial(_xla_block_fwd, scale=scale),
                                       functools.partial(_xla_block_bwd, scale=scale))
    blocks = flash_lib.BlockSizes.default(head_dim).with_overrides(block_q, block_kv)

    def fwd(q, k, v, q_seg, kv_seg, causal):
        o, lse = flash_lib.flash_attention(q, k, v, segment_ids_bt=q_seg, kv_segment_ids_bs=kv_seg,
                                           causal=causal, scale=scale, block_sizes=blocks, return_lse=True)
        return o.astype(jnp.float32), lse

    def bwd(q, k, v, q_seg, kv_seg, o, lse, do, dlse, causal):
        return flash_lib.flash_attention_bwd(q, k, v, o.astype(q.dtype), lse, do.astype(q.dtype), dlse,
                                             segment_ids_bt=q_seg, kv_segment_ids_bs=kv_seg,
                                             causal=causal, scale=scale, block_sizes=blocks)

    return context_lib.BlockKernel(fwd, bwd)


def context_parallel_attention(q_btnh: jax.Array, k_bskh: jax.Array, v_bskh: jax.Array, *,
                               segment_ids_bt: jax.Array | None = None, causal: bool = True,
                               scale: float | None = None, impl: str = "xla", block_q: int = 0,
                               block_kv: int = 0) -> tuple[jax.Array, jax.Array]:
    """Attention over the trainer's `context` axis (see `lumen_jax.parallel.context`): (out, lse).

    Must run under `rules.activate(mesh, rules)`; the tokens are in the layout's order.
    """
    mesh, rules = rules_lib.active()
    name = resolve(impl)
    problem = name == "flash" and _flash_unsupported(q_btnh, k_bskh)
    if problem:
        if impl != "auto":
            raise ValueError(f"model.attention=flash: {problem}")
        name = "xla"
    kernel = block_kernel(name, q_btnh.shape[-1], scale=scale, block_q=block_q, block_kv=block_kv)
    return context_lib.context_attention(
        q_btnh, k_bskh, v_bskh, segment_ids_bt=segment_ids_bt, causal=causal, kernel=kernel, mesh=mesh,
        q_spec=rules.spec(("batch", "seq", "act_heads", None)),
        kv_spec=rules.spec(("batch", "seq", "act_kv_heads", None)), seg_spec=rules.spec(("batch", "seq")),
        strategy=rules.context_parallel, balance=rules.context_balance)


def attention(q_btnh: jax.Array, k_bskh: jax.Array, v_bskh: jax.Array, *,
              segment_ids_bt: jax.Array | None = None, causal: bool = True,
              scale: float | None = None, impl: str = "xla", block_q: int = 0,
              block_kv: int = 0) -> jax.Array:
    """Dispatch to the attention implementation named by `impl` (see module docstring).

    `block_q`/`block_kv` are the flash kernel's tile overrides (0: tuned default); others ignore them.
    """
    active = _active_mesh()
    if active is not None and active[0].shape.get("context", 1) > 1:
        return context_parallel_attention(q_btnh, k_bskh, v_bskh, segment_ids_bt=segment_ids_bt,
                                          causal=causal, scale=scale, impl=impl, block_q=block_q,
                                          block_kv=block_kv)[0]
    name = resolve(impl)
    if name == "flash" and impl == "auto" and _flash_unsupported(q_btnh, k_bskh):
        name = "xla"
    if name == "flash":
        return flash_attention(q_btnh, k_bskh, v_bskh, segment_ids_bt=segment_ids_bt,
                               causal=causal, scale=scale, block_q=block_q, block_kv=block_kv)
    return xla_attention(q_btnh, k_bskh, v_bskh, segment_ids_bt=segment_ids_bt, causal=causal,
                         scale=scale)
