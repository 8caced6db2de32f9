"""JSON Lines objects: the line-offset index built once per (URL, version) and cached on disk,
then lines fetched by byte range (a read's lines in one concurrent batch of requests)."""

from __future__ import annotations

import numpy as np

from ..storage import Blob
from ..storage.index_cache import cached_arrays

_SCAN = 16 << 20  # bytes a request scans for newlines
_SCAN_AHEAD = 4  # such requests in flight while indexing


def remote_line_spans(blob: Blob) -> tuple[np.ndarray, np.ndarray]:
    """Byte [start, end) of every non-empty line of the object (see jsonl._line_spans)."""

    def build() -> dict[str, np.ndarray]:
        newlines = []
        offsets = list(range(0, blob.size, _SCAN))
        for i in range(0, len(offsets), _SCAN_AHEAD):
            group = offsets[i:i + _SCAN_AHEAD]
            parts = blob.read_ranges([(o, min(_SCAN, blob.size - o)) for o in group])
            for o, data in zip(group, parts):
                newlines.append(np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == ord("\n")) + o)
        ends = np.concatenate([*newlines, np.array([blob.size], dtype=np.int64)]).astype(np.int64)
        starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
        keep = ends > starts
        return {"starts": starts[keep], "ends": ends[keep]}

    arrays = cached_arrays("jsonl-lines", blob.url, blob.version, build)
    return arrays["starts"], arrays["ends"]


def head(blob: Blob, n: int = 4096) -> bytes:
    """The first bytes of the object (to name a file that is not JSON Lines)."""
    return blob.read(0, min(n, blob.size))
