"""Run a llama-server child process: used by the test harness, benchmarks and ``serve --launch``.

The server is started with explicit flags (nothing the cache depends on is left to defaults that
nothing reports back, ``docs/llama-server.md`` §16), on a loopback port, and is stopped
by PID. ``wait_ready`` polls ``/health`` until it answers 200 (while the model loads every route
answers 503 "Loading model", docs/llama-server.md §16).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that was free on ``host`` a moment ago (bind to port 0, read, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerError(RuntimeError):
    """llama-server exited or did not become healthy; the message carries its log tail."""


def stop_process_group(proc: subprocess.Popen, timeout: float) -> None:
    """Stop a child started with ``start_new_session=True``: SIGTERM to its process group, then
    SIGKILL after ``timeout`` seconds; nothing when it has ended already."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@dataclass
class LlamaServer:
    """One llama-server process.

    ``args`` are extra command-line flags appended after the ones built here. ``n_parallel`` is ``-np``
    (explicit, so the KV is non-unified per slot, docs/llama-server.md §9); ``ctx_size`` is the *total* context in
    tokens (``-c``; each slot gets ``ctx_size / n_parallel``). ``threads`` defaults to 1: on a 2-core
    machine a second busy process makes ``-t 2`` collapse (``docs/decisions.md`` D6).
    """

    binary: Path
    model: Path
    host: str = "127.0.0.1"
    port: int = 0
    n_parallel: int = 1
    ctx_size: int = 16384
    slot_save_path: Path | None = None
    threads: int = 1
    ubatch: int = 512
    batch: int = 2048
    ctx_checkpoints: int = 32
    checkpoint_min_step: int = 1024
    flash_attn: str = "off"
    cache_ram: int = 0
    api_key: str | None = None
    metrics: bool = True
    args: list[str] = field(default_factory=list)
    log_path: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    def __post_init__(self) -> None:
        if not self.port:
            self.port = free_port(self.host)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        """The full argv this server runs with."""
        cmd = [
            str(self.binary), "-m", str(self.model), "--host", self.host, "--port", str(self.port),
            "-np", str(self.n_parallel), "-c", str(self.ctx_size), "-t", str(self.threads),
            "-tb", str(self.threads), "-ub", str(self.ubatch), "-b", str(self.batch),
            "--ctx-checkpoints", str(self.ctx_checkpoints),
            "--checkpoint-min-step", str(self.checkpoint_min_step),
            "-fa", self.flash_attn, "--cache-ram", str(self.cache_ram), "--jinja", "--no-webui",
            # every size is explicit here; --fit (default on) would load the model a second time
            # to probe device memory, doubling start-up (measured on the tiny models)
            "-fit", "off",
        ]
        if self.metrics:
            cmd.append("--metrics")
        if self.slot_save_path is not None:
            Path(self.slot_save_path).mkdir(parents=True, exist_ok=True)
            cmd += ["--slot-save-path", str(self.slot_save_path)]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        return cmd + list(self.args)

    def start(self, timeout: float = 120.0) -> "LlamaServer":
        """Start the process and wait until ``/health`` answers 200. Raises ServerError."""
        if self.proc and self.proc.poll() is None:
            raise ServerError("already running")
        log = open(self.log_path, "ab") if self.log_path else None
        env = {**os.environ, **self.env}
        self.proc = subprocess.Popen(self.command(), stdout=log if log is not None else subprocess.DEVNULL,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                     start_new_session=True)
        if log is not None:
            log.close()
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        delay = 0.02
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise ServerError(f"llama-server exited with {self.proc.returncode}\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(delay)  # polling a child process's readiness, not synchronising tests
            delay = min(delay * 1.5, 0.25)
        raise ServerError(f"llama-server not healthy after {timeout} s\n{self.log_tail()}")

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` seconds; idempotent."""
        if self.proc is not None:
            stop_process_group(self.proc, timeout)

    def kill(self) -> None:
        """SIGKILL at once (a crash, for fault tests)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def restart(self, timeout: float = 120.0) -> "LlamaServer":
        """Stop and start again on the same port with the same flags (a new process: slots empty)."""
        self.stop()
        return self.start(timeout)

    def log_tail(self, n: int = 40) -> str:
        if not self.log_path or not Path(self.log_path).exists():
            return ""
        return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-n:])
