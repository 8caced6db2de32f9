"""Packing in a Grain-shaped pipeline: Grain's packer arguments -> Zephon's `Pack`.

`Dataset.pack` (and the `experimental` packing datasets built on it) translate Grain's
`length_struct`/`padding_struct`/bin arguments into one `zephon.ops.pack.Pack(seq_len, mode)`
that runs in every lane of Zephon's lane engine. `PackInput` hands it each record's token
sequence (refusing records whose packed features are not copies of one another, MaxText's
layout), and `GrainPackNames` renames its output to Grain's packer layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from zephon.errors import DecodeError, PlanError
from zephon.ops.pack import Pack
from zephon.plan import Refs
from zephon.sources.base import Columns
from zephon.sources.columns import VALUE, flatten

from .records import RECORD
from .transforms import GrainTransform


def _pack_fields(length_struct: Any) -> tuple[tuple[str, ...], int]:
    """Grain's `length_struct` -> (packed feature names, seq_len)."""
    def length(v: Any, where: str) -> int:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 2:
            raise PlanError(f"length_struct{where} must be an integer sequence length >= 2, got {v!r}")
        return int(v)

    if isinstance(length_struct, Mapping):
        if not length_struct:
            raise PlanError("length_struct is empty; give {feature: seq_len} of the token feature")
        lens = {}
        for k, v in length_struct.items():
            if not isinstance(k, str) or not k:
                raise PlanError(f"length_struct keys are feature names (str), got {k!r}")
            if isinstance(v, Mapping):
                raise PlanError(f"length_struct[{k!r}] is nested; Zephon packs flat features "
                                "(top-level dict keys of the records).")
            lens[k] = length(v, f"[{k!r}]")
        if len(set(lens.values())) > 1:
            raise PlanError(f"length_struct gives different lengths {lens}; Zephon packs one token "
                            "sequence per document into rows of one seq_len (targets are derived "
                            "from it), so every packed feature has the same length.")
        return tuple(lens), next(iter(lens.values()))
    return (VALUE,), length(length_struct, "")



def pack_step(length_struct: Any, mode: str, *, num_packing_bins: int, padding_struct: Any,
              max_sequences_per_bin: int | None, names: str) -> tuple[Pack, tuple[str, ...]]:
    """Grain's packer arguments -> (the `Pack` every lane runs, the packed feature names)."""
    fields, seq_len = _pack_fields(length_struct)
    if names not in ("maxtext", "grain", "zephon"):
        raise PlanError(f"names must be 'maxtext', 'grain' or 'zephon', got {names!r}")
    pad = 0
    if padding_struct is not None:
        vals = ({padding_struct[k] for k in fields if k in padding_struct}
                if isinstance(padding_struct, Mapping) else {padding_struct})
        if len(vals) > 1 or any(isinstance(v, bool) or not isinstance(v, (int, np.integer))
                                for v in vals):
            raise PlanError(f"padding_struct {padding_struct!r}: Zephon pads every packed "
                            "feature with one integer id; give the same id for each.")
        pad = int(next(iter(vals))) if vals else 0
    fit = mode != "concat"
    pack = Pack(seq_len, mode, field=fields[0],  # type: ignore[arg-type]
                max_open_bins=int(num_packing_bins) if fit else 8, pad_id=pad,
                max_segments=max_sequences_per_bin if fit else None,
                names="zephon" if names == "grain" else names)  # type: ignore[arg-type]
    return pack, fields


@dataclass(frozen=True)
class _FieldsOp(GrainTransform):
    """A transform over the packed features `fields` (named in its identity)."""

    fields: tuple[str, ...]
    label: ClassVar[str] = ""

    @property
    def name(self) -> str:
        return f"grain.{self.label}({','.join(self.fields)})"

    def config(self) -> dict[str, Any]:
        return {"fields": list(self.fields)}


@dataclass(frozen=True)
class PackInput(_FieldsOp):
    """The documents a packing step packs: feature `fields[0]` of each record as a 1-D token
    array (a scalar is a length-1 sequence, as in Grain), in an object column of that name.

    Further features of `length_struct` (MaxText's `targets` copy of `inputs`) must hold the
    same tokens: Zephon packs one sequence per document and derives next-token targets from
    it, so a record whose features differ is refused, naming it. Other fields are dropped
    (packing emits only its own fields, as Grain's packers do without meta features) — except
    with `keep` (a `zephon.ops.pack.Pack` given to `map()`): rows that are already columns (a
    Zephon operator such as `Chat` made them) keep every field, so `Pack` packs their per-token
    fields (a loss mask) or refuses them, naming them, as it does under `zephon.Loader`.
    """

    label = "PackInput"
    keep: bool = False

    def config(self) -> dict[str, Any]:
        return {**super().config(), **({"keep": True} if self.keep else {})}

    def _tokens(self, v: Any, refs: Refs, i: int, key: str) -> np.ndarray:
        a = np.asarray(v)
        if a.ndim > 1 or a.dtype.kind not in "iub":
            raise DecodeError(f"record {int(refs.record[i])} of source {int(refs.source[i])}: feature "
                              f"{key!r} is {a.dtype}{list(a.shape)}, not a 1-D sequence of token ids; "
                              "packing needs integer token sequences (tokenize first).")
        return a.reshape(-1)

    def apply(self, cols: Columns, refs: Refs, seed: int) -> tuple[Columns, None]:
        key = self.fields[0]
        if self.keep and RECORD not in cols and key in cols:
            toks = np.empty(len(cols[key]), dtype=object)
            for i, v in enumerate(cols[key]):
                toks[i] = self._tokens(v, refs, i, key)
            return {**cols, key: toks}, None
        if not len(refs):
            return {key: np.empty(0, dtype=object)}, None
        if RECORD in cols:
            rows = [flatten(r, tree=True) for r in cols[RECORD]]
        else:
            rows = [{k: cols[k][i] for k in self.fields if k in cols} for i in range(len(refs))]
        out = np.empty(len(rows), dtype=object)
        for i, r in enumerate(rows):
            missing = [k for k in self.fields if k not in r]
            if missing:
                raise DecodeError(f"record {int(refs.record[i])} of source {int(refs.source[i])} has no "
                                  f"feature {missing[0]!r} to pack (it has {sorted(r)}); length_struct "
                                  "names the token features of the records.")
            toks = self._tokens(r[key], refs, i, key)
            for other in self.fields[1:]:
                if not np.array_equal(self._tokens(r[other], refs, i, other), toks):
                    raise DecodeError(
                        f"record {int(refs.record[i])} of source {int(refs.source[i])}: packed feature "
                        f"{other!r} differs from {key!r}. Zephon packs one token sequence per document "
                        "and derives next-token targets from it, so the features of length_struct "
                        f"must be copies of one another (MaxText's layout); pack {key!r} alone "
                        f"(length_struct={{{key!r}: seq_len}}).")
            out[i] = toks
        return {key: out}, None


@dataclass(frozen=True)
class GrainPackNames(_FieldsOp):
    """Grain's packer output layout from `Pack(names="zephon")` rows: for every feature `k` of
    `length_struct`, `k` (the packed tokens, not shifted), `k_segment_ids` and `k_positions`
    (int32, 0 on padding) — what `grain.experimental` packers emit for copies of one sequence."""

    label = "PackNames"

    def apply(self, cols: Columns, refs: Refs, seed: int) -> tuple[Columns, None]:
        out: Columns = {}
        for k in self.fields:
            out[k] = cols["tokens"]
        for k in self.fields:
            out[f"{k}_segment_ids"] = cols["segment_ids"]
            out[f"{k}_positions"] = cols["positions"]
        return out, None
