"""The Llama-family decoder: embedding, a scanned stack of blocks, final norm, logits.

Layers are created with `nnx.vmap` (parameters stacked on a leading `layers` axis) and run with
`jax.lax.scan`, so compile time stays flat as depth grows; activation checkpointing wraps the
scanned body with a `jax.checkpoint_policies` policy chosen by `model.remat`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from lumen_jax.config import REMAT_SAVES, ModelConfig
from lumen_jax.kernels import flash_attention as flash_lib
from lumen_jax.model.layers import MLP, Attention, Block, _param, layer_rope, local_layers, norm
from lumen_jax.model import mtp as mtp_lib
from lumen_jax.model.mla import LatentAttention
from lumen_jax.model.mtp import MTPModule
from lumen_jax.model.moe import MoE
from lumen_jax.ops.choice import Ops
from lumen_jax.ops.loss import output_objective
from lumen_jax.ops.projection import SAVED_WITH_DOTS, Taps, project, remat_policy
from lumen_jax.ops.state import ModelState, combine_rules
from lumen_jax.parallel.rules import constrain

# Every policy but `full` also keeps the flash kernel's output and log-sum-exp (on the device) (a few bytes per token
# and head beside the layer's projections), so no backward runs the attention forward again; `full`
# keeps nothing, by definition. The reference (xla) attention has no such residual: it is unaffected.
# The policies that save the projections' products also keep what their backward reads beside the
# product (`SAVED_WITH_DOTS`: fp8's quantized operands and scales), so no backward quantizes again.
_KEEP_FLASH = jax.checkpoint_policies.save_only_these_names(flash_lib.RESIDUAL_NAME, *SAVED_WITH_DOTS)
_OFFLOAD_DOTS = jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host")
_REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.save_from_both_policies(jax.checkpoint_policies.dots_saveable,
                                                                     _KEEP_FLASH),
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable, _KEEP_FLASH),
    "save_attention_out": jax.checkpoint_policies.save_only_these_names("attention_out", flash_lib.RESIDUAL_NAME),
    "offload_dots": lambda prim, *avals, **params: _KEEP_FLASH(prim, *avals, **params) or _OFFLOAD_DOTS(
        prim, *avals, **params),
    # the selective ones (MaxText's): the named projection outputs (`model.layers`), and, as the dots
    # policies, the flash kernel's and fp8's residuals; everything else is recomputed
    **{name: jax.checkpoint_policies.save_only_these_names(*saved, flash_lib.RESIDUAL_NAME, *SAVED_WITH_DOTS)
       for name, saved in REMAT_SAVES.items()},
}


def embedding_lookup(table_vd: jax.Array, tokens_bt: jax.Array) -> jax.Array:
    """Rows of the table [V, D] at the tokens [B, T]: [B, T, D]. Its gradient with respect to the
    table is the scatter-add of the rows' cotangents into their tokens' rows."""
    return jnp.take(table_vd, tokens_bt, axis=0)


class Transformer(nnx.Module):
    """Decoder-only language model.

    `__call__(tokens_bt, positions_bt, segment_ids_bt)` returns logits [B, T, V] in float32. `ops`
    (default `Ops.plain(cfg)`) says how its ops run (`lumen_jax.ops.choice`).
    """

    def __init__(self, cfg: ModelConfig, ops: Ops | None = None, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.ops = ops = Ops.plain(cfg) if ops is None else ops
        # Untied: N(0, 1), Llama's embedding init (the first norm rescales it). Tied, the table is the
        # output projection too, whose logits would then have std sqrt(d_model) (an initial loss of
        # ~1,300 for llama3_1b, against ln(V) = 11.8): init_std, as Hugging Face initialises it.
        self.embed = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"),
                            cfg.init_std if cfg.tie_embeddings else 1.0)
        num_moe = cfg.num_moe_layers

        attention = LatentAttention if cfg.mla else Attention

        def stack(count: int, mlp: type, module: type = Block, axis: str = "layers") -> Block:
            @nnx.split_rngs(splits=count)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: axis})
            def make_blocks(rngs: nnx.Rngs) -> Block:
                return module(cfg, ops, rngs=rngs, mlp=mlp, attention=attention)
            return make_blocks(rngs)

        if cfg.num_layers > num_moe:  # dense layers (all of them without MoE)
            self.blocks = stack(cfg.num_layers - num_moe, MLP)
        if num_moe:  # layers k+n-1, k+2n-1, ... (n = moe.every_n_layers, k = moe.first_dense_layers)
            self.moe_blocks = stack(num_moe, MoE)
        if cfg.mtp_depth:  # multi-token prediction: its blocks are MoE where the model's last layer is
            # (`depths`, not `layers`: a pipeline runs them with the head, not in stages)
            self.mtp = stack(cfg.mtp_depth, MoE if num_moe else MLP, MTPModule, "depths")
        self.final_norm = norm(cfg, cfg.d_model)
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg.init_std)

    def __call__(self, tokens_bt: jax.Array, positions_bt: jax.Array,
                 segment_ids_bt: jax.Array | None = None) -> jax.Array:
        return self.forward(tokens_bt, positions_bt, segment_ids_bt)[0]

    def forward(self, tokens_bt: jax.Array, positions_bt: jax.Array,
                segment_ids_bt: jax.Array | None = None) -> tuple[jax.Array, dict]:
        """(logits [B, T, V] float32, aux): aux {} for a dense model; with MoE layers {"loss": the
        weighted sum of their auxiliary losses, "metrics": {name: scalar, averaged over layers}}."""
        x_btd, aux = self.run_layers(self.embed_tokens(tokens_bt), positions_bt, segment_ids_bt)
        return self.logits(x_btd), aux

    def forward_objective(self, batch: dict, weight: jax.Array, z_loss: float) -> tuple[jax.Array, jax.Array, dict]:
        """(weight * objective, cross-entropy sum, aux as in `forward`) of a batch's `inputs`,
        `positions`, `segment_ids`, `targets` and `loss_mask` [B, T]: the training objective, with
        no [B, T, V] logits (`objective`)."""
        x_btd, aux = self.run_layers(self.embed_tokens(batch["inputs"]), batch["positions"], batch["segment_ids"])
        objective, ce_sum = self.objective(x_btd, batch["targets"], batch["loss_mask"], weight, z_loss)
        if self.cfg.mtp_depth:
            objective, aux = self.mtp_objective(x_btd, batch, weight, z_loss, objective, aux)
        return objective, ce_sum, aux

    def mtp_objective(self, h_btd: jax.Array, batch: dict, weight: jax.Array, z_loss: float, objective: jax.Array,
                      aux: dict) -> tuple[jax.Array, dict]:
        """The objective plus multi-token prediction's (`model.mtp`: mtp_loss_weight / mtp_depth times the
        depths' weighted objectives), and aux with its blocks' auxiliary losses and the metric `mtp_loss`
        (the depths' mean cross-entropy per counted token). `h_btd`: the last layer's output."""
        cfg = self.cfg
        objective, ce_sums, counts, extra = self.mtp_terms(h_btd, batch, weight, z_loss, objective)
        ce_mean = jnp.zeros((), jnp.float32)
        for ce_k, count_k in zip(ce_sums, counts):
            ce_mean = ce_mean + ce_k / jnp.maximum(count_k, 1).astype(jnp.float32) / cfg.mtp_depth
        out = {**aux, "metrics": {**dict(aux.get("metrics", {})), "mtp_loss": ce_mean}}
        if "loss" in aux or cfg.moe.enabled:
            out["loss"] = aux.get("loss", jnp.zeros((), jnp.float32)) + extra
        return objective, out

    def mtp_terms(self, h_btd: jax.Array, batch: dict, weight: jax.Array, z_loss: float,
                  objective: jax.Array) -> tuple[jax.Array, list, list, jax.Array]:
        """Multi-token prediction's depths on rows `h_btd` [B, T, D] (the last layer's output) of `batch`:
        (`objective` plus mtp_loss_weight / mtp_depth times each depth's weighted objective, each depth's
        cross-entropy sum, each depth's counted tokens, the blocks' auxiliary losses summed). Whole,
        in-order rows: a pipeline runs it on a share of the rows (`mtp_objective` on all of them)."""
        cfg = self.cfg
        graphdef, state = nnx.split(self.mtp)
        w_dv = (self.embed[...].T if cfg.tie_embeddings else self.lm_head[...]).astype(jnp.dtype(cfg.compute_dtype))
        table, share = self.embed_table(), cfg.mtp_loss_weight / cfg.mtp_depth
        extra, ce_sums, counts = jnp.zeros((), jnp.float32), [], []
        for k in range(1, cfg.mtp_depth + 1):
            module = nnx.merge(graphdef, jax.tree.map(lambda v: v[k - 1], state))  # noqa: B023
            inputs_k, targets_k, mask_k = mtp_lib.shifted(batch, k, self.ops)
            e_btd = constrain(embedding_lookup(table, inputs_k), ("batch", "act_seq", "act_embed"))
            h_btd, block_aux = module(h_btd, e_btd, batch["positions"], batch["segment_ids"], layer_rope(cfg, None),
                                      self.ops)
            x_btd = constrain(module.norm(h_btd), ("batch", "seq", "act_embed"))
            obj_k, ce_k = output_objective(x_btd, w_dv, targets_k, mask_k, weight, z_loss, cfg.loss_chunk_tokens)
            objective = objective + share * obj_k
            ce_sums.append(ce_k)
            counts.append(mask_k.sum())
            if "loss" in block_aux:
                extra = extra + block_aux["loss"]
        return objective, ce_sums, counts, extra

    # The three parts of `forward`, also run one by one when the stack is cut into pipeline stages
    # (the first embeds, each runs its slice of the stacked blocks, the last makes the logits).

    def embed_tokens(self, tokens_bt: jax.Array) -> jax.Array:
        """Token embeddings [B, T, D] in the compute dtype."""
        return constrain(embedding_lookup(self.embed_table(), tokens_bt), ("batch", "act_seq", "act_embed"))

    def embed_table(self) -> jax.Array:
        """The embedding table [V, D] as the lookup reads it: in the compute dtype, its `embed` shards
        gathered (the FSDP all-gather: a lookup from a table sharded along `embed` into a
        batch-sharded output has no efficient partitioning), the vocabulary split over `tensor`; times
        sqrt(d_model) in the compute dtype under `model.embed_scale=sqrt_d_model` (Gemma: the rows it
        looks up are scaled, as transformers scales them, and the tied head is not)."""
        dt = jnp.dtype(self.cfg.compute_dtype)
        table = self.embed[...].astype(dt)
        if self.cfg.embed_scale == "sqrt_d_model":  # rounded to float32, then to the compute dtype, as transformers
            table = table * jnp.float32(self.cfg.d_model ** 0.5).astype(dt)
        return constrain(table, ("act_vocab", "act_embed"))

    def run_layers(self, x_btd: jax.Array, positions_bt: jax.Array,
                   segment_ids_bt: jax.Array | None = None,
                   real_layers: jax.Array | None = None, taps: Taps | None = None,
                   runs: list[tuple[int, int, Ops]] | None = None,
                   first_layer: jax.Array | int = 0) -> tuple[jax.Array, dict]:
        """The stacked blocks this module holds (all `num_layers`, or one pipeline stage's slice of
        them): (residual stream, aux as in `forward`).

        `real_layers`: how many of the held layers after the first dense ones are real (uneven pipeline
        stages pad a stage's stack with zero layers after its own, `parallel/pipeline/layout.Pipeline.pad`);
        None: all.
        A zero layer is the identity, but a zero MoE router still routes, so the MoE groups past the
        real ones add no auxiliary loss and no metrics.
        `taps`: the projections' taps of a split backward (`ops.projection.Taps`: per stack [L, ...],
        scanned with the layers), or a probe; None: none.
        `runs`: the held layers as runs [start, stop) with their `Ops` (a pipeline stage's slots,
        `Ops.stage_runs`); None: `Ops.layer_runs` of the model's layers.
        `first_layer`: the model's index of the first held layer (traced: a pipeline stage's), which
        says which layers are local and which global (`model.global_every`)."""
        cfg = self.cfg

        def make_body(graphdef: nnx.GraphDef, ops: Ops, stack: str):
            def body(x_btd: jax.Array, xs: tuple) -> tuple[jax.Array, dict]:
                state, layer_taps, local = xs if len(xs) == 3 else (*xs, None)
                tape = None if taps is None else taps.layer(stack, layer_taps)
                return nnx.merge(graphdef, state)(x_btd, positions_bt, segment_ids_bt, layer_rope(cfg, local), ops,
                                                  tape, local)

            if cfg.remat != "none":
                return jax.checkpoint(body, policy=remat_policy(_REMAT_POLICIES[cfg.remat]), prevent_cse=False)
            return body

        stack_taps = lambda stack: None if taps is None or taps.arrays is None else taps.arrays.get(stack)  # noqa: E731
        if cfg.moe.enabled:
            return self._moe_stack(x_btd, make_body, real_layers, stack_taps)
        graphdef, layer_state = nnx.split(self.blocks)
        xs = (layer_state, stack_taps("blocks"),
              local_layers(cfg, first_layer, jax.tree.leaves(layer_state)[0].shape[0]))
        runs = self.ops.layer_runs(cfg.num_layers) if runs is None else runs

        def scan(ops: Ops, x_btd: jax.Array, run_xs: tuple) -> jax.Array:
            return jax.lax.scan(make_body(graphdef, ops, "blocks"), x_btd, run_xs)[0]

        # ops that differ by layer (e.g. the first/last layers kept in bf16): one scan per run, each
        # as its ops say for the run's model state (`Ops.by_state`)
        for start, stop, ops in runs:
            run_xs = xs if len(runs) == 1 else jax.tree.map(lambda v: v[start:stop], xs)
            x_btd = ops.by_state(scan, run_xs[0], x_btd, run_xs)
        return x_btd, {}

    def logits(self, x_btd: jax.Array) -> jax.Array:
        """Final norm and the output projection: logits [B, T, V] float32 (generation, evaluation
        against other implementations; training uses `objective`)."""
        x_btd, w_dv = self._head(x_btd)
        logits = project("btd,dv->btv", x_btd, w_dv, self.ops, out_dtype=jnp.float32)
        return constrain(logits, ("batch", "seq", "act_vocab"))

    def objective(self, x_btd: jax.Array, targets_bt: jax.Array, loss_mask_bt: jax.Array, weight: jax.Array,
                  z_loss: float) -> tuple[jax.Array, jax.Array]:
        """Final norm, the output projection and the token objective of the last layer's output
        [B, T, D]: (weight * objective sum, cross-entropy sum), in chunks of the sequence and never
        as [B, T, V] float32 logits (`ops.loss.output_objective`, `model.loss_chunk_tokens`)."""
        x_btd, w_dv = self._head(x_btd)
        return output_objective(x_btd, w_dv, targets_bt, loss_mask_bt, weight, z_loss, self.cfg.loss_chunk_tokens)

    def _head(self, x_btd: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The output layer's operands in the compute dtype: the final norm's output [B, T, D] and the
        projection [D, V] (the embedding table's transpose when tied)."""
        dt = jnp.dtype(self.cfg.compute_dtype)
        x_btd = constrain(self.final_norm(x_btd), ("batch", "seq", "act_embed"))  # SP: gather, as in Block
        w_dv = self.embed[...].T if self.cfg.tie_embeddings else self.lm_head[...]
        return x_btd, w_dv.astype(dt)

    def _moe_stack(self, x_btd: jax.Array, make_body, real_layers: jax.Array | None,
                   stack_taps: Callable[[str], dict | None]) -> tuple[jax.Array, dict]:
        """The layers as the first `moe.first_dense_layers` dense ones (a scan; `blocks`' first
        entries), then one scan over groups of `moe.every_n_layers`: n-1 dense layers (a scan of their
        own), then an MoE layer. Returns the residual stream and the aux terms (see `forward`;
        `real_layers`, the stacks' taps: see `run_layers`)."""
        n = self.cfg.moe.every_n_layers
        moe_graph, moe_state = nnx.split(self.moe_blocks)
        # The first dense layers held: `moe.first_dense_layers`, or a pipeline stage's slots of them (its
        # `blocks` hold them before its groups' n-1 dense layers each; zeros where they are not its own).
        groups = jax.tree.leaves(moe_state)[0].shape[0]
        first = jax.tree.leaves(nnx.state(self.blocks))[0].shape[0] - (n - 1) * groups if hasattr(self, "blocks") else 0
        moe_body = make_body(moe_graph, self.ops, "moe_blocks")
        dense = None
        if n > 1 or first:
            dense_graph, dense_state = nnx.split(self.blocks)
            dense_body = make_body(dense_graph, self.ops, "blocks")
            dense_xs = (dense_state, stack_taps("blocks"))
            if first:
                x_btd, _ = jax.lax.scan(dense_body, x_btd, jax.tree.map(lambda v: v[:first], dense_xs))
                dense_xs = jax.tree.map(lambda v: v[first:], dense_xs)
            if n > 1:
                dense = jax.tree.map(lambda v: v.reshape(-1, n - 1, *v.shape[1:]), dense_xs)

        def group(x_btd: jax.Array, xs: tuple) -> tuple[jax.Array, dict]:
            dense_g, moe_g = xs
            if dense_g is not None:
                x_btd, _ = jax.lax.scan(dense_body, x_btd, dense_g)
            return moe_body(x_btd, moe_g)

        x_btd, per_layer = jax.lax.scan(group, x_btd, (dense, (moe_state, stack_taps("moe_blocks"))))
        if real_layers is None:
            loss = per_layer.pop("loss").sum()
            return x_btd, {"loss": loss, "metrics": {k: v.mean() for k, v in per_layer.items()}}
        real = jnp.arange(per_layer["loss"].shape[0]) < real_layers // n  # the groups that are not padding
        loss = jnp.where(real, per_layer.pop("loss"), 0.0).sum()
        count = jnp.maximum(real.sum(), 1).astype(jnp.float32)
        return x_btd, {"loss": loss, "metrics": {k: jnp.where(real, v, 0.0).sum() / count for k, v in per_layer.items()}}


@dataclasses.dataclass(frozen=True)
class AbstractModel:
    """The model traced without allocating: its graph and, split by NNX type, the shapes and logical
    axis names of its parameters (`nnx.Param`) and of its other state (`ops.state.ModelState`)."""

    graphdef: nnx.GraphDef
    params: dict  # {path: ShapeDtypeStruct}
    param_names: dict  # {path: logical axis names}
    state: dict  # non-parameter model state, {} when the ops keep none
    state_names: dict
    state_combine: dict  # {path: how micro-batches combine the state's next values}


def abstract_model(cfg: ModelConfig, ops: Ops | None = None) -> AbstractModel:
    """Trace `Transformer(cfg, ops)` without allocating (see `AbstractModel`)."""
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: Transformer(cfg, ops, rngs=nnx.Rngs(0)))
    graphdef, params, state = nnx.split(abstract, nnx.Param, ModelState)
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    shapes = lambda s: nnx.to_pure_dict(jax.tree.map(  # noqa: E731
        lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), s, is_leaf=is_var))
    names = lambda s: nnx.to_pure_dict(jax.tree.map(  # noqa: E731
        lambda v: tuple(v.get_metadata()["out_sharding"]), s, is_leaf=is_var))
    return AbstractModel(graphdef=graphdef, params=shapes(params), param_names=names(params),
                         state=shapes(state), state_names=names(state), state_combine=combine_rules(state))


def param_shapes_and_names(cfg: ModelConfig, ops: Ops | None = None) -> tuple[nnx.GraphDef, dict, dict]:
    """(graphdef, {path: ShapeDtypeStruct}, {path: logical names}) of the parameters."""
    a = abstract_model(cfg, ops)
    return a.graphdef, a.params, a.param_names


def init(cfg: ModelConfig, seed: int, ops: Ops | None = None) -> tuple[dict, dict]:
    """Fresh (float32 parameters, model state) as plain nested dicts (jit this with `out_shardings`)."""
    with nnx.use_eager_sharding(False):
        model = Transformer(cfg, ops, rngs=nnx.Rngs(params=seed))
    _, params, state = nnx.split(model, nnx.Param, ModelState)
    return nnx.to_pure_dict(params), nnx.to_pure_dict(state)


def init_params(cfg: ModelConfig, seed: int, ops: Ops | None = None) -> dict:
    """Fresh float32 parameters as a plain nested dict (`init` without the model state)."""
    return init(cfg, seed, ops)[0]


def merge(graphdef: nnx.GraphDef, params: dict, state: dict | None = None) -> Transformer:
    """The model with parameters `params` (plain dicts; the blocks may be a slice of the stack, as
    a stage of a cut stack holds), to call its parts (`embed_tokens`, `run_layers`, `logits`)."""
    return nnx.merge(graphdef, params, state or {})


def apply(graphdef: nnx.GraphDef, params: dict, tokens_bt: jax.Array, positions_bt: jax.Array,
          segment_ids_bt: jax.Array | None = None, state: dict | None = None) -> jax.Array:
    """Logits [B, T, V] float32 of the model `graphdef` with parameters `params` and model state
    `state` (plain dicts; `state` None: the model keeps none)."""
    return merge(graphdef, params, state)(tokens_bt, positions_bt, segment_ids_bt)


def apply_objective(graphdef: nnx.GraphDef, params: dict, batch: dict, weight: jax.Array, z_loss: float,
                    state: dict | None = None) -> tuple[jax.Array, jax.Array, dict]:
    """The training objective of a batch (`Transformer.forward_objective`): (weight * objective
    sum, cross-entropy sum, the model's auxiliary terms: {} or {"loss": scalar to add to the
    objective, "metrics": {name: scalar}})."""
    return merge(graphdef, params, state).forward_objective(batch, weight, z_loss)
