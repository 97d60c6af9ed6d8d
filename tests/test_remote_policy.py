"""The bucket-wide policy of the remote tier (``ocache/tiers/remote_policy.py``): three hosts with
different budgets, own bounds and TTLs keep the one policy stored in the bucket; a forged or newer
policy. Against a real SeaweedFS on loopback (``s3_bucket``, tests/conftest.py; hosts as in
tests/test_remote.py); no llama-server (slot files in the server's layout, ``tests/test_store.py``).
"""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

from ocache.llama.flags import ServerParams
from ocache.tiers.remote import RemoteTier
from ocache.tiers.remote_bucket import DATA, RECORDS, USE, RemoteBucket
from ocache.tiers.remote_policy import POLICY, Policy, policy_doc
from test_remote import host
from test_store import Clock, put

FLEET_KEY = b"fleet-key-0123456789abcdef"
STATE = 20_000
N_TOKENS = 50


def entry_size(store) -> int:
    """Bytes of one test entry (all are the same size: same state bytes and token count)."""
    return put(store, [0] * N_TOKENS, state_bytes=STATE, kind="a", ckpt=False, seed=99).bytes


def configured(tmp_path, name, s3, clock, *, budget: int, own: int | None, ttl_s: float,
               key: bytes | None = None, replace: bool = False):
    """A host whose config proposes ``budget`` bytes and ``ttl_s`` for the bucket, with ``own``
    bytes for its own uploads (``max_gb``)."""
    store, objects, bucket = host(tmp_path, name, s3, clock=clock)
    bucket = RemoteBucket(objects, store, budget_bytes=budget, ttl_s=ttl_s, host_max_bytes=own, host=name,
                          orphan_age_s=3600, clock=clock, fleet_key=key, replace_policy=replace)
    return store, objects, bucket


def recorded_deletes(bucket) -> list[tuple[str, str]]:
    """``(key, reason)`` of every entry ``bucket`` deletes from now on."""
    seen: list[tuple[str, str]] = []
    real = bucket.delete

    async def delete(key, reason):
        seen.append((key, reason))
        await real(key, reason)

    bucket.delete = delete
    return seen


def data_bytes_peak(*objects_list) -> dict:
    """Track the bytes of ``data/`` objects as the given clients' puts and deletes complete (all
    in this event loop): ``{"now", "peak"}``, starting from 0 (an empty bucket)."""
    track = {"now": 0, "peak": 0, "sizes": {}}
    for objects in objects_list:
        real_put, real_delete = objects.put, objects.delete

        async def tracked_put(key, body, *, create_only=False, _put=real_put):
            ok = await _put(key, body, create_only=create_only)
            if ok and key.startswith(DATA) and key not in track["sizes"]:
                n = len(body) if isinstance(body, (bytes, bytearray)) else body.seek(0, 2)
                track["sizes"][key] = n
                track["now"] += n
                track["peak"] = max(track["peak"], track["now"])
            return ok

        async def tracked_delete(key, _delete=real_delete):
            await _delete(key)
            track["now"] -= track["sizes"].pop(key, 0)

        objects.put, objects.delete = tracked_put, tracked_delete
    return track


async def bucket_state(objects) -> tuple[int, dict[str, str]]:
    """The bucket's data bytes and each record's uploader (``host``), read back from the bucket."""
    data = sum(o.size for o in await objects.list(DATA))
    hosts = {}
    for o in await objects.list(RECORDS):
        doc = json.loads(await objects.get(o.key) or b"{}")
        hosts[o.key[len(RECORDS):-5]] = doc["host"]
    return data, hosts


async def test_the_budget_and_ttl_hold_bucket_wide_with_three_hosts_configured_differently(tmp_path, s3_bucket):
    """A creates the policy from its config (8 entries, TTL 1 h); B proposes 2 entries and a 60 s
    TTL, C 100 entries and no TTL. All three upload concurrently, each more than fits: the
    bucket ends at the policy's 8 entries (not B's 2, not C's 100), the peak of concurrent
    uploads stays within one entry per other host over it, each host's own uploads within its
    own max_gb, and a host evicting for its own bound deletes only its own entries. Then a TTL
    pass: past B's own 60 s but within the bucket's hour nothing expires; past the hour every
    entry expires, with C (no TTL of its own) doing it, and an orphaned use object is swept."""
    clock = Clock()
    size = entry_size(host(tmp_path, "probe", s3_bucket)[0])
    budget = 8 * size + size // 2
    sa, oa, ba = configured(tmp_path, "A", s3_bucket, clock, budget=budget, own=5 * size, ttl_s=3600)
    sb, ob, bb = configured(tmp_path, "B", s3_bucket, clock, budget=2 * size, own=3 * size, ttl_s=60)
    sc, oc, bc = configured(tmp_path, "C", s3_bucket, clock, budget=100 * size, own=100 * size, ttl_s=0)
    hosts = [(sa, oa, ba), (sb, ob, bb), (sc, oc, bc)]
    async with oa, ob, oc:
        await ba.refresh()                        # A is first: the bucket's policy is A's config
        assert ba.policy_source == "created" and ba.counters["policy_created"] == 1
        tiers = [RemoteTier(b, SimpleNamespace(params=ServerParams())) for _, _, b in hosts]
        deletes = {b.host: recorded_deletes(b) for _, _, b in hosts}
        peak = data_bytes_peak(oa, ob, oc)
        uploader: dict[str, str] = {}
        for rnd in range(3):                      # each host commits 3 entries a round, 9 in all
            for i, (s, _, b) in enumerate(hosts):
                for j in range(3):
                    e = put(s, [1000 * i + 10 * rnd + j] * N_TOKENS, state_bytes=STATE, kind="a", ckpt=False,
                            seed=100 * i + 10 * rnd + j)
                    uploader[e.key] = b.host
            await asyncio.gather(*(t.sync(refresh=True) for t in tiers))
        for t in tiers:                           # a last round each: the excess of concurrent uploads evicted
            await t.sync(refresh=True)

        data, by_host = await bucket_state(oa)
        assert data <= budget and len(by_host) == 8, (data, budget, by_host)   # the policy's budget, full
        assert [b.policy_source for _, _, b in hosts] == ["bucket"] * 3      # read back by all
        assert all(b.budget_bytes == budget and b.ttl_s == 3600 for _, _, b in hosts)
        assert peak["peak"] <= budget + 2 * size, (peak, budget, size)
        counts = {h: list(by_host.values()).count(h) for h in "ABC"}
        assert counts["A"] <= 5 and counts["B"] <= 3, counts                 # each host's own bound
        assert bb.counters["evicted_own"] > 0 and bb.own_bytes() <= 3 * size
        for name, seen in deletes.items():        # the own bound evicts only the host's own entries
            own = [uploader[k] for k, why in seen if "own upload bound" in why]
            assert set(own) <= {name}, (name, own)

        # the ledger of a host's own uploads survives a restart
        again = RemoteBucket(ob, sb, budget_bytes=2 * size, host="B", host_max_bytes=3 * size)
        assert again.mine == bb.mine and again.own_bytes() == bb.own_bytes()

        # TTL: the bucket's hour, whatever a host's own config says
        await ob.put(f"{USE}{'f' * 32}.json", json.dumps({"hits": 1, "last_used": 0}).encode())  # no record
        now = time.time()
        bb.wall = lambda: now + 600               # past B's own 60 s, within the bucket's hour
        await tiers[1].sync(refresh=True)
        assert bb.counters["expired"] == 0 and len((await bucket_state(ob))[1]) == 8
        bc.wall = lambda: now + 3600 + 600        # past the hour (C has no TTL of its own)
        await tiers[2].sync(refresh=True)
        data, by_host = await bucket_state(oc)
        assert by_host == {} and data == 0 and bc.counters["expired"] == 8
        assert await oc.list(USE) == [] and bc.counters["uses_swept"] == 1


async def test_a_forged_policy_does_not_shrink_the_fleets_budget(tmp_path, s3_bucket):
    """A fleet with a key: A's signed policy is read by B. A bucket writer without the key
    replaces it with a 1-byte budget (unsigned), then with one signed by another key: B refuses
    both (counted once each), keeps the budget it verified and evicts nothing; a new host C keeps
    its own config's; neither overwrites the forgery. A keyed host configured to replace the
    policy repairs it. Without a fleet key a budget of 0 is refused as well."""
    clock = Clock()
    size = entry_size(host(tmp_path, "probe", s3_bucket)[0])
    sa, oa, ba = configured(tmp_path, "A", s3_bucket, clock, budget=6 * size, own=None, ttl_s=0, key=FLEET_KEY)
    sb, ob, bb = configured(tmp_path, "B", s3_bucket, clock, budget=6 * size, own=None, ttl_s=0, key=FLEET_KEY)
    async with oa, ob:
        for i in range(4):
            put(sa, [7 + i] * N_TOKENS, state_bytes=STATE, kind="a", ckpt=False, seed=i)
        ta, tb = (RemoteTier(b, SimpleNamespace(params=ServerParams())) for b in (ba, bb))
        assert await ta.sync(refresh=True) == 4
        await tb.sync(refresh=True)
        assert bb.policy_source == "bucket" and bb.budget_bytes == 6 * size

        for forged in (policy_doc(Policy(1, 1.0), "mallory", 0.0, None),
                       policy_doc(Policy(1, 1.0), "mallory", 0.0, b"another-key-0123456789")):
            await oa.put(POLICY, json.dumps(forged).encode())
            await tb.sync(refresh=True)
            assert bb.budget_bytes == 6 * size and bb.ttl_s == 0 and bb.policy_source == "refused"
        assert bb.counters["policy_refused"] == 2 and bb.counters["evicted"] == bb.counters["expired"] == 0
        assert len(await oa.list(RECORDS)) == 4
        sc, oc, bc = configured(tmp_path, "C", s3_bucket, clock, budget=5 * size, own=None, ttl_s=0, key=FLEET_KEY)
        async with oc:
            await bc.refresh()
            assert bc.policy_source == "refused" and bc.budget_bytes == 5 * size     # its own config's
            assert json.loads(await oc.get(POLICY) or b"{}")["set_by"] == "mallory"    # left as it is

            sd, od, bd = configured(tmp_path, "D", s3_bucket, clock, budget=7 * size, own=None, ttl_s=0,
                                    key=FLEET_KEY, replace=True)
            async with od:
                await bd.refresh()
                assert bd.policy_source == "replaced" and bd.counters["policy_replaced"] == 1
                await bc.refresh()
                assert bc.policy_source == "bucket" and bc.budget_bytes == 7 * size

        so, oo, bo = configured(tmp_path, "O", s3_bucket, clock, budget=6 * size, own=None, ttl_s=0)
        async with oo:                             # no fleet key: a budget of 0 is refused too
            await oo.put(POLICY, json.dumps({"version": 1, "budget_bytes": 0}).encode())
            await bo.refresh()
            assert bo.counters["policy_refused"] == 1 and bo.budget_bytes == 6 * size


async def test_a_newer_policy_is_respected_and_never_overwritten(tmp_path, s3_bucket):
    """A policy of a higher version with fields this host does not know: its budget and TTL are
    kept to, the unknown fields ignored, and a host configured to replace the policy leaves it
    as it is."""
    clock = Clock()
    newer = json.dumps({"version": 2, "budget_bytes": 123_456_789, "ttl_s": 7200, "tiers": {"gold": 1},
                        "budget_by_identity": {"id-A": 5}}).encode()
    sa, oa, ba = configured(tmp_path, "A", s3_bucket, clock, budget=10**6, own=None, ttl_s=60, replace=True)
    async with oa:
        assert await oa.put(POLICY, newer, create_only=True)
        await ba.refresh()
        assert (ba.budget_bytes, ba.ttl_s, ba.policy_source) == (123_456_789, 7200.0, "bucket")
        assert await oa.get(POLICY) == newer and ba.counters["policy_replaced"] == 0


async def test_more_hosts_uploading_at_once_than_the_budget_holds_leave_it_full(tmp_path, s3_bucket):
    """Six hosts, a budget of 3.5 entries, every host uploading 3 entries at once, 3 rounds: the bucket
    ends with the 3 entries that fit, not fewer (each host makes room for its own upload only; a
    host that also made room for the others' uploads in flight evicted the bucket empty), and the
    peak stays within one entry per other host over the budget."""
    clock = Clock()
    size = entry_size(host(tmp_path, "probe", s3_bucket)[0])
    budget = 3 * size + size // 2
    hosts = [configured(tmp_path, f"H{i}", s3_bucket, clock, budget=budget, own=None, ttl_s=0) for i in range(6)]
    for _, o, _ in hosts:
        await o.__aenter__()
    try:
        peak = data_bytes_peak(*(o for _, o, _ in hosts))
        tiers = [RemoteTier(b, SimpleNamespace(params=ServerParams())) for _, _, b in hosts]
        for rnd in range(3):
            for i, (s, _, _) in enumerate(hosts):
                for j in range(3):
                    put(s, [5000 + 100 * i + 10 * rnd + j] * N_TOKENS, state_bytes=STATE, kind="a", ckpt=False,
                        seed=5000 + 100 * i + 10 * rnd + j)
            await asyncio.gather(*(t.sync(refresh=True) for t in tiers))
        for t in tiers:
            await t.sync(refresh=True)
        data, by_host = await bucket_state(hosts[0][1])
        assert len(by_host) == 3 and data <= budget, (data, budget, by_host)
        assert peak["peak"] <= budget + 5 * size, (peak, budget, size)
    finally:
        for _, o, _ in hosts:
            await o.__aexit__(None, None, None)
