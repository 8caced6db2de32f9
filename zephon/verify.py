"""Fingerprints: the proof that two runs saw identical data.

A lane digest hashes one lane's rows of one step (field name, dtype, shape, bytes). The step
fingerprint hashes the lane digests in lane order. Every rank digests only its own lanes, so a
step fingerprint needs no data gathered and is independent of the data-parallel degree by
construction. Comparing two runs names the first step, lane and field that differ.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np

from zephon.exec.loader import LocalBatch
from zephon.sources.base import Columns


def _hash_field(h: "hashlib._Hash", name: str, arr: np.ndarray) -> None:
    arr = np.asarray(arr)
    h.update(f"{name}|{arr.dtype.str}|{arr.shape}|".encode())
    if arr.dtype == object:
        for v in arr.ravel():
            b = v if isinstance(v, (bytes, bytearray)) else np.asarray(v).tobytes() if isinstance(
                v, np.ndarray) else repr(v).encode()
            h.update(len(b).to_bytes(8, "little"))
            h.update(b)
    else:
        h.update(np.ascontiguousarray(arr).tobytes())


def field_digest(name: str, arr: np.ndarray) -> str:
    h = hashlib.sha256()
    _hash_field(h, name, arr)
    return h.hexdigest()[:32]


def lane_digest(rows: Columns) -> str:
    """Digest of one lane's rows of one step."""
    h = hashlib.sha256()
    for name in sorted(rows):
        _hash_field(h, name, rows[name])
    return h.hexdigest()[:32]


def lane_digests(batch: LocalBatch) -> dict[int, str]:
    """{lane: digest} for the lanes this batch owns."""
    return {int(l): lane_digest({k: v[batch.lane_slice(i)] for k, v in batch.data.items()})
            for i, l in enumerate(batch.lanes)}


def step_fingerprint(digests: Mapping[int, str]) -> str:
    """Hash of every lane's digest in lane order (pass the union over all ranks)."""
    h = hashlib.sha256()
    for lane in sorted(digests):
        h.update(f"{lane}:{digests[lane]};".encode())
    return h.hexdigest()[:32]


def global_fingerprint(data: Columns, lanes: int) -> str:
    """Step fingerprint of a whole global batch held in one place (e.g. a gathered jax.Array)."""
    n = len(next(iter(data.values())))
    per = n // lanes
    return step_fingerprint({l: lane_digest({k: np.asarray(v)[l * per:(l + 1) * per] for k, v in data.items()})
                             for l in range(lanes)})


@dataclass(frozen=True)
class Mismatch:
    step: int
    lane: int | None
    field: str | None
    detail: str

    def __str__(self) -> str:
        where = f"step {self.step}" + (f", lane {self.lane}" if self.lane is not None else "") + (
            f", field {self.field!r}" if self.field else "")
        return f"first difference at {where}: {self.detail}"


def first_mismatch(a: Sequence[str], b: Sequence[str]) -> int | None:
    """Index of the first differing step fingerprint (or of a length difference)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def explain_mismatch(step: int, a: LocalBatch, b: LocalBatch) -> Mismatch:
    """Names the first lane and field where two runs' batches of `step` differ."""
    for i, lane in enumerate(a.lanes):
        j = int(np.flatnonzero(b.lanes == lane)[0]) if lane in b.lanes else None
        if j is None:
            continue
        for name in sorted(set(a.data) | set(b.data)):
            if name not in a.data or name not in b.data:
                return Mismatch(step, int(lane), name, "field present in only one run")
            x, y = a.data[name][a.lane_slice(i)], b.data[name][b.lane_slice(j)]
            if field_digest(name, x) != field_digest(name, y):
                return Mismatch(step, int(lane), name, f"dtype/shape {x.dtype}{x.shape} vs {y.dtype}{y.shape}")
    return Mismatch(step, None, None, "fingerprints differ but no owned lane differs")


def run_fingerprints(batches_per_rank: Sequence[Iterable[LocalBatch]], steps: int) -> list[str]:
    """Step fingerprints of `steps` steps from the loaders of all ranks of one configuration."""
    iters = [iter(b) for b in batches_per_rank]
    out = []
    for _ in range(steps):
        digests: dict[int, str] = {}
        for it in iters:
            digests.update(lane_digests(next(it)))
        out.append(step_fingerprint(digests))
    return out
