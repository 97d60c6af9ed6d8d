"""Several llama-servers behind one ocache: a ``CacheLayer`` (``ocache/layer.py``) over one
``OCacheLayer`` per server, which picks the server for each completion and hands the request to
that server's layer (docs/architecture.md §6).

Each server keeps everything of its own: its ``Upstream`` (state, epoch, boot id), its
``OCacheLayer`` (slot table, identity, tiers). What they share is the disk store (one
``--slot-save-path`` and one ``cache_dir`` for all: ``ocache.tiers.store.shared_store`` is one
object per process, so a slot file one server saved restores into another of the same identity)
and the warmed heads the layers know (``share_heads``: the head tier's records point at store
entries, which every server of the identity can restore).

Policy ``prefix`` (the default, config ``route_policy``). A turn of a conversation that exactly one
ready server holds in a slot (``OCacheLayer.known_slot``: its earlier messages unchanged) goes there
at once, without estimates (``Router._known``). For any other completion the router asks every
*ready* server's layer ``OCacheLayer.estimate(req)`` (read-only: what the plan would reuse there,
resident or restored by the head/disk/session tiers). The request is prepared once before
(``Router._prepare``: its token view and context, ``ocache/cache/prepare.py``), on the server that
served its session last, else the first ready one; every server of the same identity estimates
from that one view, and the chosen server's plan reuses it and the lookup answers its own estimate
got (``ocache/cache/core.py`` ``lookups``): one token view and one lookup per tier per request. Prefill first (rule 2), in three steps
(``_eligible``): (1) of the servers within one ubatch (the granularity of the ``cache_n``
prediction) of the fewest tokens (prefill + another conversation destroyed), those that are not
full (full: the plan overwrites another live conversation, and every slot holds one or that
slot is busy: ``Estimate.full``), if there are any (a conversation the session tier spills first still has
to come back, and three sessions on two slots lost 1,799 and 3,278 tokens to mispredicted
restores in one ``scripts/bench-multi`` run); (2) of those, the fewest tokens: load
is only the tiebreak among equal token costs; (3) one exception: when every such server has
requests in flight, an idle one (nothing in flight) of the first step with room (an empty slot
or one holding only the kept head: ``Estimate.room``) is a candidate too, because
waiting behind or sharing the compute with running requests can cost more than that extra
prefill (the seconds below decide, with measured rates). Among the candidates it picks the least
expected seconds of work::

    cost_s = (n_tokens - usable) / tps + restore_s + destroys / tps            # this request's prefill
           + queued_prefill_tokens / tps + β · in_flight · mean_request_s      # the server's load

``tps``: the prefill rate (tokens/s): the mean of the servers' measured rates (each layer's EWMA
of ``timings``), one for all (``Router.tps`` says why); 1,000 before any measurement. ``destroys``: tokens of another live conversation
the plan would overwrite without a spill (a guest goes where it destroys least). ``queued prefill``:
the predicted prefill (``X-OCache-Prefilled``) of the requests routed there that have not finished
(reserved when the server is chosen, before any await, so concurrent decisions see each other);
``mean_request_s``: the server's EWMA of observed request durations (``Observation.total_s``;
1 s before any); ``β``: config ``route_load_weight`` (default 0.5: a request in flight costs a new
one about half of a mean request, the share of the server's time they split). A session stays where
its state is because there ``usable`` is its whole conversation; it moves only when another
server can restore as much of it (the shared store: a spill, an anchor) and its load makes it
cheaper, or to an idle server within one ubatch while its own is busy. Ties go to the server with fewer requests in flight, then
the first listed.

A prefix nobody holds yet is prefilled once: while one request's plan warms a harness head (on
whichever server), the next requests with the same head wait for that plan (at most
``GATE_WAIT_S``) and then restore its head file, since waiting for a warm-up that started earlier
is never longer than prefilling the same head again. Likewise a request for whose next 256
tokens past the shared prefix (the first 256, or 256 past the harness head:
``Estimate.prefix_key``) no server has a reuse (but by destroying an unsaved conversation, such as
the running request that prefills them) waits while another request with the same tokens is being
planned: opencode's title requests are byte-identical across sessions and come together, and a
folder's sessions starting together share their folder section past the harness head. The
waiters go on once that plan's saves (head file, anchors) are committed to the store (at most
``COMMIT_WAIT_S`` after the plan), and a
request whose estimates were asked while such a plan finished asks again (they could not see
what it left): the slot table and the store then show its tokens.

Policy ``round_robin`` (for comparisons, ``scripts/bench-multi``): the next ready server in turn,
whatever it holds; the chosen layer still plans the request.

Fail-over: only servers whose ``Upstream.state`` is ``ready`` are considered, so a server that is
down, hung, loading or restarting gets no new request; its conversations' next turns are planned
on another server from what the shared store holds (head, anchors, spills). Requests in flight on
a server that dies fail as they do with one server (the proxy answers 502/503; a generation is
never retried). A server whose estimate raises (it died between probes) is skipped and its
upstream poked.

Response headers: ``X-OCache-Upstream`` (the base URL that served the request) and
``X-OCache-Route`` (why: the policy, the chosen server's usable prefix and cost, the others').
Non-completion routes go to the first ready server (the proxy's choice).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ocache.background import Background
from ocache.layer import ParsedRequest, Plan
from ocache.upstream import UpstreamPort

log = logging.getLogger("ocache.router")

POLICIES = ("prefix", "round_robin")
#: prefill rate assumed for a server before any was measured (tokens/s): only ratios matter then
DEFAULT_TPS = 1000.0
#: request duration assumed before any was observed (seconds)
DEFAULT_REQUEST_S = 1.0
#: the longest a request waits for another request's plan of the same prefix (seconds); the wait
#: is never longer than prefilling that prefix itself would be (the other started earlier, at the
#: same rate), this bound only covers a server that hangs meanwhile
GATE_WAIT_S = 120.0
#: two servers whose expected costs differ by less than this (seconds) or this fraction of the
#: best are a tie, which goes to the server that served the session last
#: the longest the waiters of a gate wait, after its plan returned, for the commits that plan
#: started (seconds): they hash and enter one slot file each; in 4 runs of ``scripts/bench-multi``
#: (tiny model, loaded 2-core machine) the longest took 0.31 s
COMMIT_WAIT_S = 1.0
STICKY_S = 0.005
STICKY_FRACTION = 0.05


@dataclass
class _InFlight:
    prefill: int
    since: float


@dataclass
class Server:
    """One llama-server behind the router: its upstream, its cache layer, what is routed there."""

    index: int
    upstream: UpstreamPort
    layer: Any
    inflight: dict[str, _InFlight] = field(default_factory=dict)
    mean_request_s: float | None = None
    routed: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    estimate_errors: int = 0

    @property
    def url(self) -> str:
        return self.upstream.base_url

    @property
    def ready(self) -> bool:
        return getattr(self.upstream, "state", "ready") == "ready"

    def queued_prefill(self) -> int:
        return sum(f.prefill for f in self.inflight.values())


@dataclass(frozen=True)
class Choice:
    """The router's decision for one request (shown in ``X-OCache-Route``)."""

    server: Server
    reason: str
    cost_s: float | None = None
    gate: Any = None  # the plan there would prefill a prefix nobody holds: its key (see _gate_key)


def cost_s(est: Any, server: Server, tps: float, load_weight: float) -> float:
    """Expected seconds of work on ``server`` for a request with estimate ``est`` (the formula in
    the module docstring). Pure."""
    prefill = max(0, est.n_tokens - est.usable) / tps + float(est.restore_s or 0.0)
    prefill += est.destroys / tps
    mean = server.mean_request_s if server.mean_request_s is not None else DEFAULT_REQUEST_S
    load = server.queued_prefill() / tps + load_weight * len(server.inflight) * mean
    return prefill + load


class Router:
    """The ``CacheLayer`` over several servers (see the module docstring).

    ``upstreams``: ``ocache.upstream.Upstream`` objects (started by the proxy); ``layer_factory(
    upstream, config) -> CacheLayer`` builds each server's layer (``OCacheLayer``); ``configs``:
    one ``Config`` per server (its own ``upstream`` and launch argv), default ``config`` for all.
    """

    def __init__(self, upstreams: Sequence[UpstreamPort], config: Any,
                 layer_factory: Callable[[UpstreamPort, Any], Any],
                 configs: Sequence[Any] | None = None) -> None:
        self.config = config
        self.policy = getattr(config, "route_policy", "prefix") or "prefix"
        if self.policy not in POLICIES:
            raise ValueError(f"route_policy {self.policy!r}: not one of {', '.join(POLICIES)}")
        self.load_weight = float(getattr(config, "route_load_weight", 0.5))
        configs = list(configs) if configs is not None else [config] * len(upstreams)
        self.servers = [Server(i, up, layer_factory(up, cfg))
                        for i, (up, cfg) in enumerate(zip(upstreams, configs))]
        self._rr = itertools.count()
        # layers without estimates (NullLayer, ``no_cache``): round robin is all there is
        self._estimates = all(hasattr(s.layer, "estimate") for s in self.servers)
        self.counters = {"planned": 0, "no_server": 0, "estimate_errors": 0, "moved": 0, "known": 0,
                         "gate_waits": 0, "gate_rechecks": 0}
        #: prefixes nobody held whose first plan runs now (gate key -> set when that plan is done)
        self._planning: dict[Any, asyncio.Event] = {}
        #: the longest wait for another request's plan of the same prefix (seconds)
        self.gate_wait_s = GATE_WAIT_S
        self._heads: dict = {}
        self.background = Background("router")  # gates opening once a plan's saves are committed
        #: gates opened so far, and the count at which each key's gate opened last
        self._gate_seq = 0
        self._opened: dict[Any, int] = {}
        #: the server that last served each client session (``_session_of``), insertion ordered
        self._last_server: dict[str, Server] = {}
        for s in self.servers:
            if hasattr(s.upstream, "on_restart"):
                s.upstream.on_restart(self._restart_callback(s))

    @property
    def owns_slots(self) -> bool:
        """Whether a cache layer owns the servers' slots (the proxy then refuses clients' slot
        actions); False over NullLayers (``no_cache``)."""
        from ocache.layer import NullLayer

        return not all(isinstance(s.layer, NullLayer) for s in self.servers)

    def _restart_callback(self, server: Server):
        async def cb() -> None:
            server.inflight.clear()
            await server.layer.on_upstream_restart()
        return cb

    # -- choosing ------------------------------------------------------------------------------

    def share_heads(self) -> None:
        """Let every layer see the heads any of them saved: the head tier's records name store
        entries (slot files) that any server of the same identity restores (one store)."""
        for s in self.servers:
            ht = getattr(s.layer, "head_tier", None)
            if ht is not None and getattr(ht, "heads", None) is not self._heads:
                self._heads.update(ht.heads)
                ht.heads = self._heads

    def ready_servers(self) -> list[Server]:
        return [s for s in self.servers if s.ready]

    def tps(self) -> float:
        """One prefill rate for every server (tokens/s): the mean of the servers' measured rates.
        The servers of one identity are alike (one per GPU of one kind); their separately measured
        rates differ by noise (3x between the two servers of one ``scripts/bench-multi`` run on a
        loaded 2-core machine), which would move sessions for nothing."""
        known = [float(getattr(s.layer, "prefill_tps", 0) or 0) for s in self.servers]
        known = [k for k in known if k > 0]
        return sum(known) / len(known) if known else DEFAULT_TPS

    async def choose(self, req: Any) -> Choice | None:
        ready = self.ready_servers()
        if not ready:
            return None
        if self.policy == "round_robin" or len(ready) == 1 or not self._estimates:
            server = ready[next(self._rr) % len(ready)]
            why = "only ready server" if len(ready) == 1 else "round robin"
            if not self._estimates and self.policy != "round_robin":
                why += " (no cache layer)"
            server.inflight[req.request_id] = _InFlight(0, time.monotonic())
            return Choice(server, why)
        known = self._known(req, ready)
        if known is not None:
            return known
        scored = await self._scored(req, ready)
        if not scored:
            server = ready[0]
            server.inflight[req.request_id] = _InFlight(0, time.monotonic())
            return Choice(server, "first ready server (no estimate)")
        # rule 2 (prefill first): the candidates are the servers where the request costs the
        # fewest tokens; load decides among them (see _eligible)
        eligible = _eligible(scored)
        eligible.sort(key=lambda t: (round(t[0], 6), t[1], t[2]))
        # a session stays where it was last served unless moving is clearly cheaper: costs within
        # STICKY_S or STICKY_FRACTION of the best are one tie (measured costs jitter by a few ms)
        session = _session_of(req)
        last = self._last_server.get(session) if session else None
        if last is not None and eligible[0][3] is not last:
            best = eligible[0][0]
            near = [t for t in eligible if t[3] is last
                    and t[0] <= best + max(STICKY_S, STICKY_FRACTION * best)]
            if near:
                eligible.insert(0, eligible.pop(eligible.index(near[0])))
        scored.sort(key=lambda t: (t[3] is not eligible[0][3], round(t[0], 6), t[1], t[2]))
        cost, _, _, server, est = scored[0]
        others = "; ".join(f"{_short(s.url)} {c:.3f} s (usable {e.usable} {e.tier}, {len(s.inflight)} in flight)"
                           for c, _, _, s, e in scored[1:])
        why = (f"prefix: usable {est.usable} of {est.n_tokens} from {est.tier}, "
               f"{len(server.inflight)} in flight, cost {cost:.3f} s"
               + (f"; others: {others}" if others else ""))
        if any(e.own_session for *_, s, e in scored if s is not server):
            self.counters["moved"] += 1
        # reserved now, before any await: requests deciding concurrently see this one's load
        server.inflight[req.request_id] = _InFlight(max(0, est.n_tokens - est.usable), time.monotonic())
        if session:
            self._last_server[session] = server
            while len(self._last_server) > 4096:
                self._last_server.pop(next(iter(self._last_server)))
        return Choice(server, why, cost, _gate_key(est, [e for *_, e in scored]))

    async def _prepare(self, req: ParsedRequest, ready: list[Server]) -> list[Server]:
        """Have one server's layer prepare ``req`` (``OCacheLayer.prepare_request``: its token view
        and context, kept in ``req.memo`` for every server of the same identity, so the estimates
        and the chosen server's plan build no other view): the server that served the session last
        (its viewer has the conversation's earlier renders: a delta render), else the first ready
        one; one whose preparation raises (it died between probes) is skipped like a failed
        estimate and the next is asked. Returns the ready servers to ask for an estimate."""
        session = _session_of(req)
        last = self._last_server.get(session) if session else None
        order = [s for s in ready if s is last] + [s for s in ready if s is not last]
        failed: list[Server] = []
        for s in order:
            prepare = getattr(s.layer, "prepare_request", None)
            if prepare is None:
                break
            try:
                await prepare(req)
            except Exception as exc:  # noqa: BLE001 - that server is skipped, as a failed estimate
                self._estimate_failed(req, s, exc)
                failed.append(s)
                continue
            break
        return [s for s in ready if not any(s is f for f in failed)]

    async def _scored(self, req: ParsedRequest, ready: list[Server]) -> list[tuple[float, int, int, Server, Any]]:
        """``(cost_s, in flight, index, server, Estimate)`` of every ready server that answered an
        estimate for ``req`` (after :meth:`_prepare`); those that raised are skipped (counted,
        their upstream poked), those that answered None (``plan`` would not pin it) left out."""
        asked = await self._prepare(req, ready)
        results = await asyncio.gather(*(s.layer.estimate(req) for s in asked), return_exceptions=True)
        self.share_heads()  # layers made ready by the estimate registered their head tiers
        scored: list[tuple[float, int, int, Server, Any]] = []
        tps = self.tps()
        for s, est in zip(asked, results):
            if isinstance(est, BaseException):
                if isinstance(est, asyncio.CancelledError):
                    raise est
                self._estimate_failed(req, s, est)
                continue
            if est is None:
                continue
            c = cost_s(est, s, tps, self.load_weight)
            scored.append((c, len(s.inflight), s.index, s, est))
        return scored

    def _estimate_failed(self, req: ParsedRequest, s: Server, exc: BaseException) -> None:
        s.estimate_errors += 1
        self.counters["estimate_errors"] += 1
        log.warning("[%s] %s: estimate failed (%s: %s); not routed there", req.request_id,
                    s.url, type(exc).__name__, exc)
        poke = getattr(s.upstream, "poke", None)
        if poke:
            poke()

    def _known(self, req: Any, ready: list[Server]) -> Choice | None:
        """The one ready server one of whose slots holds this request's conversation
        (``OCacheLayer.known_slot``: its earlier messages unchanged), chosen without asking any
        server for an estimate (the estimates need the request's token view): that server
        reuses the whole previous turn and no other holds more of it, so the choice is the one
        the estimates would make, and its layer forwards at once (the known path). None when no
        server, or more than one, knows it."""
        hits = []
        for s in ready:
            fn = getattr(s.layer, "known_slot", None)
            try:
                slot = fn(req) if fn is not None else None
            except Exception:  # noqa: BLE001 - a shortcut only: the estimates decide then
                log.exception("[%s] %s: known_slot failed", req.request_id, s.url)
                slot = None
            if slot is not None:
                hits.append((s, slot))
        if len(hits) != 1:
            return None
        server, slot = hits[0]
        self.counters["known"] += 1
        server.inflight[req.request_id] = _InFlight(0, time.monotonic())
        session = _session_of(req)
        if session:
            self._last_server[session] = server
        return Choice(server, f"known: slot {slot} holds this conversation")

    # -- CacheLayer ----------------------------------------------------------------------------

    async def plan(self, req: Any) -> Plan:
        rid = req.request_id
        choice = await self._choose_past_gates(req)
        if choice is None:
            self.counters["no_server"] += 1
            raise RuntimeError("no ready upstream")
        server = choice.server
        gate = None
        if choice.gate is not None and choice.gate not in self._planning:
            gate = self._planning[choice.gate] = asyncio.Event()
        try:
            plan = await server.layer.plan(req)
        except BaseException:
            server.inflight.pop(rid, None)
            if gate is not None:
                gate.set()
                self._planning.pop(choice.gate, None)
            raise
        if gate is not None:
            # the waiters go on once what this plan saved is committed (not this request: it is
            # forwarded now)
            self.background.spawn(self._open_gate(choice.gate, gate, _pending_commits(server.layer)), "gate")
        self.share_heads()
        plan.upstream = server.url
        plan.headers["X-OCache-Upstream"] = server.url
        plan.headers["X-OCache-Route"] = choice.reason
        server.inflight[rid] = _InFlight(plan.read_figures().prefilled or 0, time.monotonic())
        server.routed += 1
        key = choice.reason.split(":", 1)[0]
        server.reasons[key] = server.reasons.get(key, 0) + 1
        self.counters["planned"] += 1
        inner = plan.release

        async def release() -> None:
            server.inflight.pop(rid, None)
            if inner is not None:
                await inner()

        plan.release = release
        return plan

    async def _choose_past_gates(self, req: Any) -> Choice | None:
        """``choose``, again after waiting while another request's plan of the same new prefix
        runs (at most ``gate_wait_s`` in all), and again when such a plan finished while this
        request's estimates were asked (they could not see what it left)."""
        rid = req.request_id
        deadline = time.monotonic() + self.gate_wait_s
        expired = False
        for _ in range(64):  # each turn follows another request's plan of the same prefix
            seq = self._gate_seq
            choice = await self.choose(req)
            key = choice.gate if choice is not None else None
            if choice is None or key is None or expired:
                return choice
            if key in self._planning:
                # another request's plan is prefilling this prefix right now (on some server): wait
                # for it, then reuse what it left instead of prefilling the same tokens again
                choice.server.inflight.pop(rid, None)
                self.counters["gate_waits"] += 1
                try:
                    await asyncio.wait_for(asyncio.shield(self._planning[key].wait()),
                                           max(0.0, deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    log.info("[%s] the plan of the same prefix elsewhere not done in %g s: planning anyway",
                             rid, self.gate_wait_s)
                    expired = True
                continue
            if self._opened.get(key, 0) > seq:
                choice.server.inflight.pop(rid, None)
                self.counters["gate_rechecks"] += 1
                continue
            return choice
        return choice

    async def _open_gate(self, key: Any, gate: asyncio.Event, commits: list) -> None:
        try:
            await _committed(commits, min(COMMIT_WAIT_S, self.gate_wait_s))
        finally:
            self._gate_seq += 1
            self._opened[key] = self._gate_seq
            while len(self._opened) > 1024:
                self._opened.pop(next(iter(self._opened)))
            gate.set()
            if self._planning.get(key) is gate:
                self._planning.pop(key, None)

    def _server_of(self, req: Any, plan: Plan) -> Server | None:
        """The server a plan was made for (``Plan.upstream``); a plan the router did not make (the
        proxy's fail-open ``Plan()``) belongs to the first ready server, where the proxy sent it."""
        url = getattr(plan, "upstream", None)
        for s in self.servers:
            if url and s.url == url:
                return s
        ready = self.ready_servers()
        return ready[0] if ready else None

    async def observe(self, req: Any, plan: Plan, obs: Any) -> None:
        server = self._server_of(req, plan)
        if server is None:
            return
        server.inflight.pop(req.request_id, None)
        if obs.completed and obs.status == 200 and obs.total_s:
            m = server.mean_request_s
            server.mean_request_s = obs.total_s if m is None else 0.8 * m + 0.2 * obs.total_s
        await server.layer.observe(req, plan, obs)

    async def on_upstream_restart(self) -> None:
        """The proxy's callback for its first upstream: each server's restart is handled by the
        callback the router registered on that server's ``Upstream``."""
        return None

    async def drain(self) -> None:
        for s in self.servers:
            try:
                await s.layer.drain()
            except Exception:
                log.exception("drain of %s failed", s.url)

    def begin_stop(self) -> None:
        for s in self.servers:
            fn = getattr(s.layer, "begin_stop", None)
            if fn is not None:
                fn()

    async def quiesce(self, timeout_s: float) -> int:
        """Every server's layer's ``quiesce`` (concurrently, each bounded by ``timeout_s``)."""
        async def one(layer: Any) -> int:
            fn = getattr(layer, "quiesce", None)
            return int(await fn(timeout_s)) if fn is not None else 0

        return sum(await asyncio.gather(*(one(s.layer) for s in self.servers)))

    def calls_inflight(self) -> int:
        return sum(int(getattr(s.layer, "calls_inflight", lambda: 0)()) for s in self.servers)

    async def idle(self) -> None:
        await self.background.join()
        for s in self.servers:
            idle = getattr(s.layer, "idle", None)
            if idle is not None:
                await idle()

    async def clear(self, tier: str) -> dict:
        out: dict = {"tier": tier, "cleared": 0, "servers": []}
        for s in self.servers:
            r = await s.layer.clear(tier)
            out["servers"].append({"url": s.url, **(r if isinstance(r, dict) else {})})
            if isinstance(r, dict) and isinstance(r.get("cleared"), int):
                out["cleared"] += r["cleared"]
        return out

    def warm_deps(self) -> Any:
        for s in self.ready_servers() or self.servers:
            get = getattr(s.layer, "warm_deps", None)
            if get is not None:
                return get()
        return None

    def stats(self) -> dict:
        """The first server's layer stats (what the dashboard reads) plus ``router``: the policy and
        one row per server (URL, state, epoch, in flight, routed, reasons, its layer's stats)."""
        rows = []
        for s in self.servers:
            try:
                ls = s.layer.stats()
            except Exception as exc:  # noqa: BLE001 - a row per server, whatever one of them does
                ls = {"error": f"{type(exc).__name__}: {exc}"}
            rows.append({"url": s.url, "state": getattr(s.upstream, "state", None),
                         "epoch": getattr(s.upstream, "epoch", None), "inflight": len(s.inflight),
                         "queued_prefill": s.queued_prefill(), "routed": s.routed,
                         "reasons": dict(s.reasons), "mean_request_s": s.mean_request_s,
                         "estimate_errors": s.estimate_errors, "layer": ls})
        first = rows[0]["layer"] if rows and isinstance(rows[0]["layer"], dict) else {}
        return {**first, "router": {"policy": self.policy, "load_weight": self.load_weight,
                                    **self.counters, "servers": rows}}


def _session_of(req: Any) -> str | None:
    """The client's session key of a request (``ParsedRequest.session_hint``, else its headers)."""
    from ocache.fingerprint import session_key

    return getattr(req, "session_hint", None) or session_key(getattr(req, "headers", None))


def _eligible(scored: list) -> list:
    """The candidates among ``scored`` (tuples ``(cost_s, in_flight, index, Server, Estimate)``):
    the servers where the request costs the fewest tokens (:func:`_tokens_cost`); only when every
    one of those has requests in flight, also the idle servers (nothing in flight) that cost at
    most one ubatch more (the granularity of the ``cache_n`` prediction) and have room for it
    (``Estimate.room``: an empty slot, or one holding only the kept head; the plan overwrites no
    live conversation), so that a busy server's conversation can move to an idle one when its
    expected seconds are less there. Without room such moves cost more than they saved in
    ``scripts/bench-multi``: one that overwrote another session's slot (spilled) for 3 tokens
    cost that session 799 tokens at its next turn; one into a title's slot on a server whose two
    slots two sessions used cost 1,323. Pure.

    Before that, of the servers within one ubatch of the fewest tokens, those that are not full
    (``Estimate.full``: the plan overwrites another live conversation, and every slot holds one
    or that slot is busy) are preferred to those that are, if any.

    Why not the least seconds among every server within one ubatch (the rule before): the
    seconds then decided between servers that differ by a few tokens and by ms of load, and a
    session moved for 16 tokens more and 30 ms less onto a server whose both slots were taken:
    the two sessions there lost their slots, 3,549 tokens prefilled again
    (``scripts/bench-multi``: 35,443 tokens against 31,869 for one server)."""
    least = min(_tokens_cost(t[4]) for t in scored)
    near = [t for t in scored if _tokens_cost(t[4]) <= least + t[4].ubatch]
    keep = [t for t in near if not t[4].full] if any(not t[4].full for t in near) else near
    first = min(_tokens_cost(t[4]) for t in keep)
    out = [t for t in keep if _tokens_cost(t[4]) == first]
    if all(t[3].inflight for t in out):
        out += [t for t in keep if not t[3].inflight and first < _tokens_cost(t[4])
                and not t[4].evicts and t[4].room]
    return out


def _tokens_cost(est: Any) -> int:
    """Tokens a request costs on a server: what it prefills there plus what it destroys."""
    return max(0, est.n_tokens - est.usable) + est.destroys


def _gate_key(chosen: Any, ests: list) -> Any:
    """The key under which concurrent plans of one new prefix wait for each other, or None: the
    harness head when the chosen plan would warm it (no server holds it), else the tokens up to
    256 past the shared prefix (``Estimate.prefix_key``/``prefix_len``: the first 256, or 256
    past the harness head) when no server can reuse them (but by destroying a conversation that
    is not saved first, e.g. the running first turn that is prefilling them): opencode's title requests
    (byte-identical across sessions) and a folder's sessions starting together (both would
    prefill the same folder section past the shared harness head; ``scripts/bench-multi``
    prefilled the 277-295-token section twice in 2 of 3 runs)."""
    if chosen.warm and chosen.head_key:
        return ("head", chosen.head_key)
    if chosen.prefix_key is not None and all(e.usable < chosen.prefix_len for e in ests if not e.destroys):
        return ("prefix", chosen.prefix_key)
    return None


def _pending_commits(layer: Any) -> list:
    """The background commits of ``layer``'s head and disk tiers running now: the tiers commit a
    saved slot file (hash, entry) after the plan that saved it returned (``DiskTier.save_slot``),
    and a request waiting for that plan finds the anchor only once it is committed."""
    out: list = []
    for tier in (getattr(layer, "head_tier", None), getattr(layer, "disk_tier", None)):
        get = getattr(tier, "pending_commits", None)
        if get is not None:
            out.extend(get())
    return out


async def _committed(tasks: list, bound_s: float) -> None:
    """Wait (at most ``bound_s`` seconds) for ``tasks`` (:func:`_pending_commits` as a plan
    returned: what it saved, not what later requests save). Never raises."""
    if not tasks:
        return
    try:
        # shielded: a timeout ends the wait, never the tiers' commits
        await asyncio.wait_for(asyncio.shield(asyncio.gather(*tasks, return_exceptions=True)), bound_s)
    except Exception as exc:  # noqa: BLE001 - the waiters then plan with what is there
        log.debug("commits after a gated plan not done: %s: %s", type(exc).__name__, exc)


def _short(url: str) -> str:
    return url.split("://", 1)[-1]
