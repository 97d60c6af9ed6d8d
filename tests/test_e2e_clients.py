"""End to end with the real clients: opencode (and pi) → ``ocache serve`` → the real llama-server.

The clients are installed from the npm registry (pinned, cached outside the checkout:
``ocache/toolchain/clients.py``) and run unmodified with a temp HOME; only their provider's base URL points
at ocache. The tiny generated model answers random text, so each run is one agent turn (plus
opencode's title request) and the client stops; what matters is the requests it sent and how much
of each prompt llama-server found cached.

The README "Measured" row for opencode: two runs in one project folder and one in another; the second and third runs'
agent turns must be served from the warm harness head: ``cache_n >= head tokens - one ubatch``.
The head size is computed here independently of the cache layer, with the fingerprint module's
``harness_head`` and the token view (``/apply-template`` + ``/tokenize`` of the same server).
The request records come from ``ocache serve --record`` (``ocache/record.py``). The tests skip only
when npm reports that the registry is unreachable (the npm error code is printed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from ocache.toolchain import clients
from ocache.llama.server import free_port, stop_process_group


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
        # deliberate: only a registry that cannot be reached skips (a registry that answers with an
        # error fails: test_registry_error_is_not_unreachable)
        pytest.skip(f"npm registry unreachable ({exc.code}); cannot install {client.spec}:\n{exc}")
    took = time.monotonic() - t0
    print(f"\n{client.spec}: {path} (this call {took:.1f} s; install took "
          f"{clients.install_seconds(client)} s)")
    return path


def _installed(client: clients.NpmClient, name: str):
    """A module fixture ``name``: the path of ``client``'s installed command (``_install``)."""
    @pytest.fixture(scope="module", name=name)
    def fixture() -> Path:
        return _install(client)
    return fixture


opencode_bin = _installed(clients.OPENCODE, "opencode_bin")
pi_bin = _installed(clients.PI, "pi_bin")
claude_bin = _installed(clients.CLAUDE, "claude_bin")
codex_bin = _installed(clients.CODEX, "codex_bin")


class OcacheProcess:
    """``python -m ocache serve`` as a child process (stopped by PID with SIGTERM)."""

    def __init__(self, upstream: str, workdir: Path, extra_args: tuple[str, ...] = (),
                 server_args: list[str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.record_dir = workdir / "record"
        self.log_path = workdir / "ocache.log"
        env = {**os.environ, "OCACHE_CACHE_DIR": str(workdir / "cache")}  # anchors stay in tmp
        if server_args is not None:
            # the server's flags, as a user tells them in ocache.yaml (README): the slot-save path
            # is what lets ocache verify the files it restores (head files included)
            env["OCACHE_TIERS"] = json.dumps({"resident": {"server_args": server_args}})
        cmd = [sys.executable, "-m", "ocache", "serve", "--upstream", upstream,
               "--port", str(self.port), "--record", str(self.record_dir), *extra_args]
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
        stop_process_group(self.proc, 30)
        self.log.close()


@pytest.fixture
def stack(start_server, tmp_path, request):
    """(llama-server, ocache in front of it): the dense tiny model, 2 slots of 16k tokens.
    Indirect parameter ``"no-cache"``: ocache forwards untouched (``serve --no-cache``)."""
    srv = start_server("dense", n_parallel=N_PARALLEL, ctx_size=CTX_TOTAL, ubatch=UBATCH,
                       args=["-n", str(MAX_OUTPUT)])
    mode = getattr(request, "param", "cache")
    proxy = OcacheProcess(srv.url, tmp_path, ("--no-cache",) if mode == "no-cache" else (),
                          server_args=srv.command()[1:])
    try:
        proxy.wait_ready()
        yield srv, proxy
    finally:
        proxy.stop()
        print(f"\n--- ocache log tail\n{proxy.log_tail(30)}")


def _wait_recorded(proxy: OcacheProcess, done, timeout: float = 30.0) -> list[dict]:
    """The records once ``done(records)`` holds and every completion ocache had finished by then
    is among them (the proxy records after the response, off the client's path, so the last
    record can trail the client's exit); the last read if that never happens."""
    deadline = time.monotonic() + timeout
    recs = proxy.records()
    while not done(recs) and time.monotonic() < deadline:
        time.sleep(0.1)  # polling a file another process appends to
        recs = proxy.records()
    finished = _completed(proxy)
    while len(recs) < finished and time.monotonic() < deadline:
        time.sleep(0.1)
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


def _report(label: str, runs: list[clients.ClientRun], turns: list[dict], heads: dict,
            stats: dict) -> str:
    lines = [f"{label}: run seconds " + ", ".join(f"{r.seconds:.1f}" for r in runs)]
    for i, r in enumerate(turns, 1):
        o = r["obs"]["timings"] or {}
        plan_h = (r.get("plan") or {}).get("headers") or {}
        lines.append(f"  run {i} agent turn: prompt tokens {o.get('prompt_n', 0) + o.get('cache_n', 0)}"
                     f" cache_n {o.get('cache_n')} prompt_n {o.get('prompt_n')} head "
                     f"{heads.get(r['seq'])} tier {plan_h.get('X-OCache-Tier')} predicted "
                     f"{plan_h.get('X-OCache-Predicted-Cache')} slot {r['plan'].get('body_updates')} "
                     f"ttft {r['obs'].get('ttft_s')}")
    layer = stats.get("layer") or {}
    lines.append(f"  stats: tokens {stats.get('tokens')} heads {layer.get('heads')} "
                 f"mispredictions {layer.get('recent_mispredictions')}")
    return "\n".join(lines)


def _check_requests(records: list[dict], report: str) -> None:
    """Every request reached the server and kept to the configured output cap."""
    for r in records:
        assert r["obs"]["status"] == 200, f"request {r['request_id']} answered {r['obs']['status']}\n{report}"
        cap = r["body"].get("max_tokens") or r["body"].get("max_completion_tokens")
        assert cap is not None and cap <= MAX_OUTPUT, (
            f"request {r['request_id']} asks for {cap} tokens (config cap {MAX_OUTPUT})\n{report}")


def _check_warm(turns: list[dict], heads: dict, stats: dict, report: str) -> None:
    """Runs 2.. were served from the warm head: cache_n >= head - one ubatch; and the cache layer's
    stats report that head."""
    for i, r in enumerate(turns[1:], 2):
        head = heads[r["seq"]]
        assert head is not None and head > UBATCH, f"run {i}: no harness head found\n{report}"
        t = r["obs"]["timings"]
        assert t, f"run {i}: no timings\n{report}"
        assert t["cache_n"] >= head - UBATCH, (
            f"run {i}: agent turn not served from the warm head: cache_n {t['cache_n']} < head "
            f"{head} - ubatch {UBATCH}\n{report}")
    layer_heads = {h["tokens"] for h in ((stats.get("layer") or {}).get("heads") or {}).values()}
    assert {heads[r["seq"]] for r in turns} <= layer_heads, (
        f"the cache layer's stats do not report the head sizes computed here\n{report}")


def _check_runs(runs: list[clients.ClientRun]) -> None:
    for run in runs:
        assert not run.timed_out and run.returncode == 0, run.describe()


def _opencode_runs(opencode_bin: Path, proxy: OcacheProcess, tmp_path: Path, folders: list[str],
                   between=None, prompts: list[str] | None = None
                   ) -> tuple[list[clients.ClientRun], list[dict]]:
    """``opencode run`` once per entry of ``folders`` (names of project folders under tmp_path,
    one temp HOME for all), calling ``between(i)`` before run ``i`` > 0; run ``i`` asks
    ``prompts[i]`` ("list the files here" without ``prompts``). Returns the runs and the proxy's
    records once every run's agent turn is recorded."""
    home = tmp_path / "home"
    home.mkdir()
    env = clients.isolated_env(home)
    for name in sorted(set(folders)):
        (tmp_path / name).mkdir()
        clients.write_opencode_config(tmp_path / name, proxy.url + "/v1",
                                      context_tokens=CTX_TOTAL // N_PARALLEL,
                                      output_tokens=MAX_OUTPUT)
    runs = []
    for i, name in enumerate(folders):
        if i and between is not None:
            between(i)
        prompt = prompts[i] if prompts else "list the files here"
        runs.append(clients.run_opencode(opencode_bin, tmp_path / name, prompt, env,
                                         timeout=RUN_TIMEOUT_S))
        _check_runs(runs[-1:])
    records = _wait_recorded(proxy, lambda recs: len(_agent_turns(recs)) >= len(folders))
    return runs, records


@pytest.mark.server
@pytest.mark.slow
def test_opencode_runs_are_served_from_the_warm_head(opencode_bin, stack, tmp_path):
    """The README "Measured" opencode row: run 1 in folder A (cold), run 2 in A, run 3 in folder B: runs 2 and 3 reuse the
    harness head (tools + base system prompt)."""
    srv, proxy = stack
    runs, records = _opencode_runs(opencode_bin, proxy, tmp_path, ["proj-a", "proj-a", "proj-b"])
    turns = _agent_turns(records)
    heads = _head_tokens(srv.url, turns)
    stats = proxy.stats()
    report = _report("opencode", runs, turns, heads, stats)
    print("\n" + report)
    assert len(turns) == 3, f"expected one agent turn per run\n{report}"
    assert all(r["headers"].get("user-agent", "").startswith("opencode/") for r in turns), report
    assert (tmp_path / "home" / ".local" / "share" / "opencode").is_dir(), "opencode ignored the temp HOME"
    _check_requests(records, report)
    _check_warm(turns, heads, stats, report)


@pytest.mark.server
@pytest.mark.slow
@pytest.mark.parametrize("stack", ["cache", "no-cache"], indirect=True)
def test_opencode_after_upstream_restart_resumes_from_the_saved_head(opencode_bin, stack, tmp_path,
                                                                    request):
    """llama-server restarts (slots empty) between run 1 in folder A and run 2 in folder B: ocache
    notices the new process and run 2 still starts from the head (its saved state). The control
    (``no-cache``: the same proxy forwarding untouched) shows that llama-server alone prefills the
    whole prompt there, so this scenario measures the cache layer, not the server."""
    srv, proxy = stack
    mode = request.node.callspec.params["stack"]

    runs, records = _opencode_runs(opencode_bin, proxy, tmp_path, ["proj-a", "proj-b"],
                                   lambda i: _restart_upstream(srv, proxy))
    turns = _agent_turns(records)
    heads = _head_tokens(srv.url, turns)
    stats = proxy.stats()
    report = _report(f"opencode, restart between runs ({mode})", runs, turns, heads, stats)
    print("\n" + report)
    assert len(turns) == 2, f"expected one agent turn per run\n{report}"
    _check_requests(records, report)
    if mode == "no-cache":
        head, cache_n = heads[turns[1]["seq"]], turns[1]["obs"]["timings"]["cache_n"]
        assert head is not None and cache_n < head - UBATCH, (
            f"without the cache layer run 2 was expected cold after the restart\n{report}")
    else:
        _check_warm(turns, heads, stats, report)


@pytest.mark.server
@pytest.mark.slow
def test_pi_runs_are_served_from_the_warm_head(pi_bin, stack, tmp_path):
    """The same for pi (no session header, no title request: one agent turn per run)."""
    srv, proxy = stack
    home = tmp_path / "home"
    home.mkdir()
    env = clients.isolated_env(home)
    clients.write_pi_models(home, proxy.url + "/v1", output_tokens=MAX_OUTPUT)
    runs = []
    for name in ("proj-a", "proj-a", "proj-b"):
        (tmp_path / name).mkdir(exist_ok=True)
        runs.append(clients.run_pi(pi_bin, tmp_path / name, "list the files here", env,
                                   timeout=RUN_TIMEOUT_S))
        _check_runs(runs[-1:])
    records = _wait_recorded(proxy, lambda recs: sum(bool(r["body"].get("tools")) for r in recs) >= 3)
    turns = [r for r in records if r["body"].get("tools")]
    heads = _head_tokens(srv.url, turns)
    stats = proxy.stats()
    report = _report("pi", runs, turns, heads, stats)
    print("\n" + report)
    assert len(turns) == 3 and len(records) == 3, f"expected one request per run\n{report}"
    assert all(r["headers"].get("user-agent", "").startswith("OpenAI/JS") for r in turns), report
    _check_requests(records, report)
    _check_warm(turns, heads, stats, report)


# --- the install helper itself (quick; the real npm against unreachable / failing registries) --

def test_second_install_does_not_run_npm(opencode_bin):
    """A completed install is found by its stamp: no npm call (a missing npm would fail)."""
    assert clients.install(clients.OPENCODE, npm="/nonexistent/npm") == opencode_bin
    assert opencode_bin.exists() and clients.install_seconds(clients.OPENCODE) > 0


def test_unreachable_registry_is_reported_as_such(tmp_path, monkeypatch):
    monkeypatch.setenv("OCACHE_CACHE_DIR", str(tmp_path / "cache"))
    dead = f"http://127.0.0.1:{free_port()}/"  # nothing listens there
    with pytest.raises(clients.RegistryUnreachable) as info:
        clients.install(clients.OPENCODE, timeout=120, extra_args=[
            "--registry", dead, "--fetch-retries", "0", "--cache", str(tmp_path / "npm-cache")])
    assert info.value.code == "ECONNREFUSED", str(info.value)
    assert clients.installed(clients.OPENCODE) is None
    assert not any(p.name.startswith(".opencode") and "tmp" in p.name
                   for p in clients.clients_dir().iterdir()), "a temporary install folder was left"


def test_registry_error_is_not_unreachable(tmp_path, monkeypatch):
    """A registry that answers (here: 404 for every package) is a failure, not a reason to skip."""
    from aiohttp import web

    monkeypatch.setenv("OCACHE_CACHE_DIR", str(tmp_path / "cache"))
    port = free_port()
    ready = threading.Event()
    stop: list = []

    def serve() -> None:
        async def not_found(request: web.Request) -> web.Response:
            return web.json_response({"error": "Not found"}, status=404)

        async def main() -> None:
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", not_found)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            done = asyncio.Event()
            stop.append((asyncio.get_running_loop(), done))
            ready.set()
            await done.wait()
            await runner.cleanup()

        asyncio.run(main())

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    assert ready.wait(10)
    try:
        with pytest.raises(clients.ClientInstallError) as info:
            clients.install(clients.OPENCODE, timeout=120,
                            extra_args=["--registry", f"http://127.0.0.1:{port}/", "--fetch-retries",
                                        "0", "--cache", str(tmp_path / "npm-cache")])
        assert not isinstance(info.value, clients.RegistryUnreachable), str(info.value)
        assert "E404" in str(info.value)
    finally:
        loop, done = stop[0]
        loop.call_soon_threadsafe(done.set)
        t.join(10)


def test_npm_error_code_parsing():
    assert clients.npm_error_code("npm error code ENOTFOUND\nnpm error syscall getaddrinfo") == "ENOTFOUND"
    assert clients.npm_error_code("npm ERR! code EAI_AGAIN\n") == "EAI_AGAIN"
    assert clients.npm_error_code("npm error network request failed") == "network"
    assert clients.npm_error_code("npm error code ETARGET\n") == "ETARGET"
    assert clients.npm_error_code("added 3 packages") is None
    assert clients.is_unreachable("ECONNREFUSED") and not clients.is_unreachable("ETARGET")


def _prompt_tokens_total(url: str) -> float:
    """llama-server's own prefill counter (``llamacpp:prompt_tokens_total`` on ``/metrics``)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("llamacpp:prompt_tokens_total"):
                return float(line.split()[-1])
    raise AssertionError("no llamacpp:prompt_tokens_total on /metrics")


# --- Claude Code and Codex CLI ---------------------------------------------------------------
#
# The hybrid tiny model, ONE slot (so the second folder's session really takes the slot of the
# first), the stock checkpoint spacing (--checkpoint-min-step 8192: plain llama-server then reuses
# nothing of another folder's prompt on a hybrid model, shared/fixtures README), and a logit bias
# that makes the random model end every answer at once with <|im_end|> (id 151645 in the tiny
# models' vocab): a clean, empty answer, so each client run is one turn plus Claude Code's fixed
# "no visible output" resend, the session history stays what the client itself sends back, and no
# run ends on a max_tokens error. ocache runs with the settings in ``_write_agent_config``: the disk
# tier off (its anchor splits prefill part of a request inside that request, so cache_n would count
# tokens paid for; tests/test_clients_routes.py measures reuse with every tier on, from the
# server's /metrics); everything else at its default.

AGENT_CTX = 16384
EOS_BIAS = ["--logit-bias", "151645+100", "-n", str(MAX_OUTPUT)]


def _write_agent_config(path: Path, srv) -> Path:
    import yaml

    path.write_text(yaml.safe_dump({
        "tiers": {"resident": {"server_args": srv.command()[1:]}, "disk": {"enabled": False}},
    }))
    return path


@pytest.fixture
def agent_stack(start_server, tmp_path, request):
    """(llama-server, ocache) for Claude Code / Codex; indirect ``"no-cache"`` as for ``stack``."""
    srv = start_server("hybrid", n_parallel=1, ctx_size=AGENT_CTX, ubatch=UBATCH,
                       checkpoint_min_step=8192, args=EOS_BIAS)
    mode = getattr(request, "param", "cache")
    cfg = _write_agent_config(tmp_path / "ocache.yaml", srv)
    extra = ("--config", str(cfg)) + (("--no-cache",) if mode == "no-cache" else ())
    proxy = OcacheProcess(srv.url, tmp_path, extra)
    try:
        proxy.wait_ready()
        yield srv, proxy, mode
    finally:
        proxy.stop()
        print(f"\n--- ocache log tail\n{proxy.log_tail(30)}")


def _two_folders_restart_between(srv, proxy: OcacheProcess, tmp_path: Path, plan, run):
    """Run a client per ``plan`` entry (folder name, prompt, extra), ``run(folder, prompt, extra)``,
    in the folders ``proj-a`` and ``proj-b`` (made here, a ``main.py`` each), llama-server restarted
    before the third run; each run must succeed and be recorded. Returns (the runs, the number of
    records before each run, the records)."""
    for name in ("proj-a", "proj-b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "main.py").write_text("print('hello')\n")
    runs, n_before = [], []
    for i, (folder, prompt, extra) in enumerate(plan):
        if i == 2:
            _restart_upstream(srv, proxy)
        n_before.append(_completed(proxy))
        runs.append(run(tmp_path / folder, prompt, extra))
        _check_runs(runs[-1:])
    total = _completed(proxy)
    records = _wait_recorded(proxy, lambda recs: len(recs) >= total)
    return runs, n_before, records


def _completed(proxy: OcacheProcess) -> int:
    """The completions ocache has finished (counted as each answer ends, before its record is
    written off the request's path: a run's last record can trail its client's exit)."""
    return sum(n for per in proxy.stats()["completions"].values() for n in per.values())


def _restart_upstream(srv, proxy: OcacheProcess) -> None:
    before = proxy.stats()["upstream_restarts"]
    srv.restart()
    deadline = time.monotonic() + 30
    while proxy.stats()["upstream_restarts"] <= before:  # the proxy's epoch probe
        assert time.monotonic() < deadline, "ocache did not notice the upstream restart"
        time.sleep(0.1)  # polling another process's state


def _n_prompt(rec: dict) -> int:
    t = rec["obs"]["timings"] or {}
    return int(t.get("cache_n", 0)) + int(t.get("prompt_n", 0))


def _agent_report(label: str, runs: list[clients.ClientRun], records: list[dict]) -> str:
    lines = [f"{label}: run seconds " + ", ".join(f"{r.seconds:.1f}" for r in runs)]
    for r in records:
        t = r["obs"]["timings"] or {}
        h = (r.get("plan") or {}).get("headers") or {}
        lines.append(f"  {r['path']} session {str(r.get('session'))[:12]} tokens {_n_prompt(r)} "
                     f"cache_n {t.get('cache_n')} prompt_n {t.get('prompt_n')} tier "
                     f"{h.get('X-OCache-Tier')} predicted {h.get('X-OCache-Predicted-Cache')} "
                     f"completed {r['obs'].get('completed')}")
    return "\n".join(lines)


def _first_of_each_run(records: list[dict], n_before: list[int]) -> list[dict]:
    """The first request of each run (``n_before[i]``: completions finished before run i), in the
    order ocache received them (``t``; records are written as answers end)."""
    received = sorted(records, key=lambda r: r["t"])
    return [received[n] for n in n_before]


def _agent_checks(mode: str, records: list[dict], firsts: list[dict], report: str,
                  head_min: int, alone_b: int | None = 0) -> None:
    """B's first request reuses the head (>= head_min; no-cache: the server alone reuses
    ``alone_b`` tokens, None: not checked); the continued session after the restart reuses >= 95 %
    of its previous prompt (no-cache: 0); with the cache every planned request's prediction is
    within one ubatch of cache_n."""
    for r in records:
        assert r["obs"]["status"] == 200, report
        assert r["obs"]["timings"], f"no timings observed for {r['request_id']}\n{report}"
    a_last = max((r for r in records if r["session"] == firsts[0]["session"] and r["t"] < firsts[1]["t"]),
                 key=lambda r: r["t"])
    b, cont = firsts[1], firsts[2]
    assert cont["session"] == firsts[0]["session"] != b["session"], report
    b_cache, c_cache = b["obs"]["timings"]["cache_n"], cont["obs"]["timings"]["cache_n"]
    if mode == "no-cache":
        assert c_cache == 0, report
        assert alone_b is None or b_cache == alone_b, report
        return
    assert b_cache >= head_min, report
    assert c_cache >= 0.95 * _n_prompt(a_last), report
    assert cont["plan"]["headers"]["X-OCache-Tier"] == "session", report
    for r in records:
        h = r["plan"]["headers"]
        assert "X-OCache-Predicted-Cache" in h, f"{r['request_id']} was not planned\n{report}"
        # the server's own cache_n counts ocache's split prefill of this request as reused; the
        # prediction is reuse from before the request (X-OCache-Split says how much was split)
        predicted = int(h["X-OCache-Predicted-Cache"]) + int(h.get("X-OCache-Split") or 0)
        assert abs(predicted - r["obs"]["timings"]["cache_n"]) <= UBATCH, report


def _titles(records: list[dict]) -> list[dict]:
    """opencode's title requests (no tools) in the order they arrived."""
    return [r for r in records if not r["body"].get("tools")]


def _prefilled(rec: dict) -> int:
    """The prompt tokens the server prefilled for a request as its client saw them (``prompt_n``;
    ocache's own split prefills are added back into it, ``ocache/api/figures.py``)."""
    return int(((rec.get("obs") or {}).get("timings") or {}).get("prompt_n") or 0)


def _side_by_side(opencode_bin: Path, start_server, tmp_path: Path, model: str, folders: list[str],
                  prompts: list[str] | None = None) -> tuple[dict, dict, str]:
    """The same ``opencode run`` sequence through ``ocache serve --no-cache`` (the server alone:
    forwarded untouched) and through ocache, each on its own identical fresh server. Returns the
    server's own prefill counter per mode (tokens, ocache's warm-ups and split prefills included),
    each mode's records, and a printable report."""
    totals: dict[str, float] = {}
    recs: dict[str, list[dict]] = {}
    reports = []
    for mode in ("direct", "ocache"):
        side = tmp_path / mode[:6]          # equal path lengths on both sides: same prompt sizes
        side.mkdir()
        srv = start_server(model, n_parallel=N_PARALLEL, ctx_size=CTX_TOTAL, ubatch=UBATCH,
                           args=["-n", str(MAX_OUTPUT)], slot_save_path=side / "slots",
                           log_path=side / "server.log")
        proxy = OcacheProcess(srv.url, side, ("--no-cache",) if mode == "direct" else ())
        try:
            proxy.wait_ready()
            before = _prompt_tokens_total(srv.url)
            runs, records = _opencode_runs(opencode_bin, proxy, side, folders, prompts=prompts)
            records = _wait_recorded(proxy, lambda rs: len(_titles(rs)) >= len(folders))
            totals[mode] = _prompt_tokens_total(srv.url) - before
            recs[mode] = records
            reports.append(f"{mode}: {totals[mode]:.0f} tokens prefilled over {len(records)} requests; "
                           + ", ".join(f"{'title ' if not r['body'].get('tools') else ''}{_prefilled(r)}"
                                       + (f" [{(r.get('plan') or {}).get('headers', {}).get('X-OCache-Tier')}]"
                                          if mode == "ocache" else "")
                                       for r in records))
        finally:
            proxy.stop()
            srv.stop()
    report = f"{model}, runs in {folders}:\n" + "\n".join(reports)
    if totals.get("direct"):
        report += f"\nocache / alone: {totals['ocache'] / totals['direct']:.3f}"
    return totals, recs, report


@pytest.mark.server
@pytest.mark.slow
@pytest.mark.parametrize("model", ["dense", "hybrid"])
def test_an_everyday_opencode_day_prefills_no_more_than_the_server_alone(opencode_bin, start_server,
                                                                         tmp_path, model):
    """Never worse than llama-server alone: three ``opencode run`` in one folder (each with
    its title request) and one in another, through ocache and, side by side, through ``ocache
    serve --no-cache`` (the server alone) on a second identical server. The server's own prefill
    counter with ocache (its warm-ups and split prefills included) is at most the server alone's
    (it read 8,028 vs 7,972, 1.007, on the dense model before guests were priced)."""
    totals, _recs, report = _side_by_side(opencode_bin, start_server, tmp_path, model,
                                          ["proj-a", "proj-a", "proj-a", "proj-b"])
    print("\n" + report)
    assert totals["direct"] > 0, report
    assert totals["ocache"] <= totals["direct"], report


#: Six prompts a user might give six ``opencode run`` in one project
SIX_PROMPTS = ["list the files here", "what does main.py do?", "explain util.py in two lines",
               "add a docstring to main.py", "is there a test for util.py?", "summarise the README"]


@pytest.mark.server
@pytest.mark.slow
def test_everyday_repeated_opencode_runs_in_one_folder_never_lose_the_title(opencode_bin, start_server,
                                                                          tmp_path):
    """Six ``opencode run`` in one folder, one after the other, each with its own prompt,
    no restart, on the tiny hybrid model, ocache vs the server alone side by side. Before guests
    were priced the next run's agent turn took the title's slot for a disk restore and every later
    title was prefilled in full (9,158 vs 8,360 reported by a new user). Now: the total at most the
    server alone's, and every title request prefills no more than the same run's title alone."""
    totals, recs, report = _side_by_side(opencode_bin, start_server, tmp_path, "hybrid",
                                         ["proj"] * len(SIX_PROMPTS), prompts=SIX_PROMPTS)
    print("\n" + report)
    assert totals["direct"] > 0, report
    mine, alone = _titles(recs["ocache"]), _titles(recs["direct"])
    assert len(mine) == len(alone) == len(SIX_PROMPTS), report
    for i, (m, a) in enumerate(zip(mine, alone), 1):
        assert _prefilled(m) <= _prefilled(a), f"run {i}'s title: {_prefilled(m)} vs {_prefilled(a)}\n{report}"
    assert totals["ocache"] <= totals["direct"], report


@pytest.mark.server
@pytest.mark.slow
@pytest.mark.parametrize("agent_stack", ["cache", "no-cache"], indirect=True)
def test_claude_code_two_folders_restart_continue(claude_bin, agent_stack, tmp_path, models_tiny):
    """Real Claude Code 2.1.328: ``claude -p`` in folder A, in folder B, llama-server restarts,
    ``claude --continue -p`` in A. B's first request starts from the tools block (>= 7,000 tokens;
    llama-server alone: 0) and the continued session comes back from the session tier (>= 95 %)."""
    srv, proxy, mode = agent_stack
    home = tmp_path / "home"
    home.mkdir()
    env = clients.claude_env(home, proxy.url)
    model = str(models_tiny["hybrid"])
    plan = [("proj-a", "list the files and explain main.py", ()),
            ("proj-b", "list the files and explain main.py", ()),
            ("proj-a", "now explain main.py again", ("--continue",))]
    runs, n_before, records = _two_folders_restart_between(
        srv, proxy, tmp_path, plan, lambda folder, prompt, args: clients.run_claude(
            claude_bin, folder, prompt, env, model=model, args=args, timeout=RUN_TIMEOUT_S))
    report = _agent_report(f"claude code ({mode})", runs, records)
    print("\n" + report)
    assert all(r["path"] == "/v1/messages" for r in records), report
    assert all(r["headers"].get("user-agent", "").startswith("claude-cli/2.1.328") for r in records), report
    firsts = _first_of_each_run(records, n_before)
    _agent_checks(mode, records, firsts, report, head_min=7000)


@pytest.mark.server
@pytest.mark.slow
@pytest.mark.parametrize("agent_stack", ["cache", "no-cache"], indirect=True)
def test_codex_two_folders_restart_resume(codex_bin, agent_stack, tmp_path, models_tiny):
    """Real Codex CLI 0.169.0 (``wire_api = "responses"``): ``codex exec`` in A, in B, restart,
    ``codex exec resume --last`` in A. B's first request starts from the base instructions
    (>= 5,000 tokens; alone: 0), the resumed session from the session tier (>= 95 %). Codex closes
    each stream right after ``response.completed``: the request still counts as observed."""
    srv, proxy, mode = agent_stack
    home = tmp_path / "home"
    home.mkdir()
    codex_home = home / ".codex"
    clients.write_codex_config(codex_home, proxy.url + "/v1", model=str(models_tiny["hybrid"]))
    env = clients.codex_env(home, codex_home)
    plan = [("proj-a", "list the files and explain main.py", False),
            ("proj-b", "list the files and explain main.py", False),
            ("proj-a", "now explain main.py again", True)]
    runs, n_before, records = _two_folders_restart_between(
        srv, proxy, tmp_path, plan, lambda folder, prompt, resume: clients.run_codex(
            codex_bin, folder, prompt, env, resume=resume, timeout=RUN_TIMEOUT_S))
    report = _agent_report(f"codex ({mode})", runs, records)
    print("\n" + report)
    assert all(r["path"] == "/v1/responses" for r in records), report
    assert all(r["headers"].get("user-agent", "").startswith("codex_exec/0.169.0") for r in records), report
    firsts = _first_of_each_run(records, n_before)
    # llama-server alone keeps a checkpoint at the first user item of A (~5,950 tokens, below the
    # other folder's divergence): Codex's prompt is short enough that no 8192 spacing applies
    _agent_checks(mode, records, firsts, report, head_min=5000, alone_b=None)
    if mode == "cache":
        stats = proxy.stats()["layer"]
        assert stats["observed"] == len(records) and stats["failed_responses"] == 0, report


@pytest.mark.server
@pytest.mark.slow
def test_a_day_recorded_with_the_real_opencode_is_in_the_bench_default_set(opencode_bin, engine_patched,
                                                                         models_tiny):
    """The tiny bench's default set replays a day recorded with the real opencode through ``ocache
    serve --record`` (``clients.record_opencode_day``: six runs in one folder with their own
    prompts, one in another; made once, kept outside the checkout). Every run sent its title
    request and its agent turn under one new session key, and the recording replays as a
    scenario of those requests in order."""
    from ocache.bench.run import PRESETS, recorded_days
    from ocache.record import read_stream

    path = clients.record_opencode_day()
    assert path.parent == clients.recordings_dir() and clients.opencode_day_key(
        models_tiny["hybrid"].name) in path.name
    entries = read_stream(path)
    assert len(entries) == 2 * len(clients.OPENCODE_DAY)
    sessions = [e.get("session") for e in entries]
    titles = [e for e in entries if not e["body"].get("tools")]
    assert len(titles) == len(clients.OPENCODE_DAY) and len(set(sessions)) == len(clients.OPENCODE_DAY)
    for (_folder, prompt), t in zip(clients.OPENCODE_DAY, titles):
        assert prompt in json.dumps(t["body"]["messages"]), t["body"]["messages"]
    assert "opencode" in PRESETS["tiny"].recordings
    days, notes = recorded_days(PRESETS["tiny"].recordings)
    assert not notes and [d.name for d in days] == ["recorded_opencode_day"]
    assert [s.body for s in days[0].steps] == [e["body"] for e in entries]
    assert clients.record_opencode_day() == path        # the second call reuses the recording


@contextlib.contextmanager
def side(start_server, tmp_path: Path, name: str, server_args: list[str]):
    """One side of an alone-vs-ocache comparison on its own llama-server (tiny hybrid, ``-np 2``,
    64k context, ``server_args``): ``name`` ``"alone"`` is ``ocache serve --no-cache`` (every
    request forwarded untouched, recorded with the server's timings), ``"ocache"`` the cache layer;
    yields the ready ``OcacheProcess`` (records in ``tmp_path / name``); both stopped after."""
    srv = start_server("hybrid", n_parallel=2, ctx_size=65536, args=server_args)
    (tmp_path / name).mkdir()
    proxy = OcacheProcess(srv.url, tmp_path / name, extra_args=("--no-cache",) if name == "alone" else (),
                          server_args=srv.command()[1:])
    try:
        proxy.wait_ready()
        yield proxy
    finally:
        proxy.stop()
        srv.stop()
