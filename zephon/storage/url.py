"""What a path names: a local file, or an object in a bucket (`s3://bucket/key`, `gs://bucket/key`).

Everything that takes a path in Zephon takes a URL too; this module is the one place that tells
them apart, so a local path keeps meaning exactly what it meant before object storage existed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

#: URL schemes read through an object-store client (everything else is a local path).
REMOTE_SCHEMES = ("s3", "gs")


@dataclass(frozen=True)
class ObjectURL:
    """`scheme://bucket/key`, split (key has no leading slash)."""

    scheme: str
    bucket: str
    key: str

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.key}"


def is_remote(path: str | os.PathLike[str]) -> bool:
    """True for `s3://...` and `gs://...` (a `file://` URL is local)."""
    return isinstance(path, str) and path.split("://", 1)[0] in REMOTE_SCHEMES and "://" in path


def local_path(path: str | os.PathLike[str]) -> str:
    """A local path as a string (`file:///x` -> `/x`); URLs of object stores pass unchanged."""
    name = os.fspath(path)
    return name[len("file://"):] if name.startswith("file://") else name


def parse(url: str) -> ObjectURL:
    """Splits an object URL; a URL without a bucket or a key is a ValueError naming it."""
    scheme, rest = url.split("://", 1)
    bucket, _, key = rest.partition("/")
    if scheme not in REMOTE_SCHEMES or not bucket:
        raise ValueError(f"{url!r} is not an object URL; write s3://bucket/key or gs://bucket/key")
    return ObjectURL(scheme, bucket, key)


def dirname(path: str) -> str:
    """The folder of a path or URL (for URLs: everything before the last '/')."""
    return path.rsplit("/", 1)[0] if is_remote(path) else os.path.dirname(path)
