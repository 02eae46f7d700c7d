"""Hugging Face import/export against `transformers` itself (CPU torch): logits, round trip, bad inputs.

One small random LlamaForCausalLM per layout (GQA, an explicit head_dim, Llama-3 rope scaling; untied
and single-file, tied and sharded), written with `save_pretrained`; torch is imported only here.
"""

import json
import os
import stat
import shutil

import numpy as np
import pytest

from helpers.hf import HF_KW, TOKENS, hf_logits, make_hf, our_logits, tensors
from helpers.tolerances import FP32_RTOL
from lumen_jax.checkpoint import weights
from lumen_jax.convert.__main__ import main as convert

@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {"untied": make_hf(str(root / "untied"), tied=False),
            "tied_sharded": make_hf(str(root / "tied"), tied=True, max_shard_size="20KB")}


def assert_logits_close(ours: np.ndarray, ref: np.ndarray) -> None:
    np.testing.assert_allclose(ours, ref, rtol=FP32_RTOL, atol=FP32_RTOL * float(np.abs(ref).max()))


@pytest.mark.parametrize("layout", ["untied", "tied_sharded"])
def test_from_hf_logits_match_transformers_and_to_hf_round_trips(hf_dirs, tmp_path, layout):
    hf_dir = hf_dirs[layout]
    if layout == "tied_sharded":
        assert os.path.isfile(os.path.join(hf_dir, "model.safetensors.index.json"))
    run_dir, back = str(tmp_path / "run"), str(tmp_path / "back")
    assert convert(["from-hf", "--hf-dir", hf_dir, "--out", run_dir]) == 0
    cfg = weights.read_config(run_dir, 0)
    assert (cfg.model.tie_embeddings, cfg.model.rope_scaling, cfg.model.resolved_head_dim) == \
        (layout != "untied", "llama3", 16)
    ref = hf_logits(hf_dir, TOKENS)
    assert_logits_close(our_logits(run_dir, TOKENS), ref)

    shard = ["--max-shard-gb", str(20e3 / 2**30)] if layout == "tied_sharded" else []
    assert convert(["to-hf", "--run-dir", run_dir, "--out", back, *shard]) == 0
    assert os.path.isfile(os.path.join(back, "model.safetensors.index.json")) == (layout == "tied_sharded")
    modes = {f: stat.S_IMODE(os.stat(os.path.join(back, f)).st_mode) for f in os.listdir(back)}
    assert len(set(modes.values())) == 1, modes  # the weights were 0600 beside a 0644 config.json

    original, exported = tensors(hf_dir), tensors(back)
    assert sorted(exported) == sorted(original)
    for k in original:
        np.testing.assert_array_equal(exported[k], original[k], err_msg=k)
    assert_logits_close(hf_logits(back, TOKENS), ref)  # from_pretrained reads our config.json
    config = json.load(open(os.path.join(back, "config.json")))
    assert config["max_position_embeddings"] == HF_KW["max_position_embeddings"]  # 128 in, 128 out (was 8192)


def _edit_config(src: str, dst: str, **changes) -> str:
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        c = json.load(f)
    c.update(changes)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(c, f)
    return dst


def _drop_tensor(src: str, dst: str, name: str, reshape: bool = False) -> str:
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    t = load_file(path)
    if reshape:
        t[name] = t[name][:-1]
    else:
        del t[name]
    save_file(t, path)
    return dst


def _rewrite_config(src: str, dst: str, edit) -> str:
    """A copy of the HF directory `src` at `dst` whose config.json is `edit(config)` (a new dict)."""
    shutil.copytree(src, dst)
    with open(os.path.join(src, "config.json")) as f:
        c = edit(json.load(f))
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(c, f)
    return dst


def _as_4x(c: dict, rope_scaling: dict | None) -> dict:
    """`c` (written by transformers 5.x) as transformers 4.x wrote it: `rope_theta` at the top level,
    Llama-3 scaling in `rope_scaling`, `torch_dtype`, no `rope_parameters` (Llama-3.1-8B's own
    config.json has this form)."""
    rope = c["rope_parameters"]
    c = {k: v for k, v in c.items() if k not in ("rope_parameters", "dtype")}
    return {**c, "rope_theta": rope["rope_theta"], "rope_scaling": rope_scaling, "torch_dtype": "float32",
            "transformers_version": "4.46.0"}


def _default_rope(c: dict) -> dict:
    """`c` without Llama-3 scaling: plain rope of the same theta (5.x spelling)."""
    return {**c, "rope_parameters": {"rope_type": "default", "rope_theta": c["rope_parameters"]["rope_theta"]}}


LLAMA3 = {k: HF_KW["rope_parameters"][k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                  "original_max_position_embeddings")}
# name: (the 4.x config.json from the 5.x one, the 5.x config whose logits it must give)
HF_4X = {
    "llama3": (lambda c: _as_4x(c, {"rope_type": "llama3", **LLAMA3}), lambda c: c),
    "llama3-type-key": (lambda c: _as_4x(c, {"type": "llama3", **LLAMA3}), lambda c: c),  # early 4.x key name
    "default": (lambda c: _as_4x(c, None), _default_rope),
}


@pytest.mark.parametrize("case", list(HF_4X))
def test_from_hf_reads_transformers_4x_rope_fields(hf_dirs, tmp_path, case):
    """A config.json in the 4.x spelling (written by hand: the installed transformers writes only 5.x
    `rope_parameters`) converts to the logits of the same weights under the 5.x spelling. Here
    rope_theta is 100: read as the default 10000, or the scaling dropped, the logits move."""
    to_4x, reference = HF_4X[case]
    src = hf_dirs["untied"]
    old = _rewrite_config(src, str(tmp_path / "hf4"), to_4x)
    new = _rewrite_config(src, str(tmp_path / "hf5"), reference)
    with open(os.path.join(old, "config.json")) as f:
        assert "rope_parameters" not in json.load(f)
    ref = hf_logits(new, TOKENS)
    run_dir = str(tmp_path / "run")
    assert convert(["from-hf", "--hf-dir", old, "--out", run_dir]) == 0
    m = weights.read_config(run_dir, 0).model
    assert (m.rope_theta, m.rope_scaling) == (HF_KW["rope_parameters"]["rope_theta"],
                                              "none" if case == "default" else "llama3")
    assert_logits_close(our_logits(run_dir, TOKENS), ref)
    assert_logits_close(hf_logits(old, TOKENS), ref)  # transformers reads the hand-written file the same way


def _truncate(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    data = open(path, "rb").read()
    open(path, "wb").write(data[:len(data) // 2])
    return dst


def _index_naming(src: str, dst: str, name: str) -> str:
    """`src`'s weights moved outside `dst` and named from `dst`'s index by `name` (relative to `dst`, or absolute)."""
    shutil.copytree(src, dst)
    target = os.path.normpath(os.path.join(dst, name))
    os.makedirs(os.path.dirname(target), exist_ok=True)
    shutil.move(os.path.join(dst, "model.safetensors"), target)
    from safetensors import safe_open

    with safe_open(target, framework="numpy") as f:
        weight_map = {k: name for k in f.keys()}
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return dst


def _tokenizer_link_to_a_secret(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    secret = dst + "-secret.txt"
    with open(secret, "w") as f:
        f.write("API_KEY=do-not-leak\n")
    os.chmod(secret, 0o600)
    os.symlink(secret, os.path.join(dst, "tokenizer.json"))
    return dst


def _tokenizer_not_a_tokenizer(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "tokenizer.json"), "w") as f:
        json.dump({"api_key": "do-not-leak"}, f)
    return dst


BAD_HF = {
    "mistral": (lambda s, d: _edit_config(s, d, model_type="mistral"), "model_type='mistral'"),
    # before: a table of 10^9 layers' tensor names was being built (a hang); now bounded by the tensors there
    "10**9 layers": (lambda s, d: _edit_config(s, d, num_hidden_layers=10**9),
                     "num_hidden_layers=1000000000 is not between 1 and 21, the number of tensors"),
    "one layer more than tensors": (lambda s, d: _edit_config(s, d, num_hidden_layers=22),
                                    "num_hidden_layers=22 is not between 1 and 21"),
    "no layers": (lambda s, d: _edit_config(s, d, num_hidden_layers=0), "num_hidden_layers=0 is not between 1"),
    "bias": (lambda s, d: _edit_config(s, d, attention_bias=True), "attention_bias=True"),
    "unknown field": (lambda s, d: _edit_config(s, d, sliding_window=4096), "sliding_window=4096"),
    "dynamic rope": (lambda s, d: _edit_config(s, d, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4,
                                                                      "factor": 4.0}), "rope_type='dynamic'"),
    "missing tensor": (lambda s, d: _drop_tensor(s, d, "model.layers.1.mlp.up_proj.weight"),
                       "no tensor model.layers.1.mlp.up_proj.weight"),
    "misshapen": (lambda s, d: _drop_tensor(s, d, "model.layers.0.self_attn.k_proj.weight", reshape=True),
                  "model.layers.0.self_attn.k_proj.weight has shape (31, 32)"),
    "no weights": (lambda s, d: shutil.copytree(s, d, ignore=shutil.ignore_patterns("*.safetensors")),
                   "neither model.safetensors"),
    "truncated": (_truncate, "model.safetensors is not a readable safetensors file"),
    "weight_map ..": (lambda s, d: _index_naming(s, d, "../elsewhere/model.safetensors"),
                      "names '../elsewhere/model.safetensors', which leaves the folder"),
    "weight_map absolute": (lambda s, d: _index_naming(s, d, d + "-elsewhere/model.safetensors"),
                            "-elsewhere/model.safetensors', which is an absolute path"),
    "tokenizer link out": (_tokenizer_link_to_a_secret, "tokenizer.json is a link to"),
    "not a tokenizer": (_tokenizer_not_a_tokenizer, "tokenizer.json is not a Hugging Face tokenizers JSON file"),
}


@pytest.mark.parametrize("case", list(BAD_HF))
def test_from_hf_bad_input_exits_2_with_one_line(hf_dirs, tmp_path, capsys, case):
    make, expected = BAD_HF[case]
    bad = make(hf_dirs["untied"], str(tmp_path / "bad"))
    out = str(tmp_path / "run")
    assert convert(["from-hf", "--hf-dir", bad, "--out", out]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err
    assert not os.path.exists(out)


def test_from_hf_reads_a_hugging_face_cache_snapshot_whose_files_are_links_into_blobs(hf_dirs, tmp_path):
    """huggingface_hub's cache: snapshots/<rev>/<file> -> ../../blobs/<hash>; those links are followed."""
    from helpers.hf import add_tokenizer

    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    src = str(tmp_path / "src")
    shutil.copytree(hf_dirs["untied"], src)
    add_tokenizer(src)
    for i, name in enumerate(sorted(os.listdir(src))):
        shutil.copyfile(os.path.join(src, name), repo / "blobs" / f"blob{i}")
        os.symlink(f"../../blobs/blob{i}", snapshot / name)
    run_dir = str(tmp_path / "run")
    assert convert(["from-hf", "--hf-dir", str(snapshot), "--out", run_dir]) == 0
    copied = os.path.join(run_dir, "tokenizer", "tokenizer.json")
    assert not os.path.islink(copied) and open(copied).read() == open(os.path.join(src, "tokenizer.json")).read()


def test_without_a_tokenizer_from_hf_warns_and_to_hf_refuses_a_shard_size_of_0(hf_dirs, tmp_path, capsys):
    run_dir = str(tmp_path / "run")
    assert convert(["from-hf", "--hf-dir", hf_dirs["untied"], "--out", run_dir]) == 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"warning: {hf_dirs['untied']} has no tokenizer.json"), err
    assert "data.tokenizer=byte" in err
    for size in ("0", "-1", "nan"):
        out = str(tmp_path / f"hf{size}")
        assert convert(["to-hf", "--run-dir", run_dir, "--out", out, "--max-shard-gb", size]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"--max-shard-gb={size} must be > 0" in err, err
        assert not os.path.exists(out)
