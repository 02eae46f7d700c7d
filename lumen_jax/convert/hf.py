"""The Hugging Face Llama layout <-> ours: config fields and tensors, both ways (pure numpy, no I/O).

Tensors. HF stores each layer's projections as torch Linear weights [out, in]; ours are einsum
weights [in, ...] stacked on a leading `layers` axis:

    model.layers.{l}.self_attn.q_proj.weight  [N*H, D]  ->  blocks/attn/wq    [L, D, N, H]
    model.layers.{l}.self_attn.k_proj.weight  [K*H, D]  ->  blocks/attn/wk    [L, D, K, H]  (v_proj: wv)
    model.layers.{l}.self_attn.o_proj.weight  [D, N*H]  ->  blocks/attn/wo    [L, N, H, D]
    model.layers.{l}.mlp.gate_proj.weight     [F, D]    ->  blocks/mlp/w_gate [L, D, F]     (up_proj: w_up)
    model.layers.{l}.mlp.down_proj.weight     [D, F]    ->  blocks/mlp/w_down [L, F, D]
    model.layers.{l}.input_layernorm.weight   [D]       ->  blocks/attn_norm/scale [L, D]
    model.layers.{l}.post_attention_layernorm.weight    ->  blocks/mlp_norm/scale  [L, D]
    model.embed_tokens.weight [V, D] -> embed [V, D];  model.norm.weight -> final_norm/scale;
    lm_head.weight [V, D] -> lm_head [D, V] (absent when tie_word_embeddings).

Rotary layout: HF Llama's `rotate_half` pairs dimension i with i + H/2 of each head, and so does
our `apply_rope` (half-split), so q/k need no permutation (the logits test checks it).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from lumen_jax.config import ConfigError, ModelConfig

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
# config.json fields that change nothing we compute (ids, bookkeeping, training-only defaults).
HARMLESS = frozenset({
    "architectures", "model_type", "transformers_version", "bos_token_id", "eos_token_id", "pad_token_id",
    "dtype", "torch_dtype", "initializer_range", "max_position_embeddings", "use_cache", "pretraining_tp",
    "_name_or_path", "output_attentions", "output_hidden_states", "return_dict", "tie_word_embeddings",
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
    "hidden_act", "attention_bias", "attention_dropout", "mlp_bias",
})
# Fields we support only at one value: (field, required value).
FIXED = (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False), ("attention_dropout", 0.0))


class ConvertError(ConfigError):
    """A checkpoint we cannot convert faithfully (one line, exit 2)."""


def _rope(hf: dict) -> dict:
    """The rope settings as one dict {rope_type, rope_theta, factor, ...} from 4.x or 5.x fields."""
    params = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    params.update({k: v for k, v in legacy.items() if k not in params})
    if "type" in params and "rope_type" not in params:  # early 4.x spelling
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    params.setdefault("rope_type", "default")
    return params


def model_config(hf: dict, dtype: str) -> ModelConfig:
    """Our ModelConfig for the HF Llama `config.json` dict `hf`; ConvertError for anything we would not honour."""
    arch = hf.get("architectures") or ["LlamaForCausalLM"]
    if hf.get("model_type", "llama") != "llama" or arch != ["LlamaForCausalLM"]:
        raise ConvertError(f"config.json: model_type={hf.get('model_type')!r} architectures={arch} is not "
                           "supported; from-hf reads Llama checkpoints (model_type 'llama', LlamaForCausalLM)")
    return ModelConfig(**base_fields(hf, HARMLESS, FIXED), compute_dtype=dtype)


def base_fields(hf: dict, harmless: frozenset, fixed: tuple) -> dict[str, Any]:
    """The ModelConfig fields every Llama-like decoder shares (shape, norm, rope, tying) from `hf`;
    ConvertError for a field not in `harmless`, a `fixed` field at another value, or a rope we lack."""
    unknown = sorted(set(hf) - harmless)
    if unknown:
        raise ConvertError(f"config.json field {unknown[0]}={hf[unknown[0]]!r} is not understood by the converter "
                           "and would be ignored; remove it if it changes nothing, else this model is not supported")
    for field, value in fixed:
        if field in hf and hf[field] != value:
            raise ConvertError(f"config.json {field}={hf[field]!r} is not supported (only {value!r})")
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        if not isinstance(hf.get(field), int):
            raise ConvertError(f"config.json has no integer {field} (got {hf.get(field)!r})")
    rope = _rope(hf)
    kind = rope["rope_type"]
    scaling: dict[str, Any] = {}
    if kind == "llama3":
        try:
            scaling = dict(rope_scaling="llama3", rope_scaling_factor=float(rope["factor"]),
                           rope_low_freq_factor=float(rope["low_freq_factor"]),
                           rope_high_freq_factor=float(rope["high_freq_factor"]),
                           rope_original_max_len=int(rope["original_max_position_embeddings"]))
        except KeyError as e:
            raise ConvertError(f"config.json rope scaling 'llama3' lacks {e.args[0]}") from None
        known = {"rope_type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
                 "original_max_position_embeddings"}
    elif kind == "default":
        known = {"rope_type", "rope_theta"}
    else:
        raise ConvertError(f"config.json rope_type={kind!r} is not supported; only default and llama3 rope")
    extra = sorted(set(rope) - known)
    if extra:
        raise ConvertError(f"config.json rope field {extra[0]}={rope[extra[0]]!r} is not supported "
                           f"for rope_type={kind!r} and would be ignored")
    n = hf["num_attention_heads"]
    return dict(
        d_model=hf["hidden_size"], num_layers=hf["num_hidden_layers"], num_heads=n,
        num_kv_heads=hf.get("num_key_value_heads") or n, head_dim=hf.get("head_dim") or hf["hidden_size"] // n,
        ffn_dim=hf["intermediate_size"], vocab_size=hf["vocab_size"], norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope["rope_theta"]), tie_embeddings=bool(hf.get("tie_word_embeddings", False)), **scaling)


def hf_config(m: ModelConfig, dtype: str) -> dict:
    """A transformers `config.json` for the Llama `m` (rope written both as 4.x `rope_scaling` and 5.x
    `rope_parameters`); hf_moe.hf_config adds a mixture of experts' fields to it."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_scaling == "llama3":
        rope.update(rope_type="llama3", factor=m.rope_scaling_factor, low_freq_factor=m.rope_low_freq_factor,
                    high_freq_factor=m.rope_high_freq_factor,
                    original_max_position_embeddings=m.rope_original_max_len)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": m.d_model, "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_kv_heads, "head_dim": m.resolved_head_dim, "intermediate_size": m.ffn_dim,
        "vocab_size": m.vocab_size, "rms_norm_eps": m.norm_eps, "rope_theta": m.rope_theta,
        "rope_scaling": rope if m.rope_scaling == "llama3" else None, "rope_parameters": rope,
        "tie_word_embeddings": m.tie_embeddings, "attention_bias": False, "mlp_bias": False,
        "max_position_embeddings": max(m.rope_original_max_len, 8192), "torch_dtype": dtype, "dtype": dtype,
    }


def _layer_tensors(m: ModelConfig) -> dict[str, tuple[tuple[str, str], tuple[int, ...]]]:
    """HF layer-tensor suffix -> ((our group, our name), HF shape)."""
    d, n, k, h, f = m.d_model, m.num_heads, m.num_kv_heads, m.resolved_head_dim, m.ffn_dim
    return {
        "self_attn.q_proj.weight": (("attn", "wq"), (n * h, d)),
        "self_attn.k_proj.weight": (("attn", "wk"), (k * h, d)),
        "self_attn.v_proj.weight": (("attn", "wv"), (k * h, d)),
        "self_attn.o_proj.weight": (("attn", "wo"), (d, n * h)),
        "mlp.gate_proj.weight": (("mlp", "w_gate"), (f, d)),
        "mlp.up_proj.weight": (("mlp", "w_up"), (f, d)),
        "mlp.down_proj.weight": (("mlp", "w_down"), (d, f)),
        "input_layernorm.weight": (("attn_norm", "scale"), (d,)),
        "post_attention_layernorm.weight": (("mlp_norm", "scale"), (d,)),
    }


def expected_tensors(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name of `m` and its shape."""
    out = {"model.embed_tokens.weight": (m.vocab_size, m.d_model), "model.norm.weight": (m.d_model,)}
    if not m.tie_embeddings:
        out["lm_head.weight"] = (m.vocab_size, m.d_model)
    for layer in range(m.num_layers):
        out.update({f"model.layers.{layer}.{s}": shape for s, (_, shape) in _layer_tensors(m).items()})
    return out


def _to_ours(suffix: str, w: np.ndarray, m: ModelConfig) -> np.ndarray:
    d, n, k, h = m.d_model, m.num_heads, m.num_kv_heads, m.resolved_head_dim
    if suffix.endswith("norm.weight"):
        return w
    if suffix == "self_attn.q_proj.weight":
        return w.T.reshape(d, n, h)
    if suffix in ("self_attn.k_proj.weight", "self_attn.v_proj.weight"):
        return w.T.reshape(d, k, h)
    if suffix == "self_attn.o_proj.weight":
        return w.T.reshape(n, h, d)
    return w.T  # gate/up [F, D] -> [D, F]; down [D, F] -> [F, D]


def params_from_hf(get: Callable[[str], np.ndarray], names: set[str], m: ModelConfig) -> dict:
    """Our float32 parameter tree from HF tensors (`get(name)` reads one; `names`: all in the checkpoint).

    Raises ConvertError naming the first missing, misshapen or unexpected tensor.
    """
    read = checked_reader(get, names, expected_tensors(m), m.tie_embeddings, "a Llama model")
    blocks: dict[str, dict[str, np.ndarray]] = {}
    for suffix, ((group, leaf), _) in _layer_tensors(m).items():
        stacked = [_to_ours(suffix, read(f"model.layers.{i}.{suffix}"), m) for i in range(m.num_layers)]
        blocks.setdefault(group, {})[leaf] = np.stack(stacked)
    params = {"blocks": blocks, "embed": read("model.embed_tokens.weight"),
              "final_norm": {"scale": read("model.norm.weight")}}
    if not m.tie_embeddings:
        params["lm_head"] = read("lm_head.weight").T
    return params


def checked_reader(get: Callable[[str], np.ndarray], names: set[str], want: dict[str, tuple[int, ...]],
                   tied: bool, model: str) -> Callable[[str], np.ndarray]:
    """`read(name)`: the float32 tensor `name` of shape `want[name]`, after checking that the checkpoint's
    `names` hold nothing `want` lacks; ConvertError naming the first missing, misshapen or extra tensor."""
    ignorable = {"lm_head.weight"} if tied else set()  # a tied checkpoint may still store it
    extra = sorted(x for x in names - set(want) - ignorable if not x.endswith("rotary_emb.inv_freq"))
    if extra:
        raise ConvertError(f"checkpoint tensor {extra[0]} has no place in {model} with this config.json; "
                           "the checkpoint and its config do not match")

    def read(name: str) -> np.ndarray:
        if name not in names:
            raise ConvertError(f"checkpoint has no tensor {name} (shape {want[name]}); the files are incomplete")
        w = np.asarray(get(name))
        if tuple(w.shape) != want[name]:
            raise ConvertError(f"checkpoint tensor {name} has shape {tuple(w.shape)}, config.json implies "
                               f"{want[name]}; the checkpoint and its config do not match")
        return w.astype(np.float32)

    return read


def hf_from_params(params: dict, m: ModelConfig, dtype: Any) -> dict[str, np.ndarray]:
    """HF tensors {name: array of `dtype`} from our parameter tree (numpy)."""
    if m.qkv_bias or m.qk_norm:
        raise ConvertError(f"model.{'qkv_bias' if m.qkv_bias else 'qk_norm'}=true has no place in LlamaForCausalLM; "
                           "to-hf cannot export this dense model")
    d = m.d_model
    out = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["final_norm"]["scale"]}
    if not m.tie_embeddings:
        out["lm_head.weight"] = params["lm_head"].T
    for suffix, ((group, leaf), shape) in _layer_tensors(m).items():
        stacked = params["blocks"][group][leaf]
        for i in range(m.num_layers):
            w = stacked[i]
            if suffix == "self_attn.o_proj.weight":
                w = w.reshape(-1, d).T
            elif not suffix.endswith("norm.weight"):
                w = w.reshape(d, -1).T if suffix != "mlp.down_proj.weight" else w.T
            out[f"model.layers.{i}.{suffix}"] = w
    return {k: np.ascontiguousarray(np.asarray(v).astype(dtype)) for k, v in out.items()}
