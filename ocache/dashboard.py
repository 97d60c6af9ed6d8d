"""The live view of a running ocache: ``GET /ocache/`` (a page), ``GET /ocache/api/view`` (its JSON).

One source of figures: :func:`view` turns the ``GET /v1/cache/stats`` body (``Proxy.stats_body``)
into the shape the page, ``ocache top`` and ``ocache stats`` (ocache/commands/top.py) show; nothing here counts
anything itself. The page (``ocache/data/dashboard/``: plain HTML + JS + the vendored Chart.js, see
its README) polls ``/ocache/api/view`` once a second; it works offline.

Routes (all GET, loopback like the rest of ocache):

| route | answer |
|---|---|
| ``/ocache`` | 308 to ``/ocache/`` |
| ``/ocache/`` | ``index.html`` |
| ``/ocache/static/NAME`` | a file of ``ocache/data/dashboard/`` (only names listed there) |
| ``/ocache/api/view`` | JSON: :func:`view` of the current stats; session ids (slot owners) and file-system paths only with ``Authorization: Bearer <admin_token>`` (as ``GET /v1/cache/stats``: without it, or with a wrong one, redacted, events included, and ``token_rejected`` true when one was sent; no token configured: always hidden) |

Events: :func:`install_event_log` keeps the last :data:`EVENTS_KEPT` INFO+ lines of the ``ocache``
loggers (anchors, spills, restores, evictions, restarts) for the page's event list; it is process
wide (several proxies in one process share it).

Shapes of :func:`view` (tokens are counts of tokens, bytes are bytes, ``*_s`` seconds, ``*_ms`` ms):

* ``totals``: ``completions``, ``unparsed`` (answers to completion bodies ocache could not parse,
  forwarded byte for byte: not completions, no figures), ``prefilled`` (Σ ``timings.prompt_n``: tokens the server computed),
  ``reused`` (Σ ``timings.cache_n`` as corrected, ocache/api/figures.py: tokens reused from
  before each request, so already without the tokens ocache prefilled itself for it),
  ``split`` (Σ of those: each request's own split prefill, ``tokens.split``; it is in
  ``prefilled``), ``own_prefill`` (every token ocache prefilled itself: head warm-ups, anchor and
  user splits, ``ocache warm``; the slot table's ``own_prefill_tokens``, summed over the servers,
  else ``layer.warmup_tokens``), ``own_outside`` = ``own_prefill - split`` (at least 0: what ocache
  prefilled outside the counted requests), ``saved_vs_alone`` (the headline: ``alone_prefill`` - ``ocache_prefill``,
  what llama-server alone with the same flags would have prefilled for the same requests,
  ``ocache.llama.alone``, minus what it prefilled through ocache; can be negative; None without a
  cache layer), ``saved_vs_alone_s`` (it at the measured rate), ``saved`` = ``reused -
  own_outside`` (at least 0: the saving against a cold prefill of every request, which is
  Σ prompt tokens minus the server's prefill counter; the split counted once), ``prefill_tok_s`` (the
  measured prefill rate, ``layer.prefill_tokens_per_s``), ``saved_s`` = ``saved / prefill_tok_s``
  (None before a rate is measured), ``disk_bytes`` (the store's files), ``fail_open``,
  ``mispredictions``, ``reused_by_tier`` (Σ ``cache_n`` per X-OCache-Tier);
* ``upstream``: ``state``, ``epoch``, ``restarts``, ``build_info``, ``url``;
* ``slots``: per slot ``id``, ``kind``, ``tokens``, ``head_len``, ``checkpoints``, ``busy``, ``origin``,
  ``idle_s``, ``owner`` (None when hidden or none) and ``owner_hidden``;
* ``requests``: the last completions (at most 20, oldest first): ``request_id``, ``time``,
  ``kind``, ``slot``, ``tier``, ``prefilled``, ``reused``, ``restore_ms``, ``ttft_ms``, ``status``;
* ``tiers``: ``head`` (saves, restores), ``disk`` (anchors, restores, hits, save/restore p50 s),
  ``session`` (spills, restores, hits, spill/restore p50 s, entries, bytes);
* ``align`` (``layer.align``: ocache/cache/align_route.py): ``enabled``, ``aligned``
  (requests served from the slot's own tokens after a history rewrite), ``saved`` (their saving
  against llama-server alone, ``aligned_saved_vs_alone``), ``saved_vs_slot`` (tokens those
  requests sent as is to their slot would have prefilled again at least, ``aligned_saved_tokens``:
  not a saving against the server alone),
  ``refused`` (splices the server refused: planned again as sent), ``requests``: the latest
  aligned ones (``request_id``, ``time``, ``slot``, ``kept``: the slot's tokens served, ``new``:
  tokens prefilled, ``saved``: against the server alone, ``saved_vs_slot``);
* ``store``: ``entries``, ``bytes``, ``budget_bytes``, ``by_kind`` (``anchor``/``spill`` →
  entries, bytes, hits), ``next_eviction`` (the entry eviction would take first);
* ``tiers_off``: the tiers the server's setup turns off (``tier``, ``why``, ``fix``:
  ``ocache.cache.report.tiers_off``), ``tiers_checked`` (the setup checks ran: false before
  llama-server was first ready; None without a cache layer, ``--no-cache``), ``tiers_off_lines`` (them as the page's top box, the first lines of
  ``ocache stats`` and of ``ocache serve``'s log: ``ocache.llama.checks.tiers_off_lines``);
* ``servers`` (several llama-servers behind one ocache, ocache/router.py; empty with one): per
  server ``url``, ``state``, ``epoch``, ``inflight``, ``routed`` (requests sent there), ``reasons``
  (routed by reason: ``prefix``, ``round robin``, ``only ready server``, ...), ``slots``,
  ``busy_slots``, ``tokens`` (held in its slots), ``prefilled``/``reused`` (its layer's totals).
  ``requests`` rows then carry ``upstream``.
"""

from __future__ import annotations

import collections
import logging
import time
from importlib import resources
from typing import Any, Callable

from aiohttp import web

from ocache.llama.checks import tiers_off_lines

#: Lines kept for the page's event list.
EVENTS_KEPT = 100
KIND_NAMES = {"a": "anchor", "s": "spill"}

_events: collections.deque = collections.deque(maxlen=EVENTS_KEPT)
_handler: logging.Handler | None = None


class _EventHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.getMessage()
        except Exception:  # a bad format string must not break logging
            return
        if record.name == "ocache.proxy" and record.levelno == logging.INFO and msg.startswith("["):
            return  # per-request lines: the page has them as ``requests``
        _events.append({"time": record.created, "level": record.levelname.lower(),
                        "source": record.name.removeprefix("ocache."), "message": msg})


def install_event_log() -> None:
    """Keep INFO+ lines of the ``ocache.*`` loggers for the page (idempotent)."""
    global _handler
    if _handler is None:
        _handler = _EventHandler(level=logging.INFO)
        logging.getLogger("ocache").addHandler(_handler)


def events() -> list[dict]:
    return list(_events)


def _int(v: Any) -> int:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0


def _own_prefill(layer: dict) -> int:
    """Every token ocache prefilled itself (``SlotTable.counters["own_prefill_tokens"]``, in
    ``layer.table``; with several servers, ``layer.router.servers[].layer.table``, summed), else
    (a layer that does not report it) its head warm-ups, ``layer.warmup_tokens``."""
    rows = (layer.get("router") or {}).get("servers") if isinstance(layer.get("router"), dict) else None
    tables = ([((r or {}).get("layer") or {}).get("table") for r in rows] if rows
              else [layer.get("table")])
    found = [t["own_prefill_tokens"] for t in tables if isinstance(t, dict) and "own_prefill_tokens" in t]
    return sum(_int(n) for n in found) if found else _int(layer.get("warmup_tokens"))


def view(stats: dict, admin: bool = False) -> dict:
    """The dashboard's figures from a ``/v1/cache/stats`` body (see the module docstring).
    ``admin``: show slot owners (session ids)."""
    layer = stats.get("layer") or {}
    tok = stats.get("tokens") or {}
    disk = layer.get("tier_disk") or {}
    sess = layer.get("tier_session") or {}
    store = dict(disk.get("store") or {})
    if not store and sess:  # no disk tier: the session tier's own share of the store
        store = {"entries": sess.get("entries", 0), "bytes": sess.get("bytes", 0),
                 "budget_bytes": sess.get("budget_bytes"),
                 "by_kind": {"s": {"entries": sess.get("entries", 0), "bytes": sess.get("bytes", 0)}}}
    reused, prefilled = _int(tok.get("cache_n")), _int(tok.get("prompt_n"))
    split = _int(tok.get("split"))
    own = _own_prefill(layer)
    outside = max(0, own - split)
    saved = max(0, reused - outside)
    rate = layer.get("prefill_tokens_per_s")
    rate = float(rate) if isinstance(rate, (int, float)) and rate > 0 else None
    completions = sum(_int(n) for by_tier in (stats.get("completions") or {}).values()
                      for n in by_tier.values())
    unparsed = sum(_int(n) for by_status in (stats.get("unparsed") or {}).values()
                   for n in by_status.values())
    up = stats.get("upstream") or {}
    by_kind = {KIND_NAMES.get(k, k): v for k, v in (store.get("by_kind") or {}).items()}
    return {
        "time": time.time(),
        "uptime_s": stats.get("uptime_s"),
        "admin": admin,
        "totals": {
            "completions": completions, "unparsed": unparsed, "prefilled": prefilled, "reused": reused,
            "split": split, "own_prefill": own, "own_outside": outside, "saved": saved, "prefill_tok_s": rate,
            "saved_s": None if rate is None else round(saved / rate, 3),
            **_alone(layer.get("alone"), rate),
            "disk_bytes": _int(store.get("bytes")),
            "fail_open": _int(stats.get("fail_open")),
            "mispredictions": _int(layer.get("mispredictions")),
            "inflight": _int(stats.get("inflight")),
            "reused_by_tier": {k.split(".")[1]: _int(n) for k, n in tok.items()
                               if k.startswith("tier.") and k.endswith(".cache_n")},
        },
        "upstream": {"state": up.get("state"), "epoch": up.get("epoch"),
                     "restarts": _int(up.get("restarts")), "build_info": up.get("build_info"),
                     "url": up.get("url")},
        "slots": [_slot_row(s, admin) for s in layer.get("slots") or []],
        "requests": [_request_row(r) for r in stats.get("last_completions") or []],
        "tiers": {
            "head": {"saves": _int(layer.get("head_saves")), "restores": _int(layer.get("head_restores"))},
            "disk": {"enabled": bool(disk), "anchors": _int(disk.get("anchors_written")),
                     "restores": _int(disk.get("restores")), "hits": _int(disk.get("hits")),
                     "save_s_p50": disk.get("save_s_p50"), "restore_s_p50": disk.get("restore_s_p50")},
            "session": {"enabled": bool(sess), "spills": _int(sess.get("spills")),
                        "restores": _int(sess.get("restores")), "hits": _int(sess.get("hits")),
                        "entries": _int(sess.get("entries")), "bytes": _int(sess.get("bytes")),
                        "spill_s_p50": sess.get("spill_s_p50"),
                        "restore_s_p50": sess.get("restore_s_p50")},
        },
        "store": {"entries": _int(store.get("entries")), "bytes": _int(store.get("bytes")),
                  "budget_bytes": store.get("budget_bytes"), "by_kind": by_kind,
                  "by_folder": store.get("by_folder") or [],
                  "next_eviction": store.get("next_eviction")},
        "align": _align(layer),
        "setup_warnings": list(layer.get("setup_warnings") or []),
        "tiers_off": list(layer.get("tiers_off") or []),
        "tiers_checked": layer.get("tiers_checked"),
        # the lines ocache serve's log and ocache stats print first (empty: every tier on)
        "tiers_off_lines": tiers_off_lines(layer.get("tiers_off") or []) if layer.get("tiers_off") else [],
        "servers": _servers(layer),
    }


def _slot_row(s: dict, admin: bool) -> dict:
    """One slot of the layer's stats as the dashboard shows it; its owner (a session id) only to
    an ``admin``, else only whether it has one."""
    owner = s.get("owner")
    return {"id": s.get("id"), "kind": s.get("kind"), "tokens": _int(s.get("tokens")),
            "head_len": _int(s.get("head_len")), "checkpoints": _int(s.get("checkpoints")),
            "busy": bool(s.get("busy")), "origin": bool(s.get("origin")),
            "idle_s": s.get("idle_s"),
            "owner": owner if admin else None,
            "owner_hidden": bool(owner) and not admin}


def _request_row(r: dict) -> dict:
    """One of the proxy's last completions (``last_completions``) as the dashboard shows it:
    tokens prefilled and reused, the restore's milliseconds, the time to first token in ms."""
    ttft = r.get("ttft_s")
    return {"request_id": r.get("request_id"), "time": r.get("time"),
            "kind": r.get("kind"), "slot": r.get("slot"), "tier": r.get("tier"),
            "prefilled": _int(r.get("prompt_n")), "reused": _int(r.get("cache_n")),
            "restore_ms": r.get("restore_ms"),
            "ttft_ms": None if ttft is None else round(ttft * 1e3, 1),
            "status": r.get("status"),
            **({"upstream": r["upstream"]} if r.get("upstream") else {})}


def _align(layer: dict) -> dict:
    """The aligned route's figures (``layer.align``, see the module docstring)."""
    a = layer.get("align")
    if not isinstance(a, dict):
        a = {}
    return {"enabled": bool(a.get("enabled")), "aligned": _int(a.get("aligned")),
            "saved": _int(a.get("aligned_saved_vs_alone")), "saved_vs_slot": _int(a.get("aligned_saved_tokens")),
            "refused": _int(a.get("aligned_refused")),
            "requests": [{"request_id": r.get("request_id"), "time": r.get("time"), "slot": r.get("slot"),
                          "kept": _int(r.get("kept")), "new": _int(r.get("new")),
                          "saved": _int(r.get("saved_vs_alone")), "saved_vs_slot": _int(r.get("saved"))}
                         for r in (a.get("last") or []) if isinstance(r, dict)]}


def _alone(alone: Any, rate: float | None) -> dict:
    """The saving against llama-server alone with the same flags (``layer.stats()['alone']``,
    ``ocache.llama.alone``): None where the layer does not model it (``--no-cache``, a router)."""
    if not isinstance(alone, dict):
        return {"saved_vs_alone": None, "saved_vs_alone_s": None, "alone_prefill": None,
                "ocache_prefill": None}
    saved = _int(alone.get("prefill")) - _int(alone.get("ocache_prefill"))
    return {"saved_vs_alone": saved, "saved_vs_alone_s": None if rate is None else round(saved / rate, 3),
            "alone_prefill": _int(alone.get("prefill")), "ocache_prefill": _int(alone.get("ocache_prefill"))}


def _servers(layer: dict) -> list[dict]:
    """One row per server behind the router (``layer.router.servers``, ocache/router.py); empty
    with one server."""
    rows = []
    for r in ((layer.get("router") or {}).get("servers") or []):
        ls = r.get("layer") if isinstance(r.get("layer"), dict) else {}
        slots = ls.get("slots") or []
        rows.append({"url": r.get("url"), "state": r.get("state"), "epoch": r.get("epoch"),
                     "inflight": _int(r.get("inflight")), "routed": _int(r.get("routed")),
                     "reasons": dict(r.get("reasons") or {}),
                     "busy_slots": sum(1 for x in slots if x.get("busy")), "slots": len(slots),
                     "tokens": sum(_int(x.get("tokens")) for x in slots),
                     "prefilled": _int(ls.get("prefilled_tokens")),
                     "reused": _int(ls.get("reused_tokens"))})
    return rows


# ---------------------------------------------------------------------- routes

def _static_names() -> dict[str, str]:
    files = resources.files("ocache") / "data" / "dashboard"
    types = {".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".md": "text/markdown"}
    return {p.name: types.get("." + p.name.rsplit(".", 1)[-1], "application/octet-stream")
            for p in files.iterdir() if p.is_file()}


def _static(name: str) -> web.Response:
    names = _static_names()
    if name not in names:
        raise web.HTTPNotFound(text=f"no dashboard file {name!r}")
    data = (resources.files("ocache") / "data" / "dashboard" / name).read_bytes()
    return web.Response(body=data, content_type=names[name], charset="utf-8",
                        headers={"Cache-Control": "no-cache"})


async def handle(request: web.Request, stats_body: Callable[[], dict], admin: bool,
                 private_paths: Callable[[], list] = list) -> web.StreamResponse:
    """Answer a request under ``/ocache`` (see the module docstring). ``admin``: the request carried
    the admin token (the proxy's guard decided, ocache/admin.py); without it the view, its events
    included, is redacted (``admin.redact``: slot owners and session strings dropped, ``owner_hidden``
    stays; the paths of ``private_paths()`` and any other absolute path shown as placeholders), and
    ``token_rejected`` says whether a (wrong) token was sent."""
    from ocache import admin as admin_mod

    path = request.path
    if request.method not in ("GET", "HEAD"):
        return admin_mod.error(405, f"{request.method} not allowed on {path} (use GET)",
                               "invalid_request_error")
    try:
        if path == "/ocache":
            raise web.HTTPPermanentRedirect("/ocache/")
        if path == "/ocache/":
            return _static("index.html")
        if path.startswith("/ocache/static/"):
            return _static(path.removeprefix("/ocache/static/"))
        if path == "/ocache/api/view":
            body = view(stats_body(), admin=admin)
            body["events"] = events()
            if not admin:  # view() already drops owners; redact() also drops any session string and path
                body = admin_mod.redact(body, private_paths())
            body["token_rejected"] = not admin and request.headers.get("Authorization", "").startswith("Bearer ")
            return web.json_response(body, headers={"Cache-Control": "no-store"})
        raise web.HTTPNotFound(text=f"no dashboard route {path}")
    except web.HTTPException as exc:
        return exc
