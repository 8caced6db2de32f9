"""Packing tokenized documents into fixed-length rows, as a lane accumulator.

Three modes, all deterministic and all losing no token:

- `concat` (concat-then-split): the lane's documents are laid end to end and cut every
  `seq_len` tokens; a document crossing a row boundary continues in the next row of the same
  lane — also across steps and across a stop/resume, because the carry names it (its position in
  the lane and a token offset). No padding except at the end of a finite plan.
- `first_fit` / `best_fit`: up to `max_open_bins` rows are open; each document goes into the
  first (or the tightest) open row it fits, else a new row opens; when all are taken the oldest
  open row is emitted (so no document waits long). Documents longer than `seq_len` are split
  into full rows plus a remainder that is packed like any document (never dropped, never
  truncated).

Rows come with `targets` (the next token of the same document; a document's last token has no
target and `loss_mask` 0, so nothing leaks across documents), `segment_ids` (1, 2, ... per row,
0 for padding), `positions` (0-based within each segment of the row), `loss_mask` and
`cu_seqlens` (segment boundaries of the row, padded with its number of real tokens). With
`names="maxtext"` the fields are `inputs`, `targets`, `inputs_segmentation`,
`targets_segmentation`, `inputs_position`, `targets_position` (Grain's and MaxText's names).

**Per-token fields.** Every other column whose rows are sequences of the token column's length
(a loss or response mask, per-token weights, image-token positions...) is packed with the tokens:
cut with its document, padded with 0, under its own name. A column that is not one value per
token is refused, naming it — packing never drops a field silently; `drop=` names the ones to
leave out. The column `mask` (default `loss_mask`), if the records carry it, says which tokens
are trained: the emitted `loss_mask` at a position is 1 only if its target is in the same
document *and* the record's mask is non-zero at that target token (the mask marks the tokens to
be predicted, so it shifts with the targets).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from zephon.errors import PlanError
from zephon.ops.base import Accumulator, AccumulatorStep
from zephon.sources.base import Columns

Mode = Literal["concat", "first_fit", "best_fit"]
Segment = tuple[int, int, int]  # (queue index, start, stop)


@dataclass(frozen=True)
class Pack(Accumulator):
    """Packs column `field` (token arrays) into rows of `seq_len`; see the module doc.

    Args:
      seq_len: tokens per row.
      mode: 'concat', 'first_fit' or 'best_fit'.
      field: the token column (what `Tokenize` writes).
      max_open_bins: open rows of first_fit/best_fit (bounds the carry).
      pad_id: id of padding tokens (and of targets with no next token).
      max_segments: width of `cu_seqlens` minus one (default `seq_len`, always enough); with a
        smaller value, first_fit/best_fit close a row that has that many segments.
      names: 'zephon' or 'maxtext' field names.
      dtype: integer dtype of the emitted arrays.
      mask: the records' per-token mask of trained tokens (non-zero: trained), if they carry it;
        combined into `loss_mask` (see the module doc). None: no record mask.
      drop: columns of the records not to emit (per-record values packing cannot place in rows).
    """

    streams = True  # each mode places documents one at a time, however they are cut into calls

    seq_len: int
    mode: Mode = "concat"
    field: str = "tokens"
    max_open_bins: int = 8
    pad_id: int = 0
    max_segments: int | None = None
    names: Literal["zephon", "maxtext"] = "zephon"
    dtype: str = "int32"
    mask: str | None = "loss_mask"
    drop: tuple[str, ...] = ()
    #: 2: per-token fields are packed (or refused) and the record mask shapes loss_mask; version
    #: 1 dropped every column but the tokens.
    version = 2

    def __post_init__(self) -> None:
        if isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int) or self.seq_len < 2:
            raise PlanError(f"Pack.seq_len must be an integer >= 2, got {self.seq_len!r}")
        if self.mode not in ("concat", "first_fit", "best_fit"):
            raise PlanError(f"Pack.mode must be 'concat', 'first_fit' or 'best_fit', got {self.mode!r}")
        if not isinstance(self.max_open_bins, int) or self.max_open_bins < 1:
            raise PlanError(f"Pack.max_open_bins must be a positive integer, got {self.max_open_bins!r}")
        if self.max_segments is not None and (not isinstance(self.max_segments, int) or self.max_segments < 1):
            raise PlanError(f"Pack.max_segments must be a positive integer, got {self.max_segments!r}")
        if self.mode == "concat" and self.max_segments is not None:
            raise PlanError("Pack(mode='concat') cuts rows every seq_len tokens whatever they hold; "
                            "max_segments applies to first_fit/best_fit only.")
        if self.names not in ("zephon", "maxtext"):
            raise PlanError(f"Pack.names must be 'zephon' or 'maxtext', got {self.names!r}")
        if isinstance(self.drop, str) or not all(isinstance(d, str) for d in self.drop):
            raise PlanError(f"Pack.drop must be a tuple of column names, got {self.drop!r}")
        object.__setattr__(self, "drop", tuple(self.drop))
        if self.mask is not None and (self.mask == self.field or self.mask in self.drop):
            raise PlanError(f"Pack.mask {self.mask!r} is the token column or dropped; name the "
                            "records' per-token mask column, or mask=None.")

    def config(self) -> dict[str, Any]:
        return {"seq_len": self.seq_len, "mode": self.mode, "field": self.field,
                "max_open_bins": self.max_open_bins, "pad_id": self.pad_id,
                "max_segments": self.max_segments, "names": self.names, "dtype": self.dtype,
                "mask": self.mask, "drop": list(self.drop)}

    def check_carry(self, carry: Any, held: Columns) -> None:
        docs = list(held.get(self.field, ())) if held else []
        n = len(docs)

        def seg(v: Any, what: str) -> tuple[int, int]:
            if (not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in v)):
                raise ValueError(f"{what} {v!r} is not a list of integers")
            if not v or not 0 <= v[0] < n:
                raise ValueError(f"{what} {v!r} names held input {v[0] if v else '?'} of {n}")
            return v[0], len(docs[v[0]])

        if self.mode == "concat":
            if n == 0:
                if carry is not None:
                    raise ValueError(f"carry {carry!r} with no held input (expected null)")
                return
            if n != 1 or not isinstance(carry, dict) or set(carry) != {"offset"}:
                raise ValueError(f"concat packing holds one input with carry {{'offset': k}}; got "
                                 f"{n} held and carry {carry!r}")
            off = carry["offset"]
            if isinstance(off, bool) or not isinstance(off, int) or not 0 < off < len(docs[0]):
                raise ValueError(f"carry offset {off!r} is not inside the held document "
                                 f"(1..{len(docs[0]) - 1})")
            return
        if carry is None:
            if n:
                raise ValueError(f"{n} held inputs but no carry naming them")
            return
        if not isinstance(carry, dict) or set(carry) != {"bins", "pending"} or not isinstance(carry["bins"], list):
            raise ValueError(f"fit packing's carry is {{'bins': [...], 'pending': ...}}; got {carry!r}")
        used: set[int] = set()
        for b in carry["bins"]:
            if not isinstance(b, list) or not b:
                raise ValueError(f"bin {b!r} is not a non-empty list of [input, start, stop]")
            total = 0
            for triple in b:
                if not isinstance(triple, list) or len(triple) != 3:
                    raise ValueError(f"bin segment {triple!r} is not [input, start, stop]")
                q, size = seg(triple, "bin segment")
                if not 0 <= triple[1] < triple[2] <= size:
                    raise ValueError(f"bin segment {triple!r} is outside its document of {size} tokens")
                total += triple[2] - triple[1]
                used.add(q)
            if total > self.seq_len:
                raise ValueError(f"bin {b!r} holds {total} tokens, more than seq_len {self.seq_len}")
        if len(carry["bins"]) > self.max_open_bins:
            raise ValueError(f"{len(carry['bins'])} open bins, more than max_open_bins {self.max_open_bins}")
        p = carry["pending"]
        if p is not None:
            if not isinstance(p, list) or len(p) != 2:
                raise ValueError(f"pending {p!r} is not [input, offset]")
            q, size = seg(p, "pending")
            if not 0 < p[1] < size:
                raise ValueError(f"pending offset {p[1]!r} is not inside its document of {size} tokens")
            used.add(q)
        if used != set(range(n)):
            raise ValueError(f"the carry names held inputs {sorted(used)}, but {n} are held")

    # --- the operator ------------------------------------------------------------------------
    def step(self, carry: Any, held: Columns, new: Columns, demand: int) -> AccumulatorStep:
        return self._step(carry, held, new, demand, final=False)

    def finish(self, carry: Any, held: Columns, new: Columns, demand: int) -> AccumulatorStep:
        """The lane's inputs ended (a finite plan): the last partial row and every open row are
        emitted, padded, so no token is lost at the end either."""
        return self._step(carry, held, new, demand, final=True)

    def _step(self, carry: Any, held: Columns, new: Columns, demand: int, final: bool) -> AccumulatorStep:
        if (held and self.field not in held) or (new and self.field not in new):
            have = sorted(held or new)
            raise PlanError(f"Pack reads token column {self.field!r}, but the rows have {have}; "
                            "tokenize first or set Pack(field=...).")
        docs = list(held.get(self.field, ())) + list(new.get(self.field, ()))
        h = len(held.get(self.field, ())) if held else 0
        extra = self._per_token(held, new, docs, h)
        if self.mode == "concat":
            rows, consumed, hold, carry = self._concat(carry, docs, h, demand, final)
        else:
            rows, consumed, hold, carry = self._fit(carry, docs, h, demand, final)
        return AccumulatorStep(self._emit(docs, rows, extra), consumed, hold, carry, rows)

    def _per_token(self, held: Columns, new: Columns, docs: list[np.ndarray], h: int
                   ) -> dict[str, list[np.ndarray]]:
        """The per-token columns of the queue (held + new), each checked against the tokens.

        Held rows were checked when they were new; only new rows are checked here."""
        names = sorted((set(held or ()) | set(new or ())) - {self.field} - set(self.drop))
        clash = [k for k in names if k in _OUTPUTS[self.names] and k != self.mask]
        if clash:
            raise PlanError(f"Pack emits {clash[0]!r} itself, and the records carry a column of "
                            f"that name; rename it before packing or name it in Pack(drop=...).")
        out: dict[str, list[np.ndarray]] = {}
        for k in names:
            old = list(held.get(k, ())) if held else []
            vals = list(new.get(k, ())) if new else []
            for v, d in zip(vals, docs[h:]):
                if not (type(v) is np.ndarray and v.ndim == 1 and len(v) == len(d)) and (
                        np.ndim(v) != 1 or len(v) != len(d)):
                    got = (f"a {np.asarray(v).dtype} value of shape {np.shape(v)}" if np.ndim(v) != 1
                           else f"{len(v)} values")
                    raise PlanError(
                        f"Pack: column {k!r} is not one value per token of {self.field!r} (a new "
                        f"input has {got} for {len(d)} tokens), so it cannot be packed with them and "
                        f"would be lost. Make it per token, or leave it out: Pack(drop=({k!r},)).")
            out[k] = old + vals
        return out

    def _concat(self, carry: Any, docs: list[np.ndarray], h: int, demand: int, final: bool
                ) -> tuple[list[list[Segment]], int, list[int], Any]:
        L = self.seq_len
        offset = int(carry["offset"]) if h and carry else 0
        rows: list[list[Segment]] = []
        cur: list[Segment] = []
        room = L
        q, o = 0, offset
        while q < len(docs) and len(rows) < demand:
            n = len(docs[q])
            take = min(room, n - o)
            if take > 0:
                cur.append((q, o, o + take))
            o += take
            room -= take
            if room == 0:
                rows.append(cur)
                cur, room = [], L
            if o >= n:
                q, o = q + 1, 0
        if cur and final and len(rows) < demand:  # the end: the last row, padded
            rows.append(cur)
            cur = []
        # the documents of an unfinished row are offered again next time, with more after them
        if cur:
            q, o = cur[0][0], cur[0][1]
        if q < len(docs) and o > 0:  # a document continues into the next row: hold it
            consumed = q + 1 - h
            return rows, consumed, [q], {"offset": o}
        return rows, q - h if q >= h else 0, [], None

    def _fit(self, carry: Any, docs: list[np.ndarray], h: int, demand: int, final: bool
             ) -> tuple[list[list[Segment]], int, list[int], Any]:
        L = self.seq_len
        cap = self.max_segments or L
        # segments stay as the carry holds them ([input, start, stop] lists): only read here
        bins: list[list[Segment]] = [list(b) for b in carry["bins"]] if carry else []
        pending = (carry or {}).get("pending")
        rows: list[list[Segment]] = []
        used = [sum([x[2] for x in b]) - sum([x[1] for x in b]) for b in bins]
        capped = self.max_segments is not None
        first = self.mode == "first_fit"
        q, o = (pending[0], pending[1]) if pending else (h, 0)
        while q < len(docs) and len(rows) < demand:
            n = len(docs[q])
            if n - o > L:  # a full row of one long document
                rows.append([(q, o, o + L)])
                o += L
                continue
            size = n - o
            if size <= 0:
                q, o = q + 1, 0
                continue
            i, room, top = -1, L - size, -1
            for j, u in enumerate(used):  # first fit: the first open row with room; best fit:
                if top < u <= room and (not capped or len(bins[j]) < cap):  # the fullest, the
                    i, top = j, u  # first of equals (an uncapped row has < seq_len segments)
                    if first:
                        break
            if i >= 0:
                pass
            elif len(bins) < self.max_open_bins:
                bins.append([])
                used.append(0)
                i = len(bins) - 1
            else:  # all rows taken: the oldest is emitted to make room (bounds how long a
                rows.append(bins.pop(0))  # document waits: at most max_open_bins evictions)
                used.pop(0)
                continue
            bins[i].append((q, o, n))
            used[i] += size
            if used[i] == L or len(bins[i]) >= cap:
                rows.append(bins.pop(i))
                used.pop(i)
            q, o = q + 1, 0
        while final and q >= len(docs) and bins and len(rows) < demand:  # the end: open rows out
            rows.append(bins.pop(0))
            used.pop(0)
        referenced = sorted({s[0] for b in bins for s in b} | ({q} if o > 0 and q < len(docs) else set()))
        slot = {d: k for k, d in enumerate(referenced)}
        pending_carry = [slot[q], o] if o > 0 and q < len(docs) else None
        new_carry = ({"bins": [[[slot[d], s, e] for d, s, e in b] for b in bins], "pending": pending_carry}
                     if bins or pending_carry is not None else None)
        consumed = max(0, (q + (1 if o > 0 and q < len(docs) else 0)) - h)
        # the next call's queue puts held documents first, in this order: `slot` is their index
        # there, and the pending document (the latest) comes last, just before the new ones
        return rows, consumed, referenced, new_carry

    # --- rows ----------------------------------------------------------------------------------
    def _emit(self, docs: list[np.ndarray], rows: list[list[Segment]],
              extra: dict[str, list[np.ndarray]]) -> Columns:
        L, R = self.seq_len, len(rows)
        dt = np.dtype(self.dtype)
        record_mask = extra.get(self.mask) if self.mask is not None else None
        if self.mask in _OUTPUTS[self.names]:  # combined into loss_mask, not emitted twice
            extra = {k: v for k, v in extra.items() if k != self.mask}
        fields = {k: np.zeros((R, L), np.result_type(*[np.asarray(v).dtype for v in vs]) if vs else dt)
                  for k, vs in extra.items()}
        width = (self.max_segments or L) + 1
        tokens = np.full((R, L), self.pad_id, dt)
        targets = np.full((R, L), self.pad_id, dt)
        seg = np.zeros((R, L), dt)
        pos = np.zeros((R, L), dt)
        mask = np.zeros((R, L), dt)
        cu = np.zeros((R, width), dt)
        count = np.arange(L + 1)
        # per segment: slice copies (memcpy speed); a gather per token is slower at these lengths
        for r, row in enumerate(rows):
            at = 0
            tok_r, tgt_r, seg_r, pos_r, mask_r = tokens[r], targets[r], seg[r], pos[r], mask[r]
            for k, (q, s, e) in enumerate(row):
                d = docs[q]
                n = e - s
                tok_r[at:at + n] = d[s:e]
                m = min(e + 1, len(d)) - s - 1  # targets in the same document
                tgt_r[at:at + m] = d[s + 1:s + 1 + m]
                mask_r[at:at + m] = 1 if record_mask is None else np.asarray(record_mask[q][s + 1:s + 1 + m]) != 0
                for name, f in fields.items():
                    f[r, at:at + n] = extra[name][q][s:e]
                seg_r[at:at + n] = k + 1
                pos_r[at:at + n] = count[:n]
                at += n
                cu[r, k + 1] = at
            cu[r, len(row) + 1:] = at
        if self.names == "maxtext":
            return {**fields, "inputs": tokens, "targets": targets, "inputs_segmentation": seg,
                    "targets_segmentation": seg * mask, "inputs_position": pos,
                    "targets_position": pos}
        return {**fields, "tokens": tokens, "targets": targets, "segment_ids": seg, "positions": pos,
                "loss_mask": mask, "cu_seqlens": cu}


#: the fields each naming emits (a record column of one of these names would be overwritten)
_OUTPUTS = {"zephon": frozenset({"tokens", "targets", "segment_ids", "positions", "loss_mask", "cu_seqlens"}),
            "maxtext": frozenset({"inputs", "targets", "inputs_segmentation", "targets_segmentation",
                                  "inputs_position", "targets_position"})}


def padding(batch: Columns) -> float:
    """Fraction of padding tokens in packed rows (segment id 0)."""
    seg = batch.get("segment_ids", batch.get("inputs_segmentation"))
    if seg is None:
        raise PlanError("padding() needs packed rows (segment_ids or inputs_segmentation)")
    return float((np.asarray(seg) == 0).mean())
