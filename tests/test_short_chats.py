"""Two short chats without a session key, taking turns (A, B, A, B) on ``-np 2``: through ocache
they prefill no more than llama-server alone. A slot holding less than a ubatch counted as the same
conversation as any request (``classify_slot``: ``lcp >= held - n_ubatch`` holds for lcp 0), so
both chats took turns on slot 0, each cold, while slot 1 stayed empty: 130 tokens through ocache
against 113 alone on the tiny hybrid (121 against 107 dense)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from conftest import through_ocache
from ocache.config import Config

CHATS = {"A": "Write one short sentence about the sea and boats.",
         "B": "Name three colours that mix well in a garden."}


async def _turns(base: str) -> list[tuple[str, int, str | None]]:
    """A, B, A, B: each chat's second request continues its first; (chat, prompt_n, slot)."""
    conv = {k: [{"role": "user", "content": v}] for k, v in CHATS.items()}
    out = []
    async with aiohttp.ClientSession() as c:
        for k in ("A", "B", "A", "B"):
            body = {"messages": conv[k], "max_tokens": 8, "temperature": 0}
            async with c.post(base + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
                data = await r.json()
                out.append((k, int(data["timings"]["prompt_n"]), r.headers.get("X-OCache-Slot")))
            answer = data["choices"][0]["message"].get("content") or "ok"
            conv[k] = conv[k] + [{"role": "assistant", "content": answer},
                                 {"role": "user", "content": "And one more, please."}]
    return out


@pytest.mark.parametrize("model", ["hybrid", "dense"])
async def test_two_short_chats_prefill_no_more_than_alone(start_server, model):
    srv = await asyncio.to_thread(start_server, model, n_parallel=2, flash_attn="on")
    alone = await _turns(srv.url)
    srv.stop()
    srv = await asyncio.to_thread(start_server, model, n_parallel=2, flash_attn="on")
    async with through_ocache(Config(upstream=srv.url)) as (base, _):
        through = await _turns(base)
    total_alone, total = sum(n for _, n, _ in alone), sum(n for _, n, _ in through)
    assert total <= total_alone, (alone, through)
    # each chat keeps its own slot, and its second request reuses its first
    assert through[0][2] == through[2][2] != through[1][2] == through[3][2], through
    assert through[2][1] < alone[0][1] + 10 and through[3][1] < alone[1][1] + 10, through
