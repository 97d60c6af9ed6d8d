"""The remote tier for a fleet of hosts: what a URL may carry, records of a newer layout, signed
records, and how long a request waits for the bucket. Bucket tests run against a real SeaweedFS on
loopback (``s3_bucket``, tests/conftest.py; hosts as in tests/test_remote.py); faults a real S3
server cannot produce (a bucket that never answers) come from a stand-in objects class.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import yaml

from ocache import config as cfg_mod
from ocache.tiers.remote import RemoteSettings, check_remote, open_remote_tier
from ocache.tiers.remote_client import Location, RemoteConfigError, S3Objects

KEY_ID = "AKIAFLEETTESTKEYID"
SECRET = "wJalrXUtnFEMI-s3cr3t-K7MDENG"


# ---------------------------------------------------------------------- credentials in URLs
@pytest.mark.parametrize("url", [f"s3://{KEY_ID}:{SECRET}@bkt/ocache", f"s3://{SECRET}@bkt",
                                 f"s3://bkt/ocache?X-Amz-Signature={SECRET}"])
def test_a_url_with_credentials_is_refused_without_showing_them(url):
    for call in (lambda: Location.parse(url), lambda: S3Objects(url)):
        with pytest.raises(RemoteConfigError) as err:
            call()
        msg = str(err.value)
        assert SECRET not in msg and KEY_ID not in msg
        assert msg.startswith("store.remote.url") and "AWS_SECRET_ACCESS_KEY" in msg
    with pytest.raises(cfg_mod.ConfigError) as err:
        cfg_mod.check_store({"remote": {"url": url}})
    assert SECRET not in str(err.value) and "AWS_ACCESS_KEY_ID" in str(err.value)


def test_an_endpoint_with_credentials_is_refused_and_a_plain_one_is_kept():
    with pytest.raises(cfg_mod.ConfigError) as err:
        cfg_mod.check_store({"remote": {"url": "s3://bkt", "endpoint_url": f"http://{KEY_ID}:{SECRET}@s3.internal:8333"}})
    assert SECRET not in str(err.value) and "store.remote.endpoint_url" in str(err.value)
    assert S3Objects("s3://bkt/p", endpoint_url="http://s3.internal:8333").endpoint_url == "http://s3.internal:8333"
    with pytest.raises(cfg_mod.ConfigError) as err:   # a URL given where the mapping belongs
        cfg_mod.check_store({"remote": f"s3://{KEY_ID}:{SECRET}@bkt"})
    assert SECRET not in str(err.value)


async def test_the_check_and_the_tier_refuse_a_url_with_credentials_without_showing_them(caplog):
    """A Config built in code skips ``check_store``: the doctor's check and the tier still refuse."""
    caplog.set_level(logging.DEBUG)
    cfg = cfg_mod.Config(store={"remote": {"url": f"s3://{KEY_ID}:{SECRET}@bkt/p", "endpoint_url": "http://127.0.0.1:9"}})
    got = await check_remote(cfg)
    assert got is not None and got[0] is False and SECRET not in got[1] and "credentials" in got[1]
    with pytest.raises(RemoteConfigError) as err:
        await open_remote_tier(cfg, None, None)   # refused before the store or the table is read
    assert SECRET not in str(err.value)
    assert SECRET not in caplog.text and KEY_ID not in caplog.text


def test_doctor_refuses_a_url_with_credentials_and_prints_no_secret(tmp_path):
    cfg = tmp_path / "ocache.yaml"
    cfg.write_text(yaml.safe_dump({"store": {"remote": {"url": f"s3://{KEY_ID}:{SECRET}@bkt/ocache",
                                                        "endpoint_url": "http://127.0.0.1:9"}}}))
    slots = tmp_path / "slots"
    slots.mkdir()
    out = subprocess.run([sys.executable, "-m", "ocache", "doctor", "--offline", "--config", str(cfg), "--",
                          "-m", "x.gguf", "--slot-save-path", str(slots)],
                         capture_output=True, text=True, timeout=120, env=dict(os.environ))
    text = out.stdout + out.stderr
    assert SECRET not in text and KEY_ID not in text, text
    line = next((ln for ln in out.stdout.splitlines() if "store.remote" in ln), "")
    assert "[error] store.remote.url" in line and "credentials" in line, text
    assert out.returncode == 1, text


# ---------------------------------------------------------------------- a newer layout version
async def test_a_record_of_a_newer_layout_survives_a_sync_by_an_older_host(tmp_path, s3_bucket):
    """A newer ocache's record (version above ``LAYOUT_VERSION``, a field this host does not know)
    is neither served, evicted, deleted as unparsable, nor its data swept, by a host whose sync
    reads it under budget pressure with every orphan old enough to sweep."""
    import json
    from types import SimpleNamespace

    from ocache.llama.flags import ServerParams
    from ocache.tiers.remote import RemoteTier
    from ocache.tiers.remote_bucket import DATA, LAYOUT_VERSION, RECORDS
    from test_remote import TOKS, host, listed
    from test_store import put

    sa, oa, ba = host(tmp_path, "A", s3_bucket)
    sb, ob, bb = host(tmp_path, "B", s3_bucket)
    async with oa, ob:
        new = put(sa, TOKS, state_bytes=40_000, kind="a")
        assert await ba.upload(new)
        rec_key = f"{RECORDS}{new.key}.json"
        doc = json.loads(await oa.get(rec_key) or b"{}")
        doc["version"] = LAYOUT_VERSION + 1
        doc["chunks"] = {"bin": ["a newer layout's field"]}
        await oa.delete(rec_key)
        assert await oa.put(rec_key, json.dumps(doc).encode(), create_only=True)
        # a newer layout's data object its record does not name in ``objects``
        await oa.put(f"{DATA}{new.key}-bin-part-0001", b"x" * 1000)
        before = await listed(oa, "")

        mine = put(sb, [7] * 300, state_bytes=40_000, kind="a")
        bb.budget_bytes = mine.bytes + 10         # no room for anything but B's own entry
        bb.orphan_age_s = 0.0                     # every unnamed data object is old enough to sweep
        tb = RemoteTier(bb, SimpleNamespace(params=ServerParams(), checks_xxh3=False))
        assert await tb.sync(refresh=True) == 1
        assert await tb.sync(refresh=True) == 0

        after = await listed(ob, "")
        assert {k: v for k, v in before.items()} == {k: v for k, v in after.items() if k in before}
        assert rec_key in after and f"{DATA}{new.key}-bin-part-0001" in after
        assert new.key not in bb.index and bb.held[new.key].reason == "newer"
        assert bb.counters["newer_records"] == 1 and bb.counters["bad_records"] == 0
        assert bb.counters["evicted"] == 0 and bb.counters["orphans_deleted"] == 0
        assert mine.key in bb.index                # B's own upload went on beside it
        view = SimpleNamespace(tokens=TOKS + [1, 2], head_end=0, user_starts=[])
        assert await tb.lookup(view, SimpleNamespace(kind="agent", session=None)) is None


# ---------------------------------------------------------------------- signed records
FLEET_KEY = "fleet-key-0123456789abcdef"


def signed_host(tmp_path, name, s3, key: str | None):
    from test_remote import host

    store, objects, bucket = host(tmp_path, name, s3)
    bucket._fleet_key = key.encode() if key else None
    return store, objects, bucket


async def test_a_record_signed_with_the_fleet_key_is_served(tmp_path, s3_bucket, caplog):
    from types import SimpleNamespace

    from ocache.llama.flags import ServerParams
    from ocache.tiers.remote import RemoteTier
    from ocache.tiers.remote_bucket import RECORDS
    from test_remote import TOKS
    from test_store import put

    caplog.set_level(logging.DEBUG)
    sa, oa, ba = signed_host(tmp_path, "A", s3_bucket, FLEET_KEY)
    sb, ob, bb = signed_host(tmp_path, "B", s3_bucket, FLEET_KEY)
    async with oa, ob:
        e = put(sa, TOKS, state_bytes=30_000, kind="a")
        assert await ba.upload(e)
        import json
        doc = json.loads(await oa.get(f"{RECORDS}{e.key}.json") or b"{}")
        assert isinstance(doc.get("sig"), str) and len(doc["sig"]) == 64
        tb = RemoteTier(bb, SimpleNamespace(params=ServerParams(), checks_xxh3=False), grid=100)
        offer = await tb.lookup(SimpleNamespace(tokens=TOKS + [5], head_end=0, user_starts=[]),
                                SimpleNamespace(kind="agent", session=None))
        assert offer is not None and offer.ref.key == e.key
        assert e.key in bb.index and bb.held == {}
        assert (await bb.fetch(e.key)).key == e.key and sb.get(e.key) is not None
        assert FLEET_KEY not in repr(tb.stats()) and FLEET_KEY not in caplog.text


async def test_forged_records_are_refused_quarantined_and_left_in_the_bucket(tmp_path, s3_bucket, caplog):
    """Three forgeries of a bucket writer without the fleet key: an unsigned record, one signed with
    another key, and a signed record whose data and data hash were swapped (the signature kept).
    A host with the key serves none of them, counts and logs each once, and its sync (budget
    pressure, every orphan old enough to sweep) deletes none of their objects."""
    import json
    from types import SimpleNamespace

    import xxhash

    from ocache.llama.flags import ServerParams
    from ocache.tiers.remote import RemoteTier
    from ocache.tiers.remote_bucket import RECORDS
    from test_remote import listed
    from test_store import put

    caplog.set_level(logging.INFO)
    sf, of, bf = signed_host(tmp_path, "F", s3_bucket, None)
    sw, ow, bw = signed_host(tmp_path, "W", s3_bucket, "another-key-0123456789")
    sa, oa, ba = signed_host(tmp_path, "A", s3_bucket, FLEET_KEY)
    sb, ob, bb = signed_host(tmp_path, "B", s3_bucket, FLEET_KEY)
    toks = [list(range(10 * i, 10 * i + 400)) for i in range(3)]
    async with of, ow, oa, ob:
        unsigned = put(sf, toks[0], state_bytes=30_000, kind="a")
        wrong = put(sw, toks[1], state_bytes=30_000, kind="a")
        swapped = put(sa, toks[2], state_bytes=30_000, kind="a")
        assert await bf.upload(unsigned) and await bw.upload(wrong) and await ba.upload(swapped)
        # the swap: other bytes under a new data object, the record's hash and name made to match them
        rec_key = f"{RECORDS}{swapped.key}.json"
        doc = json.loads(await oa.get(rec_key) or b"{}")
        other = bytes(reversed(await oa.get(doc["objects"]["bin"]) or b""))
        name = f"data/{swapped.key}-bin-{xxhash.xxh3_64(other).hexdigest()}"
        await oa.put(name, other)
        doc["objects"]["bin"] = name
        doc["record"]["files"]["bin"]["xxh3"] = xxhash.xxh3_64(other).hexdigest()
        await oa.delete(rec_key)
        assert await oa.put(rec_key, json.dumps(doc).encode(), create_only=True)
        before = await listed(oa, "")

        mine = put(sb, [3] * 300, state_bytes=30_000, kind="a")
        bb.budget_bytes = mine.bytes + 10
        bb.orphan_age_s = 0.0
        tb = RemoteTier(bb, SimpleNamespace(params=ServerParams(), checks_xxh3=False))
        await tb.sync(refresh=True)
        await tb.sync(refresh=True)

        assert {k: bb.held[k].reason for k in bb.held} == \
               {unsigned.key: "unsigned", wrong.key: "signature", swapped.key: "signature"}
        assert not ({unsigned.key, wrong.key, swapped.key} & set(bb.index))
        assert bb.counters["quarantined"] == 3 and bb.counters["evicted"] == 0
        assert bb.counters["bad_records"] == 0 and bb.counters["orphans_deleted"] == 0
        assert caplog.text.count("quarantined on this host") == 3        # once each, over two syncs
        after = await listed(ob, "")
        assert {k: v for k, v in after.items() if k in before} == before   # nothing of theirs deleted
        for t in toks:
            view = SimpleNamespace(tokens=t + [1], head_end=0, user_starts=[])
            assert await tb.lookup(view, SimpleNamespace(kind="agent", session=None)) is None
        assert mine.key in bb.index


def test_the_fleet_key_is_read_checked_and_never_shown(monkeypatch):
    from ocache.tiers.remote import remote_warnings

    monkeypatch.delenv("OCACHE_FLEET_KEY", raising=False)
    plain = cfg_mod.Config(store={"remote": {"url": "s3://bkt/p"}})
    assert RemoteSettings.of(plain).key() is None
    (warning,) = remote_warnings(plain)
    assert "unsigned" in warning and "plant" in warning
    monkeypatch.setenv("OCACHE_FLEET_KEY", FLEET_KEY)
    assert RemoteSettings.of(plain).key() == FLEET_KEY.encode() and remote_warnings(plain) == []
    keyed = cfg_mod.Config(store={"remote": {"url": "s3://bkt/p", "fleet_key": "k" * 40}})
    assert RemoteSettings.of(keyed).key() == b"k" * 40            # the config's key first
    assert "k" * 40 not in repr(RemoteSettings.of(keyed))
    cfg_mod.check_store({"remote": {"url": "s3://bkt/p", "fleet_key": FLEET_KEY}})
    with pytest.raises(cfg_mod.ConfigError) as err:
        cfg_mod.check_store({"remote": {"url": "s3://bkt/p", "fleet_key": 12345678901234567890}})
    assert "12345678901234567890" not in str(err.value)
    short = cfg_mod.Config(store={"remote": {"url": "s3://bkt/p", "fleet_key": "sh0rt-k3y"}})
    with pytest.raises(RemoteConfigError) as err2:
        RemoteSettings.of(short).key()
    assert "sh0rt-k3y" not in str(err2.value)


# ---------------------------------------------------------------------- deadlines
class Stalling:
    """Stands in for the tier's S3Objects where a real server cannot fail this way: ``list``,
    ``get_tagged``, ``head`` and ``stream`` never answer (they wait on ``never``, which nothing sets) and record that they were
    entered and whether the wait was cancelled; ``inner``, when given, answers everything else."""

    def __init__(self, inner=None) -> None:
        import asyncio

        self.inner = inner
        self.never = asyncio.Event()
        self.entered: list[str] = []
        self.cancelled: list[str] = []

    async def _stall(self, what: str):
        import asyncio

        self.entered.append(what)
        try:
            await self.never.wait()
        except asyncio.CancelledError:
            self.cancelled.append(what)
            raise

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return None

    async def list(self, prefix):
        return await self._stall(f"list {prefix}")

    async def stream(self, key, sink, chunk=1 << 20):
        return await self._stall(f"stream {key}")

    async def get_tagged(self, key):
        return await self._stall(f"get {key}")

    async def head(self, key):
        return await self._stall(f"head {key}")

    def __getattr__(self, name):
        return getattr(self.inner, name)


async def test_a_black_hole_bucket_never_holds_a_request_longer_than_its_cold_prefill(tmp_path, monkeypatch):
    """A bucket that accepts and never answers: the tier opens at once (its first listing runs in
    the background and stalls there); a lookup asks for the prompt's candidate records by key (no
    listing), gives up at the deadline priced by the prompt (its cold prefill at the measured rate
    plus the slack), cancels what it asked and answers None (the request is planned from the local
    tiers or cold); the next lookup leaves the bucket alone (backoff) and asks nothing."""
    import asyncio
    from types import SimpleNamespace

    from ocache.llama.flags import ServerParams
    from ocache.tiers import remote as remote_mod
    from ocache.tiers.store import Store

    black_hole = Stalling()
    monkeypatch.setattr(remote_mod.RemoteSettings, "objects", lambda self: black_hole)
    store = Store(tmp_path / "meta", tmp_path / "slots", "id-A")
    store.open()
    cfg = cfg_mod.Config(store={"remote": {"url": "s3://bkt/p", "fleet_key": FLEET_KEY}})
    tier = await asyncio.wait_for(remote_mod.open_remote_tier(cfg, store, SimpleNamespace(params=ServerParams())), 10)
    try:
        tier.grid, tier.min_tokens = 100, 0
        tier.prefill_tps_of = lambda: 1e5          # 500 tokens: 5 ms of prefill
        tier.deadline_slack_s = 0.05
        assert tier.lookup_deadline_s(500) == pytest.approx(0.055)   # cold prefill + slack, no more
        view = SimpleNamespace(tokens=list(range(500)), head_end=0, user_starts=[])
        ctx = SimpleNamespace(kind="agent", session=None)
        assert await asyncio.wait_for(tier.lookup(view, ctx), 10) is None    # bounded: a hang fails
        asked = [w for w in black_hole.entered if not w.startswith("list")]
        assert sorted(asked) == sorted(f"get records/{k}.json" for _, _, k in tier.candidates("id-A", view, ctx))
        assert len(asked) == 5 and set(asked) <= set(black_hole.cancelled)    # 100..500; none left running
        assert tier.counters["lookup_abandoned"] == 1 and tier.bucket.reach.unreachable()
        n = len(black_hole.entered)
        assert await tier.lookup(view, ctx) is None            # the backoff: nothing asked
        assert tier.counters["bucket_down"] == 1
        for _ in range(100):                  # the background listing reached the bucket (bounded)
            if "list records/" in black_hole.entered:
                break
            await asyncio.sleep(0.01)
        assert [w for w in black_hole.entered[n:] if not w.startswith("list")] == []
        assert "list records/" in black_hole.entered and tier.bucket.refreshed_at == 0
    finally:
        await asyncio.wait_for(tier.close(), 10)
    assert "list records/" in black_hole.cancelled     # closing ended the stalled listing


async def test_a_stalled_download_is_abandoned_at_what_it_saves(tmp_path, s3_bucket):
    """A's entry is in the bucket; B's download of it stalls after the record was read. B's bring
    gives up at the priced deadline (the wait cancelled, not left running), leaves no partial file
    and no reservation, and the request is told to go on without it."""
    import asyncio
    from types import SimpleNamespace

    from ocache.llama.flags import ServerParams
    from ocache.tiers.remote import RemoteTier, RemoteTierError
    from test_remote import TOKS, host
    from test_store import oc_files, put

    sa, oa, ba = host(tmp_path, "A", s3_bucket)
    sb, ob, bb = host(tmp_path, "B", s3_bucket)
    async with oa, ob:
        e = put(sa, TOKS, state_bytes=60_000, kind="a")
        assert await ba.upload(e)
        tb = RemoteTier(bb, SimpleNamespace(params=ServerParams(), checks_xxh3=False), grid=100)
        offer = await tb.lookup(SimpleNamespace(tokens=TOKS + [4], head_end=0, user_starts=[]),
                                SimpleNamespace(kind="agent", session=None))
        stalls = Stalling(ob)                  # the record was read; the data stalls
        bb.objects = stalls
        tb.prefill_tps_of = lambda: 1e6        # 1,200 tokens at 1e6 tokens/s save 1.2 ms
        tb.deadline_slack_s = 0.05
        # what it saves plus the slack, less what the lookup already waited
        assert offer is not None and 0 < offer.ref.lookup_s < 30
        assert tb.deadline_s(offer) == pytest.approx(max(0.0, 0.0512 - offer.ref.lookup_s))
        offer.ref.lookup_s = 0.0               # (on a loaded machine the lookup may take it all)
        with pytest.raises(RemoteTierError) as err:
            await asyncio.wait_for(tb.bring(offer, 0), 30)   # bounded: a hang fails the test
        assert err.value.reason == "deadline" and tb.counters["deadline_abandoned"] == 1
        assert stalls.entered == stalls.cancelled and len(stalls.cancelled) == 1
        assert oc_files(sb) == [] and sb.get(e.key) is None and sb.used_bytes() == 0
        assert not sb._reserved and e.key in bb.index and bb.quarantined == {}   # kept: the bucket was slow
