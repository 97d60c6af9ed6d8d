"""S3 endpoints that fail in ways a real S3 server does not, for the remote tier's deadline tests
and ``scripts/bench-remote-deadlines``: both on 127.0.0.1, in the caller's event loop.

* :class:`BlackHole`: a TCP server that accepts every connection and never answers a byte (a
  bucket behind a dead load balancer, a firewall that drops after the handshake).
* :class:`StallingProxy`: forwards every request to a real S3 endpoint (SeaweedFS,
  ``ocache.toolchain.s3server``) byte for byte (the client's signature stays valid: the ``Host``
  header is passed on as sent), except a GET whose key is under ``stall_prefix`` (``data/``: an
  entry's bytes): its status and headers and the first ``stall_after`` bytes of the body are sent,
  then nothing more until the connection is closed (a download that stalls mid-object).

Each counts what it saw (``accepted``, ``requests``, ``stalled``) and is stopped with
:meth:`close`.
"""

from __future__ import annotations

import asyncio
from typing import Any

#: request headers not passed on by the proxy (hop by hop) and response headers not copied back
_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "upgrade", "proxy-connection"}


class BlackHole:
    """Accepts and never answers. ``endpoint_url`` once :meth:`start` returned."""

    def __init__(self) -> None:
        self.server: asyncio.base_events.Server | None = None
        self.accepted = 0
        self._held: list[asyncio.StreamWriter] = []

    @property
    def endpoint_url(self) -> str:
        assert self.server is not None
        return "http://127.0.0.1:%d" % self.server.sockets[0].getsockname()[1]

    async def start(self) -> "BlackHole":
        async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.accepted += 1
            self._held.append(writer)   # read nothing, answer nothing, keep the socket open

        self.server = await asyncio.start_server(hold, "127.0.0.1", 0)
        return self

    async def close(self) -> None:
        for w in self._held:
            w.close()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


class StallingProxy:
    """A byte-for-byte proxy to ``upstream`` (an S3 endpoint URL) that stalls GETs of keys under
    ``stall_prefix`` after ``stall_after`` body bytes. ``endpoint_url`` once :meth:`start` returned."""

    def __init__(self, upstream: str, stall_prefix: str = "data/", stall_after: int = 65536) -> None:
        self.upstream = upstream.rstrip("/")
        self.stall_prefix = stall_prefix
        self.stall_after = int(stall_after)
        self.requests = 0
        self.stalled = 0
        self._runner: Any = None
        self._session: Any = None
        self._never = asyncio.Event()
        self.port = 0

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> "StallingProxy":
        import aiohttp
        from aiohttp import web

        self._session = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application(client_max_size=1 << 34)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]   # type: ignore[union-attr]
        return self

    async def _forward(self, request: Any) -> Any:
        from aiohttp import web

        self.requests += 1
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        # path-style keys: /<bucket>/<prefix/>data/...
        stall = request.method == "GET" and f"/{self.stall_prefix}" in request.path
        async with self._session.request(request.method, self.upstream + request.path_qs, data=body or None,
                                         headers=headers, skip_auto_headers=("Content-Type", "User-Agent",
                                                                             "Accept", "Accept-Encoding"),
                                         allow_redirects=False) as up:
            out = web.StreamResponse(status=up.status, headers={k: v for k, v in up.headers.items()
                                                                if k.lower() not in _HOP})
            await out.prepare(request)
            sent = 0
            async for chunk in up.content.iter_chunked(1 << 16):
                if stall and sent + len(chunk) > self.stall_after:
                    await out.write(chunk[:max(0, self.stall_after - sent)])
                    self.stalled += 1
                    await self._never.wait()    # until the proxy closes (the client gave up before)
                    return out
                await out.write(chunk)
                sent += len(chunk)
            await out.write_eof()
            return out

    async def close(self) -> None:
        self._never.set()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()
