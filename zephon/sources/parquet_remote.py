"""Parquet objects read by byte ranges: pyarrow's reader over a pinned `BlobFile`.

pyarrow asks for the footer and then, per row group read, for each selected column chunk's
bytes; each request is a ranged GET under the storage policy. The parsed footer is kept per
(URL, ETag) in the process, so the threads and the reopenings of one source read it once.
"""

from __future__ import annotations

import threading
from typing import Any

from ..errors import SourceError
from ..storage import Blob
from ..storage.file import BlobFile

_footers: dict[tuple[str, str], Any] = {}
_lock = threading.Lock()


def open_ranged_parquet(blob: Blob, verify: bool) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    key = (blob.url, blob.version)
    with _lock:
        meta = _footers.get(key)
    try:
        f = pq.ParquetFile(BlobFile(blob), metadata=meta, page_checksum_verification=verify)
    except (pa.ArrowException, ValueError) as e:
        raise SourceError(f"Parquet object {blob.url!r} cannot be opened: {e}. It is truncated, "
                          "corrupt or not Parquet; rewrite it before reading.") from e
    if meta is None:
        with _lock:
            if len(_footers) > 4096:
                _footers.clear()
            _footers[key] = f.metadata
    return f
