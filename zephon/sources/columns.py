"""Records <-> columns: the one rule every layer stacks by.

Sources decode records (dicts) and stack them into columns, row operators (`zephon.Map`,
`FlatMap`) hand records to Python functions and stack what they return, and the Grain layer
stacks Grain's records (any pytree) at the end of a pipeline. All of them use this module, so a
field has the same dtype whichever layer produced it and whichever records one read, step or
rank happened to hold:

- **names**: nested dict keys are joined with '/' (`{'a': {'b': 1}}` -> `a/b`). With
  `tree=True` (Grain records) tuples and lists are nodes too, numbered by position, and a bare
  leaf is the field `VALUE`; `unflatten` inverts it (digit keys `0..n-1` become a tuple).
- **values** (`stack`): text (str, bytes, numpy's `np.str_`/`np.bytes_`, 0-d S/U arrays) is an
  object array of plain `str`/`bytes`; numbers and equal-shape numeric arrays stack into one
  ndarray (as `np.stack` does); anything else (ragged, mixed, None, objects) is an object array
  holding the values unchanged. Empty values stack only when they carry a dtype (numpy arrays):
  all-empty Python lists stay objects, since numpy would call them float64 and poison integer
  token streams.
- **records**: every record of a batch has the same fields (filling a missing one would change
  a dtype depending on which records were read); fields declared `ragged` are object arrays
  always, even when one read's rows agree in shape.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np

from zephon.errors import DecodeError

Columns = dict[str, np.ndarray]  # as zephon.sources.base.Columns (not imported: sources import this)

VALUE = "__value__"
"""Field name of a record that is a bare value rather than a dict or tuple (`tree=True`)."""

_STACKS = "biufcmM"  # dtype kinds that stack into one ndarray


def objects(values: Sequence[Any]) -> np.ndarray:
    """An object array holding `values` unchanged (never descends into list or array values)."""
    return np.fromiter(values, dtype=object, count=len(values))


def _is_text(v: Any) -> bool:
    return isinstance(v, (bytes, str)) or (isinstance(v, np.ndarray) and v.ndim == 0
                                           and v.dtype.kind in "SU")


def _plain_text(v: Any) -> str | bytes:
    """np.str_/np.bytes_/0-d S|U arrays -> str/bytes, so digests never see numpy's types."""
    if isinstance(v, np.ndarray):
        v = v.item()
    return str(v) if isinstance(v, str) else bytes(v)


def stack(values: Sequence[Any]) -> np.ndarray:
    """One column from one value per record (see the module doc for the rule)."""
    if not len(values):
        return objects(values)
    if all(_is_text(v) for v in values):
        if all(type(v) is str or type(v) is bytes for v in values):
            return objects(values)
        return objects([_plain_text(v) for v in values])
    try:
        arr = np.asarray(values)
    except (ValueError, TypeError):  # ragged nesting
        return objects(values)
    if arr.dtype.kind in _STACKS and arr.shape[:1] == (len(values),) and (
            arr.size or all(isinstance(v, np.ndarray) for v in values)):
        return arr
    return objects(values)


def flatten(record: Any, *, tree: bool = False) -> dict[str, Any]:
    """{field name: leaf} of one record: `{'a': {'b': 1}}` -> `{'a/b': 1}`.

    Without `tree` the record is a dict and its keys are taken as they come (source records:
    a JSON key is any string). With `tree` it is a Grain record (a pytree): tuples and lists
    are numbered by position, a bare value is `VALUE`, and what `unflatten` could not rebuild
    (empty containers, keys that are not non-empty str without '/') is refused.
    """
    if tree:
        out: dict[str, Any] = {}
        _flatten_tree(record, "", out)
        return out
    return _flatten_dict(record, "")


def _flatten_dict(row: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in row.items():
        if isinstance(value, Mapping):
            out.update(_flatten_dict(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _flatten_tree(x: Any, path: str, out: dict[str, Any]) -> None:
    if isinstance(x, Mapping):
        if not x:
            raise DecodeError(f"record field {path or '<root>'!r} is an empty dict; Zephon stacks "
                              "records into columns and needs at least one leaf per dict.")
        for k, v in x.items():
            if not isinstance(k, str) or "/" in k or not k:
                raise DecodeError(f"record key {k!r} under {path or '<root>'!r} must be a non-empty "
                                  "str without '/' (Zephon joins nested keys with '/').")
            _flatten_tree(v, f"{path}/{k}" if path else k, out)
    elif isinstance(x, (tuple, list)):
        if not x:
            raise DecodeError(f"record field {path or '<root>'!r} is an empty sequence; return at "
                              "least one value or drop the field.")
        for i, v in enumerate(x):
            _flatten_tree(v, f"{path}/{i}" if path else str(i), out)
    else:
        out[path or VALUE] = x


def _batch_record(i: int) -> str:
    return f"record {i} of a batch"


def to_columns(records: Sequence[Any], locate: Callable[[int], str] | None = None, ragged: Collection[str] = (),
               *, tree: bool = False, template: Mapping[str, np.ndarray] | None = None) -> Columns:
    """Stacks records into named columns (`flatten` each, then `stack` each field).

    `locate(i)` names record i in errors (a file and line, a source and record); `ragged` fields
    are object arrays always; with no records the result is `template`'s columns, empty.
    """
    if not records:
        return {k: v[:0] for k, v in (template or {}).items()}
    locate = locate or _batch_record
    if not tree:
        for i, r in enumerate(records):
            if not isinstance(r, Mapping):
                raise DecodeError(f"{locate(i)} is a {type(r).__name__}; a record is a dict of "
                                  "field name -> value.")
    flat = [flatten(r, tree=tree) for r in records]
    keys = list(flat[0])
    unknown = sorted(set(ragged) - set(keys))
    if unknown:
        raise DecodeError(f"{locate(0)}: ragged names {unknown}, which the record does not have "
                          f"(it has {sorted(keys)}); fix the names given to `ragged`.")
    for i, row in enumerate(flat):
        if row.keys() != flat[0].keys():
            raise DecodeError(f"{locate(i)}: has fields {sorted(row)} but {locate(0)} has "
                              f"{sorted(keys)}; every record must have the same fields.")
    return {k: objects([row[k] for row in flat]) if k in ragged else stack([row[k] for row in flat])
            for k in keys}


def to_records(cols: Mapping[str, np.ndarray]) -> list[dict[str, Any]]:
    """Columns -> one dict per row (flat field names, numpy values)."""
    n = len(next(iter(cols.values()))) if cols else 0
    return [{k: v[i] for k, v in cols.items()} for i in range(n)]


def unflatten(cols: Mapping[str, Any]) -> Any:
    """Flat names back to structure: '/' nests dicts, digit keys 0..n-1 make a tuple, a lone
    `VALUE` is the bare value (the inverse of `flatten(..., tree=True)`)."""
    if list(cols) == [VALUE]:
        return cols[VALUE]
    root: dict[str, Any] = {}
    for name, col in cols.items():
        node = root
        *parents, last = name.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = col

    def build(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        keys = list(node)
        if sorted(keys) == [str(i) for i in range(len(keys))]:
            return tuple(build(node[str(i)]) for i in range(len(keys)))
        return {k: build(v) for k, v in node.items()}

    return build(root)


__all__ = ["VALUE", "flatten", "objects", "stack", "to_columns", "to_records",
           "unflatten"]
