"""The object-store client: obstore stores, one event loop thread, retries under a deadline.

obstore (Rust `object_store`) was picked over fsspec (gcsfs/s3fs) and pyarrow.fs because it alone
offers, from one small wheel, async ranged GETs with If-Match (a read that fails instead of
returning bytes of a replaced object), ETag + version in every response, conditional puts, and
per-request timeouts. Its own retries are switched off (`max_retries=0`: one HTTP request per
call, checked by the tests through a counting proxy): Zephon retries itself, under one deadline
(retry.py), so an outage is neither retried twice over nor hidden, and the error after the last
attempt names the URL, the byte range, the attempts and the reasons.

All requests of a process run on one asyncio loop in a daemon thread; synchronous callers submit
coroutines to it. After a fork the child starts its own loop and stores (a loop or a connection
pool never crosses a fork).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import os
import random
import threading
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any, TypeVar

from .errors import (
    ObjectChangedError,
    ObjectCorruptError,
    ObjectMissingError,
    ObjectPermissionError,
    ObjectUnavailableError,
)
from .retry import Retries, StoragePolicy, forget, overrides, policy, reason_of, retryable_status, status_of
from .url import ObjectURL

log = logging.getLogger(__name__)
T = TypeVar("T")

_lock = threading.Lock()
_pid = -1
_loop: asyncio.AbstractEventLoop | None = None
_stores: dict[tuple[str, str], Any] = {}
_sem: asyncio.Semaphore | None = None
_wakes: dict[str, _Wake] = {}  # per store ("s3://bucket"): see _Wake
#: Counters of this process (read by benchmarks and tests): requests, bytes, retries.
STATS = {"requests": 0, "bytes": 0, "retries": 0}


def _obstore() -> Any:
    try:
        import obstore
    except ImportError:
        raise ImportError("reading s3:// or gs:// needs obstore: pip install 'zephon-loader[remote]'") from None
    return obstore


def _state() -> asyncio.AbstractEventLoop:
    global _pid, _loop, _sem
    with _lock:
        if _pid != os.getpid() or _loop is None:
            _pid = os.getpid()
            _stores.clear()
            _wakes.clear()
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="zephon-storage", daemon=True).start()
            _loop, _sem = loop, None
        return _loop


def run(coro: Awaitable[T], what: str) -> T:
    """Runs `coro` on the storage loop; the wait is bounded by the policy's deadline."""
    loop = _state()
    fut: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(coro, loop)  # type: ignore[arg-type]
    pol = policy()
    done, _ = concurrent.futures.wait([fut], timeout=pol.deadline + pol.timeout + 5.0)
    if not done:
        fut.cancel()
        raise ObjectUnavailableError(f"{what}: no answer within {pol.deadline + pol.timeout:.0f} s "
                                     "(the storage deadline); check the endpoint and the network.")
    return fut.result()


_SETTINGS = ("AWS_", "GOOGLE_", "STORAGE_EMULATOR_HOST", "CLOUD_STORAGE_EMULATOR_ENDPOINT",
             "ZEPHON_STORAGE_", "ZEPHON_CACHE_DIR")


def settings() -> tuple[tuple[str, str], ...]:
    """This process's storage environment, with the knobs `configure()` changed (what a blob
    carries to worker processes)."""
    found = {k: v for k, v in os.environ.items() if k.startswith(_SETTINGS)}
    found.update(overrides())
    return tuple(sorted(found.items()))


def adopt(values: tuple[tuple[str, str], ...]) -> None:
    """Sets the storage variables this process lacks (never overrides one it has): a worker
    started by a fork server that predates them reaches the same store as its parent. In a
    child process (a runner's or a DataLoader's worker) the retry policy the blob carries wins
    over the environment: it is the opening process's, `configure()` included, while the
    child's environment is a copy of that process's variables without its overrides."""
    child = multiprocessing.parent_process() is not None
    missing = [(k, v) for k, v in values
               if k not in os.environ or (child and k.startswith("ZEPHON_STORAGE_") and os.environ[k] != v)]
    if missing:
        os.environ.update(missing)
        if any(k.startswith("ZEPHON_STORAGE_") for k, _ in missing):
            forget()
        reset()


def reset() -> None:
    """Forgets this process's stores, so the next request reads the environment again (after
    changing AWS_ENDPOINT_URL, keys or STORAGE_EMULATOR_HOST)."""
    global _sem
    with _lock:
        _stores.clear()
        _wakes.clear()
        _sem = None


def semaphore() -> asyncio.Semaphore:
    """Requests in flight in this process (created on the loop, sized by the policy)."""
    global _sem
    if _sem is None:
        _sem = asyncio.Semaphore(policy().concurrency)
    return _sem


def endpoint(scheme: str) -> str | None:
    if scheme == "s3":
        return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    host = os.environ.get("STORAGE_EMULATOR_HOST") or os.environ.get("CLOUD_STORAGE_EMULATOR_ENDPOINT")
    if host and "://" not in host:
        host = f"http://{host}"
    return host


def credential_source(scheme: str) -> str:
    """Where the credentials come from (names of variables and files only, never values)."""
    env = os.environ
    end = endpoint(scheme)
    at = f" against {end}" if end else ""
    if scheme == "s3":
        if env.get("AWS_ACCESS_KEY_ID"):
            return f"AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY from the environment{at}"
        if env.get("AWS_WEB_IDENTITY_TOKEN_FILE"):
            return f"the web identity token file named by AWS_WEB_IDENTITY_TOKEN_FILE{at}"
        if env.get("AWS_SKIP_SIGNATURE"):
            return f"no credentials (AWS_SKIP_SIGNATURE){at}"
        return f"the instance metadata service (no AWS_ACCESS_KEY_ID in the environment){at}"
    if env.get("STORAGE_EMULATOR_HOST") or env.get("CLOUD_STORAGE_EMULATOR_ENDPOINT"):
        return f"no credentials (the emulator named by STORAGE_EMULATOR_HOST{at})"
    if env.get("GOOGLE_APPLICATION_CREDENTIALS"):
        return f"the key file named by GOOGLE_APPLICATION_CREDENTIALS ({env['GOOGLE_APPLICATION_CREDENTIALS']})"
    if env.get("GOOGLE_SERVICE_ACCOUNT") or env.get("GOOGLE_SERVICE_ACCOUNT_KEY"):
        return "the service account named by GOOGLE_SERVICE_ACCOUNT(_KEY)"
    return "application default credentials (the metadata server; no GOOGLE_APPLICATION_CREDENTIALS set)"


def store(loc: ObjectURL) -> Any:
    """The obstore store of `loc`'s bucket in this process (built once, from the environment)."""
    _state()
    key = (loc.scheme, loc.bucket)
    found = _stores.get(key)
    if found is not None:
        return found
    obs = _obstore()
    pol = policy()
    end = endpoint(loc.scheme)
    client: dict[str, Any] = {"timeout": f"{pol.timeout}s", "connect_timeout": f"{min(pol.timeout, 10.0)}s"}
    if end and end.startswith("http://"):
        client["allow_http"] = True
    # obstore's own retries off: one HTTP request per call, so `retrying` alone decides (and
    # counts) attempts under one deadline; obstore's would multiply ours and hide an outage.
    retry = {"max_retries": 0, "retry_timeout": timedelta(seconds=pol.deadline)}
    if loc.scheme == "s3":
        config: dict[str, Any] = {}
        if end:
            config["endpoint"] = end
            config["virtual_hosted_style_request"] = False
        if not os.environ.get("AWS_REGION") and not os.environ.get("AWS_DEFAULT_REGION"):
            config["region"] = "us-east-1"
        made = obs.store.S3Store(loc.bucket, config=config, client_options=client, retry_config=retry)
    else:
        gconfig: dict[str, Any] = {}
        provider = None
        if end:  # fake-gcs-server and other emulators: plain HTTP and no OAuth, so no token
            gconfig["base_url"] = end  # request (it would go to the metadata server) is ever made
            provider = _emulator_token
        made = obs.store.GCSStore(loc.bucket, config=gconfig, client_options=client, retry_config=retry,
                                  credential_provider=provider)
    with _lock:
        return _stores.setdefault(key, made)


def _emulator_token() -> dict[str, Any]:
    """The bearer token sent to a GCS emulator, which checks none."""
    return {"token": "emulator", "expires_at": None}


def classify(url: str, what: str, exc: BaseException) -> tuple[bool, str, Exception | None]:
    """(retryable, short reason, final error if not retryable) for a failed request."""
    obs = _obstore()
    exc_mod = obs.exceptions
    msg = " ".join(str(exc).split())
    scheme = url.split("://", 1)[0]
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return True, "timed out", None
    if isinstance(exc, (exc_mod.NotFoundError, FileNotFoundError)) or status_of(msg) == 404:
        return False, "HTTP 404", ObjectMissingError(
            f"{url}: no such object (404) while {what}. Check the bucket and the key (list it "
            f"with your cloud CLI); credentials from {credential_source(scheme)}.")
    if isinstance(exc, (exc_mod.PermissionDeniedError, exc_mod.UnauthenticatedError)) or \
            status_of(msg) in (401, 403):
        return False, "HTTP 403", ObjectPermissionError(
            f"{url}: permission denied while {what} ({_short(msg)}). The credentials came from "
            f"{credential_source(scheme)}; give them read access to the object (and write access "
            "for checkpoints), or set the right ones.")
    if isinstance(exc, (exc_mod.PreconditionError, exc_mod.NotModifiedError)) or status_of(msg) == 412:
        return False, "HTTP 412", ObjectChangedError(
            f"{url}: the object was replaced while {what}: it is no longer the version this source "
            "pinned when it opened. Records read now could mix two versions of the data, so reading "
            "stops. Never rewrite data under a running job: restore the original object and resume "
            "from the last checkpoint, or build a new source (a new plan) for the new data.")
    if not isinstance(exc, (exc_mod.BaseError, OSError)):
        return False, type(exc).__name__, None  # a bug, not a fault of the store: raise it as is
    status = status_of(msg)
    if status == 416:
        return False, "HTTP 416", ObjectCorruptError(
            f"{url}: the server says the byte range is not in the object (416) while {what}: the "
            "object is shorter than its index says (truncated or corrupt). Rewrite it.")
    if not retryable_status(status) or isinstance(exc, exc_mod.InvalidPathError):
        return False, f"HTTP {status}", ObjectUnavailableError(f"{url}: {what} failed: {_short(msg)}")
    return True, reason_of(msg), None


def _short(msg: str, limit: int = 300) -> str:
    return msg if len(msg) <= limit else msg[:limit] + " ..."


_warned = [0.0]  # when this process last warned that requests are being retried


class _Wake:
    """Ends the backoff of a store's waiting requests when one of its requests succeeds.

    Each request backs off on its own random schedule, and a read needs all of its ranges: after
    an outage it would wait for the slowest one, which in a read of hundreds of ranges is close
    to `max_backoff` (measured: ~10 s after the server was back). Since the first request that
    gets through shows the store is back, it wakes the others, which try again at once. They are
    at most `concurrency` requests of this process, the load the store carries anyway; other
    processes and hosts find the store back on their own jittered schedules, so they do not all
    return together."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.waiting = 0

    def succeeded(self) -> None:
        if self.waiting:
            self.event.set()
            self.event = asyncio.Event()

    async def sleep(self, seconds: float) -> bool:
        """Waits `seconds`, or less if another request succeeds first; True if woken early."""
        event = self.event
        self.waiting += 1
        try:
            await asyncio.wait_for(event.wait(), seconds)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            self.waiting -= 1


def _wake(url: str) -> _Wake:
    key = url.split("/", 3)[:3]  # scheme://bucket
    return _wakes.setdefault("/".join(key), _Wake())


async def retrying(url: str, what: str, attempt_fn: Callable[[], Awaitable[T]],
                   pol: StoragePolicy | None = None, *, clock: Callable[[], float] = time.monotonic,
                   sleep: Callable[[float], Awaitable[Any]] | None = None,
                   rng: random.Random | None = None) -> T:
    """Runs one request under the policy (retry.py): each attempt within the per-attempt
    timeout, retryable failures tried again after a jittered backoff until the deadline, then
    `ObjectUnavailableError`. A success ends the backoff of the same store's waiting requests
    (see `_Wake`). At most `concurrency` requests of the process are in flight (waiting for a
    slot counts toward the deadline, not toward an attempt's timeout). `clock`, `sleep` and
    `rng` are for tests (a `sleep` given replaces the wake-up too)."""
    pol = pol or policy()
    tries = Retries(pol, clock(), rng)
    wake = _wake(url)
    while True:
        try:
            async with semaphore():
                STATS["requests"] += 1
                got = await asyncio.wait_for(attempt_fn(), tries.timeout(clock()))
            wake.succeeded()
            return got
        except (ObjectChangedError, ObjectCorruptError):
            raise
        except Exception as e:
            again, reason, final = classify(url, what, e)
            if final is not None:
                raise final from None
            if not again:
                raise
        wait = tries.failed(reason, clock())
        if wait is None:
            raise ObjectUnavailableError(tries.message(url, what))
        STATS["retries"] += 1
        now = time.monotonic()
        if now - _warned[0] > 10.0:  # an outage: one line every 10 s per process, not per request
            _warned[0] = now
            log.warning("%s: %s failed (%s); retrying for up to %g s (ZEPHON_STORAGE_DEADLINE)",
                        url, what, reason, pol.deadline)
        log.debug("%s: %s failed (%s), retry %d in %.2f s", url, what, reason, tries.attempts, wait)
        if sleep is not None:
            await sleep(wait)
        elif await wake.sleep(wait):
            tries.woken()
