"""Cache-side hardening against the real patched llama-server on the
tiny models, through the proxy in-process (``ocache.proxy.Proxy`` + ``OCacheLayer``) as in
tests/test_spill.py, with the same server settings (``-ub 128 -b 512 --ctx-checkpoints 32
--checkpoint-min-step 256 --cache-ram 0``).

Each test names the fault it injects and what the fix guarantees:

* item 1: a damaged head file (``oc-h-*.bin``) is detected by the store before the restore, deleted,
  counted, and the request is served cold with the greedy output of a cold run; head files are
  store entries (mode 0600, budget, listed, cleared by ``clear?tier=all``, ``ocache cache clear``
  and ``gc``); a tie between offers goes to the verified one;
* item 5: llama-server killed (``kill -9``) inside a restore keeps the valid entry (each tier);
* item 8: a plan cancelled at every suspension point of the planning path never keeps a slot locked;
  the next request, ``clear`` and ``drain`` finish within bounds;
* item 12: with budgets smaller than one file nothing is written to be discarded, and the drain log
  does not claim a spill that was not kept; a planned stop writes each conversation once;
* item 13: a sidecar write killed part way leaves no ``*.ckpt.tmp``; a store that cannot open makes
  no tier ask the server to save anything.
"""

from __future__ import annotations

import asyncio
import copy
import json
import fcntl
import logging
import os
import stat
import termios
import time
import types
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest

from fakes import cold_chat as cold
from ocache.cache import plan_request
from ocache.config import Config
from ocache.layer import ParsedRequest
from ocache.llama.flags import ServerParams
from ocache.llama.reuse import common_prefix
from ocache.slots import SlotState, SlotTable
from ocache.tiers import store as store_mod
from ocache.tiers.base import Offer
from ocache.tiers.resident import RequestContext

from conftest import body_of, forget_store
from conftest import session_headers as hdrs
from conftest import through_ocache as serve_ocache

UB = 128
SERVER = dict(ubatch=UB, batch=512, ctx_checkpoints=32, checkpoint_min_step=256, cache_ram=0)
CHAT = "/v1/chat/completions"
TOKEN = "t0ken"
NEVER = 10 ** 7   # a token threshold no test prompt reaches (turns a tier's writes off)


# --------------------------------------------------------------------------- helpers

def make_config(srv, cache_dir: Path, *, spill_min: int = NEVER, disk_min: int = NEVER,
                head: dict | None = None, **kw) -> Config:
    tiers = {"resident": {"server_args": srv.command()[1:]}}
    if head is not None:
        tiers["head"] = head
    return Config(upstream=srv.url, cache_dir=str(cache_dir), spill_min_tokens=spill_min,
                  disk_min_tokens=disk_min, admin_token=TOKEN, tiers=tiers, **kw)


@asynccontextmanager
async def through_ocache(config: Config):
    """conftest's ``through_ocache``, then what a process exit does to the shared store
    (``forget_store``); yields (base_url, proxy)."""
    try:
        async with serve_ocache(config) as out:
            yield out
    finally:
        forget_store(Path(config.cache_dir))


A1, A2, B1 = "opencode_agent_turn1.json", "opencode_agent_turn1_after_tool.json", "opencode_run3_proj2_agent_turn1.json"


async def send(s: aiohttp.ClientSession, base: str, proxy, body: dict, headers: dict | None = None,
               ok: bool = True) -> dict:
    async with s.post(base + CHAT, json=body, headers=headers or {},
                      timeout=aiohttp.ClientTimeout(total=300)) as r:
        data = await r.json(content_type=None)
        rec = {"status": r.status, "tier": r.headers.get("X-OCache-Tier"), "data": data}
    if ok:
        assert rec["status"] == 200, rec
    await proxy.wait_background()
    await proxy.layer.idle()
    return rec




async def settle(url: str, tries: int = 10) -> None:
    """After a restart on the same port the new llama-server was seen to drop its first
    connection(s) although /health answered (tests/test_disk_tier.py ``Harness.settle``)."""
    for i in range(tries):
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/tokenize", json={"content": "ready"}) as r:
                    if r.status == 200:
                        return
        except aiohttp.ClientError:
            if i == tries - 1:
                raise


def data_files(srv) -> list[Path]:
    """The slot directory's files, without the stores' registry (``.ocache-stores``, store_files)."""
    return sorted(p for p in Path(srv.slot_save_path).iterdir() if p.name != ".ocache-stores")


class SaveLog:
    """Counts the slot saves ocache asks the server for (``SlotTable.save``), by file name."""

    def __init__(self, monkeypatch, before=None):
        self.names: list[str] = []
        real = SlotTable.save
        log = self

        async def save(table, slot, filename):
            log.names.append(filename)
            if before is not None:
                await before(table, slot, filename)
            return await real(table, slot, filename)

        monkeypatch.setattr(SlotTable, "save", save)


# --------------------------------------------------------------------------- item 1: head files verified

def flip(path: Path, how: str, n_tokens: int) -> None:
    """Damage the KV data of a slot file in its middle (past the token header, inside one layer's
    rows, so the server's own loader accepts it and only a checksum can tell): ``bytes``: 3,000
    consecutive bytes inverted (the campaign's fault); ``bit``: one bit."""
    raw = bytearray(path.read_bytes())
    mid = (store_mod.TOKENS_OFFSET + 4 * n_tokens + len(raw)) // 2
    assert len(raw) > mid + 3000
    if how == "bit":
        raw[mid] ^= 0x10
    else:
        for i in range(mid, mid + 3000):
            raw[i] ^= 0xFF
    path.write_bytes(bytes(raw))


@pytest.mark.server
async def test_a_damaged_spill_falls_back_to_another_tiers_anchor(start_server, tmp_path):
    """A's conversation was spilled (B took the only slot) and its spill is damaged: the store's
    check deletes it, the session tier has nothing else, and the disk tier's anchor of A (its
    folder section) is restored instead; before, only the failed tier was asked again and the
    request was served from what the slot held (B's harness head), prefilling A's folder section
    again. The answer is a cold run's."""
    srv = start_server("dense", n_parallel=1, ctx_size=16384, **SERVER)
    cfg = make_config(srv, tmp_path / "cache", spill_min=2000, disk_min=1024, head={"budget_gb": 0})
    async with through_ocache(cfg) as (base, proxy), aiohttp.ClientSession() as s:
        for name in (A1, B1):
            await send(s, base, proxy, body_of(name), hdrs(name))
        layer = proxy.layer
        for t in layer.tiers:
            if hasattr(t, "flush"):
                await t.flush()
        session = next(t for t in layer.tiers if t.name == "session")
        [spill] = session.store.entries("s")             # A's, spilled when B took the slot
        body = body_of(A2)
        view = await layer.viewer.view("/v1/chat/completions", body)
        store = layer.disk_tier.store
        best = max(e.n_tokens for e in store.entries("a") if view.tokens[:e.n_tokens] == store.tokens(e.key))
        shared = common_prefix(layer.table[0].tokens, view.tokens)
        assert best > shared + UB, (best, shared)       # A's anchor holds more than B's slot shares
        [path] = [Path(srv.slot_save_path) / f.name for f in spill.files.values() if f.name.endswith(".bin")]
        flip(path, "bytes", spill.n_tokens)
        r = await send(s, base, proxy, body, hdrs(A2))
        assert session.counters["verify_failed"] == 1 and layer.counters["bring_failures"] == 1
        assert r["tier"] == "disk" and layer.counters["bring_retries"] == 1, r["tier"]
        assert r["data"]["timings"]["cache_n"] > shared + UB, (r["data"]["timings"], shared)
        ref = await cold(srv.url, body)
        assert r["data"]["choices"][0]["message"] == ref["choices"][0]["message"]


@pytest.mark.server
@pytest.mark.parametrize("model,how", [("dense", "bytes"), ("hybrid", "bytes"), ("dense", "bit")])
async def test_damaged_head_file_is_detected_and_the_request_served_exactly(start_server, tmp_path, model, how):
    """The campaign's fault: the head file of folder A's harness head is damaged, then the request
    of another folder (same harness head) lands on a slot without it. Before: restored unchecked,
    ``X-OCache-Tier: head``, greedy output != cold. Now: the store's check fails, the entry and its
    files are deleted and counted, the request is served cold and answers exactly like a cold run."""
    srv = start_server(model, n_parallel=1, ctx_size=16384, **SERVER)
    cfg = make_config(srv, tmp_path / "cache")  # only the head tier writes (no anchors, no spills)
    a, b = body_of(A1), body_of(B1)
    async with through_ocache(cfg) as (base, proxy), aiohttp.ClientSession() as s:
        r = await send(s, base, proxy, a, hdrs(A1))
        # the first request warmed (and saved) the head within itself: nothing came from before it
        assert r["tier"] == "cold", r["tier"]
        layer = proxy.layer
        [rec] = layer.head_tier.heads.values()
        bins = [p for p in data_files(srv) if p.suffix == ".bin"]
        assert len(bins) == 1, bins              # the head's slot file is the only one
        assert (await layer.clear("resident"))["cleared"] == 1
        flip(bins[0], how, len(rec.tokens))
        r = await send(s, base, proxy, b, hdrs(B1))
        ref = await cold(srv.url, b)
        assert r["tier"] != "head", r["tier"]
        assert r["data"]["timings"]["cache_n"] == 0, r["data"]["timings"]
        assert r["data"]["choices"][0]["message"] == ref["choices"][0]["message"]
        # detected, deleted, reported
        ht = layer.head_tier
        assert ht.counters["verify_failed"] == 1 and layer.counters["bring_failures"] == 1
        assert ht.counters["restore_failed"] == 0       # a failed check, not a failed restore
        assert layer.stats()["tier_head"]["verify_failed"] == 1
        assert not bins[0].exists() and not ht.store.entries("h")


@pytest.mark.server
async def test_head_files_are_store_entries(start_server, tmp_path, capsys):
    """A head file is a store entry: mode 0600, inside its own budget, listed by ``ocache cache ls``,
    deleted by ``POST /v1/cache/clear?tier=all``, ``ocache cache clear`` and ``ocache cache gc``
    (TTL); an intact one is restored (tier ``head``) and answers like a cold run."""
    from ocache.cli import build_parser

    srv = start_server("dense", n_parallel=1, ctx_size=16384, **SERVER)
    cache = tmp_path / "cache"
    a, b = body_of(A1), body_of(B1)

    def heads_on_disk() -> list[Path]:
        return [p for p in data_files(srv) if p.name.startswith("oc-h-")]

    def cli(*argv: str) -> str:
        args = build_parser().parse_args(["cache", *argv, "--cache-dir", str(cache)])
        assert args.func(args) == 0
        return capsys.readouterr().out

    legacy = Path(srv.slot_save_path) / "ocache-head-0123456789abcdef.bin"   # an earlier version's
    legacy.write_bytes(b"unverified head state")
    async with through_ocache(make_config(srv, cache)) as (base, proxy), aiohttp.ClientSession() as s:
        await send(s, base, proxy, a, hdrs(A1))
        assert not legacy.exists()
        ht = proxy.layer.head_tier
        [e] = ht.store.entries("h")
        files = heads_on_disk()
        assert files and {p.name for p in files} == {f.name for f in e.files.values()}
        assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files)
        assert ht.store.kind_budgets["h"] == 10 * 10 ** 9 and ht.store.kind_bytes("h") == e.bytes
        # intact: restored into the empty slot, exact
        await proxy.layer.clear("resident")
        r = await send(s, base, proxy, b, hdrs(B1))
        assert r["tier"] == "head" and ht.counters["restores"] == 1, (r["tier"], ht.stats())
        assert r["data"]["timings"]["cache_n"] >= len(e.tokens or ht.store.tokens(e.key)) - UB
        ref = await cold(srv.url, b)
        assert r["data"]["choices"][0]["message"] == ref["choices"][0]["message"]
        async with s.post(base + "/v1/cache/clear?tier=bogus", headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
            msg = (await resp.json())["error"]["message"]   # every tier the route takes, the response cache too
            assert resp.status == 400 and "'bogus'" in msg and "'head'" in msg and "'response'" in msg, msg
        async with s.post(base + "/v1/cache/clear?tier=all", headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
            assert resp.status == 200, await resp.text()
        assert not heads_on_disk() and not ht.store.entries("h")
        await send(s, base, proxy, a, hdrs(A1))   # warmed and saved again
        assert heads_on_disk()
    assert "head" in cli("ls")
    assert "deleted 1 entries" in cli("clear", "--kind", "heads")
    assert not heads_on_disk()
    async with aiohttp.ClientSession() as s:   # else the new ocache leaves the slot it cannot see to the server
        async with s.post(srv.url + "/slots/0?action=erase") as r:
            assert r.status == 200
    async with through_ocache(make_config(srv, cache)) as (base, proxy), aiohttp.ClientSession() as s:
        await send(s, base, proxy, a, hdrs(A1))
        assert heads_on_disk()
    assert "1 expired" in cli("gc", "--ttl-days", "0")
    assert not heads_on_disk()


@pytest.mark.server
async def test_head_budget_is_checked_before_the_write(start_server, tmp_path, monkeypatch):
    """A head budget smaller than one head file: the first head is measured (written, refused by the
    commit), every later one is refused before the server writes anything; heads stay warm by
    prefill."""
    saves = SaveLog(monkeypatch)
    srv = start_server("dense", n_parallel=1, ctx_size=16384, **SERVER)
    cfg = make_config(srv, tmp_path / "cache", head={"budget_gb": 1e-6})
    async with through_ocache(cfg) as (base, proxy), aiohttp.ClientSession() as s:
        for _ in range(3):
            await proxy.layer.clear("all")
            r = await send(s, base, proxy, body_of(A1), hdrs(A1))
            assert r["tier"] == "cold"   # the head is warmed within each request (X-OCache-Split)
        ht = proxy.layer.head_tier
        assert len(saves.names) == 1 and ht.counters["skipped_budget"] == 2, (saves.names, ht.stats())
        assert not [p for p in data_files(srv) if p.name.startswith("oc-")]


def test_a_tie_between_offers_goes_to_the_verified_one():
    """Two offers of the same length: the verified one wins (whatever the order), then the cheaper."""
    params = ServerParams(n_slots=1, n_ctx_slot=8192, n_ubatch=128)
    toks = list(range(1000, 3000))
    ctx = RequestContext(kind="agent", head_key="h", head_len=1500, task=1)
    unverified = Offer("head", 1500, 0.001)
    verified = Offer("disk", 1500, 0.01, verified=True)
    for offers in ([unverified, verified], [verified, unverified]):
        d = plan_request(toks, [SlotState(id=0, n_ctx=8192)], offers, ctx, params)
        assert d.offer is verified and d.tier == "disk"
    cheap = Offer("session", 1500, 0.001, verified=True)
    d = plan_request(toks, [SlotState(id=0, n_ctx=8192)], [verified, cheap], ctx, params)
    assert d.offer is cheap
    longer = Offer("head", 1600, 0.01)
    d = plan_request(toks, [SlotState(id=0, n_ctx=8192)], [verified, longer], ctx, params)
    assert d.offer is longer


# --------------------------------------------------------------------------- item 5: kill -9 during a restore

def kill_on_restore(table: SlotTable, srv) -> list[str]:
    """Make the next ``action=restore`` find llama-server killed (kill -9 just before the call)."""
    real = table.client.request
    seen: list[str] = []

    async def request(method, path, **kw):
        if "action=restore" in path and not seen:
            seen.append(path)
            srv.kill()
        return await real(method, path, **kw)

    table.client.request = request
    return seen


@pytest.mark.server
@pytest.mark.parametrize("tier", ["head", "disk", "session"])
async def test_killed_server_during_a_restore_keeps_the_entry(start_server, tmp_path, tier):
    """llama-server is killed (kill -9) inside ocache's restore of a valid entry: the request gets
    ocache's 503, the entry stays (a refused connection is not "the server refused the file"), and
    after the server is back the same entry is restored and confirmed."""
    srv = start_server("dense", n_parallel=1, ctx_size=16384, **SERVER)
    cache = tmp_path / "cache"
    if tier == "head":
        cfg, first, back = make_config(srv, cache), [(A1,)], B1
    elif tier == "disk":
        cfg, first, back = make_config(srv, cache, disk_min=1024, head={"budget_gb": 0}), [(A1,)], B1
    else:
        cfg, first, back = make_config(srv, cache, spill_min=2000, head={"budget_gb": 0}), [(A1,), (B1,)], A2
    async with through_ocache(cfg) as (base, proxy), aiohttp.ClientSession() as s:
        for (name,) in first:
            await send(s, base, proxy, body_of(name), hdrs(name))
        layer = proxy.layer
        store = store_mod._SHARED[(cache / "store").resolve()]
        kind = {"head": "h", "disk": "a", "session": "s"}[tier]
        for t in layer.tiers:
            if hasattr(t, "flush"):
                await t.flush()
        before = sorted(e.key for e in store.entries(kind))
        assert before, store.stats()
        if tier != "session":
            await layer.clear("resident")
        if tier == "disk":
            await layer.clear("head")   # no head known: the anchor is the only offer
        seen = kill_on_restore(layer.table, srv)
        r = await send(s, base, proxy, body_of(back), hdrs(back), ok=False)
        assert seen and r["status"] == 503, (seen, r)
        # (the session case also spilled B, which A's return evicted: a new entry beside A's)
        assert set(before) <= {e.key for e in store.entries(kind)}
        for k in before:
            store.verify(k)   # still intact
        srv.start()
        await settle(srv.url)
        r = await send(s, base, proxy, body_of(back), hdrs(back))
        assert r["tier"] == tier, (r["tier"], layer.stats())
        assert r["data"]["timings"]["cache_n"] > 1000, r["data"]["timings"]


# --------------------------------------------------------------------------- item 8: cancellation at every await

class CancelAt:
    """Drive a coroutine as a Task would, and cancel it at its ``k``-th suspension (the future it
    waits on is cancelled and ``CancelledError`` thrown in, which is what ``Task.cancel()`` does to a
    handler whose client disconnected). ``reached``: the coroutine suspended at least ``k`` times."""

    def __init__(self, coro, k: int):
        self.coro, self.k, self.reached = coro, k, False

    @types.coroutine
    def run(self):
        coro, n, value, exc = self.coro, 0, None, None
        while True:
            try:
                fut = coro.throw(exc) if exc is not None else coro.send(value)
            except StopIteration as stop:
                return stop.value
            value, exc = None, None
            n += 1
            if n == self.k:
                self.reached = True
                if fut is not None and hasattr(fut, "cancel"):
                    fut.cancel()
                exc = asyncio.CancelledError()
                continue
            try:
                value = yield fut
            except BaseException as e:  # noqa: BLE001 - handed to the coroutine
                exc = e


def agent_body(i: int, words: int = 40) -> dict:
    # a harness head (tools + the system text up to a volatile marker, ocache.fingerprint) of ~900
    # tokens, then the per-folder <env> block
    system = ("You are a careful coding assistant. " + " ".join(f"rule{j} applies." for j in range(150))
              + f"\n<env>\n  Working directory: /work/p{i}\n</env>")
    tools = [{"type": "function", "function": {"name": "read", "description": "Read a file.",
                                                "parameters": {"type": "object", "properties": {
                                                    "path": {"type": "string"}}}}}]
    return {"messages": [{"role": "system", "content": system},
                         {"role": "user", "content": f"Session {i}: " + " ".join(f"w{i}x{j}" for j in range(words))}],
            "tools": tools, "max_tokens": 2, "temperature": 0, "stream": False}


def preq(i: int, body: dict) -> ParsedRequest:
    return ParsedRequest(request_id=f"cancel-{i}", method="POST", path=CHAT, body=body,
                         headers={}, session_hint=f"ses-{i}", stream=False)


@pytest.mark.server
async def test_cancelling_the_plan_at_every_await_never_keeps_a_slot(start_server, tmp_path):
    """A client that disconnects while its request is planned cancels ``plan``. For three planning
    paths (the head warm-up and save, a head restore, an eviction with a spill), ``plan`` is
    cancelled at each of its suspension points in turn; after each: no slot lock is held, and the
    next request through the proxy, ``clear`` and (at the end) ``drain`` complete within bounds."""
    srv = start_server("dense", n_parallel=1, ctx_size=8192, **SERVER)
    cfg = make_config(srv, tmp_path / "cache", spill_min=100, disk_min=256)
    bound = aiohttp.ClientTimeout(total=60)
    async with through_ocache(cfg) as (base, proxy), aiohttp.ClientSession(timeout=bound) as s:
        await send(s, base, proxy, agent_body(0), {"x-session-affinity": "ses-0"})
        layer = proxy.layer
        assert layer.head_tier.heads, "the synthetic agent body has no harness head"
        store = store_mod._SHARED[(tmp_path / "cache" / "store").resolve()]

        async def fresh() -> None:                 # nothing known: warm the head, save it
            await asyncio.wait_for(layer.clear("all"), 30)

        # the restore paths: with the tiny model's measured prefill rate a ~900-token restore may
        # cost more than the prefill it saves (then it is rightly not taken); this test is about
        # cancelling those paths, so the rate is left unmeasured (an offer is taken when it saves
        # at least one ubatch)
        async def head_known() -> None:           # the head file, no anchor, no slot holds it
            await asyncio.wait_for(layer.clear("resident"), 30)
            await asyncio.wait_for(layer.clear("disk"), 30)
            layer.prefill_tps = None

        async def anchor_known() -> None:         # an anchor, no head known, no slot holds it
            await asyncio.wait_for(layer.clear("resident"), 30)
            await asyncio.wait_for(layer.clear("head"), 30)
            layer.prefill_tps = None

        async def conversation_resident() -> None:  # another session in the only slot: evict, spill
            await send(s, base, proxy, agent_body(0), {"x-session-affinity": "ses-0"})

        covered = {}
        def counts() -> dict:
            return {**layer.counters, **{f"disk_{k}": v for k, v in layer.disk_tier.counters.items()}}

        for name, setup, body in [("warm", fresh, agent_body(1)), ("head", head_known, agent_body(2)),
                                  ("anchor", anchor_known, agent_body(3)),
                                  ("evict", conversation_resident, agent_body(4))]:
            await send(s, base, proxy, agent_body(0), {"x-session-affinity": "ses-0"})
            k = 0
            while True:
                k += 1
                await setup()
                before = counts()
                drv = CancelAt(layer.plan(preq(k, body)), k)
                task = asyncio.ensure_future(drv.run())
                done, _ = await asyncio.wait({task}, timeout=60)
                assert done, f"{name}: plan cancelled at await {k} did not finish"
                held = [i for i in range(len(layer.table)) if layer.table.lock(i).locked()]
                if not drv.reached:           # k is past the last await: the plan completed
                    plan = task.result()
                    assert held == [plan.body_updates["id_slot"]]
                    await plan.release()
                    after = counts()
                    covered[name] = (k - 1, {c: after[c] - before[c] for c in before if after[c] != before[c]})
                    break
                assert task.cancelled() or isinstance(task.exception(), asyncio.CancelledError), task
                assert held == [], f"{name}: slot(s) {held} still locked after a cancel at await {k}"
                await layer.idle()
                assert not store._reserved, f"{name}: reservation left after a cancel at await {k}"
                # the next request is served, and clear does not wait for ever
                r = await send(s, base, proxy, agent_body(9), {"x-session-affinity": "ses-9"})
                assert r["status"] == 200
                await asyncio.wait_for(layer.clear("resident"), 30)
        print(covered)
        assert covered["warm"][1].get("warmups") == 1 and covered["warm"][1].get("head_saves") == 1, covered
        assert covered["head"][1].get("head_restores") == 1, covered
        assert covered["anchor"][1].get("disk_restores") == 1, covered
        assert covered["evict"][1].get("evictions") == 1, covered
        await asyncio.wait_for(layer.drain(), 120)


# --------------------------------------------------------------------------- item 12: budgets before the write

@pytest.mark.server
async def test_budgets_smaller_than_a_file_write_nothing_to_discard(start_server, tmp_path, monkeypatch, caplog):
    """Disk, session and head budgets of 1 kB (smaller than any slot file): at most one file is ever
    written (the first, which measures the size; the commit refuses it), every later anchor, spill
    and head is refused before the server writes anything, no evicting request waits for a save, and
    the drain log does not claim a spill that was discarded. Before: every one written, then thrown
    away, and "drain spilled 1 conversation(s)"."""
    saves = SaveLog(monkeypatch)
    srv = start_server("dense", n_parallel=1, ctx_size=16384, **SERVER)
    cfg = make_config(srv, tmp_path / "cache", spill_min=2000, disk_min=1024, head={"budget_gb": 1e-6},
                      disk_budget_gb=1e-6, spill_budget_gb=1e-6)
    caplog.set_level(logging.INFO, logger="ocache.spill")
    async with through_ocache(cfg) as (base, proxy), aiohttp.ClientSession() as s:
        await send(s, base, proxy, body_of(A1), hdrs(A1))
        await send(s, base, proxy, body_of(B1), hdrs(B1))   # evicts A
        await send(s, base, proxy, body_of(A2), hdrs(A1))   # evicts B
        layer = proxy.layer
        session = next(t for t in layer.tiers if t.name == "session")
        assert layer.counters["evictions"] == 2
        await proxy.drain(30)
        store = session.store
        print("saves:", saves.names, "refused:", session.counters["spill_skipped_budget"],
              layer.disk_tier.counters["skipped_budget"], layer.head_tier.counters["skipped_budget"])
        assert len(saves.names) <= 1, saves.names
        assert store.counters["commit_failed"] == len(saves.names)
        assert session.counters["spill_skipped_budget"] == 3, session.stats()   # 2 evictions + drain
        assert layer.disk_tier.counters["skipped_budget"] >= 2, layer.disk_tier.stats()
        assert not store.entries() and not [p for p in data_files(srv) if p.name.startswith("oc-")]
    drained = [r.getMessage() for r in caplog.records if "drain spilled" in r.getMessage()]
    assert drained and all("drain spilled 0 conversation(s)" in m for m in drained), drained


@pytest.mark.server
async def test_a_planned_stop_writes_each_conversation_once(start_server, tmp_path, monkeypatch):
    """A conversation above the eviction threshold at a planned stop is saved once (as ``drain``);
    before it was saved as ``evict`` and again as ``drain`` (2 x 66.5 MB at 126k tokens)."""
    saves = SaveLog(monkeypatch)
    srv = start_server("dense", n_parallel=1, ctx_size=16384, **SERVER)
    cfg = make_config(srv, tmp_path / "cache", spill_min=2000, head={"budget_gb": 0})
    async with through_ocache(cfg) as (base, proxy), aiohttp.ClientSession() as s:
        await send(s, base, proxy, body_of(A1), hdrs(A1))
        await proxy.drain(30)
        session = next(t for t in proxy.layer.tiers if t.name == "session")
        spills = [n for n in saves.names if n.startswith("oc-tmp-s-")]
        assert len(spills) == 1, saves.names
        [e] = session.store.entries("s")
        assert e.meta["reason"] == "drain" and session.counters["spills"] == 1


# --------------------------------------------------------------------------- item 13

@pytest.mark.server
async def test_a_sidecar_write_killed_part_way_leaves_no_temp_file(start_server, tmp_path, monkeypatch):
    """llama-server is killed while it writes a spill's checkpoint sidecar (``<file>.ckpt.tmp``,
    patches/0001): the failed save leaves no ``.ckpt.tmp`` (nor any other temp file) behind.

    To kill it at exactly that point, the test puts a FIFO where the sidecar's temp file goes, with a
    4 KiB pipe: the server's write blocks once the pipe is full (the hybrid model's sidecar is
    larger), the test sees the full pipe, then kill -9. Before: the ``.ckpt.tmp`` stayed until the
    next start of ocache."""
    srv = start_server("hybrid", n_parallel=1, ctx_size=16384, **SERVER)
    killed: list[int] = []

    def stall_and_kill(fd: int, cap: int) -> None:
        try:
            deadline = time.monotonic() + 60
            buf = bytearray(4)
            while time.monotonic() < deadline:  # bounded wait for the condition "pipe full"
                fcntl.ioctl(fd, termios.FIONREAD, buf)
                if int.from_bytes(buf, "little") >= cap:
                    # noted first: kill() waits for the process to exit, and the request may see
                    # the dead connection and finish before that wait returns
                    killed.append(cap)
                    srv.kill()
                    return
                time.sleep(0.01)
        finally:
            os.close(fd)

    async def before(table, slot, filename):
        if filename.startswith("oc-tmp-s-"):
            fifo = Path(srv.slot_save_path) / (filename + ".ckpt.tmp")
            os.mkfifo(fifo, 0o600)
            # opened read-write (Linux: never blocks) and shrunk to one page *before* the server is
            # asked to save, so its write blocks on a full pipe and never meets a closed reader
            fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
            cap = fcntl.fcntl(fd, 1031, 4096)   # F_SETPIPE_SZ
            asyncio.get_running_loop().run_in_executor(None, stall_and_kill, fd, cap)

    SaveLog(monkeypatch, before)
    cfg = make_config(srv, tmp_path / "cache", spill_min=2000, head={"budget_gb": 0})
    async with through_ocache(cfg) as (base, proxy), aiohttp.ClientSession() as s:
        await send(s, base, proxy, body_of(A1), hdrs(A1))
        r = await send(s, base, proxy, body_of(B1), hdrs(B1), ok=False)   # evicts A: the spill
        assert killed, "the sidecar write was not reached"
        assert r["status"] in (502, 503), r
        session = next(t for t in proxy.layer.tiers if t.name == "session")
        assert session.counters["spill_failed"] == 1, session.stats()
        left = [p.name for p in data_files(srv)]
        assert not [n for n in left if n.endswith(".ckpt.tmp") or n.startswith("oc-tmp-")], left


@pytest.mark.server
async def test_a_store_that_cannot_open_asks_for_no_saves(start_server, tmp_path, monkeypatch):
    """The store's directory cannot be created (a file is in the way): every tier that needs it stays
    off, requests are served, and the server is never asked to save (before: the disk tier got the
    unopened store and wrote its anchors on every request, the head tier its unverified file)."""
    saves = SaveLog(monkeypatch)
    srv = start_server("dense", n_parallel=1, ctx_size=16384, **SERVER)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "store").write_text("not a directory")
    cfg = make_config(srv, cache, spill_min=2000, disk_min=1024)
    async with through_ocache(cfg) as (base, proxy), aiohttp.ClientSession() as s:
        for name, h in ((A1, A1), (A2, A1), (B1, B1)):
            r = await send(s, base, proxy, body_of(name), hdrs(h))
            assert r["status"] == 200
        layer = proxy.layer
        assert saves.names == [], saves.names
        assert layer.disk_tier is None and layer.head_tier.store is None
        assert not [t for t in layer.tiers if t.name == "session"]
        assert not [p for p in data_files(srv)]


# --------------------------------------------------------------------------- store units (no server)

def _slot_file(path: Path, tokens: list[int], state: int) -> None:
    import struct

    words = [-1, 1, len(tokens), *tokens]
    path.write_bytes(struct.pack("<III", store_mod.SLOT_MAGIC, 3, len(words) + 1)
                     + struct.pack(f"<{len(words)}i", *words) + b"\x01" * state)


def test_size_estimate_learns_from_every_measured_file(tmp_path):
    """``estimate_bytes``: None before anything was measured; a line through the measured sizes
    after, including a file the commit refused for the budget."""
    s = store_mod.Store(tmp_path / "meta", tmp_path / "data", "id-A", budget_bytes=10_000)
    s.open()
    assert s.estimate_bytes(1000) is None
    toks = list(range(100))
    name = s.temp_name("a", "k1")
    _slot_file(s.path(name), toks, 20_000)   # larger than the budget
    with pytest.raises(store_mod.BudgetError):
        s.commit("a", toks, name)
    assert [p.name for p in (tmp_path / "data").iterdir()] == [".ocache-stores"]
    est = s.estimate_bytes(100)
    assert est is not None and est > 10_000
    with pytest.raises(store_mod.BudgetError):
        s.reserve("k2", s.estimate_bytes(200), "a")   # refused before anything is written
    toks2 = list(range(50))
    name = s.temp_name("a", "k3")
    _slot_file(s.path(name), toks2, 4_000)
    s.commit("a", toks2, name)
    e100, e50 = s.estimate_bytes(100), s.estimate_bytes(50)
    assert e50 < e100


def test_discard_temp_removes_the_sidecars_temp_file(tmp_path):
    s = store_mod.Store(tmp_path / "meta", tmp_path / "data", "id-A")
    s.open()
    name = s.temp_name("s", "k")
    for suffix in ("", ".ckpt", ".ckpt.tmp"):
        s.path(name + suffix).write_bytes(b"x")
    s.discard_temp(name)
    assert [p.name for p in (tmp_path / "data").iterdir()] == [".ocache-stores"]


def test_shared_store_keeps_no_store_that_failed_to_open(tmp_path):
    meta = tmp_path / "meta"
    meta.write_text("a file where the directory goes")
    for kind in ("s", "a"):
        with pytest.raises(OSError):
            store_mod.shared_store(meta, tmp_path / "data", "id-A", kind=kind, kind_budget_bytes=10)
    assert meta.resolve() not in store_mod._SHARED


async def _prompt_total(s: aiohttp.ClientSession, url: str) -> int:
    async with s.get(url + "/metrics") as r:
        text = await r.text()
    return int(float(next(ln.split()[-1] for ln in text.splitlines()
                          if ln.startswith("llamacpp:prompt_tokens_total"))))


@pytest.mark.server
@pytest.mark.parametrize("model", ["dense", "hybrid"])
async def test_started_in_front_of_a_warm_server_it_lets_the_server_choose(start_server, tmp_path, model):
    """ocache (re)started in front of a llama-server whose slots hold conversations it never saw:
    it cannot see what they hold, so it forwards without ``id_slot`` and the server picks the slot
    by its own prompt similarity, reusing as much as it would alone; ocache learns the slot it
    chose (the one whose id_task grew) and pins the next turn there with an exact prediction.
    Before: the turn went to the other conversation's slot and reused only the shared head."""
    srv = start_server(model, n_parallel=2, ctx_size=2 * 16384, **SERVER)
    a1, a2, b1 = body_of(A1), body_of(A2), body_of(B1)
    async with aiohttp.ClientSession() as s:
        for body, slot in ((a1, 1), (b1, 0)):      # the conversations of the earlier ocache-less life
            async with s.post(srv.url + CHAT, json=dict(body, id_slot=slot)) as r:
                assert r.status == 200
                t = (await r.json())["timings"]
            if body is a1:
                n_a1 = t["cache_n"] + t["prompt_n"]
        async with through_ocache(make_config(srv, tmp_path / "state")) as (base, proxy):
            before = await _prompt_total(s, srv.url)
            async with s.post(base + CHAT, json=a2, headers=hdrs(A2)) as r:
                assert r.status == 200 and r.headers["X-OCache-Slot"] == "server"
                t = (await r.json())["timings"]
            await proxy.wait_background()
            await proxy.layer.idle()
            assert t["cache_n"] >= n_a1 - UB                      # A's slot, as the server alone
            assert await _prompt_total(s, srv.url) - before == t["prompt_n"]
            table = proxy.layer.table
            assert table[1].tokens and not table[1].foreign and table[0].foreign
            nxt = copy.deepcopy(a2)
            nxt["messages"].append({"role": "assistant", "content": "ok"})
            nxt["messages"].append({"role": "user", "content": "and then?"})
            async with s.post(base + CHAT, json=nxt, headers=hdrs(A2)) as r:
                assert r.status == 200 and r.headers["X-OCache-Slot"] == "1"
                predicted = int(r.headers["X-OCache-Predicted-Cache"])
                t2 = (await r.json())["timings"]
            await proxy.wait_background()
            await proxy.layer.idle()
            assert abs(t2["cache_n"] - predicted) <= UB and predicted > n_a1 - UB
            assert proxy.layer.counters["server_placed"] == 1


@pytest.mark.server
async def test_warm_dir_spills_the_conversation_it_replaces(start_server, tmp_path):
    """``ocache warm DIR`` when every slot holds a conversation: the one it replaces is handed to the
    tiers first (the session tier spills it), so it comes back from the session tier (it was
    overwritten and lost, unspilled); a folder whose head a slot already starts with is not warmed a
    second time."""
    srv = start_server("dense", n_parallel=2, ctx_size=2 * 16384, **SERVER)
    from ocache.warm import folder_of

    pi = body_of("pi_turn1.json")
    convs = {"pi-1": pi, hdrs(A1)["x-session-affinity"]: body_of(A1), hdrs(B1)["x-session-affinity"]: body_of(B1)}
    convs = {o: (b, folder_of(b)) for o, b in convs.items()}
    assert len({f for _, f in convs.values()}) == 3
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with through_ocache(make_config(srv, tmp_path / "state", spill_min=256)) as (base, proxy):
        async with aiohttp.ClientSession() as s:

            async def warm(folder: str) -> dict:
                async with s.post(base + "/v1/cache/warm", json={"dir": folder}, headers=auth) as r:
                    assert r.status == 200
                    return [json.loads(x) for x in (await r.text()).splitlines()][-1]

            for owner, (body, _) in convs.items():
                await send(s, base, proxy, body, {"x-session-affinity": owner})
            table, session = proxy.layer.table, proxy.layer.session_tier
            held = {table[i].owner for i in range(2)}
            gone = next(o for o in convs if o not in held)
            last = await warm(convs[next(iter(held))][1])
            assert last.get("source") == "resident", last       # its conversation starts with it
            assert {table[i].owner for i in range(2)} == held
            target = convs[gone][1]
            def saved() -> int:   # a spill, or one found already stored (the same content)
                return session.counters["spills"] + session.counters["spill_dedup"]

            spills = saved()
            last = await warm(target)
            assert last.get("done") and not last.get("error"), last
            await proxy.layer.idle()
            assert saved() > spills, session.counters
            replaced = next(o for o in held if o not in {table[i].owner for i in range(2)})
            # restore vs prefill is priced with measured rates (a loaded machine measured a restore
            # slower than the prefill it saves and prefilled): price the spill's read as free, so
            # what is checked is that the spill exists and is offered, not this machine's seconds
            session.read_cost_s = lambda nbytes: 0.0
            rec = await send(s, base, proxy, convs[replaced][0], {"x-session-affinity": replaced})
            assert rec["tier"] == "session", rec


@pytest.mark.server
async def test_a_damaged_anchor_falls_back_to_the_next_one(start_server, tmp_path):
    """The longest anchor for a request is damaged: the store's check deletes it and the disk tier
    is asked once more: the next anchor (the harness head's) is restored instead of serving the
    request cold, and the answer is a cold run's (measured before: 11,817 tokens prefilled although
    valid 9,364- and 7,840-token anchors were on disk)."""
    srv = start_server("dense", n_parallel=1, ctx_size=16384, **SERVER)
    async with through_ocache(make_config(srv, tmp_path / "state", disk_min=512)) as (base, proxy), \
            aiohttp.ClientSession() as s:
        await send(s, base, proxy, body_of(A1), hdrs(A1))
        layer = proxy.layer
        store = layer.disk_tier.store
        anchors = sorted(store.entries("a"), key=lambda e: e.n_tokens)
        assert len(anchors) >= 2, anchors
        longest, nxt = anchors[-1], anchors[-2]
        assert (await layer.clear("resident"))["cleared"] == 1
        [path] = [Path(srv.slot_save_path) / f.name for f in longest.files.values() if f.name.endswith(".bin")]
        flip(path, "bytes", longest.n_tokens)
        b = body_of(A2)
        r = await send(s, base, proxy, b, hdrs(A2))
        assert r["tier"] == "disk", r["tier"]
        assert r["data"]["timings"]["cache_n"] >= nxt.n_tokens - UB
        assert layer.counters["bring_failures"] == 1 and layer.counters["bring_retries"] == 1
        assert longest.key not in {e.key for e in store.entries("a")}
        ref = await cold(srv.url, b)
        assert r["data"]["choices"][0]["message"] == ref["choices"][0]["message"]
