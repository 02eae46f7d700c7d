"""Hugging Face DeepSeek-V3 (`DeepseekV3ForCausalLM`, model_type deepseek_v3) <-> ours (pure numpy, no I/O).

Config. Multi-head latent attention: kv_lora_rank, q_lora_rank (null: none, our 0), qk_nope_head_dim,
qk_rope_head_dim, v_head_dim are the model keys of the same names; num_key_value_heads is num_heads
(MLA expands K/V per head); head_dim (transformers sets it to qk_rope_head_dim) is not ours. The
first `first_k_dense_replace` layers are dense, intermediate_size wide (`model.moe.first_dense_layers`,
`model.ffn_dim`), every later one MoE: n_routed_experts experts moe_intermediate_size wide, top
num_experts_per_tok, sigmoid scores, n_group groups of which topk_group are kept, renormalised when
norm_topk_prob, times routed_scaling_factor, n_shared_experts ungated shared experts, and the
selection bias e_score_correction_bias (`model.moe.balance=bias`, aux-loss-free; the import sets
the paper's sequence-wise loss 0.0001 and no other auxiliary loss).

Tensors (per layer l; ours stacked [L', ...] on `blocks` for the dense layers, `moe_blocks` for the MoE ones):

    self_attn.q_a_proj.weight          [Q, D]             ->  attn/wq_a  [D, Q]   (q_lora_rank > 0)
    self_attn.q_a_layernorm.weight     [Q]                ->  attn/q_norm/scale
    self_attn.q_b_proj.weight          [N*(A+E), Q]       ->  attn/wq_b  [Q, N, A+E]
    self_attn.q_proj.weight            [N*(A+E), D]       ->  attn/wq    [D, N, A+E]  (q_lora_rank null)
    self_attn.kv_a_proj_with_mqa.weight [R+E, D]          ->  attn/wkv_a [D, R] (rows :R), attn/wk_rope [D, E] (rows R:)
    self_attn.kv_a_layernorm.weight    [R]                ->  attn/kv_norm/scale
    self_attn.kv_b_proj.weight         [N*(A+U), R]       ->  attn/wk_b [R, N, A], attn/wv_b [R, N, U]
                                                              (per head: A key rows, then U value rows)
    self_attn.o_proj.weight            [D, N*U]           ->  attn/wo    [N, U, D]
    mlp.gate.weight [E', D] -> mlp/router [D, E'];  mlp.experts.{e}.{gate,up,down}_proj.weight -> mlp/w_*[e]
    mlp.shared_experts.{gate,up,down}_proj.weight -> mlp/shared/w_*;  mlp.gate.e_score_correction_bias [E']
      -> the model state moe_blocks/mlp/balance/bias (its load: zeros, so the bias chosen with is the
         checkpoint's, `choice_bias`; the multi-token-prediction layers': mtp/block/mlp/balance)

Rotary layout: with rope_interleave (DeepSeek's default) transformers rotates the pairs (2i, 2i+1) of
the E rotated dims; that is the half-split rotation of those dims de-interleaved (even ones first),
so the import permutes the rotated output columns of wq/wq_b and wk_rope (exact: q.k is unchanged by
a permutation applied to both) and the export permutes them back and writes rope_interleave true.

YaRN rope (the released 671B's: factor 40 over 4k) is `model.rope_scaling=yarn` with its beta and mscale
keys; as transformers' DeepSeek-V3 the scores are also scaled by m(mscale_all_dim)^2.
Refused: attention_bias, yarn's attention_factor. The
multi-token-prediction layers (`model.layers.{num_hidden_layers + k}.*`) become `model.mtp` when the
checkpoint holds them (num_nextn_predict_layers of them).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from lumen_jax.config import ModelConfig, MoeConfig
from lumen_jax.convert import hf
from lumen_jax.convert.hf import ConvertError

ARCHITECTURE = "DeepseekV3ForCausalLM"
FIELDS = frozenset({"moe_intermediate_size", "n_shared_experts", "n_routed_experts", "routed_scaling_factor",
                    "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "n_group",
                    "topk_group", "num_experts_per_tok", "first_k_dense_replace", "norm_topk_prob", "rope_interleave",
                    "num_nextn_predict_layers", "num_mtp_layers", "qk_head_dim", "output_router_logits",
                    "topk_method", "scoring_func", "moe_layer_freq", "aux_loss_alpha", "seq_aux", "ep_size"})
FIXED = (*hf.FIXED, ("topk_method", "noaux_tc"), ("scoring_func", "sigmoid"), ("moe_layer_freq", 1))
SEQUENCE_AUX = 0.0001  # the paper's sequence-wise balance loss weight (section 2.1.2)


def _int(raw: dict, name: str, default: Any = None) -> int:
    value = raw.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConvertError(f"config.json {name}={value!r} must be a non-negative integer")
    return value


def model_config(raw: dict, dtype: str, names: frozenset | set = frozenset()) -> ModelConfig:
    """Our ModelConfig of a DeepSeek-V3 `config.json` dict `raw` (module docstring); ConvertError otherwise.
    `names`: the checkpoint's tensors: `model.mtp_depth` counts the multi-token-prediction layers it holds
    (of num_nextn_predict_layers; transformers' own saves hold none)."""
    hf.check_architecture(raw, "deepseek_v3", ARCHITECTURE)
    base = hf.base_fields(raw, hf.HARMLESS | FIELDS, FIXED)
    n = base["num_heads"]
    if raw.get("num_key_value_heads", n) not in (n, None):
        raise ConvertError(f"config.json num_key_value_heads={raw['num_key_value_heads']!r} is not supported "
                           f"(multi-head latent attention expands K/V per head: num_attention_heads={n})")
    q_lora = raw.get("q_lora_rank")
    first = _int(raw, "first_k_dense_replace", 3)
    if not first < base["num_layers"]:
        raise ConvertError(f"config.json first_k_dense_replace={first} leaves no MoE layer of num_hidden_layers="
                           f"{base['num_layers']}; a dense model is not read as DeepSeek-V3 here")
    experts = _int(raw, "n_routed_experts")
    moe = MoeConfig(num_experts=experts, top_k=_int(raw, "num_experts_per_tok"), first_dense_layers=first,
                    shared_experts=_int(raw, "n_shared_experts", 1), router="sigmoid",
                    normalize_top_k=bool(raw.get("norm_topk_prob", True)),
                    routed_scaling=float(raw.get("routed_scaling_factor", 1.0)),
                    groups=raw.get("n_group") or 1, top_groups=raw.get("topk_group") or 1, balance="bias",
                    aux_loss_weight=0.0, sequence_aux_loss_weight=SEQUENCE_AUX, router_z_loss_weight=0.0,
                    expert_ffn_dim=_int(raw, "moe_intermediate_size"))
    depth = 0
    while (depth < _int(raw, "num_nextn_predict_layers", 0)
           and f"model.layers.{base['num_layers'] + depth}.eh_proj.weight" in names):
        depth += 1
    return ModelConfig(**{**base, "head_dim": 0, "num_kv_heads": n}, mtp_depth=depth,
                       kv_lora_rank=_int(raw, "kv_lora_rank"),
                       q_lora_rank=0 if q_lora is None else _int(raw, "q_lora_rank"),
                       qk_nope_head_dim=_int(raw, "qk_nope_head_dim"), qk_rope_head_dim=_int(raw, "qk_rope_head_dim"),
                       v_head_dim=_int(raw, "v_head_dim"), moe=moe, compute_dtype=dtype)


def check_exportable(m: ModelConfig) -> None:
    """ConvertError naming what of `m` DeepseekV3ForCausalLM cannot hold."""
    moe = m.moe
    for key, value, want in (("model.kv_lora_rank>0", m.mla, True), ("model.moe.num_experts>0", moe.enabled, True),
                             ("model.moe.router", moe.router, "sigmoid"), ("model.moe.every_n_layers",
                                                                           moe.every_n_layers, 1),
                             ("model.moe.shared_gate", moe.shared_gate, False),
                             ("model.tie_embeddings", m.tie_embeddings, False)):
        if value != want:
            raise ConvertError(f"{key}={value!r}: DeepseekV3ForCausalLM has {want!r}; to-hf cannot export this "
                               "latent-attention model")


def hf_config(m: ModelConfig, dtype: str) -> dict:
    """A transformers `config.json` of our DeepSeek-V3 model `m`."""
    check_exportable(m)
    moe = m.moe
    out = hf.common_config(m, dtype)
    out.pop("head_dim")
    out.update(architectures=[ARCHITECTURE], model_type="deepseek_v3", num_key_value_heads=m.num_heads,
               kv_lora_rank=m.kv_lora_rank, q_lora_rank=m.q_lora_rank or None, qk_nope_head_dim=m.qk_nope_head_dim,
               qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim,
               first_k_dense_replace=moe.first_dense_layers,
               n_routed_experts=moe.num_experts, num_experts_per_tok=moe.top_k, n_shared_experts=moe.shared_experts,
               moe_intermediate_size=m.expert_ffn_dim, norm_topk_prob=moe.normalize_top_k,
               routed_scaling_factor=moe.routed_scaling, n_group=moe.groups, topk_group=moe.top_groups,
               rope_interleave=True, num_nextn_predict_layers=m.mtp_depth, output_router_logits=False)
    return out


# --------------------------------------------------------------------------------------------------
# Tensors: hf.py's rows over "virtual" names (the two parts of kv_a_proj_with_mqa and kv_b_proj each
# a tensor of its own), joined into the real ones on the way out and split on the way in.
# --------------------------------------------------------------------------------------------------

_KV_A, _KV_B = "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_b_proj.weight"


def _where(m: ModelConfig, layer: int) -> tuple[str, int]:
    first = m.moe.first_dense_layers
    return ("blocks", layer) if layer < first else ("moe_blocks", layer - first)


def _layer_rows(m: ModelConfig, pre: str, at: tuple[str, ...], i: int, moe: bool) -> list[hf.Row]:
    """The rows of one decoder layer whose HF names start with `pre`, at index `i` of our stack `at`."""
    d, n, e_ = m.d_model, m.num_heads, m.moe.num_experts
    r, a, e, u = m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    attn = (*at, "attn")
    rows: list[hf.Row] = []
    if m.q_lora_rank:
        rows += [(pre + "self_attn.q_a_proj.weight", (*attn, "wq_a"), (i,), "linear", (d, m.q_lora_rank)),
                 (pre + "self_attn.q_a_layernorm.weight", (*attn, "q_norm", "scale"), (i,), "vector", (m.q_lora_rank,)),
                 (pre + "self_attn.q_b_proj.weight", (*attn, "wq_b"), (i,), "q", (m.q_lora_rank, n, a + e))]
    else:
        rows.append((pre + "self_attn.q_proj.weight", (*attn, "wq"), (i,), "q", (d, n, a + e)))
    rows += [(pre + _KV_A + ":latent", (*attn, "wkv_a"), (i,), "linear", (d, r)),
             (pre + _KV_A + ":rope", (*attn, "wk_rope"), (i,), "linear", (d, e)),
             (pre + "self_attn.kv_a_layernorm.weight", (*attn, "kv_norm", "scale"), (i,), "vector", (r,)),
             (pre + _KV_B + ":k", (*attn, "wk_b"), (i,), "q", (r, n, a)),
             (pre + _KV_B + ":v", (*attn, "wv_b"), (i,), "q", (r, n, u)),
             (pre + "self_attn.o_proj.weight", (*attn, "wo"), (i,), "o", (n, u, d)),
             (pre + "input_layernorm.weight", (*at, "attn_norm", "scale"), (i,), "vector", (d,)),
             (pre + "post_attention_layernorm.weight", (*at, "mlp_norm", "scale"), (i,), "vector", (d,))]
    if not moe:
        return rows + hf.mlp_rows(pre + "mlp", (*at, "mlp"), (i,), d, m.ffn_dim)
    rows.append((pre + "mlp.gate.weight", (*at, "mlp", "router"), (i,), "linear", (d, e_)))
    for x in range(e_):
        rows += hf.mlp_rows(f"{pre}mlp.experts.{x}", (*at, "mlp"), (i, x), d, m.expert_ffn_dim)
    if m.moe.shared_experts:
        rows += hf.mlp_rows(pre + "mlp.shared_experts", (*at, "mlp", "shared"), (i,), d,
                            m.moe.shared_experts * m.expert_ffn_dim)
    return rows


def _table(m: ModelConfig) -> list[hf.Row]:
    """Every tensor of our DeepSeek-V3 `m`, the multi-token-prediction layers' too (`model.layers.{L + k}`:
    hnorm, enorm, eh_proj, shared_head.norm and a decoder layer; its embed_tokens and shared_head.head are
    the model's own, checked and written apart)."""
    d = m.d_model
    rows = hf.outer_rows(m)
    for layer in range(m.num_layers):
        stack, i = _where(m, layer)
        rows += _layer_rows(m, f"model.layers.{layer}.", (stack,), i, stack == "moe_blocks")
    for k in range(m.mtp_depth):
        pre = f"model.layers.{m.num_layers + k}."
        rows += [(pre + "hnorm.weight", ("mtp", "hnorm", "scale"), (k,), "vector", (d,)),
                 (pre + "enorm.weight", ("mtp", "enorm", "scale"), (k,), "vector", (d,)),
                 (pre + "eh_proj.weight", ("mtp", "eh_proj"), (k,), "eh", (2 * d, d)),
                 (pre + "shared_head.norm.weight", ("mtp", "norm", "scale"), (k,), "vector", (d,))]
        rows += _layer_rows(m, pre, ("mtp", "block"), k, m.moe.enabled)
    return rows


def _bias_names(m: ModelConfig) -> list[str]:
    """The routers' e_score_correction_bias of every MoE layer, the multi-token-prediction layers' last."""
    layers = [*range(m.moe.first_dense_layers, m.num_layers), *range(m.num_layers, m.num_layers + m.mtp_depth)]
    return [f"model.layers.{layer}.mlp.gate.e_score_correction_bias" for layer in layers]


def _mtp_copies(m: ModelConfig) -> dict[str, str]:
    """{the MTP layers' copies of the embedding and the output head: the model's tensor they equal}."""
    out = {}
    for k in range(m.mtp_depth):
        pre = f"model.layers.{m.num_layers + k}."
        out[pre + "embed_tokens.weight"] = "model.embed_tokens.weight"
        out[pre + "shared_head.head.weight"] = "lm_head.weight"
    return out


def expected_tensors(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name of our DeepSeek-V3 model `m` and its shape (the real names)."""
    want = {k: v for k, v in hf.shapes(_table(m)).items() if ":" not in k}
    n, r, a, e, u = m.num_heads, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    for layer in range(m.num_layers + m.mtp_depth):
        pre = f"model.layers.{layer}."
        want[pre + _KV_A] = (r + e, m.d_model)
        want[pre + _KV_B] = (n * (a + u), r)
    for name in _bias_names(m):
        want[name] = (m.moe.num_experts,)
    for copy, source in _mtp_copies(m).items():
        want[copy] = want[source]
    return want


def choice_bias(bias: np.ndarray, load: np.ndarray, rate: float) -> np.ndarray:
    """The selection bias [L', E] the next step (and inference) chooses with, from the model state's last
    bias and load: `bias + rate * sign(mean(load) - load)` (`ops.moe.choice_bias`, per layer)."""
    return (bias + rate * np.sign(load.mean(-1, keepdims=True) - load)).astype(np.float32)


def _rope_order(e: int) -> np.ndarray:
    """The interleaved rotary dims (2i, 2i+1 pairs) in half-split order: the even ones, then the odd."""
    return np.concatenate([np.arange(0, e, 2), np.arange(1, e, 2)])


def _permute_rope(params: dict, m: ModelConfig, order: np.ndarray) -> dict:
    """`params` with the rotated output columns of the queries and the shared key taken in `order`."""
    a = m.qk_nope_head_dim
    out = {k: ({kk: dict(vv) if isinstance(vv, dict) else vv for kk, vv in v.items()} if isinstance(v, dict) else v)
           for k, v in params.items()}
    for stack in ("blocks", "moe_blocks", "mtp"):
        if stack not in out:
            continue
        if stack == "mtp":
            out[stack] = {**out[stack], "block": dict(out[stack]["block"])}
            out[stack]["block"]["attn"] = dict(out[stack]["block"]["attn"])
        attn = out[stack]["block"]["attn"] if stack == "mtp" else out[stack]["attn"]
        q = "wq_b" if "wq_b" in attn else "wq"
        w = np.asarray(attn[q])
        attn[q] = np.concatenate([w[..., :a], w[..., a:][..., order]], axis=-1)
        attn["wk_rope"] = np.asarray(attn["wk_rope"])[..., order]
    return out


def state_from_bias(bias: np.ndarray, m: ModelConfig) -> dict:
    """Our model state (`ops.moe.balance_state` per layer, stacked) of the DeepSeek-V3 `m` from the routers'
    selection bias [L', E] (`_bias_names`' order): that bias with a load of zeros, which leaves it as it is."""
    n = m.num_layers - m.moe.first_dense_layers

    def balance(b: np.ndarray) -> dict:
        return {"mlp": {"balance": {"bias": b, "load": np.zeros_like(b)}}}

    state = {"moe_blocks": balance(bias[:n])}
    if m.mtp_depth:
        state["mtp"] = {"block": balance(bias[n:])}
    return state


def params_from_hf(get: Callable[[str], np.ndarray], names: set[str], m: ModelConfig,
                   raw: dict) -> tuple[dict, dict]:
    """(our float32 parameter tree, our model state: the routers' selection bias, `state_from_bias`) of the
    DeepSeek-V3 `m` from HF tensors (`get(name)` reads one, `names`: all in the checkpoint; the
    multi-token-prediction layers' beyond `m.mtp_depth` are dropped). ConvertError naming the first
    missing, misshapen or unexpected tensor."""
    mtp = tuple(f"model.layers.{layer}." for layer in range(m.num_layers + m.mtp_depth, m.num_layers + 64))
    read = hf.checked_reader(get, {x for x in names if not x.startswith(mtp)}, expected_tensors(m), False,
                             f"a {ARCHITECTURE}")
    n, r, a, u = m.num_heads, m.kv_lora_rank, m.qk_nope_head_dim, m.v_head_dim

    def virtual(name: str) -> np.ndarray:
        real, _, part = name.partition(":")
        if not part:
            return read(real)
        w = read(real)
        if real.endswith(_KV_A):
            return w[:r] if part == "latent" else w[r:]
        w = w.reshape(n, a + u, r)
        return (w[:, :a] if part == "k" else w[:, a:]).reshape(-1, r)

    bias = np.stack([np.asarray(read(name), np.float32) for name in _bias_names(m)])  # [L', E]
    for copy, source in _mtp_copies(m).items():
        if not np.array_equal(read(copy), read(source)):
            raise ConvertError(f"checkpoint tensor {copy} differs from {source}: multi-token prediction shares "
                               "the model's embedding and output head here, so this checkpoint cannot be imported")
    params = hf.params_from_rows(_table(m), virtual)
    if raw.get("rope_interleave", True):
        params = _permute_rope(params, m, _rope_order(m.qk_rope_head_dim))
    return params, state_from_bias(bias, m)


def hf_from_params(params: dict, m: ModelConfig, dtype: Any, bias: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """HF tensors {name: array of `dtype`} of our DeepSeek-V3 `m` from our parameter tree (numpy), its
    rotary dims interleaved (rope_interleave true); `bias` [L', E] the routers' selection bias (the model
    state; None: zeros)."""
    check_exportable(m)
    params = _permute_rope(params, m, np.argsort(_rope_order(m.qk_rope_head_dim)))
    parts = hf.hf_from_rows(_table(m), params, dtype)
    out = {k: v for k, v in parts.items() if ":" not in k}
    for layer in range(m.num_layers + m.mtp_depth):
        pre = f"model.layers.{layer}."
        out[pre + _KV_A] = np.concatenate([parts[pre + _KV_A + ":latent"], parts[pre + _KV_A + ":rope"]])
        k = parts[pre + _KV_B + ":k"].reshape(m.num_heads, m.qk_nope_head_dim, -1)
        v = parts[pre + _KV_B + ":v"].reshape(m.num_heads, m.v_head_dim, -1)
        out[pre + _KV_B] = np.ascontiguousarray(np.concatenate([k, v], axis=1).reshape(-1, m.kv_lora_rank))
    for i, name in enumerate(_bias_names(m)):  # float32 in transformers (_keep_in_fp32_modules_strict)
        out[name] = np.zeros(m.moe.num_experts, np.float32) if bias is None else np.asarray(bias[i], np.float32)
    for copy, source in _mtp_copies(m).items():
        out[copy] = out[source]
    return out
