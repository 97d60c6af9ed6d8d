"""The router's question to one server's layer: what could you reuse for this request if it were
planned here? (``ocache/router.py`` asks every ready server and picks one before calling its
``plan``.)

The same steps as the usual route up to the decision (the prepared request, the lookup phase,
``plan_request`` on ``SlotTable.snapshot()``), read-only: no slot lease, no journal, no counter, no
table change. The prepared request (its token view) is the one every server of the same identity
shares (``ocache/cache/prepare.py``); the lookup answers are kept for this server's plan of the
request (``core.keep``), so a routed request asks each tier once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ocache.cache import core
from ocache.cache.plan import Decision, Estimate
from ocache.cache.prepare import Prepared
from ocache.layer import ParsedRequest
from ocache.slots import SlotState
from ocache.tiers.base import RequestContext
from ocache.tiers.resident import rank_slots

if TYPE_CHECKING:
    from ocache.cache.ports import PlanningServices

#: tokens past the shared prefix that key a gate (``Estimate.prefix_key``, ``router._gate_key``)
GATE_BLOCK = 256


def _prefix_block(head_len: int, predicted: int, n_tokens: int) -> int:
    """The tokens up to ``GATE_BLOCK`` past what requests of one folder share (the harness head
    when the plan reuses no more, else the usable prefix; none below ``GATE_BLOCK``): the key under
    which the router lets concurrent plans of one new prefix wait for each other
    (``router._gate_key``). 0: the prompt ends before."""
    base = head_len if head_len and predicted < head_len + GATE_BLOCK else (
        predicted if predicted >= GATE_BLOCK else 0)
    return base + GATE_BLOCK if base + GATE_BLOCK <= n_tokens or not base else 0


def _estimate_of(layer: PlanningServices, prep: Prepared, ctx: RequestContext, dec: Decision,
                 snap: list[SlotState]) -> Estimate:
    """The ``Estimate`` of decision ``dec`` on snapshot ``snap`` (pure but for reading the tiers'
    ``will_spill``)."""
    table = layer.ready_table
    tokens = prep.tokens
    own = bool(ctx.session) and any(s.owner == ctx.session for s in snap)
    destroys = 0
    if dec.evicts and not any(t.will_spill(dec.slot) for t in layer.tiers):
        destroys = len(snap[dec.slot].tokens)
    # a live conversation overwritten (spilled or not) where every slot holds one, or in a slot
    # that is busy (the plan waits for its request, and what it then finds is not this
    # prediction): the router prefers a server with room (router._eligible)
    full = bool(dec.evicts) and (dec.choice.busy or all(
        c.protected for c in rank_slots(tokens, snap, ctx, table.params)))
    block = _prefix_block(ctx.head_len, dec.predicted, len(tokens))
    return Estimate(n_tokens=len(tokens), usable=dec.predicted, tier=dec.tier, slot=dec.slot,
                    busy=dec.choice.busy, destroys=destroys,
                    restore_s=dec.offer.cost_s if dec.offer else 0.0, kind=prep.kind, own_session=own,
                    head_len=ctx.head_len, prefill_tps=layer.prefill_tps, head_key=ctx.head_key,
                    warm="warm_head" in dec.steps, prefix_key=hash(tuple(tokens[:block])) if block else None,
                    prefix_len=block, evicts=len(snap[dec.slot].tokens) if dec.evicts else 0, full=full,
                    room=any(st.origin or (not st.tokens and not st.n_total and not st.foreign)
                             for st in snap),
                    ubatch=table.params.n_ubatch)


async def estimate(layer: PlanningServices, req: ParsedRequest) -> Estimate | None:
    """This server's ``Estimate`` for ``req``, or None for a request ``plan`` would not pin
    (unconvertible, unpinnable here, rejected by the server, empty or too long). Raises what the
    layer's readiness or the token view raise when the server cannot be asked (the router then
    skips it)."""
    prep = await layer.prepare_request(req)
    if prep is None or not prep.tokens or len(prep.tokens) >= layer.ready_table.params.n_ctx_slot:
        return None
    table = layer.ready_table
    # the task id the plan would take (the table's counter is not advanced: read-only)
    ctx = prep.context(int(getattr(table, "_task_seq", 0)) + 1)
    found = await core.look_up(layer, prep, ctx)
    core.keep(layer, req, found)
    dec, _ = core.decide(layer, prep.tokens, ctx, found.offers, found.anchors)
    return _estimate_of(layer, prep, ctx, dec, table.snapshot())
