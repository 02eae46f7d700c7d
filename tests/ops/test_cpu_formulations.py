"""The CPU formulations of the ops (`lumen_jax.ops.cpu`, chosen by `ops.choice.choose` as `Ops.cpu`):
token-axis weight gradients and heads-first attention with the closed-form softmax gradient (SwiGLU
with the sigmoid recomputed is every program's now: `ops.swiglu`). They run only in the trainer's
step on one CPU device; these tests
check that they compute what the plain formulations compute, that remat policies still see the
projections as dots, and that nothing else runs them."""

import dataclasses

import jax
import jax.numpy as jnp
import optax
import pytest

from helpers.meshes import small_mesh
from helpers.tolerances import SAME_MATH_FP32_RTOL, assert_tree_close
from lumen_jax.config import REMAT_POLICIES, ModelConfig
from lumen_jax.train.build import build
from lumen_jax.config import Config, MeshConfig
from lumen_jax.model import apply, init_params, param_shapes_and_names
from lumen_jax.ops.choice import Ops, choose
from lumen_jax.parallel.rules import Rules, activate

SHAPE = ModelConfig(d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=96, vocab_size=128,
                    compute_dtype="float32")
B, T = 2, 32


def mesh_of(n: int):
    return small_mesh(fsdp=n)


def batch(seed: int = 0, segments: bool = False) -> tuple[jax.Array, ...]:
    tokens = jax.random.randint(jax.random.key(seed), (B, T + 1), 0, SHAPE.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    seg = jnp.ones((B, T), jnp.int32)
    if segments:  # two documents in the first row, positions restarting with the second
        seg = seg.at[0, T // 2:].set(2)
        positions = positions.at[0, T // 2:].set(jnp.arange(T - T // 2))
    return tokens[:, :-1], tokens[:, 1:], positions, seg


def ops_for(cfg: ModelConfig, devices: int | None) -> Ops:
    """The trainer's choice on `devices` CPU devices (None: the model outside the trainer)."""
    return Ops.plain(cfg) if devices is None else choose(cfg, jax.devices()[:devices])


def loss_fn(cfg: ModelConfig, devices: int | None = None):
    graphdef, _, _ = param_shapes_and_names(cfg, ops_for(cfg, devices))

    def loss(params, inputs, targets, positions, seg):
        logits = apply(graphdef, params, inputs, positions, seg)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    return loss


_init = jax.jit(init_params, static_argnums=(0, 1))  # one program (eager, each op compiled alone)


def traced(fn, mesh):
    """`fn` traced under the trainer's rules for `mesh` (None: outside the trainer)."""
    if mesh is None:
        return fn

    def wrapper(*args):
        with activate(mesh, Rules()):
            return fn(*args)
    return wrapper


@pytest.mark.parametrize("segments", [False, True])
def test_one_cpu_device_formulations_match_the_plain_ones(segments):
    params = _init(SHAPE, 0)
    args = batch(segments=segments)
    plain_loss, plain_grads = jax.jit(jax.value_and_grad(loss_fn(SHAPE)))(params, *args)
    cpu_loss, cpu_grads = jax.jit(traced(jax.value_and_grad(loss_fn(SHAPE, 1)), mesh_of(1)))(params, *args)
    assert float(cpu_loss) == pytest.approx(float(plain_loss), rel=SAME_MATH_FP32_RTOL)
    assert_tree_close(cpu_grads, plain_grads, SAME_MATH_FP32_RTOL, "gradients")


@pytest.mark.parametrize("devices, expected", [(None, False), (1, True), (8, False)])
def test_only_the_one_cpu_device_step_uses_them(devices, expected):
    """Outside the trainer (lumen_jax.plan's probe) and on 8 devices the jaxpr is the plain one: no
    token-gradient projection (the plain program's own custom VJPs, SwiGLU's and RMSNorm's, are in
    every program)."""
    params = _init(SHAPE, 0)
    grad = jax.grad(loss_fn(SHAPE, devices))
    jaxpr = str(jax.make_jaxpr(traced(grad, None if devices is None else mesh_of(devices)))(params, *batch()))
    assert ("name=token_grad_project" in jaxpr) == expected and "name=swiglu" in jaxpr
    assert ops_for(SHAPE, devices).cpu == expected


def test_the_trainer_chooses_them_on_one_cpu_device_only():
    for n, expected in ((1, True), (8, False)):
        cfg = Config(model=SHAPE, mesh=MeshConfig(data=1, fsdp=n, context=1, tensor=1))
        assert build(cfg, mesh_of(n)).ops.cpu == expected


# The CPU formulations count 0.38-0.58% fewer compiled FLOPs than the plain ones under each policy
# (they skip some elementwise work); the policies differ from each other by 1.1% and more
# (save_attention_out and full: 1.25%; dots_saveable and none: 1.14%): the bound sits between.
REMAT_FLOPS_RTOL = 0.006


# The selective policies name the projections' outputs alike: one of them here (all three passed, 2026-12-06).
@pytest.mark.parametrize("remat", [r for r in REMAT_POLICIES
                                   if r not in ("none", "offload_dots", "save_dot_except_mlpwi", "save_qkv_proj")])
def test_remat_policies_see_the_projections_as_dots(remat):
    """The same compiled FLOPs with and without the CPU formulations: a policy that saves dots saves
    the token-gradient projections too (without `ops.projection.remat_policy` it would see one
    opaque custom_vjp_call and recompute every projection), and each policy stays itself."""
    cfg = dataclasses.replace(SHAPE, remat=remat)
    params = _init(SHAPE, 0)  # the parameters do not depend on the policy
    flops = {name: jax.jit(traced(jax.grad(loss_fn(cfg, n)), mesh)).lower(params, *batch()).compile()
             .cost_analysis()["flops"] for name, n, mesh in (("plain", None, None), ("cpu", 1, mesh_of(1)))}
    assert flops["cpu"] == pytest.approx(flops["plain"], rel=REMAT_FLOPS_RTOL), flops
