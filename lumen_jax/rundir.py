"""The run directory: checked and created before anything compiles, `config.json` written atomically.

Every problem with the directory itself (a file in its place, a file as its parent, a read-only or
full filesystem, no permission) is the environment's fault, not a bug: a ConfigError naming the path
and the cause (exit code 2), so a supervisor does not restart it.
"""

from __future__ import annotations

import json
import os
from typing import Any

from lumen_jax.config import ConfigError


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
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise _fault(run_dir, path, e) from None
