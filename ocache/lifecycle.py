"""The proxy's life: start, planned stop, close (``Lifecycle``, the base of ``ocache.proxy.Proxy``).

A planned stop (SIGTERM, ``POST /v1/cache/drain``: ``ocache/serving.py``) runs ``begin_stop``
(no more background work against the server), ``drain`` (in-flight requests, their release and
observe tasks, ``layer.drain()``), then ``close``: ``quiesce`` (each upstream's monitor, ocache's
own slot calls, bounded by ``QUIESCE_S``) and the connections. Only then does a launched
llama-server get SIGTERM (README "Limitations": llama-server does not exit while one of ocache's
``GET /slots`` waits in its task queue).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Coroutine

from aiohttp import web

from ocache.background import Background
from ocache.config import Config
from ocache.stats import Stats
from ocache.upstream import Upstream, UpstreamPort

if TYPE_CHECKING:
    from ocache.admin import AdminRoutes
    from ocache.forward import Forwards
    from ocache.record import Recorder

log = logging.getLogger("ocache.proxy")

#: seconds a stop waits for ocache's own calls to llama-server still in flight (``quiesce``): a
#: ``GET /slots`` waits in the server's task queue for at most one batch step; a probe is bounded
#: by ``probe_timeout_s`` (5 s)
QUIESCE_S = 10.0


class Lifecycle:
    """Start, stop and background tasks of the proxy; the request path is ``Proxy``'s."""

    config: Config
    upstreams: list[Upstream]
    server_configs: list[Config] | None
    layer: Any
    stats: Stats
    inflight: int
    recorder: Recorder | None
    admin: AdminRoutes
    forwards: Forwards
    _layer_factory: Callable[[UpstreamPort, Config], Any]
    _monitor: bool
    _idle: asyncio.Event
    background: Background

    @property
    def upstream(self) -> Upstream:
        raise NotImplementedError

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raise NotImplementedError

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=int(self.config.max_body_mb * (1 << 20)),
                              middlewares=[self.admin.guard])
        app.router.add_route("*", "/{tail:.*}", self.handle)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        await self.start()

    async def _on_cleanup(self, app: web.Application) -> None:
        await self.close()

    async def start(self) -> None:
        """Start the upstream(s) (probe, monitor), the recorder if configured, and the cache layer
        (one ``layer_factory`` layer, or ``ocache.router.Router`` over one per server)."""
        from ocache.dashboard import install_event_log

        install_event_log()  # the dashboard's event list (ocache/dashboard.py)
        if self.config.record_dir:
            from ocache.record import Recorder

            self.recorder = Recorder(self.config.record_dir, redact=self.config.record_redact)
        await asyncio.gather(*(up.start(monitor=self._monitor) for up in self.upstreams))
        if len(self.upstreams) > 1:
            from ocache.router import Router

            self.layer = Router(self.upstreams, self.config, self._layer_factory,
                                configs=self.server_configs)
        else:
            self.layer = self._layer_factory(self.upstream, self.config)
        self.upstreams[0].on_restart(self._on_upstream_restart)
        for up in self.upstreams[1:]:
            up.on_restart(self._count_restart)
        for up in self.upstreams:
            up.on_hung(self._on_hung(up))
        log.info("ocache proxy -> %s (%s, layer %s)",
                 ", ".join(u.base_url for u in self.upstreams),
                 ", ".join(u.state for u in self.upstreams), type(self.layer).__name__)

    def _on_hung(self, up: Upstream) -> Callable[[str], None]:
        """``up``'s hung callback: end the forwards in flight to it (``Forwards.abort``)."""
        def hung(reason: str) -> None:
            self.forwards.abort(reason, up)
        return hung

    async def _count_restart(self) -> None:
        self.stats.upstream_restart()

    def begin_stop(self) -> None:
        """A planned stop began: the layer starts no more background work against the server
        (``layer.begin_stop``: no ``GET /slots`` reconcile after a response); in-flight requests and
        the drain still run."""
        fn = getattr(self.layer, "begin_stop", None)
        if fn is not None:
            fn()

    def calls_inflight(self) -> int:
        """ocache's own calls to the server(s) not answered yet: the layer's slot calls plus the
        probes in flight (0 when nothing of ocache's waits on llama-server's task queue)."""
        fn = getattr(self.layer, "calls_inflight", None)
        n = int(fn()) if fn is not None else 0
        return n + sum(1 for up in self.upstreams if up.probe_inflight())

    async def quiesce(self, timeout_s: float = QUIESCE_S) -> int:
        """The last step of a stop, before the connections close and a launched child gets SIGTERM
        (README "Limitations": llama-server does not exit while one of ocache's ``GET /slots`` waits
        in its task queue): ``begin_stop``, end each upstream's monitor after its running probe,
        wait for the release/observe tasks, then ``layer.quiesce`` (background work and slot calls
        in flight), all within ``timeout_s`` seconds (an upstream known to be hung is not waited
        for). Returns :meth:`calls_inflight` after it (0: nothing of ocache's is left waiting). Idempotent."""
        self.begin_stop()
        deadline = time.monotonic() + timeout_s
        hung = any(up.hung for up in self.upstreams)
        bound = 0.0 if hung else timeout_s
        for up in self.upstreams:
            await up.stop_monitor(max(0.0, min(bound, deadline - time.monotonic())))
        await self.background.wait(deadline - time.monotonic())
        fn = getattr(self.layer, "quiesce", None)
        if fn is not None:
            try:
                await fn(max(0.0, min(bound, deadline - time.monotonic())))
            except Exception:
                self.stats.layer_error("quiesce")
                log.exception("cache layer quiesce() failed")
        left = self.calls_inflight()
        if left:
            log.warning("stopping with %d call(s) of ocache's still waiting on llama-server", left)
        return left

    async def close(self) -> None:
        """``quiesce``, the background tasks, then every upstream's connections and the recorder."""
        await self.quiesce()
        await self.wait_background()
        for up in self.upstreams:
            await up.close()
        if self.recorder is not None:
            self.recorder.close()

    async def _on_upstream_restart(self) -> None:
        self.stats.upstream_restart()
        try:
            await self.layer.on_upstream_restart()
        except Exception:
            self.stats.layer_error("on_upstream_restart")
            log.exception("cache layer on_upstream_restart() failed")

    async def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no request is in flight; False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def wait_background(self) -> None:
        """Wait for pending release()/observe() tasks."""
        await self.background.join()

    async def drain(self, timeout: float) -> None:
        """Planned stop: wait for in-flight requests (up to ``timeout`` s), their observe() tasks,
        then ``layer.drain()``."""
        if not await self.wait_idle(timeout):
            log.warning("drain: %d request(s) still in flight after %.0f s", self.inflight, timeout)
        await self.wait_background()
        try:
            await self.layer.drain()
        except Exception:
            self.stats.layer_error("drain")
            log.exception("cache layer drain() failed")

    def spawn(self, coro: Coroutine[Any, Any, Any], what: str = "request") -> asyncio.Task[Any]:
        """Run ``coro`` in the background (the task, named ``proxy:what``: ``Background.spawn``);
        ``wait_background`` and a stop wait for it."""
        return self.background.spawn(coro, what)

