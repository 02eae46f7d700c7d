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

State. A stream's state is grain's: its position in the document order plus the split point of the
document in progress (concat-then-split re-reads and re-tokenizes that one document on restore).
`get_state()` is `{"streams": {"r": state_r, ...}, "config": {...}}` for the process's own streams; the
union of all processes' states restores any process count with the same global batch size. With
`num_workers > 0` the whole pipeline runs in grain worker processes (`mp_prefetch`); each worker packs
its own slice of every stream, so batches then also depend on num_workers, and the state (grain's, per
worker) only restores the same num_workers and process count.
"""

from __future__ import annotations

import json
import weakref
from typing import Any, Iterator

import grain
import numpy as np

from lumen_jax.config import DataConfig
from lumen_jax.data.errors import DataError
from lumen_jax.data.sources import Documents, HeldOut, builtin_documents, file_documents
from lumen_jax.data.tokenizer import build_tokenizer

BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")
_STATE_VERSION = 1


class _Tokenize:
    """text -> {"tokens": int32 [BOS, ids..., EOS]} (a class, not a lambda: grain workers pickle it)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, text: str) -> dict[str, np.ndarray]:
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


def _stack(rows: tuple[dict[str, np.ndarray], ...]) -> dict[str, np.ndarray]:
    return {k: np.stack([r[k] for r in rows]) for k in BATCH_KEYS}


def _shuffle_seed(seed: int) -> int:
    # grain reseeds epoch e with seed + e; mixing keeps seed s+1 from replaying seed s's epoch 1.
    return int(np.random.SeedSequence(seed % 2**64).generate_state(1)[0])


def document_order(docs: Documents, *, seed: int, shuffle: bool) -> grain.MapDataset:
    """The infinite global document order: a seeded permutation per epoch (or index order)."""
    ds = grain.MapDataset.source(docs)
    if shuffle:
        ds = ds.shuffle(seed=_shuffle_seed(seed))
    return ds.repeat()


def packed_stream(order: grain.MapDataset, stream: int, num_streams: int, tokenizer,
                  seq_len: int) -> grain.IterDataset:
    """Rows of stream `stream`: documents stream, stream+num_streams, ... of `order`, packed."""
    ds = order[stream::num_streams].map(_Tokenize(tokenizer))
    # Synchronous reads: one stream is cheap, and B streams with a thread pool each would be B pools.
    ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    ds = grain.experimental.ConcatThenSplitIterDataset(ds, length_struct={"tokens": seq_len + 1})
    return ds.map(_Row(tokenizer.pad_id))


def _documents(cfg: DataConfig, split: str) -> Documents | HeldOut:
    """split='train': the training documents (without the held-out share); 'eval': the held-out ones
    (data.eval_paths, else the data.eval_share of the training source)."""
    if split not in ("train", "eval"):
        raise DataError(f"{split=} must be train or eval")
    if split == "eval" and cfg.eval_paths:
        return file_documents(cfg.eval_paths, cfg.text_field)
    if split == "eval" and not cfg.eval_share:
        raise DataError("no held-out data: set data.eval_paths=[glob, ...] or data.eval_share (e.g. 0.01)")
    docs = (builtin_documents(cfg.builtin_max_bytes) if cfg.source == "builtin"
            else file_documents(cfg.paths, cfg.text_field))
    if cfg.eval_share and not cfg.eval_paths:
        return HeldOut(docs, cfg.eval_share, held_out=split == "eval")
    return docs


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
        if cfg.source not in ("builtin", "files"):
            raise DataError(f"data.source={cfg.source!r} is not one of builtin, files")
        self.cfg, self.seed = cfg, seed
        self.process_index, self.process_count = process_index, process_count
        self.local_batch_size = cfg.global_batch_size // process_count
        self.tokenizer = build_tokenizer(cfg.tokenizer)
        self.split = split
        self.documents = _documents(cfg, split)
        first = process_index * self.local_batch_size
        self.streams = range(first, first + self.local_batch_size)
        order = document_order(self.documents, seed=seed, shuffle=cfg.shuffle)
        ds = grain.experimental.ZipIterDataset(
            [packed_stream(order, r, cfg.global_batch_size, self.tokenizer, cfg.seq_len)
             for r in self.streams]).map(_stack)
        if cfg.num_workers > 0:
            from absl import flags  # grain workers read absl flags; a non-absl program never parsed them

            if not flags.FLAGS.is_parsed():
                flags.FLAGS.mark_as_parsed()
            ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=cfg.num_workers))
        # The iterator lives in a list the finalizer empties: closing and dropping it at collection or at
        # interpreter exit, while modules still exist (grain's own __del__ fails during teardown).
        self._holder = [iter(ds)]
        self._finalizer = weakref.finalize(self, _close_iterator, self._holder)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    @property
    def _iterator(self):
        if not self._holder:
            raise DataError("this TrainData was closed; build a new one (set_state resumes it)")
        return self._holder[0]

    def __next__(self) -> dict[str, np.ndarray]:
        batch = next(self._iterator)
        if self.cfg.num_workers > 0:  # own the memory: grain's shared-memory arrays leak if kept to exit
            batch = {k: np.array(v) for k, v in batch.items()}
        return batch

    def _fingerprint(self) -> dict[str, Any]:
        c = self.cfg
        fp = {"version": _STATE_VERSION, "seed": self.seed, "shuffle": c.shuffle, "seq_len": c.seq_len,
              "global_batch_size": c.global_batch_size, "tokenizer": c.tokenizer,
              "num_documents": len(self.documents), "num_workers": c.num_workers,
              **({"split": self.split, "eval_share": c.eval_share} if c.eval_share else {})}
        if c.num_workers > 0:
            fp.update(process_index=self.process_index, process_count=self.process_count)
        return fp

    def get_state(self) -> dict:
        """JSON-serialisable position of this process's streams (see the module docstring)."""
        state = self._iterator.get_state()
        if self.cfg.num_workers > 0:
            return {"config": self._fingerprint(), "workers": json.loads(json.dumps(state))}
        return {"config": self._fingerprint(),
                "streams": {str(r): s for r, s in zip(self.streams, state["parents"])}}

    def check_state(self, state: dict) -> None:
        """Raises DataError when `get_state()` output was written by another data pipeline."""
        saved, now = state.get("config", {}), self._fingerprint()
        diff = [f"{k}: saved {saved.get(k)!r}, now {v!r}" for k, v in now.items() if saved.get(k) != v]
        if diff:
            raise DataError("data state does not match this data pipeline (" + "; ".join(diff)
                            + "); resume with the same data settings or start the data from scratch")

    def set_state(self, state: dict) -> None:
        """Resume from `get_state()` output (after a JSON round trip is fine); raises DataError on mismatch."""
        self.check_state(state)
        if self.cfg.num_workers > 0:
            self._iterator.set_state(_tuples(state["workers"]))
            return
        missing = [r for r in self.streams if str(r) not in state["streams"]]
        if missing:
            raise DataError(f"data state has no entry for streams {missing} of process "
                            f"{self.process_index}/{self.process_count}; pass the merged states of all "
                            "processes when the process count changes")
        self._iterator.set_state({"parents": [_tuples(state["streams"][str(r)]) for r in self.streams]})

    def close(self) -> None:
        """Stops grain worker processes, if any. Also done when the object is collected or at exit."""
        self._finalizer()
