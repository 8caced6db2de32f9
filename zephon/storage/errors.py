"""The storage layer's errors: each a `SourceError` (so an `OSError`), naming the URL.

Which one tells the caller what to do: fix the URL (missing), fix the credentials (permission),
restart from a checkpoint on purpose (changed), rewrite or re-index the object (corrupt), or look
at the network or the service (unavailable, after the retries).
"""

from __future__ import annotations

from ..errors import SourceError


class ObjectMissingError(SourceError, FileNotFoundError):
    """404: no object at the URL (or no bucket)."""


class ObjectPermissionError(SourceError, PermissionError):
    """401/403: the credentials in use may not read (or write) the object."""


class ObjectChangedError(SourceError):
    """The object is not the version the source pinned when it opened (replaced or deleted)."""


class ObjectCorruptError(SourceError):
    """416 or a short read: a range the format's index points to is not in the object."""


class ObjectUnavailableError(SourceError, TimeoutError):
    """The store stayed unreachable or failing (refused or reset connections, timeouts, 429, 5xx)
    until the retry deadline (ZEPHON_STORAGE_DEADLINE)."""
