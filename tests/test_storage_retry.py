"""The retry policy of object storage (zephon.storage.retry and client.retrying) without servers:
a fake clock and sleep turn minutes of outage into milliseconds, and a seeded random source makes
the jitter reproducible. The same loop against real servers stopped and restarted is in
tests/test_storage.py (the outage tests)."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import obstore.exceptions as oe
import pytest

from zephon import storage
from zephon.storage import client
from zephon.storage.retry import Retries, StoragePolicy, reason_of

URL = "s3://bucket/data/x.bin"
WHAT = "reading bytes [10, 30)"
REFUSED = ("Generic S3 error: Error performing GET http://127.0.0.1:9/bucket/data/x.bin in 210µs - "
           "HTTP error: error sending request Debug source: Generic { store: \"S3\", source: "
           "RetryError( RetryErrorImpl { method: GET, retries: 0, max_retries: 0, inner: Http( "
           "HttpError { kind: Connect, source: hyper_util::client::legacy::Error( Connect, "
           "ConnectError( \"tcp connect error\", 127.0.0.1:9, Os { code: 111, kind: "
           "ConnectionRefused, message: \"Connection refused\" } ) ) } ) } ) }")


def _status(code: int, text: str) -> Exception:
    return oe.GenericError(f"Generic S3 error: Error performing GET {URL} in 1ms - Server returned "
                           f"non-2xx status code: {code} {text}: <Error/>")


class FakeTime:
    """A clock that moves only when the code under test sleeps (or an attempt says it took time)."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []
        self.attempts: list[float] = []  # when each attempt started

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.sleeps.append(seconds)
        self.now += seconds


def _retrying(fn, pol: StoragePolicy, t: FakeTime, seed: int = 0):
    """`client.retrying` on the storage loop, as every read runs it, with the fake time."""

    async def attempt():
        t.attempts.append(t.now)
        return await fn()

    return client.run(client.retrying(URL, WHAT, attempt, pol, clock=t.clock, sleep=t.sleep,
                                      rng=random.Random(seed)), URL)


def _failing(t: FakeTime, until: float, exc: Exception | None = None):
    """An attempt that fails with `exc` (connection refused) until `until` seconds have passed."""
    start = t.now

    async def fn():
        if t.now - start < until:
            raise exc if exc is not None else oe.GenericError(REFUSED)
        return b"data"

    return fn


def test_backoff_grows_exponentially_to_its_cap_with_full_jitter():
    pol = StoragePolicy()  # the defaults: 0.2 s doubling to 10 s
    rng = random.Random(1)
    for attempt in range(1, 14):
        cap = min(10.0, 0.2 * 2 ** (attempt - 1))
        waits = np.array([pol.delay(attempt, rng) for _ in range(4000)])
        assert waits.min() >= 0 and waits.max() <= cap
        # full jitter: uniform over the whole [0, cap], not cap plus or minus a little
        assert waits.min() < 0.02 * cap and waits.max() > 0.98 * cap
        assert abs(waits.mean() - cap / 2) < 0.03 * cap
        assert abs(np.mean(waits < cap / 4) - 0.25) < 0.03
    assert pol.delay(10_000, rng) <= 10.0  # no overflow on an endless outage


def test_an_outage_shorter_than_the_deadline_is_ridden_out():
    """The issue's failure: 6 attempts with sub-second backoff gave up after 0.3 s. Now a 10 s
    (and a 90 s) outage ends in the bytes, after as many attempts as the deadline allows."""
    for outage in (10.0, 90.0):
        for seed in range(20):
            t = FakeTime()
            assert _retrying(_failing(t, outage), StoragePolicy(), t, seed) == b"data"
            took = t.now - t.attempts[0]
            assert outage <= took <= outage + 10.0  # back at most one capped backoff after it ends
            assert len(t.attempts) > 6 and max(t.sleeps) <= 10.0


def test_a_longer_outage_fails_at_the_deadline_naming_url_range_attempts_and_reasons():
    pol = StoragePolicy()
    for seed in range(20):
        t = FakeTime()
        start = t.now

        async def fn(calls=[0]):  # noqa: B006 (a counter of this seed's attempts)
            calls[0] += 1
            raise _status(503, "Service Unavailable") if calls[0] <= 2 else oe.GenericError(REFUSED)

        with pytest.raises(storage.ObjectUnavailableError) as info:
            _retrying(fn, pol, t, seed)
        msg = str(info.value)
        assert t.now - start <= pol.deadline  # never sleeps past the deadline
        assert t.attempts[-1] - start >= pol.deadline - pol.reserve - 1e-9  # ... and uses all of it
        assert all(a - start < pol.deadline for a in t.attempts)
        n = len(t.attempts)
        assert n > 10
        assert msg.startswith(f"{URL}: {WHAT} failed after {n} attempts in ")
        assert f"HTTP 503 x2, connection refused x{n - 2}" in msg and "ZEPHON_STORAGE_DEADLINE" in msg


def test_an_attempt_never_runs_past_the_deadline():
    pol = StoragePolicy(timeout=30.0, deadline=120.0)
    r = Retries(pol, start=0.0)
    assert r.timeout(0.0) == 30.0 and r.timeout(100.0) == 20.0 and r.timeout(119.5) == 0.5
    # attempts that time out (30 s each): the last one is cut at the deadline
    t = FakeTime()
    start = t.now

    async def stalled():
        t.now += min(30.0, pol.deadline - (t.now - start))  # what asyncio.wait_for allows it
        raise asyncio.TimeoutError

    with pytest.raises(storage.ObjectUnavailableError, match=r"timed out x\d+"):
        _retrying(stalled, pol, t)
    assert t.now - start <= pol.deadline + 1e-9


def test_a_short_deadline_and_an_attempt_cap_bound_the_retries():
    t = FakeTime()
    with pytest.raises(storage.ObjectUnavailableError, match=r"after \d+ attempts in [0-2]\.\d s"):
        _retrying(_failing(t, 1e9), StoragePolicy(deadline=2.0), t)
    assert t.now - t.attempts[0] <= 2.0
    t = FakeTime()
    with pytest.raises(storage.ObjectUnavailableError, match="after 3 attempts .* or 3 attempts "
                       r"\(ZEPHON_STORAGE_ATTEMPTS\)"):
        _retrying(_failing(t, 1e9), StoragePolicy(attempts=3), t)
    assert len(t.attempts) == 3


@pytest.mark.parametrize("exc,reason", [
    (oe.GenericError(REFUSED), "connection refused"),
    (oe.GenericError("Generic GCS error: error decoding response body: Connection reset by peer (os "
                     "error 104)"), "connection reset"),
    (asyncio.TimeoutError(), "timed out"),
    (oe.GenericError("Generic S3 error: HTTP error: operation timed out"), "timed out"),
    (_status(429, "Too Many Requests"), "HTTP 429"),
    (_status(500, "Internal Server Error"), "HTTP 500"),
    (_status(503, "Service Unavailable"), "HTTP 503"),
    (_status(408, "Request Timeout"), "HTTP 408"),
    (ConnectionResetError("[Errno 104] Connection reset by peer"), "connection reset"),
])
def test_what_can_pass_is_retried(exc, reason):
    t = FakeTime()
    calls = [0]

    async def fn():
        calls[0] += 1
        if calls[0] <= 2:
            raise exc
        return b"ok"

    before = storage.STATS["retries"]
    assert _retrying(fn, StoragePolicy(), t) == b"ok"
    assert calls[0] == 3 and storage.STATS["retries"] == before + 2
    assert client.classify(URL, WHAT, exc)[:2] == (True, reason)


@pytest.mark.parametrize("exc,error", [
    (oe.NotFoundError("Object at location data/x.bin not found"), storage.ObjectMissingError),
    (_status(404, "Not Found"), storage.ObjectMissingError),
    (oe.PermissionDeniedError("403 Forbidden"), storage.ObjectPermissionError),
    (_status(401, "Unauthorized"), storage.ObjectPermissionError),
    (oe.PreconditionError("412 Precondition Failed"), storage.ObjectChangedError),
    (storage.ObjectChangedError("ETag changed"), storage.ObjectChangedError),
    (_status(416, "Range Not Satisfiable"), storage.ObjectCorruptError),
    (_status(400, "Bad Request"), storage.ObjectUnavailableError),
    (ValueError("a bug in the caller"), ValueError),
])
def test_what_waiting_cannot_fix_fails_at_the_first_attempt(exc, error):
    t = FakeTime()

    async def fn():
        raise exc

    with pytest.raises(error) as info:
        _retrying(fn, StoragePolicy(), t)
    assert len(t.attempts) == 1 and t.sleeps == []
    if error is not ValueError and not isinstance(exc, storage.ObjectChangedError):
        assert URL in str(info.value)


def test_reasons_are_short():
    assert reason_of(REFUSED) == "connection refused"
    assert reason_of("Server returned non-2xx status code: 502 Bad Gateway: ") == "HTTP 502"
    assert reason_of("status 503: b'injected fault'") == "HTTP 503"
    assert reason_of("something nobody foresaw " * 20).endswith(" ...")
    assert len(reason_of("something nobody foresaw " * 20)) < 130


def test_settings_are_read_from_the_environment_checked_and_travel_to_workers(monkeypatch):
    from zephon.storage import retry

    old = storage.policy()
    try:
        monkeypatch.setenv("ZEPHON_STORAGE_DEADLINE", "30")
        monkeypatch.setenv("ZEPHON_STORAGE_ATTEMPTS", "0")
        retry.forget()
        assert storage.policy().deadline == 30.0 and storage.policy().attempts == 0
        for name, bad in (("DEADLINE", "0"), ("MAX_BACKOFF", "-1"), ("TIMEOUT", "soon")):
            monkeypatch.setenv(f"ZEPHON_STORAGE_{name}", bad)
            retry.forget()
            with pytest.raises(ValueError, match=f"ZEPHON_STORAGE_{name}"):
                storage.policy()
            monkeypatch.setenv(f"ZEPHON_STORAGE_{name}", "30")
        with pytest.raises(TypeError, match="unknown storage setting.*'deadlne'"):
            storage.configure(deadlne=5)
        for bad in (0, -1.0, "60", float("nan")):
            with pytest.raises(ValueError, match="configure\\(deadline="):
                storage.configure(deadline=bad)
        assert storage.configure(attempts=0).attempts == 0
        # configure() in the parent travels with its blobs to a worker lacking the variables
        monkeypatch.delenv("ZEPHON_STORAGE_DEADLINE")
        retry.forget()
        storage.configure(deadline=7.5, attempts=4)
        carried = dict(client.settings())
        assert carried["ZEPHON_STORAGE_DEADLINE"] == "7.5" and carried["ZEPHON_STORAGE_ATTEMPTS"] == "4"
        monkeypatch.delenv("ZEPHON_STORAGE_ATTEMPTS")
        retry.forget()  # the worker: its own environment, none of the parent's knobs
        assert storage.policy().deadline == 120.0
        client.adopt(tuple(carried.items()))
        assert storage.policy().deadline == 7.5 and storage.policy().attempts == 4
    finally:
        monkeypatch.undo()
        retry.forget()
        storage.configure(**{f: getattr(old, f) for f in old.__dataclass_fields__})
        storage.reset()


def test_a_success_ends_the_backoff_of_the_stores_other_waiting_requests():
    """A read needs all its ranges: without the wake-up, the read after an outage waits for its
    slowest range's backoff (~max_backoff). Here three requests back off for up to 20 s; a
    fourth, with a 50 ms backoff, gets through 0.3 s after the store is back and wakes them."""
    import time

    down = [True]

    async def attempt():
        if down[0]:
            raise oe.GenericError(REFUSED)
        return b"ok"

    slow = StoragePolicy(backoff=20.0, max_backoff=20.0, deadline=60.0)
    fast = StoragePolicy(backoff=0.05, max_backoff=0.05, deadline=60.0)
    other = "gs://elsewhere/x.bin"

    async def scenario():
        async def back_up():
            await asyncio.sleep(0.3)
            down[0] = False

        waiting = [asyncio.ensure_future(client.retrying(URL, WHAT, attempt, slow, rng=random.Random(i)))
                   for i in range(3)]
        # another store's request backs off on its own: a success in s3://bucket does not wake it
        elsewhere = asyncio.ensure_future(client.retrying(other, WHAT, attempt, slow,
                                                          rng=random.Random(7)))
        await asyncio.sleep(0.1)  # they are all waiting now
        t0 = time.monotonic()
        got = await asyncio.gather(back_up(), client.retrying(URL, WHAT, attempt, fast), *waiting)
        took = time.monotonic() - t0
        done_elsewhere = elsewhere.done()
        elsewhere.cancel()
        return got[1:], took, done_elsewhere

    got, took, done_elsewhere = client.run(scenario(), URL)
    assert got == [b"ok"] * 4
    assert took < 2.0  # not the ~15 s the slowest of three 20 s backoffs would take
    assert not done_elsewhere
