"""Resuming under a changed config (`lumen_jax.checkpoint.resume`), key by key: every key of the
`model` section (its `fp8` and `moe` tables included) is changed once against a checkpoint's JSON;
a change of the state's shapes is refused naming that key, any other change resumes.

resume.check reads JSON only, so a checkpoint here is its `meta/metadata` file: the base config and
the shapes of the state it builds (what the loop records at every save). The run-level cases (exit
code, one line, nothing moved) are in tests/train/test_bad_inputs.py and test_run_faults.py.
"""

import dataclasses
import json
import os

import jax
import pytest

from helpers.meshes import one_device_mesh
from lumen_jax.checkpoint import resume
from lumen_jax.checkpoint.layout import COMMITTED, meta_path
from lumen_jax.config import Config, ConfigError, Fp8Config, ModelConfig, MoeConfig, to_dict
from lumen_jax.train.build import build

STEP = 2
BASES = {
    "dense": ModelConfig(compute_dtype="float32"),
    "moe": ModelConfig(compute_dtype="float32", moe=MoeConfig(num_experts=4)),
    # delayed fp8 keeps amax histories (model state); with 3 layers the middle one runs fp8
    "fp8": ModelConfig(compute_dtype="float32", num_layers=3, fp8=Fp8Config(recipe="delayed", amax_history=16)),
    # local and global layers (Gemma 3's pattern)
    "window": ModelConfig(compute_dtype="float32", sliding_window=8, global_every=2),
    # multi-head latent attention (DeepSeek-V3)
    "mla": ModelConfig(compute_dtype="float32", num_kv_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                       v_head_dim=8),
}
# key: (base, new value, whether the state's arrays change). Every key of ModelConfig must be here.
CHANGES = {
    "model.d_model": ("dense", 128, True),
    "model.num_layers": ("dense", 4, True),
    "model.num_heads": ("dense", 8, True),
    "model.num_kv_heads": ("dense", 4, True),
    "model.head_dim": ("dense", 32, True),
    "model.ffn_dim": ("dense", 256, True),
    "model.vocab_size": ("dense", 1024, True),
    "model.tie_embeddings": ("dense", True, True),
    "model.qkv_bias": ("dense", True, True),
    "model.qk_norm": ("dense", True, True),
    "model.block_norms": ("dense", "sandwich", True),
    "model.sliding_window": ("dense", 8, False),
    "model.global_every": ("window", 3, False),
    "model.rope_local_theta": ("window", 10000.0, False),
    "model.query_scale_dim": ("dense", 32, False),
    "model.norm_scale": ("dense", "one_plus_weight", False),
    "model.mlp_activation": ("dense", "gelu_tanh", False),
    "model.embed_scale": ("dense", "sqrt_d_model", False),
    "model.norm_eps": ("dense", 1e-6, False),
    "model.rope_theta": ("dense", 10000.0, False),
    "model.rope_scaling": ("dense", "llama3", False),
    "model.rope_scaling_factor": ("dense", 4.0, False),
    "model.rope_low_freq_factor": ("dense", 2.0, False),
    "model.rope_high_freq_factor": ("dense", 8.0, False),
    "model.rope_original_max_len": ("dense", 4096, False),
    "model.init_std": ("dense", 0.01, False),
    "model.attention": ("dense", "flash", False),
    "model.flash_block_q": ("dense", 16, False),
    "model.flash_block_kv": ("dense", 16, False),
    "model.remat": ("dense", "full", False),
    "model.loss_chunk_tokens": ("dense", 16, False),
    "model.compute_dtype": ("dense", "bfloat16", False),
    "model.fp8.recipe": ("fp8", "current", True),  # drops the amax histories
    "model.fp8.amax_history": ("fp8", 32, True),
    "model.fp8.layers": ("fp8", ("mlp",), True),
    "model.fp8.keep_bf16": ("fp8", ("first",), False),  # every layer keeps a history; the kept ones idle
    "model.moe.num_experts": ("moe", 8, True),
    "model.moe.top_k": ("moe", 1, False),
    "model.moe.every_n_layers": ("moe", 2, True),
    "model.moe.capacity_factor": ("moe", 1.25, False),
    "model.moe.shared_experts": ("moe", 1, True),
    "model.moe.shared_gate": ("moe", True, True),
    "model.moe.router": ("moe", "sigmoid", False),
    "model.moe.normalize_top_k": ("moe", False, False),
    "model.moe.routed_scaling": ("moe", 2.5, False),
    "model.moe.groups": ("moe", 2, False),
    "model.moe.top_groups": ("moe", 2, False),
    "model.moe.balance": ("moe", "bias", True),  # adds the bias and load (model state)
    "model.moe.bias_update_rate": ("moe", 0.01, False),
    "model.moe.sequence_aux_loss_weight": ("moe", 0.0001, False),
    "model.moe.aux_loss_weight": ("moe", 0.1, False),
    "model.moe.router_z_loss_weight": ("moe", 0.0, False),
    "model.moe.expert_ffn_dim": ("moe", 64, True),
    "model.moe.first_dense_layers": ("moe", 1, True),
    "model.kv_lora_rank": ("mla", 32, True),
    "model.q_lora_rank": ("mla", 16, True),
    "model.qk_nope_head_dim": ("mla", 16, True),
    "model.qk_rope_head_dim": ("mla", 4, True),
    "model.v_head_dim": ("mla", 4, True),
    "model.mtp_depth": ("dense", 1, True),
    "model.mtp_loss_weight": ("dense", 0.1, False),
    "model.rope_yarn_beta_fast": ("dense", 16.0, False),
    "model.rope_yarn_beta_slow": ("dense", 2.0, False),
    "model.rope_yarn_mscale": ("dense", 0.7, False),
    "model.rope_yarn_mscale_all_dim": ("dense", 0.7, False),
}


def model_keys(cls=ModelConfig, prefix: str = "model.") -> list[str]:
    """Every key of the model section, its sub-tables' keys dotted."""
    out = []
    for f in dataclasses.fields(cls):
        default = cls.__dataclass_fields__[f.name].default_factory  # sub-tables are default factories
        if dataclasses.is_dataclass(default):
            out += model_keys(default, f"{prefix}{f.name}.")
        else:
            out.append(prefix + f.name)
    return out


def changed(model: ModelConfig, key: str, value) -> ModelConfig:
    *tables, name = key.split(".")[1:]
    if not tables:
        return dataclasses.replace(model, **{name: value})
    table = getattr(model, tables[0])
    return dataclasses.replace(model, **{tables[0]: dataclasses.replace(table, **{name: value})})


def abstract_state(model: ModelConfig):
    return build(Config(model=model), one_device_mesh()).abstract_state()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{base: checkpoint dir}: each with the meta JSON of a step-2 checkpoint of that base."""
    out = {}
    for name, model in BASES.items():
        directory = str(tmp_path_factory.mktemp(name))
        os.makedirs(os.path.dirname(meta_path(directory, STEP)))
        with open(meta_path(directory, STEP), "w") as f:
            json.dump({"config": to_dict(Config(model=model)),
                       "state_shapes": resume.state_shapes(abstract_state(model))}, f)
        open(os.path.join(directory, str(STEP), COMMITTED), "w").close()  # as Orbax commits a step
        out[name] = directory
    return out


def test_the_table_holds_every_model_key():
    assert sorted(CHANGES) == sorted(model_keys())


@pytest.mark.parametrize("key", list(CHANGES))
def test_every_model_key_on_resume(key, checkpoints):
    base, value, reshapes = CHANGES[key]
    new = changed(BASES[base], key, value)
    state = abstract_state(new)
    differs = resume.state_shapes(state) != resume.state_shapes(abstract_state(BASES[base]))
    assert differs == reshapes, f"the table says {key}={value!r} {'changes' if reshapes else 'keeps'} the state"
    config = to_dict(Config(model=new))
    if not reshapes:
        assert resume.check(config, checkpoints[base], state, "RUN") == STEP
        return
    with pytest.raises(ConfigError) as e:
        resume.check(config, checkpoints[base], state, "RUN")
    message = str(e.value)
    assert message.startswith(f"{key}: checkpoint ") and f"resume with {key}=" in message, message
    assert "\n" not in message


def test_a_shape_change_no_key_explains_is_still_refused(checkpoints, monkeypatch):
    """A shape key taken for a numeric one (as model.num_kv_heads was in a review) must not let the
    restore try the checkpoint (which would fail and move it aside as corrupt): the first array
    whose shape differs is named instead."""
    monkeypatch.setattr(resume, "_NUMERIC_MODEL_KEYS", resume._NUMERIC_MODEL_KEYS | {"model.num_kv_heads"})
    new = changed(BASES["dense"], "model.num_kv_heads", 4)
    with pytest.raises(ConfigError) as e:
        resume.check(to_dict(Config(model=new)), checkpoints["dense"], abstract_state(new), "RUN")
    message = str(e.value)
    assert "['wk']: checkpoint [2, 64, 2, 16], now [2, 64, 4, 16]" in message, message
    assert meta_path(checkpoints["dense"], STEP) in message and "\n" not in message
