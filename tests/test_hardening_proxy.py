"""The proxy side of the fault campaign (``scripts/faults``): every bad input gets the upstream's answer, every wait is bounded.

Each test reproduces one finding of the fault campaign and fails on the code before the fix. The real patched llama-server (tiny models) is used wherever it
can produce the fault; a fake upstream only for what it cannot: a listener that never answers, a
scripted "Loading model" phase. A plain ``python -m http.server`` is the "not llama-server" case.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
import contextlib
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest

from ocache.config import Config
from ocache.layer import NullLayer
from ocache.proxy import Proxy, default_layer_factory
from ocache.serving import serve
from ocache.llama.server import free_port

from test_proxy import FakeUpstream, client, fake_upstream, normalise, poll, stream_with_stop
from conftest import end_serve, listening, serve_in_task

REPO = Path(__file__).resolve().parents[1]


@asynccontextmanager
async def proxy_on(upstream: str, layer: str = "ocache", monitor: bool = True, **cfg):
    """A Proxy on a free loopback port in front of ``upstream``; ``layer``: ``ocache`` (the real
    cache layer) or ``null``. Yields (base URL, proxy)."""
    config = Config(upstream=upstream, **cfg)
    factory = default_layer_factory() if layer == "ocache" else NullLayer
    proxy = Proxy(config, layer_factory=factory, monitor=monitor)
    async with listening(proxy) as base:
        yield base, proxy


def chat(content: str = "hello", max_tokens: int = 4, **kw) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, **kw}


async def post_raw(c: aiohttp.ClientSession, url: str, raw: bytes, **kw):
    async with c.post(url + "/v1/chat/completions", data=raw,
                      headers={"Content-Type": "application/json"}, **kw) as r:
        return r.status, dict(r.headers), await r.read()


def launch_config(engine_patched, models_tiny, tmp_path: Path, slots: Path, n_parallel: int, ctx: int,
                  **kw) -> Config:
    """``serve --launch``: ocache starts the patched llama-server on the tiny dense model itself
    (``n_parallel`` slots, ``ctx`` tokens in all, ``--slot-save-path slots``), on a free port."""
    return Config(port=0, probe_interval_s=0.2, cache_dir=str(tmp_path / "cache"),
                  launch_binary=str(engine_patched.binary),
                  launch=["-m", str(models_tiny["dense"]), "-t", "1", "-tb", "1", "-np", str(n_parallel),
                          "-c", str(ctx), "--no-webui", "--slot-save-path", str(slots)], **kw)


def errors_logged(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.fixture
async def dense(start_server, tmp_path):
    """(server, proxy base URL, proxy) with the real cache layer on the tiny dense model."""
    srv = await asyncio.to_thread(start_server, "dense", n_parallel=2)
    tiers = {"resident": {"server_args": ["-np", "2", "--slot-save-path", str(tmp_path / "slots")]}}
    async with proxy_on(srv.url, admin_token="tok", probe_interval_s=0.2, tiers=tiers) as (base, proxy):
        yield srv, base, proxy


async def answered_as_the_server_answers(dense, caplog, raw: bytes, case: str = "") -> int:
    """Post ``raw`` to the server and through ocache: ocache's answer is the server's (the same
    status; the same JSON, up to ``normalise``, for a 200, else the same bytes), not fail-open, counted
    as one unplannable body and no cache-layer error, nothing logged as an error. The server's status."""
    srv, base, proxy = dense
    async with client() as c:
        ds, _, draw = await post_raw(c, srv.url, raw)
        ps, ph, praw = await post_raw(c, base, raw)
    assert ps == ds, (case, ds, draw[:200], ps, praw[:200])
    if ds == 200:
        assert normalise(json.loads(praw)) == normalise(json.loads(draw))
    else:
        assert praw == draw
    assert "X-OCache-Fail-Open" not in ph
    await proxy.wait_background()
    st = proxy.stats.to_dict()
    assert st["layer_errors"] == {} and st["unplannable"] == {"body": 1}
    assert errors_logged(caplog) == []
    return ds


# --------------------------------------------------------------------------------------------------
# §2 deeply nested JSON, §6 UTF-16 / undecodable / lone surrogates: the upstream's answer
@pytest.mark.server
async def test_deep_nesting_gets_the_upstreams_answer(dense, caplog):
    """3,000 nested arrays: Python's json raises RecursionError, llama-server answers 200. The
    client gets the server's 200 (the bytes forwarded as they are), not aiohttp's 500."""
    raw = json.dumps(chat())[:-1].encode() + b', "x": ' + b"[" * 3000 + b"]" * 3000 + b"}"
    assert await answered_as_the_server_answers(dense, caplog, raw) == 200


@pytest.mark.server
@pytest.mark.parametrize("case", ["utf16", "utf8-bom", "latin1", "lone-surrogate"])
async def test_bodies_ocache_cannot_reencode_are_forwarded_byte_for_byte(dense, caplog, case):
    """A body that is not plain UTF-8 JSON (UTF-16, a BOM, Latin-1 bytes) or holds a lone
    surrogate: the server's own answer, never a re-encoded body; not a cache-layer error."""
    text = json.dumps(chat("héllo wörld"), ensure_ascii=False)
    raw = {"utf16": text.encode("utf-16"), "utf8-bom": b"\xef\xbb\xbf" + text.encode(),
           "latin1": text.encode("latin-1"),
           "lone-surrogate": text[:-1].encode() + b', "user": "x\\ud800y"}'}[case]
    await answered_as_the_server_answers(dense, caplog, raw, case)


@pytest.mark.server
@pytest.mark.parametrize("case", ["utf8-bom", "deep", "escaped-key"])
async def test_unparseable_body_never_pins_a_client_slot(dense, case):
    """A body ocache cannot parse but llama-server can (a UTF-8 BOM, 3,000 nested
    arrays) with the client's ``id_slot`` was forwarded byte for byte, and the server ran it in that
    slot, over another session's live conversation. Now ocache answers 400 and the server never sees
    it (the server itself answers 200 to the same bytes). On the old code: 200."""
    srv, base, proxy = dense
    async with client() as c:
        s0, h0, _ = await post_raw(c, base, json.dumps(chat("the first session's turn")).encode())
        assert s0 == 200
        slot = int(h0["X-OCache-Slot"])
        text = json.dumps(chat("another client", id_slot=slot))
        raw = {"utf8-bom": b"\xef\xbb\xbf" + text.encode(),
               "deep": text[:-1].encode() + b', "x": ' + b"[" * 3000 + b"]" * 3000 + b"}",
               "escaped-key": b"\xef\xbb\xbf" + text.replace("id_slot", "\\u0069d_slot").encode()}[case]
        ds, _, _ = await post_raw(c, srv.url, raw)
        ps, _, praw = await post_raw(c, base, raw)
    assert ds == 200                      # llama-server parses it and honours the id_slot
    assert ps == 400, praw[:300]
    assert "id_slot" in json.loads(praw)["error"]["message"]
    await proxy.wait_background()
    assert proxy.stats.to_dict()["unplannable"] == {"body": 1}


@pytest.mark.server
async def test_fail_open_forward_drops_the_clients_id_slot(dense, monkeypatch):
    """A parsed body forwarded without a plan (the cache layer failed: fail-open) is sent without
    the client's ``id_slot`` (``wire.unplanned_body``), so the server picks the slot itself."""
    srv, base, proxy = dense
    sent: list[bytes] = []
    real = proxy.forwards.forward

    async def spy(up, request, rid, body, *a, **kw):
        sent.append(body)
        return await real(up, request, rid, body, *a, **kw)

    async def broken(preq):
        raise RuntimeError("layer bug")

    monkeypatch.setattr(proxy.forwards, "forward", spy)
    monkeypatch.setattr(proxy.layer, "plan", broken)
    async with client() as c:
        ps, ph, _ = await post_raw(c, base, json.dumps(chat("hi", id_slot=1)).encode())
    assert ps == 200 and ph.get("X-OCache-Fail-Open") == "plan"
    assert sent and all("id_slot" not in json.loads(b) for b in sent)


@pytest.mark.server
@pytest.mark.parametrize("raw", [b'{"messages": [{"role": "user", "content": "hi"}', b"hello, not json",
                                 b"[1, 2, 3]"], ids=["truncated", "text", "array"])
async def test_unparsed_body_is_relayed_and_not_counted_as_a_completion(dense, raw):
    """A completion body ocache cannot parse (not JSON, not an object): the upstream's answer is
    relayed byte for byte, and the stats count it as ``unparsed`` by status, never as a completion
    (``completions``, the token totals, ``last_completions``, the Prometheus families, the view that
    ``ocache stats`` and the dashboard print)."""
    from ocache.dashboard import view

    srv, base, proxy = dense
    async with client() as c:
        ds, _, draw = await post_raw(c, srv.url, raw)
        ps, ph, praw = await post_raw(c, base, raw)
    assert (ps, praw) == (ds, draw)
    assert "X-OCache-Fail-Open" not in ph
    await proxy.wait_background()
    st = proxy.stats.to_dict()
    assert st["unplannable"] == {"body": 1}
    assert st["completions"] == {} and st["last_completions"] == [] and st["tokens"] == {}, st
    assert st["unparsed"] == {"/v1/chat/completions": {str(ds): 1}}
    prom = proxy.stats.prometheus().decode()
    assert "ocache_completions_total{" not in prom
    assert f'ocache_unparsed_total{{route="/v1/chat/completions",status="{ds}"}} 1.0' in prom
    totals = view(st)["totals"]
    assert totals["completions"] == 0 and totals["unparsed"] == 1


# --------------------------------------------------------------------------------------------------
# §4 upstream protocol errors: 502 with the reason, never aiohttp's 500
@pytest.mark.server
async def test_upstream_protocol_error_is_502_with_reason(dense):
    """llama-server answers a 60 KB request header with a 400 and ``Connection: close``, often
    followed by more data, which aiohttp's client cannot parse: ocache answers 502 naming the
    error (or, when the server's bytes were valid HTTP this time, the server's own 400), never a
    500, and keeps serving."""
    srv, base, proxy = dense
    async with client() as c:
        for _ in range(3):
            async with c.post(base + "/v1/chat/completions", json=chat(),
                              headers={"X-Big": "a" * 60000}) as r:
                data = await r.read()
                assert r.status in (400, 502), (r.status, data)
                if r.status == 502:
                    err = json.loads(data)["error"]
                    assert err["upstream"] == srv.url and "ClientResponseError" in err["message"]
        async with c.post(base + "/v1/chat/completions", json=chat()) as r:
            assert r.status == 200
    await proxy.wait_background()
    assert proxy.stats.to_dict()["layer_errors"] == {}


class MalformedUpstream:
    """A raw TCP server answering each path with bytes that are not valid HTTP (what llama-server
    itself sends only sometimes: data after ``Connection: close``)."""

    OK = {"/health": b'{"status":"ok"}', "/props": b'{"build_info":"b1-fake","total_slots":1}'}
    BAD = {
        "/garbage": b"HTTP/1.1 abc\r\n\r\n",
        "/after-close": (b"HTTP/1.1 400 Bad Request\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
                         b"HTTP/1.1 400 Bad Request\r\n\r\n"),
        "/short-body": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"a\"",
    }
    #: a stream whose second chunk has an invalid size line, sent once ``go`` is set
    STREAM_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                   b"a\r\ndata: {}\n\n\r\n")

    def __init__(self) -> None:
        self.go = asyncio.Event()

    async def _on_conn(self, reader, writer) -> None:
        try:
            line = await reader.readline()
            while (await reader.readline()) not in (b"\r\n", b""):
                pass
            path = line.split()[1].decode() if len(line.split()) > 1 else "/"
            if path == "/bad-chunk":
                writer.write(self.STREAM_HEAD)
                await writer.drain()
                await self.go.wait()
                writer.write(b"zz\r\n")
            elif path in self.OK:
                body = self.OK[path]
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                             + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
            else:
                writer.write(self.BAD.get(path, b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"))
            await writer.drain()
        finally:
            writer.close()

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._on_conn, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()


async def test_malformed_upstream_answers_are_502_with_reason():
    """Answers that are not valid HTTP: 502 naming the error before anything was relayed; a
    stream that breaks after it started is cut. (aiohttp's client does not report an invalid chunk
    size line once the body has started - its read just waits, measured with a plain
    ClientSession - so there ``stream_idle_timeout_s`` is what ends it.)"""
    async with MalformedUpstream() as up, \
            proxy_on(up.url, layer="null", monitor=False, stream_idle_timeout_s=1.0) as (base, proxy), \
            client() as c:
        assert proxy.upstream.state == "ready"
        for path in ("/garbage", "/after-close", "/short-body"):
            async with c.get(base + path) as r:
                body = await r.json()
                assert r.status == 502, (path, body)
                assert body["error"]["upstream"] == up.url and "failed" in body["error"]["message"]
        async with c.get(base + "/bad-chunk") as r:  # relayed as it comes, then the stream breaks
            assert r.status == 200
            assert await asyncio.wait_for(r.content.readline(), 30) == b"data: {}\n"
            up.go.set()
            with pytest.raises(aiohttp.ClientPayloadError):
                await asyncio.wait_for(r.read(), 30)


# --------------------------------------------------------------------------------------------------
# §3 bounded waits
class SilentListener:
    """A TCP listener that accepts connections and never answers (a hung process's socket)."""

    def __init__(self) -> None:
        self.connections = 0
        self._writers: list[asyncio.StreamWriter] = []

    async def _on_conn(self, reader, writer) -> None:
        self.connections += 1
        self._writers.append(writer)

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._on_conn, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        for w in self._writers:
            w.close()
        self.server.close()


async def test_hung_listener_one_shared_probe_and_503_at_once():
    """Against a listener that accepts and never answers, 6 concurrent /health all get 503 with
    Retry-After, and they share the probe: the listener sees at most 3 connections in all (one
    start-up probe, the forwards of none, one shared re-probe), not one probe per request."""
    async with SilentListener() as hung, \
            proxy_on(hung.url, layer="null", monitor=False, probe_timeout_s=0.5) as (base, proxy), \
            client() as c:
        assert proxy.upstream.state == "down" and proxy.upstream.hung
        seen = hung.connections

        async def health():
            async with c.get(base + "/health") as r:
                return r.status, r.headers.get("Retry-After"), await r.json()

        results = await asyncio.wait_for(asyncio.gather(*[health() for _ in range(6)]), 30)
        assert [s for s, _, _ in results] == [503] * 6
        assert all(ra is not None and int(ra) >= 1 for _, ra, _ in results)
        assert "no answer to GET /health" in results[0][2]["error"]["message"]
        assert hung.connections - seen <= 1


async def _two_in_flight(c, srv, base):
    """A non-streamed and a streamed long generation through ocache, both running on the server."""
    long = chat("count", max_tokens=100000, ignore_eos=True)
    plain = asyncio.create_task(c.post(base + "/v1/chat/completions", json=long))
    stream = await c.post(base + "/v1/chat/completions", json={**long, "stream": True})
    assert stream.status == 200
    await stream.content.readline()  # the stream is running

    async def both_busy():
        async with c.get(srv.url + "/slots") as r:
            return all(s["is_processing"] for s in await r.json())

    await poll(both_busy, timeout=30, what="both slots busy")
    return plain, stream


@asynccontextmanager
async def _stopped_under_two(c, srv, base, status: int, error: str):
    """``_two_in_flight``, then llama-server stopped (SIGSTOP): the non-streamed forward ends with
    ``status`` and ``error`` in its message, the stream is cut. The server is continued (SIGCONT)
    when the block ends."""
    plain, stream = await _two_in_flight(c, srv, base)
    os.kill(srv.proc.pid, signal.SIGSTOP)
    try:
        r = await asyncio.wait_for(plain, 60)
        assert r.status == status and error in (await r.json())["error"]["message"]
        with pytest.raises(aiohttp.ClientPayloadError):
            await asyncio.wait_for(stream.read(), 60)
        yield
    finally:
        os.kill(srv.proc.pid, signal.SIGCONT)


@pytest.mark.server
async def test_stopped_upstream_read_timeouts(start_server):
    """llama-server stopped (SIGSTOP) with two forwards in flight and no monitor to notice: the
    non-streamed one gets 504 after ``upstream_read_timeout_s``, the stream is cut after
    ``stream_idle_timeout_s``, ``/health`` answers 503 within ``probe_timeout_s``."""
    srv = await asyncio.to_thread(start_server, "dense", n_parallel=2)
    async with proxy_on(srv.url, layer="null", monitor=False, probe_timeout_s=1.0,
                        upstream_read_timeout_s=2.0, stream_idle_timeout_s=2.0) as (base, proxy), \
            client() as c:
        async with _stopped_under_two(c, srv, base, 504, "upstream_read_timeout_s"), \
                c.get(base + "/health") as r:
            assert r.status == 503 and r.headers["Retry-After"]


@pytest.mark.server
async def test_stopped_upstream_ends_forwards_503_at_once_then_recovers(start_server):
    """llama-server stopped (SIGSTOP) after it was ready, default (30 min) read timeouts: once the
    monitor's /health probe times out, the forwards in flight end (503 / a cut stream), later
    requests get 503 + Retry-After at once without a probe each; after SIGCONT all is served."""
    srv = await asyncio.to_thread(start_server, "dense", n_parallel=2)
    async with proxy_on(srv.url, layer="null", probe_interval_s=0.2, probe_timeout_s=1.0) as (base, proxy), \
            client() as c:
        async with _stopped_under_two(c, srv, base, 503, "no answer to GET /health"):
            assert proxy.upstream.hung
            probes = proxy.upstream.probes
            for path in ("/health", "/v1/chat/completions"):
                async with c.post(base + path, json=chat()) if path != "/health" else c.get(base + path) as r:
                    assert r.status == 503 and r.headers["Retry-After"]
            assert proxy.upstream.probes - probes <= 1
        await poll(lambda: proxy.upstream.state == "ready", timeout=30, what="ready again")
        async with c.post(base + "/v1/chat/completions", json=chat()) as r:
            assert r.status == 200


async def test_slow_client_body_gets_408():
    """A client that announces a body and stops sending it gets 408 after
    ``client_idle_timeout_s`` (before the fix it held the handler for ever)."""
    async with fake_upstream() as (up, fake), \
            proxy_on(up, layer="null", client_idle_timeout_s=0.5) as (base, proxy):
        host, port = base[7:].split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"mess")
        await writer.drain()
        head = await asyncio.wait_for(reader.readline(), 30)
        writer.close()
        assert head.startswith(b"HTTP/1.1 408"), head
        assert fake.seen == []  # nothing was forwarded


async def test_idle_keepalive_client_connection_closed():
    """``ocache serve`` closes an idle keep-alive client connection after ``client_keepalive_s``."""
    async with fake_upstream() as (up, fake):
        port = free_port()
        cfg = Config(upstream=up, port=port, client_keepalive_s=0.5, no_cache=True)
        stop = asyncio.Event()
        ready = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(serve(cfg, stop=stop, handle_signals=False,
                                         layer_factory=lambda u, c: NullLayer(),
                                         ready=lambda p, prt: ready.set_result(prt)))
        try:
            await asyncio.wait_for(ready, 30)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
            assert head.startswith(b"HTTP/1.1 200")
            n = int([ln for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")][0]
                    .split(b":")[1])
            await reader.readexactly(n)
            assert await asyncio.wait_for(reader.read(), 30) == b""  # closed by ocache
            writer.close()
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)


# --------------------------------------------------------------------------------------------------
# §9 requests while llama-server loads its model
async def test_loading_request_held_until_ready():
    async with fake_upstream() as (up, fake), \
            proxy_on(up, layer="null", loading_wait_s=60) as (base, proxy), client() as c:
        fake.loading = True
        await proxy.upstream.probe()
        assert proxy.upstream.state == "loading"
        req = asyncio.create_task(c.post(base + "/v1/chat/completions", json={"messages": []}))
        await poll(lambda: proxy.stats.to_dict()["held_loading"] == 1, timeout=30, what="held")
        assert not req.done() and fake.seen == []
        fake.loading = False
        r = await asyncio.wait_for(req, 30)
        assert r.status == 200 and (await r.json())["choices"][0]["message"]["content"] == "hi"
        assert "X-OCache-Fail-Open" not in r.headers and len(fake.seen) == 1


async def test_loading_past_the_bound_gets_503_with_retry_after():
    async with fake_upstream() as (up, fake), \
            proxy_on(up, layer="null", loading_wait_s=0.3, retry_after_s=7) as (base, proxy), \
            client() as c:
        fake.loading = True
        await proxy.upstream.probe()
        async with c.post(base + "/v1/chat/completions", json={"messages": []}) as r:
            assert r.status == 503 and await r.json() == FakeUpstream.LOADING
            assert r.headers["Retry-After"] == "7"
        assert proxy.stats.to_dict()["held_loading"] == 1


@pytest.mark.server
async def test_request_during_real_model_load_is_held_not_fail_open(engine_patched, models_tiny,
                                                                    tmp_path, caplog):
    """ocache first, then llama-server: a request sent while the real server answers 503 "Loading
    model" is held and served (200), with no fail-open mark and no ERROR. The load takes ~0.3 s on
    the tiny model; a start whose window the client missed is retried (at most 5)."""
    from ocache.llama.server import LlamaServer

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    async with proxy_on(url, probe_interval_s=0.2) as (base, proxy), client() as c:
        for attempt in range(5):
            srv = LlamaServer(binary=engine_patched.binary, model=models_tiny["dense"], port=port,
                              log_path=tmp_path / f"srv{attempt}.log", slot_save_path=tmp_path / "slots")
            cmd = srv.command()
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                status = None
                deadline = time.monotonic() + 60
                while status is None and time.monotonic() < deadline:
                    try:
                        async with c.get(url + "/health") as r:
                            status = r.status
                    except aiohttp.ClientConnectorError:
                        await asyncio.sleep(0.002)  # polling a child's listener, not synchronising
                if status != 503:
                    continue  # the load finished before the first answer: try another start
                async with c.post(base + "/v1/chat/completions", json=chat()) as r:
                    assert r.status == 200, await r.text()
                    assert "X-OCache-Fail-Open" not in r.headers
                # the table is reconciled (GET /slots) after each response; llama-server stopped
                # while that waits in its task queue takes 30 s to exit ("stop: cancel task")
                await proxy.wait_background()
                await proxy.layer.idle()
                if proxy.stats.to_dict()["held_loading"] >= 1:
                    break
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)
            await poll(lambda: proxy.upstream.state == "down", timeout=30, what="server gone")
        assert proxy.stats.to_dict()["held_loading"] >= 1, "never caught the loading window"
        await proxy.wait_background()
        assert proxy.stats.to_dict()["layer_errors"] == {}
        assert errors_logged(caplog) == []


@pytest.mark.server
async def test_external_restart_inside_the_probe_window_is_held(start_server, engine_patched,
                                                                tmp_path, caplog):
    """llama-server restarted behind ocache between two probes (``probe_interval_s`` 60: ocache
    still thinks it ready): a request that arrives while the new process loads its model is held
    and served, not marked fail-open with an ERROR traceback. Retried (at most 5 restarts) when the
    load finished before the request could see it."""
    srv = await asyncio.to_thread(start_server, "dense", n_parallel=2)
    async with proxy_on(srv.url, probe_interval_s=60) as (base, proxy), client() as c:
        async with c.post(base + "/v1/chat/completions", json=chat()) as r:
            assert r.status == 200
        for attempt in range(5):
            await asyncio.to_thread(srv.stop)
            srv.proc = subprocess.Popen(srv.command(), stdout=subprocess.DEVNULL,
                                        stderr=subprocess.STDOUT, start_new_session=True)
            status = None
            deadline = time.monotonic() + 60
            while status is None and time.monotonic() < deadline:
                try:
                    async with c.get(srv.url + "/health") as r:
                        status = r.status
                except aiohttp.ClientConnectorError:
                    await asyncio.sleep(0.002)  # polling a child's listener, not synchronising
            assert proxy.upstream.state == "ready"  # stale: the monitor has not probed since
            async with c.post(base + "/v1/chat/completions", json=chat()) as r:
                assert r.status == 200, await r.text()
                assert "X-OCache-Fail-Open" not in r.headers
            await asyncio.to_thread(srv.wait_ready)
            if status == 503 and proxy.stats.to_dict()["held_loading"] >= 1:
                break
        assert proxy.stats.to_dict()["held_loading"] >= 1, "never caught the loading window"
        await proxy.wait_background()
        assert proxy.stats.to_dict()["layer_errors"] == {}
        assert errors_logged(caplog) == []


# --------------------------------------------------------------------------------------------------
# §7 the admin surface
async def test_admin_routes_one_guard_one_shape():
    async with fake_upstream() as (up, fake), proxy_on(up, layer="null") as (base, _), client() as c:
        for path in ("/v1/cache/clear", "/v1/cache/warm", "/v1/cache/drain"):
            async with c.post(base + path, json={"dir": "/tmp"}) as r:
                body = await r.json()
                assert r.status == 404, (path, body)  # no admin_token: every admin route is off
                assert set(body["error"]) >= {"code", "message", "type"} and body["error"]["code"] == 404
    async with fake_upstream() as (up, fake), proxy_on(up, layer="null", admin_token="tok") as (base, _), \
            client() as c:
        for path in ("/v1/cache/clear", "/v1/cache/warm", "/v1/cache/drain"):
            for headers in ({}, {"Authorization": "Bearer nope"}):
                async with c.post(base + path, json={"dir": "/tmp"}, headers=headers) as r:
                    body = await r.json()
                    assert r.status == 401, (path, body)
                    assert body["error"]["type"] == "authentication_error" and body["error"]["code"] == 401
                    assert r.headers["WWW-Authenticate"].startswith("Bearer")
            async with c.get(base + path) as r:
                assert r.status == 405 and (await r.json())["error"]["code"] == 405


@pytest.mark.server
async def test_warm_dir_with_nul_is_400(dense):
    srv, base, proxy = dense
    async with client() as c:
        for d in ("/tmp/a\x00b", "relative/dir"):
            async with c.post(base + "/v1/cache/warm", json={"dir": d},
                              headers={"Authorization": "Bearer tok"}) as r:
                body = await r.json()
                assert r.status == 400, body
                assert body["error"]["type"] == "invalid_request_error"


@pytest.mark.server
async def test_stats_without_token_hide_session_ids(dense):
    srv, base, proxy = dense
    secret = "ses_4f2a9c1b7e"
    async with client() as c:
        async with c.post(base + "/v1/chat/completions", json=chat(),
                          headers={"x-session-id": secret, "x-session-affinity": secret}) as r:
            assert r.status == 200
        await proxy.wait_background()
        async with c.get(base + "/v1/cache/stats", headers={"Authorization": "Bearer tok"}) as r:
            assert secret in await r.text()  # the owner is known to the layer
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            async with c.get(base + "/v1/cache/stats", headers=headers) as r:
                text = await r.text()
                assert r.status == 200 and secret not in text
                assert '"owner"' not in text and json.loads(text)["redacted"]


@pytest.mark.server
async def test_client_slot_actions_refused(dense):
    """A client's POST /slots/{id}?action=save|restore|erase would change a slot behind ocache's
    slot table: 403 with the reason; reads of /slots and unknown actions still reach the server."""
    srv, base, proxy = dense
    async with client() as c:
        for action in ("erase", "save", "restore"):
            async with c.post(base + f"/slots/0?action={action}", json={"filename": "x.bin"}) as r:
                body = await r.json()
                assert r.status == 403, body
                assert "ocache owns" in body["error"]["message"]
                assert "127.0.0.1" not in body["error"]["message"]   # not where the server listens
        # the spellings llama-server routes too (each reached the server before)
        for path in ("/slots/0/?action=erase", "//slots/0?action=save", "/slots/0?action=foo&action=restore",
                     "/slots/0?action=restore&action=foo", "/slots/0?%61ction=%65rase", "/slots/0%2F?action=erase"):
            async with c.post(base + path, json={"filename": "x.bin"}) as r:
                body = await r.json()
                assert r.status == 403 and "ocache owns" in body["error"]["message"], (path, body)
        async with c.post(srv.url + "/slots/0?action=erase") as r:
            assert r.status == 200  # the server itself would have done it
        async with c.get(base + "/slots") as r:
            assert r.status == 200 and len(await r.json()) == 2
        async with c.post(base + "/slots/0?action=nonsense") as r:
            assert r.status == 400  # the server's own answer


# --------------------------------------------------------------------------------------------------
# §10 --launch that cannot start its child; an upstream that is not llama-server
@pytest.mark.server
def test_launch_that_cannot_start_exits_nonzero(engine_patched, tmp_path):
    port = free_port()
    env = {**os.environ, "OCACHE_STATE_DIR": str(tmp_path / "state"), "OCACHE_LAUNCH_MAX_FAILURES": "2",
           "OCACHE_LAUNCH_BINARY": str(engine_patched.binary)}
    missing = tmp_path / "no-such-model.gguf"
    p = subprocess.run([sys.executable, "-m", "ocache", "serve", "--port", str(port), "--launch", "--",
                        "-m", str(missing), "-t", "1"], env=env, capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    assert p.returncode == 1, p.stderr[-3000:]
    assert "2 times in a row" in p.stderr
    # the tiers' announcement says the child exited, with its status, not a timeout (it said
    # "not ready after 300 s" when the children had exited within seconds)
    assert "tiers not checked: llama-server exited with 1 2 times in a row" in p.stderr, p.stderr[-3000:]
    assert "not ready after" not in p.stderr
    # the last child's log tail, once: each child names the missing model in its own lines
    tail = p.stderr[p.stderr.index("Last log lines"):]
    assert str(missing) in tail
    assert p.stderr.count("Last log lines") == 1
    log = (tmp_path / "state" / "llama-server.log").read_text()
    assert log.count("exiting due to model loading error") == 2  # two children wrote the log
    assert tail.count("exiting due to model loading error") == 1  # only the last one's is shown


@pytest.mark.server
async def test_launch_creates_a_missing_slot_save_path(engine_patched, models_tiny, tmp_path):
    """The README's ``serve --launch -- ... --slot-save-path ~/.cache/ocache/slots`` on a fresh
    machine, where that folder does not exist yet: llama-server refuses a path that is not a
    directory (common/arg.cpp:3618-3619), so before the fix every start failed and ocache gave up.
    The supervisor creates it (mode 0700) before each start and the child comes up."""
    slots = tmp_path / "new" / "slots"
    stop = asyncio.Event()
    cfg = launch_config(engine_patched, models_tiny, tmp_path, slots, n_parallel=1, ctx=2048,
                        launch_max_failures=2)
    task, ready = serve_in_task(cfg, stop)
    try:
        proxy, _ = await asyncio.wait_for(ready, 60)
        await poll(lambda: proxy.upstream.state == "ready" or task.done(), timeout=60, what="child ready or gave up")
        assert not task.done() and proxy.upstream.state == "ready"
        assert slots.is_dir() and (slots.stat().st_mode & 0o777) == 0o700
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)


@pytest.fixture
def http_server(tmp_path):
    """A plain ``python -m http.server`` (not llama-server) on a free port."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    import urllib.request

    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(url + "/", timeout=1).read()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)  # polling a child's listener, not synchronising
    yield url
    proc.terminate()
    proc.wait(10)


async def test_not_llama_server_reported_once_and_forwarded(http_server, caplog):
    async with proxy_on(http_server, probe_interval_s=0.2) as (base, proxy), client() as c:
        assert proxy.upstream.state == "foreign"
        for _ in range(3):
            (ds, _, draw) = await post_raw(c, http_server, json.dumps(chat()).encode())
            (ps, ph, praw) = await post_raw(c, base, json.dumps(chat()).encode())
            assert ps == ds == 501 and "X-OCache-Fail-Open" not in ph
        await proxy.wait_background()
        assert proxy.stats.to_dict()["layer_errors"] == {}
        reports = [r for r in caplog.records if "is not llama-server" in r.getMessage()]
        assert len(reports) == 1 and reports[0].exc_info is None
        assert not [r for r in caplog.records if r.exc_info]


# --------------------------------------------------------------------------------------------------
# §11 ocache doctor
DOCTOR_FLAGS = ("-np", "--slot-save-path", "--ctx-checkpoints", "--checkpoint-min-step", "--metrics",
                "-fa", "--cache-ram", "-ub", "-kvu", "build")


def doctor(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ocache", "doctor", *args], capture_output=True,
                          text=True, timeout=120, cwd=cwd)


def flag_lines(out: str) -> dict[str, list[str]]:
    lines: dict[str, list[str]] = {}
    for ln in out.splitlines():
        ln = ln.strip()
        if ln.startswith("["):
            level, rest = ln[1:].split("]", 1)
            lines.setdefault(rest.strip().split(":", 1)[0], []).append(level)
    return lines


def test_doctor_tells_not_llama_server(http_server, tmp_path):
    p = doctor("--upstream", http_server, "--", "-np", "2", cwd=tmp_path)
    assert p.returncode != 0, p.stdout
    assert "not llama-server" in p.stdout + p.stderr
    assert "[ok] -np" not in p.stdout


def test_doctor_checks_a_command_line_offline(models_tiny, tmp_path):
    """No server: the command line alone, one line for every flag doctor knows."""
    p = doctor("--offline", "--", "-m", str(models_tiny["hybrid"]), "-np", "2", "-fa", "on",
               "--slot-save-path", str(tmp_path), "--ctx-checkpoints", "32",
               "--checkpoint-min-step", "1024", "--cache-ram", "0", "--metrics", cwd=tmp_path)
    lines = flag_lines(p.stdout)
    assert p.returncode == 0, p.stdout + p.stderr
    for flag in DOCTOR_FLAGS:
        assert len(lines.get(flag, [])) == 1, (flag, p.stdout)
        assert lines[flag][0] in ("ok", "warning", "unknown", "error", "info"), (flag, p.stdout)
    for flag in ("-np", "--slot-save-path", "--ctx-checkpoints", "--checkpoint-min-step", "--metrics",
                 "-fa", "--cache-ram"):
        assert lines[flag] == ["ok"], (flag, p.stdout)
    bad = doctor("--offline", "--", "-m", str(models_tiny["hybrid"]), cwd=tmp_path)
    lines = flag_lines(bad.stdout)
    assert bad.returncode == 1
    assert lines["-np"] == ["error"] and lines["--metrics"] == ["warning"] and lines["-fa"] == ["warning"]
    assert lines["--slot-save-path"] == ["warning"] and lines["--checkpoint-min-step"] == ["warning"]
    assert lines["--cache-ram"] == ["warning"]   # the default 8192 MiB: the README wants 0 (D1)


@pytest.mark.server
def test_doctor_without_command_line_says_unknown_not_warning(start_server, tmp_path):
    """A stock server (it does not report its flags; the patched one does, tests/test_tiers_off.py)
    without the command line: what only the command line can tell is unknown, never a warning;
    the folder of its slot files is unknown too, which turns the file tiers off."""
    srv = start_server("dense", stock=True, n_parallel=2)
    p = doctor("--upstream", srv.url, cwd=tmp_path)
    lines = flag_lines(p.stdout)
    for flag in DOCTOR_FLAGS:
        assert len(lines.get(flag, [])) == 1, (flag, p.stdout)
    # what the server reports is checked; what only the command line can tell is unknown
    assert lines["-np"] == ["ok"] and lines["--metrics"] == ["ok"]
    assert lines["--slot-save-path"] == ["warning"] and lines["build"] == ["warning"]
    for flag in ("-fa", "--cache-ram", "-kvu"):
        assert lines[flag] == ["unknown"], (flag, p.stdout)
    assert sum(levels.count("warning") for levels in lines.values()) == 2, p.stdout


# --------------------------------------------------------------------------------------------------
# planned stop of a supervised llama-server: nothing of ocache's waits on it at SIGTERM
@pytest.mark.server
async def test_launch_stop_sends_sigterm_with_no_get_slots_in_flight(engine_patched, models_tiny,
                                                                     monkeypatch, tmp_path):
    """``serve --launch`` stopped while a stream is in flight (the stop waits for it): the stream's
    end would start the usual ``GET /slots`` reconcile, and llama-server does not exit while a
    client waits for a task result (README "Limitations"). Every ``GET /slots`` that starts after
    the stop was asked for is held until SIGTERM is sent (at most 15 s), so that a reconcile the
    stop does not prevent shows: as one in flight at SIGTERM, or (before the fix) as a stop that
    waited for it. The stop must start none and send SIGTERM with none in flight."""
    from ocache import supervisor as sup_mod
    from ocache.slots import SlotTable

    stop = asyncio.Event()
    termed = asyncio.Event()
    inflight = {"n": 0, "started_after_stop": 0}
    at_term: list[dict] = []
    real_fetch = SlotTable.fetch_slots

    async def fetch_slots(self):
        inflight["n"] += 1
        try:
            if stop.is_set():
                inflight["started_after_stop"] += 1
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(termed.wait(), 15)
            return await real_fetch(self)
        finally:
            inflight["n"] -= 1

    real_killpg = os.killpg

    def killpg(pid, sig):
        if sig == signal.SIGTERM and not termed.is_set():
            at_term.append(dict(inflight, t=time.monotonic()))
            termed.set()
        return real_killpg(pid, sig)

    monkeypatch.setattr(SlotTable, "fetch_slots", fetch_slots)
    monkeypatch.setattr(sup_mod.os, "killpg", killpg)
    slots = tmp_path / "slots"
    slots.mkdir()
    cfg = launch_config(engine_patched, models_tiny, tmp_path, slots, n_parallel=2, ctx=4096)
    task, ready = serve_in_task(cfg, stop)
    try:
        proxy, port = await asyncio.wait_for(ready, 60)
        base = f"http://127.0.0.1:{port}"
        await poll(lambda: proxy.upstream.state == "ready", timeout=60, what="child ready")
        async with client() as c:
            body = chat("hello there " * 40, max_tokens=600, stream=True, ignore_eos=True)
            t_stop = await stream_with_stop(c, base, body, stop)
        await asyncio.wait_for(task, 60)
    finally:
        stop.set()
        if not task.done():
            await asyncio.wait_for(task, 60)
    [term] = at_term
    print(f"\nstop -> SIGTERM {term['t'] - t_stop:.2f} s (the stream's rest included); "
          f"GET /slots started after the stop: {term['started_after_stop']}, in flight at SIGTERM: {term['n']}")
    # the stop ended ocache's own reconciles (none started after it) and left none in flight
    assert term["started_after_stop"] == 0 and term["n"] == 0, term


@pytest.mark.server
async def test_planned_stop_with_the_server_stopping_too_ends(start_server, tmp_path):
    """ocache and a llama-server it does not launch stopped at once (one ``kill`` of both, a
    service manager stopping both): llama-server's task queue ends at its SIGTERM, but its HTTP
    threads still read requests on connections that were open, so a drain's ``action=save`` on
    one of ocache's pooled connections is never answered, and llama-server does not exit while
    that client waits (README "Limitations"). Before the fix both waited for the slot call's
    3,600 s bound (seen with real Claude Code sessions). The drain must end once the server is seen
    down (or at ``drain_timeout_s``), and llama-server must then exit."""
    srv = await asyncio.to_thread(start_server, "dense", n_parallel=2, ctx_size=8192)
    tiers = {"resident": {"server_args": ["-np", "2", "-c", "8192",
                                          "--slot-save-path", str(srv.slot_save_path)]}}
    stop = asyncio.Event()
    cfg = Config(port=0, upstream=srv.url, probe_interval_s=0.2, cache_dir=str(tmp_path / "cache"),
                 drain_timeout_s=20, tiers=tiers)
    task, ready = serve_in_task(cfg, stop)
    try:
        proxy, port = await asyncio.wait_for(ready, 60)
        base = f"http://127.0.0.1:{port}"
        async with client() as c:
            for name in ("alpha", "beta"):   # one conversation per slot, each above drain_min_tokens
                system = f"You are agent {name}. " + " ".join(f"rule {i}: be {name}." for i in range(300))
                body = {"messages": [{"role": "system", "content": system},
                                     {"role": "user", "content": f"hi {name}"}],
                        "tools": [{"type": "function", "function": {
                            "name": "ls", "description": "list files",
                            "parameters": {"type": "object", "properties": {}}}}],
                        "max_tokens": 4, "temperature": 0}   # an agent turn: spilled at a stop
                async with c.post(base + "/v1/chat/completions", json=body,
                                  headers={"X-Session-Id": name}) as r:
                    assert r.status == 200, await r.text()
                    assert (await r.json())["timings"]["prompt_n"] > 1024
        srv.proc.send_signal(signal.SIGTERM)
        stop.set()
        t0 = time.monotonic()
        done, _ = await asyncio.wait([task], timeout=60)
        assert done, "ocache's planned stop waited on a llama-server that was stopping"
        task.result()
        print(f"\nplanned stop with the server stopping too: ocache ended in {time.monotonic() - t0:.1f} s")
        await asyncio.to_thread(srv.proc.wait, 30)
    finally:
        await end_serve(stop, task)


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(d.name))
    return out


def _alive(pid: int) -> bool:
    """Running (a zombie left for a reaper that is not there counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.server
@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_launch_child_does_not_outlive_a_killed_ocache(engine_patched, models_tiny, tmp_path):
    """``kill -9`` of ``ocache serve --launch`` (no shutdown runs): its llama-server child gets SIGTERM
    from the kernel (PR_SET_PDEATHSIG) and exits, instead of running on with its port and memory
    (before: it stayed, found by a newcomer after three such kills)."""
    import urllib.request

    port = free_port()
    env = {**os.environ, "OCACHE_STATE_DIR": str(tmp_path / "state"),
           "OCACHE_LAUNCH_BINARY": str(engine_patched.binary)}
    p = subprocess.Popen([sys.executable, "-m", "ocache", "serve", "--port", str(port), "--launch", "--",
                          "-m", str(models_tiny["dense"]), "-t", "1", "-np", "1", "-c", "2048", "--no-webui"],
                         env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    child = None
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:   # polling two external processes, bounded
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                    break
            except OSError:
                pass
            time.sleep(0.1)
        kids = [k for k in _children(p.pid) if "llama-server" in Path(f"/proc/{k}/cmdline").read_bytes().decode(errors="replace")]
        assert len(kids) == 1, kids
        child = kids[0]
        p.kill()
        p.wait(30)
        deadline = time.monotonic() + 30
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "llama-server outlived ocache"
    finally:
        if p.poll() is None:
            p.kill()
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)
