"""The known conversation's next turn (``tiers.resident.known``): forwarded to the slot that
holds the conversation before its token view exists; the view, the prediction and the figures follow
while the server works (``ocache/cache/routes/known.py``, ``known_conversation_slot``)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json

import aiohttp
import pytest

from ocache.llama.flags import ServerParams  # noqa: F401 - the params the matcher is used under
from ocache.slots import SlotState
from ocache.tiers.resident import known_conversation_slot
from ocache.tokens import message_keys

from test_hardening_cache import A1, CHAT, SERVER, UB, _prompt_total, body_of, cold, hdrs, make_config, through_ocache



@pytest.fixture(autouse=True)
def _figures_never_wait(monkeypatch):
    """ocache's default here (tests/conftest.py lets the headers wait for the figures elsewhere):
    the answer never waits for a known turn's figures."""
    import ocache.proxy
    monkeypatch.setattr(ocache.proxy, "FIGURES_WAIT_S", 0.0)


def _predicted(proxy, headers: dict) -> int:
    """A known turn's predicted reuse (tokens) from its record (the log line's, ``last_completions``
    of /v1/cache/stats; after ``wait_background``); when the figures were ready as the answer
    began, the ``X-OCache-Predicted-Cache`` header says the same."""
    rid = headers["X-OCache-Request-Id"]
    rec = next(r for r in proxy.stats.last_completions if r["request_id"] == rid)
    assert rec["predicted"] is not None
    if "X-OCache-Predicted-Cache" in headers:
        assert int(headers["X-OCache-Predicted-Cache"]) == rec["predicted"]
    else:
        assert headers.get("X-OCache-Figures") == "late"
    return rec["predicted"]

# --------------------------------------------------------------------------- the matcher (pure)


def _conv(*contents: str) -> dict:
    return {"messages": [{"role": "system", "content": "sys"},
                         *({"role": "user" if i % 2 == 0 else "assistant", "content": c}
                           for i, c in enumerate(contents))]}


def _slot(i: int, body: dict, **kw) -> SlotState:
    _, digests, key = message_keys(body)
    st = SlotState(id=i)
    object.__setattr__(st, "tokens", [1, 2, 3])
    object.__setattr__(st, "n_total", 9)
    object.__setattr__(st, "owner", "s1")
    object.__setattr__(st, "kind", "agent")
    object.__setattr__(st, "msg_key", key)
    object.__setattr__(st, "n_msgs", len(digests))
    for k, v in kw.items():
        object.__setattr__(st, k, v)
    return st


def test_known_slot_is_the_one_whose_messages_the_request_repeats():
    turn1 = _conv("q1")
    turn2 = _conv("q1", "a1", "q2")
    other = _conv("another question")
    digests = message_keys(turn2)[1]
    slots = [_slot(0, other), _slot(1, turn1)]
    assert known_conversation_slot(slots, digests, "s1", "agent") == 1
    # an earlier message edited: no slot holds this conversation's prefix
    edited = _conv("q1 (edited)", "a1", "q2")
    assert known_conversation_slot(slots, message_keys(edited)[1], "s1", "agent") is None
    # the render fields count: tools added to the request
    assert known_conversation_slot(slots, message_keys(dict(turn2, tools=[{"type": "function"}]))[1],
                                   "s1", "agent") is None
    # another session, another kind, a slot the table cannot vouch for: never
    assert known_conversation_slot(slots, digests, "s2", "agent") is None
    assert known_conversation_slot(slots, digests, "s1", "guest") is None
    for bad in ({"pending": True}, {"foreign": True}, {"n_total": None}, {"busy": True}, {"origin": True}):
        assert known_conversation_slot([_slot(0, other), _slot(1, turn1, **bad)], digests, "s1", "agent") is None
    # the longest recorded prefix wins; two equal ones: the planner decides
    assert known_conversation_slot([_slot(0, turn1), _slot(1, turn2)], digests, "s1", "agent") == 1
    assert known_conversation_slot([_slot(0, turn1), _slot(1, turn1)], digests, "s1", "agent") is None
    # a request shorter than what the slot was sent is not its next turn
    assert known_conversation_slot([_slot(0, turn2)], message_keys(turn1)[1], "s1", "agent") is None
    # a template not yet checked append-only: only a resend of exactly the slot's messages
    assert known_conversation_slot(slots, digests, "s1", "agent", extensions=False) is None
    assert known_conversation_slot([_slot(0, turn2)], digests, "s1", "agent", extensions=False) == 0


# --------------------------------------------------------------------------- against the server

def _next_turn(body: dict, answer: str, question: str) -> dict:
    nxt = copy.deepcopy(body)
    nxt["messages"].append({"role": "assistant", "content": answer})
    nxt["messages"].append({"role": "user", "content": question})
    return nxt


async def _two_turns(s: aiohttp.ClientSession, base: str, proxy, h: dict) -> dict:
    """Two turns of the opencode conversation A1 through ocache, then the template's delta-render
    check done; returns the body of the third turn (the known path's first candidate)."""
    body = body_of(A1)
    for q in ("First question?", "Second question?"):
        async with s.post(base + CHAT, json=body, headers=h) as r:
            assert r.status == 200
            answer = (await r.json())["choices"][0]["message"]["content"] or "ok"
        await proxy.wait_background()
        body = _next_turn(body, answer, q)
    await proxy.layer.viewer.wait_verified()
    return body


@contextlib.asynccontextmanager
async def _third_turn_ready(start_server, tmp_path, stock: bool = False):
    """A dense server (patched, or ``stock``) behind ocache after :func:`_two_turns`, background
    work done: yields ``(session, base, proxy, srv, headers, body of turn 3)``."""
    srv = start_server("dense", stock=stock, n_parallel=2, ctx_size=2 * 16384, **SERVER)
    h = hdrs(A1)
    async with through_ocache(make_config(srv, tmp_path / "state")) as (base, proxy):
        async with aiohttp.ClientSession() as s:
            body = await _two_turns(s, base, proxy, h)
            await proxy.layer.idle()
            yield s, base, proxy, srv, h, body


async def known_turn_then_next(s: aiohttp.ClientSession, base: str, proxy, h: dict, body: dict,
                               question: str) -> dict:
    """Send ``body`` (a known turn: it must take the known route), let its background work end;
    returns the body of the turn after it, which asks ``question``."""
    async with s.post(base + CHAT, json=body, headers=h) as r:
        assert r.status == 200 and r.headers.get("X-OCache-Path") == "known"
        data = await r.json()
    await proxy.wait_background()
    await proxy.layer.idle()
    return _next_turn(body, data["choices"][0]["message"]["content"] or "ok", question)


async def _served_as_alone(s: aiohttp.ClientSession, base: str, proxy, url: str, h: dict, body: dict,
                           data: dict, question: str) -> dict:
    """The turn after ``data`` (the answer to ``body``) once the table cannot name that slot's
    content: the usual path, the server picks the slot by its own similarity (as alone), so it
    reuses what the slot held (``cache_n + prompt_n`` of ``data``, less one) and prefills exactly its
    ``prompt_n``. Returns the turn's body."""
    held = data["timings"]["cache_n"] + data["timings"]["prompt_n"]
    nxt = _next_turn(body, data["choices"][0]["message"]["content"] or "ok", question)
    before = await _prompt_total(s, url)
    async with s.post(base + CHAT, json=nxt, headers=h) as r:
        assert r.status == 200 and r.headers.get("X-OCache-Path") is None
        t = (await r.json())["timings"]
    await proxy.wait_background()
    assert t["cache_n"] >= held - 1 and await _prompt_total(s, url) - before == t["prompt_n"]
    return nxt


@pytest.mark.server
async def test_known_turn_is_forwarded_before_its_view_and_its_figures_are_exact(start_server, tmp_path):
    """Turn 3 of a conversation (turn 2 checked the template append-only): the token view waits
    until the request was forwarded (it would time out on the usual path, which builds the view
    first, and the request would go out unplanned); the answer still carries the slot's exact
    predicted reuse, the server prefills only the new tokens, and greedy output equals a cold
    prefill of the same prompt."""
    srv = start_server("dense", n_parallel=2, ctx_size=2 * 16384, **SERVER)
    h = hdrs(A1)
    async with through_ocache(make_config(srv, tmp_path / "state")) as (base, proxy):
        async with aiohttp.ClientSession() as s:
            t1 = body_of(A1)
            async with s.post(base + CHAT, json=t1, headers=h) as r:
                assert r.status == 200
                a1 = (await r.json())["choices"][0]["message"]["content"] or "ok"
            await proxy.wait_background()
            t2 = _next_turn(t1, a1, "Now list the files you would change.")
            async with s.post(base + CHAT, json=t2, headers=h) as r:
                assert r.status == 200
                slot2 = r.headers["X-OCache-Slot"]
                a2 = (await r.json())["choices"][0]["message"]["content"] or "ok"
            await proxy.wait_background()
            await proxy.layer.idle()
            layer = proxy.layer
            await layer.viewer.wait_verified()
            assert layer.viewer.append_only and layer.counters["known"] == 0

            forwarded, answered = asyncio.Event(), asyncio.Event()
            real_forward, real_view = proxy.forwards.forward, layer.viewer.view
            order: list[str] = []

            async def forward(*a, **kw):
                order.append("forward")
                forwarded.set()
                try:
                    return await real_forward(*a, **kw)
                finally:
                    answered.set()

            async def view(*a, **kw):
                order.append("view")
                await asyncio.wait_for(forwarded.wait(), 20)   # the usual path: times out, plan fails open
                # and not before the server's answer reached ocache: the answer must not wait for
                # the view (before, the proxy held the headers until the figures were ready)
                await asyncio.wait_for(answered.wait(), 20)
                return await real_view(*a, **kw)

            proxy.forwards.forward, layer.viewer.view = forward, view
            t3 = _next_turn(t2, a2, "Which one first?")
            before = await _prompt_total(s, srv.url)
            async with s.post(base + CHAT, json=t3, headers=h) as r:
                assert r.status == 200 and "X-OCache-Fail-Open" not in r.headers
                assert r.headers["X-OCache-Slot"] == slot2
                assert r.headers["X-OCache-Figures"] == "late"
                assert "X-OCache-Predicted-Cache" not in r.headers
                assert proxy.stats.to_dict()["figures_late"] == 1
                h3 = dict(r.headers)
                data = await r.json()
            await proxy.wait_background()
            await layer.idle()
            proxy.forwards.forward, layer.viewer.view = real_forward, real_view
            predicted = _predicted(proxy, h3)       # the record's figures (log line, stats)
            t = data["timings"]
            assert order[:2] == ["forward", "view"]
            assert layer.counters["known"] == 1 and layer.counters["known_other_plan"] == 0
            assert layer.counters["mispredictions"] == 0
            assert predicted == t["cache_n"] and t["cache_n"] > 0
            assert await _prompt_total(s, srv.url) - before == t["prompt_n"]
            # the slot table recorded turn 3: turn 4, streamed, takes the known path again
            t4 = dict(_next_turn(t3, data["choices"][0]["message"]["content"] or "ok", "Go on."),
                      stream=True)
            async with s.post(base + CHAT, json=t4, headers=h) as r:
                assert r.status == 200 and r.headers["X-OCache-Slot"] == slot2
                h4 = dict(r.headers)
                last = None
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        ev = json.loads(line[6:])
                        last = ev.get("timings") or last
            await proxy.wait_background()
            predicted = _predicted(proxy, h4)
            assert layer.counters["known"] == 2 and last is not None
            assert abs(predicted - last["cache_n"]) <= UB and layer.counters["mispredictions"] == 0
            ref = await cold(srv.url, t3)       # (overwrites a slot: last)
            assert data["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]


@pytest.mark.server
async def test_a_known_turn_whose_view_fails_is_served_and_the_slot_relearned(start_server, tmp_path):
    """The token view of a known turn fails after the request was forwarded (the server refused
    /tokenize, say): the answer is the server's own, relayed without ocache's figures; the slot's
    content is unknown to the table until GET /slots (never a wrong record), and the next turn is
    planned the usual way with exact figures."""
    srv = start_server("dense", n_parallel=2, ctx_size=2 * 16384, **SERVER)
    h = hdrs(A1)
    async with through_ocache(make_config(srv, tmp_path / "state")) as (base, proxy):
        async with aiohttp.ClientSession() as s:
            body = await _two_turns(s, base, proxy, h)
            layer = proxy.layer
            real_view = layer.viewer.view

            async def broken(*a, **kw):
                raise RuntimeError("view failed")

            layer.viewer.view = broken
            async with s.post(base + CHAT, json=body, headers=h) as r:
                assert r.status == 200 and r.headers.get("X-OCache-Path") == "known"
                assert "X-OCache-Predicted-Cache" not in r.headers
                slot = int(r.headers["X-OCache-Slot"])
                data = await r.json()
            await proxy.wait_background()
            layer.viewer.view = real_view
            assert layer.counters["known_failed"] == 1
            assert layer.table[slot].msg_key is None            # no record from a failed view
            nxt = await _served_as_alone(s, base, proxy, srv.url, h, body, data, "Third?")
            nxt = _next_turn(nxt, "ok", "Fourth?")
            async with s.post(base + CHAT, json=nxt, headers=h) as r:
                assert r.status == 200 and r.headers["X-OCache-Slot"] == str(slot)
                hn = dict(r.headers)
                t = (await r.json())["timings"]
            await proxy.wait_background()
            predicted = _predicted(proxy, hn)
            assert layer.counters["mispredictions"] == 0 and abs(predicted - t["cache_n"]) <= UB


@pytest.mark.server
async def test_a_resend_takes_the_known_path_before_the_template_is_checked(start_server, tmp_path):
    """The same request twice (a client's retry, a benchmark's repeated 1-token chat): the second is
    the known slot's own prompt whatever the template does, so it is forwarded at once even before
    any delta render checked the template; its figures are exact."""
    srv = start_server("dense", n_parallel=2, ctx_size=2 * 16384, **SERVER)
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 1, "temperature": 0}
    async with through_ocache(make_config(srv, tmp_path / "state")) as (base, proxy):
        async with aiohttp.ClientSession() as s:
            heads = []
            for _ in range(2):
                async with s.post(base + CHAT, json=body) as r:
                    assert r.status == 200
                    heads.append(dict(r.headers))
                    t = (await r.json())["timings"]
                await proxy.wait_background()
            assert not proxy.layer.viewer.append_only
            assert heads[0].get("X-OCache-Path") is None and heads[1].get("X-OCache-Path") == "known"
            assert heads[1]["X-OCache-Slot"] == heads[0]["X-OCache-Slot"]
            assert _predicted(proxy, heads[1]) == t["cache_n"] > 0


@pytest.mark.server
async def test_a_known_turn_too_long_for_the_slot_is_the_servers_400_and_keeps_the_slot(start_server, tmp_path):
    """A known conversation's next turn that does not fit the slot's context: forwarded on the
    known path (counted ``known``), answered with the server's own 400 (exceed_context_size_error),
    which refuses it before touching the slot's cache; an error answer carries no ocache header but
    its request id. It is counted ``too_long`` like on the usual path, not as a failure of the
    cache layer, and the slot keeps its record: the conversation's real next turn takes the known
    path again, with exact figures."""
    async with _third_turn_ready(start_server, tmp_path) as (s, base, proxy, srv, h, body):
        layer = proxy.layer
        assert layer.viewer.append_only
        known = layer.counters["known"]
        too_long = _next_turn(body, "ok", "word " * 12000)
        async with s.post(base + CHAT, json=too_long, headers=h) as r:
            assert r.status == 400, r.status
            assert [k for k in r.headers if k.lower().startswith("x-ocache-")] == ["X-OCache-Request-Id"], r.headers
            assert (await r.json())["error"]["type"] == "exceed_context_size_error"
        await proxy.wait_background()
        await layer.idle()
        assert layer.counters["known"] == known + 1
        assert layer.counters["too_long"] == 1 and layer.counters["known_failed"] == 0
        assert proxy.stats.to_dict()["layer_errors"] == {}
        before = await _prompt_total(s, srv.url)
        async with s.post(base + CHAT, json=body, headers=h) as r:
            assert r.status == 200 and r.headers.get("X-OCache-Path") == "known"
            hk = dict(r.headers)
            t = (await r.json())["timings"]
        await proxy.wait_background()
        predicted = _predicted(proxy, hk)
        assert layer.counters["known"] == 2 and layer.counters["mispredictions"] == 0
        assert abs(predicted - t["cache_n"]) <= UB and t["cache_n"] > 0
        assert await _prompt_total(s, srv.url) - before == t["prompt_n"]


@pytest.mark.server
async def test_a_view_the_server_contradicts_is_not_recorded_and_delta_renders_stop(start_server, tmp_path):
    """The token view of a turn is wrong (here: five tokens short, as a template that stopped being
    append-only after the delta checks would make it): the server's own prompt length in the answer
    (cache_n + prompt_n) says so. Nothing is recorded from that view (the slot is left to GET
    /slots, no tier admits the wrong tokens) and delta renders stop, so the next turn is viewed
    from a full render and planned with exact figures. Before: the wrong tokens were the slot's
    record and the next turn's base."""
    from ocache.tokens import TokenView

    async with _third_turn_ready(start_server, tmp_path) as (s, base, proxy, srv, h, body):
        layer = proxy.layer
        assert layer.viewer.append_only
        real_view = layer.viewer.view

        async def short(*a, **kw):
            v = await real_view(*a, **kw)
            return TokenView(v.tokens[:-5], v.head_end, v.user_starts, v.text, v.stats, v.msg_key, v.n_msgs)

        layer.viewer.view = short
        async with s.post(base + CHAT, json=body, headers=h) as r:
            assert r.status == 200
            slot = int(r.headers["X-OCache-Slot"])
            data = await r.json()
        await proxy.wait_background()
        await layer.idle()
        layer.viewer.view = real_view
        assert layer.counters["view_mismatches"] == 1 and not layer.viewer.append_only
        assert layer.table[slot].msg_key is None and layer.table[slot].foreign
        await _served_as_alone(s, base, proxy, srv.url, h, body, data, "Next?")
        assert layer.counters["view_mismatches"] == 1 and layer.counters["mispredictions"] == 0


@pytest.mark.server
@pytest.mark.parametrize("check", ["if_boot", "health", "stock"])
async def test_a_known_turn_is_checked_against_a_restart_with_the_fewest_round_trips(start_server, tmp_path,
                                                                                    check):
    """Before the server works on a known turn, it must be the process the slot table describes.
    ``if_boot``: the patched build checks that itself (patches/0007): the turn goes out at once,
    with no ``GET /health`` or ``GET /slots`` before it, naming the table's process in
    ``X-Llama-Server-If-Boot``; after a restart on the same port the new process refuses it with 412
    before any work (its prompt-token counter then counts only the turn's own prefill), ocache plans
    it again (``GET /slots`` sees the new process), and the client sees one answer whose predicted
    reuse is the server's ``cache_n``, with the greedy output of a cold prefill. ``health``: a patched
    build without 0007 gets one ``GET /health`` first (patches/0005). ``stock``: ``GET /slots``."""
    async with _third_turn_ready(start_server, tmp_path, check == "stock") as (s, base, proxy, srv, h, body):
        layer = proxy.layer
        if check == "health":
            layer.table.if_boot = False       # as a build without patches/0007 says in /props
        assert layer.table.if_boot == (check == "if_boot")
        events: list[str] = []
        real = layer.table.fetch_slots, layer.table.same_process, proxy.forwards.forward

        async def fetch_slots(*a, **kw):
            events.append("GET /slots")
            return await real[0](*a, **kw)

        async def same_process(*a, **kw):
            if layer.table.boot is not None:          # else it answers False without asking
                events.append("GET /health")
            return await real[1](*a, **kw)

        async def forward(*a, **kw):
            events.append("forward" + (" if-boot" if a[-1] else ""))
            return await real[2](*a, **kw)

        layer.table.fetch_slots, layer.table.same_process, proxy.forwards.forward = fetch_slots, same_process, forward
        reconciles = layer.counters["plan_reconciles"]
        async with s.post(base + CHAT, json=body, headers=h) as r:
            assert r.status == 200 and r.headers.get("X-OCache-Path") == "known"
            h3 = dict(r.headers)
            data = await r.json()
        await proxy.wait_background()
        await layer.idle()
        assert _predicted(proxy, h3) == data["timings"]["cache_n"] > 0
        first = events[:events.index("forward" + (" if-boot" if check == "if_boot" else ""))]
        assert first == {"if_boot": [], "health": ["GET /health"], "stock": ["GET /slots"]}[check], events
        assert layer.counters["known_if_boot"] == (check == "if_boot")
        assert layer.counters["known_boot_checked"] == (check == "health")
        assert layer.counters["plan_reconciles"] == reconciles + (check == "stock")
        assert layer.table.counters["boot_changed"] == 0
        if check == "stock":
            return

        nxt = _next_turn(body, data["choices"][0]["message"]["content"] or "ok", "After the restart?")
        srv.restart()
        events.clear()
        async with s.post(base + CHAT, json=nxt, headers=h) as r:
            assert r.status == 200 and r.headers.get("X-OCache-Path") is None
            hn = dict(r.headers)
            dn = await r.json()
        await proxy.wait_background()
        t = dn["timings"]
        assert int(hn["X-OCache-Predicted-Cache"]) == t["cache_n"]
        assert layer.counters["mispredictions"] == 0
        # the new process prefilled this turn once: the refused forward cost it nothing
        assert await _prompt_total(s, srv.url) == t["prompt_n"]
        ref = await cold(srv.url, nxt)
        assert dn["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]
        if check == "if_boot":
            assert events[0] == "forward if-boot", events          # no round trip before it
            assert "GET /slots" in events[1:events.index("forward")], events
            assert proxy.stats.to_dict()["stale_plans"] == 1
            # the answer of the plan made again still says ocache's own time before it (the
            # refused forward and the second plan included; before: the header was dropped)
            assert float(hn["X-OCache-Plan-Ms"]) > 0
        else:
            assert "GET /slots" in events[:events.index("forward")], events
            assert proxy.stats.to_dict()["stale_plans"] == 0
        layer.table.fetch_slots, layer.table.same_process, proxy.forwards.forward = real


@pytest.mark.server
async def test_a_restart_the_slot_table_sees_first_is_handled_once(start_server, tmp_path):
    """After a restart on the same port, a turn planned the usual way reads ``GET /slots`` and the
    slot table sees the new process before the upstream's own probe does. The probe then runs at
    once (``OCacheLayer.refresh``), and a later probe, finding the process the table already
    describes, does not empty the table again: before, the next probe wiped what ocache had learned
    about the new process since (the turn served there), so the conversation's next turn was not
    known (a newcomer's break test: "content now unknown", then server-placed turns)."""
    async with _third_turn_ready(start_server, tmp_path) as (s, base, proxy, srv, h, body):
        layer = proxy.layer
        srv.restart()
        layer.opt_known = False          # this turn takes the usual path (GET /slots first)
        try:
            async with s.post(base + CHAT, json=body, headers=h) as r:
                assert r.status == 200 and r.headers.get("X-OCache-Path") is None
                data = await r.json()
            await proxy.wait_background()
            await layer.idle()
        finally:
            layer.opt_known = True
        assert layer.table.counters["restarts_seen_in_slots"] == 1
        epoch = proxy.upstream.epoch
        await proxy.upstream.probe()         # the monitor's next probe: the same new process
        assert proxy.upstream.epoch == epoch
        nxt = _next_turn(body, data["choices"][0]["message"]["content"] or "ok", "And now?")
        async with s.post(base + CHAT, json=nxt, headers=h) as r:
            assert r.status == 200 and r.headers.get("X-OCache-Path") == "known", dict(r.headers)
            hn = dict(r.headers)
            dn = await r.json()
        await proxy.wait_background()
        assert _predicted(proxy, hn) == dn["timings"]["cache_n"] > 0
        assert layer.counters["mispredictions"] == 0


@pytest.mark.server
async def test_a_turn_sent_before_the_last_answer_was_recorded_waits_for_it_and_is_known(start_server, tmp_path,
                                                                                       monkeypatch):
    """An agent's tool loop sends the next turn the moment an answer ends, while the proxy still
    releases that answer's plan and records it (``observe``): the slot is pending. The next turn
    waits for that (``SlotTable.wait_settled``, bounded) and takes the known path, with exact
    figures; before, it was viewed and planned the usual way (``X-OCache-Path`` absent)."""
    import ocache.cache.routes.known as known_route
    from test_proxy import poll

    monkeypatch.setattr(known_route, "KNOWN_SETTLE_WAIT_S", 30.0)  # the mechanism, not the bound
    async with _third_turn_ready(start_server, tmp_path) as (s, base, proxy, srv, h, body):
        layer = proxy.layer
        gate = asyncio.Event()
        real_observe = layer.observe

        async def observe(*a, **kw):
            await asyncio.wait_for(gate.wait(), 30)
            return await real_observe(*a, **kw)

        layer.observe = observe
        async with s.post(base + CHAT, json=body, headers=h) as r:
            assert r.status == 200 and r.headers.get("X-OCache-Path") == "known"
            data = await r.json()
        nxt = _next_turn(body, data["choices"][0]["message"]["content"] or "ok", "And then?")

        async def send() -> tuple[dict, dict]:
            async with s.post(base + CHAT, json=nxt, headers=h) as r:
                assert r.status == 200
                return dict(r.headers), await r.json()

        task = asyncio.create_task(send())
        await poll(lambda: layer.counters["known_waits"] == 1, timeout=20, what="the turn waits")
        assert not task.done()
        gate.set()
        hn, dn = await asyncio.wait_for(task, 60)
        await proxy.wait_background()
        layer.observe = real_observe
        assert hn.get("X-OCache-Path") == "known" and layer.counters["known_waits_usual"] == 0
        assert _predicted(proxy, hn) == dn["timings"]["cache_n"] > 0
        assert layer.counters["mispredictions"] == 0


@pytest.mark.server
@pytest.mark.parametrize("check", ["health", "if_boot"])
async def test_a_known_turn_whose_reconcile_fails_after_a_restart_is_planned_as_usual(start_server, tmp_path,
                                                                                      check):
    """The restarted server's first ``GET /slots`` fails (measured by hand: a turn sent while the new
    process still loads its model gets ``GET /slots`` 503 ``Loading model``; the turn was then held,
    forwarded to slot 0 as a known turn of the dead process and prefilled whole, 7,366 tokens, with
    no figures, where the disk tier restored 7,234 of them). ``health`` (a build without
    patches/0007): a known turn whose reconcile fails is planned as usual. ``if_boot``: the new
    process refuses the turn (412) and the plan made again fails on that ``GET /slots``; it is
    planned once more. Either way that plan reads ``GET /slots`` again, sees the new process, and
    its predicted reuse is the server's ``cache_n``."""
    from ocache.slots import SlotError

    async with _third_turn_ready(start_server, tmp_path) as (s, base, proxy, srv, h, body):
        layer = proxy.layer
        if check == "health":
            layer.table.if_boot = False       # as a build without patches/0007 says in /props
        nxt = await known_turn_then_next(s, base, proxy, h, body, "After the restart?")
        real_fetch = layer.table.fetch_slots
        failed: list[int] = []

        async def fetch_slots(*a, **kw):
            if not failed:                  # the first GET /slots after the restart: still loading
                failed.append(1)
                raise SlotError("GET /slots: HTTP 503: 'Loading model'", 503, "unavailable_error")
            return await real_fetch(*a, **kw)

        srv.restart()
        layer.table.fetch_slots = fetch_slots
        try:
            async with s.post(base + CHAT, json=nxt, headers=h) as r:
                assert r.status == 200
                hn = dict(r.headers)
                t = (await r.json())["timings"]
            await proxy.wait_background()
        finally:
            layer.table.fetch_slots = real_fetch
        # seen by GET /health (0005), or by the server's 412 (0007)
        assert failed and layer.table.counters["boot_changed"] == (check == "health")
        assert hn.get("X-OCache-Path") is None and "X-OCache-Fail-Open" not in hn, hn
        assert int(hn["X-OCache-Predicted-Cache"]) == t["cache_n"] > 0, (hn, t)
        assert proxy.stats.to_dict()["stale_plans"] == (check == "if_boot")


@pytest.mark.server
async def test_a_clients_own_if_boot_header_is_the_servers_to_answer(start_server, tmp_path):
    """A client that sends its own ``X-Llama-Server-If-Boot`` (patches/0007) naming another process
    gets the server's own 412, as without ocache: before, a known turn's plan overwrote the
    client's value with the table's, so the server answered 200 to a precondition it should have
    refused (a newcomer's break test). The refused turn is not counted as a stale plan, and the
    next turn without the header is answered (greedy output of a cold prefill)."""
    async with _third_turn_ready(start_server, tmp_path) as (s, base, proxy, srv, h, body):
        async with s.post(srv.url + CHAT, json=body, headers={**h, "X-Llama-Server-If-Boot": "0" * 16}) as r:
            alone = (r.status, await r.json())
        assert alone[0] == 412
        async with s.post(base + CHAT, json=body, headers={**h, "X-Llama-Server-If-Boot": "0" * 16}) as r:
            assert (r.status, await r.json()) == alone
        await proxy.wait_background()
        await proxy.layer.idle()
        assert proxy.stats.to_dict()["stale_plans"] == 0
        async with s.post(base + CHAT, json=body, headers=h) as r:
            assert r.status == 200
            data = await r.json()
        ref = await cold(srv.url, body)
        assert data["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]
        assert proxy.layer.counters["mispredictions"] == 0
