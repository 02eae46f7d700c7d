"""FLOP counts of the decoder: parameters, model FLOPs (the MFU numerator), hardware FLOPs (HFU).

Pure arithmetic on `ModelConfig`, no JAX: the trainer's metrics (`lumen_jax.metrics.mfu`) and the
planner (`lumen_jax.plan`) both count with these functions. The formulas and the remat
approximations are written out with a worked example in docs/FLOPS.md. Shape letters: V vocab,
D d_model, L layers, N heads, K kv heads, H head_dim, F ffn_dim, S sequence length, C context size.
"""

from __future__ import annotations

from typing import Mapping

from lumen_jax.config import PROJECTION_NAMES, REMAT_POLICIES, REMAT_SAVES, ModelConfig


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """Counts the decoder's parameters.

    Args:
        cfg: the model shape.

    Returns:
        `total` (every parameter, the tied logits matrix once), `embedding` (V*D), `layer_matmul`
        (the linear weights one token multiplies through in one layer, averaged over the layers),
        `matmul` (weights a token multiplies through: all layers' linear weights plus the D*V logits
        matrix, counted even when tied to the embedding). With `model.moe` a token goes through its
        top_k routed experts, the shared experts and the router only: `matmul` counts those
        (active parameters), `total` every expert; `experts` is all routed experts' weights.
    """
    d, h, v = cfg.d_model, cfg.resolved_head_dim, cfg.vocab_size
    attn = d * cfg.num_heads * h * 2 + d * cfg.num_kv_heads * h * 2  # wq, wo; wk, wv
    latent_norms = 0
    if cfg.mla:  # wq (or wq_a, wq_b), wkv_a, wk_rope, wk_b, wv_b, wo; the latents' norms
        n, r, rq = cfg.num_heads, cfg.kv_lora_rank, cfg.q_lora_rank
        attn = ((d * rq + rq * n * h) if rq else d * n * h) + d * (r + cfg.qk_rope_head_dim) + r * n * (
            cfg.qk_nope_head_dim + cfg.v_head_dim) + n * cfg.v_head_dim * d
        latent_norms = r + rq
    mlp = 3 * d * cfg.ffn_dim  # w_gate, w_up, w_down
    # attn_norm, mlp_norm (and their post-norms, Gemma); q/k/v biases (Qwen2), per-head q/k norms (Qwen3, Gemma)
    small = (2 * d * (1 + (cfg.block_norms == "sandwich")) + (cfg.num_heads + 2 * cfg.num_kv_heads) * h * cfg.qkv_bias
             + 2 * h * cfg.qk_norm + latent_norms)
    layer = attn + mlp + small
    embedding = v * d
    lm_head = 0 if cfg.tie_embeddings else d * v
    moe = cfg.moe
    n_moe = cfg.num_moe_layers
    expert = 3 * d * cfg.expert_ffn_dim
    router = d * moe.num_experts + d * moe.shared_gate  # + the shared experts' gate vector
    moe_active = (moe.top_k + moe.shared_experts) * expert + router
    moe_all = (moe.num_experts + moe.shared_experts) * expert + router
    layers_matmul = (cfg.num_layers - n_moe) * (attn + mlp) + n_moe * (attn + moe_active)
    # Multi-token prediction: per depth hnorm, enorm, eh_proj [2D, D], a layer (MoE where the model has
    # MoE layers), its output norm; a token goes through it and the shared output projection again.
    mtp_layer = (attn + moe_all + small) if n_moe else layer
    mtp_total = cfg.mtp_depth * (2 * d * d + 3 * d + mtp_layer)
    mtp_matmul = cfg.mtp_depth * (2 * d * d + attn + (moe_active if n_moe else mlp) + d * v)
    return {
        "total": (embedding + (cfg.num_layers - n_moe) * layer + n_moe * (attn + moe_all + small)
                  + d + lm_head + mtp_total),  # + final_norm
        "embedding": embedding,
        "layer_matmul": attn + mlp if not n_moe else layers_matmul / cfg.num_layers,
        "matmul": layers_matmul + d * v + mtp_matmul,
        "experts": (n_moe + (cfg.mtp_depth if n_moe else 0)) * moe.num_experts * expert,
    }


def attention_forward_flops_per_token(cfg: ModelConfig, seq_len: int, *,
                                      causal: bool = True) -> float:
    """Forward FLOPs per token of QK^T and AV over all layers: 2 * 2*S*N*H * L, halved if causal (MLA:
    2*S*N*(H + Hv) * L, its values Hv wide; the kernels' zero-padded values are not model FLOPs).
    Under a sliding window W < S (`cfg.sliding_window`, causal) a query sees W keys once it is W
    deep: W - W^2 / 2S keys per query on average instead of S / 2 (equal at W = S); with
    `cfg.global_every` n, one layer in n (the global ones) sees S / 2."""
    # QK^T, AV of every layer and of the multi-token-prediction modules' blocks
    per_key = 2 * cfg.num_heads * (cfg.resolved_head_dim + cfg.value_head_dim) * (cfg.num_layers + cfg.mtp_depth)
    w = cfg.sliding_window
    if causal and 0 < w < seq_len and cfg.global_every:
        global_share = (cfg.num_layers // cfg.global_every) / cfg.num_layers
        return per_key * ((1 - global_share) * (w - w * w / (2 * seq_len)) + global_share * seq_len / 2)
    if causal and 0 < w < seq_len:
        return per_key * (w - w * w / (2 * seq_len))
    return per_key * seq_len / 2 if causal else float(per_key * seq_len)


def flops_per_token(cfg: ModelConfig, seq_len: int, *, causal: bool = True) -> float:
    """Model FLOPs per trained token (forward + backward), the MFU numerator.

    `6 * matmul_params + 3 * attention_forward` (PaLM appendix B, with the causal half). The
    embedding lookup, norms, softmax and other elementwise work are not counted.

    Args:
        cfg: the model shape.
        seq_len: tokens per sequence S (attention spans the whole sequence).
        causal: count half of the S x S score matrix (the masked half is not useful work).
    """
    return 6.0 * param_counts(cfg)["matmul"] + 3 * attention_forward_flops_per_token(
        cfg, seq_len, causal=causal)


# What the backward pass runs again under each remat policy, assumed from what the policy saves
# (docs/FLOPS.md): `projections` (the layers' linear maps re-run, by their `config.PROJECTION_NAMES`:
# all of them, none, or a selective policy's), `attention` (QK^T and AV). The planner reads the same
# facts off the model's residuals instead (`plan.residuals.recomputes`), the selective policies'
# projections from this table.
# A selective policy (`config.REMAT_SAVES`) re-runs the projections the backward reads and it does not
# save: every one but down's (mlpwo), whose output no gradient reads (its own backward reads its input,
# SwiGLU(gate, up)). With the reference attention it re-runs QK^T and AV too (unnamed: not saved); the
# flash kernel's residuals it keeps. (`full` and `save_attention_out` are counted with down's forward,
# which XLA drops: a mild upper bound, docs/FLOPS.md.)
_READ_BY_BACKWARD = tuple(n for n in PROJECTION_NAMES if n != "mlpwo")
RECOMPUTES: dict[str, dict[str, tuple[str, ...] | bool]] = {
    "none": {"projections": (), "attention": False},
    "dots_saveable": {"projections": (), "attention": False},  # every dot output is saved
    "offload_dots": {"projections": (), "attention": False},  # ... or offloaded
    "dots_with_no_batch_dims_saveable": {"projections": (), "attention": True},  # QK^T, AV have batch dims
    "save_attention_out": {"projections": PROJECTION_NAMES, "attention": False},
    "full": {"projections": PROJECTION_NAMES, "attention": True},
    **{name: {"projections": tuple(n for n in _READ_BY_BACKWARD if n not in saved), "attention": True}
       for name, saved in REMAT_SAVES.items()},
}


def projection_params(cfg: ModelConfig, names: tuple[str, ...]) -> float:
    """The matmul weights per token of one layer's projections `names` (`config.PROJECTION_NAMES`;
    all of them: the layer's `layer_matmul`, MoE and latent attention included; none: 0).
    A subset is counted for a dense layer with grouped-query attention (the selective policies'
    models: `config.checks` refuses them with MoE or latent attention)."""
    if not names:
        return 0.0
    if set(names) == set(PROJECTION_NAMES):
        return float(param_counts(cfg)["layer_matmul"])
    if cfg.mla or cfg.moe.enabled:
        raise ValueError(f"projections {names} of a layer with latent attention or MoE are not counted "
                         "one by one; the selective remat policies refuse those models")
    d, h, f = cfg.d_model, cfg.resolved_head_dim, cfg.ffn_dim
    q, kv = d * cfg.num_heads * h, d * cfg.num_kv_heads * h
    each = {"query_proj": q, "key_proj": kv, "value_proj": kv, "out_proj": q, "mlpwi_0": d * f, "mlpwi_1": d * f,
            "mlpwo": d * f}
    return float(sum(each[n] for n in names))


def hardware_flops_per_token(cfg: ModelConfig, seq_len: int, remat: str | None = None, *,
                             score_fraction: float = 0.5, context: int = 1,
                             recomputes: Mapping[str, tuple[str, ...] | bool] | None = None) -> float:
    """Model FLOPs plus the forward work the backward pass re-runs (the HFU numerator).

    `6 * matmul_params + (1 + backward) * attention + the recomputed forward work`, where
    `attention` is the attention forward over `score_fraction` of the S x S square and `backward`
    is 2 forwards (dV, dP, dQ, dK), or 2.5 under context parallelism (`context` > 1: the chunk
    kernel's backward recomputes QK^T from the saved log-sum-exp, whatever the policy). The
    recompute is 2 * L * the re-run projections' weights (`projection_params`: layer_matmul when
    all are re-run) and the attention forward when QK^T and AV are; the logits matmul lies outside
    the checkpointed layers.

    Pipeline stages change nothing here: a stage's backward runs from the residuals its forward
    saved under the same policy (`parallel/pipeline/executor.py`); the fill and the drain are the
    bubble, which is time, not FLOPs.

    Args:
        cfg: the model shape.
        seq_len: tokens per sequence.
        remat: one of `REMAT_POLICIES`; None takes `cfg.remat`.
        score_fraction: the part of the S x S square counted: 0.5 (the causal half, the MFU
          convention of `flops_per_token`), 1 (the whole square), or the busiest device's share.
        context: devices on the context axis.
        recomputes: {projections: the re-run projections' names (or a bool: all, none), attention:
          re-run}; None takes `RECOMPUTES[remat]`.
    """
    remat = cfg.remat if remat is None else remat
    if remat not in REMAT_POLICIES:
        raise ValueError(f"model.remat={remat!r} is not a known policy; "
                         f"use one of {REMAT_POLICIES}")
    redo = RECOMPUTES[remat] if recomputes is None else recomputes
    counts = param_counts(cfg)
    attention = attention_forward_flops_per_token(cfg, seq_len, causal=False) * score_fraction
    backward = 2.0 if context == 1 else 2.5
    projections = 2.0 * cfg.num_layers * projection_params(cfg, redo["projections"])
    remat_redo = (attention if redo["attention"] else 0.0) + projections
    return 6.0 * counts["matmul"] + (1 + backward) * attention + remat_redo
