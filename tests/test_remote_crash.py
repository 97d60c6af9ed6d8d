"""A crash loses at most the last turn (``tiers.session.live_save``, ocache/tiers/live.py): host A,
``ocache serve`` in a child process with its own llama-server and store, serves four turns of a
session and is killed (``SIGKILL``, its llama-server stopped with it: a host that died); host B, a
proxy in this process with its own llama-server and store (``tests/test_remote_hosts.py`` ``host``),
serves the session's fifth turn from the same bucket (SeaweedFS, ``s3_bucket``).

With live saves B restores the conversation as it was after A's fourth turn (its prompt and
answer) and prefills only the fifth turn's new message; without them the bucket holds only what A
anchored or spilled, and B prefills the conversation's tail again. Both answers equal a cold run's.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from ocache.bench.exact import PROBS_FIELDS, Generation, compare, describe
from ocache.llama.server import free_port
from ocache.tiers.remote import RemoteSettings
from test_remote_hosts import cold, host, remote_of
from ocache.llama.reuse import common_prefix
from ocache.tokens import TokenViewer
from test_spill import CHAT, SERVER, UB, body_of, send, session_headers, session_turn1

pytestmark = pytest.mark.server

ADMIN = "crash-test-admin"
#: seconds each bounded wait on the other process or the bucket may take (a loaded 2-core machine)
WAIT_S = 120.0


def next_turn(body: dict, answer: dict, k: int) -> dict:
    """``body`` with its ``answer`` and the ``k``-th follow-up user message appended."""
    out = copy.deepcopy(body)
    out["messages"].append({"role": "assistant", "content": answer["choices"][0]["message"].get("content") or ""})
    out["messages"].append({"role": "user", "content": f"Turn {k}: name {k} more of those words, one a line."})
    return out


def conversation(kind: str) -> tuple[dict, dict]:
    """The first turn and the session header of a ``synthetic`` conversation (~420 tokens) or of
    opencode's captured first agent turn (~7,250 tokens)."""
    if kind == "opencode":
        return ({**body_of("opencode_agent_turn1.json", max_tokens=8), **PROBS_FIELDS},
                session_headers("opencode_agent_turn1.json"))
    return session_turn1(5), {"x-session-affinity": "ses_crash"}


def host_a_config(srv, cache_dir: Path, s3: dict, live: bool) -> dict:
    """Host A's ocache.yaml (as JSON, a subset of YAML), as tests/test_remote_hosts.py's
    ``config_for``; live saves by default (a bucket is configured), else ``live_save: false``."""
    return {"upstream": srv.url, "cache_dir": str(cache_dir), "spill_min_tokens": 200, "admin_token": ADMIN,
            "tiers": {"resident": {"server_args": srv.command()[1:]},
                      "session": {"drain_min_tokens": 100, **({} if live else {"live_save": False})}},
            "store": {"remote": {**s3, "sync_s": 0.2, "refresh_s": 0.5}}}


async def wait_for(what: str, check, proc: subprocess.Popen | None = None) -> object:
    """Poll ``await check()`` until it returns something truthy, at most ``WAIT_S`` seconds (a
    condition in another process or the bucket: nothing to await here); fails with ``what``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    last: object = None
    while loop.time() < deadline:
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"host A exited ({proc.returncode}) while waiting for {what}")
        last = await check()
        if last:
            return last
        await asyncio.sleep(0.1)
    pytest.fail(f"not within {WAIT_S:g} s: {what} (last: {last!r})")


async def stats_of(s: aiohttp.ClientSession, base: str) -> dict:
    async with s.get(base + "/v1/cache/stats", headers={"Authorization": f"Bearer {ADMIN}"}) as r:
        return (await r.json())["layer"] if r.status == 200 else {}


async def session_spills(s3: dict) -> list[int]:
    """Token counts of the records the bucket's session pointers name."""
    out = []
    async with RemoteSettings(**s3).objects() as objects:
        for o in await objects.list("sessions/"):
            raw = await objects.get(o.key)
            rec = await objects.get(f"records/{json.loads(raw or b'{}').get('key')}.json")
            if rec is not None:
                out.append(int(json.loads(rec)["record"]["n_tokens"]))
    return out


@pytest.mark.parametrize("model,kind,live", [("dense", "synthetic", True), ("dense", "synthetic", False),
                                             ("dense", "opencode", True), ("dense", "opencode", False),
                                             ("hybrid", "opencode", True), ("hybrid", "opencode", False)])
async def test_kill_9_of_host_a_after_four_turns(start_server, tmp_path, s3_bucket, model, kind, live):
    """``kill -9`` of host A after four turns: B's fifth turn reuses all of A's fourth prompt that
    it repeats, as A's own slot would (live saves on: A saved each turn at idle and uploaded it
    with its session pointer), and answers as a cold run does; with live saves off it reuses less
    (what the test's power rests on). On A each turn reuses its slot as without live saves: all
    that it repeats of the turn before on the dense model; on the hybrid the server resumes from
    its checkpoint a few tokens before that (``lag``), on A's own slot and on B alike."""
    ctx = 4096 if kind == "synthetic" else 16384
    srv_a = start_server(model, n_parallel=1, ctx_size=ctx, slot_save_path=tmp_path / "slotsA", **SERVER)
    srv_b = start_server(model, n_parallel=1, ctx_size=ctx, slot_save_path=tmp_path / "slotsB", **SERVER)
    body, hdr = conversation(kind)
    cfg = tmp_path / "a.yaml"
    cfg.write_text(json.dumps(host_a_config(srv_a, tmp_path / "cacheA", s3_bucket, live)))
    port = free_port()
    log_a = open(tmp_path / "ocache-a.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "ocache", "serve", "--config", str(cfg), "--port", str(port)],
                            env={**os.environ, "OCACHE_STATE_DIR": str(tmp_path / "stateA")}, cwd=tmp_path,
                            stdout=log_a, stderr=subprocess.STDOUT)
    base_a = f"http://127.0.0.1:{port}"
    turns: list[dict] = []
    try:
        async with aiohttp.ClientSession() as s:
            async def healthy() -> bool:
                try:
                    async with s.get(base_a + "/health") as r:
                        return r.status == 200
                except aiohttp.ClientError:
                    return False

            await wait_for("host A's /health", healthy, proc)
            prev: list[int] = []
            lag = 0   # tokens A's own slot fell short of what a turn repeats of the one before
            for k in range(4):
                turns.append(body if k == 0 else next_turn(turns[-1], answer, k))
                async with s.post(base_a + CHAT, json=turns[-1], headers=hdr) as r:
                    answer = await r.json()
                    assert r.status == 200, answer
                toks = await tokens_of(srv_a.url, turns[-1])
                n4 = len(toks)
                if k:   # a live save left the slot as it was: the next turn reuses it as without one
                    lag = max(lag, common_prefix(prev, toks) - answer["timings"]["cache_n"])
                prev = toks
                if live:   # a person reads the answer: the turn's state (prompt and answer) reaches the bucket
                    await wait_for(f"turn {k + 1}'s spill in the bucket", lambda: _covers(s3_bucket, n4), proc)
            # what A anchored, warmed and spilled: nothing left to upload
            await wait_for("host A's uploads", lambda: _uploaded(s, base_a), proc)
            a_stats = await stats_of(s, base_a)
            kinds = await record_kinds(s3_bucket)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        log_a.close()
    srv_a.stop()   # the whole host is gone

    fifth = next_turn(turns[-1], answer, 4)
    t5 = await tokens_of(srv_b.url, fifth)
    # what of the fourth prompt the fifth repeats: all but where the template renders the answered
    # turn otherwise than its generation prompt (llama-server alone on A reuses no more of it)
    shared = common_prefix(await tokens_of(srv_b.url, turns[-1]), t5)
    n5 = len(t5)
    async with host(srv_b, tmp_path / "cacheB", s3_bucket) as (base, proxy, s):
        rec = await send(s, base, proxy, fifth, hdr)
        st = remote_of(proxy).stats()
    ref = await cold(srv_b, fifth)
    sess, rem = a_stats.get("tier_session", {}), a_stats.get("tier_remote", {})
    print(f"{model} {kind}, lag {lag}, live saves {'on' if live else 'off'}: host B reused {rec['timings']['cache_n']} of {n5} "
          f"tokens (tier {rec['tier']}; A's fourth prompt {n4}, {shared} of it in the fifth); A: live saves {sess.get('live_saves')}, "
          f"save p50 {sess.get('live_save_s_p50')} s, spill (server save) p50 {sess.get('spill_s_p50')} s, "
          f"uploads {rem.get('uploads')} of {rem.get('upload_bytes')} bytes, "
          f"spill bytes {sess.get('bytes')}, superseded deleted {rem.get('superseded_deleted')}; B downloaded {st['download_bytes']} bytes")
    v = compare(Generation.from_response(ref), Generation.from_response(rec["data"]))
    assert v.exact and v.compared >= 3, describe(v)
    assert shared >= n4 - 8, (n4, shared)
    assert lag == 0 if model == "dense" else 0 <= lag < UB, lag
    if live:
        assert rec["tier"] == "remote", (rec["tier"], rec["timings"], st)
        assert rec["timings"]["cache_n"] >= shared - lag, (rec["timings"], n4, shared, lag)
        # once a turn; each newer spill replaced the older in the bucket (its pointer moved)
        assert sess.get("live_saves") == 4 and rem.get("superseded_deleted") == 3, (sess, rem)
        assert kinds.count("s") == 1, kinds
    else:
        assert rec["timings"]["cache_n"] < shared - lag, (rec["timings"], n4, shared, lag)
        assert sess.get("live_saves") == 0 and "s" not in kinds, (sess, kinds)


async def tokens_of(url: str, body: dict) -> list[int]:
    viewer = TokenViewer(url)
    try:
        return list((await viewer.view(CHAT, body)).tokens)
    finally:
        await viewer.close()


async def record_kinds(s3: dict) -> list[str]:
    """The kind of every record in the bucket."""
    async with RemoteSettings(**s3).objects() as objects:
        return [json.loads(await objects.get(o.key) or b"{}")["record"]["kind"]
                for o in await objects.list("records/")]


async def _covers(s3: dict, n: int) -> bool:
    return any(m >= n for m in await session_spills(s3))


async def _uploaded(s: aiohttp.ClientSession, base: str) -> bool:
    """Host A has no background work pending and has uploaded every entry of its store."""
    st = await stats_of(s, base)
    if not st or any(st.get("background", {}).values()):
        return False
    local = int(((st.get("tier_disk") or {}).get("store") or {}).get("entries") or 0)
    return int((st.get("tier_remote") or {}).get("uploads") or 0) >= local
