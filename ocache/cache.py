"""The cache layer behind the proxy: plan each completion (which slot, what to do first), observe
what the server did, keep the slot table true.

Request path (``docs/architecture.md`` §1): classify (``ocache.fingerprint``) -> token view
(``ocache.tokens``) -> ``plan_request`` (pure: resident ranking + other tiers' offers) -> execute
the steps under the chosen slot's lock (``before_evict`` on every tier, warm the harness head,
``bring`` an offer) -> forward with ``id_slot`` pinned -> ``observe``: compare the predicted
``cache_n`` with the server's, count mispredictions (they are bugs), let every tier ``admit``.

Warm-up: the first agent request of a new harness fingerprint prefills its stable head
(``tokens[:head_end]``) with a no-generation request in the slot it will use anyway (it costs the
request nothing: it would prefill the same tokens), and the head's state is saved to a slot file
(``oc-h-<key>.bin``, an entry of the verified store, ``HeadTier``) when the server has
``--slot-save-path`` and the store is open. With ``-np >= 2`` one
idle non-agent slot keeps the head as the shared *origin*: when a conversation consumed it, it is
re-established in the background (a restore of the head file, or a re-prefill) once the server is
idle, so a new session in any folder resumes from the head. A request that lands on a slot without
the head gets it restored first when that is cheaper than prefilling it (the ``head`` tier).

Response headers of a planned request. They are sent before the body, so the token counts come
from the plan: what ocache prefilled itself is measured (the steps ran before forwarding), the
forwarded request's reuse is the prediction (``ocache.llama.reuse.predict_reuse``, off by at most one
ubatch unless a misprediction is counted); the response body's corrected ``timings`` and ``usage``
are the measured figures (``ocache/api/figures.py``).

* ``X-OCache-Tier``: where the reused prefix came from — ``resident`` (left in the slot by earlier
  requests), ``head`` (the head tier: its slot file restored, or the harness head ocache keeps warm
  in an origin slot), ``disk`` (a disk-tier anchor), ``session`` (a spilled conversation), restored
  in this request or before it by ocache (``ocache warm DIR``, the resume after a drain) and not yet
  used by a request; ``cold`` when nothing came from before this request (a restore that failed
  verification is ``cold`` too).
* ``X-OCache-Split``: tokens ocache prefilled itself on the slot for this request, in separate
  ``n_predict: 0`` steps (the head warm-up, the disk tier's anchor split); 0 when none.
* ``X-OCache-Prefilled``: tokens the server prefills for this request, ``Split`` included
  (``Split + prompt - predicted cache_n``).
* ``X-OCache-Reused`` (= ``X-OCache-Predicted-Cache``): tokens reused from before this request
  (``predicted cache_n - Split``), what the corrected ``cache_n``/``cached_tokens`` will say.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Collection, Mapping, Sequence

from ocache.api import convert
from ocache import fingerprint as fp_mod
from ocache.llama import flags as llama_flags, gguf as llama_gguf
from ocache.llama.reuse import Checkpoint, common_prefix, predict_reuse, simulate_prefill
from ocache.llama.flags import ServerParams, params_from_argv
from ocache.slots import SlotError, SlotNotSupported, SlotTable
from ocache.tiers.base import Offer, Tier
from ocache.tokens import TokenViewError
from ocache.tiers.resident import (RequestContext, SlotChoice, eviction_choice, overwrite_choice, ram_swap_possible,
                             rank_slots, server_should_choose)

log = logging.getLogger("ocache.cache")

CHAT_ROUTES = frozenset({"/v1/chat/completions", "/chat/completions"})
#: prefills shorter than this (tokens) do not enter the measured prefill rate: their fixed costs
#: (one ubatch at least, the sampling of the first token) dominate the per-token figure
PREFILL_RATE_MIN_TOKENS = 512


# ----------------------------------------------------------------------------------------------
# the pure planner


@dataclass(frozen=True)
class Decision:
    """The plan for one request (a plain value: logged, tested, shown in ``X-OCache-*``).

    ``slot``: the slot to pin. ``tier``: where the reused prefix comes from (``resident``, an
    offer's tier, ``head`` for a warm-up in place, ``cold``). ``predicted``/``upper``: the predicted
    ``cache_n`` and the most the server may reuse (see ``ocache.llama.reuse.Reuse``). ``steps``: what to do
    before forwarding, in order: ``before_evict``, ``bring`` or ``warm_head``, ``anchors``.
    ``evicts``: the slot holds another live conversation. ``choice``: the resident ranking entry of
    the slot. ``anchors``: the disk tier's anchor lines ``((length, reason), ...)``
    (``DiskTier.anchor_lines``), split off the prefill by the ``anchors`` step (the lines the
    prefill passes cold after the steps before it: ``DiskTier.lines_above``).
    """

    slot: int
    tier: str
    predicted: int
    upper: int
    steps: tuple[str, ...]
    evicts: bool
    choice: SlotChoice
    offer: Offer | None = None
    warnings: tuple[str, ...] = ()
    anchors: tuple[tuple[int, str], ...] = ()


def plan_request(tokens: Sequence[int], slots: Sequence[Any], offers: Sequence[Offer | None],
                 ctx: RequestContext, params: ServerParams, *, head_resident: bool = True,
                 prefill_tps: float | None = None, forced_slot: int | None = None,
                 can_spill: bool | Collection[int] = False,
                 anchors: Sequence[tuple[int, str]] | None = None) -> Decision:
    """Choose a slot and the steps for a request of ``tokens`` (pure).

    ``slots``: ``SlotTable.snapshot()``. ``offers``: non-resident tiers' ``lookup`` answers.
    ``head_resident``: some slot (or tier) already has ``ctx``'s head; False on the first agent
    request of a new fingerprint, which then warms its head in the chosen slot (``warm_head``).
    ``prefill_tps``: measured prefill rate (tokens/s) to weigh an offer's ``cost_s`` against the
    prefill it saves (None: an offer is taken when it saves at least one ubatch).
    ``forced_slot``: plan for this slot only (re-planning after waiting for its lock).
    ``can_spill``: the slot ids whose conversation the session tier would save before it is
    evicted (its ``before_evict`` hook; ``SessionTier.will_spill``), or True for every slot.
    ``anchors``: the disk tier's anchor lines (``DiskTier.anchor_lines``), None without a disk
    tier; when given, the plan ends with the ``anchors`` step.

    Another live conversation's slot is protected, but not at any price: see
    ``ocache.tiers.resident.overwrite_choice`` (the protection rule).
    Raises ValueError when there is no slot.
    """
    ranked = rank_slots(tokens, slots, ctx, params)
    if not ranked:
        raise ValueError("no slots")
    if forced_slot is not None:
        ranked = [c for c in ranked if c.slot == forced_slot] or ranked
    choice = ranked[0]
    if forced_slot is None and not choice.protected:
        choice = overwrite_choice(ranked, slots, offers, can_spill) or choice
    elif forced_slot is None:
        choice = eviction_choice(ranked, slots, can_spill) or choice
    warnings: list[str] = []
    evicts = choice.protected
    if evicts and ctx.kind == "guest":
        warnings.append("guest_on_agent_slot")
    elif evicts:
        warnings.append("conversation_evicted")
    reuse = choice.reuse
    steps: list[str] = []
    if evicts:
        steps.append("before_evict")
    tier = "resident" if reuse.cache_n > 0 else "cold"
    predicted, upper = reuse.cache_n, reuse.upper
    ub = params.n_ubatch
    # the longest offer; on a tie the verified one (its file is checked before the restore), then
    # the cheaper one
    best = max((o for o in offers if o is not None and (o.slot is None or o.slot == choice.slot)),
               key=lambda o: (o.tokens_usable, o.verified, -o.cost_s), default=None)
    take_offer = False
    if best is not None and best.tokens_usable > predicted:
        gain = best.tokens_usable - predicted
        if prefill_tps:
            take_offer = gain / prefill_tps > best.cost_s
        else:
            take_offer = gain >= ub
    if take_offer:
        steps.append("bring")
        tier, predicted = best.tier, best.tokens_usable
        upper = max(upper, predicted)
    elif (ctx.kind == "agent" and ctx.head_len > 0 and not head_resident
          and predicted < ctx.head_len - ub and len(tokens) > ctx.head_len):
        steps.append("warm_head")
        tier, predicted = "head", ctx.head_len
        upper = max(upper, predicted)
    if anchors is not None:
        steps.append("anchors")
    return Decision(choice.slot, tier, predicted, upper, tuple(steps), evicts, choice,
                    best if take_offer else None, tuple(warnings), tuple(anchors or ()))


@dataclass(frozen=True)
class Estimate:
    """One server's answer to the router's "what could you reuse for this request?"
    (``OCacheLayer.estimate``). ``n_tokens``: the prompt in tokens; ``usable``: the predicted
    ``cache_n`` there (resident, or what the head/disk/session tiers would restore first), in tokens;
    ``tier``: where it would come from; ``slot``/``busy``: the slot the plan would take and whether
    a request is running in it; ``destroys``: tokens of another live conversation the plan would
    overwrite there without the session tier saving them first (0: none);
    ``restore_s``: the chosen offer's estimated read time (seconds); ``own_session``: a slot holds
    this request's session; ``prefill_tps``: this server's measured prefill rate (tokens/s, None
    before the first measurement); ``head_key``: the harness fingerprint; ``warm``: the plan would
    prefill the head itself first (no server holds it yet); ``prefix_key``: a hash of the first 256
    tokens (in-process only: requests that start alike); ``ubatch``: the server's ``-ub`` (tokens)."""

    n_tokens: int
    usable: int
    tier: str
    slot: int
    busy: bool
    destroys: int
    restore_s: float
    kind: str
    own_session: bool
    head_len: int
    prefill_tps: float | None
    head_key: str | None = None
    warm: bool = False
    prefix_key: int | None = None
    ubatch: int = 512


# ----------------------------------------------------------------------------------------------
# the head tier: warmed harness heads saved to slot files

#: store kind of the head tier's entries (``oc-h-<key>.bin``; ``ocache.tiers.store``)
HEAD_KIND = "h"


class HeadTierError(RuntimeError):
    """A head restore failed; the request goes cold. ``reason``: a store check word (``missing``,
    ``size``, ``hash``, ``identity``, ``tokens``, ``header``, ``record``: the entry was deleted),
    ``restore`` (the server refused the file: deleted), ``upstream`` (the server could not be asked:
    the entry is kept) or ``gone`` (the entry was evicted or cleared)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"head tier: {reason}{': ' + detail if detail else ''}")
        self.reason = reason


@dataclass
class HeadRecord:
    """A warmed harness head: its token ids, the store entry holding its state (None: not saved),
    and the checkpoints a restore brings back (the patched build's sidecar; [] on a stock build)."""

    key: str
    tokens: list[int]
    entry: str | None = None
    checkpoints: list[Checkpoint] = field(default_factory=list)
    restore_s: float = 0.05
    last_used: float = 0.0


class HeadTier:
    """Offers a known harness head to any slot by restoring its slot file (a Tier).

    The files go through the verified store (``ocache.tiers.store``, kind ``"h"``) like anchors and
    spills: the server saves to a temp name, the store fsyncs, hashes, checks the token header and
    commits (mode 0600, within the ``tiers.head.budget_gb`` budget, TTL ``disk_ttl_days``, listed by
    ``ocache cache ls``, deleted by ``clear``/``gc``), and every restore is verified first (size,
    xxh3, token header, identity); a failed check deletes the entry and the request goes cold.
    ``store``: None while no store is open (no ``--slot-save-path`` known, the store cannot open, or
    a budget of 0): heads are then kept warm by prefill only and nothing is saved.
    """

    name = "head"

    def __init__(self, table: SlotTable, store: Any = None) -> None:
        self.table = table
        self.store = store
        self.heads: dict[str, HeadRecord] = {}
        self._bg: set[asyncio.Task] = set()
        self.counters: dict[str, int] = {
            "saves": 0, "save_failed": 0, "skipped_budget": 0, "restores": 0, "verify_failed": 0,
            "restore_failed": 0, "restore_upstream_failed": 0,
        }

    def _entry(self, rec: HeadRecord) -> Any:
        if self.store is None or rec.entry is None:
            return None
        e = self.store.get(rec.entry)
        if e is None:
            rec.entry = None  # evicted, expired or cleared since
        return e

    async def lookup(self, view: Any, ctx: RequestContext) -> Offer | None:
        rec = self.heads.get(ctx.head_key or "")
        if rec is None or self._entry(rec) is None:
            return None
        n = len(rec.tokens)
        if len(view.tokens) <= n or view.tokens[:n] != rec.tokens:
            return None
        return Offer("head", n, rec.restore_s, ref=rec, verified=True)

    async def bring(self, offer: Offer, slot: int) -> None:
        await self.restore_into(slot, offer.ref)
        rec: HeadRecord = offer.ref
        self.table.mark_head(slot, rec.key, len(rec.tokens))

    async def restore_into(self, slot: int, rec: HeadRecord) -> None:
        """Verify the head's entry, then restore it into ``slot`` (the caller holds the slot's lease).
        Raises HeadTierError (see there for what is deleted and what is kept)."""
        from ocache.slots import file_refused
        from ocache.tiers.store import IntegrityError

        if self._entry(rec) is None:
            raise HeadTierError("gone", rec.key)
        t0 = time.monotonic()
        try:
            e = await asyncio.to_thread(self.store.verify, rec.entry, rec.tokens)
        except KeyError as exc:
            rec.entry = None
            raise HeadTierError("gone", rec.key) from exc
        except IntegrityError as exc:  # the store deleted the entry and logged it
            self.counters["verify_failed"] += 1
            rec.entry = None
            raise HeadTierError(exc.reason, str(exc)) from exc
        try:
            resp = await self.table.restore(slot, e.bin_name, tokens=rec.tokens, checkpoints=rec.checkpoints)
        except SlotError as exc:
            self.counters["restore_failed"] += 1
            if not file_refused(exc):
                self.counters["restore_upstream_failed"] += 1
                raise HeadTierError("upstream", str(exc)) from exc
            rec.entry = None
            await asyncio.to_thread(self.store.delete, e.key, f"server refused the restore: {exc}")
            raise HeadTierError("restore", str(exc)) from exc
        if int(resp.get("n_restored", -1)) != len(rec.tokens):
            self.counters["restore_failed"] += 1   # the table holds what restore found (unknown)
            rec.entry = None
            await asyncio.to_thread(self.store.delete, e.key, "restored token count differs")
            raise HeadTierError("restore", f"n_restored={resp.get('n_restored')} != {len(rec.tokens)}")
        rec.restore_s = time.monotonic() - t0
        rec.last_used = time.monotonic()
        self.counters["restores"] += 1
        await asyncio.to_thread(self.store.touch, e.key, True)

    async def save_from(self, slot: int, rec: HeadRecord, rid: str = "-") -> bool:
        """Save the head the locked ``slot`` holds exactly (``rec.tokens``) as a store entry: the
        budget first (room made for the estimated size, or refused: nothing is written), then the
        server's ``action=save`` to a temp name; hashing and the commit run in the background
        (:meth:`flush`). Returns True when the save call succeeded or the entry exists already.
        Raises SlotNotSupported (no ``--slot-save-path``); other failures are logged and counted."""
        from ocache.tiers.store import BudgetError, entry_key, reserve_async

        store = self.store
        if store is None or store.identity is None:
            return False
        key = entry_key(store.identity, HEAD_KIND, rec.tokens)
        if store.get(key) is not None:
            rec.entry = key
            e = store.get(key)
            rec.checkpoints = [Checkpoint(int(n)) for n in (e.meta.get("checkpoints") or [])] if e else []
            return True
        est = store.estimate_bytes(len(rec.tokens)) or 0
        try:
            await reserve_async(store, key, est, HEAD_KIND)
        except BudgetError as exc:
            self.counters["skipped_budget"] += 1
            log.info("[%s] no room for head %s (%d tokens): %s", rid, rec.key, len(rec.tokens), exc)
            return False
        tmp = store.temp_name(HEAD_KIND, key)
        try:
            saved = await self.table.save(slot, tmp)
        except BaseException as exc:
            store.release(key)
            store.discard_temp(tmp)
            if isinstance(exc, SlotError) and not isinstance(exc, SlotNotSupported):
                self.counters["save_failed"] += 1
                log.warning("[%s] saving head %s failed: %s", rid, rec.key, exc)
                return False
            raise
        if int(saved.get("n_saved", -1)) != len(rec.tokens):
            self.counters["save_failed"] += 1
            store.release(key)
            store.discard_temp(tmp)
            log.warning("[%s] head %s: slot %d saved %s tokens, expected %d; discarded", rid, rec.key,
                        slot, saved.get("n_saved"), len(rec.tokens))
            return False
        store.note_size(len(rec.tokens), int(saved.get("n_written", 0) or 0))  # the .bin's bytes
        n_ck = saved.get("n_checkpoints")  # patched build: checkpoints in the sidecar
        st = self.table[slot]
        cps = (list(st.checkpoints)[-int(n_ck):] if n_ck else []) if n_ck is not None else []
        task = asyncio.get_running_loop().create_task(self._commit(rec, key, tmp, cps, rid))
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)
        return True

    async def _commit(self, rec: HeadRecord, key: str, tmp: str, cps: list[Checkpoint], rid: str) -> None:
        try:
            e = await asyncio.to_thread(self.store.commit, HEAD_KIND, rec.tokens, tmp, fingerprint=rec.key,
                                        meta={"reason": "head", "checkpoints": [c.n_tokens for c in cps]})
        except Exception as exc:  # noqa: BLE001 - the head stays warm by prefill
            self.counters["save_failed"] += 1
            log.warning("[%s] commit of head %s failed: %s", rid, rec.key, exc)
            return
        if rec.tokens == self.heads.get(rec.key, rec).tokens:
            rec.entry, rec.checkpoints = e.key, cps
        self.counters["saves"] += 1

    async def flush(self) -> None:
        """Wait for background commits."""
        while self._bg:
            await asyncio.gather(*list(self._bg), return_exceptions=True)

    async def clear(self) -> int:
        """Forget every head and delete the head entries. Returns how many heads and entries."""
        await self.flush()
        n = len(self.heads)
        self.heads.clear()
        if self.store is not None:
            n += await asyncio.to_thread(self.store.clear, HEAD_KIND)
        return n

    async def admit(self, view: Any, slot: int, obs: Any) -> None:
        return None

    async def before_evict(self, slot: int) -> None:
        return None

    async def evict(self, bytes_needed: int) -> int:
        return 0

    def stats(self) -> dict:
        return {**self.counters, "heads": len(self.heads),
                "entries": len(self.store.entries(HEAD_KIND)) if self.store is not None else 0,
                "bytes": self.store.kind_bytes(HEAD_KIND) if self.store is not None else 0,
                "budget_bytes": self.store.kind_budgets.get(HEAD_KIND) if self.store is not None else None}


# ----------------------------------------------------------------------------------------------
# the layer


@dataclass
class PlanContext:
    """What ``plan`` hands to ``observe`` (through ``Plan.context``)."""

    request_id: str
    slot: int
    decision: Decision
    view: Any
    ctx: RequestContext
    seq: int
    n_prompt: int
    predicted: int
    upper: int
    checkpoints_before: list[Checkpoint]
    t_plan: float
    #: seconds the tier's ``bring`` (restore into the slot) took, None when nothing was restored
    restore_s: float | None = None
    #: tokens / ms ocache itself prefilled on the slot for this request (head warm-up, anchor split)
    split: int = 0
    split_ms: float = 0.0

    @property
    def reused(self) -> int:
        """Predicted tokens reused from *before* this request (``predicted`` counts the split too)."""
        return max(0, self.predicted - self.split)

    @property
    def prefilled(self) -> int:
        """Predicted tokens the server prefills for this request, ocache's own steps included."""
        return self.split + max(0, self.n_prompt - self.predicted)


@dataclass
class ServerPlaced:
    """What ``_plan_server_placed`` hands to ``observe``: the request, and the slot the server chose
    (None until ``release`` found it)."""

    request_id: str
    tokens: list[int]
    ctx: RequestContext
    slot: int | None = None
    seq: int = -1


def _source_tier(restored_from: str | None, origin: bool) -> str | None:
    """The tier that put a slot's content there before this request: the slot file it was restored
    from (``ocache-head-*``: the head tier; ``oc-a-*``: a disk anchor; ``oc-s-*``: a spilled
    session, ocache/tiers/store.py names), else ``head`` for an origin slot (the harness head kept
    warm), else None (a request left it: resident)."""
    name = restored_from or ""
    if name.startswith(("ocache-head-", "oc-h")):
        return "head"
    if name.startswith("oc-s-"):
        return "session"
    if name.startswith("oc-"):
        return "disk"
    return "head" if origin else None


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


def _mk_plan(**kw: Any) -> Any:
    from ocache.layer import Plan

    return Plan(**kw)


class OCacheLayer:
    """The ``CacheLayer`` the proxy loads (``ocache.layer``): resident routing, warm heads, and the
    disk/session tiers registered with ``add_tier``.

    ``upstream``: ``ocache.upstream.Upstream`` (``session``, ``base_url``, ``epoch``, ``props``,
    ``api_key``). ``config``: ``ocache.config.Config``; ``config.launch`` is the llama-server argv
    when ocache launched it, ``config.tiers["resident"]`` may override ``ServerParams`` fields
    (``n_ubatch``, ``checkpoints``, ...) and set ``server_args`` (the argv of a server ocache did not
    launch), ``warm`` (default true), ``keep_origin`` (default true), ``reconcile`` (default true:
    ``GET /slots`` before each plan).
    """

    def __init__(self, upstream: Any, config: Any = None, *, viewer: Any = None,
                 tiers: Sequence[Tier] = ()) -> None:
        self.upstream = upstream
        self.config = config
        tiers_cfg = dict((getattr(config, "tiers", None) or {}).get("resident") or {})
        self.opt_warm = bool(tiers_cfg.pop("warm", True))
        self.opt_keep_origin = bool(tiers_cfg.pop("keep_origin", True))
        self.opt_reconcile = bool(tiers_cfg.pop("reconcile", True))
        self.param_overrides = {k: v for k, v in tiers_cfg.items() if k in ServerParams.__dataclass_fields__}
        self.markers = getattr(config, "volatile_markers", None) or fp_mod.DEFAULT_MARKERS
        server_args = tiers_cfg.pop("server_args", None)
        self.argv = list(server_args or getattr(config, "launch", None) or []) or None
        self._viewer = viewer
        self.table: SlotTable | None = None
        self.head_tier: HeadTier | None = None
        self.tiers: list[Tier] = list(tiers)
        self._ready = False
        self._ready_lock = asyncio.Lock()
        self._bg: set[asyncio.Task] = set()
        self._maint_lock = asyncio.Lock()
        self._identity: Any = None
        self._epoch = getattr(upstream, "epoch", None)
        self.prefill_tps: float | None = None
        self.findings: list[Any] = []
        self.origin_key: str | None = None
        self._no_save = False
        self.disk_tier: Any = None
        self._disk_tier_off = False
        self.journal: Any = None
        try:
            from ocache.warm import journal_for

            self.journal = journal_for(config)
        except OSError as exc:
            log.warning("folder journal unavailable (%s): `ocache warm DIR` will not know folders", exc)
        self.counters: dict[str, int] = {
            "planned": 0, "plan_errors": 0, "observed": 0, "mispredictions": 0, "mispredict_low": 0,
            "mispredict_high": 0, "predicted_tokens": 0, "observed_cache_tokens": 0,
            "prompt_tokens": 0, "warmups": 0, "warmup_tokens": 0, "head_saves": 0, "head_restores": 0,
            "origin_rebuilds": 0, "origin_skipped": 0, "evictions": 0, "guest_on_agent_slot": 0, "client_pins_overridden": 0,
            "bring_failures": 0, "failed_responses": 0, "too_long": 0, "unrenderable": 0, "unpinnable": 0, "user_splits": 0,
            "split_tokens": 0, "reused_tokens": 0, "prefilled_tokens": 0, "replans": 0,
        }
        self.by_tier: dict[str, int] = {}
        self.recent_mispredictions: deque = deque(maxlen=20)

    # -- setup ---------------------------------------------------------------------------------

    def add_tier(self, tier: Tier) -> None:
        """Register a disk/session tier; the planner consults every registered tier."""
        self.tiers.append(tier)

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
                self.head_tier = HeadTier(self.table)
            self.table.session = self.session
            data = await self.table.fetch_slots()
            self.table.params = params_from_argv(self.argv, props, data, **self.param_overrides)
            if self._epoch is not None and epoch != self._epoch:
                self.table.reset_all(epoch)
            self.table.epoch = epoch
            await self.table.refresh()
            self._epoch = epoch
            self._identity = None
            self._sync_store_identity()       # before any tier reads the store (identities coexist)
            await self._session_tier_ready()  # session tier (tiers/spill.py): register; resume after a drain
            self._disk_tier_ready()           # disk tier (tiers/disk.py): anchors on disk
            self._head_store_ready()          # head files through the same verified store (tiers/store.py)
            self._ready = True
            try:
                from ocache.llama.checks import check, probe_endpoints

                metrics_ok, actions_ok = await probe_endpoints(self.session, self.base_url, self._headers())
                self.findings = check(self.table.params, props or {}, data, argv=self.argv,
                                      metrics_ok=metrics_ok, slot_actions_ok=actions_ok)
                self._no_save = actions_ok is False
                for f in self.findings:
                    if f.level != "ok":
                        log.warning("llama-server setup: %s", f)
            except Exception:  # the checks are advice; never block serving
                log.debug("setup checks failed", exc_info=True)

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

    def _sync_store_identity(self) -> None:
        """Tell the tiers' store the server's identity (re)computed from the fresh ``/props``: after a
        restart with another model or flags only that identity's entries are served, the others
        stay on disk (``Store.set_identity``); the session tier's resume marker is checked against
        it too."""
        stores = {id(s): s for s in (getattr(t, "store", None) for t in self.tiers)
                  if s is not None and hasattr(s, "set_identity")}
        if not stores:
            return
        key = getattr(self._ident(), "key", None)
        for store in stores.values():
            if key:
                store.set_identity(key)

    def _ident(self) -> Any:
        if self._identity is None:
            props = getattr(self.upstream, "props", None) or {}
            flags = llama_flags.state_flags(self.argv, props)
            path = props.get("model_path")
            try:
                gguf = llama_gguf.gguf_identity(path) if path else None
            except (OSError, ValueError):
                gguf = None
            self._identity = fp_mod.identity(gguf, props.get("build_info", ""),
                                             props.get("chat_template", ""), flags,
                                             props.get("chat_template_tool_use"))
        return self._identity

    # -- CacheLayer ------------------------------------------------------------------------------

    async def plan(self, req: Any) -> Any:
        await self._ensure_ready()
        table = self.table
        assert table is not None
        body = req.body or {}
        path = req.path
        if path in convert.CONVERTED_ROUTES:
            # /v1/messages, /v1/responses: planned exactly like a chat request, on the chat body the
            # server itself renders (ocache/api/convert.py)
            if path in convert.ANTHROPIC_ROUTES and not self._anthropic_pin_ok():
                self.counters["unpinnable"] += 1
                return _mk_plan(headers={"X-OCache-Tier": "none", "X-OCache-Kind": "other"})
            try:
                body = convert.to_chat(path, body)
            except convert.ConversionError as exc:
                self.counters["unrenderable"] += 1  # the server answers it with its own 400
                log.debug("[%s] %s not converted: %s", req.request_id, path, exc)
                return _mk_plan(headers={"X-OCache-Tier": "none", "X-OCache-Kind": "other"})
            path = "/v1/chat/completions"
        chat = path in CHAT_ROUTES
        if body.get("cache_prompt") is False:
            # the server reuses nothing for it (n_past stays 0 without cache_prompt,
            # tools/server/server-context.cpp:3350 of the pinned source): no plan to make; the server
            # places it, and GET /slots tells the table what it replaced
            self.counters["no_cache_prompt"] += 1
            return _mk_plan(headers={"X-OCache-Tier": "none", "X-OCache-Kind": "other"})
        kind = fp_mod.classify(body, self.markers) if chat else "other"
        head = fp_mod.harness_head(body, self.markers) if kind == "agent" else None
        # GET /slots runs while the view is built (neither needs the other): one round trip less
        # on the request's path
        refreshed = asyncio.ensure_future(self._refresh(req)) if self.opt_reconcile else None
        try:
            view = await self._viewer.view(path, body, head)
        except TokenViewError as exc:
            if refreshed is not None:
                await refreshed
            if 400 <= exc.status < 500:
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
        ctx = RequestContext(kind=kind, session=session, head_key=head_key, head_len=head_len,
                             task=table.next_task(), user_starts=user_starts,
                             labels=_labels(body, getattr(req, "headers", None), kind))
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
            pctx = await self._execute(req, view, ctx, dec)
        except BaseException:
            if executing and lease.held:
                # stopped part way through the slot's steps (a restore, a warm-up, a save): what the
                # slot holds is unknown until GET /slots says
                table.mark_unknown(lease.slot)
            lease.release()
            raise

        async def release() -> None:
            lease.release()

        self.counters["planned"] += 1
        self.counters["split_tokens"] += pctx.split
        self.by_tier[pctx.decision.tier] = self.by_tier.get(pctx.decision.tier, 0) + 1
        # headers are sent before the body, so Prefilled/Reused come from the plan
        # (what ocache prefilled itself, measured, plus the predicted reuse of the forwarded request)
        headers = {"X-OCache-Slot": str(dec.slot), "X-OCache-Predicted-Cache": str(pctx.reused),
                   "X-OCache-Tier": pctx.decision.tier, "X-OCache-Kind": kind,
                   "X-OCache-Split": str(pctx.split), "X-OCache-Prefilled": str(pctx.prefilled),
                   "X-OCache-Reused": str(pctx.reused)}
        if pctx.restore_s is not None:
            headers["X-OCache-Restore-Ms"] = f"{pctx.restore_s * 1e3:.1f}"
        return _mk_plan(body_updates={"id_slot": dec.slot}, headers=headers, context=pctx, release=release,
                        split_tokens=pctx.split, split_ms=pctx.split_ms)

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

    async def estimate(self, req: Any) -> "Estimate | None":
        """What this server could do for ``req`` if it were planned here, read-only: the router
        (``ocache/router.py``) asks every server's layer and picks one before calling its ``plan``.

        The same steps as ``plan`` up to the decision (token view, classify, head, every tier's
        ``lookup``, ``plan_request`` on ``SlotTable.snapshot()``), without the slot lock, the
        journal, counters or any table change. Returns None for a request ``plan`` would not pin
        (unrenderable, unconvertible, too long). Raises what ``_ensure_ready`` / the token view
        raise when the server cannot be asked (the router then skips it).
        """
        await self._ensure_ready()
        table = self.table
        body, path = req.body or {}, req.path
        if path in convert.CONVERTED_ROUTES:
            if path in convert.ANTHROPIC_ROUTES and not self._anthropic_pin_ok():
                return None
            try:
                body = convert.to_chat(path, body)
            except convert.ConversionError:
                return None
            path = "/v1/chat/completions"
        chat = path in CHAT_ROUTES
        kind = fp_mod.classify(body, self.markers) if chat else "other"
        head = fp_mod.harness_head(body, self.markers) if kind == "agent" else None
        try:
            view = await self._viewer.view(path, body, head)
        except TokenViewError as exc:
            if 400 <= exc.status < 500:
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
        dec = await self._decide(view, ctx)
        snap = table.snapshot()
        own = bool(session) and any(s.owner == session for s in snap)
        spills = getattr(self, "_session_tier", None)
        destroys = 0
        if dec.evicts and not (spills is not None and spills.will_spill(dec.slot)):
            destroys = len(snap[dec.slot].tokens)
        return Estimate(n_tokens=len(tokens), usable=dec.predicted, tier=dec.tier, slot=dec.slot,
                        busy=dec.choice.busy, destroys=destroys,
                        restore_s=dec.offer.cost_s if dec.offer else 0.0, kind=kind, own_session=own,
                        head_len=head_len, prefill_tps=self.prefill_tps, head_key=head_key,
                        warm="warm_head" in dec.steps, prefix_key=hash(tuple(tokens[:256])),
                        ubatch=table.params.n_ubatch)

    async def _refresh(self, req: Any) -> None:
        """Reconcile the slot table with ``GET /slots``; a failure only logs (the plan then uses
        the table as it is)."""
        try:
            await self.table.refresh()
        except SlotError as exc:
            log.debug("[%s] GET /slots failed: %s", req.request_id, exc)

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
                log.exception("tier %s lookup failed", getattr(tier, "name", tier))
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
            return ctx.head_key in self.head_tier.heads
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
        session = getattr(self, "_session_tier", None)
        spillable = frozenset(s.id for s in snap if session.will_spill(s.id)) if session else frozenset()
        dec = plan_request(view.tokens, snap, offers, ctx, table.params,
                           head_resident=head_resident, prefill_tps=self.prefill_tps,
                           forced_slot=forced_slot, can_spill=spillable, anchors=anchors)
        return dec, (snap[dec.slot].version, head_resident)

    async def _execute(self, req: Any, view: Any, ctx: RequestContext, dec: Decision) -> PlanContext:
        """Run ``dec.steps`` on the locked slot and record the slot's new content."""
        table = self.table
        slot = dec.slot
        tokens = view.tokens
        own0 = table.own_prefill.get(slot, (0, 0.0))     # ocache's own prefill (figures.py)
        source = _source_tier(table[slot].restored_from, table[slot].origin)
        brought: str | None = None
        if dec.evicts:
            self.counters["evictions"] += 1
            if "guest_on_agent_slot" in dec.warnings:
                self.counters["guest_on_agent_slot"] += 1
                log.warning("[%s] guest request on slot %d replaces an agent conversation (only %d slot(s); "
                            "the session tier protects it)", req.request_id, slot, len(table))
            for tier in self.tiers:
                try:
                    await tier.before_evict(slot)
                except Exception:
                    log.exception("[%s] tier %s before_evict(slot %d) failed", req.request_id,
                                  getattr(tier, "name", tier), slot)
        restore_s = None
        if "bring" in dec.steps and dec.offer is not None:
            tier = self.head_tier if dec.offer.tier == "head" else next(
                (t for t in self.tiers if t.name == dec.offer.tier), None)
            try:
                t_bring = time.monotonic()
                await tier.bring(dec.offer, slot)
                restore_s = time.monotonic() - t_bring
                brought = dec.offer.tier
                if dec.offer.tier == "head":
                    self.counters["head_restores"] += 1
            except Exception as exc:
                self.counters["bring_failures"] += 1
                # the slot holds what the failed restore left (SlotTable.restore asked the server:
                # erased by a stock build, untouched by the patched pre-check or a failed check)
                log.warning("[%s] %s bring into slot %d failed (%s); serving from what the slot holds",
                            req.request_id, dec.offer.tier, slot, exc)
        if "warm_head" in dec.steps:
            await self._warm_head_in(slot, tokens[:ctx.head_len], ctx.head_key, req.request_id)
            await self._split_at_first_user(slot, tokens, ctx, req.request_id)
        if "anchors" in dec.steps and self.disk_tier is not None:
            # admission (docs/decisions.md D2): split the coming prefill at the planned anchor lines
            # it passes cold and save them; the slot then holds the last anchor, which this request
            # strictly extends
            st = table[slot]
            before = predict_reuse(st.tokens, st.n_total, st.checkpoints, tokens, table.params,
                                   user_starts=ctx.user_starts, task=ctx.task)
            await self.disk_tier.write_anchors(view, slot, dec.anchors, before.cache_n, ctx)
        st = table[slot]
        reuse = predict_reuse(st.tokens, st.n_total, st.checkpoints, tokens, table.params,
                              user_starts=ctx.user_starts, task=ctx.task,
                              ram_swap=st.foreign or ram_swap_possible(st, common_prefix(st.tokens, tokens), len(tokens),
                                                               table.params))
        own1 = table.own_prefill.get(slot, (0, 0.0))
        split, split_ms = own1[0] - own0[0], own1[1] - own0[1]
        # the true source of the reused prefix: a restore in this request, else
        # what was in the slot before it (restored earlier, the kept head, or a request), else cold
        if brought is not None:
            tier_name = brought
        elif reuse.cache_n - split > 0:
            tier_name = source or "resident"
        else:
            tier_name = "cold"
        decision = replace(dec, predicted=reuse.cache_n, upper=reuse.upper, tier=tier_name)
        pctx = PlanContext(req.request_id, slot, decision, view, ctx, 0, len(tokens), reuse.cache_n,
                           reuse.upper, list(st.checkpoints), time.monotonic(), restore_s, split, split_ms)
        keep_head = st.head_key if (st.head_key == ctx.head_key) else None
        pctx.seq = table.assign(slot, tokens, checkpoints=reuse.checkpoints_after, user_starts=ctx.user_starts,
                                owner=ctx.session, kind=ctx.kind, labels=dict(ctx.labels),
                                head_key=ctx.head_key or keep_head,
                                head_len=ctx.head_len if ctx.head_key else 0)
        log.debug("[%s] slot %d %s kind=%s N=%d lcp=%d predicted=%d upper=%d reason=%s steps=%s",
                  req.request_id, slot, decision.tier, ctx.kind, len(tokens), reuse.lcp, reuse.cache_n,
                  reuse.upper, reuse.reason, ",".join(dec.steps))
        return pctx

    async def _bring_next(self, req: Any, view: Any, ctx: RequestContext, slot: int, tier: Any,
                          failed: Offer) -> tuple[str | None, float | None]:
        """After a failed bring (a damaged file is deleted by the store's check, a refused restore
        deletes its entry), ask the same tier once more: its next-best entry (a shorter anchor) is
        still worth more than a cold prefill. Returns ``(tier name, restore seconds)`` or
        ``(None, None)`` when nothing was brought (the request is then served cold)."""
        try:
            offer = await tier.lookup(view, ctx)
        except Exception:
            log.exception("[%s] tier %s lookup after a failed bring failed", req.request_id, failed.tier)
            return None, None
        if offer is None or offer.ref == failed.ref or (offer.slot is not None and offer.slot != slot) \
                or offer.tokens_usable < self.table.params.n_ubatch:
            log.warning("[%s] serving cold", req.request_id)
            return None, None
        try:
            t = time.monotonic()
            await tier.bring(offer, slot)
        except Exception as exc:
            self.counters["bring_failures"] += 1
            log.warning("[%s] %s bring of the next entry into slot %d failed too (%s); serving cold",
                        req.request_id, offer.tier, slot, exc)
            self.table[slot].clear()
            return None, None
        self.counters["bring_retries"] += 1
        log.info("[%s] %s: the next entry (%d tokens) restored instead", req.request_id, offer.tier,
                 offer.tokens_usable)
        return offer.tier, time.monotonic() - t

    async def _split_at_first_user(self, slot: int, tokens: list[int], ctx: RequestContext, rid: str) -> None:
        """After a head warm-up in ``slot``, prefill on to the first user message after the head
        (``tokens[:u]``, no generation) when the model resumes only at checkpoints.

        Why: llama-server takes a checkpoint at the first user message of a prompt only while the
        slot holds none (tools/server/server-context.cpp:3530-3537 of the pinned source); the
        warm-up left some at the head's end, so without this split the request would keep none
        between the head and ``len - 4 - ubatch``, and a later session that shares more than the
        head (Codex in another folder: up to its AGENTS.md item) would fall back to the head. The
        split's own prompt end gets the server's near-end checkpoints (``u - 4 - ubatch``,
        ``u - 4``). It prefills nothing extra (those tokens are the request's own) and costs one
        round trip; it is skipped on dense models, within one ubatch of the head, or when the
        user message starts in the prompt's last 4 tokens. A failure is logged and the request goes on from whatever the slot holds."""
        table = self.table
        ub = table.params.n_ubatch
        if not table.params.checkpoints or not ctx.head_len:
            return
        u = next((u for u in ctx.user_starts if u > ctx.head_len), None)
        if u is None or u - ctx.head_len < ub or len(tokens) - u <= 4:
            return
        try:
            await table.warm(slot, tokens[:u])
            self.counters["user_splits"] += 1
        except SlotError as exc:
            log.warning("[%s] split at the first user message (token %d) in slot %d failed: %s",
                        rid, u, slot, exc)

    async def _warm_head_in(self, slot: int, head_tokens: list[int], key: str | None, rid: str = "-") -> dict:
        """Prefill ``head_tokens`` into the locked ``slot`` and save them to a head file if the server
        can (``--slot-save-path``). Records the head in the head tier."""
        table = self.table
        t = await table.warm(slot, head_tokens)
        self.counters["warmups"] += 1
        self.counters["warmup_tokens"] += int(t.get("prompt_n") or 0)
        table.mark_origin(slot, key, len(head_tokens))
        if key is None:
            return t
        rec = self.head_tier.heads.get(key) or HeadRecord(key, list(head_tokens))
        rec.tokens = list(head_tokens)
        rec.last_used = time.monotonic()
        self.head_tier.heads[key] = rec
        self.origin_key = key
        if rec.entry is None and not self._no_save and self.head_tier.store is not None:
            try:
                if await self.head_tier.save_from(slot, rec, rid):
                    self.counters["head_saves"] += 1
            except SlotNotSupported:
                self._no_save = True
                log.info("[%s] no --slot-save-path: heads are kept warm by prefill only", rid)
        return t

    async def observe(self, req: Any, plan: Any, obs: Any) -> None:
        pctx: PlanContext | None = getattr(plan, "context", None)
        if isinstance(pctx, ServerPlaced):
            self._observe_placed(pctx, obs)
            return
        if not isinstance(pctx, PlanContext):
            return
        table = self.table
        mine = table[pctx.slot].seq == pctx.seq
        timings = obs.timings or {}
        # the final timings arrived: the server finished, even if the client then closed the
        # stream before its last bytes (Codex CLI closes as soon as it has response.completed)
        ok = obs.status == 200 and (obs.completed or ("cache_n" in timings and req.path in
                                                      convert.CONVERTED_ROUTES)) and "cache_n" in timings
        if not ok:
            self.counters["failed_responses"] += 1
            if mine and not table.lock(pctx.slot).locked():
                if obs.status == 200:
                    # started but cut short (client gone, upstream error mid-stream): the slot holds
                    # the prompt if its prefill finished; GET /slots tells before the next plan
                    table.interrupted(pctx.slot, pctx.seq)
                else:
                    table.mark_unknown(pctx.slot)  # rejected: content unknown until reconciled
            return
        self.counters["observed"] += 1
        cache_n = int(timings["cache_n"])
        prompt_n = int(timings.get("prompt_n") or 0)
        ub = table.params.n_ubatch
        self.counters["predicted_tokens"] += pctx.predicted
        self.counters["observed_cache_tokens"] += cache_n   # the server's, split included (vs predicted)
        self.counters["prompt_tokens"] += pctx.n_prompt
        # what the client was told (figures.py): reuse from before the request, all prefill
        self.counters["reused_tokens"] += max(0, cache_n - pctx.split)
        self.counters["prefilled_tokens"] += prompt_n + pctx.split
        low = cache_n < pctx.predicted - ub
        high = cache_n > pctx.upper + ub
        if low or high:
            self.counters["mispredictions"] += 1
            self.counters["mispredict_low" if low else "mispredict_high"] += 1
            d = pctx.decision
            rec = {"request_id": pctx.request_id, "slot": pctx.slot, "n_prompt": pctx.n_prompt,
                   "predicted": pctx.predicted, "upper": pctx.upper, "observed": cache_n,
                   "reason": d.choice.reuse.reason, "tier": d.tier, "kind": pctx.ctx.kind}
            self.recent_mispredictions.append(rec)
            log.warning("[%s] cache_n misprediction on slot %d: predicted %d (upper %d), observed %d, "
                        "prompt %d tokens (%s)", pctx.request_id, pctx.slot, pctx.predicted, pctx.upper,
                        cache_n, pctx.n_prompt, d.choice.reuse.reason)
        # the prefill rate (tokens/s): from every prefill long enough to be dominated by its tokens,
        # the forwarded request's and ocache's own steps alike (a cold request is mostly a split:
        # measured 1,060 tok/s from a 94-token tail where the 7,251-token cold prefill ran at 7,526)
        for n, ms in ((prompt_n, timings.get("prompt_ms")), (pctx.split, pctx.split_ms)):
            if n >= PREFILL_RATE_MIN_TOKENS and ms:
                tps = n / (float(ms) / 1000.0)
                self.prefill_tps = tps if self.prefill_tps is None else 0.8 * self.prefill_tps + 0.2 * tps
        if mine:
            gen = int(timings.get("predicted_n") or 0)
            corrected = None
            if cache_n != pctx.predicted and table.params.checkpoints:
                kept = [c for c in pctx.checkpoints_before if c.n_tokens - 1 <= cache_n + 1]
                corrected = simulate_prefill(kept, cache_n, pctx.n_prompt, pctx.ctx.user_starts,
                                             table.params, pctx.ctx.task)
            table.finish(pctx.slot, pctx.seq, pctx.n_prompt + max(gen, 1) - 1, corrected)
        for tier in self.tiers:
            try:
                await tier.admit(pctx.view, pctx.slot, obs)
            except Exception:
                log.exception("[%s] tier %s admit failed", pctx.request_id, getattr(tier, "name", tier))
        self._spawn(self._maintain_origin())

    def _observe_placed(self, placed: "ServerPlaced", obs: Any) -> None:
        """The checkpoints a server-placed request's prefill made (hybrid models), from its
        ``cache_n``; those the slot had before are not known and not counted on."""
        table = self.table
        cache_n = (obs.timings or {}).get("cache_n")
        if placed.slot is None or cache_n is None or not table.params.checkpoints:
            return
        st = table[placed.slot]
        if st.seq == placed.seq:
            st.checkpoints = simulate_prefill([], int(cache_n), len(placed.tokens), placed.ctx.user_starts,
                                              table.params, placed.ctx.task)

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
            if tier is not None and hasattr(tier, "flush"):
                await tier.flush()

    async def _maintain_origin(self) -> None:
        """With ``-np >= 2``: keep the most recent harness head warm in one *empty* idle slot, by
        restoring its saved head file.

        Never over another state (a title request's slot holds what the next title reuses: the
        server alone keeps it; measured 541 tokens (tests/test_e2e_clients.py, everyday day)
        prefilled per title when ocache overwrote it) and never by prefilling the head again (that
        is prefill the server alone would not do). A slot without the head gets it restored on
        demand from the same file (``HeadTier``). Skips are counted in ``origin_skipped``.
        """
        table = self.table
        if not self.opt_keep_origin or self.origin_key is None or len(table) < 2:
            return
        async with self._maint_lock:
            rec = self.head_tier.heads.get(self.origin_key)
            if rec is None:
                return
            snap = table.snapshot()
            if any(s.busy for s in snap):
                return  # only when the server is idle
            if any(s.origin and s.head_key == rec.key for s in snap):
                return
            free = [s for s in snap if not s.busy and not s.tokens and not s.foreign
                    and not s.n_total and not s.origin]
            if not free or self.head_tier._entry(rec) is None:
                self.counters["origin_skipped"] += 1
                return
            target = min(free, key=lambda s: s.last_used)
            lock = table.lock(target.id)
            if lock.locked():
                return
            async with lock:
                try:
                    await self.head_tier.restore_into(target.id, rec)   # verified first
                    self.counters["head_restores"] += 1
                except (HeadTierError, SlotError) as exc:
                    log.warning("re-establishing head %s in slot %d failed: %s", rec.key, target.id, exc)
                    return
                table.mark_origin(target.id, rec.key, len(rec.tokens), last_used=0.0)
                self.counters["origin_rebuilds"] += 1
                log.info("head %s re-established in slot %d (%d tokens)", rec.key, target.id, len(rec.tokens))

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
            t = await self._warm_head_in(dec.slot, head_tokens, key)
        return {"slot": dec.slot, "head_key": key, "head_tokens": len(head_tokens),
                "prompt_n": t.get("prompt_n"), "cache_n": t.get("cache_n")}

    # -- session tier hooks (ocache/tiers/spill.py) ------------------------------------------------

    async def _session_tier_ready(self) -> None:
        """Register the session tier once (when the server can save slots), then restore the
        conversation a drained stop left for this start, before any request is planned (the caller
        holds the ready lock, so requests wait: a restore never races a prefill)."""
        if getattr(self, "_session_tier", None) is None and not getattr(self, "_session_tier_off", False):
            from ocache.tiers.spill import make_session_tier

            try:
                tier = make_session_tier(self.config, self.table, self._ident())
            except Exception:
                log.exception("session tier setup failed; it stays off")
                tier = None
            self._session_tier = tier
            self._session_tier_off = tier is None
            if tier is not None:
                self.add_tier(tier)
        if getattr(self, "_session_tier", None) is not None:
            await self._session_tier.after_start()

    def _disk_tier_ready(self) -> None:
        """Register the disk tier once, when the server can save slots and its slot-save-path is
        known (config ``tiers.disk.slot_save_path`` or the launch argv; ocache/tiers/disk.py)."""
        if self.disk_tier is not None or self._disk_tier_off:
            return
        from ocache.tiers.disk import make_disk_tier

        try:
            tier = None if self._no_save else make_disk_tier(self.config, self.table, self._ident,
                                                             ubatch=self.table.params.n_ubatch)
        except Exception:
            log.exception("disk tier setup failed; it stays off")
            tier = None
        self._disk_tier_off = tier is None
        if tier is not None:
            self.disk_tier = tier
            self.add_tier(tier)

    def _head_store_ready(self) -> None:
        """Open the store for the head tier's files once (kind ``"h"``; budget ``tiers.head.budget_gb``,
        default 10 GB; TTL ``disk_ttl_days``), where the server's ``--slot-save-path`` is known. Off
        (heads kept warm by prefill only, nothing saved) without it, with a budget of 0, or when the
        store cannot be opened. Files of the unverified head tier of earlier versions
        (``ocache-head-*.bin``) are removed once."""
        ht = self.head_tier
        if ht is not None and ht.store is not None:
            key = getattr(self._ident(), "key", None)
            if key and key != ht.store.identity:  # the server came back with another identity
                ht.store.set_identity(key)
            return
        if ht is None or getattr(self, "_head_store_off", False):
            return
        self._head_store_off = True
        from ocache.config import field_of, slot_save_path
        from ocache.tiers.disk import store_meta_dir
        from ocache.tiers.store import StoreError, shared_store

        tiers = field_of(self.config, "tiers") or {}
        hcfg = dict(tiers.get("head") or {}) if isinstance(tiers, dict) else {}
        budget = int(float(hcfg.get("budget_gb", 10.0)) * 1e9)
        data_dir = slot_save_path(self.config, getattr(self.table, "params", None))
        key = getattr(self._ident(), "key", None)
        if data_dir is None or not key or budget <= 0:
            log.info("head files off (%s): heads are kept warm by prefill only",
                     "no --slot-save-path known" if data_dir is None else "no identity" if not key
                     else "tiers.head.budget_gb is 0")
            return
        try:
            store = shared_store(store_meta_dir(self.config), data_dir, key, kind=HEAD_KIND,
                                 kind_budget_bytes=budget,
                                 ttl_s=float(field_of(self.config, "disk_ttl_days", 7.0)) * 86400.0)
        except (StoreError, OSError) as exc:
            log.warning("head files off: the store cannot be opened (%s); heads are kept warm by "
                        "prefill only", exc)
            return
        for p in data_dir.glob("ocache-head-*.bin*"):
            with contextlib.suppress(OSError):
                p.unlink()
                log.info("removed unverified head file %s of an earlier version", p.name)
        ht.store = store
        self._head_store_off = False

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
                        log.exception("tier %s before_evict(slot %d) for a warm-up failed",
                                      getattr(tier, "name", tier), slot)

        return WarmDeps(journal=self.journal, viewer=self._viewer, tier=self.disk_tier,
                        slots=self.table, pick_slot=pick_slot, prepare_slot=prepare_slot)

    async def on_upstream_restart(self) -> None:
        if self.table is not None:
            self.table.reset_all(getattr(self.upstream, "epoch", None))
        self._ready = False
        self._identity = None
        for tier in self.tiers:  # tiers forget per-slot beliefs about the old process
            if hasattr(tier, "on_upstream_restart"):
                try:
                    await tier.on_upstream_restart()
                except Exception:
                    log.exception("tier %s on_upstream_restart failed", getattr(tier, "name", tier))

    async def drain(self) -> None:
        """Planned stop: finish background work, then tell every tier each live conversation is about
        to be lost (the session tier spills there)."""
        await self.idle()
        if self.table is None:
            return
        # a tier with its own drain step (the session tier) spills there, once per conversation:
        # calling its before_evict too would write every long conversation twice
        evict_tiers = [t for t in self.tiers if not hasattr(t, "on_drain")]
        for st in self.table.slots:
            if st.tokens and st.kind in ("agent", "other") and evict_tiers:
                async with self.table.lock(st.id):
                    for tier in evict_tiers:
                        try:
                            await tier.before_evict(st.id)
                        except Exception:
                            log.exception("tier %s before_evict(slot %d) on drain failed",
                                          getattr(tier, "name", tier), st.id)
        for tier in self.tiers:  # the session tier spills the rest, commits, writes its resume marker
            if hasattr(tier, "on_drain"):
                try:
                    await tier.on_drain()
                except Exception:
                    log.exception("tier %s on_drain failed", getattr(tier, "name", tier))

    def stats(self) -> dict:
        table = self.table
        out: dict[str, Any] = {"layer": "ocache", **self.counters, "by_tier": dict(self.by_tier),
                               "prefill_tokens_per_s": self.prefill_tps,
                               "recent_mispredictions": list(self.recent_mispredictions),
                               "setup_warnings": [str(f) for f in self.findings if f.level != "ok"]}
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
        """``resident`` (or ``all``): erase every slot ocache knows; ``head``: forget warmed heads;
        ``disk``/``session``: delete that tier's store entries. Returns ``{"tier", "cleared"}``."""
        known = {"resident", "head", "all", *(t.name for t in self.tiers)}
        if tier not in known:
            raise ValueError(f"unknown tier {tier!r}; one of {sorted(known)}")
        cleared = 0
        if tier in ("resident", "all") and self.table is not None:
            for st in self.table.slots:
                async with self.table.lock(st.id):
                    try:
                        await self.table.erase(st.id)
                    except SlotNotSupported:
                        self.table.mark_unknown(st.id, st.n_total)   # no --slot-save-path: the server keeps it
                        continue
                    cleared += 1
        if tier in ("head", "all") and self.head_tier is not None:
            cleared += await self.head_tier.clear()   # and the head files (store kind "h")
            self.origin_key = None
        for t in self.tiers:  # disk anchors, spilled sessions (their own store entries)
            if tier in (t.name, "all") and hasattr(t, "clear"):
                cleared += int((await t.clear()).get("deleted", 0))
        return {"tier": tier, "cleared": cleared}
