"""Every release of a plan is a receipt spent once (``ocache.layer.Receipt``).

The contract (``ocache/layer.py``): ``release`` is called exactly once per plan. The real-server
test reproduces the confirmed defect: a client that leaves while the proxy plans its request again
after the server's 412 (another process than the one the plan was made for, patches/0007) had its
refused plan released twice: once when the proxy ended it, again by the finish path, which still
held it. The second release of a known turn marks its slot unknown without holding the slot's
lease (``OCacheLayer._plan_known``'s release), wiping the record of whichever request holds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp
import pytest

from ocache.layer import Plan, ReceiptLedger

from test_hardening_cache import CHAT
from test_known_turn import _third_turn_ready, known_turn_then_next


# --------------------------------------------------------------------------- the receipt (no server)

async def test_a_receipt_calls_release_once_and_counts_a_second_spend(caplog):
    calls: list[str] = []

    async def release() -> None:
        calls.append("release")

    ledger = ReceiptLedger()
    plan = Plan(release=release)
    receipt = ledger.take(plan)
    assert ledger.take(plan) is receipt          # one receipt per plan, however often it is taken
    assert ledger.held == 1 and not receipt.spent
    assert await receipt.spend() is True
    assert calls == ["release"] and ledger.held == 0 and ledger.repeats == 0
    with caplog.at_level(logging.WARNING, logger="ocache.layer"):
        assert await receipt.spend() is False    # no second call into the layer
    assert calls == ["release"] and ledger.held == 0 and ledger.repeats == 1
    assert any("released again" in r.getMessage() for r in caplog.records)


async def test_a_receipt_is_spent_before_release_runs_so_a_cancelled_release_is_not_run_again():
    """A release cancelled part way (the client left while it waited) is spent: the finish path's
    later spend is the no-op, never a second call."""
    started, never = asyncio.Event(), asyncio.Event()
    calls = 0

    async def release() -> None:
        nonlocal calls
        calls += 1
        started.set()
        await asyncio.wait_for(never.wait(), 30)

    ledger = ReceiptLedger()
    receipt = ledger.take(Plan(release=release))
    task = asyncio.create_task(receipt.spend())
    await asyncio.wait_for(started.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await receipt.spend() is False
    assert calls == 1 and ledger.held == 0 and ledger.repeats == 1


async def test_a_plan_without_release_is_spent_too():
    ledger = ReceiptLedger()
    receipt = ledger.take(Plan())
    assert ledger.held == 1
    assert await receipt.spend() is True and ledger.held == 0
    assert await receipt.spend() is False and ledger.repeats == 1


async def test_a_release_that_raises_is_spent():
    async def release() -> None:
        raise RuntimeError("boom")

    ledger = ReceiptLedger()
    receipt = ledger.take(Plan(release=release))
    with pytest.raises(RuntimeError):
        await receipt.spend()
    assert receipt.spent and ledger.held == 0


# --------------------------------------------------------------------------- against the server

@pytest.mark.server
async def test_a_client_that_leaves_while_its_turn_is_planned_again_is_released_once(start_server, tmp_path):
    """Turn 4 of a known conversation after a restart on the same port: the new process refuses
    the known turn's precondition (412), the proxy ends that plan and plans the request again, and
    the client leaves during that second plan. The refused plan's ``release`` runs once (before the
    fix: twice, the second from the finish path), and no plan is left unreleased."""
    async with _third_turn_ready(start_server, tmp_path) as (s, base, proxy, srv, h, body):
        layer = proxy.layer
        assert layer.table.if_boot               # the patched build checks the process itself
        nxt = await known_turn_then_next(s, base, proxy, h, body, "After the restart?")

        real_plan = layer.plan
        releases: list[list[str]] = []            # per plan made: its release calls
        replanning, never = asyncio.Event(), asyncio.Event()

        async def plan(req):
            if releases:                          # the plan made again after the 412
                replanning.set()
                await asyncio.wait_for(never.wait(), 30)   # the client leaves meanwhile
            made = await real_plan(req)
            inner, calls = made.release, []
            releases.append(calls)

            async def release() -> None:
                calls.append(req.request_id)
                if inner is not None:
                    await inner()

            made.release = release
            return made

        async def send() -> None:
            async with s.post(base + CHAT, json=nxt, headers=h) as r:
                await r.read()

        srv.restart()
        layer.plan = plan
        try:
            task = asyncio.create_task(send())
            await asyncio.wait_for(replanning.wait(), 60)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                await task
            assert await proxy.wait_idle(30)
            await proxy.wait_background()
        finally:
            layer.plan = real_plan
        assert proxy.stats.to_dict()["stale_plans"] == 1
        assert len(releases) == 1 and len(releases[0]) == 1, releases
        assert proxy.stats_body()["plans"] == {"held": 0, "repeated_releases": 0}


@pytest.mark.server
async def test_a_refused_connection_whose_plan_made_again_fails_is_released_once(start_server, tmp_path):
    """Two servers; the plan names one that refuses the connection (nothing listens on its port),
    so the request is planned again for the others (``Attempts._reroute``), and that plan fails:
    the client gets ocache's 503 naming the refused server. The first plan was ended there
    (released, observed as a 503); before the fix the finish path, still holding it, released it
    a second time."""
    from aiohttp.test_utils import TestServer

    from ocache.config import Config
    from ocache.layer import NullLayer
    from ocache.llama.server import free_port
    from ocache.proxy import RUNNER_KWARGS, Proxy

    srv = await asyncio.to_thread(start_server, "dense")
    closed = f"http://127.0.0.1:{free_port()}"
    proxy = Proxy(Config(upstream=srv.url, upstreams=[srv.url, closed]), layer_factory=NullLayer,
                  monitor=False)
    server = TestServer(proxy.make_app(), host="127.0.0.1")
    await server.start_server(**RUNNER_KWARGS)
    releases: list[str] = []
    plans = 0

    async def release() -> None:
        releases.append("release")

    async def plan(req):
        nonlocal plans
        plans += 1
        if plans > 1:
            raise RuntimeError("the plan made again fails")
        return Plan(upstream=proxy.upstreams[1].base_url, release=release)

    try:
        assert proxy.upstreams[0].state == "ready"
        proxy.layer.plan = plan
        async with aiohttp.ClientSession() as s:
            async with s.post(f"http://127.0.0.1:{server.port}/v1/chat/completions",
                              json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}) as r:
                assert r.status == 503
                assert r.headers["X-OCache-Upstream"] == proxy.upstreams[1].base_url
        await proxy.wait_background()
        assert plans == 2
        assert releases == ["release"]
        assert proxy.stats_body()["plans"] == {"held": 0, "repeated_releases": 0}
    finally:
        await server.close()
