"""The aligned route (docs/usage.md, rewritten histories): a chat request that is the conversation a slot holds except for
what the template or the client rewrote (past reasoning dropped or re-rendered), plus a new part,
is served as the slot's own tokens up to the end of its last generation and then the new part
(patches/0008 ``ocache_splice``). The guard and the splice are ``ocache/align.py``; the record per
slot and the plan are ``ocache/cache/align_route.py`` (``AlignRoute``, owned by the layer as
``layer.align``). Tried after the known-turn route: a known turn (earlier messages unchanged,
template append-only) is forwarded before anything is checked here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ocache.cache.prepare import Prepared, Rejected, Shape
from ocache.layer import ParsedRequest, Plan
from ocache.substitute import one_completion
from ocache.tokens import TokenView

if TYPE_CHECKING:
    from ocache.cache.ports import PlanningServices


async def plan(layer: PlanningServices, req: ParsedRequest, shape: Shape) -> Plan | None:
    """An aligned plan, or None (alignment off, not a chat request, a body asking for several
    completions, which the splice does not serve: ``one_completion``, or the guard says "as sent")."""
    if not shape.chat or not layer.align.on:
        return None
    if not one_completion(shape.body):
        layer.align.counters["as_sent_several_completions"] += 1
        return None

    async def view_of() -> TokenView | None:
        prep = await layer.prepare(req, shape)    # kept in req.memo: the next route reuses it
        return None if isinstance(prep, Rejected) else prep.view

    async def prepared_of() -> Prepared | None:
        prep = await layer.prepare(req, shape)
        return None if isinstance(prep, Rejected) else prep

    return await layer.align.plan(layer, req, shape.body, shape.path, shape.kind, shape.head, shape.keys,
                                  view_of, prepared_of)
