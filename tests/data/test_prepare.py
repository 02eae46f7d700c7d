"""`python -m lumen_jax.data.prepare`: the tokens, slices and the join, resume, bad records, bad arguments."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers.data import prepare, write_bpe_tokenizer, write_corpus
from helpers.faults import snapshot
from helpers.paths import REPO
from lumen_jax.data import DataError, PreparedDocuments, build_tokenizer, file_documents


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    globs = write_corpus(root / "text")
    docs = file_documents(globs, "text")
    tokenizer = write_bpe_tokenizer(root / "tokenizer.json", [docs[i] for i in range(len(docs))], vocab_size=300)
    return {"root": root, "globs": globs, "tokenizer": tokenizer, "docs": docs}


def run_prepare(corpus, out, *extra: str):
    proc = prepare("--input", *corpus["globs"], "--tokenizer", corpus["tokenizer"], "--out", str(out), *extra)
    return proc


def test_prepared_tokens_are_the_on_the_fly_tokens(corpus, tmp_path):
    proc = run_prepare(corpus, tmp_path / "out", "--workers", "2")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # no bad records, no warnings
    tok = build_tokenizer(corpus["tokenizer"])
    prepared = PreparedDocuments([str(tmp_path / "out")], corpus["tokenizer"], tok)
    docs = corpus["docs"]
    assert len(prepared) == len(docs) == 30 + 15 + 2  # jsonl lines, parquet rows, txt files
    for i in range(len(docs)):  # same documents, same order, same tokens
        np.testing.assert_array_equal(prepared[i], [tok.bos_id, *tok.encode(docs[i]), tok.eos_id], err_msg=f"doc {i}")
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["documents"] == len(docs) and manifest["bad_records"] == 0
    assert manifest["tokens"] == prepared.num_tokens == sum(len(prepared[i]) for i in range(len(docs)))
    assert manifest["tokenizer"]["name"] == "tokenizer.json" and manifest["dtype"] == "uint16"
    assert [s["files"] for s in manifest["shards"]] == [
        [os.path.join(corpus["root"], "text", f)] for f in ("a.jsonl", "b.parquet")] + [
        [os.path.join(corpus["root"], "text", f) for f in ("c1.txt", "c2.txt")]]  # .txt files share a shard


def test_two_slices_and_the_join_equal_one_run(corpus, tmp_path):
    assert run_prepare(corpus, tmp_path / "one", "--workers", "0").returncode == 0
    sliced = tmp_path / "sliced"
    first = run_prepare(corpus, sliced, "--shard", "1", "--num-shards", "2", "--workers", "0")
    assert first.returncode == 0, first.stderr
    assert "2 shards still to prepare" in first.stdout and not (sliced / "manifest.json").exists()
    # Training cannot read it yet, and says how far prepare got.
    with pytest.raises(DataError, match=r"has no manifest.json: prepare has finished 1 of 3 shards"):
        PreparedDocuments([str(sliced)], corpus["tokenizer"], build_tokenizer(corpus["tokenizer"]))
    early = run_prepare(corpus, sliced, "--join")
    assert early.returncode == 2 and early.stderr.count("\n") == 1
    assert early.stderr.startswith(f"error: {sliced}: 2 of 3 shards are not finished (shard-00000, shard-00002)")
    last = run_prepare(corpus, sliced, "--shard", "0", "--num-shards", "2", "--workers", "2")
    assert last.returncode == 0, last.stderr
    assert snapshot(str(sliced)) == snapshot(str(tmp_path / "one"))  # every file, byte for byte


def test_interrupted_prepare_redoes_only_unfinished_shards(corpus, tmp_path):
    out = tmp_path / "out"
    assert run_prepare(corpus, out, "--workers", "0").returncode == 0
    whole = snapshot(str(out))
    finished = {p: os.stat(out / p).st_mtime_ns for p in ("shard-00000.bin", "shard-00002.bin")}
    # Cut short while writing shard 1: its record was never written, its tokens are partial.
    (out / "shard-00001.json").unlink()
    (out / "manifest.json").unlink()
    with open(out / "shard-00001.bin", "r+b") as f:
        f.truncate(10)
    again = run_prepare(corpus, out, "--workers", "0")
    assert again.returncode == 0, again.stderr
    assert "1 shards prepared, 2 were already done" in again.stdout
    assert {p: os.stat(out / p).st_mtime_ns for p in finished} == finished  # not rewritten
    assert snapshot(str(out)) == whole
    # A finished shard damaged afterwards (its record intact, its tokens cut) is redone too.
    with open(out / "shard-00002.bin", "r+b") as f:
        f.truncate(6)
    (out / "manifest.json").unlink()
    assert "1 shards prepared, 2 were already done" in run_prepare(corpus, out, "--workers", "0").stdout
    assert snapshot(str(out)) == whole


def test_ctrl_c_is_one_line_exit_130_and_leaves_no_half_shard(tmp_path):
    """Ctrl-C (SIGINT to the process group, workers included) while shard 1 is written. Before: the
    workers died of it with tracebacks and the parent waited for their answers forever."""
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "small"}) + "\n")
    # A shard that takes half a minute with 2 workers (300 MB): the interrupt comes within
    # milliseconds of its start, however loaded the machine (at 30 MB the shard was once done first).
    line = json.dumps({"text": "document 12345 " * 50}) + "\n"
    with open(tmp_path / "b.jsonl", "w") as f:
        for _ in range(40):
            f.write(line * 10000)
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "lumen_jax.data.prepare", "--input", str(tmp_path / "*.jsonl"), "--tokenizer",
            "byte", "--out", str(out), "--workers", "2"]
    # Ctrl-C as from a terminal: a SIGINT this process ignores (as a test run in the suite's worker once
    # did) is ignored by the child too, inherited through exec, and prepare ran to the end (exit 0).
    previous = signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        proc = subprocess.Popen(argv, cwd=REPO, start_new_session=True, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    deadline = time.monotonic() + 60
    while not (out / "shard-00001.bin.partial").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    assert proc.poll() is None, "prepare ended before the interrupt: the test did not test it"
    os.killpg(proc.pid, signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    lines = err.strip().splitlines()
    assert proc.returncode == 130 and len(lines) == 1, err[-3000:]
    assert lines[0].startswith(f"stopped: interrupted (Ctrl-C); finished shards in {out} are kept"), lines[0]
    assert sorted(p.name for p in out.iterdir()) == ["plan.json", "shard-00000.bin", "shard-00000.idx",
                                                     "shard-00000.json"]


def test_corrupt_input_lines_are_reported_with_file_and_line(corpus, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "one"}\n{"text": "two"\n\n{"body": "x"}\n{"text": "five"}\n')
    proc = prepare("--input", str(bad), "--tokenizer", "byte", "--out", str(tmp_path / "out"), "--workers", "0")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[0].startswith(f"warning: skipped data file {bad} line 2: not valid JSON (")
    assert lines[1] == (f"warning: skipped data file {bad} line 4: no field 'text' (found body); "
                        "set --text-field or fix the line")
    assert "2 bad records skipped" in proc.stdout
    shard = json.loads((tmp_path / "out" / "shard-00000.json").read_text())
    assert shard["bad_records"] == 2 and len(shard["bad"]) == 2 and "line 4" in shard["bad"][1]
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["bad_records"] == 2
    docs = PreparedDocuments([str(tmp_path / "out")], "byte", build_tokenizer("byte"))
    assert [bytes(docs[i][1:-1].astype(np.uint8)).decode() for i in range(len(docs))] == ["one", "five"]


@pytest.mark.parametrize("lines, reason", [
    ('{"body": "x"}\n{"body": "y"}\n', "(2 bad records skipped; the first: data file {bad} line 1: no field 'text'"),
    ("", "(0 bad records skipped); no manifest.json written"),
])
def test_inputs_that_give_no_document_exit_2_without_a_manifest(tmp_path, lines, reason):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(lines)
    out = tmp_path / "out"
    proc = prepare("--input", str(bad), "--tokenizer", "byte", "--out", str(out), "--workers", "0")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    last = proc.stderr.splitlines()[-1]
    assert last.startswith(f"error: {out}: the inputs gave 0 documents {reason.format(bad=bad)}"), last
    assert "check --input and --text-field" in last and not (out / "manifest.json").exists()


@pytest.mark.parametrize("case, message", [
    ("slice", "error: --shard 2 --num-shards 2: need 0 <= --shard < --num-shards"),
    ("tokenizer", "error: data.tokenizer='missing.json': no such file"),
    ("input", "error: --input entry 'nothing/*.jsonl' matches no files"),
])
def test_bad_arguments_exit_2_in_one_line(corpus, tmp_path, case, message):
    inputs = ["nothing/*.jsonl"] if case == "input" else corpus["globs"]
    tokenizer = "missing.json" if case == "tokenizer" else corpus["tokenizer"]
    extra = ["--shard", "2", "--num-shards", "2"] if case == "slice" else []
    proc = prepare("--input", *inputs, "--tokenizer", tokenizer, "--out", str(tmp_path / "out"), *extra)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(message)
    assert not (tmp_path / "out").exists()


def test_another_corpus_into_the_same_directory_is_refused(corpus, tmp_path):
    out = tmp_path / "out"
    assert run_prepare(corpus, out, "--workers", "0").returncode == 0
    before = snapshot(str(out))
    proc = prepare("--input", *corpus["globs"], "--tokenizer", "byte", "--out", str(out))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith(f"error: {out} was prepared from other tokenizer than this command's")
    assert snapshot(str(out)) == before


def test_one_prepare_per_slice_of_an_out_directory(corpus, tmp_path):
    """A second data.prepare of the slice a live one prepares is refused naming the holder; another slice
    of the same --out runs beside it; once the holder is gone, the rerun prepares."""
    import socket
    from lumen_jax.runtime.lock import Lock
    out = tmp_path / "out"
    out.mkdir()
    with Lock(str(out / "prepare-0-of-1.lock")), Lock(str(out / "prepare-1-of-2.lock")):
        before = snapshot(str(out))
        proc = run_prepare(corpus, out, "--workers", "0")
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith(f"error: --out={out} is being prepared by another data.prepare of the same "
                                      "slice (--shard 0 --num-shards 1;")
        assert f"host {socket.gethostname()}, pid {os.getpid()}, started " in proc.stderr
        assert snapshot(str(out)) == before
        other = run_prepare(corpus, out, "--workers", "0", "--shard", "0", "--num-shards", "2")
        assert other.returncode == 0, other.stderr
    proc = run_prepare(corpus, out, "--workers", "0")
    assert proc.returncode == 0 and (out / "manifest.json").exists(), proc.stderr
    assert not [n for n in os.listdir(out) if n.endswith(".lock")]
