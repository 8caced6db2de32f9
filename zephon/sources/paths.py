"""Turns the ways people name a file set into an explicit, verified list of files.

Sources resolve their files once, at construction, so a missing shard fails before training starts
instead of at the step that first touches it, and so the record numbering (files in this order,
records in file order) is fixed for the life of the source.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Sequence

from ..errors import SourceError
from ..storage import url as _url

PathArg = str | os.PathLike[str]
Paths = PathArg | Sequence[PathArg]

_AT_SHARDS = re.compile(r"^(?P<prefix>.+)@(?P<count>\d+)$")
_SHARD_NAME = re.compile(r"^(?P<prefix>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})$")
_GLOB_CHARS = re.compile(r"[*?\[]")


def shard_name(prefix: str, index: int, count: int) -> str:
    """The `prefix-00000-of-00004` convention shared by ArrayRecord, TFDS and Grain."""
    return f"{prefix}-{index:05d}-of-{count:05d}"


def expand_paths(paths: Paths, kind: str) -> list[str]:
    """Resolves `paths` to existing files, in record order.

    One path may be a plain file, a glob (sorted), `prefix@N`, or one shard name
    `prefix-00000-of-0000N`; the last two mean the whole set of N shards, which is how TFDS and
    Grain name a dataset. In a list, shard names are taken literally so a caller can pick a
    subset; globs and `@N` still expand.
    """
    if isinstance(paths, (str, os.PathLike)):
        return _expand_one(_url.local_path(paths), kind, whole_set=True)
    if isinstance(paths, Sequence) and not isinstance(paths, bytes):
        if not paths:
            raise SourceError(f"{kind}: got an empty list of paths; pass at least one file.")
        return [f for p in paths for f in _expand_one(_url.local_path(p), kind, whole_set=False)]
    raise TypeError(f"{kind}: paths must be a path or a list of paths, got {type(paths).__name__}")


def _expand_one(path: str, kind: str, whole_set: bool) -> list[str]:
    if m := _AT_SHARDS.match(path):
        return _shard_set(path, m["prefix"], int(m["count"]), kind)
    if whole_set and (m := _SHARD_NAME.match(path)):
        return _shard_set(path, m["prefix"], int(m["count"]), kind)
    if _GLOB_CHARS.search(path):
        files = _glob(path)
        if not files:
            raise SourceError(f"{kind}: no file matches the pattern {path!r}; check the directory "
                              "and the pattern (globs use *, ? and [..]).")
        return files
    if not _isfile(path):
        raise SourceError(f"{kind}: file {path!r} does not exist (or is not a regular file); "
                          "expected an existing file, a glob, 'name@N' or 'name-00000-of-0000N'.")
    return [path]


def _shard_set(pattern: str, prefix: str, count: int, kind: str) -> list[str]:
    if count < 1:
        raise SourceError(f"{kind}: {pattern!r} names {count} shards; a shard set needs >= 1.")
    files = [shard_name(prefix, i, count) for i in range(count)]
    if _url.is_remote(prefix):  # one listing instead of a request per shard
        present = set(_glob(f"{prefix}-?????-of-{count:05d}"))
        missing = [f for f in files if f not in present]
    else:
        missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        shown = ", ".join(missing[:3]) + more
        raise SourceError(f"{kind}: shard set {pattern!r} is incomplete: {len(missing)} of {count} "
                          f"shards are missing ({shown}). Expected files {files[0]!r} .. "
                          f"{files[-1]!r}; re-run the writer or fix the shard count.")
    return files


def _glob(pattern: str) -> list[str]:
    """Files (or objects) matching `pattern`, sorted."""
    if _url.is_remote(pattern):
        from ..storage import glob as glob_objects

        return glob_objects(pattern)
    return sorted(f for f in glob.glob(pattern) if os.path.isfile(f))


def _isfile(path: str) -> bool:
    if _url.is_remote(path):
        from ..storage import exists

        return exists(path)
    return os.path.isfile(path)
