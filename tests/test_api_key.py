"""A llama-server started with ``--api-key`` in front of which ocache runs without
``upstream_api_key``: its ``/health`` is open, so it looks ready, but it answers 401 to ocache's own
``GET /slots``. Every request is forwarded untouched (the client's key passes as sent) and one
warning per server process names the setting; before, each request logged a 25-line traceback.
With the key configured the same requests are planned."""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from conftest import through_ocache
from ocache.config import Config

KEY = "secret-key"


async def _ask(base: str, n: int) -> list[tuple[int, str | None, str | None]]:
    out = []
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as c:
        for i in range(n):
            body = {"messages": [{"role": "user", "content": f"Say a word about {i}."}], "max_tokens": 4}
            async with c.post(base + "/v1/chat/completions", json=body) as r:
                await r.read()
                out.append((r.status, r.headers.get("X-OCache-Fail-Open"), r.headers.get("X-OCache-Slot")))
    return out


async def test_a_server_with_an_api_key_and_none_configured_says_so_once(start_server, caplog):
    srv = await asyncio.to_thread(start_server, "dense", n_parallel=2, api_key=KEY)
    caplog.set_level(logging.INFO)
    async with through_ocache(Config(upstream=srv.url)) as (base, _):
        got = await _ask(base, 3)
    assert got == [(200, "plan", None)] * 3, got
    said = [r for r in caplog.records if "runs with --api-key" in r.getMessage()]
    assert len(said) == 1 and "upstream_api_key" in said[0].getMessage() and said[0].exc_info is None
    assert not [r for r in caplog.records if "plan() failed" in r.getMessage()]

    async with through_ocache(Config(upstream=srv.url, upstream_api_key=KEY)) as (base, _):
        got = await _ask(base, 2)
    assert [(s, f) for s, f, _ in got] == [(200, None)] * 2 and all(slot is not None for *_, slot in got), got


async def test_doctor_names_the_key_a_server_refuses(start_server):
    """``ocache doctor`` against such a server says the key is missing (it reported ``--metrics:
    off`` and an unknown build before: the 401s read as features absent)."""
    import pytest

    from ocache.llama.checks import probe

    srv = await asyncio.to_thread(start_server, "dense", api_key=KEY)
    with pytest.raises(RuntimeError, match="runs with --api-key"):
        await probe(srv.url, None)
    findings, info = await probe(srv.url, None, KEY)
    assert not [f for f in findings if "--metrics" in str(f) and f.level != "ok"], findings


async def test_an_answer_the_server_refused_carries_no_reuse_figures(start_server):
    """With the key configured, a client sending a wrong key gets the server's 401, planned like
    any request (the known route forwards first): its headers say nothing was reused or prefilled
    (they said ``X-OCache-Reused`` of the plan before, for an answer the server never computed)."""
    srv = await asyncio.to_thread(start_server, "dense", n_parallel=2, api_key=KEY)
    body = {"messages": [{"role": "user", "content": "Say a word about the sea."}], "max_tokens": 4}
    async with through_ocache(Config(upstream=srv.url, upstream_api_key=KEY)) as (base, _):
        async with aiohttp.ClientSession() as c:
            for key, want in ((KEY, 200), ("wrong", 401), (KEY, 200)):
                async with c.post(base + "/v1/chat/completions", json=body,
                                  headers={"Authorization": f"Bearer {key}"}) as r:
                    await r.read()
                    assert r.status == want
                    if want == 401:
                        assert "X-OCache-Reused" not in r.headers and "X-OCache-Prefilled" not in r.headers
