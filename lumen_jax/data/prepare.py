"""`python -m lumen_jax.data.prepare`: tokenize a corpus once into token shards (format: prepared.py).

    python -m lumen_jax.data.prepare --input 'corpus/*.jsonl' --text-field text \\
        --tokenizer tokenizer.json --out data/web [--workers 8] [--shard 3 --num-shards 64] [--join]

The inputs are what `data.source=files` reads (.txt, .jsonl, .parquet globs). Each input .jsonl or
.parquet file becomes one shard (runs of .txt files share one); `--shard i --num-shards n` prepares the
shards k with k % n == i, so n machines (a SLURM array, any batch scheduler) prepare one corpus into one
directory, and whichever slice finishes the last shard writes manifest.json (`--join` writes it, or
says which shards are missing). Rerun after an interruption: finished shards are kept, a shard cut
short is redone. Worker processes parse and tokenize; the parent reads and writes in order, so the
output is the same for any --workers. A record that cannot be read (not JSON, no text field, not
UTF-8, a null row) is skipped, reported on stderr with its file and line (or row), counted in the
shard's .json and the manifest, never silently dropped. Bad arguments or unwritable output: one
line, exit 2. Ctrl-C: one line, exit 130, the shard cut short removed (its .partial files).
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import os
import signal
import sys
from typing import Any, Iterator, Sequence

import numpy as np

from lumen_jax.data import prepared
from lumen_jax.data.errors import DataError
from lumen_jax.data.sources import decode_record, list_files, open_file
from lumen_jax.data.tokenizer import build_tokenizer
from lumen_jax.runtime.lock import Busy, Lock

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports Ctrl-C
CHUNK_RECORDS = 256  # records per task sent to a worker
SHOWN_BAD = 10  # bad records printed on stderr per run (all are in the shard files)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lumen_jax.data.prepare", description=__doc__.splitlines()[0])
    p.add_argument("--input", nargs="+", action="extend", required=True,
                   help="globs of .txt / .jsonl / .parquet files (quote them), in order")
    p.add_argument("--text-field", default="text", help="jsonl field / parquet column holding the text")
    p.add_argument("--tokenizer", required=True, help="byte or the path of a Hugging Face tokenizer.json")
    p.add_argument("--out", required=True, help="the prepared directory (data.paths of data.source=prepared)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizing processes (default: all cores)")
    p.add_argument("--shard", type=int, default=0, help="this slice's index, 0..num-shards-1")
    p.add_argument("--num-shards", type=int, default=1, help="slices the work is split into (machines, array tasks)")
    p.add_argument("--join", action="store_true", help="only write manifest.json from the finished shards")
    return p.parse_args(argv)


# --------------------------------------------------------------------------------------------------
# The plan: the shards and their input files, the same for every slice
# --------------------------------------------------------------------------------------------------

def make_plan(inputs: Sequence[str], text_field: str, tokenizer_spec: str, tokenizer: Any) -> dict:
    groups: list[list[str]] = []
    for path in list_files(inputs, key="--input"):
        txt = path.lower().endswith(".txt")
        if txt and groups and groups[-1][-1].lower().endswith(".txt") and len(groups[-1]) < prepared.TXT_PER_SHARD:
            groups[-1].append(path)
        else:
            groups.append([path])
    return {"format": prepared.FORMAT, "version": prepared.VERSION, "inputs": list(inputs),
            "text_field": text_field, "tokenizer": prepared.tokenizer_identity(tokenizer_spec, tokenizer),
            "dtype": prepared.token_dtype(tokenizer.vocab_size),
            "shards": [{"name": prepared.shard_name(k), "files": files}
                       for k, files in enumerate(groups)]}


def _write_json(path: str, value: dict) -> None:
    tmp = f"{path}.partial.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)  # atomic: a reader sees the old file or the whole new one


def fix_plan(out: str, plan: dict) -> None:
    """Writes `out`/plan.json, or checks that the one there (another slice's, an earlier run's) is this plan."""
    path = os.path.join(out, prepared.PLAN)
    if not os.path.exists(path):
        os.makedirs(out, exist_ok=True)
        _write_json(path, plan)
        return
    old = prepared.read_json(path, f"remove {out} or use another --out")
    for key in ("version", "text_field", "dtype", "tokenizer", "shards"):
        same = (old.get(key) or {}).get("sha256") == plan[key]["sha256"] if key == "tokenizer" else old.get(key) == plan[key]
        if not same:
            what = {"shards": "input files", "tokenizer": "tokenizer", "text_field": "--text-field"}.get(key, key)
            raise DataError(f"{out} was prepared from other {what} than this command's ({path}); "
                            f"use the same --input, --tokenizer and --text-field, or another --out")


# --------------------------------------------------------------------------------------------------
# Workers: raw records -> tokens
# --------------------------------------------------------------------------------------------------

_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer_spec: str, text_field: str, dtype: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: --workers says how many
    _WORKER.update(tokenizer=build_tokenizer(tokenizer_spec), field=text_field, dtype=dtype)


def _pool(workers: int, tokenizer_spec: str, text_field: str, dtype: str) -> Any:
    """`workers` tokenizing processes that ignore SIGINT from birth (inherited through exec): Ctrl-C reaches
    the whole process group and the parent stops the pool; a worker that died of it would print its own
    traceback and leave its task unanswered (the parent waited for it forever)."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return multiprocessing.get_context("spawn").Pool(workers, _init_worker, (tokenizer_spec, text_field, dtype))
    finally:
        signal.signal(signal.SIGINT, previous)


def _encode(records: list[tuple[str, str, Any]]) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(tokens of the good records back to back, their lengths, a message per bad record)."""
    tok, field = _WORKER["tokenizer"], _WORKER["field"]
    pieces, lengths, bad = [], [], []
    for where, kind, raw in records:
        try:
            ids = tok.encode(decode_record(kind, raw, field, where))
        except DataError as e:
            bad.append(str(e).replace("set data.text_field", "set --text-field"))
            continue
        pieces.append(np.array([tok.bos_id, *ids, tok.eos_id], dtype=_WORKER["dtype"]))
        lengths.append(len(ids) + 2)
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, _WORKER["dtype"])
    return tokens, np.array(lengths, np.int64), bad


def _chunks(files: Sequence[str], text_field: str) -> Iterator[list]:
    chunk: list = []
    for path in files:
        f = open_file(path, text_field)
        for record in (f.raw_records() if f is not None else ()):
            chunk.append(record)
            if len(chunk) == CHUNK_RECORDS:
                yield chunk
                chunk = []
    if chunk:
        yield chunk


def _ordered(pool: Any, chunks: Iterator[list], depth: int) -> Iterator[tuple]:
    """`pool.apply_async(_encode, chunk)` for each chunk, results in order, at most `depth` in flight
    (Pool.imap would read a whole input file ahead into memory)."""
    if pool is None:
        yield from map(_encode, chunks)
        return
    pending: collections.deque = collections.deque()
    for chunk in chunks:
        pending.append(pool.apply_async(_encode, (chunk,)))
        if len(pending) >= depth:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


# --------------------------------------------------------------------------------------------------
# Shards
# --------------------------------------------------------------------------------------------------

def _finished(out: str, name: str, dtype: str) -> dict | None:
    """The shard's record when its files are complete, else None (never written, cut short, damaged)."""
    try:
        with open(os.path.join(out, name + ".json"), encoding="utf-8") as f:
            info = json.load(f)
        ok = (os.path.getsize(os.path.join(out, name + ".bin")) == info["tokens"] * np.dtype(dtype).itemsize
              and os.path.getsize(os.path.join(out, name + ".idx")) == 8 * (info["documents"] + 1))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return info if ok else None


def prepare_shard(out: str, shard: dict, plan: dict, pool: Any, depth: int) -> dict:
    """Tokenizes one shard's files into its .bin/.idx, then writes its .json (the commit)."""
    name, dtype = shard["name"], plan["dtype"]
    paths = {ext: os.path.join(out, name + ext) for ext in (".bin", ".idx", ".json")}
    for p in paths.values():  # a stale record must not outlive the files it describes
        if os.path.exists(p):
            os.remove(p)
    documents, tokens, bad = 0, 0, []
    try:
        with open(paths[".bin"] + ".partial", "wb") as bin_f, open(paths[".idx"] + ".partial", "wb") as idx_f:
            idx_f.write(np.zeros(1, np.int64).tobytes())
            for chunk_tokens, lengths, chunk_bad in _ordered(pool, _chunks(shard["files"], plan["text_field"]),
                                                             depth):
                bin_f.write(chunk_tokens.astype(f"<{np.dtype(dtype).str[1:]}", copy=False).tobytes())
                idx_f.write((tokens + np.cumsum(lengths)).astype("<i8").tobytes())
                documents, tokens = documents + len(lengths), tokens + int(lengths.sum())
                bad += chunk_bad
    except BaseException:  # Ctrl-C, a full disk: no half-written shard stays behind
        for ext in (".bin", ".idx"):
            if os.path.exists(paths[ext] + ".partial"):
                os.remove(paths[ext] + ".partial")
        raise
    os.replace(paths[".bin"] + ".partial", paths[".bin"])
    os.replace(paths[".idx"] + ".partial", paths[".idx"])
    info = {"name": name, "files": shard["files"], "documents": documents, "tokens": tokens,
            "bad_records": len(bad), "bad": bad}
    _write_json(paths[".json"], info)
    return info


def join(out: str, plan: dict) -> tuple[dict | None, list[str]]:
    """(manifest, []) once every shard is finished (manifest.json written), else (None, missing shards)."""
    infos, missing = [], []
    for shard in plan["shards"]:
        info = _finished(out, shard["name"], plan["dtype"])
        if info is None:
            missing.append(shard["name"])
        else:
            infos.append({k: info[k] for k in ("name", "files", "documents", "tokens", "bad_records")})
    if missing:
        return None, missing
    if not sum(i["documents"] for i in infos):  # nothing to train on: no manifest, exit 2
        bad = sum(i["bad_records"] for i in infos)
        first = next((b for shard in plan["shards"] for b in _finished(out, shard["name"], plan["dtype"])["bad"]),
                     None)
        raise DataError(f"{out}: the inputs gave 0 documents ({bad} bad records skipped"
                        + (f"; the first: {first}" if first else "") + "); no manifest.json written; check --input "
                        "and --text-field, then rerun")
    manifest = {**plan, "shards": infos, "documents": sum(i["documents"] for i in infos),
                "tokens": sum(i["tokens"] for i in infos), "bad_records": sum(i["bad_records"] for i in infos)}
    _write_json(os.path.join(out, prepared.MANIFEST), manifest)
    return manifest, []


def run(args: argparse.Namespace) -> int:
    if args.num_shards < 1 or not 0 <= args.shard < args.num_shards:
        raise DataError(f"--shard {args.shard} --num-shards {args.num_shards}: need 0 <= --shard < --num-shards")
    if args.workers < 0:
        raise DataError(f"--workers {args.workers} must be >= 0 (0: tokenize in this process)")
    tokenizer = build_tokenizer(args.tokenizer)
    plan = make_plan(args.input, args.text_field, args.tokenizer, tokenizer)
    out = args.out
    if args.join:
        return _prepare(args, plan, out)
    os.makedirs(out, exist_ok=True)
    # One process per slice: slices of one --out run side by side, the same slice twice would race.
    lock = Lock(os.path.join(out, f"prepare-{args.shard}-of-{args.num_shards}.lock"))
    try:
        lock.acquire()
    except Busy as e:
        raise DataError(f"--out={out} is being prepared by another data.prepare of the same slice (--shard "
                        f"{args.shard} --num-shards {args.num_shards}; {e}); wait for it to end or stop it, "
                        "then rerun: finished shards are kept") from None
    if lock.note:
        print(f"warning: {lock.note}", file=sys.stderr, flush=True)
    try:
        return _prepare(args, plan, out)
    finally:
        lock.release()


def _prepare(args: argparse.Namespace, plan: dict, out: str) -> int:
    fix_plan(out, plan)
    if not args.join:
        mine = [s for k, s in enumerate(plan["shards"]) if k % args.num_shards == args.shard]
        todo = [s for s in mine if _finished(out, s["name"], plan["dtype"]) is None]
        pool = None
        if args.workers > 1 and todo:
            pool = _pool(args.workers, args.tokenizer, args.text_field, plan["dtype"])
        if pool is None:
            _init_worker(args.tokenizer, args.text_field, plan["dtype"])
        shown = 0
        try:
            for shard in todo:
                info = prepare_shard(out, shard, plan, pool, depth=2 * max(args.workers, 1))
                for message in info["bad"][:max(SHOWN_BAD - shown, 0)]:
                    print(f"warning: skipped {message}", file=sys.stderr, flush=True)
                if len(info["bad"]) > SHOWN_BAD - shown:
                    print(f"warning: {info['name']}: {len(info['bad'])} bad records in all; every one is listed "
                          f"in {os.path.join(out, info['name'] + '.json')}", file=sys.stderr, flush=True)
                shown += len(info["bad"])
        finally:
            if pool is not None:
                pool.terminate()
        print(f"slice {args.shard} of {args.num_shards}: {len(todo)} shards prepared, {len(mine) - len(todo)} "
              f"were already done ({len(plan['shards'])} shards in all)", flush=True)
    manifest, missing = join(out, plan)
    if manifest is None:
        if args.join:
            raise DataError(f"{out}: {len(missing)} of {len(plan['shards'])} shards are not finished "
                            f"({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}); run the slices "
                            "that prepare them (--shard k % --num-shards), then --join again")
        print(f"{len(missing)} shards still to prepare (other slices); the last slice to finish writes "
              f"{os.path.join(out, prepared.MANIFEST)}", flush=True)
        return 0
    print(f"{os.path.join(out, prepared.MANIFEST)}: {manifest['documents']} documents, {manifest['tokens']} tokens, "
          f"{manifest['bad_records']} bad records skipped, {len(manifest['shards'])} shards", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(f"stopped: interrupted (Ctrl-C); finished shards in {args.out} are kept, the one cut short was "
              "removed: rerun the same command to finish", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except OSError as e:  # a full disk, a read-only --out: finished shards stay, rerun resumes
        where = f"{e.filename}: " if e.filename else ""
        print(f"error: {where}{e.strerror or e}; fix that and rerun the same command: finished shards are kept",
              file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
