"""Parquet objects read by byte ranges: pyarrow's reader over a pinned `BlobFile`.

pyarrow asks for the footer (once: the source keeps each file's `FileMetaData` and passes it
back when it reopens a file) and then, per row group read, for each selected column chunk's
bytes; each is one ranged GET under the storage policy.
"""

from __future__ import annotations

from typing import Any

from ..errors import SourceError
from ..storage import Blob
from ..storage.file import BlobFile, Spans


def open_ranged_parquet(blob: Blob, verify: bool, metadata: Any = None, spans: Spans | None = None) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(BlobFile(blob, spans), metadata=metadata, page_checksum_verification=verify)
    except (pa.ArrowException, ValueError) as e:
        raise SourceError(f"Parquet object {blob.url!r} cannot be opened: {e}. It is truncated, "
                          "corrupt or not Parquet; rewrite it before reading.") from e
