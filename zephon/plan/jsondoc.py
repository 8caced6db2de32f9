"""JSON text that must hold an object: the one rule a saved state and a saved plan share.

Both are read back from files a user may have mixed up, cut short or edited, so both refuse text
that does not parse and JSON that is not an object with an error saying what to pass instead. The
wording belongs to the caller (a state and a plan name different remedies); the checks are here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any


def loads(text: str | bytes) -> Any:
    """`json.loads` whose only failures are `json.JSONDecodeError` (and `UnicodeDecodeError` for
    bytes): text nested deeper than the decoder recurses (`"[" * 10**6`) or a number of more than
    4,300 digits raise other builtins (RecursionError, ValueError) that would escape a caller's
    handling of bad JSON."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply to parse", "", 0) from None
    except ValueError as e:  # e.g. "Exceeds the limit (4300 digits) for integer string conversion"
        raise json.JSONDecodeError(f"a number it cannot hold ({e})", "", 0) from None


def json_object(doc: Any, invalid: Callable[[json.JSONDecodeError], Exception],
                not_object: Callable[[str], Exception]) -> dict[str, Any]:
    """`doc` as a dict: parsed first when it is text (`invalid(error)` is raised if that fails),
    then `not_object(type name)` is raised unless it is a JSON object. The decoder's message is
    in the caller's error, so the exception is not chained to it."""
    if isinstance(doc, str):
        try:
            doc = loads(doc)
        except json.JSONDecodeError as e:
            raise invalid(e) from None
    if not isinstance(doc, dict):
        raise not_object(type(doc).__name__)
    return doc
