"""The Llama-family decoder: embedding, a scanned stack of blocks, final norm, logits.

Layers are created with `nnx.vmap` (parameters stacked on a leading `layers` axis) and run with
`jax.lax.scan`, so compile time stays flat as depth grows; activation checkpointing wraps the
scanned body with a `jax.checkpoint_policies` policy chosen by `model.remat`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from lumen_jax.config import ModelConfig
from lumen_jax.model.layers import Block, RMSNorm, _param, rope_frequencies
from lumen_jax.ops import fp8 as fp8_ops
from lumen_jax.ops.projection import project, remat_policy
from lumen_jax.parallel.rules import constrain

_REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_attention_out": jax.checkpoint_policies.save_only_these_names("attention_out"),
    "offload_dots": jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
}


class Transformer(nnx.Module):
    """Decoder-only language model.

    `__call__(tokens_bt, positions_bt, segment_ids_bt)` returns logits [B, T, V] in float32.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), 1.0)

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(rngs: nnx.Rngs) -> Block:
            return Block(cfg, rngs=rngs)

        self.blocks = make_blocks(rngs)
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg.init_std)

    def __call__(self, tokens_bt: jax.Array, positions_bt: jax.Array,
                 segment_ids_bt: jax.Array | None = None) -> jax.Array:
        cfg = self.cfg
        dt = jnp.dtype(cfg.compute_dtype)
        # Gather the table's `embed` shards first (the FSDP all-gather): a lookup from a table
        # sharded along `embed` into a batch-sharded output has no efficient partitioning.
        table_vd = constrain(self.embed[...].astype(dt), ("act_vocab", "act_embed"))
        x_btd = constrain(jnp.take(table_vd, tokens_bt, axis=0), ("batch", "act_seq", "act_embed"))
        inv_freq = rope_frequencies(cfg)
        graphdef, layer_state = nnx.split(self.blocks)

        def make_body(fp8_on: bool | None):
            # One function per setting: scan caches a traced body by function, and the fp8 setting
            # (`layers_enabled`) is read while tracing.
            def body(x_btd: jax.Array, state: nnx.State) -> tuple[jax.Array, None]:
                with fp8_ops.layers_enabled(fp8_on):
                    return nnx.merge(graphdef, state)(x_btd, positions_bt, segment_ids_bt, inv_freq), None

            if cfg.remat != "none":
                return jax.checkpoint(body, policy=remat_policy(_REMAT_POLICIES[cfg.remat]), prevent_cse=False)
            return body

        runs = fp8_ops.layer_runs(cfg.fp8, cfg.num_layers)
        if len(runs) == 1:
            x_btd, _ = jax.lax.scan(make_body(None), x_btd, layer_state)
        else:  # fp8 in some layers only (first/last kept in bf16): one scan per run of equal setting
            for start, stop, on in runs:
                x_btd, _ = jax.lax.scan(make_body(on), x_btd, jax.tree.map(lambda v: v[start:stop], layer_state))
        x_btd = constrain(self.final_norm(x_btd), ("batch", "seq", "act_embed"))  # SP: gather, as in Block
        w_dv = self.embed[...].T if cfg.tie_embeddings else self.lm_head[...]
        logits = project("btd,dv->btv", x_btd, w_dv.astype(dt), jnp.float32)
        return constrain(logits, ("batch", "seq", "act_vocab"))


def param_shapes_and_names(cfg: ModelConfig) -> tuple[nnx.GraphDef, dict, dict]:
    """Trace the model without allocating: (graphdef, {path: ShapeDtypeStruct}, {path: logical names})."""
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    shapes = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), state, is_leaf=is_var)
    names = jax.tree.map(lambda v: tuple(v.get_metadata()["out_sharding"]), state, is_leaf=is_var)
    return graphdef, shapes.to_pure_dict(), names.to_pure_dict()


def init_params(cfg: ModelConfig, seed: int) -> dict:
    """Fresh float32 parameters as a plain nested dict (jit this with `out_shardings`)."""
    with nnx.use_eager_sharding(False):
        model = Transformer(cfg, rngs=nnx.Rngs(params=seed))
    return nnx.state(model).to_pure_dict()


def apply(graphdef: nnx.GraphDef, params: dict, tokens_bt: jax.Array, positions_bt: jax.Array,
          segment_ids_bt: jax.Array | None = None) -> jax.Array:
    """Logits [B, T, V] float32 of the model `graphdef` with parameters `params` (a plain dict)."""
    return nnx.merge(graphdef, params)(tokens_bt, positions_bt, segment_ids_bt)
