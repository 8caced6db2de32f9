"""Indexes built from a whole object (a JSONL file's line offsets), kept on local disk by
(URL, version), so a source over the same object version is indexed once per host, not once
per process or per run.

Entries are numpy `.npz` files (never pickles), written to a temp file and renamed into place, so
processes of one host share them safely; an entry that fails to load is rebuilt. The directory
is `$ZEPHON_CACHE_DIR/index` (default `~/.cache/zephon/index`). Nothing remote is ever modified.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
from collections.abc import Callable

import numpy as np

log = logging.getLogger(__name__)


def cache_dir() -> str:
    root = os.environ.get("ZEPHON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "zephon")
    return os.path.join(root, "index")


def cached_arrays(kind: str, url: str, version: str,
                  build: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The arrays `build()` returns for (kind, url, version), from the disk cache when present."""
    digest = hashlib.sha256(f"{kind}\0{url}\0{version}".encode()).hexdigest()[:32]
    path = os.path.join(cache_dir(), f"{kind}-{digest}.npz")
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as e:
        log.warning("index cache entry %s is unreadable (%s); rebuilding it", path, e)
    arrays = build()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)  # type: ignore[arg-type]
        os.replace(tmp, path)
    except OSError as e:  # a read-only home: work without the cache
        log.warning("cannot write the index cache %s (%s); set ZEPHON_CACHE_DIR", path, e)
    return arrays
