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
