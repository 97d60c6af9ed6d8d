"""The executor: run a plan's steps on the leased slot, record what the forwarded request will
leave there (through the slot table's verbs), and return the plan context ``observe`` needs.

Steps, in ``Decision.steps`` order (``ocache.cache.plan.plan_request``): ``before_evict`` (every
tier; the session tier spills the conversation there), ``bring`` (the chosen tier restores its
offer), ``warm_head`` (the head tier prefills the harness head, then splits at the first user
message on hybrid models), ``anchors`` (the disk tier splits the prefill at the planned anchor lines
the prefill passes cold, and saves them). Then the reuse of the forwarded request is predicted again
on what the slot now holds.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Sequence

from ocache.cache.plan import Decision
from ocache.llama.reuse import Checkpoint, common_prefix, predict_reuse
from ocache.slots import SlotTable
from ocache.tiers.base import RequestContext, TierBase
from ocache.tiers.resident import ram_swap_possible
from ocache.tokens import TokenView

if TYPE_CHECKING:
    from ocache.tiers.disk import DiskTier
    from ocache.tiers.head import HeadTier

log = logging.getLogger("ocache.cache")


@dataclass
class PlanContext:
    """What ``plan`` hands to ``observe`` (through ``Plan.context``)."""

    request_id: str
    slot: int
    decision: Decision
    view: TokenView
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
    """What a request the server placed itself hands to ``observe`` (``ocache/cache/routes/server_placed.py``):
    the request, and the slot the server chose (None until ``release`` found it)."""

    request_id: str
    tokens: list[int]
    ctx: RequestContext
    slot: int | None = None
    seq: int = -1


def source_tier(restored_from: str | None, origin: bool) -> str | None:
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


async def _evict(table: SlotTable, tiers: Sequence[TierBase], counters: dict[str, int], rid: str,
                 dec: Decision) -> None:
    """The ``before_evict`` step: the slot ``dec.slot`` holds another live conversation
    (``dec.evicts``, counted ``evictions``) or a guest the session tier keeps
    (``ocache.cache.plan.guest_spilled``); every tier's ``before_evict`` runs (the session tier
    spills it; a failure is logged)."""
    slot = dec.slot
    if dec.evicts:
        counters["evictions"] += 1
    if "guest_on_agent_slot" in dec.warnings:
        counters["guest_on_agent_slot"] += 1
        log.warning("[%s] guest request on slot %d replaces an agent conversation (only %d slot(s); "
                    "the session tier protects it)", rid, slot, len(table))
    for tier in tiers:
        try:
            await tier.before_evict(slot)
        except Exception:
            log.exception("[%s] tier %s before_evict(slot %d) failed", rid, tier.name, slot)


async def execute(table: SlotTable, head: HeadTier, tiers: Sequence[TierBase], disk: DiskTier | None,
                  counters: dict[str, int], rid: str, view: TokenView, ctx: RequestContext,
                  dec: Decision) -> PlanContext:
    """Run ``dec.steps`` on the leased slot ``dec.slot`` and record its new content
    (``SlotTable.assign``). ``head``: the head tier; ``tiers``: the other tiers, in registration
    order; ``disk``: the disk tier or None; ``counters``: the layer's. Raises what a step raises
    but ``bring`` (a failed bring is counted, the slot holds what the failed restore left)."""
    slot = dec.slot
    tokens = view.tokens
    own0 = table.own_prefill.get(slot, (0, 0.0))     # ocache's own prefill (figures.py)
    source = source_tier(table[slot].restored_from, table[slot].origin)
    brought: str | None = None
    if "before_evict" in dec.steps:
        await _evict(table, tiers, counters, rid, dec)
    restore_s = None
    anchors = dec.anchors
    if "bring" in dec.steps and dec.offer is not None:
        bringer = next((t for t in (head, *tiers) if t.name == dec.offer.tier), None)
        try:
            t_bring = time.monotonic()
            if bringer is None:
                raise LookupError(f"no tier named {dec.offer.tier!r}")
            await bringer.bring(dec.offer, slot)
            restore_s = time.monotonic() - t_bring
            brought = dec.offer.tier
            if dec.offer.tier == "head":
                counters["head_restores"] += 1
        except Exception as exc:
            counters["bring_failures"] += 1
            # the slot holds what the failed restore left (SlotTable.restore asked the server:
            # erased by a stock build, untouched by the patched pre-check or a failed check)
            log.warning("[%s] %s bring into slot %d failed (%s)", rid, dec.offer.tier, slot, exc)
            brought, restore_s = await bring_next(table, counters, rid, view, ctx, slot,
                                                  (head, *tiers), dec.offer)
            if "anchors" in dec.steps and disk is not None:
                anchors = fallback_anchors(disk, rid, view, anchors)
    if "warm_head" in dec.steps:
        await head.warm_in(slot, tokens[:ctx.head_len], ctx.head_key, rid)
        await head.split_at_first_user(slot, tokens, ctx, rid)
    if "anchors" in dec.steps and disk is not None:
        # admission (docs/decisions.md D2): split the coming prefill at the planned anchor lines
        # it passes cold and save them; the slot then holds the last anchor, which this request
        # strictly extends
        st = table[slot]
        before = predict_reuse(st.tokens, st.n_total, st.checkpoints, tokens, table.params,
                               user_starts=ctx.user_starts, task=ctx.task)
        await disk.write_anchors(view, slot, anchors, before.cache_n, ctx)
    if "warm_head" in dec.steps:
        await head.checkpoint_first_user(slot, tokens, ctx, rid)
    st = table[slot]
    reuse = predict_reuse(st.tokens, st.n_total, st.checkpoints, tokens, table.params,
                          user_starts=ctx.user_starts, task=ctx.task,
                          ram_swap=st.foreign or ram_swap_possible(st, common_prefix(st.tokens, tokens),
                                                                   len(tokens), table.params))
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
    pctx = PlanContext(rid, slot, decision, view, ctx, 0, len(tokens), reuse.cache_n,
                       reuse.upper, list(st.checkpoints), time.monotonic(), restore_s, split, split_ms)
    keep_head = st.head_key if (st.head_key == ctx.head_key) else None
    pctx.seq = table.assign(slot, tokens, checkpoints=reuse.checkpoints_after, user_starts=ctx.user_starts,
                            owner=ctx.session, kind=ctx.kind, labels=dict(ctx.labels),
                            head_key=ctx.head_key or keep_head,
                            head_len=ctx.head_len if ctx.head_key else 0,
                            msg_key=getattr(view, "msg_key", None), n_msgs=getattr(view, "n_msgs", 0))
    log.debug("[%s] slot %d %s kind=%s N=%d lcp=%d predicted=%d upper=%d reason=%s steps=%s",
              rid, slot, decision.tier, ctx.kind, len(tokens), reuse.lcp, reuse.cache_n,
              reuse.upper, reuse.reason, ",".join(dec.steps))
    return pctx


def fallback_anchors(disk: DiskTier, rid: str, view: TokenView,
                     planned: tuple[tuple[int, str], ...]) -> tuple[tuple[int, str], ...]:
    """The anchor lines of a request whose planned bring failed, as a cold plan reads them
    (``DiskTier.anchor_lines`` now): the lines read before the bring left out the prefix the failed
    entry stored, which the store's check or the refused restore has since deleted (a missing slot
    file: ``Store.verify``). ``planned``: the lines read in the lookup phase, kept when the disk
    tier's read fails (logged)."""
    try:
        return tuple(disk.anchor_lines(view))
    except Exception:
        log.exception("[%s] disk tier anchor lines after a failed bring failed", rid)
        return planned


async def bring_next(table: SlotTable, counters: dict[str, int], rid: str, view: TokenView, ctx: RequestContext, slot: int,
                     tiers: Sequence[Any], failed: Any) -> tuple[str | None, float | None]:
    """After a failed bring (a damaged file is deleted by the store's check, a refused restore
    deletes its entry), ask every tier (``tiers``: the head tier, then the others) once more: the
    failed tier's next-best entry (a shorter anchor) or another tier's (the disk tier's anchor of a
    conversation whose spill was damaged) is still worth more than what the slot holds, when it
    offers at least one ubatch more; the most usable tokens win, the failed tier on a tie (the one
    lookup a request repeats, and only then). Returns
    ``(tier name, restore seconds)`` or ``(None, None)`` when nothing was brought (the request is
    then served from what the slot holds)."""
    st = table[slot]
    held = predict_reuse(st.tokens, st.n_total, st.checkpoints, view.tokens, table.params,
                         user_starts=ctx.user_starts, task=ctx.task).cache_n
    best: tuple[Any, Any] | None = None
    # the failed tier first: on a tie its next entry is taken (another tier must offer more)
    for tier in sorted((t for t in tiers if t is not None), key=lambda t: t.name != failed.tier):
        try:
            offer = await tier.lookup(view, ctx)
        except Exception:
            log.exception("[%s] tier %s lookup after a failed bring failed", rid, tier.name)
            continue
        if offer is None or (offer.tier == failed.tier and offer.ref == failed.ref) \
                or (offer.slot is not None and offer.slot != slot) \
                or offer.tokens_usable < held + table.params.n_ubatch:
            continue
        if best is None or offer.tokens_usable > best[1].tokens_usable:
            best = (tier, offer)
    if best is None:
        log.warning("[%s] serving from what slot %d holds", rid, slot)
        return None, None
    tier, offer = best
    try:
        t = time.monotonic()
        await tier.bring(offer, slot)
    except Exception as exc:
        counters["bring_failures"] += 1
        log.warning("[%s] %s bring of the next entry into slot %d failed too (%s); serving from what "
                    "the slot holds", rid, offer.tier, slot, exc)
        return None, None
    counters["bring_retries"] += 1
    log.info("[%s] %s: the next entry (%d tokens) restored instead", rid, offer.tier, offer.tokens_usable)
    return offer.tier, time.monotonic() - t
