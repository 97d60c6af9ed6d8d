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
import os
import re
import signal
import time
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from ocache.config import Config
from ocache.api.figures import Figures
from ocache.layer import NullLayer, Plan
from ocache.proxy import Proxy, forward_request_headers, host_name
from ocache.llama.server import free_port
from multidict import CIMultiDict

from conftest import end_serve, listening, load_fixture, serve_in_task


# --------------------------------------------------------------------------------------------------
# helpers
@asynccontextmanager
async def run_proxy(upstream: str, layer=None, **cfg):
    """Start a Proxy in-process on a free loopback port; yields (base_url, proxy)."""
    config = Config(upstream=upstream, **cfg)
    factory = (lambda u, c: layer) if layer is not None else NullLayer
    proxy = Proxy(config, layer_factory=factory)
    async with listening(proxy) as base:
        yield base, proxy


@asynccontextmanager
async def client():
    async with aiohttp.ClientSession(auto_decompress=False) as s:
        yield s


async def stream_with_stop(c: aiohttp.ClientSession, base: str, body: dict, stop: asyncio.Event) -> float:
    """Stream ``body``, ask for a planned stop (``stop.set()``) at its third event, and check the
    stream still ends with ``[DONE]`` (the stop lets it finish). Returns the monotonic time of the stop."""
    t_stop = 0.0
    async with c.post(base + "/v1/chat/completions", json=body) as r:
        assert r.status == 200
        n, last = 0, b""
        async for line in r.content:
            if line.startswith(b"data: "):
                n += 1
                if n == 3:
                    t_stop = time.monotonic()
                    stop.set()  # planned stop while this stream is in flight
                last = line
        assert last.strip() == b"data: [DONE]"
    return t_stop


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
        self.loading = False
        self.seen: list[dict] = []
        self.stream_started = asyncio.Event()
        self.stream_cancelled = asyncio.Event()
        self.release = asyncio.Event()
        self.before_token = lambda: None
        app = web.Application(client_max_size=1 << 30)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/props", self.props)
        app.router.add_route("*", "/echo{tail:.*}", self.echo)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/die-mid-stream", self.die_mid_stream)
        app.router.add_get("/die-mid-body", self.die_mid_body)
        self.app = app

    LOADING = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}

    async def health(self, request):
        if self.loading:
            return web.json_response(self.LOADING, status=503)
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
        if self.loading:
            return web.json_response(self.LOADING, status=503)
        body = await request.read()
        self.seen.append({"body": body, "headers": list(request.headers.items())})
        data = json.loads(body)
        if not data.get("stream"):
            return web.json_response({"choices": [{"message": {"content": "hi"}}],
                                      "timings": {"prompt_n": 3, "cache_n": 2, "predicted_n": 1}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        self.stream_started.set()
        if data.get("ping_first"):  # llama-server's keep-alive comment during a long prefill
            await resp.write(b":\n\n")
            await asyncio.wait_for(self.release.wait(), 5.0)
            self.before_token()
            await resp.write(b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n')
            await resp.write(b'data: {"choices":[],"timings":{"prompt_n":3,"cache_n":0}}\n\n')
            await resp.write(b"data: [DONE]\n\n")
            return resp
        try:
            for i in range(1000):
                await resp.write(f'data: {{"i":{i}}}\n\n'.encode())
                await asyncio.sleep(0.01)
        except (asyncio.CancelledError, ConnectionError):
            self.stream_cancelled.set()
            raise
        return resp

    async def die_mid_body(self, request):
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.content_length = 1000
        await resp.prepare(request)
        await resp.write(b'{"choices": [')
        request.transport.close()
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


async def test_large_body_forwarded_intact():
    async with fake_upstream() as (up, fake), run_proxy(up) as (base, _), client() as c:
        body = bytes(range(256)) * (32 << 10)  # 8 MiB, a long prompt's size
        async with c.put(base + "/echo", data=body) as r:
            assert r.status == 200 and await r.read() == body
        assert fake.seen[-1]["body"] == body


async def test_loading_upstream_is_forwarded_not_masked():
    """While llama-server loads its model it answers 503 "Loading model" itself: once the request
    was held for ``loading_wait_s``, that answer (with Retry-After), not ocache's "unreachable"
    503, reaches the client (holding until ready: tests/test_hardening_proxy.py)."""
    async with fake_upstream() as (up, fake), run_proxy(up, loading_wait_s=0.1) as (base, proxy), \
            client() as c:
        fake.loading = True
        await proxy.upstream.probe()
        assert proxy.upstream.state == "loading" and proxy.upstream.up
        async with c.post(base + "/v1/chat/completions", json={"messages": []}) as r:
            assert r.status == 503 and await r.json() == FakeUpstream.LOADING
            assert r.headers["Retry-After"] and "X-OCache-Upstream" not in r.headers


async def test_upstream_dies_mid_body_gives_502():
    async with fake_upstream() as (up, fake), run_proxy(up) as (base, _), client() as c:
        async with c.get(base + "/die-mid-body") as r:
            assert r.status == 502
            assert (await r.json())["error"]["upstream"] == up


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


async def test_ttft_is_the_first_token_not_the_keep_alive_comment(monkeypatch):
    """The server sends ``:\n\n`` while a prefill outlasts sse_ping_interval; TTFT must wait for
    the first ``data:`` event. A fake clock jumps 100 s between the comment and the token."""
    offset = {"s": 0.0}
    real_clock = time.perf_counter
    monkeypatch.setattr(time, "perf_counter", lambda: real_clock() + offset["s"])
    layer = RecordingLayer()
    async with fake_upstream() as (up, fake), run_proxy(up, layer) as (base, proxy), client() as c:
        fake.before_token = lambda: offset.__setitem__("s", 100.0)
        async with c.post(base + "/v1/chat/completions",
                          json={"stream": True, "messages": [], "ping_first": True}) as r:
            assert await r.content.readuntil(b"\n\n") == b":\n\n"  # the proxy relayed the comment
            fake.release.set()
            rest = await r.read()
        assert b'"content":"a"' in rest
        await proxy.wait_background()
        (obs,) = layer.observed
        assert obs.ttft_s is not None and 100.0 <= obs.ttft_s <= obs.total_s
        text = proxy.stats.prometheus().decode()
        assert 'ocache_ttft_seconds_bucket{le="60.0",route="/v1/chat/completions"} 0.0' in text
        assert 'ocache_ttft_seconds_bucket{le="120.0",route="/v1/chat/completions"} 1.0' in text


class RecordingLayer(NullLayer):
    def __init__(self):
        super().__init__()
        self.observed = []

    async def observe(self, req, plan, obs):
        self.observed.append(obs)


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
        return Plan(body_updates={"id_slot": 0}, figures=Figures(tier="disk"))

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


# --------------------------------------------------------------------------------------------------
# the real llama-server (tiny dense model)
VOLATILE_KEYS = frozenset({"id", "created", "timings", "cached_tokens"})


def normalise(obj):
    """Drop what differs between two identical greedy requests: ids (response and tool-call ids),
    ``created`` timestamps, ``timings`` and ``usage.prompt_tokens_details.cached_tokens`` (the
    repeat finds the prompt cached). Key order is kept."""
    if isinstance(obj, dict):
        return {k: normalise(v) for k, v in obj.items() if k not in VOLATILE_KEYS}
    if isinstance(obj, list):
        return [normalise(v) for v in obj]
    return obj


_VOLATILE_BYTES = re.compile(rb'"(id|created|cached_tokens)":("[^"]*"|\d+)|"timings":\{[^{}]*\}')


def normalise_bytes(raw: bytes) -> bytes:
    """The raw body with the volatile values of ``normalise`` blanked (framing, key order,
    whitespace and every other byte kept): two such bodies are byte-identical or not."""
    return _VOLATILE_BYTES.sub(lambda m: m.group(0).split(b":", 1)[0] + b":_", raw)


def sse_events(raw: bytes) -> list:
    """The ``data:`` payloads of an SSE body, JSON-decoded when possible (``[DONE]`` kept)."""
    out = []
    for block in raw.split(b"\n\n"):
        for line in block.split(b"\n"):
            if line.startswith(b"data: "):
                payload = line[6:]
                try:
                    out.append(json.loads(payload))
                except ValueError:
                    out.append(payload.decode())
    return out


def agent_body(stream: bool, include_usage: bool | None = None, max_tokens: int = 12) -> dict:
    """A real opencode agent turn (10 tools), greedy, short answer."""
    body = copy.deepcopy(load_fixture("opencode_agent_turn1.json"))
    body.update(max_tokens=max_tokens, temperature=0, top_k=1, seed=1, stream=stream)
    body.pop("stream_options", None)
    if include_usage is not None:
        body["stream_options"] = {"include_usage": include_usage}
    return body


async def both(c: aiohttp.ClientSession, direct: str, base: str, method: str, path: str, **kw):
    """The same request directly and through the proxy: [(status, headers, raw body)] x 2."""
    out = []
    for url in (direct, base):
        async with c.request(method, url + path, **kw) as r:
            out.append((r.status, r.headers.copy(), await r.read()))
    return out


@pytest.fixture
async def real(start_server):
    """(server, proxy base URL, proxy, client session) around one tiny dense llama-server."""
    srv = await asyncio.to_thread(start_server, "dense", n_parallel=1)
    async with run_proxy(srv.url, probe_interval_s=0.2) as (base, proxy), client() as c:
        yield srv, base, proxy, c


@pytest.mark.server
@pytest.mark.parametrize("stream, include_usage", [(False, None), (True, None), (True, True),
                                                   (True, False)])
async def test_chat_with_tools_identical_to_direct(real, stream, include_usage):
    srv, base, proxy, c = real
    body = agent_body(stream, include_usage)
    (ds, dh, draw), (ps, ph, praw) = await both(c, srv.url, base, "POST", "/v1/chat/completions",
                                                json=body)
    assert ds == ps == 200
    assert ph["Content-Type"] == dh["Content-Type"]
    assert normalise_bytes(praw) == normalise_bytes(draw)
    assert normalise_bytes(praw) != praw  # the normalisation only blanked ids/timestamps/timings
    if not stream:
        assert normalise(json.loads(praw)) == normalise(json.loads(draw))
        assert json.loads(praw)["timings"]["prompt_n"] > 0
    else:
        assert ph["Content-Type"].startswith("text/event-stream")
        assert "Content-Length" not in ph and ph["X-Accel-Buffering"] == "no"
        d_events, p_events = sse_events(draw), sse_events(praw)
        assert p_events[-1] == "[DONE]"
        assert [normalise(e) for e in p_events] == [normalise(e) for e in d_events]
        has_usage = any(isinstance(e, dict) and e.get("usage") for e in p_events)
        assert has_usage == bool(include_usage)  # C15: nothing the client did not ask for
    await proxy.wait_background()
    rec = proxy.stats.last_completions[-1]
    assert rec["status"] == 200 and rec["completed"]
    assert rec["prompt_n"] is not None and rec["prompt_n"] + rec["cache_n"] > 1000
    assert rec["ttft_s"] is not None and rec["ttft_s"] <= rec["total_s"]


@pytest.mark.server
async def test_other_routes_forwarded(real):
    """Non-completion routes, ``/metrics`` included, reach llama-server untouched."""
    srv, base, proxy, c = real
    (ds, dh, _), (ps, ph, _) = await both(c, srv.url, base, "GET", "/metrics")
    assert ds == ps == 200
    assert ph["Process-Start-Time-Unix"] == dh["Process-Start-Time-Unix"]
    assert ph["Content-Type"] == dh["Content-Type"]
    statuses = set()
    for method, path, kw in [("GET", "/props", {}), ("GET", "/health", {}),
                             ("GET", "/v1/models", {}), ("GET", "/slots?fail_on_no_slot=1", {}),
                             ("POST", "/tokenize", {"json": {"content": "hello world",
                                                              "with_pieces": True}}),
                             ("GET", "/no/such/route", {}),
                             # a save without a filename: llama-server answers 500 (docs/llama-server.md §5)
                             ("POST", "/slots/0?action=save", {"json": {}}),
                             ("POST", "/slots/0?action=nonsense", {"json": {}})]:
        (ds, _, draw), (ps, ph, praw) = await both(c, srv.url, base, method, path, **kw)
        assert ps == ds, path
        statuses.add(ds)
        assert ph["X-OCache-Request-Id"]
        if path == "/v1/models":
            assert normalise(json.loads(praw)) == normalise(json.loads(draw))
        else:
            assert praw == draw, path
    assert {200, 400, 404, 500} <= statuses  # errors included, each passed through unchanged


@pytest.mark.server
async def test_two_system_messages_c11(real):
    """C11: whatever llama-server answers (accept or reject), the client gets it unchanged."""
    srv, base, proxy, c = real
    body = {"messages": [{"role": "system", "content": "You are A."},
                         {"role": "system", "content": "You are B."},
                         {"role": "user", "content": "hello"}],
            "max_tokens": 4, "temperature": 0}
    (ds, _, draw), (ps, _, praw) = await both(c, srv.url, base, "POST", "/v1/chat/completions",
                                              json=body)
    assert ps == ds
    assert normalise(json.loads(praw)) == normalise(json.loads(draw))


@pytest.mark.server
async def test_unparseable_body_forwarded_byte_for_byte(real):
    srv, base, proxy, c = real
    for raw in (b'{"messages": [', b"\xff\xfe not utf8", b"[1, 2, 3]"):
        (ds, _, draw), (ps, _, praw) = await both(
            c, srv.url, base, "POST", "/v1/chat/completions", data=raw,
            headers={"Content-Type": "application/json"})
        assert ps == ds and ds >= 400
        assert praw == draw


@pytest.mark.server
async def test_fail_open_real_server(start_server):
    srv = await asyncio.to_thread(start_server, "dense", n_parallel=1)
    layer = RaisingLayer("plan")
    async with run_proxy(srv.url, layer) as (base, proxy), client() as c:
        body = agent_body(stream=False)
        (ds, _, draw), (ps, ph, praw) = await both(c, srv.url, base, "POST",
                                                   "/v1/chat/completions", json=body)
        assert ps == ds == 200 and ph["X-OCache-Fail-Open"] == "plan"
        assert normalise(json.loads(praw)) == normalise(json.loads(draw))
        await proxy.wait_background()
        assert proxy.stats.to_dict()["fail_open"] == 1
        assert layer.observed and layer.observed[0].timings["prompt_n"] >= 0


@pytest.mark.server
async def test_api_key_passes_through(start_server):
    srv = await asyncio.to_thread(start_server, "dense", api_key="sekret")
    async with run_proxy(srv.url, upstream_api_key="sekret") as (base, proxy), client() as c:
        ok = {"Authorization": "Bearer sekret"}
        (ds, _, _), (ps, _, praw) = await both(c, srv.url, base, "GET", "/v1/models", headers=ok)
        assert ds == ps == 200 and json.loads(praw)["data"]
        (ds, _, draw), (ps, _, praw) = await both(c, srv.url, base, "GET", "/v1/models")
        assert ds == ps == 401 and praw == draw
        (ds, _, _), (ps, _, _) = await both(c, srv.url, base, "POST", "/v1/chat/completions",
                                            headers={"X-Api-Key": "sekret"},
                                            json={"messages": [{"role": "user", "content": "x"}],
                                                  "max_tokens": 2})
        assert ds == ps == 200
        assert proxy.upstream.boot.start_time is not None  # probes used the configured key


async def _slots(c: aiohttp.ClientSession, url: str) -> list:
    async with c.get(url + "/slots") as r:
        return await r.json()


@pytest.mark.server
async def test_client_disconnect_frees_slot(real):
    srv, base, proxy, c = real
    body = {"messages": [{"role": "user", "content": "count to a million"}], "stream": True,
            "max_tokens": 100000, "ignore_eos": True, "temperature": 0}
    resp = await c.post(base + "/v1/chat/completions", json=body)
    assert resp.status == 200
    n = 0
    async for line in resp.content:
        if line.startswith(b"data: "):
            n += 1
            if n == 5:
                break
    assert (await _slots(c, srv.url))[0]["is_processing"]
    resp.close()
    t0 = time.monotonic()
    await poll(lambda: _idle(c, srv.url), timeout=1.0, what="slot idle after client disconnect")
    assert time.monotonic() - t0 <= 1.0
    await poll(lambda: proxy.stats.to_dict()["client_disconnects"] == 1, what="disconnect counted")
    assert await proxy.wait_idle(5)
    await proxy.wait_background()
    # the request's plan was released, once (its receipt: ocache/layer.py)
    assert proxy.stats_body()["plans"] == {"held": 0, "repeated_releases": 0}


@pytest.mark.server
async def test_a_completion_counts_as_in_flight_until_its_last_byte(real):
    """``upstream.generating`` (``/v1/cache/stats``) counts a completion from its arrival to its last
    byte relayed (what ``Upstream.quiet`` waits for: background server work never overlaps a
    decode); other routes, and a completion's end, leave it at 0."""
    srv, base, proxy, c = real

    async def generating():
        async with c.get(base + "/v1/cache/stats") as r:
            return (await r.json())["upstream"]["generating"]

    assert await generating() == 0 and await proxy.upstream.quiet(0)
    body = {"messages": [{"role": "user", "content": "count to a thousand"}], "stream": True,
            "max_tokens": 48, "ignore_eos": True, "temperature": 0}
    async with c.post(base + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        await resp.content.readline()  # the first event arrived: the answer is being relayed
        assert await generating() == 1
        waiter = asyncio.ensure_future(proxy.upstream.quiet(120))
        events = [line async for line in resp.content if line.startswith(b"data: ")]
    assert events[-1].strip() == b"data: [DONE]"
    assert await waiter is True  # quiet once the stream ended
    assert await generating() == 0
    async with c.get(base + "/props") as r:  # not a completion
        assert r.status == 200
    assert await generating() == 0


async def _idle(c, url):
    return not (await _slots(c, url))[0]["is_processing"]


@pytest.mark.server
async def test_upstream_down_up_and_restart(start_server):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    restarts = []

    class L(NullLayer):
        async def on_upstream_restart(self):
            restarts.append(proxy.upstream.epoch)

    async with run_proxy(url, L(), probe_interval_s=0.2, retry_after_s=3) as (base, proxy), \
            client() as c:
        async with c.post(base + "/v1/chat/completions", json={"messages": []}) as r:
            assert r.status == 503 and r.headers["Retry-After"] == "3"
            assert (await r.json())["error"]["upstream"] == url
        assert proxy.upstream.epoch == 0
        srv = await asyncio.to_thread(start_server, "dense", port=port)
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        async with c.post(base + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
        assert proxy.upstream.epoch == 1 and proxy.upstream.restarts == 0
        first_boot = proxy.upstream.boot
        await asyncio.to_thread(srv.restart)

        async def restarted():
            async with c.get(base + "/v1/cache/stats") as r:
                s = await r.json()
            return s["upstream"]["epoch"] == 2 and s["upstream_restarts"] == 1

        await poll(restarted, timeout=10, what="restart detected")
        assert restarts == [2]
        assert proxy.upstream.boot.start_time != first_boot.start_time
        async with c.post(base + "/v1/chat/completions", json=body) as r:
            assert r.status == 200


def _serve_launched(engine_patched, models_tiny, layer) -> tuple[asyncio.Event, asyncio.Task, asyncio.Future]:
    """``serve --launch`` of the tiny dense model (``-np 1 -c 4096``) with ``layer``: (stop, the
    serve task, a future of (proxy, port) once it listens)."""
    cfg = Config(port=0, probe_interval_s=0.2, launch_binary=str(engine_patched.binary),
                 launch=["-m", str(models_tiny["dense"]), "-t", "1", "-tb", "1", "-np", "1",
                         "-c", "4096", "--no-webui"])
    stop = asyncio.Event()
    task, ready = serve_in_task(cfg, stop, lambda u, c: layer)
    return stop, task, ready


@pytest.mark.server
async def test_serve_launch_restarts_child_and_drains(engine_patched, models_tiny):
    """``serve --launch``: a killed child is restarted (new PID = new epoch); on stop, an in-flight
    stream finishes, then ``layer.drain()`` runs with nothing in flight, then the child stops."""
    drained = []
    proxies = []

    class L(NullLayer):
        async def drain(self):
            drained.append(proxies[0].inflight)

    stop, task, ready = _serve_launched(engine_patched, models_tiny, L())
    try:
        proxy, port = await asyncio.wait_for(ready, 30)
        proxies.append(proxy)
        base = f"http://127.0.0.1:{port}"
        await poll(lambda: proxy.upstream.state == "ready", timeout=60, what="child ready")
        assert proxy.upstream.epoch == 1
        pid1 = proxy.upstream.boot.pid
        assert pid1 is not None
        os.kill(pid1, signal.SIGKILL)
        await poll(lambda: proxy.upstream.epoch == 2 and proxy.upstream.state == "ready",
                   timeout=60, what="restarted child detected")
        pid2 = proxy.upstream.boot.pid
        assert pid2 not in (None, pid1) and proxy.stats.to_dict()["upstream_restarts"] == 1

        async with client() as c:
            body = {"messages": [{"role": "user", "content": "go"}], "stream": True,
                    "max_tokens": 300, "ignore_eos": True, "temperature": 0}
            await stream_with_stop(c, base, body, stop)
        await asyncio.wait_for(task, 60)
    finally:
        stop.set()
        if not task.done():
            await asyncio.wait_for(task, 60)
    assert drained == [0]
    with pytest.raises(ProcessLookupError):
        os.kill(pid2, 0)


@pytest.mark.server
async def test_serve_launch_holds_a_request_while_it_starts_the_next_child(engine_patched, models_tiny,
                                                                         monkeypatch):
    """``serve --launch``: between the child's exit and the next child listening (the restart
    backoff, here 2 s) a request found the upstream down and got ocache's 503; llama-server's own
    clients would have had to retry. Now the supervisor's exit notice (``Upstream.expect_restart``)
    holds it, as while a model loads, and the next child answers it."""
    from ocache.supervisor import Supervisor

    monkeypatch.setattr(Supervisor, "restart_backoff_s", 2.0)
    stop, task, ready = _serve_launched(engine_patched, models_tiny, NullLayer())
    try:
        proxy, port = await asyncio.wait_for(ready, 30)
        base = f"http://127.0.0.1:{port}"
        await poll(lambda: proxy.upstream.state == "ready", timeout=60, what="child ready")
        pid1 = proxy.upstream.boot.pid
        os.kill(pid1, signal.SIGKILL)
        await poll(lambda: proxy.upstream.state == "down", timeout=30, what="the exit seen")
        body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 2, "temperature": 0}
        async with client() as c:
            async with c.post(base + "/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
                await r.json()
        assert proxy.upstream.boot.pid not in (None, pid1)
        assert proxy.stats.to_dict()["upstream_unavailable"] == 0
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)



@pytest.mark.server
async def test_serve_launch_answers_held_requests_once_it_gives_up(engine_patched, models_tiny, tmp_path,
                                                                  monkeypatch):
    """``serve --launch`` whose next child cannot start (its model file deleted, then the child
    killed): requests held for the next child (``Upstream.expect_restart``) were kept until their
    ``loading_wait_s`` ran out (a newcomer's break test: 8 requests answered 503 after the full
    120 s, and ocache exited 112 s after the supervisor had given up). Once the supervisor gives up
    they get ocache's 503 at once, and serve ends with the supervisor's LaunchError."""
    import shutil

    from ocache.supervisor import LaunchError, Supervisor

    monkeypatch.setattr(Supervisor, "restart_backoff_s", 0.2)
    model = tmp_path / "model.gguf"
    shutil.copyfile(models_tiny["dense"], model)
    cfg = Config(port=0, probe_interval_s=0.2, launch_binary=str(engine_patched.binary),
                 launch_max_failures=2, loading_wait_s=3600.0, drain_timeout_s=3600.0,
                 launch=["-m", str(model), "-t", "1", "-tb", "1", "-np", "1", "-c", "4096", "--no-webui"])
    stop = asyncio.Event()
    task, ready = serve_in_task(cfg, stop, lambda u, c: NullLayer())
    try:
        proxy, port = await asyncio.wait_for(ready, 30)
        base = f"http://127.0.0.1:{port}"
        await poll(lambda: proxy.upstream.state == "ready", timeout=60, what="child ready")
        model.unlink()
        os.kill(proxy.upstream.boot.pid, signal.SIGKILL)
        await poll(lambda: proxy.upstream.restarting, timeout=30, what="the exit seen")
        body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 2, "temperature": 0}

        async def one(stream: bool) -> int:
            async with client() as c:
                async with c.post(base + "/v1/chat/completions", json={**body, "stream": stream}) as r:
                    await r.read()
                    return r.status

        # bounded far below loading_wait_s: before the fix these waited for it (an hour here)
        statuses = await asyncio.wait_for(asyncio.gather(one(False), one(True), one(False)), 90)
        assert statuses == [503, 503, 503]
        with pytest.raises(LaunchError, match="2 times in a row"):
            await asyncio.wait_for(task, 90)
    finally:
        await end_serve(stop, task)


def test_the_patched_builds_boot_id_decides_whether_the_process_restarted():
    """patches/0005: the ``X-Llama-Server-Boot`` of ``/health`` settles it either way, even without
    ``--metrics`` (no start time) and after a time the server was unreachable; without it the
    older signals apply."""
    from ocache.upstream import BootId, _restart_reason

    a, b = BootId(build_info="b1", boot="aaaa"), BootId(build_info="b1", boot="bbbb")
    assert _restart_reason(a, b, None, None, False) == "boot id aaaa -> bbbb"
    assert _restart_reason(a, BootId(build_info="b1", boot="aaaa"), 10, 2, True) is None
    assert _restart_reason(BootId(build_info="b1"), BootId(build_info="b1"), None, None, True) is not None
