"""Fingerprints: the proof that two runs saw identical data.

A lane digest hashes one lane's rows of one step (field name, dtype, shape, bytes). The step
fingerprint hashes the lane digests in lane order. Every rank digests only its own lanes, so a
step fingerprint needs no data gathered and is independent of the data-parallel degree by
construction. Comparing two runs names the first step, lane and field that differ.

Lane records keep, per lane of a step, its digest and every row's; `compare_steps` finds the first
differing row and `Divergence` names it. The report of a whole configuration matrix (`Report`,
`RunResult`, `write_heatmap`) is in `zephon.testing.report`.

Terms (docs/glossary.md): fingerprint.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from zephon.exec.loader import LocalBatch
from zephon.sources.base import Columns


def _hash_objects(h: Any, values: Iterable[Any]) -> None:
    """Hashes the values of an object array one by one: bytes as they are, arrays by their bytes,
    anything else by its repr; each prefixed with its length."""
    for v in values:
        b = v if isinstance(v, (bytes, bytearray)) else np.asarray(v).tobytes() if isinstance(
            v, np.ndarray) else repr(v).encode()
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)


def _hash_field(h: hashlib._Hash, name: str, arr: np.ndarray) -> None:
    arr = np.asarray(arr)
    h.update(f"{name}|{arr.dtype.str}|{arr.shape}|".encode())
    if arr.dtype == object:
        _hash_objects(h, arr.ravel())
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


# --- lane records: what a configuration run keeps of every step -------------------------------

def _field_desc(arr: np.ndarray) -> str:
    """dtype and per-row shape, e.g. 'int32(256,)'."""
    return f"{arr.dtype}{tuple(arr.shape[1:])}"


def row_digests(arr: np.ndarray) -> list[str]:
    """A short digest of every row of `arr` (its bytes; object rows value by value)."""
    arr = np.asarray(arr)
    out = []
    if arr.dtype == object:
        for row in arr:
            h = hashlib.blake2b(digest_size=8)
            _hash_objects(h, np.asarray(row, dtype=object).ravel() if isinstance(row, np.ndarray) else [row])
            out.append(h.hexdigest())
        return out
    flat = np.ascontiguousarray(arr).reshape(len(arr), -1).view(np.uint8) if arr.size else None
    for j in range(len(arr)):
        out.append(hashlib.blake2b(flat[j].tobytes() if flat is not None else b"",
                                   digest_size=8).hexdigest())
    return out


@dataclass(frozen=True)
class LaneRecord:
    """One lane's rows of one step: its lane digest and, per field, dtype/shape and row digests."""

    digest: str
    fields: Mapping[str, tuple[str, tuple[str, ...]]]

    @property
    def rows(self) -> int:
        return max((len(r) for _, r in self.fields.values()), default=0)

    def to_json(self) -> list[Any]:
        return [self.digest, {k: [d, list(r)] for k, (d, r) in self.fields.items()}]

    @staticmethod
    def from_json(obj: Sequence[Any]) -> LaneRecord:
        return LaneRecord(obj[0], {k: (d, tuple(r)) for k, (d, r) in obj[1].items()})


StepRecord = dict[int, LaneRecord]


def lane_records(lanes: Iterable[int], cols: Columns) -> StepRecord:
    """Records of every lane in `lanes` (ints, or an int array) from their rows `cols`
    (lane-major, equal rows per lane)."""
    ids = [int(l) for l in lanes]
    if not ids:
        return {}
    n = len(next(iter(cols.values()))) if cols else 0
    per = n // len(ids)
    out: StepRecord = {}
    for i, lane in enumerate(ids):
        rows = {k: np.asarray(v)[i * per:(i + 1) * per] for k, v in cols.items()}
        out[lane] = LaneRecord(lane_digest(rows), {k: (_field_desc(v), tuple(row_digests(v)))
                                                   for k, v in rows.items()})
    return out


def record_fingerprint(step: StepRecord) -> str:
    """The step fingerprint of a step's lane records (equal to `step_fingerprint` of its digests)."""
    return step_fingerprint({l: r.digest for l, r in step.items()})


@dataclass(frozen=True)
class Divergence:
    """Where a run first differs from the reference: step, lane, global row, field and why."""

    step: int
    lane: int | None = None
    row: int | None = None
    field: str | None = None
    detail: str = ""
    expected: str | None = None   # `explain` of the reference's row
    got: str | None = None        # `explain` of the run's row, when its emitter has provenance

    def where(self) -> str:
        parts = [f"step {self.step}"]
        if self.lane is not None:
            parts.append(f"lane {self.lane}")
        if self.row is not None:
            parts.append(f"row {self.row}")
        if self.field is not None:
            parts.append(f"field {self.field!r}")
        return ", ".join(parts)

    def __str__(self) -> str:
        out = f"first difference at {self.where()}" + (f": {self.detail}" if self.detail else "")
        if self.expected:
            out += f"\n    reference row: {self.expected}"
        if self.got:
            out += f"\n    this run's row: {self.got}"
        return out

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "lane": self.lane, "row": self.row, "field": self.field,
                "detail": self.detail, "expected": self.expected, "got": self.got}


def compare_steps(ref: StepRecord, got: StepRecord, ignore: frozenset[str] = frozenset()
                  ) -> tuple[int | None, int | None, str | None, str] | None:
    """(lane, row within lane, field, detail) of the first difference of one step, or None."""
    if set(ref) != set(got):
        odd = sorted(set(ref) ^ set(got))
        return (odd[0], None, None, f"lane {odd[0]} is in only one run (reference lanes "
                f"{_span(sorted(ref))}, this run {_span(sorted(got))}): another lane count")
    for lane in sorted(ref):
        a, b = ref[lane], got[lane]
        if a.digest == b.digest and not ignore:
            continue
        for name in sorted(set(a.fields) | set(b.fields)):
            if name in ignore:
                continue
            if name not in a.fields or name not in b.fields:
                return lane, None, name, ("field missing in this run" if name in a.fields
                                          else "field only in this run")
            (da, ra), (db, rb) = a.fields[name], b.fields[name]
            if da != db or len(ra) != len(rb):
                return lane, 0, name, f"dtype/shape {da} x {len(ra)} rows in the reference, {db} x {len(rb)} here"
            for j, (x, y) in enumerate(zip(ra, rb)):
                if x != y:
                    return lane, j, name, "values differ"
    return None


def _span(lanes: Sequence[int]) -> str:
    if lanes and list(lanes) == list(range(lanes[0], lanes[-1] + 1)) and len(lanes) > 3:
        return f"{lanes[0]}..{lanes[-1]}"
    return str(list(lanes))


def describe_row(entry: Mapping[str, Any]) -> str:
    """One line of `LocalBatch.explain()` for a report: lane and source/record/epoch, or the
    pieces (source, record, epoch, token range) a packed row holds."""
    head = f"lane {entry.get('lane')}"
    if "segments" in entry:
        segs = entry["segments"]
        shown = "; ".join(f"source {s['source']} record {s['record']} epoch {s['epoch']} tokens "
                          f"{s['tokens'][0]}:{s['tokens'][1]}" for s in segs[:4])
        more = f"; ... {len(segs) - 4} more" if len(segs) > 4 else ""
        return f"{head}, {len(segs)} piece(s): {shown}{more}"
    if "record" in entry:
        return f"{head}, source {entry['source']} record {entry['record']} epoch {entry['epoch']}"
    return head
