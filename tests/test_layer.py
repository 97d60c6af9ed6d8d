"""The cache layer's own logic (plan, execute, observe) against the in-memory slot server of
``tests/fakes.py``: no llama-server, seconds (``pytest -m "not server"``)."""

from __future__ import annotations

import asyncio

import pytest

from fakes import CountingTier, make_layer, request, serve


async def _until(cond, what: str, bound: int = 10_000) -> None:
    """Yield to the event loop until ``cond()`` holds (bounded by a number of loop turns)."""
    for _ in range(bound):
        if cond():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never happened: {what}")


async def test_one_lookup_per_tier_per_request():
    tier = CountingTier()
    layer = make_layer(n_slots=2, tiers=[tier])
    toks = list(range(1, 301))
    await serve(layer, request(toks, "a"))
    assert tier.lookups == 1
    await serve(layer, request(toks + list(range(400, 450)), "b"))
    assert tier.lookups == 2
    assert layer.counters["planned"] == 2


async def test_one_lookup_per_tier_when_waiting_for_the_slot():
    """Two requests of the same conversation: the second waits for the first's lease; the slot
    changed meanwhile, so it plans again, from the same offers (no second lookup)."""
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
    assert tier.lookups == 2
    assert layer.counters["replans"] == 1
    assert plan_b.body_updates == {"id_slot": 0}
    assert plan_b.headers["X-OCache-Tier"] == "resident"
    await plan_b.release()


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
