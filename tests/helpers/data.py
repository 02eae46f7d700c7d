"""Synthetic packed batches for model and step tests; small corpora on disk and `python -m lumen_jax.data.prepare`."""

import numpy as np


def packed_batch(batch: int, seq: int, vocab: int, seed: int) -> dict[str, np.ndarray]:
    """Random tokens packed as 1-3 documents per row, with positions, segment ids and a pad tail."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (batch, seq + 1)).astype(np.int32)
    seg = np.zeros((batch, seq), np.int32)
    pos = np.zeros((batch, seq), np.int32)
    for b in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, seq - 2), size=rng.integers(0, 3), replace=False))
        bounds = [0, *cuts.tolist(), seq - rng.integers(0, 3)]  # a short padding tail
        for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            seg[b, lo:hi] = i + 1
            pos[b, lo:hi] = np.arange(hi - lo)
    same_doc_next = np.concatenate([seg[:, 1:] == seg[:, :-1], np.zeros((batch, 1), bool)], axis=1)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": seg, "positions": pos,
            "loss_mask": ((seg > 0) & same_doc_next).astype(np.float32)}


# --------------------------------------------------------------------------------------------------
# Small corpora on disk and `python -m lumen_jax.data.prepare` over them
# --------------------------------------------------------------------------------------------------

def write_corpus(root, letters: str = "abcdefgh", docs: int = 30, seed: int = 0) -> list[str]:
    """A .jsonl, a .parquet and two .txt files of documents over `letters` (so a row's source can be
    told from its bytes); returns the globs, in the order data.paths / --input take them."""
    import json
    import os

    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    words = lambda: " ".join("".join(rng.choice(list(letters), rng.integers(1, 7)))  # noqa: E731
                             for _ in range(rng.integers(1, 12)))
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "a.jsonl"), "w") as f:
        for _ in range(docs):
            f.write(json.dumps({"text": words(), "id": 1}) + "\n")
    pq.write_table(pa.table({"text": [words() for _ in range(docs // 2)]}), os.path.join(root, "b.parquet"))
    for name in ("c1.txt", "c2.txt"):
        with open(os.path.join(root, name), "w") as f:
            f.write(words())
    return [os.path.join(root, "*.jsonl"), os.path.join(root, "*.parquet"), os.path.join(root, "*.txt")]


def write_bpe_tokenizer(path, texts: list[str], vocab_size: int = 120) -> str:
    """A small byte-level BPE tokenizer.json trained on `texts`, with Llama's special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))
    return str(path)


def prepare(*args: str):
    """`python -m lumen_jax.data.prepare ARGS` as a user runs it: the CompletedProcess (text output)."""
    import subprocess
    import sys

    from helpers.paths import REPO

    return subprocess.run([sys.executable, "-m", "lumen_jax.data.prepare", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
