"""Image prompts through the session tier (spills) and the disk tier, against the real patched
llama-server with the tiny vision projector (``ocache/toolchain/vision.py``) and real PNG bytes,
two images per conversation.

What the server does with them (the pinned source): a slot file of an image prompt holds the
token list with ``-1`` at each image's positions and each image's chunk with its id, the SHA-256 of
the image's bytes (``server_tokens::serialize``, tools/server/server-common.cpp:570-590;
``mtmd_input_chunk_save``, tools/mtmd/mtmd.cpp:2407-2446); a restored slot is matched against a new
prompt chunk by chunk by that id (``server_tokens::get_common_prefix``, server-common.cpp:697-745).
ocache reads the header as its token view (``ocache.tiers.slotfile.read_slot_tokens``), so its
entries are keyed by the images' digests: the same bytes under another URL hit, other pixels miss
from the image on.

Checked on each tiny model (``-ub 128``, ``--ctx-checkpoints 32 --checkpoint-min-step 256``,
``--cache-ram 0``, spills from 200 tokens):

* eviction: on ``-np 1`` conversation A (two images) is spilled when B takes the slot; A's next
  turn, with its first image under another URL, is restored from the spill with ``cache_n`` >= its
  prompt minus one ubatch, and its greedy output equals a cold prefill's (``ocache.bench.exact``);
  then, evicted again, a turn whose second image has other pixels reuses nothing from that image
  on (its output is cold's too);
* restart: a planned stop (drain) spills A, llama-server restarts, the next ocache resumes it and
  A's next turn gets ``cache_n`` >= its prompt minus one ubatch, output equal to cold.

``.venv/bin/python -m pytest -q tests/test_image_tiers.py`` (needs the engine and tiny models:
``ocache engine build``, ``ocache models make --preset tiny``).
"""

from __future__ import annotations

import copy
import random

import aiohttp
import pytest

from fakes import cold_chat as cold
from ocache.bench.exact import PROBS_FIELDS, Generation, compare, describe
from ocache.media import digest
from ocache.toolchain.vision import TINY, make_projector

from test_images import data_url, png
from test_spill import (CHAT, SERVER, TOOLS, UB, forget_store, make_config, n_prompt, send, through_ocache,
                        tier_of)

pytestmark = pytest.mark.server

MODELS = ["dense", "hybrid"]
WORDS = ("alpha beta gamma delta river stone cloud paper lamp window garden tiger violet copper "
         "engine harbor pencil mountain silver orange planet bridge candle forest").split()


def turn1(i: int, first: str, second: str, tail: int = 0) -> dict:
    """A coding agent's first request (tools: ocache classifies it as an agent's, whose slot is
    protected and spilled): a system text of ~260 words and one user message with two images
    between text parts, the last one followed by ``tail`` more words."""
    rng = random.Random(3100 + i)
    system = "You are a careful assistant who reads screenshots. " + " ".join(rng.choice(WORDS) for _ in range(260))
    question = "What changed between them? " + " ".join(rng.choice(WORDS) for _ in range(tail))
    return {"messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": [
                    {"type": "text", "text": f"Conversation {i}: here is the first screenshot."},
                    {"type": "image_url", "image_url": {"url": first}},
                    {"type": "text", "text": "And the second one."},
                    {"type": "image_url", "image_url": {"url": second}},
                    {"type": "text", "text": question.strip()}]}],
            "tools": TOOLS, "max_tokens": 8, "temperature": 0, "stream": False, **PROBS_FIELDS}


def turn2(first: dict, answer: dict, text: str = "Name one thing in the second picture.") -> dict:
    body = copy.deepcopy(first)
    body["messages"].append({"role": "assistant", "content": answer["choices"][0]["message"].get("content") or ""})
    body["messages"].append({"role": "user", "content": text})
    return body


def with_images(body: dict, first: str, second: str) -> dict:
    """``body`` with its two image URLs replaced."""
    out = copy.deepcopy(body)
    parts = [p for p in out["messages"][1]["content"] if p["type"] == "image_url"]
    parts[0]["image_url"]["url"], parts[1]["image_url"]["url"] = first, second
    return out




async def exact_vs_cold(url: str, body: dict, rec: dict, what: str) -> None:
    """The response ``rec`` against a cold run of ``body``; prints one line of figures (``-s``)."""
    v = compare(Generation.from_response(await cold(url, body)), Generation.from_response(rec["data"]))
    assert v.exact and v.compared >= 4, (describe(v), rec["tier"], rec["timings"])
    t = rec["timings"]
    print(f"[images] {what}: tier {rec['tier']}, prompt {t['cache_n'] + t['prompt_n']}, cache_n {t['cache_n']}, "
          f"prefilled {t['prompt_n']}, {v.compared} tokens equal to cold")


async def view_of(url: str, body: dict) -> list[int]:
    from ocache.tokens import TokenViewer

    viewer = TokenViewer(url)
    try:
        return list((await viewer.view(CHAT, body)).tokens)
    finally:
        await viewer.close()


async def image_start(url: str, body: dict, k: int) -> int:
    """Index of the first position of the ``k``-th image in ``body``'s token view."""
    toks = await view_of(url, body)
    starts = [i for i, t in enumerate(toks) if t < 0 and (i == 0 or toks[i - 1] >= 0)]
    return starts[k]


async def tail_inside_last_image(url: str, first: str, second: str) -> int:
    """A ``tail`` (words) for :func:`turn1` that puts the server's ``N - 4 - n_ubatch`` batch break
    inside the second image: the server cannot break there (server-context.cpp:3509-3511), so a
    model of its checkpoints that ignored images would predict one there that the server never takes."""
    for tail in range(40, 240, 2):
        toks = await view_of(url, turn1(1, first, second, tail))
        end = max(i for i, t in enumerate(toks) if t < 0) + 1
        if end - TINY.n_patches < len(toks) - 4 - UB < end:
            return tail
    raise AssertionError("no tail puts the break inside the image")


def pictures() -> tuple[bytes, bytes, bytes, bytes]:
    """Four different real PNGs (the conversation A's two, B's one, A's changed second one)."""
    return png(40, 32, 1), png(24, 24, 3), png(32, 32, 5), png(24, 24, 4)


@pytest.mark.parametrize("model", MODELS)
async def test_evicted_image_conversation_is_restored_and_keyed_by_the_image_bytes(start_server, tmp_path, model):
    srv = start_server(model, n_parallel=1, ctx_size=8192, args=["--mmproj", str(make_projector())], **SERVER)
    one, two, other, changed = pictures()
    assert digest(data_url(one)) == digest(data_url(one, "image/jpeg"))
    ha, hb = {"x-session-affinity": "ses_img_a"}, {"x-session-affinity": "ses_img_b"}
    tail = await tail_inside_last_image(srv.url, data_url(one), data_url(two))
    a1, b1 = turn1(1, data_url(one), data_url(two), tail), turn1(2, data_url(other), data_url(two))
    cfg = make_config(srv, tmp_path / "cache", 200)
    async with through_ocache(cfg) as (base, proxy), aiohttp.ClientSession() as s:
        r_a1 = await send(s, base, proxy, a1, ha)
        tier = tier_of(proxy)
        predicted = [c.n_tokens for c in proxy.layer.table[0].checkpoints]
        await send(s, base, proxy, b1, hb)          # B takes the only slot: A is spilled
        await tier.flush()
        assert tier.counters["spills"] == 1, tier.stats()
        [ea] = tier.store.entries("s")
        stored = tier.store.tokens(ea.key)
        # the entry holds A's view: both images' positions keyed by their digests
        assert len([t for t in stored if t < 0]) == 2 * TINY.n_patches
        # the sidecar rule for media: the hybrid's spill carries the checkpoints the server took
        # (none right after an image, none where a batch would have broken inside one), and they
        # are the ones ocache's model predicted (ocache.llama.reuse.simulate_prefill)
        saved = list(ea.meta.get("checkpoints") or [])
        after_image = {i for i in range(1, len(stored)) if stored[i - 1] < 0 <= stored[i]}
        if model == "hybrid":
            assert saved and not set(saved) & after_image, (saved, after_image)
            assert saved == predicted, (saved, predicted)
        else:
            assert saved == [] and predicted == []

        # A's next turn with its first image under another URL: the same bytes, the same entry
        a2 = with_images(turn2(a1, r_a1["data"]), data_url(one, "image/jpeg"), data_url(two))
        na2 = await n_prompt(srv.url, a2)
        rec = await send(s, base, proxy, a2, ha)
        await tier.flush()
        assert rec["tier"] == "session", rec
        assert rec["timings"]["cache_n"] >= na2 - UB, (rec["timings"], na2)
        assert tier.counters["hits"] == 1 and tier.counters["unconfirmed"] == 0, tier.stats()
        assert proxy.layer.counters["mispredictions"] == 0, proxy.layer.counters
        assert proxy.layer.counters["bring_failures"] == 0
        await exact_vs_cold(srv.url, a2, rec, f"{model} after an eviction, first image under another URL")

        # B again (A is spilled once more), then A's turn with its second image changed: nothing
        # from that image on is reused (a miss there), and the answer is cold's
        await send(s, base, proxy, turn2(b1, {"choices": [{"message": {"content": "ok"}}]}), hb)
        await tier.flush()
        a2x = with_images(a2, data_url(one, "image/jpeg"), data_url(changed))
        cut = await image_start(srv.url, a2x, 1)
        rec = await send(s, base, proxy, a2x, ha)
        assert rec["timings"]["cache_n"] <= cut, (rec["timings"], cut)
        assert rec["timings"]["cache_n"] == rec["predicted"], rec
        await exact_vs_cold(srv.url, a2x, rec, f"{model} second image changed (image at {cut})")
        assert proxy.layer.counters["mispredictions"] == 0, proxy.layer.counters


@pytest.mark.parametrize("model", MODELS)
async def test_image_conversation_resumes_after_a_restart(start_server, tmp_path, model):
    srv = start_server(model, n_parallel=1, ctx_size=8192, args=["--mmproj", str(make_projector())], **SERVER)
    one, two, _other, _changed = pictures()
    ha = {"x-session-affinity": "ses_img_restart"}
    a1 = turn1(3, data_url(one), data_url(two))
    cache = tmp_path / "cache"
    async with through_ocache(make_config(srv, cache, 200, drain_min_tokens=200)) as (base, proxy), aiohttp.ClientSession() as s:
        r_a1 = await send(s, base, proxy, a1, ha)
        await proxy.drain(30)
        assert tier_of(proxy).counters["spills"] == 1, tier_of(proxy).stats()
    forget_store(cache)
    srv.restart()

    a2 = turn2(a1, r_a1["data"])
    na2 = await n_prompt(srv.url, a2)
    async with through_ocache(make_config(srv, cache, 200, drain_min_tokens=200)) as (base, proxy), aiohttp.ClientSession() as s:
        rec = await send(s, base, proxy, a2, ha)
        tier = tier_of(proxy)
        assert tier.counters["resumed"] == 1, tier.stats()
        assert rec["tier"] == "session", rec
        assert rec["timings"]["cache_n"] >= na2 - UB, (rec["timings"], na2)
        assert proxy.layer.counters["mispredictions"] == 0, proxy.layer.counters
        await exact_vs_cold(srv.url, a2, rec, f"{model} after a drained restart")
