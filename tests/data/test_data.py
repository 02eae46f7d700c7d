"""lumen_jax.data: tokenizers, sources, packing, process independence, resume, seeds, errors."""

from __future__ import annotations

import dataclasses
import json
import os
import sysconfig

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lumen_jax.config import DataConfig
from lumen_jax.data import (BATCH_KEYS, ByteTokenizer, DataError, Documents, HFTokenizer, TrainData,
                            build_tokenizer, builtin_documents, file_documents)
from lumen_jax.data import pipeline

BUILTIN = DataConfig(source="builtin", builtin_max_bytes=300_000, seq_len=32, global_batch_size=8)


def take(data: TrainData, n: int) -> list[dict[str, np.ndarray]]:
    return [next(data) for _ in range(n)]


def assert_same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


@pytest.fixture
def corpus(tmp_path):
    """Five short documents in three formats: a few rows per epoch, so epochs end quickly."""
    (tmp_path / "a.txt").write_text("alpha beta gamma\n")
    (tmp_path / "b.txt").write_text("the second document is a little longer than the first one")
    with open(tmp_path / "c.jsonl", "w") as f:
        f.write(json.dumps({"text": "jsonl one", "id": 1}) + "\n\n")  # the blank line is skipped
        f.write(json.dumps({"text": "jsonl two: ünïcode"}) + "\n")
    pq.write_table(pa.table({"text": ["parquet row"], "n": [3]}), tmp_path / "d.parquet")
    return tmp_path


def files_cfg(root, **kw) -> DataConfig:
    base = dict(source="files", paths=(str(root / "*.txt"), str(root / "*.jsonl"), str(root / "*.parquet")),
                seq_len=16, global_batch_size=2)
    return DataConfig(**{**base, **kw})


# --------------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------------

def test_byte_tokenizer():
    tok = build_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 259
    assert {tok.bos_id, tok.eos_id, tok.pad_id} == {256, 257, 258}
    ids = tok.encode("hé!")
    assert ids == list("hé!".encode()) and max(ids) < 256
    assert tok.decode([tok.bos_id, *ids, tok.eos_id]) == "hé!"


def _write_hf_tokenizer(path, specials=("<s>", "</s>", "<pad>")) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {w: i for i, w in enumerate(["<unk>", *specials, "hello", "world", "jsonl", "one", "two"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if "<s>" in vocab:  # a post-processor that adds BOS, like Llama's: encode() must not apply it
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    tok.save(str(path))
    return str(path)


def test_hf_tokenizer(tmp_path):
    tok = build_tokenizer(_write_hf_tokenizer(tmp_path / "tok.json"))
    assert isinstance(tok, HFTokenizer)
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (1, 2, 3, 9)
    assert tok.encode("hello world") == [4, 5]  # no BOS from the post-processor


def test_hf_tokenizer_errors(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        build_tokenizer(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DataError, match="not a Hugging Face tokenizers JSON"):
        build_tokenizer(str(tmp_path / "bad.json"))
    with pytest.raises(DataError, match="no BOS token"):
        build_tokenizer(_write_hf_tokenizer(tmp_path / "nobos.json", specials=("<eos>",)))


# --------------------------------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------------------------------

def test_builtin_source_is_capped_sorted_and_without_tests():
    docs = builtin_documents(200_000)
    paths = [f.path for f in docs.files]
    assert sum(f.limit for f in docs.files) == 200_000
    # The standard library's files, walked in sorted path order (directory by directory): the
    # order of the corpus never depends on the file system's listing order.
    root = sysconfig.get_paths()["stdlib"]
    rel = [os.path.relpath(p, root).split(os.sep) for p in paths]
    assert rel == sorted(rel) and len(rel) > 3, rel[:5]
    assert rel[0] == sorted(f for f in os.listdir(root) if f.endswith(".py"))[:1]
    assert not any(part in ("test", "tests", "site-packages") for p in paths for part in p.split(os.sep))
    assert docs[0] == open(paths[0], encoding="utf-8").read()
    assert len(docs[len(docs) - 1].encode()) <= docs.files[-1].limit  # the last file is cut to fit


def test_file_source_reads_txt_jsonl_parquet(corpus):
    docs = file_documents([str(corpus / "*")], "text")
    assert list(docs[i] for i in range(len(docs))) == [
        "alpha beta gamma\n", "the second document is a little longer than the first one",
        "jsonl one", "jsonl two: ünïcode", "parquet row"]


@pytest.mark.parametrize("name, content, match", [
    ("x.csv", "a,b", r"x\.csv: unsupported extension '\.csv'"),
    ("x.parquet", "not parquet", r"x\.parquet: not a readable parquet file \(.+\)"),
])
def test_bad_files_fail_at_startup(tmp_path, name, content, match):
    (tmp_path / name).write_text(content)
    with pytest.raises(DataError, match=match):
        file_documents([str(tmp_path / name)], "text")


def test_startup_errors(tmp_path):
    with pytest.raises(DataError, match="matches no files"):
        file_documents([str(tmp_path / "nothing*.jsonl")], "text")
    with pytest.raises(DataError, match="needs data.paths"):
        file_documents([], "text")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "p.parquet")
    with pytest.raises(DataError, match=r"p\.parquet: no column 'text' \(columns: body\); set data.text_field"):
        file_documents([str(tmp_path / "p.parquet")], "text")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="no documents"):
        file_documents([str(tmp_path / "empty.jsonl")], "text")


@pytest.mark.parametrize("line, match", [
    ('{"text": "ok"', r"line 2: not valid JSON \(.*\); fix or remove the line"),
    ('{"body": "x"}', r"line 2: no field 'text' \(found body\); set data.text_field"),
    ('{"text": 3}', r"line 2: field 'text' is int, not a string"),
])
def test_bad_jsonl_line_names_file_and_line(tmp_path, line, match):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n")
    docs = file_documents([str(path)], "text")
    assert docs[0] == "fine"
    with pytest.raises(DataError, match=str(path).replace(".", r"\.") + " " + match):
        docs[1]
    # ... and through the pipeline, unwrapped by grain
    with pytest.raises(DataError, match="bad.jsonl line 2"):
        take(TrainData(DataConfig(source="files", paths=(str(path),), seq_len=8, global_batch_size=1,
                                  shuffle=False), seed=0), 3)


def test_invalid_utf8_txt(tmp_path):
    (tmp_path / "x.txt").write_bytes(b"ok \xff\xfe")
    with pytest.raises(DataError, match=r"x\.txt: not valid UTF-8 at byte 3"):
        file_documents([str(tmp_path / "x.txt")], "text")[0]


# --------------------------------------------------------------------------------------------------
# Packing
# --------------------------------------------------------------------------------------------------

def test_rows_pack_documents_exactly(corpus):
    cfg = files_cfg(corpus, shuffle=False, global_batch_size=1)
    data = TrainData(cfg, seed=0)
    tok = data.tokenizer
    docs = [data.documents[i] for i in range(len(data.documents))]
    stream = np.concatenate([[tok.bos_id, *tok.encode(d), tok.eos_id] for d in docs * 3])
    doc_of = np.concatenate([np.full(len(tok.encode(d)) + 2, i) for i, d in enumerate(docs * 3)])
    pos_in_doc = np.concatenate([np.arange(len(tok.encode(d)) + 2) for d in docs * 3])
    T = cfg.seq_len
    for k, b in enumerate(take(data, 12)):
        assert {key: (v.shape, v.dtype) for key, v in b.items()} == {
            "inputs": ((1, T), np.int32), "targets": ((1, T), np.int32), "segment_ids": ((1, T), np.int32),
            "positions": ((1, T), np.int32), "loss_mask": ((1, T), np.float32)}
        lo = k * (T + 1)  # each row is a window of T + 1 tokens: inputs[:-1], targets[1:]
        np.testing.assert_array_equal(b["inputs"][0], stream[lo:lo + T])
        same = doc_of[lo:lo + T] == doc_of[lo + 1:lo + T + 1]
        np.testing.assert_array_equal(b["loss_mask"][0], same.astype(np.float32))
        np.testing.assert_array_equal(b["targets"][0][same], stream[lo + 1:lo + T + 1][same])
        assert (b["targets"][0][~same] == tok.pad_id).all()
        seg = b["segment_ids"][0]
        assert seg[0] == 1 and (np.diff(seg) >= 0).all() and (seg > 0).all()  # rows are always full
        # segments change exactly at document boundaries; positions count within the row's piece
        np.testing.assert_array_equal(np.diff(seg) != 0, np.diff(doc_of[lo:lo + T]) != 0)
        first = doc_of[lo]
        pieces = np.where(doc_of[lo:lo + T] == first, pos_in_doc[lo:lo + T] - pos_in_doc[lo], pos_in_doc[lo:lo + T])
        np.testing.assert_array_equal(b["positions"][0], pieces)


def test_order_is_a_fresh_permutation_each_epoch(corpus):
    docs = file_documents([str(corpus / "*")], "text")
    order = pipeline.document_order(docs, seed=3, shuffle=True)
    epochs = [[order[e * 5 + i] for i in range(5)] for e in range(3)]
    assert all(sorted(ep) == sorted(docs[i] for i in range(5)) for ep in epochs)
    assert len({tuple(ep) for ep in epochs}) > 1


# --------------------------------------------------------------------------------------------------
# Processes, seeds, state
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("process_count", [2, 4])
def test_global_batch_is_independent_of_process_count(process_count):
    whole = take(TrainData(BUILTIN, seed=1), 6)
    parts = [take(TrainData(BUILTIN, seed=1, process_index=p, process_count=process_count), 6)
             for p in range(process_count)]
    for step, batch in enumerate(whole):
        for k in BATCH_KEYS:
            np.testing.assert_array_equal(np.concatenate([p[step][k] for p in parts]), batch[k])
        assert parts[0][step]["inputs"].shape == (BUILTIN.global_batch_size // process_count, BUILTIN.seq_len)


def test_each_process_reads_only_its_documents(monkeypatch):
    read: dict = {}
    current = []
    orig = Documents.__getitem__

    def spy(self, index):
        read.setdefault(current[0], set()).add(index)
        return orig(self, index)

    monkeypatch.setattr(Documents, "__getitem__", spy)
    cfg = dataclasses.replace(BUILTIN, builtin_max_bytes=2_000_000, seq_len=8)
    for p in (0, 1, "all"):
        current[:] = [p]
        take(TrainData(cfg, seed=0, **({} if p == "all" else dict(process_index=p, process_count=2))), 4)
    assert read[0] and read[1] and not read[0] & read[1]
    assert read[0] | read[1] == read["all"]


def test_seeds(corpus):
    same = [take(TrainData(BUILTIN, seed=5), 3) for _ in range(2)]
    assert_same(*same)
    other = take(TrainData(BUILTIN, seed=6), 3)
    assert not all(np.array_equal(a["inputs"], b["inputs"]) for a, b in zip(same[0], other))


@pytest.mark.parametrize("k", [0, 1, 3, 7, 12])
def test_resume_exactly_across_epochs(corpus, k):
    cfg = files_cfg(corpus)  # ~9 rows per epoch over 2 streams: k=7, 12 resume past epoch boundaries
    data = TrainData(cfg, seed=0)
    take(data, k)
    state = json.loads(json.dumps(data.get_state()))
    expected = take(data, 10)
    resumed = TrainData(cfg, seed=0)
    resumed.set_state(state)
    assert_same(take(resumed, 10), expected)


def test_resume_with_another_process_count_from_merged_states():
    one = TrainData(BUILTIN, seed=2)
    take(one, 5)
    state = json.loads(json.dumps(one.get_state()))
    expected = take(one, 3)
    halves = [TrainData(BUILTIN, seed=2, process_index=p, process_count=2) for p in range(2)]
    for h in halves:
        h.set_state(state)
    got = [take(h, 3) for h in halves]
    for step in range(3):
        np.testing.assert_array_equal(np.concatenate([g[step]["inputs"] for g in got]), expected[step]["inputs"])
    # one half's state alone does not restore the other half
    with pytest.raises(DataError, match=r"no entry for streams \[0, 1, 2, 3\]"):
        TrainData(BUILTIN, seed=2, process_index=0, process_count=2).set_state(halves[1].get_state())


def test_state_from_other_settings_is_refused():
    state = TrainData(BUILTIN, seed=0).get_state()
    with pytest.raises(DataError, match=r"seed: saved 0, now 1"):
        TrainData(BUILTIN, seed=1).set_state(state)


def test_hf_tokenizer_pipeline_and_workers_resume(corpus, tmp_path):
    """The pipeline with a HF tokenizer in two grain worker processes: deterministic and resumable."""
    cfg = files_cfg(corpus, tokenizer=_write_hf_tokenizer(tmp_path / "tok.json"), seq_len=4, num_workers=2)
    data = TrainData(cfg, seed=0)
    take(data, 5)
    state = json.loads(json.dumps(data.get_state()))
    expected = take(data, 6)
    data.close()
    resumed = TrainData(cfg, seed=0)
    resumed.set_state(state)
    got = take(resumed, 6)
    resumed.close()
    assert_same(got, expected)
    assert max(int(b["inputs"].max()) for b in got) < data.tokenizer.vocab_size
