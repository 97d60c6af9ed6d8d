"""The headline saving is against llama-server alone: ``ocache.llama.alone`` models what
the same server with the same flags would have prefilled without ocache (its own slot choice and
reuse), the layer feeds it every answered request, and the dashboard / ``ocache stats`` lead with
that saving and label the one against a cold prefill as such. The model is checked here against a
real stock llama-server sent the same requests directly; the figure served at the end of a bench's
(c) is set beside its measured (b) - (c) by ``ocache bench`` itself (``Bench.alone_table``,
docs/benchmarks.md F1: equal on a recorded opencode day)."""

from __future__ import annotations

import aiohttp
import pytest

from ocache import dashboard
from ocache.commands import top
from ocache.config import Config
from ocache.llama.alone import AloneModel
from ocache.llama.flags import ServerParams

from test_hardening_cache import A1, A2, B1, CHAT, SERVER, body_of, hdrs, send, through_ocache

DENSE = ServerParams(n_slots=2, checkpoints=False)
HYBRID = ServerParams(n_slots=2, checkpoints=True, n_ubatch=64, n_batch=256, checkpoint_min_step=64)


def toks(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 5000 + 10 for i in range(n)]


def test_the_server_alone_keeps_each_conversation_on_its_slot_by_similarity():
    m = AloneModel()
    a1, b1 = toks(1000, 1), toks(800, 2)
    a2, b2 = a1 + toks(200, 3), b1 + toks(50, 4)
    assert m.serve(a1, DENSE) == 1000
    assert m.pick(b1, DENSE) == 0          # a1 took slot 1 (LRU ties go to the highest id); b1: slot 0
    assert m.serve(b1, DENSE) == 800
    assert m.serve(a2, DENSE) == 200       # back on a1's slot: f_sim 0.83 > 0.1
    assert m.serve(b2, DENSE) == 50
    assert (m.prefill, m.requests) == (1050 + 1000, 4)


def test_lru_ties_go_to_the_highest_slot_and_a_dissimilar_prompt_evicts_the_oldest():
    m = AloneModel()
    assert m.pick(toks(10, 1), DENSE) == 1    # all never used: the last of the equal t_last_used
    m.serve(toks(500, 1), DENSE)              # slot 1
    m.serve(toks(500, 2), DENSE)              # slot 0 (LRU)
    m.serve(toks(500, 1) + [1], DENSE)        # slot 1 again, now the most recent
    assert m.pick(toks(500, 9), DENSE) == 0   # nothing similar: the least recently used


def test_a_restart_empties_every_slot_and_a_hybrid_resumes_only_at_checkpoints():
    m = AloneModel()
    a1 = toks(2000, 1)
    m.serve(a1, DENSE)
    m.restart()
    assert m.serve(a1 + toks(10, 2), DENSE) == 2010 and m.restarts == 1
    h = AloneModel()
    h.serve(a1, HYBRID, user_starts=(0, 1500), generated=20, generated_ids=toks(20, 4))
    # the next turn re-renders the answer differently (the server reported the ids it sampled):
    # it diverges inside what the slot holds, so the hybrid resumes from the newest checkpoint at
    # or before the divergence, not from token 2000
    got = h.serve(a1 + toks(300, 5), HYBRID, user_starts=(0, 1500, 2100))
    assert 300 < got < 2300, got


def test_the_view_leads_with_the_saving_against_the_server_alone():
    stats = {"uptime_s": 1.0, "completions": {}, "tokens": {"cache_n": 9000, "prompt_n": 1000},
             "layer": {"warmup_tokens": 0, "alone": {"prefill": 4000, "ocache_prefill": 1000, "requests": 3}}}
    v = dashboard.view(stats)
    assert v["totals"]["saved_vs_alone"] == 3000 and v["totals"]["saved"] == 9000
    lines = top.summary_lines(v, "http://x")
    assert lines[1].startswith("saved   3,000 tokens") and "llama-server alone" in lines[1], lines
    assert lines[2].startswith("vs cold 9,000 tokens") and "cold prefill" in lines[2], lines


@pytest.mark.server
@pytest.mark.parametrize("mode", ["planned", "first-failed-open", "pinned"])
async def test_the_model_matches_a_real_stock_server_sent_the_same_requests(start_server, tmp_path, monkeypatch,
                                                                           mode):
    """The same turns (opencode turn 1, its follow-up, another project's turn 1, the follow-up again)
    sent to a stock llama-server directly and through ocache in front of the patched one: the model's
    prefill for the server alone is the stock server's measured ``prompt_n`` sum, within the answer
    tokens of each request (the model does not know the generated tokens; the dense model reuses at
    any token), and the headline is that minus what the server prefilled through ocache.
    ``first-failed-open``: the first turn's plan fails (as when the token view times out on a
    starved server), so it is forwarded without tokens; the model still counts it, in its place
    (left out, the follow-up looked cold to the server alone and its reuse was claimed).
    ``pinned``: the bodies name ``id_slot`` 1, 0, 1, 0, which the server alone honours (the
    follow-up lands on the empty slot, cold) and ocache does not pass on (it places each request
    itself); the model takes the client's slot as the server alone does (before: it placed by
    similarity, took the follow-up as warm and claimed a reuse that alone never had)."""
    turns = [A1, A2, B1, A2]
    pins = iter([1, 0, 1, 0] * 2)

    def body_of_mode(name: str) -> dict:
        return {**body_of(name), "id_slot": next(pins)} if mode == "pinned" else body_of(name)

    alone = start_server("dense", stock=True, n_parallel=2, ctx_size=2 * 16384, **SERVER)
    measured = 0
    async with aiohttp.ClientSession() as s:
        for name in turns:
            async with s.post(alone.url + CHAT, json=body_of_mode(name), timeout=aiohttp.ClientTimeout(total=300)) as r:
                data = await r.json()
            measured += int(data["timings"]["prompt_n"])
    srv = start_server("dense", n_parallel=2, ctx_size=2 * 16384, **SERVER)
    config = Config(upstream=srv.url, cache_dir=str(tmp_path / "state"))
    async with through_ocache(config) as (base, proxy), aiohttp.ClientSession() as s:
        if mode == "first-failed-open":
            from ocache.tokens import TokenViewer, TokenViewError
            view, failed = TokenViewer.view, []

            async def view_failing_once(self, *args, **kwargs):
                if not failed:
                    failed.append(1)
                    raise TokenViewError("/tokenize: no answer within 5 s (a fault of the test)")
                return await view(self, *args, **kwargs)

            monkeypatch.setattr(TokenViewer, "view", view_failing_once)
        through = 0
        for name in turns:
            rec = await send(s, base, proxy, body_of_mode(name), hdrs(name))
            through += int(rec["data"]["timings"]["prompt_n"])
        st = proxy.layer.stats()["alone"]
    assert st["requests"] == len(turns), st
    assert abs(st["prefill"] - measured) <= 8 * len(turns), (st, measured)
    assert st["saved"] == st["prefill"] - st["ocache_prefill"] and st["ocache_prefill"] >= through - 8


def test_a_dense_prompt_that_continues_into_the_answer_reuses_it_alone():
    """The model does not know the answer's token ids. On a dense server a next prompt that sends
    the answer back reuses it too (the server's cache_n covers prompt and answer), so the server
    alone is not charged for it: the saving against it was overstated by each answer's length (the
    tiny bench's growth: 45 reported, 0 measured). A hybrid reuses the whole slot when the prompt
    runs past all it holds, else it resumes at a checkpoint: with the answer's ids unknown, a prompt
    that long is taken to continue into it (the tiny hybrid's title_interleave: 19 tokens claimed);
    with the ids the server reported (``ocache_generated``), the prediction is exact either way."""
    first = toks(2000, 1)
    nxt = first + toks(16, 2) + toks(30, 3)
    m = AloneModel()
    assert m.serve(first, DENSE, generated=16) == 2000
    # the answer (16 tokens ocache never saw; the slot holds 15 of them, the last one sampled and
    # never evaluated) and a 30-token user turn: that token and the 30 are new
    assert m.serve(nxt, DENSE) == 31
    h = AloneModel()
    h.serve(first, HYBRID, user_starts=(0,), generated=16)
    assert h.serve(nxt, HYBRID) == 31
    # the ids known: the same answer sent back reuses it all; another rendering of it resumes at
    # a checkpoint inside the prompt (before token 2000)
    for ids, expect in ((toks(16, 2), lambda n: n == 31), (toks(16, 7), lambda n: n > 46)):
        k = AloneModel()
        k.serve(first, HYBRID, user_starts=(0,), generated=16, generated_ids=ids)
        assert expect(k.serve(nxt, HYBRID)), k.prefill


async def test_a_request_forwarded_without_tokens_is_fed_in_its_place_once_its_prompt_is_learned():
    """A turn forwarded untouched (the plan failed open, so no tokens) is fed to the model when its
    prompt is learned after the answer, and the answers after it wait behind it: the next turn,
    which the server reused from it, is not charged to the server alone as cold. Without it the
    headline said 7,266 tokens saved on a loaded machine where (b) - (c) measured 0."""
    import asyncio

    from ocache.cache.observe import AloneTally
    from ocache.layer import Observation

    from ocache.cache.execute import ServerPlaced
    from ocache.tiers.base import RequestContext

    def placed(tokens: list[int]) -> ServerPlaced:   # a request the server placed, with its tokens
        return ServerPlaced("r", tokens, RequestContext())

    def answer(prompt_n: int, cache_n: int) -> Observation:
        return Observation(status=200, completed=True, timings={"prompt_n": prompt_n, "cache_n": cache_n, "predicted_n": 8})

    turn1, title = toks(1000, 1), toks(300, 9)
    turn2 = turn1 + toks(40, 2)
    learned: asyncio.Future = asyncio.get_running_loop().create_future()
    tasks = []
    t = AloneTally()
    assert t.feed(placed(title), answer(300, 0), DENSE) == 300
    # turn 1 forwarded without tokens: queued; turn 2 (answered after it) waits behind it
    assert t.feed_later(learned, answer(1000, 0), DENSE, lambda coro, what: tasks.append(asyncio.ensure_future(coro)))
    assert t.feed(placed(turn2), answer(40, 1000), DENSE) is None and t.pending == 2
    learned.set_result((turn1, (), 0))
    await asyncio.gather(*tasks)
    st = t.stats()
    assert t.pending == 0 and st["requests"] == 3
    # alone: the title, turn 1 cold, turn 2 reusing turn 1 (and, dense, up to the 7 answer tokens
    # the slot holds, Reuse.upper: never more saved than measured); fed without turn 1, turn 2 was
    # cold alone and 1,000 tokens were claimed
    assert st["ocache_prefill"] == 300 + 1000 + 40
    assert 300 + 1000 + 40 - 7 <= st["prefill"] <= st["ocache_prefill"] and -7 <= st["saved"] <= 0
    # a prompt never learned: as much on both sides, nothing claimed
    u = AloneTally()

    async def fails():
        raise OSError("server gone")

    assert u.feed_later(fails(), answer(500, 0), DENSE, lambda coro, what: tasks.append(asyncio.ensure_future(coro)))
    await asyncio.gather(*tasks)
    assert u.stats()["saved"] == 0 and u.stats()["unknown_prompts"] == 1 and u.prefill == 500
