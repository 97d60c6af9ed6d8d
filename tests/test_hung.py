"""The hung verdict: it needs ``hung_probes`` missed ``/health`` probes in a row,
and it cancels what it abandons.

One ``/health`` without an answer in ``probe_timeout_s`` on a loaded machine cut a generation
running at 116-128 tokens/s (503 to the client). A real llama-server answers ``/health`` at once, so
a slow but healthy one is a fake here (``tests/test_proxy.py`` ``FakeUpstream``, its ``/health``
held for exactly one probe); a stopped one is the real server under SIGSTOP.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from aiohttp import web

from test_hardening_proxy import chat, proxy_on
from test_proxy import FakeUpstream, client, poll


class SlowHealth(FakeUpstream):
    """A fake llama-server whose next ``stall`` ``/health`` requests never answer (until the client
    gives up), and whose stream sends one chunk, then waits for ``finish`` before its last."""

    def __init__(self) -> None:
        super().__init__()
        self.stall = 0
        self.health_calls = 0
        self.finish = asyncio.Event()
        self.app.router._frozen = False
        self.app.router.add_post("/v1/completions", self.held_stream)

    async def health(self, request):
        self.health_calls += 1
        if self.stall > 0:
            self.stall -= 1
            await asyncio.Event().wait()   # no answer: the probe's own timeout ends it
        return await super().health(request)

    async def held_stream(self, request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"content":"a","stop":false}\n\n')
        self.stream_started.set()
        try:
            await self.finish.wait()
        except asyncio.CancelledError:
            self.stream_cancelled.set()  # the proxy closed the connection: the task is cancelled
            raise
        await resp.write(b'data: {"content":"b","stop":true}\n\n')
        return resp


@asynccontextmanager
async def _streaming(hung_probes: int):
    """A stream through ocache (the null layer, no periodic probe, probes that time out after 0.3 s,
    the hung verdict after ``hung_probes`` misses) from a ``SlowHealth`` upstream; yields (the fake,
    the proxy, the stream's response)."""
    fake = SlowHealth()
    server = TestServer(fake.app, host="127.0.0.1")
    await server.start_server()
    url = f"http://127.0.0.1:{server.port}"
    try:
        async with proxy_on(url, layer="null", probe_interval_s=60, probe_timeout_s=0.3,
                            hung_probes=hung_probes) as (base, proxy), client() as c:
            yield fake, proxy, await c.post(base + "/v1/completions", json={"prompt": "x", "stream": True})
    finally:
        await server.close()


async def test_one_missed_probe_does_not_cut_a_healthy_generation():
    """One ``/health`` without an answer while a stream runs: the probe tries again, gets the answer,
    and the stream ends whole. On the old code the one miss was the hung verdict: the stream was cut."""
    async with _streaming(hung_probes=3) as (fake, proxy, resp):
        assert resp.status == 200
        assert (await resp.content.readline()).startswith(b"data:")
        calls = fake.health_calls
        fake.stall = 1
        await asyncio.wait_for(proxy.upstream.probe(), 30)
        assert fake.health_calls == calls + 2     # the missed one, then the answered one
        assert proxy.upstream.state == "ready" and not proxy.upstream.hung
        assert proxy.upstream.missed_probes == 1
        fake.finish.set()
        rest = await asyncio.wait_for(resp.read(), 30)
        assert b'"stop":true' in rest and not fake.stream_cancelled.is_set()


async def test_hung_verdict_after_every_probe_missed_cancels_the_abandoned_stream():
    """``hung_probes`` misses in a row: the verdict, the stream cut, and the upstream connection
    closed, so the server cancels the abandoned generation (llama-server stops a task whose
    connection closed: server-context.cpp:4709-4716, ``should_stop``)."""
    async with _streaming(hung_probes=2) as (fake, proxy, resp):
        await resp.content.readline()
        fake.stall = 2
        await asyncio.wait_for(proxy.upstream.probe(), 30)
        assert proxy.upstream.hung and proxy.upstream.missed_probes == 2
        with pytest.raises(aiohttp.ClientPayloadError):
            await asyncio.wait_for(resp.read(), 30)
        await asyncio.wait_for(fake.stream_cancelled.wait(), 30)


@pytest.mark.server
async def test_stopped_server_abandoned_generation_is_cancelled_and_its_slot_serves_again(start_server):
    """The real server stopped (SIGSTOP) during a long non-streamed generation through ocache: the
    hung verdict ends the forward with 503; after SIGCONT the server has cancelled the abandoned
    task (every slot idle, the connection was closed), and the next request through ocache (pinned
    by the cache layer to a slot) gets 200, not a 504 behind the abandoned generation."""
    srv = await asyncio.to_thread(start_server, "dense", n_parallel=1)
    async with proxy_on(srv.url, probe_interval_s=0.2, probe_timeout_s=0.5, hung_probes=2,
                        upstream_read_timeout_s=60) as (base, proxy), client() as c:
        long = chat("count", max_tokens=100000, ignore_eos=True)
        plain = asyncio.create_task(c.post(base + "/v1/chat/completions", json=long))

        async def busy():
            async with c.get(srv.url + "/slots") as r:
                return all(s["is_processing"] for s in await r.json())

        await poll(busy, timeout=60, what="the slot generating")
        os.kill(srv.proc.pid, signal.SIGSTOP)
        try:
            r = await asyncio.wait_for(plain, 60)
            assert r.status == 503
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)

        async def idle():
            async with c.get(srv.url + "/slots") as r:
                return not any(s["is_processing"] for s in await r.json())

        await poll(idle, timeout=60, what="the abandoned generation cancelled")
        await poll(lambda: proxy.upstream.state == "ready", timeout=60, what="ready again")
        async with c.post(base + "/v1/chat/completions", json=chat("count")) as r:
            assert r.status == 200, await r.text()
            json.loads(await r.read())


@pytest.mark.server
@pytest.mark.parametrize("path", ["/apply-template", "/tokenize"])
async def test_server_stopped_during_the_token_view_ends_the_plan_with_503(start_server, monkeypatch, path):
    """The server stopped (SIGSTOP) while a request's plan waits for its token view (the first
    ``/apply-template`` or ``/tokenize`` of the plan is the moment): the hung verdict ends the plan,
    and the client gets ocache's 503 with ``Retry-After``, not the view's own 120 s bound. After
    SIGCONT the next request is served. On the old code the hung verdict ended forwards only: the
    client waited for the view's 120 s timeout (this test's 60 s bound fails first)."""
    from ocache.tokens import TokenViewer

    srv = await asyncio.to_thread(start_server, "dense", n_parallel=1)
    real = TokenViewer.post
    stopped: list[str] = []

    async def stop_first(self, where, payload):
        if where == path and not stopped:
            stopped.append(where)
            os.kill(srv.proc.pid, signal.SIGSTOP)
        return await real(self, where, payload)

    monkeypatch.setattr(TokenViewer, "post", stop_first)
    async with proxy_on(srv.url, probe_interval_s=0.2, probe_timeout_s=0.5, hung_probes=2) as (base, proxy), \
            client() as c:
        try:
            async with c.post(base + "/v1/chat/completions", json=chat("a question"), timeout=60) as r:
                assert stopped == [path]
                assert r.status == 503 and r.headers["Retry-After"]
                assert "no answer to GET /health" in (await r.json())["error"]["message"]
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        await poll(lambda: proxy.upstream.state == "ready", timeout=60, what="ready again")
        async with c.post(base + "/v1/chat/completions", json=chat("another question")) as r:
            assert r.status == 200
