"""The usual route: the planner chooses the slot and the steps, ocache leases that slot, runs the
steps (``execute``) and pins the forwarded request there (``id_slot``).

Every tier is asked once before the plan (``core.lookups``: the router's estimate's answers when it
asked them on this server). A plan made again after a wait (for the chosen slot's lease) asks them
again when a slot was written meanwhile (``core.stale``): the request that held the slot may have
spilled this request's own conversation, which the lookups before the wait could not offer (a
burst of three conversations' next turns on ``-np 2``: one came back from another session's shared
anchor, prefilling 2,526 tokens where its own spill left 26).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

from ocache.cache import core
from ocache.cache.execute import execute
from ocache.cache.plan import Decision
from ocache.cache.prepare import Prepared
from ocache.layer import ParsedRequest, Plan
from ocache.slots import SlotLease
from ocache.tiers.base import RequestContext
from ocache.tiers.resident import rank_slots

if TYPE_CHECKING:
    from ocache.cache.ports import PlanningServices

log = logging.getLogger("ocache.cache")

#: times a plan moves to another slot when the one it waited for changed meanwhile
REPLANS_MAX = 3
#: seconds a plan waits for a busy slot's lease while another slot is idle; then it takes the best
#: idle slot (a busy slot is held by a request in flight: a whole generation: tests/test_waits.py). A
#: turn finding its own slot still being released (its previous answer just relayed) waits less
LEASE_WAIT_S = 5.0


async def _relook(layer: PlanningServices, prep: Prepared, ctx: RequestContext, lk: core.Lookups) -> core.Lookups:
    """``lk``, or the tiers' answers asked again when a slot was written since ``lk`` was read."""
    if not core.stale(layer, lk):
        return lk
    log.debug("slots written while waiting: asking the tiers again")
    return await core.look_up(layer, prep, ctx)


async def _lease(layer: PlanningServices, prep: Prepared, ctx: RequestContext, lk: core.Lookups,
                 dec: Decision, seen: tuple[int, bool]
                 ) -> tuple[Decision, tuple[int, bool], SlotLease, core.Lookups]:
    """The lease of ``dec``'s slot. While it is busy, waited for ``LEASE_WAIT_S`` at a time; when it
    is still busy and another slot is idle by then, the decision for the best idle slot instead (the
    ranking's order, the tiers asked again when a slot was written meanwhile) and its lease. Returns
    the decision, its inputs, the lease and the lookups the decision was made with."""
    table = layer.ready_table
    while True:
        if not table.snapshot()[dec.slot].busy:
            return dec, seen, await table.lease(dec.slot), lk
        try:
            return dec, seen, await table.lease(dec.slot, LEASE_WAIT_S), lk
        except TimeoutError:
            snap = table.snapshot()
            idle = [c.slot for c in rank_slots(prep.tokens, snap, ctx, table.params) if not c.busy]
            if not idle:
                continue
            layer.counters["replans"] += 1
            log.info("slot %d still busy after %g s: planning on idle slot %d", dec.slot, LEASE_WAIT_S,
                     idle[0])
            lk = await _relook(layer, prep, ctx, lk)
            dec, seen = core.decide(layer, prep.tokens, ctx, lk.offers, lk.anchors, forced_slot=idle[0])


async def _lease_settled(layer: PlanningServices, prep: Prepared, ctx: RequestContext,
                         lk: core.Lookups) -> tuple[Decision, SlotLease]:
    """Decide, lease the chosen slot, and plan again while a slot changed during the wait for its
    lease (another request used it): the tiers are asked again (``_relook``: what that request
    spilled or saved is offered) and the plan moves to a better idle slot rather than evict a
    conversation, at most ``REPLANS_MAX`` times, then keeps the slot held. Returns the final
    decision and the lease of its slot; a cancellation or error releases what it holds."""
    table = layer.ready_table
    dec, seen = core.decide(layer, prep.tokens, ctx, lk.offers, lk.anchors)
    dec, seen, lease, lk = await _lease(layer, prep, ctx, lk, dec, seen)
    try:
        for attempt in range(REPLANS_MAX):
            if seen == core.inputs(layer, dec.slot, ctx) and not core.stale(layer, lk):
                break  # nothing the plan read changed while we waited
            layer.counters["replans"] += 1
            lk = await _relook(layer, prep, ctx, lk)
            fresh, fresh_seen = core.decide(layer, prep.tokens, ctx, lk.offers, lk.anchors, held=dec.slot)
            if fresh.slot == dec.slot or fresh.choice.busy or attempt == REPLANS_MAX - 1:
                if fresh.slot == dec.slot:
                    dec = fresh
                else:
                    dec, _ = core.decide(layer, prep.tokens, ctx, lk.offers, lk.anchors,
                                         forced_slot=dec.slot, held=dec.slot)
                break
            lease.release()
            dec, seen = fresh, fresh_seen
            lease = await table.lease(dec.slot)
    except BaseException:
        lease.release()
        raise
    return dec, lease


async def plan(layer: PlanningServices, req: ParsedRequest, prep: Prepared, ctx: RequestContext,
               accept: Callable[[Decision], bool] | None = None) -> Plan | None:
    """Plan ``req`` the usual way (see the module docstring). The slot's lease is released on every
    path out of here but the success one, which hands it to the plan's ``release``: an exception or
    a cancellation (the client went away) at any await never leaves the slot locked; stopped part
    way through the slot's steps (a restore, a warm-up, a save), the slot's content is unknown until
    ``GET /slots`` says. ``accept``: a caller's condition on the final decision (the aligned route
    planning a spilled conversation's prompt: it must be brought back whole); None when it does not
    hold, before any step ran. Raises what a step raises."""
    table = layer.ready_table
    lk = await core.lookups(layer, req, prep, ctx)
    dec, lease = await _lease_settled(layer, prep, ctx, lk)
    if accept is not None and not accept(dec):
        lease.release()
        return None
    try:
        pctx = await execute(table, layer.ready_head, layer.tiers, layer.disk_tier, layer.counters,
                             req.request_id, prep.view, ctx, dec)
    except BaseException:
        if lease.held:
            table.mark_unknown(lease.slot)
        lease.release()
        raise

    async def release() -> None:
        lease.release()

    return Plan(body_updates={"id_slot": dec.slot}, figures=core.planned(layer, pctx, prep.kind),
                context=pctx, release=release, split_tokens=pctx.split, split_ms=pctx.split_ms)
