"""Whole-object operations: list a glob, test existence, read a small object, write atomically.

`put_atomic` writes with one PUT (never a multipart upload): S3 and GCS make an object visible
only once its whole body has arrived, so a reader sees the previous object or the new one, never
a part. Checkpoints rely on that.
"""

from __future__ import annotations

import asyncio
import fnmatch
import re
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from .blob import open_blob
from .client import endpoint, policy, retrying, run, store
from .url import parse

_GLOB_CHARS = re.compile(r"[*?\[]")


def list_objects(prefix_url: str) -> list[tuple[str, int]]:
    """(URL, size) of every object whose key starts with the URL's key, sorted by key."""
    loc = parse(prefix_url)

    async def once() -> Any:
        from obstore import list as list_

        return await list_(store(loc), prefix=loc.key or None, chunk_size=1000).collect_async()

    rows = run(retrying(prefix_url, "listing objects", once), prefix_url)
    out = [(f"{loc.scheme}://{loc.bucket}/{r['path']}", int(r["size"])) for r in rows]
    return sorted(out)


def glob(pattern_url: str) -> list[str]:
    """Object URLs matching a glob (`*`, `?`, `[..]`; a `*` does not cross '/'), sorted."""
    loc = parse(pattern_url)
    m = _GLOB_CHARS.search(loc.key)
    literal = loc.key[:m.start()] if m else loc.key
    prefix = literal.rsplit("/", 1)[0] + "/" if "/" in literal else ""
    depth = loc.key.count("/")
    found = list_objects(f"{loc.scheme}://{loc.bucket}/{prefix}")
    out = []
    for url, _ in found:
        key = parse(url).key
        if key.count("/") == depth and fnmatch.fnmatchcase(key, loc.key):
            out.append(url)
    return out


def exists(url: str) -> bool:
    """True if an object is at `url` (404 -> False; other errors raise)."""
    from .errors import ObjectMissingError

    try:
        open_blob(url)
    except ObjectMissingError:
        return False
    return True


def read_object(url: str) -> bytes:
    """The whole object (for small ones: states, plans, indexes)."""
    return open_blob(url).read_all()


def put_atomic(url: str, data: bytes) -> None:
    """Writes `data` as the object at `url` with one PUT: all or nothing (see the module doc)."""
    loc = parse(url)
    emulator = endpoint("gs") if loc.scheme == "gs" else None

    async def once() -> Any:
        if emulator:  # fake-gcs-server has no path-style XML PUT: one JSON-API media upload,
            return await asyncio.to_thread(_emulator_upload, emulator, loc.bucket, loc.key, data)
        from obstore import put_async

        return await put_async(store(loc), loc.key, data, use_multipart=False)

    run(retrying(url, f"writing {len(data)} bytes (PUT)", once), url)


def _emulator_upload(endpoint: str, bucket: str, key: str, data: bytes) -> None:
    """A single-request upload (also atomic) to a GCS emulator's JSON API."""
    query = urllib.parse.urlencode({"uploadType": "media", "name": key})
    req = urllib.request.Request(f"{endpoint}/upload/storage/v1/b/{urllib.parse.quote(bucket)}/o?{query}",
                                 data=data, method="POST",
                                 headers={"Content-Type": "application/octet-stream"})
    try:
        urllib.request.urlopen(req, timeout=policy().timeout).close()  # the emulator
    except urllib.error.HTTPError as e:
        raise OSError(f"status {e.code}: {e.read()[:200]!r}") from None
