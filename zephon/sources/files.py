"""Detects a file that changes under a running job.

A source records each file's identity (device, inode, size, modification time) when it opens the
set, and compares it after every read (one `os.stat` per file the read touched) and on every read
error. A file rewritten in place or replaced while a job reads it would otherwise give records
from two versions of the data, empty records (ArrayRecord's reader) or, memory-mapped, a SIGBUS
that kills the process; this turns all of them into a `SourceError` that names the file.

What it cannot see: a rewrite that keeps the inode, the size and the modification time (a tool
that restores the old mtime after writing in place, or a write within one timestamp tick of the
stamp on filesystems with coarse timestamps).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import SourceError
from ..storage.url import is_remote


@dataclass(frozen=True)
class FileStamp:
    dev: int
    ino: int
    size: int
    mtime_ns: int

    def describe(self) -> str:
        return f"inode {self.ino}, {self.size} bytes, mtime {self.mtime_ns / 1e9:.6f}"


#: What a URL's stamp is: objects are pinned by version in `zephon.storage` (If-Match on every
#: read), so the stat-based checks here do not apply to them.
REMOTE = FileStamp(-1, -1, -1, -1)


def stamp(path: str, kind: str) -> FileStamp:
    """The identity of `path` now (raises SourceError naming it if it cannot be stat'ed)."""
    if is_remote(path):
        return REMOTE
    try:
        st = os.stat(path)
    except OSError as e:
        raise SourceError(f"{kind}: cannot stat {path!r}: {e}") from e
    return FileStamp(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def changed(path: str, recorded: FileStamp, kind: str) -> SourceError | None:
    """A SourceError describing how `path` changed since `recorded`, or None if it did not."""
    if recorded == REMOTE:
        return None
    try:
        st = os.stat(path)
    except FileNotFoundError:
        now = "it no longer exists (deleted or renamed)"
    except OSError as e:
        now = f"it cannot be stat'ed any more ({e})"
    else:
        current = FileStamp(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if current == recorded:
            return None
        how = []
        if (current.dev, current.ino) != (recorded.dev, recorded.ino):
            how.append("it was replaced by another file")
        if current.size != recorded.size:
            how.append(f"its size went from {recorded.size} to {current.size} bytes")
        if current.mtime_ns != recorded.mtime_ns:
            how.append("it was modified")
        now = "; ".join(how)
    return SourceError(
        f"{path}: the file changed while {kind} was reading it ({now}; it was "
        f"{recorded.describe()} when the source opened it). Records read now could mix two "
        "versions of the data, so reading stops. Never rewrite a data file under a running job: "
        "restore the original file and resume from the last checkpoint, or, if the new data is "
        "intended, build a new source (a new plan) and start it from step 0.")


def check_unchanged(paths: list[str], stamps: list[FileStamp], files: list[int] | range,
                    kind: str) -> None:
    """Raises the SourceError of the first of `files` (indices) that changed since opening."""
    for i in files:
        err = changed(paths[i], stamps[i], kind)
        if err is not None:
            raise err
