"""The commands that read a run's weights (generate, evaluate, convert to-hf, train.init_from) verify the
checkpoint as the trainer's restore does: a damaged step is one line naming the step and the file or
array, exit 2, nothing on disk changed; asked for the latest, they name the damaged step and use the one
before. train.init_from takes the tokenizer and RoPE of the weights it starts from."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from helpers import hf
from helpers.faults import args, snapshot
from helpers.paths import REPO
from lumen_jax.checkpoint import weights
from lumen_jax.train import init_from as init_from_lib
from lumen_jax.convert.__main__ import main as convert
from lumen_jax.generate import ONE_DEVICE, Generator, Sampling, main as generate
from lumen_jax.train import cli as train_cli
from lumen_jax.train.evaluate import main as evaluate


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny trained run with checkpoints at steps 1 and 2."""
    run = str(tmp_path_factory.mktemp("trained") / "run")
    assert train_cli.main(args(run, "checkpoint.every_steps=1")) == 0
    return run


def _state(run: str, step: int) -> str:
    return os.path.join(run, "checkpoints", str(step), "state")


def _data_chunks(run: str, step: int) -> list[str]:
    d = os.path.join(_state(run, step), "ocdbt.process_0", "d")
    return [os.path.join(d, f) for f in os.listdir(d) if os.path.getsize(os.path.join(d, f)) > 10_000]


def _other_arrays(run: str, step: int) -> None:
    """Step `step` holds step 1's arrays: every file reads back, every checksum differs."""
    shutil.rmtree(_state(run, step))
    shutil.copytree(_state(run, 1), _state(run, step))


def _every_97th_byte(run: str, step: int) -> None:
    for path in _data_chunks(run, step):
        data = bytearray(open(path, "rb").read())
        data[::97] = bytes(b ^ 0xFF for b in data[::97])
        open(path, "wb").write(data)


def _flip_bytes(run: str, step: int) -> None:
    """One byte flipped in every 4 kB page of the data files: every array over 4 kB is damaged. (Its
    middle byte alone hit whichever array OCDBT wrote mid-file, an optimizer moment when two saves'
    writes interleaved under load: generate, which reads the parameters only, then saw no damage.)"""
    for path in _data_chunks(run, step):
        data = bytearray(open(path, "rb").read())
        data[2048::4096] = bytes(b ^ 0xFF for b in data[2048::4096])
        open(path, "wb").write(data)


def _swapped_elements(run: str, step: int) -> None:
    """Two unequal elements of one parameter trade places: the plain sum of the bits stays, their order does not."""
    import jax
    import orbax.checkpoint as ocp

    from lumen_jax.runtime.checksums import checksum_list

    checkpointer = ocp.StandardCheckpointer()
    tree = jax.tree.map(np.asarray, checkpointer.restore(_state(run, step)))
    name, table = next((k, v) for k, v in tree["params"].items() if getattr(v, "ndim", 0) >= 1)
    flat = table.reshape(-1).copy()
    j = int(np.flatnonzero(flat != flat[0])[0])
    flat[[0, j]] = flat[[j, 0]]
    before, after = checksum_list(tree["params"][name]), checksum_list(flat.reshape(table.shape))
    assert before[0][0] == after[0][0] and before[0][1] != after[0][1], (before, after)
    tree["params"][name] = flat.reshape(table.shape)
    shutil.rmtree(_state(run, step))
    checkpointer.save(_state(run, step), tree)
    checkpointer.wait_until_finished()


def _truncated_sharding(run: str, step: int) -> None:
    path = os.path.join(_state(run, step), "_sharding")
    text = open(path).read()
    open(path, "w").write(text[:len(text) // 2])


DAMAGE = {  # how: what the one line names
    "other arrays": (_other_arrays, "differs from the checksum recorded when it was saved"),
    "swapped elements": (_swapped_elements, "differs from the checksum recorded when it was saved"),
    "every 97th byte": (_every_97th_byte, "is damaged (ZSTD_decompressStream() failed"),
    "flipped bytes": (_flip_bytes, "/checkpoints/2/state"),
    "truncated _sharding": (_truncated_sharding, "/checkpoints/2/state/_sharding is damaged"),
}


def _without_log(tree: dict) -> dict:
    return {k: v for k, v in tree.items() if k != "library.log"}  # readers send Orbax's tracebacks there


def _one_line(capfd) -> str:
    err = capfd.readouterr().err
    lines = [line for line in err.strip().splitlines()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_every_reader_stops_on_a_damaged_step_with_one_line(trained, damage, tmp_path, capfd):
    run = str(tmp_path / "run")
    shutil.copytree(trained, run)
    how, named = DAMAGE[damage]
    how(run, 2)
    before = snapshot(run)
    capfd.readouterr()
    for command, argv in ((generate, ["--prompt-ids", "1,2", "--max-new-tokens", "2"]),
                          (evaluate, ["--data", "train", "--batches", "1"])):
        assert command(["--run-dir", run, "--step", "2", *argv]) == 2
        line = _one_line(capfd)
        assert "checkpoint step 2" in line and named in line and "choose another --step (1)" in line, line
    out = str(tmp_path / "hf")
    assert convert(["to-hf", "--run-dir", run, "--step", "2", "--out", out]) == 2
    assert named in _one_line(capfd) and not os.path.exists(out)
    assert _without_log(snapshot(run)) == _without_log(before), "a reader changed the run directory"


def test_the_latest_damaged_step_is_named_and_the_one_before_used(trained, tmp_path):
    """What a person sees: `generate` on a run whose newest checkpoint is damaged."""
    run = str(tmp_path / "run")
    shutil.copytree(trained, run)
    _flip_bytes(run, 2)
    before = snapshot(run)
    proc = subprocess.run([sys.executable, "-m", "lumen_jax.generate", "--run-dir", run, "--prompt-ids", "5,17,60",
                           "--max-new-tokens", "4"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = proc.stderr.strip().splitlines()[0]
    assert first.startswith("warning: checkpoint step 2") and first.endswith("; using step 1"), proc.stderr
    step1 = Generator(weights.load_onto_mesh(trained, 1, base_mesh=ONE_DEVICE), Sampling()).generate([[5, 17, 60]], 4)
    assert [int(t) for t in proc.stdout.strip().splitlines()[-1].split()] == step1[0]
    assert _without_log(snapshot(run)) == _without_log(before)


def test_init_from_a_run_with_no_usable_checkpoint_is_one_line(trained, tmp_path, capfd):
    source = str(tmp_path / "source")
    shutil.copytree(trained, source)
    for step in (1, 2):
        _every_97th_byte(source, step)
    before = snapshot(source)
    capfd.readouterr()
    new = str(tmp_path / "new")
    assert train_cli.main(args(new, f"train.init_from={source}")) == 2
    line = _one_line(capfd)
    assert f"no checkpoint of {source} is usable: checkpoint step 2" in line and "1 older one is unusable" in line
    assert _without_log(snapshot(source)) == _without_log(before)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A small random Hugging Face Llama (rope_theta 100, Llama-3 scaling, rms_norm_eps 1e-6) with a tokenizer."""
    hf_dir = hf.make_hf(str(tmp_path_factory.mktemp("llama") / "hf"), tied=False)
    hf.add_tokenizer(hf_dir)
    return hf_dir


FINE_TUNE = ["model.d_model=32", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
             "model.head_dim=16", "model.ffn_dim=48", "model.vocab_size=320", "data.builtin_max_bytes=200000"]


def test_init_from_takes_the_models_tokenizer_and_rope_and_names_them(llama, tmp_path, capfd):
    run = str(tmp_path / "run")
    capfd.readouterr()
    assert train_cli.main(args(run, *FINE_TUNE, "train.steps=1", "checkpoint.every_steps=1",
                               f"train.init_from={llama}")) == 0
    out, err = capfd.readouterr()
    [note] = [line for line in err.splitlines() if line.startswith("note:")]
    tokenizer = os.path.join(llama, "tokenizer.json")
    for part in (f"the Hugging Face model {llama} defines", "model.rope_theta=100.0 (the config had 500000.0)",
                 "model.norm_eps=1e-06", "model.rope_scaling=llama3", "model.rope_original_max_len=64",
                 f"data.tokenizer={tokenizer} (the config had byte)"):
        assert part in note, (part, note)
    assert f"weights from train.init_from={llama}" in out.splitlines()[0]
    with open(os.path.join(run, "config.json")) as f:
        recorded = json.load(f)
    assert recorded["data"]["tokenizer"] == tokenizer
    assert (recorded["model"]["rope_theta"], recorded["model"]["norm_eps"], recorded["model"]["rope_scaling"]) == \
        (100.0, 1e-6, "llama3")
    # The resume keeps them (from its own checkpoint) and says init_from is not used.
    assert train_cli.main(args(run, *FINE_TUNE, "train.steps=2", f"train.init_from={llama}")) == 0
    out, err = capfd.readouterr()
    assert f"note: train.init_from={llama} is not used: {run} has checkpoints" in err, err
    assert "resumed from step 1" in out


def test_init_from_mismatches_and_truncated_weights_are_one_line(llama, tmp_path, capfd):
    capfd.readouterr()
    run = str(tmp_path / "run")
    assert train_cli.main(args(run, *FINE_TUNE, "model.vocab_size=512", f"train.init_from={llama}")) == 2
    line = _one_line(capfd)
    assert "model.vocab_size=512 differs from the weights of train.init_from" in line
    assert line.endswith("set model.vocab_size=320"), line
    truncated = str(tmp_path / "truncated")
    shutil.copytree(llama, truncated)
    path = os.path.join(truncated, "model.safetensors")
    data = open(path, "rb").read()
    open(path, "wb").write(data[:len(data) // 2])
    assert train_cli.main(args(run, *FINE_TUNE, f"train.init_from={truncated}")) == 2
    line = _one_line(capfd)
    assert f"{path} is not a readable safetensors file" in line and "truncated" in line, line
    assert not os.path.exists(run)
    # Without a tokenizer.json the run keeps bytes, and says so.
    os.remove(os.path.join(truncated, "tokenizer.json"))
    shutil.copyfile(os.path.join(llama, "model.safetensors"), path)
    cfg = train_cli.load_config(os.path.join(REPO, "configs/tiny.yaml"), [*FINE_TUNE, f"train.init_from={truncated}"])
    cfg, notes = init_from_lib.defined_by_init_from(cfg, run)
    assert cfg.data.tokenizer == "byte" and cfg.model.rope_theta == 100.0
    assert any(n.startswith("warning: train.init_from=") and "names no tokenizer" in n for n in notes), notes


def test_imported_model_state_is_saved_verified_and_read(tmp_path):
    """save_weights' model_state (an import's router bias) reads back through load_model_state, verified by
    its own checksums (a changed one: one line naming the array); an import without one, or one laid out
    otherwise than the reader's, reads as the fresh state (zeros)."""
    import jax

    cfg = train_cli.load_config(os.path.join(REPO, "configs/tiny.yaml"), [])
    params = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    state = {"moe_blocks": {"mlp": {"balance": {"bias": np.full((2, 4), -0.5, np.float32),
                                                "load": np.zeros((2, 4), np.float32)}}}}
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), state)
    run = str(tmp_path / "run")
    weights.save_weights(run, cfg, params, model_state=state)
    got = weights.load_model_state(run, 0, abstract)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(x), y)
    np.testing.assert_array_equal(np.asarray(weights.load_params(run, 0, jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), params))["w"]), params["w"])
    other = {"balance": {"bias": abstract["moe_blocks"]["mlp"]["balance"]["bias"]}}
    assert not np.any(np.asarray(weights.load_model_state(run, 0, other)["balance"]["bias"]))
    old = str(tmp_path / "old")  # an import written before model state was: zeros, as before
    weights.save_weights(old, cfg, params)
    assert not any(np.any(np.asarray(x)) for x in jax.tree.leaves(weights.load_model_state(old, 0, abstract)))
    meta = os.path.join(run, "checkpoints", "0", "meta", "metadata")
    recorded = json.load(open(meta))
    recorded["model_state_checksums"][0][1] ^= 1
    json.dump(recorded, open(meta, "w"))
    with pytest.raises(weights.UnusableCheckpoint) as e:
        weights.load_model_state(run, 0, abstract)
    line = str(e.value)
    assert "array model_state/moe_blocks/mlp/balance/bias in " in line and "differs from the checksum" in line, line
