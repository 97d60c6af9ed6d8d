"""The server-placed route: forward without ``id_slot`` and let llama-server choose the slot by its
own prompt similarity, when the resident ranking says it chooses at least as well
(``ocache.tiers.resident.server_should_choose``).

ocache holds every slot's lease until the server has placed it (taken in slot order, so two such
requests never deadlock), so that no other request runs and the one slot whose ``id_task`` grows is
the server's choice: a watcher polls ``GET /slots`` for that slot (``SlotTable.placed_slot``, at
most ``PLACEMENT_WAIT_S``) and then lets every other lease go, so a request that comes meanwhile
runs on another slot instead of waiting for the whole generation (6.56 s behind 1,500 tokens
before: ``tests/test_waits.py``). Not chosen while any slot is leased (its lease would be waited for). ``release``
records what the slot now holds (``SlotTable.learn_placement``) before letting its lease go, and
``observe`` predicts the checkpoints its prefill made (``Observer.observe_placed``). The answer's
figures are the server's own (nothing was split).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from ocache.cache.execute import ServerPlaced
from ocache.cache.prepare import Prepared
from ocache.cache.routes.usual import LEASE_WAIT_S
from ocache.api.figures import Figures
from ocache.layer import ParsedRequest, Plan
from ocache.slots import SlotError, SlotLease
from ocache.tiers.base import RequestContext
from ocache.tiers.resident import rank_slots, server_should_choose

if TYPE_CHECKING:
    from ocache.cache.ports import PlanningServices

log = logging.getLogger("ocache.cache")

#: seconds the watcher looks for the slot the server chose; past it every lease is held to the end
PLACEMENT_WAIT_S = 30.0


def chooses(layer: PlanningServices, prep: Prepared, ctx: RequestContext) -> bool:
    """``server_should_choose`` on the current table, and no slot leased now (every lease is taken:
    one held by a running request would be waited for until it ends)."""
    table = layer.ready_table
    snap = table.snapshot()
    if any(s.busy for s in snap):
        return False
    return server_should_choose(rank_slots(prep.tokens, snap, ctx, table.params), snap)


async def plan(layer: PlanningServices, req: ParsedRequest, prep: Prepared, ctx: RequestContext) -> Plan | None:
    """The server-placed plan of ``req`` (see the module docstring), or None when the planner
    chooses better. Raises what ``GET /slots`` raises (every lease released)."""
    if not chooses(layer, prep, ctx):
        return None
    table = layer.ready_table
    leases: list[SlotLease] = []
    try:
        for i in range(len(table)):
            # a slot leased meanwhile (another request placed or generating there) is waited for at
            # most LEASE_WAIT_S: then this request goes the usual way (its bounded lease wait)
            leases.append(await table.lease(i, LEASE_WAIT_S))
        await table.refresh()          # the id_task of every slot, right before the request
    except TimeoutError:
        for lease in leases:
            lease.release()
        log.info("[%s] a slot stayed leased for %g s: not server-placed", req.request_id, LEASE_WAIT_S)
        return None
    except BaseException:
        for lease in leases:
            lease.release()
        raise
    before = table.task_ids()
    tokens = prep.tokens
    placed = ServerPlaced(req.request_id, tokens, ctx)
    layer.counters["server_placed"] += 1

    found: list[int] = []

    async def watch() -> None:
        slot = await table.placed_slot(before, PLACEMENT_WAIT_S)
        if slot is not None:
            found.append(slot)
            for lease in leases:
                if lease.slot != slot:
                    lease.release()

    watcher = asyncio.ensure_future(watch())

    async def release() -> None:
        watcher.cancel()   # it holds nothing: a lease it let go stays released (idempotent)
        try:
            placed.slot = await table.learn_placement(
                before, tokens, owner=ctx.session, kind=ctx.kind, user_starts=ctx.user_starts,
                labels=dict(ctx.labels), slot=found[0] if found else None)
            if placed.slot is not None:
                placed.seq = table[placed.slot].seq
                log.info("[%s] the server placed the request in slot %d", req.request_id, placed.slot)
        except SlotError as exc:
            log.warning("[%s] which slot the server chose is unknown (%s)", req.request_id, exc)
        finally:
            for lease in leases:
                lease.release()

    return Plan(figures=Figures(tier="none", kind=prep.kind, slot="server"), context=placed, release=release)
