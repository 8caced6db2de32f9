"""How hard a request to object storage tries before it gives up.

Every request has a timeout, and every byte range a bounded number of attempts and a total
deadline, so a dead or stalled endpoint becomes an error naming the URL, the range and the
attempts after at most `deadline` seconds, never a hang. Only failures that can pass are
retried: 408, 429, 5xx, timeouts and dropped connections. 404, 401/403, 412 (the object was
replaced) and 416 (a range past the end: the index is wrong) fail at once.

Knobs (environment, read when a store is first used in a process; `configure()` overrides):
ZEPHON_STORAGE_TIMEOUT (s, per request, default 30), ZEPHON_STORAGE_DEADLINE (s, per range,
default 120), ZEPHON_STORAGE_ATTEMPTS (default 6), ZEPHON_STORAGE_CONCURRENCY (requests in
flight per process, default 64), ZEPHON_STORAGE_OVERFETCH (default 0.8: one read's requests may
fetch at most this fraction more bytes than it asked for, spent on the smallest gaps between its
ranges, which saves their round trips), ZEPHON_STORAGE_MERGE_GAP (bytes, default 65536: no
gap longer than this is ever fetched), ZEPHON_STORAGE_MAX_REQUEST (bytes, default 8 MiB),
ZEPHON_STORAGE_CACHE_BYTES (the local cache's budget in bytes, default 0: no cache; see cache.py).
"""

from __future__ import annotations

import os
import random
import re
from dataclasses import dataclass, fields, replace
from typing import Any


@dataclass(frozen=True)
class StoragePolicy:
    timeout: float = 30.0
    deadline: float = 120.0
    attempts: int = 6
    concurrency: int = 64
    overfetch: float = 0.8
    merge_gap: int = 65536
    max_request: int = 8 << 20
    cache_bytes: int = 0
    backoff: float = 0.1
    max_backoff: float = 5.0

    def delay(self, attempt: int) -> float:
        """Full-jitter exponential backoff before retry number `attempt` (1-based)."""
        return random.uniform(0.0, min(self.max_backoff, self.backoff * 2 ** (attempt - 1)))


def _from_env() -> StoragePolicy:
    values: dict[str, Any] = {}
    for f in fields(StoragePolicy):
        raw = os.environ.get(f"ZEPHON_STORAGE_{f.name.upper()}")
        if raw is None:
            continue
        try:
            value = float(raw) if f.type in ("float", float) else int(raw)
        except ValueError:
            raise ValueError(f"ZEPHON_STORAGE_{f.name.upper()}={raw!r} is not a number") from None
        if value < 0 or (value == 0 and f.name not in ("merge_gap", "cache_bytes", "overfetch")):
            raise ValueError(f"ZEPHON_STORAGE_{f.name.upper()} must be > 0, got {raw!r}")
        values[f.name] = value
    return StoragePolicy(**values)


_policy: StoragePolicy | None = None


def policy() -> StoragePolicy:
    global _policy
    if _policy is None:
        _policy = _from_env()
    return _policy


def configure(**changes: Any) -> StoragePolicy:
    """Overrides knobs for this process (e.g. `configure(deadline=10)`); returns the policy."""
    global _policy
    _policy = replace(policy(), **changes)
    return _policy


_STATUS = re.compile(r"status(?: code)?:? ?(\d{3})\b|\b([1-5]\d\d) [A-Z][a-z]+")


def status_of(message: str) -> int | None:
    """The HTTP status an error message of the client reports ("status code: 503",
    "503 Service Unavailable"), if any."""
    m = _STATUS.search(message)
    return int(m.group(1) or m.group(2)) if m else None


def retryable_status(status: int | None) -> bool:
    """True when a request that failed with `status` may succeed if tried again."""
    return status is None or status in (408, 429) or status >= 500
