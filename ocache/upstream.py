"""The upstream llama-server as the proxy knows it: its URL, one shared HTTP client session, whether
it is reachable, and which *process* it is (the epoch).

Restart detection uses what the server itself reports, never timing guesses
(docs/llama-server.md §5):

* ``/metrics`` response header ``Process-Start-Time-Unix`` (server-context.cpp, handle_metrics):
  despite its name it is ``ggml_time_us()`` at init (CLOCK_MONOTONIC µs), an opaque boot id that
  changes on every restart; needs ``--metrics``;
* ``/props.build_info`` (a different binary is a different process);
* ``id_task`` in ``GET /slots``: task ids restart from 0 in a new process, so a smaller maximum than
  seen before means a restart (used only when the boot id is unavailable: ``/slots`` wakes a
  sleeping server);
* the PID, when ocache launched the server itself (``supervisor.py``);
* ``X-Llama-Server-Boot``, a header of every answer of the patched build (patches/0005): 64 random
  bits drawn at start, decisive when both probes have it.

If none of these is available and the server was seen unreachable in between, the reappearance is
treated as a restart (the conservative choice: resident assumptions are dropped).

Probing is *shared*: ``probe()`` starts one ``GET /health`` (bounded by ``probe_timeout_s``) and
every caller that comes while it runs awaits that same probe; ``check(wait_s)`` waits for it at
most ``wait_s`` and, while the upstream is known to be hung (its last probe timed out), not at all.
llama-server answers ``/health`` without the task queue, even while it is busy or sleeping
(tools/server/server-context.cpp:5012-5023, ``create_response(true)``), so a probe that times out
means a stopped or hung process, not a long prefill (every request gets an HTTP thread: a pool of
``n_threads_http`` fixed plus up to 1024 dynamic threads, server-http.cpp:162-166 and 572-574).
When the upstream becomes hung, the ``on_hung`` callbacks run (the proxy ends the forwards in
flight: their answers would never come).

An upstream that answers HTTP but is not llama-server (``/health`` neither 200 ``{"status": "ok"}``
nor 503 "Loading model", tools/server/server-http.cpp:307-327; or a ``/props`` that is not
llama-server's) is in state ``"foreign"``: reported once in the log, and the proxy forwards to it
without the cache layer.

Generations in flight: the proxy brackets every completion request (accepted, before its plan ->
last byte relayed) with ``generation()``; ``quiet(timeout_s)`` waits until none is in flight. Background
work that asks the server for CPU but is on no request's path (the token view's full-render check,
ocache/tokens.py) waits for it, so it does not run on the server's cores while a slot decodes: on a
2-core machine a 32k-token ``/apply-template`` (60-160 ms of the server's CPU) overlapping a
64-token answer made its ``predicted_ms`` longer (``scripts/bench-decode``, README "Measured").

Epochs count from 1 (the first process seen); ``epoch == 0`` means the upstream has never been
reachable. Each change after the first calls the registered restart callbacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import asdict, dataclass, replace
from typing import Awaitable, Callable, Iterator, Protocol

import aiohttp

# the patched build's process id header (patches/0005); what llama-server's answers mean
from ocache.background import cancel_and_wait
from ocache.llama.slot_api import BOOT_HEADER, is_llama_props, is_loading, json_or_none

log = logging.getLogger("ocache.upstream")


class UpstreamPort(Protocol):
    """One llama-server as the cache half reads it (``OCacheLayer``, ``TokenViewer``, the router's
    ``Server``): ``Upstream`` is one, ``tests/fakes.py``'s ``FakeUpstream`` another.

    ``base_url``: where it answers; ``api_key``: its ``--api-key`` (None: none); ``session``: the
    shared HTTP session (None: the reader opens its own); ``epoch``: counts the server's restarts
    (a new one voids what was known of the old process); ``props``: its last ``/props`` (None
    before the first probe). Readers take what else ``Upstream`` has (``boot``, ``probe``,
    ``state``, ``on_restart``, ...) with ``getattr``/``hasattr`` and a default."""

    @property
    def base_url(self) -> str: ...

    @property
    def api_key(self) -> str | None: ...

    @property
    def session(self) -> aiohttp.ClientSession | None: ...

    @property
    def epoch(self) -> int: ...

    @property
    def props(self) -> dict | None: ...


#: How often the monitor probes while the upstream is unreachable (seconds).
DOWN_PROBE_INTERVAL_S = 0.25


@dataclass(frozen=True)
class BootId:
    """What identifies one upstream process; None = not available from this server."""

    start_time: str | None = None     # /metrics header Process-Start-Time-Unix
    build_info: str | None = None     # /props build_info
    pid: int | None = None            # launched child's PID
    boot: str | None = None           # X-Llama-Server-Boot of /health (patches/0005)

    def __str__(self) -> str:
        """For log lines: ``build b1-0c1e570+ocache.4c2c8b9c, started 1796120425, pid 27309``."""
        parts = [f"build {self.build_info}" if self.build_info else "build unknown"]
        if self.start_time:
            parts.append(f"started {self.start_time}")
        if self.pid is not None:
            parts.append(f"pid {self.pid}")
        if self.boot:
            parts.append(f"boot {self.boot}")
        return ", ".join(parts)


class Upstream:
    """One llama-server behind the proxy.

    ``session`` is the shared aiohttp ClientSession (created by ``start()``; the cache layer uses it
    for its own calls; the proxy forwards through it with ``auto_decompress=False``). ``props`` is the
    last ``/props`` JSON (None before the first successful probe). ``state`` is ``"down"``
    (connection refused / unreachable / no answer to ``hung_probes`` ``/health`` requests in a row,
    ``probe_timeout_s`` each: then ``hung`` is True), ``"loading"`` (``/health`` answers 503 while the model loads), ``"ready"``
    or ``"foreign"`` (not llama-server; ``foreign_reason`` says why).
    """

    def __init__(self, base_url: str, api_key: str | None = None, probe_interval_s: float = 2.0,
                 pid_source: Callable[[], int | None] | None = None,
                 probe_timeout_s: float = 5.0, hung_probes: int = 3) -> None:
        self.base_url = base_url.rstrip("/")
        self.hung_probes = max(1, int(hung_probes))
        self.api_key = api_key
        self.probe_interval_s = probe_interval_s
        self.probe_timeout_s = probe_timeout_s
        self.pid_source = pid_source
        self.session: aiohttp.ClientSession | None = None
        self.state = "down"
        self.epoch = 0
        self.restarts = 0
        self.boot: BootId | None = None
        self.max_task: int | None = None
        self.props: dict | None = None
        self.last_error: str | None = None
        self.last_probe: float | None = None
        self.epoch_started: float | None = None
        self.hung = False
        #: the supervisor saw the server it launched exit and is starting another
        #: (``expect_restart``); cleared once a process is ready again or the supervisor gives up.
        #: While set, a request that finds the upstream down is held for the new process
        #: (``Attempts._upstream_state``) instead of answered 503
        self.restarting = False
        self.foreign_reason: str | None = None
        self.probes = 0
        self.missed_probes = 0             # /health requests of the probes that got no answer in time
        self._seen_down = False
        self._callbacks: list[Callable[[], Awaitable[None]]] = []
        self._hung_callbacks: list[Callable[[str], None]] = []
        self._probe_task: asyncio.Task | None = None
        self._ready = asyncio.Event()
        self._down = asyncio.Event()       # set while the state is "down" (unreachable or hung)
        self._abandoned = asyncio.Event()  # set once the supervisor gave up restarting the server
        #: why the supervisor gave up (``restart_abandoned``; e.g. "llama-server exited with 1 5
        #: times in a row within 5 s of starting"), None while it has not
        self.abandoned_why: str | None = None
        self._down.set()
        self._wake = asyncio.Event()
        self.generating = 0                # completions forwarded and not yet fully relayed
        self._quiet = asyncio.Event()      # set while ``generating`` is 0
        self._quiet.set()
        self._background: set[asyncio.Task] = set()  # ocache's own server work off any request's path
        self._monitor: asyncio.Task | None = None

    # --- lifecycle ------------------------------------------------------------------------------
    async def start(self, monitor: bool = True) -> None:
        """Create the client session, probe once, start the background monitor."""
        if self.session is None:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0, ttl_dns_cache=300)
            self.session = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10.0),
            )
        await self.probe()
        if monitor and self._monitor is None:
            self._monitor = asyncio.create_task(self._run_monitor(), name="ocache-upstream-monitor")

    async def stop_monitor(self, timeout_s: float) -> bool:
        """A planned stop: end the background monitor after the probe it is running (each of its
        steps is bounded by ``probe_timeout_s``; ``GET /metrics`` waits in llama-server's task queue
        like ``GET /slots``), waiting at most ``timeout_s`` seconds, then cancel what is left.
        Returns True when no probe was left in flight."""
        clean = True
        for task in (self._monitor, self._probe_task):   # the monitor first: it starts no new probe
            if task is None or task.done():
                continue
            if task is self._monitor:
                task.cancel()   # it only waits between probes; the probe itself is the shared task
            else:
                done, _ = await asyncio.wait([task], timeout=timeout_s)
                if not done:
                    clean = False
                    task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._monitor = None
        return clean

    def probe_inflight(self) -> bool:
        """Whether a probe (``/health``, ``/metrics``, ``/props``) is waiting for the server."""
        return self._probe_task is not None and not self._probe_task.done()

    async def close(self) -> None:
        if self._probe_task is not None and not self._probe_task.done():
            self._probe_task.cancel()
            try:
                await self._probe_task
            except (asyncio.CancelledError, Exception):
                pass
        if self._monitor is not None:
            await cancel_and_wait(self._monitor)
            self._monitor = None
        if self.session is not None:
            await self.session.close()
            self.session = None

    def on_restart(self, callback: Callable[[], Awaitable[None]]) -> None:
        """Register ``async callback()`` run when a new upstream process is detected."""
        self._callbacks.append(callback)

    @property
    def up(self) -> bool:
        return self.state != "down"

    def url(self, path: str) -> str:
        return self.base_url + path

    def _set_state(self, state: str) -> None:
        self.state = state
        if state == "ready":
            self.restarting = False
            self._ready.set()
        else:
            self._ready.clear()
        if state == "down":
            self._down.set()
        else:
            self._down.clear()

    def _set_down(self, error: str, hung: bool) -> None:
        became_hung = hung and not (self.state == "down" and self.hung)
        if self.state != "down" or self.hung != hung:
            log.warning("upstream %s %s: %s", self.base_url, "not answering" if hung else "unreachable",
                        error)
        self._set_state("down")
        self.hung = hung
        self._seen_down = True
        self.last_error = error
        if became_hung:
            for cb in list(self._hung_callbacks):
                try:
                    cb(error)
                except Exception:
                    log.exception("upstream hung callback failed")

    def on_hung(self, callback: Callable[[str], None]) -> None:
        """Register ``callback(reason)``, run (synchronously) when the upstream stops answering."""
        self._hung_callbacks.append(callback)

    def expect_restart(self, why: str) -> None:
        """The supervisor (ocache/supervisor.py) saw the server it launched exit and is starting
        another: down now (before a probe notices), and ``restarting`` until a new process is ready
        or :meth:`restart_abandoned`."""
        self.restarting = True
        self._abandoned.clear()
        self.abandoned_why = None
        self._set_down(why, False)
        self._wake.set()

    def restart_abandoned(self, why: str = "") -> None:
        """The supervisor gave up restarting the server (``why``: the child's exits, kept in
        ``abandoned_why``): requests are no longer held for it, and those held now (``wait_ready``)
        are let go at once (they get ocache's 503) instead of waiting out their ``loading_wait_s``."""
        self.restarting = False
        self.abandoned_why = why or "the supervisor gave up restarting llama-server"
        self._abandoned.set()

    def notify_unreachable(self, error: str, hung: bool = False) -> None:
        """The proxy could not connect (or, ``hung``, got no answer in time): mark down and let the
        monitor probe at the fast rate."""
        self._set_down(error, hung)
        self._wake.set()

    async def wait_down(self) -> None:
        """Return once the state is ``"down"`` (a probe could not connect or got no answer in
        ``probe_timeout_s``: what is in flight to the server may never be answered). Unbounded:
        callers race it against the work it guards (``OCacheLayer.drain``)."""
        await self._down.wait()

    async def wait_ready(self, timeout: float) -> bool:
        """Wait until the state is ``"ready"``, at most ``timeout`` seconds; True if it is. Returns
        False at once when the supervisor gave up (``abandoned_why`` says why)."""
        if self.state == "ready":
            return True
        if self._abandoned.is_set() and self.state == "down":
            return False  # the supervisor gave up: no server is coming
        self._wake.set()
        ready = asyncio.ensure_future(self._ready.wait())
        abandoned = asyncio.ensure_future(self._abandoned.wait())
        try:
            await asyncio.wait({ready, abandoned}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
            abandoned.cancel()
        return self.state == "ready"

    async def check(self, wait_s: float) -> str:
        """The state after the shared probe, waiting for it at most ``wait_s`` seconds (not at all
        while the upstream is known hung: the probe then runs in the background)."""
        task = self._shared_probe()
        if not (self.state == "down" and self.hung):
            await asyncio.wait({task}, timeout=wait_s)
        return self.state

    @contextlib.contextmanager
    def generation(self) -> Iterator[None]:
        """Bracket one completion request, from its arrival (before the plan) to its last byte
        relayed or its failure; concurrent uses count."""
        self.generating += 1
        self._quiet.clear()
        try:
            yield
        finally:
            self.generating -= 1
            if self.generating <= 0:
                self.generating = 0
                self._quiet.set()

    async def quiet(self, timeout_s: float) -> bool:
        """Wait until no completion is in flight (``generation``), at most ``timeout_s`` seconds;
        True if none is."""
        if self.generating == 0:
            return True
        try:
            await asyncio.wait_for(self._quiet.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass
        return self.generating == 0

    def track_background(self, task: asyncio.Task) -> None:
        """Count ``task`` (server work on no request's path, e.g. a render check) in
        ``to_dict()["background"]`` until it is done."""
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def poke(self) -> None:
        """Probe soon (e.g. the supervisor just started a new child)."""
        self._wake.set()

    # --- probing --------------------------------------------------------------------------------
    @property
    def _http(self) -> aiohttp.ClientSession:
        """The shared session; RuntimeError before ``start()`` (or after ``close()``)."""
        if self.session is None:
            raise RuntimeError(f"upstream {self.base_url}: start() was not called")
        return self.session

    def auth_headers(self) -> dict[str, str]:
        """The ``Authorization`` header of the server's ``--api-key`` (config ``upstream_api_key``)
        for ocache's own requests to it; empty without a key."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _shared_probe(self) -> asyncio.Task:
        task = self._probe_task
        if task is None or task.done():
            task = self._probe_task = asyncio.get_running_loop().create_task(
                self._probe_once(), name="ocache-upstream-probe")
        return task

    async def probe(self) -> str:
        """Check reachability and identity (one probe shared by every caller that comes while it
        runs); returns the state. Runs restart callbacks when the process changed. Never raises for
        upstream problems (they set ``state``/``last_error``); each step is bounded by
        ``probe_timeout_s``."""
        assert self.session is not None, "start() first"
        return await asyncio.shield(self._shared_probe())

    async def _probe_once(self) -> str:
        """One shared probe: ``GET /health`` up to ``hung_probes`` times in a row while it gets no
        answer in ``probe_timeout_s`` (the hung verdict needs every one of them missed: one slow
        answer on a loaded machine once cut a healthy generation; the verdict comes
        after at most ``hung_probes * probe_timeout_s`` seconds), then the identity."""
        self.last_probe = time.time()
        self.probes += 1
        timeout = aiohttp.ClientTimeout(total=self.probe_timeout_s)
        tries = 1 if self.state == "down" and self.hung else self.hung_probes  # known hung: one try
        for attempt in range(1, tries + 1):
            try:
                async with self._http.get(self.url("/health"), timeout=timeout) as r:
                    body = await r.read()
                    health = r.status
                    ctype = r.headers.get("Content-Type", "")
                    boot_id = r.headers.get(BOOT_HEADER)
                break
            except asyncio.TimeoutError:
                self.missed_probes += 1
                if attempt < tries:
                    log.info("upstream %s: no answer to GET /health in %g s (%d of %d before the hung "
                             "verdict)", self.base_url, self.probe_timeout_s, attempt, tries)
                    continue
                self._set_down(f"no answer to GET /health in {self.probe_timeout_s:g} s, {tries} "
                               "time(s) in a row (stopped or hung; llama-server answers /health at "
                               "once)", hung=True)
                return self.state
            except (aiohttp.ClientError, OSError) as exc:
                self._set_down(f"{type(exc).__name__}: {exc}", hung=False)
                return self.state
        self.hung = False
        health_json = json_or_none(body)
        if health == 503 and is_loading(health_json):
            # 503 "Loading model" (server-http.cpp:307-327): the process is there, not ready yet.
            if self.state != "loading":
                log.info("upstream %s is up, loading its model (health 503)", self.base_url)
            self._set_state("loading")
            return self.state
        if health != 200 or not (isinstance(health_json, dict) and health_json.get("status") == "ok"):
            return self._set_foreign(f"GET /health answered {health} {ctype or 'no content type'}, "
                                     "not llama-server's {\"status\": \"ok\"}")
        boot, max_task, props_status = await self._identity()
        if boot_id:
            boot = replace(boot, boot=boot_id)
        if props_status == 200 and not is_llama_props(self.props):
            return self._set_foreign("GET /props is not llama-server's (no build_info / total_slots)")
        if props_status == 404:
            return self._set_foreign("GET /props answered 404 (llama-server always has /props)")
        was = self.state
        self._set_state("ready")
        self.last_error = None
        self.foreign_reason = None
        if was != "ready":
            log.info("upstream %s ready (%s)", self.base_url, boot)
        await self._check_epoch(boot, max_task)
        return self.state

    def _set_foreign(self, reason: str) -> str:
        if self.state != "foreign":
            log.error("upstream %s is not llama-server (%s): forwarding to it without the cache "
                      "layer; check --upstream", self.base_url, reason)
        self._set_state("foreign")
        self.foreign_reason = reason
        self.last_error = f"not llama-server: {reason}"
        return self.state

    async def _identity(self) -> tuple[BootId, int | None, int | None]:
        """(boot id, max ``id_task`` or None, ``/props`` HTTP status or None)."""
        start_time = build_info = None
        max_task = props_status = None
        timeout = aiohttp.ClientTimeout(total=max(self.probe_timeout_s, 5.0))
        try:
            async with self._http.get(self.url("/metrics"), headers=self.auth_headers(),
                                        timeout=timeout) as r:
                await r.read()
                if r.status == 200:
                    start_time = r.headers.get("Process-Start-Time-Unix")
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            pass
        try:
            async with self._http.get(self.url("/props"), headers=self.auth_headers(),
                                        timeout=timeout) as r:
                props_status = r.status
                data = await r.read()
                if r.status == 200:
                    props = json_or_none(data)
                    if isinstance(props, dict):
                        self.props = props
                        build_info = props.get("build_info")
                    else:
                        self.props = None
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
            pass
        if start_time is None:
            try:
                async with self._http.get(self.url("/slots"), headers=self.auth_headers(),
                                            timeout=timeout) as r:
                    if r.status == 200:
                        slots = await r.json(content_type=None)
                        ids: list[int] = [i for i in (s.get("id_task") for s in slots if isinstance(s, dict))
                                          if isinstance(i, int)]
                        max_task = max(ids) if ids else -1
                    else:
                        await r.read()
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
                pass
        pid = self.pid_source() if self.pid_source else None
        return BootId(start_time, build_info, pid), max_task, props_status

    async def _check_epoch(self, boot: BootId, max_task: int | None) -> None:
        prev, prev_task = self.boot, self.max_task
        self.boot = boot
        if max_task is not None:
            self.max_task = max_task if prev_task is None else max(max_task, prev_task)
        seen_down, self._seen_down = self._seen_down, False
        if prev is None:
            self.epoch = 1
            self.epoch_started = time.time()
            return
        reason = _restart_reason(prev, boot, prev_task, max_task, seen_down)
        if reason is None:
            return
        self.epoch += 1
        self.restarts += 1
        self.epoch_started = time.time()
        self.max_task = max_task
        log.warning("upstream %s restarted (%s): epoch %d", self.base_url, reason, self.epoch)
        for cb in list(self._callbacks):
            try:
                await cb()
            except Exception:
                log.exception("upstream restart callback failed")

    async def _run_monitor(self) -> None:
        while True:
            interval = (self.probe_interval_s if self.state in ("ready", "foreign")
                        else DOWN_PROBE_INTERVAL_S)
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=interval)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            try:
                await self.probe()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("upstream probe failed")

    def to_dict(self) -> dict:
        return {
            "url": self.base_url,
            "state": self.state,
            "hung": self.hung,
            "foreign": self.foreign_reason,
            "probes": self.probes,
            "missed_probes": self.missed_probes,
            "epoch": self.epoch,
            "restarts": self.restarts,
            "boot": asdict(self.boot) if self.boot else None,
            "build_info": (self.props or {}).get("build_info"),
            "total_slots": (self.props or {}).get("total_slots"),
            "last_error": self.last_error,
            "epoch_started": self.epoch_started,
            "generating": self.generating,
            "background": len(self._background),
        }


def _restart_reason(prev: BootId, new: BootId, prev_task: int | None, new_task: int | None,
                    seen_down: bool) -> str | None:
    """Why ``new`` is a different process than ``prev`` (None: the same process)."""
    if prev.boot is not None and new.boot is not None:
        # the patched build's own process id (patches/0005): decisive either way
        return f"boot id {prev.boot} -> {new.boot}" if prev.boot != new.boot else None
    if prev.pid is not None and new.pid is not None and prev.pid != new.pid:
        return f"pid {prev.pid} -> {new.pid}"
    if prev.start_time is not None and new.start_time is not None:
        if prev.start_time != new.start_time:
            return f"start time {prev.start_time} -> {new.start_time}"
        strong = True
    else:
        strong = prev.pid is not None and new.pid is not None
    if prev.build_info and new.build_info and prev.build_info != new.build_info:
        return f"build {prev.build_info} -> {new.build_info}"
    if strong:
        return None
    if prev_task is not None and new_task is not None and new_task < prev_task:
        return f"task ids went back ({prev_task} -> {new_task})"
    if seen_down:
        return "was unreachable and no boot id is available"
    return None
