"""The lane operator contract: what runs inside every lane, and how it is named in a checkpoint.

A lane is a sequential stream of records. Operators come in two kinds:

- **Row operators** (`Transform`): pure functions of the rows they are given, vectorised over
  columns — map, random map, filter, flat map, tokenize. Their carry is empty, so any window of a
  lane's inputs can be processed by any thread or process in any order; the engine runs them in
  parallel over read-ahead windows. `apply(cols, refs, seed)` returns the new columns and which
  input row each output row came from (`None`: one to one; a bool mask: a filter; sorted int
  indices: a flat map).
- **Accumulators** (`Accumulator`): `(carry, inputs) -> (carry', outputs, inputs consumed)` — a
  packer is one. They run in lane order in the consumer. Their carry is small JSON that refers
  to the records it still holds (by position in the lane, never by value): after a restore the
  engine re-reads and re-processes just those records.

Every operator has an identity — a name, a version you bump when its behaviour changes, and a JSON
config — which a checkpoint records. A restore under a different identity is refused, naming the
operator and the field. A lambda or local function has no stable name: it works, but `state()`
refuses it with a message saying how to declare one (`Map(fn, name=..., version=...)`).

Terms (docs/glossary.md): operator, row operator, one-to-one, accumulator, carry, held, demand.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from zephon.errors import DecodeError, PlanError, StateError, deprecated_attribute
from zephon.plan import Refs
from zephon.plan.permute import splitmix64
from zephon.sources.base import Columns

Record = dict[str, Any]
JSON = Any


def fn_name(fn: Any) -> str:
    """The qualified name of a callable (what an operator is called when not named).

    Without the module: a script's functions live in `__main__` when it runs and under their
    module name when a test or a worker imports it, and a checkpoint must match both."""
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


def stable_name(name: str) -> bool:
    """Whether `name` identifies code across processes and restarts (no lambda, no closure)."""
    return "<lambda>" not in name and "<locals>" not in name


def check_json(what: str, value: Any) -> Any:
    try:
        json.dumps(value, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise PlanError(f"{what} must be JSON (numbers, strings, lists, dicts): {e}") from None
    return value


class Operator:
    """Identity shared by every lane operator: `op_name`, `version`, `config()`."""

    #: Bump when the operator's output for the same input changes.
    version: int = 1

    @property
    def op_name(self) -> str:
        """Stable name recorded in checkpoints (class name, plus the function's for wrappers)."""
        name = getattr(self, "name", None)
        if isinstance(name, str) and name:
            return name
        fn = getattr(self, "fn", None)
        return type(self).__name__ if fn is None else f"{type(self).__name__}({fn_name(fn)})"

    def config(self) -> dict[str, JSON]:
        """JSON parameters that change the output (seq_len, field names, ...)."""
        cfg = getattr(self, "params", None)
        return dict(cfg) if cfg else {}

    def identity(self) -> dict[str, JSON]:
        """What a checkpoint records; `checked_identity` refuses anonymous functions."""
        return {"name": self.op_name, "version": int(self.version), "config": self.config()}

    def checked_identity(self) -> dict[str, JSON]:
        ident = self.identity()
        if not stable_name(ident["name"]):
            raise StateError(
                f"operator {ident['name']} has no stable identity (a lambda or a function defined "
                "inside another), so a checkpoint could not tell whether it changed. Define the "
                "function at module level, or name it: "
                f"{type(self).__name__}(fn, name='my_op', version=1, params={{...}}).")
        check_json(f"config of operator {ident['name']}", ident["config"])
        return ident


def identity_diff(saved: Sequence[Mapping[str, Any]], mine: Sequence[Mapping[str, Any]]) -> list[str]:
    """Human-readable differences between two pipelines' identities (for refusing a restore)."""
    out: list[str] = []
    if len(saved) != len(mine):
        out.append(f"the checkpoint's pipeline has {len(saved)} operators "
                   f"({[s.get('name') for s in saved]}), this one {len(mine)} "
                   f"({[m.get('name') for m in mine]})")
    for i, (s, m) in enumerate(zip(saved, mine)):
        s = s if isinstance(s, Mapping) else {"name": s}
        if s.get("name") != m["name"]:
            out.append(f"operator {i}: name {s.get('name')!r} != {m['name']!r}")
            continue
        if s.get("version") != m["version"]:
            out.append(f"operator {i} ({m['name']}): version {s.get('version')!r} != {m['version']!r}")
        _config_diff(f"operator {i} ({m['name']}): config", "", s.get("config") or {}, m["config"] or {}, out)
    return out


def _config_diff(head: str, path: str, a: Any, b: Any, out: list[str]) -> None:
    """Names the differing leaves of two configs (nested: a per-source chain's tokenizer hash
    or EOS), each value cut short, rather than printing both configs whole."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        for k in sorted(set(a) | set(b), key=str):
            _config_diff(head, f"{path}.{k}" if path else str(k), a.get(k, "<absent>"), b.get(k, "<absent>"), out)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for j, (x, y) in enumerate(zip(a, b)):
            _config_diff(head, f"{path}[{j}]", x, y, out)
    elif a != b:
        out.append(f"{head} {path} {_short(a)} != {_short(b)}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# --- row operators ------------------------------------------------------------------------------
class Transform(Operator):
    """A row operator: pure, carry-free, vectorised. Subclasses implement `apply`.

    `apply(cols, refs, seed) -> (cols, rows)`: `rows` is None (output row i is input row i), a
    bool mask over the inputs (filter) or non-decreasing input row indices, one per output row
    (flat map: one record may give several outputs, or none).
    """

    #: Whether every input gives exactly one output (lets the loader keep O(1) random access).
    one_to_one: bool = True
    #: Whether an input may give more than one output (changes how a lane's position is written).
    expands: bool = False

    def apply(self, cols: Columns, refs: Refs, seed: int) -> tuple[Columns, np.ndarray | None]:
        raise NotImplementedError(f"{type(self).__name__} subclasses Transform but does not implement "
                                  "apply(cols, refs, seed) -> (cols, rows)")


def record_seeds(seed: int, refs: Refs) -> np.ndarray:
    """64-bit seeds derived from (seed, source, record, epoch) only."""
    h = splitmix64(np.uint64(seed & 0xFFFFFFFFFFFFFFFF))
    with np.errstate(over="ignore"):
        for part in (refs.source, refs.record, refs.epoch):
            h = splitmix64(h ^ part.astype(np.uint64))
    return np.broadcast_to(h, refs.record.shape)


def transform_seed(seed: int, position: int) -> int:
    """The seed of the transform at `position` in a pipeline seeded with `seed`."""
    mixed = splitmix64(np.uint64(seed & 0xFFFFFFFFFFFFFFFF) ^ splitmix64(np.uint64(position)))
    return int(mixed) & 0x7FFFFFFFFFFFFFFF


def record_rng(seed: int) -> np.random.Generator:
    return np.random.Generator(np.random.Philox(key=int(seed)))


def call_on_record(fn: Callable[..., Any], what: str, refs: Refs, i: int, *args: Any) -> Any:
    """Calls a per-record function; a failure names the record (nothing is skipped)."""
    try:
        return fn(*args)
    except Exception as e:
        raise DecodeError(f"{what} failed on record {int(refs.record[i])} of source "
                          f"{int(refs.source[i])} (epoch {int(refs.epoch[i])}): {e!r}. Fix the "
                          "transform or the record; nothing was skipped.") from e


def output_of(what: str, refs: Refs, rows: Sequence[int] | None = None) -> Callable[[int], str]:
    """Names output i of operator `what` by the record it came from (input `rows[i]`), for the
    errors of stacking outputs into columns (a Map that returned something other than a dict)."""
    def locate(i: int) -> str:
        j = i if rows is None else rows[i]
        return (f"{what}'s output for record {int(refs.record[j])} of source {int(refs.source[j])} "
                f"(epoch {int(refs.epoch[j])})")
    return locate


def output_rows(what: str, rows: Any, n_in: int) -> np.ndarray | None:
    """Validates a row operator's `rows` result -> None or sorted input indices."""
    if rows is None:
        return None
    rows = np.asarray(rows)
    if rows.dtype == bool:
        if rows.shape != (n_in,):
            raise PlanError(f"{what} returned a mask of shape {rows.shape}, expected ({n_in},)")
        return np.flatnonzero(rows)
    if rows.ndim != 1 or not np.issubdtype(rows.dtype, np.integer):
        raise PlanError(f"{what} returned rows of dtype {rows.dtype} and shape {rows.shape}; "
                        "return None, a bool mask over the inputs, or input row indices.")
    rows = rows.astype(np.int64, copy=False)
    if rows.size and (rows[0] < 0 or rows[-1] >= n_in or np.any(np.diff(rows) < 0)):
        raise PlanError(f"{what} returned input rows that are not sorted indices into its "
                        f"{n_in} inputs; a flat map must keep the inputs' order.")
    return rows


def run_transforms(transforms: Sequence[Transform], cols: Columns, refs: Refs,
                   seed: int) -> tuple[Columns, np.ndarray]:
    """Applies row operators in order; returns the output columns and each output's input row.

    Each operator gets its own seed, derived from (seed, its position in the pipeline), so two
    RandomMaps in one pipeline draw independent numbers for the same record.
    """
    src = np.arange(len(refs))
    for i, t in enumerate(transforms):
        n_in = len(refs)
        cols, raw = t.apply(cols, refs, transform_seed(seed, i))
        if not isinstance(cols, dict):
            raise PlanError(f"{t.op_name} returned {type(cols).__name__}; a batched operator returns "
                            "a dict {field: array} with one row per output.")
        rows = output_rows(t.op_name, raw, n_in)
        masked = raw is not None and np.asarray(raw).dtype == bool
        if rows is not None and (rows.size != n_in or np.any(rows != np.arange(n_in))):
            refs = refs.take(rows)
            src = src[rows]
            # a filter may return its input columns with the mask (Grain-style): select them
            if masked:
                cols = {k: v[rows] if len(v) == n_in else v for k, v in cols.items()}
        n = len(refs)
        for k, v in cols.items():
            if len(v) != n:
                raise PlanError(f"{t.op_name} returned column {k!r} with {len(v)} rows for {n} "
                                "outputs; a count-changing operator must say which input each "
                                "output came from (return a mask or input row indices).")
    return cols, src


def sub_index(src: np.ndarray) -> np.ndarray:
    """Rank of each output among the outputs of the same input (0 for one-to-one chains)."""
    if src.size == 0:
        return src.copy()
    first = np.searchsorted(src, src, side="left")
    return np.arange(len(src), dtype=np.int64) - first


# --- accumulators -------------------------------------------------------------------------------
@dataclass
class AccumulatorStep:
    """What an accumulator's `step` returns.

    outputs: the rows it emitted (at most `demand`; fewer means it needs more inputs).
    consumed: how many of the *new* inputs it used; the rest are offered again next call.
    hold: indices into `held + new[:consumed]` of the inputs it keeps for later (its carry refers
      to them by their position in `hold`).
    carry: small JSON (offsets, bins as lists of [hold index, start, stop], counters).
    segments: optional per output row provenance, a list of (input index, start, stop) tuples
      into `held + new` — what `Loader.explain` reports for packed rows.
    """

    outputs: Columns
    consumed: int
    hold: Sequence[int] = ()
    carry: JSON = None
    segments: list[list[tuple[int, int, int]]] | None = None


class Accumulator(Operator):
    """A stateful lane operator: `step(carry, held, new, demand) -> AccumulatorStep`.

    `held` are the inputs the previous call kept (`AccumulatorStep.hold`, re-materialised after a
    restore), `new` the next inputs of the lane, both as columns; `carry` the JSON it returned
    last (None at the start of a lane). It must be pure — the same arguments give the same
    `AccumulatorStep` — and emit at most `demand` rows. Example, pairing consecutive records::

        class Pairs(zephon.Accumulator):
            def step(self, carry, held, new, demand):
                x = np.concatenate([held["x"], new["x"]])
                n = min(len(x) // 2, demand)
                used = 2 * n - len(held["x"])           # new inputs in emitted pairs
                rest = len(x) - 2 * n
                keep = [2 * n] if rest and len(new["x"]) > used else []
                return zephon.AccumulatorStep({"a": x[0:2 * n:2], "b": x[1:2 * n:2]},
                                              consumed=used + len(keep), hold=keep)
    """

    #: True when the rows emitted do not depend on how the lane's inputs are cut into calls
    #: (`new` one input at a time or a hundred give the same rows): the engine may then call it
    #: with the inputs that have already arrived instead of waiting for a fixed number, so the
    #: first batch comes after the first windows, not after enough windows for that number.
    #: Leave it False unless that holds: the engine's fixed numbers keep the rest deterministic.
    streams: bool = False

    def step(self, carry: JSON, held: Columns, new: Columns, demand: int) -> AccumulatorStep:
        raise NotImplementedError(f"{type(self).__name__} subclasses Accumulator but does not "
                                  "implement step(carry, held, new, demand) -> AccumulatorStep")

    def finish(self, carry: JSON, held: Columns, new: Columns, demand: int) -> AccumulatorStep:
        """Like `step`, when `new` holds the lane's last inputs (a finite plan ends): emit what
        the carry still holds if it makes rows. Default: `step`."""
        return self.step(carry, held, new, demand)

    def check_carry(self, carry: JSON, held: Columns) -> None:
        """Raises ValueError naming what is wrong with a restored `carry` for these `held` inputs
        (a hand-edited or foreign state); the loader reports it with the lane. Default: any."""


#: Names kept for one version: old name -> (the object, what to use instead).
DEPRECATED: dict[str, tuple[Any, str]] = {
    "Step": (AccumulatorStep, "zephon.AccumulatorStep (what an accumulator's step() returns)"),
}


def __getattr__(name: str) -> Any:
    return deprecated_attribute(__name__, name, DEPRECATED)
