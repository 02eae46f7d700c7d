"""The experts' grouped SwiGLU (ops/grouped.py): both forms against a per-assignment reference,
values and gradients, padding assignments, under `jax.vmap` (the train step's replica axis), and
the block layout (fp32)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.tolerances import FP32_RTOL
from lumen_jax.ops import grouped

X, D, F, R, A = 5, 8, 4, 12, 40  # experts, d_model, ffn, rows, assignments


def _inputs(seed: int):
    ks = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(ks[0], (R, D), jnp.float32)
    row = jax.random.randint(ks[1], (A,), 0, R, jnp.int32)
    group = jax.random.randint(ks[2], (A,), 0, X + 1, jnp.int32)  # X: padding, gives 0
    group = group.at[:8].set(2)  # one expert with more than a block of rows (block 8)
    weights = tuple(jax.random.normal(k, s) / np.sqrt(s[1]) for k, s in
                    zip(ks[3:], [(X, D, F), (X, D, F), (X, F, D)]))
    return x, row, group, weights


def _reference(x, row, group, weights):
    """Assignment by assignment: its expert's SwiGLU of its row (0 for padding), float64."""
    x, row, group = np.asarray(x, np.float64), np.asarray(row), np.asarray(group)
    wg, wu, wd = (np.asarray(w, np.float64) for w in weights)
    y = np.zeros((len(row), D))
    for a, (r, e) in enumerate(zip(row, group)):
        if e < X:
            g, u = x[r] @ wg[e], x[r] @ wu[e]
            y[a] = (g / (1 + np.exp(-g)) * u) @ wd[e]
    return y


def _autodiff_reference(x, row, group, weights):
    """The same in jnp with each assignment's weights gathered ([A, D, F]: autodiff's gradients)."""
    e = jnp.minimum(group, X - 1)
    xa = x[row]
    g = jnp.einsum("ad,adf->af", xa, weights[0][e])
    u = jnp.einsum("ad,adf->af", xa, weights[1][e])
    y = jnp.einsum("af,afd->ad", jax.nn.silu(g) * u, weights[2][e])
    return jnp.where((group < X)[:, None], y, 0.0)


@pytest.mark.parametrize("form", grouped.FORMS)
def test_swiglu_matches_per_assignment_reference(form):
    x, row, group, weights = _inputs(0)
    y = jax.jit(lambda *a: grouped.swiglu(*a, form=form, expected_rows=X * 8))(x, row, group, weights)
    assert grouped.block_rows(X * 8, X) == 8  # several blocks for expert 2
    np.testing.assert_allclose(np.asarray(y), _reference(x, row, group, weights), rtol=FP32_RTOL, atol=1e-6)


def _loss(fn, ct):
    return lambda x, weights, row, group: jnp.sum(fn(x, row, group, weights) * ct)


@pytest.mark.parametrize("form", grouped.FORMS)
def test_gradients_match_autodiff_of_the_reference(form):
    x, row, group, weights = _inputs(1)
    ct = jax.random.normal(jax.random.key(9), (A, D))
    ours = _loss(lambda *a: grouped.swiglu(*a, form=form, expected_rows=X * 8), ct)
    got = jax.jit(jax.grad(ours, argnums=(0, 1)))(x, weights, row, group)
    want = jax.jit(jax.grad(_loss(_autodiff_reference, ct), argnums=(0, 1)))(x, weights, row, group)
    for name, g, w in zip(["x", "w_gate", "w_up", "w_down"], jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=FP32_RTOL, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("form", grouped.FORMS)
def test_under_vmap_each_example_keeps_its_own_weight_gradients(form):
    """vmap over 3 examples with shared weights (the step's replica vmap): each example's gradients,
    not their sum, and the same as running the examples one by one."""
    examples = [_inputs(s) for s in (2, 3, 4)]
    weights = examples[0][3]
    stack = lambda i: jnp.stack([e[i] for e in examples])  # noqa: E731
    ct = jax.random.normal(jax.random.key(5), (A, D))
    grad = jax.grad(_loss(lambda *a: grouped.swiglu(*a, form=form), ct), argnums=(0, 1))
    got = jax.jit(jax.vmap(grad, in_axes=(0, None, 0, 0)))(stack(0), weights, stack(1), stack(2))
    for i, (x, row, group, _) in enumerate(examples):
        want = jax.jit(grad)(x, weights, row, group)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(g[i]), np.asarray(w), rtol=FP32_RTOL, atol=1e-6)


def test_block_layout_holds_each_expert_in_whole_blocks():
    group = jnp.array([3, 0, 3, 3, 5, 0, 3, 1, 3, 3], jnp.int32)  # 5 = padding (experts=5)
    plan = jax.jit(lambda g: grouped.plan_blocks(g, 5, 2))(group)
    slot, src, blocks = np.asarray(plan.slot_a), np.asarray(plan.src_p), np.asarray(plan.group_j)
    # expert 0: 2 rows -> block 0; expert 1: 1 row -> block 1; expert 3: 6 rows -> blocks 2-4
    np.testing.assert_array_equal(slot, [4, 0, 5, 6, 2 * 10, 1, 7, 2, 8, 9])
    assert int(plan.used) == 5 and len(blocks) == 10  # ceil(10 / 2) + 5 blocks of room
    np.testing.assert_array_equal(blocks[:5], [0, 1, 3, 3, 3])
    for a, s in enumerate(slot):
        if s < len(src):
            assert src[s] == a and blocks[s // 2] == group[a]
    assert (src == 10).sum() == 20 - 9  # every other padded row holds no assignment


def _split(form, x, row, group, weights, ct, expected_rows=None):
    """A split backward's two halves: (B's rows gradient, the tap's cotangents), then replay's vjp at
    the recorded cotangents: the weight gradients."""
    shapes = grouped.tap_shapes(jax.ShapeDtypeStruct(x.shape, x.dtype), group.shape[0], weights, form, expected_rows)
    tap = {k: jnp.zeros(s.shape, s.dtype) for k, s in shapes.items()}
    def b(x, tap):  # the weights stopped: B's vjp does not reach them
        y = grouped.swiglu(x, row, group, jax.lax.stop_gradient(weights), form, expected_rows, tap)
        return jnp.sum(y * ct)
    dx, recorded = jax.grad(b, argnums=(0, 1))(x, tap)
    _, vjp = jax.vjp(lambda w: grouped.replay(w, recorded, form), weights)
    return dx, vjp(tuple(recorded[k] for k in grouped.TAP_COTANGENTS))[0]


@pytest.mark.parametrize("form", grouped.FORMS)
def test_a_split_backward_is_the_whole_backward(form):
    """B (the tapped backward) gives the rows' gradient and no weight gradient; `replay`'s vjp at the
    recorded cotangents gives the weight gradients: the whole backward's, bit for bit (blocks: the
    same float32 sums in the same order), and under `jax.vmap` each example's own."""
    x, row, group, weights = _inputs(6)
    ct = jax.random.normal(jax.random.key(7), (A, D))
    whole = jax.jit(jax.grad(_loss(lambda *a: grouped.swiglu(*a, form=form, expected_rows=X * 8), ct),
                             argnums=(0, 1)))(x, weights, row, group)
    dx, dw = jax.jit(lambda *a: _split(form, *a, expected_rows=X * 8))(x, row, group, weights, ct)
    for name, got, want in zip(["x", "w_gate", "w_up", "w_down"], (dx, *dw), jax.tree.leaves(whole)):
        if form == "blocks":
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)
        else:
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=FP32_RTOL, atol=1e-6, err_msg=name)
    examples = [_inputs(s)[:3] for s in (2, 3)]
    stack = lambda i: jnp.stack([e[i] for e in examples])  # noqa: E731
    got = jax.jit(jax.vmap(lambda *a: _split(form, *a), in_axes=(0, 0, 0, None, None)))(
        stack(0), stack(1), stack(2), weights, ct)
    for i, (x, row, group) in enumerate(examples):
        want = jax.jit(lambda *a: _split(form, *a))(x, row, group, weights, ct)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(g[i]), np.asarray(w), rtol=FP32_RTOL, atol=1e-6)
