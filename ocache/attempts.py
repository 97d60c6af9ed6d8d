"""One request's way to an answer: plan it, send it, recover, in one loop (``Attempts``).

Each recovery acts on what the upstream said, and only when the server did no work for the
request, so nothing that reached a server runs twice:

| the upstream | what ocache does |
|---|---|
| down or loading before the plan | one shared probe; held while it loads (``loading_wait_s``); down: 503 |
| ``plan`` raised, the server changed meanwhile (restart, loading) | probed, held, planned once more |
| refused the connection (several servers) | the plan ended (a 503 for the layer), planned on the others, once |
| answered 503 while loading its model | held until ready, sent again (server-http.cpp:307-327) |
| answered 412 to the plan's precondition | the plan ended, the upstream probed, planned again (``STALE_REPLANS``) |
| answered 412 to the client's own precondition | the plan ended, the 412 is the answer |
| stopped answering (hung) | the send, or the plan waiting on the server, ends with ocache's 503 (``ocache/forward.py``) |

The request's state lives in one ``Attempt``; ``Attempt.plan`` is always the plan in hand: a plan
is taken off it (``Attempts._end``) before its receipt is spent, so the finish path, which reads
``Attempt.plan`` whenever the handler ends (a client that leaves mid re-plan included), never
releases a plan twice (``ocache/layer.py`` ``Receipt``).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from ocache import admin
from ocache.credentials import CredentialCheck
from ocache.forward import CONNECT_FAILED, CURRENT_UPSTREAM, UpstreamHung, unavailable
from ocache.layer import NullLayer, Observation, ParsedRequest, Plan
from ocache.ports import ProxyPorts
from ocache.tokens import TokenViewError
from ocache.wire import NULL_DROPS, STEERING, other_body, unplanned_body, with_fields

log = logging.getLogger("ocache.proxy")

#: times one request is planned again after the server refused its plan's precondition (412:
#: another process than the one the plan was made for, ``Attempts._stale``); refused once more,
#: it is forwarded untouched
STALE_REPLANS = 2
#: Seconds a request waits for the shared upstream probe when the upstream is not known ready
#: (a refused connection answers in milliseconds; a hung one is not waited for at all).
PROBE_WAIT_S = 1.0
#: llama-server's own probe routes: a 503 from one of them is the answer, never held
PROBE_ROUTES = frozenset({"/health", "/v1/health", "/metrics", "/props", "/slots"})


#: bytes per token above which a body cannot fit the slot's context: a token is a few bytes of
#: text, at most ~6 per character as a JSON ``\\u`` escape; 64 leaves room for roles, tools and
#: markup. A body above ``max(PLAN_MIN_BYTES, 64 * n_ctx)`` is not planned (``too_large``)
BYTES_PER_TOKEN_MAX = 64
#: bodies up to this size are always planned (images in base64 take bytes, not tokens)
PLAN_MIN_BYTES = 16 << 20
#: a body with media (base64 images, audio) may be large and short in tokens: the server judges it
_MEDIA = re.compile(rb'"(?:image_url|input_audio|image|input_image|file)"')


def too_large(body: bytes, props: Mapping | None) -> bool:
    """Whether ``body`` has more bytes than its prompt could ever fit the server's slot context
    (``props["default_generation_settings"]["n_ctx"]``, tokens) at ``BYTES_PER_TOKEN_MAX``: the
    server refuses such a prompt after tokenizing it, so ocache forwards it unplanned instead of
    building a token view of it (a 50 MB body spent the view's whole 120 s, then logged a
    traceback). False when the context is not known."""
    dgs = (props or {}).get("default_generation_settings")
    n_ctx = dgs.get("n_ctx") if isinstance(dgs, Mapping) else None
    if not isinstance(n_ctx, int) or n_ctx <= 0:
        return False
    return len(body) > max(PLAN_MIN_BYTES, BYTES_PER_TOKEN_MAX * n_ctx)


def up_headers(plan: Plan | None) -> Mapping[str, str] | None:
    """The request headers a plan adds to the forwarded request (``Plan.upstream_headers``)."""
    return (plan.upstream_headers or None) if plan is not None else None


@dataclass
class Attempt:
    """One request on its way: what the client sent (``body``, bytes; ``preq``: the parsed
    completion, None for other routes), the plan in hand and the body it makes (``out_body``),
    the headers ocache adds to the answer (``extra``), and the answer's ``Observation``."""

    request: web.Request
    rid: str
    t0: float                      # time.perf_counter() at receipt, seconds
    body: bytes
    has_body: bool
    preq: ParsedRequest | None
    timeout: aiohttp.ClientTimeout
    out_body: bytes = b""
    plan: Plan | None = None
    plannable: bool = True         # False: not shown to the layer (foreign, loading)
    fail_open: bool = False
    extra: dict[str, str] = field(default_factory=dict)
    obs: Observation = field(default_factory=lambda: Observation(status=0, completed=False))
    up_resp: aiohttp.ClientResponse | None = None
    sent: web.StreamResponse | None = None
    #: the answer's bytes as the upstream sent them (the body, or the SSE stream), recorded for the
    #: response cache when this request answers its key (ocache/response_cache.py); None: not kept
    keep: bytearray | None = None
    #: the server's verdict on the request's credentials (``Attempts.accepted``); None: not asked
    credentials_ok: bool | None = None

    @property
    def path(self) -> str:
        return self.request.path

    def stamp(self, fail_open: bool = False) -> None:
        """The answer's ocache headers for the plan in hand: the request id, ``X-OCache-Fail-Open``
        when the layer failed, the plan's headers, and ``X-OCache-Plan-Ms`` (ms from receipt to
        this forward, for a completion)."""
        self.extra = {"X-OCache-Request-Id": self.rid}
        if fail_open:
            self.extra["X-OCache-Fail-Open"] = "plan"
        if self.plan is not None:
            self.extra.update(self.plan.headers)
        if self.preq is not None:
            self.extra["X-OCache-Plan-Ms"] = f"{(time.perf_counter() - self.t0) * 1e3:.2f}"


class Attempts:
    """The plan-send-recover loop, whole: the plan (``layer.plan`` and the body it makes), the
    probe and the hold before it, every send and every recovery, over ``proxy``'s ports (its
    layer, upstreams, stats, receipts, forwards and finisher: ``ocache.ports.ProxyPorts``)."""

    def __init__(self, proxy: ProxyPorts) -> None:
        self.proxy = proxy
        self._refused_epoch: object = None   # the server process whose refusal was logged
        self.credentials = CredentialCheck()

    async def _plan(self, preq: ParsedRequest, body: bytes) -> tuple[Plan, bytes]:
        """``layer.plan`` and the body it makes (``with_fields``); the plan's receipt is taken at
        once (``ReceiptLedger.take``), and spent here if the body cannot be made."""
        p = self.proxy
        plan = await p.layer.plan(preq)
        p.receipts.take(plan)
        out_body = body
        # a client's own steering fields never pass (wire.STEERING): without a cache layer only
        # ocache_splice is ours to drop, id_slot reaches the server as it would without ocache
        drop = NULL_DROPS if isinstance(p.layer, NullLayer) else STEERING
        if plan.body_updates or (preq.body is not None and any(k in preq.body for k in drop)):
            try:
                out_body = with_fields(body, preq.body if preq.body is not None else {}, plan.body_updates, drop)
            except BaseException:
                p.spawn(p.finisher.release(preq.request_id, plan))
                raise
        return plan, out_body

    async def _upstream_state(self, rid: str, path: str) -> str:
        """The upstream state after the shared probe (waited for at most ``PROBE_WAIT_S``); while it
        loads its model, the request is held until it is ready, at most ``loading_wait_s``."""
        p = self.proxy
        up = p.upstream
        state = await up.check(PROBE_WAIT_S)
        if path in PROBE_ROUTES or p.config.loading_wait_s <= 0:
            return state
        if state == "loading" or (state == "down" and up.restarting):
            # loading its model; or the llama-server ocache launched exited and the supervisor
            # is starting another (Upstream.expect_restart): held for it, as llama-server's own
            # clients would retry, rather than answered 503 in the second before the new one binds
            p.stats.held_loading()
            log.info("[%s] llama-server is %s: holding the request (up to %g s)", rid,
                     "loading its model" if state == "loading" else "being started again by ocache",
                     p.config.loading_wait_s)
            await up.wait_ready(p.config.loading_wait_s)
            state = up.state
        return state

    async def accepted(self, att: Attempt) -> bool:
        """Whether the server accepts ``att``'s credentials (``CredentialCheck``, asked once per
        request and remembered on it): True when ocache has no ``upstream_api_key`` (the server
        checks none it knows of) or no session to ask with; False when the check got no answer.
        Asked before the response cache and the plan: a client the server refuses is neither
        replayed a stored answer nor given a token view."""
        if att.credentials_ok is None:
            up = self.proxy.upstream
            if att.preq is None or not up.api_key or up.session is None:
                return True
            att.credentials_ok = await self.credentials.accepted(up.session, up.base_url, up.epoch,
                                                                 att.preq.headers)
        return att.credentials_ok

    # --- plan -----------------------------------------------------------------------------------
    async def plan(self, att: Attempt) -> web.Response | None:
        """Plan the request (a completion with a JSON object body, on a ready llama-server), then
        route it to the plan's server. Returns ocache's 503 when the upstream is down, else None
        (``att.plan`` is the plan, or None: forwarded untouched)."""
        p = self.proxy
        att.out_body = att.body
        if p.upstream.state == "foreign":
            att.plannable = False  # not llama-server: forwarded without the layer (the monitor re-probes)
        elif p.upstream.state != "ready":
            # Down or loading: one shared probe now, so that a server that just came up is
            # identified (epoch, restart callbacks) before the cache layer plans anything for it.
            state = await self._upstream_state(att.rid, att.path)
            if state == "down":
                return self._down(att)
            att.plannable = state == "ready"
        preq = att.preq
        if preq is not None and preq.body is not None and att.plannable and too_large(att.body, p.upstream.props):
            # more bytes than the server's context can hold as tokens: not planned (no token view
            # spending its whole bound on it); text only: llama-server's own 400 at once (it spent
            # 60 s tokenizing 50 MB before refusing it); with media: forwarded for the server to judge
            log.info("[%s] body of %d bytes exceeds what the slot context holds: not planned", att.rid,
                     len(att.body))
            p.stats.unplannable("size")
            att.plannable = False
            if not _MEDIA.search(att.body):
                return self._too_large(att)
        if preq is not None and preq.body is not None and att.plannable and not await self.accepted(att):
            # the server checks keys and refuses this one: nothing is planned for a client the
            # server will answer 401 (ocache/credentials.py)
            p.stats.unplannable("credentials")
            att.plannable = False
        if preq is not None and preq.body is not None and att.plannable:
            epoch = p.upstream.epoch
            try:
                # the hung verdict ends a plan waiting on the server (a token view, a restore)
                att.plan, att.out_body = await p.forwards.planned(p.upstream, self._plan(preq, att.body))
            except asyncio.CancelledError:
                raise
            except UpstreamHung:
                log.warning("[%s] llama-server stopped answering while the request was planned", att.rid)
                return self._down(att)
            except RecursionError:
                log.warning("[%s] body nested too deeply for the cache layer: forwarded untouched", att.rid)
                p.stats.unplannable("nesting")
                preq.body = None
            except Exception as exc:
                down = await self._plan_failed(att, preq, epoch, exc)
                if down is not None:
                    return down
        if att.plan is not None and att.plan.upstream and len(p.upstreams) > 1:
            chosen = p.upstream_named(att.plan.upstream)
            if chosen is not None:
                CURRENT_UPSTREAM.set(chosen)
        att.stamp(att.fail_open)
        return None

    async def _plan_failed(self, att: Attempt, preq: ParsedRequest, epoch: object,
                           exc: Exception) -> web.Response | None:
        """``plan`` raised. The upstream itself (restarted inside the probe window, loading its
        model) or ocache's own fault? Only the latter is a layer error (fail-open); after the
        former, held while it loads, and planned once more. Returns ocache's 503 when it is down."""
        p = self.proxy
        state = await p.upstream.probe()
        if state == "ready" and p.upstream.epoch == epoch:
            status = getattr(exc, "status", 0)
            if status in (401, 403):
                # a server started with --api-key refuses ocache's own GET /slots (its /health is
                # open, so it looks ready): one line per server process, not a traceback a request
                if self._refused_epoch != epoch:
                    self._refused_epoch = epoch
                    log.warning("[%s] llama-server answers %s to ocache's own requests (%s): it runs "
                                "with --api-key; set upstream_api_key (env OCACHE_UPSTREAM_API_KEY) to "
                                "its key. Until then every request is forwarded untouched, uncached",
                                att.rid, status, exc)
            elif isinstance(exc, TokenViewError) and exc.timed_out:
                # the token view got no answer in time (a busy or starved server): a condition the
                # message names, not a fault of ocache's code to trace
                log.warning("[%s] the token view failed (%s): forwarding untouched", att.rid, exc)
            else:
                log.exception("[%s] cache layer plan() failed: forwarding untouched", att.rid)
            p.stats.layer_error("plan")
            att.fail_open = True
            return None
        log.warning("[%s] llama-server changed while planning (%s, epoch %s -> %s: %s)",
                    att.rid, state, epoch, p.upstream.epoch, type(exc).__name__)
        state = await self._upstream_state(att.rid, att.path)
        if state == "down":
            return self._down(att)
        if state == "ready":
            try:
                att.plan, att.out_body = await self._plan(preq, att.body)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("[%s] cache layer plan() failed: forwarding untouched", att.rid)
                p.stats.layer_error("plan")
                att.fail_open = True
        return None

    def _too_large(self, att: Attempt) -> web.Response:
        """ocache's 400 for a text body larger than the slot context can hold, in llama-server's
        shape for it (``exceed_context_size_error``, server-common.cpp's ``format_error_response``)."""
        p = self.proxy
        p.stats.request(att.path, 400)
        dgs = (p.upstream.props or {}).get("default_generation_settings") or {}
        resp = admin.error(400, f"request ({len(att.body)} bytes) exceeds the available context size "
                           f"({dgs.get('n_ctx')} tokens) at any tokenization, try increasing it",
                           "exceed_context_size_error", att.rid)
        return resp

    def _down(self, att: Attempt) -> web.Response:
        p = self.proxy
        p.stats.upstream_unavailable()
        p.stats.request(att.path, 503)
        return unavailable(p.config, p.upstream, att.rid)

    # --- send, recover --------------------------------------------------------------------------
    async def send(self, att: Attempt) -> aiohttp.ClientResponse | web.Response:
        """Forward the request and recover (the table in the module docstring): the upstream's
        answer to relay, or ocache's own 502/503/504."""
        resp = await self._forward(att)
        if (not isinstance(resp, aiohttp.ClientResponse) and att.request.get(CONNECT_FAILED)
                and att.plan is not None and att.plan.upstream and att.preq is not None):
            # the chosen server refused the connection (died since its last probe): the request
            # never reached it, so it is planned again on the servers still up (once)
            if await self._reroute(att, att.preq):
                resp = await self._forward(att)
        if not isinstance(resp, aiohttp.ClientResponse):
            return resp
        if resp.status == 503 and att.path not in PROBE_ROUTES and att.plannable:
            resp = await self._held_503(att, resp)
            if not isinstance(resp, aiohttp.ClientResponse):
                return resp
        for attempt in range(STALE_REPLANS + 1):
            headers = up_headers(att.plan)
            if resp.status != 412 or not headers or att.preq is None:
                break
            if any(k in att.request.headers for k in headers if not k.lower().startswith("x-ocache-")):
                # the client's own precondition refused (it was forwarded as the client sent it,
                # Forwards._send): the server's 412 is the answer, as without ocache; the plan is
                # ended (the server did no work: its slot marked unknown)
                plan_ms = att.extra.get("X-OCache-Plan-Ms", "")
                await self._end(att)
                att.extra = {"X-OCache-Request-Id": att.rid, "X-OCache-Plan-Ms": plan_ms}
                break
            # the server is not the process the plan was made for (patches/0007): it did no
            # work for the request; the plan is ended and the request planned again
            await self._stale(att, att.preq, resp, untouched=attempt == STALE_REPLANS)
            resp = await self._forward(att)
            if not isinstance(resp, aiohttp.ClientResponse):
                return resp
        return resp

    async def _forward(self, att: Attempt) -> aiohttp.ClientResponse | web.Response:
        """One send of the request as planned now to the current upstream (``Forwards.forward``,
        ocache/forward.py). A completion sent without a
        plan to a llama-server never carries the client's ``id_slot`` (``wire.unplanned_body``), nor
        does a POST to any other route (``wire.other_body``): removed, or ocache's 400 when the
        body cannot be rewritten."""
        att.obs.status = 0
        body = att.out_body
        p = self.proxy
        if att.plan is None and att.body and p.upstream.state != "foreign":
            if att.preq is not None:
                unplanned = unplanned_body(att.body, att.preq.body)
            elif att.request.method == "POST":
                unplanned = other_body(att.body, NULL_DROPS if isinstance(p.layer, NullLayer) else STEERING)
            else:
                unplanned = att.body
            if unplanned is None:
                att.obs.status = 400
                log.info("[%s] unplanned body may name a steering field: 400", att.rid)
                return admin.error(400, "ocache could not parse this body and will not forward an "
                                   "id_slot or ocache_* field it may hold (send plain UTF-8 JSON "
                                   "without a BOM, nested less deeply)", "invalid_request_error", att.rid)
            body = unplanned
        resp = await p.forwards.forward(p.upstream, att.request, att.rid, body, att.has_body, att.timeout,
                                        att.obs, up_headers(att.plan))
        att.up_resp = resp if isinstance(resp, aiohttp.ClientResponse) else None
        return resp

    def _done_with(self, resp: aiohttp.ClientResponse) -> None:
        resp.release()
        self.proxy.forwards.done(resp)

    async def _end(self, att: Attempt) -> None:
        """End the plan in hand: the request did not reach the server it was made for. Taken off
        ``att`` first (the finish path then never sees it), its completion cancelled (so that its
        release marks its slot unknown), then its receipt spent, in a task of its own that a client
        leaving meanwhile does not cancel (the layer's release then runs to its end, once)."""
        plan, att.plan = att.plan, None
        att.out_body = att.body
        if plan is None:
            return
        if plan.completion is not None:
            plan.completion.cancel()
        await asyncio.shield(self.proxy.spawn(self.proxy.finisher.release(att.rid, plan)))

    async def _reroute(self, att: Attempt, preq: ParsedRequest) -> bool:
        """Several servers: the plan's server refused the connection (now marked down). End that
        plan (release + observe as a 503) and plan the request again; True when the new plan names
        another server (now the current one), False when there is none (the client then gets the
        503)."""
        p = self.proxy
        if len(p.upstreams) < 2:
            return False
        dead = p.upstream
        plan, att.plan = att.plan, None
        att.out_body = att.body
        p.spawn(p.finisher.after(preq, plan, Observation(status=503, completed=False), True))
        try:
            new_plan, out_body = await self._plan(preq, att.body)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.warning("[%s] re-planning after %s refused the connection failed", att.rid,
                        dead.base_url, exc_info=True)
            return False
        chosen = p.upstream_named(new_plan.upstream)
        if chosen is None or chosen is dead:
            p.spawn(p.finisher.release(att.rid, new_plan))
            return False
        log.info("[%s] %s refused the connection: routed to %s instead", att.rid,
                 dead.base_url, chosen.base_url)
        CURRENT_UPSTREAM.set(chosen)
        att.plan, att.out_body = new_plan, out_body
        att.stamp()
        return True

    async def _held_503(self, att: Attempt, resp: aiohttp.ClientResponse) -> aiohttp.ClientResponse | web.Response:
        """The upstream answered 503: if it is loading its model (restarted since the last probe),
        hold the request until it is ready (``loading_wait_s``) and send it again (a 503 "Loading
        model" was answered before any work, server-http.cpp:307-327); else its 503 stands."""
        p = self.proxy
        state = await p.upstream.probe()
        if state != "loading" or p.config.loading_wait_s <= 0:
            return resp
        try:
            await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        p.stats.held_loading()
        log.info("[%s] llama-server answered 503 while loading its model: holding the request (up "
                 "to %g s)", att.rid, p.config.loading_wait_s)
        self._done_with(resp)
        # ready: the request is served; still loading after the bound: the client gets the
        # server's own 503, with Retry-After (added by the relay)
        await p.upstream.wait_ready(p.config.loading_wait_s)
        return await self._forward(att)

    async def _stale(self, att: Attempt, preq: ParsedRequest, resp: aiohttp.ClientResponse,
                     untouched: bool = False) -> None:
        """The server refused the plan's ``upstream_headers`` with 412: it is not the process the
        plan was made for (``X-Llama-Server-If-Boot``, patches/0007: a restart since the slot
        table's last ``GET /slots``) and did no work for the request. The plan is ended
        (``_end``), the upstream probed (the new process identified before anything is planned for
        it), and the request planned again; ``untouched`` (or planning fails): forwarded untouched,
        fail-open."""
        p = self.proxy
        try:
            async with asyncio.timeout(p.config.probe_timeout_s):
                detail = (await resp.read())[:300].decode("utf-8", "replace")
        except (aiohttp.ClientError, asyncio.TimeoutError):
            detail = ""
        self._done_with(resp)
        log.info("[%s] llama-server refused the plan: it is another process than the one the plan "
                 "was made for (412 %s); planned again", att.rid, detail)
        p.stats.stale_plan()
        await self._end(att)
        await p.upstream.probe()
        if not untouched:
            await self._plan_again(att, preq)
        # receipt to this forward: the refused one and the plan made again included
        att.stamp(fail_open=att.plan is None)

    async def _plan_again(self, att: Attempt, preq: ParsedRequest) -> None:
        """Plan a request once more after its first plan was ended because the server changed:
        ``att.plan`` the new plan, or None when planning fails twice (forwarded untouched)."""
        p = self.proxy
        for attempt in (1, 2):
            try:
                att.plan, att.out_body = await self._plan(preq, att.body)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # the new process may not answer everything yet (GET /slots 503 'Loading model'
                # right after it came up): one more plan once it is probed again
                if attempt == 1 and await p.upstream.probe() == "ready":
                    log.info("[%s] planning for the new server failed (%s: %s): planning again",
                             att.rid, type(exc).__name__, exc)
                    continue
                log.exception("[%s] cache layer plan() failed for the new server: forwarding "
                              "untouched", att.rid)
                p.stats.layer_error("plan")
