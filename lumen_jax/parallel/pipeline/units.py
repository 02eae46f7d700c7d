"""What one device along `pipeline` runs in a tick of the lock-step program, and what it carries.

`executor.py` builds a `Device` per stage inside its `shard_map` and runs the schedule's segments;
the units of work are here: `forward` (a chunk on one micro-batch, residuals to the stash), `head`
(the final norm, logits and loss, split over the stages by tokens), `backward` (the stashed
residuals' vjp), `weight` (zero_bubble's weight-gradient unit) and `tick`, which runs a segment's
units and sends their activations and cotangents one stage on or back. `StageFns` is how the model
enters: as functions, so this package never imports model/. `Carry` is a device's state from tick
to tick. Shape letters as in `executor.py`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lumen_jax.parallel import rules as rules_lib
from lumen_jax.parallel import shard
from lumen_jax.parallel.pipeline.layout import AXIS, Pipeline
from lumen_jax.parallel.pipeline.schedule import Cell, HeadCell, Lockstep, Segment


@dataclasses.dataclass(frozen=True)
class StageFns:
    """The model's parts, each a function of the full parameter tree (stacks: one chunk's slice)."""

    # table: (params) -> the embedding table [V, D] as the lookup reads it (its compute dtype, gathered)
    table: Callable[[dict], jax.Array]
    # embed: (table, tokens [B, T]) -> [B, T, D], the table's rows at the tokens. A plain lookup: its
    # gradient with respect to the table is the scatter-add of the rows' cotangents into their
    # tokens' rows, which the executor runs itself (`Device.embedding_grad`).
    embed: Callable[[jax.Array, jax.Array], jax.Array]
    # layers: (params, model state, x [B, T, D], micro-batch, the chunk's real layers (uneven stages;
    # None: all), taps=the projections' taps of a split backward or None, stage=the chunk's virtual
    # stage index (traced; layers that differ by depth, e.g. fp8's kept ones, look it up))
    # -> (y [B, T, D], the chunk's auxiliary loss (a scalar added to the objective; 0 without one),
    # its metrics {name: scalar, the mean over its real layers})
    layers: Callable[..., tuple[jax.Array, jax.Array, dict]]
    head: Callable[[dict, jax.Array, jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]
    # head: (params, y [B, T', D], targets [B, T'], mask [B, T'], weight) -> (weight * summed objective,
    # summed cross-entropy)
    # The model state's next values: two micro-batches' merged (earlier, later), and [R, ...] -> one.
    combine_state: Callable[[dict, dict], dict] = lambda earlier, later: later
    fold_state: Callable[[dict], dict] = lambda state_r: jax.tree.map(lambda a: a[-1], state_r)
    # A split backward (zero_bubble): () -> an empty probe of the layers' projection taps
    # (`ops.projection.Taps`), passed to `layers` as `taps=`; None: the backward stays whole.
    taps: Callable[[], Any] | None = None
    # Multi-token prediction, run with the head (`mtp_keys`: its parameters and model state, outside the
    # stacks; absent from the parameters: none): (params, its model state, h [B', T, D] whole rows of the
    # last stage's output, the micro-batch's same rows, weight) -> (weight * its objective, its auxiliary
    # loss (a mean over the rows), each depth's cross-entropy sum [Dm], each depth's counted tokens [Dm]).
    mtp: Callable[..., tuple[jax.Array, jax.Array, jax.Array, jax.Array]] | None = None
    mtp_keys: tuple[str, ...] = ("mtp",)


def _varying(fn: Callable, weights: tuple, varying: tuple) -> tuple[list[bool], list[Any]]:
    """Per output leaf of `fn(*weights, *varying)`: whether it depends on `varying` (a walk of the
    jaxpr: an equation's outputs depend on what any of its inputs depends on; the jitted stage's
    equation (`_jitted`) is walked inside, as if inlined), and its shape and dtype."""
    jaxpr = jax.make_jaxpr(fn)(*weights, *varying).jaxpr
    n_weights = len(jax.tree.leaves(weights))
    outer = _depends(jaxpr, [i >= n_weights for i in range(len(jaxpr.invars))], inline=_STAGE)
    return outer, [v.aval for v in jaxpr.outvars]


def _depends(jaxpr: Any, inputs: list[bool], inline: str | None = None) -> list[bool]:
    """Per output of `jaxpr`: whether it depends on an input flagged in `inputs`; the equations of
    jitted functions named `inline` are walked inside (one level), the others as one equation."""
    dep = {v for v, d in zip(jaxpr.invars, inputs) if d}
    for eqn in jaxpr.eqns:
        ins = [not hasattr(v, "val") and v in dep for v in eqn.invars]
        if inline is not None and eqn.params.get("name") == inline and "jaxpr" in eqn.params:
            dep.update(v for v, d in zip(eqn.outvars, _depends(eqn.params["jaxpr"].jaxpr, ins)) if d)
        elif any(ins):
            dep.update(eqn.outvars)
    return [not hasattr(v, "val") and v in dep for v in jaxpr.outvars]


def row_groups(rows: int, tokens: int) -> tuple[int, int]:
    """(Gb, Gs): the devices a micro-batch's `rows` and its `tokens` per row are split over inside a
    tick: the axes of the `batch` and the `seq` rules of the enclosing `rules.activate` (the replica
    axes, which the ticks' vmap takes, are not among them; `seq` is context parallelism's); 1 outside
    one, or where they do not split evenly."""
    def size(name: str, n: int) -> int:
        groups = shard.axes_size((name,))
        return groups if n % groups == 0 else 1
    return size("batch", rows), size("seq", tokens)


def _f32_zeros(a: jax.Array) -> jax.Array:
    """A float32 gradient sum for `a` (compute-dtype weights when the step passes them, `cast`)."""
    return jnp.zeros(a.shape, jnp.float32)


def add_to(total: jax.Array, d: jax.Array) -> jax.Array:
    return total + d.astype(total.dtype)


def _strided(x: jax.Array, p: int, s: jax.Array, pieces: int = 1) -> jax.Array:
    """Tokens s, s+P, s+2P, ... of each of the `pieces` equal runs of [B, T, ...] (a device's tokens
    along `context` each, so nothing moves between devices), each run padded with zeros to a
    multiple of P first (any T: a padded position's loss mask is 0): [B, pieces * ceil(T/pieces/P), ...].
    Where the runs divide by P these are the tokens s, s+P, ... of the whole sequence, in order."""
    b, t, rest = x.shape[0], x.shape[1], x.shape[2:]
    n = t // pieces
    per = -(-n // p)
    runs = jnp.pad(x.reshape(b, pieces, n, *rest), [(0, 0), (0, 0), (0, per * p - n)] + [(0, 0)] * len(rest))
    picked = jax.lax.dynamic_index_in_dim(runs.reshape(b, pieces, per, p, *rest), s, axis=3, keepdims=False)
    return picked.reshape(b, pieces * per, *rest)


def _rows(x: jax.Array, p: int, s: jax.Array, pieces: int = 1) -> jax.Array:
    """Stage s's share of the rows of [B, ...]: of each of the `pieces` equal runs of rows (a device's rows
    along the batch axes each, so nothing moves between devices), its s-th P-th: [B / P, ...]."""
    b, rest = x.shape[0], x.shape[1:]
    if b % (pieces * p):
        raise ValueError(f"{b} rows in {pieces} groups do not split over {p} pipeline stages")
    picked = jax.lax.dynamic_index_in_dim(x.reshape(pieces, p, b // (pieces * p), *rest), s, axis=1, keepdims=False)
    return picked.reshape(b // p, *rest)


def _at(a: jax.Array, i: jax.Array) -> jax.Array:
    """a[i] for a traced index i: the same dynamic slice as jnp's indexing, without its ~1 ms of
    Python per call (a tick reads every stashed residual leaf and every chunk leaf this way)."""
    return jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False)


def _jitted(stage: Callable, taps: Any) -> Callable:
    """`stage` (its last argument the arrays of the probed `taps`, or None) as one `jax.jit`: the
    stage's layers are traced once, and JAX caches that jaxpr, its jvp and its partial evaluation
    (the residuals) for every later call in the same trace context (each segment's forward, each
    backward's structure and weight residuals, `Device.start`'s shapes). The step's program is the
    same: XLA inlines the calls before it optimizes."""
    def pipeline_stage(c, o, st, x, mb, v, t):
        return stage(c, o, st, x, mb, v, None if t is None else taps.tapping(t))
    return jax.jit(pipeline_stage)


_STAGE = "pipeline_stage"  # the jitted stage's name in a jaxpr (`_varying` walks inside it)


class Carry(NamedTuple):
    """What one device carries from tick to tick (with R > 1 replica groups: each leaf [R, ...])."""

    stash: list  # per stashed residual leaf: [S + 1, ...], a forward's residuals until its backward
    w_stash: list  # split: per tap leaf [WS + 1, Lc, ...], a backward's projection inputs and cotangents until W
    g_stash: jax.Array  # [S + 1, B, T, D]: the loss's cotangent of the last virtual stage's outputs
    x_recv: jax.Array  # [B, T, D]: the activation the previous stage sent (in the tick that made it)
    g_send: jax.Array  # [B, T, D]: the last backward's input cotangent, not yet sent (`Device.tick`)
    d_stacked: dict  # [V, Lc, ...]: gradient sums of this device's chunks
    d_other: dict  # gradient sums of the replicated parameters (embedding, final norm, head)
    d_table: jax.Array  # [Gb, Gs, V, D] float32: each row group's sum of the embedding table's gradient
    ce: jax.Array  # the summed cross-entropy of this device's share of the head's tokens
    state: dict  # [V, Lc, ...]: the model state's next value (ops/state.py)
    head_state: dict  # the model state of what runs with the head (multi-token prediction's): its next value
    metrics: dict  # the model's aux metrics, summed over real forwards


class _TickCells(NamedTuple):
    """The lock-step program's tables as the ticks' scan reads them: each a `Cell` of [ticks, P]
    int32 arrays (`head` a `HeadCell` of [ticks]); inside a tick, that tick's [P] (`head`: scalars)."""

    fwd: Cell
    bwd: Cell
    head: HeadCell
    wgt: Cell  # the weight-gradient units (split backward; else the backwards', never read)

    @classmethod
    def of(cls, prog: Lockstep) -> "_TickCells":
        columns = lambda table, kind: kind(*np.moveaxis(np.asarray(table, np.int32), -1, 0))  # noqa: E731
        return cls(fwd=columns(prog.fwd, Cell), bwd=columns(prog.bwd, Cell), head=columns(prog.head, HeadCell),
                   wgt=columns(prog.wgt if prog.split else prog.bwd, Cell))


@dataclasses.dataclass(frozen=True)
class Device:
    """One device of the `pipeline` axis inside the `shard_map`: its stage's parameters (chunks
    [V, Lc, ...]) and the tick's three units of work, each one function."""

    pipe: Pipeline
    fns: StageFns
    cast: Callable[[dict], dict]
    s: jax.Array  # this device's stage index
    stacked: dict  # [V, Lc, ...]
    other: dict
    state: dict  # [V, Lc, ...]
    head_state: dict  # the model state of what runs with the head (`StageFns.mtp`), replicated
    tokens: jax.Array
    scale: jax.Array
    aux_share: float  # the auxiliary loss's share of one micro-batch of one replica group
    stashed: tuple = ()  # per residual leaf: whether the stash holds it (else taken again from the weights)
    taps: Any = None  # split backward: the probed taps of the layers' projections (`StageFns.taps`)
    w_tree: Any = None  # the taps' tree structure (the W stash's leaves)
    table: Any = None  # the embedding table the lookup reads (`StageFns.table` of the cast weights)
    groups: tuple[int, int] = (1, 1)  # the devices a micro-batch's rows and tokens are split over (`row_groups`)
    mtp: bool = False  # multi-token prediction runs with the head (`StageFns.mtp`)
    # `stage` as one `jax.jit` (`start`: `_jitted`), which `residuals` calls
    traced_stage: Callable | None = None

    @property
    def act_dtype(self):
        return jnp.dtype(self.pipe.compute_dtype)

    def chunk(self, tree: dict, c: jax.Array | int) -> dict:
        return jax.tree.map(lambda a: a[c] if isinstance(c, int) else _at(a, c), tree)

    def start(self, chunk0: dict, zeros_act: jax.Array, zero_mb: dict, r: int,
              replica_axes: tuple[str, ...]) -> tuple["Device", "Carry"]:
        """This device ready for the first tick, and that tick's carry: the projections a split
        backward taps (probed on chunk 0; none found: the backward stays whole), which residuals
        depend on the micro-batch (stashed; the others, the weights' alone, are taken again in the
        backward, where XLA drops the rest of that second trace), and the carry's zeros: stash
        slots, gradient sums, metrics. With R replica groups (r > 1) every leaf gets [R, ...]."""
        prog, dev = self.pipe.program, self
        state0 = dev.chunk(dev.state, 0)
        if prog.split and dev.fns.taps is not None:
            probe = dev.fns.taps()
            jax.eval_shape(lambda: dev.stage(chunk0, dev.other, state0, zeros_act, zero_mb, jnp.int32(0), probe))
            if any(probe.found.values()):
                dev = dataclasses.replace(dev, taps=probe, w_tree=jax.tree.structure(jax.eval_shape(probe.zeros, chunk0)))
        dev = dataclasses.replace(dev, traced_stage=_jitted(dev.stage, dev.taps))
        w_shapes = [] if dev.taps is None else jax.tree.leaves(jax.eval_shape(dev.taps.zeros, chunk0))
        leaves_fn = lambda c, o, st, x, mb, v: jax.tree.leaves(dev.residuals(c, o, st, x, mb, v)[1])  # noqa: E731
        metrics_fn = lambda c, o, st, x, mb, v: dev.residuals(c, o, st, x, mb, v)[2]  # noqa: E731
        varying = (zeros_act, zero_mb, jnp.int32(0))
        if r > 1:  # as the replica vmap makes them: a shard_map inside (the experts' dispatch) sees its group's rows
            # (and the ticks' trace context: `traced_stage`'s jaxpr is traced here once, for them too)
            leaves_fn, metrics_fn = (jax.vmap(fn, in_axes=(None, None, None, 0, 0, None), spmd_axis_name=replica_axes)
                                     for fn in (leaves_fn, metrics_fn))
            varying = (*jax.tree.map(lambda a: jnp.zeros((r, *a.shape), a.dtype), varying[:2]), varying[2])
        stashed, shapes = _varying(leaves_fn, (chunk0, dev.other, state0), varying)
        if r > 1:  # a stashed leaf [R, ...] (the carry adds R below); the others are the weights'
            shapes = [jax.ShapeDtypeStruct(a.shape[1:] if keep else a.shape, a.dtype) for a, keep in zip(shapes, stashed)]
        dev = dataclasses.replace(dev, stashed=tuple(stashed))
        metrics0 = jax.tree.map(lambda a: jnp.zeros(a.shape[1:] if r > 1 else a.shape, jnp.float32),
                                jax.eval_shape(metrics_fn, chunk0, dev.other, state0, *varying))
        slots = lambda n, a: jnp.zeros((n + 1, *a.shape), a.dtype)  # noqa: E731
        carry = Carry(stash=[slots(prog.slots, a) for a, keep in zip(shapes, stashed) if keep],
                       w_stash=[slots(prog.wslots, a) for a in w_shapes], g_stash=slots(prog.slots, zeros_act),
                       x_recv=zeros_act, g_send=zeros_act,
                       d_stacked=jax.tree.map(_f32_zeros, dev.stacked), d_other=jax.tree.map(_f32_zeros, dev.other),
                       d_table=jnp.zeros((*dev.groups, *dev.table.shape), jnp.float32),
                       ce=jnp.zeros((), jnp.float32), state=jax.tree.map(jnp.zeros_like, dev.state),
                       head_state=jax.tree.map(jnp.zeros_like, dev.head_state),
                       metrics={**metrics0, **({"mtp_loss": jnp.zeros((), jnp.float32)} if dev.mtp else {})})
        if r > 1:  # one stash and one gradient sum per replica group (carry [R, ...]), see loss_and_grads
            carry = jax.tree.map(lambda a: jnp.zeros((r, *a.shape), a.dtype), carry)
        return dev, carry

    def stage(self, chunk: dict, other: dict, state: dict, x: jax.Array, mb: dict, v: jax.Array,
              taps: Any = None):
        """Virtual stage v's forward of one micro-batch from its input x (`stage_input`): ((y [B, T, D]
        in the compute dtype, aux loss), metrics)."""
        w = self.cast({**other, **chunk})
        # uneven stages: the chunk's real layers after the model's first ones (`Pipeline.stage_rest`)
        real = jnp.asarray(self.pipe.stage_rest(), jnp.int32)[v] if self.pipe.layers else None
        y, aux_loss, metrics = self.fns.layers(w, state, x, mb, real, taps=taps, stage=v)
        return (y.astype(self.act_dtype), jnp.asarray(aux_loss, jnp.float32)), metrics

    def residuals(self, chunk: dict, other: dict, state: dict, x_recv: jax.Array, mb: dict, v: jax.Array):
        """(y, the vjp holding the forward's residuals, metrics) of `stage`. Split backward: the vjp
        also takes the projections' zero taps, whose cotangents are what the weight unit needs."""
        stage = self.traced_stage
        if self.taps is None:
            (y, _), vjp, metrics = jax.vjp(lambda c, o, st, x: stage(c, o, st, x, mb, v, None), chunk, other, state,
                                           x_recv, has_aux=True)
            return y, vjp, metrics
        (y, _), vjp, metrics = jax.vjp(lambda c, o, st, x, t: stage(self.taps.stop(c), o, st, x, mb, v, t),
                                       chunk, other, state, x_recv, self.taps.zeros(chunk), has_aux=True)
        return y, vjp, metrics

    def stage_input(self, x_recv: jax.Array, mb: dict, v: jax.Array) -> jax.Array:
        """Virtual stage v's input: the embedded tokens on v = 0, else the activation received."""
        return jnp.where(v == 0, self.fns.embed(self.table, mb["inputs"]).astype(self.act_dtype), x_recv)

    def embedding_grad(self, d_table: jax.Array, tokens: jax.Array, d_rows: jax.Array) -> jax.Array:
        """`d_table` [Gb, Gs, V, D] plus the scatter-add of the rows' cotangents d_rows [B, T, D] into
        their tokens' rows [B, T]. Each row group (the devices the rows and their tokens are split
        over, `row_groups`: the batch axes and context's) adds its own rows into its own sum, so no
        row leaves its device: one lookup gradient into one table gathers, in every tick, the
        group's rows onto each device (a ZeRO-3 step's embedding cotangents and token ids: [fsdp x
        B, T, D] per backward; under context parallelism every device's tokens). The sums are added
        once, after the last tick."""
        gb, gs = self.groups
        add = lambda acc, tk, d: acc.at[tk].add(d.astype(acc.dtype))  # noqa: E731
        if gb * gs == 1:
            return add(d_table[0, 0], tokens, d_rows)[None, None]

        def groups(a: jax.Array) -> jax.Array:  # [B, T, ...] -> [Gb, Gs, B/Gb, T/Gs, ...], each group a device's
            b, t = a.shape[:2]
            return a.reshape(gb, b // gb, gs, t // gs, *a.shape[2:]).swapaxes(1, 2)
        # the group axes split over the `batch` and `seq` axes (vmaps: the scatter's batch dimensions,
        # which XLA partitions by group), the table's vocabulary over `tensor` as the lookup reads it
        split = ("batch" if gb > 1 else None, "seq" if gs > 1 else None)
        pin = lambda a, *names: rules_lib.constrain(a, (*split, *names))  # noqa: E731
        table = lambda a: pin(a, "act_vocab", "act_embed")  # noqa: E731
        summed = jax.vmap(jax.vmap(add))(table(d_table), pin(groups(tokens), None, None),
                                         pin(groups(d_rows), None, None, None))
        return table(summed)

    def forward(self, c: Carry, f: Cell, mbs: dict) -> tuple[Carry, jax.Array]:
        """This stage's forward `f` on the activation received; its residuals into the stash slot."""
        v = f.chunk * self.pipe.program.stages + self.s
        mb = jax.tree.map(lambda a: a[f.mb], mbs)
        y, vjp, metrics = self.residuals(self.chunk(self.stacked, f.chunk), self.other,
                                         self.chunk(self.state, f.chunk), self.stage_input(c.x_recv, mb, v), mb, v)
        kept = iter([leaf for leaf, keep in zip(jax.tree.leaves(vjp), self.stashed) if keep])
        stash = [buf.at[f.slot].set(next(kept)) for buf in c.stash]
        weight = f.valid.astype(jnp.float32)
        if self.pipe.layers:  # a chunk's metrics are its layers' mean: weighted by its share of the layers
            layers = np.asarray(self.pipe.stage_rest())  # (after the model's first ones, which have none)
            weight = weight * jnp.asarray(layers * len(layers) / layers.sum(), jnp.float32)[v]
        metrics = {**c.metrics, **jax.tree.map(lambda a, x: a + weight * x, {k: c.metrics[k] for k in metrics}, metrics)}
        return c._replace(stash=stash, metrics=metrics), y

    def head_loss(self, other: dict, head_state: dict, y_last: jax.Array,
                  mb: dict) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
        """The loss of the last virtual stage's output (zeros elsewhere), each stage taking every
        P-th token of each context device's run (`_strided`: any sequence length), and, with
        multi-token prediction, its depths on this stage's share of the rows (`_rows`: whole, in-order
        rows): (scaled objective, (cross-entropy of this stage's tokens, multi-token prediction's
        cross-entropy sums and counted tokens per depth of its rows, [Dm] each; zeros without))."""
        p = self.pipe.program.stages
        y_all = jax.lax.psum(y_last, AXIS)
        w = self.cast({**other, **jax.lax.stop_gradient(self.chunk(self.stacked, 0))})
        pick = functools.partial(_strided, p=p, s=self.s, pieces=self.groups[1])
        objective, ce = self.fns.head(w, pick(y_all), pick(mb["targets"]), pick(mb["loss_mask"]),
                                      self.scale / self.tokens)
        if not self.mtp:
            return objective, (ce, jnp.zeros((0,), jnp.float32), jnp.zeros((0,), jnp.float32))
        rows = functools.partial(_rows, p=p, s=self.s, pieces=self.groups[0])
        mtp_objective, aux_loss, ce_sums, counts = self.fns.mtp(w, head_state, rows(y_all), jax.tree.map(rows, mb),
                                                                self.scale / self.tokens)
        # the auxiliary loss is a mean over this stage's rows, 1/P of the micro-batch's
        objective = objective + mtp_objective + aux_loss * self.scale * self.aux_share / p
        return objective, (ce, ce_sums, counts)

    def head(self, c: Carry, h: HeadCell, f: Cell, y: jax.Array, mbs: dict) -> Carry:
        """The loss of this tick's last-virtual-stage output (`h`) and its cotangent, into the slot of
        this stage's forward `f`, which made it on the last stage. With multi-token prediction: its
        state's next value (merged over micro-batches) and the `mtp_loss` metric (the depths' mean
        cross-entropy per counted token of the micro-batch, its rows' sums added over the stages)."""
        prog = self.pipe.program
        mb = jax.tree.map(lambda a: a[h.mb], mbs)
        y_last = jnp.where((self.s == prog.stages - 1) & (f.chunk == prog.virtual - 1), y, jnp.zeros_like(y))
        _, head_vjp, (ce, ce_sums, counts) = jax.vjp(lambda o, hs, yl: self.head_loss(o, hs, yl, mb), self.other,
                                                     self.head_state, y_last, has_aux=True)
        real = h.valid.astype(jnp.float32)
        d_other, d_head_state, dy = head_vjp(real)
        c = c._replace(d_other=jax.tree.map(add_to, c.d_other, d_other), ce=c.ce + real * ce,
                       g_stash=c.g_stash.at[f.slot].set(dy.astype(self.act_dtype)))  # read by the last stage's backward
        if not self.mtp:
            return c
        merged = self.fns.combine_state(c.head_state, d_head_state)
        head_state = jax.tree.map(lambda a, new: jnp.where(h.valid > 0, new, a), c.head_state, merged)
        ce_sums, counts = jax.lax.psum((ce_sums, counts), AXIS)
        mtp_loss = (ce_sums / jnp.maximum(counts, 1.0)).mean()
        # every stage adds it (identical after the psum); `_reduced` divides the P*V*M copies' sum by P*V*M
        metrics = {**c.metrics, "mtp_loss": c.metrics["mtp_loss"] + real * prog.virtual * mtp_loss}
        return c._replace(head_state=head_state, metrics=metrics)

    def backward(self, c: Carry, b: Cell, g_recv: jax.Array, zeros_act: jax.Array, zero_mb: dict,
                 mbs: dict) -> tuple[Carry, jax.Array]:
        """This stage's backward `b` from its stashed residuals and the cotangent received (the loss's on
        the last virtual stage): gradients summed into the chunk's, the input's cotangent returned
        (on virtual stage 0, the embedding's: summed into the table's gradient, zeros sent).
        Split: the tapped projections' weight gradients are left to `weight`, their inputs and
        output cotangents go to its stash slot."""
        prog = self.pipe.program
        valid, i, chunk, slot = b.valid, b.mb, b.chunk, b.slot
        v = chunk * prog.stages + self.s
        chunk_state = self.chunk(self.state, chunk)
        # its structure and weight residuals
        _, vjp, _ = self.residuals(self.chunk(self.stacked, chunk), self.other, chunk_state, zeros_act, zero_mb, v)
        leaves, treedef = jax.tree.flatten(vjp)
        kept = iter([_at(buf, slot) for buf in c.stash])
        vjp = jax.tree.unflatten(treedef, [next(kept) if keep else leaf for leaf, keep in zip(leaves, self.stashed)])
        g = jnp.where(v == prog.stages * prog.virtual - 1, c.g_stash[slot], g_recv) * valid.astype(self.act_dtype)
        d_aux = valid.astype(jnp.float32) * self.scale * self.aux_share
        # A bubble tick's backward runs on an empty slot, whose zero residuals can make inf and
        # NaN (a router's weights divided by their zero sum): it adds nothing, selected away.
        d_chunk, d_other, d_state, dx, *d_taps = jax.tree.map(lambda d: jnp.where(valid > 0, d, jnp.zeros_like(d)),
                                                              vjp((g, d_aux)))
        if d_taps:
            c = c._replace(w_stash=[buf.at[b.wslot].set(d) for buf, d in zip(c.w_stash, jax.tree.leaves(d_taps[0]))])
        d_stacked = jax.tree.map(lambda a, d: a.at[chunk].add(d.astype(a.dtype)), c.d_stacked, d_chunk)
        d_other = jax.tree.map(add_to, c.d_other, d_other)
        merged = self.fns.combine_state(self.chunk(c.state, chunk), d_state)
        state = jax.tree.map(lambda a, new: a.at[chunk].set(jnp.where(valid > 0, new, a[chunk])), c.state, merged)
        first = v == 0
        d_table = self.embedding_grad(c.d_table, mbs["inputs"][i], jnp.where(first, dx, jnp.zeros_like(dx)))
        return (c._replace(d_stacked=d_stacked, d_other=d_other, d_table=d_table, state=state),
                jnp.where(first, jnp.zeros_like(dx), dx))

    def weight(self, c: Carry, w: Cell) -> Carry:
        """This stage's weight unit `w` (split backward): the tapped projections' weight gradients, one
        einsum each, from the inputs and output cotangents its backward stashed."""
        cts = jax.tree.unflatten(self.w_tree, [_at(buf, w.wslot) for buf in c.w_stash])
        d_w = self.taps.weight_grads(lambda p: self.cast({**self.other, **p}), self.chunk(self.stacked, w.chunk), cts)
        d_w = jax.tree.map(lambda d: jnp.where(w.valid > 0, d, jnp.zeros_like(d)), d_w)
        return c._replace(d_stacked={k: jax.tree.map(lambda a, d: a.at[w.chunk].add(d.astype(a.dtype)), a, d_w[k])
                                     if k in d_w else a
                                     for k, a in c.d_stacked.items()})

    def ring(self, x: jax.Array, step: int) -> jax.Array:
        """`x` sent `step` stages along `pipeline` (+1: on, -1: back). With one chunk per device
        (V = 1) the wrap-around pair is left out: stage 0 reads the embedding, not an activation,
        and the last stage the loss's cotangent, so what would arrive there is never read (it
        receives zeros). Interleaved: the last stage's chunk c feeds stage 0's chunk c + 1."""
        prog = self.pipe.program
        p = prog.stages
        pairs = [(i, (i + step) % p) for i in range(p) if prog.virtual > 1 or 0 <= i + step < p]
        return jax.lax.ppermute(x, AXIS, pairs)

    def tick(self, seg: Segment, c: Carry, cells: _TickCells, mbs: dict, zeros_act: jax.Array,
             zero_mb: dict, receive: bool = True) -> tuple[Carry, None]:
        """One tick of segment `seg`, its sends beside work that does not need them (docs/PIPELINE.md,
        "Sends under compute"): the cotangent the previous tick's backward returned (`g_send`) is
        sent first and read only by this tick's backward, so the forward and the loss run beside it;
        the forward's activation is sent as soon as it is made and read in the next tick, so this
        tick's backward and weight unit run beside it. The last backward's cotangent is never sent
        (nothing reads it). `receive` False: the first tick of a segment run on its own
        (`Lockstep.alone`), after a tick without a backward: no cotangent to send."""
        mine = lambda cell: Cell(*(a[self.s] for a in cell))  # noqa: E731
        f, b, w = mine(cells.fwd), mine(cells.bwd), mine(cells.wgt)
        g_recv = (self.ring(c.g_send, -1) if receive else zeros_act) if seg.backward else None
        if seg.forward:
            c, y = self.forward(c, f, mbs)
            c = c._replace(x_recv=self.ring(y, 1))
        if seg.head:
            c = self.head(c, cells.head, f, y, mbs)
        if seg.backward:
            c, dx = self.backward(c, b, g_recv, zeros_act, zero_mb, mbs)
            c = c._replace(g_send=dx.astype(self.act_dtype))
        if seg.weight and self.taps is not None:
            c = self.weight(c, w)
        return c, None

    def run(self, c: Carry, mbs: dict, zeros_act: jax.Array, zero_mb: dict, r: int,
            replica_axes: tuple[str, ...]) -> Carry:
        """Every tick of the program: one `lax.scan` per segment (ticks that run the same kinds of
        work), under a `vmap` over the R replica groups when r > 1 (each its own carry [R, ...]).
        A segment with backwards after one without (the fill's) runs its first tick on its own, before
        its scan (`Lockstep.alone`): that tick has no cotangent to receive, so none is sent."""
        cells = _TickCells.of(self.pipe.program)
        for seg, alone in zip(self.pipe.program.segments, self.pipe.program.alone()):
            def body(c, rw, receive=True, seg=seg):
                tick = functools.partial(self.tick, seg, zeros_act=zeros_act, zero_mb=zero_mb, receive=receive)
                if r > 1:
                    tick = jax.vmap(tick, in_axes=(0, None, 0), spmd_axis_name=replica_axes)
                return tick(c, rw, mbs)
            start = seg.start
            if alone:
                c, _ = body(c, jax.tree.map(lambda a: jnp.asarray(a[start]), cells), receive=False)
                start += 1
            if start < seg.stop:
                c, _ = jax.lax.scan(body, c, jax.tree.map(lambda a: jnp.asarray(a[start:seg.stop]), cells))
        return c
