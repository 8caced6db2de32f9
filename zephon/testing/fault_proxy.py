"""A small asyncio HTTP proxy on 127.0.0.1 that injects the faults object storage has in real
life: added latency, 503s, stalls and connections reset in the middle of a body.

It forwards each request unchanged (the Host header too, so S3 signatures still verify) over an
upstream connection kept alive per client connection, then applies the next scheduled fault to
ranged GETs only (so test set-up traffic is never disturbed). Used by the storage tests and
benchmarks/storage.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass

from .object_servers import free_port


@dataclass
class Faults:
    latency: float = 0.0  # seconds added before every request is forwarded
    status: int = 0  # answer the next `count` ranged GETs with this status (e.g. 503, 429)
    stall: float = 0.0  # ... or hold them this long before answering (a stalled server)
    reset: bool = False  # ... or send half of the real answer, then reset the connection
    count: int = 0  # how many ranged GETs the fault above applies to (-1: all)
    faulted: int = 0  # ranged GETs that got a fault so far
    requests: int = 0  # requests forwarded so far

    def take(self) -> bool:
        if self.count == 0:
            return False
        if self.count > 0:
            self.count -= 1
        self.faulted += 1
        return True


class FaultProxy:
    def __init__(self, upstream: str, rewrite_host: bool = False) -> None:
        """`rewrite_host`: send the upstream's Host (for servers that route by it, like
        fake-gcs-server; never for S3, whose signature covers the Host the client sent)."""
        host, _, port = upstream.split("://", 1)[1].partition(":")
        self.upstream = (host, int(port))
        self.rewrite_host = rewrite_host
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.faults = Faults()
        self._open: set[asyncio.StreamWriter] = set()  # client and upstream connections
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fault-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the fault proxy did not start")

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._client, "127.0.0.1", self.port))
        self._ready.set()
        self._loop.run_forever()

    def close(self) -> None:
        async def shutdown() -> None:
            self._server.close()
            for w in list(self._open):  # connections still open (kept alive): closed on the loop
                w.close()
            await asyncio.sleep(0.05)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []  # kept alive
        self._open.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                headers = {k.strip().lower(): v.strip() for k, _, v in
                           (line.partition(":") for line in lines[1:] if line)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                ranged = lines[0].startswith("GET ") and "range" in headers
                await self._one(head, body, ranged, writer, upstream)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            for _, up_w in upstream:
                self._open.discard(up_w)
                up_w.close()
            self._open.discard(writer)
            with contextlib.suppress(Exception):
                writer.close()

    async def _one(self, head: bytes, body: bytes, ranged: bool, writer: asyncio.StreamWriter,
                   upstream: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]) -> None:
        f = self.faults
        f.requests += 1
        if f.latency:  # every request waits its full latency, on its own (concurrent requests overlap)
            await asyncio.sleep(f.latency)
        fault = ranged and f.take()
        if fault and f.status:
            msg = b"injected fault"
            writer.write(f"HTTP/1.1 {f.status} Injected\r\nContent-Length: {len(msg)}\r\n"
                         "Content-Type: text/plain\r\n\r\n".encode() + msg)
            await writer.drain()
            return
        if fault and f.stall:
            await asyncio.sleep(f.stall)
        text = head.decode("latin-1").split("\r\n")
        kept = [ln for ln in text[1:] if ln and not ln.lower().startswith("connection:")]
        if self.rewrite_host:
            kept = [f"Host: {self.upstream[0]}:{self.upstream[1]}" if ln.lower().startswith("host:")
                    else ln for ln in kept]
        request = ("\r\n".join([text[0], *kept, "", ""])).encode("latin-1") + body
        # one upstream connection per client connection, reused while the upstream keeps it open
        # (a new TCP connection per request made this proxy, not the server, the bottleneck)
        if not upstream:
            upstream.append(await asyncio.open_connection(*self.upstream))
            self._open.add(upstream[0][1])
        up_r, up_w = upstream[0]
        keep = False
        try:
            up_w.write(request)
            await up_w.drain()
            answer, keep = await _response(up_r, text[0].startswith("HEAD "))
        finally:
            if not keep:  # closed by the upstream, or broken: a new one next time
                upstream.clear()
                self._open.discard(up_w)
                up_w.close()
        if fault and f.reset:
            writer.write(answer[: len(answer) // 2])
            await writer.drain()
            writer.transport.abort()
            raise ConnectionResetError("injected reset")
        writer.write(answer)
        await writer.drain()
        if not keep:  # the upstream closed its side: so does the client's connection
            raise ConnectionResetError("upstream asked to close")


async def _response(up: asyncio.StreamReader, head_request: bool) -> tuple[bytes, bool]:
    """One whole HTTP/1.1 response as raw bytes, and whether the connection stays usable."""
    head = await up.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {k.strip().lower(): v.strip().lower() for k, _, v in
               (line.partition(":") for line in lines[1:] if line)}
    keep = headers.get("connection") != "close"
    if head_request or status in (204, 304) or 100 <= status < 200:
        return head, keep
    if "content-length" in headers:
        return head + await up.readexactly(int(headers["content-length"])), keep
    if "chunked" in headers.get("transfer-encoding", ""):
        parts = [head]
        while True:
            line = await up.readuntil(b"\r\n")
            size = int(line.split(b";")[0], 16)
            parts += [line, await up.readexactly(size + 2)]
            if size == 0:
                if parts[-1] != b"\r\n":  # trailers: up to the empty line
                    parts.append(await up.readuntil(b"\r\n\r\n"))
                return b"".join(parts), keep
    return head + await up.read(), False  # delimited by the close


def main() -> None:
    """`python -m zephon.testing.fault_proxy UPSTREAM [--latency S] [--rewrite-host]`: a proxy in
    its own process (benchmarks: the proxy's work must not share the reader's GIL); prints its
    endpoint, then serves until killed or until its parent exits."""
    import argparse
    import os
    import sys
    import time

    ap = argparse.ArgumentParser()
    ap.add_argument("upstream")
    ap.add_argument("--latency", type=float, default=0.0)
    ap.add_argument("--rewrite-host", action="store_true")
    args = ap.parse_args()
    proxy = FaultProxy(args.upstream, rewrite_host=args.rewrite_host)
    proxy.faults.latency = args.latency
    print(proxy.endpoint, flush=True)
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(0.5)
    sys.exit(0)


if __name__ == "__main__":
    main()
