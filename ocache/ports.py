"""What the proxy's rooms receive of the proxy: ``ProxyPorts``, the proxy as its rooms see it.

``Attempts`` (ocache/attempts.py), ``Finisher`` (ocache/finish.py), ``AdminRoutes``
(ocache/admin.py) and the response cache (ocache/response_cache.py) are handed the ``Proxy``
(ocache/proxy.py) but depend on this port instead: the parts of it they read, each one public.
The proxy imports its rooms; none of them imports the proxy. The types are protocols or values of
modules below the proxy, so that this module stays a leaf of the proxy's half.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Coroutine, Mapping, Protocol, TypeVar

import aiohttp
from aiohttp import web

from ocache.config import Config
from ocache.layer import Observation, ParsedRequest, Plan, ReceiptLedger
from ocache.record import Recorder
from ocache.stats import Stats
from ocache.upstream import Upstream

T = TypeVar("T")


class ForwardsPort(Protocol):
    """The sends to the upstreams (``ocache.forward.Forwards``)."""

    async def planned(self, up: Upstream, aw: Awaitable[T]) -> T: ...

    async def forward(self, up: Upstream, request: web.Request, rid: str, body: bytes, has_body: bool,
                      timeout: aiohttp.ClientTimeout, obs: Observation,
                      up_headers: Mapping[str, str] | None = None) -> aiohttp.ClientResponse | web.Response: ...

    def done(self, resp: aiohttp.ClientResponse) -> None: ...


class FinisherPort(Protocol):
    """The after-the-answer steps (``ocache.finish.Finisher``)."""

    async def release(self, rid: str, plan: Plan) -> None: ...

    async def after(self, preq: ParsedRequest, plan: Plan | None, obs: Observation,
                    observe: bool = True) -> None: ...

    def record(self, preq: ParsedRequest, plan: Plan | None, obs: Observation, timings: dict | None,
               split: int) -> dict[str, Any]: ...


class ResponsesPort(Protocol):
    """The response cache as the admin routes see it (``ocache.response_cache.ResponseCache``)."""

    def clear(self) -> dict[str, Any]: ...

    def stats(self) -> dict[str, Any]: ...


class ProxyPorts(Protocol):
    """The proxy (``ocache.proxy.Proxy``) as its rooms see it."""

    @property
    def config(self) -> Config: ...

    @property
    def stats(self) -> Stats: ...

    @property
    def layer(self) -> Any: ...

    @property
    def receipts(self) -> ReceiptLedger: ...

    @property
    def recorder(self) -> Recorder | None: ...

    @property
    def responses(self) -> ResponsesPort | None: ...

    @property
    def forwards(self) -> ForwardsPort: ...

    @property
    def finisher(self) -> FinisherPort: ...

    @property
    def upstreams(self) -> list[Upstream]: ...

    @property
    def upstream(self) -> Upstream: ...

    @property
    def inflight(self) -> int: ...

    @property
    def stop_event(self) -> asyncio.Event | None: ...

    @property
    def server_configs(self) -> list[Config] | None: ...

    def upstream_named(self, url: str | None) -> Upstream | None: ...

    def spawn(self, coro: Coroutine[Any, Any, Any], what: str = "request") -> asyncio.Task[Any]: ...

    def new_id(self) -> str: ...
