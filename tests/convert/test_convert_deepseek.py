"""DeepSeek-V3 import and export against `transformers` itself (CPU torch): multi-head latent attention
(with and without a query latent, interleaved and half-split rope), the first layers dense then MoE,
the routers' selection bias (nonzero, imported as model state), logits, controls, the round trip,
greedy generation, a run started from the import, refusals."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from helpers.hf import (DEEPSEEK_MODELS, TOKENS, assert_to_hf_round_trips, from_hf_refusal, hf_greedy, hf_logits,
                        import_each, logits_close, logits_of, make_hf_deepseek, our_model_state, our_params, tensors)
from helpers.paths import REPO
from helpers.tolerances import FP32_RTOL
from lumen_jax.convert.__main__ import main as convert

KINDS = list(DEEPSEEK_MODELS)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """{kind: (HF dir, run dir imported with from-hf, transformers' logits of TOKENS)}."""
    return import_each(str(tmp_path_factory.mktemp("hf_deepseek")), make_hf_deepseek, KINDS)


@pytest.mark.parametrize("kind", KINDS)
def test_from_hf_logits_match_transformers(imported, kind):
    """Our logits equal transformers' (float32), the routers' selection bias read as the import's model state;
    controls: that bias left out (zeros), the rotated dims left interleaved, and the MoE layers' group choice
    off, each must show."""
    hf_dir, run_dir, ref = imported[kind]
    model, params = our_params(run_dir)
    state = our_model_state(run_dir)
    raw = json.load(open(os.path.join(hf_dir, "config.json")))
    assert (model.mla, model.kv_lora_rank, model.q_lora_rank, model.v_head_dim) == (
        True, 16, raw["q_lora_rank"] or 0, 12)
    assert model.rope_scaling == ("yarn" if kind == "deepseek_v3_yarn" else "none")
    assert (model.moe.first_dense_layers, model.moe.router, model.moe.groups, model.moe.top_groups,
            model.moe.routed_scaling, model.moe.balance) == (raw["first_k_dense_replace"], "sigmoid", 4, 2, 2.5, "bias")
    ours = logits_of(model, params, TOKENS, state)
    np.testing.assert_allclose(ours, ref, rtol=FP32_RTOL, atol=FP32_RTOL * float(np.abs(ref).max()))
    balance = state["moe_blocks"]["mlp"]["balance"]
    source = tensors(hf_dir)
    bias = np.stack([source[f"model.layers.{i}.mlp.gate.e_score_correction_bias"]
                     for i in range(model.moe.first_dense_layers, model.num_layers)])
    assert np.abs(bias).min() > 0
    np.testing.assert_array_equal(np.asarray(balance["bias"]), bias)
    np.testing.assert_array_equal(np.asarray(balance["load"]), 0)  # the bias chosen with is the checkpoint's
    # control 0: the selection bias dropped (the fresh state) changes which experts are chosen
    assert not logits_close(logits_of(model, params, TOKENS), ref)
    # control 1: the shared key's rotated columns in the other order (interleaved <-> half-split)
    e = model.qk_rope_head_dim
    other = np.concatenate([np.arange(0, e, 2), np.arange(1, e, 2)])
    moved = {**params, "moe_blocks": {**params["moe_blocks"], "attn": dict(params["moe_blocks"]["attn"])}}
    moved["moe_blocks"]["attn"]["wk_rope"] = np.asarray(params["moe_blocks"]["attn"]["wk_rope"])[..., other]
    assert not logits_close(logits_of(model, moved, TOKENS, state), ref)
    # control 2: routing without the group limit (every group open) must differ
    import dataclasses
    ungrouped = dataclasses.replace(model, moe=dataclasses.replace(model.moe, top_groups=4))
    assert not logits_close(logits_of(ungrouped, params, TOKENS, state), ref)


@pytest.mark.parametrize("kind", ["deepseek_v3", "deepseek_v3_yarn"])
def test_to_hf_round_trips_every_tensor_and_transformers_loads_it(imported, tmp_path, kind):
    config, source = assert_to_hf_round_trips(*imported[kind], str(tmp_path / "back"))
    for k in ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "first_k_dense_replace", "n_group",
              "topk_group", "routed_scaling_factor", "rope_interleave"):
        assert config[k] == source[k], k


def test_to_hf_of_half_split_rope_writes_it_interleaved(imported, tmp_path):
    """rope_interleave false comes back true with the rotated rows permuted: the same logits."""
    hf_dir, run_dir, ref = imported["deepseek_v3_plain_q"]
    back = str(tmp_path / "back")
    assert convert(["to-hf", "--run-dir", run_dir, "--out", back]) == 0
    config = json.load(open(os.path.join(back, "config.json")))
    assert config["rope_interleave"] is True and config["q_lora_rank"] is None
    assert sorted(tensors(back)) == sorted(tensors(hf_dir))
    np.testing.assert_allclose(hf_logits(back, TOKENS), ref, rtol=FP32_RTOL, atol=FP32_RTOL * float(np.abs(ref).max()))


def test_generate_on_an_imported_deepseek_equals_transformers(imported):
    """Greedy tokens equal transformers' generate (the KV cache holds K/V expanded per head)."""
    hf_dir, run_dir, _ = imported["deepseek_v3"]
    prompt = [5, 17, 60, 3, 88]
    want = hf_greedy(hf_dir, prompt, 6)
    gen = subprocess.run([sys.executable, "-m", "lumen_jax.generate", "--run-dir", run_dir, "--prompt-ids",
                          ",".join(map(str, prompt)), "--max-new-tokens", "6"],
                         cwd=REPO, timeout=300, capture_output=True, text=True)
    assert gen.returncode == 0, gen.stderr[-2000:]
    assert [int(t) for t in gen.stdout.split()] == want


BAD = {
    "yarn factor": ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 8, "attention_factor": 2.0}},
                    "config.json yarn rope attention_factor=2.0 is not supported"),
    "gqa": ({"num_key_value_heads": 2}, "config.json num_key_value_heads=2 is not supported"),
    "scoring": ({"scoring_func": "softmax"}, "config.json scoring_func='softmax' is not supported"),
    "all dense": ({"first_k_dense_replace": 3}, "config.json first_k_dense_replace=3 leaves no MoE layer"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_from_hf_bad_deepseek_config_exits_2_with_one_line(imported, tmp_path, capsys, case):
    change, fragment = BAD[case]
    err = from_hf_refusal(imported["deepseek_v3"][0], str(tmp_path), change, capsys)
    assert fragment in err, err


@pytest.mark.heavy
def test_init_from_an_imported_deepseek_starts_with_its_router_bias(imported, tmp_path, capsys):
    """A run with train.init_from= the import starts with its routers' selection bias: the bias its first
    step chose with (the model state of its step-1 checkpoint) is the checkpoint's. The Hugging Face
    directory itself, converted in memory, gives the same state; a run whose model state is laid out
    otherwise (another model.moe.balance) starts with its own, and a note says so.

    Then to-hf of that trained run (a large bias_update_rate, so that the selection bias changes the
    routing) writes the bias the model state chooses with (its last bias updated by its last load) as
    e_score_correction_bias, and transformers' logits equal ours with that state (and differ from ours
    without it). One training subprocess for both claims."""
    import dataclasses

    import jax
    import yaml

    from lumen_jax.checkpoint import weights
    from lumen_jax.config import to_dict
    from lumen_jax.model import abstract_model
    from lumen_jax.train import init_from as init_from_lib

    hf_dir, source, _ = imported["deepseek_v3"]
    want = np.asarray(our_model_state(source)["moe_blocks"]["mlp"]["balance"]["bias"])
    assert np.abs(want).min() > 0
    raw = to_dict(weights.read_config(source, 0))
    run_dir = str(tmp_path / "run")
    raw["data"].update(builtin_max_bytes=100_000, seq_len=16, global_batch_size=2)
    raw["train"].update(steps=1, init_from=source, run_dir=run_dir)
    raw["model"]["moe"]["bias_update_rate"] = 0.5  # for to-hf below: the next bias moves the routing
    raw["checkpoint"]["every_steps"] = 1
    raw["log"].update(every_steps=1, tensorboard=False, progress=False)
    raw["runtime"]["cpu_devices"] = 1
    config = tmp_path / "finetune.yaml"
    config.write_text(yaml.safe_dump({k: v for k, v in raw.items() if k != "name"}))
    proc = subprocess.run([sys.executable, "-m", "lumen_jax.train", "--config", str(config), "mesh.fsdp=1"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    np.testing.assert_array_equal(np.asarray(our_model_state(run_dir)["moe_blocks"]["mlp"]["balance"]["bias"]), want)

    cfg = weights.read_config(source, 0)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    on_one = lambda tree: jax.tree.map(  # noqa: E731
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=one), tree)
    a = abstract_model(cfg.model)
    for path in (hf_dir, source):
        _, state = init_from_lib.init_from(path, on_one(a.params), on_one(a.state))
        np.testing.assert_array_equal(np.asarray(state["moe_blocks"]["mlp"]["balance"]["bias"]), want)
    other = abstract_model(dataclasses.replace(cfg.model, moe=dataclasses.replace(cfg.model.moe, balance="aux_loss")))
    capsys.readouterr()
    assert init_from_lib.init_from(source, on_one(other.params), on_one(other.state))[1] is None
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"note: the model state of train.init_from={source} (moe_blocks/mlp/balance/bias") and (
        "the run starts with its own fresh model state" in err and "\n" not in err), err

    # to-hf of the trained run: the bias its next step chooses with
    from lumen_jax.model import apply

    back = str(tmp_path / "back")
    assert convert(["to-hf", "--run-dir", run_dir, "--out", back]) == 0
    cfg = weights.read_config(run_dir, 1)
    a = abstract_model(cfg.model)
    params = weights.load_params(run_dir, 1, on_one(a.params))
    state = weights.load_model_state(run_dir, 1, on_one(a.state))
    balance = state["moe_blocks"]["mlp"]["balance"]
    bias, load = np.asarray(balance["bias"]), np.asarray(balance["load"])
    np.testing.assert_array_equal(bias, want)
    bias = bias + 0.5 * np.sign(load.mean(-1, keepdims=True) - load)  # what the next step chooses with
    assert np.abs(bias - want).max() > 0.1
    exported = tensors(back)
    first = cfg.model.moe.first_dense_layers
    for i in range(bias.shape[0]):
        np.testing.assert_array_equal(exported[f"model.layers.{i + first}.mlp.gate.e_score_correction_bias"], bias[i])
    tokens = TOKENS % cfg.model.vocab_size
    positions = np.arange(tokens.shape[1])[None]
    ours = np.asarray(apply(a.graphdef, params, tokens, positions, state=state))
    ref = hf_logits(back, tokens)
    np.testing.assert_allclose(ours, ref, rtol=FP32_RTOL, atol=FP32_RTOL * float(np.abs(ref).max()))
    zero = jax.tree.map(np.zeros_like, state)
    assert not logits_close(np.asarray(apply(a.graphdef, params, tokens, positions, state=zero)), ref)


def _with_mtp_layer(src: str, dst: str) -> dict:
    """A copy of the DeepSeek-V3 `src` with a hand-made multi-token-prediction layer 3 (its block from
    layer 2's tensors, perturbed; hnorm, enorm, eh_proj random; the embedding and head copied, as the
    released checkpoint stores them); returns its tensors."""
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    t = load_file(path)
    rng = np.random.default_rng(0)
    for name in [n for n in t if n.startswith("model.layers.2.")]:
        w = t[name]
        t[name.replace("layers.2.", "layers.3.")] = w if name.endswith("e_score_correction_bias") else (
            w + 0.01 * rng.standard_normal(w.shape).astype(w.dtype))
    d = t["model.norm.weight"].shape[0]
    t.update({"model.layers.3.hnorm.weight": rng.standard_normal(d).astype(np.float32),
              "model.layers.3.enorm.weight": rng.standard_normal(d).astype(np.float32),
              "model.layers.3.eh_proj.weight": rng.standard_normal((d, 2 * d)).astype(np.float32),
              "model.layers.3.shared_head.norm.weight": rng.standard_normal(d).astype(np.float32),
              "model.layers.3.shared_head.head.weight": t["lm_head.weight"],
              "model.layers.3.embed_tokens.weight": t["model.embed_tokens.weight"]})
    save_file(t, path, metadata={"format": "pt"})
    raw = json.load(open(os.path.join(dst, "config.json")))
    json.dump({**raw, "num_nextn_predict_layers": 1}, open(os.path.join(dst, "config.json"), "w"))
    return t


def test_from_hf_imports_the_mtp_layer_and_to_hf_writes_it_back(imported, tmp_path, capsys):
    """model.layers.{L}.*: enorm, hnorm, eh_proj (its [embedding; hidden] columns as our [hidden; embedding]
    rows), shared_head.norm and the block land in model.mtp (mtp_depth 1); the main logits are unchanged;
    to-hf writes every tensor back bit for bit. A head copy that differs from lm_head: one line, exit 2."""
    _, _, ref = imported["deepseek_v3"]
    hf_dir, run_dir = str(tmp_path / "hf"), str(tmp_path / "run")
    t = _with_mtp_layer(imported["deepseek_v3"][0], hf_dir)
    assert convert(["from-hf", "--hf-dir", hf_dir, "--out", run_dir]) == 0
    model, params = our_params(run_dir)
    assert model.mtp_depth == 1
    mtp = params["mtp"]
    w, d = t["model.layers.3.eh_proj.weight"], model.d_model
    np.testing.assert_array_equal(mtp["eh_proj"][0][:d], w[:, d:].T)  # the hidden state's rows
    np.testing.assert_array_equal(mtp["eh_proj"][0][d:], w[:, :d].T)  # the embedding's
    np.testing.assert_array_equal(mtp["hnorm"]["scale"][0], t["model.layers.3.hnorm.weight"])
    np.testing.assert_array_equal(mtp["norm"]["scale"][0], t["model.layers.3.shared_head.norm.weight"])
    np.testing.assert_array_equal(mtp["block"]["mlp"]["router"][0], t["model.layers.3.mlp.gate.weight"].T)
    np.testing.assert_array_equal(mtp["block"]["attn"]["wkv_a"][0],
                                  t["model.layers.3.self_attn.kv_a_proj_with_mqa.weight"][:16].T)
    state = our_model_state(run_dir)
    np.testing.assert_array_equal(np.asarray(state["mtp"]["block"]["mlp"]["balance"]["bias"][0]),
                                  t["model.layers.3.mlp.gate.e_score_correction_bias"])
    np.testing.assert_allclose(logits_of(model, params, TOKENS, state), ref, rtol=FP32_RTOL,
                               atol=FP32_RTOL * float(np.abs(ref).max()))
    back = str(tmp_path / "back")
    assert convert(["to-hf", "--run-dir", run_dir, "--out", back]) == 0
    exported = tensors(back)
    assert sorted(exported) == sorted(t)
    for k in t:
        np.testing.assert_array_equal(exported[k], t[k], err_msg=k)
    assert json.load(open(os.path.join(back, "config.json")))["num_nextn_predict_layers"] == 1
    # the head's copy must be the head
    from safetensors.numpy import load_file, save_file
    path = os.path.join(hf_dir, "model.safetensors")
    bad = load_file(path)
    bad["model.layers.3.shared_head.head.weight"] = bad["model.layers.3.shared_head.head.weight"] * 2
    save_file(bad, path, metadata={"format": "pt"})
    assert convert(["from-hf", "--hf-dir", hf_dir, "--out", str(tmp_path / "run2")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "model.layers.3.shared_head.head.weight differs from lm_head.weight" in err, err
