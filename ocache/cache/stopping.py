"""Stopping: a planned stop's last steps on the layer (``OCacheLayer.quiesce``, ``drain``), each
bounded in seconds."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ocache.cache.ports import PlanningServices

log = logging.getLogger("ocache.cache")


async def quiesce(layer: PlanningServices, timeout_s: float) -> int:
    """The last step before llama-server is stopped: ``OCacheLayer.begin_stop``, then wait (at most
    ``timeout_s`` seconds in all) for background work and for every slot call in flight, so
    that no connection of ocache's waits on the server's task queue when it gets SIGTERM
    (llama-server does not exit while a client waits for a task's result: it polls the client
    every ``HTTP_POLLING_SECONDS``, tools/server/server-context.cpp:40, server-queue.cpp:550-560;
    README "Limitations"). Returns the slot calls still in flight (0 when none)."""
    layer.begin_stop()
    deadline = time.monotonic() + timeout_s
    await layer.background.wait(deadline - time.monotonic())
    if layer.table is None:
        return 0
    return await layer.table.wait_calls(max(0.0, deadline - time.monotonic()))


async def drain(layer: PlanningServices) -> None:
    """Planned stop: finish background work, then every tier's drain step (by default its
    ``before_evict`` on each live conversation; the session tier spills each once, commits and
    writes its resume marker).

    Abandoned (cancelled, counted ``drain_abandoned``, logged) once the server is seen down
    (``Upstream.wait_down``) or after the config's ``drain_timeout_s`` seconds: a
    llama-server stopped together with ocache ends its task queue at SIGTERM while its HTTP
    threads still read requests on open connections, so a slot save sent on one of ocache's
    pooled connections is never answered (measured: ``kill -TERM`` of both at once left both
    running until ocache was killed; the slot call's own bound is ``SlotTable`` ``timeout_s``,
    3,600 s), and llama-server does not exit while that client waits (README "Limitations").
    What was not spilled by then is lost, as it would be without ocache."""
    timeout_s = getattr(layer.config, "drain_timeout_s", None)
    work = asyncio.ensure_future(drain_tiers(layer))
    wait_down = getattr(layer.upstream, "wait_down", None)
    down = asyncio.ensure_future(wait_down()) if wait_down is not None else None
    try:
        await asyncio.wait([t for t in (work, down) if t is not None], timeout=timeout_s,
                           return_when=asyncio.FIRST_COMPLETED)
    finally:
        if down is not None:
            down.cancel()
    if not work.done():
        why = ("llama-server went down" if down is not None and down.done() and not down.cancelled()
               else f"not finished in {timeout_s:g} s (drain_timeout_s)")
        log.warning("drain abandoned: %s; the slot calls in flight will not be answered, "
                    "conversations not spilled yet are not kept", why)
        layer.counters["drain_abandoned"] = layer.counters.get("drain_abandoned", 0) + 1
        work.cancel()
        await asyncio.wait([work], timeout=5.0)   # cancelled slot calls close their connections
        return
    work.result()


async def drain_tiers(layer: PlanningServices) -> None:
    """Background work finished, then every tier's ``on_drain`` (a failure is logged)."""
    await layer.idle()
    if layer.table is None:
        return
    for tier in layer.tiers:
        try:
            await tier.on_drain(layer.table)
        except Exception:
            log.exception("tier %s on_drain failed", tier.name)
