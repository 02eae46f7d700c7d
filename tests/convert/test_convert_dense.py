"""Qwen3, Qwen2, Mistral and Gemma 3 dense import and export against `transformers` itself (CPU torch):
logits and a swapped-norms / dropped-biases / no-window / each-Gemma-feature-dropped control, greedy
generation, the round trip, real models' config.json, bad inputs. One small random model per layout
(helpers.hf.DENSE_MODELS: Qwen3 untied and tied with a head_dim that is not d_model / heads, Qwen2 with q/k/v
biases, Mistral with a sliding window of 6 keys, Gemma 3 of 7 layers in its local/global pattern), written
with `save_pretrained`."""

import dataclasses
import os

import jax
import numpy as np
import pytest

from helpers.hf import (DENSE_MODELS, TOKENS, assert_to_hf_round_trips, from_hf_refusal, hf_greedy, hf_logits,
                        import_each, logits_close, logits_of, make_hf_dense, our_params)
from helpers.tolerances import FP32_RTOL
from lumen_jax.convert import hf
from lumen_jax.convert.__main__ import main as convert
from lumen_jax.generate import main as generate

KINDS = list(DENSE_MODELS)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """{kind: (HF dir, run dir imported with from-hf, transformers' logits of TOKENS)}."""
    return import_each(str(tmp_path_factory.mktemp("hf_dense")), make_hf_dense, KINDS)


def _control(params: dict, kind: str) -> dict:
    """`params` with what the family adds to Llama misplaced: q_norm and k_norm swapped (Qwen3), the
    q/k/v biases dropped (Qwen2); Mistral's window is the model's, not the parameters' (its control
    drops the window from the model instead; Gemma's control is `GEMMA_DROPPED`)."""
    if kind in ("mistral", "gemma3"):
        return params
    attn = dict(params["blocks"]["attn"])
    if kind.startswith("qwen3"):
        attn["q_norm"], attn["k_norm"] = attn["k_norm"], attn["q_norm"]
    else:
        attn.update({b: np.zeros_like(attn[b]) for b in ("bq", "bk", "bv")})
    return {**params, "blocks": {**params["blocks"], "attn": attn}}


@pytest.mark.parametrize("kind", KINDS)
def test_from_hf_logits_match_transformers_and_a_misplaced_norm_or_bias_does_not(imported, kind):
    _, run_dir, ref = imported[kind]
    model, params = our_params(run_dir)
    assert (model.qk_norm, model.qkv_bias, model.tie_embeddings, model.resolved_head_dim, model.sliding_window) == {
        "qwen3": (True, False, False, 32, 0), "qwen3_tied": (True, False, True, 32, 0),
        "qwen2": (False, True, False, 16, 0), "mistral": (False, False, False, 16, 6),
        "gemma3": (True, False, True, 32, 4)}[kind]
    ours = logits_of(model, params, TOKENS)
    np.testing.assert_allclose(ours, ref, rtol=FP32_RTOL, atol=FP32_RTOL * float(np.abs(ref).max()))
    control = dataclasses.replace(model, sliding_window=0) if kind == "mistral" else model
    if kind == "gemma3":
        control = dataclasses.replace(model, **GEMMA_DROPPED["norm +1"])
    assert not logits_close(logits_of(control, _control(params, kind), TOKENS), ref)


# Each of Gemma 3's features dropped alone, on the imported random Gemma 3: its logits must move.
GEMMA_DROPPED = {
    "norm +1": dict(norm_scale="weight"), "embedding scale": dict(embed_scale="none"),
    "query scale": dict(query_scale_dim=0), "geglu": dict(mlp_activation="silu"),
    "global layers": dict(global_every=0, rope_local_theta=0.0), "local rope": dict(rope_local_theta=0.0),
    "linear rope": dict(rope_scaling="none"), "sandwich norms": dict(block_norms="pre"),
}


def test_gemma3_import_reads_its_pattern_and_numerics(imported):
    model, _ = our_params(imported["gemma3"][1])
    assert (model.global_every, model.rope_theta, model.rope_scaling, model.rope_scaling_factor,
            model.rope_local_theta, model.query_scale_dim, model.norm_scale, model.block_norms, model.mlp_activation,
            model.embed_scale) == (6, 1e4, "linear", 4.0, 100.0, 24, "one_plus_weight", "sandwich", "gelu_tanh",
                                   "sqrt_d_model")


@pytest.mark.parametrize("feature", list(GEMMA_DROPPED))
def test_gemma3_logits_need_each_of_its_features(imported, feature):
    _, run_dir, ref = imported["gemma3"]
    model, params = our_params(run_dir)
    if feature == "sandwich norms":
        params = {**params, "blocks": {k: v for k, v in params["blocks"].items() if not k.startswith("post_")}}
    assert not logits_close(logits_of(dataclasses.replace(model, **GEMMA_DROPPED[feature]), params, TOKENS), ref)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_generate_equals_transformers(imported, kind, capsys):
    hf_dir, run_dir, _ = imported[kind]
    prompt = [5, 17, 60, 3, 88]
    assert generate(["--run-dir", run_dir, "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", "8"]) == 0
    ours = [int(t) for t in capsys.readouterr().out.split()]
    assert ours == hf_greedy(hf_dir, prompt, 8)


@pytest.mark.parametrize("kind", KINDS)
def test_to_hf_round_trips_every_tensor_and_transformers_loads_it(imported, kind, tmp_path):
    assert_to_hf_round_trips(*imported[kind], str(tmp_path / "back"))


# Real models' config.json as the hub serves them (transformers 4.x spelling), the ids shortened.
QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151643,
    "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02, "intermediate_size": 4864,
    "max_position_embeddings": 32768, "max_window_layers": 24, "model_type": "qwen2", "num_attention_heads": 14,
    "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}
QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02,
    "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}


# google/gemma-3-1b-pt's config.json (4.x spelling: rope_local_base_freq, sliding_window_pattern, no layer_types).
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": 1,
    "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
    "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768,
    "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
    "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0", "use_cache": True, "vocab_size": 262144,
}


def test_real_gemma3_config_maps_onto_its_pattern():
    """Gemma 3 1B: 26 layers (not a multiple of 6), 5 local then 1 global, each kind its rope base."""
    g = hf.model_config(GEMMA3_1B, "bfloat16")
    assert (g.num_layers, g.global_every, g.sliding_window, g.rope_theta, g.rope_local_theta, g.rope_scaling,
            g.query_scale_dim, g.resolved_head_dim, g.num_kv_heads, g.tie_embeddings) == (
        26, 6, 512, 1e6, 1e4, "none", 256, 256, 1, True)
    assert hf.family_of(g) == "gemma3_text"
    assert hf.hf_config(g, "bfloat16")["layer_types"] == [
        "full_attention" if i in (5, 11, 17, 23) else "sliding_attention" for i in range(26)]


def test_real_qwen_configs_map_onto_qkv_bias_and_qk_norm():
    """Qwen2.5-0.5B and Qwen3-0.6B's config.json (an inactive sliding_window, 4.x rope_theta) convert."""
    q2, q3 = hf.model_config(QWEN25_05B, "bfloat16"), hf.model_config(QWEN3_06B, "bfloat16")
    assert (q2.qkv_bias, q2.qk_norm, q2.tie_embeddings, q2.resolved_head_dim, q2.num_kv_heads, q2.rope_theta) == (
        True, False, True, 64, 2, 1e6)
    assert (q3.qkv_bias, q3.qk_norm, q3.head_dim, q3.d_model, q3.num_layers, q3.rope_scaling) == (
        False, True, 128, 1024, 28, "none")
    assert (hf.family_of(q2), hf.family_of(q3)) == ("qwen2", "qwen3")


BAD = {
    "sliding window": ("qwen2", {"use_sliding_window": True, "sliding_window": 64},
                       "config.json use_sliding_window=True is not supported (only False)"),
    "sliding layers": ("qwen3", {"layer_types": ["full_attention", "sliding_attention"]},
                       "config.json layer_types=['full_attention', 'sliding_attention'] is not supported"),
    "o_proj bias": ("qwen3", {"attention_bias": True}, "config.json attention_bias=True is not supported"),
    "unknown field": ("qwen2", {"rope_interleaved": True}, "config.json field rope_interleaved=True is not understood"),
    "architecture": ("qwen3", {"architectures": ["Qwen3ForSequenceClassification"]},
                     "model_type='qwen3' with architectures=['Qwen3ForSequenceClassification'] is not supported"),
    "final softcap": ("gemma3", {"final_logit_softcapping": 30.0},
                      "config.json final_logit_softcapping=30.0 is not supported (only None)"),
    "attention softcap": ("gemma3", {"attn_logit_softcapping": 50.0},
                          "config.json attn_logit_softcapping=50.0 is not supported (only None)"),
    "gemma layer pattern": ("gemma3", {"layer_types": ["full_attention"] + ["sliding_attention"] * 6},
                            "is not n-1 sliding_attention layers then one full_attention, repeated"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_from_hf_bad_dense_config_exits_2_with_one_line(imported, tmp_path, capsys, case):
    kind, change, fragment = BAD[case]
    err = from_hf_refusal(imported[kind][0], str(tmp_path), change, capsys)
    assert fragment in err, err


def test_to_hf_refuses_qk_norm_with_qkv_bias(tmp_path, capsys):
    """No dense family has both: one line, exit 2, nothing written."""
    from lumen_jax.checkpoint import weights
    from lumen_jax.config import Config, ModelConfig
    from lumen_jax.model import init_params

    cfg = Config(model=ModelConfig(d_model=16, num_layers=1, num_heads=2, num_kv_heads=1, ffn_dim=16, vocab_size=32,
                                   qkv_bias=True, qk_norm=True))
    run_dir, back = str(tmp_path / "run"), str(tmp_path / "back")
    weights.save_weights(run_dir, cfg, jax.jit(init_params, static_argnums=(0, 1))(cfg.model, 0))
    assert convert(["to-hf", "--run-dir", run_dir, "--out", back]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: model.qkv_bias=true with model.qk_norm=true has no place in LlamaForCausalLM") and (
        "\n" not in err), err
    assert not os.path.exists(back)


@pytest.mark.parametrize("layout", ["pattern", "all global", "all local"])
def test_to_hf_of_our_gemma_layouts_loads_in_transformers_and_imports_back(tmp_path, layout):
    """configs/tiny_gemma3.yaml (random weights, norms away from 0) exported as Gemma3ForCausalLM: 5 local
    then 1 global, every layer global (no window: transformers still needs a sliding_window, which binds
    nothing), every layer local. transformers' logits are ours; from-hf of the export is the same model."""
    from lumen_jax.checkpoint import weights
    from lumen_jax.config.files import load_config
    from lumen_jax.model import init_params

    cfg = load_config(os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tiny_gemma3.yaml"))
    change = {"pattern": {}, "all global": dict(sliding_window=0, global_every=0, rope_local_theta=0.0),
              "all local": dict(global_every=0, rope_local_theta=0.0)}[layout]
    model = dataclasses.replace(cfg.model, compute_dtype="float32", **change)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: a + 0.05 * rng.standard_normal(a.shape).astype(a.dtype),
                          jax.jit(init_params, static_argnums=(0, 1))(model, 0))
    run_dir, back, again = (str(tmp_path / name) for name in ("run", "hf", "again"))
    weights.save_weights(run_dir, cfg.replace(model=model), params)
    assert convert(["to-hf", "--run-dir", run_dir, "--out", back]) == 0
    ref = logits_of(model, params, TOKENS)
    assert logits_close(hf_logits(back, TOKENS), ref)
    assert convert(["from-hf", "--hf-dir", back, "--out", again]) == 0
    assert our_params(again)[0] == model


def test_init_from_a_gemma_takes_its_numerics(imported, tmp_path):
    """train.init_from of the Hugging Face Gemma 3 takes its window, pattern, ropes and numerics (the
    shape keys must match it, block_norms among them), so fine-tuning runs Gemma's layer, not Llama's."""
    from lumen_jax.config import Config
    from lumen_jax.train.init_from import defined_by_init_from

    hf_dir, run_dir, _ = imported["gemma3"]
    model = our_params(run_dir)[0]
    shape = {k: getattr(model, k) for k in ("d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "ffn_dim",
                                            "vocab_size", "qk_norm", "block_norms", "tie_embeddings")}
    cfg = Config(model=dataclasses.replace(Config().model, **shape))
    cfg = cfg.replace(train=dataclasses.replace(cfg.train, init_from=hf_dir))
    got = defined_by_init_from(cfg, str(tmp_path / "fresh"))[0].model
    assert got == dataclasses.replace(model, compute_dtype=got.compute_dtype, attention=got.attention)


def test_mistral_decodes_from_a_ring_of_its_window_as_transformers(imported):
    """Every Mistral layer has the window (6 keys), so the cache is a ring of 6 slots, not the 16 of a
    prompt of 9 plus 7 new tokens: prefill keeps the prompt's last 6 keys, each new token overwrites the
    one that left the window. Each token's logits equal transformers' forward of the whole sequence, for
    the long prompt alone and left-padded in a batch with a short one (padding inside the ring)."""
    from lumen_jax.checkpoint import weights
    from lumen_jax.generate import ONE_DEVICE, Generator, Sampling
    from lumen_jax.model import decode

    hf_dir, run_dir, _ = imported["mistral"]
    loaded = weights.load_onto_mesh(run_dir, None, base_mesh=ONE_DEVICE)
    prompts, new = [[5, 17, 60, 3, 88, 41, 12, 9, 30], [70, 2, 9]], 7
    gen = Generator(loaded, Sampling())
    batch, logits = gen.generate(prompts, new, return_logits=True)
    for row, (prompt, tokens) in enumerate(zip(prompts, batch)):
        ref = hf_logits(hf_dir, np.array([prompt + tokens]))[0, len(prompt) - 1:-1]
        np.testing.assert_allclose(logits[row], ref, rtol=FP32_RTOL, atol=FP32_RTOL * float(np.abs(ref).max()))
    assert batch[0] == gen.generate(prompts[:1], new)[0] == hf_greedy(hf_dir, prompts[0], new)
    model = weights.read_config(run_dir, weights.resolve_step(run_dir, None)).model
    assert (decode.cache_length(model, 16), decode.cache_length(dataclasses.replace(model, global_every=2), 16)) == (6, 16)
