"""The remote tier looks entries up by key: the requests a lookup sends to the bucket, counted at
the S3 client (botocore's ``before-call`` event, one per HTTP request, each page of a listing
included), against a real SeaweedFS on loopback (``s3_server``, tests/conftest.py) whose bucket
holds 10,000 records (``filled``: written once for the module; no test here changes them). No llama-server: entries are written in the server's layout (``tests/test_store.py``).
"""

from __future__ import annotations

import asyncio
import base64
import contextvars
import json
from types import SimpleNamespace

import pytest

from ocache.llama.flags import ServerParams
from ocache.tiers.entry import entry_key, prefix_hash, token_bytes
from ocache.tiers.remote import RemoteTier
from ocache.tiers.remote_bucket import RECORDS, RemoteBucket
from ocache.tiers.remote_client import S3Objects
from test_remote import TOKS, host
from test_store import put

#: records in the bucket besides the ones a test looks up
FILLER = 10_000

#: which caller sent a request: "request" inside a lookup the test awaits, else the background
_WHO: contextvars.ContextVar[str] = contextvars.ContextVar("who", default="background")


def count_requests(objects: S3Objects) -> list[tuple[str, str]]:
    """Record ``(who, operation)`` of every request the client sends from now on (``who`` from
    ``_WHO`` in the sending task's context: tasks a lookup gathers inherit it); a request for the
    bucket's policy object is ``"<operation> policy"``."""
    calls: list[tuple[str, str]] = []

    def before_call(model, params=None, **kw):
        policy = str((params or {}).get("url_path", "")).endswith("/policy.json")
        calls.append((_WHO.get(), model.name + (" policy" if policy else "")))

    objects.client.meta.events.register("before-call.s3", before_call)
    return calls


async def fill(objects: S3Objects, template: dict, n: int, identity: str = "id-A") -> None:
    """Put ``n`` valid records of 8-token anchors (their own keys, ``template``'s data objects)
    under ``records/``, 64 at a time."""
    sem = asyncio.Semaphore(64)

    async def one(i: int) -> None:
        toks = [7, i // 65536, i % 65536, 1, 2, 3, 4, 5]
        key = entry_key(identity, "a", toks)
        rec = dict(template["record"], key=key, n_tokens=len(toks), tokens_xxh3=prefix_hash(toks))
        rec["tokens_b64"] = base64.b64encode(token_bytes(toks)).decode()
        doc = dict(template, record=rec)
        async with sem:
            await objects.put(f"{RECORDS}{key}.json", json.dumps(doc).encode())

    await asyncio.gather(*(one(i) for i in range(n)))


@pytest.fixture(scope="module")
def filled(s3_server, tmp_path_factory):
    """One bucket for the module: host A's entry of ``TOKS`` (anchor, 30 kB) and ``FILLER`` other
    records; yields its ``store.remote`` settings (the credentials in the environment meanwhile)
    and A's entry key. Filled once: ~45 s on the loaded machine."""
    import secrets

    with pytest.MonkeyPatch.context() as mp:
        for k, v in s3_server.credentials_env().items():
            mp.setenv(k, v)
        mp.delenv("AWS_PROFILE", raising=False)
        settings = s3_server.create_bucket(f"oc-{secrets.token_hex(6)}")

        async def build() -> str:
            sa, oa, ba = host(tmp_path_factory.mktemp("filled"), "A", settings)
            async with oa:
                e = put(sa, TOKS, state_bytes=30_000, kind="a")
                assert await ba.upload(e)
                template = json.loads(await oa.get(f"{RECORDS}{e.key}.json") or b"{}")
                await fill(oa, template, FILLER)
            return e.key

        key = asyncio.run(build())
        yield settings, key


async def lookup(tier: RemoteTier, tokens: list[int], session: str | None = None):
    """``tier.lookup`` in a task marked as a request's (``_WHO``)."""
    async def run():
        _WHO.set("request")
        return await tier.lookup(SimpleNamespace(tokens=tokens, head_end=0, user_starts=[]),
                                 SimpleNamespace(kind="agent", session=session))
    return await asyncio.create_task(run())


async def test_lookups_ask_by_key_never_list_and_do_not_grow_with_the_bucket(tmp_path, filled):
    """With 10,000 other records in the bucket, a lookup sends one GET per candidate length of the
    prompt (the grid's lines up to its length) and a GET of its session's pointer, no listing;
    asked again it sends none (a hit is kept, a miss remembered); the answer is the entry a
    bucket of one record gives. The in-memory index stays within its bounds however many keys
    are looked up."""
    s3, key = filled
    sb, ob, bb = host(tmp_path, "B", s3)
    async with ob:
        calls = count_requests(ob)
        tb = RemoteTier(bb, SimpleNamespace(params=ServerParams(), checks_xxh3=False), grid=100)
        prompt = TOKS + [4] * 350                                   # 1,550 tokens: 15 grid lines
        n_cands = len(tb.candidates("id-A", SimpleNamespace(tokens=prompt, head_end=0, user_starts=[])))
        assert n_cands == 15

        offer = await lookup(tb, prompt, session="s-1")
        assert offer is not None and offer.ref.key == key and offer.tokens_usable == len(TOKS)
        mine = [op for who, op in calls if who == "request"]
        # the longest lines first: 1500..1300 miss, 1200 (the entry) matches, and the lines below
        # it are in the same batch of 16; plus the session pointer
        assert mine == ["GetObject"] * (n_cands + 1), mine
        assert "ListObjectsV2" not in mine

        calls.clear()
        assert (await lookup(tb, prompt, session="s-1")).ref.key == key     # kept: nothing asked
        miss = [9] * 1550
        assert await lookup(tb, miss) is None
        assert [op for who, op in calls if who == "request"] == ["GetObject"] * 15
        calls.clear()
        assert await lookup(tb, miss) is None                                # remembered
        assert calls == []

        await bb.refresh()                        # (a listing of 10,001 records: the sync's, not a lookup's)
        assert len(bb.catalog) == FILLER + 1 and bb.index.nbytes < 1 << 20
        assert [op for who, op in calls if who == "request"] == []
        assert {op for who, op in calls} - {"GetObject policy", "PutObject policy"} == {"ListObjectsV2"}

        # the index is bounded in entries and bytes
        small = RemoteBucket(ob, sb, budget_bytes=10**9, index_max_entries=4, index_max_bytes=10**9)
        ts = RemoteTier(small, SimpleNamespace(params=ServerParams(), checks_xxh3=False), grid=4, min_tokens=8)
        for i in range(0, 40):
            await lookup(ts, [7, i // 65536, i % 65536, 1, 2, 3, 4, 5, 6])
        assert len(small.index) == 4 and small.index.dropped == 36
        tiny = RemoteBucket(ob, sb, budget_bytes=10**9, index_max_bytes=4 * (2048 + 32))
        tt = RemoteTier(tiny, SimpleNamespace(params=ServerParams(), checks_xxh3=False), grid=4, min_tokens=8)
        for i in range(0, 10):
            await lookup(tt, [7, i // 65536, i % 65536, 1, 2, 3, 4, 5, 6])
        assert len(tiny.index) == 4 and tiny.index.nbytes <= tiny.index.max_bytes


async def test_a_new_host_looks_up_before_its_first_listing(tmp_path, filled, monkeypatch):
    """A new host over a bucket of 10,000 records: the tier opens without reading the bucket, and
    its first lookup is answered by key (the grid's GETs) while the background listing runs; no
    record is read by the listing."""
    from ocache import config as cfg_mod
    from ocache.tiers import remote as remote_mod
    from ocache.tiers.store import Store

    s3, key = filled
    opened: list[S3Objects] = []
    make = remote_mod.RemoteSettings.objects

    def objects(self):
        o = make(self)
        opened.append(o)
        return o

    monkeypatch.setattr(remote_mod.RemoteSettings, "objects", objects)
    store = Store(tmp_path / "new" / "meta", tmp_path / "new" / "slots", "id-A")
    store.open()
    cfg = cfg_mod.Config(store={"remote": {**s3, "refresh_s": 60}},
                         tiers={"disk": {"grid": 100}}, disk_min_tokens=0)
    tier = await asyncio.wait_for(remote_mod.open_remote_tier(cfg, store, SimpleNamespace(params=ServerParams(),
                                                                                          checks_xxh3=False)), 30)
    try:
        calls = count_requests(opened[-1])   # (the sync task started before: counted as background)
        offer = await lookup(tier, TOKS + [4])
        assert offer is not None and offer.ref.key == key
        mine = [op for who, op in calls if who == "request"]
        assert mine == ["GetObject"] * 12, mine       # 1,201 tokens: the grid's 12 lines
        for _ in range(600):                  # the background listing completes (bounded)
            if tier.bucket.refreshed_at:
                break
            await asyncio.sleep(0.1)
        assert tier.bucket.refreshed_at and len(tier.bucket.catalog) == FILLER + 1
        background = [op for who, op in calls if who == "background"]
        assert "GetObject" not in background and "ListObjectsV2" in background
        assert tier.bucket.counters["record_gets"] == len(mine)
    finally:
        await asyncio.wait_for(tier.close(), 30)


def test_the_candidate_keys_are_the_content_addresses_of_the_prefixes():
    """``RemoteTier.candidates`` hashes the prompt once (``prefix_keys``): each key equals
    ``entry_key`` of its prefix; the lengths are the grid's lines from ``min_tokens``, the head
    (kinds ``h`` and, from ``min_tokens``, ``a``) and the first user message."""
    import random

    from ocache.tiers.remote import prefix_keys

    toks = [random.Random(5).randrange(1, 150_000) for _ in range(5000)]
    raw = token_bytes(toks)
    lengths = [1, 7, 1024, 1025, 4999, 5000]
    assert prefix_keys("id", "a", raw, lengths) == {n: entry_key("id", "a", toks[:n]) for n in lengths}
    tier = RemoteTier.__new__(RemoteTier)
    tier.grid, tier.min_tokens = 1024, 2048
    got = tier.candidates("id", SimpleNamespace(tokens=toks, head_end=1500, user_starts=[2500, 3000]))
    assert [(m, k) for m, k, _ in got] == [(4096, "a"), (3072, "a"), (2500, "a"), (2048, "a"), (1500, "h")]
    assert all(key == entry_key("id", k, toks[:m]) for m, k, key in got)
