"""The live ``leases_held`` figure of the slot table (``SlotTable.counters``, reported by
``OCacheLayer.stats()["table"]`` and so by ``/v1/cache/stats``): how many ``SlotLease``s are held
right now. 0 when idle, whatever the requests before did (served, cancelled while waiting for a
lease, cancelled while bringing a prefix); > 0 exactly while a plan holds a slot. The cache layer
over the in-memory slot server of ``tests/fakes.py`` (no llama-server: a cancellation at a chosen
await), and once end to end: the real llama-server, the in-process proxy, ``GET /v1/cache/stats``."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from fakes import CountingTier, make_layer, request, serve, until as _until
from ocache.config import Config
from ocache.slots import SlotStates


async def finish(layer, req, plan) -> None:
    """What the proxy does after forwarding ``req``: the fake server runs it, then release, observe."""
    from ocache.layer import Observation

    timings = layer.table.complete(plan.body_updates["id_slot"], req.body["prompt"], 1)
    await plan.release()
    await layer.observe(req, plan, Observation(200, True, timings))


def held(layer) -> int:
    assert layer.table.counters["leases_held"] == layer.stats()["table"]["leases_held"]
    return layer.table.counters["leases_held"]


async def test_a_lease_counts_while_held_and_once():
    t = SlotStates()
    t._ensure(2)
    a = await t.lease(0)
    b = await t.lease(1)
    assert t.counters["leases_held"] == 2
    a.release()
    a.release()                                   # idempotent: counted back once
    assert t.counters["leases_held"] == 1
    async with b:
        pass
    assert t.counters["leases_held"] == 0 and not t.lock(1).locked()


class BlockingTier(CountingTier):
    """Offers a prefix and blocks in ``bring`` until cancelled (``entered`` set once it waits)."""

    name = "blocking"

    def __init__(self) -> None:
        super().__init__()
        self.entered = asyncio.Event()

    async def lookup(self, view, ctx):
        from ocache.tiers.base import Offer

        self.lookups += 1
        return Offer(self.name, len(view.tokens) - 10, 0.0, verified=True)

    async def bring(self, offer, slot):
        self.entered.set()
        await asyncio.Event().wait()              # until the plan is cancelled


async def test_leases_held_is_zero_when_idle_and_counts_a_held_slot():
    layer = make_layer(n_slots=2)
    toks = list(range(1, 301))
    assert held(layer) == 0
    await serve(layer, request(toks, "a", session="s"))
    await serve(layer, request(toks + list(range(400, 450)), "b", session="s"))
    await layer.idle()
    assert held(layer) == 0
    c, d = request(toks + list(range(400, 480)), "c", session="s"), request(list(range(5000, 5300)), "d", session="t")
    plan_c = await layer.plan(c)
    assert held(layer) == 1                       # the request holds its slot until release
    plan_d = await layer.plan(d)
    assert held(layer) == 2
    await finish(layer, c, plan_c)
    assert held(layer) == 1
    await finish(layer, d, plan_d)
    await layer.idle()
    assert held(layer) == 0


async def test_leases_held_returns_to_zero_after_cancelled_plans():
    layer = make_layer(n_slots=1)
    toks = list(range(1, 301))
    await serve(layer, request(toks, "a", session="s"))
    # a plan cancelled while it waits for the slot another request holds
    b = request(toks + [7] * 20, "b", session="s")
    holder = await layer.plan(b)
    waiter = asyncio.ensure_future(layer.plan(request(toks + [7] * 40, "c", session="s")))
    await _until(lambda: bool(layer.table.lock(0)._waiters), "c waits for slot 0's lease")
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert held(layer) == 1
    await finish(layer, b, holder)
    await layer.idle()
    assert held(layer) == 0
    # a plan cancelled while it holds the slot (bringing a prefix into it)
    tier = BlockingTier()
    layer.add_tier(tier)
    task = asyncio.ensure_future(layer.plan(request(list(range(2000, 2600)), "d", session="u")))
    await asyncio.wait_for(tier.entered.wait(), 10)
    assert held(layer) == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await layer.idle()
    assert held(layer) == 0 and not layer.table.lock(0).locked()


async def stats_leases(s: aiohttp.ClientSession, base: str) -> int:
    async with s.get(base + "/v1/cache/stats") as r:
        assert r.status == 200
        return (await r.json())["layer"]["table"]["leases_held"]


@pytest.mark.server
async def test_cache_stats_read_no_lease_held_when_idle(start_server, tmp_path):
    """``GET /v1/cache/stats`` through the real proxy: ``table.leases_held`` reads 0 after a
    request, 1 while a streamed answer is open (its plan holds the slot until the response ends),
    and 0 again after the client left that stream part way."""
    from test_spill import SERVER, through_ocache

    srv = start_server("dense", n_parallel=2, ctx_size=8192, **SERVER)
    cfg = Config(upstream=srv.url, cache_dir=str(tmp_path / "cache"),
                 tiers={"resident": {"server_args": srv.command()[1:]}})
    prompt = " ".join(f"w{i}" for i in range(300))
    async with through_ocache(cfg) as (base, proxy), aiohttp.ClientSession() as s:
        async with s.post(base + "/completion", json={"prompt": prompt, "n_predict": 4, "temperature": 0}) as r:
            assert r.status == 200
            await r.read()
        await proxy.wait_background()
        await proxy.layer.idle()
        assert await stats_leases(s, base) == 0
        body = {"prompt": prompt + " more", "n_predict": 400, "temperature": 0, "stream": True}
        async with s.post(base + "/completion", json=body) as r:
            assert r.status == 200
            async for line in r.content:
                if line.startswith(b"data: {"):
                    break                          # the answer streams: the plan holds its slot
            assert await stats_leases(s, base) == 1
            r.close()                              # the client goes away mid-stream
        assert await proxy.wait_idle(60)
        await proxy.wait_background()
        await proxy.layer.idle()
        assert await stats_leases(s, base) == 0
