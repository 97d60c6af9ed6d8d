"""``ocache serve``'s run: the launched llama-server(s) if any, the proxy listening, a planned stop.

``serve`` starts the children of ``--launch`` (one
``Supervisor`` each, ``launch_replicas``), wires their start/exit/give-up events to the proxy's
upstreams, listens, and on SIGTERM/SIGINT (or ``stop``) stops accepting, drains, and only after the
proxy closed (``Proxy.close``: quiesce) stops the children (README "Limitations").
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import TYPE_CHECKING, Any, Callable

from aiohttp import web

from ocache.config import Config
from ocache.proxy import RUNNER_KWARGS, Proxy
from ocache.upstream import Upstream, UpstreamPort

if TYPE_CHECKING:
    from ocache.supervisor import Supervisor

log = logging.getLogger("ocache.proxy")



def _signals(stop: asyncio.Event, handle: bool) -> list[signal.Signals]:
    """SIGTERM and SIGINT set ``stop`` (when ``handle``); the signals whose handlers were added."""
    loop = asyncio.get_running_loop()
    added = []
    if handle:
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, stop.set)
                added.append(sig)
            except (NotImplementedError, RuntimeError):
                pass
    return added


async def _launch(config: Config, stop: asyncio.Event, supervisors: list[Supervisor]) -> None:
    """Start ``launch_replicas`` llama-server children of ``config.launch`` (appended to
    ``supervisors`` as they are made, so that the caller stops them on any exit), and point
    ``config.upstream``/``upstreams`` at them. Raises ``supervisor.LaunchError``."""
    from ocache.llama.flags import given_flags
    from ocache.paths import state_root
    from ocache.supervisor import LaunchError, Supervisor

    n = config.launch_replicas
    if n > 1 and given_flags(list(config.launch)).get("port") is not None:
        raise LaunchError("launch_replicas > 1 gives each child its own free port: remove "
                          "--port from the llama-server arguments")
    for i in range(n):
        kw: dict[str, dict[str, str]] = {}
        if config.launch_devices:
            kw["env"] = {"CUDA_VISIBLE_DEVICES": config.launch_devices[i % len(config.launch_devices)]}
        # the child's stdout+stderr: where a failed start explains itself (tail logged on exit)
        sup = Supervisor(config.launch, binary=config.launch_binary,
                         log_path=state_root() / ("llama-server.log" if n == 1
                                                  else f"llama-server-{i}.log"),
                         max_quick_failures=config.launch_max_failures,
                         backend=config.launch_backend, env=kw.get("env"))
        sup.on_give_up = stop.set  # a child that cannot start: stop, exit non-zero
        supervisors.append(sup)
    config.upstream = supervisors[0].url
    if n > 1:
        config.upstreams = [s.url for s in supervisors]
    for sup in supervisors:
        await sup.start()


def _wire(proxy: Proxy, supervisors: list[Supervisor], stop: asyncio.Event) -> None:
    """Each child's events to its upstream: a start probes it, an exit holds requests for the next
    child (not 503), a give-up answers the held requests 503 and stops ocache."""
    def give_up(sup: Supervisor, up: Upstream) -> Callable[[], None]:
        def gave_up() -> None:
            up.restart_abandoned(sup.gave_up_why or "")
            stop.set()
        return gave_up

    for sup, up in zip(supervisors, proxy.upstreams):
        sup.on_start = up.poke
        sup.on_exit = up.expect_restart
        sup.on_give_up = give_up(sup, up)
        sup.calls_inflight = proxy.calls_inflight   # recorded when SIGTERM is sent


async def _listen(proxy: Proxy, config: Config) -> tuple[web.AppRunner, web.TCPSite, int]:
    """The proxy's app listening on ``config.host:port``: (runner, site, the bound port; it differs
    from ``config.port`` when that is 0 and the OS picked one). Raises OSError if the address is
    taken."""
    runner = web.AppRunner(proxy.make_app(), handler_cancellation=True,
                           shutdown_timeout=config.drain_timeout_s,
                           keepalive_timeout=config.client_keepalive_s, **RUNNER_KWARGS)
    try:
        await runner.setup()
        site = web.TCPSite(runner, config.host, config.port)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    port = next((a[1] for a in runner.addresses if isinstance(a, tuple)), config.port)
    log.info("ocache listening on http://%s:%d -> %s", config.host, port,
             ", ".join(config.upstreams) if len(config.upstreams) > 1 else config.upstream)
    if config.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s, not loopback: anyone who can reach this port can use the "
                    "model%s", config.host, "" if config.admin_token else " (and no admin_token is set)")
    return runner, site, port


async def serve(config: Config, stop: asyncio.Event | None = None,
                ready: Callable[[Proxy, int], None] | None = None,
                layer_factory: Callable[[UpstreamPort, Config], Any] | None = None,
                handle_signals: bool = True) -> None:
    """Run the proxy until SIGTERM/SIGINT (or ``stop`` is set); then stop accepting, drain in-flight
    requests (``drain_timeout_s``), call ``layer.drain()``, and stop the launched child if any.
    ``ready(proxy, port)`` is called once listening. Raises OSError if the address is taken,
    ``supervisor.LaunchError`` if the child cannot be started."""
    from ocache.supervisor import LaunchError

    stop = stop or asyncio.Event()
    signals = _signals(stop, handle_signals)
    supervisors: list[Supervisor] = []
    runner = None
    try:
        if config.launch:
            await _launch(config, stop, supervisors)
        proxy = Proxy(config, layer_factory=layer_factory,
                      pid_source=supervisors[0].pid if supervisors else None,
                      pid_sources=[s.pid for s in supervisors] or None)
        proxy.stop_event = stop
        _wire(proxy, supervisors, stop)
        runner, site, port = await _listen(proxy, config)
        if ready:
            ready(proxy, port)
        await stop.wait()
        proxy.begin_stop()   # no more background GET /slots: the drain's own calls are awaited
        failed = next((s.failed for s in supervisors if s.failed), None)
        if failed:
            await site.stop()
            raise LaunchError(failed)
        log.info("stopping: no new connections, draining %d in-flight request(s)", proxy.inflight)
        await site.stop()
        await proxy.drain(config.drain_timeout_s)
    finally:
        if runner is not None:
            # cancels what is still in flight, then Proxy.close: quiesce (the monitors, the
            # reconciles, every slot call answered, bounded) and the connections closed; only then
            # does a launched llama-server get SIGTERM (README "Limitations")
            await runner.cleanup()
        for sup in supervisors:
            await sup.stop()
        loop = asyncio.get_running_loop()
        for sig in signals:
            loop.remove_signal_handler(sig)
        log.info("ocache stopped")
