"""Prepared data: the token shards `python -m lumen_jax.data.prepare` writes, and reading them back.

A prepared directory holds

    plan.json            inputs, text field, tokenizer (name, sha256, special ids) and the shards, each
                         with its input files; written first, the same for every slice of the work
    shard-00000.bin      the shard's documents back to back, each [BOS, ids..., EOS] (exactly what
                         on-the-fly tokenization trains on), little-endian uint16 or uint32 (manifest dtype)
    shard-00000.idx      int64 token offsets, one per document and one more: document i of the shard is
                         bin[idx[i]:idx[i+1]]
    shard-00000.json     the shard's document and token counts, file sizes and bad records; written
                         last, so a shard is finished exactly when its .json exists and the sizes match
    manifest.json        the join: plan.json plus every shard's counts, written when all shards are done

A shard is one input .jsonl or .parquet file, or a run of up to `TXT_PER_SHARD` .txt files, in the
order on-the-fly reading lists them (sources.list_files): document k of the prepared data is
document k of `data.source=files` over the same globs.

Why memory-mapped arrays and not ArrayRecord: reading a document is one slice of a mapped file (no
record decoding, no copy until the row is built), a fixed-length window is a slice that may span
documents and shards, which records cannot serve without reading whole documents, and the operating
system's page cache is shared by every grain worker of a host. benchmarks/data_loader.py measures
both formats' random reads (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Sequence

import numpy as np

from lumen_jax.data.errors import DataError
from lumen_jax.runtime.paths import escape

FORMAT = "lumen_jax prepared data"
VERSION = 1
PLAN, MANIFEST = "plan.json", "manifest.json"
TXT_PER_SHARD = 1024


def shard_name(k: int) -> str:
    return f"shard-{k:05d}"


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 2**16 else "uint32"


def tokenizer_identity(spec: str, tokenizer: Any) -> dict[str, Any]:
    """What a prepared directory records of its tokenizer; `sha256` of the tokenizer file decides equality."""
    if spec == "byte":
        digest = hashlib.sha256(b"lumen_jax byte tokenizer").hexdigest()
    else:
        with open(os.path.expanduser(spec), "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
    return {"name": "byte" if spec == "byte" else os.path.basename(spec), "sha256": digest,
            "vocab_size": tokenizer.vocab_size, "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id,
            "pad_id": tokenizer.pad_id}


def read_json(path: str, what: str) -> dict:
    """A JSON object from `path`, or a one-line DataError saying what is wrong and the fix."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror}); {what}") from None
    except ValueError as e:
        raise DataError(f"{path}: not valid JSON ({str(e).splitlines()[0]}); {what}") from None
    if not isinstance(value, dict):
        raise DataError(f"{path}: not a JSON object; {what}")
    return value


class _Shard:
    """One shard's token file and offsets, mapped on first use (in each process or grain worker).

    Opening checks what a damaged or crafted manifest could make us read: the shard's name stays inside
    its directory, the file sizes are the manifest's, the offsets start at 0, increase and end at the
    token count. A read checks its ids against the tokenizer's vocabulary (`ids`)."""

    def __init__(self, directory: str, info: dict, dtype: str, vocab_size: int):
        fix = "run the same python -m lumen_jax.data.prepare command again: it redoes damaged shards"
        for ext in (".bin", ".idx"):
            why = escape(directory, info["name"] + ext if isinstance(info["name"], str) else info["name"])
            if why is not None:
                raise DataError(f"{os.path.join(directory, MANIFEST)} names shard {info['name']!r}, which {why}; "
                                f"prepare {directory} again")
        self.bin = os.path.join(directory, info["name"] + ".bin")
        self.idx = os.path.join(directory, info["name"] + ".idx")
        self.documents, self.tokens, self.dtype = int(info["documents"]), int(info["tokens"]), dtype
        self.vocab_size, self.directory = vocab_size, directory
        for path, want in ((self.bin, self.tokens * np.dtype(dtype).itemsize), (self.idx, 8 * (self.documents + 1))):
            try:
                size = os.path.getsize(path)
            except OSError as e:
                raise DataError(f"prepared shard {path}: cannot read ({e.strerror}); {fix}") from None
            if size != want:
                raise DataError(f"prepared shard {path} has {size} bytes, its manifest says {want}; {fix}")
        idx = np.fromfile(self.idx, "<i8")
        if idx[0] != 0:
            raise DataError(f"prepared shard {self.idx}: the first offset is {idx[0]}, not 0; {fix}")
        bad = np.flatnonzero((idx[1:] <= idx[:-1]) | (idx[1:] > self.tokens))
        if bad.size or idx[-1] != self.tokens:
            i = int(bad[0]) if bad.size else self.documents - 1
            raise DataError(f"prepared shard {self.idx}: document {i} ends at token {idx[i + 1]} (starts at "
                            f"{idx[i]}, the shard holds {self.tokens}): the offsets must increase up to the "
                            f"token count; {fix}")
        self._maps: tuple[np.ndarray, np.ndarray] | None = None

    def ids(self, tokens: np.ndarray) -> np.ndarray:
        """`tokens` (read from this shard) as int32, refused when one lies past the vocabulary."""
        if tokens.size and int(tokens.max()) >= self.vocab_size:
            raise DataError(f"prepared shard {self.bin} holds token id {int(tokens.max())}, past the vocabulary of "
                            f"its tokenizer ({self.vocab_size} ids): the shard is damaged; prepare "
                            f"{self.directory} again")
        return np.asarray(tokens, np.int32)

    def __getstate__(self) -> dict:  # grain workers map the files themselves
        return {**self.__dict__, "_maps": None}

    @property
    def maps(self) -> tuple[np.ndarray, np.ndarray]:
        if self._maps is None:
            tokens = (np.memmap(self.bin, self.dtype, mode="r") if self.tokens
                      else np.zeros(0, self.dtype))
            self._maps = tokens, np.memmap(self.idx, np.int64, mode="r")
        return self._maps


class PreparedDocuments:
    """The documents of prepared directories, in order, as int32 token arrays [BOS, ids..., EOS].

    A random-access source for grain (`len`, `[i]`), like `sources.Documents`; `span(a, b)` reads
    tokens a..b of all documents back to back (the fixed-length windows of `data.order=windows`).
    Opening checks the manifest, the tokenizer and every shard's file sizes; a mismatch is a one-line
    DataError naming the file and the fix.
    """

    def __init__(self, directories: Sequence[str], tokenizer_spec: str, tokenizer: Any, key: str = "data.paths"):
        if not directories:
            raise DataError(f"data.source=prepared needs {key}: directories written by "
                            "python -m lumen_jax.data.prepare")
        want = tokenizer_identity(tokenizer_spec, tokenizer)
        self.shards: list[_Shard] = []
        for d in directories:
            d = os.path.expanduser(d)
            manifest = os.path.join(d, MANIFEST)
            if not os.path.isfile(manifest):
                raise DataError(self._not_prepared(d, key))
            m = read_json(manifest, f"prepare {d} again")
            if m.get("format") != FORMAT or m.get("version") != VERSION:
                raise DataError(f"{manifest}: not a version-{VERSION} {FORMAT} manifest; prepare {d} again")
            tok = m["tokenizer"]
            if tok["sha256"] != want["sha256"]:
                raise DataError(f"data.tokenizer={tokenizer_spec!r} (sha256 {want['sha256'][:12]}) is not the "
                                f"tokenizer {d} was prepared with ({tok['name']}, sha256 {tok['sha256'][:12]}); "
                                f"set data.tokenizer to that tokenizer or prepare {d} again with --tokenizer "
                                f"{tokenizer_spec}")
            if m.get("dtype") not in ("uint16", "uint32"):
                raise DataError(f"{manifest}: dtype={m.get('dtype')!r} is not uint16 or uint32; prepare {d} again")
            for k, s in enumerate(m["shards"]):
                try:
                    if int(s["documents"]):
                        self.shards.append(_Shard(d, s, m["dtype"], tokenizer.vocab_size))
                except DataError:
                    raise
                except (KeyError, TypeError, ValueError) as e:  # a field missing or not a number
                    raise DataError(f"{manifest}: shard {k} is damaged ({type(e).__name__}: {str(e)[:80]}); "
                                    f"prepare {d} again") from None
        self.directories = tuple(directories)
        # what a resume fingerprints (sources.data_files): the manifests and every shard's files
        self.paths = [os.path.join(os.path.expanduser(d), MANIFEST) for d in directories] + [
            p for s in self.shards for p in (s.bin, s.idx)]
        self.doc_offsets = np.cumsum([0] + [s.documents for s in self.shards])
        self.token_offsets = np.cumsum([0] + [s.tokens for s in self.shards])
        if not len(self):
            raise DataError(f"{key}={list(directories)} hold no documents; prepare them from files with text")

    @staticmethod
    def _not_prepared(d: str, key: str) -> str:
        plan = os.path.join(d, PLAN)
        if not os.path.isdir(d):
            return (f"{key} entry {d!r} is not a directory; give directories written by "
                    "python -m lumen_jax.data.prepare --out DIR")
        if not os.path.isfile(plan):
            return (f"{key} entry {d!r} has no {MANIFEST}: it is not prepared data; run "
                    f"python -m lumen_jax.data.prepare --out {d} ...")
        try:
            with open(plan, encoding="utf-8") as f:
                shards = [s["name"] for s in json.load(f)["shards"]]
        except (OSError, ValueError, KeyError, TypeError):
            shards = []
        done = sum(os.path.isfile(os.path.join(d, s + ".json")) for s in shards)
        return (f"{key} entry {d!r} has no {MANIFEST}: prepare has finished {done} of {len(shards)} shards; "
                f"run the remaining slices (or python -m lumen_jax.data.prepare --out {d} --join)")

    def __len__(self) -> int:
        return int(self.doc_offsets[-1])

    @property
    def num_tokens(self) -> int:
        return int(self.token_offsets[-1])

    def __getitem__(self, index: int) -> np.ndarray:
        k = int(np.searchsorted(self.doc_offsets, index, side="right")) - 1
        tokens, idx = self.shards[k].maps
        i = int(index - self.doc_offsets[k])
        return self.shards[k].ids(tokens[idx[i]:idx[i + 1]])

    def span(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens int32 [stop-start], starts bool [stop-start]: a document begins at that token) of the
        documents' token stream from `start` to `stop`, across shard boundaries."""
        tokens, starts = [], []
        k = int(np.searchsorted(self.token_offsets, start, side="right")) - 1
        while start < stop:
            shard, base = self.shards[k], int(self.token_offsets[k])
            tok, idx = shard.maps
            lo, hi = start - base, min(stop - base, shard.tokens)
            tokens.append(shard.ids(tok[lo:hi]))
            first, last = np.searchsorted(idx, [lo, hi], side="left")
            begin = np.zeros(hi - lo, bool)
            begin[np.asarray(idx[first:last]) - lo] = True
            starts.append(begin)
            start, k = base + hi, k + 1
        return np.concatenate(tokens), np.concatenate(starts)

    def __repr__(self) -> str:
        return f"PreparedDocuments({len(self)} documents, {self.num_tokens} tokens: {', '.join(self.directories)})"
