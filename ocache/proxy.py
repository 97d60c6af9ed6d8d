"""``ocache serve``: a transparent, fail-open asyncio reverse proxy in front of llama-server.

Clients change only their base URL. Every route is forwarded (any method, path, query, body and
headers); completion routes (``layer.COMPLETION_ROUTES``) with a JSON object body are first shown
to the cache layer, which may set top-level body fields (e.g. ``id_slot``). Any exception in the
cache layer is logged with the request id and the request is forwarded untouched; a body ocache
cannot re-encode exactly (``parse_body``: not UTF-8 - UTF-16/32, a BOM, Latin-1 -, invalid JSON,
nested too deeply, not an object, a lone surrogate) is forwarded byte for byte and never planned
(counted as ``unplannable``, not as a layer error), so the client gets the upstream's own answer.

Relay rules:

* Hop-by-hop headers (RFC 9110 §7.6.1: ``Connection`` and the headers it names, ``Keep-Alive``,
  ``TE``, ``Trailer``, ``Transfer-Encoding``, ``Upgrade``, ``Proxy-*``) are dropped in both
  directions; ``Host`` and ``Content-Length`` are set for the upstream hop; ``Authorization`` and
  everything else pass through. No compression is added or removed (``Content-Encoding`` passes as
  is, ``auto_decompress`` is off on both sides).
* SSE (``text/event-stream``) is relayed chunk by chunk as it arrives (no buffering, no
  re-chunking), without Content-Length, with ``X-Accel-Buffering: no``. Events are parsed only to
  read ``timings``/``usage``, after the chunk was written. The upstream body is never modified,
  with one exception: when the layer prefilled part of the prompt itself for this request
  (``Plan.split_tokens`` > 0), the reuse figures of a 200 completion response
  (``timings.cache_n``/``prompt_n``/``prompt_ms``, ``usage.prompt_tokens_details.cached_tokens``)
  are corrected to count only what was reused from before the request (ocache/api/figures.py), in a
  stream line by line (a line is held back only until its end arrives).
* A client disconnect cancels the handler (aiohttp ``handler_cancellation``) and closes the
  upstream connection at once; llama-server then cancels the task and the slot goes idle.
* Upstream answers (400, 500, ...) reach the client unchanged. When the upstream cannot be
  reached ocache answers 503 with ``Retry-After`` and an error naming the URL; when it closes the
  connection before answering, or answers something that is not valid HTTP (any aiohttp client
  error), 502 with the reason; when it sends no byte for ``upstream_read_timeout_s`` (non-streamed)
  504; a stream that sends no chunk for ``stream_idle_timeout_s`` is cut (no clean end).
* Bounded waits: while the upstream is not known ready, each request waits for the one shared
  ``/health`` probe at most ``PROBE_WAIT_S``, and not at all while it is known hung (503 +
  ``Retry-After`` at once); a client's ``/health`` is forwarded with ``probe_timeout_s``. When the
  upstream becomes hung (a probe timed out: llama-server answers ``/health`` at once even while
  busy), the forwards in flight end at once (503, or a cut stream). While llama-server loads its
  model (``/health`` 503 "Loading model", after a start or a restart, even one inside the probe
  window) requests are held until it is ready, at most ``loading_wait_s``; then they get the
  server's 503 with ``Retry-After``. Client side: a request body that stalls for
  ``client_idle_timeout_s`` gets 408, idle keep-alive connections close after
  ``client_keepalive_s``, bodies above ``max_body_mb`` get 413.
* An upstream that is not llama-server (``Upstream.state == "foreign"``) is reported once in the log;
  requests are forwarded to it without the cache layer.

Several llama-servers (config ``upstreams``, or ``launch_replicas`` > 1 with ``--launch``): one
``Upstream`` per server, the layer is ``ocache.router.Router`` (one cache layer per server), and a
planned request goes to the server its plan names (``Plan.upstream``; ``X-OCache-Upstream`` and
``X-OCache-Route`` say which and why), everything else to the first ready server. Each rule above
holds per server (its probe, its 503, its hung forwards ended). A request whose server refuses the
connection (it never reached it) is planned once more on the others; nothing that reached a server
is sent again.

Routes served by ocache itself (everything else, ``/metrics`` included, goes to llama-server):

| route | answer |
|---|---|
| ``GET /v1/cache/stats`` | JSON: proxy counters, upstream state/epoch, ``layer.stats()`` |
| ``GET /v1/cache/metrics`` | Prometheus text (``stats.py`` lists the metrics) |
| ``POST /v1/cache/clear?tier=all`` | ``layer.clear(tier)`` |
| ``POST /v1/cache/warm`` ``{"dir": "/abs/path"}`` | ``ocache warm DIR``: warm that folder's head (NDJSON progress lines; 404 if the folder was never seen, 400 for a dir that is not absolute or holds NUL; ocache/warm.py) |
| ``POST /v1/cache/drain`` | ``ocache drain``: planned stop, like SIGTERM (ocache/tiers/spill.py) |

One guard (``AdminRoutes.guard``, ``ocache/admin.py``) runs in front of every route: the
DNS-rebinding guard, the admin token for clear/warm/drain (404 when no ``admin_token`` is configured,
401 without the right ``Authorization: Bearer``), stats redacted (no session ids, no slot owners)
without the token, and 403 for a client's ``POST /slots/{id}?action=save|restore|erase`` while a
cache layer owns the slots. Every error ocache answers has one shape,
``{"error": {"code", "message", "type"}}``.

Response headers added by ocache (all ``X-OCache-*``):

| header | when | meaning |
|---|---|---|
| ``X-OCache-Request-Id`` | every response | id of this request in ocache's log lines |
| ``X-OCache-Fail-Open`` | completion, layer raised | ``plan``: the cache layer failed; request forwarded untouched |
| ``X-OCache-Figures`` | known conversation's turn | ``late``: its figures were not ready when the answer began (``FIGURES_WAIT_S``); they reach the log line and ``last_completions`` |
| ``X-OCache-Upstream`` | 503 from ocache; several servers: every planned request | the upstream URL that could not be reached / that served the request |
| ``X-OCache-Route`` | several servers, planned request | why that server (ocache/router.py) |
| ``X-OCache-Tier`` | set by the layer | where the reused prefix came from (``resident``/``head``/``disk``/``session``/``cold``; ``response``: the whole answer replayed by the response cache, ocache/response_cache.py) |
| ``X-OCache-Split``, ``-Prefilled``, ``-Reused`` | set by the layer | tokens ocache prefilled itself for this request; tokens the server prefills for it (ocache's steps included); tokens reused from before it (see ``ocache/cache/orchestrator.py``) |
| other ``X-OCache-*`` | set by the layer | see ``ocache/cache/orchestrator.py`` (e.g. ``X-OCache-Slot``) |

Where each part lives (one concern per module; ``Proxy`` reads as read -> parse -> plan -> send
with recovery -> relay -> finish): ``ocache/wire.py`` (headers across the hop, the bodies ocache
may re-encode), ``ocache/attempts.py`` (plan, send and the recovery loop), ``ocache/forward.py``
(one send to one upstream, the forwards in flight, ocache's own 502/503/504),
``ocache/relay.py`` (relay and SSE observation), ``ocache/finish.py`` (the log line, the record,
release and observe), ``ocache/admin.py`` (the guard and ocache's own routes),
``ocache/lifecycle.py`` (start, planned stop, close), ``ocache/serving.py`` (``ocache serve``).
Every release of a plan is a receipt spent once (``ocache.layer.Receipt``); ``GET
/v1/cache/stats`` ``plans.held`` counts those not spent yet (0 when idle).

Logging: one line per completion at INFO (request id, route, status, slot, tier, ``split N`` when
ocache prefilled N tokens itself, the corrected timings, TTFT, total); other routes at DEBUG.

DNS-rebinding guard: a request whose ``Host`` header names neither localhost/127.0.0.1/::1, nor the
bound host, nor a name in ``allowed_hosts`` gets 403 (``allowed_hosts: ['*']`` disables the guard).

``ocache serve --launch`` whose child cannot start (``launch_max_failures`` exits in a row within 5 s
of a start) stops and exits with status 1, printing the last child's log tail (ocache/supervisor.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import secrets
import time
from typing import TYPE_CHECKING, Any, Callable

import aiohttp
from aiohttp import web

from ocache import admin, dashboard
from ocache.admin import AdminRoutes
from ocache.background import Background
from ocache.api import figures
from ocache.attempts import PROBE_WAIT_S, STALE_REPLANS, Attempt, Attempts
from ocache.config import Config
from ocache.finish import PLAN_COMPLETION_WAIT_S, Finisher, request_line
from ocache.forward import CURRENT_UPSTREAM, UpstreamHung, Forwards, read_timeout, upstream_failed
from ocache.layer import (COMPLETION_ROUTES, CacheLayer, NullLayer, Observation, ParsedRequest, Plan,
                          ReceiptLedger)
from ocache.lifecycle import QUIESCE_S, Lifecycle
from ocache.relay import SSEObserver, collects, observe_json, relay_stream
from ocache.response_cache import ResponseCache
from ocache.stats import Stats
from ocache.upstream import Upstream, UpstreamPort
from ocache.warm import make_warm_handler
from ocache.wire import (HOP_BY_HOP, Unparseable, forward_request_headers, forward_response_headers,
                         host_name, parse_body, with_fields)

if TYPE_CHECKING:
    from ocache.record import Recorder

__all__ = [
    "COMPLETION_ROUTES", "FIGURES_WAIT_S", "HOP_BY_HOP", "PLAN_COMPLETION_WAIT_S", "PROBE_WAIT_S",
    "QUIESCE_S", "RUNNER_KWARGS", "STALE_REPLANS", "Observation", "ParsedRequest", "Plan", "Proxy",
    "Unparseable", "UpstreamHung", "default_layer_factory", "forward_request_headers",
    "forward_response_headers", "host_name", "parse_body", "request_line", "with_fields",
]

log = logging.getLogger("ocache.proxy")

#: Non-streamed responses up to this size are read whole and sent with one write; larger ones and
#: those without Content-Length are relayed as they arrive (completion routes are always read whole
#: when not SSE, to observe ``timings``).
_READ_WHOLE_MAX = 4 << 20
#: Keyword arguments for aiohttp's AppRunner / TestServer (besides handler_cancellation=True).
RUNNER_KWARGS: dict[str, Any] = dict(auto_decompress=False, access_log=None, max_field_size=65536)
#: seconds the answer's headers may wait for a known turn's ``completion`` so that its figures go
#: into them; 0: never (the figures then reach the log line and /v1/cache/stats only). The test
#: suite sets it high (tests/conftest.py) where tests read figures from headers; the default is
#: covered by tests/test_known_turn.py
FIGURES_WAIT_S = 0.0


def default_layer_factory(no_cache: bool = False) -> Callable[[UpstreamPort, Config], CacheLayer]:
    """``OCacheLayer`` from ``ocache.cache`` if importable (and not ``no_cache``), else NullLayer."""
    if not no_cache:
        try:
            from ocache.cache import OCacheLayer

            return OCacheLayer
        except ImportError as exc:
            log.warning("cache layer not available (%s): forwarding without cache", exc)
    return NullLayer


class Proxy(Lifecycle):
    """The proxy: ``make_app()`` gives the aiohttp Application; ``start``/``close`` run with it
    (``Lifecycle``, ocache/lifecycle.py).

    ``layer_factory(upstream, config) -> CacheLayer`` builds the cache layer once the upstream
    object exists. ``pid_source`` (the supervisor's) feeds the upstream's restart detection.

    Several servers (config ``upstreams``, or ``launch_replicas`` > 1): one ``Upstream`` each
    (``upstreams``; ``pid_sources`` one per server), the layer is ``ocache.router.Router`` over one
    ``layer_factory`` layer per server (``server_configs``: each server's Config, default this one
    with its ``upstream``), and each request is forwarded to the server its plan names
    (``Plan.upstream``), other routes to the first ready one. ``upstream`` is the current request's
    server (a context variable set per request), else the first.
    """

    def __init__(self, config: Config, layer_factory: Callable[[UpstreamPort, Config], Any] | None = None,
                 pid_source: Callable[[], int | None] | None = None,
                 monitor: bool = True, pid_sources: list[Callable[[], int | None] | None] | None = None,
                 server_configs: list[Config] | None = None) -> None:
        self.config = config
        urls = list(config.upstreams or []) or [config.upstream]
        pids = list(pid_sources or []) or [pid_source]
        self.upstreams = [Upstream(u, api_key=config.upstream_api_key,
                                   probe_interval_s=config.probe_interval_s,
                                   pid_source=pids[i] if i < len(pids) else None,
                                   probe_timeout_s=config.probe_timeout_s,
                                   hung_probes=config.hung_probes)
                          for i, u in enumerate(urls)]
        self.server_configs = server_configs or (
            [dataclasses.replace(config, upstream=u, upstreams=[]) for u in urls] if len(urls) > 1
            else None)
        self._layer_factory = layer_factory or default_layer_factory(config.no_cache)
        self.layer: Any = None
        self.stats = Stats(layer_stats=self._layer_stats)
        self.inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.background = Background("proxy")   # a request's release, observe and record
        self._ids = itertools.count(1)
        self._id_prefix = secrets.token_hex(2)
        self._monitor = monitor
        self.recorder: Recorder | None = None
        #: set by ``serve()``: the event a planned stop (SIGTERM, ``POST /v1/cache/drain``) sets
        self.stop_event: asyncio.Event | None = None
        #: the receipts of the plans in hand (``ocache/layer.py``): each released exactly once
        self.receipts = ReceiptLedger()
        self.forwards = Forwards(config, self.stats)
        #: the response cache, when the config enables it (ocache/response_cache.py)
        self.responses = ResponseCache.from_config(config)
        self.attempts = Attempts(self)
        self.finisher = Finisher(self)
        self.admin = AdminRoutes(self, self._own_routes(), dashboard.handle)

    def _own_routes(self) -> dict[str, Any]:
        """Admin routes whose handlers live with their tier: ``POST /v1/cache/warm`` (``ocache warm
        DIR``, ocache/warm.py) and ``POST /v1/cache/drain`` (``ocache drain``, ocache/tiers/spill.py)."""
        def warm_deps() -> Any:
            get = getattr(self.layer, "warm_deps", None)
            return get() if get is not None else None

        def request_stop() -> None:
            if self.stop_event is not None:
                self.stop_event.set()

        return {"/v1/cache/warm": make_warm_handler(warm_deps, self.config.admin_token),
                "/v1/cache/drain": admin.make_drain_handler(request_stop, self.config.admin_token)}

    @property
    def upstream(self) -> Upstream:
        """The upstream of the request being handled (``Plan.upstream``), else the first."""
        return CURRENT_UPSTREAM.get(self.upstreams[0])

    def default_upstream(self) -> Upstream:
        """Where a request goes that no plan routes: the first ready server, else the first not
        known hung, else the first."""
        for up in self.upstreams:
            if up.state == "ready":
                return up
        for up in self.upstreams:
            if not up.hung:
                return up
        return self.upstreams[0]

    def upstream_named(self, url: str | None) -> Upstream | None:
        """The upstream whose base URL is ``url`` (a plan's ``Plan.upstream``), if any."""
        if not url:
            return None
        return next((u for u in self.upstreams if u.base_url == url.rstrip("/")), None)

    def _layer_stats(self) -> dict[str, Any]:
        out = self.layer.stats() if self.layer is not None else {}
        if self.responses is not None:   # ocache_layer_stat{key="response_cache.hits"}, ...
            out = {**out, "response_cache": self.responses.stats()}
        return out

    def stats_body(self) -> dict[str, Any]:
        """The ``GET /v1/cache/stats`` JSON (``AdminRoutes.stats_body``, ocache/admin.py)."""
        return self.admin.stats_body()

    def new_id(self) -> str:
        return f"{self._id_prefix}{next(self._ids):05x}"

    # --- request handling -----------------------------------------------------------------------
    async def handle(self, request: web.Request) -> web.StreamResponse:
        rid = request.get(admin.RID) or self.new_id()
        own = await self.admin.serve(request, rid)
        if own is not None:
            return own
        self.inflight += 1
        self._idle.clear()
        # a completion is in flight from here (before its plan, so before it is routed) to its last
        # byte relayed, on every upstream (servers behind one ocache may share the machine's
        # cores): background work that needs a server's CPU, such as the checks the plan spawns,
        # waits until none is (Upstream.quiet, ocache/upstream.py)
        generation = contextlib.ExitStack()
        if request.method == "POST" and request.path in COMPLETION_ROUTES:
            for up in self.upstreams:
                generation.enter_context(up.generation())
        try:
            with generation:
                return await self._proxy(request, rid)
        finally:
            self.inflight -= 1
            if self.inflight == 0:
                self._idle.set()

    async def _proxy(self, request: web.Request, rid: str) -> web.StreamResponse:
        """read -> parse -> (the response cache) -> plan -> send with recovery
        (``ocache/attempts.py``) -> relay -> finish."""
        t0 = time.perf_counter()
        has_body = request.body_exists
        body = await self._read(request, rid)
        if not isinstance(body, bytes):
            return body                      # ocache's 408 / 413
        if len(self.upstreams) > 1:
            CURRENT_UPSTREAM.set(self.default_upstream())
        preq = None
        if request.method == "POST" and request.path in COMPLETION_ROUTES:
            preq = self._parse(request, rid, request.method, request.path, body)
        att = Attempt(request, rid, t0, body, has_body, preq, self._read_timeout(request.path, preq))
        # the response cache (ocache/response_cache.py): a stored answer replayed, or this request
        # answers its key (its answer recorded and settled once it is over), or not cached; never
        # for credentials the server refuses now (a key the restarted server no longer accepts)
        lead = await self.responses.serve(self, att) if self.responses is not None and (
            preq is None or preq.body is None or self.upstream.state != "ready"
            or await self.attempts.accepted(att)) else None
        if isinstance(lead, web.StreamResponse):
            return lead
        try:
            return await self._answer(att)
        finally:
            if self.responses is not None and lead is not None:
                self.responses.settle(lead, att)

    async def _answer(self, att: Attempt) -> web.StreamResponse:
        """plan -> send with recovery -> relay -> finish, for one request read and parsed."""
        down = await self.attempts.plan(att)
        if down is not None:
            return down                      # ocache's 503: not reachable (no plan was made)
        disconnected = False
        try:
            up_resp = await self.attempts.send(att)
            if not isinstance(up_resp, aiohttp.ClientResponse):
                return up_resp               # ocache's own 502/503/504
            return await self._relay(att, up_resp)
        except asyncio.CancelledError:
            disconnected = True
            raise
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            disconnected = True
            return att.sent or web.Response(status=499)
        finally:
            self._end_request(att, disconnected)

    async def _read(self, request: web.Request, rid: str) -> bytes | web.Response:
        """The request body, or ocache's answer when it cannot be read: 408 (stalled for
        ``client_idle_timeout_s``), 413 (above ``max_body_mb``; the connection then closes)."""
        path = request.path
        try:
            return await self._read_body(request)
        except asyncio.TimeoutError:
            self.stats.request(path, 408)
            return admin.error(408, f"the request body stalled: no byte for "
                               f"{self.config.client_idle_timeout_s:g} s (client_idle_timeout_s)",
                               "timeout_error", rid)
        except web.HTTPRequestEntityTooLarge:
            # ocache's own limit (llama-server has none): its answer in the one error shape, counted
            # and logged like every answer; the rest of the body is not read, so the connection closes
            self.stats.request(path, 413)
            log.info("[%s] %s %s 413: request body above max_body_mb (%g MB)", rid, request.method,
                     path, self.config.max_body_mb)
            resp = admin.error(413, f"the request body is larger than max_body_mb "
                               f"({self.config.max_body_mb:g} MB)", "invalid_request_error", rid)
            resp.force_close()
            return resp

    async def _read_body(self, request: web.Request) -> bytes:
        """The whole request body; ``asyncio.TimeoutError`` when the client sends no byte for
        ``client_idle_timeout_s``; ``web.HTTPRequestEntityTooLarge`` above ``max_body_mb``."""
        if not request.body_exists:
            return b""
        limit = int(self.config.max_body_mb * (1 << 20))  # as the Application's client_max_size
        idle = self.config.client_idle_timeout_s
        parts: list[bytes] = []
        size = 0
        content = request.content
        while True:
            # what has arrived already needs no timer (a small body is there with its headers)
            chunk = content.read_nowait()
            if not chunk:
                if content.at_eof():
                    break
                async with asyncio.timeout(idle):
                    chunk = await content.readany()
                if not chunk:
                    break
            size += len(chunk)
            if limit and size > limit:
                raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=size)
            parts.append(chunk)
        return b"".join(parts)

    def _parse(self, request: web.Request, rid: str, method: str, path: str,
               body: bytes) -> ParsedRequest:
        try:
            obj = parse_body(body)
        except Unparseable as exc:
            # forwarded byte for byte: the upstream's answer, whatever it is (not a layer error)
            log.debug("[%s] body not planned: %s", rid, exc)
            self.stats.unplannable("body")
            obj = None
        hint = request.headers.get("x-session-affinity") or request.headers.get("x-session-id")
        return ParsedRequest(request_id=rid, method=method, path=path, body=obj,
                             headers=request.headers, session_hint=hint,
                             stream=bool(obj is not None and obj.get("stream") is True))

    def _read_timeout(self, path: str, preq: ParsedRequest | None) -> aiohttp.ClientTimeout:
        """The upstream read timeout of one forward (``ocache.forward.read_timeout``)."""
        return read_timeout(self.config, path, preq)

    # --- relay ----------------------------------------------------------------------------------
    async def _relay(self, att: Attempt, up_resp: aiohttp.ClientResponse) -> web.StreamResponse:
        """Relay the upstream's answer: SSE chunk by chunk, a completion (or a small answer) read
        whole, anything else as it arrives (ocache/relay.py)."""
        await self._late_figures(att)
        plan, obs = att.plan, att.obs
        obs.status = up_resp.status
        headers = forward_response_headers(up_resp.headers)
        headers.update(att.extra)
        if up_resp.status >= 400:   # no answer: no figures, nothing the plan found
            for name in [h for h in headers if h.lower().startswith("x-ocache-")
                         and h.lower() not in figures.Figures.ERROR_HEADERS]:
                headers.pop(name, None)
        if up_resp.status == 503 and self.upstream.state == "loading":
            headers["Retry-After"] = str(self.config.retry_after_s)
        split = plan.split_tokens if plan is not None and up_resp.status == 200 else 0
        # the sampled ids the plan asked for (patches/0010) never reach the client
        rewrite = split > 0 or (plan is not None and bool(plan.body_updates.get("ocache_generated")))
        if up_resp.headers.get("Content-Type", "").startswith("text/event-stream"):
            idle = self.config.stream_idle_timeout_s
            return await relay_stream(att.request, up_resp, headers, obs, att.t0,
                                      SSEObserver(collects(self.layer, att.path), att.keep)
                                      if att.preq is not None else None,
                                      idle_s=idle if att.timeout.sock_read != idle else None,
                                      rewriter=figures.LineRewriter(split, plan.split_ms)
                                      if plan is not None and rewrite else None,
                                      on_upstream_failed=self.upstream.poke)
        if (att.request.method == "POST" and att.path in COMPLETION_ROUTES) or att.request.method == "HEAD" \
                or (up_resp.content_length is not None and up_resp.content_length <= _READ_WHOLE_MAX):
            return await self._relay_whole(att, up_resp, headers, split, rewrite)
        return await relay_stream(att.request, up_resp, headers, obs, att.t0, None,
                                  on_upstream_failed=self.upstream.poke)

    async def _late_figures(self, att: Attempt) -> None:
        """A plan that finishes while the server works (``ocache.cache.routes.known.complete``): its figures
        go into the headers only if they are ready now (or within ``FIGURES_WAIT_S``); by default
        the answer never waits for them (they reach the log line and /v1/cache/stats once they
        are), and it says ``X-OCache-Figures: late``."""
        plan = att.plan
        if plan is None or plan.completion is None:
            return
        if not plan.completion.done() and FIGURES_WAIT_S > 0:
            await asyncio.wait({plan.completion}, timeout=FIGURES_WAIT_S)
        if plan.completion.done():
            att.extra.update(plan.headers)
        else:
            att.extra["X-OCache-Figures"] = "late"
            self.stats.figures_late()

    async def _relay_whole(self, att: Attempt, up_resp: aiohttp.ClientResponse, headers: Any,
                           split: int, rewrite: bool = False) -> web.StreamResponse:
        """Read the answer whole (observed: ``timings``, ``usage``, content; its reuse figures
        corrected for ``split``), then send it with one write; ocache's 502/504 when the upstream
        fails before its whole answer arrived (nothing sent yet)."""
        obs = att.obs
        try:
            data = await up_resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            obs.status = 504 if isinstance(exc, asyncio.TimeoutError) else 502
            self.upstream.poke()
            return upstream_failed(self.upstream, att.rid, obs.status, "while answering", exc, att.timeout)
        obs.ttft_s = time.perf_counter() - att.t0
        if att.preq is not None and data:
            observe_json(att.path, data, obs)
        if att.keep is not None:
            att.keep += data      # the response cache's record (ocache/response_cache.py)
        if rewrite and data and att.plan is not None:
            data = figures.rewrite(data, split, att.plan.split_ms)
        att.sent = web.Response(status=up_resp.status, reason=up_resp.reason, headers=headers, body=data)
        await att.sent.prepare(att.request)
        await att.sent.write_eof()
        obs.completed = True
        return att.sent

    # --- finish ---------------------------------------------------------------------------------
    def _end_request(self, att: Attempt, disconnected: bool) -> None:
        """The request is over (relayed, failed, or the client gone): the upstream connection
        released (kept alive only after a complete answer; closed, llama-server cancels the task),
        the status counted, and for a completion ``Finisher.finish`` with the plan in hand."""
        obs = att.obs
        obs.total_s = time.perf_counter() - att.t0
        up_resp = att.up_resp
        if up_resp is not None:
            self.forwards.done(up_resp)
            if obs.completed:
                up_resp.release()
            else:
                up_resp.close()  # drop the connection: llama-server cancels the task
        if obs.status:
            self.stats.request(att.path, obs.status)
        if disconnected and not obs.completed:
            self.stats.disconnect(att.path)
        if att.preq is not None:
            self.finisher.finish(att.preq, att.plan, obs, disconnected, observe=att.plannable)
        elif log.isEnabledFor(logging.DEBUG):
            log.debug("[%s] %s %s %s %.1fms", att.rid, att.request.method, att.request.path_qs,
                      obs.status, obs.total_s * 1e3)
