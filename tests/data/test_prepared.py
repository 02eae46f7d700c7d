"""Reading prepared data: the same batches as on-the-fly, windows, resume, process counts, the tokenizer check."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from helpers.data import prepare, write_corpus
from lumen_jax.config import DataConfig
from lumen_jax.data import DataError, TrainData


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("prepared")
    globs = write_corpus(root / "text", docs=40)
    proc = prepare("--input", *globs, "--tokenizer", "byte", "--out", str(root / "web"), "--workers", "0")
    assert proc.returncode == 0, proc.stderr
    return {"globs": tuple(globs), "dir": str(root / "web")}


def files_cfg(corpus, **kw) -> DataConfig:
    return DataConfig(**{"source": "files", "paths": corpus["globs"], "seq_len": 16, "global_batch_size": 4, **kw})


def prepared_cfg(corpus, **kw) -> DataConfig:
    return DataConfig(**{"source": "prepared", "paths": (corpus["dir"],), "seq_len": 16, "global_batch_size": 4,
                         **kw})


def take(data: TrainData, n: int) -> list[dict]:
    return [next(data) for _ in range(n)]


def assert_same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for step, (x, y) in enumerate(zip(a, b)):
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=f"batch {step} {k}")


def test_prepared_documents_give_the_on_the_fly_batches(corpus):
    # ~1,100 tokens, 4 rows of 17 a batch: 30 batches cross several epochs of the document order.
    assert_same(take(TrainData(prepared_cfg(corpus), seed=3), 30), take(TrainData(files_cfg(corpus), seed=3), 30))


def test_windows_are_the_packed_rows_of_one_stream_in_a_permuted_order(corpus):
    """One stream without shuffling packs the documents back to back into windows of seq_len + 1:
    exactly data.order=windows in index order, up to the last full window of the epoch. Shuffled,
    the windows of one epoch are a permutation of those."""
    one = dict(global_batch_size=1, shuffle=False)
    windows = TrainData(prepared_cfg(corpus, order="windows", **one), seed=0)
    n = windows.sources[0].documents.num_tokens // 17
    packed = take(TrainData(files_cfg(corpus, **one), seed=0), n)
    assert_same(take(windows, n), packed)
    shuffled = take(TrainData(prepared_cfg(corpus, order="windows", global_batch_size=1), seed=5), n)
    key = lambda b: tuple(np.concatenate([b[k][0] for k in ("inputs", "targets", "segment_ids", "positions")]))  # noqa: E731
    assert sorted(map(key, shuffled)) == sorted(map(key, packed))
    assert [key(b) for b in shuffled] != [key(b) for b in packed]


@pytest.mark.parametrize("order, k", [("documents", 7), ("windows", 0), ("windows", 23)])
def test_resume_mid_epoch_exactly(corpus, order, k):
    cfg = prepared_cfg(corpus, order=order)
    data = TrainData(cfg, seed=1)
    take(data, k)
    state = json.loads(json.dumps(data.get_state()))
    assert state["batches"] == k
    expected = take(data, 8)
    resumed = TrainData(cfg, seed=1)
    resumed.set_state(state)
    assert_same(take(resumed, 8), expected)


@pytest.mark.parametrize("order", ["documents", "windows"])
def test_prefetch_changes_nothing_but_when(corpus, order):
    """data.prefetch=3 makes batches ahead in a thread: the same batches, and a state that resumes exactly."""
    ahead = TrainData(prepared_cfg(corpus, order=order, prefetch=3), seed=6)
    try:
        first = take(ahead, 4)
        state = json.loads(json.dumps(ahead.get_state()))
        later = take(ahead, 4)
    finally:
        ahead.close()
    assert_same(first + later, take(TrainData(prepared_cfg(corpus, order=order), seed=6), 8))
    resumed = TrainData(prepared_cfg(corpus, order=order), seed=6)
    resumed.set_state(state)
    assert_same(take(resumed, 4), later)


def test_windows_state_restores_another_process_count_and_worker_count(corpus):
    cfg = prepared_cfg(corpus, order="windows")
    one = TrainData(cfg, seed=2)
    take(one, 5)
    state = one.get_state()
    expected = take(one, 3)
    halves = [TrainData(cfg, seed=2, process_index=p, process_count=2) for p in range(2)]
    for h in halves:
        h.set_state(state)  # one process's state: a batch count, whatever the processes
    got = [take(h, 3) for h in halves]
    for step in range(3):
        for key in expected[step]:
            np.testing.assert_array_equal(np.concatenate([g[step][key] for g in got]), expected[step][key])
    workers = TrainData(dataclasses.replace(cfg, num_workers=2), seed=2)
    try:
        workers.set_state(state)
        assert_same(take(workers, 3), expected)  # grain workers take batches w, w+2, ... in order
    finally:
        workers.close()


def test_the_loops_merged_windows_state_restores_another_process_count(corpus, monkeypatch):
    """Two processes' windows states, merged as the loop merges them for a checkpoint, restore one."""
    from lumen_jax.train import loop

    cfg = prepared_cfg(corpus, order="windows", num_workers=0)
    halves = [TrainData(cfg, seed=2, process_index=p, process_count=2) for p in range(2)]
    for h in halves:
        take(h, 4)
    monkeypatch.setattr(loop.distributed, "gather_json", lambda state, to_all=True: [h.get_state() for h in halves])
    merged = json.loads(json.dumps(loop._all_data_states(halves[0].get_state())))
    whole = TrainData(cfg, seed=2)
    whole.set_state(loop._own_data_state(merged))
    expected = [np.concatenate([next(h)["inputs"] for h in halves]) for _ in range(2)]
    assert_same([{"inputs": b["inputs"]} for b in take(whole, 2)], [{"inputs": e} for e in expected])


def test_eval_paths_may_be_prepared_directories_or_globs(corpus):
    prepared = TrainData(prepared_cfg(corpus, eval_paths=(corpus["dir"],)), seed=0, split="eval")
    text = TrainData(prepared_cfg(corpus, eval_paths=corpus["globs"]), seed=0, split="eval")
    assert_same(take(prepared, 3), take(text, 3))
    with pytest.raises(DataError, match=r"mixes prepared directories and globs of files; give one kind"):
        TrainData(prepared_cfg(corpus, eval_paths=(corpus["dir"], *corpus["globs"])), seed=0, split="eval")


def test_a_tokenizer_other_than_the_manifests_is_refused(corpus, tmp_path):
    from helpers.data import write_bpe_tokenizer

    other = write_bpe_tokenizer(tmp_path / "tok.json", ["abc def"], vocab_size=300)
    with pytest.raises(DataError) as e:
        TrainData(prepared_cfg(corpus, tokenizer=other), seed=0)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"data.tokenizer={other!r} (sha256 ") and f"is not the tokenizer {corpus['dir']} was " \
        "prepared with (byte, sha256 " in msg and msg.endswith(f"prepare {corpus['dir']} again with --tokenizer {other}")


def test_training_with_another_tokenizer_exits_2_in_one_line(corpus, tmp_path, capsys):
    from helpers.data import write_bpe_tokenizer
    from helpers.faults import args, snapshot
    from lumen_jax.train import cli as train_cli

    other = write_bpe_tokenizer(tmp_path / "tok.json", ["abc def"], vocab_size=300)
    before = snapshot(corpus["dir"])
    rc = train_cli.main(args(str(tmp_path / "run"), "data.source=prepared", f"data.paths=[{corpus['dir']}]",
                             f"data.tokenizer={other}"))
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: data.tokenizer={other!r} (sha256 ")
    assert snapshot(corpus["dir"]) == before


def test_a_damaged_shard_names_the_file_and_the_fix(corpus, tmp_path):
    import shutil

    copy = tmp_path / "web"
    shutil.copytree(corpus["dir"], copy)
    with open(copy / "shard-00001.bin", "r+b") as f:
        f.truncate(4)
    with pytest.raises(DataError, match=rf"prepared shard {copy}/shard-00001.bin has 4 bytes, its manifest says "
                                        r"\d+; run the same python -m lumen_jax.data.prepare command again"):
        TrainData(prepared_cfg(corpus, paths=(str(copy),)), seed=0)


def _edit_idx(copy, k: int, value: int) -> None:
    idx = np.fromfile(copy / "shard-00000.idx", "<i8")
    idx[k] = value
    idx.tofile(copy / "shard-00000.idx")  # the same size: the manifest's byte counts still hold


def _edit_manifest(copy, **changes) -> None:
    m = json.loads((copy / "manifest.json").read_text())
    m["shards"][0].update(changes)
    (copy / "manifest.json").write_text(json.dumps(m))


def _shard_outside(copy, name: str) -> None:
    """shard-00000 moved to `name` (relative to the folder or absolute) and the manifest naming it there."""
    import os
    import shutil

    target = os.path.normpath(os.path.join(copy, name))
    os.makedirs(os.path.dirname(target), exist_ok=True)
    for ext in (".bin", ".idx"):
        shutil.move(copy / f"shard-00000{ext}", target + ext)
    _edit_manifest(copy, name=name)


CORRUPT = {  # how: what the one line says
    "offset 10**12": (lambda c: _edit_idx(c, 1, 10**12), "shard-00000.idx: document 0 ends at token 1000000000000"),
    "offset -5": (lambda c: _edit_idx(c, 2, -5), "shard-00000.idx: document 1 ends at token -5"),
    "first offset": (lambda c: _edit_idx(c, 0, 3), "shard-00000.idx: the first offset is 3, not 0"),
    "name ..": (lambda c: _shard_outside(c, "../elsewhere/shard-00000"),
                "names shard '../elsewhere/shard-00000', which leaves the folder"),
    "name absolute": (lambda c: _shard_outside(c, str(c) + "-elsewhere/shard-00000"),
                      "-elsewhere/shard-00000', which is an absolute path"),
    "documents abc": (lambda c: _edit_manifest(c, documents="abc"), "manifest.json: shard 0 is damaged"),
}


@pytest.mark.parametrize("case", list(CORRUPT))
def test_a_corrupt_manifest_or_offset_is_refused_when_the_shard_is_opened(corpus, tmp_path, case):
    import shutil

    copy = tmp_path / "web"
    shutil.copytree(corpus["dir"], copy)
    how, says = CORRUPT[case]
    how(copy)
    with pytest.raises(DataError) as e:
        TrainData(prepared_cfg(corpus, paths=(str(copy),)), seed=0)
    assert "\n" not in str(e.value) and says in str(e.value), str(e.value)


def _id_past_the_vocabulary(corpus, tmp_path):
    """A copy of the prepared data whose shard 0 holds id 4235, which the byte tokenizer (259 ids) never gives."""
    import shutil

    copy = tmp_path / "web"
    shutil.copytree(corpus["dir"], copy)
    tokens = np.fromfile(copy / "shard-00000.bin", "<u2")
    tokens[5] = 4235
    tokens.tofile(copy / "shard-00000.bin")
    return copy


@pytest.mark.parametrize("order", ["documents", "windows"])
def test_a_token_id_past_the_vocabulary_is_refused(corpus, tmp_path, order):
    """One line naming the shard and the id, never a NaN loss."""
    copy = _id_past_the_vocabulary(corpus, tmp_path)
    with pytest.raises(DataError) as e:
        take(TrainData(prepared_cfg(corpus, paths=(str(copy),), order=order, shuffle=False), seed=0), 3)
    assert str(e.value) == (f"prepared shard {copy}/shard-00000.bin holds token id 4235, past the vocabulary of "
                            f"its tokenizer (259 ids): the shard is damaged; prepare {copy} again")


def test_training_on_a_token_id_past_the_vocabulary_exits_2_in_one_line(corpus, tmp_path, capsys):
    from helpers.faults import args
    from lumen_jax.train import cli as train_cli

    copy = _id_past_the_vocabulary(corpus, tmp_path)
    rc = train_cli.main(args(str(tmp_path / "run"), "data.source=prepared", f"data.paths=[{copy}]", "data.shuffle=false"))
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: prepared shard {copy}/shard-00000.bin holds token id 4235"), err


def test_a_changed_shard_is_named_on_resume_and_restart_starts_the_data_again(corpus, tmp_path):
    """The resume check fingerprints the shards (size, sampled sha256): a shard rewritten in place, same
    size and document count, is refused by name; data.on_change=restart starts from the first batch."""
    import shutil
    web = str(tmp_path / "web")
    shutil.copytree(corpus["dir"], web)
    cfg = prepared_cfg({"dir": web})
    data = TrainData(cfg, seed=0)
    take(data, 3)
    state = json.loads(json.dumps(data.get_state()))
    TrainData(cfg, seed=0).set_state(state)  # unchanged: resumes
    with open(f"{web}/shard-00000.bin", "r+b") as f:  # the last token, another id, same size
        f.seek(-2, 2)
        last = int.from_bytes(f.read(2), "little")
        f.seek(-2, 2)
        f.write(((last + 1) % 200).to_bytes(2, "little"))
    with pytest.raises(DataError, match=r"shard-00000.bin changed \(same size, other bytes\).*data.on_change=restart"):
        TrainData(cfg, seed=0).set_state(state)
    restart = dataclasses.replace(cfg, on_change="restart")
    resumed = TrainData(restart, seed=0)
    resumed.set_state(state)
    assert_same(take(resumed, 2), take(TrainData(restart, seed=0), 2))
