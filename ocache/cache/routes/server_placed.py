"""The server-placed route: forward without ``id_slot`` and let llama-server choose the slot by its
own prompt similarity, when the resident ranking says it chooses at least as well
(``ocache.tiers.resident.server_should_choose``).

ocache holds every slot's lease meanwhile (taken in slot order, so two such requests never
deadlock), so that no other request runs and the one slot whose ``id_task`` grows is the server's
choice; ``release`` records what it now holds (``SlotTable.learn_placement``) before letting the
leases go, and ``observe`` predicts the checkpoints its prefill made
(``Observer.observe_placed``). The answer's figures are the server's own (nothing was split).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ocache.cache.execute import ServerPlaced
from ocache.cache.prepare import Prepared
from ocache.layer import ParsedRequest, Plan
from ocache.slots import SlotError, SlotLease
from ocache.tiers.base import RequestContext
from ocache.tiers.resident import rank_slots, server_should_choose

if TYPE_CHECKING:
    from ocache.cache.orchestrator import OCacheLayer

log = logging.getLogger("ocache.cache")


def chooses(layer: OCacheLayer, prep: Prepared, ctx: RequestContext) -> bool:
    """``server_should_choose`` on the current table."""
    table = layer.ready_table
    snap = table.snapshot()
    return server_should_choose(rank_slots(prep.tokens, snap, ctx, table.params), snap)


async def plan(layer: OCacheLayer, req: ParsedRequest, prep: Prepared, ctx: RequestContext) -> Plan | None:
    """The server-placed plan of ``req`` (see the module docstring), or None when the planner
    chooses better. Raises what ``GET /slots`` raises (every lease released)."""
    if not chooses(layer, prep, ctx):
        return None
    table = layer.ready_table
    leases: list[SlotLease] = []
    try:
        for i in range(len(table)):
            leases.append(await table.lease(i))
        await table.refresh()          # the id_task of every slot, right before the request
    except BaseException:
        for lease in leases:
            lease.release()
        raise
    before = table.task_ids()
    tokens = prep.tokens
    placed = ServerPlaced(req.request_id, tokens, ctx)
    layer.counters["server_placed"] += 1

    async def release() -> None:
        try:
            placed.slot = await table.learn_placement(
                before, tokens, owner=ctx.session, kind=ctx.kind, user_starts=ctx.user_starts,
                labels=dict(ctx.labels))
            if placed.slot is not None:
                placed.seq = table[placed.slot].seq
                log.info("[%s] the server placed the request in slot %d", req.request_id, placed.slot)
        except SlotError as exc:
            log.warning("[%s] which slot the server chose is unknown (%s)", req.request_id, exc)
        finally:
            for lease in leases:
                lease.release()

    return Plan(headers={"X-OCache-Tier": "none", "X-OCache-Kind": prep.kind, "X-OCache-Slot": "server"},
                context=placed, release=release)
