"""``OCacheLayer``: the cache half behind the proxy, a thin orchestrator of one request's path.

Request path (``docs/architecture.md`` §1), one direction, each step in its own module:

    parse (proxy.py) -> fingerprint (ocache/fingerprint.py) -> token view (ocache/tokens.py)
    -> plan (lookup phase: every tier's ``lookup`` once; ocache/cache/plan.py ``plan_request``,
       pure) -> lease the slot (``SlotTable.lease``; re-plan, pure, only if the slot changed)
    -> execute (ocache/cache/execute.py: before_evict, bring, warm_head, anchors; the slot's new
       content through the table's verbs) -> forward (proxy.py) -> observe
       (ocache/cache/observe.py: mispredictions, the slot's content) -> admit (every tier)

Around it: tier wiring when the layer gets ready (ocache/cache/wiring.py), the head tier and its
origin slot (ocache/tiers/head.py), drain, clear, stats.

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
import copy
import logging
import time
from dataclasses import replace
from typing import Any, Mapping, Sequence

from ocache import fingerprint as fp_mod
from ocache.api import convert
from ocache.cache import wiring
from ocache.cache.execute import PlanContext, ServerPlaced, execute
from ocache.cache.observe import Observer
from ocache.cache.plan import Decision, Estimate, plan_request
from ocache.llama.flags import params_from_argv
from ocache.slots import IF_BOOT_HEADER, SlotError, SlotNotSupported, SlotTable
from ocache.tiers.base import Offer, RequestContext, TierBase
from ocache.tiers.head import HeadTier, open_head_store
from ocache.tiers.resident import known_conversation_slot, rank_slots, server_should_choose
from ocache.tokens import TokenViewError, message_keys
from ocache.cache.align_route import AlignContext, AlignRoute, enabled as align_enabled   # [align]

log = logging.getLogger("ocache.cache")

CHAT_ROUTES = frozenset({"/v1/chat/completions", "/chat/completions"})
#: seconds after which a plan reconciles the table with ``GET /slots`` even when it vouches for
#: every slot: a restart the upstream's probe (every 2 s, ``ocache.upstream``) has not seen yet shows
#: there (``SlotTable._restarted``), and so does use of the server beside ocache. 0: every plan
#: reads it (concurrently with the token view). Measured with 2.0 (``ocache bench --preset tiny``,
#: restart_mid_session): a turn sent right after a restart was planned on the old table and
#: prefilled 14,795 tokens where the server alone prefilled 14,687 (rule 2 broken); with 0 the
#: restart is seen and the session comes back from disk (about half). The per-plan read cost no
#: measurable latency (scripts/bench-proxy: 1-token chat +2.5 ms p50 either way).
RECONCILE_MAX_AGE_S = 0.0
#: seconds a known conversation's next turn waits for its slot to settle (the previous answer's
#: plan released and the answer recorded: ``SlotTable.wait_settled``) when it arrived before that;
#: past it, the usual path
KNOWN_SETTLE_WAIT_S = 0.5
#: seconds the release of a known conversation's plan waits for its completion (the token view of
#: the forwarded request, ``OCacheLayer._complete_known``) before it gives up on the slot's record
KNOWN_COMPLETE_MAX_S = 120.0


def _labels(body: Any, headers: Any, kind: str) -> tuple[tuple[str, str | None], ...]:
    """``RequestContext.labels``: folder (agent requests), client, model. Never raises."""
    from ocache.fingerprint import client_of
    from ocache.warm import folder_of

    try:
        folder = folder_of(body) if kind == "agent" and isinstance(body, dict) else None
        model = body.get("model") if isinstance(body, dict) else None
        return (("folder", folder), ("client", client_of(headers)),
                ("model", model if isinstance(model, str) else None))
    except Exception:  # noqa: BLE001 - labels are for display only
        return ()


def _rejected_body(status: int) -> bool:
    """Whether a token view's HTTP error is the server's verdict on the body itself: a 4xx, or the
    500 it answers for a message it cannot parse (``Failed to parse messages: ... key 'text' not
    found`` for an Anthropic text block without its text: the exception of common/chat.cpp:468 of
    the pinned source, answered as a server error); not a 503 (loading: a restart) or a failed
    connection (0)."""
    return 400 <= status < 500 or status == 500


def _as_settled(snapshot: list) -> list:
    """Copies of the busy or pending slots of ``snapshot`` as they will be once their request's
    answer is recorded (lease free, not pending, the count the prompt gives), for
    ``known_conversation_slot``: which slot the next turn would find once it settles."""
    out = []
    for s in snapshot:
        if s.busy or s.pending:
            s = copy.copy(s)
            object.__setattr__(s, "busy", False)
            object.__setattr__(s, "pending", False)
            if s.n_total is None:
                object.__setattr__(s, "n_total", len(s.tokens))
        out.append(s)
    return out


def _mk_plan(**kw: Any) -> Any:
    from ocache.layer import Plan

    return Plan(**kw)


class OCacheLayer:
    """The ``CacheLayer`` the proxy loads (``ocache.layer``): resident routing, warm heads, and the
    disk/session tiers registered with ``add_tier``.

    ``upstream``: ``ocache.upstream.Upstream`` (``session``, ``base_url``, ``epoch``, ``props``,
    ``api_key``). ``config``: ``ocache.config.Config`` (the layer's keys: ``wiring.LayerOptions``).
    ``viewer``: a ``TokenViewer`` (default: one over ``upstream``); ``tiers``: tiers registered
    from the start; ``table``: the slot table (default: one over ``upstream``, built when the
    layer gets ready; tests pass an in-memory one).
    """

    def __init__(self, upstream: Any, config: Any = None, *, viewer: Any = None,
                 tiers: Sequence[TierBase] = (), table: SlotTable | None = None) -> None:
        self.upstream = upstream
        self.config = config
        opts = wiring.layer_options(config)
        self.opt_warm = opts.warm
        self.opt_keep_origin = opts.keep_origin
        self.opt_reconcile = opts.reconcile
        self.opt_fast_path = opts.fast_path
        self.param_overrides = dict(opts.param_overrides)
        self.argv = list(opts.argv) if opts.argv else None
        self.markers = getattr(config, "volatile_markers", None) or fp_mod.DEFAULT_MARKERS
        self._viewer = viewer
        self.counters: dict[str, int] = {
            "planned": 0, "plan_errors": 0, "observed": 0, "mispredictions": 0, "mispredict_low": 0,
            "mispredict_high": 0, "predicted_tokens": 0, "observed_cache_tokens": 0,
            "prompt_tokens": 0, "warmups": 0, "warmup_tokens": 0, "head_saves": 0, "head_restores": 0,
            "origin_rebuilds": 0, "origin_skipped": 0, "server_placed": 0, "no_cache_prompt": 0, "evictions": 0, "guest_on_agent_slot": 0, "client_pins_overridden": 0,
            "bring_failures": 0, "bring_retries": 0, "failed_responses": 0, "too_long": 0, "unrenderable": 0, "unpinnable": 0, "user_splits": 0,
            "split_tokens": 0, "reused_tokens": 0, "prefilled_tokens": 0, "replans": 0,
            "plan_reconciles": 0, "fast_path": 0, "fast_path_other_plan": 0,
            "fast_path_anchors_skipped": 0, "fast_path_failed": 0, "view_mismatches": 0,
            "known_boot_checked": 0, "known_if_boot": 0, "known_waits": 0, "known_waits_usual": 0,
        }
        self.align = AlignRoute(align_enabled(config))   # [align] issue 26, ocache/cache/align_route.py
        self.wants_message = self.align.on                # [align] the proxy collects streamed answers
        self.table: SlotTable | None = table
        self.head_tier: HeadTier | None = None if table is None else self._make_head_tier(table)
        self.tiers: list[TierBase] = list(tiers)
        self.by_tier: dict[str, int] = {}
        self.observer = Observer(self.counters, on_view_mismatch=self._view_mismatch)
        self._ready = False
        self._ready_lock = asyncio.Lock()
        self._bg: set[asyncio.Task] = set()
        self._identity: Any = None
        self._epoch = getattr(upstream, "epoch", None)
        self.findings: list[Any] = []
        self._no_save = False
        self.disk_tier: Any = None
        self._disk_tier_off = False
        self._session_tier: Any = None
        self._session_tier_off = False
        #: a planned stop began (:meth:`begin_stop`): no new GET /slots reconcile or origin upkeep
        self._stopping = False
        self.journal: Any = None
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
    def recent_mispredictions(self) -> Any:
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

    async def _ensure_ready(self) -> None:
        if self._ready and getattr(self.upstream, "epoch", None) == self._epoch:
            return
        async with self._ready_lock:
            epoch = getattr(self.upstream, "epoch", None)
            if self._ready and epoch == self._epoch:
                return
            if self._viewer is None:
                from ocache.tokens import TokenViewer

                self._viewer = TokenViewer(self.upstream)
            props = getattr(self.upstream, "props", None)
            if self.table is None:
                self.table = SlotTable(self.session, self.base_url, headers=self._headers())
            if self.head_tier is None:
                self.head_tier = self._make_head_tier(self.table)
            self.table.session = self.session
            data = await self.table.fetch_slots()
            self.table.params = params_from_argv(self.argv, props, data, **self.param_overrides)
            if self._epoch is not None and epoch != self._epoch and not self._table_knows_process():
                self.table.reset_all(epoch)
            self.table.epoch = epoch
            caps = props.get("ocache") if isinstance(props, Mapping) else None
            # patches/0006: this server checks a restore's xxh3 on its own read of the file
            self.table.checks_xxh3 = isinstance(caps, Mapping) and caps.get("restore_xxh3") is True
            # patches/0007: this server refuses a request planned for another process (412)
            self.table.if_boot = isinstance(caps, Mapping) and caps.get("if_boot") is True
            await self.table.refresh()
            self._epoch = epoch
            self._identity = None
            # before any tier reads the store (identities coexist)
            wiring.sync_store_identity(self.tiers, getattr(self._ident(), "key", None))
            await self._session_tier_ready()  # session tier (tiers/spill.py): register; resume after a drain
            self._disk_tier_ready()           # disk tier (tiers/disk.py): anchors on disk
            # head files through the same verified store (tiers/store.py)
            open_head_store(self.head_tier, self.config, self.table.params, getattr(self._ident(), "key", None))
            self._ready = True
            found = await wiring.setup_findings(self.session, self.base_url, self._headers(), self.table.params,
                                                props, data, self.argv)
            if found is not None:
                self.findings, actions_ok = found
                self._no_save = actions_ok is False
                self.head_tier.no_save = self.head_tier.no_save or self._no_save

    def _ident(self) -> Any:
        """The server's identity (``wiring.server_identity``), computed once per epoch."""
        if self._identity is None:
            self._identity = wiring.server_identity(getattr(self.upstream, "props", None), self.argv)
        return self._identity

    async def _session_tier_ready(self) -> None:
        """Register the session tier once (when the server can save slots), then restore the
        conversation a drained stop left for this start, before any request is planned (the caller
        holds the ready lock, so requests wait: a restore never races a prefill)."""
        if self._session_tier is None and not self._session_tier_off:
            tier = wiring.build_session_tier(self.config, self.table, self._ident())
            self._session_tier = tier
            self._session_tier_off = tier is None
            if tier is not None:
                self.add_tier(tier)
        if self._session_tier is not None:
            await self._session_tier.after_start()

    def _disk_tier_ready(self) -> None:
        """Register the disk tier once, when the server can save slots and its slot-save-path is
        known (config ``tiers.disk.slot_save_path`` or the launch argv; ocache/tiers/disk.py)."""
        if self.disk_tier is not None or self._disk_tier_off:
            return
        tier = None if self._no_save else wiring.build_disk_tier(self.config, self.table, self._ident)
        self._disk_tier_off = tier is None
        if tier is not None:
            self.disk_tier = tier
            self.add_tier(tier)

    def _anthropic_pin_ok(self) -> bool:
        """Whether a ``/v1/messages`` request can be pinned to a slot: one slot (nothing to pin),
        or a server whose ``/props`` reports ``ocache.anthropic_id_slot`` (patches/0003: the stock
        converter drops ``id_slot``, server-chat.cpp:592-597; the patched build reports the result
        of running its own converter on a probe). Otherwise such requests are forwarded unplanned
        (counted as ``unpinnable``) and ``GET /slots`` tells the table what they changed."""
        props = getattr(self.upstream, "props", None) or {}
        caps = props.get("ocache") if isinstance(props, Mapping) else None
        if isinstance(caps, Mapping) and caps.get("anthropic_id_slot") is True:
            return True
        return self.table is not None and len(self.table) == 1

    # -- CacheLayer: the request path ------------------------------------------------------------

    def _as_chat(self, req: Any) -> tuple[Mapping, str, str | None]:
        """``(body, path, refusal)``: a ``/v1/messages`` / ``/v1/responses`` request as the chat body
        the server itself renders (ocache/api/convert.py, path ``/v1/chat/completions``), any other
        as it is; ``refusal`` is ``unpinnable`` (an Anthropic request this server cannot pin:
        ``_anthropic_pin_ok``) or ``unrenderable`` (not convertible: the server answers it with its
        own 400), else None. The converted body is kept in ``req.memo``."""
        body, path = req.body or {}, req.path
        if path not in convert.CONVERTED_ROUTES:
            return body, path, None
        if path in convert.ANTHROPIC_ROUTES and not self._anthropic_pin_ok():
            return body, path, "unpinnable"
        memo = getattr(req, "memo", None)
        if memo is not None and "chat" in memo:
            return memo["chat"], "/v1/chat/completions", None
        try:
            chat = convert.to_chat(path, body)
        except convert.ConversionError as exc:
            log.debug("[%s] %s not converted: %s", req.request_id, path, exc)
            return body, path, "unrenderable"
        if memo is not None:
            memo["chat"] = chat
        return chat, "/v1/chat/completions", None

    @staticmethod
    def _keys(req: Any, body: Mapping) -> tuple:
        """``message_keys(body)``, computed once per request (``req.memo``)."""
        memo = getattr(req, "memo", None)
        if memo is None:
            return message_keys(body)
        if "keys" not in memo:
            memo["keys"] = message_keys(body)
        return memo["keys"]

    def known_slot(self, req: Any) -> int | None:
        """The slot :meth:`_plan_known` would take for ``req`` now (read-only, no await; the router
        asks it first: ``ocache/router.py``), or None: not ready, the known path off or not yet
        possible (template not checked append-only), not a chat request, no slot holds it."""
        table = self.table
        if not (self._ready and table is not None and self.opt_fast_path):
            return None
        body, path, refusal = self._as_chat(req)
        if refusal is not None or path not in CHAT_ROUTES or body.get("cache_prompt") is False:
            return None
        session = req.session_hint or fp_mod.session_key(getattr(req, "headers", None))
        kind = fp_mod.classify(body, self.markers)
        return known_conversation_slot(table.snapshot(), self._keys(req, body)[1], session, kind,
                                       bool(getattr(self._viewer, "append_only", False)))

    async def plan(self, req: Any) -> Any:
        await self._ensure_ready()
        table = self.table
        assert table is not None
        body, path, refusal = self._as_chat(req)
        if refusal is not None:
            self.counters[refusal] += 1
            return _mk_plan(headers={"X-OCache-Tier": "none", "X-OCache-Kind": "other"})
        chat = path in CHAT_ROUTES
        if body.get("cache_prompt") is False:
            # the server reuses nothing for it (n_past stays 0 without cache_prompt,
            # tools/server/server-context.cpp:3350 of the pinned source): no plan to make; the server
            # places it, and GET /slots tells the table what it replaced
            self.counters["no_cache_prompt"] += 1
            return _mk_plan(headers={"X-OCache-Tier": "none", "X-OCache-Kind": "other"})
        kind = fp_mod.classify(body, self.markers) if chat else "other"
        head = fp_mod.harness_head(body, self.markers) if kind == "agent" else None
        keys = None
        if chat and self.opt_fast_path:
            keys = self._keys(req, body)
            known = await self._plan_known(req, body, path, kind, head, keys)
            if known is not None:
                return known
        if chat and self.align.on:   # [align] a rewritten history served from the slot's own tokens
            keys = keys or self._keys(req, body)
            aligned = await self.align.plan(self, req, body, path, kind, head, keys)
            if aligned is not None:
                return aligned
        # GET /slots only when the table cannot vouch for a slot (it then runs while the view is
        # built: neither needs the other); otherwise the reconcile after each response did it
        refreshed = None
        if self.opt_reconcile and not self._stopping and table.needs_reconcile(RECONCILE_MAX_AGE_S):
            self.counters["plan_reconciles"] += 1
            refreshed = asyncio.ensure_future(self._refresh(req.request_id))
        try:
            view = await self._viewer.view(path, body, head, keys)
        except TokenViewError as exc:
            if refreshed is not None:
                await refreshed
            if _rejected_body(exc.status):
                # the server rejects this body (it will answer the forwarded request the same way):
                # a client error, not a cache-layer failure; forward untouched, no plan
                self.counters["unrenderable"] += 1
                return _mk_plan(headers={"X-OCache-Tier": "none", "X-OCache-Kind": kind})
            raise
        except BaseException:
            if refreshed is not None:
                refreshed.cancel()
            raise
        if refreshed is not None:
            await refreshed
        tokens = view.tokens
        params = table.params
        if len(tokens) >= params.n_ctx_slot or not tokens:
            self.counters["too_long"] += 1
            return _mk_plan(headers={"X-OCache-Tier": "cold", "X-OCache-Kind": kind})
        ctx = await self._context(req, body, view, kind, head, chat)
        if self._server_should_choose(view, ctx):
            return await self._plan_server_placed(req, view, ctx, kind)
        # every tier is asked once per request; the plan and any re-plan use these answers
        offers, anchors = await self._lookups(view, ctx)
        dec, seen = self._decide(view, ctx, offers, anchors)
        # the slot's lease is released on every path out of here but the success one (which hands
        # it to the proxy's release()): an exception or a cancellation (the client went away) at any
        # await below must never leave the slot locked
        lease = await table.lease(dec.slot)
        executing = False
        try:
            for attempt in range(3):
                if seen == self._inputs(dec.slot, ctx):
                    break  # nothing the plan read about this slot changed while we waited
                # the slot changed while we waited for its lease (another request used it): plan
                # again (pure, same offers); move to a better idle slot rather than evict a
                # conversation
                self.counters["replans"] += 1
                fresh, fresh_seen = self._decide(view, ctx, offers, anchors, held=dec.slot)
                if fresh.slot == dec.slot or fresh.choice.busy or attempt == 2:
                    if fresh.slot == dec.slot:
                        dec = fresh
                    else:
                        dec, _ = self._decide(view, ctx, offers, anchors, forced_slot=dec.slot, held=dec.slot)
                    break
                lease.release()
                dec, seen = fresh, fresh_seen
                lease = await table.lease(dec.slot)
            executing = True
            pctx = await execute(table, self.head_tier, self.tiers, self.disk_tier, self.counters,
                                 req.request_id, view, ctx, dec)
        except BaseException:
            if executing and lease.held:
                # stopped part way through the slot's steps (a restore, a warm-up, a save): what the
                # slot holds is unknown until GET /slots says
                table.mark_unknown(lease.slot)
            lease.release()
            raise

        async def release() -> None:
            lease.release()

        return _mk_plan(body_updates={"id_slot": dec.slot}, headers=self._planned(pctx, kind), context=pctx,
                        release=release, split_tokens=pctx.split, split_ms=pctx.split_ms)

    async def _context(self, req: Any, body: Mapping, view: Any, kind: str, head: Any, chat: bool) -> RequestContext:
        """The request's ``RequestContext`` from its view (head key and length, user starts,
        session, a new task id, labels); notes an agent request in the folder journal."""
        head_len = view.head_end or 0
        head_key = fp_mod.fingerprint(head, self._ident()) if head is not None and head_len else None
        user_starts = tuple(view.user_starts) if (chat or body.get("message_delimiters")) else ()
        if "id_slot" in (req.body or {}):
            self.counters["client_pins_overridden"] += 1
        if kind == "agent" and self.journal is not None:
            try:
                await asyncio.to_thread(self.journal.note, body, head_key)
            except OSError as exc:
                log.warning("[%s] folder journal not written: %s", req.request_id, exc)
        session = req.session_hint or fp_mod.session_key(getattr(req, "headers", None))
        return RequestContext(kind=kind, session=session, head_key=head_key, head_len=head_len,
                              task=self.table.next_task(), user_starts=user_starts,
                              labels=_labels(body, getattr(req, "headers", None), kind))

    def _planned(self, pctx: PlanContext, kind: str) -> dict[str, str]:
        """Count a planned request and return its ``X-OCache-*`` headers. They are sent before the
        body, so Prefilled/Reused come from the plan (what ocache prefilled itself, measured, plus
        the predicted reuse of the forwarded request)."""
        self.counters["planned"] += 1
        self.counters["split_tokens"] += pctx.split
        self.by_tier[pctx.decision.tier] = self.by_tier.get(pctx.decision.tier, 0) + 1
        headers = {"X-OCache-Slot": str(pctx.slot), "X-OCache-Predicted-Cache": str(pctx.reused),
                   "X-OCache-Tier": pctx.decision.tier, "X-OCache-Kind": kind,
                   "X-OCache-Split": str(pctx.split), "X-OCache-Prefilled": str(pctx.prefilled),
                   "X-OCache-Reused": str(pctx.reused)}
        if pctx.restore_s is not None:
            headers["X-OCache-Restore-Ms"] = f"{pctx.restore_s * 1e3:.1f}"
        return headers

    # -- the known conversation: forwarded first, viewed meanwhile ------------------------------

    async def _plan_known(self, req: Any, body: Mapping, path: str, kind: str, head: Any,
                          keys: tuple) -> Any:
        """The next turn of a conversation a slot holds (``known_conversation_slot``: its earlier
        messages unchanged, the template checked append-only; or exactly its messages, a resend):
        pinned to that slot and forwarded at once, without waiting for its token view. The plan is the one the planner makes for such a request (that
        slot, no step before forwarding; the reason is in ``known_conversation_slot``); the view,
        the prediction, the slot table's record and the ``X-OCache-*`` figures are computed while
        the server works (``Plan.completion``; the answer does not wait for it: its headers carry the
        figures when they are ready as llama-server's answer begins, which it sends only with its
        first result, after the prompt's prefill: tools/server/server-context.cpp:4514-4517 of the
        pinned source; else ``X-OCache-Figures: late``). Critical path: one
        ``message_keys`` pass and one check that the server is the process the table describes
        (``GET /health`` on a patched build, ``GET /slots`` otherwise: a restart must be seen),
        nothing in proportion to the prompt's tokens (``scripts/bench-long``).

        What the planner would have done differently is counted after the fact:
        ``fast_path_other_plan`` (another slot, a restore or a head warm-up) and
        ``fast_path_anchors_skipped`` (the disk tier's anchor split of the new tokens; the session
        tier still spills the conversation before an eviction). Returns None (plan as usual) when
        no slot holds the conversation or the slot changed before its lease was taken."""
        table = self.table
        session = req.session_hint or fp_mod.session_key(getattr(req, "headers", None))
        ext = bool(getattr(self._viewer, "append_only", False))
        snap = table.snapshot()
        slot = known_conversation_slot(snap, keys[1], session, kind, ext)
        if slot is None:
            # the client sent this turn the moment the previous answer ended, before the proxy
            # released that plan and recorded the answer (an agent's tool loop does): wait for that
            # (bounded), rather than view and plan a turn whose slot is known a few ms later
            settling = known_conversation_slot(_as_settled(snap), keys[1], session, kind, ext)
            if settling is None:
                return None
            self.counters["known_waits"] += 1
            if not await table.wait_settled(settling, KNOWN_SETTLE_WAIT_S):
                self.counters["known_waits_usual"] += 1   # waited, then planned the usual way
                return None
            slot = known_conversation_slot(table.snapshot(), keys[1], session, kind, ext)
            if slot is None:
                self.counters["known_waits_usual"] += 1
                return None
        if_boot = None
        if self.opt_reconcile and table.needs_reconcile(RECONCILE_MAX_AGE_S):
            # a restart since the table's last GET /slots must be seen before the server works on
            # the turn: the patched build checks that itself when the request names the process
            # (SlotTable.precondition, patches/0007: 412 before any work, and the proxy plans it
            # again), else it answers GET /health without waiting for a decode step
            # (SlotTable.same_process, patches/0005); else, or when in doubt, GET /slots itself
            if_boot = table.precondition()
            if if_boot is not None:
                self.counters["known_if_boot"] += 1
            elif not table.unvouched() and await table.same_process():
                self.counters["known_boot_checked"] += 1
            else:
                self.counters["plan_reconciles"] += 1
                if not await self._refresh(req.request_id):
                    # the server could not say what its slots hold (a new process still loading its
                    # model answers GET /slots 503 'Loading model'): the table may describe a dead
                    # process, so this turn is not sent to that slot as a known one
                    return None
            if if_boot is None and known_conversation_slot(table.snapshot(), keys[1], session, kind, ext) != slot:
                return None
        version = table.version(slot)
        lease = await table.lease(slot)
        if table.version(slot) != version:
            lease.release()
            return None
        self.counters["fast_path"] += 1
        plan = _mk_plan(body_updates={"id_slot": slot},
                        headers={"X-OCache-Slot": str(slot), "X-OCache-Kind": kind, "X-OCache-Path": "known"})
        if if_boot is not None:
            plan.upstream_headers[IF_BOOT_HEADER] = if_boot
        try:
            task = asyncio.get_running_loop().create_task(
                self._complete_known(req, plan, body, path, kind, head, keys, slot))
        except BaseException:
            lease.release()
            raise
        plan.completion = task

        async def release() -> None:
            try:
                done, _ = await asyncio.wait({task}, timeout=KNOWN_COMPLETE_MAX_S)
                if not done:
                    self.counters["fast_path_failed"] += 1
                    task.cancel()
                if not done or task.cancelled() or task.exception() is not None:
                    table.mark_unknown(slot)   # forwarded there; what it holds now is for GET /slots
            finally:
                lease.release()

        plan.release = release
        return plan

    async def _complete_known(self, req: Any, plan: Any, body: Mapping, path: str, kind: str,
                              head: Any, keys: tuple, slot: int) -> None:
        """``Plan.completion`` of :meth:`_plan_known`: the view, the planner's own decision (only
        counted), the forced decision for ``slot`` without steps, ``execute`` (the table's record),
        then ``plan.headers`` / ``plan.context``. A prompt too long for the slot is counted
        ``too_long`` (``X-OCache-Tier: cold``, no record: the server refuses it without touching the
        slot). Raises what the view raises (``release`` then marks the slot unknown; the answer is
        relayed without figures)."""
        table = self.table
        try:
            view = await self._viewer.view(path, body, head, keys)
            if view.tokens and len(view.tokens) >= table.params.n_ctx_slot:
                # a client error, counted as on the usual path: the server answers it with its own
                # 400 before it touches the slot's cache (tools/server/server-context.cpp:3336-3344
                # of the pinned source; GET /slots' n_prompt_tokens is the cache's size, :747), so
                # the slot keeps what the table records and the next turn is known again
                self.counters["too_long"] += 1
                plan.headers.update({"X-OCache-Tier": "cold"})
                return
            if not view.tokens:
                raise TokenViewError("empty prompt")
            ctx = await self._context(req, body, view, kind, head, True)
            offers, anchors = await self._lookups(view, ctx)
            best, _ = self._decide(view, ctx, offers, anchors, held=slot)
            if best.slot != slot or {"bring", "warm_head"} & set(best.steps):
                self.counters["fast_path_other_plan"] += 1
                log.info("[%s] known conversation forwarded to slot %d; the planner would have chosen "
                         "slot %d (%s, predicted %d)", req.request_id, slot, best.slot,
                         ",".join(best.steps) or "no steps", best.predicted)
            elif anchors and self.disk_tier is not None and self.disk_tier.lines_above(anchors, best.predicted):
                self.counters["fast_path_anchors_skipped"] += 1
            dec, _ = self._decide(view, ctx, [], None, forced_slot=slot, held=slot)
            dec = replace(dec, steps=(), evicts=False, offer=None)
            pctx = await execute(table, self.head_tier, self.tiers, self.disk_tier, self.counters,
                                 req.request_id, view, ctx, dec)
        except asyncio.CancelledError:
            raise   # its plan was ended (a refused precondition) or it ran past KNOWN_COMPLETE_MAX_S
        except BaseException:
            self.counters["fast_path_failed"] += 1
            raise
        plan.headers.update(self._planned(pctx, kind))
        plan.context = pctx

    def _server_should_choose(self, view: Any, ctx: RequestContext) -> bool:
        """``tiers/resident.py`` ``server_should_choose`` on the current table."""
        snap = self.table.snapshot()
        return server_should_choose(rank_slots(view.tokens, snap, ctx, self.table.params), snap)

    async def _plan_server_placed(self, req: Any, view: Any, ctx: RequestContext, kind: str) -> Any:
        """Forward without ``id_slot`` and let the server choose the slot (``server_should_choose``):
        ocache holds every slot's lease meanwhile (taken in slot order, so two such requests never
        deadlock), so that no other request runs and the one slot whose ``id_task`` grows is the
        server's choice; ``release`` records what it now holds (``SlotTable.learn_placement``)
        before letting the leases go, and ``observe`` predicts the checkpoints its prefill made.
        The answer's figures are the server's own (nothing was split)."""
        table = self.table
        leases: list[Any] = []
        try:
            for i in range(len(table)):
                leases.append(await table.lease(i))
            await table.refresh()          # the id_task of every slot, right before the request
        except BaseException:
            for lease in leases:
                lease.release()
            raise
        before = table.task_ids()
        placed = ServerPlaced(req.request_id, view.tokens, ctx)
        self.counters["server_placed"] += 1

        async def release() -> None:
            try:
                placed.slot = await table.learn_placement(
                    before, view.tokens, owner=ctx.session, kind=ctx.kind, user_starts=ctx.user_starts,
                    labels=dict(ctx.labels))
                if placed.slot is not None:
                    placed.seq = table[placed.slot].seq
                    log.info("[%s] the server placed the request in slot %d", req.request_id, placed.slot)
            except SlotError as exc:
                log.warning("[%s] which slot the server chose is unknown (%s)", req.request_id, exc)
            finally:
                for lease in leases:
                    lease.release()

        return _mk_plan(headers={"X-OCache-Tier": "none", "X-OCache-Kind": kind, "X-OCache-Slot": "server"},
                        context=placed, release=release)

    async def estimate(self, req: Any) -> Estimate | None:
        """What this server could do for ``req`` if it were planned here, read-only: the router
        (``ocache/router.py``) asks every server's layer and picks one before calling its ``plan``.

        The same steps as ``plan`` up to the decision (token view, classify, head, the lookup
        phase, ``plan_request`` on ``SlotTable.snapshot()``), without the slot lease, the journal,
        counters or any table change. (The chosen server's ``plan`` asks its tiers again: two
        lookups per tier for a routed request.) Returns None for a request ``plan`` would not pin
        (unrenderable, unconvertible, too long). Raises what ``_ensure_ready`` / the token view
        raise when the server cannot be asked (the router then skips it).
        """
        await self._ensure_ready()
        table = self.table
        body, path, refusal = self._as_chat(req)
        if refusal is not None:
            return None
        chat = path in CHAT_ROUTES
        kind = fp_mod.classify(body, self.markers) if chat else "other"
        head = fp_mod.harness_head(body, self.markers) if kind == "agent" else None
        try:
            view = await self._viewer.view(path, body, head)
        except TokenViewError as exc:
            if _rejected_body(exc.status):
                return None
            raise
        tokens = view.tokens
        if not tokens or len(tokens) >= table.params.n_ctx_slot:
            return None
        head_len = view.head_end or 0
        head_key = fp_mod.fingerprint(head, self._ident()) if head is not None and head_len else None
        session = req.session_hint or fp_mod.session_key(getattr(req, "headers", None))
        ctx = RequestContext(kind=kind, session=session, head_key=head_key, head_len=head_len,
                             task=getattr(table, "_task_seq", 0) + 1,
                             user_starts=tuple(view.user_starts) if (chat or body.get("message_delimiters")) else ())
        offers, anchors = await self._lookups(view, ctx)
        dec, _ = self._decide(view, ctx, offers, anchors)
        snap = table.snapshot()
        own = bool(session) and any(s.owner == session for s in snap)
        destroys = 0
        if dec.evicts and not any(t.will_spill(dec.slot) for t in self.tiers):
            destroys = len(snap[dec.slot].tokens)
        # a live conversation overwritten (spilled or not) where every slot holds one, or in a slot
        # that is busy (the plan waits for its request, and what it then finds is not this
        # prediction): the router prefers a server with room (router._eligible)
        full = bool(dec.evicts) and (dec.choice.busy or all(
            c.protected for c in rank_slots(tokens, snap, ctx, table.params)))
        # the tokens up to 256 past what requests of one folder share (the harness head when the
        # plan reuses no more, else the usable prefix; none below 256): the key under which the
        # router lets concurrent plans of one new prefix wait for each other (router._gate_key)
        base = head_len if head_len and dec.predicted < head_len + 256 else (
            dec.predicted if dec.predicted >= 256 else 0)
        block = base + 256 if base + 256 <= len(tokens) or not base else 0
        return Estimate(n_tokens=len(tokens), usable=dec.predicted, tier=dec.tier, slot=dec.slot,
                        busy=dec.choice.busy, destroys=destroys,
                        restore_s=dec.offer.cost_s if dec.offer else 0.0, kind=kind, own_session=own,
                        head_len=head_len, prefill_tps=self.prefill_tps, head_key=head_key,
                        warm="warm_head" in dec.steps, prefix_key=hash(tuple(tokens[:block])) if block else None,
                        prefix_len=block, evicts=len(snap[dec.slot].tokens) if dec.evicts else 0, full=full,
                        room=any(st.origin or (not st.tokens and not st.n_total and not st.foreign)
                                 for st in snap),
                        ubatch=table.params.n_ubatch)

    async def _refresh(self, rid: str) -> bool:
        """Reconcile the slot table with ``GET /slots``; whether it succeeded. A failure only logs
        (the usual plan then uses the table as it is; a known turn is planned as usual instead).

        When that ``GET /slots`` shows a new server process before the upstream's own probe did,
        the probe runs now (and with it ``on_upstream_restart``: the tiers forget the old
        process's slots), before the caller plans anything on the new process; found later, at the
        next probe, it wiped what ocache had learned about the new process since (a newcomer's
        break test: slot 0 restored and three turns served there, then "content now unknown")."""
        seen = self.table.counters["restarts_seen_in_slots"]
        try:
            await self.table.refresh()
        except SlotError as exc:
            log.debug("[%s] GET /slots failed: %s", rid, exc)
            return False
        probe = getattr(self.upstream, "probe", None)
        if self.table.counters["restarts_seen_in_slots"] != seen and probe is not None:
            await probe()
        return True

    async def _lookups(self, view: Any, ctx: RequestContext) -> tuple[list[Offer | None], Any]:
        """The lookup phase, once per request: every tier's ``lookup`` (head tier first), and the
        disk tier's anchor lines (None without a disk tier). A tier whose lookup raises offers
        nothing."""
        offers: list[Offer | None] = []
        tiers: list[Any] = [self.head_tier, *self.tiers]
        for tier in tiers:
            try:
                offers.append(await tier.lookup(view, ctx))
            except Exception:
                log.exception("tier %s lookup failed", tier.name)
        anchors = None
        if self.disk_tier is not None:
            try:
                anchors = self.disk_tier.anchor_lines(view)
            except Exception:
                log.exception("disk tier anchor lines failed")
                anchors = ()
        return offers, anchors

    def _head_resident(self, ctx: RequestContext) -> bool:
        if ctx.head_key and self.opt_warm:
            return self.head_tier.knows(ctx.head_key)
        return True

    def _inputs(self, slot: int, ctx: RequestContext) -> tuple:
        """What a plan read that can change while the request waits for ``slot``'s lease: the slot's
        write counter and whether the request's head is known."""
        return (self.table.version(slot), self._head_resident(ctx))

    def _decide(self, view: Any, ctx: RequestContext, offers: Sequence[Offer | None], anchors: Any,
                forced_slot: int | None = None, held: int | None = None) -> tuple[Decision, tuple]:
        """``plan_request`` on a snapshot of the table with the lookup phase's answers (pure but for
        reading the table). ``held``: the slot whose lock this request holds (not busy for its own
        plan). Returns the decision and :meth:`_inputs` of its slot as read for it."""
        table = self.table
        head_resident = self._head_resident(ctx)
        snap = table.snapshot(held=held)
        # the slots whose conversation a tier saves before it is evicted (the session tier)
        spillable = frozenset(s.id for s in snap if any(t.will_spill(s.id) for t in self.tiers))
        dec = plan_request(view.tokens, snap, offers, ctx, table.params,
                           head_resident=head_resident, prefill_tps=self.prefill_tps,
                           forced_slot=forced_slot, can_spill=spillable, anchors=anchors)
        return dec, (snap[dec.slot].version, head_resident)


    def _view_mismatch(self, rid: str) -> None:
        """A response showed the token view wrong (``Observer``): the viewer trusts no delta render
        until the next epoch (``TokenViewer.distrust``), so the next views are full renders."""
        distrust = getattr(self._viewer, "distrust", None)
        if distrust is not None:
            distrust(f"request {rid}: the server's prompt length differed from the view")

    async def observe(self, req: Any, plan: Any, obs: Any) -> None:
        pctx: PlanContext | None = getattr(plan, "context", None)
        if isinstance(pctx, AlignContext):   # [align]
            await self.align.observe(self, req, plan, obs)
            return
        if isinstance(pctx, ServerPlaced):
            self.observer.observe_placed(self.table, pctx, obs)
            return
        if not isinstance(pctx, PlanContext):
            return
        ok = await self.observer.observe(self.table, self.tiers, req, pctx, obs)
        await self.align.observe(self, req, plan, obs)   # [align] the turn this slot now holds
        if self._stopping:
            return  # a planned stop: nothing new is sent to the server off a request's path
        if self.opt_reconcile:
            # the server's count for the slot just used (and a restart seen in the id_task values),
            # off the next request's path
            self._spawn(self._refresh(pctx.request_id))
        if ok:
            self._spawn(self.head_tier.maintain_origin())

    # -- background ------------------------------------------------------------------------------

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    async def idle(self) -> None:
        """Wait for background work (origin re-establishment, the tiers' commits) to finish."""
        while self._bg:
            await asyncio.gather(*list(self._bg), return_exceptions=True)
        for tier in (self.head_tier, *self.tiers):
            if tier is not None:
                await tier.flush()

    async def warm_head(self, body: Mapping, path: str = "/v1/chat/completions") -> dict:
        """Warm the stable harness head of an agent request ``body`` now (``ocache warm DIR``).

        Returns ``{"slot", "head_key", "head_tokens", "prompt_n", "cache_n"}``. Raises ValueError
        when the body has no recognisable harness head.
        """
        await self._ensure_ready()
        head = fp_mod.harness_head(body, self.markers)
        if head is None:
            raise ValueError("no stable harness head in this request (unknown layout)")
        view = await self._viewer.view(path, body, head)
        if not view.head_end:
            raise ValueError("the head could not be located in the rendered prompt")
        key = fp_mod.fingerprint(head, self._ident())
        head_tokens = view.tokens[:view.head_end]
        ctx = RequestContext(kind="guest", head_key=None, task=self.table.next_task())
        snap = self.table.snapshot()
        for s in snap:
            if s.origin and s.head_key == key and s.tokens == head_tokens:
                return {"slot": s.id, "head_key": key, "head_tokens": len(head_tokens), "prompt_n": 0,
                        "cache_n": len(head_tokens)}
        dec = plan_request(head_tokens, snap, [], ctx, self.table.params)
        async with self.table.lock(dec.slot):
            t = await self.head_tier.warm_in(dec.slot, head_tokens, key)
        return {"slot": dec.slot, "head_key": key, "head_tokens": len(head_tokens),
                "prompt_n": t.get("prompt_n"), "cache_n": t.get("cache_n")}

    def warm_deps(self) -> Any:
        """What ``POST /v1/cache/warm`` (``ocache warm DIR``) needs: ocache/warm.py ``WarmDeps``."""
        from ocache.warm import WarmDeps

        if self.journal is None:
            return None

        async def pick_slot() -> int:
            """An idle slot that holds no live conversation: an empty one first, then a guest's or
            a head, then one whose content ocache cannot see (it may be a conversation), LRU among
            equals; else the planner's choice for a guest (which ranks protected conversations
            last; ``prepare_slot`` then hands it to the tiers)."""
            await self._ensure_ready()
            snap = self.table.snapshot()
            free = [s for s in snap if not s.busy and s.kind not in ("agent", "other")]
            if free:
                return min(free, key=lambda s: (bool(s.foreign and s.n_total), bool(s.tokens or s.n_total),
                                                s.last_used)).id
            ctx = RequestContext(kind="guest", task=self.table.next_task())
            return plan_request([0], snap, [], ctx, self.table.params).slot

        async def prepare_slot(slot: int) -> None:
            """The warm-up replaces a live conversation only when every slot holds one; then the
            tiers' ``before_evict`` run first, as for a request (the session tier spills it)."""
            st = self.table[slot]
            if st.tokens and st.kind in ("agent", "other") and not st.origin:
                self.counters["evictions"] += 1
                log.info("warm: slot %d holds a conversation (%d tokens); every slot does: it is "
                         "handed to the tiers before the warm-up replaces it", slot, len(st.tokens))
                for tier in self.tiers:
                    try:
                        await tier.before_evict(slot)
                    except Exception:
                        log.exception("tier %s before_evict(slot %d) for a warm-up failed", tier.name, slot)

        return WarmDeps(journal=self.journal, viewer=self._viewer, tier=self.disk_tier,
                        slots=self.table, pick_slot=pick_slot, prepare_slot=prepare_slot)

    # -- around the path: restart, drain, stats, clear -------------------------------------------

    def _table_knows_process(self) -> bool:
        """Whether the slot table's last ``GET /slots`` came from the process the upstream now
        reports (the same ``X-Llama-Server-Boot``, patches/0005): its own restart detection
        (``SlotTable.refresh``) already emptied the old process's slots and kept what requests to
        the new one filled, so a later restart notice must not empty them again."""
        boot = getattr(getattr(self.upstream, "boot", None), "boot", None)
        return self.table is not None and boot is not None and self.table.boot == boot

    async def on_upstream_restart(self) -> None:
        self.align.forget()   # [align]
        if self.table is not None:
            if self._table_knows_process():
                self.table.epoch = getattr(self.upstream, "epoch", None)
            else:
                self.table.reset_all(getattr(self.upstream, "epoch", None))
        self._ready = False
        self._identity = None
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

    def calls_inflight(self) -> int:
        """Slot HTTP calls to the server not answered yet (``SlotTable.calls_inflight``)."""
        return self.table.calls_inflight if self.table is not None else 0

    async def quiesce(self, timeout_s: float) -> int:
        """The last step before llama-server is stopped: :meth:`begin_stop`, then wait (at most
        ``timeout_s`` seconds in all) for background work and for every slot call in flight, so
        that no connection of ocache's waits on the server's task queue when it gets SIGTERM
        (llama-server does not exit while a client waits for a task's result: it polls the client
        every ``HTTP_POLLING_SECONDS``, tools/server/server-context.cpp:40, server-queue.cpp:550-560;
        README "Limitations"). Returns the slot calls still in flight (0 when none)."""
        self.begin_stop()
        deadline = time.monotonic() + timeout_s
        if self._bg:
            await asyncio.wait(list(self._bg), timeout=max(0.0, deadline - time.monotonic()))
        if self.table is None:
            return 0
        return await self.table.wait_calls(max(0.0, deadline - time.monotonic()))

    async def drain(self) -> None:
        """Planned stop: finish background work, then every tier's drain step (by default its
        ``before_evict`` on each live conversation; the session tier spills each once, commits and
        writes its resume marker).

        Abandoned (cancelled, counted ``drain_abandoned``, logged) once the server is seen down
        (``Upstream.wait_down``) or after the config's ``drain_timeout_s`` seconds: a
        llama-server stopped together with ocache ends its task queue at SIGTERM while its HTTP
        threads still read requests on open connections, so a slot save sent on one of ocache's
        pooled connections is never answered (measured: ``kill -TERM`` of both at once left both
        running until ocache was killed; the slot call's own bound is ``SlotTable`` ``timeout_s``,
        3,600 s), and llama-server does not exit while that client waits (README "Limitations").
        What was not spilled by then is lost, as it would be without ocache."""
        timeout_s = getattr(self.config, "drain_timeout_s", None)
        work = asyncio.ensure_future(self._drain_tiers())
        wait_down = getattr(self.upstream, "wait_down", None)
        down = asyncio.ensure_future(wait_down()) if wait_down is not None else None
        try:
            await asyncio.wait([t for t in (work, down) if t is not None], timeout=timeout_s,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            if down is not None:
                down.cancel()
        if not work.done():
            why = ("llama-server went down" if down is not None and down.done() and not down.cancelled()
                   else f"not finished in {timeout_s:g} s (drain_timeout_s)")
            log.warning("drain abandoned: %s; the slot calls in flight will not be answered, "
                        "conversations not spilled yet are not kept", why)
            self.counters["drain_abandoned"] = self.counters.get("drain_abandoned", 0) + 1
            work.cancel()
            await asyncio.wait([work], timeout=5.0)   # cancelled slot calls close their connections
            return
        work.result()

    async def _drain_tiers(self) -> None:
        await self.idle()
        if self.table is None:
            return
        for tier in self.tiers:
            try:
                await tier.on_drain(self.table)
            except Exception:
                log.exception("tier %s on_drain failed", tier.name)

    def stats(self) -> dict:
        table = self.table
        out: dict[str, Any] = {"layer": "ocache", **self.counters, "by_tier": dict(self.by_tier),
                               "prefill_tokens_per_s": self.prefill_tps,
                               "recent_mispredictions": list(self.recent_mispredictions),
                               "setup_warnings": [str(f) for f in self.findings if f.level != "ok"],
                               "align": self.align.stats()}   # [align]
        if table is not None:
            out["slots"] = [{"id": s.id, "tokens": len(s.tokens), "n_total": s.n_total, "kind": s.kind,
                             "owner": s.owner, "origin": s.origin, "checkpoints": len(s.checkpoints),
                             "busy": table.lock(s.id).locked(), "head_len": s.head_len,
                             "idle_s": round(time.monotonic() - s.last_used, 1) if s.last_used else None}
                            for s in table.slots]
            out["table"] = dict(table.counters)
            out["heads"] = {k: {"tokens": len(r.tokens), "entry": r.entry}
                            for k, r in self.head_tier.heads.items()}
            out["tier_head"] = self.head_tier.stats()
        for tier in self.tiers:
            try:
                out[f"tier_{tier.name}"] = tier.stats()
            except Exception as exc:  # stats must never break the route
                out[f"tier_{tier.name}"] = {"error": f"{type(exc).__name__}: {exc}"}
        return out

    async def clear(self, tier: str) -> dict:
        """``resident`` (or ``all``): erase every slot ocache knows; ``head``: forget warmed heads and
        their files; ``disk``/``session``: delete that tier's store entries. Returns
        ``{"tier", "cleared"}``."""
        known = {"resident", "head", "all", *(t.name for t in self.tiers)}
        if tier not in known:
            raise ValueError(f"unknown tier {tier!r}; one of {sorted(known)}")
        cleared = 0
        if tier in ("resident", "all"):
            self.align.forget()   # [align]
        if tier in ("resident", "all") and self.table is not None:
            for st in self.table.slots:
                async with self.table.lock(st.id):
                    try:
                        await self.table.erase(st.id)
                    except SlotNotSupported:
                        self.table.mark_unknown(st.id, st.n_total)   # no --slot-save-path: the server keeps it
                        continue
                    cleared += 1
        for t in (self.head_tier, *self.tiers):  # head files, disk anchors, spilled sessions
            if t is not None and tier in (t.name, "all"):
                cleared += int((await t.clear()).get("deleted", 0))
        return {"tier": tier, "cleared": cleared}
