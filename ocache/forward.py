"""One send to one upstream, and the sends in flight to each (``Forwards``).

``Forwards.forward`` sends a request to an ``Upstream`` and returns its ``ClientResponse``, or
ocache's own answer when there is none: 503 (cannot connect, ``/health`` not answering, the upstream
stopped answering while this send waited), 504 (no byte in time), 502 (closed without answering,
or an answer that is not valid HTTP: any aiohttp client error). A pooled keep-alive connection the
server had already closed is resent once on a fresh one (no answer came, so nothing ran twice).

The sends, relays and plans (``Forwards.planned``) in flight are kept per upstream so that an
upstream that becomes hung (``hung_probes`` probes timed out: ``Upstream.on_hung``) ends them at
once (``Forwards.abort``) instead of leaving them to ``upstream_read_timeout_s``. What to do after an answer (re-plan, reroute, hold) is the
attempts loop's (``ocache/attempts.py``); this module sends once.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Awaitable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import aiohttp
from aiohttp import web
from yarl import URL

from ocache import admin
from ocache.config import Config
from ocache.layer import Observation
from ocache.stats import Stats
from ocache.upstream import Upstream
from ocache.wire import SKIP_AUTO, forward_request_headers

if TYPE_CHECKING:
    from ocache.layer import ParsedRequest

log = logging.getLogger("ocache.proxy")

T = TypeVar("T")

#: Routes llama-server answers at once, without its task queue (server-context.cpp:4635-4646):
#: forwarded with ``probe_timeout_s`` as their read timeout.
HEALTH_ROUTES = frozenset({"/health", "/v1/health"})

#: The upstream the current request is forwarded to (set per request task by the proxy and the
#: attempts loop; several servers behind one ocache: ``ocache/router.py``). Unset: the first one.
CURRENT_UPSTREAM: contextvars.ContextVar[Upstream] = contextvars.ContextVar("ocache_upstream")

#: request key: this request's forward could not connect (nothing reached the server)
CONNECT_FAILED: Any = (admin._Key("ocache_connect_failed", bool) if admin._Key
                       else "ocache_connect_failed")


class UpstreamHung(aiohttp.ClientConnectionError):
    """The upstream stopped answering (its /health probe timed out) while a forward was in flight."""


def read_timeout(config: Config, path: str, preq: ParsedRequest | None) -> aiohttp.ClientTimeout:
    """The upstream read timeout of one forward: ``probe_timeout_s`` for /health,
    ``stream_idle_timeout_s`` between chunks of a stream, ``upstream_read_timeout_s`` for the
    rest (aiohttp ``sock_read``: the longest wait for the next byte, seconds)."""
    if path in HEALTH_ROUTES:
        read = config.probe_timeout_s
    elif preq is not None and preq.stream:
        read = config.stream_idle_timeout_s
    else:
        read = config.upstream_read_timeout_s
    return aiohttp.ClientTimeout(total=None, sock_connect=10.0, sock_read=read)


def unavailable(config: Config, up: Upstream, rid: str) -> web.Response:
    """ocache's 503 for an upstream it cannot reach: the URL, its last error, ``Retry-After``
    (``retry_after_s``) and ``X-OCache-Upstream``."""
    url = up.base_url
    resp = admin.error(503, f"llama-server at {url} is not reachable ({up.last_error}); "
                       "ocache will forward as soon as it is up", "unavailable_error", rid,
                       upstream=url)
    resp.headers["Retry-After"] = str(config.retry_after_s)
    resp.headers["X-OCache-Upstream"] = url
    return resp


def upstream_failed(up: Upstream, rid: str, status: int, when: str, exc: BaseException,
                    timeout: aiohttp.ClientTimeout) -> web.Response:
    """ocache's 502/504 for an upstream that failed ``when`` ("before answering", "while
    answering"), in the one error shape, with the reason; logged at WARNING."""
    url = up.base_url
    if isinstance(exc, asyncio.TimeoutError):
        what = (f"sent no byte for {timeout.sock_read:g} s {when} (upstream_read_timeout_s / "
                "stream_idle_timeout_s)")
    elif isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
                          aiohttp.ClientConnectionResetError)) and when == "before answering":
        what = f"closed the connection without answering ({type(exc).__name__})"
    else:
        what = f"failed {when}: {type(exc).__name__}: {exc}"
    log.warning("[%s] upstream %s %s", rid, url, what)
    return admin.error(status, f"upstream {url} {what}", "server_error" if status == 502
                       else "timeout_error", rid, upstream=url)


class Forwards:
    """The forwards in flight: sends still waiting for an answer's head (their handler tasks) and
    answers being relayed (their ``ClientResponse``), each with its upstream."""

    def __init__(self, config: Config, stats: Stats) -> None:
        self.config = config
        self.stats = stats
        self._sending: set[asyncio.Task[Any]] = set()   # handler tasks awaiting an answer's head
        self._aborted: set[asyncio.Task[Any]] = set()   # of those, the ones abort() cancelled
        self._relaying: set[aiohttp.ClientResponse] = set()
        self._up: dict[object, Upstream] = {}            # send task / response -> its upstream

    def done(self, resp: aiohttp.ClientResponse) -> None:
        """``resp`` is no longer relayed (read, released or closed)."""
        self._relaying.discard(resp)
        self._up.pop(resp, None)

    def abort(self, reason: str, up: Upstream | None = None) -> None:
        """The upstream ``up`` (None: every one) stopped answering: end every forward in flight to
        it now (their answers would never come; without this they would wait for
        ``upstream_read_timeout_s``). A send waiting for its head gets ocache's 503; a relay in
        progress is cut (``UpstreamHung`` raised into its body)."""
        sending = [t for t in self._sending if up is None or self._up.get(t) is up]
        relaying = [r for r in self._relaying if up is None or self._up.get(r) is up]
        if sending or relaying:
            log.warning("upstream stopped answering: ending %d forward(s) in flight",
                        len(sending) + len(relaying))
        for task in sending:
            if task not in self._aborted:
                self._aborted.add(task)
                task.cancel(msg="upstream hung")
        for resp in relaying:
            resp.content.set_exception(UpstreamHung(f"stopped answering mid-response ({reason})"))

    async def planned(self, up: Upstream, aw: Awaitable[T]) -> T:
        """Await ``aw`` (a request's plan: its token view, a restore, a warm-up, all sent to ``up``)
        as a forward in flight: the hung verdict (``abort``) ends it with ``UpstreamHung`` instead of
        leaving the client to the plan's own bounds (a server stopped during a restore kept the
        client 75 s). The plan sees a cancellation (it releases what it holds, as
        when the client leaves). Raises what ``aw`` raises, ``asyncio.CancelledError`` when the
        client left."""
        task = asyncio.current_task()
        assert task is not None
        self._sending.add(task)
        self._up[task] = up
        try:
            return await aw
        except asyncio.CancelledError:
            if task not in self._aborted or task.cancelling() != 1:
                raise
            task.uncancel()
            raise UpstreamHung("stopped answering while the request was planned") from None
        finally:
            self._sending.discard(task)
            self._up.pop(task, None)
            self._aborted.discard(task)

    async def forward(self, up: Upstream, request: web.Request, rid: str, body: bytes, has_body: bool,
                      timeout: aiohttp.ClientTimeout, obs: Observation,
                      up_headers: Mapping[str, str] | None = None) -> aiohttp.ClientResponse | web.Response:
        """Send ``request`` (with ``body``, bytes; ``up_headers``: the plan's
        ``upstream_headers``, added) to ``up``: its ``ClientResponse``, now in flight, or ocache's
        own 502/503/504 (``obs.status`` set to it). A connection refused sets
        ``request[CONNECT_FAILED]``. Raises ``asyncio.CancelledError`` when the client left."""
        task = asyncio.current_task()
        assert task is not None
        self._sending.add(task)
        self._up[task] = up
        try:
            resp = await self._send(up, request, body, has_body, timeout, up_headers)
            self._relaying.add(resp)
            self._up[resp] = up
            return resp
        except asyncio.CancelledError:
            # abort() cancelled this handler once (the upstream stopped answering) and nothing
            # else did (a client that left cancels it too: then it stays cancelled)
            if task not in self._aborted or task.cancelling() != 1:
                raise
            task.uncancel()
            obs.status = 503
            self.stats.upstream_unavailable()
            return unavailable(self.config, up, rid)
        except aiohttp.ClientConnectorError as exc:
            obs.status = 503
            request[CONNECT_FAILED] = True
            up.notify_unreachable(f"{type(exc).__name__}: {exc}")
            self.stats.upstream_unavailable()
            return unavailable(self.config, up, rid)
        except asyncio.TimeoutError as exc:
            if request.path in HEALTH_ROUTES:
                # this client's /health got no answer in time: its 503, and a shared probe now; the
                # hung verdict is the probe's (``hung_probes`` misses in a row), never one request's
                obs.status = 503
                up.last_error = f"no answer to {request.path} in {timeout.sock_read:g} s"
                up.poke()
                self.stats.upstream_unavailable()
                return unavailable(self.config, up, rid)
            obs.status = 504
            up.poke()
            return upstream_failed(up, rid, 504, "before answering", exc, timeout)
        except aiohttp.ClientError as exc:
            obs.status = 502
            up.poke()
            return upstream_failed(up, rid, 502, "before answering", exc, timeout)
        finally:
            self._sending.discard(task)
            self._up.pop(task, None)
            self._aborted.discard(task)

    async def _send(self, up: Upstream, request: web.Request, body: bytes, has_body: bool,
                    timeout: aiohttp.ClientTimeout | None = None,
                    up_headers: Mapping[str, str] | None = None) -> aiohttp.ClientResponse:
        url = URL(up.base_url + request.raw_path, encoded=True)
        headers = forward_request_headers(request.headers)
        if up_headers:
            # a header the client sent itself is forwarded as it is (a client's own
            # X-Llama-Server-If-Boot, patches/0007, is its precondition for the server to judge)
            headers.update({k: v for k, v in up_headers.items() if k not in headers})
        has_body = has_body or bool(body) or "Content-Length" in request.headers
        kw: dict[str, Any] = dict(data=body if has_body else None, headers=headers,
                                  skip_auto_headers=SKIP_AUTO, allow_redirects=False,
                                  auto_decompress=False)
        if timeout is not None:
            kw["timeout"] = timeout
        session = up.session
        assert session is not None, "Upstream.start() opens the session"
        try:
            return await session.request(request.method, url, **kw)
        except aiohttp.ClientConnectorError:
            raise
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            # A pooled keep-alive connection the server had already closed (idle timeout, restart):
            # the request did not get an answer, so one resend on a fresh connection is safe.
            log.debug("upstream connection dropped before an answer (%s); resending once", exc)
            up.poke()  # a dropped connection may mean a restart: check the boot id now
            return await session.request(request.method, url, **kw)
