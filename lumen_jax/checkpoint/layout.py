"""Where a run directory keeps its checkpoints, as Orbax writes them:

    <run_dir>/checkpoints/<step>/state/...       the arrays (an Orbax PyTree item)
    <run_dir>/checkpoints/<step>/meta/metadata   JSON: config, data position, checksums, state shapes

A step's folder is committed once Orbax renames it from `<step>.orbax-checkpoint-tmp-*`, after
writing its `_CHECKPOINT_METADATA` into it: a numbered folder without that file (an empty one a user
made, a copy cut short) is no step. Reading this layout needs no Orbax (resume.py decides on JSON alone).
"""

from __future__ import annotations

import os

STATE, META = "state", "meta"
COMMITTED = "_CHECKPOINT_METADATA"  # written by Orbax's finalize, before the rename that commits a step


def checkpoints_dir(run_dir: str) -> str:
    """`<run_dir>/checkpoints`, absolute."""
    return os.path.join(os.path.abspath(run_dir), "checkpoints")


def committed_steps(checkpoint_dir: str, item: str | None = None) -> list[int]:
    """The steps whose folder Orbax committed (renamed from its temporary name), ascending.

    `item`: only steps whose folder holds that item (`STATE`: the arrays are there)."""
    try:
        names = os.listdir(checkpoint_dir)
    except OSError:
        return []
    return sorted(int(n) for n in names if n.isdigit() and os.path.isfile(os.path.join(checkpoint_dir, n, COMMITTED))
                  and os.path.isdir(os.path.join(checkpoint_dir, n, *((item,) if item else ()))))


def item_dir(checkpoint_dir: str, step: int, item: str) -> str:
    """`<checkpoint_dir>/<step>/<item>`."""
    return os.path.join(checkpoint_dir, str(step), item)


def meta_path(checkpoint_dir: str, step: int) -> str:
    """`<checkpoint_dir>/<step>/meta/metadata`: the JSON a save writes beside the arrays."""
    return os.path.join(item_dir(checkpoint_dir, step, META), "metadata")
