"""Zephon's exceptions.

Every error names the problem and the fix. They subclass the builtin a caller would otherwise
catch (ValueError, OSError, ...) so existing handlers keep working.
"""

from __future__ import annotations

import numbers
import warnings
from typing import Any


class ZephonError(Exception):
    """Base class of every error Zephon raises on purpose."""


class PlanError(ZephonError, ValueError):
    """A plan that cannot describe a valid stream of global batches."""


class SourceError(ZephonError, OSError):
    """A record source that is missing, truncated or unreadable."""


class DecodeError(ZephonError, ValueError):
    """A record that was read but could not be decoded by the declared spec."""


class StateError(ZephonError, ValueError):
    """A checkpoint state that does not belong to this plan or is malformed."""


class WorkerError(ZephonError, RuntimeError):
    """A runner's worker died or raised; the consumer gets this instead of hanging."""


def check_positive_int(value: Any, what: str) -> int:
    """`value` as an int if it is a positive integer (a bool is not); otherwise a PlanError
    saying that `what` must be one."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise PlanError(f"{what} must be a positive integer, got {value!r}")
    return int(value)


def divisors(n: int) -> list[int]:
    """The positive divisors of `n`, ascending: the counts that split `n` things evenly (error
    messages list them as the choices that work)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def deprecated_attribute(module: str, name: str, table: dict[str, tuple[Any, str]]) -> Any:
    """`table[name]`'s object, with a DeprecationWarning naming its replacement, for a module's
    `__getattr__` that keeps renamed names working for one version; otherwise the AttributeError
    Python would raise. `table` maps an old name to (the object, what to use instead)."""
    if name not in table:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    obj, instead = table[name]
    warnings.warn(f"{module}.{name} is deprecated and will be removed in the next version; use {instead}.",
                  DeprecationWarning, stacklevel=3)
    return obj
