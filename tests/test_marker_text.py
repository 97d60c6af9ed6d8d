"""A conversation whose text holds the shape of llama-server's media marker (``<__media_…__>``: an
agent reading ocache/media.py) and no image is planned like any other. The view took it for media,
found no image to pair it with and gave up on the request (forwarded unplanned): the server then
placed it by similarity, and after an aligned turn it shared too little with the conversation's
slot and went to the empty one, cold (the opencode prune test: 7,865 tokens where alone took 1,820)."""

from __future__ import annotations

import asyncio

import aiohttp

from conftest import through_ocache
from ocache.config import Config


async def test_the_media_markers_shape_in_text_is_planned(start_server):
    srv = await asyncio.to_thread(start_server, "dense", n_parallel=2)
    msgs = [{"role": "user", "content": "What does this line do? MARKER = '<__media_abc123XYZ__>' " * 20}]
    async with through_ocache(Config(upstream=srv.url)) as (base, proxy), aiohttp.ClientSession() as c:
        got = []
        for _ in range(2):
            async with c.post(base + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 8}) as r:
                data = await r.json()
                assert r.status == 200, data
                got.append((r.headers.get("X-OCache-Slot"), data["timings"]["cache_n"]))
            msgs = msgs + [{"role": "assistant", "content": data["choices"][0]["message"]["content"] or "ok"},
                           {"role": "user", "content": "And the next line?"}]
        assert proxy.layer.counters["unrenderable"] == 0
    assert got[0][0] is not None and got[1][0] == got[0][0] and got[1][1] > 0, got
