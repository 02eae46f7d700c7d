"""The run directory: checked and created before anything compiles, `config.json` written atomically.

Every problem with the directory itself (a file in its place, a file as its parent, a read-only or
full filesystem, no permission) is the environment's fault, not a bug: a ConfigError naming the path
and the cause (exit code 2), so a supervisor does not restart it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sys
from typing import Any, Iterator

from lumen_jax.config import ConfigError
from lumen_jax.runtime.lock import Busy, Lock

LOCK = "lumen.lock"  # the writer's lock (runtime/lock.py): one trainer per run directory
# Files the trainer appends to: a symbolic link there would make it write wherever the link points.
APPENDED = ("metrics.jsonl", "events.jsonl", "library.log")
# What a run directory may hold before its config.json is written: the launchers' logs/ (local.py,
# slurm.sbatch), a failed multi-process start's events, the supervisor's report, a killed start's lock,
# probe or temporary file.
EARLY = ("events.jsonl", "goodput.json", "logs", LOCK, ".write-probe-", "config.json.tmp-")


class RunDirBusy(ConfigError):
    """Another live trainer writes in the run directory (nothing may be written there, not even an event)."""


# The environment's faults: a full or read-only filesystem, a quota, no permission.
ENVIRONMENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})


def _fault(run_dir: str, path: str, e: OSError) -> ConfigError:
    what = e.strerror or type(e).__name__
    return ConfigError(f"train.run_dir={run_dir}: cannot write {path} ({what}); "
                       "free disk space, fix permissions or choose another train.run_dir")


def write_json(run_dir: str, name: str, value: Any) -> None:
    """Writes `<run_dir>/<name>` through a temporary file and a rename: whole or not at all."""
    path = os.path.join(run_dir, name)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(value, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        _remove(tmp)
        raise _fault(run_dir, path, e) from None


def _ours(config_json: str) -> bool:
    """Whether `config_json` is a run's config as `write_json` leaves it (a JSON object of our sections)."""
    try:
        with open(config_json, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(value, dict) and all(isinstance(value.get(k), dict) for k in ("model", "train", "data"))


def refuse_foreign(run_dir: str) -> None:
    """ConfigError when `run_dir` is a non-empty folder that is not a run directory (its config.json is not
    ours, or it has none and holds files we never write there), when a file we append to is a link, or when
    its checkpoints is not a folder or holds a link."""
    try:
        names = sorted(os.listdir(run_dir))
    except OSError:
        return
    if "config.json" in names and not _ours(os.path.join(run_dir, "config.json")):
        raise ConfigError(f"train.run_dir={run_dir} holds a config.json that lumen_jax did not write (no model, "
                          "train and data sections): it is not a run directory, and training would replace that "
                          "file; choose a new or empty train.run_dir")
    if "config.json" not in names and "checkpoints" not in names:
        foreign = [n for n in names if not n.startswith(EARLY)]
        if foreign:
            shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
            raise ConfigError(f"train.run_dir={run_dir} is not empty and is not a run directory (no config.json; "
                              f"it holds {shown}); choose a new or empty train.run_dir")
    checkpoints = os.path.join(run_dir, "checkpoints")
    if "checkpoints" in names and not os.path.isdir(checkpoints):  # else found only at the first save
        raise ConfigError(f"train.run_dir={run_dir}: {checkpoints} is a file, not the checkpoints folder; move "
                          "it away (the run saves its steps there), or choose another train.run_dir")
    linked = sorted(n for n in os.listdir(checkpoints) if os.path.islink(os.path.join(checkpoints, n))) if (
        "checkpoints" in names) else []
    if linked:  # else Orbax fails to delete it as an old step, at a later save, with a message about that save
        path = os.path.join(checkpoints, linked[0])
        raise ConfigError(f"train.run_dir={run_dir}: {path} is a symbolic link (to {os.readlink(path)}); lumen_jax "
                          "deletes old steps and does not follow links: put the folder itself there (mv), or "
                          "remove the link")
    for name in names:
        path = os.path.join(run_dir, name)
        if (name in APPENDED or (name.startswith("library-") and name.endswith(".log"))) and os.path.islink(path):
            raise ConfigError(f"train.run_dir={run_dir}: {name} is a symbolic link (to {os.readlink(path)}); "
                              "lumen_jax appends to it and does not follow links: replace the link with a "
                              "regular file (or remove it), or choose another train.run_dir")


def prepare(run_dir: str) -> None:
    """Creates `run_dir` and checks that it takes a write; ConfigError naming the path otherwise."""
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise ConfigError(f"train.run_dir={run_dir} is a file, not a directory; choose another "
                          "train.run_dir or move the file away")
    refuse_foreign(run_dir)
    parent = os.path.dirname(os.path.abspath(run_dir))
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError(f"train.run_dir={run_dir}: {parent} is a file, not a directory; "
                          "choose another train.run_dir")
    created = not os.path.isdir(run_dir)
    try:
        os.makedirs(run_dir, exist_ok=True)
    except OSError as e:
        raise _fault(run_dir, run_dir, e) from None
    probe = os.path.join(run_dir, f".write-probe-{os.getpid()}")
    try:  # a read-only or full filesystem fails here, before anything compiles
        with open(probe, "wb") as f:
            f.write(b"\0" * 65536)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        _remove(probe)
        if created:  # leave no empty folder behind
            _remove(run_dir, os.rmdir)
        raise _fault(run_dir, run_dir, e) from None
    _remove(probe)


def claim(run_dir: str) -> Lock:
    """`prepare(run_dir)`, then its writer's lock (release it when the run ends); RunDirBusy naming the
    holder when another live trainer has it."""
    prepare(run_dir)
    lock = Lock(os.path.join(run_dir, LOCK))
    try:
        lock.acquire()
    except Busy as e:
        raise RunDirBusy(f"train.run_dir={run_dir} is in use by another trainer ({e}); wait for it to end or "
                         "stop it, or choose another train.run_dir") from None
    except OSError as e:
        raise _fault(run_dir, lock.path, e) from None
    if lock.note:
        print(f"warning: {lock.note}", file=sys.stderr, flush=True)
    return lock


@contextlib.contextmanager
def claimed(run_dir: str) -> Iterator[None]:
    """The block runs as the run directory's one writer: process 0 of the job checks, creates and locks
    it (`claim`) and every process raises the ConfigError process 0 met, so none of them waits for a
    process 0 that has left. The lock is given back when the block ends (and the folder removed if
    this claim created it and it is still empty)."""
    import jax

    from lumen_jax.runtime import distributed

    lock, error = None, None
    created = jax.process_index() == 0 and not os.path.isdir(run_dir)
    if jax.process_index() == 0:
        try:
            lock = claim(run_dir)
        except ConfigError as e:
            error = e
    if jax.process_count() > 1:
        told = distributed.gather_json(None if error is None else [str(error), isinstance(error, RunDirBusy)])[0]
        if told is not None and error is None:
            error = (RunDirBusy if told[1] else ConfigError)(told[0])
    if error is not None:
        raise error
    try:
        yield
    finally:
        if lock is not None:
            lock.release()
        if created:  # a run refused before it wrote anything leaves no empty folder
            _remove(run_dir, os.rmdir)


def _remove(path: str, how=os.remove) -> None:
    try:
        how(path)
    except OSError:
        pass
