"""Small random Hugging Face models (transformers, CPU torch: Llama, Qwen2, Qwen3, Mistral, Gemma 3, Mixtral,
Qwen2-MoE, Qwen3-MoE, DeepSeek-V3) and a run directory's logits, for the converter and generation tests. torch is imported
only inside these functions."""

import json
import os
import shutil
from typing import Callable

import jax
import numpy as np

from helpers.tolerances import FP32_RTOL
from lumen_jax.checkpoint import weights
from lumen_jax.model import abstract_model, apply

TOKENS = np.array([[5, 17, 60, 3, 88, 41, 12, 7, 93, 30, 2, 64, 19, 75, 8, 50, 33, 90, 1, 44]], np.int32)
HF_KW = dict(vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=128,
             rope_parameters={"rope_type": "llama3", "rope_theta": 100.0, "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64})


def make_hf(path: str, tied: bool, max_shard_size: str | None = None) -> str:
    return _save_random(path, "LlamaConfig", "LlamaForCausalLM", {**HF_KW, "tie_word_embeddings": tied}, 1 + tied,
                        max_shard_size)


def _save_random(path: str, config_cls: str, model_cls: str, kw: dict, seed: int,
                 max_shard_size: str | None = None, router_bias: float = 0.0) -> str:
    """A random transformers `model_cls` of `config_cls(**kw)` written with save_pretrained: norms,
    biases and routers randomised too (norm weights start at 1 and biases at 0, so a misplaced one
    would not show; a router of near-uniform scores would hide a wrong routing); with `router_bias`,
    DeepSeek-V3's selection bias (a buffer, zeros in a fresh model) random of that scale too."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.3 if "norm" in name else 1.0 if name.endswith("gate.weight") else 0.05
            p.add_(torch.randn_like(p) * scale)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * router_bias)
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return path


# Tiny dense models (2 layers, d_model 64, GQA, plain rope): Qwen3 (q/k norms) with a head_dim
# that is not d_model / heads, untied and tied; Qwen2 (q/k/v biases); Mistral (a sliding window); Gemma 3.
DENSE_KW = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=128,
                rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
DENSE_MODELS = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=False)),
    "qwen3_tied": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    # A window of 6 keys binds over TOKENS' 20 and over generation's prompts and new tokens.
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=6, tie_word_embeddings=False)),
    # Gemma 3: 7 layers in its pattern (5 sliding, 1 full, 1 sliding) with a window of 4 keys, each kind
    # its own rope (the full layers' linearly scaled), queries scaled by 24**-0.5 (not head_dim 32's), tied.
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=7, head_dim=32, sliding_window=4, query_pre_attn_scalar=24, tie_word_embeddings=True,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}})),
}


def make_hf_dense(path: str, kind: str) -> str:
    """A random `kind` (DENSE_MODELS) written with save_pretrained."""
    config_cls, model_cls, extra = DENSE_MODELS[kind]
    return _save_random(path, config_cls, model_cls, {**DENSE_KW, **extra}, 5)


# Tiny mixtures of experts: 8 experts, top-2; Qwen2-MoE of 3 layers with two dense ones first
# (decoder_sparse_step 3), a shared expert twice an expert's width and unrenormalised top-k; Qwen3-MoE
# renormalised.
MOE_KW = {k: v for k, v in HF_KW.items() if k != "rope_parameters"}
MOE_KW.update(num_experts_per_tok=2, rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
MOE_MODELS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=8, intermediate_size=24)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=8, moe_intermediate_size=16, shared_expert_intermediate_size=32,
                       num_hidden_layers=3, decoder_sparse_step=3, norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_experts=8, moe_intermediate_size=16,
                                                                 norm_topk_prob=True)),
}


# Tiny DeepSeek-V3s: latent attention (kv rank 16, rope 8 + nope 16 q/k dims, values 12 wide), the first
# layer dense, then MoE layers of 8 sigmoid-scored experts in 4 groups (2 kept), top-2, a shared expert,
# routed scaling 2.5; one with a query latent and interleaved rope, one with neither.
DEEPSEEK_KW = dict(vocab_size=320, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
                   routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12,
                   qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
                   rms_norm_eps=1e-6, max_position_embeddings=128,
                   rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
DEEPSEEK_MODELS = {"deepseek_v3": {}, "deepseek_v3_plain_q": dict(q_lora_rank=None, rope_interleave=False,
                                                                   first_k_dense_replace=2, num_hidden_layers=4),
                   # YaRN as the released 671B has it (factor 40 over 4k), scaled down: 4 over 8 positions,
                   # the two mscales apart so that the rotated dims and the scores are both scaled
                   "deepseek_v3_yarn": dict(rope_parameters={
                       "rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "original_max_position_embeddings": 8,
                       "beta_fast": 32, "beta_slow": 1, "mscale": 0.8, "mscale_all_dim": 0.6})}


def make_hf_deepseek(path: str, kind: str) -> str:
    """A random DeepSeek-V3 `kind` (DEEPSEEK_MODELS) written with save_pretrained, its routers' selection
    bias (e_score_correction_bias) random and as large as the sigmoid scores, so that it changes which
    experts (and groups) are chosen, as a trained checkpoint's does."""
    return _save_random(path, "DeepseekV3Config", "DeepseekV3ForCausalLM", {**DEEPSEEK_KW, **DEEPSEEK_MODELS[kind]}, 7,
                        router_bias=0.5)


def make_hf_moe(path: str, kind: str, max_shard_size: str | None = None) -> str:
    """A random `kind` (MOE_MODELS) written with save_pretrained."""
    config_cls, model_cls, extra = MOE_MODELS[kind]
    return _save_random(path, config_cls, model_cls, {**MOE_KW, **extra}, 3, max_shard_size)


def imported(root: str, tied: bool, name: str) -> tuple[str, str]:
    """(HF dir, run dir): a small random Llama written with transformers under `root`, converted with from-hf."""
    from lumen_jax.convert.__main__ import main as convert

    hf_dir = make_hf(os.path.join(root, "hf"), tied=tied)
    assert convert(["from-hf", "--hf-dir", hf_dir, "--out", os.path.join(root, name)]) == 0
    return hf_dir, os.path.join(root, name)


def import_each(root: str, make: Callable[[str, str], str], kinds: list[str]) -> dict[str, tuple]:
    """{kind: (HF dir `make(root/kind, kind)`, the run dir from-hf makes of it, transformers' logits of TOKENS)}."""
    from lumen_jax.convert.__main__ import main as convert

    out = {}
    for kind in kinds:
        hf_dir = make(os.path.join(root, kind), kind)
        run_dir = os.path.join(root, f"{kind}_run")
        assert convert(["from-hf", "--hf-dir", hf_dir, "--out", run_dir]) == 0
        out[kind] = (hf_dir, run_dir, hf_logits(hf_dir, TOKENS))
    return out


def logits_close(ours: np.ndarray, ref: np.ndarray) -> bool:
    """Equal in float32: FP32_RTOL relative, and FP32_RTOL of the largest |logit| absolute."""
    return np.allclose(ours, ref, rtol=FP32_RTOL, atol=FP32_RTOL * float(np.abs(ref).max()))


def hf_logits(hf_dir: str, tokens: np.ndarray) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()


def our_params(run_dir: str) -> tuple:
    """(model config, parameters on one device) of the run's latest checkpoint."""
    step = weights.resolve_step(run_dir, None)
    cfg = weights.read_config(run_dir, step)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    a = abstract_model(cfg.model)
    return cfg.model, weights.load_params(run_dir, step, jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=one), a.params))


def our_model_state(run_dir: str) -> dict:
    """The non-parameter model state (a router's selection bias) of the run's latest checkpoint, on one
    device, as generate and evaluate read it (zeros where it holds none)."""
    step = weights.resolve_step(run_dir, None)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    a = abstract_model(weights.read_config(run_dir, step).model)
    return weights.load_model_state(run_dir, step, jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=one), a.state))


# One program per model (the graph static): eager, each of the forward's many small ops compiles on its own,
# and a control (other weights, the state zeroed) of the same model reuses the program.
_apply = jax.jit(lambda graphdef, params, tokens, positions, state: apply(graphdef, params, tokens, positions,
                                                                           state=state), static_argnums=0)


def logits_of(model_cfg, params: dict, tokens: np.ndarray, state: dict | None = None) -> np.ndarray:
    """Our logits of `tokens`; `state`: the model state (None: zeros, as a run starts)."""
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    a = abstract_model(model_cfg)
    if state is None:
        state = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), a.state)
    return np.asarray(_apply(a.graphdef, params, tokens, positions, state))


def our_logits(run_dir: str, tokens: np.ndarray) -> np.ndarray:
    return logits_of(*our_params(run_dir), tokens, our_model_state(run_dir))


def tensors(folder: str) -> dict[str, np.ndarray]:
    """Every tensor of the safetensors files in `folder`."""
    from safetensors.numpy import load_file

    files = [f for f in os.listdir(folder) if f.endswith(".safetensors")]
    return {k: v for f in files for k, v in load_file(os.path.join(folder, f)).items()}


def assert_to_hf_round_trips(hf_dir: str, run_dir: str, ref: np.ndarray, back: str) -> tuple[dict, dict]:
    """`convert to-hf` of the import `run_dir` into `back` gives every tensor of `hf_dir` bit for bit and
    its architecture, and transformers' logits of TOKENS from it equal `ref`; returns both config.json."""
    from lumen_jax.convert.__main__ import main as convert

    assert convert(["to-hf", "--run-dir", run_dir, "--out", back]) == 0
    original, exported = tensors(hf_dir), tensors(back)
    assert sorted(exported) == sorted(original)
    for k in original:
        np.testing.assert_array_equal(exported[k], original[k], err_msg=k)
    config, source = (json.load(open(os.path.join(d, "config.json"))) for d in (back, hf_dir))
    assert (config["architectures"], config["model_type"]) == (source["architectures"], source["model_type"])
    assert config["max_position_embeddings"] == source["max_position_embeddings"]  # the import's context, back
    np.testing.assert_allclose(hf_logits(back, TOKENS), ref, rtol=FP32_RTOL, atol=FP32_RTOL * float(np.abs(ref).max()))
    return config, source


def from_hf_refusal(src: str, root: str, change: dict, capsys) -> str:
    """The one error line of `convert from-hf` (exit 2, nothing written) of a copy of `src` under `root`
    whose config.json has `change`."""
    from lumen_jax.convert.__main__ import main as convert

    hf_dir, out = os.path.join(root, "hf"), os.path.join(root, "run")
    shutil.copytree(src, hf_dir)
    raw = json.load(open(os.path.join(hf_dir, "config.json")))
    json.dump({**raw, **change}, open(os.path.join(hf_dir, "config.json"), "w"))
    assert convert(["from-hf", "--hf-dir", hf_dir, "--out", out]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    assert not os.path.exists(out)
    return err


def hf_greedy(hf_dir: str, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' `generate(do_sample=False)`: the new token ids (EOS does not stop it)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def add_tokenizer(hf_dir: str) -> str:
    """Writes a small byte-level BPE `tokenizer.json` (300 ids, `<s>`/`</s>`) into `hf_dir`; returns its path."""
    import glob

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "json", "*.py"))), trainer)
    path = os.path.join(hf_dir, "tokenizer.json")
    tok.save(path)
    return path
