"""Document sources: random-access sequences of text (`len(src)`, `src[i] -> str`) that grain reads from.

* `builtin_documents(max_bytes)`: the `.py` files of this Python's standard library, in sorted path
  order, without tests, site-packages and caches, until `max_bytes` (the last file is cut to fit).
  No download; the same corpus wherever the same Python version runs.
* `file_documents(globs, text_field)`: `.txt` (one document per file), `.jsonl` (one per non-empty line,
  the string field `text_field`), `.parquet` (one per row, the string column `text_field`).

Start-up only lists files and indexes them (a jsonl file is scanned once for newlines, a parquet file's
footer is read); text is read when grain asks for a document. So a bad file is reported at start-up
(missing, unreadable, not parquet, no such column) and a bad record when it is first read (a line that is
not JSON, a missing field). Every problem is a one-line `DataError` naming the file and the fix.
Parquet columns are loaded whole on first use and kept (per process / worker): memory = the text size.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import mmap
import os
import sys
import sysconfig
from typing import Iterator

import numpy as np

from lumen_jax.data.errors import DataError

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
EXTENSIONS = (".txt", ".jsonl", ".parquet")


def _oneline(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__


# --------------------------------------------------------------------------------------------------
# One file each
# --------------------------------------------------------------------------------------------------

class _TextFile:
    """One document: the whole file (builtin files are cut at `limit` bytes and decoded leniently)."""

    def __init__(self, path: str, limit: int | None = None, lenient: bool = False):
        self.path, self.limit, self.lenient = path, limit, lenient
        if not lenient:
            try:
                open(path, "rb").close()
            except OSError as e:
                raise DataError(f"data file {path}: cannot read ({e.strerror})") from None

    def __len__(self) -> int:
        return 1

    def get(self, i: int) -> str:
        try:
            with open(self.path, "rb") as f:
                raw = f.read() if self.limit is None else f.read(self.limit)
        except OSError as e:
            raise DataError(f"data file {self.path}: cannot read ({e.strerror})") from None
        return raw.decode("utf-8", errors="replace") if self.lenient else utf8_text(raw, f"data file {self.path}")

    def raw_records(self) -> Iterator[tuple[str, str, bytes]]:
        """(where, kind, raw) of each document, in order, for `decode_record` (prepare reads these)."""
        with open(self.path, "rb") as f:
            yield f"data file {self.path}", "txt", f.read()


def utf8_text(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not valid UTF-8 at byte {e.start}; re-encode the file as UTF-8") from None


class _JsonlFile:
    """One document per non-empty line; the index holds each line's byte range and number."""

    def __init__(self, path: str, field: str):
        self.path, self.field = path, field
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size:
                    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                    buf = np.frombuffer(mm, np.uint8)
                    try:
                        ends = np.flatnonzero(buf == ord("\n"))
                        if buf[-1] != ord("\n"):
                            ends = np.append(ends, size)
                        starts = np.concatenate([[0], ends[:-1] + 1])
                        first = buf[np.minimum(starts, size - 1)]
                        blank = (ends == starts) | ((ends - starts == 1) & (first == ord("\r")))
                        blank |= self._empty_texts(mm, starts, ends, blank)
                    finally:  # the mmap cannot close while a view exists; a Ctrl-C here must stay a Ctrl-C
                        del buf
                        with contextlib.suppress(BufferError):
                            mm.close()
                else:
                    starts = ends = blank = np.zeros(0, np.int64)
                    self.empty = 0
        except OSError as e:
            raise DataError(f"data file {path}: cannot read ({e.strerror})") from None
        keep = ~blank.astype(bool)
        self.starts, self.ends = starts[keep], ends[keep]
        self.lines = np.flatnonzero(keep) + 1

    # Lines this short are parsed at start-up to find documents whose text is "" (a longer line with
    # an empty text, i.e. other long fields, is found only when read, and trains on BOS/EOS alone).
    SHORT_LINE = 256

    def _empty_texts(self, mm: mmap.mmap, starts: np.ndarray, ends: np.ndarray, blank: np.ndarray) -> np.ndarray:
        empty = np.zeros(len(starts), bool)
        for i in np.flatnonzero(~blank & (ends - starts <= self.SHORT_LINE)):
            try:
                record = json.loads(mm[int(starts[i]):int(ends[i])])
            except ValueError:
                continue  # reported with its line number when read
            empty[i] = isinstance(record, dict) and isinstance(record.get(self.field), str) and not record[self.field]
        self.empty = int(empty.sum())
        return empty

    def __len__(self) -> int:
        return len(self.starts)

    def get(self, i: int) -> str:
        where = f"data file {self.path} line {self.lines[i]}"
        try:
            with open(self.path, "rb") as f:
                f.seek(int(self.starts[i]))
                raw = f.read(int(self.ends[i] - self.starts[i]))
        except OSError as e:
            raise DataError(f"{where}: cannot read ({e.strerror})") from None
        return jsonl_text(raw, self.field, where)

    def raw_records(self) -> Iterator[tuple[str, str, bytes]]:
        if not len(self):
            return
        with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            for start, end, line in zip(self.starts.tolist(), self.ends.tolist(), self.lines.tolist()):
                yield f"data file {self.path} line {line}", "jsonl", mm[start:end]


def jsonl_text(raw: bytes, field: str, where: str) -> str:
    """The string `field` of one jsonl line, or a DataError starting with `where` (file and line)."""
    try:
        record = json.loads(raw)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise DataError(f"{where}: not valid JSON ({_oneline(e)}); fix or remove the line") from None
    if not isinstance(record, dict) or field not in record:
        keys = ", ".join(map(str, record)) if isinstance(record, dict) else f"a JSON {type(record).__name__}"
        raise DataError(f"{where}: no field {field!r} (found {keys}); set data.text_field "
                        "or fix the line")
    text = record[field]
    if not isinstance(text, str):
        raise DataError(f"{where}: field {field!r} is {type(text).__name__}, not a string; "
                        "fix or remove the line")
    return text


class _ParquetFile:
    """One document per row of column `field`; the column is read on first use and kept."""

    def __init__(self, path: str, field: str):
        import pyarrow.parquet as pq

        self.path, self.field = path, field
        try:
            pf = pq.ParquetFile(path)
        except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
            raise DataError(f"data file {path}: not a readable parquet file ({_oneline(e)})") from None
        names = pf.schema_arrow.names
        if field not in names:
            raise DataError(f"data file {path}: no column {field!r} (columns: {', '.join(names)}); "
                            "set data.text_field")
        kind = pf.schema_arrow.field(field).type
        if str(kind) not in ("string", "large_string", "string_view"):
            raise DataError(f"data file {path}: column {field!r} has type {kind}, not string; "
                            "set data.text_field to a text column")
        self.num_rows = pf.metadata.num_rows
        self._column = None

    def __getstate__(self):  # grain workers get the index, not the loaded column
        return {**self.__dict__, "_column": None}

    def __len__(self) -> int:
        return self.num_rows

    def get(self, i: int) -> str:
        if self._column is None:
            import pyarrow.parquet as pq

            try:
                self._column = pq.read_table(self.path, columns=[self.field]).column(0).combine_chunks()
            except (OSError, ValueError) as e:
                raise DataError(f"data file {self.path}: cannot read column {self.field!r} "
                                f"({_oneline(e)})") from None
        return parquet_text(self._column[i].as_py(), self.field, f"data file {self.path} row {i}")

    def raw_records(self) -> Iterator[tuple[str, str, str | None]]:
        import pyarrow.parquet as pq

        try:
            i = 0
            for batch in pq.ParquetFile(self.path).iter_batches(batch_size=4096, columns=[self.field]):
                for text in batch.column(0).to_pylist():
                    yield f"data file {self.path} row {i}", "parquet", text
                    i += 1
        except (OSError, ValueError) as e:
            raise DataError(f"data file {self.path}: cannot read column {self.field!r} ({_oneline(e)})") from None


def parquet_text(text: str | None, field: str, where: str) -> str:
    if text is None:
        raise DataError(f"{where}: {field!r} is null; drop or fill null rows")
    return text


def decode_record(kind: str, raw: bytes | str | None, field: str, where: str) -> str:
    """The text of one `raw_records` item, or the DataError on-the-fly reading would raise for it."""
    if kind == "jsonl":
        return jsonl_text(raw, field, where)
    if kind == "txt":
        return utf8_text(raw, where)
    return parquet_text(raw, field, where)


# --------------------------------------------------------------------------------------------------
# Many files as one sequence
# --------------------------------------------------------------------------------------------------

class Documents:
    """The documents of several files as one random-access sequence of strings (a grain data source)."""

    def __init__(self, files: list, description: str):
        self.files = files
        self.offsets = np.cumsum([0] + [len(f) for f in files])
        self.description = description

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, index: int) -> str:
        k = int(np.searchsorted(self.offsets, index, side="right")) - 1
        return self.files[k].get(int(index - self.offsets[k]))

    def __repr__(self) -> str:
        return f"Documents({len(self)} documents: {self.description})"


class HeldOut:
    """The documents of `docs` held out for evaluation (`held_out=True`) or those left for training.

    Document i is held out when a fixed uniform draw for i falls below `share` (a seeded generator
    over len(docs)): the same documents whatever the seed, batch size or process count.
    """

    def __init__(self, docs: Documents, share: float, held_out: bool):
        draws = np.random.default_rng(20240917).random(len(docs))
        self.docs, self.indices = docs, np.flatnonzero((draws < share) == held_out)
        if not len(self.indices):
            raise DataError(f"data.eval_share={share} leaves no {'held-out' if held_out else 'training'} "
                            f"documents of {len(docs)}; change data.eval_share or use data.eval_paths")
        self.description = f"{'held-out' if held_out else 'training'} share of {docs!r}"

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> str:
        return self.docs[int(self.indices[index])]

    def __repr__(self) -> str:
        return f"HeldOut({len(self)} documents: {self.description})"


def builtin_documents(max_bytes: int) -> Documents:
    """The standard library's `.py` files in sorted path order, `max_bytes` of them in total."""
    if max_bytes <= 0:
        raise DataError(f"data.builtin_max_bytes={max_bytes} must be positive")
    root = sysconfig.get_paths()["stdlib"]
    files, left = [], max_bytes
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)  # walk order = sorted paths
        for name in sorted(filenames):
            if not name.endswith(".py") or left <= 0:
                continue
            path = os.path.join(dirpath, name)
            size = os.path.getsize(path)
            files.append(_TextFile(path, limit=min(size, left), lenient=True))
            left -= size
        if left <= 0:
            break
    if not files:
        raise DataError(f"the builtin corpus found no .py files under {root}; use data.source=files")
    return Documents(files, f"{len(files)} .py files, {max_bytes - max(left, 0)} bytes of {root}")


def list_files(patterns: tuple[str, ...] | list[str], key: str = "data.paths") -> list[str]:
    """The files matched by `patterns` (globs, `**` allowed): sorted per glob, globs in order, no repeats."""
    if not patterns:
        raise DataError(f"{key} is empty: give globs of .txt / .jsonl / .parquet files")
    paths: list[str] = []
    for pattern in patterns:
        matched = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
        if not matched:
            raise DataError(f"{key} entry {pattern!r} matches no files; check the path or glob")
        for p in matched:
            if os.path.isdir(p):
                raise DataError(f"{key} entry {pattern!r} matches the directory {p}; "
                                f"use a glob such as {os.path.join(p, '*.jsonl')!r}")
            if p not in paths:
                paths.append(p)
    return paths


FINGERPRINT_BYTES = 1 << 16  # hashed at each end of a data file: a resume reads little, even of a large corpus


def file_fingerprint(path: str) -> list:
    """[path, size, sha256 of its first and last FINGERPRINT_BYTES]: cheap evidence that a file changed
    (appended, truncated, replaced), which a resume compares with the checkpoint's."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        digest.update(f.read(FINGERPRINT_BYTES))
        if size > FINGERPRINT_BYTES:
            f.seek(max(size - FINGERPRINT_BYTES, FINGERPRINT_BYTES))
            digest.update(f.read())
    return [path, size, digest.hexdigest()[:16]]


def data_files(docs: object) -> list[str]:
    """The files a source's documents are read from (a held-out share: its source's)."""
    docs = docs.docs if isinstance(docs, HeldOut) else docs
    return list(docs.paths) if hasattr(docs, "paths") else [f.path for f in docs.files]


def open_file(path: str, text_field: str) -> _TextFile | _JsonlFile | _ParquetFile | None:
    """The document index of one file (None: an empty .txt file, which holds no document)."""
    ext = os.path.splitext(path)[1].lower()
    if ext == ".txt":
        return _TextFile(path) if os.path.getsize(path) else None  # empty: it would train on BOS and EOS alone
    if ext == ".jsonl":
        return _JsonlFile(path, text_field)
    if ext == ".parquet":
        return _ParquetFile(path, text_field)
    raise DataError(f"data file {path}: unsupported extension {ext!r}; use .txt (one document per "
                    "file), .jsonl (one per line) or .parquet (column data.text_field)")


def file_documents(patterns: tuple[str, ...] | list[str], text_field: str) -> Documents:
    """The documents of the files matched by `patterns` (globs, `**` allowed), in sorted order per glob."""
    if not patterns:
        raise DataError("data.source=files needs data.paths: globs of .txt / .jsonl / .parquet files")
    paths = list_files(patterns)
    files, empty = [], 0
    for p in paths:
        f = open_file(p, text_field)
        empty += 1 if f is None else getattr(f, "empty", 0)
        if f is not None:
            files.append(f)
    docs = Documents(files, f"{len(files)} files from {', '.join(patterns)}")
    if not len(docs):
        raise DataError(f"data.paths {', '.join(patterns)} matched {len(paths)} files but no documents "
                        f"with text ({empty} empty documents, blank lines not counted); "
                        "point data.paths at files with text")
    if empty:
        print(f"warning: data.paths {', '.join(patterns)}: skipped {empty} empty documents; training on the "
              f"other {len(docs)}", file=sys.stderr, flush=True)
    return docs
