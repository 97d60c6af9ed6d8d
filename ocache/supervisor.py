"""``ocache serve --launch -- <llama-server args>``: run llama-server as a child of the proxy.

The supervisor starts the server with the given arguments (on a free loopback port unless the
arguments name ``--host``/``--port``), restarts it when it dies (with a backoff of 0.5 s doubling to
10 s, reset after 30 s of uptime), reports its PID to ``Upstream`` (a new PID is a new epoch), and
stops it on shutdown (SIGTERM to its process group, SIGKILL after ``stop_timeout`` seconds). On Linux
the child also gets SIGTERM when ocache itself dies without a shutdown (kill -9, a crash:
``PR_SET_PDEATHSIG``, prctl(2)), so it never outlives ocache holding its port and memory.

A child that cannot start (missing model, bad flag, port in use) exits within seconds each time:
after ``max_quick_failures`` such exits in a row (``Config.launch_max_failures``, default 5) the
supervisor gives up, sets ``failed`` and calls ``on_give_up``; ``ocache serve`` then stops and exits
with status 1, printing the last child's log tail (each child's lines are told apart by the log
offset at its start: earlier children's lines are never mixed in).

The binary is ``Config.launch_binary`` if set, else the first argument if it is an executable file
(``--launch -- /path/llama-server -m ...``), else the patched engine build of ``Config.launch_backend`` (``ocache.toolchain.engine.find``).
``--metrics`` is added when absent so that restart detection can read the boot id
(docs/llama-server.md §5).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from pathlib import Path
from typing import BinaryIO, Callable

from ocache.background import cancel_and_wait
from ocache.llama.flags import given_flags
from ocache.llama.server import free_port

log = logging.getLogger("ocache.supervisor")

#: prctl(2) option: the signal the calling process gets when its parent thread dies
_PR_SET_PDEATHSIG = 1


def _die_with_parent_fn():
    """A ``preexec_fn`` that asks the kernel to send the child SIGTERM when ocache dies (Linux:
    prctl(PR_SET_PDEATHSIG)), or None elsewhere. libc's ``prctl`` is looked up here, before the
    fork, so the child only makes one C call before exec."""
    if not os.uname().sysname == "Linux":
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    sig = int(signal.SIGTERM)

    def _set() -> None:
        prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)

    return _set


class LaunchError(RuntimeError):
    """The server cannot be launched (no binary, bad arguments); the message says why."""


def resolve_binary(args: list[str], binary: str | None, backend: str = "cpu") -> tuple[str, list[str]]:
    """(binary path, remaining args); without ``binary`` or an executable first argument, the
    patched engine build of ``backend`` (config ``launch_backend``). Raises LaunchError when no
    llama-server can be found."""
    if binary:
        return binary, list(args)
    if args and not args[0].startswith("-") and os.path.isfile(args[0]) and os.access(args[0], os.X_OK):
        return args[0], list(args[1:])
    from ocache.toolchain import engine

    try:
        build = engine.find(stock=False, backend=backend)
    except engine.EngineError as exc:
        raise LaunchError(str(exc)) from exc
    if build is None:
        flag = "" if backend == "cpu" else f" --backend {backend}"
        raise LaunchError(f"no llama-server binary: build it with `ocache engine build{flag}`, or pass "
                          "its path as the first argument after `--launch --`")
    return str(build.binary), list(args)


class Supervisor:
    """One supervised llama-server child. ``url`` is where it listens."""

    def __init__(self, args: list[str], binary: str | None = None, log_path: Path | None = None,
                 stop_timeout: float = 20.0, max_quick_failures: int | None = None,
                 backend: str = "cpu", env: dict[str, str] | None = None) -> None:
        self.binary, self.args = resolve_binary(args, binary, backend)
        given = given_flags(self.args)
        host = given.get("host") or "127.0.0.1"
        port = given.get("port")
        if "host" not in given:
            self.args += ["--host", host]
        if port is None:
            port = free_port(host)
            self.args += ["--port", str(port)]
        if not given.get("metrics"):
            self.args.append("--metrics")
        #: ``--slot-save-path`` as given: llama-server refuses to start when it is not a directory
        #: (common/arg.cpp:3614-3619 of the pinned source, "not a directory"), so each start creates it first (mode 0700)
        self.slot_save_path: str | None = given.get("slot_save_path")
        self.url = f"http://{host}:{port}"
        #: extra environment of the child (e.g. ``CUDA_VISIBLE_DEVICES`` per replica), over ours
        self.env = dict(env) if env else None
        self.log_path = log_path
        self.stop_timeout = stop_timeout
        self.proc: asyncio.subprocess.Process | None = None
        self.starts = 0
        self._stopping = False
        self._task: asyncio.Task | None = None
        self.on_start: Callable[[], None] | None = None  # callable() run after each (re)start, e.g. Upstream.poke
        self.on_give_up: Callable[[], None] | None = None  # callable() run once when the supervisor stops restarting
        #: callable(why) run when the child exits and another will be started (Upstream.expect_restart)
        self.on_exit: Callable[[str], None] | None = None
        self.failed: str | None = None  # why it gave up (with the last child's log tail)
        #: why it gave up, in one line (the exit status and count), for ``Upstream.restart_abandoned``
        self.gave_up_why: str | None = None
        self._log_offset = 0
        #: callable() -> int: ocache's calls to the server still in flight (``Proxy.calls_inflight``),
        #: read when SIGTERM is sent; ``term_calls_inflight`` keeps that figure (None: not stopped
        #: yet or not known) and ``stop_s`` the seconds from SIGTERM to the child's exit
        self.calls_inflight: Callable[[], int] | None = None
        self.term_calls_inflight: int | None = None
        self.stop_s: float | None = None
        if max_quick_failures is not None:
            self.max_quick_failures = max_quick_failures

    #: consecutive exits within 5 s of a start after which the supervisor gives up (bad arguments)
    max_quick_failures = 5
    #: seconds before the first restart after an exit (doubling per quick failure, at most 10 s)
    restart_backoff_s = 0.5

    def log_tail(self, n: int = 8) -> str:
        """The last ``n`` lines the *current* child wrote to the log (its stdout and stderr; not
        those of earlier children), or "" without a log."""
        if not self.log_path:
            return ""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-n:])

    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.returncode is None else None

    def _make_slot_save_path(self) -> None:
        """Create ``--slot-save-path`` (and its parents, mode 0700) when it does not exist yet, so
        that the README's first ``--launch`` works on a fresh machine. A ``~`` path is left to the
        child (the shell expands it before ocache sees it). An OSError is logged; the child's own
        error then says why it cannot start."""
        path = self.slot_save_path
        if not path or path.startswith("~") or Path(path).is_dir():
            return
        try:
            Path(path).mkdir(mode=0o700, parents=True, exist_ok=True)
            log.info("created --slot-save-path %s (it did not exist)", path)
        except OSError as exc:
            log.warning("cannot create --slot-save-path %s: %s", path, exc)

    async def _spawn(self) -> asyncio.subprocess.Process:
        """Start one child (it becomes ``self.proc``) and return it. Raises LaunchError."""
        self._make_slot_save_path()
        log_file = open(self.log_path, "ab") if self.log_path else None
        out: BinaryIO | int = log_file if log_file is not None else asyncio.subprocess.DEVNULL
        if log_file is not None:
            self._log_offset = log_file.tell()  # this child's lines start here
        try:
            proc = await asyncio.create_subprocess_exec(
                self.binary, *self.args, stdin=asyncio.subprocess.DEVNULL, stdout=out,
                stderr=asyncio.subprocess.STDOUT, start_new_session=True,
                preexec_fn=_die_with_parent_fn(),
                env={**os.environ, **self.env} if self.env else None)
        except OSError as exc:
            raise LaunchError(f"cannot start {self.binary}: {exc}") from None
        finally:
            if log_file is not None:
                log_file.close()
        self.proc = proc
        self.starts += 1
        log.info("launched llama-server pid %d at %s: %s%s %s", proc.pid, self.url,
                 "".join(f"{k}={v} " for k, v in (self.env or {}).items()), self.binary,
                 " ".join(self.args))
        if self.on_start:
            self.on_start()
        return proc

    async def start(self) -> None:
        """Start the child and the watcher that restarts it. Raises LaunchError."""
        proc = await self._spawn()
        self._task = asyncio.create_task(self._watch(proc), name="ocache-supervisor")

    async def _watch(self, proc: asyncio.subprocess.Process) -> None:
        """Wait for ``proc`` to exit, then restart it (``self.proc`` stays the last started child;
        a failed restart leaves it, exited, to be counted as a quick failure)."""
        backoff = self.restart_backoff_s
        quick = 0
        while not self._stopping:
            started = time.monotonic()
            rc = await proc.wait()
            if self._stopping:
                return
            up_s = time.monotonic() - started
            if up_s > 30:
                backoff = self.restart_backoff_s
            quick = quick + 1 if up_s < 5 else 0
            tail = self.log_tail()
            if quick >= self.max_quick_failures:
                self.gave_up_why = (f"llama-server exited with {rc} {quick} times in a row within 5 s "
                                    "of starting; not restarting it")
                self.failed = (f"llama-server exited with {rc} {quick} times in a row within 5 s of "
                               f"starting; not restarting it again (fix its arguments: "
                               f"{self.binary} {' '.join(self.args)}). Last log lines of the last "
                               f"start ({self.log_path}):\n{tail}")
                log.error("%s", self.gave_up_why)
                if self.on_give_up:
                    self.on_give_up()
                return
            if self.on_exit:
                self.on_exit(f"the launched llama-server (pid {proc.pid}) exited with {rc}; "
                             f"starting another in {backoff:.1f} s")
            if quick:  # a start that failed: its log tail is printed once, if the supervisor gives up
                log.warning("llama-server pid %d exited with %s after %.1f s (%d of %d quick failures); "
                            "restarting in %.1f s", proc.pid, rc, up_s, quick,
                            self.max_quick_failures, backoff)
            else:
                log.warning("llama-server pid %d exited with %s after %.1f s; restarting in %.1f s. "
                            "Its last log lines (%s):\n%s", proc.pid, rc, up_s, backoff,
                            self.log_path, tail)
            await asyncio.sleep(backoff)  # restart backoff, not synchronisation
            backoff = min(backoff * 2, 10.0)
            if self._stopping:
                return
            try:
                proc = await self._spawn()
            except LaunchError:
                log.exception("restart failed")

    async def stop(self) -> None:
        """Stop the child: SIGTERM to its process group, SIGKILL after ``stop_timeout``. ``ocache
        serve`` calls it after ``Proxy.close`` (quiesce: no call of ocache's left waiting on the
        server, its connections closed)."""
        self._stopping = True
        if self._task is not None:
            await cancel_and_wait(self._task)
        p = self.proc
        if p is None or p.returncode is not None:
            return
        if self.calls_inflight is not None:
            try:
                self.term_calls_inflight = int(self.calls_inflight())
            except Exception:  # noqa: BLE001 - a figure for the log only
                self.term_calls_inflight = None
            if self.term_calls_inflight:
                # llama-server waits for a client whose task result is pending (it polls it every
                # HTTP_POLLING_SECONDS, tools/server/server-context.cpp:40): the exit may wait
                log.warning("SIGTERM to llama-server pid %d with %d call(s) of ocache's in flight",
                            p.pid, self.term_calls_inflight)
        t0 = time.monotonic()
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            await asyncio.wait_for(p.wait(), self.stop_timeout)
        except asyncio.TimeoutError:
            log.warning("llama-server pid %d ignored SIGTERM; killing", p.pid)
            os.killpg(p.pid, signal.SIGKILL)
            await p.wait()
        self.stop_s = time.monotonic() - t0
        log.info("llama-server pid %d stopped (%s) %.2f s after SIGTERM", p.pid, p.returncode, self.stop_s)
