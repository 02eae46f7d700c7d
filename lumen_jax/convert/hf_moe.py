"""The Hugging Face mixtures of experts <-> ours: Mixtral, Qwen2-MoE, Qwen3-MoE (pure numpy, no I/O).

`FAMILIES` names each by its `model_type`. What they add to Llama (hf.py) and where it goes:

    router     {moe}.gate.weight                   [E, D]  ->  moe_blocks/mlp/router [Lm, D, E]
    experts    {moe}.experts.{e}.{gate}.weight     [F, D]  ->  moe_blocks/mlp/w_gate [Lm, E, D, F]  (up: w_up)
               {moe}.experts.{e}.{down}.weight     [D, F]  ->  moe_blocks/mlp/w_down [Lm, E, F, D]
    Qwen2-MoE  mlp.shared_expert.{gate,up,down}_proj.weight -> moe_blocks/mlp/shared/w_* (width shared_experts * F)
               mlp.shared_expert_gate.weight       [1, D]  ->  moe_blocks/mlp/shared_gate [Lm, D]
               self_attn.{q,k,v}_proj.bias     [N*H | K*H] ->  */attn/bq [L', N, H], bk, bv [L', K, H]
    Qwen3-MoE  self_attn.{q,k}_norm.weight         [H]     ->  */attn/q_norm/scale, k_norm/scale [L', H]

with {moe} = `block_sparse_moe` and expert projections w1 (gate), w3 (up), w2 (down) for Mixtral,
`mlp` and gate_proj / up_proj / down_proj for Qwen. HF layer l is an MoE layer when
(l + 1) % decoder_sparse_step == 0 (Mixtral: every layer), as our `moe.every_n_layers`; the other
layers are dense (`blocks`, HF `mlp.{gate,up,down}_proj`). Routing: softmax over all experts, top-k,
renormalised when `norm_topk_prob` (Mixtral always): `moe.normalize_top_k`.

The load-balancing weight. transformers' `load_balancing_loss_func` pools the router outputs of all
layers into one loss, E * sum_i F_i * P_i with F_i the share of tokens sent to expert i (sum_i F_i =
top_k), and adds `router_aux_loss_coef` times it. Ours is E * sum_i f_i * P_i per MoE layer with
sum_i f_i = 1, summed over the layers. For one layer HF's loss is top_k times ours, and with L
MoE layers that route alike ours is L times one layer's, so the same strength is
`aux_loss_weight = router_aux_loss_coef * top_k / L` (exact for L = 1); from-hf sets that, to-hf
writes the inverse. Neither model has a router z-loss: an import sets router_z_loss_weight 0.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from lumen_jax.config import ModelConfig, MoeConfig
from lumen_jax.convert import hf
from lumen_jax.convert.hf import ConvertError


@dataclasses.dataclass(frozen=True)
class Family:
    """How one transformers MoE architecture names its parts."""

    architecture: str
    moe: str  # the MoE block's module name in a layer
    expert_names: tuple[str, str, str]  # gate, up, down projections of one expert
    shared: bool  # a shared expert with a sigmoid gate (Qwen2-MoE)
    qkv_bias: bool  # q/k/v projection biases
    qk_norm: bool  # per-head q/k RMSNorm
    fields: frozenset  # config.json fields it adds to Llama's that the import reads or checks


_QWEN_FIELDS = hf.SLIDING | {"num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                             "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef",
                             "output_router_logits"}
FAMILIES = {
    "mixtral": Family("MixtralForCausalLM", "block_sparse_moe", ("w1", "w3", "w2"), False, False, False,
                      frozenset({"num_local_experts", "num_experts", "num_experts_per_tok", "router_aux_loss_coef",
                                 "router_jitter_noise", "output_router_logits", "sliding_window"})),
    "qwen2_moe": Family("Qwen2MoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"), True, True, False,
                        _QWEN_FIELDS | {"shared_expert_intermediate_size", "qkv_bias"}),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"), False, False, True,
                        _QWEN_FIELDS),
}


def _int(raw: dict, *names: str) -> int:
    for name in names:
        if isinstance(raw.get(name), int):
            return raw[name]
    raise ConvertError(f"config.json has no integer {names[0]} (got {raw.get(names[0])!r})")


def model_config(raw: dict, dtype: str) -> ModelConfig:
    """Our ModelConfig for the HF MoE `config.json` dict `raw` (model_type in FAMILIES)."""
    kind = raw.get("model_type")
    fam = FAMILIES[kind]
    hf.check_architecture(raw, kind, fam.architecture)
    fixed = [*hf.FIXED, ("router_jitter_noise", 0.0), ("mlp_only_layers", [])]
    if kind == "mixtral":
        fixed.append(("sliding_window", None))
    if kind == "qwen2_moe" and raw.get("qkv_bias", True) is not True:
        raise ConvertError(f"config.json qkv_bias={raw['qkv_bias']!r} is not supported (Qwen2-MoE: only true)")
    base = hf.base_fields(raw, hf.HARMLESS | fam.fields, tuple(fixed))
    experts, top_k = _int(raw, "num_experts", "num_local_experts"), _int(raw, "num_experts_per_tok")
    every = raw.get("decoder_sparse_step", 1) if kind != "mixtral" else 1
    if not isinstance(every, int) or every < 1 or base["num_layers"] % every:
        raise ConvertError(f"config.json decoder_sparse_step={every!r} must divide num_hidden_layers="
                           f"{base['num_layers']}")
    expert_ffn = base["ffn_dim"] if kind == "mixtral" else _int(raw, "moe_intermediate_size")
    shared = 0
    if fam.shared:
        width = _int(raw, "shared_expert_intermediate_size")
        if width % expert_ffn:
            raise ConvertError(f"config.json shared_expert_intermediate_size={width} is not a multiple of "
                               f"moe_intermediate_size={expert_ffn}; the shared expert is shared_experts * "
                               "moe_intermediate_size wide here")
        shared = width // expert_ffn
    coef = float(raw.get("router_aux_loss_coef", 0.001))
    moe = MoeConfig(num_experts=experts, top_k=top_k, every_n_layers=every, shared_experts=shared,
                    shared_gate=shared > 0, router="softmax",
                    normalize_top_k=True if kind == "mixtral" else bool(raw.get("norm_topk_prob", False)),
                    aux_loss_weight=coef * top_k / (base["num_layers"] // every), router_z_loss_weight=0.0,
                    expert_ffn_dim=expert_ffn)
    return ModelConfig(**base, qkv_bias=fam.qkv_bias, qk_norm=fam.qk_norm, moe=moe, compute_dtype=dtype)


def family_of(m: ModelConfig) -> str:
    """The model_type that expresses our MoE model `m`; ConvertError naming what none of them has."""
    moe = m.moe
    for key, value, plain in (("router", moe.router, "softmax"), ("groups", moe.groups, 1),
                              ("routed_scaling", moe.routed_scaling, 1.0), ("balance", moe.balance, "aux_loss")):
        if value != plain:
            raise ConvertError(f"model.moe.{key}={hf_show(value)} has no place in MixtralForCausalLM, "
                               f"Qwen2MoeForCausalLM or Qwen3MoeForCausalLM (they route with {key}={hf_show(plain)}); "
                               "to-hf cannot export this model")
    if m.qk_norm:
        if moe.shared_experts or m.qkv_bias:
            raise ConvertError("model.qk_norm=true (Qwen3-MoE) with model.moe.shared_experts or model.qkv_bias "
                               "has no Hugging Face architecture here; to-hf cannot export this model")
        return "qwen3_moe"
    if moe.shared_experts:
        if not moe.shared_gate:
            raise ConvertError(f"model.moe.shared_experts={moe.shared_experts} without model.moe.shared_gate: "
                               "Qwen2MoeForCausalLM always gates its shared expert; to-hf cannot export this model")
        return "qwen2_moe"
    if m.qkv_bias or not moe.normalize_top_k or moe.every_n_layers > 1:
        raise ConvertError("model.qkv_bias, model.moe.normalize_top_k=false or model.moe.every_n_layers>1 without "
                           "shared experts or qk_norm matches neither Mixtral (every layer MoE, renormalised top-k) "
                           "nor Qwen2-MoE (a gated shared expert) nor Qwen3-MoE (qk_norm); to-hf cannot export it")
    return "mixtral"


def hf_show(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def hf_config(m: ModelConfig, dtype: str) -> dict:
    """A transformers `config.json` for the MoE model `m` (`family_of(m)`)."""
    kind = family_of(m)
    moe = m.moe
    out = hf.common_config(m, dtype)
    layers = m.num_layers // moe.every_n_layers
    out.update(architectures=[FAMILIES[kind].architecture], model_type=kind, num_experts_per_tok=moe.top_k,
               router_aux_loss_coef=moe.aux_loss_weight * layers / moe.top_k, output_router_logits=False)
    if kind == "mixtral":
        out.update(num_local_experts=moe.num_experts, intermediate_size=m.expert_ffn_dim, sliding_window=None,
                   router_jitter_noise=0.0)
        return out
    out.update(num_experts=moe.num_experts, moe_intermediate_size=m.expert_ffn_dim, norm_topk_prob=moe.normalize_top_k,
               decoder_sparse_step=moe.every_n_layers, mlp_only_layers=[], use_sliding_window=False)
    if kind == "qwen2_moe":
        out.pop("attention_bias")
        out.update(qkv_bias=True, shared_expert_intermediate_size=moe.shared_experts * m.expert_ffn_dim)
    return out


# --------------------------------------------------------------------------------------------------
# Tensors: hf.py's rows, with the MoE layers' router, experts and shared expert
# --------------------------------------------------------------------------------------------------


def _table(m: ModelConfig, kind: str) -> list[hf.Row]:
    """hf.Row of every tensor of the MoE model `m` as the family `kind` names them."""
    fam, moe = FAMILIES[kind], m.moe
    d, e, every = m.d_model, moe.num_experts, moe.every_n_layers
    rows = hf.outer_rows(m)
    for layer in range(m.num_layers):
        is_moe = (layer + 1) % every == 0
        stack, i = ("moe_blocks", layer // every) if is_moe else ("blocks", layer - (layer + 1) // every)
        pre = f"model.layers.{layer}."
        rows += hf.attention_rows(m, layer, stack, i, fam.qkv_bias, fam.qk_norm)
        if not is_moe:
            rows += hf.mlp_rows(pre + "mlp", (stack, "mlp"), (i,), d, m.ffn_dim)
            continue
        rows.append((f"{pre}{fam.moe}.gate.weight", (stack, "mlp", "router"), (i,), "linear", (d, e)))
        for x in range(e):
            rows += hf.mlp_rows(f"{pre}{fam.moe}.experts.{x}", (stack, "mlp"), (i, x), d, m.expert_ffn_dim,
                                fam.expert_names)
        if fam.shared and moe.shared_experts:
            rows += hf.mlp_rows(pre + "mlp.shared_expert", (stack, "mlp", "shared"), (i,), d,
                                moe.shared_experts * m.expert_ffn_dim)
            rows.append((pre + "mlp.shared_expert_gate.weight", (stack, "mlp", "shared_gate"), (i,), "row", (d,)))
    return rows


def expected_tensors(m: ModelConfig, kind: str) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name of the MoE model `m` (of family `kind`) and its shape."""
    return hf.shapes(_table(m, kind))


def params_from_hf(read: Callable[[str], np.ndarray], m: ModelConfig, kind: str) -> dict:
    """Our float32 parameter tree from the HF tensors `read(name)` returns (checked by the caller)."""
    return hf.params_from_rows(_table(m, kind), read)


def hf_from_params(params: dict, m: ModelConfig, dtype: Any) -> dict[str, np.ndarray]:
    """HF tensors {name: array of `dtype`} of the MoE model `m` from our parameter tree (numpy); q/k/v
    biases are written as zeros when `m` has none (Qwen2-MoE always has them)."""
    return hf.hf_from_rows(_table(m, family_of(m)), params, dtype)
