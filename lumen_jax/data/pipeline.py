"""The training input pipeline: documents -> seeded order -> tokens -> packed rows -> local batches.

Order. Documents are indexed 0..N-1 (sources.py). Epoch e visits them in a permutation seeded by
(seed, e) (`grain.MapDataset.shuffle` + `repeat`: a fresh permutation every epoch, forever), or in
index order when `shuffle=False`. This infinite sequence is the *global document order*.

Streams and packing. The global batch has G = global_batch_size rows; row r of every batch comes from
*stream* r, which takes the documents at positions r, r+G, r+2G, ... of the global order, tokenizes each
as [BOS] + tokens + [EOS] (lazily, in a grain map), and packs them back to back with grain's
`ConcatThenSplitIterDataset` into windows of seq_len + 1 tokens. A window gives one row:
inputs = window[:-1], targets = window[1:], so no token is lost at a row boundary. A document longer than
the room left in a row is split; its remainder starts the next row of the same stream, with positions
restarting at 0 (rows never attend across each other, and RoPE only sees relative offsets, so
restarting loses nothing). Rows are always full: padding (segment 0, PAD id, mask 0) only appears if
grain ever had to pad, which concat-then-split does not do on an infinite stream.

Processes. Process p of P owns streams [p*B, (p+1)*B) with B = G // P, and builds only those: it reads
and tokenizes only its 1/P of the documents and packs only its rows. Stream r depends on nothing but
(seed, G, seq_len, corpus, tokenizer), so the global batch (process 0's rows, then process 1's, ...) is the
same for every process count: exactly what `jax.make_array_from_process_local_data` expects. The price
of packing per stream instead of once globally: each row's packing context is its own stream (no effect
on the token mix), and every process indexes the whole corpus's file list (cheap metadata).

Sources. `data.source=prepared` reads documents already tokenized (prepared.py): the same documents
in the same order as `files` over the inputs they were prepared from, so the same batches for the
same seed. `data.mixture` gives several sources with weights: each row comes whole from one source,
chosen by grain's mixing over the global row position (mixture.py); stream r then keeps one packed
stream per source. The state also records the batches taken and, for a mixture, the tokens each
source gave so far (the same number on every process; the loop logs them as tokens_<name>).

Windows. `data.order=windows` (prepared data only) cuts each source's token stream, all documents back
to back in order, into windows of seq_len + 1 tokens and shuffles the windows (a fresh permutation per
epoch; the Megatron / nanoGPT sampler). A window is one row, segment ids and positions from the
document boundaries inside it, exactly as packing would give for the same tokens. Global row
position g = b*G + r is a pure function of (seed, g), so a batch is random access: the state is the
batch count alone, and it restores any process count and any data.num_workers (grain workers take
batches w, w+W, ... and give them back in order). With one stream and no shuffle the windows are
exactly the rows documents-mode packing gives over the same tokens in their first epoch.

State. A stream's state is grain's: its position in the document order plus the split point of the
document in progress (concat-then-split re-reads and re-tokenizes that one document on restore).
`get_state()` is `{"streams": {"r": state_r, ...}, "config": {...}}` for the process's own streams; the
union of all processes' states restores any process count with the same global batch size. With
`num_workers > 0` the whole pipeline runs in grain worker processes (`mp_prefetch`); each worker packs
its own slice of every stream, so batches then also depend on num_workers, and the state (grain's, per
worker) only restores the same num_workers and process count.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import weakref
from typing import Any, Iterator

import grain
import numpy as np

from lumen_jax.config import DataConfig, MixtureSource
from lumen_jax.data import mixture
from lumen_jax.data.errors import DataError
from lumen_jax.data.prepared import MANIFEST, PreparedDocuments
from lumen_jax.data.sources import HeldOut, builtin_documents, data_files, file_documents, file_fingerprint
from lumen_jax.data.tokenizer import build_tokenizer

BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")
_STATE_VERSION = 1


class _Tokenize:
    """text -> {"tokens": int32 [BOS, ids..., EOS]} (a class, not a lambda: grain workers pickle it)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, text: str | np.ndarray) -> dict[str, np.ndarray]:
        if isinstance(text, np.ndarray):  # a prepared document: [BOS, ids..., EOS] already
            return {"tokens": text}
        ids = self.tokenizer.encode(text)
        tokens = np.empty(len(ids) + 2, np.int32)
        tokens[0], tokens[1:-1], tokens[-1] = self.tokenizer.bos_id, ids, self.tokenizer.eos_id
        return {"tokens": tokens}


class _Row:
    """A packed window of seq_len + 1 tokens -> one training row of seq_len."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, packed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        tokens, seg, pos = packed["tokens"], packed["tokens_segment_ids"], packed["tokens_positions"]
        seg_t = seg[:-1]
        real = seg_t != 0
        same_doc = real & (seg[1:] == seg_t)  # the target continues this token's document
        return {
            "inputs": np.where(real, tokens[:-1], self.pad_id).astype(np.int32),
            "targets": np.where(same_doc, tokens[1:], self.pad_id).astype(np.int32),
            "segment_ids": seg_t.astype(np.int32),
            "positions": np.where(real, pos[:-1], 0).astype(np.int32),
            "loss_mask": same_doc.astype(np.float32),
        }


class _Window:
    """Window w of a prepared token stream (seq_len + 1 tokens) -> one training row, its segments and
    positions from the document starts inside it (a document cut at the window's start restarts at 0)."""

    def __init__(self, docs: PreparedDocuments, seq_len: int, pad_id: int):
        self.docs, self.length, self.row = docs, seq_len + 1, _Row(pad_id)

    def __call__(self, w: int) -> dict[str, np.ndarray]:
        tokens, starts = self.docs.span(w * self.length, (w + 1) * self.length)
        at = np.arange(self.length)
        return self.row({"tokens": tokens, "tokens_segment_ids": 1 + np.cumsum(starts) - starts[0],
                         "tokens_positions": at - np.maximum.accumulate(np.where(starts, at, 0))})


class _Batch:
    """Global batch b -> this process's rows of it: global row positions b*G + r, r in `streams`."""

    def __init__(self, rows: grain.MapDataset, streams: range, num_streams: int):
        self.rows, self.streams, self.num_streams = rows, streams, num_streams

    def __call__(self, b: int) -> dict[str, np.ndarray]:
        return _stack(tuple(self.rows[b * self.num_streams + r] for r in self.streams))


def _stack(rows: tuple[dict[str, np.ndarray], ...]) -> dict[str, np.ndarray]:
    return {k: np.stack([r[k] for r in rows]) for k in BATCH_KEYS}


def _shuffle_seed(seed: int, source: int = 0) -> int:
    # grain reseeds epoch e with seed + e; mixing keeps seed s+1 from replaying seed s's epoch 1.
    entropy = seed % 2**64 if source == 0 else [seed % 2**64, source]
    return int(np.random.SeedSequence(entropy).generate_state(1)[0])


def document_order(docs: Any, *, seed: int, shuffle: bool, source: int = 0) -> grain.MapDataset:
    """The infinite global order of `docs` (documents, or window indices): a seeded permutation per
    epoch (or index order). `source`: the mixture source, whose permutation is its own."""
    ds = grain.MapDataset.source(docs)
    if shuffle:
        ds = ds.shuffle(seed=_shuffle_seed(seed, source))
    return ds.repeat()


def packed_stream(order: grain.MapDataset, stream: int, num_streams: int, tokenizer,
                  seq_len: int) -> grain.IterDataset:
    """Rows of stream `stream`: documents stream, stream+num_streams, ... of `order`, packed."""
    ds = order[stream::num_streams].map(_Tokenize(tokenizer))
    # Synchronous reads: one stream is cheap, and B streams with a thread pool each would be B pools.
    ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    ds = grain.experimental.ConcatThenSplitIterDataset(ds, length_struct={"tokens": seq_len + 1})
    return ds.map(_Row(tokenizer.pad_id))


@dataclasses.dataclass(frozen=True)
class Source:
    """One source of the rows: its name (metrics), weight and documents."""

    name: str
    weight: float
    documents: Any  # Documents | HeldOut | PreparedDocuments: len(), [i] -> text or tokens


def _open(source: str, paths: tuple[str, ...], cfg: DataConfig, key: str) -> Any:
    if source == "builtin":
        return builtin_documents(cfg.builtin_max_bytes)
    if source == "prepared":
        return PreparedDocuments(paths, cfg.tokenizer, build_tokenizer(cfg.tokenizer, cfg.tokenizer_sha256), key)
    return file_documents(paths, cfg.text_field)


def sources(cfg: DataConfig, split: str) -> list[Source]:
    """split='train': the training documents of each source (without the held-out share); 'eval': the
    held-out ones (data.eval_paths, else the data.eval_share of each training source)."""
    if split not in ("train", "eval"):
        raise DataError(f"{split=} must be train or eval")
    if split == "eval" and cfg.eval_paths:  # prepared directories or globs of files
        prepared = [os.path.isfile(os.path.join(os.path.expanduser(p), MANIFEST)) for p in cfg.eval_paths]
        if any(prepared) and not all(prepared):
            raise DataError(f"data.eval_paths={list(cfg.eval_paths)} mixes prepared directories and globs of "
                            "files; give one kind")
        return [Source("eval", 1.0, _open("prepared" if all(prepared) else "files", cfg.eval_paths, cfg,
                                          "data.eval_paths"))]
    if split == "eval" and not cfg.eval_share:
        raise DataError("no held-out data: set data.eval_paths=[glob, ...] or data.eval_share (e.g. 0.01)")
    entries = cfg.mixture or (MixtureSource(paths=cfg.paths),)
    out = []
    for i, m in enumerate(entries):
        key = f"data.mixture[{i}].paths" if cfg.mixture else "data.paths"
        docs = _open(cfg.source, m.paths, cfg, key)
        if cfg.eval_share:
            docs = HeldOut(docs, cfg.eval_share, held_out=split == "eval")
        out.append(Source(m.label if cfg.mixture else cfg.source, m.weight, docs))
    return out


def _close_iterator(holder: list) -> None:
    while holder:
        close = getattr(holder.pop(), "close", None)
        if close is not None:
            close()


def _tuples(state: Any) -> Any:
    """Undo JSON: concat-then-split compares its slices with tuples, JSON gave lists back."""
    if isinstance(state, dict):
        return {k: {f: tuple(s) for f, s in v.items()} if k == "remainder_slices" else _tuples(v)
                for k, v in state.items()}
    if isinstance(state, list):
        return [_tuples(v) for v in state]
    return state


SHOWN_FILES = 3  # changed data files named in a resume's refusal


def _changed_files(saved: list, now: list) -> list[str]:
    """What differs between two lists of `file_fingerprint`s, in order: each changed file by name (at
    most SHOWN_FILES, then a count). Files are matched by position, so a moved copy is the same data."""
    out = []
    for old, new in zip(saved, now):
        if list(old[1:]) != list(new[1:]):
            how = (f"{old[1]} bytes, now {new[1]}" if old[1] != new[1] else "same size, other bytes")
            out.append(f"{new[0]} changed ({how})")
    out += [f"{f[0]} is new" for f in now[len(saved):]] + [f"{f[0]} is gone" for f in saved[len(now):]]
    if len(out) > SHOWN_FILES:
        out = out[:SHOWN_FILES] + [f"{len(out) - SHOWN_FILES} more files changed"]
    return out


class TrainData:
    """Iterator of this process's rows of each global batch, forever, resumable.

    Each batch is a dict of [global_batch_size // process_count, seq_len] arrays:
    inputs, targets, segment_ids, positions (int32) and loss_mask (float32); see BATCH_KEYS and the
    module docstring. Process p's rows are rows [p*B, (p+1)*B) of the global batch. `split`: train
    (the training documents) or eval (data.eval_paths, else the held-out data.eval_share).
    """

    def __init__(self, cfg: DataConfig, *, seed: int, process_index: int = 0, process_count: int = 1,
                 split: str = "train"):
        if cfg.seq_len < 1:
            raise DataError(f"data.seq_len={cfg.seq_len} must be positive")
        if process_count < 1 or not 0 <= process_index < process_count:
            raise DataError(f"{process_index=} must be in [0, {process_count=})")
        if cfg.global_batch_size < 1 or cfg.global_batch_size % process_count:
            raise DataError(f"data.global_batch_size={cfg.global_batch_size} must be a positive multiple "
                            f"of the process count {process_count}")
        if cfg.source not in ("builtin", "files", "prepared"):
            raise DataError(f"data.source={cfg.source!r} is not one of builtin, files, prepared")
        if cfg.order == "windows" and cfg.source != "prepared":
            raise DataError(f"data.order=windows needs data.source=prepared (not {cfg.source!r}), "
                            "or data.order=documents")
        self.cfg, self.seed = cfg, seed
        self.process_index, self.process_count = process_index, process_count
        self.local_batch_size = cfg.global_batch_size // process_count
        self.tokenizer = build_tokenizer(cfg.tokenizer, cfg.tokenizer_sha256)
        self.split = split
        self.sources = sources(cfg, split)
        self.documents = self.sources[0].documents if len(self.sources) == 1 else None
        if cfg.order == "windows" and cfg.eval_share:
            raise DataError(f"data.order=windows cuts whole prepared token streams and cannot hold out "
                            f"data.eval_share={cfg.eval_share} of their documents; hold out data with "
                            "data.eval_paths (prepared directories), or use data.order=documents")
        # Evaluation on text files (data.eval_paths globs) packs documents whatever data.order says.
        self.windows = cfg.order == "windows" and all(isinstance(s.documents, PreparedDocuments)
                                                      for s in self.sources)
        first = process_index * self.local_batch_size
        self.streams = range(first, first + self.local_batch_size)
        self._batches = 0  # batches handed out (the windows' position, the mixture's token counts)
        self._holder: list = []
        self._files: list | None = None  # the data files' fingerprints, taken on first use
        self._finalizer = weakref.finalize(self, _close_iterator, self._holder)
        self._start(0)

    def _windows(self) -> grain.MapDataset:
        """Global row position -> row, windows of every source mixed by weight (module docstring)."""
        rows = []
        for i, src in enumerate(self.sources):
            prepared = src.documents
            count = prepared.num_tokens // (self.cfg.seq_len + 1)
            if not count:
                raise DataError(f"data source {src.name!r} has {prepared.num_tokens} tokens, less than one window "
                                f"of data.seq_len+1={self.cfg.seq_len + 1}; lower data.seq_len or add data")
            order = document_order(grain.MapDataset.range(count), seed=self.seed, shuffle=self.cfg.shuffle, source=i)
            rows.append(order.map(_Window(prepared, self.cfg.seq_len, self.tokenizer.pad_id)))
        return rows[0] if len(rows) == 1 else grain.MapDataset.mix(rows, [s.weight for s in self.sources])

    def _streams(self) -> grain.IterDataset:
        """This process's packed streams (one per local row), each a mixture when there are sources."""
        G, T, tok = self.cfg.global_batch_size, self.cfg.seq_len, self.tokenizer
        orders = [document_order(s.documents, seed=self.seed, shuffle=self.cfg.shuffle, source=i)
                  for i, s in enumerate(self.sources)]
        if len(orders) == 1:
            streams = [packed_stream(orders[0], r, G, tok, T) for r in self.streams]
        else:
            weights = [s.weight for s in self.sources]
            streams = [mixture.Select(mixture.stream_selection(r, G, weights),
                                      [packed_stream(o, r, G, tok, T) for o in orders]) for r in self.streams]
        return grain.experimental.ZipIterDataset(streams).map(_stack)

    def _start(self, batch: int) -> None:
        """(Re)builds the iterator; windows start at global batch `batch` (random access)."""
        _close_iterator(self._holder)
        c = self.cfg
        if self.windows:
            ds = grain.MapDataset.range(batch, sys.maxsize).map(_Batch(self._windows(), self.streams,
                                                                       c.global_batch_size))
            ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
        else:
            ds = self._streams()
        if c.num_workers > 0:
            from absl import flags  # grain workers read absl flags; a non-absl program never parsed them

            if not flags.FLAGS.is_parsed():
                flags.FLAGS.mark_as_parsed()
            ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=c.num_workers,
                                                             per_worker_buffer_size=max(c.prefetch, 1)))
        elif c.prefetch > 0:
            ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=c.prefetch)
        # The iterator lives in a list the finalizer empties: closing and dropping it at collection or at
        # interpreter exit, while modules still exist (grain's own __del__ fails during teardown).
        self._holder.append(iter(ds))

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    @property
    def _iterator(self):
        if not self._holder:
            raise DataError("this TrainData was closed; build a new one (set_state resumes it)")
        return self._holder[0]

    def __next__(self) -> dict[str, np.ndarray]:
        batch = next(self._iterator)
        self._batches += 1
        if self.cfg.num_workers > 0:  # own the memory: grain's shared-memory arrays leak if kept to exit
            batch = {k: np.array(v) for k, v in batch.items()}
        return batch

    def tokens_per_source(self, batches: int) -> dict[str, int]:
        """Tokens each source gave to the first `batches` global batches (every row: seq_len tokens)."""
        rows = mixture.rows_per_source(batches * self.cfg.global_batch_size, [s.weight for s in self.sources])
        return {s.name: n * self.cfg.seq_len for s, n in zip(self.sources, rows)}

    def _fingerprint(self) -> dict[str, Any]:
        c = self.cfg
        fp = {"version": _STATE_VERSION, "seed": self.seed, "shuffle": c.shuffle, "seq_len": c.seq_len,
              "global_batch_size": c.global_batch_size, "tokenizer": c.tokenizer,
              "num_documents": sum(len(s.documents) for s in self.sources), "num_workers": c.num_workers,
              **({"split": self.split, "eval_share": c.eval_share} if c.eval_share else {})}
        if len(self.sources) > 1:
            fp["mixture"] = [[s.name, s.weight, len(s.documents)] for s in self.sources]
        if self._files is None and not (c.source == "builtin" and not (self.split == "eval" and c.eval_paths)):
            self._files = [file_fingerprint(p) for s in self.sources for p in data_files(s.documents)]
        if self._files is not None:  # the files the position points into: size and sampled hash
            fp["files"] = self._files
        if self.windows:  # batches are random access: any worker count, any process count
            del fp["num_workers"]
            fp["order"] = "windows"
        elif c.num_workers > 0:
            fp.update(process_index=self.process_index, process_count=self.process_count)
        return fp

    def get_state(self) -> dict:
        """JSON-serialisable position of this process's streams (see the module docstring)."""
        state = {"config": self._fingerprint(), "batches": self._batches}
        if len(self.sources) > 1:
            state["tokens"] = self.tokens_per_source(self._batches)
        if self.windows:
            return state
        grain_state = self._iterator.get_state()
        if self.cfg.num_workers > 0:
            return {**state, "workers": json.loads(json.dumps(grain_state))}
        return {**state, "streams": {str(r): s for r, s in zip(self.streams, grain_state["parents"])}}

    def check_state(self, state: dict) -> bool:
        """Whether `get_state()` output was written on this data with these settings: False when not and
        data.on_change=restart (the data starts from its first batch), else a DataError naming what
        changed. A state written before files were fingerprinted is compared by its settings only."""
        saved, now = dict(state.get("config", {})), self._fingerprint()
        if saved.get("tokenizer", "byte") != "byte" and isinstance(saved["tokenizer"], str):
            saved["tokenizer"] = os.path.abspath(saved["tokenizer"])  # recorded before paths were made absolute
        diff = [f"{k}: saved {saved.get(k)!r}, now {v!r}" for k, v in now.items()
                if k != "files" and saved.get(k) != v]
        diff += [f"{k}: saved {v!r}, now absent" for k, v in saved.items() if k not in now and k != "files"]
        if "files" in saved and "files" in now:
            diff += _changed_files(saved["files"], now["files"])
        if not diff:
            return True
        if self.cfg.on_change == "restart":
            return False
        raise DataError("the data differs from the checkpoint's (" + "; ".join(diff) + "); resume with the data "
                        "and data settings it was written with, or set data.on_change=restart to keep the "
                        "trained model and start the data again from its first batch")

    def set_state(self, state: dict) -> None:
        """Resume from `get_state()` output (after a JSON round trip is fine); raises DataError on mismatch
        (data.on_change=restart: the data starts from its first batch instead, said on stderr)."""
        if not self.check_state(state):
            if self.process_index == 0:
                from lumen_jax.runtime.logs import console
                print("note: the data differs from the checkpoint's; data.on_change=restart: the model resumes, "
                      "the data starts again from its first batch", file=console(), flush=True)
            return
        if self.windows:
            self._start(state["batches"])
        elif self.cfg.num_workers > 0:
            self._iterator.set_state(_tuples(state["workers"]))
        else:
            missing = [r for r in self.streams if str(r) not in state["streams"]]
            if missing:
                raise DataError(f"data state has no entry for streams {missing} of process "
                                f"{self.process_index}/{self.process_count}; pass the merged states of all "
                                "processes when the process count changes")
            self._iterator.set_state({"parents": [_tuples(state["streams"][str(r)]) for r in self.streams]})
        self._batches = state.get("batches", 0)  # states written before the count existed: counts from here

    def close(self) -> None:
        """Stops grain worker processes, if any. Also done when the object is collected or at exit."""
        self._finalizer()
