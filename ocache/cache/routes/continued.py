"""The continued route: a client's compaction of a conversation a slot holds, served as that
conversation's continuation (issue 26 item 3, seed 000 §13.9).

opencode's compaction request has no tools and one user message with the whole history flattened
as text (``ocache/compaction.py``), so as sent it shares no token with what the slot holds: a cold
prefill of the entire history. When :func:`ocache.compaction.parse` recognises such a request and
its guard (``ocache.compaction.matches``) finds the conversation in a slot's record (the aligned
route's, ``ocache/cache/align_route.py``: what ocache recorded and relayed for the slot's last
turn; the requester's own, recorded with its session key and credentials,
``ocache.compaction.owns``, and its whole history, entry for entry), the request is served as the
recorded request and its answer plus one user turn with the client's instruction
(``ocache.compaction.continuation``): pinned to that slot, with patch 0008's ``ocache_splice`` (the
slot's tokens up to the end of its last generation, then the request's new turn;
``ocache.align.decide``), or without one where the continuation's render already extends what the
slot holds (an append-only template). The server prefills only the instruction turn. Anything
else (not a compaction, no record matches, the guard or ``decide`` refuses, a server without 0008,
a converted route, ``tiers.resident.continue_compaction: false`` or ``tiers.resident.align:
false``) returns None: the request takes the other routes as sent.

Headers ``X-OCache-Continued: K+N`` (the slot's K tokens + the N of the instruction turn) and
``X-OCache-Path: continued``; stats ``layer.continued`` (:meth:`ContinueRoute.stats`); one log line.

Codex's compaction (``ocache.compaction.without_tools``: the conversation's own items, the answer and
one user item with its instructions, but ``tools: []``) is served the same way on ``/v1/responses``
(only there: a chat request without the tools its conversation had goes as sent):
the request's messages rendered with the conversation's tools, its ``tools``, ``tool_choice`` and
``parallel_tool_calls`` put back as the conversation sent them (``Turn.raw``). A Responses answer
does not say whether the model ended it, so there the continuation is sent without a splice, when its
render begins with the slot's known prompt: the server's own prefix match then reuses the
conversation (and whatever of the answer the render repeats) and prefills the rest.

Only the resident slot is used: a conversation that left its slot (spilled, evicted) is forwarded
as sent. After the answer the slot holds the continuation (the table learns its count: prompt +
generated - 1, docs/llama-server.md §7); the conversation's record stays (its tokens are still the
slot's first ones, checked by the server's hash), so a retried compaction or a later turn of the
conversation is served from it again.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ocache.align import Aligned, AsSent, Splice, Turn, decide
from ocache.api.convert import RESPONSES_ROUTES
from ocache.api.figures import Figures
from ocache.cache.align_route import SETTLE_WAIT_S, SPLICE_HEADER, AlignContext, held_after, hold_known, settle_slot
from ocache.cache.prepare import Prepared, Shape
from ocache.compaction import Compaction, continuation, matches, parse, without_tools
from ocache.config import field_of
from ocache.layer import Observation, ParsedRequest, Plan
from ocache.slots import SlotTable
from ocache.substitute import one_completion, owner_of
from ocache.tokens import TokenViewError

if TYPE_CHECKING:
    from ocache.cache.ports import AlignRecord, ContinuedRecord, PlanningServices

log = logging.getLogger("ocache.cache")

CHAT_PATHS = ("/v1/chat/completions", "/chat/completions")


def enabled(config: Any) -> bool:
    """``tiers.resident.continue_compaction`` (default true)."""
    tiers = field_of(config, "tiers", None) or {}
    return bool((tiers.get("resident") or {}).get("continue_compaction", True))


class ContinueRoute:
    """The route's switch and counters: ``requests`` (compactions served as a continuation),
    ``saved_tokens`` (the request's own prompt tokens minus the instruction turn's: what it would
    have prefilled as sent, less what it prefilled), ``refused`` (a 412 of the server: planned
    again, as sent), ``recognised`` (compaction requests seen), ``recognised_without_tools`` (a
    recorded conversation continued by one user turn without its tools: Codex's compaction,
    ``ocache.compaction.without_tools``), ``as_sent_<reason>`` (a compaction not continued) and
    ``other_requests`` (requests without tools looked at that continue no conversation held here:
    an opencode title request, another session's; not compactions, so not logged as one)."""

    def __init__(self, on: bool = True) -> None:
        self.on = on
        self.counters: Counter[str] = Counter()

    def stats(self) -> dict:
        return {"enabled": self.on, "requests": 0, "saved_tokens": 0, **self.counters}


@dataclass
class ContinuedContext(AlignContext):
    """``Plan.context`` of a continued request (an :class:`AlignContext`: the layer hands its
    response to ``AlignRoute.observe``, which calls :meth:`on_observed`)."""

    route: ContinuedRecord = field(default_factory=ContinueRoute)
    saved: int = 0

    def on_observed(self, align: AlignRecord, table: SlotTable, obs: Observation) -> None:
        """The slot now holds the continuation: its count (prompt + generated - 1) when the answer
        came, and the conversation's record again (still its first tokens); a 412 (the slot no
        longer held them) counts ``refused``, and the record is gone."""
        if obs.status == 412:
            self.route.counters["refused"] += 1
            return
        # the slot keeps the conversation's known first prompt and its owner (``hold_known`` at plan
        # time), now with the server's count; not marked unknown, which would show it empty and
        # send every new request server-placed (as after an aligned answer, align_route.hold_known)
        settle_slot(table, self.slot, self.seq, obs)
        n_held = held_after(obs.timings or {})
        if n_held is None or table[self.slot].seq != self.seq or table[self.slot].pending:
            return
        if obs.status == 200 and obs.completed and n_held >= self.turn.n_held:
            align.records[self.slot] = (table[self.slot].seq, self.turn)


def _candidate(layer: PlanningServices, table: SlotTable, comp: Compaction | None, body: Any,
               owner: str) -> tuple[int, Turn] | str:
    """The slot whose recorded conversation ``comp`` compacts (None: that ``body`` continues without
    its tools, ``ocache.compaction.without_tools``), a conversation of the requester's (``owner``:
    ``ocache.substitute.owner_of`` of the request), or why none."""
    why = "no record"
    for slot, (seq, turn) in list(layer.align.records.items()):
        st = table[slot]
        if st.seq != seq or st.pending:
            continue
        miss = matches(comp, turn, body, owner) if comp is not None else without_tools(turn, body, owner)
        if not isinstance(miss, str):
            return slot, turn
        why = miss
    return why


async def settle(table: SlotTable) -> None:
    """A client sends its compaction the moment the previous answer ends, before the proxy observed
    it (and the aligned route recorded it): wait for busy slots (bounded, ``SETTLE_WAIT_S``)."""
    for st in table.snapshot():
        if st.pending or st.busy:
            await table.wait_settled(st.id, SETTLE_WAIT_S)


def _as_sent(route: ContinuedRecord, rid: str, why: str) -> None:
    route.counters["as_sent_" + why.replace(" ", "_")] += 1
    log.info("[%s] compaction not continued: %s", rid, why)


async def _decide(layer: PlanningServices, table: SlotTable, comp: Compaction | None, body: Any,
                  shape: Shape, owner: str, found: tuple[int, Turn] | None = None) -> tuple | str:
    """(slot, turn, the continuation's body fields, the decision, its tokens, whether it needs a
    splice) for a recognised compaction (``comp`` None: a conversation continued without its
    tools, ``found`` its slot and record), or why not."""
    eot = await layer.align.eot(layer)
    viewer = layer.current_viewer
    if eot is None or viewer is None:
        return "no splice on this server"
    if found is None:
        got = _candidate(layer, table, comp, body, owner)
        if isinstance(got, str):
            await settle(table)      # the previous answer may not be recorded yet
            got = _candidate(layer, table, comp, body, owner)
        if isinstance(got, str):
            return got
        found = got
    slot, turn = found
    if comp is not None:
        fields = continuation(turn, comp)
    else:
        msgs = without_tools(turn, body, owner)
        assert not isinstance(msgs, str)
        fields = {**dict(turn.fields), "messages": msgs}
    try:
        view = await viewer.view(shape.path, fields)
    except TokenViewError as exc:
        return f"the continuation does not render ({exc})"
    dec = decide(turn, fields, view.tokens, eot, n_ctx=table.params.n_ctx_slot)
    if isinstance(dec, AsSent) and dec.reason == "extends":
        # the render already begins with what the slot holds: no splice needed
        dec = Aligned(Splice(turn.n_held, (), tuple(view.tokens[turn.n_held:])), 0)
        return slot, turn, fields, dec, view.tokens, False
    known = turn.known
    n_ctx = table.params.n_ctx_slot
    if (isinstance(dec, AsSent) and turn.finish_reason is None and known and len(view.tokens) > len(known)
            and tuple(view.tokens[:len(known)]) == known and (n_ctx is None or len(view.tokens) <= n_ctx)):
        # a Responses answer does not say whether the model ended it (ocache.relay.responses_message):
        # no splice, but the render begins with the slot's known prompt, so the server's own prefix
        # match reuses that much and whatever of the answer its render repeats
        dec = Aligned(Splice(len(known), (), tuple(view.tokens[len(known):])), 0)
        return slot, turn, fields, dec, view.tokens, False
    if isinstance(dec, AsSent):
        return dec.reason
    # the substitution gate's last condition, as for an aligned request: every span the proof
    # declares is judged on its text (a compaction of an answer quoting the end-of-turn marker
    # served the answer's tail twice without it)
    judged = await layer.align.judge_of(layer).whole(turn, view.tokens, dec)
    if isinstance(judged, AsSent):
        return judged.reason
    return slot, turn, fields, judged, view.tokens, True


def _updates(req: ParsedRequest, body: Any, turn: Turn, fields: dict, slot: int) -> dict:
    """The forwarded body's fields of a continuation pinned to ``slot``: on the chat route the
    continuation's fields; a Responses request takes the conversation's tools back in its own form
    (its messages are the request's own already: ``ocache.compaction.without_tools``), and the empty
    answer the client left out as an item before its last one (the user turn)."""
    if req.path not in RESPONSES_ROUTES:
        return {**fields, "id_slot": slot}
    updates = {**dict(turn.raw), "id_slot": slot}
    if len(fields["messages"]) > len(body["messages"]):
        items = list((req.body or {}).get("input") or [])
        items.insert(len(items) - 1, {"type": "message", "role": "assistant",
                                      "content": [{"type": "output_text", "text": ""}]})
        updates["input"] = items
    return updates


async def plan(layer: PlanningServices, req: ParsedRequest, shape: Shape) -> Plan | None:
    """A continued plan, or None (module docstring: anything else is forwarded as sent)."""
    route = layer.continued
    table = layer.table
    if not (route.on and layer.align.on and shape.chat and req.path in (*CHAT_PATHS, *RESPONSES_ROUTES)) \
            or table is None:
        return None
    body = shape.body    # a Responses body in the chat form the server renders
    if not one_completion(body):
        return None
    comp = parse(body) if req.path in CHAT_PATHS else None
    owner = owner_of(req.headers)
    if comp is None:
        # a conversation continued by one user turn without its tools (Codex's compaction)? Only on
        # the Responses route, Codex's: a chat client that stops offering tools is served its own
        # rendering (putting the tools back would offer the model tools the client did not). The
        # previous answer may not be recorded yet: wait (bounded) only for a slot whose last request's
        # messages open this one's (AlignRoute.settle)
        if req.path not in RESPONSES_ROUTES or body.get("tools") or not isinstance(body.get("messages"), list):
            return None
        await layer.align.settle(table, shape.keys)
        if not any(t.fields.get("tools") and 0 < len(body["messages"]) - len(t.messages) <= 2
                   for _, t in layer.align.records.values()):
            return None
        found = _candidate(layer, table, None, body, owner)
        if isinstance(found, str):
            # continues no conversation of the requester's held here (an opencode title request,
            # another session's request): not a compaction, so neither logged nor counted as one
            route.counters["other_requests"] += 1
            log.debug("[%s] no conversation continued without its tools: %s", req.request_id, found)
            return None
        got = await _decide(layer, table, None, body, shape, owner, found)
        if isinstance(got, str):
            _as_sent(route, req.request_id, "without tools: " + got)
            return None
        if req.path in RESPONSES_ROUTES and not got[1].raw.get("tools"):
            _as_sent(route, req.request_id, "without tools: the conversation's tools are not in this API's form")
            return None
        route.counters["recognised_without_tools"] += 1
    else:
        route.counters["recognised"] += 1
        got = await _decide(layer, table, comp, body, shape, owner)
        if isinstance(got, str):
            _as_sent(route, req.request_id, got)
            return None
    slot, turn, fields, dec, tokens, splice = got
    prep = await layer.prepare(req, shape)    # the request as sent (kept in req.memo for the next route)
    n_sent = len(prep.view.tokens) if isinstance(prep, Prepared) else 0
    seq = table[slot].seq
    lease = await table.lease(slot)
    if table[slot].seq != seq or table[slot].pending:
        lease.release()
        _as_sent(route, req.request_id, "the slot changed")
        return None
    sp = dec.splice
    saved = max(0, n_sent - len(sp.tail))
    route.counters["requests"] += 1
    route.counters["saved_tokens"] += saved
    log.info("[%s] compaction continued on slot %d: the conversation's %d tokens + %d of the "
             "instruction turn (as sent: %d tokens)", req.request_id, slot, sp.n_keep, len(sp.tail), n_sent)
    # every id of the prompt served is known: the slot's, then the instruction turn (a splice), or
    # the continuation's own render (sent as it is)
    seq = hold_known(table, slot, tuple(turn.ids) + tuple(sp.tail) if splice and turn.ids else tuple(tokens))
    layer.align.records.pop(slot, None)
    ctx = ContinuedContext(req.request_id, slot, dec, turn, list(tokens), fields, seq=seq, route=route, saved=saved,
                           spliced=bool(splice))

    async def release() -> None:
        lease.release()

    updates = _updates(req, body, turn, fields, slot)
    if splice:
        updates["ocache_splice"] = sp.field()
    return Plan(body_updates=updates,
                headers={"X-OCache-Continued": f"{sp.n_keep}+{len(sp.tail)}", "X-OCache-Path": "continued"},
                figures=Figures(tier="resident", kind=shape.kind, slot=slot),
                context=ctx, release=release,
                upstream_headers={SPLICE_HEADER: str(sp.n_keep)} if splice else {})
