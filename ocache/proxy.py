"""``ocache serve``: a transparent, fail-open asyncio reverse proxy in front of llama-server.

Clients change only their base URL. Every route is forwarded (any method, path, query, body and
headers); completion routes (``layer.COMPLETION_ROUTES``) with a JSON object body are first shown
to the cache layer, which may set top-level body fields (e.g. ``id_slot``). Any exception in the
cache layer is logged with the request id and the request is forwarded untouched; a body that is
not a JSON object is forwarded byte for byte and never planned.

Relay rules:

* Hop-by-hop headers (RFC 9110 §7.6.1: ``Connection`` and the headers it names, ``Keep-Alive``,
  ``TE``, ``Trailer``, ``Transfer-Encoding``, ``Upgrade``, ``Proxy-*``) are dropped in both
  directions; ``Host`` and ``Content-Length`` are set for the upstream hop; ``Authorization`` and
  everything else pass through. No compression is added or removed (``Content-Encoding`` passes as
  is, ``auto_decompress`` is off on both sides).
* SSE (``text/event-stream``) is relayed chunk by chunk as it arrives (no buffering, no
  re-chunking), without Content-Length, with ``X-Accel-Buffering: no``. Events are parsed only to
  read ``timings``/``usage``, after the chunk was written. The upstream body is never modified.
* A client disconnect cancels the handler (aiohttp ``handler_cancellation``) and closes the
  upstream connection at once; llama-server then cancels the task and the slot goes idle.
* Upstream answers (400, 500, 503 "Loading model", ...) reach the client unchanged. When the
  upstream cannot be reached ocache answers 503 with ``Retry-After`` and an error naming the URL;
  when it closes the connection before answering, 502.

Routes served by ocache itself (everything else, ``/metrics`` included, goes to llama-server):

| route | answer |
|---|---|
| ``GET /v1/cache/stats`` | JSON: proxy counters, upstream state/epoch, ``layer.stats()`` |
| ``GET /v1/cache/metrics`` | Prometheus text (``stats.py`` lists the metrics) |
| ``POST /v1/cache/clear?tier=all`` | ``layer.clear(tier)``; needs ``Authorization: Bearer <admin_token>``: 401 without or with a wrong token, 404 when no admin_token is configured |
| ``POST /v1/cache/warm`` ``{"dir": "/abs/path"}`` | ``ocache warm DIR``: warm that folder's head (NDJSON progress lines; 404 if the folder was never seen; ocache/warm.py) |
| ``POST /v1/cache/drain`` | ``ocache drain``: planned stop, like SIGTERM (admin token as for clear; ocache/tiers/spill.py) |

Response headers added by ocache (all ``X-OCache-*``):

| header | when | meaning |
|---|---|---|
| ``X-OCache-Request-Id`` | every response | id of this request in ocache's log lines |
| ``X-OCache-Fail-Open`` | completion, layer raised | ``plan``: the cache layer failed; request forwarded untouched |
| ``X-OCache-Upstream`` | 503/502 from ocache | the upstream URL that could not be reached |
| ``X-OCache-Tier`` | set by the layer | which tier provided the prefix (``resident``/``head``/``disk``/``session``/``cold``) |
| other ``X-OCache-*`` | set by the layer | see ``ocache/cache.py`` (e.g. ``X-OCache-Slot``) |

Logging: one line per completion at INFO (request id, route, status, slot, timings, TTFT, total);
other routes at DEBUG.

DNS-rebinding guard: a request whose ``Host`` header names neither localhost/127.0.0.1/::1, nor the
bound host, nor a name in ``allowed_hosts`` gets 403 (``allowed_hosts: ['*']`` disables the guard).
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import itertools
import json
import logging
import os
import secrets
import signal
import sys
import time
from typing import Any, Awaitable, Callable

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from . import config as config_mod
from .config import Config
from .layer import COMPLETION_ROUTES, CacheLayer, NullLayer, Observation, ParsedRequest, Plan
from .stats import Stats
from .upstream import Upstream

log = logging.getLogger("ocache.proxy")

#: RFC 9110 §7.6.1 hop-by-hop fields (plus the non-standard Proxy-Connection); ``Proxy-*`` too.
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "te", "trailer", "transfer-encoding", "upgrade",
    "proxy-connection", "proxy-authenticate", "proxy-authorization",
})
#: Request headers not forwarded: hop-by-hop, plus those the upstream hop sets itself.
_REQ_DROP = HOP_BY_HOP | {"host", "content-length", "expect"}
#: Response headers not copied: hop-by-hop, plus Content-Length (set by aiohttp for the body sent).
_RESP_DROP = HOP_BY_HOP | {"content-length"}
#: aiohttp client headers never added on its own: the client's own are forwarded instead.
_SKIP_AUTO = frozenset({"User-Agent", "Accept", "Accept-Encoding", "Content-Type"})
#: Non-streamed responses up to this size are read whole and sent with one write; larger ones and
#: those without Content-Length are relayed as they arrive (completion routes are always read whole
#: when not SSE, to observe ``timings``).
_READ_WHOLE_MAX = 4 << 20
#: Keyword arguments for aiohttp's AppRunner / TestServer (besides handler_cancellation=True).
RUNNER_KWARGS = dict(auto_decompress=False, access_log=None, max_field_size=65536)

_PROBE_ROUTES = frozenset({"/health", "/v1/health", "/metrics", "/props", "/slots"})


def _hop_names(headers) -> set[str]:
    """Hop-by-hop names: the fixed set plus every name listed in ``Connection``."""
    names = set(HOP_BY_HOP)
    for value in headers.getall("Connection", ()):
        names.update(t.strip().lower() for t in value.split(",") if t.strip())
    return names


def _end_to_end(headers, extra_drop: set[str] | frozenset[str]) -> CIMultiDict:
    """``headers`` without hop-by-hop ones (RFC 9110 §7.6.1), ``Proxy-*`` and ``extra_drop``;
    multi-valued headers and their order kept."""
    drop = _hop_names(headers) | extra_drop
    out = CIMultiDict()
    for k, v in headers.items():
        lk = k.lower()
        if lk in drop or lk.startswith("proxy-"):
            continue
        out.add(k, v)
    return out


def forward_request_headers(headers) -> CIMultiDict:
    """Client request headers to send upstream."""
    return _end_to_end(headers, _REQ_DROP)


def forward_response_headers(headers) -> CIMultiDict:
    """Upstream response headers to send to the client."""
    return _end_to_end(headers, _RESP_DROP)


def host_name(host_header: str) -> str:
    """The name part of a Host header value, lower case (``[::1]:8081`` -> ``[::1]``)."""
    h = host_header.strip().lower()
    if h.startswith("["):
        end = h.find("]")
        return h[: end + 1] if end >= 0 else h
    if h.count(":") == 1:
        return h.split(":", 1)[0]
    return h


def _json_error(status: int, message: str, type_: str, rid: str, **extra: Any) -> web.Response:
    body = {"error": {"code": status, "message": message, "type": type_, **extra}}
    resp = web.json_response(body, status=status)
    resp.headers["X-OCache-Request-Id"] = rid
    return resp


class _SSEObserver:
    """Reads ``timings``/``usage`` from SSE ``data:`` lines as chunks pass by (never delays them)."""

    __slots__ = ("_buf", "timings", "usage", "events")

    def __init__(self) -> None:
        self._buf = b""
        self.timings: dict | None = None
        self.usage: dict | None = None
        self.events = 0

    def feed(self, chunk: bytes) -> None:
        buf = self._buf + chunk if self._buf else chunk
        start = 0
        while True:
            nl = buf.find(b"\n", start)
            if nl < 0:
                break
            line = buf[start:nl]
            start = nl + 1
            if line.startswith(b"data:"):
                self.events += 1
                if b'"timings"' in line or b'"usage"' in line:
                    self._parse(line[5:])
        self._buf = buf[start:] if start < len(buf) else b""
        if len(self._buf) > (16 << 20):  # a pathological unterminated line: stop observing it
            self._buf = b""

    def _parse(self, data: bytes) -> None:
        try:
            obj = json.loads(data)
        except ValueError:
            return
        if isinstance(obj, dict):
            if isinstance(obj.get("timings"), dict):
                self.timings = obj["timings"]
            if isinstance(obj.get("usage"), dict):
                self.usage = obj["usage"]


def _content_of(path: str, obj: dict) -> str | None:
    try:
        if path == "/completion":
            return obj.get("content")
        choice = obj["choices"][0]
        if "message" in choice:
            return choice["message"].get("content")
        return choice.get("text")
    except (KeyError, IndexError, TypeError, AttributeError):
        return None


def default_layer_factory(no_cache: bool = False) -> Callable[[Upstream, Config], CacheLayer]:
    """``OCacheLayer`` from ``ocache.cache`` if importable (and not ``no_cache``), else NullLayer."""
    if not no_cache:
        try:
            from .cache import OCacheLayer  # type: ignore[attr-defined]

            return OCacheLayer
        except ImportError as exc:
            log.warning("cache layer not available (%s): forwarding without cache", exc)
    return NullLayer


class Proxy:
    """The proxy: ``make_app()`` gives the aiohttp Application; ``start``/``close`` run with it.

    ``layer_factory(upstream, config) -> CacheLayer`` builds the cache layer once the upstream
    object exists. ``pid_source`` (the supervisor's) feeds the upstream's restart detection.
    """

    def __init__(self, config: Config, layer_factory: Callable[[Upstream, Config], Any] | None = None,
                 pid_source: Callable[[], int | None] | None = None,
                 monitor: bool = True) -> None:
        self.config = config
        self.upstream = Upstream(config.upstream, api_key=config.upstream_api_key,
                                 probe_interval_s=config.probe_interval_s, pid_source=pid_source)
        self._layer_factory = layer_factory or default_layer_factory(config.no_cache)
        self.layer: Any = None
        self.stats = Stats(layer_stats=self._layer_stats)
        self.inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._tasks: set[asyncio.Task] = set()
        self._ids = itertools.count(1)
        self._id_prefix = secrets.token_hex(2)
        self._monitor = monitor
        self._allowed = config.bind_names
        self._allow_any = "*" in config.allowed_hosts
        self.recorder = None
        #: set by ``serve()``: the event a planned stop (SIGTERM, ``POST /v1/cache/drain``) sets
        self.stop_event: asyncio.Event | None = None
        self._extra = self._extra_routes()

    def _extra_routes(self) -> dict[str, Callable[[web.Request], Awaitable[web.StreamResponse]]]:
        """Admin routes whose handlers live with their tier: ``POST /v1/cache/warm`` (``ocache warm
        DIR``, ocache/warm.py) and ``POST /v1/cache/drain`` (``ocache drain``, ocache/tiers/spill.py)."""
        from .tiers.spill import make_drain_handler
        from .warm import make_warm_handler

        def warm_deps() -> Any:
            get = getattr(self.layer, "warm_deps", None)
            return get() if get is not None else None

        def request_stop() -> None:
            if self.stop_event is not None:
                self.stop_event.set()

        return {"/v1/cache/warm": make_warm_handler(warm_deps, self.config.admin_token),
                "/v1/cache/drain": make_drain_handler(request_stop, self.config.admin_token)}

    # --- lifecycle ------------------------------------------------------------------------------
    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=int(self.config.max_body_mb * (1 << 20)))
        app.router.add_route("*", "/{tail:.*}", self.handle)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        await self.start()

    async def _on_cleanup(self, app: web.Application) -> None:
        await self.close()

    async def start(self) -> None:
        if self.config.record_dir:
            from .record import Recorder

            self.recorder = Recorder(self.config.record_dir, redact=self.config.record_redact)
        await self.upstream.start(monitor=self._monitor)
        self.layer = self._layer_factory(self.upstream, self.config)
        self.upstream.on_restart(self._on_upstream_restart)
        log.info("ocache proxy -> %s (%s, layer %s)", self.upstream.base_url, self.upstream.state,
                 type(self.layer).__name__)

    async def close(self) -> None:
        await self.wait_background()
        await self.upstream.close()
        if self.recorder is not None:
            self.recorder.close()

    async def _on_upstream_restart(self) -> None:
        self.stats.upstream_restart()
        try:
            await self.layer.on_upstream_restart()
        except Exception:
            self.stats.layer_error("on_upstream_restart")
            log.exception("cache layer on_upstream_restart() failed")

    async def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no request is in flight; False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def wait_background(self) -> None:
        """Wait for pending release()/observe() tasks."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def drain(self, timeout: float) -> None:
        """Planned stop: wait for in-flight requests (up to ``timeout`` s), their observe() tasks,
        then ``layer.drain()``."""
        if not await self.wait_idle(timeout):
            log.warning("drain: %d request(s) still in flight after %.0f s", self.inflight, timeout)
        await self.wait_background()
        try:
            await self.layer.drain()
        except Exception:
            self.stats.layer_error("drain")
            log.exception("cache layer drain() failed")

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _layer_stats(self) -> dict:
        return self.layer.stats() if self.layer is not None else {}

    # --- request handling -----------------------------------------------------------------------
    def _new_id(self) -> str:
        return f"{self._id_prefix}{next(self._ids):05x}"

    def _host_ok(self, request: web.Request) -> bool:
        if self._allow_any:
            return True
        host = request.headers.get("Host")
        if host is None:
            return True  # HTTP/1.0 without Host: not a browser, nothing to rebind
        return host_name(host) in self._allowed

    async def handle(self, request: web.Request) -> web.StreamResponse:
        rid = self._new_id()
        if not self._host_ok(request):
            log.warning("[%s] rejected Host %r (DNS-rebinding guard; see allowed_hosts)", rid,
                        request.headers.get("Host"))
            self.stats.request(request.path, 403)
            return _json_error(403, f"Host {request.headers.get('Host')!r} is not allowed; add it "
                               "to allowed_hosts in the ocache config", "forbidden_error", rid)
        path = request.path
        if path in ("/v1/cache/stats", "/v1/cache/metrics", "/v1/cache/clear"):
            resp = await self._admin(request, rid, path)
            self.stats.request(path, resp.status)
            return resp
        if path in self._extra and request.method == "POST":
            resp = await self._extra[path](request)
            self.stats.request(path, resp.status)
            return resp
        self.inflight += 1
        self._idle.clear()
        try:
            return await self._proxy(request, rid)
        finally:
            self.inflight -= 1
            if self.inflight == 0:
                self._idle.set()

    async def _proxy(self, request: web.Request, rid: str) -> web.StreamResponse:
        t0 = time.perf_counter()
        method, path = request.method, request.path
        has_body = request.body_exists
        body = await request.read()
        is_completion = method == "POST" and path in COMPLETION_ROUTES
        preq: ParsedRequest | None = None
        if is_completion:
            preq = self._parse(request, rid, method, path, body)

        if self.upstream.state != "ready":
            # Down or loading: look again now, so that a server that just came up is identified
            # (epoch, restart callbacks) before the cache layer plans anything for it.
            await self.upstream.probe()
            if not self.upstream.up:
                self.stats.upstream_unavailable()
                self.stats.request(path, 503)
                return self._unavailable(rid)

        plan: Plan | None = None
        fail_open = False
        out_body = body
        if preq is not None and preq.body is not None:
            try:
                plan = await self.layer.plan(preq)
                if plan.body_updates:
                    out_body = json.dumps({**preq.body, **plan.body_updates}, ensure_ascii=False,
                                          separators=(",", ":")).encode()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("[%s] cache layer plan() failed: forwarding untouched", rid)
                self.stats.layer_error("plan")
                fail_open = True
                out_body = body
                if plan is not None and plan.release is not None:
                    self._spawn(self._release_only(rid, plan))
                plan = None

        obs = Observation(status=0, completed=False)
        up_resp: aiohttp.ClientResponse | None = None
        sent: web.StreamResponse | None = None
        disconnected = False
        extra = {"X-OCache-Request-Id": rid}
        if fail_open:
            extra["X-OCache-Fail-Open"] = "plan"
        if plan is not None:
            extra.update(plan.headers)
        try:
            try:
                up_resp = await self._send_upstream(request, out_body, has_body)
            except (aiohttp.ClientConnectorError, aiohttp.ClientConnectionResetError,
                    aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                obs.status = 503 if isinstance(exc, aiohttp.ClientConnectorError) else 502
                if obs.status == 503:
                    self.upstream.notify_unreachable(f"{type(exc).__name__}: {exc}")
                    self.stats.upstream_unavailable()
                    return self._unavailable(rid)
                self.upstream.poke()
                return _json_error(502, f"upstream {self.upstream.base_url} closed the connection "
                                   f"without answering ({type(exc).__name__})", "server_error",
                                   rid, upstream=self.upstream.base_url)
            obs.status = up_resp.status
            headers = forward_response_headers(up_resp.headers)
            headers.update(extra)
            ctype = up_resp.headers.get("Content-Type", "")
            if ctype.startswith("text/event-stream"):
                sent = await self._relay_stream(request, up_resp, headers, obs, t0,
                                                _SSEObserver() if preq is not None else None)
            elif (is_completion or method == "HEAD"
                  or (up_resp.content_length is not None
                      and up_resp.content_length <= _READ_WHOLE_MAX)):
                try:
                    data = await up_resp.read()
                except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError,
                        aiohttp.ClientOSError) as exc:
                    # The upstream died before its whole answer arrived (nothing sent yet).
                    obs.status = 502
                    self.upstream.poke()
                    return _json_error(502, f"upstream {self.upstream.base_url} failed while "
                                       f"answering ({type(exc).__name__}: {exc})", "server_error",
                                       rid, upstream=self.upstream.base_url)
                sent = web.Response(status=up_resp.status, reason=up_resp.reason, headers=headers,
                                    body=data)
                obs.ttft_s = time.perf_counter() - t0
                if preq is not None and data:
                    self._observe_json(path, data, obs)
                await sent.prepare(request)
                await sent.write_eof()
                obs.completed = True
            else:
                sent = await self._relay_stream(request, up_resp, headers, obs, t0, None)
            return sent
        except asyncio.CancelledError:
            disconnected = True
            raise
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            disconnected = True
            return sent or web.Response(status=499)
        finally:
            obs.total_s = time.perf_counter() - t0
            if up_resp is not None:
                if obs.completed:
                    up_resp.release()
                else:
                    up_resp.close()  # drop the connection: llama-server cancels the task
            if obs.status:
                self.stats.request(path, obs.status)
            if disconnected:
                self.stats.disconnect(path)
            if preq is not None:
                self._finish(preq, plan, obs, disconnected)
            elif log.isEnabledFor(logging.DEBUG):
                log.debug("[%s] %s %s %s %.1fms", rid, method, request.path_qs, obs.status,
                          obs.total_s * 1e3)

    async def _send_upstream(self, request: web.Request, body: bytes,
                             has_body: bool) -> aiohttp.ClientResponse:
        url = URL(self.upstream.base_url + request.raw_path, encoded=True)
        headers = forward_request_headers(request.headers)
        has_body = has_body or bool(body) or "Content-Length" in request.headers
        kw = dict(data=body if has_body else None, headers=headers, skip_auto_headers=_SKIP_AUTO,
                  allow_redirects=False, auto_decompress=False)
        try:
            return await self.upstream.session.request(request.method, url, **kw)
        except aiohttp.ClientConnectorError:
            raise
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            # A pooled keep-alive connection the server had already closed (idle timeout, restart):
            # the request did not get an answer, so one resend on a fresh connection is safe.
            log.debug("upstream connection dropped before an answer (%s); resending once", exc)
            self.upstream.poke()  # a dropped connection may mean a restart: check the boot id now
            return await self.upstream.session.request(request.method, url, **kw)

    async def _relay_stream(self, request: web.Request, up_resp: aiohttp.ClientResponse,
                            headers: CIMultiDict, obs: Observation, t0: float,
                            observer: _SSEObserver | None) -> web.StreamResponse:
        sse = observer is not None or headers.get("Content-Type", "").startswith("text/event-stream")
        resp = web.StreamResponse(status=up_resp.status, reason=up_resp.reason, headers=headers)
        if sse:
            resp.headers["X-Accel-Buffering"] = "no"
        elif up_resp.content_length is not None:
            resp.content_length = up_resp.content_length
        await resp.prepare(request)
        try:
            async for chunk in up_resp.content.iter_any():
                await resp.write(chunk)
                if obs.ttft_s is None:
                    obs.ttft_s = time.perf_counter() - t0
                if observer is not None:
                    observer.feed(chunk)
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError,
                aiohttp.ClientOSError) as exc:
            # The upstream died mid-response: end the client's connection without a clean
            # end-of-stream so it cannot mistake a truncated answer for a complete one.
            log.warning("upstream failed mid-response: %s", exc)
            if request.transport is not None:
                request.transport.close()
            return resp
        finally:
            if observer is not None:
                obs.timings, obs.usage = observer.timings, observer.usage
        await resp.write_eof()
        obs.completed = True
        return resp

    def _parse(self, request: web.Request, rid: str, method: str, path: str,
               body: bytes) -> ParsedRequest:
        obj = None
        if body:
            try:
                obj = json.loads(body)
            except (ValueError, UnicodeDecodeError):
                obj = None
            if not isinstance(obj, dict):
                obj = None
        hint = request.headers.get("x-session-affinity") or request.headers.get("x-session-id")
        return ParsedRequest(request_id=rid, method=method, path=path, body=obj,
                             headers=request.headers, session_hint=hint,
                             stream=bool(obj is not None and obj.get("stream") is True))

    @staticmethod
    def _observe_json(path: str, data: bytes, obs: Observation) -> None:
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            return
        if not isinstance(obj, dict):
            return
        if isinstance(obj.get("timings"), dict):
            obs.timings = obj["timings"]
        if isinstance(obj.get("usage"), dict):
            obs.usage = obj["usage"]
        if obs.status == 200:
            obs.content = _content_of(path, obj)

    def _unavailable(self, rid: str) -> web.Response:
        url = self.upstream.base_url
        resp = _json_error(503, f"llama-server at {url} is not reachable ({self.upstream.last_error}); "
                           "ocache will forward as soon as it is up", "unavailable_error", rid,
                           upstream=url)
        resp.headers["Retry-After"] = str(self.config.retry_after_s)
        resp.headers["X-OCache-Upstream"] = url
        return resp

    # --- after the response ---------------------------------------------------------------------
    def _finish(self, preq: ParsedRequest, plan: Plan | None, obs: Observation,
                disconnected: bool) -> None:
        slot = None
        if plan is not None and isinstance(plan.body_updates.get("id_slot"), int):
            slot = plan.body_updates["id_slot"]
        elif preq.body is not None and isinstance(preq.body.get("id_slot"), int) \
                and preq.body["id_slot"] >= 0:
            slot = preq.body["id_slot"]
        tier = (plan.headers.get("X-OCache-Tier") if plan is not None else None) or "none"
        t = obs.timings or {}
        record = {
            "request_id": preq.request_id, "path": preq.path, "status": obs.status,
            "stream": preq.stream, "slot": slot, "tier": tier,
            "prompt_n": t.get("prompt_n"), "cache_n": t.get("cache_n"),
            "prompt_ms": t.get("prompt_ms"), "predicted_n": t.get("predicted_n"),
            "ttft_s": obs.ttft_s, "total_s": round(obs.total_s, 6), "completed": obs.completed,
            "epoch": self.upstream.epoch,
        }
        if obs.completed or disconnected:
            self.stats.completion(preq.path, tier, obs.timings, obs.ttft_s, record)
        log.info("[%s] %s %s%s %d%s slot=%s tier=%s prompt_n=%s cache_n=%s predicted_n=%s "
                 "ttft=%s total=%.0fms", preq.request_id, preq.method, preq.path,
                 " stream" if preq.stream else "", obs.status,
                 " DISCONNECTED" if disconnected else ("" if obs.completed else " INCOMPLETE"),
                 "?" if slot is None else slot, tier, t.get("prompt_n"), t.get("cache_n"),
                 t.get("predicted_n"),
                 "-" if obs.ttft_s is None else f"{obs.ttft_s * 1e3:.0f}ms", obs.total_s * 1e3)
        self._spawn(self._after(preq, plan, obs))

    async def _release_only(self, rid: str, plan: Plan) -> None:
        try:
            await plan.release()
        except Exception:
            self.stats.layer_error("release")
            log.exception("[%s] cache layer release() failed", rid)

    async def _after(self, preq: ParsedRequest, plan: Plan | None, obs: Observation) -> None:
        if plan is not None:
            if plan.release is not None:
                await self._release_only(preq.request_id, plan)
            try:
                await self.layer.observe(preq, plan, obs)
            except Exception:
                self.stats.layer_error("observe")
                log.exception("[%s] cache layer observe() failed", preq.request_id)
        elif preq.body is not None:
            # Fail-open or no plan: the layer still learns what happened under an empty plan.
            try:
                await self.layer.observe(preq, Plan(), obs)
            except Exception:
                self.stats.layer_error("observe")
                log.exception("[%s] cache layer observe() failed", preq.request_id)
        if self.recorder is not None:
            await asyncio.to_thread(self.recorder.record, preq, plan, obs)

    # --- ocache's own routes --------------------------------------------------------------------
    async def _admin(self, request: web.Request, rid: str, path: str) -> web.Response:
        if path == "/v1/cache/stats" and request.method == "GET":
            try:
                layer = self.layer.stats() if self.layer is not None else {}
            except Exception as exc:
                self.stats.layer_error("stats")
                layer = {"error": f"{type(exc).__name__}: {exc}"}
            body = {**self.stats.to_dict(), "inflight": self.inflight,
                    "upstream": self.upstream.to_dict(), "layer": layer,
                    "layer_class": type(self.layer).__name__}
            resp = web.json_response(body)
        elif path == "/v1/cache/metrics" and request.method == "GET":
            resp = web.Response(body=self.stats.prometheus(),
                                headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
        elif path == "/v1/cache/clear" and request.method == "POST":
            token = self.config.admin_token
            if not token:
                return _json_error(404, "admin routes are disabled: set admin_token in the ocache "
                                   "config", "not_found_error", rid)
            auth = request.headers.get("Authorization", "")
            given = auth[7:] if auth.startswith("Bearer ") else ""
            if not given or not hmac.compare_digest(given.encode(), token.encode()):
                resp = _json_error(401, "admin token required: Authorization: Bearer <admin_token>",
                                   "authentication_error", rid)
                resp.headers["WWW-Authenticate"] = 'Bearer realm="ocache"'
                return resp
            tier = request.query.get("tier", "all")
            try:
                result = await self.layer.clear(tier)
            except ValueError as exc:
                return _json_error(400, str(exc), "invalid_request_error", rid)
            except Exception as exc:
                self.stats.layer_error("clear")
                log.exception("[%s] cache layer clear(%r) failed", rid, tier)
                return _json_error(500, f"clear failed: {type(exc).__name__}: {exc}",
                                   "server_error", rid)
            log.info("[%s] cache cleared (tier=%s): %s", rid, tier, result)
            resp = web.json_response(result)
        else:
            return _json_error(405, f"{request.method} not allowed on {path}", "invalid_request_error",
                               rid)
        resp.headers["X-OCache-Request-Id"] = rid
        return resp


# --- ocache serve ---------------------------------------------------------------------------------
async def serve(config: Config, stop: asyncio.Event | None = None,
                ready: Callable[["Proxy", int], None] | None = None,
                layer_factory: Callable[[Upstream, Config], Any] | None = None,
                handle_signals: bool = True) -> None:
    """Run the proxy until SIGTERM/SIGINT (or ``stop`` is set); then stop accepting, drain in-flight
    requests (``drain_timeout_s``), call ``layer.drain()``, and stop the launched child if any.
    ``ready(proxy, port)`` is called once listening. Raises OSError if the address is taken,
    ``supervisor.LaunchError`` if the child cannot be started."""
    from .supervisor import Supervisor

    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    signals = []
    if handle_signals:
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, stop.set)
                signals.append(sig)
            except (NotImplementedError, RuntimeError):
                pass
    supervisor = None
    runner = None
    try:
        if config.launch:
            from .paths import state_root

            # the child's stdout+stderr: where a failed start explains itself (tail logged on exit)
            supervisor = Supervisor(config.launch, binary=config.launch_binary,
                                    log_path=state_root() / "llama-server.log")
            config.upstream = supervisor.url
            await supervisor.start()
        proxy = Proxy(config, layer_factory=layer_factory,
                      pid_source=supervisor.pid if supervisor else None)
        proxy.stop_event = stop
        if supervisor:
            supervisor.on_start = proxy.upstream.poke
        runner = web.AppRunner(proxy.make_app(), handler_cancellation=True,
                               shutdown_timeout=config.drain_timeout_s, **RUNNER_KWARGS)
        await runner.setup()
        site = web.TCPSite(runner, config.host, config.port)
        await site.start()
        port = site.port
        log.info("ocache listening on http://%s:%d -> %s", config.host, port, config.upstream)
        if config.host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("listening on %s, not loopback: anyone who can reach this port can use the "
                        "model%s", config.host, "" if config.admin_token else " (and no admin_token is set)")
        if ready:
            ready(proxy, port)
        await stop.wait()
        log.info("stopping: no new connections, draining %d in-flight request(s)", proxy.inflight)
        await site.stop()
        await proxy.drain(config.drain_timeout_s)
    finally:
        if runner is not None:
            await runner.cleanup()
        if supervisor:
            await supervisor.stop()
        for sig in signals:
            loop.remove_signal_handler(sig)
        log.info("ocache stopped")


def build_config(args: argparse.Namespace) -> Config:
    overrides = {
        "host": args.host, "port": args.port, "upstream": args.upstream,
        "admin_token": args.admin_token, "record_dir": args.record,
        "no_cache": True if args.no_cache else None,
        "record_redact": True if args.redact else None,
    }
    if args.launch:
        if not args.launch_args:
            raise config_mod.ConfigError("--launch needs the llama-server arguments after `--` "
                                         "(ocache serve --launch -- -m model.gguf ...)")
        overrides["launch"] = list(args.launch_args)
    elif args.launch_args:
        raise config_mod.ConfigError("llama-server arguments given without --launch "
                                     "(use: ocache serve --launch -- ARGS)")
    if getattr(args, "verbose", False):
        overrides["log_level"] = "debug"
    return config_mod.load(args.config, overrides=overrides)


def _cmd_serve(args: argparse.Namespace) -> int:
    if args.help_config:
        print(config_mod.describe())
        return 0
    try:
        cfg = build_config(args)
    except config_mod.ConfigError as exc:
        print(f"ocache serve: config error: {exc}", file=sys.stderr)
        return 2
    logging.getLogger().setLevel(cfg.log_level.upper())
    if cfg.cache_dir:
        os.environ["OCACHE_STATE_DIR"] = cfg.cache_dir  # ocache.paths.state_root() reads it
    try:
        asyncio.run(serve(cfg))
    except OSError as exc:
        print(f"ocache serve: cannot listen on {cfg.host}:{cfg.port}: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # LaunchError and the like: a clear message, not a traceback
        from .supervisor import LaunchError

        if isinstance(exc, LaunchError):
            print(f"ocache serve: {exc}", file=sys.stderr)
            return 1
        raise
    return 0


def register(subparsers) -> None:
    """Add ``ocache serve`` to the CLI."""
    p = subparsers.add_parser(
        "serve", help="run the caching proxy in front of llama-server",
        description="Run the ocache proxy. Config: ocache.yaml < env OCACHE_* < these flags "
                    "(--help-config lists every key).")
    p.add_argument("--config", metavar="FILE", help="YAML config file (default ./ocache.yaml)")
    p.add_argument("--host", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (default 8081)")
    p.add_argument("--upstream", metavar="URL", help="llama-server URL (default http://127.0.0.1:8080)")
    p.add_argument("--admin-token", help="token for POST /v1/cache/clear")
    p.add_argument("--record", metavar="DIR", help="record each completion request (JSON lines, ocache/record.py) in DIR")
    p.add_argument("--redact", action="store_true",
                   help="with --record: keep structure and counts, drop all text (ocache/record.py)")
    p.add_argument("--no-cache", action="store_true", help="forward everything untouched (NullLayer)")
    p.add_argument("--launch", action="store_true",
                   help="start llama-server as a child with the arguments after `--`")
    p.add_argument("--help-config", action="store_true", help="print the config schema and exit")
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help="debug logging")
    p.add_argument("launch_args", nargs="*", metavar="-- LLAMA_SERVER_ARGS",
                   help="llama-server arguments (with --launch)")
    p.set_defaults(func=_cmd_serve)
