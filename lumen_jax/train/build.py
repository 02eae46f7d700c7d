"""Assemble a run from its config: mesh, sharding rules, model, optimizer, jitted init and step.

`build(cfg, mesh)` returns a `Trainer` whose `init()` creates the train state directly in its
shards and whose `step(state, batch)` is one `jax.jit` over the whole step with explicit in/out
shardings and the state donated.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from lumen_jax.checkpoint import manager as checkpoint
from lumen_jax.config import Config
from lumen_jax.data import BATCH_KEYS
from lumen_jax.model import abstract_model, init as init_model
from lumen_jax.ops.choice import Ops, choose
from lumen_jax.train.optim import make_optimizer, schedule
from lumen_jax.parallel import communication as comm, context as context_lib
from lumen_jax.parallel.pipeline.layout import Pipeline
from lumen_jax.parallel.rules import Rules, activate
from lumen_jax.runtime import process
from lumen_jax.train import step as step_lib

BATCH_AXES = ("batch", "seq")


@dataclasses.dataclass
class Trainer:
    cfg: Config
    mesh: Mesh
    rules: Rules
    step_cfg: step_lib.StepConfig
    param_names: dict  # {path: logical axis names}
    ops: Ops  # how the model's ops run (lumen_jax.ops.choice); `ops.note` goes into the start-up line
    # the state in memory <-> on disk (uneven or interleaved stages: the stacks as held <-> real layers)
    stored: checkpoint.StoredLayout
    state_shardings: step_lib.TrainState
    batch_sharding: NamedSharding
    init: Any  # () -> TrainState
    step: Any  # (TrainState, batch) -> (TrainState, metrics)
    grads: Any  # (params, batch) -> (loss, grads): the step's gradients, for tests and tools
    step_and_grads: Any  # (TrainState, batch) -> (TrainState, metrics, grads): `step` and its gradients, not donating

    def param_specs(self, kind: str = "params") -> dict:
        """PartitionSpec of every parameter for `kind` in params | grads | optimizer."""
        return self.rules.tree_specs(self.param_names, kind)

    def abstract_state(self) -> step_lib.TrainState:
        """Shapes, dtypes and target shardings of the state (for restoring onto this mesh)."""
        return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                            jax.eval_shape(self.init), self.state_shardings)

    def real_layers(self, tree: dict) -> dict:
        """A params-like tree (parameters, gradients, model state) with its layer stacks as the model
        orders them: `Pipeline.unpad` of what uneven or interleaved stages hold (else `tree`)."""
        pipe = self.step_cfg.pipeline
        return tree if pipe is None else _on_stacks(pipe, pipe.unpad, tree)

    def stored_abstract_state(self) -> step_lib.TrainState:
        """`abstract_state` as checkpoints hold it (the real layers only, in order)."""
        return self.stored.target(self.abstract_state())

    def shard_batch(self, local_batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Global sharded arrays from this process's rows of the batch.

        Under context parallelism the tokens of every row are first put in the load-balanced order
        the attention expects (`parallel.context.permute_tokens`; positions move with them).
        """
        layout = context_lib.Layout(self.mesh.shape["context"], self.rules.context_balance)
        return {k: jax.make_array_from_process_local_data(
                    self.batch_sharding, context_lib.permute_tokens(np.asarray(local_batch[k]), layout))
                for k in BATCH_KEYS}


def _layer_stacks(names: dict) -> tuple[str, ...]:
    """The top-level parameters stacked along `layers` (the dense and the MoE blocks): what pipeline stages cut."""
    is_names = lambda x: isinstance(x, tuple)  # noqa: E731
    return tuple(k for k, sub in names.items()
                 if all(n[:1] == ("layers",) for n in jax.tree.leaves(sub, is_leaf=is_names)))


def _on_stacks(pipe: Pipeline, fn: Any, tree: dict) -> dict:
    """`fn(stack, name)` applied to the layer stacks of a params-like tree (params, model state), the rest kept."""
    return {k: fn(v, k) if k in pipe.stacks else v for k, v in tree.items()}


def _fresh_state(pipe: Pipeline | None, state: dict) -> dict:
    """The model state at step 0 (zeros), with uneven or interleaved stages in the layout of the stacks
    in memory (`Pipeline.pad`)."""
    if pipe is not None and pipe.reorders:
        state = jax.eval_shape(functools.partial(_on_stacks, pipe, pipe.pad), state)
    return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), state)


def _stored_sharding(sh: NamedSharding, shape: tuple[int, ...]) -> NamedSharding:
    """The sharding of a stack's real layers [L, ...] as written: L need not divide over `pipeline`,
    so `pipeline` moves from the layers axis to the first other axis it divides (else the layers
    are replicated over it for the save): the save copies no more per device than the stage holds."""
    spec = [*sh.spec, *(None,) * (len(shape) - len(sh.spec))]
    as_tuple = lambda e: () if e is None else (e,) if isinstance(e, str) else tuple(e)  # noqa: E731
    spec = [as_tuple(e) for e in spec]
    p = sh.mesh.shape["pipeline"]
    spec[0] = tuple(a for a in spec[0] if a != "pipeline")
    for i in range(1, len(shape)):
        if shape[i] % (int(np.prod([sh.mesh.shape[a] for a in spec[i]])) * p) == 0:
            spec[i] = (*spec[i], "pipeline")
            break
    return NamedSharding(sh.mesh, P(*(e[0] if len(e) == 1 else (e or None) for e in spec)))


def _stored_layout(pipe: Pipeline, tx: optax.GradientTransformation, abstract: step_lib.TrainState,
                   state_sh: step_lib.TrainState) -> checkpoint.StoredLayout:
    """Uneven or interleaved stages: the stacks as held in memory (params, the optimizer's copies of
    them, model state: `Pipeline.pad`) <-> their real layers [L, ...] in order on disk, so a
    checkpoint restores under any stage split, even stages or no pipeline (checkpoint.StoredLayout)."""
    marks = {k: jax.tree.map(lambda _: k if k in pipe.stacks else "", v) for k, v in abstract.params.items()}

    def convert(fn: Any, state: step_lib.TrainState) -> step_lib.TrainState:
        opt = optax.tree_map_params(tx, lambda a, stack: fn(a, stack) if stack else a, state.opt_state, marks,
                                    transform_non_params=lambda a: a)
        return state.replace(params=_on_stacks(pipe, fn, state.params), opt_state=opt,
                             model_state=_on_stacks(pipe, fn, state.model_state))

    stored = jax.eval_shape(functools.partial(convert, pipe.unpad), abstract)
    stored_sh = jax.tree.map(lambda s, a, sh: sh if s.shape == a.shape else _stored_sharding(sh, s.shape),
                             stored, abstract, state_sh)
    to_disk = jax.jit(functools.partial(convert, pipe.unpad), out_shardings=stored_sh)
    from_disk = jax.jit(functools.partial(convert, pipe.pad), out_shardings=state_sh)
    with_sh = lambda _: jax.tree.map(  # noqa: E731
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), stored, stored_sh)
    model_from_disk = jax.jit(lambda params, model_state: (_on_stacks(pipe, pipe.pad, params),
                                                           _on_stacks(pipe, pipe.pad, model_state)),
                              out_shardings=(state_sh.params, state_sh.model_state))
    return checkpoint.StoredLayout(save=to_disk, target=with_sh, load=from_disk, load_model=model_from_disk)


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


def _state_shardings(mesh: Mesh, rules: Rules, names: dict, state_names: dict, tx: optax.GradientTransformation,
                     abstract: step_lib.TrainState) -> step_lib.TrainState:
    """Where the train state lives: the parameters and the model state by the rules' `params` specs,
    the optimizer's copies of the parameters by its `optimizer` specs (mesh.zero_stage), the
    scalars replicated."""
    named = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    replicated = named(P())
    opt_param_sh = jax.tree.map(named, rules.tree_specs(names, "optimizer"), is_leaf=_is_spec)
    opt_sh = optax.tree_map_params(tx, lambda _, sh: sh, abstract.opt_state, opt_param_sh,
                                   transform_non_params=lambda _: replicated,
                                   is_leaf=lambda x: isinstance(x, NamedSharding))
    return step_lib.TrainState(step=replicated, params=jax.tree.map(named, rules.tree_specs(names, "params"),
                                                                    is_leaf=_is_spec),
                               opt_state=opt_sh, loss_scale=replicated, good_steps=replicated,
                               model_state=jax.tree.map(named, rules.tree_specs(state_names, "params"),
                                                        is_leaf=_is_spec))


def _placement(cfg: Config, mesh: Mesh, rules: Rules, names: dict, pipelined: bool) -> step_lib.Placement:
    """Where the step's intermediate trees live (`step.Placement`): the reduced gradients by the
    rules' `grads` specs, the compute weights and the replica groups' gradient sums as the
    communication plan (`communication.gradient_plan`) places them."""
    # A pipelined step runs its ticks under the replica vmap (one gradient reduction per step) unless
    # sequence parallelism splits its activations over `tensor`: XLA's SPMD partitioner stops on such
    # vmapped ticks (jaxlib 0.10.2, a check failure, docs/PLATFORM.md). That step has no replica axes
    # here: its stages make `data` and `context` manual instead (parallel/pipeline/executor.py), each
    # device ticking on its own rows and tokens, and reduce them once, after the last tick (fsdp
    # reduced once is refused with it: config/checks.py).
    sp_ticks = pipelined and cfg.mesh.sequence_parallel and mesh.shape["tensor"] > 1
    plan = comm.gradient_plan(cfg.mesh, cfg.train.micro_batches, mesh, rules, names, pipelined=pipelined,
                              per_replica=not sp_ticks)
    pin = lambda specs: functools.partial(  # noqa: E731
        jax.lax.with_sharding_constraint,
        shardings=jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=_is_spec))
    return step_lib.Placement(grads=pin(rules.tree_specs(names, "grads")), weights=pin(plan.weight_specs),
                              accumulator=pin(plan.accumulator_specs), replicas=plan.replicas,
                              replica_axes=plan.replica_axes, replica_seq=plan.replica_seq, keep_weights=cfg.mesh.fsdp_regather == "per_step")


def build(cfg: Config, mesh: Mesh, ops: Ops | None = None) -> Trainer:
    """The run of `cfg` on `mesh`. `ops`: how the model's ops run; None chooses them from the mesh's
    devices (`ops.choice.choose`); `python -m lumen_jax.lower` passes the choice for a target GPU."""
    rules = Rules(zero_stage=cfg.mesh.zero_stage, sequence_parallel=cfg.mesh.sequence_parallel,
                  zero_axes=cfg.mesh.zero_mesh_axes,
                  context_parallel=cfg.mesh.context_parallel, context_balance=cfg.mesh.context_balance,
                  tensor_overlap=cfg.mesh.tensor_overlap)
    if ops is None:
        ops = choose(cfg.model, list(mesh.devices.flat), mesh.shape["context"])  # a ConfigError before compiling
    model = abstract_model(cfg.model, ops)
    names = model.param_names
    tx = make_optimizer(cfg.optim, cfg.train.steps, names)
    fp16 = cfg.model.compute_dtype == "float16"
    pipe = (Pipeline.create(mesh, cfg.model.d_model, cfg.model.compute_dtype, cfg.mesh.pipeline_schedule,
                            cfg.train.micro_batches, cfg.mesh.pipeline_virtual_stages,
                            stacks=_layer_stacks(names), layers=cfg.mesh.pipeline_layers,
                            first=cfg.model.moe.first_dense_layers if cfg.model.moe.enabled else 0,
                            num_layers=cfg.model.num_layers)
            if mesh.shape["pipeline"] > 1 else None)
    sc = step_lib.StepConfig(graphdef=model.graphdef, tx=tx, lr_schedule=schedule(cfg.optim, cfg.train.steps),
                             micro_batches=cfg.train.micro_batches, z_loss=cfg.optim.z_loss,
                             dynamic_loss_scale=fp16,
                             loss_scale_growth_interval=cfg.optim.loss_scale_growth_interval,
                             fresh_state=_fresh_state(pipe, model.state),
                             state_combine=model.state_combine,
                             weight_dtypes=jax.tree.map(lambda n: ops.weight_dtype(n, cfg.model.compute_dtype),
                                                        names, is_leaf=lambda x: isinstance(x, tuple)),
                             reduce_dtype=cfg.mesh.reduce_dtype, pipeline=pipe)

    def make_state() -> step_lib.TrainState:
        params, model_state = init_model(cfg.model, cfg.train.seed, ops)
        if pipe is not None:  # uneven stages padded with zero layers, interleaved device-major (Pipeline.pad)
            params, model_state = _on_stacks(pipe, pipe.pad, params), _on_stacks(pipe, pipe.pad, model_state)
        return step_lib.init_state(params, tx, cfg.optim.loss_scale_init if fp16 else 1.0, model_state)

    abstract = jax.eval_shape(make_state)
    state_sh = _state_shardings(mesh, rules, names, model.state_names, tx, abstract)
    replicated = NamedSharding(mesh, P())
    grad_sh = jax.tree.map(functools.partial(NamedSharding, mesh), rules.tree_specs(names, "grads"), is_leaf=_is_spec)
    batch_sh = NamedSharding(mesh, rules.spec(BATCH_AXES))
    batch_shardings = {k: batch_sh for k in BATCH_KEYS}
    placement = _placement(cfg, mesh, rules, names, pipelined=pipe is not None)
    trace_rules = dataclasses.replace(rules, replica_axes=placement.replica_axes)

    def traced(fn):  # trace under the rules so `constrain` in the model pins activations
        @functools.wraps(fn)
        def wrapper(*args):
            with activate(mesh, trace_rules):
                return fn(*args)
        return wrapper

    init = jax.jit(make_state, out_shardings=state_sh)
    # runtime.xla_gpu_flags on GPUs: the step's compile options (those this XLA has)
    options = process.step_compile_options(cfg.runtime, cfg.model, cfg.mesh, mesh.devices.flat[0].platform) or None
    step = jax.jit(traced(functools.partial(step_lib.train_step, sc=sc, placement=placement)),
                   in_shardings=(state_sh, batch_shardings), out_shardings=(state_sh, replicated),
                   donate_argnums=0, compiler_options=options)
    step_and_grads = jax.jit(traced(functools.partial(step_lib.train_step_and_grads, sc=sc, placement=placement)),
                             in_shardings=(state_sh, batch_shardings), out_shardings=(state_sh, replicated, grad_sh),
                             compiler_options=options)
    grads = jax.jit(traced(lambda p, b: step_lib.loss_and_grads(p, b, 1.0, sc, placement)),
                    in_shardings=(state_sh.params, batch_shardings), out_shardings=(replicated, grad_sh))
    stored = _stored_layout(pipe, tx, abstract, state_sh) if pipe is not None and pipe.reorders else checkpoint.StoredLayout()
    return Trainer(cfg=cfg, mesh=mesh, rules=rules, step_cfg=sc, param_names=names, ops=ops,
                   stored=stored, state_shardings=state_sh, batch_sharding=batch_sh, init=init, step=step, grads=grads,
                   step_and_grads=step_and_grads)
