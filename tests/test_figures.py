"""Figures that tell the truth: for every planned request, the cached tokens a
client reads equal the prompt tokens minus what the server itself prefilled for that request — the
delta of llama-server's own ``llamacpp:prompt_tokens_total`` (``/metrics``, the server runs with
``--metrics``), which counts ocache's split prefills and head warm-ups too.

Real parts: the patched llama-server on the tiny models (``-np 1``: no background head
re-establishment, so each delta belongs to one request), the in-process proxy with OCacheLayer and
its disk and session tiers, real opencode request bodies (helpers of tests/test_spill.py, ``-ub
128``; ``disk_min_tokens`` 1,024 and ``spill_min_tokens`` 2,000 so the tiny prompts take every path).
Paths covered, streamed and not, chat and ``/completion``: warm (the head prefilled by ocache in the
request) + split (the disk tier's anchor split), resident, spill (another session evicts) + restore
from the session tier, restore from a disk anchor after a server restart, and the repeat-line
anchor split of a raw ``/completion``.
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass

import aiohttp
import pytest

from ocache.api import figures
from ocache.config import Config

from test_spill import CHAT, SERVER, UB, body_of, forget_store, session_headers, through_ocache


async def prompt_total(s: aiohttp.ClientSession, url: str) -> int:
    async with s.get(url + "/metrics") as r:
        assert r.status == 200
        for line in (await r.text()).splitlines():
            if line.startswith("llamacpp:prompt_tokens_total "):
                return int(float(line.split()[1]))
    raise AssertionError("no llamacpp:prompt_tokens_total (is --metrics on?)")


@dataclass
class Rec:
    path: str
    stream: bool
    hdr: dict
    timings: dict
    usage: dict | None
    n_prompt: int
    delta: int          # server prefill for this request (its /metrics counter)

    @property
    def cached(self) -> int:
        """The cached tokens the client reads: usage.prompt_tokens_details.cached_tokens on the
        OpenAI routes, timings.cache_n on /completion."""
        if self.usage is not None:
            return self.usage["prompt_tokens_details"]["cached_tokens"]
        return self.timings["cache_n"]


async def metered(s, base: str, proxy, srv, path: str, body: dict, headers: dict | None = None) -> Rec:
    before = await prompt_total(s, srv.url)
    timings = usage = None
    n_prompt = None
    async with s.post(base + path, json=body, headers=headers or {}) as r:
        assert r.status == 200, await r.text()
        hdr = {k: v for k, v in r.headers.items() if k.startswith("X-OCache")}
        if body.get("stream"):
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                    continue
                obj = json.loads(line[5:])
                timings = obj.get("timings") or timings
                usage = obj.get("usage") or usage
                n_prompt = obj.get("tokens_evaluated", n_prompt)
        else:
            data = await r.json()
            timings, usage, n_prompt = data["timings"], data.get("usage"), data.get("tokens_evaluated")
    await proxy.wait_background()
    await proxy.layer.idle()
    await proxy.layer.disk_tier.flush()
    delta = await prompt_total(s, srv.url) - before
    if usage is not None:
        n_prompt = usage["prompt_tokens"]
    return Rec(path, bool(body.get("stream")), hdr, timings, usage, int(n_prompt), delta)


def check(rec: Rec) -> None:
    """The done-when rule, and the headers' meaning (computed from the plan: exact up to a
    misprediction of at most one ubatch)."""
    what = (rec.path, rec.stream, rec.hdr, rec.timings, rec.usage, rec.delta)
    print(f"{rec.path:22} stream={rec.stream!s:5} tier={rec.hdr['X-OCache-Tier']:8} "
          f"split={rec.hdr['X-OCache-Split']:>5} prompt={rec.n_prompt:5} server prefill={rec.delta:5} "
          f"cached={rec.cached:5} header prefilled={rec.hdr['X-OCache-Prefilled']}")
    assert rec.cached == rec.n_prompt - rec.delta, what
    assert rec.timings["cache_n"] == rec.n_prompt - rec.delta, what
    assert rec.timings["prompt_n"] == rec.delta, what
    assert abs(int(rec.hdr["X-OCache-Prefilled"]) - rec.delta) <= UB, what
    assert abs(int(rec.hdr["X-OCache-Reused"]) - (rec.n_prompt - rec.delta)) <= UB, what


def stream(body: dict) -> dict:
    b = copy.deepcopy(body)
    b["stream"] = True
    b["stream_options"] = {"include_usage": True}
    return b


def config(srv, cache) -> Config:
    return Config(upstream=srv.url, cache_dir=str(cache), spill_min_tokens=2000, disk_min_tokens=1024,
                  tiers={"resident": {"server_args": srv.command()[1:]}})


@pytest.mark.server
@pytest.mark.parametrize("model", ["dense", "hybrid"])
async def test_client_cached_tokens_equal_prompt_minus_server_prefill(start_server, tmp_path, model, caplog):
    srv = start_server(model, n_parallel=1, ctx_size=16384, **SERVER)
    a1, a2 = body_of("opencode_agent_turn1.json"), body_of("opencode_agent_turn1_after_tool.json")
    b1 = body_of("opencode_run3_proj2_agent_turn1.json")
    ha, hb = session_headers("opencode_agent_turn1.json"), session_headers("opencode_run3_proj2_agent_turn1.json")
    cache = tmp_path / "cache"
    recs: list[Rec] = []
    caplog.set_level(logging.INFO, logger="ocache.proxy")
    async with through_ocache(config(srv, cache)) as (base, proxy), aiohttp.ClientSession() as s:
        # warm + split: the head is prefilled by ocache, then the disk tier splits at the session start
        r = await metered(s, base, proxy, srv, CHAT, a1, ha)
        assert int(r.hdr["X-OCache-Split"]) > 0 and r.hdr["X-OCache-Tier"] == "cold", r.hdr
        assert r.cached == 0 and r.delta >= r.n_prompt  # nothing came from before this request
        recs.append(r)
        # resident, streamed: the next turn of the same session
        r = await metered(s, base, proxy, srv, CHAT, stream(a2), ha)
        assert r.hdr["X-OCache-Tier"] == "resident" and r.hdr["X-OCache-Split"] == "0", r.hdr
        recs.append(r)
        # another session takes the only slot (A is spilled), streamed: it reuses the harness head A
        # left there and gets its own session start split off
        r = await metered(s, base, proxy, srv, CHAT, stream(b1), hb)
        assert r.hdr["X-OCache-Tier"] in ("resident", "head", "disk") and int(r.hdr["X-OCache-Split"]) > 0, r.hdr
        recs.append(r)
        # A returns: restored from the session tier (B is spilled)
        a3 = copy.deepcopy(a2)
        a3["messages"].append({"role": "user", "content": "and one more thing"})
        r = await metered(s, base, proxy, srv, CHAT, a3, ha)
        assert r.hdr["X-OCache-Tier"] == "session", r.hdr
        recs.append(r)
        # raw /completion: a prompt prefilled cold twice gets a repeat anchor by a split
        p = " ".join(f"w{i}" for i in range(400))  # ~1.6k tokens: above the 1,024 grid line, below the spill minimum
        for body in ({"prompt": p, "n_predict": 2, "temperature": 0},
                     {"prompt": "something else entirely", "n_predict": 2, "temperature": 0}):
            recs.append(await metered(s, base, proxy, srv, "/completion", body))
        r = await metered(s, base, proxy, srv, "/completion", {"prompt": p + " w1 w2", "n_predict": 2,
                                                                "temperature": 0})
        assert int(r.hdr["X-OCache-Split"]) > 0, (r.hdr, proxy.layer.disk_tier.stats())
        recs.append(r)
        q = " ".join(f"v{i}" for i in range(400))
        for body in ({"prompt": q, "n_predict": 2, "temperature": 0},
                     {"prompt": "and something else", "n_predict": 2, "temperature": 0}):
            recs.append(await metered(s, base, proxy, srv, "/completion", body))
        r = await metered(s, base, proxy, srv, "/completion", {"prompt": q + " v1", "n_predict": 2,
                                                                "temperature": 0, "stream": True})
        assert int(r.hdr["X-OCache-Split"]) > 0, r.hdr
        recs.append(r)
        for r in recs:
            check(r)

        # /v1/cache/stats, /v1/cache/metrics and the log line read the same corrected figures
        async with s.get(base + "/v1/cache/stats") as resp:
            tok = (await resp.json())["tokens"]
        assert tok["cache_n"] == sum(r.cached for r in recs), tok
        assert tok["prefilled"] == tok["prompt_n"] == sum(r.delta for r in recs), tok
        assert tok["saved_vs_cold"] == sum(r.n_prompt - r.delta for r in recs), tok
        assert tok["split"] == sum(int(r.hdr["X-OCache-Split"]) for r in recs), tok
        async with s.get(base + "/v1/cache/metrics") as resp:
            prom = await resp.text()
        processed = sum(float(line.split()[-1]) for line in prom.splitlines()
                        if line.startswith("ocache_prompt_tokens_total{") and 'kind="processed"' in line)
        assert int(processed) == sum(r.delta for r in recs)
        first = recs[0]
        line = next(m.getMessage() for m in caplog.records
                    if m.getMessage().startswith(f"[{first.hdr['X-OCache-Request-Id']}]"))
        assert f"split {int(first.hdr['X-OCache-Split']):,}" in line and f"reused {first.cached:,}" in line, line

    # restores after a server restart (a new process, a new /metrics counter): A and B (streamed)
    # from their spilled conversations, a new session in A's folder from A's disk anchor or from
    # A's spill (its first turn is A's byte for byte: any session's spill is offered: tests/test_session_shared_spill.py)
    forget_store(cache)
    srv.restart()
    c1 = body_of("opencode_run2_agent_turn1.json")
    async with through_ocache(config(srv, cache)) as (base, proxy), aiohttp.ClientSession() as s:
        for body, h, tiers in ((a2, ha, ("disk", "session")), (stream(b1), hb, ("disk", "session")),
                               (c1, session_headers("opencode_run2_agent_turn1.json"), ("disk", "session"))):
            r = await metered(s, base, proxy, srv, CHAT, body, h)
            assert r.hdr["X-OCache-Tier"] in tiers and r.cached > 0, r.hdr
            check(r)


def test_rewrite_changes_only_the_figures():
    """The correction is textual and touches only the numbers after the figure keys: a generated
    text that spells them out is left alone, every other byte is the server's."""
    body = (b'{"choices":[{"message":{"content":"\\"cache_n\\":5, \\"prompt_n\\":3"}}],"usage":'
            b'{"completion_tokens":4,"prompt_tokens":7300,"total_tokens":7304,"prompt_tokens_details":'
            b'{"cached_tokens":7197}},"timings":{"cache_n":7197,"prompt_n":103,"prompt_ms":250.5,'
            b'"prompt_per_token_ms":2.43,"prompt_per_second":411.2,"predicted_n":4}}')
    out = json.loads(figures.rewrite(body, 7000, 3000.0))
    assert out["choices"][0]["message"]["content"] == '"cache_n":5, "prompt_n":3'
    assert out["usage"] == {"completion_tokens": 4, "prompt_tokens": 7300, "total_tokens": 7304,
                            "prompt_tokens_details": {"cached_tokens": 197}}
    t = out["timings"]
    assert (t["cache_n"], t["prompt_n"], t["prompt_ms"], t["predicted_n"]) == (197, 7103, 3250.5, 4)
    assert abs(t["prompt_per_second"] - 7103 / 3.2505) < 1e-6
    assert figures.rewrite(body, 0) is body
    # Anthropic usage (input_tokens = prompt - cached) and a Responses usage (input_tokens = prompt)
    anth = b'{"type":"message","usage":{"cache_read_input_tokens":7197,"input_tokens":103,"output_tokens":4}}'
    assert json.loads(figures.rewrite(anth, 7000))["usage"] == {"cache_read_input_tokens": 197,
                                                               "input_tokens": 7103, "output_tokens": 4}
    resp = b'{"usage":{"input_tokens":7300,"input_tokens_details":{"cached_tokens":7197},"output_tokens":4}}'
    assert json.loads(figures.rewrite(resp, 7000))["usage"] == {
        "input_tokens": 7300, "input_tokens_details": {"cached_tokens": 197}, "output_tokens": 4}
    lr = figures.LineRewriter(10)
    assert lr.feed(b'data: {"timings":{"cache_n":20,"prom') == b"" and lr.holding
    assert lr.feed(b'pt_n":5}}\n\ndata: [DONE]\n\n') == b'data: {"timings":{"cache_n":10,"prompt_n":15}}\n\ndata: [DONE]\n\n'
    assert not lr.holding and lr.flush() == b""


def test_a_plans_figures_are_written_once_and_read_as_values():
    """``Figures``: the plan's ``X-OCache-*`` headers are written from the value (``Plan.figures``,
    ``Plan.set_figures``), and every reader (``ocache/finish.py``, ``ocache/router.py``) reads the
    value (``Plan.read_figures``), never header strings parsed back."""
    from ocache.layer import Plan

    fig = figures.Figures(tier="disk", kind="agent", slot=1, predicted_cache=900, split=128, prefilled=228,
                          reused=900, restore_ms=12.3)
    plan = Plan(headers={"X-OCache-Path": "known"}, figures=fig)
    assert plan.headers == {"X-OCache-Path": "known", "X-OCache-Slot": "1", "X-OCache-Predicted-Cache": "900",
                            "X-OCache-Tier": "disk", "X-OCache-Kind": "agent", "X-OCache-Split": "128",
                            "X-OCache-Prefilled": "228", "X-OCache-Reused": "900", "X-OCache-Restore-Ms": "12.3"}
    assert plan.read_figures() is fig
    # a plan whose route gave no figures: none known (header strings are never parsed back)
    strings = Plan(headers={"X-OCache-Slot": "0", "X-OCache-Tier": "resident", "X-OCache-Prefilled": "40"})
    assert strings.read_figures() == figures.Figures()
    # the server-placed route's slot is a word; an unknown figure is not sent
    assert Plan(figures=figures.Figures(tier="none", kind="other", slot="server")).headers == {
        "X-OCache-Slot": "server", "X-OCache-Tier": "none", "X-OCache-Kind": "other"}
    known = Plan(figures=figures.Figures(kind="agent", slot=2))
    assert known.read_figures().prefilled is None    # the router counts 0 until its completion ran
    known.set_figures(figures.Figures(tier="cold", kind="agent", slot=2))
    assert known.headers["X-OCache-Tier"] == "cold" and known.read_figures().tier == "cold"
