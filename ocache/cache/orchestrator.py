"""``OCacheLayer``: the cache half behind the proxy, a dispatcher of one request's routes plus
observe, stats, clear and the lifecycle.

Request path (``docs/architecture.md`` §1), one direction, each step in its own module:

    parse (proxy.py) -> shape (ocache/cache/prepare.py: body, kind, head, message keys; no await)
    -> the routes before the view (ocache/cache/routes/: ``known``)
    -> prepare (ocache/cache/prepare.py: the token view, ocache/tokens.py, and the context; once
       per request, shared by the router's estimate, ocache/cache/estimate.py, and this plan)
    -> the routes after the view (``server_placed``, ``usual``: the lookup phase, every tier's
       ``lookup`` once, ocache/cache/core.py; ``plan_request``, pure, ocache/cache/plan.py; lease
       the slot, re-plan, pure, only if the slot changed)
    -> execute (ocache/cache/execute.py: before_evict, bring, warm_head, anchors; the slot's new
       content through the table's verbs) -> forward (proxy.py) -> observe
       (ocache/cache/observe.py: mispredictions, the slot's content) -> admit (every tier)

Around it: tier wiring when the layer gets ready (ocache/cache/wiring.py), the head tier and its
origin slot (ocache/tiers/head.py), warm-ups (ocache/cache/warmup.py), drain, clear, stats.

Response headers of a planned request. They are sent before the body, so the token counts come
from the plan: what ocache prefilled itself is measured (the steps ran before forwarding), the
forwarded request's reuse is the prediction (``ocache.llama.reuse.predict_reuse``, off by at most one
ubatch unless a misprediction is counted); the response body's corrected ``timings`` and ``usage``
are the measured figures (``ocache/api/figures.py``).

* ``X-OCache-Tier``: where the reused prefix came from — ``resident`` (left in the slot by earlier
  requests), ``head`` (the head tier: its slot file restored, or the harness head ocache keeps warm
  in an origin slot), ``disk`` (a disk-tier anchor), ``session`` (a spilled conversation), restored
  in this request or before it by ocache (``ocache warm DIR``, the resume after a drain) and not yet
  used by a request; ``cold`` when nothing came from before this request.
* ``X-OCache-Split``: tokens ocache prefilled itself on the slot for this request, in separate
  ``n_predict: 0`` steps (the head warm-up, the disk tier's anchor split); 0 when none.
* ``X-OCache-Prefilled``: tokens the server prefills for this request, ``Split`` included
  (``Split + prompt - predicted cache_n``).
* ``X-OCache-Reused`` (= ``X-OCache-Predicted-Cache``): tokens reused from before this request
  (``predicted cache_n - Split``), what the corrected ``cache_n``/``cached_tokens`` will say.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any, Mapping, Sequence, TypeVar

from ocache import fingerprint as fp_mod
from ocache.background import Background
from ocache.cache import core, report, routes, stopping, warmup, wiring
from ocache.cache.align_route import AlignContext, AlignRoute, enabled as align_enabled, mode as align_mode
from ocache.cache.routes.continued import ContinueRoute, enabled as continue_enabled
from ocache.cache.estimate import estimate as estimate_of
from ocache.cache.execute import PlanContext, ServerPlaced
from ocache.cache.identity import IdentityKeeper
from ocache.cache.observe import AloneTally, Fed, Observer
from ocache.cache.plan import Estimate
from ocache.cache.prepare import Prepared, Refusal, Rejected, Shape, anthropic_pin_ok, prepare, shape_of
from ocache.cache.routes import known
from ocache.config import Config
from ocache.fingerprint import Identity
from ocache.layer import Observation, ParsedRequest, Plan
from ocache.llama.checks import Finding
from ocache.llama.flags import argv_from_launch, params_from_argv
from ocache.slots import SlotError, SlotTable
from ocache.tiers.base import TierBase
from ocache.tiers.disk import DiskTier
from ocache.tiers.head import HeadTier, open_head_store
from ocache.tiers.spill import SessionTier
from ocache.tokens import CHAT_ROUTES, TokenViewer, TokenViewError
from ocache.upstream import UpstreamPort
from ocache.warm import FolderJournal, WarmDeps

#: the chat routes whose answers the align route records (their turns may be substituted later)
RECORDED_CHAT = ("/v1/chat/completions", "/chat/completions")

log = logging.getLogger("ocache.cache")

__all__ = ["CHAT_ROUTES", "OCacheLayer"]


#: the layer's counters (``GET /v1/cache/stats``), each from 0
COUNTERS = (
    "planned", "plan_errors", "observed", "mispredictions", "mispredict_low", "mispredict_high",
    "predicted_tokens", "observed_cache_tokens", "prompt_tokens", "warmups", "warmup_tokens",
    "head_saves", "head_restores", "origin_rebuilds", "origin_skipped", "server_placed",
    "no_cache_prompt", "evictions", "guest_on_agent_slot", "client_pins_overridden",
    "bring_failures", "bring_retries", "failed_responses", "too_long", "unrenderable", "unpinnable",
    "user_splits", "split_tokens", "reused_tokens", "prefilled_tokens", "replans",
    "plan_reconciles", "known", "known_other_plan", "known_anchors_skipped",
    "known_failed", "view_mismatches", "known_boot_checked", "known_if_boot", "known_waits",
    "known_waits_usual",
)

_Part = TypeVar("_Part")


def _made_ready(part: _Part | None, what: str) -> _Part:
    """``part`` of the layer, which ``ensure_ready`` makes; RuntimeError while it is None."""
    if part is None:
        raise RuntimeError(f"the cache layer is not ready: no {what} yet")
    return part


class OCacheLayer:
    """The ``CacheLayer`` the proxy loads (``ocache.layer``): resident routing, warm heads, and the
    disk/session tiers registered with ``add_tier``.

    ``upstream``: ``ocache.upstream.Upstream`` (``session``, ``base_url``, ``epoch``, ``props``,
    ``api_key``). ``config``: ``ocache.config.Config`` (the layer's keys: ``wiring.LayerOptions``).
    ``viewer``: a ``TokenViewer`` (default: one over ``upstream``); ``tiers``: tiers registered
    from the start; ``table``: the slot table (default: one over ``upstream``, built when the
    layer gets ready; tests pass an in-memory one).
    """

    def __init__(self, upstream: UpstreamPort, config: Config | None = None, *, viewer: TokenViewer | None = None,
                 tiers: Sequence[TierBase] = (), table: SlotTable | None = None) -> None:
        self.upstream = upstream
        self.config = config
        opts = wiring.layer_options(config)
        self.opt_warm, self.opt_keep_origin, self.opt_reconcile, self.opt_known = (
            opts.warm, opts.keep_origin, opts.reconcile, opts.known)
        self.param_overrides = dict(opts.param_overrides)
        #: the launch flags: ``server_args`` / ``--launch`` as configured, else (per epoch) what a
        #: patched server reports in ``/props`` ``ocache.launch`` (patches/0009, ``argv_from_launch``)
        self.configured_argv = list(opts.argv) if opts.argv else None
        self.argv = self.configured_argv
        self.markers = getattr(config, "volatile_markers", None) or fp_mod.DEFAULT_MARKERS
        self._viewer = viewer
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.align = AlignRoute(align_enabled(config), exact=align_mode(config) == "exact")   # ocache/cache/align_route.py
        self.wants_message = self.align.on  # the proxy collects streamed answers (alignment reads them)
        self.continued = ContinueRoute(continue_enabled(config))   # ocache/cache/routes/continued.py
        self.table: SlotTable | None = table
        self.head_tier: HeadTier | None = None if table is None else self._make_head_tier(table)
        self.tiers: list[TierBase] = list(tiers)
        self.by_tier: dict[str, int] = {}
        self.observer = Observer(self.counters, on_view_mismatch=self._view_mismatch)
        self._ready = False
        self._ready_lock = asyncio.Lock()
        #: the layer's background work (reconcile, origin upkeep): a stop waits for it
        self.background = Background("layer")
        self.ids = IdentityKeeper(lambda: getattr(self.upstream, "props", None), lambda: self.argv,
                                  self._ready_lock, self._digested)
        self._epoch = getattr(upstream, "epoch", None)
        self.findings: list[Finding] = []
        self._no_save = False
        #: the saving against llama-server alone (report.stats ``alone``)
        self.alone = AloneTally()
        #: the disk, session and remote tiers built from the config (``ensure_ready``)
        self.built = wiring.BuiltTiers(self.tiers)
        self.disk_tier: DiskTier | None = None
        self.session_tier: SessionTier | None = None
        #: a planned stop began (:meth:`begin_stop`): no new GET /slots reconcile or origin upkeep
        self._stopping = False
        self.journal: FolderJournal | None = None
        try:
            from ocache.warm import journal_for

            self.journal = journal_for(config)
        except OSError as exc:
            log.warning("folder journal unavailable (%s): `ocache warm DIR` will not know folders", exc)

    # -- setup (ocache/cache/wiring.py) --------------------------------------------------------

    def _make_head_tier(self, table: SlotTable) -> HeadTier:
        return HeadTier(table, events=self.counters, keep_origin=self.opt_keep_origin)

    def add_tier(self, tier: TierBase) -> None:
        """Register a disk/session tier; the planner consults every registered tier."""
        self.tiers.append(tier)

    @property
    def prefill_tps(self) -> float | None:
        """The measured prefill rate (tokens/s), see ``Observer``."""
        return self.observer.prefill_tps

    @prefill_tps.setter
    def prefill_tps(self, value: float | None) -> None:
        self.observer.prefill_tps = value

    @property
    def recent_mispredictions(self) -> deque:
        return self.observer.recent_mispredictions

    @property
    def origin_key(self) -> str | None:
        return self.head_tier.origin_key if self.head_tier is not None else None

    @property
    def session(self) -> Any:
        return getattr(self.upstream, "session", None)

    @property
    def base_url(self) -> str:
        return getattr(self.upstream, "base_url", None) or str(self.upstream)

    def _headers(self) -> dict:
        key = getattr(self.upstream, "api_key", None)
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def ensure_ready(self) -> None:
        """Make the layer ready for the upstream's current process (once per epoch, under a lock):
        the viewer, the slot table sized and reconciled by ``GET /slots``, the server's parameters
        and capabilities, the tiers, the setup checks. Raises what ``GET /slots`` raises."""
        if self._ready and getattr(self.upstream, "epoch", None) == self._epoch:
            return
        async with self._ready_lock:
            epoch = getattr(self.upstream, "epoch", None)
            if self._ready and epoch == self._epoch:
                return
            if self._viewer is None:
                self._viewer = TokenViewer(self.upstream,
                                           view_timeout_s=getattr(self.config, "view_timeout_s", None),
                                           view_slack_s=getattr(self.config, "view_slack_s", None),
                                           prefill_tps_of=lambda: self.prefill_tps)
            props = getattr(self.upstream, "props", None)
            if self.table is None:
                self.table = SlotTable(self.session, self.base_url, headers=self._headers())
            if self.head_tier is None:
                self.head_tier = self._make_head_tier(self.table)
            self.table.session = self.session
            data = await self.table.fetch_slots()
            caps = props.get("ocache") if isinstance(props, Mapping) else None
            reported = argv_from_launch(caps.get("launch")) if isinstance(caps, Mapping) else None
            self.argv = self.configured_argv if self.configured_argv is not None else reported
            self.table.params = params_from_argv(self.argv, props, data, **self.param_overrides)
            if self._epoch is not None and epoch != self._epoch:
                self.alone.restart()   # the server alone would have lost every slot too
            if self._epoch is not None and epoch != self._epoch and not self._table_knows_process():
                self.table.reset_all(epoch)
            self.table.epoch = epoch
            # patches/0006: this server checks a restore's xxh3 on its own read of the file
            self.table.checks_xxh3 = isinstance(caps, Mapping) and caps.get("restore_xxh3") is True
            # patches/0007: this server refuses a request planned for another process (412)
            self.table.if_boot = isinstance(caps, Mapping) and caps.get("if_boot") is True
            await self.table.refresh()
            self._epoch = epoch
            self.ids.forget()
            await self.ids.digest_first()
            # before any tier reads the store (identities coexist)
            wiring.sync_store_identity(self.tiers, self.identity().key)
            # session (tiers/spill.py: resume after a drain), disk (tiers/disk.py), remote (tiers/remote.py)
            await self.built.ready(self.config, self.table, self.identity, no_save=self._no_save,
                                   prefill_tps_of=lambda: self.prefill_tps, upstream=self.upstream)
            self.disk_tier, self.session_tier = self.built.disk, self.built.session
            # head files through the same verified store (tiers/store.py)
            open_head_store(self.head_tier, self.config, self.table.params, self.identity().key)
            self._ready = True
            found = await wiring.setup_findings(self.session, self.base_url, self._headers(),
                                                wiring.checked_params(self.ready_table.params, self.config), props, data, self.argv)
            if found is not None:
                self.findings, actions_ok = found
                self._no_save = actions_ok is False
                self.head_tier.no_save = self.head_tier.no_save or self._no_save

    def identity(self) -> Identity:
        """The server's identity (``IdentityKeeper.current``: once per epoch, again once the model
        file's digest is known)."""
        return self.ids.current()

    def _digested(self, key: str) -> None:
        """A background digest's new identity ``key``: the tiers' stores and the head files under it."""
        wiring.sync_store_identity(self.tiers, key)
        if self._ready and self.head_tier is not None and self.table is not None:
            open_head_store(self.head_tier, self.config, self.table.params, key)

    def _anthropic_pin_ok(self) -> bool:
        """``prepare.anthropic_pin_ok`` for this server and its slot count."""
        return anthropic_pin_ok(getattr(self.upstream, "props", None), len(self.table or ()))

    # -- the request path: shape, the routes, prepare (ocache/cache/routes/, prepare.py) -----------

    @property
    def ready(self) -> bool:
        """The layer got ready for the upstream's current process (``ensure_ready``)."""
        return self._ready

    @property
    def ready_table(self) -> SlotTable:
        """The slot table; raises RuntimeError before the layer was first made ready."""
        return _made_ready(self.table, "slot table")

    @property
    def current_viewer(self) -> TokenViewer | None:   # None before the layer was first made ready
        return self._viewer

    @property
    def ready_head(self) -> HeadTier:
        """The head tier; raises RuntimeError before the layer was first made ready."""
        return _made_ready(self.head_tier, "head tier")

    @property
    def viewer(self) -> TokenViewer:
        """The token viewer; raises RuntimeError before the layer was first made ready."""
        return _made_ready(self._viewer, "token viewer")

    @property
    def template_append_only(self) -> bool:
        """Whether this server's viewer checked the chat template append-only
        (``TokenViewer.append_only``): what the known route needs of a message-level match."""
        return bool(getattr(self._viewer, "append_only", False))

    def shape(self, req: ParsedRequest) -> Shape | Refusal:
        """``prepare.shape_of`` with this layer's markers and Anthropic pinning (a refusal string:
        ``unpinnable``, ``unrenderable``)."""
        return shape_of(req, self.markers, self._anthropic_pin_ok)

    async def prepare(self, req: ParsedRequest, shape: Shape) -> Prepared | Rejected:
        """The request's ``Prepared`` for this server's identity (``prepare.prepare``: built once,
        shared with every server of that identity). Raises TokenViewError (server unreachable)."""
        return await prepare(req, shape, self.viewer, self.identity())

    async def prepare_request(self, req: ParsedRequest) -> Prepared | None:
        """Ready the layer, then the request's ``Prepared`` (the router asks one server for it
        before the estimates); None for a request no plan pins (refused, rejected by the server).
        Raises what readiness and the view raise (the server cannot be asked)."""
        await self.ensure_ready()
        shape = self.shape(req)
        if isinstance(shape, str):
            return None
        prep = await self.prepare(req, shape)
        return prep if isinstance(prep, Prepared) else None

    def known_slot(self, req: ParsedRequest) -> int | None:
        """The slot the known route would take for ``req`` now (read-only, no await; the router
        asks it first: ``ocache/router.py``), or None: not ready, the known route off or not yet
        possible (template not checked append-only), not a chat request, no slot holds it."""
        if not (self._ready and self.table is not None and self.opt_known):
            return None
        shape = self.shape(req)
        if isinstance(shape, str) or not known.applies(self, shape):
            return None
        return known.find(self, shape)

    async def estimate(self, req: ParsedRequest) -> Estimate | None:
        """What this server could reuse for ``req`` (``ocache/cache/estimate.py``)."""
        return await estimate_of(self, req)

    async def plan(self, req: ParsedRequest) -> Plan:
        """The plan of :meth:`_route`; a chat turn pinned to a slot asks the server for the ids it
        samples (``ocache_generated``, patches/0010) while alignment is on and the server reports
        them: the next turn's substitution is then compared on every id the slot holds
        (``ocache/substitute.py``). The ids are taken out of the answer before the client sees it
        (``ocache.api.figures.strip_generated``)."""
        if self.align.exact:
            await self.align.warmups.cancel()   # an arriving request: the idle warm-up gives way
        self.built.arrived()                    # and a live save waits for the next quiet moment
        plan = await self._route(req)
        if (self.align.on and req.path in RECORDED_CHAT and isinstance(plan.body_updates.get("id_slot"), int)
                and ((getattr(self.upstream, "props", None) or {}).get("ocache") or {}).get("generated_ids")):
            plan.body_updates["ocache_generated"] = True
        return plan

    async def _route(self, req: ParsedRequest) -> Plan:
        """Dispatch ``req`` to the first route that takes it (``routes.BEFORE_VIEW`` on its shape,
        then ``routes.AFTER_VIEW`` on its prepared form); a request no route may pin gets a plan
        that forwards it as it is (counted by why)."""
        await self.ensure_ready()
        shape = self.shape(req)
        if isinstance(shape, str):
            self.counters[shape] += 1
            return core.unplanned("none", "other")
        if not shape.cache_prompt:
            # the server reuses nothing for it (n_past stays 0 without cache_prompt,
            # tools/server/server-context.cpp:3350 of the pinned source): no plan to make; the server
            # places it, and GET /slots tells the table what it replaced
            self.counters["no_cache_prompt"] += 1
            return core.unplanned("none", "other")
        for early in routes.BEFORE_VIEW:
            got = await early(self, req, shape)
            if got is not None:
                return got
        prep = await self._prepare_reconciled(req, shape)
        if isinstance(prep, Rejected):
            # the server rejects this body (it will answer the forwarded request the same way):
            # a client error, not a cache-layer failure; forward untouched, no plan
            self.counters["unrenderable"] += 1
            return core.unplanned("none", shape.kind)
        if not prep.tokens or len(prep.tokens) >= self.ready_table.params.n_ctx_slot:
            self.counters["too_long"] += 1
            return core.unplanned("cold", shape.kind)
        ctx = await core.context(self, req, prep)
        for route in routes.AFTER_VIEW:
            got = await route(self, req, prep, ctx)
            if got is not None:
                return got
        raise AssertionError("the usual route plans every request")

    async def _prepare_reconciled(self, req: ParsedRequest, shape: Shape) -> Prepared | Rejected:
        """``prepare``, with ``GET /slots`` read meanwhile when the table cannot vouch for a slot
        (neither needs the other); otherwise the reconcile after each response did it."""
        refreshed = None
        table = self.ready_table
        if self.opt_reconcile and not self._stopping and table.needs_reconcile(core.RECONCILE_MAX_AGE_S):
            self.counters["plan_reconciles"] += 1
            refreshed = asyncio.ensure_future(self.refresh(req.request_id))
        try:
            prep = await self.prepare(req, shape)
        except TokenViewError:
            if refreshed is not None:
                await refreshed
            raise
        except BaseException:
            if refreshed is not None:
                refreshed.cancel()
            raise
        if refreshed is not None:
            await refreshed
        return prep

    async def refresh(self, rid: str) -> bool:
        """Reconcile the slot table with ``GET /slots``; whether it succeeded. A failure only logs
        (the usual plan then uses the table as it is; a known turn is planned as usual instead).

        When that ``GET /slots`` shows a new server process before the upstream's own probe did,
        the probe runs now (and with it ``on_upstream_restart``: the tiers forget the old
        process's slots), before the caller plans anything on the new process; found later, at the
        next probe, it wiped what ocache had learned about the new process since (a newcomer's
        break test: slot 0 restored and three turns served there, then "content now unknown")."""
        table = self.ready_table
        seen = table.counters["restarts_seen_in_slots"]
        try:
            await table.refresh()
        except SlotError as exc:
            log.debug("[%s] GET /slots failed: %s", rid, exc)
            return False
        probe = getattr(self.upstream, "probe", None)
        if table.counters["restarts_seen_in_slots"] != seen and probe is not None:
            await probe()
        return True

    def _view_mismatch(self, pctx: PlanContext) -> None:
        """A response showed the token view wrong (``Observer``): the viewer that built it (another
        server's of the same identity, when the router prepared the request there) and this
        server's trust no delta render until the next epoch (``TokenViewer.distrust``), so the next
        views are full renders."""
        why = f"request {pctx.request_id}: the server's prompt length differed from the view"
        for viewer in dict.fromkeys((getattr(pctx.view, "source", None), self._viewer)):
            distrust = getattr(viewer, "distrust", None)
            if distrust is not None:
                distrust(why)

    async def observe(self, req: ParsedRequest, plan: Plan, obs: Observation) -> None:
        """Record one response (``Observer``), then, off the next request's path, reconcile the slot
        just used and keep the harness head's origin slot. Never raises but what a tier raises."""
        pctx = getattr(plan, "context", None)
        table = self.table
        if table is None:
            return
        pin = (req.body or {}).get("id_slot")   # the client's own: the server alone honours it
        alone_n = self.alone.feed(pctx, obs, table.params, pin)
        if AloneTally.fed(pctx) is None:   # forwarded without tokens (the plan failed open)
            self.alone.feed_later(prompt_of(self, req), obs, table.params, self.background.spawn, pin)
        if isinstance(pctx, AlignContext):
            if alone_n is not None:   # [align] its saving against the server alone, measured
                self.align.saved_vs_alone(pctx, alone_n - int((obs.timings or {}).get("prompt_n") or 0))
            await self.align.observe(self, req, plan, obs)
            return
        if isinstance(pctx, ServerPlaced):
            self.observer.observe_placed(table, pctx, obs)
            return
        if not isinstance(pctx, PlanContext):
            return
        ok = await self.observer.observe(table, self.tiers, req, pctx, obs)
        await self.align.observe(self, req, plan, obs)   # the turn this slot now holds
        if self._stopping:
            return  # a planned stop: nothing new is sent to the server off a request's path
        if self.opt_reconcile:
            # the server's count for the slot just used (and a restart seen in the id_task values),
            # off the next request's path
            self.background.spawn(self.refresh(pctx.request_id), "reconcile")
        if ok and self.head_tier is not None:
            self.background.spawn(self.head_tier.maintain_origin(), "origin")

    # -- background ------------------------------------------------------------------------------

    async def idle(self) -> None:
        """Wait for background work (origin re-establishment, the tiers' commits) to finish."""
        await self.background.join()
        for tier in (self.head_tier, *self.tiers):
            if tier is not None:
                await tier.flush()

    async def warm_head(self, body: Mapping, path: str = "/v1/chat/completions") -> dict:
        """``warmup.warm_head``: prefill the harness head of an agent request ``body`` now."""
        return await warmup.warm_head(self, body, path)

    def warm_deps(self) -> WarmDeps | None:
        """``warmup.warm_deps``: what ``POST /v1/cache/warm`` needs (ocache/warm.py ``WarmDeps``)."""
        return warmup.warm_deps(self)

    # -- around the path: restart, drain, stats, clear -------------------------------------------

    def _table_knows_process(self) -> bool:
        """Whether the slot table's last ``GET /slots`` came from the process the upstream now
        reports (the same ``X-Llama-Server-Boot``, patches/0005): its own restart detection
        (``SlotTable.refresh``) already emptied the old process's slots and kept what requests to
        the new one filled, so a later restart notice must not empty them again."""
        boot = getattr(getattr(self.upstream, "boot", None), "boot", None)
        return self.table is not None and boot is not None and self.table.boot == boot

    async def on_upstream_restart(self) -> None:
        self.align.forget()
        if self.table is not None:
            if self._table_knows_process():
                self.table.epoch = getattr(self.upstream, "epoch", None)
            else:
                self.table.reset_all(getattr(self.upstream, "epoch", None))
        self._ready = False
        self.ids.forget()
        for tier in self.tiers:  # tiers forget per-slot beliefs about the old process
            try:
                await tier.on_upstream_restart()
            except Exception:
                log.exception("tier %s on_upstream_restart failed", tier.name)

    def begin_stop(self) -> None:
        """A planned stop began: from now on no background ``GET /slots`` reconcile (after a
        response, or before a plan) and no origin upkeep is started; :meth:`drain` and what it
        awaits still talk to the server."""
        self._stopping = True
        self.built.stop_live()

    def calls_inflight(self) -> int:
        """Slot HTTP calls to the server not answered yet (``SlotTable.calls_inflight``)."""
        return self.table.calls_inflight if self.table is not None else 0

    async def quiesce(self, timeout_s: float) -> int:
        """``stopping.quiesce``: the last step before llama-server is stopped (bounded by
        ``timeout_s`` seconds); returns the slot calls still in flight."""
        return await stopping.quiesce(self, timeout_s)

    async def drain(self) -> None:
        """``stopping.drain``: a planned stop's drain of every tier (bounded by the config's
        ``drain_timeout_s`` and the server going down)."""
        await stopping.drain(self)

    def stats(self) -> dict:
        """``report.stats``: what ``GET /v1/cache/stats`` shows of this layer."""
        return report.stats(self)

    async def clear(self, tier: str) -> dict:
        """``report.clear``: erase what ``tier`` (``resident``, ``head``, a tier's name, ``all``)
        holds; returns ``{"tier", "cleared"}``. Raises ValueError for an unknown tier."""
        return await report.clear(self, tier)


async def prompt_of(layer: OCacheLayer, req: ParsedRequest) -> Fed | None:
    """The prompt tokens and user-message starts of a request answered without a plan that held
    them (``OCacheLayer.prepare``: one token view, kept in the request's memo), for the
    server-alone model (``AloneTally.feed_later``); None when it has none (not a chat body ocache
    renders, rejected by the server). Raises what the view raises (the server unreachable)."""
    shape = layer.shape(req)
    if isinstance(shape, str):
        return None
    prep = await layer.prepare(req, shape)
    if not isinstance(prep, Prepared) or not prep.view.tokens:
        return None
    return list(prep.view.tokens), prep.ctx.user_starts, 0
