"""``ocache stats``' "vs cold" line (``dashboard.view`` ``totals.saved``): Σ prompt tokens minus what
the server prefilled, ocache's own steps included, with each request's split prefill counted once.

The figures a request reports are already corrected for its split (ocache/api/figures.py:
``cache_n`` loses it, ``prompt_n`` gains it), so "reused" is net of it. The old view subtracted the
head warm-ups (``layer.warmup_tokens``) from it again, and did not subtract what ocache prefilled
outside any request (``ocache warm``): on a day with a head warm-up it showed less than the truth.

No server: a day on the in-memory server of ``tests/fakes.py`` (its ``/completion`` answers with
the dense model's reuse), every prefill it does summed as llama-server's ``prompt_tokens_total``
would be, the requests counted by the real ``Stats`` with the real correction."""

from __future__ import annotations

import pytest

from ocache import dashboard
from ocache.api.figures import correct_timings
from ocache.commands import top
from ocache.stats import Stats

from fakes import FakeSlotTable

PATH = "/v1/chat/completions"


def toks(n: int, seed: int) -> list[int]:
    return [seed * 100_000 + i for i in range(n)]


async def test_vs_cold_counts_the_split_once_and_what_ocache_prefilled_outside_requests():
    table = FakeSlotTable(n_slots=2, n_ctx=16384)
    await table.refresh()                       # learn the two slots from the fake's GET /slots
    server_prefill = 0      # llama-server's prompt_tokens_total over the day
    prompts = 0             # Σ prompt tokens of the requests the clients sent
    stats = Stats()

    async def own(slot: int, tokens: list[int]) -> int:
        nonlocal server_prefill
        t = await table.warm(slot, tokens)
        server_prefill += t["prompt_n"]
        return t["prompt_n"]

    def request(slot: int, prompt: list[int], split: int) -> None:
        nonlocal server_prefill, prompts
        raw = table.complete(slot, prompt)
        server_prefill += raw["prompt_n"]
        prompts += len(prompt)
        stats.completion(PATH, "cold", correct_timings(raw, split), None, {"n_prompt": len(prompt)},
                         split=split)

    a = toks(8000, 1)
    warm = await own(0, a[:6000])               # the harness head's warm-up, for request 1
    request(0, a, split=warm)
    request(0, a + toks(100, 2), split=0)       # the next turn: resident
    c = toks(4000, 3)
    await own(1, c[:3000])                      # `ocache warm DIR`: no request's split
    anchor = await own(1, c[:3500])             # an anchor split, for request 3
    request(1, c, split=anchor)

    true_vs_cold = prompts - server_prefill
    assert (prompts, server_prefill, true_vs_cold) == (20_100, 12_100, 8_000)
    body = {**stats.to_dict(), "layer": {"warmup_tokens": warm, "table": dict(table.counters)}}
    t = dashboard.view(body)["totals"]
    assert t["saved"] == true_vs_cold, t          # the old view: 11,000 - 6,000 = 5,000
    assert (t["reused"], t["split"], t["own_prefill"], t["own_outside"]) == (11_000, 6_500, 9_500, 3_000)
    line = next(x for x in top.summary_lines(dashboard.view(body), "http://x") if x.startswith("vs cold"))
    assert line.startswith("vs cold 8,000 tokens") and "minus 3,000 ocache prefilled outside" in line, line

    # several servers: the router's rows carry each server's table, summed
    rows = [{"layer": {"table": {"own_prefill_tokens": 6000}}}, {"layer": {"table": {"own_prefill_tokens": 3500}}}]
    routed = {**stats.to_dict(), "layer": {"table": {"own_prefill_tokens": 6000}, "router": {"servers": rows}}}
    assert dashboard.view(routed)["totals"]["saved"] == true_vs_cold


@pytest.mark.server
async def test_vs_cold_equals_the_server_counter_on_a_day_of_splits_and_restores(start_server, tmp_path):
    """The real server (hybrid, ``-np 1``: each prefill belongs to a request or to ocache's own
    steps), through the in-process ocache: a head warm-up with an anchor split, a resident turn,
    another session (the first is spilled), the first again (restored from the session tier). The
    view's "vs cold" is Σ prompt tokens minus the growth of llama-server's own
    ``llamacpp:prompt_tokens_total`` over the day."""
    import copy

    import aiohttp

    from test_figures import config, metered, prompt_total, stream
    from test_spill import CHAT, SERVER, body_of, session_headers, through_ocache

    srv = start_server("hybrid", n_parallel=1, ctx_size=16384, **SERVER)
    a1, a2 = body_of("opencode_agent_turn1.json"), body_of("opencode_agent_turn1_after_tool.json")
    b1 = body_of("opencode_run3_proj2_agent_turn1.json")
    ha, hb = session_headers("opencode_agent_turn1.json"), session_headers("opencode_run3_proj2_agent_turn1.json")
    a3 = copy.deepcopy(a2)
    a3["messages"].append({"role": "user", "content": "and one more thing"})
    async with through_ocache(config(srv, tmp_path / "cache")) as (base, proxy), aiohttp.ClientSession() as s:
        day0 = await prompt_total(s, srv.url)
        recs = [await metered(s, base, proxy, srv, CHAT, body, h)
                for body, h in ((a1, ha), (stream(a2), ha), (stream(b1), hb), (a3, ha))]
        day = await prompt_total(s, srv.url) - day0
        async with s.get(base + "/v1/cache/stats") as r:
            body = await r.json()
    tiers = [r.hdr["X-OCache-Tier"] for r in recs]
    assert int(recs[0].hdr["X-OCache-Split"]) > 0 and tiers[3] == "session", [r.hdr for r in recs]
    t = dashboard.view(body)["totals"]
    assert t["saved"] == sum(r.n_prompt for r in recs) - day, (t, day, [r.n_prompt for r in recs])
    assert t["split"] > 0 and t["own_prefill"] >= t["split"], t
