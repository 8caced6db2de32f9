"""Grain-side pieces of the benchmark, in their own module so worker processes can import them
(and so Zephon's cases never import Grain)."""

from __future__ import annotations

from collections.abc import Sequence

from absl import flags

flags.FLAGS.mark_as_parsed()  # grain reads absl flags; no absl main() runs in the benchmark

import grain  # noqa: E402
import numpy as np  # noqa: E402


class DecodeRecord(grain.transforms.Map):
    """Grain's usual per-record decode."""

    def map(self, record: bytes) -> np.ndarray:
        return np.frombuffer(record, dtype=np.int32)


def decode_batch(records: Sequence[bytes]) -> np.ndarray:
    """The decode Zephon's FixedFields does, as a Grain batch_fn: one frombuffer over the joined
    records of a batch."""
    return np.frombuffer(bytearray().join(records), dtype=np.int32).reshape(len(records), -1)


# --- the filter benchmark (bench_filter.py): the same predicate, Grain's ways -------------------
from bench_filter import HASH_COLUMN, keep_half  # noqa: E402


class KeepHalf(grain.transforms.Filter):
    """Per decoded record: `bench_filter.keep_half` for one row."""

    def filter(self, record: np.ndarray) -> bool:
        return not record[HASH_COLUMN] & 1


class KeepHalfBytes(grain.transforms.Filter):
    """Per raw record, before decoding: the low byte of little-endian int32 token 1."""

    def filter(self, record: bytes) -> bool:
        return not record[4 * HASH_COLUMN] & 1


def decode_filter_batch(records: Sequence[bytes]) -> np.ndarray:
    """batch_fn of the batched-filter configurations: one decode and one vectorised predicate
    over a chunk of records, returning the survivors (Zephon's batched Filter, in Grain)."""
    tokens = decode_batch(records)
    return tokens[keep_half({"tokens": tokens})]
