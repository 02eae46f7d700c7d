"""The repository's root, and its scripts (launch/, benchmarks/) imported as modules."""

import importlib.util
import os
import sys
import types

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_script(path: str, name: str | None = None) -> types.ModuleType:
    """The script `path` (relative to the repository, e.g. "launch/supervise.py"), imported afresh as
    module `name` (default: its file name without .py) and registered in sys.modules under it
    (dataclasses look their module up there)."""
    name = name or os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, path))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
