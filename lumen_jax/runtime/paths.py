"""Names that a metadata file gives (a prepared dataset's shards, a Hugging Face index's weight files,
a model directory's tokenizer): each must name a regular file inside the folder that holds it, so
that a crafted name (`../elsewhere/x`, `/etc/passwd`, a link to a private file) reads nothing else.
"""

from __future__ import annotations

import os
import stat
from typing import Sequence


def escape(folder: str, name: object, roots: Sequence[str] = ()) -> str | None:
    """Why `name` does not name a regular file inside `folder`, or None when it does (or is missing).

    Args:
      folder: the folder whose metadata gives `name`.
      name: the name as read (any JSON value).
      roots: other folders a link in `folder` may point into (a Hugging Face cache snapshot's files
        are links into the cache's `blobs/`).

    Returns:
      A phrase to follow the name in an error ("is an absolute path", ...), or None.
    """
    if not isinstance(name, str) or not name.strip():
        return "is not a file name"
    if os.path.isabs(name):
        return "is an absolute path, not a name inside the folder"
    if ".." in name.replace("\\", "/").split("/"):
        return "leaves the folder (`..`)"
    real = os.path.realpath(os.path.join(folder, name))
    allowed = [os.path.realpath(folder), *(os.path.realpath(r) for r in roots)]
    if not any(real.startswith(os.path.join(r, "")) for r in allowed):
        return f"is a link to {real}, outside {folder}"
    try:
        mode = os.stat(real).st_mode
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    return None if stat.S_ISREG(mode) else "is not a regular file"
