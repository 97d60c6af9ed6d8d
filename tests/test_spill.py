"""The session tier (``ocache.tiers.spill``) against the real patched llama-server on the tiny models.

Requests go through the proxy in-process (``ocache.proxy.Proxy`` + ``OCacheLayer``, which registers
the session tier), like tests/test_resident.py. Server settings as there: ``-ub 128`` (so "one
ubatch" is a tight bound), ``-b 512``, ``--ctx-checkpoints 32 --checkpoint-min-step 256`` (the tiny
conversations are a few thousand tokens), ``--cache-ram 0`` (the RAM cache is off wherever ocache
plans, see the module docstring of ``ocache.tiers.spill``).

**The spill threshold is lowered** in these tests (``spill_min_tokens`` 2,000 for the opencode
fixtures, which render to ~7k tokens; 200 for the synthetic 8-session test) instead of the
default 16,384, so that the tiny fixtures are spilled.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from ocache.config import Config
from ocache.bench.exact import PROBS_FIELDS, Generation, compare, describe
from ocache import admin
from ocache.tiers import spill as spill_mod
from ocache.tokens import TokenViewer

from conftest import app_in_thread, body_of, forget_store, session_headers, through_ocache

UB = 128
SERVER = dict(ubatch=UB, batch=512, ctx_checkpoints=32, checkpoint_min_step=256, cache_ram=0)
MODELS = ["dense", "hybrid"]
CHAT = "/v1/chat/completions"


# --------------------------------------------------------------------------- helpers

def make_config(srv, cache_dir: Path, min_tokens: int, **session) -> Config:
    return Config(upstream=srv.url, cache_dir=str(cache_dir), spill_min_tokens=min_tokens,
                  tiers={"resident": {"server_args": srv.command()[1:]}, "session": session})


def tier_of(proxy) -> spill_mod.SessionTier:
    t = next((t for t in proxy.layer.tiers if t.name == "session"), None)
    assert t is not None, "the session tier was not registered (no --slot-save-path seen?)"
    return t


async def send(s: aiohttp.ClientSession, base: str, proxy, body: dict, headers: dict | None = None,
               path: str = CHAT) -> dict:
    async with s.post(base + path, json=body, headers=headers or {}) as r:
        data = await r.json()
        assert r.status == 200, data
        rec = {"tier": r.headers.get("X-OCache-Tier"), "slot": r.headers.get("X-OCache-Slot"),
               "predicted": int(r.headers.get("X-OCache-Predicted-Cache", -1)), "timings": data["timings"],
               "data": data}
    await proxy.wait_background()   # observe()/admit() run after the response
    await proxy.layer.idle()
    return rec


async def n_prompt(url: str, body: dict) -> int:
    viewer = TokenViewer(url)
    try:
        return len((await viewer.view(CHAT, body)).tokens)
    finally:
        await viewer.close()


# --------------------------------------------------------------------------- A / B / A on one slot

@pytest.mark.server
@pytest.mark.parametrize("model", MODELS)
async def test_aba_on_one_slot_parks_and_restores(start_server, tmp_path, model):
    """-np 1: A, then B (another session) spills A; A's return spills B and restores A, and
    prefills only what is new: prompt_n <= new tokens + one ubatch."""
    srv = start_server(model, n_parallel=1, ctx_size=16384, **SERVER)
    a1, a2 = body_of("opencode_agent_turn1.json"), body_of("opencode_agent_turn1_after_tool.json")
    b1 = body_of("opencode_run3_proj2_agent_turn1.json")
    ha, hb = session_headers("opencode_agent_turn1.json"), session_headers("opencode_run3_proj2_agent_turn1.json")
    assert ha != hb and ha == session_headers("opencode_agent_turn1_after_tool.json")
    na1, na2 = await n_prompt(srv.url, a1), await n_prompt(srv.url, a2)
    assert na1 >= 2000
    cfg = make_config(srv, tmp_path / "cache", 2000)
    async with through_ocache(cfg) as (base, proxy), aiohttp.ClientSession() as s:
        await send(s, base, proxy, a1, ha)
        tier = tier_of(proxy)
        assert tier.counters["spills"] == 0
        await send(s, base, proxy, b1, hb)
        await tier.flush()
        assert tier.counters["spills"] == 1, tier.stats()
        [ea] = tier.store.entries("s")
        assert ea.meta["session"] == spill_mod.hint_key(ha["x-session-affinity"])
        assert ea.n_tokens > na1  # prompt + the generated tokens the slot holds

        rec = await send(s, base, proxy, a2, ha)
        await tier.flush()
        assert rec["tier"] == "session", rec
        assert tier.counters["spills"] == 2 and tier.counters["restores"] == 1
        assert tier.counters["hits"] == 1 and tier.counters["unconfirmed"] == 0
        t = rec["timings"]
        assert t["prompt_n"] <= (na2 - na1) + UB, (t, na1, na2)
        assert abs(t["cache_n"] - rec["predicted"]) <= UB, (t, rec["predicted"])
        # B is parked now, A's older spill was superseded by nothing (A was not spilled again)
        sessions = sorted(e.meta["session"] for e in tier.store.entries("s"))
        assert sessions == sorted([spill_mod.hint_key(ha["x-session-affinity"]),
                                   spill_mod.hint_key(hb["x-session-affinity"])])

        # B comes back unchanged (the same prompt): restored, only the last token re-evaluated
        # (dense) or resumed from the checkpoint near its end (hybrid)
        rec = await send(s, base, proxy, b1, hb)
        assert rec["tier"] == "session" and rec["timings"]["prompt_n"] <= UB + 8, rec["timings"]


# --------------------------------------------------------------------------- drain + restart

@pytest.mark.server
@pytest.mark.parametrize("model", MODELS)
async def test_drain_then_restart_resumes_at_the_end(start_server, tmp_path, model):
    """A planned stop spills the resident conversation; the next start restores it before the first
    request, and the next turn reads only what is new."""
    srv = start_server(model, n_parallel=1, ctx_size=16384, **SERVER)
    a1, a2 = body_of("opencode_agent_turn1.json"), body_of("opencode_agent_turn1_after_tool.json")
    ha = session_headers("opencode_agent_turn1.json")
    na1, na2 = await n_prompt(srv.url, a1), await n_prompt(srv.url, a2)
    cache = tmp_path / "cache"
    cfg = make_config(srv, cache, 16384)  # a threshold above the conversation: no eviction spill, only the drain
    async with through_ocache(cfg) as (base, proxy), aiohttp.ClientSession() as s:
        await send(s, base, proxy, a1, ha)
        await proxy.drain(30)
        tier = tier_of(proxy)
        assert tier.counters["spills"] == 1, tier.stats()
        assert (cache / "store" / spill_mod.RESUME_MARKER).exists()
    forget_store(cache)
    srv.restart()

    cfg = make_config(srv, cache, 16384)
    async with through_ocache(cfg) as (base, proxy), aiohttp.ClientSession() as s:
        rec = await send(s, base, proxy, a2, ha)
        tier = tier_of(proxy)
        assert tier.counters["resumed"] == 1, tier.stats()
        assert not (cache / "store" / spill_mod.RESUME_MARKER).exists()  # consumed
        t = rec["timings"]
        # the true source: the session tier restored it at start-up
        assert rec["tier"] == "session", rec
        assert t["prompt_n"] <= (na2 - na1) + UB, (t, na1, na2)
        assert t["cache_n"] >= na1 - UB


# --------------------------------------------------------------------------- 8 sessions, 2 slots

WORDS = ("alpha beta gamma delta river stone cloud paper lamp window garden tiger violet copper "
         "engine harbor pencil mountain silver orange planet bridge candle forest").split()
TOOLS = [{"type": "function", "function": {"name": "read", "description": "Read a file from disk.",
                                            "parameters": {"type": "object", "properties": {
                                                "path": {"type": "string"}}, "required": ["path"]}}}]


def session_turn1(i: int) -> dict:
    rng = random.Random(1000 + i)
    text = " ".join(rng.choice(WORDS) for _ in range(260))
    return {"messages": [{"role": "system", "content": "You are a careful coding assistant."},
                         {"role": "user", "content": f"Session {i}. Summarise: {text}"}],
            "tools": TOOLS, "max_tokens": 6, "temperature": 0, "stream": False, **PROBS_FIELDS}


def session_turn2(i: int, first: dict, answer: dict) -> dict:
    msg = answer["choices"][0]["message"]
    body = copy.deepcopy(first)
    body["messages"].append({"role": "assistant", "content": msg.get("content") or ""})
    body["messages"].append({"role": "user", "content": f"Now session {i} again: name three of those words."})
    return body


@pytest.mark.server
@pytest.mark.parametrize("model", MODELS)
async def test_eight_sessions_on_two_slots_never_cross(start_server, tmp_path, model):
    """8 concurrent sessions on -np 2 with spills forced by a low threshold (200 tokens): every
    response equals a cold run of the same prompt alone on the server (``ocache.bench.exact``: greedy
    tokens up to the cold run's first near-tie, log-probabilities within its tolerance), so no
    state crossed sessions; the batching of concurrent requests is noise the check allows for."""
    srv = start_server(model, n_parallel=2, ctx_size=2 * 4096, **SERVER)
    cfg = make_config(srv, tmp_path / "cache", 200)
    n = 8
    hdr = [{"x-session-affinity": f"ses_test_{i}"} for i in range(n)]
    firsts = [session_turn1(i) for i in range(n)]
    async with through_ocache(cfg) as (base, proxy), aiohttp.ClientSession() as s:
        r1 = await asyncio.gather(*(send(s, base, proxy, firsts[i], hdr[i]) for i in range(n)))
        seconds = [session_turn2(i, firsts[i], r1[i]["data"]) for i in range(n)]
        r2 = await asyncio.gather(*(send(s, base, proxy, seconds[i], hdr[i]) for i in range(n)))
        tier = tier_of(proxy)
        await tier.flush()
        st = tier.stats()
        assert st["spills"] >= 2 and st["restores"] >= 1, st
        assert proxy.layer.counters["bring_failures"] == 0
    # cold references, straight to the server, one at a time, no cache
    answers = set()
    compared = 0
    async with aiohttp.ClientSession() as s:
        for body, rec in [*zip(firsts, r1), *zip(seconds, r2)]:
            async with s.post(srv.url + CHAT, json=dict(body, cache_prompt=False, id_slot=0)) as r:
                cold = await r.json()
            assert cold["timings"]["cache_n"] == 0
            v = compare(Generation.from_response(cold), Generation.from_response(rec["data"]))
            assert v.exact, (describe(v), rec["tier"], rec["timings"])
            compared += v.compared
            answers.add(json.dumps(Generation.from_response(cold).tokens))
    # the comparison has power: the sessions' answers differ from one another, and most tokens
    # were compared (near-ties are rare on the generated models)
    assert len(answers) >= n, answers
    assert compared >= n * 6, compared


# --------------------------------------------------------------------------- kill -9 mid-spill

KILLED_SPILL = r"""
import asyncio, json, sys
from pathlib import Path
import aiohttp
from ocache.slots import SlotTable
from ocache.tiers import spill
from ocache.tiers.store import Store

url, data_dir, meta_dir = sys.argv[1:4]

async def main():
    toks = json.loads(sys.stdin.readline())
    async with aiohttp.ClientSession() as s:
        table = SlotTable(s, url)
        await table.refresh()
        await table.warm(0, toks)
        st = table[0]
        st.kind, st.owner = "agent", "ses_killed"
        store = Store(Path(meta_dir), Path(data_dir), "identity-of-the-killed-run")
        store.open()
        tier = spill.SessionTier(store, table, spill.SpillConfig(min_tokens=100))
        await tier.admit(type("V", (), {"tokens": toks, "user_starts": []})(), 0,
                         type("O", (), {"timings": {}, "completed": True, "status": 200})())
        real = store.commit
        def paused(kind, tokens, temp_bin, **kw):
            print("SAVED", temp_bin, flush=True)   # the server wrote the file; no record yet
            sys.stdin.readline()                   # the parent kills us here (kill -9)
            return real(kind, tokens, temp_bin, **kw)
        store.commit = paused
        await tier.before_evict(0)
        await tier.flush()

asyncio.run(main())
"""


@pytest.mark.server
async def test_kill_during_spill_leaves_nothing_trusted(start_server, tmp_path):
    """kill -9 of the process while a spill is being committed (the server's file written, partially
    here, no record): the next start removes the file, offers nothing, and serves the session cold."""
    srv = start_server("dense", n_parallel=1, ctx_size=8192, **SERVER)
    cache = tmp_path / "cache"
    meta = cache / "store"
    data_dir = Path(srv.slot_save_path)
    viewer = TokenViewer(srv.url)
    try:
        toks = await viewer.tokenize(" ".join(random.Random(7).choice(WORDS) for _ in range(600)))
    finally:
        await viewer.close()
    script = tmp_path / "killed_spill.py"
    script.write_text(KILLED_SPILL)
    child = subprocess.Popen([sys.executable, str(script), srv.url, str(data_dir), str(meta)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             cwd=str(Path(__file__).resolve().parents[1]))
    try:
        child.stdin.write(json.dumps(toks) + "\n")
        child.stdin.flush()
        line = child.stdout.readline()
        assert line.startswith("SAVED "), line
        tmp_name = line.split()[1]
        tmp_file = data_dir / tmp_name
        assert tmp_file.exists() and tmp_file.stat().st_size > 0
        # the kill lands while the file is still being written: keep its first half
        with open(tmp_file, "r+b") as f:
            f.truncate(tmp_file.stat().st_size // 2)
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    srv.restart()  # the conversation is no longer resident anywhere

    cfg = make_config(srv, cache, 100)
    async with through_ocache(cfg) as (base, proxy), aiohttp.ClientSession() as s:
        rec = await send(s, base, proxy, {"prompt": toks, "n_predict": 4, "temperature": 0}, path="/completion")
        tier = tier_of(proxy)
        assert not tier.store.entries("s")
        assert tier.store.report.orphans >= 1
        assert not [p for p in data_dir.iterdir() if p.name.startswith("oc-")]
        assert tier.counters["restores"] == 0 and tier.counters["offers"] == 0
        assert rec["timings"]["cache_n"] == 0 and rec["tier"] == "cold", rec


# --------------------------------------------------------------------------- identity (no server)

def test_session_identity():
    class V:
        def __init__(self, tokens, user_starts):
            self.tokens, self.user_starts = tokens, user_starts

    # tokens: head [1..4], user turn starting with the turn-start token 9, then the assistant turn
    first = V([1, 2, 3, 4, 9, 50, 51, 9, 60], [4])
    later = V([1, 2, 3, 4, 9, 50, 51, 9, 60, 61, 62, 9, 70, 9], [4, 11])
    other = V([1, 2, 3, 4, 9, 50, 52, 9, 60], [4])
    assert spill_mod.first_turn_end(first.tokens, first.user_starts) == 7
    assert spill_mod.session_key(None, first) == spill_mod.session_key(None, later)
    assert spill_mod.session_key(None, first) != spill_mod.session_key(None, other)
    assert spill_mod.session_key("ses_1", first) == spill_mod.hint_key("ses_1") != spill_mod.hint_key("ses_2")
    assert spill_mod.session_key(None, V([1, 2, 3], [])) is None


# --------------------------------------------------------------------------- an answer cut mid-stream

async def cut_stream(s: aiohttp.ClientSession, base: str, proxy, body: dict, headers: dict,
                     events: int = 8) -> dict:
    """Stream ``body`` through ocache and close the connection after ``events`` text deltas (a
    coding agent's user pressing Esc). Returns the assistant message received so far."""
    text: dict[str, list[str]] = {"content": [], "reasoning_content": []}
    async with s.post(base + CHAT, json=body, headers=headers) as r:
        assert r.status == 200
        n = 0
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            delta = (json.loads(line[6:])["choices"] or [{}])[0].get("delta") or {}
            for k in text:
                if delta.get(k):
                    text[k].append(delta[k])
                    n += 1
            if n >= events:
                break
        assert n >= events, "the answer ended before it could be cut"
        r.close()   # the client goes away mid-stream
    assert await proxy.wait_idle(60)
    await proxy.wait_background()
    await proxy.layer.idle()
    msg = {"role": "assistant", **{k: "".join(v) for k, v in text.items() if v}}
    msg.setdefault("content", "[interrupted]")   # the server refuses an assistant turn without content
    return msg


@pytest.mark.server
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("stop", ["evict", "drain"])
async def test_interrupted_stream_is_spilled_and_its_next_turn_restored(start_server, tmp_path, model, stop):
    """A streamed answer cut off mid-stream leaves the prompt plus a partial answer in the slot.
    ``evict``: another session takes the only slot (-np 1); ``drain``: a planned stop, then a new
    ocache on the same server and store (the slot was erased meanwhile). Either way the session tier
    spills the cut conversation, and its next turn (the prompt + the partial answer + a new user
    message) is restored from it: ``cache_n`` covers at least the cut request's prompt (dense; on the
    hybrid model what its checkpoints reach, as the tier predicted), and the greedy answer equals a
    cold prefill of that turn (``ocache.bench.exact``)."""
    srv = start_server(model, n_parallel=1, ctx_size=16384, **SERVER)
    a1 = body_of("opencode_agent_turn1.json", max_tokens=2000)
    a1.update(stream=True, ignore_eos=True)
    b1 = body_of("opencode_run3_proj2_agent_turn1.json")
    ha, hb = session_headers("opencode_agent_turn1.json"), session_headers("opencode_run3_proj2_agent_turn1.json")
    na1 = await n_prompt(srv.url, a1)
    cfg = make_config(srv, tmp_path / "cache", 2000, resume=False)   # the next turn finds it by lookup

    async def next_turn(s, base, proxy, partial) -> tuple[dict, dict]:
        a2 = copy.deepcopy(a1)
        a2.update(stream=False, max_tokens=12, **PROBS_FIELDS)
        a2.pop("ignore_eos")
        a2["messages"] += [partial, {"role": "user", "content": "go on, and list the files"}]
        rec = await send(s, base, proxy, a2, ha)
        assert rec["tier"] == "session", rec
        assert tier_of(proxy).counters["hits"] == 1, tier_of(proxy).stats()
        return a2, rec

    async with through_ocache(cfg) as (base, proxy), aiohttp.ClientSession() as s:
        partial = await cut_stream(s, base, proxy, a1, ha)
        tier = tier_of(proxy)
        st = proxy.layer.table[0]
        assert st.interrupted and len(st.tokens) == na1
        assert tier.counters["interrupted_seen"] == 1
        if stop == "evict":
            await send(s, base, proxy, b1, hb)   # B takes A's slot: A is spilled first
        else:
            await proxy.drain(30)
        await tier.flush()
        assert tier.counters["spills"] == 1, tier.stats()   # A's cut conversation, nothing else
        assert tier.counters["interrupted_spills"] == 1, tier.stats()
        [ea] = [e for e in tier.store.entries("s") if e.meta.get("interrupted")]
        assert ea.meta["session"] == spill_mod.hint_key(ha["x-session-affinity"])
        assert ea.meta["reason"] == stop and ea.meta["prompt_n"] == na1
        assert ea.n_tokens > na1     # the prompt + the tokens generated before the cut
        if stop == "evict":
            a2, rec = await next_turn(s, base, proxy, partial)
    if stop == "drain":
        # the next start: a new ocache, the server's slot emptied meanwhile
        async with aiohttp.ClientSession() as s:
            async with s.post(srv.url + "/slots/0?action=erase") as r:
                assert r.status == 200
        forget_store(tmp_path / "cache")
        async with through_ocache(cfg) as (base, proxy), aiohttp.ClientSession() as s:
            a2, rec = await next_turn(s, base, proxy, partial)
    t = rec["timings"]
    assert abs(t["cache_n"] - rec["predicted"]) <= UB, (t, rec["predicted"])
    # dense: the whole prompt (and any generated token the new turn repeats); hybrid: from the
    # checkpoint the prefill left near the prompt's end (docs/llama-server.md §14)
    assert t["cache_n"] >= (na1 if model == "dense" else na1 - UB), (t, na1)
    print(f"\n{model}/{stop}: cut prompt {na1} tokens, spilled {ea.n_tokens}; next turn "
          f"cache_n {t['cache_n']}, prompt_n {t['prompt_n']}")
    async with aiohttp.ClientSession() as s:
        async with s.post(srv.url + CHAT, json=dict(a2, cache_prompt=False, id_slot=0)) as r:
            cold = await r.json()
    assert cold["timings"]["cache_n"] == 0
    v = compare(Generation.from_response(cold), Generation.from_response(rec["data"]))
    assert v.exact and v.compared >= 4, describe(v)


@pytest.mark.server
async def test_a_conversation_too_short_to_spill_keeps_its_slot_while_another_is_empty(start_server, tmp_path):
    """The planner counts an overwrite as free only for slots the session tier would really spill
    (``SessionTier.will_spill``). A finished 700-token conversation (under ``spill_min_tokens``)
    and a new one sharing only the system prompt with it (cache-pressure's shape, ``scripts/bench-retention``): the
    new one goes to the empty slot instead of overwriting the first for ~10 shared tokens, and the
    first one's return reuses its whole prompt. (Before: it was overwritten, nothing spilled, and
    its return prefilled again.)"""
    srv = start_server("dense", n_parallel=2, ctx_size=2 * 4096, **SERVER)
    rng = random.Random(5)
    # long single-token words: more than guest_max_chars (6,000) characters in under 1,024 tokens,
    # so the request is "other" (a conversation), not a guest
    words = ("understanding information development environment international performance "
             "administration responsibility").split()

    def plain(seed: int) -> dict:
        r = random.Random(seed)
        text = " ".join(r.choice(words) for _ in range(650))
        return {"messages": [{"role": "system", "content": "You are a helpful assistant."},
                             {"role": "user", "content": f"{seed}: {text}"}],
                "max_tokens": 2, "temperature": 0, "stream": False}

    a, b = plain(rng.randrange(10**6)), plain(rng.randrange(10**6))
    cfg = make_config(srv, tmp_path / "cache", 1024)
    async with through_ocache(cfg) as (base, proxy), aiohttp.ClientSession() as s:
        ra = await send(s, base, proxy, a)
        n_a = ra["timings"]["prompt_n"] + ra["timings"]["cache_n"]
        assert 300 < n_a < 1024, n_a                     # too short for the session tier
        rb = await send(s, base, proxy, b)
        assert rb["slot"] != ra["slot"], (ra, rb)
        back = await send(s, base, proxy, a)
        tier = tier_of(proxy)
        await tier.flush()
    assert back["slot"] == ra["slot"] and back["timings"]["cache_n"] >= n_a - 1, back
    assert tier.counters["spills"] == 0


# --------------------------------------------------------------------------- ocache drain (no server)

def test_drain_command_calls_the_route(tmp_path, capsys):
    """`ocache drain` POSTs /v1/cache/drain with the admin token; the handler answers 202 and sets the
    stop event (what SIGTERM sets); without the token it is refused and nothing stops."""
    import threading

    from aiohttp import web

    from ocache.llama.server import free_port

    stopped = threading.Event()
    app = web.Application()
    app.router.add_post("/v1/cache/drain", admin.make_drain_handler(stopped.set, "s3cret"))
    async def stats(request):
        return web.json_response({})

    app.router.add_get("/v1/cache/stats", stats)
    from ocache.cli import build_parser

    with app_in_thread(app) as url:
        parser_args = ["drain", "--url", url, "--wait", "0"]
        p = build_parser()
        args = p.parse_args(parser_args)
        assert args.func(args) == 1 and not stopped.is_set()
        err = capsys.readouterr().err
        assert "admin token required" in err and "--admin-token" in err  # a sentence, not HTTP 401 + JSON
        args = p.parse_args(parser_args + ["--admin-token", "s3cret"])
        assert args.func(args) == 0
        assert stopped.wait(10)
    args = p.parse_args(["drain", "--url", f"http://127.0.0.1:{free_port()}", "--wait", "0"])
    assert args.func(args) == 2 and "cannot reach ocache" in capsys.readouterr().err
