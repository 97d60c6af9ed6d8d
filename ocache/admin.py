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
field, at any depth.

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
import re
from typing import Any, Callable

from aiohttp import web

#: POST routes that change the cache or stop ocache: they need the admin token.
ADMIN_POST = frozenset({"/v1/cache/clear", "/v1/cache/warm", "/v1/cache/drain"})
#: GET routes that only report: open (stats redacted without the token).
ADMIN_GET = frozenset({"/v1/cache/stats", "/v1/cache/metrics"})
ADMIN_ROUTES = ADMIN_POST | ADMIN_GET
#: llama-server's slot actions: ``POST /slots/:id_slot`` (tools/server/server.cpp:291) dispatches
#: ``action`` = save / restore / erase, anything else is 400 (server-context.cpp:4841-4871).
SLOT_ACTIONS = frozenset({"save", "restore", "erase"})
_SLOT_PATH = re.compile(r"^/slots/[^/]+$")
_Key = getattr(web, "RequestKey", None)  # aiohttp >= 3.12; plain strings before
#: request storage: the request id ocache gave the request, and whether it carried the admin token
RID = _Key("ocache_rid", str) if _Key else "ocache_rid"
ADMIN = _Key("ocache_admin", bool) if _Key else "ocache_admin"
#: keys whose values name a client (a session id), dropped from redacted stats
PRIVATE_KEYS = frozenset({"owner", "session", "session_id", "session_hint"})


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
    """A client's ``POST /slots/{id}?action=save|restore|erase`` (llama-server's slot files)."""
    return (request.method == "POST" and request.query.get("action") in SLOT_ACTIONS
            and _SLOT_PATH.match(request.path) is not None)


def slot_action_refused(request: web.BaseRequest, upstream_url: str, rid: str | None) -> web.Response:
    action = request.query.get("action")
    return error(403, f"ocache owns llama-server's slots: a client's /slots action={action} would "
                 "change a slot behind ocache's slot table. Use POST /v1/cache/clear (admin token) "
                 f"or `ocache warm DIR`, or call llama-server directly at {upstream_url}",
                 "forbidden_error", rid)


def redact(obj: Any) -> Any:
    """A copy of ``obj`` without the values of ``PRIVATE_KEYS`` at any depth (iterative: no
    recursion limit)."""
    out: Any = _shallow(obj)
    stack = [out]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in list(items):
            if isinstance(node, dict) and k in PRIVATE_KEYS and (k == "owner" or isinstance(v, str)):
                del node[k]  # "session" is also a tier's name (a counter key): only string values go
                continue
            if isinstance(v, (dict, list)):
                node[k] = _shallow(v)
                stack.append(node[k])
    return out


def _shallow(v: Any) -> Any:
    if isinstance(v, dict):
        return dict(v)
    if isinstance(v, (list, tuple)):
        return list(v)
    return v


def make_drain_handler(stop: Callable[[], None], admin_token: str | None):
    """An aiohttp handler for ``POST /v1/cache/drain`` that the proxy mounts: checks the admin token
    (``Authorization: Bearer``; 404 when no token is configured, like the other admin routes), answers
    202 and calls ``stop()`` (the same event SIGTERM sets in ``ocache.proxy.serve``: stop accepting,
    finish in-flight requests, ``layer.drain()`` spills, then exit)."""

    async def handle(request: web.Request) -> web.Response:
        refused = denied(request, admin_token)
        if refused is not None:
            return refused
        asyncio.get_running_loop().call_soon(stop)
        return web.json_response({"draining": True}, status=202)

    return handle
