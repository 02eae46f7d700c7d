"""Weighted mixtures of sources, decided per row: which source gives row r of global batch b.

Every row of every batch comes whole from one source. Global row position g = b * G + r (G =
data.global_batch_size) takes its source from grain's proportional mixing (`grain.MapDataset.mix`,
a deterministic interleave: of every sum(p) consecutive positions, source s takes p_s, with p the
weights scaled to integers, the smallest to 100). So each batch holds the sources in proportion (no
batch is all one source), the proportions over a run match the weights to within one period, and
the rows (so tokens: every row is seq_len tokens) each source gave up to batch b are a closed
formula of b (`rows_per_source`), the same on every process and after any resume: the metrics'
tokens per source need no communication.

`Select` is the documents-mode stream: stream r keeps one packed stream per source and takes its
k-th row from the source of position k * G + r. Its state is the row count k (the selection's
position) and each source's packing state. With grain worker processes its selection is sliced with the packed streams, so
worker w's k-th row is the stream's row k * W + w, which grain's round-robin puts back in place.
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

import grain


def integer_proportions(weights: Sequence[float]) -> list[int]:
    """The integer proportions grain's mixing uses for `weights` (the smallest scaled to 100)."""
    scale = 100 / min(weights)
    return [int(w * scale) for w in weights]


def rows_per_source(positions: int, weights: Sequence[float]) -> list[int]:
    """How many of the first `positions` global rows each source gives under grain's mixing.

    The same arithmetic as grain's selection map (the count of source i among positions [0, k)
    peels off k * p_i / remaining, rounded, source by source); tests/data check the two agree.
    """
    props = integer_proportions(weights)
    remaining, k, counts = sum(props), positions, []
    for p in props:
        rest = (k * (remaining - p)) // remaining
        counts.append(k - rest)
        k, remaining = rest, remaining - p
    return counts


def source_positions(weights: Sequence[float]) -> grain.MapDataset:
    """Global row position g -> the index of its source (grain's mixing over constant datasets)."""
    return grain.MapDataset.mix([grain.MapDataset.source([s]).repeat() for s in range(len(weights))],
                                list(weights))


class _StreamSource:
    """Row k of stream r -> the source of global position k * G + r."""

    def __init__(self, stream: int, num_streams: int, weights: Sequence[float]):
        self.stream, self.num_streams = stream, num_streams
        self.sources = source_positions(weights)

    def __call__(self, k: int) -> int:
        return self.sources[k * self.num_streams + self.stream]


def stream_selection(stream: int, num_streams: int, weights: Sequence[float]) -> grain.IterDataset:
    """Row k of stream `stream` -> its source, in order (an IterDataset over a MapDataset of positions,
    so grain workers slice it as they slice the packed rows: worker w reads rows w, w+W, ...)."""
    positions = grain.MapDataset.range(sys.maxsize).map(_StreamSource(stream, num_streams, weights))
    return positions.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))


class Select(grain.IterDataset):
    """Row k comes from `sources[selection's k-th item]` (each source an infinite IterDataset of rows)."""

    def __init__(self, selection: grain.IterDataset, sources: Sequence[grain.IterDataset]):
        super().__init__([selection, *sources])

    def __iter__(self) -> grain.DatasetIterator:
        return _SelectIterator([iter(p) for p in self._parents])

    def __str__(self) -> str:
        return f"Select({len(self._parents) - 1} sources)"


class _SelectIterator(grain.DatasetIterator):
    def __init__(self, parents: list[grain.DatasetIterator]):
        super().__init__(parents)  # the selection, then the sources

    def __next__(self) -> Any:
        return next(self._parents[1 + next(self._parents[0])])

    def get_state(self) -> dict[str, Any]:
        return {"parents": [p.get_state() for p in self._parents]}

    def set_state(self, state: dict[str, Any]) -> None:
        for p, s in zip(self._parents, state["parents"]):
            p.set_state(s)
