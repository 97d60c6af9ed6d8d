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
