"""WebDataset tar shards as a random-access source.

A WebDataset shard is a plain tar whose members are named `<key>.<ext>` (`000123.jpg`,
`000123.txt`, `000123.json`, `000123.cls`); a sample is the group of members sharing a key
(the member's path up to the first dot of its file name, as webdataset splits it). Streams read
shards front to back; a random-access loader needs each member's byte range instead. So each
shard is scanned once for its tar headers — through the storage layer, so local paths, `s3://`
and `gs://` work alike — and the index (member names, offsets, sizes) is cached on disk by
(URL, version) (`zephon.storage.index_cache`), like JSONL line offsets: a host indexes a shard
version once, whatever the number of processes or runs.

Fields are the extensions (`jpg`, `txt`, ...) plus `__key__`; every sample must have every field
(given as `fields=` or taken from the first sample), or the source refuses it at construction,
naming the shard, the key and the missing member — before a training run reaches it. With
`missing="skip"` such samples are left out of the numbering instead (the same ones for every
reader, since the numbering is fixed at construction).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np

from ..errors import DecodeError, SourceError
from ..storage import Blob, open_blob
from ..storage.blob import read_blobs
from ..storage.index_cache import cached_arrays
from ..storage.url import is_remote
from .base import Columns, as_indices
from .parallel import map_files
from .paths import Paths, expand_paths

__all__ = ["WebDatasetSource", "split_key", "tar_members", "write_webdataset"]

log = logging.getLogger(__name__)

_BLOCK = 512
_SCAN = 8 << 20    # bytes fetched per request while scanning headers

#: Extensions decoded to values by default (others stay bytes): text -> str, class -> int64, json.
TEXT_EXTS = frozenset({"txt", "text", "caption"})
INT_EXTS = frozenset({"cls", "cls2", "index", "id"})
JSON_EXTS = frozenset({"json"})


def split_key(name: str) -> tuple[str, str]:
    """('dir/000123', 'jpg') from 'dir/000123.jpg'; the extension starts at the file name's first dot."""
    slash = name.rfind("/")
    dot = name.find(".", slash + 1)
    if dot < 0:
        return name, ""
    return name[:dot], name[dot + 1:]


def _octal(field: bytes) -> int:
    if field[:1] and field[0] & 0x80:   # GNU base-256 for sizes >= 8 GiB
        return int.from_bytes(field[1:], "big")
    text = field.split(b"\0", 1)[0].strip()
    return int(text, 8) if text else 0


def _checksum_ok(h: bytes) -> bool:
    try:
        want = _octal(h[148:156])
    except ValueError:
        return False
    b = np.frombuffer(h, np.uint8)
    return int(b.sum()) - int(b[148:156].sum()) + 8 * 32 == want


class _Reader:
    """Sequential-ish reads of a blob in large requests (headers hop forward through the tar)."""

    def __init__(self, blob: Blob) -> None:
        self.blob = blob
        self.start = 0
        self.buf = b""

    def read(self, offset: int, n: int) -> bytes:
        if not (self.start <= offset and offset + n <= self.start + len(self.buf)):
            size = max(n, min(_SCAN, self.blob.size - offset))
            size = min(size, self.blob.size - offset)
            self.start, self.buf = offset, self.blob.read(offset, size) if size > 0 else b""
        return self.buf[offset - self.start: offset - self.start + n]


def tar_members(blob: Blob) -> dict[str, np.ndarray]:
    """Regular members of a tar: {'names': U, 'offsets': int64 (of the data), 'sizes': int64}.

    Follows ustar, GNU long names ('L') and pax path records ('x'); anything else that is not a
    regular file (directories, links, global headers) is skipped."""
    r = _Reader(blob)
    names: list[str] = []
    offsets: list[int] = []
    sizes: list[int] = []
    pos = 0
    long_name: str | None = None
    while pos + _BLOCK <= blob.size:
        h = r.read(pos, _BLOCK)
        if len(h) < _BLOCK or h == b"\0" * _BLOCK:
            break
        if not _checksum_ok(h):
            raise SourceError(f"{blob.url}: no valid tar header at byte {pos} (checksum mismatch): "
                              "the file is not an uncompressed tar, or it is corrupt there. "
                              "WebDataset shards are plain .tar files.")
        size = _octal(h[124:136])
        kind = h[156:157]
        data = pos + _BLOCK
        if kind == b"L":
            long_name = r.read(data, size).split(b"\0", 1)[0].decode("utf-8", "replace")
        elif kind == b"x":
            for line in r.read(data, size).decode("utf-8", "replace").splitlines():
                _, _, kv = line.partition(" ")
                k, _, v = kv.partition("=")
                if k == "path":
                    long_name = v
        elif kind in (b"0", b"\0", b"7"):
            name = h[0:100].split(b"\0", 1)[0].decode("utf-8", "replace")
            if h[257:262] == b"ustar" and h[345:500].strip(b"\0"):
                name = h[345:500].split(b"\0", 1)[0].decode("utf-8", "replace") + "/" + name
            if long_name is not None:
                name, long_name = long_name, None
            if data + size > blob.size:
                raise SourceError(f"{blob.url}: tar member {name!r} needs bytes up to {data + size} "
                                  f"but the file has {blob.size}: the shard is truncated.")
            names.append(name)
            offsets.append(data)
            sizes.append(size)
        else:
            long_name = None
        pos = data + (size + _BLOCK - 1) // _BLOCK * _BLOCK
    return {"names": np.array(names, dtype=str) if names else np.empty(0, "U1"),
            "offsets": np.array(offsets, np.int64), "sizes": np.array(sizes, np.int64)}


def _index(blob: Blob) -> dict[str, np.ndarray]:
    return cached_arrays("wds-tar", blob.url, blob.version, lambda: tar_members(blob))


def _decode_value(ext: str, data: bytes) -> Any:
    last = ext.rsplit(".", 1)[-1]
    if last in TEXT_EXTS:
        return data.decode("utf-8")
    if last in INT_EXTS:
        return int(data.decode("ascii").strip())
    if last in JSON_EXTS:
        return json.loads(data)
    return data


class WebDatasetSource:
    """Samples of WebDataset tar shards (local paths, globs, `s3://`, `gs://`), random access.

    fields: the extensions every sample has (default: those of the first sample); columns are
        named by extension, plus `__key__` (the sample's key) .
    decode: turn `txt`/`text`/`caption` into str, `cls`/`cls2`/`index`/`id` into int64 and `json`
        into Python values (False: every field stays bytes); images always stay bytes — decode
        them with `zephon.media.DecodeImage`, a lane operator with an identity.
    missing: 'raise' (a sample without one of the fields is a `SourceError` naming the shard, key
        and member) or 'skip' (such samples are not numbered).
    exclude: samples left out of the numbering, as '<shard path>/<key>' (Energon's excludes).
    """

    def __init__(self, paths: Paths | Sequence[str], fields: Sequence[str] | None = None, *,
                 decode: bool = True, missing: str = "raise", exclude: Collection[str] = ()) -> None:
        if missing not in ("raise", "skip"):
            raise ValueError(f"WebDatasetSource: missing must be 'raise' or 'skip', got {missing!r}")
        self.paths = _expand(paths)
        self._blobs: list[Blob] = map_files(open_blob, self.paths)
        indexes = [_index(b) for b in self._blobs] if len(self._blobs) < 4 else \
            map_files(_index, self._blobs)  # type: ignore[arg-type]
        self.decode = bool(decode)
        keys_all, exts_all, shard_all, offs, sizes = [], [], [], [], []
        for s, ix in enumerate(indexes):
            pairs = [split_key(str(n)) for n in ix["names"]]
            keys_all += [k for k, _ in pairs]
            exts_all += [e for _, e in pairs]
            shard_all.append(np.full(len(pairs), s, np.int64))
            offs.append(ix["offsets"])
            sizes.append(ix["sizes"])
        if not keys_all:
            raise SourceError(f"WebDatasetSource: the shards {self.paths[:3]} hold no members")
        shard = np.concatenate(shard_all)
        offsets, lengths = np.concatenate(offs), np.concatenate(sizes)
        if fields is None:
            first = keys_all[0]
            fields = [e for k, e, s in zip(keys_all, exts_all, shard) if k == first and s == 0]
        self.fields = tuple(fields)
        if not self.fields or len(set(self.fields)) != len(self.fields):
            raise ValueError(f"WebDatasetSource: fields must be distinct extensions, got {self.fields!r}")
        # group members by (shard, key) in order of first appearance
        where: dict[tuple[int, str], int] = {}
        order: list[tuple[int, str]] = []
        col = {f: i for i, f in enumerate(self.fields)}
        table: list[list[int]] = []
        for m, (k, e, s) in enumerate(zip(keys_all, exts_all, shard.tolist())):
            j = where.get((s, k))
            if j is None:
                j = where[(s, k)] = len(order)
                order.append((s, k))
                table.append([-1] * len(self.fields))
            c = col.get(e)
            if c is not None:
                table[j][c] = m
        members = np.array(table, np.int64).reshape(len(order), len(self.fields))
        self._per_shard_all = np.bincount([o[0] for o in order], minlength=len(self.paths))
        if exclude:
            drop = {str(e) for e in exclude}
            out = np.array([f"{self.paths[s]}/{k}" in drop for s, k in order], bool)
            members[out] = np.iinfo(np.int64).max   # neither missing nor kept: left out silently
        bad = np.flatnonzero((members < 0).any(axis=1))
        excluded = (members == np.iinfo(np.int64).max).all(axis=1)
        if bad.size and missing == "raise":
            s, k = order[int(bad[0])]
            lack = [f for f, m in zip(self.fields, members[bad[0]]) if m < 0]
            raise SourceError(
                f"WebDatasetSource: shard {self.paths[s]!r}, sample {k!r} has no member "
                f"{k}.{lack[0]} (it lacks {lack}; every sample needs {list(self.fields)}; "
                f"{bad.size} of {len(order)} samples are incomplete). Fix the shard, pass "
                "fields= naming only the extensions every sample has, or missing='skip' to leave "
                "incomplete samples out.")
        keep = np.flatnonzero((members >= 0).all(axis=1) & ~excluded)
        if bad.size:
            log.warning("WebDatasetSource: %d of %d samples lack a field of %s and are left out",
                        bad.size, len(order), list(self.fields))
        self._members = members[keep]
        self._keys = np.array([order[i][1] for i in keep], dtype=object)
        self._shard = np.array([order[i][0] for i in keep], np.int64)
        self._offsets, self._lengths = offsets, lengths

    def __len__(self) -> int:
        return len(self._members)

    def samples_per_shard(self, include_excluded: bool = False) -> list[int]:
        """Samples numbered from each shard (or every key group, `include_excluded=True`)."""
        if include_excluded:
            return [int(n) for n in self._per_shard_all]
        return [int(n) for n in np.bincount(self._shard, minlength=len(self.paths))]

    def __repr__(self) -> str:
        return f"WebDatasetSource({len(self.paths)} shards, {len(self)} samples, fields={list(self.fields)})"

    def read(self, indices: np.ndarray) -> Columns:
        idx = as_indices(indices, len(self), repr(self))
        mem = self._members[idx]                       # [n, fields] member ids
        shard = self._shard[idx]
        flat = mem.ravel()
        flat_shard = np.repeat(shard, len(self.fields))
        got: list[bytes] = [b""] * flat.size
        shards = np.unique(flat_shard)
        items = []
        for s in shards.tolist():
            pos = np.flatnonzero(flat_shard == s)
            m = flat[pos]
            items.append((pos, self._blobs[s], list(zip(self._offsets[m].tolist(), self._lengths[m].tolist()))))
        datas = read_blobs([(b, r) for _, b, r in items])
        for (pos, _, _), data in zip(items, datas):
            for p, d in zip(pos.tolist(), data):
                got[p] = d
        out: Columns = {"__key__": self._keys[idx]}
        nf = len(self.fields)
        for c, f in enumerate(self.fields):
            vals = got[c::nf]
            if self.decode and f.rsplit(".", 1)[-1] in TEXT_EXTS | INT_EXTS | JSON_EXTS:
                try:
                    dec = [_decode_value(f, v) for v in vals]
                except (ValueError, UnicodeDecodeError) as e:
                    raise self._decode_error(idx, c, vals, e) from e
                if f.rsplit(".", 1)[-1] in INT_EXTS:
                    out[f] = np.array(dec, np.int64)
                    continue
                vals = dec
            arr = np.empty(len(vals), object)
            for i, v in enumerate(vals):   # element-wise: a JSON list must stay one value
                arr[i] = v
            out[f] = arr
        return out

    def _decode_error(self, idx: np.ndarray, c: int, vals: list[bytes], e: Exception) -> DecodeError:
        f = self.fields[c]
        for i, v in enumerate(vals):
            try:
                _decode_value(f, v)
            except (ValueError, UnicodeDecodeError) as err:
                r = int(idx[i])
                return DecodeError(f"WebDatasetSource: shard {self.paths[self._shard[r]]!r}, sample "
                                   f"{self._keys[r]!r}, member {self._keys[r]}.{f}: {err}. Fix the "
                                   "member, or pass decode=False to get bytes.")
        return DecodeError(f"WebDatasetSource: field {f!r}: {e}")


def _expand(paths: Paths | Sequence[str]) -> list[str]:
    items = [paths] if isinstance(paths, str) else list(paths)  # type: ignore[arg-type]
    if all(not is_remote(str(p)) for p in items):
        return expand_paths(paths, "WebDatasetSource")
    return [str(p) for p in items]


def write_webdataset(path: str, samples: Sequence[dict[str, Any]],
                     encode: Callable[[str, Any], bytes] | None = None) -> None:
    """Writes one tar shard: each sample a dict with '__key__' and {ext: bytes | str | int | dict}."""
    import io
    import tarfile

    def enc(ext: str, v: Any) -> bytes:
        if encode is not None:
            return encode(ext, v)
        if isinstance(v, (bytes, bytearray)):
            return bytes(v)
        if isinstance(v, str):
            return v.encode("utf-8")
        if isinstance(v, (int, np.integer)):
            return str(int(v)).encode()
        return json.dumps(v).encode("utf-8")

    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tf:
        for s in samples:
            key = s["__key__"]
            for ext, v in s.items():
                if ext == "__key__":
                    continue
                data = enc(ext, v)
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                info.mtime = 0
                tf.addfile(info, io.BytesIO(data))
