"""Three conversations' next turns in one burst on ``-np 2`` (the hybrid tiny model, the real patched
llama-server, the in-process proxy): no request prefills more than the server alone would for it plus
one ubatch, in each of ``RUNS`` runs.

The first turns are sent one after another, so the third evicts (spills) one of the first two. The
next turns then arrive together: one of them finds its conversation spilled and evicts another
conversation whose own next turn is in the same burst; that turn was looked up before its
conversation was spilled and waited for the slot's lease. Planned from those lookups it came back
from whatever the lookups offered (the harness head, another conversation's anchor) and prefilled
its conversation again; the re-plan after the wait asks the tiers again (``ocache/cache/routes/usual.py``).

"Alone" is measured on the same server: each conversation's two turns sent straight to slot 0 after
an erase, the second turn's ``timings.prompt_n``. ocache's prefill of a request is the server's
``prompt_n`` plus what ocache prefilled itself before forwarding it (``X-OCache-Split``).
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from test_spill import CHAT, SERVER, UB, make_config, session_turn1, session_turn2, through_ocache

#: runs of the burst (each on a fresh ocache and cache folder, the server's slots erased)
RUNS = 5
#: conversations in the burst, on two slots
N = 3
#: seconds any one request may take before the test fails (the tiny model answers in well under one)
REQUEST_BOUND_S = 120


async def _post(s: aiohttp.ClientSession, url: str, body: dict, headers: dict | None = None) -> tuple[dict, dict]:
    async with s.post(url + CHAT, json=body, headers=headers or {},
                      timeout=aiohttp.ClientTimeout(total=REQUEST_BOUND_S)) as r:
        data = await r.json()
        assert r.status == 200, data
        return data, dict(r.headers)


async def _erase(s: aiohttp.ClientSession, url: str, n_slots: int) -> None:
    for i in range(n_slots):
        async with s.post(f"{url}/slots/{i}?action=erase", json={}) as r:
            assert r.status == 200, await r.text()


async def _alone(s: aiohttp.ClientSession, url: str, first: dict, second: dict) -> int:
    """The server alone: both turns on slot 0 after an erase; the second turn's prefill."""
    await _erase(s, url, 2)
    await _post(s, url, dict(first, id_slot=0))
    data, _ = await _post(s, url, dict(second, id_slot=0))
    return int(data["timings"]["prompt_n"])


@pytest.mark.server
async def test_three_next_turns_in_one_burst_prefill_no_more_than_alone(start_server, tmp_path):
    srv = start_server("hybrid", n_parallel=2, ctx_size=2 * 4096, **SERVER)
    firsts = [session_turn1(i) for i in range(N)]
    hdr = [{"x-session-affinity": f"ses_burst_{i}"} for i in range(N)]
    seconds: list[dict] | None = None
    runs: list[list[tuple[int, str | None]]] = []
    async with aiohttp.ClientSession() as s:
        for run in range(RUNS):
            await _erase(s, srv.url, 2)
            cfg = make_config(srv, tmp_path / f"cache{run}", 200)
            async with through_ocache(cfg) as (base, proxy):
                answers = []
                for i in range(N):
                    data, _ = await _post(s, base, firsts[i], hdr[i])
                    await asyncio.wait_for(proxy.wait_background(), REQUEST_BOUND_S)
                    await asyncio.wait_for(proxy.layer.idle(), REQUEST_BOUND_S)
                    answers.append(data)
                turn2 = [session_turn2(i, firsts[i], answers[i]) for i in range(N)]
                if seconds is None:
                    seconds = turn2
                assert turn2 == seconds, "greedy first answers differ between runs"
                got = await asyncio.gather(*(_post(s, base, turn2[i], hdr[i]) for i in range(N)))
                runs.append([(int(d["timings"]["prompt_n"]) + int(h.get("X-OCache-Split", 0)),
                              h.get("X-OCache-Tier")) for d, h in got])
                await asyncio.wait_for(proxy.wait_background(), REQUEST_BOUND_S)
                assert proxy.layer.counters["bring_failures"] == 0
        assert seconds is not None
        alone = [await _alone(s, srv.url, firsts[i], seconds[i]) for i in range(N)]
    over = [(run, i, p, tier, alone[i]) for run, r in enumerate(runs) for i, (p, tier) in enumerate(r)
            if p > alone[i] + UB]
    assert not over, f"(run, conversation, prefilled, tier, alone): {over}; all runs: {runs}"
