"""How hard a request to object storage tries before it gives up.

A request is retried until a deadline, not for a fixed number of attempts: an outage of the
store (a restart, a failover, a network blip) is ridden out if it ends within `deadline` seconds
(120 by default, about what the clouds' own clients allow), and becomes an error naming the URL,
the byte range, the attempts and the reasons once it has lasted that long. Between attempts the
request waits a random time between 0 and `backoff * 2**(n-1)` (exponential backoff with full
jitter: the processes and requests that failed together do not retry together), growing to at
most `max_backoff` and never past the deadline: the last attempt starts just before it. The
first request that gets through ends the waits of the same store's other requests in the
process (client._Wake), so a read of many ranges is back as soon as the store is, not after
its slowest range's backoff.

Only failures that can pass are retried: connections refused or reset, request timeouts and
stalls, 408, 429 and 5xx. 404, 401/403, 412 (the object was replaced) and 416 (a range past the
end: the index is wrong) fail at the first attempt, since waiting cannot fix them.

Knobs (environment, read when a store is first used in a process; `configure()` overrides them
in this process and in the worker processes it starts that do not set them):
ZEPHON_STORAGE_DEADLINE (s per request, all attempts together, default 120),
ZEPHON_STORAGE_TIMEOUT (s per attempt, default 30), ZEPHON_STORAGE_BACKOFF (s, the first
retry's largest wait, default 0.2), ZEPHON_STORAGE_MAX_BACKOFF (s, the largest wait, default 10),
ZEPHON_STORAGE_ATTEMPTS (a cap on attempts, default 0: none, the deadline decides),
ZEPHON_STORAGE_CONCURRENCY (requests in flight per process, default 64),
ZEPHON_STORAGE_OVERFETCH (default 0.8: one read's requests may fetch at most this fraction more
bytes than it asked for, spent on the smallest gaps between its ranges, which saves their round
trips), ZEPHON_STORAGE_MERGE_GAP (bytes, default 65536: no gap longer than this is ever fetched),
ZEPHON_STORAGE_MAX_REQUEST (bytes, default 8 MiB), ZEPHON_STORAGE_CACHE_BYTES (the local cache's
budget in bytes, default 0: no cache; see cache.py).
"""

from __future__ import annotations

import os
import random
import re
from collections import Counter
from dataclasses import dataclass, field, fields, replace
from typing import Any

#: Knobs that may be 0 (0 means: off / no limit).
_ZERO_OK = ("merge_gap", "cache_bytes", "overfetch", "attempts")


@dataclass(frozen=True)
class StoragePolicy:
    timeout: float = 30.0
    deadline: float = 120.0
    attempts: int = 0
    concurrency: int = 64
    overfetch: float = 0.8
    merge_gap: int = 65536
    max_request: int = 8 << 20
    cache_bytes: int = 0
    backoff: float = 0.2
    max_backoff: float = 10.0

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """The wait before retry number `attempt` (1-based): uniform in [0, min(max_backoff,
        backoff * 2**(attempt-1))] (full jitter)."""
        cap = min(self.max_backoff, self.backoff * 2.0 ** min(attempt - 1, 60))
        return (rng or random).uniform(0.0, cap)

    @property
    def reserve(self) -> float:
        """The time the last attempt gets before the deadline: the backoff never sleeps into it."""
        return min(1.0, self.timeout, self.deadline / 10)


def _env_name(name: str) -> str:
    return f"ZEPHON_STORAGE_{name.upper()}"


def _check(name: str, value: Any, shown: str) -> None:
    """A knob's value must be a number >= 0 (> 0 unless 0 means off for it)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ValueError(f"{shown} is not a number")
    if value < 0 or (value == 0 and name not in _ZERO_OK):
        raise ValueError(f"{shown}: {name} must be > 0")


def _from_env() -> StoragePolicy:
    values: dict[str, Any] = {}
    for f in fields(StoragePolicy):
        raw = os.environ.get(_env_name(f.name))
        if raw is None:
            continue
        try:
            value = float(raw) if f.type in ("float", float) else int(raw)
        except ValueError:
            raise ValueError(f"{_env_name(f.name)}={raw!r} is not a number") from None
        _check(f.name, value, f"{_env_name(f.name)}={raw!r}")
        values[f.name] = value
    return StoragePolicy(**values)


_policy: StoragePolicy | None = None


def policy() -> StoragePolicy:
    global _policy
    if _policy is None:
        _policy = _from_env()
    return _policy


def configure(**changes: Any) -> StoragePolicy:
    """Overrides knobs for this process (e.g. `configure(deadline=10)`); returns the policy.
    Worker processes that do not set the knob's variable themselves get the override too (it
    travels with every blob this process opens: see `overrides`)."""
    global _policy
    unknown = sorted(set(changes) - {f.name for f in fields(StoragePolicy)})
    if unknown:
        raise TypeError(f"unknown storage setting(s) {unknown}; the settings are "
                        f"{[f.name for f in fields(StoragePolicy)]}")
    for name, value in changes.items():
        _check(name, value, f"configure({name}={value!r})")
    _policy = replace(policy(), **changes)
    return _policy


def forget() -> None:
    """Drops this process's policy, so the next request reads the environment again."""
    global _policy
    _policy = None


def overrides() -> dict[str, str]:
    """The knobs `configure()` set in this process that differ from its environment, as the
    variables a worker process reads (so a worker follows its parent's configuration)."""
    if _policy is None:
        return {}
    env = _from_env()
    return {_env_name(f.name): str(int(v)) if f.type in ("int", int) else repr(float(v))
            for f in fields(StoragePolicy)
            if (v := getattr(_policy, f.name)) != getattr(env, f.name)}


_STATUS = re.compile(r"status(?: code)?:? ?(\d{3})\b|\b([1-5]\d\d) [A-Z][a-z]+")


def status_of(message: str) -> int | None:
    """The HTTP status an error message of the client reports ("status code: 503",
    "503 Service Unavailable"), if any."""
    m = _STATUS.search(message)
    return int(m.group(1) or m.group(2)) if m else None


def retryable_status(status: int | None) -> bool:
    """True when a request that failed with `status` may succeed if tried again."""
    return status is None or status in (408, 429) or status >= 500


#: Lower-cased fragments of a client's error message -> the short reason an error reports.
_REASONS = (
    ("connection refused", "connection refused"),
    ("connectionrefused", "connection refused"),
    ("connection reset", "connection reset"),
    ("connectionreset", "connection reset"),
    ("broken pipe", "connection reset"),
    ("connection closed", "connection closed"),
    ("incompletemessage", "connection closed"),
    ("end of file before message length", "connection closed"),
    ("error decoding response body", "connection closed mid-body"),
    ("timed out", "timed out"),
    ("timeout", "timed out"),
    ("dns error", "DNS lookup failed"),
    ("failed to lookup address", "DNS lookup failed"),
)


def reason_of(message: str) -> str:
    """A short reason for a retryable failure ("HTTP 503", "connection refused", ...), for the
    error after the last attempt: a client's full message runs to hundreds of characters."""
    status = status_of(message)
    if status is not None:
        return f"HTTP {status}"
    low = message.lower()
    for fragment, reason in _REASONS:
        if fragment in low:
            return reason
    first = " ".join(message.split())
    return first if len(first) <= 120 else first[:120] + " ..."


@dataclass
class Retries:
    """The retry bookkeeping of one request: when to try again, when to give up, what to say.

    Pure (the caller passes the clock's readings and may pass the random source), so the policy
    is tested without waiting."""

    policy: StoragePolicy
    start: float
    rng: random.Random | None = None
    attempts: int = 0
    reasons: Counter[str] = field(default_factory=Counter)
    elapsed: float = 0.0
    last: bool = False  # the attempt under way is the last one (the deadline is next)

    def timeout(self, now: float) -> float:
        """The time the next attempt may take: the per-attempt timeout, cut at the deadline."""
        return max(0.001, min(self.policy.timeout, self.policy.deadline - (now - self.start)))

    def failed(self, reason: str, now: float) -> float | None:
        """Records a failed attempt; returns the seconds to wait before the next one, or None
        when the request has to give up (the deadline, or the optional cap on attempts)."""
        pol = self.policy
        self.attempts += 1
        self.reasons[reason] += 1
        self.elapsed = now - self.start
        room = pol.deadline - pol.reserve - self.elapsed  # the last attempt starts by then
        if self.last or room < 0 or (pol.attempts and self.attempts >= pol.attempts):
            return None
        wait = pol.delay(self.attempts, self.rng)
        if wait >= room:
            wait, self.last = room, True
        return wait

    def woken(self) -> None:
        """The wait ended early (another request got through): the next attempt is not the
        last one after all, however soon it comes."""
        self.last = False

    def summary(self) -> str:
        """'connection refused x31, HTTP 503 x2': each reason seen, with its count."""
        return ", ".join(f"{r} x{n}" if n > 1 else r for r, n in self.reasons.items())

    def message(self, url: str, what: str) -> str:
        pol = self.policy
        cap = f" or {pol.attempts} attempts (ZEPHON_STORAGE_ATTEMPTS)" if pol.attempts else ""
        return (f"{url}: {what} failed after {self.attempts} attempts in {self.elapsed:.1f} s "
                f"({self.summary()}). Connections refused or reset, timeouts, 429 and 5xx are "
                f"retried with backoff for up to {pol.deadline:g} s (ZEPHON_STORAGE_DEADLINE){cap}; "
                "check the endpoint and the network, then resume from the last checkpoint.")
