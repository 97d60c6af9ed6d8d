"""The response cache on the real server (ocache/response_cache.py).

Real parts: the patched llama-server on the tiny dense model (``-np 1``, ``--metrics``), the
in-process proxy with OCacheLayer and ``response_cache: {enabled: true}``. What the server did for
a request is read from its own ``/metrics`` counters (``llamacpp:prompt_tokens_total``: tokens
prefilled, ``llamacpp:tokens_predicted_total``: tokens decoded), before and after.

* A repeated greedy request, on all four APIs (chat, completions, Anthropic messages, Responses),
  streamed and not, is answered with the stored answer: equal to the first answer but for its ids
  and timestamps and its figures (which say the whole prompt was reused, 0 prefilled, 0 decoded),
  ``X-OCache-Tier: response``, and the server prefilled and decoded nothing for it. On today's
  main (no response cache) the second request runs on the server: this fails.
* Two concurrent identical greedy requests make one upstream call: the slot's lease is held by the
  test until one of them waits for the other's answer (``ResponseCache.followed``), so they overlap
  by construction, not by timing.
* A non-greedy request is never served from it, and an error answer is never stored.
* Behind llama-server's ``--api-key``: an answer stored for a valid key is replayed only to that
  key; a request with no key, a wrong key, or the key in another header goes to the server and gets
  its 401 (or its 200: a valid key in ``X-Api-Key``), also while the valid request is in flight
  (it does not wait on it); an identical request with the valid key does.
"""

from __future__ import annotations

import asyncio
import copy
import json
from contextlib import asynccontextmanager

import aiohttp
import pytest

from ocache.api.refresh import ID_KEYS, TIME_KEYS
from ocache.config import Config
from ocache.response_cache import Lead

from conftest import through_ocache

pytestmark = pytest.mark.server

PROMPT = "Write one sentence about a small red boat on a quiet lake."
#: (route, greedy body) of each API; ``stream`` is added per case
CASES = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "temperature": 0,
                              "max_tokens": 12}),
    ("/v1/completions", {"prompt": PROMPT, "temperature": 0, "max_tokens": 12}),
    ("/v1/messages", {"model": "tiny", "max_tokens": 12, "temperature": 0,
                      "messages": [{"role": "user", "content": PROMPT}]}),
    ("/v1/responses", {"model": "tiny", "input": PROMPT, "temperature": 0, "max_output_tokens": 12}),
]


@asynccontextmanager
async def proxy_for(srv, tmp_path, admin_token=None, upstream_api_key=None, **rc):
    cfg = Config(upstream=srv.url, cache_dir=str(tmp_path / "cache"), admin_token=admin_token,
                 upstream_api_key=upstream_api_key, response_cache={"enabled": True, **rc},
                 tiers={"resident": {"server_args": srv.command()[1:]}})
    async with through_ocache(cfg) as (base, proxy), aiohttp.ClientSession() as s:
        yield base, proxy, s


async def work(s: aiohttp.ClientSession, url: str) -> tuple[int, int]:
    """(tokens prefilled, tokens decoded) so far by the server at ``url`` (its /metrics)."""
    got = {}
    async with s.get(url + "/metrics") as r:
        assert r.status == 200
        for line in (await r.text()).splitlines():
            name, _, value = line.partition(" ")
            if name in ("llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total"):
                got[name] = int(float(value))
    return got["llamacpp:prompt_tokens_total"], got["llamacpp:tokens_predicted_total"]


async def ask(s: aiohttp.ClientSession, base: str, path: str, body: dict,
              headers: dict | None = None) -> tuple[int, dict, list]:
    """(status, X-OCache-* headers, the answer as a list of JSON objects: the body, or each SSE
    ``data:`` object in order, ``"[DONE]"`` kept as a string)."""
    async with s.post(base + path, json=body, headers=headers) as r:
        hdr = {k: v for k, v in r.headers.items() if k.startswith("X-OCache")}
        raw = await r.read()
        if not r.headers.get("Content-Type", "").startswith("text/event-stream"):
            return r.status, hdr, [json.loads(raw)]
        events = []
        for line in raw.split(b"\n"):
            if line.startswith(b"data:"):
                text = line[5:].strip()
                events.append(text.decode() if text == b"[DONE]" else json.loads(text))
        return r.status, hdr, events


def normal(v, key=None):
    """``v`` with its ids and timestamps blanked and its figures (``timings``, the cached counts of
    ``usage``) taken out: what must be equal between a stored answer and its replay."""
    if isinstance(v, dict):
        out = {}
        for k, x in v.items():
            if k == "timings":
                continue
            if k == "usage" and isinstance(x, dict):
                x = {uk: uv for uk, uv in x.items() if uk not in (
                    "prompt_tokens_details", "input_tokens_details", "cache_read_input_tokens",
                    "input_tokens" if "cache_read_input_tokens" in x else "")}
            out[k] = normal(x, k)
        return out
    if isinstance(v, list):
        return [normal(x) for x in v]
    if key in ID_KEYS and isinstance(v, str):
        return "<id>"
    if key in TIME_KEYS and isinstance(v, (int, float)):
        return 0
    return v


def figures_of(events: list) -> tuple[dict | None, list[dict]]:
    """(the last ``timings``, every ``usage``) found anywhere in the answer."""
    timings, usages = None, []

    def walk(v):
        nonlocal timings
        if isinstance(v, dict):
            for k, x in v.items():
                if k == "timings" and isinstance(x, dict):
                    timings = x
                elif k == "usage" and isinstance(x, dict):
                    usages.append(x)
                else:
                    walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)
    walk(events)
    return timings, usages


def first_id(events: list) -> str | None:
    for e in events:
        if isinstance(e, dict):
            if isinstance(e.get("id"), str):
                return e["id"]
            for sub in ("message", "response"):
                if isinstance(e.get(sub), dict) and isinstance(e[sub].get("id"), str):
                    return e[sub]["id"]
    return None


async def test_repeated_greedy_request_is_replayed_on_every_api(start_server, tmp_path):
    srv = start_server("dense", n_parallel=1, ctx_size=4096)
    async with proxy_for(srv, tmp_path) as (base, proxy, s):
        for path, greedy_body in CASES:
            for stream in (False, True):
                body = copy.deepcopy(greedy_body)
                if stream:
                    body["stream"] = True
                    if path in ("/v1/chat/completions", "/v1/completions"):
                        body["stream_options"] = {"include_usage": True}
                case = (path, stream)
                st1, h1, a1 = await ask(s, base, path, body)
                assert st1 == 200 and h1["X-OCache-Tier"] != "response", (case, h1, a1)
                before = await work(s, srv.url)
                st2, h2, a2 = await ask(s, base, path, body)
                after = await work(s, srv.url)
                assert st2 == 200 and h2["X-OCache-Tier"] == "response", (case, h2)
                assert after == before, (case, "the server prefilled/decoded for a replay", before, after)
                assert (h2["X-OCache-Prefilled"], h2["X-OCache-Split"]) == ("0", "0"), (case, h2)
                # the stored answer, ids and timestamps (and the figures) aside
                assert normal(a2) == normal(a1), case
                assert first_id(a2) != first_id(a1) and first_id(a2) is not None, case
                timings, usages = figures_of(a2)
                n_prompt = int(h2["X-OCache-Reused"])
                t1, _ = figures_of(a1)
                if t1 is not None:   # the server's own prompt length: cache_n + prompt_n
                    assert n_prompt == t1["cache_n"] + t1["prompt_n"], case
                if timings is not None:
                    assert (timings["prompt_n"], timings["cache_n"], timings["predicted_n"]) == \
                        (0, n_prompt, 0), (case, timings)
                assert usages, case
                for u in usages:
                    if "prompt_tokens_details" in u:
                        assert u["prompt_tokens_details"]["cached_tokens"] == u["prompt_tokens"], (case, u)
                    if "input_tokens_details" in u:
                        assert u["input_tokens_details"]["cached_tokens"] == u["input_tokens"], (case, u)
                    if "cache_read_input_tokens" in u:
                        assert (u.get("input_tokens", 0), u["cache_read_input_tokens"]) == (0, n_prompt), (case, u)
        rc = proxy.responses.stats()
        assert rc["hits"] == len(CASES) * 2 and rc["stored"] == len(CASES) * 2, rc
        assert rc["entries"] == len(CASES) * 2 and rc["bytes"] > 0, rc
        async with s.get(base + "/v1/cache/stats") as r:
            assert (await r.json())["response_cache"]["hits"] == rc["hits"]
        per_tier = proxy.stats.to_dict()
        assert "response" in json.dumps(per_tier), per_tier


async def test_clear_route_empties_the_response_cache(start_server, tmp_path):
    srv = start_server("dense", n_parallel=1, ctx_size=4096)
    path, body = CASES[0]
    auth = {"Authorization": "Bearer t0k"}
    async with proxy_for(srv, tmp_path, admin_token="t0k") as (base, proxy, s):
        await ask(s, base, path, body)
        assert (await ask(s, base, path, body))[1]["X-OCache-Tier"] == "response"
        async with s.post(base + "/v1/cache/clear?tier=response", headers=auth) as r:
            assert r.status == 200 and await r.json() == {"tier": "response", "cleared": 1}
        before = await work(s, srv.url)
        st, hdr, _ = await ask(s, base, path, body)
        assert st == 200 and hdr["X-OCache-Tier"] != "response"
        assert (await work(s, srv.url))[1] > before[1]          # decoded again
        async with s.post(base + "/v1/cache/clear?tier=all", headers=auth) as r:
            assert r.status == 200 and (await r.json())["response"] == 1
        assert proxy.responses.stats()["entries"] == 0


async def test_concurrent_identical_requests_make_one_upstream_call(start_server, tmp_path):
    srv = start_server("dense", n_parallel=1, ctx_size=4096)
    path, body = CASES[0]
    async with proxy_for(srv, tmp_path) as (base, proxy, s):
        # the layer gets ready (its slot table) on a first, other request
        st, _, _ = await ask(s, base, path, {**body, "messages": [{"role": "user", "content": "hello"}]})
        assert st == 200
        await proxy.wait_background()
        await proxy.layer.idle()
        before = await work(s, srv.url)
        lock = proxy.layer.table.lock(0)      # -np 1: no plan gets past the lease while held
        await lock.acquire()
        proxy.responses.followed.clear()
        try:
            both = [asyncio.create_task(ask(s, base, path, body)) for _ in range(2)]
            await asyncio.wait_for(proxy.responses.followed.wait(), 60)
            assert proxy.responses.stats()["answering"] == 1
        finally:
            lock.release()
        (st1, h1, a1), (st2, h2, a2) = await asyncio.wait_for(asyncio.gather(*both), 120)
        after = await work(s, srv.url)
        assert st1 == st2 == 200
        tiers = sorted([h1["X-OCache-Tier"], h2["X-OCache-Tier"]])
        assert tiers.count("response") == 1, tiers
        upstream = a1 if h1["X-OCache-Tier"] != "response" else a2
        t = upstream[0]["timings"]
        # one prefill and one decode on the server: the upstream answer's own
        assert after[0] - before[0] == t["prompt_n"], (before, after, t)
        assert after[1] - before[1] == t["predicted_n"], (before, after, t)
        assert normal(a1) == normal(a2)
        rc = proxy.responses.stats()
        assert rc["coalesced"] == 1 and rc["answering"] == 0, rc


async def test_non_greedy_never_served_and_errors_never_stored(start_server, tmp_path):
    srv = start_server("dense", n_parallel=1, ctx_size=4096)
    path, body = CASES[0]
    async with proxy_for(srv, tmp_path) as (base, proxy, s):
        sampled = {**body, "temperature": 0.9, "seed": 3}     # the same seed: still not served
        for temp_body in (sampled, sampled, {k: v for k, v in body.items() if k != "temperature"}):
            before = await work(s, srv.url)
            st, hdr, _ = await ask(s, base, path, temp_body)
            assert st == 200 and hdr["X-OCache-Tier"] != "response", hdr
            assert (await work(s, srv.url))[1] > before[1]      # decoded on the server
        rc = proxy.responses.stats()
        assert rc["not_greedy"] == 3 and rc["entries"] == 0 and rc["hits"] == 0, rc
        # a greedy body the server refuses after its token view was built (a grammar it cannot parse)
        bad = {**body, "grammar": "root ::= ("}
        for _ in range(2):
            st, hdr, answer = await ask(s, base, path, bad)
            assert st >= 400 and hdr.get("X-OCache-Tier") != "response", (st, answer)
        rc = proxy.responses.stats()
        assert rc["misses"] == 2 and rc["not_stored"] == 2 and rc["entries"] == 0, rc


KEY = "rc-sekret"
VALID = {"Authorization": f"Bearer {KEY}"}


async def test_a_stored_answer_is_replayed_only_to_its_credentials(start_server, tmp_path):
    srv = start_server("dense", n_parallel=1, ctx_size=4096, api_key=KEY)
    path, body = CASES[0]
    async with proxy_for(srv, tmp_path, upstream_api_key=KEY) as (base, proxy, s):
        st, hdr, _ = await ask(s, base, path, body, VALID)
        assert st == 200 and hdr["X-OCache-Tier"] != "response", hdr
        assert proxy.responses.stats()["stored"] == 1
        refused = [{}, {"Authorization": "Bearer wrong"}, {"X-Api-Key": "wrong"},
                   {"Authorization": KEY[::-1], "X-Api-Key": KEY}]   # Authorization is read first
        for headers in refused:
            st, hdr, answer = await ask(s, base, path, body, headers)
            async with s.post(srv.url + path, json=body, headers=headers) as r:  # the server's own
                direct = r.status, await r.json()
            assert direct[0] == 401, (headers, direct)
            assert (st, answer) == (401, [direct[1]]) and hdr.get("X-OCache-Tier") != "response", \
                (headers, st, hdr, answer)
        st, hdr, _ = await ask(s, base, path, body, VALID)
        assert st == 200 and hdr["X-OCache-Tier"] == "response", hdr
        # the valid key in the other header: the server accepts it; another entry, then replayed
        for tier in ("upstream", "response"):
            st, hdr, _ = await ask(s, base, path, body, {"X-Api-Key": KEY})
            assert st == 200 and (hdr["X-OCache-Tier"] == "response") == (tier == "response"), (tier, hdr)
        rc = proxy.responses.stats()
        assert (rc["hits"], rc["stored"], rc["entries"]) == (2, 2, 2), rc
        # the refused never reached the cache (ocache asked the server first: no lookup, no token
        # view for them): the two misses are the valid key's first requests in each header
        assert (rc["misses"], rc["not_stored"]) == (2, 0), rc


async def test_a_request_without_the_key_never_waits_on_one_with_it(start_server, tmp_path):
    srv = start_server("dense", n_parallel=1, ctx_size=4096, api_key=KEY)
    path, body = CASES[0]
    async with proxy_for(srv, tmp_path, upstream_api_key=KEY) as (base, proxy, s):
        st, _, _ = await ask(s, base, path, {**body, "messages": [{"role": "user", "content": "hello"}]},
                             VALID)
        assert st == 200
        await proxy.wait_background()
        await proxy.layer.idle()
        # each request's way out of the response cache: a Lead (it answers its key upstream)
        out: asyncio.Queue = asyncio.Queue()
        serve = proxy.responses.serve

        async def spy(p, att):
            got = await serve(p, att)
            out.put_nowait(got)
            return got

        proxy.responses.serve = spy
        followed = proxy.responses.followed
        lock = proxy.layer.table.lock(0)      # -np 1: no plan gets past the lease while held
        await lock.acquire()
        tasks = []
        try:
            tasks.append(asyncio.create_task(ask(s, base, path, body, VALID)))
            leader = await asyncio.wait_for(out.get(), 60)
            assert isinstance(leader, Lead), leader
            followed.clear()
            waits = asyncio.create_task(followed.wait())
            # no key: refused by the server's key check before the cache, so it is answered (the
            # server's 401) while the valid one is still held, and the cache never sees it
            st2, h2, a2 = await asyncio.wait_for(ask(s, base, path, body), 60)
            assert not followed.is_set() and out.empty(), "the key-less request went into the cache"
            assert proxy.responses.stats()["answering"] == 1
            tasks.append(asyncio.create_task(ask(s, base, path, body, VALID)))  # the valid key again
            await asyncio.wait_for(waits, 60)
            assert proxy.responses.counters["coalesced"] == 1
        finally:
            lock.release()
            results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 120)
        (st1, h1, _), (st3, h3, _) = results
        assert st1 == 200 and h1["X-OCache-Tier"] != "response", h1
        assert st2 == 401 and h2.get("X-OCache-Tier") != "response", (st2, h2, a2)
        assert a2[0]["error"]["type"] == "authentication_error", a2
        assert st3 == 200 and h3["X-OCache-Tier"] == "response", h3
        rc = proxy.responses.stats()
        # stored: the first request ("hello") and the valid one; the 401 never in the cache
        assert (rc["coalesced"], rc["stored"], rc["not_stored"], rc["answering"]) == (1, 2, 0, 0), rc
