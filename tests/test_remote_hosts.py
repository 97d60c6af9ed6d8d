"""Two hosts, one bucket (issue 30): two ocache proxies, each with its own real llama-server (tiny
dense model, ``start_server``), its own ``--slot-save-path`` and ``cache_dir`` (so its own local
store), and one S3 bucket on a real SeaweedFS (``s3_bucket``, tests/conftest.py) as ``store.remote``.
The proxies run in this process (``tests/test_spill.py`` ``through_ocache``); they share nothing but
the bucket: their stores are opened from different directories.

The failover test runs on the dense and the hybrid tiny model. Server settings as tests/test_spill.py (``-ub 128``, ``--cache-ram 0``, checkpoints every 256).
"""

from __future__ import annotations

import asyncio
import copy
import json
from contextlib import asynccontextmanager

import aiohttp
import pytest

from ocache.bench.exact import Generation, compare, describe
from ocache.config import Config
from ocache.tiers.remote import RemoteTier
from test_spill import CHAT, SERVER, UB, body_of, n_prompt, send, session_headers, session_turn1, \
    session_turn2, through_ocache

pytestmark = pytest.mark.server


def config_for(srv, cache_dir, s3: dict, **extra) -> Config:
    return Config(upstream=srv.url, cache_dir=str(cache_dir), spill_min_tokens=200,
                  tiers={"resident": {"server_args": srv.command()[1:]},
                         "session": {"drain_min_tokens": 100}},
                  store={"remote": {**s3, "sync_s": 0.2, "refresh_s": 0.5}}, **extra)


def remote_of(proxy) -> RemoteTier:
    t = next((t for t in proxy.layer.tiers if t.name == "remote"), None)
    assert t is not None, "the remote tier was not registered"
    return t


@asynccontextmanager
async def host(srv, cache_dir, s3: dict, listed: bool = True, **extra):
    """One host: a proxy with the cache layer in front of ``srv``; yields (base_url, proxy, http
    session), the layer ready (and, ``listed``, the bucket's first background listing done); its
    remote tier is closed at the end (its sync task and client)."""
    async with through_ocache(config_for(srv, cache_dir, s3, **extra)) as (base, proxy), \
            aiohttp.ClientSession() as s:
        try:
            await proxy.layer.ensure_ready()   # the tiers; the remote one reads the index in the background
            tier = remote_of(proxy)
            for _ in range(600 if listed else 0):   # its first listing, as a host that has run a while
                if tier.bucket.refreshed_at:
                    break
                await asyncio.sleep(0.05)
            assert tier.bucket.refreshed_at or not listed, tier.stats()
            yield base, proxy, s
        finally:
            if proxy.layer is not None:
                for t in proxy.layer.tiers:
                    if isinstance(t, RemoteTier):
                        await t.close()


async def cold(srv, body: dict) -> dict:
    async with aiohttp.ClientSession() as s:
        async with s.post(srv.url + CHAT, json=dict(body, cache_prompt=False, id_slot=0)) as r:
            out = await r.json()
    assert out["timings"]["cache_n"] == 0
    return out


async def spilled_on_a(srv_a, tmp_path, s3) -> tuple[dict, dict, int]:
    """Host A serves a session's first turn, then stops (a drain: the session is spilled and
    uploaded). Returns (first body, its answer, its prompt tokens)."""
    first = session_turn1(3)
    hdr = {"x-session-affinity": "ses_failover"}
    async with host(srv_a, tmp_path / "cacheA", s3) as (base, proxy, s):
        r1 = await send(s, base, proxy, first, hdr)
        await proxy.drain(30)
        st = remote_of(proxy).stats()
        assert st["uploads"] >= 1 and st["entries"] >= 1, st
        assert any(r.entry.kind == "s" for r in remote_of(proxy).bucket.index.values()), st
    return first, r1["data"], await n_prompt(srv_a.url, first)


@pytest.mark.parametrize("model", ["dense", "hybrid"])
async def test_a_session_from_host_a_continues_on_host_b(start_server, tmp_path, s3_bucket, model):
    """As after a failover: the next turn on B restores A's spilled conversation from the bucket
    (``cache_n`` >= A's last prompt minus one ubatch) and answers as a cold run does."""
    srv_a = start_server(model, n_parallel=1, ctx_size=4096, slot_save_path=tmp_path / "slotsA", **SERVER)
    srv_b = start_server(model, n_parallel=1, ctx_size=4096, slot_save_path=tmp_path / "slotsB", **SERVER)
    first, answer, n1 = await spilled_on_a(srv_a, tmp_path, s3_bucket)
    second = session_turn2(3, first, answer)
    async with host(srv_b, tmp_path / "cacheB", s3_bucket) as (base, proxy, s):
        rec = await send(s, base, proxy, second, {"x-session-affinity": "ses_failover"})
        st = remote_of(proxy).stats()
    assert rec["tier"] == "remote", (rec["tier"], rec["timings"], st)
    assert rec["timings"]["cache_n"] >= n1 - UB, (rec["timings"], n1)
    assert st["downloads"] == 1 and st["restores"] == 1 and st["hits"] == 1, st
    ref = await cold(srv_b, second)
    print(f"host B: cache_n {rec['timings']['cache_n']}, prompt_n {rec['timings']['prompt_n']} "
          f"({rec['timings']['prompt_ms']:.0f} ms) after a {st['download_bytes']}-byte download in "
          f"{st['download_s_max'] * 1e3:.0f} ms; cold: prompt_n {ref['timings']['prompt_n']} "
          f"({ref['timings']['prompt_ms']:.0f} ms)")
    v = compare(Generation.from_response(ref), Generation.from_response(rec["data"]))
    assert v.exact and v.compared >= 3, describe(v)


async def test_a_flipped_byte_in_the_bucket_is_refused_before_the_server_reads_it(start_server, tmp_path, s3_bucket):
    """The same failover with one byte of the spilled slot file flipped in the bucket: B's download
    fails its hash check, nothing is restored (the request is prefilled as on a cold host, and
    answers as a cold run does), and the damaged entry is quarantined on B, not deleted for the fleet."""
    srv_a = start_server("dense", n_parallel=1, ctx_size=4096, slot_save_path=tmp_path / "slotsA", **SERVER)
    srv_b = start_server("dense", n_parallel=1, ctx_size=4096, slot_save_path=tmp_path / "slotsB", **SERVER)
    first, answer, n1 = await spilled_on_a(srv_a, tmp_path, s3_bucket)
    second = session_turn2(3, first, answer)
    async with host(srv_b, tmp_path / "cacheB", s3_bucket) as (base, proxy, s):
        tier = remote_of(proxy)
        listed = [await tier.bucket.entry(k) for k in tier.bucket.catalog]   # read by key from B's listing
        r = next(r for r in listed if r is not None and r.entry.kind == "s")
        raw = bytearray(await tier.bucket.objects.get(r.objects["bin"]) or b"")
        raw[len(raw) - 100] ^= 0x40
        await tier.bucket.objects.put(r.objects["bin"], bytes(raw))
        rec = await send(s, base, proxy, second, {"x-session-affinity": "ses_failover"})
        st = tier.stats()
        left = sorted(p.name for p in (tmp_path / "slotsB").iterdir() if p.name.startswith("oc-tmp-"))
        assert tier.bucket.quarantined == {r.key: "hash"}     # on B only: left in the bucket
        assert f"records/{r.key}.json" in {o.key for o in await tier.bucket.objects.list("records/")}
    assert st["verify_failed"] == 1 and st["quarantined"] == 1 and st["restores"] == 0 and st["downloads"] == 0, st
    assert left == []
    assert rec["timings"]["cache_n"] < n1 - UB, rec["timings"]
    v = compare(Generation.from_response(await cold(srv_b, second)), Generation.from_response(rec["data"]))
    assert v.exact, describe(v)


async def test_a_new_session_on_b_in_a_folder_restores_its_head_from_the_bucket(start_server, tmp_path, s3_bucket):
    """A's first opencode turn in a folder writes the disk tier's anchors (harness head, session
    start) and uploads them; a new session in the same folder on B restores the longest of them
    from the bucket instead of prefilling it."""
    srv_a = start_server("dense", n_parallel=1, ctx_size=16384, slot_save_path=tmp_path / "slotsA", **SERVER)
    srv_b = start_server("dense", n_parallel=1, ctx_size=16384, slot_save_path=tmp_path / "slotsB", **SERVER)
    a1 = body_of("opencode_agent_turn1.json")
    async with host(srv_a, tmp_path / "cacheA", s3_bucket) as (base, proxy, s):
        await send(s, base, proxy, a1, session_headers("opencode_agent_turn1.json"))
        tier = remote_of(proxy)
        await tier.flush()
        anchors = [r.entry.n_tokens for r in tier.bucket.index.values() if r.entry.kind == "a"]
    assert anchors, tier.stats()
    other = copy.deepcopy(a1)
    last = next(m for m in reversed(other["messages"]) if m["role"] == "user")
    last["content"] = "List every file of this folder, one a line." if isinstance(last["content"], str) \
        else [{"type": "text", "text": "List every file of this folder, one a line."}]
    async with host(srv_b, tmp_path / "cacheB", s3_bucket) as (base, proxy, s):
        rec = await send(s, base, proxy, other, {"x-session-affinity": "ses_new_on_b"})
        st = remote_of(proxy).stats()
    assert rec["tier"] == "remote", (rec["tier"], rec["timings"], st)
    assert rec["timings"]["cache_n"] >= max(anchors) - UB, (rec["timings"], anchors)
    print(f"host B, new session: cache_n {rec['timings']['cache_n']}, prompt_n {rec['timings']['prompt_n']} "
          f"after a {st['download_bytes']}-byte download in {st['download_s_max'] * 1e3:.0f} ms")
    assert st["downloads"] == 1, json.dumps(st)


async def timed_send(s, base, proxy, body: dict, headers: dict) -> tuple[dict, float]:
    """``send`` timed from the request to its whole answer (then the observation, not the layer's
    ``idle``: that flushes the remote tier, a sync round, which a black hole holds for its client
    timeouts)."""
    loop = asyncio.get_running_loop()
    t = loop.time()
    async with s.post(base + CHAT, json=body, headers=headers) as r:
        data = await r.json()
        wall = loop.time() - t
        assert r.status == 200, data
        rec = {"tier": r.headers.get("X-OCache-Tier"), "timings": data["timings"], "data": data}
    await proxy.wait_background()
    return rec, wall


async def test_a_black_hole_bucket_ends_in_a_cold_exact_plan(start_server, tmp_path, monkeypatch):
    """Host B's bucket accepts connections and never answers (a fault a real S3 server cannot
    produce: ``ocache.toolchain.s3faults.BlackHole``). The proxy starts without reading it, the
    first request's lookup gives up at the deadline priced by the prompt (its cold prefill, nothing
    before the server's rate was measured, plus 1 s) and the request is planned cold and answers as a cold run does; the
    next request within the backoff does not ask the bucket."""
    from ocache.tiers.remote import DEADLINE_SLACK_S
    from ocache.toolchain.s3faults import BlackHole

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    srv_b = start_server("dense", n_parallel=1, ctx_size=4096, slot_save_path=tmp_path / "slotsB", **SERVER)
    hole = await BlackHole().start()
    first = session_turn1(3)
    n = await n_prompt(srv_b.url, first)
    try:
        s3 = {"url": "s3://bkt/ocache", "endpoint_url": hole.endpoint_url, "region": "us-east-1"}
        async with host(srv_b, tmp_path / "cacheB", s3, listed=False) as (base, proxy, s):
            tier = remote_of(proxy)
            assert tier.prefill_tps_of() is None and tier.lookup_deadline_s(n) == DEADLINE_SLACK_S
            rec, wall = await timed_send(s, base, proxy, first, {"x-session-affinity": "ses_hole"})
            st = tier.stats()
            assert tier.bucket.reach.unreachable() or st["bucket_down"] == 0
        assert hole.accepted >= 1 and tier.bucket.refreshed_at == 0
    finally:
        await hole.close()
    assert rec["tier"] == "cold" and rec["timings"]["cache_n"] == 0, (rec["tier"], rec["timings"], st)
    assert st["lookup_abandoned"] == 1 and st["offers"] == 0 and st["downloads"] == 0, st
    t = asyncio.get_running_loop().time()
    ref = await cold(srv_b, first)
    cold_s = asyncio.get_running_loop().time() - t
    print(f"black hole: a {n}-token first request took {wall:.2f} s through ocache (lookup deadline "
          f"{DEADLINE_SLACK_S:.2f} s: no rate measured yet), {cold_s:.2f} s cold to llama-server alone")
    v = compare(Generation.from_response(ref), Generation.from_response(rec["data"]))
    assert v.exact and v.compared >= 3, describe(v)


async def test_a_stalled_download_ends_in_a_cold_exact_plan(start_server, tmp_path, s3_bucket):
    """A's spilled conversation is in the bucket; B reads the bucket through a proxy that stalls
    every data object after 64 KiB (``ocache.toolchain.s3faults.StallingProxy``). B's next turn of
    the session finds the spill by key, its download is abandoned at what it saves (plus 1 s, less
    the lookup), and the request goes on from what the slot holds (cold here), answering as a cold
    run does; nothing partial is left in B's slot directory."""
    from ocache.toolchain.s3faults import StallingProxy

    srv_a = start_server("dense", n_parallel=1, ctx_size=4096, slot_save_path=tmp_path / "slotsA", **SERVER)
    srv_b = start_server("dense", n_parallel=1, ctx_size=4096, slot_save_path=tmp_path / "slotsB", **SERVER)
    first, answer, n1 = await spilled_on_a(srv_a, tmp_path, s3_bucket)
    second = session_turn2(3, first, answer)
    proxy_s3 = await StallingProxy(s3_bucket["endpoint_url"], stall_after=4096).start()
    try:
        async with host(srv_b, tmp_path / "cacheB", dict(s3_bucket, endpoint_url=proxy_s3.endpoint_url)) \
                as (base, proxy, s):
            rec, wall = await timed_send(s, base, proxy, second, {"x-session-affinity": "ses_failover"})
            st = remote_of(proxy).stats()
    finally:
        await proxy_s3.close()
    left = sorted(p.name for p in (tmp_path / "slotsB").iterdir() if p.name.startswith("oc-tmp-"))
    assert proxy_s3.stalled >= 1 and st["deadline_abandoned"] == 1, st
    assert st["downloads"] == 0 and st["restores"] == 0 and left == [], (st, left)
    assert rec["tier"] != "remote" and rec["timings"]["cache_n"] < n1 - UB, (rec["tier"], rec["timings"])
    t = asyncio.get_running_loop().time()
    ref = await cold(srv_b, second)
    cold_s = asyncio.get_running_loop().time() - t
    print(f"stalled download: the next turn took {wall:.2f} s through ocache (the spill of {n1} tokens; "
          f"no rate measured yet: its deadline is 1 s, less the lookup), {cold_s:.2f} s cold to llama-server alone")
    v = compare(Generation.from_response(ref), Generation.from_response(rec["data"]))
    assert v.exact and v.compared >= 3, describe(v)
