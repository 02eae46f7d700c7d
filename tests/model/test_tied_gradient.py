"""The tied output projection's gradient against a hand reference: a tied model is the untied one
whose output projection is the embedding table transposed, so its table's gradient is the untied
embedding's gradient plus the output projection's gradient transposed (both uses of the table add)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from helpers.tolerances import FP32_RTOL, assert_tree_close
from lumen_jax.config import ModelConfig
from lumen_jax.model import apply_objective, init_params, param_shapes_and_names

UNTIED = ModelConfig(d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=64, vocab_size=64,
                     compute_dtype="float32", loss_chunk_tokens=4)  # the training objective, in 4 chunks
TIED = dataclasses.replace(UNTIED, tie_embeddings=True)


def _loss_and_grads(cfg: ModelConfig, params: dict, tokens_bt: jax.Array, targets_bt: jax.Array) -> tuple:
    graphdef = param_shapes_and_names(cfg)[0]
    positions_bt = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)

    batch = {"inputs": tokens_bt, "positions": positions_bt, "segment_ids": None, "targets": targets_bt,
             "loss_mask": jnp.ones_like(targets_bt)}

    def loss(p: dict) -> jax.Array:
        return apply_objective(graphdef, p, batch, 1.0 / targets_bt.size, 0.0)[0]
    return jax.value_and_grad(loss)(params)


def test_tied_table_gradient_is_embedding_plus_output_projection_transposed():
    tied = init_params(TIED, seed=0)
    assert "lm_head" not in tied
    untied = {**tied, "lm_head": tied["embed"].T}  # the same function of the tokens, two tables
    key_tokens, key_targets = jax.random.split(jax.random.key(1))
    tokens_bt = jax.random.randint(key_tokens, (2, 16), 0, UNTIED.vocab_size)
    targets_bt = jax.random.randint(key_targets, (2, 16), 0, UNTIED.vocab_size)

    loss_tied, g_tied = _loss_and_grads(TIED, tied, tokens_bt, targets_bt)
    loss_untied, g_untied = _loss_and_grads(UNTIED, untied, tokens_bt, targets_bt)
    np.testing.assert_allclose(loss_tied, loss_untied, rtol=FP32_RTOL)
    # The output projection's share is not small beside the lookup's: a tied gradient that dropped it
    # (a stop_gradient on the table in the logits) would differ by far more than the tolerance.
    expected_vd = g_untied["embed"] + g_untied["lm_head"].T
    head_share = np.abs(np.asarray(g_untied["lm_head"])).max()
    assert head_share > 10 * FP32_RTOL * np.abs(np.asarray(expected_vd)).max(), head_share
    assert_tree_close(g_tied["embed"], expected_vd, FP32_RTOL, "embed")
    rest = lambda g: {k: v for k, v in g.items() if k not in ("embed", "lm_head")}  # noqa: E731
    assert_tree_close(rest(g_tied), rest(g_untied), FP32_RTOL, "blocks")
