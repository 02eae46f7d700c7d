"""The Hugging Face dense decoders <-> ours: Llama, Mistral, Qwen2, Qwen3, Gemma 3 (pure numpy, no I/O).

`FAMILIES` names each by its `model_type`; config fields and tensors go both ways, and the tensor table
(`Row`, `KINDS`) is the one hf_moe.py builds its mixtures of experts from.

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
    Qwen2 (model.qkv_bias): self_attn.{q,k,v}_proj.bias [N*H | K*H] -> blocks/attn/bq [L, N, H], bk, bv [L, K, H]
    Qwen3 (model.qk_norm):  self_attn.{q,k}_norm.weight [H] -> blocks/attn/q_norm/scale, k_norm/scale [L, H]

Both Qwen configs carry sliding-window fields (`use_sliding_window`, `sliding_window`,
`max_window_layers`, `layer_types`); transformers uses `sliding_window` only when `use_sliding_window`
is true, so an import takes them while every layer is full attention and refuses them otherwise.
Mistral is Llama's tensors with a sliding window over every layer (`sliding_window`, null for none:
`model.sliding_window`, 0 for none); to-hf writes a dense model with a window as Mistral.

Gemma 3 (`Gemma3ForCausalLM`, model_type gemma3_text) is Qwen3's tensors with two more norms per layer
and its own numerics, each a model key: norms times (1 + w) (`model.norm_scale=one_plus_weight`, w kept as
stored, so the round trip is exact), sandwich norms (`model.block_norms`):

    input_layernorm -> attn_norm, post_attention_layernorm -> post_attn_norm,
    pre_feedforward_layernorm -> mlp_norm, post_feedforward_layernorm -> post_mlp_norm;

GeGLU (`model.mlp_activation=gelu_tanh`), the embedding times sqrt(hidden_size) (`model.embed_scale`), scores
times query_pre_attn_scalar**-0.5 (`model.query_scale_dim`); `layer_types` as n-1 sliding layers then a full one,
repeated (`model.global_every` n; all full: no window; all sliding: every layer windowed), the full layers'
rope (default or linear) `model.rope_theta`/`rope_scaling`, the sliding layers' (default) `model.rope_local_theta`.
Soft-capping (`attn_logit_softcapping`, `final_logit_softcapping`) is refused unless null, as Gemma 3 sets it.

Rotary layout: HF Llama's `rotate_half` pairs dimension i with i + H/2 of each head, and so does
our `apply_rope` (half-split), so q/k need no permutation (the logits test checks it).
"""

from __future__ import annotations

import dataclasses
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
FIXED = (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False), ("attention_dropout", 0.0),
         ("use_sliding_window", False))
# The Qwen configs' sliding-window fields (harmless while use_sliding_window is false and every layer is
# full attention; base_fields checks both).
SLIDING = frozenset({"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"})


@dataclasses.dataclass(frozen=True)
class Dense:
    """One transformers dense decoder: what it adds to Llama's attention."""

    architecture: str
    qkv_bias: bool  # q/k/v projection biases (Qwen2)
    qk_norm: bool  # per-head q/k RMSNorm (Qwen3)
    fields: frozenset  # config.json fields it adds to HARMLESS that the import reads or checks


# Gemma 3's fields beyond Llama's; the 4.x spellings too (rope_local_base_freq, sliding_window_pattern).
GEMMA = frozenset({"hidden_activation", "query_pre_attn_scalar", "sliding_window", "layer_types",
                   "sliding_window_pattern", "_sliding_window_pattern", "rope_local_base_freq", "cache_implementation",
                   "final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention"})
GEMMA_FIXED = (("hidden_activation", "gelu_pytorch_tanh"), ("final_logit_softcapping", None),
               ("attn_logit_softcapping", None), ("use_bidirectional_attention", False), ("attention_bias", False),
               ("attention_dropout", 0.0))
# Gemma's model keys, each at the value Gemma 3 needs (every other family: the schema's defaults).
GEMMA_KEYS = (("norm_scale", "one_plus_weight"), ("block_norms", "sandwich"), ("mlp_activation", "gelu_tanh"),
              ("embed_scale", "sqrt_d_model"), ("qk_norm", True), ("qkv_bias", False))

FAMILIES = {
    "llama": Dense("LlamaForCausalLM", False, False, frozenset()),
    "qwen2": Dense("Qwen2ForCausalLM", True, False, SLIDING),
    "qwen3": Dense("Qwen3ForCausalLM", False, True, SLIDING),
    "mistral": Dense("MistralForCausalLM", False, False, frozenset({"sliding_window"})),
    "gemma3_text": Dense("Gemma3ForCausalLM", False, True, GEMMA),
}


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
    """Our ModelConfig for the HF dense `config.json` dict `hf` (model_type in FAMILIES, llama when it has
    none); ConvertError for anything we would not honour."""
    kind = hf.get("model_type", "llama")
    fam = FAMILIES[kind]
    check_architecture(hf, kind, fam.architecture)
    if kind == "gemma3_text":
        return gemma_config(hf, dtype)
    window = 0
    if kind == "mistral":
        window = hf.get("sliding_window") or 0
        if not isinstance(window, int) or window < 0:
            raise ConvertError(f"config.json sliding_window={window!r} must be a positive integer or null")
    return ModelConfig(**base_fields(hf, HARMLESS | fam.fields, FIXED), qkv_bias=fam.qkv_bias,
                       qk_norm=fam.qk_norm, sliding_window=window, compute_dtype=dtype)


def check_architecture(hf: dict, kind: str, architecture: str) -> None:
    """ConvertError unless `hf`'s architectures are [architecture] (or absent)."""
    arch = hf.get("architectures") or [architecture]
    if arch != [architecture]:
        raise ConvertError(f"config.json: model_type={kind!r} with architectures={arch} is not supported; "
                           f"from-hf reads model_type {kind!r} as [{architecture!r}]")


def base_fields(hf: dict, harmless: frozenset, fixed: tuple, layer_types: bool = False) -> dict[str, Any]:
    """The ModelConfig fields every Llama-like decoder shares (shape, norm, rope, tying) from `hf`;
    ConvertError for a field not in `harmless`, a `fixed` field at another value, or a rope we lack.
    `layer_types`: the caller reads sliding layers (Gemma); else only full ones are taken."""
    unknown = sorted(set(hf) - harmless)
    if unknown:
        raise ConvertError(f"config.json field {unknown[0]}={hf[unknown[0]]!r} is not understood by the converter "
                           "and would be ignored; remove it if it changes nothing, else this model is not supported")
    for field, value in fixed:
        if field in hf and hf[field] != value:
            raise ConvertError(f"config.json {field}={hf[field]!r} is not supported (only {value!r})")
    types = hf.get("layer_types")
    if not layer_types and types is not None and set(types) != {"full_attention"}:
        raise ConvertError(f"config.json layer_types={sorted(set(types))} is not supported (only "
                           "full_attention: no sliding-window layers)")
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
    elif kind == "linear":
        scaling = dict(rope_scaling="linear", rope_scaling_factor=float(rope.get("factor", 1.0)))
        known = {"rope_type", "rope_theta", "factor"}
    elif kind == "yarn":
        try:
            scaling = dict(rope_scaling="yarn", rope_scaling_factor=float(rope["factor"]),
                           rope_original_max_len=int(rope["original_max_position_embeddings"]),
                           rope_yarn_beta_fast=float(rope.get("beta_fast") or 32),
                           rope_yarn_beta_slow=float(rope.get("beta_slow") or 1),
                           rope_yarn_mscale=float(rope.get("mscale") or 0.0),
                           rope_yarn_mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0))
        except (KeyError, TypeError) as e:
            raise ConvertError(f"config.json rope scaling 'yarn' lacks {e.args[0]}") from None
        for field, value in (("attention_factor", None), ("truncate", True)):
            if rope.get(field, value) != value:
                raise ConvertError(f"config.json yarn rope {field}={rope[field]!r} is not supported (only {value!r})")
        known = {"rope_type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                 "mscale", "mscale_all_dim", "attention_factor", "truncate"}
    elif kind == "default":
        known = {"rope_type", "rope_theta"}
    else:
        raise ConvertError(f"config.json rope_type={kind!r} is not supported; only default, linear, llama3 and "
                           "yarn rope")
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


def gemma_config(hf: dict, dtype: str) -> ModelConfig:
    """Our ModelConfig of a Gemma 3 text `config.json` (see the module docstring); ConvertError otherwise."""
    hf = {"tie_word_embeddings": True, **hf}  # Gemma3TextConfig's default, which hub configs leave out
    n_layers = hf.get("num_hidden_layers")
    pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6
    types = hf.get("layer_types") or gemma_layer_types(n_layers if isinstance(n_layers, int) else 0, pattern, True)
    params = dict(hf.get("rope_parameters") or {})
    full = {"rope_type": "default", **(params.get("full_attention") or {}), **(hf.get("rope_scaling") or {})}
    full.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
    local = {"rope_type": "default", **(params.get("sliding_attention") or {})}
    local.setdefault("rope_theta", hf.get("rope_local_base_freq", 10_000.0))
    sliding, every = "sliding_attention" in types, 0
    if sliding and "full_attention" in types:
        every = types.index("full_attention") + 1
    local_theta = 0.0  # the local layers' rope: the global layers' (0), or a plain one of its own
    if every and local != full:
        if set(local) != {"rope_type", "rope_theta"} or local["rope_type"] != "default":
            raise ConvertError(f"config.json sliding_attention rope {local} is not supported beside another "
                               "full_attention rope (only a default rope of its own)")
        local_theta = float(local["rope_theta"])
    rope = local if sliding and not every else full  # every layer sliding: theirs
    legacy = {"rope_parameters", "rope_scaling", "rope_theta", "rope_local_base_freq"}
    base = base_fields({**{k: v for k, v in hf.items() if k not in legacy}, "rope_parameters": rope},
                       HARMLESS | GEMMA, GEMMA_FIXED, layer_types=True)
    if list(types) != gemma_layer_types(base["num_layers"], every, sliding) or not set(types) <= {
            "sliding_attention", "full_attention"}:
        raise ConvertError(f"config.json layer_types={list(types)} is not n-1 sliding_attention layers then one "
                           "full_attention, repeated (model.global_every); this layer pattern is not supported")
    window = hf.get("sliding_window") if sliding else 0
    if not isinstance(window, int) or window < (1 if sliding else 0):
        raise ConvertError(f"config.json sliding_window={window!r} must be a positive integer with sliding layers")
    scalar = hf.get("query_pre_attn_scalar", 256)
    if scalar != int(scalar) or scalar <= 0:
        raise ConvertError(f"config.json query_pre_attn_scalar={scalar!r} is not supported (a positive integer)")
    return ModelConfig(**base, sliding_window=window, global_every=every,
                       rope_local_theta=local_theta, query_scale_dim=int(scalar),
                       compute_dtype=dtype, **dict(GEMMA_KEYS))


def gemma_layer_types(num_layers: int, every: int, window: bool) -> list[str]:
    """transformers' layer_types: without a window every layer full_attention; with one, layer i
    full_attention when (i + 1) % every == 0 (`model.global_every`; 0: every layer sliding)."""
    return ["sliding_attention" if window and (not every or (i + 1) % every) else "full_attention"
            for i in range(num_layers)]


def family_of(m: ModelConfig) -> str:
    """The model_type that expresses our dense model `m`; ConvertError naming what none of them has."""
    gemma = dict(GEMMA_KEYS)
    if any(getattr(m, k) != ModelConfig.__dataclass_fields__[k].default for k in gemma if k not in (
            "qk_norm", "qkv_bias")) or m.global_every or m.rope_local_theta or m.query_scale_dim:
        for key, want in GEMMA_KEYS:
            if getattr(m, key) != want:
                raise ConvertError(f"model.{key}={getattr(m, key)} with Gemma's numerics: Gemma3ForCausalLM has "
                                   f"{key}={want}; to-hf cannot export this dense model")
        if m.rope_scaling == "llama3":
            raise ConvertError("model.rope_scaling=llama3 has no place in Gemma3ForCausalLM (default or linear "
                               "rope); to-hf cannot export this dense model")
        return "gemma3_text"
    if m.sliding_window and (m.qkv_bias or m.qk_norm):
        raise ConvertError(f"model.sliding_window={m.sliding_window} with model.qkv_bias or model.qk_norm has no "
                           "place in MistralForCausalLM (a window, Llama's projections); to-hf cannot export it")
    if m.sliding_window:
        return "mistral"
    if m.qkv_bias and m.qk_norm:
        raise ConvertError("model.qkv_bias=true with model.qk_norm=true has no place in LlamaForCausalLM, "
                           "Qwen2ForCausalLM (q/k/v biases) or Qwen3ForCausalLM (q/k norms); to-hf cannot export "
                           "this dense model")
    return "qwen3" if m.qk_norm else "qwen2" if m.qkv_bias else "llama"


def common_config(m: ModelConfig, dtype: str) -> dict:
    """The `config.json` fields every family here writes alike (rope both as 4.x `rope_scaling` and 5.x
    `rope_parameters`); hf_config and hf_moe.hf_config add the family's."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_scaling == "llama3":
        rope.update(rope_type="llama3", factor=m.rope_scaling_factor, low_freq_factor=m.rope_low_freq_factor,
                    high_freq_factor=m.rope_high_freq_factor,
                    original_max_position_embeddings=m.rope_original_max_len)
    elif m.rope_scaling == "linear":
        rope.update(rope_type="linear", factor=m.rope_scaling_factor)
    elif m.rope_scaling == "yarn":
        rope.update(rope_type="yarn", factor=m.rope_scaling_factor,
                    original_max_position_embeddings=m.rope_original_max_len,
                    beta_fast=m.rope_yarn_beta_fast, beta_slow=m.rope_yarn_beta_slow, mscale=m.rope_yarn_mscale,
                    mscale_all_dim=m.rope_yarn_mscale_all_dim)
    return {
        "hidden_act": "silu", "hidden_size": m.d_model, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_kv_heads, "head_dim": m.resolved_head_dim,
        "intermediate_size": m.ffn_dim, "vocab_size": m.vocab_size, "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta, "rope_scaling": rope if m.rope_scaling != "none" else None,
        "rope_parameters": rope, "tie_word_embeddings": m.tie_embeddings, "attention_bias": False,
        "max_position_embeddings": max(m.rope_original_max_len, 8192), "torch_dtype": dtype, "dtype": dtype,
    }


def hf_config(m: ModelConfig, dtype: str) -> dict:
    """A transformers `config.json` for the dense model `m`, of the family `family_of(m)`."""
    kind = family_of(m)
    out = common_config(m, dtype)
    out.update(architectures=[FAMILIES[kind].architecture], model_type=kind)
    if kind == "gemma3_text":
        return gemma_hf_config(m, out)
    if kind == "llama":
        out["mlp_bias"] = False
    elif kind == "mistral":
        out["sliding_window"] = m.sliding_window
    else:
        out.update(use_sliding_window=False, sliding_window=None)
    if kind == "qwen2":
        out.pop("attention_bias")  # its q/k/v biases are not a setting
    return out


def gemma_hf_config(m: ModelConfig, common: dict) -> dict:
    """Gemma 3's `config.json` of our model `m` from `common_config`'s fields."""
    out = {k: v for k, v in common.items() if k not in ("hidden_act", "rope_theta", "rope_scaling")}
    full = out["rope_parameters"]
    local = {"rope_type": "default", "rope_theta": m.rope_local_theta} if m.rope_local_theta else full
    out.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=m.query_scale_dim or m.resolved_head_dim,
               # transformers builds the sliding mask even with no sliding layer: any window will do
               sliding_window=m.sliding_window or out["max_position_embeddings"],
               layer_types=gemma_layer_types(m.num_layers, m.global_every, bool(m.sliding_window)),
               rope_parameters={"full_attention": full, "sliding_attention": local},
               final_logit_softcapping=None, attn_logit_softcapping=None, use_bidirectional_attention=False)
    return out


# --------------------------------------------------------------------------------------------------
# Tensors: one table of rows (HF name, our path, index in our stack, kind, our shape of one slice)
# that both directions read; hf_moe.py builds its tables from the same rows.
# --------------------------------------------------------------------------------------------------

Row = tuple[str, tuple[str, ...], tuple[int, ...], str, tuple[int, ...]]

# kind -> (HF -> ours, ours -> HF, our shape -> HF shape) of one tensor (one layer, one expert); `s`
# is our shape of the slice. HF stores torch Linear weights [out, in]; ours are einsum weights [in, ...].
KINDS: dict[str, tuple[Callable, Callable, Callable]] = {
    "q": (lambda w, s: w.T.reshape(s), lambda w, s: w.reshape(s[0], -1).T, lambda s: (s[1] * s[2], s[0])),
    "o": (lambda w, s: w.T.reshape(s), lambda w, s: w.reshape(-1, s[2]).T, lambda s: (s[2], s[0] * s[1])),
    "linear": (lambda w, s: w.T, lambda w, s: w.T, lambda s: (s[1], s[0])),
    "vector": (lambda w, s: w, lambda w, s: w, lambda s: s),
    "bias": (lambda w, s: w.reshape(s), lambda w, s: w.reshape(-1), lambda s: (s[0] * s[1],)),
    "row": (lambda w, s: w[0], lambda w, s: w[None], lambda s: (1, s[0])),
    # DeepSeek-V3's MTP eh_proj [D, 2D] reads [embedding; hidden] (vLLM's deepseek_mtp, which runs the
    # released weights); ours [2D, D] reads [hidden; embedding] (the paper's order)
    "eh": (lambda w, s: np.concatenate([w[:, s[1]:], w[:, :s[1]]], axis=1).T,
           lambda w, s: np.concatenate([w[s[1]:].T, w[:s[1]].T], axis=1), lambda s: (s[1], s[0])),
}


def outer_rows(m: ModelConfig) -> list[Row]:
    """The embedding, the final norm and (untied) the output head."""
    rows = [("model.embed_tokens.weight", ("embed",), (), "vector", (m.vocab_size, m.d_model)),
            ("model.norm.weight", ("final_norm", "scale"), (), "vector", (m.d_model,))]
    if not m.tie_embeddings:
        rows.append(("lm_head.weight", ("lm_head",), (), "linear", (m.d_model, m.vocab_size)))
    return rows


def attention_rows(m: ModelConfig, layer: int, stack: str, i: int, qkv_bias: bool, qk_norm: bool) -> list[Row]:
    """HF layer `layer`'s attention and its two norms, at index `i` of our `stack` (`blocks`, `moe_blocks`)."""
    d, n, kv, h = m.d_model, m.num_heads, m.num_kv_heads, m.resolved_head_dim
    pre, at = f"model.layers.{layer}.", (stack, "attn")
    rows = [(pre + "self_attn.q_proj.weight", (*at, "wq"), (i,), "q", (d, n, h)),
            (pre + "self_attn.k_proj.weight", (*at, "wk"), (i,), "q", (d, kv, h)),
            (pre + "self_attn.v_proj.weight", (*at, "wv"), (i,), "q", (d, kv, h)),
            (pre + "self_attn.o_proj.weight", (*at, "wo"), (i,), "o", (n, h, d))]
    if qkv_bias:
        rows += [(pre + "self_attn.q_proj.bias", (*at, "bq"), (i,), "bias", (n, h)),
                 (pre + "self_attn.k_proj.bias", (*at, "bk"), (i,), "bias", (kv, h)),
                 (pre + "self_attn.v_proj.bias", (*at, "bv"), (i,), "bias", (kv, h))]
    if qk_norm:
        rows += [(pre + "self_attn.q_norm.weight", (*at, "q_norm", "scale"), (i,), "vector", (h,)),
                 (pre + "self_attn.k_norm.weight", (*at, "k_norm", "scale"), (i,), "vector", (h,))]
    norms = {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm"}
    if m.block_norms == "sandwich":  # Gemma: post_attention_layernorm is the attention's post-norm
        norms = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attn_norm",
                 "pre_feedforward_layernorm": "mlp_norm", "post_feedforward_layernorm": "post_mlp_norm"}
    return rows + [(f"{pre}{n}.weight", (stack, ours, "scale"), (i,), "vector", (d,)) for n, ours in norms.items()]


def mlp_rows(name: str, path: tuple[str, ...], index: tuple[int, ...], d: int, f: int,
             projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> list[Row]:
    """A gated MLP of width `f` whose HF module is `name` (its gate, up, down `projections`) at `path`/`index`."""
    gate, up, down = projections
    return [(f"{name}.{gate}.weight", (*path, "w_gate"), index, "linear", (d, f)),
            (f"{name}.{up}.weight", (*path, "w_up"), index, "linear", (d, f)),
            (f"{name}.{down}.weight", (*path, "w_down"), index, "linear", (f, d))]


def table(m: ModelConfig) -> list[Row]:
    """Every tensor of the dense model `m` (its biases and q/k norms as `m` has them)."""
    rows = outer_rows(m)
    for layer in range(m.num_layers):
        rows += attention_rows(m, layer, "blocks", layer, m.qkv_bias, m.qk_norm)
        rows += mlp_rows(f"model.layers.{layer}.mlp", ("blocks", "mlp"), (layer,), m.d_model, m.ffn_dim)
    return rows


def shapes(rows: list[Row]) -> dict[str, tuple[int, ...]]:
    """{HF name: HF shape} of `rows`."""
    return {name: tuple(KINDS[k][2](shape)) for name, _, _, k, shape in rows}


def expected_tensors(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name of the dense model `m` and its shape."""
    return shapes(table(m))


def params_from_rows(rows: list[Row], read: Callable[[str], np.ndarray]) -> dict:
    """Our float32 parameter tree from the HF tensors `read(name)` returns (checked by the caller)."""
    slices: dict[tuple[str, ...], dict[tuple[int, ...], np.ndarray]] = {}
    for name, path, index, k, shape in rows:
        slices.setdefault(path, {})[index] = KINDS[k][0](read(name), shape)
    params: dict = {}
    for path, parts in slices.items():
        node = params
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = _stack(parts)
    return params


def _stack(parts: dict[tuple[int, ...], np.ndarray]) -> np.ndarray:
    """The array whose slice at each index tuple is `parts[index]` (indices dense from 0)."""
    if () in parts:
        return parts[()]
    heads = sorted({i[0] for i in parts})
    return np.stack([_stack({i[1:]: a for i, a in parts.items() if i[0] == h}) for h in heads])


def params_from_hf(get: Callable[[str], np.ndarray], names: set[str], m: ModelConfig) -> dict:
    """Our float32 parameter tree of the dense model `m` from HF tensors (`get(name)` reads one; `names`:
    all in the checkpoint). Raises ConvertError naming the first missing, misshapen or unexpected tensor."""
    read = checked_reader(get, names, expected_tensors(m), m.tie_embeddings,
                          f"a {FAMILIES[family_of(m)].architecture}")
    return params_from_rows(table(m), read)


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


def hf_from_rows(rows: list[Row], params: dict, dtype: Any) -> dict[str, np.ndarray]:
    """HF tensors {name: array of `dtype`} of `rows` from our parameter tree (numpy); q/k/v biases the
    tree lacks are written as zeros (Qwen2-MoE always has them)."""
    out = {}
    for name, path, index, k, shape in rows:
        node: Any = params
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        w = np.zeros(shape, np.float32) if node is None and path[-1] in ("bq", "bk", "bv") else np.asarray(node)[index]
        out[name] = np.ascontiguousarray(KINDS[k][1](w, shape).astype(dtype))
    return out


def hf_from_params(params: dict, m: ModelConfig, dtype: Any) -> dict[str, np.ndarray]:
    """HF tensors {name: array of `dtype`} of the dense model `m` (`family_of(m)`) from our parameter tree."""
    family_of(m)
    return hf_from_rows(table(m), params, dtype)
