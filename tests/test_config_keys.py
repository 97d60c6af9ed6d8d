"""Every config key that ``ocache serve --help-config`` lists has an effect (ocache/config.py).

``test_help_config_keys_all_probed`` reads the key list from the command itself, so a key added to
``Config`` or ``config.TIER_DOCS`` without a probe here fails. Each probe sets the key to a value other
than its default and checks what the owning code does with it: the proxy's answers (guard, admin
routes, body limit, 503 while the upstream is down), what ``serve()`` binds and launches, the tiers
the factories build (ocache/tiers/disk.py ``make_disk_tier``, ocache/tiers/spill.py
``make_session_tier``) and the cache layer's options (ocache/cache/wiring.py ``layer_options``).
No llama-server is needed: the upstream is a closed loopback port (nothing listens there), and the
tier factories get a slot table stand-in that only carries ``params``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
from contextlib import asynccontextmanager
from operator import attrgetter
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest

from ocache import config as cfg_mod
from ocache import serving as proxy_mod
from ocache.commands import serve as serve_cmd
from ocache.config import Config
from ocache.layer import NullLayer
from ocache.proxy import Proxy
from ocache.llama.server import free_port

from conftest import listening

IDENTITY = "test-identity-0123456789abcdef"


def _closed_upstream() -> str:
    return f"http://127.0.0.1:{free_port()}"  # free = nothing listens: the upstream is down


@asynccontextmanager
async def _proxy(**kw):
    """A Proxy with the NullLayer on a free loopback port; yields (base_url, proxy)."""
    kw.setdefault("upstream", _closed_upstream())
    proxy = Proxy(Config(**kw), layer_factory=NullLayer, monitor=False)
    async with listening(proxy) as base, aiohttp.ClientSession() as c:
        yield base, proxy, c


async def _get(c, url, **kw):
    async with c.get(url, **kw) as r:
        return r.status, dict(r.headers), await r.read()


async def _post(c, url, **kw):
    async with c.post(url, **kw) as r:
        return r.status, dict(r.headers), await r.read()


@asynccontextmanager
async def _serve(config: Config, **kw):
    """``proxy.serve(config)`` in a task until the block ends; yields (proxy, port)."""
    stop = asyncio.Event()
    got: asyncio.Future = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(proxy_mod.serve(config, stop=stop, handle_signals=False,
                                               layer_factory=NullLayer,
                                               ready=lambda p, port: got.set_result((p, port)), **kw))
    try:
        done, _ = await asyncio.wait({task, got}, timeout=20, return_when=asyncio.FIRST_COMPLETED)
        assert got in done, f"serve() did not come up: {task.exception() if task.done() else 'timeout'}"
        yield got.result()
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)


def _slots(save_dir: Path | None, n_ubatch: int = 512):
    """The part of the slot table the tier factories read."""
    return SimpleNamespace(params=SimpleNamespace(slot_save_path=str(save_dir) if save_dir else None,
                                                  n_ubatch=n_ubatch))


def _tier_factory(name: str):
    """The factory of tier ``name``: ``make_disk_tier`` (``disk``) or ``make_session_tier`` (``session``)."""
    if name == "disk":
        from ocache.tiers.disk import make_disk_tier

        return make_disk_tier
    from ocache.tiers.spill import make_session_tier

    return make_session_tier


def _tier(name: str, tmp_path: Path, **kw):
    """Tier ``name`` as ``Config(**kw)`` makes it for a server with a slot-save path (None: off)."""
    save = tmp_path / "slots"
    save.mkdir(exist_ok=True)
    kw.setdefault("cache_dir", str(tmp_path / "state"))
    return _tier_factory(name)(Config(**kw), _slots(save), IDENTITY)


def _disk(tmp_path: Path, **kw):
    return _tier("disk", tmp_path, **kw)


def _session(tmp_path: Path, **kw):
    return _tier("session", tmp_path, **kw)


def _layer(**kw):
    from ocache.cache import OCacheLayer

    return OCacheLayer(SimpleNamespace(epoch=0, session=None, base_url="http://127.0.0.1:1",
                                       props={}), Config(**kw))


# ------------------------------------------------------------------------------------ the probes
# Each probe: async (tmp_path, monkeypatch) -> None; it asserts a difference the key makes.

async def p_host(tmp_path, mp):
    # the bound host's name passes the Host guard (a name nobody listed gets 403) ...
    async with _proxy(host="127.0.0.2") as (base, _, c):
        assert (await _get(c, base + "/health", headers={"Host": "127.0.0.2"}))[0] != 403
    async with _proxy() as (base, _, c):
        assert (await _get(c, base + "/health", headers={"Host": "127.0.0.2"}))[0] == 403
    # ... and serve() listens on it (127.0.0.2 is loopback on Linux, a different address)
    port = free_port()
    async with _serve(Config(host="127.0.0.2", port=port, upstream=_closed_upstream())):
        async with aiohttp.ClientSession() as c:
            assert (await _get(c, f"http://127.0.0.2:{port}/health"))[0] == 503
            with pytest.raises(aiohttp.ClientConnectionError):
                await _get(c, f"http://127.0.0.1:{port}/health")


async def p_port(tmp_path, mp):
    port = free_port()
    async with _serve(Config(port=port, upstream=_closed_upstream())) as (_, bound):
        assert bound == port
        async with aiohttp.ClientSession() as c:
            assert (await _get(c, f"http://127.0.0.1:{port}/health"))[0] == 503


async def p_upstream(tmp_path, mp):
    up = _closed_upstream()
    async with _proxy(upstream=up) as (base, proxy, c):
        status, headers, _ = await _get(c, base + "/health")
        assert proxy.upstream.base_url == up
        assert status in (502, 503) and headers["X-OCache-Upstream"].startswith(up)


async def p_upstream_api_key(tmp_path, mp):
    async with _proxy(upstream_api_key="sekret") as (_, proxy, _c):
        assert proxy.upstream.auth_headers() == {"Authorization": "Bearer sekret"}
    async with _proxy() as (_, proxy, _c):
        assert proxy.upstream.auth_headers() == {}


async def p_admin_token(tmp_path, mp):
    async with _proxy() as (base, _, c):
        assert (await _post(c, base + "/v1/cache/clear"))[0] == 404
    async with _proxy(admin_token="tok") as (base, _, c):
        assert (await _post(c, base + "/v1/cache/clear"))[0] == 401


async def p_allowed_hosts(tmp_path, mp):
    async with _proxy() as (base, _, c):
        assert (await _get(c, base + "/health", headers={"Host": "box.lan"}))[0] == 403
    async with _proxy(allowed_hosts=["box.lan"]) as (base, _, c):
        assert (await _get(c, base + "/health", headers={"Host": "box.lan"}))[0] != 403


async def p_cache_dir(tmp_path, mp):
    from ocache.tiers.disk import store_meta_dir

    assert store_meta_dir(Config(cache_dir=str(tmp_path / "mine"))) == tmp_path / "mine" / "store"
    assert store_meta_dir(Config()) != tmp_path / "mine" / "store"
    tier = _disk(tmp_path, cache_dir=str(tmp_path / "mine"))
    assert tier is not None and Path(tier.store.meta_dir).resolve() == (tmp_path / "mine" / "store").resolve()


async def p_log_level(tmp_path, mp):
    seen = []

    async def fake_serve(config, **kw):
        seen.append(logging.getLogger().level)

    mp.setattr(serve_cmd, "serve", fake_serve)
    (tmp_path / "ocache.yaml").write_text("log_level: error\n")
    mp.chdir(tmp_path)
    root = logging.getLogger()
    old = root.level
    try:
        args = _serve_args()
        assert await asyncio.to_thread(serve_cmd._cmd_serve, args) == 0
        (tmp_path / "ocache.yaml").write_text("log_level: debug\n")
        assert await asyncio.to_thread(serve_cmd._cmd_serve, args) == 0
    finally:
        root.setLevel(old)
    assert seen == [logging.ERROR, logging.DEBUG]


def _serve_args():
    import argparse

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd")
    serve_cmd.register(sub)
    return parser.parse_args(["serve"])


async def p_max_body_mb(tmp_path, mp):
    body = b"x" * 4096
    async with _proxy(max_body_mb=0.001) as (base, proxy, c):
        for path in ("/v1/chat/completions", "/v1/messages", "/v1/responses"):
            status, headers, raw = await _post(c, base + path, data=body)
            assert status == 413
            # ocache's own answer, in the one error shape (README "Bad input"), counted
            assert json.loads(raw)["error"]["code"] == 413, raw
            assert headers.get("X-OCache-Request-Id"), headers
            assert proxy.stats.to_dict()["requests"][path]["413"] == 1
    async with _proxy() as (base, _, c):
        assert (await _post(c, base + "/v1/chat/completions", data=body))[0] != 413


async def p_retry_after_s(tmp_path, mp):
    async with _proxy(retry_after_s=7) as (base, proxy, c):
        proxy.upstream.state = "down"
        status, headers, _ = await _get(c, base + "/health")
        assert status == 503 and headers["Retry-After"] == "7"


async def p_probe_interval_s(tmp_path, mp):
    async with _proxy(probe_interval_s=0.5) as (_, proxy, _c):
        assert proxy.upstream.probe_interval_s == 0.5


async def p_drain_timeout_s(tmp_path, mp):
    seen = []

    async def drain(self, timeout):
        seen.append(timeout)
        return True

    mp.setattr(Proxy, "drain", drain)
    async with _serve(Config(port=free_port(), upstream=_closed_upstream(), drain_timeout_s=3.5)):
        pass
    assert seen == [3.5]


async def p_no_cache(tmp_path, mp):
    assert Proxy(Config(no_cache=True))._layer_factory is NullLayer
    assert Proxy(Config())._layer_factory is not NullLayer


async def p_record_dir(tmp_path, mp):
    async with _proxy(record_dir=str(tmp_path / "rec")) as (_, proxy, _c):
        assert proxy.recorder is not None
    async with _proxy() as (_, proxy, _c):
        assert proxy.recorder is None


async def p_record_redact(tmp_path, mp):
    async with _proxy(record_dir=str(tmp_path / "a"), record_redact=True) as (_, proxy, _c):
        assert proxy.recorder.redact is True
    async with _proxy(record_dir=str(tmp_path / "b")) as (_, proxy, _c):
        assert proxy.recorder.redact is False


class _Launched(Exception):
    pass


def _capture_supervisor(mp, seen):
    from ocache import supervisor

    class Fake:
        def __init__(self, args, binary=None, log_path=None, max_quick_failures=None, backend="cpu", **kw):
            seen.append((list(args), binary) if backend == "cpu" else (list(args), binary, backend))
            if max_quick_failures is not None:
                seen_failures.append(max_quick_failures)
            raise _Launched()

    seen_failures = mp.seen_failures = []

    mp.setattr(supervisor, "Supervisor", Fake)


async def _launched(mp, **kw) -> list:
    """``serve`` of ``launch: [-m, x.gguf]`` and ``kw`` up to the supervisor's start (faked):
    what the supervisor was made with, as ``_capture_supervisor`` notes it."""
    seen: list = []
    _capture_supervisor(mp, seen)
    with pytest.raises(_Launched):
        await proxy_mod.serve(Config(launch=["-m", "x.gguf"], **kw), handle_signals=False)
    return seen


async def p_launch(tmp_path, mp):
    assert await _launched(mp) == [(["-m", "x.gguf"], None)]


async def p_launch_binary(tmp_path, mp):
    assert await _launched(mp, launch_binary="/opt/ls") == [(["-m", "x.gguf"], "/opt/ls")]


async def p_launch_max_failures(tmp_path, mp):
    await _launched(mp, launch_max_failures=2)
    assert mp.seen_failures == [2]


def _timeouts(**kw):
    from ocache.proxy import ParsedRequest  # noqa: F401  (the type the proxy passes)

    proxy = Proxy(Config(upstream=_closed_upstream(), **kw), layer_factory=NullLayer, monitor=False)
    streamed = type("P", (), {"stream": True})()
    plain = type("P", (), {"stream": False})()
    return (proxy._read_timeout("/health", None).sock_read,
            proxy._read_timeout("/v1/chat/completions", streamed).sock_read,
            proxy._read_timeout("/v1/chat/completions", plain).sock_read)


async def p_upstream_read_timeout_s(tmp_path, mp):
    assert _timeouts(upstream_read_timeout_s=12.5)[2] == 12.5


async def p_stream_idle_timeout_s(tmp_path, mp):
    assert _timeouts(stream_idle_timeout_s=9.5)[1] == 9.5


async def p_probe_timeout_s(tmp_path, mp):
    assert _timeouts(probe_timeout_s=1.5)[0] == 1.5
    async with _proxy(probe_timeout_s=1.5) as (_, proxy, _c):
        assert proxy.upstream.probe_timeout_s == 1.5


async def p_hung_probes(tmp_path, mp):
    """The behaviour: tests/test_hung.py (one missed probe does not end a generation)."""
    async with _proxy(hung_probes=4) as (_, proxy, _c):
        assert proxy.upstream.hung_probes == 4


async def p_loading_wait_s(tmp_path, mp):
    """A request while the upstream loads its model waits for it at most ``loading_wait_s``."""
    waits = []

    async with _proxy(loading_wait_s=0.2) as (base, proxy, c):
        async def wait_ready(timeout):
            waits.append(timeout)
            return False

        async def check(bound):
            return "loading"

        mp.setattr(proxy.upstream, "wait_ready", wait_ready)
        mp.setattr(proxy.upstream, "check", check)
        proxy.upstream.state = "loading"
        await _get(c, base + "/v1/models")
    assert waits and waits[0] == 0.2


async def p_client_idle_timeout_s(tmp_path, mp):
    """A body that stalls longer than ``client_idle_timeout_s`` gets 408."""
    async with _proxy(client_idle_timeout_s=0.3) as (base, proxy, c):
        async def slow():
            yield b'{"messages": ['
            await asyncio.sleep(2)   # the stall under test (longer than the 0.3 s bound)
            yield b']}'

        async with c.post(base + "/v1/chat/completions", data=slow(),
                          headers={"Content-Type": "application/json"}) as r:
            assert r.status == 408


async def p_client_keepalive_s(tmp_path, mp):
    seen = {}
    real = proxy_mod.web.AppRunner

    class Runner(real):
        def __init__(self, app, **kw):
            seen.update(kw)
            super().__init__(app, **kw)

    mp.setattr(proxy_mod.web, "AppRunner", Runner)
    async with _serve(Config(port=free_port(), upstream=_closed_upstream(), client_keepalive_s=3.5)):
        pass
    assert seen["keepalive_timeout"] == 3.5


async def p_head_budget_gb(tmp_path, mp):
    """``tiers.head.budget_gb`` is the head store's byte budget (0: no head files)."""
    import types

    from ocache.tiers import head, store

    seen = []
    mp.setattr(store, "shared_store", lambda *a, **kw: seen.append(kw["kind_budget_bytes"]) or
               types.SimpleNamespace(identity="id"))
    slots = tmp_path / "slots"
    slots.mkdir()
    for gb, want in ((2, [2 * 10**9]), (0, [])):
        seen.clear()
        tier = head.HeadTier(None)
        config = Config(cache_dir=str(tmp_path / "state"),
                        tiers={"head": {"budget_gb": gb}, "session": {"slot_save_path": str(slots)}})
        head.open_head_store(tier, config, None, "k")
        assert seen == want


async def p_launch_backend(tmp_path, mp):
    assert await _launched(mp, launch_backend="cuda") == [(["-m", "x.gguf"], None, "cuda")]


async def p_disk_budget_gb(tmp_path, mp):
    tier = _disk(tmp_path, disk_budget_gb=3)
    assert tier.store.kind_budgets["a"] == 3 * 10**9


async def p_disk_ttl_days(tmp_path, mp):
    assert _disk(tmp_path, disk_ttl_days=2).store.ttl_s == 2 * 86400


async def p_disk_min_tokens(tmp_path, mp):
    assert _disk(tmp_path, disk_min_tokens=777).cfg.min_tokens == 777


async def p_spill_budget_gb(tmp_path, mp):
    from ocache.tiers.spill import KIND

    assert _session(tmp_path, spill_budget_gb=0) is None
    assert _session(tmp_path, spill_budget_gb=2).store.kind_budgets[KIND] == 2 * 10**9


async def p_spill_min_tokens(tmp_path, mp):
    assert _session(tmp_path, spill_min_tokens=99).cfg.min_tokens == 99


async def p_volatile_markers(tmp_path, mp):
    assert _layer(volatile_markers=["@@"]).markers == ["@@"]
    assert _layer().markers != ["@@"]


async def p_tiers(tmp_path, mp):
    # tiers is a mapping of the keys below; anything else is refused
    with pytest.raises(cfg_mod.ConfigError):
        cfg_mod.check_tiers({"disk": {"enabld": False}})


async def p_resident_server_args(tmp_path, mp):
    assert _layer(tiers={"resident": {"server_args": ["-np", "3"]}}).argv == ["-np", "3"]
    assert _layer(launch=["-np", "2"]).argv == ["-np", "2"]


def p_resident_switch(key: str, attr: str):
    """The probe of the switch ``tiers.resident.<key>`` (on by default): the layer's ``attr``
    (a dotted path) is False when it is off, True when it is not set."""
    read = attrgetter(attr)

    async def probe(tmp_path, mp):
        assert read(_layer(tiers={"resident": {key: False}})) is False
        assert read(_layer()) is True
    return probe


async def p_resident_server_params(tmp_path, mp):
    from ocache.llama.flags import params_from_argv

    layer = _layer(tiers={"resident": {"n_ubatch": 256}})
    assert layer.param_overrides == {"n_ubatch": 256}
    assert params_from_argv(None, {}, [], **layer.param_overrides).n_ubatch == 256


def p_tier_enabled(name: str):
    """The probe of ``tiers.<name>.enabled``: the tier is made unless it is false."""
    async def probe(tmp_path, mp):
        assert _tier(name, tmp_path) is not None
        assert _tier(name, tmp_path, tiers={name: {"enabled": False}}) is None
    return probe


def p_tier_slot_save_path(name: str):
    """The probe of ``tiers.<name>.slot_save_path``: the tier's files go there, also when the
    server names no slot-save path; without either there is no tier."""
    async def probe(tmp_path, mp):
        make = _tier_factory(name)
        other = tmp_path / "other"
        other.mkdir()
        c = Config(cache_dir=str(tmp_path / "state"), tiers={name: {"slot_save_path": str(other)}})
        tier = make(c, _slots(None), IDENTITY)
        assert tier is not None and Path(tier.store.data_dir) == other
        assert make(Config(cache_dir=str(tmp_path / "s2")), _slots(None), IDENTITY) is None
    return probe


async def p_disk_grid(tmp_path, mp):
    assert _disk(tmp_path, tiers={"disk": {"grid": 256}}).cfg.grid == 256


async def p_disk_free_floor_gb(tmp_path, mp):
    assert _disk(tmp_path, tiers={"disk": {"free_floor_gb": 1.5}}).store.free_floor_bytes == 1.5e9


async def p_disk_admit_after(tmp_path, mp):
    assert _disk(tmp_path, tiers={"disk": {"admit_after": 5}}).cfg.admit_after == 5


async def p_session_drain_min_tokens(tmp_path, mp):
    assert _session(tmp_path, tiers={"session": {"drain_min_tokens": 10}}).cfg.drain_min_tokens == 10


async def p_session_guest_min_tokens(tmp_path, mp):
    tier = _session(tmp_path, tiers={"session": {"guest_min_tokens": 600}})
    assert tier.cfg.guest_min_tokens == 600 and tier.cfg.min_tokens == 256


async def p_session_resume(tmp_path, mp):
    assert _session(tmp_path, tiers={"session": {"resume": False}}).cfg.resume is False


async def _built_session(tmp_path: Path, **session):
    """The session tier as the layer gets ready (``BuiltTiers.ready``: live saves enabled or not)."""
    from ocache.cache.wiring import BuiltTiers

    save = tmp_path / "slots"
    save.mkdir(parents=True, exist_ok=True)
    built = BuiltTiers([])
    await built.ready(Config(cache_dir=str(tmp_path / "state"), tiers={"session": session}), _slots(save),
                      lambda: IDENTITY, no_save=True, prefill_tps_of=lambda: None,
                      upstream=SimpleNamespace(generating=0))
    return built.session


async def p_session_live_save(tmp_path, mp):
    # default "remote": off without store.remote; true: on without it; false: off
    assert (await _built_session(tmp_path)).live.enabled is False
    assert (await _built_session(tmp_path / "on", live_save=True)).live.enabled is True
    assert (await _built_session(tmp_path / "off", live_save=False)).live.enabled is False
    with pytest.raises(cfg_mod.ConfigError, match="live_save"):
        cfg_mod.check_tiers({"session": {"live_save": "sometimes"}})


async def p_session_live_save_quiet_s(tmp_path, mp):
    assert _session(tmp_path, tiers={"session": {"live_save_quiet_s": 7.5}}).live.quiet_s == 7.5


async def p_upstreams(tmp_path, mp):
    """Several upstreams: one Upstream each and the Router over them; /health goes to the first
    ready one (none is: 503 naming the first)."""
    from ocache.router import Router

    ups = [_closed_upstream(), _closed_upstream()]
    async with _proxy(upstreams=ups) as (base, proxy, c):
        assert [u.base_url for u in proxy.upstreams] == ups
        assert isinstance(proxy.layer, Router) and len(proxy.layer.servers) == 2
        status, headers, _ = await _get(c, base + "/health")
        assert status == 503 and headers["X-OCache-Upstream"] == ups[0]
    async with _proxy() as (_, proxy, _c):
        assert len(proxy.upstreams) == 1 and not isinstance(proxy.layer, Router)


def _router(**kw):
    from ocache.router import Router

    ups = [SimpleNamespace(base_url=f"http://127.0.0.1:{i}", state="ready") for i in (1, 2)]
    return Router(ups, Config(**kw), lambda u, c: SimpleNamespace(estimate=None))


async def p_route_policy(tmp_path, mp):
    assert _router(route_policy="round_robin").policy == "round_robin"
    assert _router().policy == "prefix"
    r = _router(route_policy="round_robin")
    picks = [(await r.choose(SimpleNamespace(request_id="x"))).server.index for _ in range(4)]
    assert picks == [0, 1, 0, 1]


async def p_route_load_weight(tmp_path, mp):
    from ocache.cache import Estimate
    from ocache.router import Server, _InFlight, cost_s

    est = Estimate(n_tokens=100, usable=0, tier="cold", slot=0, busy=False, destroys=0, restore_s=0.0,
                   kind="agent", own_session=False, head_len=0, prefill_tps=None)
    busy = Server(0, None, None, mean_request_s=2.0)
    busy.inflight["r"] = _InFlight(0, 0.0)
    w = _router(route_load_weight=3.0).load_weight
    assert w == 3.0 and _router().load_weight == 0.5
    assert cost_s(est, busy, 100.0, w) == 1.0 + 3.0 * 2.0


def _fake_supervisors(mp) -> list:
    """Supervisor stand-ins that record each child's ``env`` and stop ``serve()`` at the first start."""
    from ocache import supervisor

    made: list = []

    class Fake:
        def __init__(self, args, **kw):
            self.url = f"http://127.0.0.1:{9000 + len(made)}"
            self.failed = None
            made.append(kw.get("env"))

        async def start(self):
            raise _Launched()

        async def stop(self):
            return None

    mp.setattr(supervisor, "Supervisor", Fake)
    return made


async def p_launch_replicas(tmp_path, mp):
    from ocache import supervisor

    made = _fake_supervisors(mp)
    cfg = Config(launch=["-m", "x.gguf"], launch_replicas=3)
    with pytest.raises(_Launched):
        await proxy_mod.serve(cfg, handle_signals=False)
    assert len(made) == 3 and cfg.upstreams == [f"http://127.0.0.1:{9000 + i}" for i in range(3)]
    made.clear()
    cfg = Config(launch=["-m", "x.gguf"])
    with pytest.raises(_Launched):
        await proxy_mod.serve(cfg, handle_signals=False)
    assert len(made) == 1 and cfg.upstreams == []
    with pytest.raises(supervisor.LaunchError, match="--port"):
        await proxy_mod.serve(Config(launch=["-m", "x.gguf", "--port", "1"], launch_replicas=2),
                              handle_signals=False)


async def p_launch_devices(tmp_path, mp):
    from ocache import supervisor

    real = supervisor.Supervisor
    made = _fake_supervisors(mp)
    with pytest.raises(_Launched):
        await proxy_mod.serve(Config(launch=["-m", "x.gguf"], launch_replicas=2,
                                     launch_devices=["0", "1"]), handle_signals=False)
    assert made == [{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}]
    made.clear()
    with pytest.raises(_Launched):
        await proxy_mod.serve(Config(launch=["-m", "x.gguf"], launch_replicas=2), handle_signals=False)
    assert made == [None, None]
    # the real supervisor starts its child with that variable set
    out = tmp_path / "env.txt"
    script = tmp_path / "child.sh"
    script.write_text(f'#!/bin/sh\necho "$CUDA_VISIBLE_DEVICES" > {out}\n')
    script.chmod(0o755)
    sup = real([], binary=str(script), env={"CUDA_VISIBLE_DEVICES": "1"})
    await sup._spawn()
    await sup.proc.wait()
    assert out.read_text().strip() == "1"


async def p_response_cache(tmp_path, mp):
    on = Proxy(Config(upstream=_closed_upstream(), response_cache={"enabled": True, "ttl_s": 5,
                                                                    "max_mb": 1}),
               layer_factory=NullLayer, monitor=False).responses
    assert on is not None and (on.ttl_s, on.max_bytes) == (5.0, 1 << 20)
    assert Proxy(Config(upstream=_closed_upstream()), layer_factory=NullLayer, monitor=False).responses is None


async def p_store(tmp_path, mp):
    from ocache.cache import wiring
    from ocache.tiers import remote_bucket
    from ocache.tiers.remote import RemoteTier
    from ocache.tiers.store import Store

    async def no_bucket(self):   # nothing listens at the endpoint: the tier is built, not used
        return None

    mp.setattr(remote_bucket.RemoteBucket, "refresh", no_bucket)
    mp.setenv("AWS_ACCESS_KEY_ID", "k")
    mp.setenv("AWS_SECRET_ACCESS_KEY", "s")
    store = Store(tmp_path / "meta", tmp_path / "slots", IDENTITY)
    store.open()
    tiers = [SimpleNamespace(name="disk", store=store)]
    table = SimpleNamespace(params=None)
    assert await wiring.build_remote_tier(Config(), table, tiers) is None
    cfg = Config(store={"remote": {"url": "s3://bkt/pre", "endpoint_url": _closed_upstream(), "max_gb": 2}})
    tier = await wiring.build_remote_tier(cfg, table, tiers)
    try:
        assert isinstance(tier, RemoteTier) and tier.bucket.budget_bytes == 2 * 10**9
        assert tier.bucket.host_max_bytes == 2 * 10**9 and tier.bucket.ttl_s == 0
        assert tier.bucket.objects.location.prefix == "pre/"
    finally:
        await tier.close()
    cfg = Config(store={"remote": {"url": "s3://bkt/pre", "endpoint_url": _closed_upstream(), "max_gb": 2,
                                   "budget_gb": 50, "ttl_s": 86400, "policy": "replace"}})
    tier = await wiring.build_remote_tier(cfg, table, tiers)
    try:   # the bucket-wide policy this host proposes (and replaces), its own uploads' bound
        assert (tier.bucket.proposed.budget_bytes, tier.bucket.proposed.ttl_s) == (50 * 10**9, 86400.0)
        assert tier.bucket.host_max_bytes == 2 * 10**9 and tier.bucket._replace is True
    finally:
        await tier.close()
    for bad in ({"policy": "overwrite"}, {"ttl_s": -1}, {"budget_gb": 0}):
        with pytest.raises(cfg_mod.ConfigError, match=f"store.remote.{next(iter(bad))}"):
            cfg_mod.check_store({"remote": {"url": "s3://bkt", **bad}})
    with pytest.raises(cfg_mod.ConfigError, match="store.remote: unknown key"):
        cfg_mod.check_store({"remote": {"url": "s3://bkt", "bucket": "x"}})


async def p_view_timeout_s(tmp_path, mp):
    from test_view_bound import first_request

    _status, headers, _body, _fake, bound = await first_request(view_timeout_s=0.2)
    assert bound == 0.2 and headers.get("X-OCache-Fail-Open") == "plan"


async def p_view_slack_s(tmp_path, mp):
    from test_view_bound import first_request

    _status, headers, _body, _fake, bound = await first_request(view_slack_s=0.2, view_timeout_s=30)
    assert bound == 30 and headers.get("X-OCache-Fail-Open") == "plan"


PROBES = {
    "host": p_host, "port": p_port, "upstream": p_upstream, "upstream_api_key": p_upstream_api_key,
    "admin_token": p_admin_token, "allowed_hosts": p_allowed_hosts, "cache_dir": p_cache_dir,
    "log_level": p_log_level, "max_body_mb": p_max_body_mb, "retry_after_s": p_retry_after_s,
    "probe_interval_s": p_probe_interval_s, "drain_timeout_s": p_drain_timeout_s,
    "no_cache": p_no_cache, "record_dir": p_record_dir, "record_redact": p_record_redact,
    "launch": p_launch, "launch_binary": p_launch_binary, "launch_backend": p_launch_backend,
    "launch_max_failures": p_launch_max_failures, "upstream_read_timeout_s": p_upstream_read_timeout_s,
    "stream_idle_timeout_s": p_stream_idle_timeout_s, "probe_timeout_s": p_probe_timeout_s,
    "hung_probes": p_hung_probes, "view_timeout_s": p_view_timeout_s,
    "view_slack_s": p_view_slack_s,
    "loading_wait_s": p_loading_wait_s, "client_idle_timeout_s": p_client_idle_timeout_s,
    "client_keepalive_s": p_client_keepalive_s, "disk_budget_gb": p_disk_budget_gb,
    "disk_ttl_days": p_disk_ttl_days, "disk_min_tokens": p_disk_min_tokens,
    "spill_budget_gb": p_spill_budget_gb, "spill_min_tokens": p_spill_min_tokens,
    "volatile_markers": p_volatile_markers, "tiers": p_tiers,
    "tiers.resident.server_args": p_resident_server_args,
    "tiers.resident.warm": p_resident_switch("warm", "opt_warm"),
    "tiers.resident.keep_origin": p_resident_switch("keep_origin", "opt_keep_origin"),
    "tiers.resident.reconcile": p_resident_switch("reconcile", "opt_reconcile"),
    "tiers.resident.known": p_resident_switch("known", "opt_known"),
    "tiers.resident.align": p_resident_switch("align", "align.on"),
    "tiers.resident.continue_compaction": p_resident_switch("continue_compaction", "continued.on"),
    "tiers.resident.<ServerParams.field>": p_resident_server_params,
    "tiers.disk.enabled": p_tier_enabled("disk"),
    "tiers.disk.slot_save_path": p_tier_slot_save_path("disk"),
    "tiers.disk.grid": p_disk_grid, "tiers.disk.free_floor_gb": p_disk_free_floor_gb,
    "tiers.disk.admit_after": p_disk_admit_after, "tiers.head.budget_gb": p_head_budget_gb, "tiers.session.enabled": p_tier_enabled("session"),
    "tiers.session.slot_save_path": p_tier_slot_save_path("session"),
    "tiers.session.drain_min_tokens": p_session_drain_min_tokens,
    "tiers.session.guest_min_tokens": p_session_guest_min_tokens,
    "tiers.session.resume": p_session_resume,
    "tiers.session.live_save": p_session_live_save,
    "tiers.session.live_save_quiet_s": p_session_live_save_quiet_s,
    "upstreams": p_upstreams, "route_policy": p_route_policy, "route_load_weight": p_route_load_weight,
    "launch_replicas": p_launch_replicas, "launch_devices": p_launch_devices,
    "response_cache": p_response_cache, "store": p_store,
}


def _help_config_keys() -> list[str]:
    out = subprocess.run([sys.executable, "-m", "ocache", "serve", "--help-config"], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    return [line.split()[0] for line in out.splitlines() if line and not line[0].isspace()]


def test_help_config_keys_all_probed():
    keys = _help_config_keys()
    assert "tiers.disk.enabled" in keys and "n_parallel" not in keys
    assert sorted(keys) == sorted(PROBES)


@pytest.mark.parametrize("key", sorted(PROBES))
async def test_config_key_has_an_effect(key, tmp_path, monkeypatch):
    from ocache.tiers import store

    monkeypatch.setattr(store, "_SHARED", {})  # each probe opens its own store
    await PROBES[key](tmp_path, monkeypatch)


@pytest.mark.parametrize("where", ["yaml", "env", "cli"])
def test_removed_key_is_a_clear_error(tmp_path, where):
    f = tmp_path / "ocache.yaml"
    f.write_text("n_parallel: 2\n" if where == "yaml" else "")
    with pytest.raises(cfg_mod.ConfigError, match="n_parallel.*removed.*-np"):
        cfg_mod.load(f, env={"OCACHE_N_PARALLEL": "2"} if where == "env" else {},
                     overrides={"n_parallel": 2} if where == "cli" else None)


def test_the_known_routes_former_key_is_still_read_with_a_warning(caplog):
    """``tiers.resident.fast_path``, the known route's former name, is accepted and read as
    ``tiers.resident.known`` (a warning says so); given both, ``known`` is read."""
    from ocache.config import check_tiers

    with caplog.at_level(logging.WARNING, logger="ocache.config"):
        check_tiers({"resident": {"fast_path": False}})
    assert "tiers.resident.fast_path is deprecated" in caplog.text
    assert _layer(tiers={"resident": {"fast_path": False}}).opt_known is False
    assert _layer(tiers={"resident": {"fast_path": False, "known": True}}).opt_known is True


def test_a_bad_align_value_is_a_config_error_of_serve(tmp_path, capsys):
    """``tiers.resident.align: maybe`` stops ``ocache serve`` with a config error (exit 2) before
    anything starts, as every other bad value does (it raised from inside the layer before:
    a traceback and an unclosed session); the three values and their spellings are accepted."""
    from ocache.cli import main

    for ok in (True, False, "exact", "splice", "off"):
        cfg_mod.check_tiers({"resident": {"align": ok}})
    f = tmp_path / "ocache.yaml"
    f.write_text("tiers:\n  resident:\n    align: maybe\n")
    assert main(["serve", "--config", str(f), "--upstream", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert "config error: tiers.resident.align: 'maybe' is not one of true, false, exact" in err
    assert "Traceback" not in err


def test_a_near_miss_of_a_config_env_variable_is_warned_and_others_stay_quiet(caplog):
    """``OCACHE_ADMIN_TOKN`` was ignored without a word (the admin routes then answer 404); the
    variables other tools share the prefix with (``OCACHE_SHARED``, ``OCACHE_URL``) stay quiet."""
    caplog.set_level("WARNING", logger="ocache.config")
    cfg = cfg_mod.load(None, env={"OCACHE_ADMIN_TOKN": "x", "OCACHE_SHARED": "/s", "OCACHE_URL": "http://h"})
    assert cfg.admin_token is None
    said = [r.getMessage() for r in caplog.records]
    assert said == ["env OCACHE_ADMIN_TOKN is not a config key (ignored): did you mean OCACHE_ADMIN_TOKEN?"], said


def test_replicas_without_launch_is_a_config_error(capsys):
    """``--replicas 2`` without ``--launch`` started nothing and said nothing."""
    from ocache.cli import main

    assert main(["serve", "--replicas", "2", "--upstream", "http://127.0.0.1:9"]) == 2
    assert "--replicas starts llama-server children: it needs --launch" in capsys.readouterr().err
