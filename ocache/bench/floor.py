"""The floor under any Python relay on this machine, for ``scripts/bench-proxy --floor``: the least
an aiohttp reverse proxy and an asyncio byte pump cost per request, measured beside ``ocache
serve`` in one interleaved run (so that ocache's own added latency can be read against what the
framework alone costs here).

* ``aiohttp``: a minimal aiohttp reverse proxy (one route: read the body, one pooled
  ``ClientSession`` request upstream with the same method, path, body and content type, relay the
  status, content type and body chunk by chunk). No timeouts, no header hygiene, no fail-open: the
  framework's cost only, not a usable proxy.
* ``tcp``: an asyncio byte pump (``asyncio.Protocol`` both ways, ``TCP_NODELAY``): no HTTP parsing
  at all, one upstream connection per client connection.

Usage: ``python -m ocache.bench.floor aiohttp|tcp UPSTREAM_URL PORT`` (binds 127.0.0.1:PORT and
serves until killed).
"""

from __future__ import annotations

import asyncio
import socket
import sys
from typing import cast
from urllib.parse import urlsplit


def run_aiohttp(upstream: str, port: int) -> None:
    """Serve the minimal aiohttp relay on 127.0.0.1:``port`` until killed."""
    import aiohttp
    from aiohttp import web

    async def relay(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {"Content-Type": request.headers["Content-Type"]} if "Content-Type" in request.headers else {}
        async with request.app["session"].request(request.method, upstream + request.path_qs,
                                                  data=body or None, headers=headers) as up:
            resp = web.StreamResponse(status=up.status)
            if "Content-Type" in up.headers:
                resp.headers["Content-Type"] = up.headers["Content-Type"]
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    async def start(app: web.Application) -> None:
        app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def stop(app: web.Application) -> None:
        await app["session"].close()

    app = web.Application()
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_route("*", "/{tail:.*}", relay)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


class _Pipe(asyncio.Protocol):
    """One direction's socket; writes what it receives to its peer (buffered until the peer is up)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: _Pipe | None = None
        self.pending: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a TCP stream's transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.write(data)
        else:
            self.pending.append(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()


def _host_port(url: str) -> tuple[str, int]:
    """The host and port of ``url``; raises ValueError when it names no port."""
    up = urlsplit(url)
    if up.hostname is None or up.port is None:
        raise ValueError(f"the upstream needs a host and a port: {url}")
    return up.hostname, up.port


def run_tcp(upstream: str, port: int) -> None:
    """Serve the byte pump on 127.0.0.1:``port`` until killed."""
    up_host, up_port = _host_port(upstream)

    class Front(_Pipe):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            asyncio.get_running_loop().create_task(self._connect())

        async def _connect(self) -> None:
            back = _Pipe()
            back.peer = self
            transport, _ = await asyncio.get_running_loop().create_connection(
                lambda: back, up_host, up_port)
            self.peer = back
            for data in self.pending:
                transport.write(data)
            self.pending.clear()

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Front, "127.0.0.1", port)
        await server.serve_forever()

    asyncio.run(main())


if __name__ == "__main__":
    kind, url, p = sys.argv[1], sys.argv[2].rstrip("/"), int(sys.argv[3])
    {"aiohttp": run_aiohttp, "tcp": run_tcp}[kind](url, p)
