"""One writer per folder: an exclusive `flock` on a lock file inside it, with the holder written in it.

A run directory (train) and a prepared dataset's `--out` (data.prepare) each take one for as long as
they write. The kernel drops a `flock` when its holder dies (SIGKILL, a crash, a lost node's process
on a local filesystem), so a stale lock never blocks a restart; the file itself only says who held it
last (host, pid, start time). A clean release deletes the file; a killed holder leaves it behind
and the next holder overwrites it.

Deleting the file while others may be opening it is safe: a holder checks, after its `flock`
succeeds, that the path still names the file it locked (else it locked a deleted file and tries again).
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
from typing import Any

# Filesystems without flock (some network mounts): the lock is not taken, and `Lock.note` says so.
_UNSUPPORTED = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL})


class Busy(Exception):
    """Another live process holds the lock; str(): who (host, pid, start time)."""


def _holder_text(raw: bytes) -> str:
    try:
        h = json.loads(raw.decode("utf-8"))
        who = f"host {h['host']}, pid {h['pid']}, started {h['started']}"
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return "another process (it has not written its name yet)"
    if h["host"] == socket.gethostname() and not _alive(h["pid"]):
        who += ", which has exited: a process it started still holds the lock (e.g. a data worker); stop it"
    return who


def _alive(pid: Any) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError, OverflowError):
        return True
    return True


class Lock:
    """An exclusive lock on `path`, taken by `acquire()`, given back by `release()` (or the process's end)."""

    def __init__(self, path: str):
        self.path = path
        self.fd: int | None = None
        self.note = ""  # why no lock was taken, when the filesystem has none

    def acquire(self) -> "Lock":
        """Takes the lock; raises Busy naming the holder, or OSError when the file cannot be made."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raw = os.pread(fd, 4096, 0)
                os.close(fd)
                raise Busy(_holder_text(raw)) from None
            except OSError as e:
                os.close(fd)
                if e.errno not in _UNSUPPORTED:
                    raise
                self.note = f"{self.path}: this filesystem has no file locks ({e.strerror}); a second writer is not refused"
                return self
            try:
                same = os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the holder before us deleted the file we locked: lock the new one
        self.fd = fd
        holder = {"host": socket.gethostname(), "pid": os.getpid(),
                  "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        return self

    def release(self) -> None:
        """Deletes the file, then unlocks it (safe to call twice, or without a lock)."""
        if self.fd is None:
            return
        try:
            os.remove(self.path)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> "Lock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
