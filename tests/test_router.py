"""Several llama-servers behind one ocache (ocache/router.py): routing by usable prefix and load,
fail-over, one disk store for all servers of one identity.

Real parts: two patched llama-servers on the tiny dense model on loopback, both with the same
``--slot-save-path`` (the ``start_server`` fixture's default: one folder per test), the in-process
proxy with a Router over one OCacheLayer per server, real opencode request bodies (two project
folders). Exactness is judged per token against a cold run of the same prompt alone on a server
(``ocache.bench.exact``).
"""

from __future__ import annotations

import asyncio
import copy
import json
from contextlib import asynccontextmanager

import aiohttp
import pytest

from ocache.bench.exact import PROBS_FIELDS, Generation, compare, describe
from ocache.config import Config
from ocache.router import Router, Server, cost_s

from conftest import body_of, session_headers, through_ocache
from test_spill import CHAT, SERVER

A1, A2 = "opencode_agent_turn1.json", "opencode_agent_turn1_after_tool.json"
B1, B2 = "opencode_run3_proj2_agent_turn1.json", "opencode_run3_proj2_agent_turn1_after_tool.json"


def router_config(servers, cache_dir, **kw) -> Config:
    return Config(upstream=servers[0].url, upstreams=[s.url for s in servers], cache_dir=str(cache_dir),
                  tiers={"resident": {"server_args": servers[0].command()[1:]}}, **kw)


@asynccontextmanager
async def through_router(config: Config):
    """A proxy with the Router over one OCacheLayer per upstream; yields (base_url, proxy)."""
    async with through_ocache(config) as (base, proxy):
        assert isinstance(proxy.layer, Router)
        yield base, proxy


def body(name: str, max_tokens: int = 8) -> dict:
    return {**body_of(name, max_tokens), **PROBS_FIELDS}


def new_session(b: dict, text: str) -> dict:
    """Another session in the same folder: the same system prompt and tools, another first user
    message."""
    out = copy.deepcopy(b)
    first_user = next(i for i, m in enumerate(out["messages"]) if m["role"] == "user")
    out["messages"] = out["messages"][:first_user] + [{"role": "user", "content": text}]
    return out


async def send(s, base, proxy, b: dict, headers: dict) -> dict:
    async with s.post(base + CHAT, json=b, headers=headers) as r:
        data = await r.json()
        assert r.status == 200, data
        rec = {"upstream": r.headers.get("X-OCache-Upstream"), "route": r.headers.get("X-OCache-Route"),
               "tier": r.headers.get("X-OCache-Tier"), "timings": data["timings"], "data": data}
    print(f"{rec['upstream']} {rec['tier']} cache_n {rec['timings']['cache_n']} "
          f"prompt_n {rec['timings']['prompt_n']}: {rec['route']}")
    await proxy.wait_background()
    await proxy.layer.idle()
    return rec


async def cold(url: str, b: dict) -> dict:
    async with aiohttp.ClientSession() as s:
        async with s.post(url + CHAT, json=dict(b, cache_prompt=False, id_slot=0)) as r:
            data = await r.json()
    assert data["timings"]["cache_n"] == 0
    return data


def assert_exact(ref: dict, rec: dict) -> None:
    v = compare(Generation.from_response(ref), Generation.from_response(rec["data"]))
    assert v.exact and v.compared >= 4, (describe(v), rec["route"])


def two_servers(start_server, model: str = "dense"):
    return [start_server(model, n_parallel=2, ctx_size=2 * 16384, **SERVER) for _ in range(2)]


# --------------------------------------------------------------------------------- the cost model

def test_cost_prefers_the_server_holding_the_prefix_and_weighs_load():
    """Pure: more usable prefix is cheaper; a request in flight costs β × the mean request time;
    a conversation destroyed without a spill costs its re-prefill."""
    from ocache.cache import Estimate
    from ocache.router import _InFlight

    def est(usable, destroys=0, restore_s=0.0):
        return Estimate(n_tokens=8000, usable=usable, tier="resident", slot=0, busy=False,
                        destroys=destroys, restore_s=restore_s, kind="agent", own_session=False,
                        head_len=7000, prefill_tps=None)

    idle = Server(0, None, None)
    busy = Server(1, None, None, mean_request_s=4.0)
    busy.inflight["x"] = _InFlight(prefill=0, since=0.0)
    assert cost_s(est(7900), idle, 1000.0, 0.5) < cost_s(est(7000), idle, 1000.0, 0.5)
    # 900 tokens more to prefill (0.9 s) beat sharing a server whose requests take 4 s
    assert cost_s(est(7000), idle, 1000.0, 0.5) < cost_s(est(7900), busy, 1000.0, 0.5)
    assert cost_s(est(7900), busy, 1000.0, 0.0) < cost_s(est(7000), idle, 1000.0, 0.0)
    assert cost_s(est(100, destroys=5000), idle, 1000.0, 0.5) > cost_s(est(0), idle, 1000.0, 0.5)


def _fake_router(ests: list, load_weight: float = 0.5) -> Router:
    """A Router over stand-in layers whose ``estimate`` answers the given Estimates (no server)."""
    from types import SimpleNamespace

    def layer(est):
        async def estimate(req):
            return est
        return SimpleNamespace(estimate=estimate, prefill_tps=1000.0)

    ups = [SimpleNamespace(base_url=f"http://127.0.0.1:{i + 1}", state="ready") for i in range(len(ests))]
    it = iter(ests)
    return Router(ups, Config(route_load_weight=load_weight), lambda u, c: layer(next(it)))


def _est(n, usable, ubatch=128, destroys=0, **kw):
    from ocache.cache import Estimate

    return Estimate(n_tokens=n, usable=usable, tier="resident" if usable else "cold", slot=0, busy=False,
                    destroys=destroys, restore_s=0.0, kind="guest", own_session=False, head_len=0,
                    prefill_tps=1000.0, ubatch=ubatch, **kw)


async def test_load_never_buys_latency_with_more_prefill_than_one_ubatch():
    """Rule 2 across servers: a request whose prefix is resident on a busy server stays there when
    the idle one would prefill more than one ubatch more (a title request: 540 of 541 resident);
    within one ubatch the load decides (the busy server's conversation moves)."""
    from ocache.router import _InFlight

    req = type("R", (), {"request_id": "r1"})()
    r = _fake_router([_est(541, 540), _est(541, 0)])
    r.servers[0].inflight["x"] = _InFlight(0, 0.0)
    r.servers[0].mean_request_s = 4.0
    assert (await r.choose(req)).server.index == 0
    r = _fake_router([_est(8000, 7926), _est(8000, 7909)])  # 74 vs 91 tokens to prefill
    r.servers[0].inflight["x"] = _InFlight(0, 0.0)
    r.servers[0].mean_request_s = 4.0
    c = await r.choose(req)
    assert c.server.index == 1 and "in flight" in c.reason
    # the choice is reserved at once: a concurrent decision sees it as load
    assert "r1" in r.servers[1].inflight
    # a guest goes where it destroys least: same prefill, one server would overwrite a conversation
    r = _fake_router([_est(600, 0, destroys=5000), _est(600, 0)])
    assert (await r.choose(type("R", (), {"request_id": "g"})())).server.index == 1


async def test_load_decides_only_among_the_least_prefill_unless_an_idle_server_is_within_one_ubatch():
    """Prefill first: a conversation resident on a busy server (1,007 tokens to prefill there) does
    not move to another busy server that would prefill 16 tokens more, however much less loaded
    that one is (bench-multi: such a move cost the two sessions already there their slots);
    equal token costs go to the less loaded server; an idle server within one ubatch wins only
    while every least-prefill server is busy and only where it has room (a free slot: it overwrites
    no live conversation), and a server more than one ubatch dearer never."""
    from ocache.router import _InFlight

    def req(rid):
        return type("R", (), {"request_id": rid})()

    r = _fake_router([_est(8242, 7235), _est(8242, 7219)])
    r.servers[0].inflight["x"] = _InFlight(0, 0.0)
    r.servers[0].mean_request_s = 2.0       # its load: 0.5 x 1 x 2 s = 1 s
    r.servers[1].inflight["y"] = _InFlight(0, 0.0)
    r.servers[1].mean_request_s = 0.2       # 0.1 s: cheaper in seconds by ~0.9 s
    assert (await r.choose(req("1"))).server.index == 0
    r = _fake_router([_est(8242, 7235), _est(8242, 7235)])   # equal tokens: the load decides
    r.servers[0].inflight["x"] = _InFlight(0, 0.0)
    assert (await r.choose(req("2"))).server.index == 1
    r = _fake_router([_est(8242, 7235), _est(8242, 7219)])   # the least-prefill server is idle too
    r.servers[1].mean_request_s = 0.2
    assert (await r.choose(req("3"))).server.index == 0
    r = _fake_router([_est(8242, 7235), _est(8242, 7232, evicts=7244)])  # idle, but overwrites one
    r.servers[0].inflight["x"] = _InFlight(0, 0.0)
    r.servers[0].mean_request_s = 4.0
    assert (await r.choose(req("5"))).server.index == 0
    r = _fake_router([_est(8242, 7235), _est(8242, 7219, room=False)])   # idle, no free slot
    r.servers[0].inflight["x"] = _InFlight(0, 0.0)
    r.servers[0].mean_request_s = 4.0
    assert (await r.choose(req("6"))).server.index == 0
    r = _fake_router([_est(8242, 7235), _est(8242, 7100)])   # idle but 135 > 128 tokens more
    r.servers[0].inflight["x"] = _InFlight(0, 0.0)
    r.servers[0].mean_request_s = 4.0
    assert (await r.choose(req("4"))).server.index == 0


async def test_a_server_with_room_wins_over_a_full_one_within_one_ubatch():
    """bench-multi's first turns: a session's head is on disk for both servers; one server, whose
    two slots hold two other live conversations, would reuse 44 tokens more by overwriting one of
    them (spilled first: no destroys). Within one ubatch the server with room wins; beyond one
    ubatch, or when both are full, the fewest tokens do."""
    def req(rid):
        return type("R", (), {"request_id": rid})()

    full = dict(evicts=7236, full=True)
    r = _fake_router([_est(7260, 6986, **full), _est(7260, 6942)])
    assert (await r.choose(req("1"))).server.index == 1
    r = _fake_router([_est(7260, 6986, **full), _est(7260, 6800)])   # 186 > 128 tokens more
    assert (await r.choose(req("2"))).server.index == 0
    r = _fake_router([_est(7260, 6942, **full), _est(7260, 6986, **full)])
    assert (await r.choose(req("3"))).server.index == 1
    # with room (a free slot besides the overwritten one) the fewest tokens win
    r = _fake_router([_est(7260, 6986, evicts=7236), _est(7260, 6942)])
    assert (await r.choose(req("4"))).server.index == 0


def test_gate_key_ignores_a_reuse_only_a_destroyed_conversation_offers():
    """The second session of a folder starting while the first prefills the folder section: the
    only server reusing past the harness head would overwrite the running first turn (not saved:
    destroys), so the request waits for that plan (same key: 256 past the head) instead of
    prefilling the section again; a server that reuses it without destroying one ends the wait."""
    from ocache.router import _gate_key

    chosen = _est(7236, 6942, prefix_key=11, prefix_len=7198)
    assert _gate_key(chosen, [chosen, _est(7236, 7222, destroys=7245)]) == ("prefix", 11)
    assert _gate_key(chosen, [chosen, _est(7236, 7219)]) is None
    title = _est(541, 0, prefix_key=12, prefix_len=256)
    assert _gate_key(title, [title, _est(541, 0)]) == ("prefix", 12)


async def test_a_request_asks_again_when_a_plan_of_its_prefix_ended_while_it_estimated():
    """Two identical title requests: B's estimates are asked before A's plan records the title in
    server 0's slot and answer only after A's plan is done (and its gate open). B then asks
    again and goes where the title is (server 0, 540 of 541), not to the other, idle server."""
    from types import SimpleNamespace

    from ocache.layer import Plan

    held = {0: 0, 1: 0}          # tokens of the title each server's slots hold
    answer_b = asyncio.Event()
    asked_b = asyncio.Event()

    def layer(i):
        async def estimate(req):
            usable = max(0, held[i] - 1)          # what this server holds when asked
            if req.request_id == "b" and not answer_b.is_set():
                asked_b.set()
                await answer_b.wait()
            return _est(541, usable, prefix_key=7 if usable < 256 else None, prefix_len=256)

        async def plan(req):
            held[i] = 541
            return Plan()
        return SimpleNamespace(estimate=estimate, plan=plan, prefill_tps=1000.0)

    ups = [SimpleNamespace(base_url=f"http://127.0.0.1:{i + 1}", state="ready") for i in range(2)]
    it = iter(range(2))
    r = Router(ups, Config(), lambda u, c: layer(next(it)))
    b = asyncio.ensure_future(r.plan(SimpleNamespace(request_id="b", headers={})))
    await asyncio.wait_for(asked_b.wait(), 10)
    a = await r.plan(SimpleNamespace(request_id="a", headers={}))
    assert a.upstream == "http://127.0.0.1:1"
    await r.idle()                                # A's gate opens (nothing to commit here)
    answer_b.set()
    pb = await asyncio.wait_for(b, 10)
    assert pb.upstream == "http://127.0.0.1:1", pb.headers["X-OCache-Route"]
    assert r.counters["gate_rechecks"] == 1


async def test_a_gate_opens_when_the_commits_of_its_plan_are_done_not_later_ones():
    """The first plan of a new prefix saved an anchor whose commit (hash, entry) runs after the plan
    returned: a request of the same prefix waits until that commit is done (before, it would find
    no anchor and prefill the section again), and not for a commit started after that plan (a
    title waited until the stream ended)."""
    from types import SimpleNamespace

    from ocache.layer import Plan

    first_commit, later_commit = asyncio.Event(), asyncio.Event()
    tier = SimpleNamespace(tasks=[])
    tier.pending_commits = lambda: [t for t in tier.tasks if not t.done()]

    async def estimate(req):
        return _est(7245, 6942, prefix_key=5, prefix_len=7198)

    async def plan(req):
        tier.tasks.append(asyncio.ensure_future(first_commit.wait()))
        return Plan()

    ups = [SimpleNamespace(base_url=f"http://127.0.0.1:{i + 1}", state="ready") for i in range(2)]
    r = Router(ups, Config(), lambda u, c: SimpleNamespace(estimate=estimate, plan=plan, prefill_tps=1000.0,
                                                         disk_tier=tier))
    await r.plan(SimpleNamespace(request_id="a", headers={}))
    tier.tasks.append(asyncio.ensure_future(later_commit.wait()))   # another request's save
    b = asyncio.ensure_future(r.plan(SimpleNamespace(request_id="b", headers={})))
    done, _ = await asyncio.wait({b}, timeout=0.5)
    assert not done and r.counters["gate_waits"] == 1
    first_commit.set()
    await asyncio.wait_for(b, 10)
    assert not later_commit.is_set()
    later_commit.set()
    await r.idle()


async def test_a_near_tie_goes_to_the_server_that_served_the_session_last():
    """Costs that differ by measurement jitter (both servers can bring the conversation from the
    shared store) do not move a session: the tie goes to where it was served last; a clearly
    cheaper server still wins."""
    from ocache.router import Server

    def req(rid):
        return type("R", (), {"request_id": rid, "session_hint": "ses-a", "headers": {}})()

    r = _fake_router([_est(7328, 7251), _est(7328, 7251)])
    r._last_server["ses-a"] = r.servers[1]
    assert (await r.choose(req("1"))).server.index == 1          # an exact tie: not index order
    r = _fake_router([_est(7328, 7251), _est(7328, 7251)])
    r._last_server["ses-a"] = r.servers[1]
    r.servers[0].mean_request_s = r.servers[1].mean_request_s = 1.0
    r.servers[1].inflight["x"] = __import__("ocache.router", fromlist=["_InFlight"])._InFlight(0, 0.0)
    assert (await r.choose(req("2"))).server.index == 0          # busy: clearly dearer, it moves
    assert r._last_server["ses-a"] is r.servers[0] and isinstance(r.servers[0], Server)


# --------------------------------------------------------------------------------- real servers

@pytest.mark.server
async def test_new_session_goes_to_the_server_holding_its_folder(start_server, tmp_path):
    """Folder B's first session ran on server 2 (server 1 was down: fail-over); server 1 is back.
    A new session in folder B goes to server 2, where its folder's prefix is resident (beyond the
    harness head both servers can get from the shared store), and reuses more than the head."""
    s1, s2 = two_servers(start_server)
    b1 = body(B1)
    hb = session_headers(B1)
    async with through_router(router_config([s1, s2], tmp_path / "cache")) as (base, proxy), \
            aiohttp.ClientSession() as s:
        s1.stop()
        assert await proxy.upstreams[0].probe() == "down"
        first = await send(s, base, proxy, b1, hb)
        assert first["upstream"] == s2.url, first["route"]
        s1.start()
        assert await proxy.upstreams[0].probe() == "ready"
        nb = new_session(b1, "Another question about this project: what does the build do?")
        rec = await send(s, base, proxy, nb, {"x-session-affinity": "ses_new_b"})
        assert rec["upstream"] == s2.url, rec["route"]
        head = proxy.layer.servers[1].layer.table[0].head_len or 0
        assert rec["timings"]["cache_n"] > head > 0, (rec["timings"], head, rec["route"])
        ref = await cold(s1.url, nb)
    assert_exact(ref, rec)


@pytest.mark.server
async def test_busy_servers_second_conversation_goes_to_the_idle_one(start_server, tmp_path):
    """Two conversations live on server 1; while the first generates a long answer, the second's
    next turn is served by the server that is not generating it (server 2, from the shared store,
    when A's turn runs on server 1), exactly. No assertion on a choice made by measured seconds."""
    s1, s2 = two_servers(start_server)
    a1, b1, b2 = body(A1), body(B1), body(B2)
    ha, hb = session_headers(A1), session_headers(B1)
    async with through_router(router_config([s1, s2], tmp_path / "cache")) as (base, proxy), \
            aiohttp.ClientSession() as s:
        r = [await send(s, base, proxy, a1, ha), await send(s, base, proxy, b1, hb)]
        assert [x["upstream"] for x in r] == [s1.url, s1.url], [x["route"] for x in r]
        long = dict(body(A2, max_tokens=4000), stream=True)
        async with s.post(base + CHAT, json=long, headers=ha) as held:
            # where A's turn goes is decided by measured seconds (its slot on server 1, or a restore
            # on server 2 when that is estimated faster on a loaded machine): not asserted
            busy = held.headers["X-OCache-Upstream"]
            await held.content.readline()  # the first event: A's generation is under way there
            rec = await send(s, base, proxy, b2, hb)
        assert rec["upstream"] != busy, rec["route"]      # B's next turn never waits behind A's answer
        if busy == s1.url:                                # B's own server is the busy one
            assert rec["upstream"] == s2.url and "in flight" in rec["route"], rec["route"]
        ref = await cold(s1.url, b2)
    assert_exact(ref, rec)


@pytest.mark.server
@pytest.mark.parametrize("model", ["dense", "hybrid"])
async def test_kill_9_of_one_server_its_conversation_continues_on_the_other(start_server, tmp_path, model):
    """kill -9 of server 1 with a generation in flight: that request fails (no retry); the
    conversation's next turn is served by server 2 from the shared store with cache_n >= the head,
    and its greedy output equals a cold run."""
    s1, s2 = two_servers(start_server, model)
    a1, a2 = body(A1), body(A2)
    ha = session_headers(A1)
    async with through_router(router_config([s1, s2], tmp_path / "cache")) as (base, proxy), \
            aiohttp.ClientSession() as s:
        first = await send(s, base, proxy, a1, ha)
        assert first["upstream"] == s1.url, first["route"]
        head = proxy.layer.servers[0].layer.table[int(first["data"].get("id_slot", 0) or 0)].head_len
        head = head or max(st.head_len for st in proxy.layer.servers[0].layer.table.snapshot())
        assert head > 0
        long = dict(body(A2, max_tokens=4000), stream=True)
        async with s.post(base + CHAT, json=long, headers=ha) as held:
            assert held.headers["X-OCache-Upstream"] == s1.url
            await held.content.readline()
            s1.kill()
            with pytest.raises(aiohttp.ClientPayloadError):
                await held.read()  # cut, not completed (no retry of a generation)
        await proxy.wait_background()
        rec = await send(s, base, proxy, a2, ha)
        assert rec["upstream"] == s2.url, rec["route"]
        assert rec["timings"]["cache_n"] >= head, (rec["timings"], head, rec["tier"])
        ref = await cold(s2.url, a2)
    assert_exact(ref, rec)


@pytest.mark.server
async def test_non_completion_routes_and_stats(start_server, tmp_path):
    """/health, /v1/models go to the first ready server (server 2 while server 1 is down); the
    stats list both servers."""
    s1, s2 = two_servers(start_server)
    async with through_router(router_config([s1, s2], tmp_path / "cache")) as (base, proxy), \
            aiohttp.ClientSession() as s:
        s1.stop()
        assert await proxy.upstreams[0].probe() == "down"
        async with s.get(base + "/v1/models") as r:
            assert r.status == 200
        async with s.get(base + "/health") as r:
            assert r.status == 200
        async with s.get(base + "/v1/cache/stats") as r:
            st = await r.json()
        rows = st["layer"]["router"]["servers"]
        assert [x["url"] for x in rows] == [s1.url, s2.url]
        assert [x["state"] for x in rows] == ["down", "ready"]
        assert [u["url"] for u in st["upstreams"]] == [s1.url, s2.url]
        json.dumps(st)


@pytest.mark.server
async def test_serve_launch_replicas_starts_two_children_behind_the_router(engine_patched, models_tiny, tmp_path):
    """``serve --launch`` with ``launch_replicas: 2``: two children, each on its own port with the
    same --slot-save-path (one store), each its own log; a completion is served by one of them and
    says which (X-OCache-Upstream); the dashboard view has a row per server."""
    from ocache import serving as proxy_mod
    from ocache.dashboard import view
    from ocache.llama.server import free_port

    slots = tmp_path / "slots"
    slots.mkdir()
    args = [str(engine_patched.binary), "-m", str(models_tiny["dense"]), "-np", "2", "-c", "16384",
            "-t", "1", "-ub", "128", "--slot-save-path", str(slots), "--jinja", "-fit", "off"]
    cfg = Config(port=free_port(), launch=args, launch_replicas=2, cache_dir=str(tmp_path / "cache"))
    stop = asyncio.Event()
    got: asyncio.Future = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(proxy_mod.serve(cfg, stop=stop, handle_signals=False,
                                               ready=lambda p, port: got.set_result((p, port))))
    try:
        done, _ = await asyncio.wait({task, got}, timeout=120, return_when=asyncio.FIRST_COMPLETED)
        assert got in done, task.exception() if task.done() else "serve() did not come up"
        proxy, port = got.result()
        assert len(cfg.upstreams) == 2 and cfg.upstreams[0] != cfg.upstreams[1]
        for up in proxy.upstreams:
            assert await up.wait_ready(120), up.to_dict()
        b = body(A1)
        async with aiohttp.ClientSession() as s:
            async with s.post(f"http://127.0.0.1:{port}{CHAT}", json=b, headers=session_headers(A1)) as r:
                assert r.status == 200, await r.text()
                assert r.headers["X-OCache-Upstream"] in cfg.upstreams
            async with s.get(f"http://127.0.0.1:{port}/v1/cache/stats") as r:
                st = await r.json()
        rows = view(st, admin=False)["servers"]
        assert [x["url"] for x in rows] == cfg.upstreams and sum(x["routed"] for x in rows) == 1
        logs = sorted(p.name for p in (tmp_path / "ocache-state").glob("llama-server-*.log"))
        assert logs == ["llama-server-0.log", "llama-server-1.log"], logs
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)


@pytest.mark.server
async def test_a_known_conversations_next_turn_is_routed_without_estimates(start_server, tmp_path):
    """Turn 3 of a conversation one server holds: the router sends it there without asking either
    server for an estimate (each would build its token view first), and that server's layer takes
    the known path; the figures stay exact and so does the greedy output."""
    servers = two_servers(start_server)
    h = session_headers(A1)
    async with through_router(router_config(servers, tmp_path / "cache")) as (base, proxy), \
            aiohttp.ClientSession() as s:
        b = body(A1)
        first = await send(s, base, proxy, b, h)
        for q in ("Now the second question?", "And the third?"):
            b = copy.deepcopy(b)
            b["messages"] += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": q}]
            if q.startswith("And"):
                for srv in proxy.layer.servers:
                    await srv.layer.viewer.wait_verified()
                asked: list[str] = []
                for srv in proxy.layer.servers:
                    real = srv.layer.estimate

                    async def counted(req, _real=real, _url=srv.url):
                        asked.append(_url)
                        return await _real(req)

                    srv.layer.estimate = counted
            async with s.post(base + CHAT, json=b, headers=h) as r:
                data = await r.json()
                assert r.status == 200, data
                rec = {k: r.headers.get(k) for k in ("X-OCache-Upstream", "X-OCache-Route", "X-OCache-Path",
                                                     "X-OCache-Predicted-Cache")}
            await proxy.wait_background()
            await proxy.layer.idle()
        assert asked == [] and rec["X-OCache-Route"].startswith("known"), rec
        assert rec["X-OCache-Upstream"] == first["upstream"] and rec["X-OCache-Path"] == "known"
        assert int(rec["X-OCache-Predicted-Cache"]) == data["timings"]["cache_n"]
        assert proxy.layer.counters["known"] == 1
        ref = await cold(servers[0].url, b)
    assert_exact(ref, {"data": data, "route": rec["X-OCache-Route"]})
