"""Aux-loss-free balancing (`model.moe.balance: bias`): the bias and load are model state that the
step updates by DeepSeek-V3's rule from the whole global batch's counts (checked by hand over two
steps, on a mesh with micro-batches), never parameters; and it flattens the load against no
balancing on the same seed."""

import dataclasses
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from helpers.data import packed_batch
from helpers.meshes import mesh_config, small_mesh
from helpers.metrics import losses_and_grad_norms
from helpers.paths import REPO
from helpers.run import BASE
from lumen_jax.checkpoint import weights
from lumen_jax.config import MoeConfig
from lumen_jax.generate import ONE_DEVICE, Generator, Sampling
from lumen_jax.model.layers import rope_frequencies
from lumen_jax.train.build import build
from lumen_jax.train.evaluate import evaluate

E, K, RATE = 8, 2, 0.01


def _config(balance: str, rate: float = RATE, micro_batches: int = 1, **mesh):
    return BASE.replace(
        model=dataclasses.replace(BASE.model, d_model=32, num_layers=1, num_heads=2, num_kv_heads=1, vocab_size=128,
                                  moe=MoeConfig(num_experts=E, top_k=K, expert_ffn_dim=16, aux_loss_weight=0.0,
                                                router_z_loss_weight=0.0, balance=balance, bias_update_rate=rate)),
        data=dataclasses.replace(BASE.data, global_batch_size=8),
        optim=dataclasses.replace(BASE.optim, lr=1e-2, schedule="constant", z_loss=0.0),
        mesh=mesh_config(**mesh), train=dataclasses.replace(BASE.train, micro_batches=micro_batches))


def _counts_by_hand(trainer, params: dict, model_state: dict, batch: dict, bias: np.ndarray) -> np.ndarray:
    """Assignments per expert over the whole batch: the router's input from the model's layer, then
    softmax, score + bias, top-2 and the count in numpy."""
    graphdef = trainer.step_cfg.graphdef

    @jax.jit  # one program (eager, each op compiled alone)
    def router_logits(params, model_state, batch):
        model = nnx.merge(graphdef, params, model_state)
        g, layer_state = nnx.split(model.moe_blocks)
        block = nnx.merge(g, jax.tree.map(lambda v: v[0], layer_state))
        x = model.embed_tokens(batch["inputs"])
        h = block.attn_norm(x)
        x = x + block.attn(h, batch["positions"], batch["segment_ids"], rope_frequencies(model.cfg), model.ops)
        return block.mlp_norm(x) @ block.mlp.router[...]

    logits = np.asarray(router_logits(params, model_state, batch), np.float64).reshape(-1, E)
    scores = np.exp(logits - logits.max(-1, keepdims=True))
    scores /= scores.sum(-1, keepdims=True)
    chosen = np.argsort(scores + bias, axis=-1)[:, ::-1][:, :K]
    return np.bincount(chosen.reshape(-1), minlength=E).astype(np.float64)


def test_bias_update_equals_the_formula_over_the_global_batch():
    """expert=2 data=2 with 2 micro-batches: after step 1 the state holds the bias step 1 chose with
    (0) and the whole batch's load; after step 2 the bias is 0 + rate * sign(mean load - load)."""
    cfg = _config("bias", micro_batches=2, expert=2, data=2)
    trainer = build(cfg, small_mesh(expert=2, data=2))
    state = trainer.init()
    assert "balance" not in str(jax.tree_util.tree_structure(state.params))  # not a parameter, no optimizer state
    raw = packed_batch(8, cfg.data.seq_len, 128, seed=0)
    batch = trainer.shard_batch(raw)
    tokens = float(raw["inputs"].size)
    bias_seen = np.zeros(E)
    for step in range(2):
        counts = _counts_by_hand(trainer, state.params, state.model_state, raw, bias_seen)
        state, _ = trainer.step(state, batch)
        ms = jax.device_get(state.model_state)["moe_blocks"]["mlp"]["balance"]
        np.testing.assert_array_equal(ms["load"][0], counts)  # summed over micro-batches and devices, exact
        assert counts.sum() == K * tokens and counts.max() > counts.min()
        np.testing.assert_array_equal(ms["bias"][0], bias_seen.astype(np.float32))  # the bias this step chose with
        bias_seen = bias_seen + RATE * np.sign(counts.mean() - counts)
    assert np.abs(ms["bias"]).max() > 0  # step 2 chose with a bias


def _train(balance: str, steps: int = 60) -> dict:
    cfg = _config(balance, rate=0.02)
    trainer = build(cfg, small_mesh())
    state = trainer.init()
    batch = trainer.shard_batch(packed_batch(8, cfg.data.seq_len, 128, seed=0))
    spreads = []
    for _ in range(steps):
        state, metrics = trainer.step(state, batch)
        m = jax.device_get(metrics)
        spreads.append(float(m["moe/expert_fraction_max"] - m["moe/expert_fraction_min"]))
    return {"spread": np.mean(spreads[-20:]), "loss": float(m["loss"])}


def test_bias_balancing_flattens_the_load_against_none():
    """Same seed, no auxiliary loss in either: over the last 20 of 60 steps the most and least used
    experts are closer with the bias than without it, and the model still learns."""
    biased, unbalanced = _train("bias"), _train("aux_loss")
    assert biased["spread"] < 0.7 * unbalanced["spread"], (biased, unbalanced)
    assert biased["loss"] < 1.0, biased  # from ln(128) = 4.85


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, timeout=300, capture_output=True, text=True)


@pytest.mark.heavy
def test_resume_is_bit_exact_with_the_bias_in_the_checkpoint_and_generate_evaluate_use_it(tmp_path, monkeypatch):
    """tiny_moe with balance=bias on expert=2: 6 steps straight and 3 + 3 resumed give the same losses
    and grad norms bit for bit and the same bias and load; generate and evaluate run on the run (step 6)
    and use its bias (with the state zeroed their results change)."""
    common = ["--config", "configs/tiny_moe.yaml", "runtime.cpu_devices=2", "mesh.expert=2",
              "checkpoint.every_steps=3", "model.moe.balance=bias", "model.moe.bias_update_rate=0.005",
              "log.every_steps=1", "log.progress=false"]
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    for run_dir, steps in ((straight, (6,)), (resumed, (3, 6))):
        for n in steps:
            out = _cli("lumen_jax.train", *common, f"train.run_dir={run_dir}", f"train.steps={n}")
            assert out.returncode == 0, out.stderr[-2000:]
    assert losses_and_grad_norms(resumed) == losses_and_grad_norms(straight)
    states = []
    for run_dir in (straight, resumed):
        loaded = weights.load_onto_mesh(run_dir, None, base_mesh=ONE_DEVICE)
        assert loaded.step == 6
        states.append(jax.device_get(loaded.model_state))
    balance = [s["moe_blocks"]["mlp"]["balance"] for s in states]
    for key in ("bias", "load"):
        np.testing.assert_array_equal(balance[0][key], balance[1][key])
    assert np.abs(balance[0]["bias"]).max() > 0
    # generate and evaluate in this process (their command lines on an MoE run, generate on expert=2:
    # tests/convert/test_convert_moe.py)
    loaded = weights.load_onto_mesh(resumed, None, base_mesh=ONE_DEVICE)
    result = evaluate(resumed, None, "train", 1)
    assert result["step"] == 6, result
    with_bias = result["eval_loss"]
    _, logits = Generator(loaded, Sampling()).generate([[1, 2, 3]], 2, return_logits=True)
    zeros = lambda tree: jax.tree.map(lambda a: jax.device_put(np.zeros(a.shape, a.dtype), a.sharding), tree)  # noqa: E731
    monkeypatch.setattr(weights, "load_model_state", lambda run_dir, step, abstract: zeros(abstract))
    assert evaluate(resumed, None, "train", 1)["eval_loss"] != with_bias
    unbiased = dataclasses.replace(loaded, model_state=zeros(loaded.model_state))
    assert not np.array_equal(Generator(unbiased, Sampling()).generate([[1, 2, 3]], 2, return_logits=True)[1], logits)
