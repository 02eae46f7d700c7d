"""Generation with a KV cache: greedy equals recomputing the prefix and transformers' greedy `generate`,
padded batches equal their rows alone, seeded sampling is reproducible, tensor=2 equals one device; a
mixture-of-experts model decodes as its forward and evaluates on the devices at hand (to-hf refuses it);
--max-new-tokens is capped at the model's context; the progress bar on a terminal."""

import os
import re
import sys

import jax
import numpy as np
import pytest

from helpers import hf
from helpers.hf import hf_greedy
from helpers.terminal import run_in_pty
from helpers.tolerances import FP32_RTOL
from lumen_jax.checkpoint import weights
from lumen_jax.config import Config, DataConfig, MeshConfig, ModelConfig, MoeConfig
from lumen_jax.convert.__main__ import main as convert
from lumen_jax.generate import ONE_DEVICE, Generator, Sampling, main as generate, sample
from lumen_jax.model import apply, init_params
from lumen_jax.train.evaluate import evaluate, main as evaluate_cli

PROMPTS = [[5, 17, 60, 3, 88, 41, 12], [70, 2, 9]]
NEW = 8


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return hf.imported(str(tmp_path_factory.mktemp("gen")), tied=False, name="run")


def greedy_without_cache(loaded, prompt: list[int], new: int, with_logits: bool = False):
    """Greedy decoding that recomputes the whole sequence for every token (no cache), and the logits
    [new, V] each token was chosen from. The sequence is zero-padded to its final length: causal
    attention keeps the padding out of the earlier logits."""
    forward = jax.jit(lambda p, x, pos: apply(loaded.model.graphdef, p, x, pos))
    ids = np.zeros((1, len(prompt) + new), np.int32)
    ids[0, :len(prompt)] = prompt
    positions = np.arange(ids.shape[1], dtype=np.int32)[None]
    logits = []
    for t in range(len(prompt), ids.shape[1]):
        logits.append(np.asarray(forward(loaded.params, ids, positions))[0, t - 1])
        ids[0, t] = int(np.argmax(logits[-1]))
    return (ids[0, len(prompt):].tolist(), np.stack(logits)) if with_logits else ids[0, len(prompt):].tolist()


def test_greedy_cache_equals_no_cache_and_transformers_and_padded_rows(run):
    hf_dir, run_dir = run
    loaded = weights.load_onto_mesh(run_dir, None, base_mesh=ONE_DEVICE)
    gen = Generator(loaded, Sampling())
    alone = [gen.generate([p], NEW)[0] for p in PROMPTS]
    tokens, logits = greedy_without_cache(loaded, PROMPTS[0], NEW, with_logits=True)
    assert alone[0] == tokens
    assert alone[0] == hf_greedy(hf_dir, PROMPTS[0], NEW)
    batch, batch_logits = gen.generate(PROMPTS, NEW, return_logits=True)
    assert batch == alone  # left-padded into one batch, masked per row
    # Token equality alone is blind to small errors (a position off by one): the logits too, fp32.
    np.testing.assert_allclose(batch_logits[0], logits, rtol=FP32_RTOL, atol=FP32_RTOL * np.abs(logits).max())


def test_sampling_is_seeded_and_tensor_2_equals_one_device(run):
    _, run_dir = run
    one = weights.load_onto_mesh(run_dir, None, base_mesh=ONE_DEVICE)
    two = weights.load_onto_mesh(run_dir, None, ["mesh.tensor=2"], base_mesh=ONE_DEVICE)
    assert two.mesh.shape["tensor"] == 2 and two.mesh.devices.size == 2
    four = weights.load_onto_mesh(run_dir, None, ["mesh.tensor=2", "mesh.data=2"], base_mesh=ONE_DEVICE)
    assert four.mesh.shape["tensor"] == 2 and four.mesh.devices.size == 4
    # tensor=2 beside data=2 (the tensor split is the same program part as on tensor=2 alone)
    three = [*PROMPTS, [33]]  # over data=2: padded with a filler row
    assert Generator(four, Sampling()).generate(three, NEW) == Generator(one, Sampling()).generate(three, NEW)
    hot = Generator(one, Sampling(temperature=1.5, top_k=40, top_p=0.95))
    first = hot.generate(PROMPTS, NEW, seed=3)
    assert hot.generate(PROMPTS, NEW, seed=3) == first
    assert hot.generate(PROMPTS, NEW, seed=4) != first


def test_cli_prompt_ids_last_line_prompts_file_and_bad_input(run, tmp_path, capsys):
    _, run_dir = run
    assert generate(["--run-dir", run_dir, "--prompt-ids", ",".join(map(str, PROMPTS[1])),
                     "--max-new-tokens", str(NEW)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    loaded = weights.load_onto_mesh(run_dir, None, base_mesh=ONE_DEVICE)
    assert [int(t) for t in last.split()] == greedy_without_cache(loaded, PROMPTS[1], NEW)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def main(\n\nimport os\n")
    assert generate(["--run-dir", run_dir, "--prompts", str(prompts), "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out  # each prompt, then its continuation (which may hold a newline)
    assert out.startswith("def main(") and "\nimport os" in out, out
    for bad, expected in ((["--prompt-ids", "1,x"], "--prompt-ids='1,x'"), (["--prompt-ids", "320"], "[0, 320)"),
                          (["--prompt-ids", "1", "--top-p", "0"], "--top-p=0.0"),
                          (["--prompt-ids", "1", "mesh.tensor=3"], "mesh.tensor=3"),
                          (["--prompt-ids", "1", "optim.lr=1"], "only mesh.*"),
                          (["--prompt-ids", "1", "--step", "7"], "--step=7")):
        assert generate(["--run-dir", run_dir, *bad]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and expected in err, (bad, err)
    assert generate(["--run-dir", run_dir + "-missing", "--prompt-ids", "1"]) == 2
    assert "has no checkpoints" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------
# The sampling filters on fixed distributions (no model): which tokens can be drawn at all
# --------------------------------------------------------------------------------------------------

DRAWS = 4000  # rows drawn at once: a token of probability >= 0.2 is missed with odds below 1e-300


def drawable(probs: list[float], s: Sampling, seed: int = 0) -> set[int]:
    """The tokens `sample` draws over DRAWS independent rows of the same distribution."""
    import jax.numpy as jnp

    logits = jnp.log(jnp.tile(jnp.asarray(probs, jnp.float32), (DRAWS, 1)))
    return set(np.asarray(sample(logits, jax.random.key(seed), s)).tolist())


@pytest.mark.parametrize("filters,expected", [
    (dict(top_p=0.7), {0, 1}),  # 0.5 < 0.7: token 1 is still needed; 0.5 + 0.3 >= 0.7: token 2 is not
    (dict(top_k=2), {0, 1}),
    (dict(top_p=0.49), {0}),  # token 0 alone has mass 0.5 >= 0.49
    (dict(top_p=0.51), {0, 1}),
    (dict(top_p=0.81), {0, 1, 2}),
    (dict(top_p=0.01), {0}),  # the top token always survives, however small top_p
    (dict(top_k=1), {0}),
    (dict(top_k=3), {0, 1, 2}),
    (dict(top_k=2, top_p=0.4), {0}),  # both: top-k first, then top-p of what is left
    (dict(), {0, 1, 2}),
])
def test_sampling_filters_keep_exactly_their_set(filters, expected):
    got = drawable([0.5, 0.3, 0.2], Sampling(temperature=1.0, **filters))
    assert got == expected, (filters, got)


def test_the_top_token_survives_every_filter_wherever_it_is():
    """The largest logit anywhere in the row (not only at index 0), with a high temperature and the
    tightest filters, is still drawable, and is then the only token."""
    probs = [0.05, 0.1, 0.6, 0.25]
    for s in (Sampling(temperature=3.0, top_p=1e-3), Sampling(temperature=3.0, top_k=1),
              Sampling(temperature=0.2, top_k=1, top_p=1e-3)):
        assert drawable(probs, s, seed=1) == {2}, s
    assert drawable(probs, Sampling(temperature=1.0, top_p=0.7)) == {2, 3}


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    """Random mixture-of-experts weights (every second layer MoE) in a run directory whose config records a
    training mesh of 16 devices (data=2 pipeline=2 expert=4): more than this machine has."""
    model = ModelConfig(d_model=32, num_layers=4, num_heads=4, num_kv_heads=2, ffn_dim=48, vocab_size=512,
                        init_std=0.3, compute_dtype="float32",
                        moe=MoeConfig(num_experts=4, top_k=2, every_n_layers=2, expert_ffn_dim=32))
    cfg = Config(model=model, mesh=MeshConfig(data=2, fsdp=1, pipeline=2, expert=4),
                 data=DataConfig(seq_len=32, global_batch_size=8, builtin_max_bytes=200_000))
    run_dir = str(tmp_path_factory.mktemp("moe") / "run")
    weights.save_weights(run_dir, cfg, jax.device_get(jax.jit(init_params, static_argnums=(0, 1))(model, 3)))
    return run_dir


def test_moe_decodes_as_its_forward_and_evaluates_on_the_devices_at_hand(moe_run, tmp_path, capsys):
    loaded = weights.load_onto_mesh(moe_run, None, base_mesh=ONE_DEVICE)
    assert loaded.mesh.devices.size == 1
    tokens, logits = Generator(loaded, Sampling()).generate([PROMPTS[0]], NEW, return_logits=True)
    want, want_logits = greedy_without_cache(loaded, PROMPTS[0], NEW, with_logits=True)
    assert tokens[0] == want and len(set(want)) > 1
    np.testing.assert_allclose(logits[0], want_logits, rtol=FP32_RTOL, atol=FP32_RTOL * np.abs(want_logits).max())
    assert generate(["--run-dir", moe_run, "--prompt-ids", ",".join(map(str, PROMPTS[0])),
                     "--max-new-tokens", str(NEW)]) == 0
    assert [int(t) for t in capsys.readouterr().out.strip().splitlines()[-1].split()] == want

    assert evaluate_cli(["--run-dir", moe_run, "--data", "train", "--batches", "1"]) == 0
    assert capsys.readouterr().out.startswith("step 0: eval_loss ")
    spread = evaluate(moe_run, None, "train", 1)  # fsdp=8, whatever the training mesh
    alone = evaluate(moe_run, None, "train", 1, ["mesh.fsdp=1"])  # one device
    np.testing.assert_allclose(spread["eval_loss"], alone["eval_loss"], rtol=FP32_RTOL)

    out = str(tmp_path / "hf")
    assert convert(["to-hf", "--run-dir", moe_run, "--out", out]) == 2
    err = capsys.readouterr().err.strip()
    # every second layer MoE without a shared expert: no Hugging Face family here expresses it
    assert len(err.splitlines()) == 1 and "model.moe.every_n_layers>1 without shared experts" in err, err
    assert not os.path.exists(out)


def test_max_new_tokens_is_capped_at_the_models_context(run, moe_run, capsys):
    _, imported = run
    for run_dir, context, source in ((imported, 128, "max_position_embeddings of the imported model"),
                                     (moe_run, 32, "data.seq_len=32, the length it was trained at")):
        assert generate(["--run-dir", run_dir, "--prompt-ids", "70,2,9", "--max-new-tokens", "100000"]) == 0
        out, err = capsys.readouterr()
        assert err.startswith(f"note: --max-new-tokens=100000 capped at {context - 3}: the model's context is "
                              f"{context} tokens ({source}) and the prompt takes 3"), err
        assert len(out.strip().splitlines()[-1].split()) == context - 3
    assert generate(["--run-dir", moe_run, "--prompt-ids", ",".join(["7"] * 32)]) == 2
    assert "fills the model's context of 32" in capsys.readouterr().err


def test_a_terminal_shows_the_progress_of_a_batch(run, tmp_path):
    _, run_dir = run
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def main(\nimport os\n")
    with open(tmp_path / "out.txt", "w") as stdout:
        code, terminal = run_in_pty([sys.executable, "-m", "lumen_jax.generate", "--run-dir", run_dir, "--prompts",
                                     str(prompts), "--max-new-tokens", "40"], stdout=stdout)
    assert code == 0, terminal[-3000:]
    assert re.search(r"generate: +\d+%\|.*\| +\d+/40 \[", terminal) and "tok" in terminal, terminal[-3000:]
    assert (tmp_path / "out.txt").read_text().startswith("def main(")


def test_the_runs_tokenizer_is_recorded_by_absolute_path_and_hash(tmp_path, monkeypatch, capsys):
    """Trained with data.tokenizer=tok.json (relative), generate and evaluate from another folder that
    has its own tok.json use the run's; a run's tokenizer changed since training is refused in one line."""
    import hashlib

    from helpers.data import write_bpe_tokenizer
    from helpers.faults import RUN_STEPS, args
    from lumen_jax.train import cli as train_cli

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    mine = write_bpe_tokenizer(a / "tok.json", ["the cat sat on the mat", "def main(): return 0"], vocab_size=300)
    other = write_bpe_tokenizer(b / "tok.json", ["zebras quickly vexed", "jumping quartz"], vocab_size=300)
    run = str(tmp_path / "run")
    monkeypatch.chdir(a)
    assert train_cli.main(args(run, "data.tokenizer=tok.json")) == 0
    data = weights.read_config(run, RUN_STEPS).data
    assert (data.tokenizer, data.tokenizer_sha256) == (mine, hashlib.sha256(open(mine, "rb").read()).hexdigest())
    monkeypatch.chdir(b)
    assert generate(["--run-dir", run, "--prompt", "the cat", "--max-new-tokens", "2"]) == 0
    capsys.readouterr()
    os.replace(other, mine)  # the run's tokenizer file now holds other ids
    for command, argv in ((generate, ["--prompt", "the cat", "--max-new-tokens", "2"]),
                          (evaluate_cli, ["--data", "train", "--batches", "1"])):
        assert command(["--run-dir", run, *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith(f"error: data.tokenizer={mine!r} has sha256 "), err
        assert "not the tokenizer the run recorded" in err, err
