"""The token view of a request is bounded (``view_timeout_s``) and fails open, whoever else the
server is serving.

A second ocache's first request in front of a llama-server answering another ocache waited 121.5 s:
``/tokenize`` got no answer until the viewer's 120 s HTTP timeout, then the request was forwarded as
sent anyway. A server that does not answer the view is a fake here (``tests/test_proxy.py``
``FakeUpstream``: ``/apply-template`` and ``/tokenize`` held until the client gives up, ``GET /slots``
and the completion answered), with the bound set low in the proxy's config. On the old code the
request waits for the 120 s HTTP timeout: the test's own 60 s bound on it fails.
"""

from __future__ import annotations

import asyncio
import json

from aiohttp import web
from aiohttp.test_utils import TestServer

from fakes import until
from test_hardening_proxy import chat, proxy_on
from test_proxy import FakeUpstream, client

#: seconds the test waits for any one answer (far above the bound under test, below the old 120 s)
BOUND_S = 60


class BusyView(FakeUpstream):
    """A llama-server busy for the view: every ``/apply-template`` and ``/tokenize`` is held (counted
    in ``held``; ``abandoned`` counts those the client closed)."""

    def __init__(self) -> None:
        super().__init__()
        self.held = 0
        self.abandoned = 0
        self.app.router._frozen = False
        self.app.router.add_post("/apply-template", self.hold)
        self.app.router.add_post("/tokenize", self.hold)
        self.app.router.add_get("/slots", self.slots)

    async def hold(self, request):
        self.held += 1
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.abandoned += 1
            raise
        return web.json_response({})

    async def slots(self, request):
        return web.json_response([{"id": 0, "n_ctx": 4096, "is_processing": True, "id_task": 7}])


async def first_request(**cfg) -> tuple[int, dict, dict, BusyView, float | None]:
    """One chat request through a fresh ocache (config ``cfg``) in front of :class:`BusyView`:
    its status, headers, the body the fake got, the fake, and the viewer's bound. Every wait is
    bounded (``BOUND_S``), and the view calls it abandoned are closed before it returns."""
    fake = BusyView()
    server = TestServer(fake.app, host="127.0.0.1")
    await server.start_server()
    url = f"http://127.0.0.1:{server.port}"
    try:
        async with proxy_on(url, probe_interval_s=60, **cfg) as (base, proxy), client() as c:
            body = chat("hello from the second ocache")

            async def ask():
                async with c.post(base + "/v1/chat/completions", json=body) as r:
                    return r.status, dict(r.headers), await r.json()

            status, headers, data = await asyncio.wait_for(ask(), BOUND_S)
            assert status == 200, data
            assert fake.held >= 1                      # the view was asked and never answered
            assert json.loads(fake.seen[-1]["body"]) == body   # forwarded as sent: no slot pinned
            assert proxy.layer.viewer.counters["view_timeouts"] >= 1
            await until(lambda: fake.abandoned == fake.held, "the abandoned view calls closed")
            return status, headers, body, fake, proxy.layer.viewer.view_timeout_s
    finally:
        await server.close()


async def test_a_first_request_whose_view_gets_no_answer_is_forwarded_as_sent():
    _status, headers, _body, _fake, bound = await first_request(view_timeout_s=0.3)
    assert headers.get("X-OCache-Fail-Open") == "plan", headers
    assert bound == 0.3
