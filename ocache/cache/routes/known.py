"""The known route: the next turn of a conversation a slot holds (``known_conversation_slot``: its
earlier messages unchanged, the template checked append-only; or exactly its messages, a resend),
pinned to that slot and forwarded at once, without waiting for its token view.

The plan is the one the planner makes for such a request (that slot, no step before forwarding; the
reason is in ``known_conversation_slot``); the view, the prediction, the slot table's record and
the ``X-OCache-*`` figures are computed while the server works (``Plan.completion``; the answer does
not wait for it: its headers carry the figures when they are ready as llama-server's answer begins,
which it sends only with its first result, after the prompt's prefill:
tools/server/server-context.cpp:4514-4517 of the pinned source; else ``X-OCache-Figures: late``).
Critical path: one ``message_keys`` pass and one check that the server is the process the table
describes (``GET /health`` on a patched build, ``GET /slots`` otherwise: a restart must be seen),
nothing in proportion to the prompt's tokens (``scripts/bench-long``).

What the planner would have done differently is counted after the fact: ``known_other_plan``
(another slot, a restore or a head warm-up) and ``known_anchors_skipped`` (the disk tier's
anchor split of the new tokens; the session tier still spills the conversation before an
eviction).
"""

from __future__ import annotations

import asyncio
import copy
import logging
from dataclasses import replace
from typing import TYPE_CHECKING

from ocache.cache import core
from ocache.cache.execute import execute
from ocache.cache.prepare import Prepared, Rejected, Shape
from ocache.api.figures import Figures
from ocache.layer import ParsedRequest, Plan
from ocache.slots import IF_BOOT_HEADER, SlotState
from ocache.tiers.resident import known_conversation_slot
from ocache.tokens import TokenViewError

if TYPE_CHECKING:
    from ocache.cache.ports import PlanningServices

log = logging.getLogger("ocache.cache")

#: seconds a known conversation's next turn waits for its slot to settle (the previous answer's
#: plan released and the answer recorded: ``SlotTable.wait_settled``) when it arrived before that;
#: past it, the usual path
KNOWN_SETTLE_WAIT_S = 0.5
#: seconds the release of a known conversation's plan waits for its completion (the token view of
#: the forwarded request, :func:`complete`) before it gives up on the slot's record
KNOWN_COMPLETE_MAX_S = 120.0


def as_settled(snapshot: list[SlotState]) -> list[SlotState]:
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


def applies(layer: PlanningServices, shape: Shape) -> bool:
    """Whether the known route may take the request: the layer is ready with the route on
    (``tiers.resident.known``), a chat request that keeps the server's prompt cache."""
    return (layer.ready and layer.table is not None and layer.opt_known and shape.chat
            and shape.cache_prompt)


def find(layer: PlanningServices, shape: Shape, snapshot: list[SlotState] | None = None) -> int | None:
    """The slot holding ``shape``'s conversation now (read-only, no await), or None."""
    table = layer.ready_table
    return known_conversation_slot(table.snapshot() if snapshot is None else snapshot, shape.digests,
                                   shape.session, shape.kind, layer.template_append_only)


async def _settled_slot(layer: PlanningServices, shape: Shape) -> int | None:
    """:func:`find`, or, when the client sent this turn the moment the previous answer ended,
    before the proxy released that plan and recorded the answer (an agent's tool loop does), the
    slot once that is done (waited at most ``KNOWN_SETTLE_WAIT_S``), rather than view and plan a
    turn whose slot is known a few ms later. None: plan the usual way."""
    table = layer.ready_table
    snap = table.snapshot()
    slot = find(layer, shape, snap)
    if slot is not None:
        return slot
    settling = find(layer, shape, as_settled(snap))
    if settling is None:
        return None
    layer.counters["known_waits"] += 1
    slot = find(layer, shape) if await table.wait_settled(settling, KNOWN_SETTLE_WAIT_S) else None
    if slot is None:
        layer.counters["known_waits_usual"] += 1   # waited, then planned the usual way
    return slot


async def _same_process(layer: PlanningServices, req: ParsedRequest, shape: Shape, slot: int) -> tuple[bool, str | None]:
    """Whether the table still describes the server's process, so ``slot`` can be trusted:
    ``(ok, if_boot)``. A restart since the table's last GET /slots must be seen before the server
    works on the turn: the patched build checks that itself when the request names the process
    (``if_boot``: ``SlotTable.precondition``, patches/0007: 412 before any work, and the proxy plans
    it again), else it answers GET /health without waiting for a decode step
    (``SlotTable.same_process``, patches/0005); else, or when in doubt, GET /slots itself. Not ok
    when the server could not say what its slots hold (a new process still loading its model
    answers GET /slots 503 'Loading model') or the slot no longer holds the conversation."""
    table = layer.ready_table
    if not (layer.opt_reconcile and table.needs_reconcile(core.RECONCILE_MAX_AGE_S)):
        return True, None
    if_boot = table.precondition()
    if if_boot is not None:
        layer.counters["known_if_boot"] += 1
        return True, if_boot
    if not table.unvouched() and await table.same_process():
        layer.counters["known_boot_checked"] += 1
    else:
        layer.counters["plan_reconciles"] += 1
        if not await layer.refresh(req.request_id):
            return False, None
    return find(layer, shape) == slot, None


async def plan(layer: PlanningServices, req: ParsedRequest, shape: Shape) -> Plan | None:
    """The known plan of ``req`` (see the module docstring), or None (plan as usual) when no slot
    holds the conversation or the slot changed before its lease was taken."""
    if not applies(layer, shape):
        return None
    table = layer.ready_table
    slot = await _settled_slot(layer, shape)
    if slot is None:
        return None
    ok, if_boot = await _same_process(layer, req, shape, slot)
    if not ok:
        return None
    version = table.version(slot)
    lease = await table.lease(slot)
    if table.version(slot) != version:
        lease.release()
        return None
    layer.counters["known"] += 1
    out = Plan(body_updates={"id_slot": slot}, headers={"X-OCache-Path": "known"},
               figures=Figures(kind=shape.kind, slot=slot))
    if if_boot is not None:
        out.upstream_headers[IF_BOOT_HEADER] = if_boot
    try:
        task = asyncio.get_running_loop().create_task(complete(layer, req, out, shape, slot))
    except BaseException:
        lease.release()
        raise
    out.completion = task

    async def release() -> None:
        try:
            done, _ = await asyncio.wait({task}, timeout=KNOWN_COMPLETE_MAX_S)
            if not done:
                layer.counters["known_failed"] += 1
                task.cancel()
            if not done or task.cancelled() or task.exception() is not None:
                table.mark_unknown(slot)   # forwarded there; what it holds now is for GET /slots
        finally:
            lease.release()

    out.release = release
    return out


async def _prepared(layer: PlanningServices, req: ParsedRequest, shape: Shape) -> Prepared:
    """The prepared request of a known turn; raises TokenViewError when the server rejects the
    body or the prompt is empty (the answer is then relayed without figures)."""
    prep = await layer.prepare(req, shape)
    if isinstance(prep, Rejected):
        raise TokenViewError("the server rejects this body", prep.status)
    if not prep.tokens:
        raise TokenViewError("empty prompt")
    return prep


async def complete(layer: PlanningServices, req: ParsedRequest, plan: Plan, shape: Shape, slot: int) -> None:
    """``Plan.completion`` of :func:`plan`: the prepared request, the planner's own decision (only
    counted), the forced decision for ``slot`` without steps, ``execute`` (the table's record),
    then ``plan.figures`` (``Plan.set_figures``) / ``plan.context``. A prompt too long for the slot is counted
    ``too_long`` (``X-OCache-Tier: cold``, no record: the server refuses it without touching the
    slot). Raises what the view raises (``release`` then marks the slot unknown)."""
    table = layer.ready_table
    try:
        prep = await _prepared(layer, req, shape)
        if len(prep.tokens) >= table.params.n_ctx_slot:
            # a client error, counted as on the usual path: the server answers it with its own
            # 400 before it touches the slot's cache (tools/server/server-context.cpp:3336-3344
            # of the pinned source; GET /slots' n_prompt_tokens is the cache's size, :747), so
            # the slot keeps what the table records and the next turn is known again
            layer.counters["too_long"] += 1
            plan.set_figures(replace(plan.read_figures(), tier="cold"))
            return
        ctx = await core.context(layer, req, prep)
        lk = await core.lookups(layer, req, prep, ctx)
        best, _ = core.decide(layer, prep.tokens, ctx, lk.offers, lk.anchors, held=slot)
        if best.slot != slot or {"bring", "warm_head"} & set(best.steps):
            layer.counters["known_other_plan"] += 1
            log.info("[%s] known conversation forwarded to slot %d; the planner would have chosen "
                     "slot %d (%s, predicted %d)", req.request_id, slot, best.slot,
                     ",".join(best.steps) or "no steps", best.predicted)
        elif lk.anchors and layer.disk_tier is not None and layer.disk_tier.lines_above(lk.anchors, best.predicted):
            layer.counters["known_anchors_skipped"] += 1
        dec, _ = core.decide(layer, prep.tokens, ctx, [], None, forced_slot=slot, held=slot)
        dec = replace(dec, steps=(), evicts=False, offer=None)
        pctx = await execute(table, layer.ready_head, layer.tiers, layer.disk_tier, layer.counters,
                             req.request_id, prep.view, ctx, dec)
    except asyncio.CancelledError:
        raise   # its plan was ended (a refused precondition) or it ran past KNOWN_COMPLETE_MAX_S
    except BaseException:
        layer.counters["known_failed"] += 1
        raise
    plan.set_figures(core.planned(layer, pctx, shape.kind))
    plan.context = pctx
