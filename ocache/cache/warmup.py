"""Warm-ups off a request's path: a harness head prefilled on demand (``OCacheLayer.warm_head``)
and what ``POST /v1/cache/warm`` (``ocache warm DIR``, ``ocache/warm.py``) needs from the layer
(``OCacheLayer.warm_deps``)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Mapping

from ocache import fingerprint as fp_mod
from ocache.cache.plan import plan_request
from ocache.tiers.base import RequestContext

if TYPE_CHECKING:
    from ocache.cache.ports import PlanningServices
    from ocache.warm import WarmDeps

log = logging.getLogger("ocache.cache")


async def warm_head(layer: PlanningServices, body: Mapping, path: str = "/v1/chat/completions") -> dict:
    """Warm the stable harness head of an agent request ``body`` now (``ocache warm DIR``).

    Returns ``{"slot", "head_key", "head_tokens", "prompt_n", "cache_n"}`` (token counts). Raises
    ValueError when the body has no recognisable harness head."""
    await layer.ensure_ready()
    table, head_tier = layer.ready_table, layer.ready_head
    head = fp_mod.harness_head(body, layer.markers)
    if head is None:
        raise ValueError("no stable harness head in this request (unknown layout)")
    view = await layer.viewer.view(path, body, head)
    if not view.head_end:
        raise ValueError("the head could not be located in the rendered prompt")
    key = fp_mod.fingerprint(head, layer.identity())
    head_tokens = view.tokens[:view.head_end]
    ctx = RequestContext(kind="guest", head_key=None, task=table.next_task())
    snap = table.snapshot()
    for s in snap:
        if s.origin and s.head_key == key and s.tokens == head_tokens:
            return {"slot": s.id, "head_key": key, "head_tokens": len(head_tokens), "prompt_n": 0,
                    "cache_n": len(head_tokens)}
    dec = plan_request(head_tokens, snap, [], ctx, table.params)
    async with table.lock(dec.slot):
        t = await head_tier.warm_in(dec.slot, head_tokens, key)
    return {"slot": dec.slot, "head_key": key, "head_tokens": len(head_tokens),
            "prompt_n": t.get("prompt_n"), "cache_n": t.get("cache_n")}


def warm_deps(layer: PlanningServices) -> WarmDeps | None:
    """What ``POST /v1/cache/warm`` needs: ocache/warm.py ``WarmDeps``; None without a folder
    journal."""
    from ocache.warm import WarmDeps

    if layer.journal is None:
        return None

    async def pick_slot() -> int:
        """An idle slot that holds no live conversation: an empty one first, then a guest's or
        a head, then one whose content ocache cannot see (it may be a conversation), LRU among
        equals; else the planner's choice for a guest (which ranks protected conversations
        last; ``prepare_slot`` then hands it to the tiers)."""
        await layer.ensure_ready()
        table = layer.ready_table
        snap = table.snapshot()
        free = [s for s in snap if not s.busy and s.kind not in ("agent", "other")]
        if free:
            return min(free, key=lambda s: (bool(s.foreign and s.n_total), bool(s.tokens or s.n_total),
                                            s.last_used)).id
        ctx = RequestContext(kind="guest", task=table.next_task())
        return plan_request([0], snap, [], ctx, table.params).slot

    async def prepare_slot(slot: int) -> None:
        """The warm-up replaces a live conversation only when every slot holds one; then the
        tiers' ``before_evict`` run first, as for a request (the session tier spills it)."""
        st = layer.ready_table[slot]
        if st.tokens and st.kind in ("agent", "other") and not st.origin:
            layer.counters["evictions"] += 1
            log.info("warm: slot %d holds a conversation (%d tokens); every slot does: it is "
                     "handed to the tiers before the warm-up replaces it", slot, len(st.tokens))
            for tier in layer.tiers:
                try:
                    await tier.before_evict(slot)
                except Exception:
                    log.exception("tier %s before_evict(slot %d) for a warm-up failed", tier.name, slot)

    # the viewer and table as they are now (None before the layer's first readiness: the route's
    # pick_slot makes it ready, and a warm-up that finds neither fails with its error reported)
    return WarmDeps(journal=layer.journal, viewer=layer.current_viewer, tier=layer.disk_tier,
                    slots=layer.table, pick_slot=pick_slot, prepare_slot=prepare_slot)
