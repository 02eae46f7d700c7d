"""Projection dispatch: `project(spec, x, w, ops, ...)`, the einsum of activations and a weight.

The model computes every projection (Q/K/V/O, SwiGLU, logits) through `project`; `Ops.projection`
(chosen once when the step is built, `ops.choice`) says how it runs:

- `einsum`: `jnp.einsum(spec, x, w)` in the compute dtype, gradients by JAX's transpose rules.
- `token_grad`: the trainer's step on one CPU device: the same forward with the weight gradient
  written as one einsum over the token axes (`ops.cpu.token_grad_project`).
- `fp8`: the layer type runs fp8 matmuls (`ops.fp8.einsum` with the recipe of `model.fp8`; the
  delayed recipe's amax histories are the layer's model state, `ops.state`), or, where the traced
  `Ops.fp8_keep` holds (a pipeline stage's slot of a kept layer), the compute dtype's.
- `fp8_kept`: an fp8 layer type in a layer kept in the compute dtype (the first/last layer):
  the plain matmul in the form `ops.fp8.einsum` gives it.

`regather` (`Ops.regather`: the policy saves a projection's input, `remat: none`): under sequence
parallelism the column-parallel projections (Q/K/V, gate/up) read their input gathered along the
sequence over `tensor`, and autodiff would keep that gathered input, [B, T, D] per device, for the
weight gradients. `project_columns` runs them as one custom VJP instead (`_regathered`) whose residual
is the device's own rows, [B, T/t, D] (Megatron's: Korthikanti et al. 2022, section 4.2.2), gathered
again in the backward for the weight gradients: one all-gather per input more, t - 1 rows of t less
saved per input.

A custom VJP reaches remat policies as one opaque `custom_vjp_call`: `remat_policy` wraps a
`jax.checkpoint_policies` policy so that it sees each `token_grad` projection as its dot.

`Taps` split a backward in two (zero_bubble's B and W units, Qi et al. 2023): a vjp of the layers
gives the input gradient and, per projection, its input and output cotangent; `Taps.replay` turns
those into the weight gradients later, one einsum per projection, without the cotangent chain again.
An MoE layer's routed experts (grouped matmuls, `ops.grouped`) are tapped the same way, through
`Tape.grouped`: their rows, SwiGLU outputs and cotangents wait for W instead.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.extend
import jax.numpy as jnp
from flax import nnx

from lumen_jax.ops import cpu, fp8, grouped
from lumen_jax.ops.choice import Ops
from lumen_jax.parallel import collective_matmul
from lumen_jax.parallel import rules as rules_lib


# Residual names (`checkpoint_name`) of projections' backward passes that the remat policies saving the
# projections' products keep too: fp8's quantized operands and their scales (1 byte per element,
# against quantizing the float32 master weight and the activation again in the backward).
SAVED_WITH_DOTS = (fp8.RESIDUAL_NAME,)


def project(spec: str, x: jax.Array, w: jax.Array, ops: Ops, layer_type: str | None = None,
            state: nnx.Dict | None = None, out_dtype: Any = None, peers: tuple[nnx.Dict, ...] | None = None) -> jax.Array:
    """`jnp.einsum(spec, x, w)` of activations `x` (compute dtype) and a weight `w` (float32 master).

    Args:
      spec: an einsum whose second operand is the weight and whose output keeps x's leading
        (token) axes, e.g. `"btd,df->btf"`, `"btnh,nhd->btd"`.
      x: activations, e.g. [B, T, D].
      w: the weight, e.g. [D, F]; cast to x's dtype here (fp8 quantizes it from float32).
      ops: the implementation choice; `layer_type` (attention | mlp | None) selects fp8.
      state: this projection's model state (`projection_state`), or None.
      out_dtype: the einsum's `preferred_element_type` (float32 logits from bfloat16 inputs).
      peers: the states of every projection that reads this same `x` (this one's included), or None:
        fp8's delayed recipe scales `x` from all their histories, so one quantization serves them all.

    Returns:
      The einsum's value; gradients equal the einsum's (float32: to rounding of the summation order).
    """
    how = ops.projection(layer_type)
    if how == "fp8":
        return fp8.einsum(spec, x, w, ops.fp8.recipe, state, ops.fp8_keep, peers, ops.fp8_warm)
    if how == "fp8_kept":
        return fp8.einsum(spec, x, w, "none")
    w = w.astype(x.dtype)
    if how == "token_grad":
        return cpu.token_grad_project(spec, x, w, out_dtype)
    return jnp.einsum(spec, x, w, preferred_element_type=out_dtype)


def project_columns(specs: tuple[str, ...], x: jax.Array, ws: tuple[jax.Array, ...], ops: Ops,
                    layer_type: str | None = None, states: tuple[nnx.Dict | None, ...] | None = None
                    ) -> tuple[jax.Array, ...]:
    """The column-parallel projections of one input (Q/K/V, gate/up): `project(spec, x, w, ...)` for
    each of `specs` and `ws`, weights split over their output features by the rules (`heads`, `mlp`).

    With `Ops.regather` under sequence parallelism (`regathers`) `x` arrives gathered and the plain
    einsums run as one custom VJP that keeps x's own rows and gathers them again in the backward
    (`_regathered`). Under `mesh.tensor_overlap=collective_matmul` (with sequence parallelism over `tensor`) `x`
    arrives split along the sequence (`proj_seq`) and the plain einsums run as one all-gather
    matmul (`parallel.collective_matmul`): x's blocks travel under the partial matmuls of every
    weight. Otherwise, and for fp8 projections (whose scales see the whole operand), each runs as
    `project`, x gathered before them by the partitioner; fp8 projections get each other's `states`
    as `peers` (one delayed scale of their shared input).
    """
    states = states if states is not None else (None,) * len(specs)
    if ops.projection(layer_type) == "einsum" and collective_matmul.active():
        return collective_matmul.all_gather_matmul(specs, x, tuple(w.astype(x.dtype) for w in ws))
    if ops.projection(layer_type) == "einsum" and ops.regather and regathers(x.ndim):
        return _regathered(specs, x, tuple(w.astype(x.dtype) for w in ws))
    peers = None if all(st is None for st in states) else states  # fp8: one scale of x for all of them
    return tuple(project(spec, x, w, ops, layer_type, st, peers=peers) for spec, w, st in zip(specs, ws, states))


def project_rows(spec: str, x: jax.Array, w: jax.Array, ops: Ops, layer_type: str | None = None,
                 state: nnx.Dict | None = None) -> jax.Array:
    """A row-parallel projection (O, down: the weight split over its input features, the output
    summed over `tensor`): `project(spec, x, w, ...)`, or under `mesh.tensor_overlap=collective_matmul`
    a reduce-scatter matmul whose result is split along the sequence as the residual stream
    (`parallel.collective_matmul`). With `Ops.regather` under sequence parallelism, the einsum with
    its output cotangent gathered once for both of the backward's matmuls (`_cotangent_gathered`)."""
    if ops.projection(layer_type) == "einsum" and collective_matmul.active():
        return collective_matmul.reduce_scatter_matmul(spec, x, w.astype(x.dtype))
    if ops.projection(layer_type) == "einsum" and ops.regather and regathers(len(spec.split("->")[1])):
        return _cotangent_gathered(spec, x, w.astype(x.dtype))
    return project(spec, x, w, ops, layer_type, state)


# A column-parallel projection's input [B, T, D]: split along the sequence as the residual stream
# (`act_seq`: over `tensor` under sequence parallelism), gathered for the matmul (`proj_seq`).
_SPLIT = ("batch", "act_seq", "act_embed")
_GATHERED = ("batch", "proj_seq", "act_embed")


def regathers(ndim: int = 3) -> bool:
    """Whether the enclosing `rules.activate` gathers a column-parallel projection's input ([B, T, D]:
    `ndim` 3) along the sequence over mesh axes of more than one device (sequence parallelism without
    `mesh.tensor_overlap=collective_matmul`, which gathers it in steps itself): where `Ops.regather`
    keeps only the local rows for the backward. False outside `activate`."""
    got = rules_lib.active()
    if got is None or ndim != 3 or collective_matmul.active():
        return False
    mesh, rules = got
    axes = lambda a: set((a,) if isinstance(a, str) else a or ())  # noqa: E731
    split = axes(rules.spec(_SPLIT)[1]) - axes(rules.spec(_GATHERED)[1])
    return any(dict(mesh.shape).get(a, 1) > 1 for a in split)


def _einsums(specs: tuple[str, ...], x: jax.Array, ws: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    return tuple(jnp.einsum(spec, x, w) for spec, w in zip(specs, ws))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _regathered(specs: tuple[str, ...], x: jax.Array, ws: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """`einsum(spec, x, w)` for each of `specs` and `ws` of one gathered input `x` [B, T, D]; the
    residual is x's local rows ([B, T/t, D] under sequence parallelism), gathered again in the
    backward for the weight gradients (`regathers`)."""
    return _einsums(specs, x, ws)


def _regathered_fwd(specs: tuple[str, ...], x: jax.Array, ws: tuple[jax.Array, ...]) -> tuple[tuple, tuple]:
    # x's own rows: a slice of the gathered x (the partitioner's rows of the norm output it gathered)
    return _einsums(specs, x, ws), (rules_lib.constrain(x, _SPLIT), ws)


def _regathered_bwd(specs: tuple[str, ...], res: tuple, dys: tuple) -> tuple:
    rows, ws = res
    x = rules_lib.constrain(rows, _GATHERED)  # the all-gather again, for the weight gradients
    _, vjp = jax.vjp(functools.partial(_einsums, specs), x, ws)
    return vjp(tuple(dys))


_regathered.defvjp(_regathered_fwd, _regathered_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _cotangent_gathered(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """`einsum(spec, x, w)` of a row-parallel projection (output [B, T, D], partial sums over
    `tensor`, reduce-scattered along the sequence by the partitioner) whose backward gathers the
    output cotangent once, for the input and the weight gradient together. Left to autodiff the
    partitioner gathered it once per matmul (the two all-gathers of one operand spelled with
    different device groups, which XLA's CSE does not merge): two all-gathers per projection."""
    return jnp.einsum(spec, x, w)


def _cotangent_gathered_fwd(spec: str, x: jax.Array, w: jax.Array) -> tuple[jax.Array, tuple]:
    return jnp.einsum(spec, x, w), (x, w)


def _cotangent_gathered_bwd(spec: str, res: tuple, dy: jax.Array) -> tuple:
    _, vjp = jax.vjp(functools.partial(jnp.einsum, spec), *res)
    return vjp(rules_lib.constrain(dy, _GATHERED))


_cotangent_gathered.defvjp(_cotangent_gathered_fwd, _cotangent_gathered_bwd)


@jax.custom_vjp
def _record(x: jax.Array, tap_x: jax.Array) -> jax.Array:
    """x, unchanged; the "cotangent" of the zero `tap_x` (x's shape) is x itself: a vjp that runs
    through it hands back the projection's input (recomputed by the backward under remat, as the
    policy says) beside the gradients, for the weight-gradient unit."""
    del tap_x
    return x


def _record_fwd(x: jax.Array, tap_x: jax.Array) -> tuple[jax.Array, jax.Array]:
    del tap_x
    return x, x


def _record_bwd(x: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    return g, x


_record.defvjp(_record_fwd, _record_bwd)


@dataclasses.dataclass(frozen=True)
class _Grouped:
    """A tapped grouped matmul (an MoE layer's routed experts, `Tape.grouped`): its weights' keys,
    the shapes of one layer's taps (`ops.grouped.tap_shapes`, as the layer sees them) and the
    replay (`weights, recorded inputs -> the matmuls' outputs`, whose vjp gives their gradients)."""

    weights: tuple[str, ...]
    shapes: dict  # {name: jax.ShapeDtypeStruct}: grouped.TAP_INPUTS + grouped.TAP_COTANGENTS
    replay: Callable[[tuple, dict], tuple]


def _weight(tree: dict, key: str) -> Any:
    for name in key.split("."):
        tree = tree[name]
    return tree


@dataclasses.dataclass(frozen=True)
class _Tapped:
    """One tapped projection of a stack: its einsum, how it runs, whose input it reads (projections
    of one input, Q/K/V and gate/up, record it once) and the shapes of one layer's taps."""

    spec: str
    ops: Ops
    layer_type: str | None
    source: str  # the key whose tap records the input
    x: jax.ShapeDtypeStruct
    y: jax.ShapeDtypeStruct


class Taps:
    """Zero inputs on a stack of layers' projections that split their backward (zero_bubble's B and W).

    With `arrays` (from `zeros`), each plain-einsum projection y = x @ w of the layers runs as
    `x' @ w + tap_y`, x' = x recorded by `tap_x`; one vjp of the layers with the tapped weights
    stopped (`stop`) then returns the input gradient and, as the taps' cotangents, each projection's
    output cotangent dy and input x, but no weight gradient of a tapped weight. `replay(weights, cotangents)`
    gives those weights' gradients later (its vjp: x^T dy, the einsum JAX's transpose does).
    Projections with a backward of their own (fp8's scales and histories) are not tapped: their
    weight gradients stay in the first vjp. The MoE experts' grouped matmuls are (`_Grouped`).

    Without `arrays`, a probe: tracing the layers fills `found` ({stack: {key: _Tapped or _Grouped}};
    a key is the weight's path in a layer, "attn.wq", or a grouped matmul's, "mlp.experts").
    """

    def __init__(self, arrays: dict | None = None, found: dict | None = None):
        # {stack: {key: {"x": [L, ...] (the source keys only), "y": [L, ...]}}}; a grouped key: its
        # `_Grouped.shapes` names, [L, devices, ...]
        self.arrays = arrays
        self.found = {} if found is None else found

    def stop(self, params: dict) -> dict:
        """`params` (the stacks' parameters) with the tapped weights under `stop_gradient`. Stopped
        here, outside the layers' scan, a weight stays a scan input, which the vjp keeps as it is (a
        residual of the weights alone, not stashed); stopped inside the scan's body it would be a
        new per-layer output, which the pipeline would stash for every micro-batch in flight."""
        tapped = {(stack, *w.split(".")) for stack, keys in self.weights().items() for w in keys}
        return jax.tree_util.tree_map_with_path(
            lambda path, a: jax.lax.stop_gradient(a) if tuple(k.key for k in path) in tapped else a, params)

    def weights(self) -> dict[str, list[str]]:
        """{stack: the keys of the tapped weights}: a projection's weight, a grouped matmul's three."""
        return {stack: [w for key, t in found.items() for w in (t.weights if isinstance(t, _Grouped) else (key,))]
                for stack, found in self.found.items()}

    def tapping(self, arrays: dict) -> "Taps":
        """These (probed) taps with `arrays` (a chunk's, `zeros`-shaped): the layers run tapped."""
        return Taps(arrays, self.found)

    def layer(self, stack: str, arrays: dict | None) -> "Tape":
        """The tape of one layer of `stack` (its slice of `arrays`, None when probing)."""
        return Tape(self.found.setdefault(stack, {}), arrays, self.arrays is None)

    def zeros(self, params: dict) -> dict:
        """The taps of the layers `params` holds (the model's parameters, or a chunk's: each stack
        [L, ...]): zeros [L, ...] per tapped projection."""
        def one(sds: jax.ShapeDtypeStruct, stack: str) -> jax.Array:
            return jnp.zeros((jax.tree.leaves(params[stack])[0].shape[0], *sds.shape), sds.dtype)

        def taps(t: Any, key: str, stack: str) -> dict:
            if isinstance(t, _Grouped):
                return {name: one(sds, stack) for name, sds in t.shapes.items()}
            return ({"x": one(t.x, stack)} if t.source == key else {}) | {"y": one(t.y, stack)}
        return {stack: {key: taps(t, key, stack) for key, t in found.items()}
                for stack, found in self.found.items() if found}

    def replay(self, weights: dict, cotangents: dict) -> dict:
        """{stack: {key: y [L, ...]}}: the tapped projections of the recorded inputs (the taps'
        `cotangents` from a vjp, `zeros`-shaped: each source's "x") with `weights` ({stack: the
        layers' weights [L, ...]}, compute dtype)."""
        out = {}
        for stack, found in self.found.items():
            for key, t in found.items():
                if isinstance(t, _Grouped):  # (x w_gate, x w_up, h w_down) of the recorded rows
                    w = tuple(_weight(weights[stack], k) for k in t.weights)
                    recorded = {n: cotangents[stack][key][n] for n in grouped.TAP_INPUTS}
                    out.setdefault(stack, {})[key] = jax.vmap(t.replay)(w, recorded)
                    continue
                x = cotangents[stack][t.source]["x"]
                out.setdefault(stack, {})[key] = jax.vmap(
                    lambda x, w, t=t: project(t.spec, x, w, t.ops, t.layer_type))(x, _weight(weights[stack], key))
        return out

    def weight_grads(self, weights_of: Callable[[dict], dict], params: dict, cotangents: dict) -> dict:
        """The tapped weights' gradients from the taps' `cotangents`: `replay`'s vjp at the recorded
        output cotangents ("y"), one einsum x^T dy per projection (its forward einsums go unused).
        `params`: the stacks' parameters (float32; the result has their structure),
        `weights_of(params)`: the compute-dtype weights, differentiated through."""
        stacks = {k: params[k] for k in self.found if self.found[k]}
        def dy(t: Any, recorded: dict) -> Any:
            return tuple(recorded[n] for n in grouped.TAP_COTANGENTS) if isinstance(t, _Grouped) else recorded["y"]
        dys = {k: {key: dy(self.found[k][key], c) for key, c in d.items()} for k, d in cotangents.items()}
        return jax.vjp(lambda p: self.replay(weights_of(p), cotangents), stacks)[1](dys)[0]


class Tape:
    """The taps of one layer's projections (`Taps.layer`); `scope(name)` for a sub-module's."""

    def __init__(self, found: dict, arrays: dict | None, probe: bool, prefix: str = "",
                 seen: dict | None = None):
        self.found, self.arrays, self.probe, self.prefix = found, arrays, probe, prefix
        # the layer's inputs so far: probing {id(x): the key that records it}, tapping {key: recorded x}
        self.seen = {} if seen is None else seen

    def scope(self, name: str) -> "Tape":
        return Tape(self.found, self.arrays, self.probe, f"{self.prefix}{name}.", self.seen)

    def grouped(self, attr: str, weights: tuple[str, ...], shapes: dict | None = None,
                replay: Callable[[tuple, dict], tuple] | None = None) -> dict | None:
        """This layer's taps of the grouped matmul `attr` whose weights are `weights` (this scope's
        attributes): its zero arrays, or None when probing. Probing, pass `shapes` (the taps as the
        layer sees them) and `replay` (`_Grouped`) once they are known; they are recorded."""
        key = self.prefix + attr
        if self.probe:
            if shapes is not None:
                self.found[key] = _Grouped(tuple(self.prefix + w for w in weights), shapes, replay)
            return None
        return self.arrays[key]

    def project(self, attr: str, spec: str, x: jax.Array, w: jax.Array, ops: Ops, layer_type: str | None,
                state: nnx.Dict | None = None, peers: tuple[nnx.Dict, ...] | None = None) -> jax.Array:
        """`project(spec, x, w, ...)` of the weight `attr` of this scope, tapped when it is a plain einsum."""
        key = self.prefix + attr
        if ops.projection(layer_type) not in ("einsum", "token_grad"):
            return project(spec, x, w, ops, layer_type, state, peers=peers)
        if self.probe:
            y = project(spec, x, w, ops, layer_type, state)
            source = self.seen.setdefault(id(x), key)
            self.found[key] = _Tapped(spec, ops, layer_type, source, jax.ShapeDtypeStruct(x.shape, x.dtype),
                                      jax.ShapeDtypeStruct(y.shape, y.dtype))
            return y
        t = self.found[key]
        if t.source == key:
            self.seen[key] = _record(x, self.arrays[key]["x"])
        return project(spec, self.seen[t.source], w, ops, layer_type) + self.arrays[key]["y"]  # w: `Taps.stop`


def projection_state(ops: Ops, layer_type: str, projections: tuple[str, ...]) -> nnx.Dict | None:
    """The model state of a layer's projections `projections` (names), or None when they keep none
    (only fp8's delayed recipe does: an amax history per operand, `ops.fp8.histories`)."""
    if layer_type in ops.fp8_types and ops.fp8.recipe == "delayed":
        return fp8.histories(ops.fp8, projections)
    return None


def _only_dot(jaxpr: jax.extend.core.Jaxpr) -> jax.extend.core.JaxprEqn | None:
    """The dot_general of a jaxpr that computes one einsum and nothing else, else None."""
    dots, others = [], 0
    for eqn in jaxpr.eqns:
        subs = list(jax.extend.core.jaxprs_in_params(eqn.params))
        if eqn.primitive.name == "dot_general":
            dots.append(eqn)
        elif subs:
            found = [_only_dot(sub) for sub in subs]
            dots += [d for d in found if d is not None]
            others += sum(d is None for d in found)
        elif eqn.primitive.name not in ("convert_element_type", "transpose", "reshape"):
            others += 1
    return dots[0] if len(dots) == 1 and not others else None


def remat_policy(policy: Callable[..., Any]) -> Callable[..., Any]:
    """`policy` (a `jax.checkpoint_policies` policy) seeing each `token_grad` projection as its dot.

    Without this the dot-based policies (`dots_saveable`, ...) would save none of the projections
    and recompute them all. The outputs of a collective matmul (`parallel.collective_matmul`,
    named `REMAT_NAME`) reach `policy` as a dot without batch dimensions, for the same reason. Other custom VJPs (fp8 dots, flash and context-parallel attention) are
    more than one dot and reach `policy` unchanged, so programs without `token_grad` see `policy`
    exactly.
    """
    def adapted(prim, *avals, **params):
        if prim.name == "name" and params.get("name") == collective_matmul.REMAT_NAME:
            # a collective matmul's output (its custom VJP is opaque): decided as a projection's dot
            return policy(jax.lax.dot_general_p, *avals, dimension_numbers=(((), ()), ((), ())),
                          precision=None, preferred_element_type=None)
        if prim.name == "custom_vjp_call":
            dot = _only_dot(params["call_jaxpr"].jaxpr)
            if dot is not None:
                return policy(dot.primitive, *avals, **dot.params)
        return policy(prim, *avals, **params)
    return adapted

