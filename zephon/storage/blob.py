"""One object (or local file), its version pinned when it is opened, read by byte ranges.

`open_blob(url)` asks the store once for the size and the version (S3/GCS ETag; for a local file
inode + size + mtime). Every later read sends If-Match with that ETag and checks the ETag of the
answer, so an object replaced under a running job is an `ObjectChangedError` naming the URL and
never bytes of two versions. A blob is a small frozen value: it pickles into worker processes
with its pin, so every process reads the same version.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from . import cache
from .client import STATS, adopt, retrying, run, settings, store
from .errors import ObjectChangedError, ObjectCorruptError, ObjectMissingError
from .ranges import plan_requests
from .retry import policy
from .url import is_remote, local_path, parse


@dataclass(frozen=True)
class Blob:
    """An object of a store (`url`) or a local file, pinned at `version`."""

    url: str
    size: int
    version: str
    #: The storage settings of the process that opened it (endpoint, credentials: see
    #: `client.settings`); a worker process that lacks them (a fork server started before they
    #: were set) adopts them. Never in a repr, a log or a state.
    settings: tuple[tuple[str, str], ...] = field(default=(), repr=False, compare=False)

    def read(self, offset: int, length: int) -> bytes:
        return self.read_ranges([(offset, length)])[0]

    def read_all(self) -> bytes:
        return self.read(0, self.size) if self.size else b""

    def read_ranges(self, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """The bytes of each (offset, length), in the order asked; fetched concurrently."""
        if is_remote(self.url):
            return read_blobs([(self, ranges)])[0]
        self.check(ranges)
        return _read_local(self, ranges)

    def check(self, ranges: Sequence[tuple[int, int]]) -> None:
        """Raises `ObjectCorruptError` for a range outside the object (a wrong index)."""
        bad = [(o, n) for o, n in ranges if o < 0 or n < 0 or o + n > self.size]
        if bad:
            o, n = bad[0]
            raise ObjectCorruptError(f"{self.url}: byte range [{o}, {o + n}) is outside the object "
                                     f"({self.size} bytes): its index is corrupt or belongs to "
                                     "another version. Rewrite or re-index it.")


def open_blob(url: str) -> Blob:
    """Pins the current version of `url` (HEAD for objects, stat for local files)."""
    if not is_remote(url):
        path = local_path(url)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise ObjectMissingError(f"{path}: no such file") from None
        return Blob(path, st.st_size, f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}")
    loc = parse(url)

    async def head() -> Any:
        from obstore import head_async

        return await head_async(store(loc), loc.key)

    meta = run(retrying(url, "reading its size and version (HEAD)", head), url)
    etag = meta.get("e_tag") or meta.get("version") or ""
    return Blob(url, int(meta["size"]), str(etag), settings())


def _read_local(blob: Blob, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
    fd = os.open(blob.url, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        if f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}" != blob.version:
            raise ObjectChangedError(f"{blob.url}: the file changed since it was opened (replaced "
                                     "or modified); reading stops rather than mix two versions.")
        out = [os.pread(fd, n, o) for o, n in ranges]
    finally:
        os.close(fd)
    short = [i for i, ((_, n), got) in enumerate(zip(ranges, out)) if len(got) != n]
    if short:
        o, n = ranges[short[0]]
        raise ObjectCorruptError(f"{blob.url}: short read at [{o}, {o + n})")
    return out


def read_blobs(items: Sequence[tuple[Blob, Sequence[tuple[int, int]]]],
               overfetch: float | None = None) -> list[list[bytes]]:
    """`blob.read_ranges(ranges)` for every (blob, ranges), all objects' requests in flight
    together (a read that touches several shards waits for one round of requests, not one per
    shard). Local files are read in place. `overfetch` overrides the policy's for this call
    (0: only touching ranges share a request)."""
    out: list[list[bytes] | None] = [None] * len(items)
    remote = []
    for i, (blob, ranges) in enumerate(items):
        if is_remote(blob.url):
            blob.check(ranges)
            adopt(blob.settings)
            remote.append(i)
        else:
            out[i] = blob.read_ranges(ranges)
    if remote:
        pol = policy()
        got = (_read_cached_many if pol.cache_bytes > 0 else _fetch_many)([items[i] for i in remote], overfetch)
        for i, data in zip(remote, got):
            out[i] = data
    return [o if o is not None else [] for o in out]


def _read_cached_many(items: Sequence[tuple[Blob, Sequence[tuple[int, int]]]],
                      overfetch: float | None = None) -> list[list[bytes]]:
    """Ranges from the local cache; the misses fetched together, then cached (cache.py)."""
    budget = policy().cache_bytes
    hits = [cache.lookup(blob.url, blob.version, ranges) for blob, ranges in items]
    missing = [[i for i, h in enumerate(found) if h is None] for found in hits]
    want = [[ranges[i] for i in miss] for (_, ranges), miss in zip(items, missing)]
    got = _fetch_many([(blob, w) for (blob, _), w in zip(items, want)], overfetch)
    out = []
    for (blob, _), found, miss, w, data in zip(items, hits, missing, want, got):
        if miss:
            cache.store(blob.url, blob.version, w, data, budget)
        for i, d in zip(miss, data):
            found[i] = d
        out.append([h if h is not None else b"" for h in found])
    return out


def _fetch_many(items: Sequence[tuple[Blob, Sequence[tuple[int, int]]]],
                overfetch: float | None = None) -> list[list[bytes]]:
    pol = policy()
    plans = []
    for _, ranges in items:
        wanted = [(o, n) for o, n in ranges if n > 0]
        plans.append(plan_requests(wanted, pol.merge_gap, pol.max_request,
                                   pol.overfetch if overfetch is None else overfetch))

    async def all_requests() -> list[list[bytes]]:
        groups = [asyncio.gather(*(_fetch(blob, s, e, pol) for s, e in reqs))
                  for (blob, _), (reqs, _) in zip(items, plans)]
        return [list(g) for g in await asyncio.gather(*groups)]

    fetched = run(all_requests(), items[0][0].url) if any(reqs for reqs, _ in plans) else \
        [[] for _ in items]
    return [_reassemble(ranges, where, data) for (_, ranges), (_, where), data in zip(items, plans, fetched)]


def _reassemble(ranges: Sequence[tuple[int, int]], where: list[tuple[int, int]],
                fetched: list[bytes]) -> list[bytes]:
    """Each range's bytes, in the order asked, cut from the requests that fetched them."""
    out: list[bytes] = []
    k = 0
    for _, n in ranges:
        if n == 0:
            out.append(b"")
            continue
        req, off = where[k]
        k += 1
        data = fetched[req]
        out.append(data if off == 0 and n == len(data) else data[off:off + n])
    return out


async def _fetch(blob: Blob, start: int, end: int, pol: Any) -> bytes:
    """Bytes [start, end) of the pinned version of `blob`, under the retry policy."""
    from obstore import get_async

    loc = parse(blob.url)

    async def once() -> bytes:
        opts: dict[str, Any] = {"range": (start, end)}
        if blob.version:
            opts["if_match"] = blob.version
        result = await get_async(store(loc), loc.key, options=opts)  # type: ignore[arg-type]
        got_tag = result.meta.get("e_tag")
        if blob.version and got_tag and got_tag != blob.version:
            raise ObjectChangedError(f"{blob.url}: the object was replaced (ETag {got_tag} is "
                                     f"not the pinned {blob.version}); reading stops rather "
                                     "than mix two versions. Restore the original object, "
                                     "or build a new source for the new data.")
        data = bytes(await result.bytes_async())
        if len(data) != end - start:
            raise ObjectCorruptError(f"{blob.url}: asked for bytes [{start}, {end}) and got "
                                     f"{len(data)} bytes (a short read): the object is shorter "
                                     "than its index says. Rewrite it.")
        STATS["bytes"] += len(data)
        return data

    return await retrying(blob.url, f"reading bytes [{start}, {end})", once, pol)


__all__ = ["Blob", "open_blob", "read_blobs"]
