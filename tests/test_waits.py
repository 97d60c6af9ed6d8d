"""Bounded waits in the request path, on the real llama-server (tiny models).

In front of a server whose slots ocache does not know (it started after other clients used the
server), a request is forwarded without ``id_slot`` (the server-placed route) and ocache held every
slot's lease until it ended: a 4-token chat waited 6.56 s behind a 1,500-token generation (0.24 s
direct), and behind an agent's 32,000-token output it would wait for all of it.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from test_hardening_proxy import chat, proxy_on
from test_proxy import client

FOREIGN = " ".join(f"word{i}" for i in range(300))   # a conversation ocache never saw


@pytest.mark.server
async def test_request_beside_a_server_placed_generation_does_not_wait_for_it(start_server, tmp_path):
    """A long stream the server placed itself (``X-OCache-Slot: server``) is running; a short chat
    through ocache is answered while it still runs (on the other slot), not after it. On the old
    code the chat waited for every lease, so for the whole generation (tens of seconds here: the
    slot's 16k context filled by ``ignore_eos``), and the long stream ended first."""
    srv = await asyncio.to_thread(start_server, "dense", n_parallel=2, ctx_size=2 * 16384)
    tiers = {"resident": {"server_args": ["-np", "2", "--slot-save-path", str(tmp_path / "slots")]}}
    async with client() as c:
        async with c.post(srv.url + "/v1/chat/completions",
                          json=chat(FOREIGN, max_tokens=2, id_slot=1)) as r:   # before ocache
            assert r.status == 200
        async with proxy_on(srv.url, admin_token="tok", probe_interval_s=0.5, tiers=tiers) as (base, proxy):
            long = chat(FOREIGN, max_tokens=100000, ignore_eos=True, stream=True)
            stream = await c.post(base + "/v1/chat/completions", json=long)
            try:
                assert stream.status == 200 and stream.headers["X-OCache-Slot"] == "server"
                await asyncio.wait_for(stream.content.readline(), 60)     # it runs
                async with c.post(base + "/v1/chat/completions", json=chat("hi", max_tokens=4),
                                  timeout=120) as r:
                    assert r.status == 200
                    slot = r.headers["X-OCache-Slot"]
                    json.loads(await r.read())
                assert not stream.content.at_eof()             # the long one still runs
                async with c.get(srv.url + "/slots") as r:
                    busy = [s["id"] for s in await r.json() if s["is_processing"]]
                assert busy and slot not in {str(b) for b in busy}
            finally:
                stream.close()


@pytest.mark.server
async def test_a_body_larger_than_any_context_gets_the_servers_answer_at_once(start_server, caplog):
    """A 50 MB chat body (far more bytes than the slot context can hold as tokens): ocache builds
    no token view of it (``attempts.too_large``) and answers the 400 llama-server gives (it took 60 s
    on this machine to tokenize it first) at once, counted as ``unplannable: size``, nothing
    forwarded, no error logged. On the old code the view spent its whole 120 s bound, then logged an
    error with a traceback (this test's 30 s bound fails first)."""
    import logging

    srv = await asyncio.to_thread(start_server, "dense", n_parallel=1)
    raw = json.dumps(chat("word " * (10 << 20), max_tokens=1)).encode()
    assert len(raw) > 50 << 20
    async with proxy_on(srv.url, probe_interval_s=0.5) as (base, proxy), client() as c:
        async with c.post(base + "/v1/chat/completions", data=raw,
                          headers={"Content-Type": "application/json"}, timeout=30) as r:
            status = r.status
            answer = await r.json()
        await proxy.wait_background()
        assert proxy.stats.to_dict()["unplannable"] == {"size": 1}
    assert status == 400 and answer["error"]["type"] == "exceed_context_size_error", answer
    assert not [x for x in caplog.records if x.levelno >= logging.ERROR]


@pytest.mark.server
async def test_a_request_whose_best_slot_is_generating_takes_the_idle_one(start_server, tmp_path):
    """Two identical long generations through ocache on ``-np 2``, the second sent once the first
    runs: the second's best slot is the first's (the same prompt), busy with a generation that does
    not end; it runs on the other slot (at the latest after ``usual.LEASE_WAIT_S``, the bounded lease
    wait) and both run together. Guards the bound; it passes on the code before it too (the planner
    already preferred the idle slot here: the unbounded wait needs the first to hold every lease)."""
    from ocache.cache.routes.usual import LEASE_WAIT_S

    srv = await asyncio.to_thread(start_server, "dense", n_parallel=2, ctx_size=2 * 16384)
    tiers = {"resident": {"server_args": ["-np", "2", "--slot-save-path", str(tmp_path / "slots")]}}
    long = chat("Count.", max_tokens=100000, ignore_eos=True, stream=True)
    async with proxy_on(srv.url, admin_token="tok", probe_interval_s=0.5, tiers=tiers) as (base, proxy), \
            client() as c:
        first = await c.post(base + "/v1/chat/completions", json=long)
        second = None
        try:
            await asyncio.wait_for(first.content.readline(), 60)
            second = await asyncio.wait_for(c.post(base + "/v1/chat/completions", json=long),
                                            LEASE_WAIT_S + 60)
            assert second.status == 200
            await asyncio.wait_for(second.content.readline(), 60)
            assert second.headers["X-OCache-Slot"] != first.headers["X-OCache-Slot"]
            async with c.get(srv.url + "/slots") as r:
                assert all(s["is_processing"] for s in await r.json())
        finally:
            first.close()
            if second is not None:
                second.close()
