"""ocache's admin surface: one guard for every admin route, one error shape.

Routes and who may use them (``Config.admin_token``; ``Authorization: Bearer <admin_token>``):

| route | without a configured token | token configured, missing or wrong | right token |
|---|---|---|---|
| ``POST /v1/cache/clear``, ``/warm``, ``/drain`` | 404 (the routes are off) | 401 | served |
| ``GET /v1/cache/stats`` | served, redacted | served, redacted | served in full |
| ``GET /v1/cache/metrics`` | served (counters only, no ids) | served | served |
| ``GET /ocache/``, ``/ocache/api/view`` (the dashboard, ocache/dashboard.py) | served, redacted | served, redacted (``token_rejected``) | served in full |
| ``POST /slots/{id}?action=save|restore|erase`` (llama-server's own) | 403 while the cache layer is on | 403 | 403 |

*Redacted* stats drop every value that names a client: the slot ``owner`` (the client's session id,
``x-session-affinity``/``x-session-id``) and any string ``session``/``session_id``/``session_hint``
field, at any depth; and no text in them names a file-system path: the folders ocache knows
(``AdminRoutes.private_paths``) read ``<state>`` (its state directory), ``<cache>`` (the build and
model cache), ``<slots>`` (llama-server's ``--slot-save-path``) and ``<model>`` (the GGUF), and any
other absolute path in a string (an event's message, an error) reads ``<path>``. The same holds for
the dashboard's JSON, events included.

Slot actions from clients are refused, not forwarded: ocache's slot table (``ocache/slots.py``) is
the one owner of what each slot holds; a client's save/restore/erase behind its back would make
every prediction and every restore decision about that slot wrong until the next reconcile (issue
12 §7). With ``--no-cache`` (the NullLayer owns nothing) they are forwarded as any other route.
Talk to llama-server directly for slot files of your own.

Every error ocache itself answers has one shape (the OpenAI/llama-server error object, so clients
that parse llama-server's errors parse ocache's too)::

    {"error": {"code": <http status>, "message": "<why, what to do>", "type": "<kind>_error", ...}}

with ``X-OCache-Request-Id`` when the request has an id.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterable, Mapping, Sequence

from aiohttp import web

from ocache.layer import NullLayer
from ocache.wire import host_name

if TYPE_CHECKING:
    from ocache.ports import ProxyPorts

log = logging.getLogger("ocache.proxy")

#: an aiohttp handler: what the guard passes a request on to
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
#: the dashboard's handler (``ocache.dashboard.handle``): request, the stats JSON, admin or not,
#: the private paths to scrub
Dashboard = Callable[[web.Request, Callable[[], dict], bool, Callable[[], list]],
                     Awaitable[web.StreamResponse]]

#: POST routes that change the cache or stop ocache: they need the admin token.
ADMIN_POST = frozenset({"/v1/cache/clear", "/v1/cache/warm", "/v1/cache/drain"})
#: GET routes that only report: open (stats redacted without the token).
ADMIN_GET = frozenset({"/v1/cache/stats", "/v1/cache/metrics"})
#: llama-server's slot actions: ``POST /slots/:id_slot`` (tools/server/server.cpp:291) dispatches
#: ``action`` = save / restore / erase, anything else is 400 (server-context.cpp:4841-4871).
SLOT_ACTIONS = frozenset({"save", "restore", "erase"})
#: every spelling of ``/slots/{id}`` llama-server routes: cpp-httplib matches ``/slots/:id_slot`` with
#: a trailing slash too (``/slots/0/?action=erase`` once erased slot 0 behind the guard), so
#: repeated and trailing slashes are matched here as well (the path is percent-decoded by aiohttp)
_SLOT_PATH = re.compile(r"^/+slots/+[^/]+/*$")
_Key = getattr(web, "RequestKey", None)  # aiohttp >= 3.12; plain strings before
#: request storage: the request id ocache gave the request, and whether it carried the admin token
RID = _Key("ocache_rid", str) if _Key else "ocache_rid"
ADMIN = _Key("ocache_admin", bool) if _Key else "ocache_admin"
#: keys whose values name a client (a session id), dropped from redacted stats
#: keys whose (string) values a caller without the admin token never reads: session ids, and every
#: project folder or file-system path (the stats and the view once named project folders and the
#: state directory to a caller without the token)
PRIVATE_KEYS = frozenset({"owner", "session", "session_id", "session_hint", "folder", "dir", "cwd", "path",
                          "cache_dir", "state_dir", "data_dir", "meta_dir", "slot_save_path", "model_path"})


def error(status: int, message: str, type_: str, rid: str | None = None, **extra: Any) -> web.Response:
    """The one error response shape (see the module docstring)."""
    resp = web.json_response({"error": {"code": status, "message": message, "type": type_, **extra}},
                             status=status)
    if rid:
        resp.headers["X-OCache-Request-Id"] = rid
    return resp


def token_ok(request: web.BaseRequest, token: str | None) -> bool:
    """Whether ``request`` carries ``Authorization: Bearer <token>`` (constant-time compare)."""
    if not token:
        return False
    auth = request.headers.get("Authorization", "")
    given = auth[7:] if auth.startswith("Bearer ") else ""
    return bool(given) and hmac.compare_digest(given.encode(), token.encode())


def denied(request: web.BaseRequest, token: str | None, rid: str | None = None) -> web.Response | None:
    """None if ``request`` may use a token-guarded admin route, else the error to answer: 404 when
    no token is configured (the routes are off), 401 (with ``WWW-Authenticate``) when it is missing
    or wrong."""
    if not token:
        return error(404, f"{request.path} is disabled: set admin_token in the ocache config "
                     "(ocache serve --admin-token TOKEN)", "not_found_error", rid)
    if not token_ok(request, token):
        resp = error(401, "admin token required: Authorization: Bearer <admin_token>",
                     "authentication_error", rid)
        resp.headers["WWW-Authenticate"] = 'Bearer realm="ocache"'
        return resp
    return None


def is_slot_action(request: web.BaseRequest) -> bool:
    """A client's ``POST /slots/{id}?action=save|restore|erase`` (llama-server's slot files), in any
    spelling the server routes: every value of a repeated ``action`` counts (``?action=foo&action=
    restore`` restored a slot behind the guard: the server read the other value)."""
    return (request.method == "POST" and _SLOT_PATH.match(request.path) is not None
            and any(a in SLOT_ACTIONS for a in request.query.getall("action", ())))


def slot_action_refused(request: web.BaseRequest, rid: str | None) -> web.Response:
    """403 for a client's slot action; the message does not name the server's address (a client
    of ocache need not learn where llama-server listens)."""
    action = ",".join(request.query.getall("action", ()))
    return error(403, f"ocache owns llama-server's slots: a client's /slots action={action} would "
                 "change a slot behind ocache's slot table. Use POST /v1/cache/clear (admin token) "
                 "or `ocache warm DIR`, or call llama-server directly",
                 "forbidden_error", rid)


#: an absolute (or ``~/``) path in a text: a ``/`` that does not follow a word character, ``:``,
#: ``/``, ``.``, ``-`` or ``>`` (so not a URL's path, ``tokens/s`` or what follows a placeholder),
#: then characters up to a space, a quote or a bracket
_ABS_PATH = re.compile(r"(?<![\w:/.>-])~?/[^\s'\"`,;:()\[\]{}<>|]+")
#: first components of the HTTP routes messages name (``POST /v1/chat/completions``, ``/slots/0``):
#: not file-system paths
_ROUTE_ROOTS = frozenset({"v1", "slots", "ocache", "props", "metrics", "health", "tokenize", "detokenize",
                          "completion", "completions", "chat", "apply-template", "infill", "embedding",
                          "embeddings", "rerank", "reranking", "lora-adapters", "api"})
#: what a path ``_ABS_PATH`` finds reads as without the token
PATH_PLACEHOLDER = "<path>"


def scrub_text(text: str, paths: Sequence[tuple[str, str]] = ()) -> str:
    """``text`` with each of ``paths`` (``(path, placeholder)``, longest first) replaced by its
    placeholder, then every other absolute path of two or more components by ``PATH_PLACEHOLDER``
    (an HTTP route such as ``/v1/chat/completions`` or ``/slots/0`` stays). Pure."""
    for path, name in paths:
        if path in text:
            text = text.replace(path, name)

    def one(m: re.Match) -> str:
        parts = [x for x in m.group(0).lstrip("~").split("/") if x]
        return m.group(0) if len(parts) < 2 or parts[0] in _ROUTE_ROOTS else PATH_PLACEHOLDER

    return _ABS_PATH.sub(one, text) if "/" in text else text


def redact(obj: Any, paths: Sequence[tuple[str, str]] = ()) -> Any:
    """A copy of ``obj`` without the values of ``PRIVATE_KEYS`` at any depth, and every other
    string (keys too) through :func:`scrub_text` with ``paths`` (iterative: no recursion limit)."""
    paths = sorted(paths, key=lambda p: -len(p[0]))
    out: Any = _shallow(obj)
    if isinstance(out, str):
        return scrub_text(out, paths)
    stack = [out] if isinstance(out, (dict, list)) else []
    while stack:
        node = stack.pop()
        if isinstance(node, dict) and any(isinstance(k, str) and "/" in k for k in node):
            renamed = {(scrub_text(k, paths) if isinstance(k, str) else k): v for k, v in node.items()}
            node.clear()
            node.update(renamed)
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in list(items):
            if isinstance(node, dict) and k in PRIVATE_KEYS and (k == "owner" or isinstance(v, str)):
                del node[k]  # "session" is also a tier's name (a counter key): only string values go
                continue
            if isinstance(v, str):
                node[k] = scrub_text(v, paths)
            elif isinstance(v, (dict, list, tuple)):
                node[k] = _shallow(v)
                stack.append(node[k])
    return out


def known_paths(configs: Iterable[Any], params: Iterable[Any] = ()) -> list[tuple[str, str]]:
    """The folders and files ocache knows, each as ``(path, placeholder)`` in every spelling a
    text may carry (as given, ``~`` expanded, resolved): the state directory (``cache_dir``, else
    ``paths.state_root``) ``<state>``, the cache root ``<cache>``, each ``--slot-save-path``
    (``tiers.session|disk.slot_save_path``, the ``launch`` or ``tiers.resident.server_args`` argv,
    the servers' ``ServerParams``) ``<slots>`` and each ``-m`` model ``<model>``. ``configs``:
    ``Config`` objects; ``params``: ``ServerParams`` (or None). A path without a ``/`` or that is
    ``/`` itself is left out (replacing it would rewrite ordinary words)."""
    import os

    from ocache.config import field_of
    from ocache.llama.flags import given_flags
    from ocache.paths import cache_root, state_root

    found: dict[str, str] = {}

    def add(raw: Any, name: str) -> None:
        if not raw or not isinstance(raw, (str, os.PathLike)):
            return
        raw = str(raw)
        forms = {raw, os.path.expanduser(raw)}
        try:
            forms |= {os.path.abspath(os.path.expanduser(raw)), os.path.realpath(os.path.expanduser(raw))}
        except (OSError, ValueError):
            pass
        for f in forms:
            f = f.rstrip("/") if len(f) > 1 else f
            if "/" in f and f.strip("/") and f not in found:
                found[f] = name

    for cfg in configs:
        tiers = field_of(cfg, "tiers") or {}
        tiers = tiers if isinstance(tiers, dict) else {}
        for name in ("session", "disk"):
            t = tiers.get(name)
            add(t.get("slot_save_path") if isinstance(t, dict) else None, "<slots>")
        res = tiers.get("resident")
        for argv in (field_of(cfg, "launch"), res.get("server_args") if isinstance(res, dict) else None):
            try:
                given = given_flags([str(a) for a in argv]) if argv else {}
            except ValueError:
                given = {}
            add(given.get("slot_save_path"), "<slots>")
            add(given.get("model_path"), "<model>")
        add(field_of(cfg, "cache_dir"), "<state>")
    for p in params:
        add(field_of(p, "slot_save_path"), "<slots>")
        add(field_of(p, "model_path"), "<model>")
    for root, name in ((state_root, "<state>"), (cache_root, "<cache>")):
        try:
            add(root(), name)
        except OSError:
            pass
    return list(found.items())


def _shallow(v: Any) -> Any:
    if isinstance(v, dict):
        return dict(v)
    if isinstance(v, (list, tuple)):
        return list(v)
    return v


def make_drain_handler(stop: Callable[[], None], admin_token: str | None) -> Handler:
    """An aiohttp handler for ``POST /v1/cache/drain`` that the proxy mounts: checks the admin token
    (``Authorization: Bearer``; 404 when no token is configured, like the other admin routes), answers
    202 and calls ``stop()`` (the same event SIGTERM sets in ``ocache.serving.serve``: stop accepting,
    finish in-flight requests, ``layer.drain()`` spills, then exit)."""

    async def handle(request: web.Request) -> web.Response:
        refused = denied(request, admin_token)
        if refused is not None:
            return refused
        asyncio.get_running_loop().call_soon(stop)
        return web.json_response({"draining": True}, status=202)

    return handle


def _is_dashboard(path: str) -> bool:
    return path == "/ocache" or path.startswith("/ocache/")


class AdminRoutes:
    """The guard in front of every route and ocache's own routes, for one proxy (its config,
    layer, stats and upstreams: ``ocache.ports.ProxyPorts``): ``guard`` is the aiohttp middleware, ``serve`` answers
    ``/v1/cache/stats|metrics|clear|warm|drain`` and the dashboard, ``stats_body`` is the stats
    JSON."""

    def __init__(self, proxy: ProxyPorts, extra: Mapping[str, Handler], dashboard: Dashboard) -> None:
        self.proxy = proxy
        self._allowed = proxy.config.bind_names
        self._allow_any = "*" in proxy.config.allowed_hosts
        #: admin routes whose handlers live with their tier: ``POST /v1/cache/warm`` (``ocache warm
        #: DIR``, ocache/warm.py) and ``POST /v1/cache/drain`` (``ocache drain``, ocache/tiers/spill.py)
        self._extra = dict(extra)
        self._dashboard = dashboard     # the dashboard's handler (ocache/dashboard.py ``handle``)

    def _host_ok(self, request: web.Request) -> bool:
        if self._allow_any:
            return True
        host = request.headers.get("Host")
        if host is None:
            return True  # HTTP/1.0 without Host: not a browser, nothing to rebind
        return host_name(host) in self._allowed

    @web.middleware
    async def guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """The one guard in front of every route: a request id, the DNS-rebinding guard, the admin
        token for ``POST /v1/cache/clear|warm|drain`` (404 when no token is set, 401 without the
        right one), ``request[ADMIN]`` for the stats' redaction, and 403 for a client's
        ``/slots/{id}?action=save|restore|erase`` while a cache layer owns the slots."""
        proxy = self.proxy
        token = proxy.config.admin_token
        rid = request[RID] = proxy.new_id()
        path = request.path
        resp: web.StreamResponse | None = None
        if not self._host_ok(request):
            log.warning("[%s] rejected Host %r (DNS-rebinding guard; see allowed_hosts)", rid,
                        request.headers.get("Host"))
            resp = error(403, f"Host {request.headers.get('Host')!r} is not allowed; add it "
                         "to allowed_hosts in the ocache config", "forbidden_error", rid)
        elif path in ADMIN_POST:
            if request.method != "POST":
                resp = error(405, f"{request.method} not allowed on {path} (use POST)",
                             "invalid_request_error", rid)
            else:
                resp = denied(request, token, rid)
            request[ADMIN] = resp is None
        elif path in ADMIN_GET:
            if request.method not in ("GET", "HEAD"):
                resp = error(405, f"{request.method} not allowed on {path} (use GET)",
                             "invalid_request_error", rid)
            request[ADMIN] = token_ok(request, token)
        elif _is_dashboard(path):  # the dashboard: like the stats
            request[ADMIN] = token_ok(request, token)
        elif is_slot_action(request) and getattr(proxy.layer, "owns_slots",
                                                 not isinstance(proxy.layer, NullLayer)):
            log.warning("[%s] refused a client's %s %s (ocache owns the slots)", rid, request.method,
                        request.path_qs)
            resp = slot_action_refused(request, rid)
        if resp is not None:
            proxy.stats.request(path, resp.status)
            return resp
        return await handler(request)

    async def serve(self, request: web.Request, rid: str) -> web.StreamResponse | None:
        """ocache's answer for one of its own routes (counted in the stats), or None for a route
        that goes to llama-server. Method and token were checked by ``guard``."""
        path = request.path
        resp: web.StreamResponse
        if path in ("/v1/cache/stats", "/v1/cache/metrics", "/v1/cache/clear"):
            resp = await self._own(request, rid, path)
        elif _is_dashboard(path):  # the dashboard (ocache/dashboard.py)
            resp = await self._dashboard(request, self.stats_body, bool(request.get(ADMIN)), self.private_paths)
        elif path in self._extra:
            resp = await self._extra[path](request)
        else:
            return None
        resp.headers.setdefault("X-OCache-Request-Id", rid)
        self.proxy.stats.request(path, resp.status)
        return resp

    def private_paths(self) -> list[tuple[str, str]]:
        """``known_paths`` of this proxy: its config, each server's, and the parameters of each
        server's slot table (what ``--slot-save-path`` and ``-m`` the server reported)."""
        proxy = self.proxy
        layer = proxy.layer
        layers = [s.layer for s in getattr(layer, "servers", None) or []] or [layer]
        params = [getattr(getattr(x, "table", None), "params", None) for x in layers]
        return known_paths([proxy.config, *(proxy.server_configs or [])], params)

    def stats_body(self) -> dict[str, Any]:
        """The ``GET /v1/cache/stats`` JSON (also what the dashboard, ocache/dashboard.py, reads):
        the proxy's counters, ``inflight``, ``plans`` (receipts held and repeated releases,
        ``ocache/layer.py``; ``held`` reads 0 when idle), the upstream(s) and ``layer.stats()``."""
        proxy = self.proxy
        try:
            layer = proxy.layer.stats() if proxy.layer is not None else {}
        except Exception as exc:
            proxy.stats.layer_error("stats")
            layer = {"error": f"{type(exc).__name__}: {exc}"}
        body = {**proxy.stats.to_dict(), "inflight": proxy.inflight,
                "plans": proxy.receipts.to_dict(),
                "upstream": proxy.upstream.to_dict(), "layer": layer,
                "layer_class": type(proxy.layer).__name__}
        if len(proxy.upstreams) > 1:
            body["upstreams"] = [u.to_dict() for u in proxy.upstreams]
        if proxy.responses is not None:
            body["response_cache"] = proxy.responses.stats()
        return body

    async def _own(self, request: web.Request, rid: str, path: str) -> web.Response:
        proxy = self.proxy
        if path == "/v1/cache/stats":
            body = self.stats_body()
            if not request.get(ADMIN):
                body = redact(body, self.private_paths())
                body["redacted"] = ("session ids, slot owners and file-system paths hidden: send "
                                    "Authorization: Bearer <admin_token>")
            resp = web.json_response(body)
        elif path == "/v1/cache/metrics":
            resp = web.Response(body=proxy.stats.prometheus(),
                                headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
        else:  # POST /v1/cache/clear
            tier = request.query.get("tier", "all")
            responses = proxy.responses   # the response cache (ocache/response_cache.py), or None
            try:
                if tier == "response":
                    result = responses.clear() if responses is not None else {"tier": tier, "cleared": 0}
                else:
                    result = await proxy.layer.clear(tier)
                    if tier == "all" and responses is not None:
                        result["response"] = responses.clear()["cleared"]
            except ValueError as exc:   # the layer's tiers; this route adds the response cache's
                return error(400, f"{exc} or 'response'", "invalid_request_error", rid)
            except Exception as exc:
                proxy.stats.layer_error("clear")
                log.exception("[%s] cache layer clear(%r) failed", rid, tier)
                return error(500, f"clear failed: {type(exc).__name__}: {exc}", "server_error", rid)
            log.info("[%s] cache cleared (tier=%s): %s", rid, tier, result)
            resp = web.json_response(result)
        resp.headers["X-OCache-Request-Id"] = rid
        return resp
