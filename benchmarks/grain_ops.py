"""Grain-side pieces of the benchmark, in their own module so worker processes can import them
(and so Zephon's cases never import Grain)."""

from __future__ import annotations

from typing import Sequence

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
