"""data.mixture: realised proportions, tokens per source, resume, processes and workers, the metrics."""

from __future__ import annotations

import json

import numpy as np
import pytest

from helpers.data import prepare, write_corpus
from helpers.faults import args as run_args
from helpers.metrics import read_metrics
from lumen_jax.config import DataConfig, MixtureSource
from lumen_jax.data import TrainData
from lumen_jax.data.mixture import rows_per_source, source_positions

DIGITS = frozenset(b"0123456789")


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Two prepared sources told apart by their bytes: `web` is letters, `code` is digits."""
    root = tmp_path_factory.mktemp("mixture")
    out = {}
    for name, letters in (("web", "abcdefgh"), ("code", "0123456789")):
        globs = write_corpus(root / f"{name}-text", letters=letters, docs=40, seed=len(name))
        proc = prepare("--input", *globs, "--tokenizer", "byte", "--out", str(root / name), "--workers", "0")
        assert proc.returncode == 0, proc.stderr
        out[name] = {"dir": str(root / name), "globs": tuple(globs)}
    return out


def mix_cfg(sources, source="prepared", **kw) -> DataConfig:
    key = "dir" if source == "prepared" else "globs"
    paths = {n: (s[key],) if source == "prepared" else s[key] for n, s in sources.items()}
    mixture = (MixtureSource(paths=paths["web"], weight=0.7, name="web"),
               MixtureSource(paths=paths["code"], weight=0.3, name="code"))
    return DataConfig(**{"source": source, "mixture": mixture, "seq_len": 16, "global_batch_size": 8, **kw})


def code_rows(batches: list[dict]) -> np.ndarray:
    """Per row of every batch: whether it came from `code` (its tokens are digits, not letters)."""
    rows = np.concatenate([b["inputs"] for b in batches])
    return np.array([any(int(t) in DIGITS for t in row) for row in rows])


@pytest.mark.parametrize("weights", [(0.7, 0.3), (1.0, 1.0), (0.5, 0.2, 0.3), (3.0, 0.25)])
def test_rows_per_source_is_graings_mixing(weights):
    sources = source_positions(weights)
    chosen = np.array([sources[g] for g in range(3000)])
    for n in (0, 1, 7, 333, 1000, 2999, 3000):
        assert rows_per_source(n, weights) == [int((chosen[:n] == s).sum()) for s in range(len(weights))], n


@pytest.mark.parametrize("order, source", [("documents", "prepared"), ("windows", "prepared"), ("documents", "files")])
def test_realised_proportions_and_tokens_per_source(sources, order, source):
    data = TrainData(mix_cfg(sources, source, order=order), seed=0)
    batches = [next(data) for _ in range(250)]  # 2,000 rows of 16 tokens
    code = code_rows(batches)
    assert len(code) == 2000 and abs(code.mean() - 0.3) <= 0.03, code.mean()
    # Every batch mixes: no batch of 8 rows is all one source.
    per_batch = code.reshape(250, 8).mean(1)
    assert (per_batch > 0).all() and (per_batch < 1).all()
    # The state's counts are the realised ones, token for token.
    assert data.get_state()["tokens"] == {"web": int((~code).sum()) * 16, "code": int(code.sum()) * 16}


@pytest.mark.parametrize("order, k", [("documents", 9), ("windows", 9)])
def test_mixture_resumes_exactly(sources, order, k):
    cfg = mix_cfg(sources, order=order)
    data = TrainData(cfg, seed=4)
    [next(data) for _ in range(k)]
    state = json.loads(json.dumps(data.get_state()))
    expected = [next(data) for _ in range(6)]
    resumed = TrainData(cfg, seed=4)
    resumed.set_state(state)
    for x, y in zip(expected, [next(resumed) for _ in range(6)]):
        for key in x:
            np.testing.assert_array_equal(x[key], y[key], err_msg=key)
    assert resumed.get_state()["tokens"] == data.get_state()["tokens"]


def test_mixture_state_restores_another_process_count(sources):
    cfg = mix_cfg(sources)
    halves = [TrainData(cfg, seed=1, process_index=p, process_count=2) for p in range(2)]
    for h in halves:
        [next(h) for _ in range(5)]
    states = [json.loads(json.dumps(h.get_state())) for h in halves]
    merged = {**states[0], "streams": {**states[0]["streams"], **states[1]["streams"]}}  # as the loop merges
    expected = [np.concatenate([next(h)["inputs"] for h in halves]) for _ in range(3)]
    whole = TrainData(cfg, seed=1)
    whole.set_state(merged)
    for step in range(3):
        np.testing.assert_array_equal(next(whole)["inputs"], expected[step])


def test_workers_slice_the_selection_with_the_rows(sources):
    """Grain workers each pack a slice of every stream; the source of each row stays the one the
    global position gives, so the realised counts still equal the state's; the state resumes."""
    data = TrainData(mix_cfg(sources, num_workers=2), seed=0)
    try:
        # 7 batches: a checkpoint whose selection position, restarted at 0, would pick other sources
        # (after 20, 0.7/0.3's interleave happens to repeat itself closely enough to hide that).
        batches = [next(data) for _ in range(7)]
        code = code_rows(batches)
        positions = source_positions((0.7, 0.3))
        np.testing.assert_array_equal(code, [positions[g] == 1 for g in range(7 * 8)])  # row by row
        assert data.get_state()["tokens"] == {"web": int((~code).sum()) * 16, "code": int(code.sum()) * 16}
        state = json.loads(json.dumps(data.get_state()))
        expected = [next(data) for _ in range(3)]
    finally:
        data.close()
    resumed = TrainData(mix_cfg(sources, num_workers=2), seed=0)
    try:
        resumed.set_state(state)
        for x, y in zip(expected, [next(resumed) for _ in range(3)]):
            np.testing.assert_array_equal(x["inputs"], y["inputs"])
    finally:
        resumed.close()


def test_training_logs_tokens_per_source(sources, tmp_path):
    from lumen_jax.train import cli as train_cli

    web, code = sources["web"]["dir"], sources["code"]["dir"]
    run_dir = str(tmp_path / "run")
    mixture = f"data.mixture=[{{paths: [{web}], weight: 0.7}}, {{paths: [{code}], weight: 0.3}}]"
    assert train_cli.main(run_args(run_dir, "data.source=prepared", mixture, "checkpoint.every_steps=0")) == 0
    rows = read_metrics(run_dir)
    G, T = 8, 32  # helpers.faults.SMALL
    assert [(r["step"], r["tokens_web"], r["tokens_code"]) for r in rows] == [
        (s, *(n * T for n in rows_per_source(s * G, (0.7, 0.3)))) for s in (1, 2)]
