"""The run directory: checked and created before anything compiles, `config.json` written atomically.

Every problem with the directory itself (a file in its place, a file as its parent, a read-only or
full filesystem, no permission) is the environment's fault, not a bug: a ConfigError naming the path
and the cause (exit code 2), so a supervisor does not restart it.
"""

from __future__ import annotations

import errno
import json
import os
from typing import Any

from lumen_jax.config import ConfigError


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


def prepare(run_dir: str) -> None:
    """Creates `run_dir` and checks that it takes a write; ConfigError naming the path otherwise."""
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise ConfigError(f"train.run_dir={run_dir} is a file, not a directory; choose another "
                          "train.run_dir or move the file away")
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


def _remove(path: str, how=os.remove) -> None:
    try:
        how(path)
    except OSError:
        pass
