"""The chunked output layer and loss (`ops.loss.output_objective`) against a hand formula: its value
and its gradients with respect to the input and the weight, with and without chunks and z-loss,
on one device and with the vocabulary and the tokens split over 8; no [tokens, vocab] float32
buffer in the compiled program; its collectives those of one unchunked output layer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.meshes import small_mesh
from helpers.tolerances import BF16_RTOL, FP32_RTOL, assert_tree_close
from lumen_jax.compiler import hlo
from lumen_jax.ops.loss import CHUNK_LOGITS, chunk_count, output_objective
from lumen_jax.parallel.rules import Rules, activate

B, T, D, V = 4, 16, 8, 64


def _inputs(dtype=jnp.float32):
    kx, kw, kt, km = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(kx, (B, T, D), jnp.float32).astype(dtype)
    w = (2.0 * jax.random.normal(kw, (D, V), jnp.float32)).astype(dtype)  # logits of std ~6: a peaked softmax
    targets = jax.random.randint(kt, (B, T), 0, V)
    mask = (jax.random.uniform(km, (B, T)) > 0.25).astype(jnp.int32)
    return x, w, targets, mask


def _by_hand(x, w, targets, mask, weight, z_loss):
    """weight * sum over kept tokens of (log Z - logit[target] + z_loss log(Z)^2), in float64."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    logits = x @ w
    top = logits.max(-1, keepdims=True)
    log_z = (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))[..., 0]
    target = np.take_along_axis(logits, np.asarray(targets)[..., None], -1)[..., 0]
    per_token = log_z - target + z_loss * log_z ** 2
    p = np.exp(logits - log_z[..., None])
    dlogits = p * (1 + 2 * z_loss * log_z)[..., None] - np.eye(V)[np.asarray(targets)]
    dlogits *= weight * np.asarray(mask, np.float64)[..., None]
    return (weight * (per_token * mask).sum(), ((log_z - target) * mask).sum(),
            dlogits @ w.T, np.einsum("btd,btv->dv", x, dlogits))


def _ours(x, w, targets, mask, weight, z_loss, chunk_tokens):
    def objective(x, w):
        return output_objective(x, w, targets, mask, weight, z_loss, chunk_tokens)
    (value, ce), grads = jax.value_and_grad(objective, argnums=(0, 1), has_aux=True)(x, w)
    return value, ce, *grads


@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
@pytest.mark.parametrize("chunk_tokens", [0, 4])  # 0: one chunk at these shapes; 4: four chunks
def test_objective_and_gradients_equal_the_formula(z_loss, chunk_tokens):
    x, w, targets, mask = _inputs()
    want = _by_hand(x, w, targets, mask, 0.25, z_loss)
    got = jax.jit(_ours, static_argnums=(5, 6))(x, w, targets, mask, 0.25, z_loss, chunk_tokens)
    for name, g, e in zip(("objective", "cross-entropy", "dx", "dw"), got, want):
        assert_tree_close(g, e, FP32_RTOL, name)


def test_bfloat16_operands_give_the_float32_formula_of_the_rounded_operands():
    """bf16 x and w, float32 logits: the value equals the formula of the rounded operands in float32
    terms; the gradients are rounded once, to bf16, after their float32 sums."""
    x, w, targets, mask = _inputs(jnp.bfloat16)
    want = _by_hand(x, w, targets, mask, 0.25, 1e-2)
    got = jax.jit(_ours, static_argnums=(5, 6))(x, w, targets, mask, 0.25, 1e-2, 4)
    assert got[2].dtype == got[3].dtype == jnp.bfloat16
    assert_tree_close(got[0], want[0], FP32_RTOL, "objective")
    for name, g, e in zip(("dx", "dw"), got[2:], want[2:]):
        assert_tree_close(g, e, BF16_RTOL, name)


def test_chunk_count():
    assert chunk_count(2, 8192, 128256) == 8  # llama3_1b at 2 x 8192: 1024 positions, 1.0 GiB of logits
    assert 2 * 8192 // 8 * 128256 <= CHUNK_LOGITS
    assert chunk_count(8, 128, 512) == 1  # tiny: all of it in one chunk
    assert chunk_count(8, 128, 512, 16) == 8
    assert chunk_count(1, 12, 512, 5) == 3  # positions per chunk divide the sequence: 4, not 5


MESH = {"data": 2, "fsdp": 1, "context": 2, "tensor": 2}  # tokens over data and context, vocabulary over tensor


UNEVEN = {"data": 1, "fsdp": 8, "context": 1, "tensor": 1}  # 4 rows on 8 devices: under the partitioner


def _on_mesh(chunk_tokens, z_loss=1e-2, axes=MESH):
    """The jitted gradient on an 8-device mesh, inputs placed as the trainer places them."""
    mesh, rules = small_mesh(**axes), Rules()
    even = axes is MESH  # UNEVEN's 4 rows cannot be placed on 8 devices: the arrays come in whole

    def shard(a, names):
        return jax.device_put(a, jax.NamedSharding(mesh, rules.spec(names))) if even else a
    x, w, targets, mask = _inputs()
    args = (shard(x, ("batch", "seq", "act_embed")), shard(w, ("act_embed", "act_vocab")),
            shard(targets, ("batch", "seq")), shard(mask, ("batch", "seq")))

    def run(x, w, targets, mask):
        with activate(mesh, rules):
            return _ours(x, w, targets, mask, 0.25, z_loss, chunk_tokens)
    return jax.jit(run), args


@pytest.mark.parametrize("chunk_tokens, axes", [(0, MESH), (2, MESH), (2, UNEVEN)])
def test_on_eight_devices_equals_the_formula(chunk_tokens, axes):
    fn, args = _on_mesh(chunk_tokens, axes=axes)
    want = _by_hand(*_inputs(), 0.25, 1e-2)
    for name, g, e in zip(("objective", "cross-entropy", "dx", "dw"), fn(*args), want):
        assert_tree_close(g, e, FP32_RTOL, name)


def _compiled(chunk_tokens) -> hlo.Module:
    fn, args = _on_mesh(chunk_tokens)
    return hlo.parse(fn.lower(*args).compile().as_text())


def _collective_bytes(chunk_tokens) -> dict[str, int]:
    shape = dict(small_mesh(**MESH).shape)
    return {f"{c.kind} {'+'.join(c.axes)}": c.total for c in hlo.on_mesh(_compiled(chunk_tokens), shape)}


def test_chunks_move_the_bytes_of_one_output_layer():
    """Four chunks per device (run per device) cross the devices with no more bytes than one chunk
    under the partitioner: the weight's gradient [D, V/2] float32 is summed over the token devices
    once, after the chunks (under the partitioner every chunk's would be), and the softmax statistics
    are the same [B, T] values cut into four; the per-device sums of the objective add 8 bytes per
    axis group."""
    one, four = _collective_bytes(0), _collective_bytes(2)
    weight_grad = D * V // 2 * 4
    assert four["all-reduce data+context"] == weight_grad, four
    assert sum(four.values()) <= sum(one.values()) + 3 * 8, (one, four)


def test_no_float32_buffer_holds_the_devices_tokens_by_vocabulary():
    """A device's logits would be [B/2, T/2, V/2] float32; four chunks hold a quarter each."""
    module = _compiled(2)
    local = (B // 2) * (T // 2) * (V // 2)
    sizes = [int(np.prod(a.dims)) for i in module.instrs for a in i.arrays if a.dtype == "f32"]
    assert max(sizes) < local and local // 4 in sizes, (local, sorted(set(sizes))[-5:])
