"""``ocache serve`` (ocache/proxy.py): transparency, streaming, disconnects, upstream lifecycle,
fail-open, observation, admin routes.

Integration tests (``@pytest.mark.server``) run the real llama-server (tiny dense model) and compare
what a client gets through the proxy with what it gets directly. A fake upstream (``fake_upstream``)
is used only where the real server cannot produce the condition or report it: echoing the headers
it received (hop-by-hop handling), dying in the middle of a stream, a scripted boot id.
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from ocache.config import Config
from ocache.layer import NullLayer, Plan
from ocache.proxy import RUNNER_KWARGS, Proxy, forward_request_headers, host_name
from ocache.server import free_port
from multidict import CIMultiDict

from conftest import load_fixture


# --------------------------------------------------------------------------------------------------
# helpers
@asynccontextmanager
async def run_proxy(upstream: str, layer=None, **cfg):
    """Start a Proxy in-process on a free loopback port; yields (base_url, proxy)."""
    config = Config(upstream=upstream, **cfg)
    factory = (lambda u, c: layer) if layer is not None else NullLayer
    proxy = Proxy(config, layer_factory=factory)
    server = TestServer(proxy.make_app(), host="127.0.0.1")
    await server.start_server(**RUNNER_KWARGS)
    try:
        yield f"http://127.0.0.1:{server.port}", proxy
    finally:
        await server.close()


@asynccontextmanager
async def client():
    async with aiohttp.ClientSession(auto_decompress=False) as s:
        yield s


async def poll(cond, timeout: float = 5.0, what: str = "condition"):
    """Await ``cond()`` (sync or async) until truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        r = cond()
        if asyncio.iscoroutine(r):
            r = await r
        if r:
            return r
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)  # polling an external condition, not synchronising


class FakeUpstream:
    """An aiohttp app standing in for llama-server where the real one cannot show a condition."""

    def __init__(self):
        self.boot = "1000"
        self.seen: list[dict] = []
        self.stream_started = asyncio.Event()
        self.stream_cancelled = asyncio.Event()
        app = web.Application(client_max_size=1 << 30)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/props", self.props)
        app.router.add_route("*", "/echo{tail:.*}", self.echo)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/die-mid-stream", self.die_mid_stream)
        self.app = app

    async def health(self, request):
        return web.json_response({"status": "ok"})

    async def props(self, request):
        return web.json_response({"build_info": "b1-fake", "total_slots": 1})

    async def metrics(self, request):
        return web.Response(text="llamacpp:requests_processing 0\n",
                            headers={"Process-Start-Time-Unix": self.boot})

    async def echo(self, request):
        body = await request.read()
        self.seen.append({"headers": list(request.headers.items()), "body": body,
                          "path_qs": request.path_qs, "method": request.method})
        headers = CIMultiDict([("Connection", "keep-alive, X-Hop"), ("X-Hop", "1"),
                               ("Keep-Alive", "timeout=5"), ("X-End", "kept")])
        return web.Response(body=body, headers=headers, content_type="application/octet-stream")

    async def chat(self, request):
        body = await request.read()
        self.seen.append({"body": body, "headers": list(request.headers.items())})
        data = json.loads(body)
        if not data.get("stream"):
            return web.json_response({"choices": [{"message": {"content": "hi"}}],
                                      "timings": {"prompt_n": 3, "cache_n": 2, "predicted_n": 1}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        self.stream_started.set()
        try:
            for i in range(1000):
                await resp.write(f'data: {{"i":{i}}}\n\n'.encode())
                await asyncio.sleep(0.01)
        except (asyncio.CancelledError, ConnectionError):
            self.stream_cancelled.set()
            raise
        return resp

    async def die_mid_stream(self, request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"i":0}\n\n')
        request.transport.close()
        return resp


@asynccontextmanager
async def fake_upstream():
    fake = FakeUpstream()
    server = TestServer(fake.app, host="127.0.0.1")
    await server.start_server(auto_decompress=False)
    try:
        yield f"http://127.0.0.1:{server.port}", fake
    finally:
        await server.close()


# --------------------------------------------------------------------------------------------------
# pure helpers
def test_hop_by_hop_request_headers_dropped():
    h = CIMultiDict([("Connection", "keep-alive, X-Secret-Hop"), ("X-Secret-Hop", "1"),
                     ("Keep-Alive", "timeout=5"), ("TE", "trailers"), ("Trailer", "X"),
                     ("Transfer-Encoding", "chunked"), ("Upgrade", "h2c"),
                     ("Proxy-Authorization", "Basic x"), ("Proxy-Foo", "y"), ("Host", "a"),
                     ("Content-Length", "3"), ("Authorization", "Bearer k"),
                     ("X-Session-Id", "s"), ("Accept", "a"), ("Accept", "b")])
    out = forward_request_headers(h)
    assert list(out.items()) == [("Authorization", "Bearer k"), ("X-Session-Id", "s"),
                                 ("Accept", "a"), ("Accept", "b")]


@pytest.mark.parametrize("value, name", [("127.0.0.1:8081", "127.0.0.1"), ("LOCALHOST", "localhost"),
                                         ("[::1]:8081", "[::1]"), ("evil.example", "evil.example"),
                                         ("::1", "::1")])
def test_host_name(value, name):
    assert host_name(value) == name


# --------------------------------------------------------------------------------------------------
# fake upstream: what the real server cannot show
async def test_headers_and_bytes_forwarded_hop_by_hop_stripped():
    async with fake_upstream() as (up, fake), run_proxy(up) as (base, _), client() as c:
        body = b"\x00\xffnot json at all\r\n"
        async with c.post(base + "/echo/a%2Fb?x=1&y=%20", data=body,
                          headers={"Authorization": "Bearer k", "Connection": "X-Drop",
                                   "X-Drop": "1", "Content-Type": "text/weird",
                                   "Content-Encoding": "gzip", "User-Agent": "test-agent/1"}) as r:
            got = await r.read()
            assert r.status == 200
            assert got == body
            assert "X-Hop" not in r.headers and "Keep-Alive" not in r.headers
            assert r.headers["X-End"] == "kept"
            assert r.headers["X-OCache-Request-Id"]
        seen = fake.seen[-1]
        names = [k.lower() for k, _ in seen["headers"]]
        assert seen["path_qs"] == "/echo/a%2Fb?x=1&y=%20"
        assert seen["body"] == body
        assert ("Authorization", "Bearer k") in seen["headers"]
        assert ("Content-Encoding", "gzip") in seen["headers"]
        assert ("Content-Type", "text/weird") in seen["headers"]
        assert "x-drop" not in names
        assert ("User-Agent", "test-agent/1") in seen["headers"]  # the client's, not aiohttp's
        assert names.count("user-agent") == 1


async def test_upstream_dies_mid_stream_truncates_client():
    async with fake_upstream() as (up, fake), run_proxy(up) as (base, _), client() as c:
        async with c.get(base + "/die-mid-stream") as r:
            assert r.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):
                await r.read()


async def test_client_disconnect_cancels_upstream_stream():
    async with fake_upstream() as (up, fake), run_proxy(up) as (base, proxy), client() as c:
        resp = await c.post(base + "/v1/chat/completions", json={"stream": True, "messages": []})
        async for _ in resp.content:  # read a few events
            break
        resp.close()
        await asyncio.wait_for(fake.stream_cancelled.wait(), 2.0)
        await poll(lambda: proxy.stats.to_dict()["client_disconnects"] == 1, what="disconnect count")


class RaisingLayer(NullLayer):
    def __init__(self, stage):
        super().__init__()
        self.stage = stage
        self.observed = []

    async def plan(self, req):
        if self.stage == "plan":
            raise RuntimeError("boom in plan")
        if self.stage == "updates":
            return Plan(body_updates={"bad": object()})
        return Plan(body_updates={"id_slot": 0}, headers={"X-OCache-Tier": "disk"})

    async def observe(self, req, plan, obs):
        self.observed.append(obs)
        if self.stage == "observe":
            raise RuntimeError("boom in observe")


@pytest.mark.parametrize("stage", ["plan", "updates"])
async def test_fail_open_forwards_untouched(stage):
    layer = RaisingLayer(stage)
    async with fake_upstream() as (up, fake), run_proxy(up, layer) as (base, proxy), client() as c:
        raw = b'{"messages": [], "max_tokens": 1,   "x": "\\u00e9"}'
        async with c.post(base + "/v1/chat/completions", data=raw,
                          headers={"Content-Type": "application/json"}) as r:
            assert r.status == 200
            assert r.headers["X-OCache-Fail-Open"] == "plan"
        assert fake.seen[-1]["body"] == raw
        await proxy.wait_background()
        assert proxy.stats.to_dict()["fail_open"] == 1


async def test_plan_updates_applied_and_observed():
    layer = RaisingLayer("observe")
    async with fake_upstream() as (up, fake), run_proxy(up, layer) as (base, proxy), client() as c:
        async with c.post(base + "/v1/chat/completions", json={"messages": [], "n": 1}) as r:
            assert r.status == 200
            assert r.headers["X-OCache-Tier"] == "disk"
        assert json.loads(fake.seen[-1]["body"]) == {"messages": [], "n": 1, "id_slot": 0}
        await proxy.wait_background()
        (obs,) = layer.observed
        assert obs.timings == {"prompt_n": 3, "cache_n": 2, "predicted_n": 1}
        assert obs.content == "hi" and obs.completed and obs.status == 200
        stats = proxy.stats.to_dict()
        assert stats["layer_errors"] == {"observe": 1}
        assert stats["completions"]["/v1/chat/completions"] == {"disk": 1}
        assert stats["tokens"]["cache_n"] == 2


async def test_host_guard_and_admin_routes():
    async with fake_upstream() as (up, fake), run_proxy(up, admin_token="tok") as (base, proxy), \
            client() as c:
        async with c.get(base + "/echo", headers={"Host": "evil.example:8081"}) as r:
            assert r.status == 403
            assert "allowed_hosts" in (await r.json())["error"]["message"]
        async with c.get(base + "/echo", headers={"Host": "localhost:1234"}) as r:
            assert r.status == 200
        async with c.post(base + "/v1/cache/clear") as r:
            assert r.status == 401
        async with c.post(base + "/v1/cache/clear", headers={"Authorization": "Bearer nope"}) as r:
            assert r.status == 401
        async with c.post(base + "/v1/cache/clear?tier=disk",
                          headers={"Authorization": "Bearer tok"}) as r:
            assert r.status == 200 and (await r.json())["tier"] == "disk"
        async with c.get(base + "/v1/cache/metrics") as r:
            text = await r.text()
            assert 'ocache_requests_total{route="other",status="403"} 1.0' in text
            assert "ocache_layer_stat" in text
    async with fake_upstream() as (up, fake), run_proxy(up, allowed_hosts=["*"]) as (base, _), \
            client() as c:
        async with c.get(base + "/echo", headers={"Host": "evil.example"}) as r:
            assert r.status == 200
        async with c.post(base + "/v1/cache/clear", headers={"Authorization": "Bearer x"}) as r:
            assert r.status == 404  # no admin token configured: the route does not exist


async def test_fake_restart_detected_by_boot_id():
    restarts = []

    class L(NullLayer):
        async def on_upstream_restart(self):
            restarts.append(1)

    async with fake_upstream() as (up, fake), run_proxy(up, L()) as (base, proxy):
        assert proxy.upstream.epoch == 1
        fake.boot = "2000"  # a new process reports a new boot id
        await proxy.upstream.probe()
        assert proxy.upstream.epoch == 2 and restarts == [1]
        await proxy.upstream.probe()
        assert proxy.upstream.epoch == 2  # same boot id, same process


async def test_upstream_down_then_up():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    fake = FakeUpstream()
    async with run_proxy(url) as (base, proxy), client() as c:
        async with c.get(base + "/health") as r:
            assert r.status == 503
            assert int(r.headers["Retry-After"]) >= 1
            err = (await r.json())["error"]
            assert url in err["message"] and err["upstream"] == url
        runner = web.AppRunner(fake.app, auto_decompress=False)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        try:
            async with c.get(base + "/health") as r:
                assert r.status == 200
            assert proxy.upstream.epoch == 1 and proxy.upstream.restarts == 0
        finally:
            await runner.cleanup()
