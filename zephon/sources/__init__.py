"""Record sources: random-access, vectorised readers that return columns (see base.py)."""

from .array_record import ArrayRecordSource, write_array_record, write_sharded_array_record
from .base import Columns, RecordSource, as_indices
from .jsonl import JsonlSource
from .memory import ArraySource
from .parquet import ParquetSource, write_parquet
from .spec import Decoder, FixedFields, RawBytes, RecordSpec
from .tfds import TFDSSource

__all__ = [
    "ArrayRecordSource",
    "ArraySource",
    "Columns",
    "Decoder",
    "FixedFields",
    "JsonlSource",
    "ParquetSource",
    "RawBytes",
    "RecordSource",
    "RecordSpec",
    "TFDSSource",
    "as_indices",
    "write_array_record",
    "write_parquet",
    "write_sharded_array_record",
]
