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

One guard (``Proxy._guard``, rules in ``ocache/admin.py``) runs in front of every route: the
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
| ``X-OCache-Tier`` | set by the layer | where the reused prefix came from (``resident``/``head``/``disk``/``session``/``cold``) |
| ``X-OCache-Split``, ``-Prefilled``, ``-Reused`` | set by the layer | tokens ocache prefilled itself for this request; tokens the server prefills for it (ocache's steps included); tokens reused from before it (see ``ocache/cache/orchestrator.py``) |
| other ``X-OCache-*`` | set by the layer | see ``ocache/cache/orchestrator.py`` (e.g. ``X-OCache-Slot``) |

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
import contextvars
import dataclasses
import itertools
import json
import logging
import re
import secrets
import signal
import time
from collections.abc import Mapping
from typing import Any, Awaitable, Callable

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from ocache import admin
from ocache.api import figures
from ocache.config import Config
from ocache.api.convert import timings_from_usage
from ocache.layer import COMPLETION_ROUTES, CacheLayer, NullLayer, Observation, ParsedRequest, Plan
from ocache.stats import Stats
from ocache.upstream import Upstream

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
#: seconds a stop waits for ocache's own calls to llama-server still in flight (``Proxy.quiesce``): a
#: ``GET /slots`` waits in the server's task queue for at most one batch step; a probe is bounded
#: by ``probe_timeout_s`` (5 s)
QUIESCE_S = 10.0

RUNNER_KWARGS = dict(auto_decompress=False, access_log=None, max_field_size=65536)

_PROBE_ROUTES = frozenset({"/health", "/v1/health", "/metrics", "/props", "/slots"})
#: Routes llama-server answers at once, without its task queue (server-context.cpp:4635-4646):
#: forwarded with ``probe_timeout_s`` as their read timeout.
_HEALTH_ROUTES = frozenset({"/health", "/v1/health"})
#: Seconds a request waits for the shared upstream probe when the upstream is not known ready
#: (a refused connection answers in milliseconds; a hung one is not waited for at all).
PROBE_WAIT_S = 1.0
#: seconds the proxy's bookkeeping after an answer (the log line, the stats record, ``observe``) waits
#: for a plan's ``completion`` (``Plan.completion``: the token view and the figures of a known
#: conversation's turn, computed while the server works); the answer itself never waits for it
PLAN_COMPLETION_WAIT_S = 30.0
#: seconds the answer's headers may wait for a known turn's ``completion`` so that its figures go
#: into them; 0: never (the figures then reach the log line and /v1/cache/stats only). The test
#: suite sets it high (tests/conftest.py) where tests read figures from headers; the default is
#: covered by tests/test_known_turn.py
FIGURES_WAIT_S = 0.0
#: times one request is planned again after the server refused its plan's precondition (412:
#: another process than the one the plan was made for, ``Proxy._stale_plan``); refused once more,
#: it is forwarded untouched
STALE_REPLANS = 2
#: A JSON escape of a UTF-16 surrogate: only a body with one can hold a lone surrogate.
_SURROGATE_ESC = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE = re.compile("[\ud800-\udfff]")


#: The upstream the current request is forwarded to (set per request task in ``Proxy._proxy``;
#: several servers behind one ocache: ``ocache/router.py``). Unset: the first upstream.
_CURRENT_UPSTREAM: contextvars.ContextVar[Upstream] = contextvars.ContextVar("ocache_upstream")


#: request key: this request's forward could not connect (nothing reached the server)
_CONNECT_FAILED = admin._Key("ocache_connect_failed", bool) if admin._Key else "ocache_connect_failed"


def _up_headers(plan: Plan | None) -> Mapping[str, str] | None:
    """The request headers a plan adds to the forwarded request (``Plan.upstream_headers``)."""
    return (getattr(plan, "upstream_headers", None) or None) if plan is not None else None


class UpstreamHung(aiohttp.ClientConnectionError):
    """The upstream stopped answering (its /health probe timed out) while a forward was in flight."""


class Unparseable(ValueError):
    """A request body ocache does not plan (it is forwarded byte for byte); the message says why."""


def parse_body(body: bytes) -> dict | None:
    """The JSON object of a completion body, or None for an empty body. Raises ``Unparseable``
    for anything ocache must not re-encode: bytes that are not UTF-8 (RFC 8259 §8.1 requires UTF-8
    between systems; Python's ``json.loads`` would silently accept UTF-16/32), a UTF-8 BOM, invalid
    JSON, nesting deeper than Python's recursion limit (``RecursionError``), a JSON value that is not
    an object, or a string with a lone surrogate (``"\\ud800"``: not encodable as UTF-8)."""
    if not body:
        return None
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Unparseable(f"not UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        obj = json.loads(text)
    except RecursionError:
        raise Unparseable("JSON nested too deeply for the cache layer") from None
    except ValueError as exc:
        raise Unparseable(f"not JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise Unparseable(f"JSON {type(obj).__name__}, not an object")
    if _SURROGATE_ESC.search(body) and _has_lone_surrogate(obj):
        raise Unparseable("a string holds a lone UTF-16 surrogate")
    return obj


def with_fields(raw: bytes, obj: dict, updates: dict) -> bytes:
    """The body ``raw`` (whose parsed object is ``obj``, ``parse_body``) with the top-level fields of
    ``updates`` added (``id_slot``). When none of them is in ``obj`` they are spliced in after the
    opening brace: the client's bytes stay as sent and the cost does not grow with the prompt
    (re-encoding a 126k-token body took ~3 ms). A field the client set itself is replaced by
    re-encoding the whole object (a duplicate key would leave the choice to the server's parser)."""
    if any(k in obj for k in updates):
        return json.dumps({**obj, **updates}, ensure_ascii=False, separators=(",", ":")).encode()
    i = raw.index(b"{") + 1      # parse_body accepted a JSON object (no BOM): "{" comes first
    fields = ",".join(json.dumps(k) + ":" + json.dumps(v, ensure_ascii=False, separators=(",", ":"))
                      for k, v in updates.items()).encode()
    sep = b"" if raw[i:].lstrip().startswith(b"}") else b","
    return raw[:i] + fields + sep + raw[i:]


def _has_lone_surrogate(obj: Any) -> bool:
    """Whether any key or string value holds a surrogate code point (``json.loads`` joins valid
    pairs, so any that is left is lone). Iterative: no recursion limit."""
    stack = [obj]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            if _SURROGATE.search(node):
                return True
        elif isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


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


_json_error = admin.error  # the one error shape (ocache/admin.py)


class _SSEObserver:
    """Reads ``timings``/``usage`` from SSE ``data:`` lines as chunks pass by (never delays them),
    and notices the stream's *final event*.

    ``final`` turns True once a line of the final event was fed (the proxy feeds a chunk only after
    writing it to the client, so the client then has the whole answer): ``data: [DONE]`` (chat and
    text completions, tools/server/server-context.cpp:4525), a ``data:`` object with ``timings``
    that ends the answer — ``"stop": true`` (native ``/completion``, server-task.cpp:346), a non-null
    ``finish_reason`` or a ``usage`` chunk (OpenAI routes; the final chunk carries ``timings``,
    server-task.cpp:503-518; partial chunks carry ``timings`` only with ``timings_per_token``, and
    then with ``finish_reason: null``) — or a Responses API ``response.completed`` event
    (server-task.cpp:689), or an Anthropic ``message_stop``. A client that closes its socket right
    after that (python-requests ``iter_lines()`` + ``break``) has received a complete response.

    ``first_at``: ``time.perf_counter()`` when the first ``data:`` event that is not a prompt
    progress report passed (the first generated token): not the server's keep-alive comment
    ``":\n\n"``, sent while a prefill outlasts ``sse_ping_interval`` (default 30 s;
    tools/server/server-context.cpp:4535-4548, common/common.h:626)."""

    __slots__ = ("_buf", "timings", "usage", "events", "_anthropic", "first_at", "final", "message",
                 "finish_reason")

    def __init__(self, collect: bool = False) -> None:
        # [align] ``collect``: also build the chat answer from the deltas (``message``, for the
        # aligned route, ocache/cache/align_route.py); None: not collected
        self.message: dict | None = {"role": "assistant", "content": ""} if collect else None
        self.finish_reason: str | None = None
        self._anthropic: dict | None = None
        self._buf = b""
        self.timings: dict | None = None
        self.usage: dict | None = None
        self.events = 0
        self.first_at: float | None = None
        self.final = False

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
                if self.first_at is None and b'"prompt_progress"' not in line:
                    self.first_at = time.perf_counter()
                if self.message is not None and b'"choices"' in line:   # [align]
                    self._delta(line[5:])
                if (b'"timings"' in line or b'"usage"' in line or b"response.completed" in line
                        or b"message_stop" in line):
                    self._parse(line[5:])
                elif line[5:].strip() == b"[DONE]":
                    self.final = True
            elif line.startswith(b"event:") and line[6:].strip() in (b"response.completed", b"message_stop"):
                self.final = True
        self._buf = buf[start:] if start < len(buf) else b""
        if len(self._buf) > (16 << 20):  # a pathological unterminated line: stop observing it
            self._buf = b""

    def _delta(self, data: bytes) -> None:
        """[align] Add one chat chunk's delta (content, reasoning, tool calls by index) to ``message``;
        a chunk that does not parse ends the collection (``message`` None)."""
        try:
            choices = json.loads(data)["choices"]
            if not choices:   # the usage chunk of stream_options.include_usage
                return
            choice = choices[0]
            delta = choice.get("delta") or {}
            msg = self.message
            assert msg is not None
            for key in ("content", "reasoning_content"):
                if isinstance(delta.get(key), str):
                    msg[key] = msg.get(key, "") + delta[key]
            for tc in delta.get("tool_calls") or ():
                calls = msg.setdefault("tool_calls", [])
                i = int(tc.get("index", len(calls)))
                while len(calls) <= i:
                    calls.append({"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
                fn = tc.get("function") or {}
                calls[i]["id"] = tc.get("id") or calls[i]["id"]
                calls[i]["function"]["name"] += fn.get("name") or ""
                calls[i]["function"]["arguments"] += fn.get("arguments") or ""
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        except (ValueError, KeyError, IndexError, TypeError, AttributeError, RecursionError, AssertionError):
            self.message = None

    def _parse(self, data: bytes) -> None:
        try:
            obj = json.loads(data)
        except (ValueError, RecursionError):
            return
        if isinstance(obj, dict):
            if isinstance(obj.get("timings"), dict):
                self.timings = obj["timings"]
                if obj.get("stop") is True or isinstance(obj.get("usage"), dict) or any(
                        isinstance(c, dict) and c.get("finish_reason") is not None
                        for c in (obj.get("choices") or ())):
                    self.final = True
            if isinstance(obj.get("usage"), dict):
                self.usage = obj["usage"]
            # Anthropic stream (no timings): message_start's usage has the prompt counts, the final
            # message_delta's the output count (ocache/api/convert.py timings_from_usage)
            start = obj.get("message") if obj.get("type") == "message_start" else None
            if isinstance(start, dict) and isinstance(start.get("usage"), dict):
                self._anthropic = dict(start["usage"])
            elif obj.get("type") == "message_delta" and self.timings is None and self._anthropic:
                self.timings = timings_from_usage({**self._anthropic, **(self.usage or {})})
            if obj.get("type") in ("response.completed", "message_stop"):
                self.final = True


def _collects(layer: Any, path: str) -> bool:
    """[align] Whether a streamed chat answer's message is collected for the layer
    (``wants_message``: the aligned route is on)."""
    return bool(getattr(layer, "wants_message", False)) and path in ("/v1/chat/completions", "/chat/completions")


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
            from ocache.cache import OCacheLayer  # type: ignore[attr-defined]

            return OCacheLayer
        except ImportError as exc:
            log.warning("cache layer not available (%s): forwarding without cache", exc)
    return NullLayer


class Proxy:
    """The proxy: ``make_app()`` gives the aiohttp Application; ``start``/``close`` run with it.

    ``layer_factory(upstream, config) -> CacheLayer`` builds the cache layer once the upstream
    object exists. ``pid_source`` (the supervisor's) feeds the upstream's restart detection.

    Several servers (config ``upstreams``, or ``launch_replicas`` > 1): one ``Upstream`` each
    (``upstreams``; ``pid_sources`` one per server), the layer is ``ocache.router.Router`` over one
    ``layer_factory`` layer per server (``server_configs``: each server's Config, default this one
    with its ``upstream``), and each request is forwarded to the server its plan names
    (``Plan.upstream``), other routes to the first ready one. ``upstream`` is the current request's
    server (a context variable set per request), else the first.
    """

    def __init__(self, config: Config, layer_factory: Callable[[Upstream, Config], Any] | None = None,
                 pid_source: Callable[[], int | None] | None = None,
                 monitor: bool = True, pid_sources: list | None = None,
                 server_configs: list[Config] | None = None) -> None:
        self.config = config
        urls = list(config.upstreams or []) or [config.upstream]
        pids = list(pid_sources or []) or [pid_source]
        self.upstreams = [Upstream(u, api_key=config.upstream_api_key,
                                   probe_interval_s=config.probe_interval_s,
                                   pid_source=pids[i] if i < len(pids) else None,
                                   probe_timeout_s=config.probe_timeout_s)
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
        #: forwards in flight: sends still waiting for the answer's head, answers being relayed
        self._sending: set[asyncio.Task] = set()   # handler tasks awaiting an answer's head
        self._aborted: set[asyncio.Task] = set()   # of those, the ones _abort_forwards cancelled
        self._relaying: set[aiohttp.ClientResponse] = set()
        self._forward_up: dict[Any, Upstream] = {}  # send task / response -> its upstream

    @property
    def upstream(self) -> Upstream:
        """The upstream of the request being handled (``Plan.upstream``), else the first."""
        return _CURRENT_UPSTREAM.get(self.upstreams[0])

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

    def _extra_routes(self) -> dict[str, Callable[[web.Request], Awaitable[web.StreamResponse]]]:
        """Admin routes whose handlers live with their tier: ``POST /v1/cache/warm`` (``ocache warm
        DIR``, ocache/warm.py) and ``POST /v1/cache/drain`` (``ocache drain``, ocache/tiers/spill.py)."""
        from ocache.admin import make_drain_handler
        from ocache.warm import make_warm_handler

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
        app = web.Application(client_max_size=int(self.config.max_body_mb * (1 << 20)),
                              middlewares=[self._guard])
        app.router.add_route("*", "/{tail:.*}", self.handle)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        await self.start()

    async def _on_cleanup(self, app: web.Application) -> None:
        await self.close()

    async def start(self) -> None:
        from ocache.dashboard import install_event_log

        install_event_log()  # the dashboard's event list (ocache/dashboard.py)
        if self.config.record_dir:
            from ocache.record import Recorder

            self.recorder = Recorder(self.config.record_dir, redact=self.config.record_redact)
        await asyncio.gather(*(up.start(monitor=self._monitor) for up in self.upstreams))
        if len(self.upstreams) > 1:
            from ocache.router import Router

            self.layer = Router(self.upstreams, self.config, self._layer_factory,
                                configs=self.server_configs)
        else:
            self.layer = self._layer_factory(self.upstream, self.config)
        self.upstreams[0].on_restart(self._on_upstream_restart)
        for up in self.upstreams[1:]:
            up.on_restart(self._count_restart)
        for up in self.upstreams:
            up.on_hung(lambda reason, up=up: self._abort_forwards(reason, up))
        log.info("ocache proxy -> %s (%s, layer %s)",
                 ", ".join(u.base_url for u in self.upstreams),
                 ", ".join(u.state for u in self.upstreams), type(self.layer).__name__)

    async def _count_restart(self) -> None:
        self.stats.upstream_restart()

    def begin_stop(self) -> None:
        """A planned stop began: the layer starts no more background work against the server
        (``layer.begin_stop``: no ``GET /slots`` reconcile after a response); in-flight requests and
        the drain still run."""
        fn = getattr(self.layer, "begin_stop", None)
        if fn is not None:
            fn()

    def calls_inflight(self) -> int:
        """ocache's own calls to the server(s) not answered yet: the layer's slot calls plus the
        probes in flight (0 when nothing of ocache's waits on llama-server's task queue)."""
        fn = getattr(self.layer, "calls_inflight", None)
        n = int(fn()) if fn is not None else 0
        return n + sum(1 for up in self.upstreams if up.probe_inflight())

    async def quiesce(self, timeout_s: float = QUIESCE_S) -> int:
        """The last step of a stop, before the connections close and a launched child gets SIGTERM
        (README "Limitations": llama-server does not exit while one of ocache's ``GET /slots`` waits
        in its task queue): ``begin_stop``, end each upstream's monitor after its running probe,
        wait for the release/observe tasks, then ``layer.quiesce`` (background work and slot calls
        in flight), all within ``timeout_s`` seconds (an upstream known to be hung is not waited
        for). Returns :meth:`calls_inflight` after it (0: nothing of ocache's is left waiting). Idempotent."""
        self.begin_stop()
        deadline = time.monotonic() + timeout_s
        hung = any(up.hung for up in self.upstreams)
        bound = 0.0 if hung else timeout_s
        for up in self.upstreams:
            await up.stop_monitor(max(0.0, min(bound, deadline - time.monotonic())))
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=max(0.0, deadline - time.monotonic()))
        fn = getattr(self.layer, "quiesce", None)
        if fn is not None:
            try:
                await fn(max(0.0, min(bound, deadline - time.monotonic())))
            except Exception:
                self.stats.layer_error("quiesce")
                log.exception("cache layer quiesce() failed")
        left = self.calls_inflight()
        if left:
            log.warning("stopping with %d call(s) of ocache's still waiting on llama-server", left)
        return left

    async def close(self) -> None:
        await self.quiesce()
        await self.wait_background()
        for up in self.upstreams:
            await up.close()
        if self.recorder is not None:
            self.recorder.close()

    def _abort_forwards(self, reason: str, up: Upstream | None = None) -> None:
        """The upstream ``up`` stopped answering: end every forward in flight to it now (their
        answers would never come; without this they would wait for ``upstream_read_timeout_s``)."""
        def on(x: Any) -> bool:
            return up is None or self._forward_up.get(x, self.upstreams[0]) is up

        sending = [t for t in self._sending if on(t)]
        relaying = [r for r in self._relaying if on(r)]
        if sending or relaying:
            log.warning("upstream stopped answering: ending %d forward(s) in flight",
                        len(sending) + len(relaying))
        for task in sending:
            if task not in self._aborted:
                self._aborted.add(task)
                task.cancel(msg="upstream hung")
        for resp in relaying:
            resp.content.set_exception(UpstreamHung(f"stopped answering mid-response ({reason})"))

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

    @web.middleware
    async def _guard(self, request: web.Request, handler) -> web.StreamResponse:
        """The one guard in front of every route (ocache/admin.py): a request id, the DNS-rebinding
        guard, the admin token for ``POST /v1/cache/clear|warm|drain`` (404 when no token is set,
        401 without the right one), ``request["ocache_admin"]`` for the stats' redaction, and 403
        for a client's ``/slots/{id}?action=save|restore|erase`` while a cache layer owns the slots."""
        rid = request[admin.RID] = self._new_id()
        path = request.path
        resp: web.StreamResponse | None = None
        if not self._host_ok(request):
            log.warning("[%s] rejected Host %r (DNS-rebinding guard; see allowed_hosts)", rid,
                        request.headers.get("Host"))
            resp = _json_error(403, f"Host {request.headers.get('Host')!r} is not allowed; add it "
                               "to allowed_hosts in the ocache config", "forbidden_error", rid)
        elif path in admin.ADMIN_POST:
            if request.method != "POST":
                resp = _json_error(405, f"{request.method} not allowed on {path} (use POST)",
                                   "invalid_request_error", rid)
            else:
                resp = admin.denied(request, self.config.admin_token, rid)
            request[admin.ADMIN] = resp is None
        elif path in admin.ADMIN_GET:
            if request.method not in ("GET", "HEAD"):
                resp = _json_error(405, f"{request.method} not allowed on {path} (use GET)",
                                   "invalid_request_error", rid)
            request[admin.ADMIN] = admin.token_ok(request, self.config.admin_token)
        elif path == "/ocache" or path.startswith("/ocache/"):  # the dashboard: like the stats
            request[admin.ADMIN] = admin.token_ok(request, self.config.admin_token)
        elif admin.is_slot_action(request) and getattr(self.layer, "owns_slots",
                                                        not isinstance(self.layer, NullLayer)):
            log.warning("[%s] refused a client's %s %s (ocache owns the slots)", rid, request.method,
                        request.path_qs)
            resp = admin.slot_action_refused(request, self.upstream.base_url, rid)
        if resp is not None:
            self.stats.request(path, resp.status)
            return resp
        return await handler(request)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        rid = request.get(admin.RID) or self._new_id()
        path = request.path
        if path in ("/v1/cache/stats", "/v1/cache/metrics", "/v1/cache/clear"):
            resp = await self._admin(request, rid, path)
            self.stats.request(path, resp.status)
            return resp
        if path == "/ocache" or path.startswith("/ocache/"):  # the dashboard (ocache/dashboard.py)
            from ocache.dashboard import handle as dashboard

            resp = await dashboard(request, self.stats_body, bool(request.get(admin.ADMIN)))
            resp.headers.setdefault("X-OCache-Request-Id", rid)
            self.stats.request(path, resp.status)
            return resp
        if path in self._extra:  # method and token already checked by _guard
            resp = await self._extra[path](request)
            resp.headers.setdefault("X-OCache-Request-Id", rid)
            self.stats.request(path, resp.status)
            return resp
        self.inflight += 1
        self._idle.clear()
        # a completion is in flight from here (before its plan, so before it is routed) to its last
        # byte relayed, on every upstream (servers behind one ocache may share the machine's
        # cores): background work that needs a server's CPU, such as the checks the plan spawns,
        # waits until none is (Upstream.quiet, ocache/upstream.py)
        generation = contextlib.ExitStack()
        if request.method == "POST" and path in COMPLETION_ROUTES:
            for up in self.upstreams:
                generation.enter_context(up.generation())
        try:
            with generation:
                return await self._proxy(request, rid)
        finally:
            self.inflight -= 1
            if self.inflight == 0:
                self._idle.set()

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

    def _read_timeout(self, path: str, preq: ParsedRequest | None) -> aiohttp.ClientTimeout:
        """The upstream read timeout of one forward: ``probe_timeout_s`` for /health,
        ``stream_idle_timeout_s`` between chunks of a stream, ``upstream_read_timeout_s`` for the
        rest (aiohttp ``sock_read``: the longest wait for the next byte)."""
        if path in _HEALTH_ROUTES:
            read = self.config.probe_timeout_s
        elif preq is not None and preq.stream:
            read = self.config.stream_idle_timeout_s
        else:
            read = self.config.upstream_read_timeout_s
        return aiohttp.ClientTimeout(total=None, sock_connect=10.0, sock_read=read)

    async def _plan(self, preq: ParsedRequest, body: bytes) -> tuple[Plan, bytes]:
        plan = await self.layer.plan(preq)
        out_body = body
        if plan.body_updates:
            try:
                out_body = with_fields(body, preq.body, plan.body_updates)
            except BaseException:
                if plan.release is not None:
                    self._spawn(self._release_only(preq.request_id, plan))
                raise
        return plan, out_body

    async def _plan_completed(self, rid: str, plan: Plan) -> None:
        """Wait for ``plan.completion`` (bounded by ``PLAN_COMPLETION_WAIT_S``); a late or failed one
        is logged and counted, and the request's log line and record carry no figures."""
        task = plan.completion
        done, _ = await asyncio.wait({task}, timeout=PLAN_COMPLETION_WAIT_S)
        if not done:
            log.warning("[%s] the plan's figures were not ready in %g s: relayed without them",
                        rid, PLAN_COMPLETION_WAIT_S)
            self.stats.layer_error("plan_late")
        else:
            self._completion_failed(rid, task)

    def _completion_failed(self, rid: str, task: asyncio.Task) -> None:
        """Log and count a finished ``Plan.completion`` that failed (its figures are missing)."""
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            log.warning("[%s] the plan's figures failed (%s: %s): relayed without them",
                        rid, type(exc).__name__, exc)
            self.stats.layer_error("plan_completion")

    async def _proxy(self, request: web.Request, rid: str) -> web.StreamResponse:
        t0 = time.perf_counter()
        method, path = request.method, request.path
        has_body = request.body_exists
        try:
            body = await self._read_body(request)
        except asyncio.TimeoutError:
            self.stats.request(path, 408)
            return _json_error(408, f"the request body stalled: no byte for "
                               f"{self.config.client_idle_timeout_s:g} s (client_idle_timeout_s)",
                               "timeout_error", rid)
        except web.HTTPRequestEntityTooLarge:
            # ocache's own limit (llama-server has none): its answer in the one error shape, counted
            # and logged like every answer; the rest of the body is not read, so the connection closes
            self.stats.request(path, 413)
            log.info("[%s] %s %s 413: request body above max_body_mb (%g MB)", rid, method, path,
                     self.config.max_body_mb)
            resp = _json_error(413, f"the request body is larger than max_body_mb "
                               f"({self.config.max_body_mb:g} MB)", "invalid_request_error", rid)
            resp.force_close()
            return resp
        is_completion = method == "POST" and path in COMPLETION_ROUTES
        if len(self.upstreams) > 1:
            _CURRENT_UPSTREAM.set(self.default_upstream())
        preq: ParsedRequest | None = None
        if is_completion:
            preq = self._parse(request, rid, method, path, body)

        plannable = True
        if self.upstream.state == "foreign":
            plannable = False  # not llama-server: forwarded without the layer (the monitor re-probes)
        elif self.upstream.state != "ready":
            # Down or loading: one shared probe now, so that a server that just came up is
            # identified (epoch, restart callbacks) before the cache layer plans anything for it.
            state = await self._upstream_state(rid, path)
            if state == "down":
                self.stats.upstream_unavailable()
                self.stats.request(path, 503)
                return self._unavailable(rid)
            plannable = state == "ready"

        plan: Plan | None = None
        fail_open = False
        out_body = body
        if preq is not None and preq.body is not None and plannable:
            epoch = self.upstream.epoch
            try:
                plan, out_body = await self._plan(preq, body)
            except asyncio.CancelledError:
                raise
            except RecursionError:
                log.warning("[%s] body nested too deeply for the cache layer: forwarded untouched", rid)
                self.stats.unplannable("nesting")
                preq.body = None
            except Exception as exc:
                # The upstream itself (restarted inside the probe window, loading its model) or
                # ocache's own fault? Only the latter is a layer error.
                state = await self.upstream.probe()
                if state == "ready" and self.upstream.epoch == epoch:
                    log.exception("[%s] cache layer plan() failed: forwarding untouched", rid)
                    self.stats.layer_error("plan")
                    fail_open = True
                else:
                    log.warning("[%s] llama-server changed while planning (%s, epoch %s -> %s: %s)",
                                rid, state, epoch, self.upstream.epoch, type(exc).__name__)
                    state = await self._upstream_state(rid, path)
                    if state == "down":
                        self.stats.upstream_unavailable()
                        self.stats.request(path, 503)
                        return self._unavailable(rid)
                    if state == "ready":
                        try:
                            plan, out_body = await self._plan(preq, body)
                        except asyncio.CancelledError:
                            raise
                        except Exception:
                            log.exception("[%s] cache layer plan() failed: forwarding untouched", rid)
                            self.stats.layer_error("plan")
                            fail_open = True
                if plan is None:
                    out_body = body

        if plan is not None and plan.upstream and len(self.upstreams) > 1:
            chosen = next((u for u in self.upstreams if u.base_url == plan.upstream.rstrip("/")), None)
            if chosen is not None:
                _CURRENT_UPSTREAM.set(chosen)
        obs = Observation(status=0, completed=False)
        up_resp: aiohttp.ClientResponse | None = None
        sent: web.StreamResponse | None = None
        disconnected = False
        extra = {"X-OCache-Request-Id": rid}
        if fail_open:
            extra["X-OCache-Fail-Open"] = "plan"
        if plan is not None:
            extra.update(plan.headers)
        if preq is not None:
            # ocache's own time on the request's critical path: receipt to forward (body read and
            # parsed, planned, the steps before forwarding: a restore or a split included)
            extra["X-OCache-Plan-Ms"] = f"{(time.perf_counter() - t0) * 1e3:.2f}"
        timeout = self._read_timeout(path, preq)
        try:
            up_resp = await self._forward(request, rid, out_body, has_body, timeout, obs, _up_headers(plan))
            if (not isinstance(up_resp, aiohttp.ClientResponse) and request.get(_CONNECT_FAILED)
                    and plan is not None and plan.upstream and preq is not None):
                # the chosen server refused the connection (died since its last probe): the request
                # never reached it, so it is planned again on the servers still up (once)
                rerouted = await self._reroute(preq, plan, body)
                if rerouted is not None:
                    plan, out_body = rerouted
                    extra = {"X-OCache-Request-Id": rid, **plan.headers,
                             "X-OCache-Plan-Ms": f"{(time.perf_counter() - t0) * 1e3:.2f}"}
                    obs.status = 0
                    up_resp = await self._forward(request, rid, out_body, has_body, timeout, obs,
                                                  _up_headers(plan))
            if not isinstance(up_resp, aiohttp.ClientResponse):
                return up_resp  # ocache's own 502/503/504
            if up_resp.status == 503 and path not in _PROBE_ROUTES and plannable:
                up_resp = await self._held_503(request, rid, out_body, has_body, timeout, obs, up_resp,
                                               _up_headers(plan))
                if not isinstance(up_resp, aiohttp.ClientResponse):
                    return up_resp
            for attempt in range(STALE_REPLANS + 1):
                if up_resp.status != 412 or not _up_headers(plan) or preq is None:
                    break
                if any(k in request.headers for k in _up_headers(plan)):
                    # the client's own precondition refused (it was forwarded as the client sent
                    # it, ``_send_upstream``): the server's 412 is the answer, as without ocache;
                    # the plan is ended (the server did no work: its slot marked unknown)
                    await self._end_plan(rid, plan)
                    plan = None
                    extra = {"X-OCache-Request-Id": rid, "X-OCache-Plan-Ms": extra.get("X-OCache-Plan-Ms", "")}
                    break
                # the server is not the process the plan was made for (patches/0007): it did no
                # work for the request; the plan is ended and the request planned again
                plan, out_body = await self._stale_plan(preq, plan, body, up_resp,
                                                        untouched=attempt == STALE_REPLANS)
                extra = {"X-OCache-Request-Id": rid, **(plan.headers if plan is not None else
                                                        {"X-OCache-Fail-Open": "plan"}),
                         # receipt to this forward: the refused one and the plan made again included
                         "X-OCache-Plan-Ms": f"{(time.perf_counter() - t0) * 1e3:.2f}"}
                obs.status = 0
                up_resp = await self._forward(request, rid, out_body, has_body, timeout, obs,
                                              _up_headers(plan))
                if not isinstance(up_resp, aiohttp.ClientResponse):
                    return up_resp
            if plan is not None and plan.completion is not None:
                # a plan that finishes while the server works (OCacheLayer._plan_known): its figures
                # go into the headers only if they are ready now (or within FIGURES_WAIT_S); by
                # default the answer never waits for them (they reach the log line and
                # /v1/cache/stats once they are)
                if not plan.completion.done() and FIGURES_WAIT_S > 0:
                    await asyncio.wait({plan.completion}, timeout=FIGURES_WAIT_S)
                if plan.completion.done():
                    extra.update(plan.headers)
                else:
                    extra["X-OCache-Figures"] = "late"
                    self.stats.figures_late()
            obs.status = up_resp.status
            headers = forward_response_headers(up_resp.headers)
            headers.update(extra)
            if up_resp.status == 503 and self.upstream.state == "loading":
                headers["Retry-After"] = str(self.config.retry_after_s)
            ctype = up_resp.headers.get("Content-Type", "")
            split = plan.split_tokens if plan is not None and up_resp.status == 200 else 0
            if ctype.startswith("text/event-stream"):
                sent = await self._relay_stream(request, up_resp, headers, obs, t0,
                                                _SSEObserver(_collects(self.layer, path)) if preq is not None else None,
                                                timed=timeout.sock_read != self.config.stream_idle_timeout_s,
                                                rewriter=figures.LineRewriter(split, plan.split_ms)
                                                if split > 0 else None)
            elif (is_completion or method == "HEAD"
                  or (up_resp.content_length is not None
                      and up_resp.content_length <= _READ_WHOLE_MAX)):
                try:
                    data = await up_resp.read()
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    # The upstream failed before its whole answer arrived (nothing sent yet).
                    obs.status = 504 if isinstance(exc, asyncio.TimeoutError) else 502
                    self.upstream.poke()
                    return self._upstream_failed(rid, obs.status, "while answering", exc, timeout)
                obs.ttft_s = time.perf_counter() - t0
                if preq is not None and data:
                    self._observe_json(path, data, obs)
                if split > 0 and data:
                    data = figures.rewrite(data, split, plan.split_ms)
                sent = web.Response(status=up_resp.status, reason=up_resp.reason, headers=headers,
                                    body=data)
                await sent.prepare(request)
                await sent.write_eof()
                obs.completed = True
            else:
                sent = await self._relay_stream(request, up_resp, headers, obs, t0, None, timed=False)
            return sent
        except asyncio.CancelledError:
            disconnected = True
            raise
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            disconnected = True
            return sent or web.Response(status=499)
        finally:
            obs.total_s = time.perf_counter() - t0
            if isinstance(up_resp, aiohttp.ClientResponse):
                self._relaying.discard(up_resp)
                self._forward_up.pop(up_resp, None)
                if obs.completed:
                    up_resp.release()
                else:
                    up_resp.close()  # drop the connection: llama-server cancels the task
            if obs.status:
                self.stats.request(path, obs.status)
            if disconnected and not obs.completed:
                self.stats.disconnect(path)
            if preq is not None:
                self._finish(preq, plan, obs, disconnected, observe=plannable)
            elif log.isEnabledFor(logging.DEBUG):
                log.debug("[%s] %s %s %s %.1fms", rid, method, request.path_qs, obs.status,
                          obs.total_s * 1e3)

    async def _reroute(self, preq: ParsedRequest, plan: Plan, body: bytes) -> tuple[Plan, bytes] | None:
        """Several servers: the plan's server refused the connection (now marked down). End that
        plan (release + observe as a 503) and plan the request again; the new plan, or None when
        there is none elsewhere (the client then gets the 503)."""
        if len(self.upstreams) < 2:
            return None
        dead = self.upstream
        self._spawn(self._after(preq, plan, Observation(status=503, completed=False), True))
        try:
            new_plan, out_body = await self._plan(preq, body)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.warning("[%s] re-planning after %s refused the connection failed", preq.request_id,
                        dead.base_url, exc_info=True)
            return None
        chosen = next((u for u in self.upstreams
                       if new_plan.upstream and u.base_url == new_plan.upstream.rstrip("/")), None)
        if chosen is None or chosen is dead:
            if new_plan.release is not None:
                self._spawn(self._release_only(preq.request_id, new_plan))
            return None
        log.info("[%s] %s refused the connection: routed to %s instead", preq.request_id,
                 dead.base_url, chosen.base_url)
        _CURRENT_UPSTREAM.set(chosen)
        return new_plan, out_body

    async def _stale_plan(self, preq: ParsedRequest, plan: Plan, body: bytes,
                          up_resp: aiohttp.ClientResponse, untouched: bool = False) -> tuple[Plan | None, bytes]:
        """The server refused ``plan``'s ``upstream_headers`` with 412: it is not the process the plan
        was made for (``X-Llama-Server-If-Boot``, patches/0007: a restart since the slot table's last
        ``GET /slots``) and did no work for the request. The plan is ended (its completion cancelled,
        so that ``release`` marks its slot unknown), the upstream probed (the new process
        identified before anything is planned for it), and the request planned again: the new plan
        and body, or (None, the client's body) when that fails or ``untouched`` (forwarded
        untouched, fail-open)."""
        rid = preq.request_id
        try:
            async with asyncio.timeout(self.config.probe_timeout_s):
                detail = (await up_resp.read())[:300].decode("utf-8", "replace")
        except (aiohttp.ClientError, asyncio.TimeoutError):
            detail = ""
        up_resp.release()
        self._relaying.discard(up_resp)
        self._forward_up.pop(up_resp, None)
        log.info("[%s] llama-server refused the plan: it is another process than the one the plan "
                 "was made for (412 %s); planned again", rid, detail)
        self.stats.stale_plan()
        await self._end_plan(rid, plan)
        await self.upstream.probe()
        if untouched:
            return None, body
        return await self._plan_again(preq, body)

    async def _end_plan(self, rid: str, plan: Plan) -> None:
        """End a plan whose request did not reach the server it was made for: its completion
        cancelled (so that ``release`` marks its slot unknown), then released."""
        if plan.completion is not None:
            plan.completion.cancel()
        if plan.release is not None:
            await self._release_only(rid, plan)

    async def _plan_again(self, preq: ParsedRequest, body: bytes) -> tuple[Plan | None, bytes]:
        """Plan a request once more after its first plan was ended (``_end_plan``) because the
        server changed: the new plan and body, or (None, the client's body) when planning fails
        twice (forwarded untouched, fail-open)."""
        rid = preq.request_id
        for attempt in (1, 2):
            try:
                return await self._plan(preq, body)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # the new process may not answer everything yet (GET /slots 503 'Loading model'
                # right after it came up): one more plan once it is probed again
                if attempt == 1 and await self.upstream.probe() == "ready":
                    log.info("[%s] planning for the new server failed (%s: %s): planning again", rid,
                             type(exc).__name__, exc)
                    continue
                log.exception("[%s] cache layer plan() failed for the new server: forwarding untouched", rid)
                self.stats.layer_error("plan")
        return None, body

    async def _upstream_state(self, rid: str, path: str) -> str:
        """The upstream state after the shared probe (waited for at most ``PROBE_WAIT_S``); while it
        loads its model, the request is held until it is ready, at most ``loading_wait_s``."""
        state = await self.upstream.check(PROBE_WAIT_S)
        if path in _PROBE_ROUTES or self.config.loading_wait_s <= 0:
            return state
        if state == "loading" or (state == "down" and self.upstream.restarting):
            # loading its model; or the llama-server ocache launched exited and the supervisor
            # is starting another (Upstream.expect_restart): held for it, as llama-server's own
            # clients would retry, rather than answered 503 in the second before the new one binds
            self.stats.held_loading()
            log.info("[%s] llama-server is %s: holding the request (up to %g s)", rid,
                     "loading its model" if state == "loading" else "being started again by ocache",
                     self.config.loading_wait_s)
            await self.upstream.wait_ready(self.config.loading_wait_s)
            state = self.upstream.state
        return state

    async def _forward(self, request: web.Request, rid: str, body: bytes, has_body: bool,
                       timeout: aiohttp.ClientTimeout, obs: Observation,
                       up_headers: Mapping[str, str] | None = None):
        """Send the request upstream (``up_headers``: the plan's ``upstream_headers``, added): the
        ``ClientResponse``, or ocache's own answer when there is none: 503 (cannot connect / /health
        not answering), 504 (no answer in time), 502 (closed without answering, or an answer that
        is not valid HTTP: any aiohttp client error)."""
        task = asyncio.current_task()
        self._sending.add(task)
        self._forward_up[task] = self.upstream
        try:
            resp = await self._send_upstream(request, body, has_body, timeout, up_headers)
            self._relaying.add(resp)
            self._forward_up[resp] = self.upstream
            return resp
        except asyncio.CancelledError:
            # _abort_forwards cancelled this handler once (the upstream stopped answering) and
            # nothing else did (a client that left cancels it too: then it stays cancelled)
            if task not in self._aborted or task.cancelling() != 1:
                raise
            task.uncancel()
            obs.status = 503
            self.stats.upstream_unavailable()
            return self._unavailable(rid)
        except aiohttp.ClientConnectorError as exc:
            obs.status = 503
            request[_CONNECT_FAILED] = True
            self.upstream.notify_unreachable(f"{type(exc).__name__}: {exc}")
            self.stats.upstream_unavailable()
            return self._unavailable(rid)
        except asyncio.TimeoutError as exc:
            if request.path in _HEALTH_ROUTES:
                obs.status = 503
                self.upstream.notify_unreachable(
                    f"no answer to {request.path} in {timeout.sock_read:g} s (stopped or hung)", hung=True)
                self.stats.upstream_unavailable()
                return self._unavailable(rid)
            obs.status = 504
            self.upstream.poke()
            return self._upstream_failed(rid, 504, "before answering", exc, timeout)
        except aiohttp.ClientError as exc:
            obs.status = 502
            self.upstream.poke()
            return self._upstream_failed(rid, 502, "before answering", exc, timeout)
        finally:
            self._sending.discard(task)
            self._forward_up.pop(task, None)
            self._aborted.discard(task)

    async def _held_503(self, request: web.Request, rid: str, body: bytes, has_body: bool,
                        timeout: aiohttp.ClientTimeout, obs: Observation,
                        up_resp: aiohttp.ClientResponse, up_headers: Mapping[str, str] | None = None):
        """The upstream answered 503: if it is loading its model (restarted since the last probe),
        hold the request until it is ready (``loading_wait_s``) and send it again (a 503 "Loading
        model" was answered before any work, server-http.cpp:307-327); else its 503 stands."""
        state = await self.upstream.probe()
        if state != "loading" or self.config.loading_wait_s <= 0:
            return up_resp
        try:
            await up_resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        self.stats.held_loading()
        log.info("[%s] llama-server answered 503 while loading its model: holding the request (up "
                 "to %g s)", rid, self.config.loading_wait_s)
        up_resp.release()
        self._relaying.discard(up_resp)
        self._forward_up.pop(up_resp, None)
        # ready: the request is served; still loading after the bound: the client gets the
        # server's own 503, with Retry-After (added by the caller)
        await self.upstream.wait_ready(self.config.loading_wait_s)
        return await self._forward(request, rid, body, has_body, timeout, obs, up_headers)

    def _upstream_failed(self, rid: str, status: int, when: str, exc: BaseException,
                         timeout: aiohttp.ClientTimeout) -> web.Response:
        url = self.upstream.base_url
        if isinstance(exc, asyncio.TimeoutError):
            what = (f"sent no byte for {timeout.sock_read:g} s {when} (upstream_read_timeout_s / "
                    "stream_idle_timeout_s)")
        elif isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
                              aiohttp.ClientConnectionResetError)) and when == "before answering":
            what = f"closed the connection without answering ({type(exc).__name__})"
        else:
            what = f"failed {when}: {type(exc).__name__}: {exc}"
        log.warning("[%s] upstream %s %s", rid, url, what)
        return _json_error(status, f"upstream {url} {what}", "server_error" if status == 502
                           else "timeout_error", rid, upstream=url)

    async def _send_upstream(self, request: web.Request, body: bytes, has_body: bool,
                             timeout: aiohttp.ClientTimeout | None = None,
                             up_headers: Mapping[str, str] | None = None) -> aiohttp.ClientResponse:
        url = URL(self.upstream.base_url + request.raw_path, encoded=True)
        headers = forward_request_headers(request.headers)
        if up_headers:
            # a header the client sent itself is forwarded as it is (a client's own
            # X-Llama-Server-If-Boot, patches/0007, is its precondition for the server to judge)
            headers.update({k: v for k, v in up_headers.items() if k not in headers})
        has_body = has_body or bool(body) or "Content-Length" in request.headers
        kw = dict(data=body if has_body else None, headers=headers, skip_auto_headers=_SKIP_AUTO,
                  allow_redirects=False, auto_decompress=False)
        if timeout is not None:
            kw["timeout"] = timeout
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
                            observer: _SSEObserver | None, timed: bool = False,
                            rewriter: "figures.LineRewriter | None" = None) -> web.StreamResponse:
        """Relay the body chunk by chunk as it arrives. Between chunks the upstream's silence is
        bounded by the request's ``sock_read``; ``timed``: also by a per-chunk timer of
        ``stream_idle_timeout_s`` (an SSE answer to a request whose body did not say
        ``"stream": true``, so whose ``sock_read`` is the longer read timeout). ``rewriter``: corrects
        the reuse figures line by line (ocache/api/figures.py); the observer still reads the server's."""
        sse = observer is not None or headers.get("Content-Type", "").startswith("text/event-stream")
        resp = web.StreamResponse(status=up_resp.status, reason=up_resp.reason, headers=headers)
        if sse:
            resp.headers["X-Accel-Buffering"] = "no"
        elif up_resp.content_length is not None:
            resp.content_length = up_resp.content_length
        await resp.prepare(request)
        chunks = up_resp.content.iter_any()
        idle = self.config.stream_idle_timeout_s if timed and sse else None
        try:
            while True:
                try:
                    if idle is None:
                        chunk = await chunks.__anext__()
                    else:
                        async with asyncio.timeout(idle):
                            chunk = await chunks.__anext__()
                except StopAsyncIteration:
                    break
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    # The upstream died, hung (stream_idle_timeout_s) or sent invalid framing
                    # mid-response: end the client's connection without a clean end-of-stream so
                    # it cannot mistake a truncated answer for a complete one.
                    log.warning("[%s] upstream failed mid-response: %s", headers.get("X-OCache-Request-Id"),
                                "no chunk in time (stream_idle_timeout_s / upstream_read_timeout_s)"
                                if isinstance(exc, asyncio.TimeoutError)
                                else f"{type(exc).__name__}: {exc}")
                    self.upstream.poke()
                    if request.transport is not None:
                        request.transport.close()
                    return resp
                out = rewriter.feed(chunk) if rewriter is not None else chunk
                try:
                    if out:
                        await resp.write(out)  # a client that went away raises here (not caught)
                finally:
                    # observed even when the client left during this write: it is what the server
                    # did (Codex CLI closes right after response.completed, the chunk with timings);
                    # the server's own figures, for the cache layer
                    if observer is not None:
                        observer.feed(chunk)
                if obs.ttft_s is None and (observer is None or observer.first_at is not None):
                    obs.ttft_s = (time.perf_counter() if observer is None else observer.first_at) - t0
                if observer is not None and observer.final and (rewriter is None or not rewriter.holding):
                    # the final event was written: complete, even if the client closes now
                    obs.completed = True
        finally:
            if observer is not None:
                obs.timings, obs.usage = observer.timings, observer.usage
                if observer.message is not None:   # [align]
                    obs.message, obs.finish_reason = observer.message, observer.finish_reason
        if rewriter is not None and rewriter.holding:
            await resp.write(rewriter.flush())
        await resp.write_eof()
        obs.completed = True
        return resp

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

    @staticmethod
    def _observe_json(path: str, data: bytes, obs: Observation) -> None:
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return
        if not isinstance(obj, dict):
            return
        if isinstance(obj.get("timings"), dict):
            obs.timings = obj["timings"]
        if isinstance(obj.get("usage"), dict):
            obs.usage = obj["usage"]
            if obs.timings is None:  # an Anthropic answer carries usage only
                obs.timings = timings_from_usage(obs.usage)
        if obs.status == 200:
            obs.content = _content_of(path, obj)
            # [align] the chat answer as relayed, for the aligned route (ocache/cache/align_route.py)
            choice = (obj.get("choices") or [None])[0] if isinstance(obj.get("choices"), list) else None
            if isinstance(choice, dict) and isinstance(choice.get("message"), dict):
                obs.message, obs.finish_reason = choice["message"], choice.get("finish_reason")

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
                disconnected: bool, observe: bool = True) -> None:
        """The request's log line, stats record and ``_after`` (release, observe, recorder); for a
        plan whose ``completion`` is still running, once it is done (``_plan_completed``)."""
        if plan is not None and plan.completion is not None and not plan.completion.done():
            self._spawn(self._finish_completed(preq, plan, obs, disconnected, observe))
            return
        if plan is not None and plan.completion is not None:
            self._completion_failed(preq.request_id, plan.completion)
        self._finish_now(preq, plan, obs, disconnected, observe)

    async def _finish_completed(self, preq: ParsedRequest, plan: Plan, obs: Observation,
                                disconnected: bool, observe: bool) -> None:
        await self._plan_completed(preq.request_id, plan)
        self._finish_now(preq, plan, obs, disconnected, observe)

    def _finish_now(self, preq: ParsedRequest, plan: Plan | None, obs: Observation,
                    disconnected: bool, observe: bool = True) -> None:
        slot = None
        if plan is not None and isinstance(plan.body_updates.get("id_slot"), int):
            slot = plan.body_updates["id_slot"]
        elif preq.body is not None and isinstance(preq.body.get("id_slot"), int) \
                and preq.body["id_slot"] >= 0:
            slot = preq.body["id_slot"]
        headers = plan.headers if plan is not None else {}
        tier = headers.get("X-OCache-Tier") or "none"
        split = plan.split_tokens if plan is not None and obs.status == 200 else 0
        # the figures the client read: reuse from before this request only (ocache/api/figures.py)
        timings = figures.correct_timings(obs.timings, split, plan.split_ms if split else 0.0)
        t = timings or {}
        restore_ms = headers.get("X-OCache-Restore-Ms")
        record = {
            "request_id": preq.request_id, "path": preq.path, "status": obs.status,
            "stream": preq.stream, "slot": slot, "tier": tier, "kind": headers.get("X-OCache-Kind"),
            "split": split,
            "n_prompt": (int((obs.timings or {}).get("cache_n") or 0)
                         + int((obs.timings or {}).get("prompt_n") or 0)) if obs.timings else None,
            "prompt_n": t.get("prompt_n"), "cache_n": t.get("cache_n"),
            "prompt_ms": t.get("prompt_ms"), "predicted_n": t.get("predicted_n"),
            "restore_ms": float(restore_ms) if restore_ms else None,
            "predicted": int(headers["X-OCache-Predicted-Cache"])
            if "X-OCache-Predicted-Cache" in headers else None,
            "ttft_s": obs.ttft_s, "total_s": round(obs.total_s, 6), "completed": obs.completed,
            "epoch": self.upstream.epoch, "time": time.time(),
        }
        if len(self.upstreams) > 1:
            record["upstream"] = self.upstream.base_url
        if preq.body is None:
            # a body ocache could not parse (forwarded byte for byte, counted as unplannable at
            # parse): the upstream's answer is relayed, but it is no completion of ocache's
            self.stats.unparsed(preq.path, obs.status)
        elif obs.completed or disconnected:
            self.stats.completion(preq.path, tier, timings, obs.ttft_s, record, split=split)
        log.info("[%s] %s", preq.request_id, request_line(record, preq.method, disconnected))
        self._spawn(self._after(preq, plan, obs, observe))

    async def _release_only(self, rid: str, plan: Plan) -> None:
        try:
            await plan.release()
        except Exception:
            self.stats.layer_error("release")
            log.exception("[%s] cache layer release() failed", rid)

    async def _after(self, preq: ParsedRequest, plan: Plan | None, obs: Observation,
                     observe: bool = True) -> None:
        """Release the plan, then ``layer.observe`` (not for a request that was never shown to the
        layer because the upstream was loading or not llama-server), then the recorder."""
        if plan is not None:
            if plan.release is not None:
                await self._release_only(preq.request_id, plan)
            try:
                await self.layer.observe(preq, plan, obs)
            except Exception:
                self.stats.layer_error("observe")
                log.exception("[%s] cache layer observe() failed", preq.request_id)
        elif preq.body is not None and observe:
            # Fail-open or no plan: the layer still learns what happened under an empty plan.
            try:
                await self.layer.observe(preq, Plan(), obs)
            except Exception:
                self.stats.layer_error("observe")
                log.exception("[%s] cache layer observe() failed", preq.request_id)
        if self.recorder is not None:
            await asyncio.to_thread(self.recorder.record, preq, plan, obs)

    # --- ocache's own routes --------------------------------------------------------------------
    def stats_body(self) -> dict:
        """The ``GET /v1/cache/stats`` JSON (also what the dashboard, ocache/dashboard.py, reads)."""
        try:
            layer = self.layer.stats() if self.layer is not None else {}
        except Exception as exc:
            self.stats.layer_error("stats")
            layer = {"error": f"{type(exc).__name__}: {exc}"}
        body = {**self.stats.to_dict(), "inflight": self.inflight,
                "upstream": self.upstream.to_dict(), "layer": layer,
                "layer_class": type(self.layer).__name__}
        if len(self.upstreams) > 1:
            body["upstreams"] = [u.to_dict() for u in self.upstreams]
        return body

    async def _admin(self, request: web.Request, rid: str, path: str) -> web.Response:
        """ocache's own routes; method and token were checked by ``_guard`` (ocache/admin.py)."""
        if path == "/v1/cache/stats":
            body = self.stats_body()
            if not request.get(admin.ADMIN):
                body = admin.redact(body)
                body["redacted"] = ("session ids and slot owners hidden: send Authorization: "
                                    "Bearer <admin_token>")
            resp = web.json_response(body)
        elif path == "/v1/cache/metrics":
            resp = web.Response(body=self.stats.prometheus(),
                                headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
        else:  # POST /v1/cache/clear
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
        resp.headers["X-OCache-Request-Id"] = rid
        return resp


def request_line(rec: dict, method: str, disconnected: bool = False) -> str:
    """The per-request log line, from a ``last_completions`` record (``_finish``), e.g.
    ``POST /v1/chat/completions 200 agent slot 0: prefilled 77, reused 7,251 from resident,
    restore 18.2 ms; generated 4; ttft 329 ms, total 329 ms``. ``prefilled`` is the server's
    ``timings.prompt_n``, ``reused`` its ``cache_n`` (tokens; both as corrected for ``split``, the
    tokens ocache prefilled itself for the request, ocache/api/figures.py), ``from`` the X-OCache-Tier; without
    timings (an error, a non-llama-server answer) only status and times are shown."""
    def n(v: Any) -> str:
        return f"{int(v):,}" if isinstance(v, (int, float)) else "?"

    if disconnected:
        state = " (client closed after the final event)" if rec.get("completed") else " DISCONNECTED"
    else:
        state = "" if rec.get("completed") else " INCOMPLETE"
    head = (f"{method} {rec['path']}{' stream' if rec.get('stream') else ''} {rec['status']}{state}"
            f" {rec.get('kind') or 'other'}"
            f" slot {'?' if rec.get('slot') is None else rec['slot']}"
            + (f" on {rec['upstream'].split('://', 1)[-1]}" if rec.get("upstream") else ""))
    parts = []
    if rec.get("prompt_n") is not None or rec.get("cache_n") is not None:
        reuse = f"prefilled {n(rec.get('prompt_n'))}, reused {n(rec.get('cache_n'))}"
        if rec.get("tier") not in (None, "none", "cold"):
            reuse += f" from {rec['tier']}"
        if rec.get("split"):  # ocache's own split/warm-up steps: counted in prefilled, not reused
            reuse += f" (split {n(rec['split'])}: prefilled by ocache's own steps)"
        if rec.get("restore_ms") is not None:
            reuse += f", restore {rec['restore_ms']:.1f} ms"
        parts.append(reuse)
        if rec.get("predicted_n") is not None:
            parts.append(f"generated {n(rec['predicted_n'])}")
    ttft = rec.get("ttft_s")
    parts.append(f"ttft {'-' if ttft is None else f'{ttft * 1e3:.0f} ms'}, "
                 f"total {rec['total_s'] * 1e3:.0f} ms")
    return f"{head}: {'; '.join(parts)}"


# --- ocache serve ---------------------------------------------------------------------------------
async def serve(config: Config, stop: asyncio.Event | None = None,
                ready: Callable[["Proxy", int], None] | None = None,
                layer_factory: Callable[[Upstream, Config], Any] | None = None,
                handle_signals: bool = True) -> None:
    """Run the proxy until SIGTERM/SIGINT (or ``stop`` is set); then stop accepting, drain in-flight
    requests (``drain_timeout_s``), call ``layer.drain()``, and stop the launched child if any.
    ``ready(proxy, port)`` is called once listening. Raises OSError if the address is taken,
    ``supervisor.LaunchError`` if the child cannot be started."""
    from ocache.supervisor import LaunchError, Supervisor

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
    supervisors: list = []
    runner = None
    try:
        if config.launch:
            from ocache.paths import state_root

            n = config.launch_replicas
            from ocache.llama.flags import given_flags

            if n > 1 and given_flags(list(config.launch)).get("port") is not None:
                raise LaunchError("launch_replicas > 1 gives each child its own free port: remove "
                                  "--port from the llama-server arguments")
            for i in range(n):
                kw = {}
                if config.launch_devices:
                    kw["env"] = {"CUDA_VISIBLE_DEVICES": config.launch_devices[i % len(config.launch_devices)]}
                # the child's stdout+stderr: where a failed start explains itself (tail logged on exit)
                sup = Supervisor(config.launch, binary=config.launch_binary,
                                 log_path=state_root() / ("llama-server.log" if n == 1
                                                          else f"llama-server-{i}.log"),
                                 max_quick_failures=config.launch_max_failures,
                                 backend=config.launch_backend, **kw)
                sup.on_give_up = stop.set  # a child that cannot start: stop, exit non-zero
                supervisors.append(sup)
            config.upstream = supervisors[0].url
            if n > 1:
                config.upstreams = [s.url for s in supervisors]
            for sup in supervisors:
                await sup.start()
        proxy = Proxy(config, layer_factory=layer_factory,
                      pid_source=supervisors[0].pid if supervisors else None,
                      pid_sources=[s.pid for s in supervisors] or None)
        proxy.stop_event = stop
        for sup, up in zip(supervisors, proxy.upstreams):
            sup.on_start = up.poke
            sup.on_exit = up.expect_restart     # requests are held for the next child, not 503
            # a child that cannot start: the requests held for it get the 503 now, then ocache stops
            sup.on_give_up = (lambda up=up: (up.restart_abandoned(), stop.set()))
            sup.calls_inflight = proxy.calls_inflight   # recorded when SIGTERM is sent
        runner = web.AppRunner(proxy.make_app(), handler_cancellation=True,
                               shutdown_timeout=config.drain_timeout_s,
                               keepalive_timeout=config.client_keepalive_s, **RUNNER_KWARGS)
        await runner.setup()
        site = web.TCPSite(runner, config.host, config.port)
        await site.start()
        # the bound port (differs from config.port when that is 0: the OS picked one)
        port = next((a[1] for a in runner.addresses if isinstance(a, tuple)), config.port)
        log.info("ocache listening on http://%s:%d -> %s", config.host, port,
                 ", ".join(config.upstreams) if len(config.upstreams) > 1 else config.upstream)
        if config.host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("listening on %s, not loopback: anyone who can reach this port can use the "
                        "model%s", config.host, "" if config.admin_token else " (and no admin_token is set)")
        if ready:
            ready(proxy, port)
        await stop.wait()
        proxy.begin_stop()   # no more background GET /slots: the drain's own calls are awaited
        failed = next((s.failed for s in supervisors if s.failed), None)
        if failed:
            await site.stop()
            raise LaunchError(failed)
        log.info("stopping: no new connections, draining %d in-flight request(s)", proxy.inflight)
        await site.stop()
        await proxy.drain(config.drain_timeout_s)
    finally:
        if runner is not None:
            # cancels what is still in flight, then Proxy.close: quiesce (the monitors, the
            # reconciles, every slot call answered, bounded) and the connections closed; only then
            # does a launched llama-server get SIGTERM (README "Limitations")
            await runner.cleanup()
        for sup in supervisors:
            await sup.stop()
        for sig in signals:
            loop.remove_signal_handler(sig)
        log.info("ocache stopped")
