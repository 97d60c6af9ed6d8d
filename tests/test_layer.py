"""The cache layer's own logic (plan, execute, observe) against the in-memory slot server of
``tests/fakes.py``: no llama-server, seconds (``pytest -m "not server"``)."""

from __future__ import annotations

import asyncio

import pytest

from fakes import CountingTier, make_layer, request, serve, until as _until


async def test_one_lookup_per_tier_per_request():
    tier = CountingTier()
    layer = make_layer(n_slots=2, tiers=[tier])
    toks = list(range(1, 301))
    await serve(layer, request(toks, "a"))
    assert tier.lookups == 1
    await serve(layer, request(toks + list(range(400, 450)), "b"))
    assert tier.lookups == 2
    assert layer.counters["planned"] == 2


async def test_a_plan_made_again_after_the_wait_asks_the_tiers_again():
    """Two requests of the same conversation: the second waits for the first's lease; the slot
    changed meanwhile, so it plans again and asks every tier again (what the first request wrote
    is offered); a plan that found its slot free asks once."""
    from ocache.layer import Observation

    tier = CountingTier()
    layer = make_layer(n_slots=1, tiers=[tier])
    toks = list(range(1, 301))
    a = request(toks, "a", session="s")
    plan_a = await layer.plan(a)
    assert tier.lookups == 1
    table = layer.table
    b = request(toks + list(range(500, 520)), "b", session="s")
    task_b = asyncio.ensure_future(layer.plan(b))
    await _until(lambda: tier.lookups == 2 and table.lock(0).locked() and table.lock(0)._waiters,
                 "b waits for slot 0's lease")
    timings = table.complete(0, toks, 1)
    await plan_a.release()
    await layer.observe(a, plan_a, Observation(200, True, timings))
    plan_b = await asyncio.wait_for(task_b, 10)
    assert tier.lookups == 3
    assert layer.counters["replans"] == 1
    assert plan_b.body_updates == {"id_slot": 0}
    assert plan_b.headers["X-OCache-Tier"] == "resident"
    await plan_b.release()


class SpillingTier(CountingTier):
    """The session tier's part in a burst: ``before_evict`` saves the evicted slot's conversation
    (a slot file on the fake server, keyed by its owner) once ``gate`` is set; ``lookup`` offers the
    saved conversation sharing the longest prefix with the request (past ``floor`` tokens)."""

    name = "spill"

    def __init__(self, table, floor: int) -> None:
        super().__init__()
        self.table = table
        self.floor = floor
        self.gate = asyncio.Event()
        self.gate.set()
        self.evicting = asyncio.Event()
        self.saved: dict[str, list[int]] = {}

    def will_spill(self, slot):
        st = self.table[slot]
        return st.owner is not None and len(st.tokens) > self.floor

    async def before_evict(self, slot):
        st = self.table[slot]
        if st.owner is None:
            return
        self.evicting.set()
        await self.gate.wait()
        name = f"oc-s-{st.owner}.bin"
        await self.table.save(slot, name)
        self.saved[name] = list(st.tokens)

    async def lookup(self, view, ctx):
        from ocache.llama.reuse import common_prefix
        from ocache.tiers.base import Offer

        self.lookups += 1
        best = max(((common_prefix(t, view.tokens), n) for n, t in self.saved.items()), default=None)
        if best is None or best[0] <= self.floor:
            return None
        return Offer(self.name, min(best[0], len(view.tokens) - 1), 0.0, ref=best[1], verified=True)

    async def bring(self, offer, slot):
        await self.table.restore(slot, offer.ref, tokens=self.saved[offer.ref])


class SharedAnchorTier(CountingTier):
    """A disk anchor every session shares: the first ``len(head)`` tokens (a harness head)."""

    name = "anchor"

    def __init__(self, table, head: list[int]) -> None:
        super().__init__()
        self.table = table
        self.head = head
        table.files["oc-a-head.bin"] = list(head)

    async def lookup(self, view, ctx):
        from ocache.tiers.base import Offer

        self.lookups += 1
        if view.tokens[:len(self.head)] != self.head:
            return None
        return Offer(self.name, len(self.head), 0.0, ref="oc-a-head.bin", verified=True)

    async def bring(self, offer, slot):
        await self.table.restore(slot, offer.ref, tokens=self.head)


async def test_a_turn_whose_conversation_is_spilled_while_it_waits_comes_back_from_the_spill():
    """A burst on one slot: conversation A's next turn is looked up while A is still resident, then
    waits for the slot's lease, which B's request holds while it spills A (B's eviction). The re-plan
    after the wait asks the tiers again and restores A's own spill, prefilling only the new turn;
    planned from the lookups before the wait, it came back from the shared anchor (the head) and
    prefilled A's whole conversation again."""
    from ocache.layer import Observation

    head = list(range(1, 201))
    layer = make_layer(n_slots=1)
    table = layer.table
    spill, anchor = SpillingTier(table, floor=len(head)), SharedAnchorTier(table, head)
    layer.add_tier(spill)
    layer.add_tier(anchor)
    conv_a = head + list(range(1000, 1600))
    await serve(layer, request(conv_a, "a1", session="a"))
    assert table[0].owner is not None and table[0].tokens[:len(conv_a)] == conv_a

    spill.gate.clear()                                   # B's eviction of A stops before the save
    b = request(head + list(range(3000, 3600)), "b", session="b")
    task_b = asyncio.ensure_future(layer.plan(b))
    await asyncio.wait_for(spill.evicting.wait(), 10)    # B holds slot 0 and is evicting A
    a2 = request(conv_a + list(range(1700, 1720)), "a2", session="a")
    looked = spill.lookups
    task_a2 = asyncio.ensure_future(layer.plan(a2))
    await _until(lambda: spill.lookups == looked + 1 and table.lock(0)._waiters,
                 "A's next turn looked up and waits for slot 0's lease")
    assert not spill.saved                               # its lookup could not see a spill of A
    spill.gate.set()
    plan_b = await asyncio.wait_for(task_b, 10)
    assert list(spill.saved.values()) == [conv_a]
    timings_b = table.complete(0, b.body["prompt"], 1)
    await plan_b.release()
    await layer.observe(b, plan_b, Observation(200, True, timings_b))

    plan_a2 = await asyncio.wait_for(task_a2, 10)
    assert plan_a2.headers["X-OCache-Tier"] == "spill", plan_a2.headers
    timings = table.complete(0, a2.body["prompt"], 1)
    await plan_a2.release()
    await layer.observe(a2, plan_a2, Observation(200, True, timings))
    assert timings["prompt_n"] == 20                     # the new turn only, not A again
    assert layer.counters["mispredictions"] == 0


class RefusedFileTier(CountingTier):
    """Offers a long prefix whose slot file the server refuses (400): the patched pre-check leaves
    the slot as it was."""

    name = "refused"

    def __init__(self, table, usable: int) -> None:
        super().__init__()
        self.table = table
        self.usable = usable

    async def lookup(self, view, ctx):
        from ocache.tiers.base import Offer

        self.lookups += 1
        return Offer(self.name, self.usable, 0.0, verified=True)

    async def bring(self, offer, slot):
        await self.table.restore(slot, "oc-a-refused.bin", tokens=[1] * offer.tokens_usable)


async def test_a_failed_bring_leaves_the_slot_as_the_restore_found_it():
    """SlotTable.restore asks the server after a refused file; the slot it found intact is served
    from (before: the layer cleared it, predicted a cold prefill, and the server's reuse was a
    counted misprediction)."""
    layer = make_layer(n_slots=1)
    first = list(range(1, 601))
    await serve(layer, request(first, "a", session="s"))
    tier = RefusedFileTier(layer.table, 1500)
    layer.add_tier(tier)
    plan, timings = await serve(layer, request(first + list(range(1000, 2000)), "b", session="s"))
    assert layer.counters["bring_failures"] == 1
    assert timings["cache_n"] == 600
    assert plan.headers["X-OCache-Tier"] == "resident"
    assert plan.headers["X-OCache-Reused"] == "600"
    assert layer.counters["mispredictions"] == 0


def _slot_reads(table) -> int:
    return sum(1 for c in table.calls if c == ("GET", "/slots"))


async def test_a_plan_reads_get_slots_only_when_the_table_cannot_vouch(monkeypatch):
    """With a reconcile age bound (the default is 0: every plan reads GET /slots, see
    ``RECONCILE_MAX_AGE_S``), a plan reads it only when the table cannot vouch for a slot."""
    from ocache.cache import core

    monkeypatch.setattr(core, "RECONCILE_MAX_AGE_S", 60.0)
    layer = make_layer(n_slots=2)
    toks = list(range(1, 301))
    await serve(layer, request(toks, "a", session="s"))
    await layer.idle()                        # the reconcile after the response ran
    table = layer.table
    assert table[0].n_total == 300 or table[1].n_total == 300
    n0 = _slot_reads(table)
    plan = await layer.plan(request(toks + [7] * 20, "b", session="s"))
    assert _slot_reads(table) == n0           # nothing to reconcile: no GET /slots before forwarding
    table.complete(plan.body_updates["id_slot"], toks + [7] * 20)   # its prefill ran, then it was cut
    await plan.release()
    # a slot whose response was cut short: the table cannot vouch for its count
    table.interrupted(plan.body_updates["id_slot"], table[plan.body_updates["id_slot"]].seq)
    plan = await layer.plan(request(toks + [7] * 40, "c", session="s"))
    assert _slot_reads(table) == n0 + 1
    await plan.release()


async def test_a_restart_inside_the_probe_window_is_seen_once_the_reconcile_is_old():
    """The server restarted (id_task went back) and the upstream probe has not said so: a plan
    after ``RECONCILE_MAX_AGE_S`` reads GET /slots, sees the restart, and plans cold."""
    from ocache.cache import core

    layer = make_layer(n_slots=1)
    toks = list(range(1, 301))
    await serve(layer, request(toks, "a", session="s"))
    await serve(layer, request(toks + [5] * 10, "a2", session="s"))
    await layer.idle()
    table = layer.table
    table.restart()
    table.reconciled_at -= core.RECONCILE_MAX_AGE_S + 1
    plan, timings = await serve(layer, request(toks + [5] * 30, "b", session="s"))
    assert table.counters["restarts_seen_in_slots"] == 1
    assert plan.headers["X-OCache-Tier"] == "cold"
    assert timings["cache_n"] == 0
    assert layer.counters["mispredictions"] == 0


async def test_a_plan_cancelled_while_waiting_for_the_lease_leaves_the_slot_free():
    tier = CountingTier()
    layer = make_layer(n_slots=1, tiers=[tier])
    toks = list(range(1, 301))
    plan_a = await layer.plan(request(toks, "a"))
    table = layer.table
    task_b = asyncio.ensure_future(layer.plan(request(toks, "b")))
    await _until(lambda: table.lock(0)._waiters, "b waits for the lease")
    task_b.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task_b
    await plan_a.release()
    assert not table.lock(0).locked()
    plan_c = await asyncio.wait_for(layer.plan(request(toks, "c")), 10)
    assert plan_c.body_updates == {"id_slot": 0}
    await plan_c.release()


async def test_a_cut_short_or_rejected_response_leaves_the_slot_unvouched():
    from ocache.layer import Observation

    layer = make_layer(n_slots=2)
    toks = list(range(1, 301))
    req = request(toks, "a")
    plan = await layer.plan(req)
    slot = plan.body_updates["id_slot"]
    await plan.release()
    await layer.observe(req, plan, Observation(200, False, None))        # client went away
    st = layer.table[slot]
    assert (st.tokens, st.n_total, st.pending) == (toks, None, True)
    req2 = request(toks + [3] * 5, "b")
    plan2 = await layer.plan(req2)
    slot2 = plan2.body_updates["id_slot"]
    await plan2.release()
    await layer.observe(req2, plan2, Observation(400, True, None))       # rejected
    st = layer.table[slot2]
    assert st.foreign and st.tokens == []
    assert layer.counters["failed_responses"] == 2


async def test_drain_tells_every_tier_about_each_live_conversation():
    tier = CountingTier()
    layer = make_layer(n_slots=2, tiers=[tier])
    await serve(layer, request(list(range(1, 301)), "a", session="s1"))
    await serve(layer, request(list(range(1000, 1400)), "b", session="s2"))
    await layer.drain()
    assert sorted(tier.evicts) == [0, 1]
    assert tier.admits == 2


async def test_a_slot_call_on_a_reset_connection_is_sent_once_more():
    """ECONNRESET on the send (a pooled keep-alive connection the server had closed): the call is
    sent again once (every slot call is idempotent); a second reset is an UpstreamError."""
    import contextlib
    import errno

    import aiohttp

    from ocache.slots import SlotTable, UpstreamError

    class Resp:
        status = 200

        async def json(self, content_type=None):
            return [{"id": 0, "n_ctx": 4096}]

    class Session:
        def __init__(self, resets: int) -> None:
            self.resets, self.calls = resets, 0

        @contextlib.asynccontextmanager
        async def _req(self):
            self.calls += 1
            if self.calls <= self.resets:
                raise aiohttp.ClientOSError(errno.ECONNRESET, "Connection reset by peer")
            yield Resp()

        def request(self, *a, **kw):
            return self._req()

    s = Session(resets=1)
    assert await SlotTable(s, "http://x").fetch_slots() == [{"id": 0, "n_ctx": 4096}]
    assert s.calls == 2
    s = Session(resets=2)
    with pytest.raises(UpstreamError):
        await SlotTable(s, "http://x").fetch_slots()
    assert s.calls == 2


def test_the_disk_tiers_anchor_lines_are_a_declared_step_of_the_plan():
    from ocache.cache import RequestContext, plan_request
    from ocache.llama.flags import ServerParams
    from ocache.slots import SlotState
    from ocache.tiers.disk import DiskConfig, DiskTier

    params = ServerParams(n_slots=1, n_ctx_slot=16384, cache_ram=0, checkpoints=False)
    toks = list(range(1, 6001))
    lines = ((1024, "repeat"), (4096, "head"), (5120, "session"))
    dec = plan_request(toks, [SlotState(0, n_ctx=16384)], [], RequestContext(), params, anchors=lines)
    assert dec.steps[-1] == "anchors" and dec.anchors == lines
    assert "anchors" not in plan_request(toks, [SlotState(0, n_ctx=16384)], [], RequestContext(), params).steps
    tier = DiskTier(None, None, DiskConfig(max_anchors_per_request=2))   # lines_above is pure
    assert tier.lines_above(lines, 0) == [(4096, "head"), (5120, "session")]
    assert tier.lines_above(lines, 4096) == [(5120, "session")]
    assert tier.lines_above(lines, 6000) == []


async def test_a_restart_seen_in_slots_keeps_what_a_request_of_the_new_process_left():
    """A request ran on the new process before the table saw the restart: the reconcile after its
    response keeps that slot (the server reports its task and the count ocache recorded) and empties
    the others. Before: every slot was emptied and the next turn restored from a tier what the slot
    already held (bench restart_mid_session, tiny dense: prefilled 156 where the server alone
    prefilled 48)."""
    layer = make_layer(n_slots=2)
    table = layer.table
    a, b = list(range(1, 301)), list(range(2000, 2400))
    await serve(layer, request(a, "a", session="s1"))
    await serve(layer, request(b, "b", session="s2"))
    await layer.idle()
    slot_a = next(s.id for s in table.slots if s.owner == "s1")
    table.restart()
    table.held[slot_a] = []                      # (the new process holds nothing yet)
    plan, timings = await serve(layer, request(a + [9] * 20, "a2", session="s1"))   # planned stale
    assert plan.body_updates["id_slot"] == slot_a and timings["cache_n"] == 0
    await layer.idle()                           # the reconcile after it sees the restart
    assert table.counters["restarts_seen_in_slots"] == 1
    assert table[slot_a].tokens == a + [9] * 20 and table[slot_a].n_total == len(a) + 20
    assert table[1 - slot_a].tokens == [] and table[1 - slot_a].n_total == 0
    plan, timings = await serve(layer, request(a + [9] * 20 + [8] * 10, "a3", session="s1"))
    assert plan.headers["X-OCache-Tier"] == "resident" and timings["cache_n"] == len(a) + 20


async def test_get_slots_reconciles_a_slot_the_table_cannot_vouch_for():
    """``SlotTable.refresh`` corrects an idle slot's belief from ``GET /slots``. Before, sizing the
    table rewrote every slot's ``n_ctx`` on each call, which bumped each slot's version, so the
    reconcile took every slot for "changed while GET /slots was in flight" and corrected none."""
    from fakes import FakeSlotTable

    table = FakeSlotTable(n_slots=2)
    await table.refresh()
    table.held[0], table.ran[0] = list(range(50)), True
    table._task(0)
    table.mark_unknown(0)                 # e.g. a step stopped part way: the count is unknown
    await table.refresh()
    assert table[0].n_total == 50 and table[0].foreign
