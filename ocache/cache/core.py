"""The planning core every route shares: the lookup phase, the pure decision on a table snapshot,
the request's context on this server, and the headers of a planned request.

Each function takes the layer (``OCacheLayer``, ready: its slot table and head tier exist) and
reads its table and tiers; none changes a slot (the routes do, through the lease and
``execute``).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from ocache.cache.execute import PlanContext
from ocache.cache.plan import Decision, plan_request
from ocache.cache.prepare import Prepared, memo_of
from ocache.api.figures import Figures
from ocache.layer import ParsedRequest, Plan
from ocache.tiers.base import Offer, RequestContext

if TYPE_CHECKING:
    from ocache.cache.ports import PlanningServices

log = logging.getLogger("ocache.cache")

#: seconds after which a plan reconciles the table with ``GET /slots`` even when it vouches for
#: every slot: a restart the upstream's probe (every 2 s, ``ocache.upstream``) has not seen yet shows
#: there (``SlotTable._restarted``), and so does use of the server beside ocache. 0: every plan
#: reads it (concurrently with the token view). Measured with 2.0 (``ocache bench --preset tiny``,
#: restart_mid_session): a turn sent right after a restart was planned on the old table and
#: prefilled 14,795 tokens where the server alone prefilled 14,687 (rule 2 broken); with 0 the
#: restart is seen and the session comes back from disk (about half). The per-plan read cost no
#: measurable latency (scripts/bench-proxy: 1-token chat +2.5 ms p50 either way).
RECONCILE_MAX_AGE_S = 0.0

#: ``Decision`` inputs of a plan that can change while it waits for a slot's lease: the slot's
#: write counter and whether the request's head is known (:func:`inputs`)
Inputs = tuple[int, bool]


@dataclass(frozen=True)
class Lookups:
    """The lookup phase's answers for one request on one server: ``offers`` (every tier's
    ``lookup``, the head tier first; None where a tier offers nothing) and ``anchors`` (the disk
    tier's anchor lines ``((length in tokens, reason), ...)``, None without a disk tier), with what
    they were read against: the prepared request, the table's epoch and every slot's write counter
    (``SlotTable.version``)."""

    offers: tuple[Offer | None, ...]
    anchors: tuple[tuple[int, str], ...] | None
    prepared: Prepared
    epoch: Any
    versions: tuple[int, ...]


def unplanned(tier: str, kind: str) -> Plan:
    """The plan of a request forwarded as it is (no slot pinned): ``X-OCache-Tier`` ``tier``."""
    return Plan(figures=Figures(tier=tier, kind=kind))


def _versions(layer: PlanningServices) -> tuple[int, ...]:
    table = layer.ready_table
    return tuple(table.version(i) for i in range(len(table)))


def stale(layer: PlanningServices, found: Lookups) -> bool:
    """Whether ``found`` may no longer be what the tiers answer: the epoch changed or a slot was
    written since it was read (a request's steps ran there: a spill of the conversation it evicted,
    an anchor split, a restore; the session tier's entry of an evicted conversation is committed by
    the request that evicts it, ``SessionTier.before_evict``)."""
    return found.epoch != layer.ready_table.epoch or found.versions != _versions(layer)


async def look_up(layer: PlanningServices, prep: Prepared, ctx: RequestContext) -> Lookups:
    """Ask every tier once (head tier first) and the disk tier's anchor lines. A tier whose lookup
    raises offers nothing (logged)."""
    offers: list[Offer | None] = []
    for tier in (layer.ready_head, *layer.tiers):
        try:
            offers.append(await tier.lookup(prep.view, ctx))
        except Exception:
            log.exception("tier %s lookup failed", tier.name)
    anchors = None
    if layer.disk_tier is not None:
        try:
            anchors = tuple(layer.disk_tier.anchor_lines(prep.view))
        except Exception:
            log.exception("disk tier anchor lines failed")
            anchors = ()
    return Lookups(tuple(offers), anchors, prep, layer.ready_table.epoch, _versions(layer))


def _key(layer: PlanningServices) -> tuple[str, int]:
    return ("lookups", id(layer))


def keep(layer: PlanningServices, req: ParsedRequest, found: Lookups) -> None:
    """Keep ``found`` (the router's estimate on this server) for this server's plan of ``req``."""
    memo_of(req)[_key(layer)] = found


async def lookups(layer: PlanningServices, req: ParsedRequest, prep: Prepared, ctx: RequestContext) -> Lookups:
    """The lookup phase of ``req`` on this server, once per request: the answers the router's
    estimate got here (:func:`keep`; spent once), while they were read for this prepared request,
    on this epoch, with no slot written since; else asked now."""
    kept = memo_of(req).pop(_key(layer), None)
    if (isinstance(kept, Lookups) and kept.prepared is prep and kept.epoch == layer.ready_table.epoch
            and kept.versions == _versions(layer)):
        return kept
    return await look_up(layer, prep, ctx)


def head_resident(layer: PlanningServices, ctx: RequestContext) -> bool:
    """Whether the request's head needs no warm-up: some slot or the head tier has it, or the
    request has none, or warm-ups are off (``tiers.resident.warm``)."""
    if ctx.head_key and layer.opt_warm:
        return layer.ready_head.knows(ctx.head_key)
    return True


def inputs(layer: PlanningServices, slot: int, ctx: RequestContext) -> Inputs:
    """What a plan read that can change while the request waits for ``slot``'s lease: the slot's
    write counter and whether the request's head is known."""
    return (layer.ready_table.version(slot), head_resident(layer, ctx))


def decide(layer: PlanningServices, tokens: Sequence[int], ctx: RequestContext, offers: Sequence[Offer | None],
           anchors: Sequence[tuple[int, str]] | None, forced_slot: int | None = None,
           held: int | None = None) -> tuple[Decision, Inputs]:
    """``plan_request`` on a snapshot of the table with the lookup phase's answers (pure but for
    reading the table). ``held``: the slot whose lease this request holds (not busy for its own
    plan). Returns the decision and :func:`inputs` of its slot as read for it."""
    table = layer.ready_table
    resident = head_resident(layer, ctx)
    snap = table.snapshot(held=held)
    # the slots whose conversation a tier saves before it is evicted (the session tier)
    spillable = frozenset(s.id for s in snap if any(t.will_spill(s.id) for t in layer.tiers))
    dec = plan_request(tokens, snap, offers, ctx, table.params, head_resident=resident,
                       prefill_tps=layer.prefill_tps, forced_slot=forced_slot, can_spill=spillable,
                       anchors=anchors)
    return dec, (snap[dec.slot].version, resident)


async def context(layer: PlanningServices, req: ParsedRequest, prep: Prepared) -> RequestContext:
    """The request's context on this server (a new task id of its table), for a plan: counts a
    client's own ``id_slot`` (overridden) and notes an agent request in the folder journal."""
    if "id_slot" in (req.body or {}):
        layer.counters["client_pins_overridden"] += 1
    if prep.kind == "agent" and layer.journal is not None:
        try:
            await asyncio.to_thread(layer.journal.note, prep.shape.body, prep.ctx.head_key)
        except OSError as exc:
            log.warning("[%s] folder journal not written: %s", req.request_id, exc)
    return prep.context(layer.ready_table.next_task())


def planned(layer: PlanningServices, pctx: PlanContext, kind: str) -> Figures:
    """Count a planned request and return its figures (``X-OCache-*`` headers). They are sent
    before the body, so Prefilled/Reused come from the plan (what ocache prefilled itself,
    measured, plus the predicted reuse of the forwarded request)."""
    layer.counters["planned"] += 1
    layer.counters["split_tokens"] += pctx.split
    layer.by_tier[pctx.decision.tier] = layer.by_tier.get(pctx.decision.tier, 0) + 1
    return Figures(tier=pctx.decision.tier, kind=kind, slot=pctx.slot, predicted_cache=pctx.reused,
                   split=pctx.split, prefilled=pctx.prefilled, reused=pctx.reused,
                   restore_ms=None if pctx.restore_s is None else float(f"{pctx.restore_s * 1e3:.1f}"))
