"""End to end with the real clients: opencode (and pi) → ``ocache serve`` → the real llama-server.

The clients are installed from the npm registry (pinned, cached outside the checkout:
``ocache/clients.py``) and run unmodified with a temp HOME; only their provider's base URL points
at ocache. The tiny generated model answers random text, so each run is one agent turn (plus
opencode's title request) and the client stops; what matters is the requests it sent and how much
of each prompt llama-server found cached.

Per issue 8 item 5: two runs in one project folder and one in another; the second and third runs'
agent turns must be served from the warm harness head: ``cache_n >= head tokens - one ubatch``.
The head size is computed here independently of the cache layer, with the fingerprint module's
``harness_head`` and the token view (``/apply-template`` + ``/tokenize`` of the same server).
The request records come from ``ocache serve --record`` (``ocache/record.py``). The tests skip only
when npm reports that the registry is unreachable (the npm error code is printed).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from ocache import clients
from ocache.server import free_port

pytestmark = [pytest.mark.server, pytest.mark.slow]

#: Server shape: opencode's agent turn is ~7-8k tokens (tools + system prompt), so 16k per slot;
#: two slots so the title request and the agent turn (sent in parallel) do not evict each other.
N_PARALLEL = 2
CTX_TOTAL = 32768
UBATCH = 512
#: Generation cap (tokens) both in the client configs and on the server (``-n``).
MAX_OUTPUT = 64
RUN_TIMEOUT_S = 300.0


def _install(client: clients.NpmClient) -> Path:
    t0 = time.monotonic()
    try:
        path = clients.install(client)
    except clients.RegistryUnreachable as exc:
        pytest.skip(f"npm registry unreachable ({exc.code}); cannot install {client.spec}:\n{exc}")
    took = time.monotonic() - t0
    print(f"\n{client.spec}: {path} (this call {took:.1f} s; install took "
          f"{clients.install_seconds(client)} s)")
    return path


@pytest.fixture(scope="module")
def opencode_bin() -> Path:
    return _install(clients.OPENCODE)


@pytest.fixture(scope="module")
def pi_bin() -> Path:
    return _install(clients.PI)


class OcacheProcess:
    """``python -m ocache serve`` as a child process (stopped by PID with SIGTERM)."""

    def __init__(self, upstream: str, workdir: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.record_dir = workdir / "record"
        self.log_path = workdir / "ocache.log"
        env = {**os.environ, "OCACHE_CACHE_DIR": str(workdir / "cache")}  # anchors stay in tmp
        cmd = [sys.executable, "-m", "ocache", "serve", "--upstream", upstream,
               "--port", str(self.port), "--record", str(self.record_dir)]
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, cwd=workdir,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ocache serve exited with {self.proc.returncode}\n{self.log_tail()}")
            try:
                self.stats()
                return
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.1)  # polling a child's readiness, not synchronising the test
        raise RuntimeError(f"ocache serve not answering after {timeout} s\n{self.log_tail()}")

    def stats(self) -> dict:
        with urllib.request.urlopen(self.url + "/v1/cache/stats", timeout=5) as resp:
            return json.loads(resp.read())

    def records(self) -> list[dict]:
        from ocache.record import iter_stream

        out: list[dict] = []
        for f in sorted(self.record_dir.glob("stream-*.jsonl")):
            out.extend(iter_stream(f))
        return sorted(out, key=lambda r: (r["t"], r["seq"]))

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


@pytest.fixture
def stack(start_server, tmp_path):
    """(llama-server, ocache in front of it): the dense tiny model, 2 slots of 16k tokens."""
    srv = start_server("dense", n_parallel=N_PARALLEL, ctx_size=CTX_TOTAL, ubatch=UBATCH,
                       args=["-n", str(MAX_OUTPUT)])
    proxy = OcacheProcess(srv.url, tmp_path)
    try:
        proxy.wait_ready()
        yield srv, proxy
    finally:
        proxy.stop()
        print(f"\n--- ocache log tail\n{proxy.log_tail(30)}")


def _wait_recorded(proxy: OcacheProcess, n: int, timeout: float = 30.0) -> list[dict]:
    """The records once at least ``n`` completions are written (the proxy records after the
    response, off the client's path, so the last one can trail the client's exit)."""
    deadline = time.monotonic() + timeout
    recs = proxy.records()
    while len(recs) < n and time.monotonic() < deadline:
        time.sleep(0.1)  # polling a file another process appends to
        recs = proxy.records()
    return recs


def _head_tokens(llama_url: str, records: list[dict]) -> dict[int, int | None]:
    """seq → head tokens of each agent-turn record (None: no head found), via the token view."""
    from ocache.fingerprint import harness_head
    from ocache.tokens import TokenViewer

    async def go() -> dict[int, int | None]:
        viewer = TokenViewer(llama_url)
        try:
            out = {}
            for r in records:
                head = harness_head(r["body"])
                view = await viewer.view(r["path"], r["body"], head)
                out[r["seq"]] = view.head_end
            return out
        finally:
            await viewer.close()

    return asyncio.run(go())


def _agent_turns(records: list[dict]) -> list[dict]:
    """The first agent turn (a body with tools) of each opencode session, in run order."""
    firsts: dict[str, dict] = {}
    for r in records:
        if r["body"].get("tools") and r.get("session") and r["session"] not in firsts:
            firsts[r["session"]] = r
    return list(firsts.values())


def _report(label: str, runs: list[clients.ClientRun], turns: list[dict], heads: dict) -> str:
    lines = [f"{label}: run seconds " + ", ".join(f"{r.seconds:.1f}" for r in runs)]
    for i, r in enumerate(turns, 1):
        o = r["obs"]["timings"] or {}
        plan_h = (r.get("plan") or {}).get("headers") or {}
        lines.append(f"  run {i} agent turn: prompt tokens {o.get('prompt_n', 0) + o.get('cache_n', 0)}"
                     f" cache_n {o.get('cache_n')} prompt_n {o.get('prompt_n')} head "
                     f"{heads.get(r['seq'])} tier {plan_h.get('X-OCache-Tier')} "
                     f"ttft {r['obs'].get('ttft_s')}")
    return "\n".join(lines)


def _check_warm(turns: list[dict], heads: dict, report: str) -> None:
    assert len(turns) == 3, f"expected one agent turn per run, got {len(turns)}\n{report}"
    for i, r in enumerate(turns[1:], 2):
        head = heads[r["seq"]]
        assert head is not None and head > UBATCH, f"run {i}: no harness head found\n{report}"
        t = r["obs"]["timings"]
        assert r["obs"]["status"] == 200 and t, f"run {i}: no timings\n{report}"
        assert t["cache_n"] >= head - UBATCH, (
            f"run {i}: agent turn not served from the warm head: cache_n {t['cache_n']} < head "
            f"{head} - ubatch {UBATCH}\n{report}")


def _check_runs(runs: list[clients.ClientRun]) -> None:
    for run in runs:
        assert not run.timed_out and run.returncode == 0, run.describe()


def test_opencode_runs_are_served_from_the_warm_head(opencode_bin, stack, tmp_path):
    srv, proxy = stack
    home, proj_a, proj_b = tmp_path / "home", tmp_path / "proj-a", tmp_path / "proj-b"
    for d in (home, proj_a, proj_b):
        d.mkdir()
    env = clients.isolated_env(home)
    for proj in (proj_a, proj_b):
        clients.write_opencode_config(proj, proxy.url + "/v1", context_tokens=CTX_TOTAL // N_PARALLEL,
                                      output_tokens=MAX_OUTPUT)
    runs = []
    for proj in (proj_a, proj_a, proj_b):
        runs.append(clients.run_opencode(opencode_bin, proj, "list the files here", env,
                                         timeout=RUN_TIMEOUT_S))
        _check_runs(runs[-1:])
    # each run: a title request + at least one agent turn
    records = _wait_recorded(proxy, 6)
    turns = _agent_turns(records)
    heads = _head_tokens(srv.url, turns)
    report = _report("opencode", runs, turns, heads)
    print("\n" + report)
    assert {r["session"] for r in turns} == {r["session"] for r in records if r.get("session")}, report
    assert all(r["headers"].get("user-agent", "").startswith("opencode/") for r in turns), report
    _check_warm(turns, heads, report)
    stats = proxy.stats()
    assert stats["tokens"]["cache_n"] >= sum(heads[r["seq"]] - UBATCH for r in turns[1:]), stats


def test_pi_runs_are_served_from_the_warm_head(pi_bin, stack, tmp_path):
    srv, proxy = stack
    home, proj_a, proj_b = tmp_path / "home", tmp_path / "proj-a", tmp_path / "proj-b"
    for d in (home, proj_a, proj_b):
        d.mkdir()
    env = clients.isolated_env(home)
    clients.write_pi_models(home, proxy.url + "/v1", context_tokens=CTX_TOTAL // N_PARALLEL,
                            output_tokens=MAX_OUTPUT)
    runs = []
    for proj in (proj_a, proj_a, proj_b):
        runs.append(clients.run_pi(pi_bin, proj, "list the files here", env, timeout=RUN_TIMEOUT_S))
        _check_runs(runs[-1:])
    records = _wait_recorded(proxy, 3)
    # pi sends no session header: one run = one agent turn here (random text, no tool call)
    turns = [r for r in records if r["body"].get("tools")]
    heads = _head_tokens(srv.url, turns)
    report = _report("pi", runs, turns, heads)
    print("\n" + report)
    assert len(turns) == 3, report
    _check_warm(turns, heads, report)
