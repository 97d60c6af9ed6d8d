"""The remote tier's bucket against a real S3 server on loopback (SeaweedFS, ``ocache/toolchain/s3server.py``;
``s3_bucket`` in tests/conftest.py): two hosts are two local stores (own slot directory and meta
directory) over one bucket. No llama-server: the slot files are written in the server's layout
(``tests/test_store.py`` ``put``); the restore into a server is ``tests/test_remote_hosts.py``.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from ocache.llama.flags import ServerParams
from ocache.tiers.remote import RemoteSettings, RemoteTier
from ocache.tiers.remote_bucket import DATA, RECORDS, USE, RemoteBucket, RemoteError
from ocache.tiers.remote_client import Location, RemoteConfigError, S3Objects
from ocache.tiers.store import Store, entry_key
from test_store import Clock, oc_files, put, write_slot_file

TOKS = list(range(100, 1300))


def host(tmp_path: Path, name: str, s3: dict, identity: str = "id-A", budget: int = 10**9,
         clock=None) -> tuple[Store, S3Objects, RemoteBucket]:
    store = Store(tmp_path / name / "meta", tmp_path / name / "slots", identity, clock=clock or Clock())
    store.open()
    objects = RemoteSettings(**s3).objects()
    bucket = RemoteBucket(objects, store, budget_bytes=budget, host=name, orphan_age_s=3600,
                          clock=clock or Clock())
    return store, objects, bucket


async def listed(objects: S3Objects, prefix: str) -> dict[str, int]:
    return {o.key: o.size for o in await objects.list(prefix)}


def test_location_parse():
    assert Location.parse("s3://bkt/a/b/") == Location("bkt", "a/b/")
    assert Location.parse("s3://bkt") == Location("bkt", "")
    for bad in ("http://bkt/x", "s3:///x", "s3://bkt/x?y=1"):
        with pytest.raises(RemoteConfigError):
            Location.parse(bad)


async def test_create_only_put(s3_bucket):
    async with RemoteSettings(**s3_bucket).objects() as o:
        assert await o.put("records/k.json", b"first", create_only=True) is True
        assert await o.put("records/k.json", b"second", create_only=True) is False
        assert await o.get("records/k.json") == b"first"
        assert await o.get("records/none.json") is None


async def test_an_entry_uploaded_by_one_host_is_fetched_verified_by_another(tmp_path, s3_bucket):
    sa, oa, ba = host(tmp_path, "A", s3_bucket)
    sb, ob, bb = host(tmp_path, "B", s3_bucket)
    async with oa, ob:
        e = put(sa, TOKS, state_bytes=200_000, kind="a")
        assert await ba.upload(e)
        objs = await listed(oa, "")
        assert f"{RECORDS}{e.key}.json" in objs
        assert sum(v for k, v in objs.items() if k.startswith(DATA)) == e.bytes
        await bb.refresh()
        assert list(bb.catalog) == [e.key] and bb.sizes == {e.key: e.bytes}
        assert bb.index == {}                      # a listing reads no record: asked for by key
        got = await bb.fetch(e.key)
        assert got.key == e.key and got.meta.get("remote") == "A"
        assert {r: (f.size, f.xxh3) for r, f in got.files.items()} == \
               {r: (f.size, f.xxh3) for r, f in e.files.items()}
        assert sb.verify(e.key, TOKS).key == e.key          # a trusted local entry now
        assert sb.find_prefixes(TOKS + [1, 2], kind="a")[0].key == e.key


async def test_a_flipped_byte_in_the_bucket_is_refused_and_nothing_reaches_the_slot_dir(tmp_path, s3_bucket):
    sa, oa, ba = host(tmp_path, "A", s3_bucket)
    sb, ob, bb = host(tmp_path, "B", s3_bucket)
    async with oa, ob:
        e = put(sa, TOKS, state_bytes=100_000, kind="a")
        await ba.upload(e)
        name = ba.index[e.key].objects["bin"]
        raw = bytearray(await oa.get(name) or b"")
        raw[len(raw) // 2] ^= 0x01
        await oa.put(name, bytes(raw))
        await bb.refresh()
        with pytest.raises(RemoteError) as err:
            await bb.fetch(e.key)
        assert err.value.reason == "hash"
        assert oc_files(sb) == [] and sb.get(e.key) is None and sb.used_bytes() == 0
        assert bb.counters["verify_failed"] == 1 and bb.counters["quarantined"] == 1
        # quarantined on B, not deleted for the fleet (the fault may be B's); B never tries it again
        assert bb.quarantined == {e.key: "hash"}
        with pytest.raises(RemoteError) as err:
            await bb.fetch(e.key)
        assert err.value.reason == "quarantined" and bb.counters["verify_failed"] == 1
        await bb.refresh()
        assert e.key in bb.quarantined
        tb = RemoteTier(bb, SimpleNamespace(params=ServerParams(), checks_xxh3=False))
        view = SimpleNamespace(tokens=TOKS + [1], head_end=0, user_starts=[])
        assert await tb.lookup(view, SimpleNamespace(kind="agent", session=None)) is None
        assert f"{RECORDS}{e.key}.json" in await listed(oa, RECORDS)


async def test_a_host_that_dies_between_data_and_record_leaves_nothing_restorable(tmp_path, s3_bucket, monkeypatch):
    sa, oa, ba = host(tmp_path, "A", s3_bucket)
    sb, ob, bb = host(tmp_path, "B", s3_bucket)
    async with oa, ob:
        e = put(sa, TOKS, state_bytes=50_000, kind="s")
        real_put = oa.put

        async def dies_at_the_record(key, body, *, create_only=False):
            if key.startswith(RECORDS):
                raise ConnectionResetError("host A died")
            return await real_put(key, body, create_only=create_only)

        monkeypatch.setattr(oa, "put", dies_at_the_record)
        with pytest.raises(ConnectionResetError):
            await ba.upload(e)
        assert any(k.startswith(DATA) for k in await listed(ob, ""))
        await bb.refresh()
        assert bb.index == {}                                  # nothing to restore
        assert await bb.sweep() == 0                           # younger than orphan_age_s: kept
        bb.orphan_age_s = 0.0
        assert await bb.sweep() == len(e.files)                # then swept
        assert await listed(ob, "") == {"policy.json": (await ob.head("policy.json")).size}   # nothing else


async def test_two_hosts_uploading_one_entry_keep_one_record_and_the_winners_bytes(tmp_path, s3_bucket):
    sa, oa, ba = host(tmp_path, "A", s3_bucket)
    sb, ob, bb = host(tmp_path, "B", s3_bucket)
    sc, oc, bc = host(tmp_path, "C", s3_bucket)
    async with oa, ob, oc:
        ea = put(sa, TOKS, state_bytes=30_000, kind="a", seed=1)
        eb = put(sb, TOKS, state_bytes=30_000, kind="a", seed=2)   # same key, other bytes
        assert ea.key == eb.key and ea.files["bin"].xxh3 != eb.files["bin"].xxh3
        assert await ba.upload(ea)

        async def not_yet(key):      # B asked whether the bucket has it before A's record landed
            return None

        head, ob.head = ob.head, not_yet
        assert await bb.upload(eb)
        ob.head = head
        assert bb.counters["upload_lost_race"] == 1
        data = await listed(oa, DATA)
        assert len(data) == len(ea.files) and all(ea.files["bin"].xxh3 in k or "ckpt" in k for k in data)
        await bc.refresh()
        got = await bc.fetch(ea.key)
        assert got.files["bin"].xxh3 == ea.files["bin"].xxh3


async def test_the_bucket_budget_holds_under_writes_from_two_hosts(tmp_path, s3_bucket):
    clock = Clock()
    sa, oa, ba = host(tmp_path, "A", s3_bucket, clock=clock)
    sb, ob, bb = host(tmp_path, "B", s3_bucket, clock=clock)
    async with oa, ob:
        ta = RemoteTier(ba, SimpleNamespace(params=ServerParams()))
        tb = RemoteTier(bb, SimpleNamespace(params=ServerParams()))
        size = put(sa, [1, 2, 3], state_bytes=20_000, kind="a", ckpt=False).bytes
        budget = 5 * size + size // 2
        ba.budget_bytes = bb.budget_bytes = budget
        for i in range(6):
            put(sa, [10 + i] * 50, state_bytes=20_000, kind="a", ckpt=False, seed=i)
            put(sb, [90 + i] * 50, state_bytes=20_000, kind="a", ckpt=False, seed=10 + i)
        await asyncio.gather(ta.sync(), tb.sync())
        await asyncio.gather(ta.sync(), tb.sync())
        await ta.sync()
        records = await listed(oa, RECORDS)
        total = 0
        for k in records:
            doc = json.loads(await oa.get(k) or b"{}")
            total += sum(f["size"] for f in doc["record"]["files"].values())
        assert 0 < total <= budget
        assert len(records) == 5
        data = await listed(oa, DATA)
        assert sum(data.values()) <= budget + 2 * size  # at most one orphan per host, swept later


async def test_eviction_follows_the_value_rule_with_the_use_objects(tmp_path, s3_bucket):
    clock = Clock()
    sa, oa, ba = host(tmp_path, "A", s3_bucket, clock=clock)
    sb, ob, bb = host(tmp_path, "B", s3_bucket, clock=clock)
    async with oa, ob:
        es = [put(sa, [20 + i] * 40, state_bytes=10_000, kind="a", ckpt=False, seed=i) for i in range(3)]
        for e in es:
            await ba.upload(e)
        await bb.refresh()
        await bb.note_use(es[0].key)              # B confirmed a hit of the oldest one
        assert USE + es[0].key + ".json" in await listed(ob, USE)
        await ba.refresh()
        assert ba.index[es[0].key].entry.hits >= 1
        ba.budget_bytes = 2 * es[0].bytes + 1
        await ba.make_room(0)
        assert set(ba.index) == {es[0].key, es[2].key} or set(ba.index) == {es[0].key, es[1].key}
        assert es[0].key in ba.index


async def test_lookup_offers_a_bucket_entry_the_local_store_lacks(tmp_path, s3_bucket):
    sa, oa, ba = host(tmp_path, "A", s3_bucket)
    sb, ob, bb = host(tmp_path, "B", s3_bucket)
    so, oo, bo = host(tmp_path, "O", s3_bucket, identity="id-other")
    async with oa, ob, oo:
        e = put(sa, TOKS, state_bytes=50_000, kind="a")
        await ba.upload(e)
        tb = RemoteTier(bb, SimpleNamespace(params=ServerParams(), checks_xxh3=False), grid=100)
        view = SimpleNamespace(tokens=TOKS + [7, 8, 9], head_end=0, user_starts=[])
        offer = await tb.lookup(view, SimpleNamespace(kind="agent", session=None))
        assert offer is not None and offer.tier == "remote" and offer.tokens_usable == len(TOKS)
        assert offer.cost_s > 0
        assert await tb.lookup(SimpleNamespace(tokens=TOKS[:-1] + [5], head_end=0, user_starts=[]),
                               SimpleNamespace(kind="agent", session=None)) is None  # not a prefix
        to = RemoteTier(bo, SimpleNamespace(params=ServerParams()), grid=100)
        assert await to.lookup(view, SimpleNamespace(kind="agent", session=None)) is None  # other identity
        await bb.fetch(e.key)
        assert await tb.lookup(view, SimpleNamespace(kind="agent", session=None)) is None  # local now
        assert entry_key("id-A", "a", TOKS) == e.key


@pytest.mark.parametrize("secret_ok", [True, False])
def test_doctor_checks_the_bucket(tmp_path, s3_bucket, secret_ok, monkeypatch):
    """``ocache doctor`` reads ``store.remote`` from the config and asks the bucket: an ok line with
    the credentials of the environment, an error line and exit status 1 with a wrong secret."""
    import os
    import subprocess
    import sys

    import yaml

    if not secret_ok:
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    cfg = tmp_path / "ocache.yaml"
    cfg.write_text(yaml.safe_dump({"store": {"remote": s3_bucket}}))
    slots = tmp_path / "slots"
    slots.mkdir()
    out = subprocess.run([sys.executable, "-m", "ocache", "doctor", "--offline", "--config", str(cfg), "--",
                          "-m", "x.gguf", "--slot-save-path", str(slots)],
                         capture_output=True, text=True, timeout=120, env=dict(os.environ))
    line = next((ln for ln in out.stdout.splitlines() if "store.remote" in ln), "")
    if secret_ok:
        assert "[ok] store.remote" in line and "(0 entries)" in line, out.stdout + out.stderr
        assert "bucket policy: none yet" in line, line            # no host listed the bucket yet
        assert "[warn] store.remote.fleet_key: not set" in out.stdout, out.stdout   # records unsigned
    else:
        assert "[error] store.remote" in line and out.returncode == 1, out.stdout + out.stderr


def test_store_config_is_checked():
    from ocache import config as cfg_mod

    cfg_mod.check_store({"remote": {"url": "s3://bkt/p", "max_gb": 1, "endpoint_url": "http://x:1"}})
    for bad, match in (({"remote": {"url": "http://bkt"}}, "url"), ({"other": {}}, "unknown key"),
                       ({"remote": {"url": "s3://bkt", "max_gb": "lots"}}, "max_gb"),
                       ({"remote": {"url": "s3://bkt", "max_gb": True}}, "max_gb")):
        with pytest.raises(cfg_mod.ConfigError, match=match):
            cfg_mod.check_store(bad)
    assert RemoteSettings.of(cfg_mod.Config()) is None
    s = RemoteSettings.of(cfg_mod.Config(store={"remote": {"url": "s3://bkt/p", "max_gb": 3}}))
    assert s is not None and s.max_gb == 3 and s.sync_s == 1.0


async def test_the_layers_of_one_store_share_one_bucket_and_one_sync(tmp_path, s3_bucket):
    """Several servers of one host (``upstreams:``) have one layer each over one local store: their
    remote tiers share one bucket (client, index, uploads); only the first runs the sync."""
    from ocache.config import Config
    from ocache.tiers.remote import open_remote_tier

    store = Store(tmp_path / "meta", tmp_path / "slots", "id-A")
    store.open()
    cfg = Config(store={"remote": {**s3_bucket, "sync_s": 0.1}})
    t1 = await open_remote_tier(cfg, store, SimpleNamespace(params=ServerParams()))
    t2 = await open_remote_tier(cfg, store, SimpleNamespace(params=ServerParams()))
    try:
        assert t1 is not None and t2 is not None and t1.bucket is t2.bucket
        assert t1._task is not None and t2._task is None
        e = put(store, TOKS, state_bytes=10_000, kind="h")
        await t2.flush()
        assert e.key in t1.bucket.index and t1.bucket.counters["uploads"] == 1
    finally:
        await t2.close()
        await t1.close()


async def test_a_data_object_gone_meanwhile_fails_the_download_and_deletes_nothing(tmp_path, s3_bucket):
    """Another host evicting the entry deletes its record first, then its data: a host whose index
    still lists it finds the data gone, gives up (``missing``), leaves no file behind and deletes
    nothing in the bucket."""
    sa, oa, ba = host(tmp_path, "A", s3_bucket)
    sb, ob, bb = host(tmp_path, "B", s3_bucket)
    async with oa, ob:
        e = put(sa, TOKS, state_bytes=20_000, kind="a")
        await ba.upload(e)
        await bb.refresh()
        await oa.delete(ba.index[e.key].objects["bin"])
        with pytest.raises(RemoteError) as err:
            await bb.fetch(e.key)
        assert err.value.reason == "missing" and e.key not in bb.index
        assert oc_files(sb) == [] and sb.used_bytes() == 0
        assert f"{RECORDS}{e.key}.json" in await listed(oa, RECORDS)
