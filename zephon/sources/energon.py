"""Megatron-Energon prepared data sets (`energon prepare`): the `.nv-meta/` folder's shard list,
split and sample counts, read as a `WebDatasetSource`.

An Energon data set is WebDataset tar shards plus `.nv-meta/`: `.info.json` (older: `.info.yaml`)
maps every shard, relative to the data set's root, to its sample count; `split.yaml` (or
`split.json`) lists each split's shards as brace patterns (`parts/data-{000..009}.tar`) and an
`exclude` list of shards or single samples (`parts/data-003.tar/000123`). Energon's own index
(`.tar.idx` files or its SQLite index) is not needed: Zephon builds and caches its own member index
per shard version, and checks each shard's sample count against `.info.json`, so a shard that
changed since `prepare` is named rather than read with the wrong numbering.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from typing import Any

from ..errors import SourceError
from ..storage import open_blob
from ..storage.url import is_remote
from .webdataset import WebDatasetSource

__all__ = ["braces", "energon_source", "energon_split"]

META = ".nv-meta"


def braces(pattern: str) -> list[str]:
    """Brace expansion as Energon (and webdataset) use it: `{a,b}` alternatives and `{000..009}`
    numeric ranges (zero padding kept), nested and repeated, left to right."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if m is None:
        return [pattern]
    head, tail, body = pattern[:m.start()], pattern[m.end():], m.group(1)
    rng = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if rng:
        a, b = rng.group(1), rng.group(2)
        width = len(a) if a.startswith("0") or len(a) == len(b) else 0
        step = 1 if int(b) >= int(a) else -1
        items = [str(i).zfill(width) for i in range(int(a), int(b) + step, step)]
    else:
        items = body.split(",")
    return [x for item in items for x in braces(head + item + tail)]


def _read(path: str) -> str | None:
    try:
        if is_remote(path):
            return open_blob(path).read_all().decode("utf-8")
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (FileNotFoundError, OSError):
        return None


def _load(root: str, names: Sequence[str]) -> tuple[str, Any]:
    for name in names:
        path = f"{root.rstrip('/')}/{META}/{name}"
        text = _read(path)
        if text is not None:
            if name.endswith(".json"):
                return path, json.loads(text)
            import yaml
            return path, yaml.safe_load(text)
    raise SourceError(f"{root}: no {META}/{names[0]} (nor {', '.join(names[1:])}): not a data set "
                      "prepared by `energon prepare`. Run it, or read the shards with WebDatasetSource.")


def energon_split(root: str | os.PathLike[str], split: str = "train") -> tuple[list[str], dict[str, int], set[str]]:
    """(shard paths of `split` in order, {shard path: sample count}, excluded 'shard/key' samples)."""
    root = os.fspath(root)
    _, info = _load(root, [".info.json", ".info.yaml"])
    where, splits = _load(root, ["split.yaml", "split.json"])
    parts = (splits or {}).get("split_parts") or {}
    if split not in parts:
        raise SourceError(f"{where}: no split {split!r} (it has {sorted(parts)})")
    excluded = {e for pat in (splits.get("exclude") or []) for e in braces(pat)}
    names = [n for pat in parts[split] for n in braces(pat) if n not in excluded]
    if not names:
        raise SourceError(f"{where}: split {split!r} has no shards left after its excludes")
    counts = (info or {}).get("shard_counts") or {}
    missing = [n for n in names if n not in counts]
    if missing:
        raise SourceError(f"{root}/{META}: shard {missing[0]!r} of split {split!r} has no count in the "
                          "info file; re-run `energon prepare`.")
    join = (lambda n: f"{root.rstrip('/')}/{n}") if is_remote(root) else (lambda n: os.path.join(root, n))
    samples = {e for e in excluded if any(e.startswith(n + "/") for n in names)}
    return [join(n) for n in names], {join(n): int(counts[n]) for n in names}, \
        {join(e) for e in samples}


def energon_source(root: str | os.PathLike[str], split: str = "train", fields: Sequence[str] | None = None,
                   *, decode: bool = True) -> WebDatasetSource:
    """A `WebDatasetSource` over an Energon data set's split, its excluded samples left out and
    every shard's sample count checked against `.nv-meta`."""
    shards, counts, excluded = energon_split(root, split)
    src = WebDatasetSource(shards, fields, decode=decode, exclude=excluded)
    got = src.samples_per_shard(include_excluded=True)
    for path, n in zip(shards, got):
        if n != counts[path]:
            raise SourceError(f"{path}: {n} samples, but {META} says {counts[path]}: the shard changed "
                              "since `energon prepare` (or was prepared with other key rules); "
                              "re-run prepare.")
    return src
