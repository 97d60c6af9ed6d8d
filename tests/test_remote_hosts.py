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
async def host(srv, cache_dir, s3: dict, **extra):
    """One host: a proxy with the cache layer in front of ``srv``; yields (base_url, proxy, http
    session), the layer ready; its remote tier is closed at the end (its sync task and client)."""
    async with through_ocache(config_for(srv, cache_dir, s3, **extra)) as (base, proxy), \
            aiohttp.ClientSession() as s:
        try:
            await proxy.layer.ensure_ready()   # the tiers; the remote one reads the index in the background
            tier = remote_of(proxy)
            for _ in range(600):               # its first read, as a host that has run a while (bounded)
                if tier.bucket.refreshed_at:
                    break
                await asyncio.sleep(0.05)
            assert tier.bucket.refreshed_at, tier.stats()
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
