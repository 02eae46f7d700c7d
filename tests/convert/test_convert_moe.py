"""Mixtral, Qwen2-MoE and Qwen3-MoE import and export against `transformers` itself (CPU torch):
logits, a swapped-weights control, the round trip, greedy generation, evaluate, the aux-loss
convention, bad inputs. One small random model per family, written with `save_pretrained`
(Qwen2-MoE sharded with an index, a dense first layer, a gated shared expert)."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from helpers.hf import (MOE_MODELS, TOKENS, assert_to_hf_round_trips, from_hf_refusal, hf_greedy, import_each,
                        logits_close, logits_of, make_hf_moe, our_params)
from helpers.paths import REPO
from helpers.tolerances import FP32_RTOL
from lumen_jax.checkpoint import weights
from lumen_jax.train import init_from as init_from_lib
from lumen_jax.config import ConfigError
from lumen_jax.convert.__main__ import main as convert

FAMILIES = list(MOE_MODELS)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """{family: (HF dir, run dir imported with from-hf, transformers' logits of TOKENS)}."""
    return import_each(str(tmp_path_factory.mktemp("hf_moe")), lambda path, kind: make_hf_moe(
        path, kind, max_shard_size="40KB" if kind == "qwen2_moe" else None), FAMILIES)


@pytest.mark.parametrize("kind", FAMILIES)
def test_from_hf_logits_match_transformers_and_swapped_experts_do_not(imported, kind):
    hf_dir, run_dir, ref = imported[kind]
    model, params = our_params(run_dir)
    assert model.moe.num_experts == 8 and model.moe.top_k == 2
    assert (model.moe.normalize_top_k, model.moe.shared_gate, model.qkv_bias, model.qk_norm) == {
        "mixtral": (True, False, False, False), "qwen2_moe": (False, True, True, False),
        "qwen3_moe": (True, False, False, True)}[kind]
    if kind == "qwen2_moe":
        assert os.path.isfile(os.path.join(hf_dir, "model.safetensors.index.json"))
        assert model.moe.every_n_layers == 3 and model.moe.shared_experts == 2
    coef = json.load(open(os.path.join(hf_dir, "config.json")))["router_aux_loss_coef"]
    moe_layers = model.num_layers // model.moe.every_n_layers
    assert model.moe.aux_loss_weight == pytest.approx(coef * 2 / moe_layers, rel=1e-12)  # top_k / layers
    assert model.moe.router_z_loss_weight == 0
    ours = logits_of(model, params, TOKENS)
    np.testing.assert_allclose(ours, ref, rtol=FP32_RTOL, atol=FP32_RTOL * float(np.abs(ref).max()))
    # the control: experts 0 and 1 of the MoE layers swapped (one of their three matrices) must show
    swapped = {**params, "moe_blocks": {**params["moe_blocks"], "mlp": dict(params["moe_blocks"]["mlp"])}}
    w_up = np.array(params["moe_blocks"]["mlp"]["w_up"])
    swapped["moe_blocks"]["mlp"]["w_up"] = w_up[:, [1, 0, *range(2, 8)]]
    assert not logits_close(logits_of(model, swapped, TOKENS), ref)


@pytest.mark.parametrize("kind", FAMILIES)
def test_to_hf_round_trips_every_tensor_and_transformers_loads_it(imported, kind, tmp_path):
    config, source = assert_to_hf_round_trips(*imported[kind], str(tmp_path / "back"))
    assert config["model_type"] == kind
    np.testing.assert_allclose(config["router_aux_loss_coef"], source["router_aux_loss_coef"], rtol=1e-12)


def test_generate_and_evaluate_on_an_imported_moe(imported):
    """Greedy tokens of the Qwen2-MoE import equal transformers' generate (expert=2 mesh); evaluate
    runs on it (exit 0, its one line)."""
    hf_dir, run_dir, _ = imported["qwen2_moe"]
    prompt = [5, 17, 60, 3, 88]
    want = hf_greedy(hf_dir, prompt, 6)
    gen = subprocess.run([sys.executable, "-m", "lumen_jax.generate", "--run-dir", run_dir, "--prompt-ids",
                          ",".join(map(str, prompt)), "--max-new-tokens", "6", "mesh.expert=2",
                          "runtime.cpu_devices=2"], cwd=REPO, timeout=300, capture_output=True, text=True)
    assert gen.returncode == 0, gen.stderr[-2000:]
    assert [int(t) for t in gen.stdout.split()] == want
    ev = subprocess.run([sys.executable, "-m", "lumen_jax.evaluate", "--run-dir", run_dir, "--data", "train",
                         "--batches", "1", "data.seq_len=16", "data.global_batch_size=2"],
                        cwd=REPO, timeout=300, capture_output=True, text=True)
    assert ev.returncode == 0 and ev.stdout.startswith("step 0: eval_loss "), ev.stderr[-2000:]


def test_hf_aux_loss_is_top_k_times_ours_for_one_layer():
    """transformers' load_balancing_loss_func on one layer's router logits = top_k * our balance loss:
    from-hf's aux_loss_weight = router_aux_loss_coef * top_k / (MoE layers)."""
    import jax.numpy as jnp
    import torch
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from lumen_jax.config import MoeConfig
    from lumen_jax.ops import moe as moe_ops

    logits = np.random.default_rng(0).normal(size=(1, 24, 8)).astype(np.float32)
    for top_k in (2, 3):
        theirs = float(load_balancing_loss_func((torch.from_numpy(logits[0]),), 8, top_k))
        _, _, stats = moe_ops.route(jnp.asarray(logits), jnp.eye(8), MoeConfig(num_experts=8, top_k=top_k))
        np.testing.assert_allclose(theirs, top_k * float(stats["balance_loss"]), rtol=FP32_RTOL)


BAD = {
    "sliding window": ("mixtral", {"sliding_window": 4096}, "config.json sliding_window=4096 is not supported"),
    "mlp_only_layers": ("qwen3_moe", {"mlp_only_layers": [1]}, "config.json mlp_only_layers=[1] is not supported"),
    "shared width": ("qwen2_moe", {"shared_expert_intermediate_size": 40},
                     "config.json shared_expert_intermediate_size=40 is not a multiple of moe_intermediate_size=16"),
    "10**9 experts": ("mixtral", {"num_local_experts": 10**9}, "num_local_experts=1000000000 is not between 1 and"),
    "unknown field": ("qwen3_moe", {"moe_router_bias": True}, "config.json field moe_router_bias=True is not understood"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_from_hf_bad_moe_config_exits_2_with_one_line(imported, tmp_path, capsys, case):
    kind, change, fragment = BAD[case]
    err = from_hf_refusal(imported[kind][0], str(tmp_path), change, capsys)
    assert fragment in err, err


def test_to_hf_refuses_a_routing_no_hf_family_has(tmp_path, capsys):
    """A run with balance=bias (DeepSeek-V3's selection bias) has no place in these architectures:
    one line, exit 2, nothing written."""
    from lumen_jax.config import Config, ModelConfig, MoeConfig

    cfg = Config(model=ModelConfig(d_model=16, num_layers=1, num_heads=2, num_kv_heads=1, ffn_dim=16, vocab_size=32,
                                   moe=MoeConfig(num_experts=4, balance="bias")))
    from lumen_jax.model import init_params

    run_dir = str(tmp_path / "run")
    weights.save_weights(run_dir, cfg, jax.jit(init_params, static_argnums=(0, 1))(cfg.model, 0))
    back = str(tmp_path / "back")
    assert convert(["to-hf", "--run-dir", run_dir, "--out", back]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: model.moe.balance='bias' has no place in MixtralForCausalLM") and "\n" not in err
    assert not os.path.exists(back)


def test_init_from_a_hf_moe_takes_its_routing(imported, tmp_path):
    """train.init_from of the Qwen2-MoE directory: a config that renormalises top-k is given the
    weights' normalize_top_k=false, with a note; a different expert count is one line naming the key."""
    hf_dir, run_dir, _ = imported["qwen2_moe"]
    cfg = weights.read_config(run_dir, 0)
    mine = cfg.replace(model=dataclasses.replace(cfg.model, moe=dataclasses.replace(cfg.model.moe, normalize_top_k=True)),
                       train=dataclasses.replace(cfg.train, init_from=hf_dir))
    got, notes = init_from_lib.defined_by_init_from(mine, str(tmp_path / "new"))
    assert got.model.moe.normalize_top_k is False
    assert any("model.moe.normalize_top_k=False (the config had True)" in n for n in notes), notes
    wrong = mine.replace(model=dataclasses.replace(mine.model, moe=dataclasses.replace(mine.model.moe, num_experts=4)))
    with pytest.raises(ConfigError) as e:
        init_from_lib.defined_by_init_from(wrong, str(tmp_path / "new"))
    assert str(e.value).startswith("model.moe.num_experts=4 differs from the weights of train.init_from=")
