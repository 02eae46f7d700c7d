"""The data loader's tokens/s on this host, on-the-fly against prepared, next to what 8 H100s consume.

    .venv/bin/python benchmarks/data_loader.py [--mb 8] [--tokenizer tokenizer.json] [--seq-len 8192]

Builds a corpus (the first --mb MB of the Python standard library's text as one .jsonl), a byte-level
BPE tokenizer trained on it (--vocab 32000; or --tokenizer PATH, e.g. Llama 3's tokenizer.json), and
prepares it with `python -m lumen_jax.data.prepare` (timed at 1 and all workers). Then it times
`TrainData` (rows of --seq-len, --rows rows a batch) for three loaders: files (on-the-fly
tokenization), prepared documents (data.order=documents) and prepared windows (data.order=windows), each
in-process (1 core) and with grain workers (2 and all cores), and prints tokens/s per host next to the
planner's tokens/s for llama3_1b and llama3_8b on 8 H100s (`lumen_jax.plan`: one host's devices), and
the random-read rate of the prepared format against the same documents in ArrayRecord. Results and the
command go in docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from lumen_jax.config import DataConfig  # noqa: E402
from lumen_jax.config.files import load_config  # noqa: E402
from lumen_jax.data import PreparedDocuments, TrainData, build_tokenizer, builtin_documents  # noqa: E402
from lumen_jax.plan.hardware import DEVICES, layout_from_config  # noqa: E402
from lumen_jax.plan.predict import predict  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_corpus(root: str, megabytes: float) -> tuple[str, list[str]]:
    docs = builtin_documents(int(megabytes * 1e6))
    texts = [docs[i] for i in range(len(docs))]
    path = os.path.join(root, "corpus.jsonl")
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    return path, texts


def train_tokenizer(path: str, texts: list[str], vocab: int) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(path)
    return path


def prepare(corpus: str, tokenizer: str, out: str, workers: int) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "lumen_jax.data.prepare", "--input", corpus, "--tokenizer", tokenizer,
                    "--out", out, "--workers", str(workers)], cwd=REPO, check=True, capture_output=True)
    return time.perf_counter() - t0


def loader_tokens_per_s(cfg: DataConfig, seconds: float) -> float:
    data = TrainData(cfg, seed=0)
    try:
        for _ in range(2):  # warm-up: workers start, first documents read
            next(data)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            next(data)
            n += 1
        return n * cfg.global_batch_size * cfg.seq_len / (time.perf_counter() - t0)
    finally:
        data.close()


def consumed_tokens_per_s(name: str) -> float:
    """The planner's tokens/s for configs/<name>.yaml on one host of 8 H100s (micro-batches to fit)."""
    cfg = load_config(os.path.join(REPO, "configs", f"{name}.yaml"), ["train.micro_batches=8"])
    return predict(cfg, layout_from_config(cfg, 8), DEVICES["h100"]).tokens_per_s


def format_reads(prepared_dir: str, tokenizer: str, root: str, reads: int) -> list[tuple[str, float, float]]:
    """(format, documents/s, tokens/s) of random document reads: the prepared shards, and ArrayRecord
    holding the same documents (one record each, the token ids' bytes), read through grain."""
    import grain

    docs = PreparedDocuments([prepared_dir], tokenizer, build_tokenizer(tokenizer))
    rng = np.random.default_rng(0)
    picks = rng.integers(0, len(docs), reads)
    rows = []

    def timed(name, read):
        t0, tokens = time.perf_counter(), 0
        for i in picks:
            tokens += len(read(int(i)))
        dt = time.perf_counter() - t0
        rows.append((name, reads / dt, tokens / dt))

    timed("prepared (mmap)", docs.__getitem__)
    try:
        from array_record.python.array_record_module import ArrayRecordWriter
    except ImportError:
        return rows
    path = os.path.join(root, "docs.array_record")
    writer = ArrayRecordWriter(path, "group_size:1")
    for i in range(len(docs)):
        writer.write(docs[i].tobytes())
    writer.close()
    source = grain.sources.ArrayRecordDataSource([path])
    timed("ArrayRecord (grain source)", lambda i: np.frombuffer(source[i], np.int32))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=8.0, help="corpus size in MB of text")
    p.add_argument("--tokenizer", default="", help="a tokenizer.json (default: train a BPE of --vocab)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--rows", type=int, default=8, help="rows per batch")
    p.add_argument("--seconds", type=float, default=6.0, help="timed seconds per loader")
    p.add_argument("--dir", default="")
    args = p.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="lumen-data-bench-")
    corpus, texts = write_corpus(root, args.mb)
    tokenizer = args.tokenizer or train_tokenizer(os.path.join(root, "tokenizer.json"), texts, args.vocab)
    cores = os.cpu_count() or 1
    counts = sorted({1, 2, cores})
    prep_s = {w: prepare(corpus, tokenizer, os.path.join(root, f"prepared-{w}"), w) for w in counts}
    prepared_dir = os.path.join(root, f"prepared-{counts[-1]}")
    tokens = PreparedDocuments([prepared_dir], tokenizer, build_tokenizer(tokenizer)).num_tokens
    print(f"corpus: {len(texts)} documents, {sum(map(len, texts)) / 1e6:.1f} MB, {tokens:,} tokens "
          f"({os.path.basename(tokenizer)}), {cores} cores; rows of {args.seq_len} tokens, {args.rows} a batch")
    print("prepare: " + ", ".join(f"{w} worker{'s' * (w > 1)} {s:.1f} s ({tokens / s / 1e6:.2f}M tokens/s)"
                                  for w, s in prep_s.items()))
    base = DataConfig(seq_len=args.seq_len, global_batch_size=args.rows, tokenizer=tokenizer)
    loaders = {"files (on the fly)": dict(source="files", paths=(corpus,)),
               "prepared, documents": dict(source="prepared", paths=(prepared_dir,)),
               "prepared, windows": dict(source="prepared", paths=(prepared_dir,), order="windows")}
    workers = {f"{c} core{'s' * (c > 1)}": (0 if c == 1 else c) for c in counts}
    print(f"\n{'loader':24s}" + "".join(f"{w:>16s}" for w in workers) + "   (tokens/s per host)")
    measured = {}
    for name, kw in loaders.items():
        row = [loader_tokens_per_s(dataclasses.replace(base, **kw, num_workers=n), args.seconds)
               for n in workers.values()]
        measured[name] = max(row)
        print(f"{name:24s}" + "".join(f"{r:16,.0f}" for r in row))
    print("\nconsumed by one host of 8 H100s (the planner, train.micro_batches=8):")
    need = {m: consumed_tokens_per_s(m) for m in ("llama3_1b", "llama3_8b")}
    for m, n in need.items():
        print(f"  {m:10s} {n:14,.0f} tokens/s")
    fastest = max(need.values())
    for name, got in measured.items():
        print(f"  {name:24s} best {got:14,.0f} tokens/s = {got / fastest:6.1f} x the faster model's need")
    print("\nrandom document reads (the format choice):")
    for name, per_s, tok_s in format_reads(prepared_dir, tokenizer, root, reads=20000):
        print(f"  {name:28s}{per_s:12,.0f} documents/s {tok_s:16,.0f} tokens/s")


if __name__ == "__main__":
    main()
