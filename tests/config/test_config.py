"""lumen_jax.config: loading (YAML, gin, base:, overrides), strict types, validation. No JAX."""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import yaml

from helpers.paths import REPO as ROOT
from lumen_jax import config as C
from lumen_jax.config import Config, ConfigError, from_dict, show, to_dict
from lumen_jax.config.checks import validate
from lumen_jax.config.files import load_config

CONFIGS = os.path.join(ROOT, "configs")

# Device counts each shipped file is sized for (see the comment at the top of each file).
DEVICES = {"base": 8, "tiny": 8, "llama3_1b": 64, "llama3_8b": 64, "llama3_70b": 512, "llama3_405b": 16384,
           "tiny_moe": 8, "mixtral_8x7b": 64, "qwen3_30b_a3b": 64, "qwen3_8b": 64, "tiny_qwen3": 8,
           "mistral_7b": 64, "tiny_mistral": 8, "gemma3_12b": 64, "tiny_gemma3": 8,
           "deepseek_v3": 1024, "tiny_deepseek_v3": 8}


def cfg_path(name: str) -> str:
    return os.path.join(CONFIGS, name)


def write(tmp_path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return str(p)


def with_(cfg: Config, **changes: dict) -> Config:
    """cfg with some section fields replaced: with_(cfg, model=dict(num_heads=8))."""
    return cfg.replace(**{s: dataclasses.replace(getattr(cfg, s), **kw) for s, kw in changes.items()})


def error(fn, *args) -> str:
    with pytest.raises(ConfigError) as e:
        fn(*args)
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


TINY = load_config(cfg_path("tiny.yaml"))


# --------------------------------------------------------------------------------------------------
# Shipped files
# --------------------------------------------------------------------------------------------------

def test_every_config_file_loads_and_validates():
    files = sorted(glob.glob(os.path.join(CONFIGS, "*.yaml")) + glob.glob(os.path.join(CONFIGS, "*.gin")))
    names = {os.path.splitext(os.path.basename(f))[0] for f in files}
    assert names == set(DEVICES), "add each new config file to DEVICES with the device count it is sized for"
    for f in files:
        cfg = load_config(f)
        assert cfg.name == os.path.splitext(os.path.basename(f))[0]
        shape = validate(cfg, DEVICES[cfg.name])
        assert math.prod(shape.values()) == DEVICES[cfg.name]


def test_base_yaml_lists_every_default():
    assert to_dict(load_config(cfg_path("base.yaml"))) == {**to_dict(Config()), "name": "base"}
    with open(cfg_path("base.yaml")) as f:
        raw = yaml.safe_load(f)
    assert {s: set(v) for s, v in raw.items()} == {s: set(v) for s, v in to_dict(Config()).items()
                                                 if s != "name"}


def test_tiny_values():
    m, d = TINY.model, TINY.data
    assert (m.d_model, m.num_layers, m.num_heads, m.num_kv_heads, m.ffn_dim, m.vocab_size) == (64, 2, 4, 2, 172, 512)
    assert m.compute_dtype == "float32"
    assert (d.seq_len, d.global_batch_size, TINY.train.steps) == (128, 16, 100)
    assert TINY.runtime.cpu_devices == 8 and TINY.mesh.fsdp == -1
    assert TINY.optim.lr == 3e-3 and isinstance(TINY.optim.lr, float) and TINY.optim.warmup_steps == 10
    assert validate(TINY, 8) == {"data": 1, "fsdp": 8, "pipeline": 1, "expert": 1, "context": 1, "tensor": 1}


def test_llama_presets_shapes():
    expect = {"llama3_1b": (2048, 16, 32, 8, 8192), "llama3_8b": (4096, 32, 32, 8, 14336),
              "llama3_70b": (8192, 80, 64, 8, 28672), "llama3_405b": (16384, 126, 128, 8, 53248)}
    for name, shape in expect.items():
        m = load_config(cfg_path(f"{name}.yaml")).model
        assert (m.d_model, m.num_layers, m.num_heads, m.num_kv_heads, m.ffn_dim) == shape
        assert m.vocab_size == 128256 and m.rope_scaling == "llama3" and m.compute_dtype == "bfloat16"
        assert m.resolved_head_dim == 128 if name != "llama3_1b" else m.resolved_head_dim == 64
    one_b = load_config(cfg_path("llama3_1b.yaml")).model
    assert one_b.tie_embeddings and one_b.rope_scaling_factor == 32.0


def test_qwen3_presets():
    """Qwen3-8B's shape (8.19B parameters with its untied head, as published: 8.2B) and its tiny
    sibling: the same layer options on tiny.yaml's shape."""
    from lumen_jax.metrics import flops

    m = load_config(cfg_path("qwen3_8b.yaml")).model
    assert (m.d_model, m.num_layers, m.num_heads, m.num_kv_heads, m.resolved_head_dim, m.ffn_dim, m.vocab_size) == (
        4096, 36, 32, 8, 128, 12288, 151936)
    assert m.qk_norm and not m.tie_embeddings and m.rope_theta == 1e6 and m.norm_eps == 1e-6
    assert abs(flops.param_counts(m)["total"] - 8.19e9) <= 0.01e9
    tiny = load_config(cfg_path("tiny_qwen3.yaml")).model
    assert tiny.qk_norm and not tiny.tie_embeddings and tiny.resolved_head_dim == 32 and tiny.d_model == TINY.model.d_model


def test_mistral_presets():
    """Mistral-7B-v0.1's shape (7.24B parameters, published: 7.3B; 7,241,732,096 by hand: 32 layers
    of 4096 x (4096 + 1024 + 1024 + 4096) + 3 x 4096 x 14336 + 2 x 4096, two 32000 x 4096 tables,
    4096) with its 4,096-key window, and the tiny sibling's window, which binds at its 128 tokens."""
    from lumen_jax.metrics import flops

    m = load_config(cfg_path("mistral_7b.yaml")).model
    assert (m.d_model, m.num_layers, m.num_heads, m.num_kv_heads, m.resolved_head_dim, m.ffn_dim, m.vocab_size,
            m.sliding_window) == (4096, 32, 32, 8, 128, 14336, 32000, 4096)
    assert not m.tie_embeddings and m.rope_theta == 1e4 and m.norm_eps == 1e-5 and m.rope_scaling == "none"
    assert flops.param_counts(m)["total"] == 7_241_732_096
    tiny = load_config(cfg_path("tiny_mistral.yaml"))
    assert 0 < tiny.model.sliding_window < tiny.data.seq_len and tiny.model.d_model == TINY.model.d_model


def test_gemma3_presets():
    """Gemma 3 12B's text model (11,766,034,176 parameters by hand: 48 layers of 3840 x (4096 + 2048 + 2048
    + 4096) + 3 x 3840 x 15360 + 4 x 3840 + 2 x 256, one tied 262208 x 3840 table, 3840) in its pattern of
    5 local layers (a 1,024-key window, RoPE 1e4) then 1 global (RoPE 1e6 / 8); the tiny sibling's 7 layers
    show the pattern and its window binds at its 128 tokens."""
    from lumen_jax.metrics import flops

    m = load_config(cfg_path("gemma3_12b.yaml")).model
    assert (m.d_model, m.num_layers, m.num_heads, m.num_kv_heads, m.resolved_head_dim, m.ffn_dim, m.vocab_size,
            m.sliding_window, m.global_every, m.query_scale_dim) == (3840, 48, 16, 8, 256, 15360, 262208, 1024, 6, 256)
    assert (m.rope_theta, m.rope_scaling, m.rope_scaling_factor, m.rope_local_theta) == (1e6, "linear", 8.0, 1e4)
    assert (m.norm_scale, m.block_norms, m.mlp_activation, m.embed_scale, m.qk_norm, m.tie_embeddings) == (
        "one_plus_weight", "sandwich", "gelu_tanh", "sqrt_d_model", True, True)
    assert flops.param_counts(m)["total"] == 11_766_034_176
    tiny = load_config(cfg_path("tiny_gemma3.yaml"))
    assert tiny.model.num_layers > tiny.model.global_every and 0 < tiny.model.sliding_window < tiny.data.seq_len
    assert tiny.model.d_model == TINY.model.d_model and tiny.model.block_norms == "sandwich"


def test_deepseek_v3_presets():
    """DeepSeek-V3's 671,026,404,352 parameters by hand (without its multi-token-prediction module): an
    untied 129280 x 7168 embedding and head, 61 latent-attention layers of 7168 x 1536 + 1536 x 128 x 192
    + 7168 x (512 + 64) + 512 x 128 x (128 + 128) + 128 x 128 x 7168 and norms 1536 + 512 + 2 x 7168, 3
    dense MLPs of 3 x 7168 x 18432, 58 MoE layers of a 7168 x 256 router and 257 experts of 3 x 7168 x 2048,
    the final norm; the tiny sibling keeps the pattern (a dense first layer, then MoE)."""
    from lumen_jax.metrics import flops

    m = load_config(cfg_path("deepseek_v3.yaml")).model
    d = 7168
    attn = d * 1536 + 1536 + 1536 * 128 * 192 + d * 576 + 512 + 512 * 128 * 256 + 128 * 128 * d + 2 * d
    by_hand = 2 * 129280 * d + d + 61 * attn + 3 * 3 * d * 18432 + 58 * (d * 256 + 257 * 3 * d * 2048)
    assert by_hand == 671_026_404_352 == flops.param_counts(m)["total"]
    assert (m.num_moe_layers, m.moe.first_dense_layers, m.moe.groups, m.moe.top_groups) == (58, 3, 8, 4)
    tiny = load_config(cfg_path("tiny_deepseek_v3.yaml")).model
    assert tiny.mla and 0 < tiny.moe.first_dense_layers < tiny.num_layers and tiny.d_model == TINY.model.d_model


def test_an_error_quotes_a_huge_value_in_brief():
    """A value of 5,000 paths in a one-line error is cut to what recognises it (before: the whole
    value, 2 GB for a YAML alias bomb of 10^8 paths)."""
    text = show(["path/to/shard"] * 5000)
    assert text.startswith("['path/to/shard', 'path/to/shard'") and len(text) < 300, text
    assert show(64) == "64" and show("abc") == "'abc'" and show((1, 2)) == "[1, 2]" and show(True) == "true"


def test_gin_equals_yaml_for_tiny():
    assert load_config(cfg_path("tiny.gin")) == TINY
    # Loading again in the same process starts from a clean slate.
    assert load_config(cfg_path("tiny.gin")) == TINY
    assert load_config(cfg_path("tiny.gin"), ["model.num_layers=3"]).model.num_layers == 3


def test_gin_leaves_no_global_bindings(tmp_path):
    load_config(write(tmp_path, "a.gin", "model.num_layers = 7\n"))
    assert load_config(write(tmp_path, "b.gin", "optim.lr = 1e-3\n")).model.num_layers == 2


def test_gin_include_and_macro(tmp_path):
    write(tmp_path, "parent.gin", "model.num_layers = 5\n")
    p = write(tmp_path, "child.gin", """\
        include 'parent.gin'
        WIDTH = 128
        model.d_model = %WIDTH
        """)
    cfg = load_config(p)
    assert (cfg.model.num_layers, cfg.model.d_model, cfg.name) == (5, 128, "child")


def test_gin_errors(tmp_path):
    msg = error(load_config, write(tmp_path, "a.gin", "model.d_modle = 64\n"))
    assert "model.d_modle" in msg and "did you mean model.d_model?" in msg
    msg = error(load_config, write(tmp_path, "b.gin", "modle.d_model = 64\n"))
    assert "'modle'" in msg and "did you mean model?" in msg
    msg = error(load_config, write(tmp_path, "c.gin", "model.num_layers = 'abc'\n"))
    assert msg == "model.num_layers='abc' must be an int; got str"
    msg = error(load_config, write(tmp_path, "d.gin", "model.num_layers = abc\n"))
    assert "not valid gin" in msg


@pytest.mark.parametrize("line", ["import evilmod", "from evilmod import payload", "import evilmod as e",
                                  "from __gin__ import dynamic_registration"])
def test_gin_refuses_code_loading(tmp_path, monkeypatch, line):
    """A config file is data: an import line (in the file or in one it includes) is refused before it runs."""
    marker = tmp_path / "ran"
    write(tmp_path, "evilmod.py", f"open({str(marker)!r}, 'w').close()\npayload = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "evilmod", raising=False)
    top = write(tmp_path, "evil.gin", f"model.num_layers = 3\n{line}\n")
    assert error(load_config, top) == (
        f"{top}:2: `{line}` would load code; a config file is data: remove the line")
    inner = f"inner_{tmp_path.name}.gin"  # gin searches the folders of earlier loads too: a name of its own
    write(tmp_path, inner, f"\n\n{line}\n")
    outer = write(tmp_path, "outer.gin", f"include '{inner}'\nmodel.num_layers = 3\n")
    assert error(load_config, outer) == (
        f"{tmp_path / inner}:3: `{line}` would load code; a config file is data: remove the line")
    assert not marker.exists() and "evilmod" not in sys.modules


def test_jax_not_imported():
    code = ("import sys, lumen_jax.config; assert 'lumen_jax.config.files' not in sys.modules; "
            "import lumen_jax.config.files as c; c.load_config('configs/tiny.gin'); assert 'jax' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


# --------------------------------------------------------------------------------------------------
# YAML, base:, overrides
# --------------------------------------------------------------------------------------------------

def test_defaults_when_no_path():
    cfg = load_config(None)
    assert cfg == Config() and cfg.name == "default"


def test_base_inheritance_deep_merges(tmp_path):
    (tmp_path / "sub").mkdir()
    write(tmp_path, "grand.yaml", "model: {d_model: 96, num_layers: 3}\noptim: {lr: 1.0e-3}\n")
    write(tmp_path, "sub/parent.yaml", "base: ../grand.yaml\nmodel: {num_layers: 4}\n")
    p = write(tmp_path, "sub/child.yml", "base: parent.yaml\nmodel: {num_heads: 2}\noptim:\n")
    cfg = load_config(p)
    assert (cfg.model.d_model, cfg.model.num_layers, cfg.model.num_heads) == (96, 4, 2)
    assert cfg.optim.lr == 1e-3  # an empty child section keeps the base one
    assert cfg.name == "child"


def test_base_errors(tmp_path):
    msg = error(load_config, write(tmp_path, "a.yaml", "base: missing.yaml\n"))
    assert "base='missing.yaml'" in msg and "does not exist" in msg
    write(tmp_path, "x.yaml", "base: y.yaml\n")
    msg = error(load_config, write(tmp_path, "y.yaml", "base: x.yaml\n"))
    assert "extends itself" in msg
    msg = error(load_config, write(tmp_path, "n.yaml", "name: foo\n"))
    assert "name='foo'" in msg


def test_file_errors(tmp_path):
    assert "does not exist" in error(load_config, str(tmp_path / "nope.yaml"))
    assert ".yaml, .yml or .gin" in error(load_config, write(tmp_path, "a.toml", "x = 1\n"))
    assert "not valid YAML" in error(load_config, write(tmp_path, "b.yaml", "model: [\n"))
    assert "mapping of sections" in error(load_config, write(tmp_path, "c.yaml", "- 1\n"))
    msg = error(load_config, write(tmp_path, "d.yaml", "model: 3\n"))
    assert "model=3" in msg and "mapping" in msg


def test_yaml_scientific_floats(tmp_path):
    cfg = load_config(write(tmp_path, "a.yaml", "optim: {lr: 3e-4, eps: 1E-8, weight_decay: 1}\n"))
    assert cfg.optim.lr == 3e-4 and isinstance(cfg.optim.lr, float)
    assert cfg.optim.eps == 1e-8
    assert cfg.optim.weight_decay == 1.0 and isinstance(cfg.optim.weight_decay, float)


def test_override_parsing():
    cfg = load_config(cfg_path("tiny.yaml"), [
        "optim.lr=3e-4", "mesh.sequence_parallel=true", "model.num_layers=4", "data.paths=[a.txt, b/*.txt]",
        "train.run_dir=2024", "data.tokenizer=tok.json", "checkpoint.every_minutes=5", "runtime.platform="])
    assert cfg.optim.lr == 3e-4 and isinstance(cfg.optim.lr, float)
    assert cfg.mesh.sequence_parallel is True
    assert cfg.model.num_layers == 4
    assert cfg.data.paths == ("a.txt", "b/*.txt")
    assert cfg.train.run_dir == "2024" and cfg.data.tokenizer == "tok.json"
    assert cfg.checkpoint.every_minutes == 5.0 and isinstance(cfg.checkpoint.every_minutes, float)
    assert cfg.runtime.platform == ""
    assert load_config(None, ["data.paths=corpus/*.txt"]).data.paths == ("corpus/*.txt",)
    # Later overrides win; overrides win over the file.
    assert load_config(cfg_path("tiny.yaml"), ["optim.lr=1", "optim.lr=2"]).optim.lr == 2.0


def test_override_errors():
    for bad in ("optim.lr", "lr=3", "optim.=3", "a.b.c=1"):
        assert "section.key=value" in error(load_config, None, [bad])
    assert error(load_config, None, ["model.d_modle=64"]) == \
        "unknown config key model.d_modle=64; did you mean model.d_model?"
    assert "did you mean model.d_model?" in error(load_config, None, ["modle.d_model=64"])
    assert "did you mean data.seq_len?" in error(load_config, None, ["model.seq_len=64"])
    assert error(load_config, None, ["model.num_layers=abc"]) == "model.num_layers='abc' must be an int; got str"
    assert error(load_config, None, ["log.jsonl=maybe"]) == "log.jsonl='maybe' must be a bool (true or false); got str"


# --------------------------------------------------------------------------------------------------
# Strict dict -> dataclasses
# --------------------------------------------------------------------------------------------------

def test_unknown_keys_and_sections():
    assert error(from_dict, {"model": {"d_modle": 64}}) == \
        "unknown config key model.d_modle=64; did you mean model.d_model?"
    msg = error(from_dict, {"modle": {"d_model": 64}})
    assert "'modle'" in msg and "did you mean model?" in msg
    assert "did you mean data.global_batch_size?" in error(from_dict, {"model": {"global_batch_size": 8}})
    msg = error(from_dict, {"model": {"zzz": 1}})
    assert "model.zzz=1" in msg and "keys of model:" in msg


@pytest.mark.parametrize("section,key,value,expect", [
    ("model", "num_layers", "abc", "model.num_layers='abc' must be an int; got str"),
    ("model", "num_layers", 2.5, "model.num_layers=2.5 must be an int; got float"),
    ("model", "num_layers", True, "model.num_layers=true must be an int; got bool"),
    ("optim", "lr", "fast", "optim.lr='fast' must be a float; got str"),
    ("optim", "lr", False, "optim.lr=false must be a float; got bool"),
    ("log", "jsonl", "yes", "log.jsonl='yes' must be a bool (true or false); got str"),
    ("log", "jsonl", 1, "log.jsonl=1 must be a bool (true or false); got int"),
    ("data", "tokenizer", 3, "data.tokenizer=3 must be a str; got int"),
    ("data", "paths", "a.txt", "data.paths='a.txt' must be a list of str; got str"),
    ("data", "paths", ["a", 1], "data.paths=['a', 1] must be a list of str; got list"),
])
def test_type_errors(section, key, value, expect):
    assert error(from_dict, {section: {key: value}}) == expect


def test_coercions():
    cfg = from_dict({"optim": {"lr": 1}, "data": {"paths": ["a", "b"]}})
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)
    assert cfg.data.paths == ("a", "b")


@pytest.mark.parametrize("key,value", [
    ("model.attention", "flashy"), ("model.remat", "some"), ("model.compute_dtype", "float64"),
    ("model.rope_scaling", "ntk"), ("optim.schedule", "step"), ("mesh.zero_stage", 4),
    ("mesh.context_parallel", "tree"), ("mesh.context_balance", "striped"), ("data.source", "web"),
])
def test_enum_errors(key, value):
    section, name = key.split(".")
    msg = error(from_dict, {section: {name: value}})
    assert msg.startswith(f"{key}={value!r} is not one of the allowed values")
    allowed = C.CHOICES[key]
    assert all(repr(a) in msg for a in allowed)


def test_round_trip():
    for f in glob.glob(os.path.join(CONFIGS, "*.yaml")):
        cfg = load_config(f)
        d = to_dict(cfg)
        assert from_dict(d) == cfg
        assert from_dict(json.loads(json.dumps(d))) == cfg
        assert from_dict(yaml.safe_load(yaml.safe_dump(d))) == cfg
    d = to_dict(load_config(None, ["data.paths=[a, b]"]))
    assert d["data"]["paths"] == ["a", "b"]


# --------------------------------------------------------------------------------------------------
# validate
# --------------------------------------------------------------------------------------------------

def test_mesh_minus_one_resolution():
    assert validate(TINY, 8)["fsdp"] == 8
    assert validate(with_(TINY, mesh=dict(data=2)), 8) == {"data": 2, "fsdp": 4, "pipeline": 1, "expert": 1, "context": 1, "tensor": 1}
    cfg = with_(TINY, mesh=dict(fsdp=2, tensor=-1))
    assert validate(cfg, 4) == {"data": 1, "fsdp": 2, "pipeline": 1, "expert": 1, "context": 1, "tensor": 2}
    assert "at most one axis may be -1" in error(validate, with_(TINY, mesh=dict(data=-1)), 8)
    assert "mesh.fsdp=-1 cannot fill 8 devices" in error(validate, with_(TINY, mesh=dict(tensor=3)), 8)
    assert "mesh.tensor=0" in error(validate, with_(TINY, mesh=dict(tensor=0)), 8)


def test_mesh_product_mismatch():
    msg = error(validate, with_(TINY, mesh=dict(fsdp=2)), 8)
    assert "2 devices but 8 are available" in msg and "set one axis to -1" in msg


@pytest.mark.parametrize("key,value", [("num_heads", 9), ("num_kv_heads", 3), ("ffn_dim", 171),
                                       ("vocab_size", 511)])
def test_tensor_divides_model(key, value):
    base = with_(TINY, model=dict(d_model=96, num_heads=12, num_kv_heads=6, ffn_dim=96, vocab_size=96),
                 mesh=dict(fsdp=1, tensor=2))
    assert validate(base, 2)["tensor"] == 2
    msg = error(validate, with_(base, model={key: value}), 2)
    assert msg.startswith(f"mesh.tensor=2 does not divide model.{key}={value}; "
                          f"choose mesh.tensor among the divisors of {value}")


def test_brief_example_message():
    cfg = with_(TINY, model=dict(d_model=64, num_heads=8, num_kv_heads=8, ffn_dim=192, vocab_size=384),
                mesh=dict(fsdp=1, tensor=3))
    assert error(validate, cfg, 3) == ("mesh.tensor=3 does not divide model.num_heads=8; "
                                       "choose mesh.tensor among the divisors of 8 (1, 2)")


def test_fsdp_divides_d_model():
    msg = error(validate, with_(TINY, model=dict(d_model=20, num_heads=2)), 8)
    assert msg.startswith("mesh.fsdp=8 does not divide model.d_model=20")
    assert validate(with_(TINY, model=dict(d_model=20, num_heads=2), mesh=dict(fsdp=4, data=2)), 8)


def test_gqa_and_head_dim():
    msg = error(validate, with_(TINY, model=dict(num_kv_heads=3)), 8)
    assert "model.num_kv_heads=3 does not divide model.num_heads=4" in msg
    msg = error(validate, with_(TINY, model=dict(d_model=66)), 8)
    assert "model.d_model=66" in msg and "model.num_heads=4" in msg and "model.head_dim" in msg
    validate(with_(TINY, model=dict(d_model=66, head_dim=16), mesh=dict(data=4, fsdp=2)), 8)


def test_selective_remat_needs_named_projections():
    """The selective remat policies save named projections, which latent attention and MoE layers do not name."""
    for model in ("tiny_moe", "tiny_deepseek_v3"):
        cfg = load_config(cfg_path(f"{model}.yaml"), ["model.remat=save_dot_except_mlpwi_1"])
        msg = error(validate, cfg, 8)
        assert msg.startswith("model.remat=save_dot_except_mlpwi_1 saves named projections") and "\n" not in msg
        assert ("kv_lora_rank" if model == "tiny_deepseek_v3" else "moe.num_experts") in msg
    validate(with_(TINY, model=dict(remat="save_dot_except_mlpwi_1")), 8)


def test_batch_and_sequence():
    msg = error(validate, with_(TINY, data=dict(global_batch_size=12)), 8)
    assert msg.startswith("data.global_batch_size=12 is not divisible by mesh.data*mesh.fsdp*mesh.expert*train.micro_batches=1*8*1*1=8")
    msg = error(validate, with_(TINY, train=dict(micro_batches=4)), 8)
    assert "data.global_batch_size=16" in msg and "=32" in msg
    validate(with_(TINY, train=dict(micro_batches=2)), 8)
    msg = error(validate, with_(TINY, data=dict(seq_len=100), mesh=dict(context=8, fsdp=1)), 8)
    assert msg.startswith("data.seq_len=100 is not divisible by mesh.context=8")
    cfg = with_(TINY, data=dict(seq_len=10), mesh=dict(fsdp=-1, context=2, tensor=2, sequence_parallel=True))
    msg = error(validate, cfg, 8)
    assert "mesh.sequence_parallel=true" in msg and "data.seq_len=10" in msg and "mesh.context*mesh.tensor=4" in msg
    msg = error(validate, with_(TINY, data=dict(seq_len=36), mesh=dict(context=4, fsdp=2)), 8)
    assert msg.startswith("mesh.context_balance=zigzag cuts data.seq_len=36 into 2*mesh.context=8 chunks")
    assert validate(with_(TINY, data=dict(seq_len=36), mesh=dict(context=4, fsdp=2, context_balance="contiguous")),
                    8)["context"] == 4
    validate(with_(cfg, data=dict(seq_len=16)), 8)


def test_one_fix_for_every_rule_of_a_length_and_depth():
    """The first message a user sees asks for what every rule needs, not what its own rule needs."""
    for seq_len in (100, 9):  # not a multiple of 3; a multiple of 3 but not of 2*3
        msg = error(validate, with_(TINY, data=dict(seq_len=seq_len), mesh=dict(context=3, fsdp=1, data=-1)), 6)
        assert "use a multiple of 6" in msg, msg
    msg = error(validate, with_(TINY, model=dict(num_layers=8), train=dict(micro_batches=2),
                                mesh=dict(pipeline=2, pipeline_schedule="interleaved", pipeline_virtual_stages=3)), 8)
    assert msg.startswith("model.num_layers=8 is not divisible by mesh.pipeline*mesh.pipeline_virtual_stages=2*3=6;")
    assert "whose product divides 8" in msg, msg


def test_settings_that_do_nothing_or_drop_most_tokens_warn():
    from lumen_jax.config.checks import warnings

    [line] = warnings(with_(TINY, mesh=dict(sequence_parallel=True)))
    assert line.startswith("mesh.sequence_parallel=true does nothing with mesh.tensor=1")
    moe = C.MoeConfig(num_experts=8, capacity_factor=0.1)
    [line] = warnings(with_(TINY, model=dict(moe=moe)))
    assert line.startswith("model.moe.capacity_factor=0.1 < 1 drops at least 90% of the tokens' expert assignments")
    assert warnings(with_(TINY, model=dict(moe=dataclasses.replace(moe, capacity_factor=1.25)))) == []


@pytest.mark.parametrize("key,value,fragment", [
    ("model.num_layers", 0, "model.num_layers=0 must be >= 1"),
    ("model.d_model", -1, "model.d_model=-1 must be >= 1"),
    ("model.num_heads", 0, "model.num_heads=0 must be >= 1"),
    ("model.vocab_size", 0, "model.vocab_size=0 must be >= 1"),
    ("model.rope_theta", 0.0, "model.rope_theta=0.0 must be > 0"),
    ("model.loss_chunk_tokens", -1, "model.loss_chunk_tokens=-1 must be >= 0"),
    ("train.steps", 0, "train.steps=0 must be >= 1"),
    ("train.micro_batches", 0, "train.micro_batches=0 must be >= 1"),
    ("optim.lr", 0.0, "optim.lr=0.0 must be > 0"),
    ("optim.lr", -1e-3, "optim.lr=-0.001 must be > 0"),
    ("optim.warmup_steps", -1, "optim.warmup_steps=-1 must be >= 0"),
    ("optim.b2", 1.0, "optim.b2=1.0 must be < 1"),
    ("log.every_steps", 0, "log.every_steps=0 must be >= 1"),
    ("runtime.cpu_devices", -2, "runtime.cpu_devices=-2 must be >= 0"),
    ("data.seq_len", 0, "data.seq_len=0 must be >= 1"),
])
def test_bounds(key, value, fragment):
    section, name = key.split(".")
    msg = error(validate, with_(TINY, **{section: {name: value}}), 8)
    assert msg.startswith(fragment) and f"set {key} to a value" in msg


@pytest.mark.parametrize("override,expected", [
    ("optim.lr=1e308", "optim.lr=1e+308 overflows float32 (largest 3.4e+38), the dtype the step uses; "
                       "set optim.lr to a smaller value"),
    ("optim.lr=inf", "optim.lr=inf is not a finite number; set optim.lr to a finite value"),
    ("optim.eps=1e-50", "optim.eps=1e-50 rounds to 0.0 in float32, the dtype the step uses, and must be > 0; "
                        "set optim.eps to a value > 0 that float32 holds"),
    ("optim.loss_scale_init=-1e39", "optim.loss_scale_init=-1e+39 overflows float32"),
])
def test_floats_are_checked_in_float32(override, expected):
    """A float is checked as the step uses it: 1e308 is finite in float64 and inf in float32."""
    assert error(validate, load_config(None, [override]), 8).startswith(expected)


def test_the_tokenizer_is_pinned_by_absolute_path_and_sha256_on_load(tmp_path, monkeypatch):
    import hashlib

    (tmp_path / "tok.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    data = load_config(None, ["data.tokenizer=tok.json"]).data
    digest = hashlib.sha256(b"{}").hexdigest()
    assert (data.tokenizer, data.tokenizer_sha256) == (str(tmp_path / "tok.json"), digest)
    assert load_config(None, ["data.tokenizer=tok.json", f"data.tokenizer_sha256={digest}"]).data == data
    msg = error(load_config, None, ["data.tokenizer=tok.json", "data.tokenizer_sha256=" + "0" * 64])
    assert msg.startswith(f"data.tokenizer={str(tmp_path / 'tok.json')!r} has sha256 {digest[:12]}, not "
                          "data.tokenizer_sha256=000000000000..."), msg
    assert load_config(None, []).data.tokenizer == "byte"


def test_data_source_and_tokenizer(tmp_path):
    msg = error(validate, with_(TINY, data=dict(source="files")), 8)
    assert "data.source='files'" in msg and "data.paths" in msg
    validate(with_(TINY, data=dict(source="files", paths=("x/*.txt",))), 8)
    msg = error(validate, with_(TINY, data=dict(tokenizer=str(tmp_path / "tok.json"))), 8)
    assert "data.tokenizer=" in msg and "tok.json" in msg and "does not exist" in msg
    (tmp_path / "tok.json").write_text("{}")
    validate(with_(TINY, data=dict(tokenizer=str(tmp_path / "tok.json"))), 8)


def test_data_mixture_from_yaml_and_overrides(tmp_path):
    path = write(tmp_path, "mix.yaml", """
        data:
          source: prepared
          mixture: [{paths: [data/web], weight: 0.7}, {paths: data/code, weight: 0.3, name: code}]
        """)
    mix = load_config(path).data.mixture
    assert mix == (C.MixtureSource(paths=("data/web",), weight=0.7), C.MixtureSource(("data/code",), 0.3, "code"))
    assert [m.label for m in mix] == ["web", "code"]
    over = load_config(None, ["data.source=prepared", "data.mixture=[{paths: [data/web], weight: 1}]"]).data
    assert over.mixture == (C.MixtureSource(paths=("data/web",), weight=1.0),)
    assert from_dict(to_dict(load_config(path))) == load_config(path)  # round trip through JSON-like dicts
    with pytest.raises(ConfigError, match=r"^unknown key data.mixture\[0\].wieght; did you mean weight\?"):
        load_config(None, ["data.mixture=[{paths: [a], wieght: 1}]"])
    with pytest.raises(ConfigError, match=r"^data.mixture\[0\]='a' must be a mapping of paths, weight, name"):
        load_config(None, ["data.mixture=a"])
    with pytest.raises(ConfigError, match=r"^data.mixture=3 must be a list of mappings \(paths, weight, name\)"):
        from_dict({"data": {"mixture": 3}})


@pytest.mark.parametrize("data, fragment", [
    (dict(source="prepared", paths=("web",), mixture=(C.MixtureSource(("code",)),)), "data.mixture and data.paths"),
    (dict(mixture=(C.MixtureSource(("code",)),)), "data.mixture needs data.source=files or prepared"),
    (dict(source="files", mixture=(C.MixtureSource(("a",), 0.0),)), "data.mixture[0].weight=0.0 must be a positive"),
    (dict(source="files", mixture=(C.MixtureSource(("a",), 1e-300), C.MixtureSource(("b",), 1.0))),
     "data.mixture[0].weight=1e-300 must be a positive number from 1e-30 to 1e+30"),
    (dict(source="files", mixture=(C.MixtureSource(("a",), 1e300),)), "data.mixture[0].weight=1e+300 must be a positive"),
    (dict(source="files", mixture=(C.MixtureSource(("a",), 1e-6), C.MixtureSource(("b",), 2.0))),
     "data.mixture weights 1e-06 and 2.0 differ by more than 1,000,000x"),
    (dict(source="files", mixture=(C.MixtureSource(("x/a",)), C.MixtureSource(("y/a",)))), "data.mixture has two sources named 'a'"),
    (dict(source="files", paths=("a.txt",), order="windows"), "data.order=windows cuts the prepared token stream"),
    (dict(source="prepared", paths=("no/such/dir",)), "data.paths entry 'no/such/dir' is not a directory"),
])
def test_data_mixture_and_order_rules(data, fragment):
    assert error(validate, with_(TINY, data=data), 8).startswith(fragment)


def test_rope_llama3_factors():
    cfg = with_(TINY, model=dict(rope_scaling="llama3", rope_low_freq_factor=4.0, rope_high_freq_factor=4.0))
    assert "model.rope_high_freq_factor=4.0 must be > model.rope_low_freq_factor=4.0" in error(validate, cfg, 8)


def test_validate_rechecks_types_of_configs_built_in_code():
    msg = error(validate, with_(TINY, model=dict(attention="flashy")), 8)
    assert msg.startswith("model.attention='flashy' is not one of the allowed values")
    msg = error(validate, with_(TINY, model=dict(num_layers="2")), 8)
    assert msg == "model.num_layers='2' must be an int; got str"


# --------------------------------------------------------------------------------------------------
# One nested level: model.fp8
# --------------------------------------------------------------------------------------------------

def test_fp8_yaml_override_gin_and_round_trip(tmp_path):
    assert Config().model.fp8 == C.Fp8Config() and Config().model.fp8.recipe == "none"
    p = write(tmp_path, "a.yaml", "base: " + cfg_path("tiny.yaml") + "\nmodel: {fp8: {recipe: delayed}}\n")
    cfg = load_config(p)
    assert cfg.model.fp8 == C.Fp8Config(recipe="delayed") and cfg.model.d_model == 64
    cfg = load_config(p, ["model.fp8.amax_history=16", "model.fp8.keep_bf16=[]", "model.fp8.layers=mlp"])
    assert cfg.model.fp8 == C.Fp8Config(recipe="delayed", amax_history=16, layers=("mlp",), keep_bf16=())
    assert load_config(None, ["model.fp8={recipe: current}"]).model.fp8.recipe == "current"
    g = load_config(write(tmp_path, "a.gin", "model.fp8.recipe = 'blockwise'\nmodel.fp8.keep_bf16 = ['last']\n"))
    assert g.model.fp8 == C.Fp8Config(recipe="blockwise", keep_bf16=("last",))
    assert load_config(cfg_path("tiny.gin")).model.fp8 == C.Fp8Config()  # no bindings: the defaults
    d = to_dict(cfg)
    assert d["model"]["fp8"] == {"recipe": "delayed", "amax_history": 16, "layers": ["mlp"], "keep_bf16": []}
    assert from_dict(d) == cfg == from_dict(yaml.safe_load(yaml.safe_dump(d))) == from_dict(json.loads(json.dumps(d)))
    validate(with_(TINY, model=dict(fp8=C.Fp8Config(recipe="delayed"))), 8)


def test_fp8_errors(tmp_path):
    assert error(load_config, None, ["model.fp8.recpie=delayed"]) == \
        "unknown config key model.fp8.recpie=delayed; did you mean model.fp8.recipe?"
    assert error(load_config, None, ["model.fp9.recipe=delayed"]) == \
        "unknown config key model.fp9; did you mean model.fp8?"
    assert error(load_config, None, ["model.recipe=delayed"]) == \
        "unknown config key model.recipe=delayed; did you mean model.fp8.recipe?"
    assert "section.key=value" in error(load_config, None, ["model.fp8.recipe.x=1"])
    assert error(from_dict, {"model": {"fp8": {"recipe": "e4m3"}}}) == (
        "model.fp8.recipe='e4m3' is not one of the allowed values; choose model.fp8.recipe from "
        "'none', 'current', 'delayed', 'blockwise'")
    assert error(from_dict, {"model": {"fp8": {"layers": ["attention", "moe"]}}}) == (
        "model.fp8.layers=['attention', 'moe'] has 'moe', not among the allowed values; choose the items "
        "of model.fp8.layers from 'attention', 'mlp'")
    assert "model.fp8.keep_bf16=['middle'] has 'middle'" in error(from_dict, {"model": {"fp8": {"keep_bf16": ["middle"]}}})
    assert error(from_dict, {"model": {"fp8": "delayed"}}).startswith(
        "model.fp8='delayed' must be a mapping of keys (recipe, amax_history, layers, keep_bf16)")
    assert error(from_dict, {"model": {"fp8": {"amax_history": "long"}}}) == \
        "model.fp8.amax_history='long' must be an int; got str"
    msg = error(validate, with_(TINY, model=dict(fp8=C.Fp8Config(amax_history=0))), 8)
    assert msg.startswith("model.fp8.amax_history=0 must be >= 1")
    msg = error(validate, with_(TINY, model=dict(fp8=C.Fp8Config(recipe="fp8"))), 8)
    assert msg.startswith("model.fp8.recipe='fp8' is not one of the allowed values")
    msg = error(load_config, write(tmp_path, "b.gin", "model.fp8.recpie = 'delayed'\n"))
    assert msg.endswith("unknown config key model.fp8.recpie; did you mean model.fp8.recipe?")


# --------------------------------------------------------------------------------------------------
# Keys that moved: every parallelism setting is in `mesh`
# --------------------------------------------------------------------------------------------------

MOVED = [("optim", "zero_stage", 1, "mesh"), ("model", "context_parallel", "allgather", "mesh"),
         ("model", "context_balance", "contiguous", "mesh")]


@pytest.mark.parametrize("section,key,value,new", MOVED)
def test_moved_keys_are_errors_not_aliases(tmp_path, section, key, value, new):
    expect = f"{section}.{key} moved to {new}.{key}"
    assert error(from_dict, {section: {key: value}}) == expect
    assert error(load_config, None, [f"{section}.{key}={value}"]) == expect
    assert error(load_config, write(tmp_path, "a.yaml", f"{section}:\n  {key}: {value}\n")) == expect
    gin_value = value if isinstance(value, int) else repr(value)
    assert error(load_config, write(tmp_path, "a.gin", f"{section}.{key} = {gin_value}\n")) == expect
    cfg = load_config(None, [f"{new}.{key}={value}"])
    assert getattr(cfg.mesh, key) == value and C.MOVED[f"{section}.{key}"] == f"{new}.{key}"


def test_moved_key_through_the_cli_exits_2(capsys):
    from lumen_jax.train import cli as train_cli
    rc = train_cli.main(["--config", cfg_path("tiny.yaml"), "optim.zero_stage=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == ["error: optim.zero_stage moved to mesh.zero_stage"]


def test_fp8_error_through_the_cli_exits_2(capsys):
    from lumen_jax.train import cli as train_cli
    rc = train_cli.main(["--config", cfg_path("tiny.yaml"), "model.fp8.recipe=e5m2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "model.fp8.recipe='e5m2' is not one of the allowed values" in err[0]
