"""Complete means complete: a response whose final event was written is complete,
even when the client closes its socket right after it.

The client is the real python-requests (``stream=True``, ``iter_lines()``, ``break`` at the final
line, then the ``with`` block closes the socket) — what cache-pressure 0.6.3 does. The server is the
real patched llama-server on the tiny dense model, through the in-process proxy with OCacheLayer
(helpers of tests/test_spill.py, same server settings and the lowered spill threshold). One test
drives a fake upstream that holds the stream open after its final event: the only way to make the
client's close land, every time, before the upstream's end of stream (with a real server the
order is a race, lost 11 times in 18 in a cache-pressure run).
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import requests
from aiohttp import web
from aiohttp.test_utils import TestServer

from ocache.config import Config
from ocache.layer import NullLayer
from ocache.proxy import RUNNER_KWARGS, Proxy

from test_spill import CHAT, SERVER, body_of, make_config, send, session_headers, through_ocache, tier_of



def stream_then_close(url: str, body: dict, headers: dict, last: bytes | None) -> list[bytes]:
    """python-requests: read the SSE lines until ``last`` (a line equal to it; None: a line holding
    ``"stop":true``), then leave the ``with`` block, which closes the connection at once."""
    got: list[bytes] = []
    with requests.post(url, json=body, headers=headers, stream=True, timeout=120) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if not line:
                continue
            got.append(line)
            if (line == last) if last is not None else b'"stop":true' in line:
                break
    return got


@pytest.mark.server
async def test_client_closing_right_after_done_is_complete_and_spilled(start_server, tmp_path):
    """-np 1. Conversation A is streamed to a client that closes right after ``data: [DONE]``, on
    the chat route, then on ``/completion`` (final event ``"stop": true``); each is observed as a
    complete response. Then B takes the only slot: A is spilled like any complete conversation."""
    srv = start_server("dense", n_parallel=1, ctx_size=16384, **SERVER)
    a1 = body_of("opencode_agent_turn1.json", max_tokens=8)
    a1["stream"] = True
    ha = session_headers("opencode_agent_turn1.json")
    b1 = body_of("opencode_run3_proj2_agent_turn1.json")
    hb = session_headers("opencode_run3_proj2_agent_turn1.json")
    cfg = make_config(srv, tmp_path / "cache", 2000)
    async with through_ocache(cfg) as (base, proxy), aiohttp.ClientSession() as s:
        rounds = 3
        for _ in range(rounds):
            lines = await asyncio.to_thread(stream_then_close, base + CHAT, a1, ha, b"data: [DONE]")
            assert lines[-1] == b"data: [DONE]"
            assert await proxy.wait_idle(60)
            await proxy.wait_background()
        raw = {"prompt": "The quick brown fox " * 40, "n_predict": 4, "stream": True, "temperature": 0}
        lines = await asyncio.to_thread(stream_then_close, base + "/completion", raw, {}, None)
        assert b'"stop":true' in lines[-1]
        assert await proxy.wait_idle(60)
        await proxy.wait_background()
        c = proxy.layer.counters
        assert c["failed_responses"] == 0 and c["observed"] == rounds + 1, c
        assert proxy.stats.to_dict()["client_disconnects"] == 0
        assert all(r["completed"] for r in proxy.stats.last_completions), proxy.stats.last_completions

        # A again (same session), closed after [DONE]; then B takes the slot: A must be spilled
        await asyncio.to_thread(stream_then_close, base + CHAT, a1, ha, b"data: [DONE]")
        assert await proxy.wait_idle(60)
        await proxy.wait_background()
        await send(s, base, proxy, b1, hb)
        tier = tier_of(proxy)
        await tier.flush()
        assert tier.counters["spills"] == 1, tier.stats()


class _Recorder(NullLayer):
    """A cache layer that only records the observations the proxy hands it."""

    def __init__(self, upstream=None, config=None):
        super().__init__(upstream, config)
        self.seen: list = []

    async def observe(self, req, plan, obs):
        self.seen.append(obs)


async def test_final_event_then_a_held_stream_is_complete():
    """Deterministic order: the fake upstream writes its final event and holds the stream until the
    proxy has seen the client go (its in-flight count drops to 0); the observation is complete, the
    disconnect is not counted. A stream cut before its final event stays incomplete."""
    release = asyncio.Event()

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"hi"}}]}\n\n')
        if body.get("final", True):
            await resp.write(b'data: {"choices":[{"finish_reason":"stop","index":0,"delta":{}}],'
                             b'"timings":{"cache_n":0,"prompt_n":5,"predicted_n":1}}\n\ndata: [DONE]\n\n')
        await asyncio.wait_for(release.wait(), 30)  # held open (bounded) until the proxy saw the close
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def props(request: web.Request) -> web.Response:  # what makes it pass for llama-server
        return web.json_response({"build_info": "b1-fake", "total_slots": 1})

    up = web.Application()
    up.router.add_post("/v1/chat/completions", chat)
    up.router.add_get("/health", health)
    up.router.add_get("/props", props)
    up_srv = TestServer(up, host="127.0.0.1")
    await up_srv.start_server()
    cfg = Config(upstream=f"http://127.0.0.1:{up_srv.port}")
    proxy = Proxy(cfg, layer_factory=lambda u, c: _Recorder(u, c), monitor=False)
    srv = TestServer(proxy.make_app(), host="127.0.0.1")
    await srv.start_server(**RUNNER_KWARGS)  # TestServer sets handler_cancellation=True
    try:
        url = f"http://127.0.0.1:{srv.port}/v1/chat/completions"
        for final in (True, False):
            release.clear()
            last = b"data: [DONE]" if final else b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"hi"}}]}'
            await asyncio.to_thread(stream_then_close, url, {"messages": [], "final": final}, {}, last)
            assert await proxy.wait_idle(30)
            release.set()
            await proxy.wait_background()
        done, cut = proxy.layer.seen
        assert done.completed and done.timings == {"cache_n": 0, "prompt_n": 5, "predicted_n": 1}
        assert not cut.completed
        assert proxy.stats.to_dict()["client_disconnects"] == 1  # only the cut one
    finally:
        release.set()
        await srv.close()
        await up_srv.close()
