"""The output layer and the training objective, in chunks, per device: `output_objective` is the
only entry point (`Transformer.objective` calls it).

Over the tokens the mask keeps it computes

    weight * sum(CE(x W, target) + z_loss * log(Z)^2),   log(Z) = logsumexp(x W)

(cross-entropy plus PaLM's z-loss) without ever holding the [B, T, V] logits:

- Chunks. Each device's positions are cut into C chunks of Tc (chunk k holds positions k, k + C,
  k + 2C, ...); a chunk's logits [B, Tc, V] are made in float32 from compute-dtype operands,
  reduced and dropped. `model.loss_chunk_tokens` sets Tc; 0 derives it (`chunk_count`: at most
  CHUNK_LOGITS float32 logits per chunk on a device).
- The gradient in the same pass. The objective ends the graph and its cotangent only scales it,
  so the forward pass computes the gradients too (`weight` carries the loss scale and the
  1 / tokens of the mean: compute-dtype gradients are scaled before they are rounded, as JAX's
  backward would scale them). Per chunk: the three matmuls of an output layer (logits, the
  input's gradient, the weight's), nothing recomputed; the weight's gradient sums over the chunks
  in float32. The gradient of a token's objective with respect to its logits (p = softmax,
  y its one-hot, m its mask):  m * ((1 + 2 z_loss log(Z)) p - y).
- Per device (`parallel.shard.per_device`): tokens over the batch axes and `context`, the
  vocabulary over `tensor` (Megatron's vocab-parallel cross-entropy: each device reduces its
  columns, then a max and two sums of [B, Tc] cross the vocabulary's devices per chunk). The
  weight's gradient sums over the chunks on each device and crosses the devices once, in the
  transpose of the per-device call; under the partitioner instead, every chunk's would.

Shape letters: B rows, T positions, D model width, V vocabulary (a device's slice of it), C
chunks, Tc = T / C.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lumen_jax.parallel import shard

CHUNK_LOGITS = 2 ** 28  # the derived chunk: at most this many float32 logits on a device (1 GiB)
_VOCAB = ("act_vocab",)
_X_AXES = ("batch", "seq", "act_embed")
_W_AXES = ("act_embed", "act_vocab")
_TOKEN_AXES = ("batch", "seq")
_SUM_AXES = ("batch", "seq", "act_vocab")  # one sum per device


def chunk_count(rows: int, positions: int, vocab: int, chunk_tokens: int = 0) -> int:
    """C: the fewest chunks a device's [rows, positions] tokens are cut into, each of at most
    `chunk_tokens` positions (0: at most CHUNK_LOGITS logits, rows x positions x vocab / C)."""
    want = chunk_tokens or max(1, CHUNK_LOGITS // (rows * vocab))
    return positions // max(d for d in range(1, min(want, positions) + 1) if positions % d == 0)


def output_objective(x_btd: jax.Array, w_dv: jax.Array, targets_bt: jax.Array, mask_bt: jax.Array,
                     weight: jax.Array, z_loss: float, chunk_tokens: int = 0) -> tuple[jax.Array, jax.Array]:
    """(weight * summed objective, summed cross-entropy) of the output layer `x_btd @ w_dv`.

    Args:
      x_btd: the final norm's output [B, T, D], compute dtype.
      w_dv: the output projection [D, V], compute dtype.
      targets_bt: the next tokens [B, T], int.
      mask_bt: which tokens count [B, T] (0/1, any dtype).
      weight: the scalar the objective is multiplied by (loss scale / tokens); a constant: no
        gradient reaches it.
      z_loss: the coefficient of log(Z)^2; 0: none.
      chunk_tokens: positions per chunk (`chunk_count`); 0: derived.

    Returns:
      The weighted objective (its gradient reaches x and w) and the unweighted cross-entropy sum
      (a metric: no gradient flows from it).
    """
    # Per device where there are chunks and the mesh splits the rows, positions and vocabulary evenly.
    # One chunk runs under the partitioner (which sums the weight's gradient once too), and so does a
    # micro-batch of fewer rows than the batch's devices (the partitioner pads it).
    splits = [shard.axes_size((name,)) for name in ("batch", "seq", "act_vocab")]
    sizes = (*targets_bt.shape, w_dv.shape[1])
    even = all(n % k == 0 for n, k in zip(sizes, splits))
    (b, k_b), (t, k_t), (v, k_v) = zip(sizes, splits)
    chunks = chunk_count(-(-b // k_b), t // k_t if t % k_t == 0 else t, -(-v // k_v), chunk_tokens)
    per_device = even and chunks > 1
    vocab = _VOCAB if per_device else ()

    def local(x_btd, w_dv, targets_bt, mask_bt, weight):
        offset = shard.index_over(vocab) * w_dv.shape[1]  # the first vocabulary id this device holds
        objective, ce_sum = _objective(x_btd, w_dv, targets_bt, mask_bt, weight, offset, z_loss, chunks, vocab)
        return objective.reshape(1, 1, 1), ce_sum.reshape(1, 1, 1)  # this device's sums: added below

    run = shard.per_device(local, in_axes=(_X_AXES, _W_AXES, _TOKEN_AXES, _TOKEN_AXES, ()),
                           out_axes=(_SUM_AXES, _SUM_AXES)) if per_device else local
    objective, ce_sum = run(
        x_btd, w_dv, targets_bt, mask_bt.astype(jnp.float32),
        jax.lax.stop_gradient(jnp.asarray(weight, jnp.float32)))
    return objective.sum(), jax.lax.stop_gradient(ce_sum.sum())


def _chunked(a_bt: jax.Array, chunks: int) -> jax.Array:
    """[B, T, ...] -> [C, B, Tc, ...]: chunk k holds positions k, k + C, ..."""
    b, t = a_bt.shape[:2]
    return jnp.moveaxis(a_bt.reshape(b, t // chunks, chunks, *a_bt.shape[2:]), 2, 0)


def _unchunked(a_cbt: jax.Array) -> jax.Array:
    """The inverse of `_chunked`."""
    c, b, tc = a_cbt.shape[:3]
    return jnp.moveaxis(a_cbt, 0, 2).reshape(b, tc * c, *a_cbt.shape[3:])


def _chunk(x_btd: jax.Array, w_dv: jax.Array, targets_bt: jax.Array, mask_bt: jax.Array, weight: jax.Array,
           offset: jax.Array, z_loss: float, vocab: tuple[str, ...], grads: bool) -> tuple[jax.Array, ...]:
    """One chunk on one device: (objective sum, cross-entropy sum), and with `grads` the weighted
    gradients (float32) with respect to the device's columns of the weight [D, V] and to its input
    [B, Tc, D] (this device's columns' share)."""
    logits_btv = jnp.einsum("btd,dv->btv", x_btd, w_dv, preferred_element_type=jnp.float32)
    max_bt = shard.pmax_over(jax.lax.stop_gradient(logits_btv.max(-1)), vocab)
    log_z_bt = max_bt + jnp.log(shard.psum_over(jnp.exp(logits_btv - max_bt[..., None]).sum(-1), vocab))
    # The target's logit as a masked sum over the vocabulary, not a lookup: each device sums its columns.
    hit_btv = jax.lax.broadcasted_iota(jnp.int32, logits_btv.shape, 2) + offset == targets_bt[..., None]
    target_bt = shard.psum_over(jnp.where(hit_btv, logits_btv, 0.0).sum(-1), vocab)
    ce_sum = ((log_z_bt - target_bt) * mask_bt).sum()
    objective = ce_sum + z_loss * (jnp.square(log_z_bt) * mask_bt).sum() if z_loss else ce_sum
    if not grads:
        return objective, ce_sum
    scale_bt = weight * mask_bt * (1.0 + 2.0 * z_loss * log_z_bt if z_loss else 1.0)
    p_btv = jnp.exp(logits_btv - log_z_bt[..., None])
    dlogits_btv = scale_bt[..., None] * p_btv - jnp.where(hit_btv, (weight * mask_bt)[..., None], 0.0)
    dlogits_btv = dlogits_btv.astype(x_btd.dtype)
    dx_btd = jnp.einsum("btv,dv->btd", dlogits_btv, w_dv, preferred_element_type=jnp.float32)
    dw_dv = jnp.einsum("btd,btv->dv", x_btd, dlogits_btv, preferred_element_type=jnp.float32)
    return objective, ce_sum, dw_dv, dx_btd


def _scan(x_btd, w_dv, targets_bt, mask_bt, weight, offset, z_loss, chunks, vocab, grads):
    """`_chunk` over the C chunks: (objective, cross-entropy) sums, and with `grads` the weight's
    gradient (summed) and the input's (reassembled)."""
    def body(carry, xs):
        x_btd, targets_bt, mask_bt = xs
        out = _chunk(x_btd, w_dv, targets_bt, mask_bt, weight, offset, z_loss, vocab, grads)
        n = len(carry)  # the sums (objective, cross-entropy[, the weight's gradient]); then the input's gradient
        return tuple(a + b for a, b in zip(carry, out[:n])), out[n] if grads else None

    if chunks == 1:  # no loop around one chunk
        return _chunk(x_btd, w_dv, targets_bt, mask_bt, weight, offset, z_loss, vocab, grads)
    zero = jnp.zeros((), jnp.float32)
    init = (zero, zero, jnp.zeros(w_dv.shape, jnp.float32)) if grads else (zero, zero)
    carry, dx_cbtd = jax.lax.scan(body, init, (_chunked(x_btd, chunks), _chunked(targets_bt, chunks),
                                               _chunked(mask_bt, chunks)))
    return (*carry, _unchunked(dx_cbtd)) if grads else carry


def _reported(offset: jax.Array, weight: jax.Array, objective: jax.Array, ce_sum: jax.Array):
    """This device's share of the sums over all devices: the devices that split a chunk's vocabulary
    compute the same sums (after their max and sums cross), so the first of them reports them and
    the others report 0; the sum over devices counts each token once."""
    first = offset == 0
    return jnp.where(first, weight * objective, 0.0), jnp.where(first, ce_sum, 0.0)


# `_scan` with a custom VJP: its sums as `_reported`, its gradients made in the forward pass. The
# backward gives every device, for the cotangent g of the sum over devices, its columns' part of the
# gradients: the weight's columns it holds, and its columns' share of the input's gradient (the
# transpose of `per_device` sums those over the vocabulary's devices, and the weight's over the
# token's devices).
@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _objective(x_btd, w_dv, targets_bt, mask_bt, weight, offset, z_loss, chunks, vocab):
    objective, ce_sum = _scan(x_btd, w_dv, targets_bt, mask_bt, weight, offset, z_loss, chunks, vocab, grads=False)
    return _reported(offset, weight, objective, ce_sum)


def _objective_fwd(x_btd, w_dv, targets_bt, mask_bt, weight, offset, z_loss, chunks, vocab):
    objective, ce_sum, dw_dv, dx_btd = _scan(x_btd, w_dv, targets_bt, mask_bt, weight, offset, z_loss, chunks,
                                             vocab, grads=True)
    dtypes = (jnp.zeros((), x_btd.dtype), jnp.zeros((), w_dv.dtype))  # what the gradients are cast to
    return _reported(offset, weight, objective, ce_sum), (dx_btd, dw_dv, dtypes, jnp.zeros_like(weight))


def _objective_bwd(z_loss, chunks, vocab, residuals, cotangents):
    dx_btd, dw_dv, (x_like, w_like), zero = residuals
    g = cotangents[0]  # the cross-entropy sum is a metric: `output_objective` stops its gradient
    return (g * dx_btd).astype(x_like.dtype), (g * dw_dv).astype(w_like.dtype), None, None, zero, None


_objective.defvjp(_objective_fwd, _objective_bwd)
