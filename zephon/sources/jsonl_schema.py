"""The field types of a JSON Lines schema: what a value's kind is, what holds two kinds, how a
line's value is checked against its field's kind, and what to tell the user when it is not.

JSON has no schema, so `JsonlSource` fixes one and holds every line to it; these are the rules,
apart from the files and lines they are applied to. Element types of a list are counted in C
(`list.count` over the types), so checking a long token list costs no Python call per element.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping
from typing import Any

#: Field types of a JSONL schema. "float" accepts JSON integers too (1 for 1.0); "list" accepts
#: any list; "any" accepts anything, null included, and always gives an object column.
KINDS = ("int", "float", "bool", "str", "list[int]", "list[float]", "list[bool]", "list[str]",
         "list", "any")
_SCALAR = {bool: "bool", int: "int", float: "float", str: "str"}


def _is_float(x: Any) -> bool:
    return type(x) is float or type(x) is int


_ELEMENT: dict[str, Callable[[Any], bool]] = {
    "int": lambda x: type(x) is int,
    "float": _is_float,
    "bool": lambda x: type(x) is bool,
    "str": lambda x: type(x) is str,
}


def checker(kind: str) -> Callable[[Any], bool]:
    if kind in _ELEMENT:
        return _ELEMENT[kind]
    if kind == "list":
        return lambda v: type(v) is list
    if kind.startswith("list["):  # element types counted in C: no Python call per element
        allowed = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}[kind[5:-1]]

        def check(v: Any) -> bool:
            if type(v) is not list:
                return False
            types = list(map(type, v))
            return sum(map(types.count, allowed)) == len(types)

        return check
    return lambda v: True  # any


def kind_of(value: Any) -> str:
    """The narrowest schema kind of one JSON value ("null", "list[]" for an empty list)."""
    if value is None:
        return "null"
    scalar = _SCALAR.get(type(value))
    if scalar is not None:
        return scalar
    if type(value) is list:
        elements = {_SCALAR.get(type(x), "other") for x in value}
        if not elements:
            return "list[]"
        if elements == {"int", "float"}:
            return "list[float]"
        if len(elements) == 1 and "other" not in elements:
            return f"list[{elements.pop()}]"
        return "list"
    return "an object" if isinstance(value, dict) else "any"


def merge(a: str, b: str) -> str | None:
    """The kind that holds both, or None when they conflict (a drift in the inferred lines)."""
    if a == b:
        return a
    if {a, b} == {"int", "float"}:
        return "float"
    if a.startswith("list") and b.startswith("list"):
        if "list[]" in (a, b):
            return b if a == "list[]" else a
        if {a, b} == {"list[int]", "list[float]"}:
            return "list[float]"
        if "list" in (a, b):
            return "list"
    return None


def hint(field: str, kinds: Collection[str]) -> str:
    if "null" in kinds:
        return (f"fill the nulls when writing the file, or pass schema={{{field!r}: 'any'}} to get "
                "the field as an object column")
    return (f"fix the data, or pass schema={{{field!r}: 'any'}} (an object column) or the one "
            "type you want")


def validate_schema(schema: Mapping[str, str]) -> dict[str, str]:
    """A schema given by the user, checked: field name -> one of `KINDS`."""
    if not isinstance(schema, Mapping) or not schema:
        raise ValueError("JsonlSource: schema must be a non-empty dict of field -> type, e.g. "
                         "{'text': 'str', 'label': 'int'}; types: " + ", ".join(KINDS))
    bad = {k: v for k, v in schema.items() if not isinstance(k, str) or v not in KINDS}
    if bad:
        raise ValueError(f"JsonlSource: schema entries {bad} are not field name -> one of "
                         f"{list(KINDS)} (nested fields are named 'outer/inner').")
    return dict(schema)


def short(value: Any) -> str:
    """A value as the user wrote it, cut to fit an error message."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 40 else text[:37] + "..."
