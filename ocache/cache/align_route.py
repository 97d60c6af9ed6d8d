"""The aligned route: a rewritten history served from the slot's own tokens (issue 26).

One request route of :class:`ocache.cache.orchestrator.OCacheLayer`, beside the known turn, the
server-placed and the usual one. It keeps, per slot, what ocache recorded and relayed for the last
turn of the conversation the slot holds (:class:`ocache.align.Turn`), and plans a chat request that
:func:`ocache.align.decide` finds to be that conversation rewritten (past reasoning dropped or
re-rendered by the template or the client, the previous answer as the server generated it) plus a
new part: pinned to the slot, with patch 0008's ``ocache_splice`` (patches/README.md), so the server
serves the slot's tokens up to the end of its last generation and then the request's new part, and
prefills only that. Anything else (no record, the guard refuses, a build without 0008, config
``tiers.resident.align: false``) returns None: the request takes the other routes as sent.

Hooks in ``OCacheLayer`` (``ocache/cache/orchestrator.py``, each marked ``# [align]``):

* ``plan``: ``aligned = await self.align.plan(self, req, body, path, kind, head, keys)`` after
  the known-turn route declined (a known turn, its earlier messages unchanged on a template checked
  append-only, is forwarded at once and needs no splice; on a template that rewrites, or after a
  client's rewrite, it declines) and before the view of the usual route; a plan returned is the
  request's plan;
* ``observe``: ``await self.align.observe(self, req, plan, obs)`` after the observer recorded the
  response (both the aligned plans, whose context is an :class:`AlignContext`, and every other
  plan's :class:`ocache.cache.execute.PlanContext`);
* ``on_upstream_restart`` and ``clear``: ``self.align.forget()``; ``stats``: ``"align"``.

The record is checked against the slot table before use: the slot's ``seq`` (which
``SlotTable.assign``, ``clear`` and ``mark_unknown`` change) must still be the one recorded, and the
server checks the rest (0008's hashes, 412 otherwise: the plan carries the upstream header
``X-OCache-Splice``, so the proxy answers the 412 by ending the plan, which marks the slot unknown,
and planning the request again, ``Proxy._stale_plan``; the record is gone by then and the request
goes as sent). An aligned plan records in the slot table what the slot will hold as it does for a
prompt sent as is (``hold_known``: the ids ocache knows begin it, the rest counted when the answer
comes, prompt + generated - 1, docs/llama-server.md §7); its conversation stays the slot's owner, so
the planner keeps new conversations off it, and only this route continues the conversation there
(the table has no message key for it).

Needs the relayed answer: ``Observation.message`` and ``Observation.finish_reason``, set by the
proxy for a non-streamed chat answer, and for a streamed one from its deltas when the layer's
``wants_message`` is true (``ocache.relay.SSEObserver(collect=True)``: one JSON parse per chunk, only then).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, replace
from typing import Any, Awaitable, Callable, Iterator, Mapping, Sequence

import aiohttp

from ocache.api.figures import Figures
from ocache.align import (NO_PARTIAL, PROBE, Aligned, AsSent, Decision, Turn, canonical, decide, fields_of,
                          record, sampled_ids, text_calls, turn_end_marker)
from ocache.cache.align_judge import SpanJudge
from ocache.fingerprint import session_key
from ocache.substitute import owned, owner_of
from ocache.api.convert import RESPONSES_ROUTES
from ocache.cache.exact import ExactWarmups
from ocache.cache.ports import PlanningServices
from ocache.cache.execute import PlanContext
from ocache.config import align_mode, field_of
from ocache.layer import Observation, Plan, ParsedRequest
from ocache.slots import SlotTable
from ocache.tokens import TokenView, TokenViewError

log = logging.getLogger("ocache.cache")

#: the routes whose turns are recorded: chat, and Responses (Codex), whose compaction without tools
#: the continued route serves (``ocache/cache/routes/continued.py``; such a turn is recorded in the
#: chat form the server renders, ``req.memo["chat"]``, and is never aligned itself)
RECORDED_PATHS = ("/v1/chat/completions", "/chat/completions", *RESPONSES_ROUTES)

#: the request header an aligned plan adds (ignored by llama-server): it makes a 412 of the
#: server the plan's, so the proxy plans the request again rather than relaying it
SPLICE_HEADER = "X-OCache-Splice"

#: most seconds a plan waits for the previous answer of its conversation to be observed (``settle``)
SETTLE_WAIT_S = 2.0


#: records of conversations that left their slot kept for their next turn (``AlignRoute.parked``)
PARKED_KEPT = 64

#: aligned requests kept for ``stats()["last"]`` (the dashboard's table)
LAST_KEPT = 20


@dataclass
class AlignContext:
    """``Plan.context`` of an aligned request: the decision, the record it came from, the request's
    own prompt tokens (its render), the slot and the slot table's ``seq`` when the plan was made."""

    request_id: str
    slot: int
    decision: Aligned
    turn: Turn
    tokens: list[int]
    body: Mapping
    #: the slot table's ``seq`` of the content this request leaves (``hold_known``), for ``finish``
    seq: int = -1
    #: the declared spans, named (``ocache.cache.align_judge.SpanJudge``): the debug record of what
    #: the served prompt differs from the rendering in
    declared: tuple[str, ...] = ()
    #: set once the server answered it 200 (it was served and counted, ``aligned``)
    served: bool = False
    #: the request carried the splice (``ocache_splice``); a continuation sent as it is did not
    spliced: bool = True


def held_after(timings: Mapping) -> int | None:
    """Tokens a slot holds after an answer with these ``timings``: its prompt (``cache_n`` +
    ``prompt_n``) and every generated token but the last (docs/llama-server.md §7); None when they
    lack a figure."""
    try:
        return int(timings["cache_n"]) + int(timings["prompt_n"]) + max(int(timings["predicted_n"]), 1) - 1
    except (KeyError, TypeError, ValueError):
        return None


def hold_known(table: SlotTable, slot: int, known: tuple[int, ...], keep: int | None = None) -> int:
    """Record in the slot table (whose lease the caller holds) what an aligned request to ``slot``
    leaves there: the ids ocache knows begin it (``known``: the first prompt sent as is in this
    chain, checked by the server's 0008 hash), then tokens it cannot name (the generated turns and
    the new parts), counted when the response comes (``SlotTable.finish``, pending until then).
    The owner, kind, labels, head and the checkpoints inside ``known`` stay the slot's. Returns the
    new ``seq``.

    Not ``mark_unknown``: a slot marked unknown (``foreign``) shows as empty in the stats and makes
    every new request go server-placed (``tiers/resident.py`` ``server_should_choose``), which
    then placed two new chats one after the other on one slot while the other sat idle; the table
    vouches for ``known`` as it does for any prompt it sent (the tokens after a prompt are counted,
    never named, docs/llama-server.md §7). ``keep``: the slot's ids the splice keeps (``n_keep``;
    None: all of ``known`` that the slot held); what the slot held past it is gone."""
    st = table[slot]
    n = len(known) if keep is None else keep
    # the checkpoints predicted inside ``known`` stay (the splice keeps the slot's first n_keep >=
    # len(known) tokens); those the aligned prefills make are not predicted (a reuse predicted low)
    return table.assign(slot, known, checkpoints=[c for c in st.checkpoints if c.n_tokens <= n],
                        user_starts=[u for u in st.user_starts if u < n], owner=st.owner,
                        kind=st.kind, labels=st.labels, head_key=st.head_key if st.head_len <= n else None,
                        head_len=st.head_len if st.head_len <= n else 0)


def mode(config: Any) -> str:
    """``tiers.resident.align``: ``"splice"`` (true, the default: a rewritten history served as the
    slot's ids plus the new part), ``"exact"`` (every prompt the template's; after a turn that
    ended without a tool call the next prompt's predictable prefix is prefilled at idle,
    :class:`ocache.cache.exact.ExactWarmups`) or ``"off"`` (false). Raises ConfigError (a ValueError) for another value."""
    tiers = field_of(config, "tiers", None) or {}
    return align_mode((tiers.get("resident") or {}).get("align", True))


def enabled(config: Any) -> bool:
    """Whether the align route records turns (``mode`` splice or exact)."""
    return mode(config) != "off"


def _continues(turn: Turn, body: Any) -> bool:
    """Whether a request (its ``body``) continues ``turn``'s conversation: the same prompt fields
    (tools, template arguments) and its messages open with the record's, reasoning aside."""
    msgs = body.get("messages") if isinstance(body, Mapping) else None
    if not isinstance(msgs, list) or len(msgs) < len(turn.messages) or fields_of(body) != dict(turn.fields):
        return False
    try:
        return all(canonical(a) == canonical(b) for a, b in zip(msgs, turn.messages))
    except (AttributeError, TypeError):
        return False


def settle_slot(table: SlotTable, slot: int, seq: int, obs: Observation) -> None:
    """What a substituted response (aligned or continued) left in ``slot``, through the table's
    verbs, while the slot still holds the plan's content (``seq``) and no request holds it: a
    complete answer, the count (``SlotTable.finish``: prompt + generated - 1); one cut short,
    ``interrupted`` (``GET /slots`` counts it); a refused or failed one (412: patch 0008 refused
    the splice), unknown until ``GET /slots``."""
    if table.lock(slot).locked() or table[slot].seq != seq:
        return
    n_held = held_after(obs.timings or {})
    if obs.status == 200 and obs.completed and n_held is not None:
        table.finish(slot, seq, n_held)
    elif obs.status == 200:
        table.interrupted(slot, seq)
    else:
        table.mark_unknown(slot)


class AlignRoute:
    """Per-slot records and the aligned plans (module docstring). ``counters``: ``aligned``
    (requests served with a splice), ``aligned_saved_tokens`` (``Aligned.saved`` summed: what those
    requests sent as is *to the slot they were aligned on* would have prefilled again at least; not a
    saving against llama-server alone, whose slot holds the template's own rendering: the newcomer's
    loop counted 6,800 here for a real saving of 2,866), ``aligned_saved_vs_alone`` (the saving
    against llama-server alone with the same flags: per aligned request, what the server-alone model
    ``ocache.llama.alone`` prefills for its own render minus what the server prefilled for it,
    summed; may be negative), ``aligned_refused`` (a 412 of the
    server: the request was planned again), and ``as_sent_<reason>`` for a record that matched the
    history but not the guard. ``last``: the latest aligned requests (at most ``LAST_KEPT``, oldest
    first), each ``request_id``, ``time`` (epoch seconds), ``slot``, ``kept`` (the slot's tokens
    served), ``new`` (tokens prefilled: the request's new part), ``saved`` (its ``Aligned.saved``),
    ``saved_vs_alone`` (once answered)."""

    def __init__(self, on: bool = True, exact: bool = False) -> None:
        self.on = on
        #: exact mode (``mode``): no splice; an ended turn's next prompt prefix warmed at idle
        self.exact = exact
        self.records: dict[int, tuple[int, Turn]] = {}   # slot -> (table seq when recorded, turn)
        self.counters: Counter[str] = Counter()
        self.warmups = ExactWarmups(self.counters, lambda slot: self.records.pop(slot, None))
        self.last: deque[dict] = deque(maxlen=LAST_KEPT)
        self.eot_id: int | None = None
        self.think_close: int | None = None
        #: records whose slot was taken, by owner (:meth:`_park`), oldest first
        self.parked: OrderedDict[str, Turn] = OrderedDict()
        #: requests planned by :meth:`_restored_plan`: (decision, the parked record), for observe
        self._restored: dict[str, tuple[Aligned, Turn]] = {}
        #: the declared half of the gate: each span judged on its text (``/detokenize``)
        self.judge: SpanJudge | None = None
        #: why alignment is off on this server (stats ``align.off``), None while it is on
        self.off_why: str | None = None
        self._probed = False

    def forget(self) -> None:
        self.records.clear()
        self.parked.clear()
        self._probed = False
        self.eot_id = None

    def saved_vs_alone(self, ctx: AlignContext, tokens: int) -> None:
        """Count an answered aligned request's saving against the server alone (``tokens``: the
        server-alone model's prefill for its render minus the server's ``prompt_n`` for it). A
        continued compaction's context (``routes/continued.py``, an ``AlignContext`` with
        ``on_observed``) is not an aligned request: not counted."""
        if getattr(ctx, "on_observed", None) is not None:
            return
        self.counters["aligned_saved_vs_alone"] += tokens
        for row in reversed(self.last):
            if row["request_id"] == ctx.request_id:
                row["saved_vs_alone"] = tokens
                break

    def stats(self) -> dict:
        # planned but not served (the server refused the splice, 412; the client left first; the
        # plan ended before it was sent): only ``aligned`` counts substitutions that were served
        not_served = max(0, self.counters["aligned_planned"] - self.counters["aligned"])
        return {"enabled": self.on, "off": self.off_why, "records": len(self.records), **self.counters,
                "aligned_not_served": not_served, "last": list(self.last)}

    async def eot(self, layer: PlanningServices) -> int | None:
        """The template's end-of-turn token (``ocache.align.turn_end_marker`` of the server's render
        of a probe, tokenized: one token), once per process; None (no alignment) without patch 0008
        (``/props`` ``ocache.splice``) or without such a token."""
        if self._probed:
            return self.eot_id
        props = getattr(layer.upstream, "props", None) or {}
        self._probed = True
        self.eot_id = None
        if not (props.get("ocache") or {}).get("splice"):
            self.off_why = "the server does not serve ocache_splice (patches/0008)"
            return None
        try:
            rendered = (await layer.viewer.post("/apply-template", {
                "messages": [{"role": "user", "content": PROBE}], "add_generation_prompt": False})).get("prompt", "")
            marker = turn_end_marker(rendered) if isinstance(rendered, str) else None
            toks = await layer.viewer.tokenize_remote(marker, False) if marker else []
            close = await layer.viewer.tokenize_remote("</think>", False)
        except (TokenViewError, asyncio.TimeoutError, aiohttp.ClientError, ValueError) as exc:
            # the probe's calls are bounded (``ocache.tokens`` prices them): a loaded or stopped
            # server costs this request its alignment, not the process's; probed again next time
            self._probed = False
            self.off_why = f"the end-of-turn probe got no answer ({type(exc).__name__}); probed again"
            return None
        self.eot_id = toks[0] if len(toks) == 1 else None
        # the sampled ids (patches/0010) make every token of the slot known; without them nothing
        # can be compared and nothing is aligned (``not_aligned_why``)
        if not (props.get("ocache") or {}).get("generated_ids"):
            self.eot_id = None
            self.off_why = "the server does not report the sampled ids (patches/0010)"
            return None
        if self.eot_id is None:
            self.off_why = "the template shows no single end-of-turn token"
            return None
        self.think_close = close[0] if len(close) == 1 else None
        self.off_why = None
        return self.eot_id

    def _candidate(self, table: SlotTable, msgs: list, owner: str | None = None) -> tuple[int, int, Turn] | None:
        """The slot whose record's messages open ``msgs`` (reasoning aside) and whose content is
        still the one recorded; of several such slots (two sessions that sent the same messages),
        the one whose record is ``owner``'s (``owner_of`` of the request), else the first."""
        found = list(self._candidates(table, msgs))
        return next((c for c in found if c[2].owner == owner), found[0] if found else None)

    def _candidates(self, table: SlotTable, msgs: list) -> Iterator[tuple[int, int, Turn]]:
        """Each ``(slot, seq, turn)`` whose record's messages open ``msgs`` and whose content is
        still the one recorded (a record whose slot changed is parked on the way)."""
        for slot, (seq, turn) in list(self.records.items()):
            n = len(turn.messages)
            if len(msgs) < n + 2:
                continue
            try:
                if any(canonical(a) != canonical(b) for a, b in zip(msgs[:n], turn.messages)):
                    continue
            except (AttributeError, TypeError):
                return
            st = table[slot]
            if st.seq != seq or st.pending:
                self._park(self.records.pop(slot, (seq, turn))[1])
                continue
            yield slot, seq, turn

    def judge_of(self, layer: PlanningServices) -> SpanJudge:
        """The span judge, its port the layer's token viewer's bounded call."""
        if self.judge is None:
            self.judge = SpanJudge(lambda: layer.viewer.post)
        return self.judge

    def _owned(self, table: SlotTable, headers: Any) -> tuple[int, int, Turn] | None:
        """The slot whose record is the requester's own conversation (``owner_of``, a session key
        required) and whose content is still the one recorded: a candidate for a partial splice
        only (``SpanJudge.partial``), the history having changed."""
        if session_key(headers) is None:
            return None
        owner = owner_of(headers)
        for slot, (seq, turn) in list(self.records.items()):
            st = table[slot]
            if owned(turn.owner, owner) and st.seq == seq and not st.pending:
                return slot, seq, turn
        return None

    def _park(self, turn: Turn) -> None:
        """Keep a record whose slot was taken (its conversation spilled, or gone) under its owner,
        at most ``PARKED_KEPT``: the conversation's next turn may be served from its spill
        (:meth:`_restored_plan`)."""
        if turn.owner is None or not turn.ids:
            return
        self.parked.pop(turn.owner, None)
        self.parked[turn.owner] = turn
        while len(self.parked) > PARKED_KEPT:
            self.parked.popitem(last=False)

    async def _restored_plan(self, layer: PlanningServices, req: ParsedRequest, body: Mapping, msgs: list,
                             prepared_of: Callable[[], Awaitable[Any]], kind: str) -> Plan | None:
        """The requester's conversation left its slot (``parked``): when the request is that
        conversation rewritten plus a new part (the same guard, ``decide`` and declared spans), plan
        the prompt it would be served (the conversation's every id, then the new part) the usual
        way, accepted only when the plan brings all those ids back into a slot (its spill), and send
        it with the splice; else None, nothing done (the request goes as sent). The server checks
        every kept id (0008): a slot that holds anything else refuses."""
        owner = owner_of(req.headers)
        turn = self.parked.get(owner)
        if turn is None or len(msgs) < len(turn.messages) + 2:
            return None
        try:
            if any(canonical(a) != canonical(b) for a, b in zip(msgs[:len(turn.messages)], turn.messages)):
                return None
        except (AttributeError, TypeError):
            return None
        prep = await prepared_of()
        if prep is None or self.eot_id is None:
            return None
        table: SlotTable = layer.ready_table
        dec = decide(turn, body, prep.view.tokens, self.eot_id, n_ctx=table.params.n_ctx_slot, owner=owner)
        if isinstance(dec, Aligned):
            dec = await self.judge_of(layer).whole(turn, prep.view.tokens, dec)
        if isinstance(dec, AsSent):
            self.counters["restored_as_sent_" + dec.reason.replace(" ", "_")] += 1
            return None
        from ocache.cache import core
        from ocache.cache.prepare import Prepared
        from ocache.cache.routes import usual

        sp = dec.splice
        served = list(turn.ids) + list(sp.tail)
        view = replace(prep.view, tokens=served, text="", msg_key=None, n_msgs=0,
                       user_starts=[u for u in prep.view.user_starts if u < len(turn.ids)])
        prep2 = Prepared(shape=prep.shape, view=view, identity=prep.identity, ctx=prep.ctx)
        ctx = await core.context(layer, req, prep2)
        plan = await usual.plan(layer, req, prep2, ctx, accept=lambda d: d.predicted >= sp.n_keep)
        if plan is None:
            self.counters["restored_not_whole"] += 1
            return None
        self.parked.pop(owner, None)
        self.counters["aligned_planned"] += 1
        self.counters["aligned_restored"] += 1
        self._restored[req.request_id] = (dec, turn)
        plan.body_updates["ocache_splice"] = sp.field()
        plan.upstream_headers = {**(plan.upstream_headers or {}), SPLICE_HEADER: str(sp.n_keep)}
        plan.headers.update({"X-OCache-Aligned": f"{sp.n_keep}+{len(sp.tail)}", "X-OCache-Path": "aligned"})
        log.info("[%s] aligned from its spill: %s; the conversation's %d tokens + %d new", req.request_id,
                 plan.headers.get("X-OCache-Tier"), sp.n_keep, len(sp.tail))
        return plan

    async def settle(self, table: SlotTable, keys: Any) -> None:
        """An agent sends its next turn the moment the previous answer ends, before the proxy has
        observed that answer (and this route recorded it): wait (bounded, ``SETTLE_WAIT_S``) for a
        slot whose last request's messages open this one's (``SlotState.msg_key``, the digests of
        ``ocache.tokens.message_keys``) while its response is still pending or its lease held."""
        digests = keys[1] if keys else []
        for st in table.snapshot():
            if not st.n_msgs or st.msg_key is None or len(digests) < st.n_msgs:
                continue
            if digests[st.n_msgs - 1] == st.msg_key and (st.pending or st.busy):
                self.counters["settle_waits"] += 1
                await table.wait_settled(st.id, SETTLE_WAIT_S)
                return

    async def _decision(self, layer: PlanningServices, req: ParsedRequest, body: Mapping, slot: int, turn: Turn,
                        tokens: Sequence[int], whole: bool) -> Decision:
        """The gate's decision for a request (its rendering ``tokens``) on ``turn``'s slot: the
        whole splice (``decide``, its spans judged) when the record's history opens the request
        (``whole``), else or failing that a partial one (``SpanJudge.partial``); counted
        ``partial_as_sent_<why>`` when neither is made."""
        table: SlotTable = layer.ready_table
        eot = self.eot_id if self.eot_id is not None else -1
        dec: Decision = (decide(turn, body, tokens, eot, n_ctx=table.params.n_ctx_slot, owner=owner_of(req.headers))
                         if whole else AsSent("history differs"))
        if isinstance(dec, Aligned):
            dec = await self.judge_of(layer).whole(turn, tokens, dec)
        if isinstance(dec, AsSent) and dec.reason not in NO_PARTIAL and table.params.checkpoints is not None:
            part = await self.judge_of(layer).partial(table, slot, turn, tokens, eot, owner_of(req.headers),
                                                       session_key(req.headers) is not None)
            if isinstance(part, AsSent):
                self.counters["partial_as_sent_" + part.reason.replace(" ", "_")] += 1
            else:
                dec = part
        return dec

    async def plan(self, layer: PlanningServices, req: ParsedRequest, body: Mapping, path: str, kind: str,
                   head: Any, keys: Any, view_of: Callable[[], Awaitable[Any]] | None = None,
                   prepared_of: Callable[[], Awaitable[Any]] | None = None) -> Plan | None:
        """An aligned plan for ``req``, or None (the other routes plan it as sent). ``view_of``: the
        request's token view as the layer prepares it (shared with the route that plans it when this
        one declines: one view per request, ``tests/test_one_view.py``); None: the viewer's own.
        ``prepared_of``: the request's ``Prepared`` (the same memo), for a conversation that left its
        slot (:meth:`_restored_plan`); None: not tried."""
        if not self.on or self.exact or req.path not in ("/v1/chat/completions", "/chat/completions"):
            return None
        # probed here, once, so that recording an answer (observe) never waits for the server:
        # the next turn may be planned the moment the answer's last byte left
        if await self.eot(layer) is None or not (self.records or self.parked):
            return None
        msgs = body.get("messages")
        table = layer.table
        if not isinstance(msgs, list) or table is None:
            return None
        await self.settle(table, keys)
        found = self._candidate(table, msgs, owner_of(req.headers))
        whole = found is not None
        if found is None:
            found = self._owned(table, req.headers)   # the requester's own slot: a partial splice only
        if found is None:
            if prepared_of is None or not self.parked:
                return None
            return await self._restored_plan(layer, req, body, msgs, prepared_of, kind)
        slot, seq, turn = found
        view = await view_of() if view_of is not None else await layer.viewer.view(path, body, head, keys)
        if view is None:   # the server rejects the body: the usual route forwards it as sent
            return None
        dec = await self._decision(layer, req, body, slot, turn, view.tokens, whole)
        if isinstance(dec, AsSent):
            self.counters["as_sent_" + dec.reason.replace(" ", "_")] += 1
            if dec.reason != "extends":
                log.info("[%s] not aligned on slot %d: %s", req.request_id, slot, dec.reason)
            if dec.reason != "extends" and prepared_of is not None and owner_of(req.headers) in self.parked:
                # the slot holds the requester's other conversation (another mode: its tools or
                # system prompt): the one it continues may wait in its spill
                return await self._restored_plan(layer, req, body, msgs, prepared_of, kind)
            return None
        # the slot's content is the one the record was checked against (``seq`` from before the
        # view was awaited): another request that took the slot meanwhile voids the plan here,
        # not with a 412 of the server
        lease = await table.lease(slot)
        if table[slot].seq != seq or table[slot].pending:
            lease.release()
            self.counters["aligned_slot_changed"] += 1
            return None
        sp = dec.splice
        self.counters["aligned_planned"] += 1
        if dec.partial:
            self.counters["aligned_partial_planned"] += 1
        self.last.append({"request_id": req.request_id, "time": time.time(), "slot": slot,
                          "kept": sp.n_keep, "new": len(sp.tail), "saved": dec.saved, "partial": dec.partial})
        log.info("[%s] aligned%s on slot %d: the slot's %d tokens + %d new of the request's %d",
                 req.request_id, " (partial)" if dec.partial else "", slot, sp.n_keep, len(sp.tail),
                 len(view.tokens))
        # the slot's whole prompt is known now: its ids kept, then the request's new part
        ctx = AlignContext(req.request_id, slot, dec, turn, list(view.tokens), body,
                           seq=hold_known(table, slot, tuple(turn.ids[:sp.n_keep]) + tuple(sp.tail), keep=dec.reused),
                           declared=dec.names)
        self.records.pop(slot, None)
        if ctx.declared:
            log.debug("[%s] declared: %s", req.request_id, "; ".join(ctx.declared))

        async def release() -> None:
            lease.release()

        # the figures of README's header table: the server serves the slot's n_keep tokens and
        # prefills the tail, nothing else (0008: cache_n = n_keep, prompt_n = len(tail);
        # tests/test_align_exact.py checks them against the answer's timings); a hybrid model's
        # partial splice resumes at a checkpoint before n_keep (``Aligned.reused``) and prefills the
        # kept ids after it again
        return Plan(body_updates={"id_slot": slot, "ocache_splice": sp.field()},
                    headers={"X-OCache-Aligned": f"{sp.n_keep}+{len(sp.tail)}", "X-OCache-Path": "aligned"},
                    figures=Figures(tier="resident", kind=kind, slot=slot, split=0, prefilled=sp.n_prompt - dec.reused,
                                    reused=dec.reused, predicted_cache=dec.reused),
                    context=ctx, release=release, upstream_headers={SPLICE_HEADER: str(sp.n_keep)})

    async def epilogue(self, layer: PlanningServices, ctx: AlignContext, obs: Observation) -> None:
        """What every planned answer gets after its slot's count (``Observer.observe`` for the
        usual routes), for a substituted one: the prediction checked (a splice serves exactly
        ``n_keep`` tokens of the slot: ``cache_n`` must be that; a miss is counted
        ``substituted_mispredicted`` and logged), then every tier's ``admit`` with the prompt
        served as the slot table holds it (``hold_known``: the slot's ids, then the new part), so
        the session tier may spill the conversation on eviction or a planned stop, and the disk
        tier learns its prefill rate. Only a complete 200 answer whose slot still holds this plan's
        content; never raises (a tier's error is logged)."""
        table: SlotTable | None = layer.table
        if table is None or obs.status != 200 or not obs.completed:
            return
        timings = obs.timings or {}
        sp = ctx.decision.splice
        cache_n = timings.get("cache_n")
        if ctx.spliced:
            if cache_n is not None and int(cache_n) != ctx.decision.reused:
                self.counters["substituted_mispredicted"] += 1
                log.warning("[%s] substituted on slot %d: predicted %d tokens of the slot, the server "
                            "reused %s", ctx.request_id, ctx.slot, ctx.decision.reused, cache_n)
        st = table[ctx.slot]
        if st.seq != ctx.seq or st.pending or table.lock(ctx.slot).locked():
            return
        view = TokenView(tokens=list(st.tokens), head_end=st.head_len or None, user_starts=list(st.user_starts),
                         text="")
        for tier in getattr(layer, "tiers", ()) or ():
            try:
                await tier.admit(view, ctx.slot, obs)
            except Exception:
                log.exception("[%s] tier %s admit failed", ctx.request_id, tier.name)


    async def observe(self, layer: PlanningServices, req: ParsedRequest, plan: Plan, obs: Observation) -> None:
        """Record the turn a response leaves in its slot (an aligned one or any other chat turn that
        the slot table recorded); a response without its answer (a stream, an error, cut short)
        drops the slot's record."""
        table: SlotTable | None = layer.table
        if not self.on or table is None:
            return
        ctx = getattr(plan, "context", None)
        restored = self._restored.pop(req.request_id, None)
        if isinstance(ctx, AlignContext):
            slot = ctx.slot
            on_observed = getattr(ctx, "on_observed", None)   # a continued compaction (routes/continued.py)
            if on_observed is not None:
                self.records.pop(slot, None)
                on_observed(self, table, obs)
                await self.epilogue(layer, ctx, obs)
                return
            if obs.status == 412:
                self.counters["aligned_refused"] += 1
            elif obs.status == 200 and on_observed is None and not ctx.served:
                ctx.served = True
                self.counters["aligned"] += 1
                self.counters["aligned_saved_tokens"] += ctx.decision.saved
            settle_slot(table, ctx.slot, ctx.seq, obs)
            await self.epilogue(layer, ctx, obs)
        elif isinstance(ctx, PlanContext):
            slot = ctx.slot
        else:
            return
        gone = self.records.pop(slot, None)
        sent = (req.memo.get("chat") or {}) if req.path in RESPONSES_ROUTES else (req.body or {})
        if gone is not None and (gone[1].owner != owner_of(req.headers) or not _continues(gone[1], sent)):
            # another conversation took the slot (another owner's, or the owner's own in another
            # mode: its tools or system prompt switched, which the resident tier keeps as another
            # live conversation and spills, ``ocache.tiers.resident.departs_before_user``): the
            # record waits for its spill
            self._park(gone[1])
        message = getattr(obs, "message", None)
        body = req.body or {}
        raw = None
        if req.path in RESPONSES_ROUTES:   # recorded in the chat form the server rendered
            raw, body = body, req.memo.get("chat") or {}
        if (obs.status != 200 or not obs.completed or not isinstance(message, Mapping)
                or req.path not in RECORDED_PATHS
                or await self.eot(layer) is None or self.eot_id is None):
            return
        t = obs.timings or {}
        if isinstance(ctx, AlignContext):
            n_held = held_after(t)
            if n_held is None or table[slot].seq != ctx.seq or table[slot].pending:
                return   # no count, or the slot was planned again meanwhile: its record is that plan's
            turn = record(body, ctx.tokens, self.eot_id, message, getattr(obs, "finish_reason", None),
                          n_held, slot, ctx.decision, ctx.turn, generated=sampled_ids(t),
                          think_close=self.think_close, owner=owner_of(req.headers))
        else:
            st = table[slot]
            if st.pending or st.n_total is None or st.tokens != list(ctx.view.tokens):
                return
            if restored is not None:   # served from its spill with the splice (_restored_plan)
                self.counters["aligned"] += 1
                self.counters["aligned_saved_tokens"] += restored[0].saved
            dec_r, prev_r = restored if restored is not None else (None, None)
            turn = record(body, ctx.view.tokens, self.eot_id, message, getattr(obs, "finish_reason", None),
                          st.n_total, slot, dec_r, prev_r, raw, generated=sampled_ids(t),
                          think_close=self.think_close, owner=owner_of(req.headers))
        # whose conversation it is: a substitution (aligned, continued: ocache.compaction.owns)
        # serves it only to its owner
        self.records[slot] = (table[slot].seq, turn)
        if (self.exact and isinstance(ctx, PlanContext) and getattr(obs, "finish_reason", None) == "stop"
                and not message.get("tool_calls") and text_calls(str(message.get("content") or "")) is None
                and req.path in RECORDED_PATHS):
            # the turn ended without a tool call: the client waits for its user (exact mode)
            self.warmups.schedule(layer, slot, table[slot].seq, body, message)
