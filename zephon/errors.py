"""Zephon's exceptions.

Every error names the problem and the fix. They subclass the builtin a caller would otherwise
catch (ValueError, OSError, ...) so existing handlers keep working.
"""

from __future__ import annotations


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
