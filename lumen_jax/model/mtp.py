"""Multi-token prediction (DeepSeek-V3, section 2.2; `model.mtp_depth` D > 0): D sequential modules after
the main model, each predicting one token further.

Module k (1..D) at position i takes the previous depth's hidden state h^{k-1}_i (h^0: the main model's
last layer, before its final norm) and the embedding of token t_{i+k} (shared embedding table):

    h'^k_i = M_k [RMSNorm(h^{k-1}_i); RMSNorm(Emb(t_{i+k}))]      M_k: [2D, D] (`eh_proj`)
    h^k    = TRM_k(h'^k)                                           one transformer block (MoE where the model's are)
    P^k_{i+k+1} = OutHead(RMSNorm(h^k_i))                          the model's output projection, shared

and its cross-entropy against t_{i+k+1}; the objective adds `model.mtp_loss_weight` / D times the sum over
depths (lambda averaged over the depths), each depth's tokens weighed as the main objective's. Position i
counts at depth k when t_{i+k+1} is a real target of the same document as position i (packed documents:
the segment ids at i and i+k agree) and lies within the row. Training only: `forward` (generation,
evaluation) runs the main model alone. Under context parallelism the shifts cross devices
(`ops.sequence`) and the module's attention is the main layers' (context-parallel) attention; a
pipeline runs the modules with its head, each stage on a share of the rows (`Transformer.mtp_terms`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from lumen_jax.config import ModelConfig
from lumen_jax.model.layers import Block, _param, norm
from lumen_jax.ops import sequence
from lumen_jax.ops.choice import Ops
from lumen_jax.parallel.rules import constrain


class MTPModule(nnx.Module):
    """One depth: `hnorm`, `enorm`, `eh_proj` [2D, D], a `block`, its output norm `norm`."""

    def __init__(self, cfg: ModelConfig, ops: Ops, *, rngs: nnx.Rngs, mlp: type, attention: type):
        d = cfg.d_model
        self.hnorm = norm(cfg, d)
        self.enorm = norm(cfg, d)
        self.eh_proj = _param(rngs, (2 * d, d), (None, "embed"), cfg.init_std)
        self.block = Block(cfg, ops, rngs=rngs, mlp=mlp, attention=attention)
        self.norm = norm(cfg, d)

    def __call__(self, h_btd: jax.Array, e_btd: jax.Array, positions_bt: jax.Array, segment_ids_bt: jax.Array | None,
                 inv_freq: jax.Array, ops: Ops) -> tuple[jax.Array, dict]:
        """(h^k [B, T, D], the block's aux terms) from h^{k-1} and the embeddings of the tokens k ahead."""
        cat = jnp.concatenate([self.hnorm(h_btd), self.enorm(e_btd)], axis=-1)
        x = jnp.einsum("btc,cd->btd", cat, self.eh_proj[...].astype(cat.dtype))
        return self.block(constrain(x, ("batch", "act_seq", "act_embed")), positions_bt, segment_ids_bt, inv_freq, ops)


def shifted(batch: dict, k: int, ops: Ops) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Depth k's (input tokens t_{i+k}, targets t_{i+k+1}, mask) [B, T] from a batch's `targets` (t_{i+1}),
    `loss_mask` and `segment_ids`: shifted left by k-1 and k in the original token order (`ops.sequence`:
    across context devices and zigzag's order too), the last positions masked (their tokens wrap
    around), and so is a position whose target lies in another document."""
    targets, mask, seg = batch["targets"], batch["loss_mask"], batch["segment_ids"]
    inputs_k = targets if k == 1 else sequence.shift_left(targets, k - 1, ops)[0]
    targets_k, in_row = sequence.shift_left(targets, k, ops)
    keep = jnp.asarray(in_row) & (sequence.shift_left(mask, k, ops)[0] > 0)
    if seg is not None:
        keep = keep & (sequence.shift_left(seg, k, ops)[0] == seg)
    return inputs_k, targets_k, keep.astype(mask.dtype)
