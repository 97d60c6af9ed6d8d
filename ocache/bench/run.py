"""``ocache bench``: replay real agent sessions against stock llama-server, tuned llama-server and
ocache, side by side in one run, and measure each against the prefill oracle.

Three configurations, same model, same source build (``ocache.toolchain.engine``), one at a time on the
machine (never two heavy processes at once), each scenario on freshly started processes:

* **a** - the stock build with stock defaults: only model, address, context size, threads and
  ``--jinja`` are given (so ``-np`` auto = 4 slots with a unified KV cache, ``--cache-ram 8192``,
  ``--ctx-checkpoints 32``, ``-cms 8192``; docs/llama-server.md §9, §10, §14);
* **b** - the stock build with the flags the README recommends for agents:
  ``-fa on``, ``--ctx-checkpoints 32``, ``--checkpoint-min-step 1024`` (below the ~7k-token
  opencode prompt, docs/llama-server.md §14), ``--cache-ram 0``, ``-np``
  (2, or the scenario's ``n_parallel``);
* **c** - ``ocache serve --upstream URL`` with its defaults and no ``ocache.yaml`` (the README's first
  code block) in front of (b)'s flags on the patched build, plus what ocache needs from the server
  (``--slot-save-path``, ``--metrics``), which that build reports in ``/props`` (patches/0009), so
  ocache is told nothing else. When ``ocache serve`` cannot
  run its cache layer, (c) is the proxy with ``--no-cache`` (NullLayer) and the report says so.

Presets: ``tiny`` (the smoke run: the tiny hybrid model, four scenarios: growth,
restart_mid_session, new_session_other_folder, opencode_runs_same_folder, and a day recorded with the
real opencode through ``ocache serve --record``, made once by ``ocache.toolchain.clients``;
``--no-recordings`` leaves it out) and ``bench`` (the README's main command: the
bench-sized hybrid model, four scenarios, ``-t 1``); ``--all-scenarios`` runs every one-host scenario in ``scenarios/``; a
scenario with ``hosts: 2`` (``two_hosts_day``) runs only when ``--scenario`` names it, with its own
runner and report (``ocache.bench.hosts``).
``long`` (32k/64k/128k-token conversations, ocache vs llama-server alone) has its own runner and
report: ``ocache.bench.long``.

Per scenario and configuration: the tokens llama-server prefilled (its ``/metrics`` counter, so
ocache's own warm-ups count, beside the clients' ``prompt_n``), the oracle's total, prefill
efficiency (oracle / server prefill), client TTFT per request as a ratio to a cold run of the same
request, and exactness (greedy output == the cold run's); where (b) and (c) both ran, the headline
saving ocache reported at the end of (c) beside the measured (b) - (c) (``Bench.alone_table``). Output into ``--out`` (default
``./out``): ``bench-<preset>.md`` (tables), ``prefill-<preset>-<model>.png`` (per-request prefilled
tokens for a, b, c and the oracle), ``bench-<preset>.json`` (every measured request) and the
servers' logs under ``logs/``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ocache.bench.exact import TOL_NATS
from ocache.paths import checkout, repo_root, shipped
import aiohttp

from ocache.bench.results import ConfigRun, fixed, scenario_runs, table_row
from ocache.bench.rule2 import RULE2_MAX, over_requests, rule2
from ocache.bench.replay import (REJECTED_NOTE, PrefillMeter, Row, Scenario, Target, assign_server_prefill, load_scenario,
                     measure, replay, scenario_from_recording)
from ocache.llama.server import LlamaServer, ServerError, free_port, stop_process_group

log = logging.getLogger("ocache.bench.run")

CONFIGS = ("a", "b", "c")
CONFIG_TITLES = {
    "a": "stock llama-server, stock defaults",
    "b": "stock llama-server, the README's flags",
    "c": "ocache serve (defaults) in front of (b) on the patched build",
}
#: Efficiency goal for (c) (README "Measured": where (c) stays under it, and why).
GOAL = 0.95


@dataclass(frozen=True)
class Preset:
    """Bench sizes. ``threads``: llama-server ``-t``/``-tb``; ``ctx_per_slot`` tokens;
    ``cache_ram_mib``/``checkpoint_min_step``: (b)/(c) ``--cache-ram``/``--checkpoint-min-step``,
    the README's recommended ``0``/``1024``;
    ``time_scale`` multiplies the scenario gaps."""

    models: tuple[str, ...]
    threads: int
    ctx_per_slot: int
    cache_ram_mib: int
    checkpoint_min_step: int = 1024
    n_parallel: int = 2
    time_scale: float = 1.0
    #: "per-config": each configuration's requests are run cold on its own llama-server;
    #: "shared": each distinct request body is run cold once, on the first server that sent it,
    #: configurations running in the order c, b, a (a mismatch against a reference made on
    #: another server is re-checked on the configuration's own server before it is reported)
    cold: str = "shared"
    #: scenario file stems run by default (None: all in the folder)
    scenarios: tuple[str, ...] | None = None
    #: real-client days recorded through ``ocache serve --record`` replayed by default too
    #: (``opencode``: ``ocache.toolchain.clients.record_opencode_day``, made once and kept outside
    #: the checkout; skipped with a note when opencode cannot be installed)
    recordings: tuple[str, ...] = ()


PRESETS = {
    # smoke test: the tiny hybrid model prefills a 7k-token opencode turn in well under a second
    "tiny": Preset(models=("hybrid",), threads=1, ctx_per_slot=12288, cache_ram_mib=0,
                   time_scale=0.2,
                   scenarios=("growth", "restart_mid_session", "new_session_other_folder",
                              "opencode_runs_same_folder"),
                   recordings=("opencode",)),
    # the README's main command: the bench-sized hybrid (6 delta-net + 2 attention layers).
    # -t 1, not 2: in (c) the proxy process works beside the server, and with -t 2 any second
    # busy process collapses llama-server's prefill ~50x on 2 cores (measured here: 30-44 tok/s
    # for this model under load; docs/decisions.md D6)
    # At -t 1 this model prefills ~185 tokens/s here, so a 7.3k-token opencode turn takes ~40 s
    # and every scenario costs ~6-8 minutes (replays + cold references): the default is the
    # four most telling ones (~30 min); --all-scenarios runs every scenario (12; ~1.5 h on the bench models).
    "bench": Preset(models=("hybrid",), threads=1, ctx_per_slot=12288, cache_ram_mib=0,
                    scenarios=("growth", "restart_mid_session", "aba_one_slot",
                               "new_session_other_folder")),
}


def default_fixtures() -> Path | None:
    """The client captures the scenarios send: ``$OCACHE_SHARED/fixtures``, else ``../shared/fixtures``
    beside the checkout; None for an installed package without ``OCACHE_SHARED`` (the captures are
    third-party text, never in the package: an installed bench
    must not look beside ``site-packages``)."""
    shared = os.environ.get("OCACHE_SHARED")
    if shared:
        return Path(shared) / "fixtures"
    root = checkout()
    return root.parent / "shared" / "fixtures" if root is not None else None


def fixtures_missing(fixtures: Path | None, who: str = "ocache bench") -> str:
    """The message for a fixtures folder that is not there (``default_fixtures``' None included)."""
    if fixtures is None:
        return (f"{who}: no client captures: this ocache is installed without its checkout; give "
                "--fixtures DIR or OCACHE_SHARED=DIR (the folder holding fixtures/), or replay a recorded "
                "stream with --recording FILE")
    return f"{who}: fixtures folder {fixtures} not found (set OCACHE_SHARED or --fixtures)"


def scenarios_dir() -> Path:
    """The shipped scenarios: the checkout's ``scenarios/``, else the installed package's copy
    (``ocache/data/scenarios``, ``ocache.paths.shipped``)."""
    return shipped("scenarios")


class StockDefaultsServer(LlamaServer):
    """llama-server with stock defaults: nothing but model, address, total context, threads,
    ``--jinja`` and ``--metrics`` (read-only counters, for the prefill meter) on the command line;
    every cache-related flag is left to the build's defaults."""

    def command(self) -> list[str]:
        return [str(self.binary), "-m", str(self.model), "--host", self.host, "--port",
                str(self.port), "-c", str(self.ctx_size), "-t", str(self.threads), "-tb",
                str(self.threads), "--jinja", "--metrics", *self.args]


class OCacheProcess:
    """``ocache serve`` as a child process in front of ``upstream_url`` (fresh cache dir)."""

    def __init__(self, upstream_url: str, cache_dir: Path, log_path: Path,
                 no_cache: bool = False, slot_save_path: Path | None = None,
                 store: dict | None = None, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cache_dir = cache_dir
        self.log_path = log_path
        cmd = [sys.executable, "-m", "ocache", "serve", "--upstream", upstream_url,
               "--host", "127.0.0.1", "--port", str(self.port)]
        if no_cache:
            cmd.append("--no-cache")
        self.cmd = cmd
        self.slot_save_path = slot_save_path
        #: ``store:`` of the configuration (``{"remote": {...}}``: ocache.tiers.remote), and
        #: environment added to the child's (the bucket's credentials)
        self.store = store
        self.extra_env = dict(env or {})
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60.0) -> "OCacheProcess":
        """Start and wait until ``GET /v1/cache/stats`` answers 200; raises ServerError."""
        self.cache_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        env = self.env()
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(self.cmd, stdout=logf, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env, cwd=str(self.cache_dir),
                                         start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"ocache serve exited with {self.proc.returncode}\n"
                                  f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/v1/cache/stats", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.1)  # polling a child's readiness
        raise ServerError(f"ocache serve not ready after {timeout} s\n{self.log_tail()}")

    def env(self) -> dict[str, str]:
        """The child's environment: the caller's, with ``OCACHE_CACHE_DIR`` this run's folder, no
        ``OCACHE_CONFIG`` (it also runs in that folder, so no ``ocache.yaml`` of the caller's is read:
        its configuration is the defaults, the caller's ``OCACHE_<KEY>`` variables and the flags),
        the caller's extra ``env`` and ``store:`` (``OCACHE_STORE``, the remote tier),
        ``PYTHONPATH`` led by the checkout this ``ocache`` runs from, if any (the child runs the
        same code), and ``slot_save_path`` given as ``OCACHE_TIERS`` when
        set (for a server that does not report it: a stock build; the patched one does, patches/0009)."""
        env = {k: v for k, v in os.environ.items() if k != "OCACHE_CONFIG"}
        env.update(self.extra_env)
        env["OCACHE_CACHE_DIR"] = str(self.cache_dir)
        if self.store:
            env["OCACHE_STORE"] = json.dumps(self.store)   # a dict key's env form is YAML (JSON is YAML)
        root = checkout()
        if root is not None:   # an installed package is found by the same interpreter anyway
            env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
        if self.slot_save_path is not None:
            p = json.dumps(str(self.slot_save_path))
            env["OCACHE_TIERS"] = f"{{disk: {{slot_save_path: {p}}}, session: {{slot_save_path: {p}}}}}"
        return env

    def stats(self) -> dict | None:
        try:
            with urllib.request.urlopen(self.url + "/v1/cache/stats", timeout=10) as r:
                return json.loads(r.read())
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def stop(self, timeout: float = 60.0) -> None:
        if self.proc is not None:
            stop_process_group(self.proc, timeout)

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def layer_name(stats: dict | None) -> str | None:
    """The cache layer ocache reported in /v1/cache/stats (``NullLayer`` for ``{"layer": "null"}``)."""
    if not stats:
        return None
    layer = stats.get("layer")
    if isinstance(layer, dict):
        name = layer.get("layer") or layer.get("name") or layer.get("class")
        if name == "null":
            return "NullLayer"
        return str(name) if name else "OCacheLayer"
    return str(layer) if layer else None


class Bench:
    """Runs the scenarios over the configurations; see the module docstring."""

    def __init__(self, preset: str, scenarios: list[Scenario], out: Path,
                 configs: tuple[str, ...] = CONFIGS, models: tuple[str, ...] | None = None,
                 time_scale: float | None = None, threads: int | None = None,
                 template: str | None = None, ctx_per_slot: int | None = None) -> None:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
        self.preset_name = preset
        self.preset = PRESETS[preset]
        self.scenarios = scenarios
        self.out = out
        self.configs = configs
        self.models = models or self.preset.models
        self.time_scale = self.preset.time_scale if time_scale is None else time_scale
        #: ``--template``: the template every scenario is served with (ocache.bench.agent
        #: resolve_template), in place of each scenario's own ``template:``
        self.template = template
        if threads:
            import dataclasses
            self.preset = dataclasses.replace(self.preset, threads=threads)
        if ctx_per_slot:  # a template that renders the clients' prompts longer (Qwen3-Coder's tools)
            import dataclasses
            self.preset = dataclasses.replace(self.preset, ctx_per_slot=ctx_per_slot)
        self.results: dict[str, dict[str, dict[str, ConfigRun]]] = {}  # model -> scenario -> cfg
        self.notes: list[str] = []
        self._cold: dict[tuple[str, str], dict] = {}  # (config, model) -> body key -> Response

    # --- processes ----------------------------------------------------------------------------
    def _prepare(self) -> None:
        from ocache.toolchain import engine
        from ocache.toolchain import models

        self.builds = {"stock": engine.build(stock=True)}
        if "c" in self.configs:
            self.builds["patched"] = engine.build()
        self.model_paths = models.make(self.preset_name)
        self.logs = self.out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)

    def template_of(self, scenario: Scenario, model: str) -> str | None:
        """The template file ``model`` is served with on ``scenario`` (None: its own): ``--template``
        or the scenario's ``template:`` (``ocache.bench.agent.resolve_template``)."""
        from ocache.bench.agent import resolve_template

        return resolve_template(self.template if self.template is not None else scenario.template, model)

    def _server(self, config: str, model: str, scenario: Scenario, work: Path,
                tag: str | None = None) -> LlamaServer:
        """``config``'s llama-server (a, b or c: see the module docstring) for ``scenario``; its log
        is named after ``tag`` (default: ``config``)."""
        from ocache.bench.agent import template_args

        p = self.preset
        np_ = scenario.n_parallel or p.n_parallel
        logf = self.logs / f"{model}-{scenario.name}-{tag or config}-llama.log"
        logf.unlink(missing_ok=True)
        args = template_args(self.template_of(scenario, model), model)
        if config == "a":
            return StockDefaultsServer(binary=self.builds["stock"].binary,
                                       model=self.model_paths[model],
                                       ctx_size=p.ctx_per_slot * p.n_parallel, threads=p.threads,
                                       log_path=logf, args=args)
        cms = min(p.checkpoint_min_step, p.ctx_per_slot // 2)
        kw: dict[str, Any] = dict(model=self.model_paths[model], n_parallel=np_,
                                  ctx_size=p.ctx_per_slot * np_, threads=p.threads,
                                  ctx_checkpoints=32, checkpoint_min_step=cms, flash_attn="on",
                                  cache_ram=p.cache_ram_mib, log_path=logf, args=args)
        if config == "b":
            return LlamaServer(binary=self.builds["stock"].binary, metrics=True, **kw)
        return LlamaServer(binary=self.builds["patched"].binary, metrics=True,
                           slot_save_path=work / "slots", **kw)

    async def run_one(self, config: str, model: str, scenario: Scenario) -> ConfigRun:
        """Start fresh processes for ``config``, replay ``scenario``, measure, stop them."""
        work = self.out / "work" / f"{model}-{scenario.name}-{config}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True, exist_ok=True, mode=0o700)
        srv = self._server(config, model, scenario, work)
        proxy: OCacheProcess | None = None
        t0 = time.monotonic()
        layer = None
        stats = None
        try:
            await asyncio.to_thread(srv.start, 300.0)
            url = srv.url
            if config == "c":
                started, layer = await asyncio.to_thread(self._start_proxy, srv, work, model, scenario)
                proxy, url = started, started.url

            async def restart() -> None:
                await asyncio.to_thread(srv.restart, 300.0)

            meter = PrefillMeter(srv.url)
            target = Target(url=url, upstream_url=srv.url, restart=restart, meter=meter)
            sent = await replay(scenario, target, time_scale=self.time_scale)
            if proxy is not None:
                # stop ocache before the cold runs go to its upstream, so its background work
                # (admission, spill on drain) is all counted and never sees the cold runs
                stats = await asyncio.to_thread(proxy.stats)
                layer = layer_name(stats) or layer
                await asyncio.to_thread(proxy.stop)
            async with aiohttp.ClientSession() as http:
                assign_server_prefill(sent, await meter.sample(http))
            grid = srv.ubatch if model == "hybrid" else None
            cold = self._cold.setdefault(
                (config if self.preset.cold == "per-config" else "shared", model), {})
            rows = await measure(sent, srv.url, grid, cold_cache=cold)
            return ConfigRun(config, rows, time.monotonic() - t0, layer, stats)
        except Exception as exc:  # one failed configuration must not lose the others' results
            log.exception("%s/%s/%s failed", model, scenario.name, config)
            return ConfigRun(config, [], time.monotonic() - t0, layer, stats,
                             error=f"{type(exc).__name__}: {exc}")
        finally:
            if proxy is not None:
                await asyncio.to_thread(proxy.stop)
            await asyncio.to_thread(srv.stop)

    def _start_proxy(self, srv: LlamaServer, work: Path, model: str,
                     scenario: Scenario) -> tuple[OCacheProcess, str | None]:
        logf = self.logs / f"{model}-{scenario.name}-c-ocache.log"
        logf.unlink(missing_ok=True)
        # `ocache serve --upstream URL` alone, the README's first code block: the patched server
        # reports its --slot-save-path and the rest of its launch (patches/0009)
        proxy = OCacheProcess(srv.url, work / "ocache-cache", logf)
        try:
            proxy.start()
        except ServerError as exc:
            note = (f"(c) `ocache serve` failed to start with its cache layer; fell back to "
                    f"`--no-cache` (NullLayer): {str(exc).splitlines()[0]}")
            if note not in self.notes:
                self.notes.append(note)
            proxy = OCacheProcess(srv.url, work / "ocache-cache", logf, no_cache=True)
            proxy.start()
            return proxy, "NullLayer (fallback)"
        return proxy, layer_name(proxy.stats())

    async def run(self) -> None:
        self._prepare()
        log.info("plan: %d runs (%d model(s) x %d scenario(s) x %d configuration(s))",
                 len(self.models) * len(self.scenarios) * len(self.configs), len(self.models),
                 len(self.scenarios), len(self.configs))
        for model in self.models:
            for sc in self.scenarios:
                per = self.results.setdefault(model, {}).setdefault(sc.name, {})
                order = self.configs if self.preset.cold == "per-config" else \
                    tuple(sorted(self.configs, reverse=True))
                for cfg in order:
                    log.info("%s / %s / (%s) %s", model, sc.name, cfg, CONFIG_TITLES[cfg])
                    run = await self.run_one(cfg, model, sc)
                    per[cfg] = run
                    # keep the report in a, b, c order whatever order they ran in
                    per_sorted = {c: per[c] for c in sorted(per)}
                    per.clear()
                    per.update(per_sorted)
                    eff = run.efficiency
                    log.info("  -> server prefill %d (client prompt_n %d), oracle %d, "
                             "efficiency %s, %.1f s%s", run.observed, run.total("prompt_n"),
                             run.oracle_total,
                             f"{eff:.3f}" if eff is not None else "-", run.wall_s,
                             f", ERROR {run.error}" if run.error else "")

    # --- reports ------------------------------------------------------------------------------
    def summary_table(self) -> str:
        lines = ["| model | scenario | config | requests | client prompt_n | server prefill "
                 "| grid oracle | efficiency | LCP bound | TTFT / cold (median) | exact | notes |",
                 "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for model, sc, runs in scenario_runs(self.results):
            for cfg, run in runs.items():
                k, n = run.exact
                eff = run.efficiency
                ratio = run.ttft_ratio
                notes = []
                if run.error:
                    notes.append(f"error: {run.error[:80]}")
                if cfg == "c" and run.layer:
                    notes.append(f"layer {run.layer}")
                errs = [r for r in run.rows if r.error]
                if errs:
                    rejected = [r.note.removeprefix(REJECTED_NOTE) for r in errs
                                if r.note and r.note.startswith(REJECTED_NOTE)]
                    notes.append(f"{len(errs)} request errors" + (
                        f" ({len(rejected)} rejected by the server itself: {rejected[0][:100]})"
                        if rejected else ""))
                lines.append(table_row(model, sc, cfg, len(run.rows), run.total("prompt_n"), run.observed,
                                       run.oracle_total, fixed(eff, 3), run.oracle_exact_total,
                                       fixed(ratio, 2), f"{k}/{n}", "; ".join(notes)))
        return "\n".join(lines)

    def never_worse_table(self) -> str:
        """Per scenario: the server's own prefill under (a), (b), (c), (c) / min((a), (b)), the
        requests where (c) prefilled more than (a) or (b) (``rule2.over_requests``: how many, how
        many of them title requests) and the verdict of the project's rule 2 on the scenario:
        it holds when (c) / min((a), (b)) <= ``RULE2_MAX`` and no title request prefilled more
        than under (a) or (b) (a title is the same prompt every run, so the server
        alone always reuses it; a restart's or an agent turn's gain must not hide its loss)."""
        lines = ["| model | scenario | (a) stock | (b) tuned | (c) ocache | (c) / min((a), (b)) "
                 "| requests (c) > min((a), (b)) | title requests among them | rule 2 |",
                 "|---|---|---:|---:|---:|---:|---:|---:|---|"]
        for model, sc, runs in scenario_runs(self.results):
            obs = {c: runs[c].observed for c in ("a", "b", "c") if c in runs}
            v = rule2(runs)
            ratio = "-" if v["ratio"] is None else f"{v['ratio']:.3f}"
            if v["ratio"] is not None and v["ratio"] > RULE2_MAX:
                ratio = f"**{ratio}**"
            over = v["over"]
            verdict = {None: "-", True: "holds", False: "**fails**"}[v["holds"]]
            if v["swapped"]:
                verdict += (f" ({v['swapped']} baseline request(s) of another prompt or without an "
                            f"answer: counted as (c)'s)")
            lines.append(f"| {model} | {sc} | {obs.get('a', '-')} | {obs.get('b', '-')} "
                         f"| {obs.get('c', '-')} | {ratio} "
                         f"| {len(over)} (+{sum(o['excess'] for o in over)} tokens) "
                         f"| {sum(1 for o in over if o['title'])} | {verdict} |")
        return "\n".join(lines)

    def worse_requests(self) -> str:
        """Per scenario, every request where (c) prefilled more than (a) or (b) (``rule2.over_requests``),
        with the three prefills, ``cache_n`` and ocache's headers (the reason to read), under the
        scenario's rule-2 verdict."""
        out = []
        for model, sc, runs in scenario_runs(self.results):
            v = rule2(runs)
            if not v["over"]:
                continue
            over = v["over"]
            verdict = {None: "-", True: "holds", False: "fails"}[v["holds"]]
            out.append(f"- **{model}/{sc}**: {len(over)} requests, "
                       f"+{sum(o['excess'] for o in over)} tokens over min((a), (b)) in all, "
                       f"{sum(1 for o in over if o['title'])} of them title requests; "
                       f"(c) / min((a), (b)) "
                       f"{'-' if v['ratio'] is None else format(v['ratio'], '.3f')}: "
                       f"rule 2 {verdict}")
            for o in over:
                r = o["row"]
                hdrs = ", ".join(f"{h}={v}" for h, v in sorted(r.ocache.items()))
                out.append(f"  - #{r.index} {r.label}{' (title)' if o['title'] else ''}: "
                           f"(a) {'-' if o['a'] is None else o['a']}, "
                           f"(b) {'-' if o['b'] is None else o['b']}, (c) {o['c']} "
                           f"(+{o['excess']}); cache_n {r.cache_n}"
                           + (f"; ocache: {hdrs}" if hdrs else ""))
        return "\n".join(out) if out else "(none)"

    def detail_tables(self) -> str:
        out = []
        for model, sc, runs in scenario_runs(self.results):
            out.append(f"\n### {model} / {sc}\n")
            out.append("| # | request | tokens | oracle prefill | "
                       + " | ".join(f"{c} prefill: server / client (cache_n)" for c in runs)
                       + " | " + " | ".join(f"{c} TTFT/cold" for c in runs)
                       + " | exact " + "/".join(runs) + " |")
            out.append("|---:|---|---:|---:|" + "---:|" * (2 * len(runs)) + "---|")
            base = runs.get("c") or next(iter(runs.values()))
            for i, r in enumerate(base.rows):
                cells, ttfts, ex = [], [], []
                for cfg, run in runs.items():
                    rr = run.rows[i] if i < len(run.rows) else None
                    if rr is None:
                        cells.append("-")
                        ttfts.append("-")
                        ex.append("-")
                        continue
                    cells.append(f"{rr.server_prefill} / {rr.prompt_n} ({rr.cache_n})")
                    ttfts.append("-" if rr.ttft_ratio is None else f"{rr.ttft_ratio:.2f}")
                    ex.append({True: "y", False: "**n**", None: "?"}[rr.exact])
                label = ("↻ " if r.restart_before else "") + r.label
                out.append(f"| {i} | {label} | {r.n_tokens} | {r.oracle.prefill} | "
                           + " | ".join(cells) + " | " + " | ".join(ttfts)
                           + " | " + "/".join(ex) + " |")
        return "\n".join(out)

    def shortfalls(self) -> str:
        """Where (c) fell short of the goal: each request whose prefill exceeded the oracle's,
        with the token position where reuse stopped and ocache's own headers about it."""
        out = []
        for model, sc, runs in scenario_runs(self.results):
            run = runs.get("c")
            if run is None:
                continue
            eff = run.efficiency
            k, n = run.exact
            if run.error:
                out.append(f"- **{model}/{sc}**: (c) failed: {run.error}")
                continue
            if (eff is not None and eff >= GOAL) and k == n:
                continue
            out.append(f"- **{model}/{sc}**: efficiency "
                       f"{'-' if eff is None else f'{eff:.3f}'}, exact {k}/{n}")
            for r in run.rows:
                used = r.server_prefill if r.server_prefill is not None else (r.prompt_n or 0)
                short = used - r.oracle.prefill
                if short > 0 or r.exact is False:
                    hdrs = ", ".join(f"{h}={v}" for h, v in sorted(r.ocache.items()))
                    out.append(
                        f"  - #{r.index} {r.label}: {r.n_tokens} tokens; reuse stopped at "
                        f"token {r.cache_n} (cache_n), the oracle reuses {r.oracle.reuse} "
                        f"(LCP {r.oracle.lcp} with earlier sequence {r.oracle.source}); "
                        f"server prefilled {used} (client prompt_n {r.prompt_n}), "
                        f"{short} tokens over the oracle"
                        + ("" if r.exact is not False else "; **output differs from cold**")
                        + (f"; ocache: {hdrs}" if hdrs else "")
                        + (f"; {r.note}" if r.note else ""))
        return "\n".join(out) if out else "(none: (c) met the goal on every scenario)"

    def markdown(self, wall_s: float, command: str) -> str:
        p = self.preset
        parts = [
            f"# ocache bench ({self.preset_name})\n",
            f"Command: `{command}` — {wall_s / 60:.1f} min wall on this machine.\n",
            "Configurations: " + "; ".join(f"**{c}** {CONFIG_TITLES[c]}" for c in self.configs)
            + ".\n",
            f"Servers: `-t {p.threads}`, {p.ctx_per_slot} tokens per slot; (b)/(c): `-np "
            f"{p.n_parallel}` (or the scenario's), `-fa on --ctx-checkpoints 32 --checkpoint-min-step "
            f"{min(p.checkpoint_min_step, p.ctx_per_slot // 2)} --cache-ram {p.cache_ram_mib}`; "
            "(c) adds `--slot-save-path --metrics` and runs `ocache serve --upstream URL` with no "
            "`ocache.yaml`: the patched build reports its flags in `/props` (patches/0009). Greedy (`temperature 0`), generation capped "
            "per scenario.\n",
            "Server prefill = the tokens llama-server itself prefilled (`llamacpp:prompt_tokens_total` "
            "on `/metrics`, counted per step, so a proxy's own warm-ups count; client prompt_n = "
            "`timings.prompt_n` the client saw). "
            "Efficiency = grid oracle prefill / server prefill (summed per scenario); the grid oracle "
            "reuses the longest prefix shared with any earlier sequence, rounded down to the ubatch "
            "grid on hybrids, so a cache that keeps states off the grid (ocache's head anchors) can "
            "score above 1; the `LCP bound` is that reuse without rounding, which nothing can beat. TTFT / cold "
            "= client TTFT divided by that of a cold run (`cache_prompt: false`) of the same "
            "request; exact = the greedy tokens equal that cold run's (run alone, not streamed) "
            "up to its first near-tie, with every compared token's log-probability within "
            f"{TOL_NATS} nats (`ocache/bench/exact.py`: past a near-tie the continuation is not defined "
            "by the state, batching noise may flip it). "
            + ("Cold runs: on each configuration's own llama-server.\n"
               if p.cold == "per-config" else
               "Cold runs: once per distinct request body, on the first llama-server that sent "
               "it, configurations running in the order c, b, a (so mostly (c)'s upstream: the "
               "patched build with (b)'s flags; for (a), whose flags differ, a mismatch is "
               "confirmed on its own server before it is reported).\n"),
        ]
        served = sorted({(sc.name, m, self.template_of(sc, m)) for sc in self.scenarios
                         for m in self.models if self.template_of(sc, m)})
        if served:
            parts.append("Chat templates (the pinned source's `models/templates/`, `--chat-template-file`, "
                         "for (a), (b) and (c) alike; the other scenarios run on the models' own): "
                         + "; ".join(f"{n} on {m}: `{t}`" for n, m, t in served) + ". An aligned request "
                         "of (c) (`X-OCache-Aligned`) is judged on the prompt it was served (the slot's "
                         "tokens, then the rendering's new part): its oracle and its cold reference "
                         "(`/completion` of those token ids) are that prompt's.\n")
        if self.notes:
            parts.append("Notes:\n" + "\n".join(f"- {n}" for n in self.notes) + "\n")
        parts.append("## Summary\n\n" + self.summary_table() + "\n")
        parts.append("## Never worse than llama-server alone\n\nThe server's own prefill "
                     "(`llamacpp:prompt_tokens_total`, ocache's own steps included) per "
                     f"scenario; rule 2 holds where (c) / min((a), (b)) <= {RULE2_MAX:.2f} and no "
                     "title request prefilled more than under (a) or (b).\n\n"
                     + self.never_worse_table() + "\n\nRequests where (c) prefilled more "
                     "than (a) or (b), per scenario (matched by label and occurrence):\n\n"
                     + self.worse_requests() + "\n")
        if {"b", "c"} <= set(self.configs):
            parts.append("## The headline saving ocache reported, against the measured (b) - (c)\n\n"
                         "What the dashboard and `ocache stats` led with at the end of (c) (the saving "
                         "against llama-server alone with the same flags, `ocache/llama/alone.py`) beside "
                         "the server prefill of (b) minus that of (c) for the same stream.\n\n"
                         + self.alone_table() + "\n")
        if "c" in self.configs:
            parts.append(f"## Where (c) is below {GOAL} efficiency or not exact\n\n"
                         + self.shortfalls() + "\n")
        parts.append("## Per request\n" + self.detail_tables() + "\n")
        return "\n".join(parts)

    def alone_table(self) -> str:
        """Per model and scenario where (b) and (c) both ran: the saving the dashboard and ``ocache
        stats`` led with at the end of (c) (``/v1/cache/stats`` ``layer.alone``: llama-server alone
        with the same flags as modelled by ``ocache.llama.alone``, minus what the server prefilled
        through ocache) beside the bench's measured (b) - (c) (``ocache.bench.verdict.alone_check``;
        a miss over 5 % is in bold)."""
        from ocache.bench.verdict import alone_check

        rows = alone_check(self.to_json())
        if not rows:
            return "(no scenario with both (b) and (c) and ocache's figures)"
        lines = ["| model | scenario | (b) | (c) | (b) - (c) measured | headline ocache reported "
                 "| its server-alone model / through ocache | off, of (b) - (c) | off, of (b) |",
                 "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            off = f"{r['off']:.1%}"
            lines.append(f"| {r['model']} | {r['scenario']} | {r['b']:,} | {r['c']:,} | {r['measured']:,} "
                         f"| {r['reported']:,} | {r['alone_prefill']:,} / {r['ocache_prefill']:,} "
                         f"| {off if r['off'] <= 0.05 else f'**{off}**'} | {r['off_of_b']:.1%} |")
        return "\n".join(lines)

    #: legend names of the configurations (CONFIG_TITLES, short)
    def plot(self) -> list[Path]:
        """The PNGs of this run (``ocache/bench/plots.py``)."""
        from ocache.bench import plots

        return plots.plot(self.results, self.preset_name, self.out)

    def to_json(self) -> dict:
        def row(r: Row) -> dict:
            d = asdict(r)
            d["ttft_ratio"] = r.ttft_ratio
            return d
        return {model: {sc: {cfg: {"rows": [row(r) for r in run.rows], "wall_s": run.wall_s,
                                   "layer": run.layer, "ocache_stats": run.ocache_stats,
                                   "error": run.error, "efficiency": run.efficiency}
                             for cfg, run in runs.items()}
                        for sc, runs in per.items()}
                for model, per in self.results.items()}

    def write(self, wall_s: float, command: str) -> tuple[Path, list[Path]]:
        self.out.mkdir(parents=True, exist_ok=True)
        md = self.out / f"bench-{self.preset_name}.md"
        md.write_text(self.markdown(wall_s, command))
        (self.out / f"bench-{self.preset_name}.json").write_text(
            json.dumps(self.to_json(), indent=1, default=str))
        return md, self.plot()


def load_scenarios(directory: Path, fixtures: Path, names: list[str] | None = None) -> list[Scenario]:
    """Every ``*.yaml`` in ``directory`` (sorted), or only ``names`` (file stems)."""
    files = sorted(directory.glob("*.yaml"))
    if names:
        wanted = set(names)
        files = [f for f in files if f.stem in wanted]
        missing = wanted - {f.stem for f in files}
        if missing:
            raise SystemExit(f"ocache bench: no scenario {sorted(missing)} in {directory}")
    if not files:
        raise SystemExit(f"ocache bench: no scenario files in {directory}")
    return [load_scenario(f, fixtures) for f in files]


def recorded_days(names: tuple[str, ...]) -> tuple[list[Scenario], list[str]]:
    """The preset's recorded real-client days as scenarios (``Preset.recordings``), each made
    once by the tests' toolchain (a few minutes the first time), and a note per day that could not
    be made (the registry unreachable, a run failed). Unknown names raise ValueError."""
    from ocache.toolchain import clients

    scenarios, notes = [], []
    for name in names:
        if name != "opencode":
            raise ValueError(f"unknown recorded day {name!r} (known: opencode)")
        try:
            path = clients.record_opencode_day()
        except Exception as exc:  # noqa: BLE001 - the scenarios still run; the report says why
            notes.append(f"recorded {name} day skipped: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            continue
        sc = scenario_from_recording(path)
        sc.name = f"recorded_{name}_day"
        sc.description = (f"a day recorded with the real {name} through `ocache serve --record` "
                          f"({path.name}, `ocache.toolchain.clients.record_{name}_day`)")
        scenarios.append(sc)
    return scenarios, notes
