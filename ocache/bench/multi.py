"""The multi-server bench (``scripts/bench-multi``): two llama-servers behind one ocache, four
concurrent opencode-shaped sessions in two project folders, under three routings:

* ``prefix``: the router's default policy (ocache/router.py: usable prefix and load);
* ``round_robin``: the router's ``round_robin`` policy (the next ready server in turn; each server's
  own ocache layer still plans the request there);
* ``round_robin-plain``: round robin over the same two servers without ocache's cache layers
  (``no_cache``: what a round-robin load balancer in front of llama-server does; each server
  reuses only what its own slots hold);
* ``single``: the same stream on one server with the same flags (``-np 2``), and ``single-np4``
  (one server with as many slots as the two together), through one OCacheLayer.

Every run starts fresh servers (tiny dense model unless ``--model``), one ``--slot-save-path`` and
one ocache state folder for the servers of a run. The stream: each session is an opencode run in
its folder (``opencode_agent_turn1.json`` for folder A, ``opencode_run3_proj2_agent_turn1.json`` for
folder B; the second session of a folder asks another first question), its first turn sent
together with its title request (a guest, as opencode does), then ``--turns`` - 1 tool rounds,
each adding a scripted assistant step and the tool's output (a seeded 1/4 to all of
``--user-words`` words: the same bytes in every run, so every run prefills the same prompts). The
four sessions run concurrently.

Measured per run: total server prefill = the sum over the run's servers of
``llamacpp:prompt_tokens_total`` (what llama-server itself prefilled, ocache's warm-ups and splits
included: docs/llama-server.md), requests per server, and the greedy answers; with ``--exact``
every agent answer is compared per token with a cold run of the same prompt alone on a fresh
server (``ocache.bench.exact``).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

import aiohttp
from aiohttp.test_utils import TestServer

from ocache.bench.exact import PROBS_FIELDS, Generation, compare, describe
from ocache.bench.replay import PrefillMeter
from ocache.config import Config
from ocache.llama.server import LlamaServer

CHAT = "/v1/chat/completions"
FOLDERS = {"A": ("opencode_agent_turn1.json", "opencode_title.json"),
           "B": ("opencode_run3_proj2_agent_turn1.json", "opencode_run3_proj2_title.json")}
WORDS = ("alpha beta gamma delta river stone cloud paper lamp window garden tiger violet copper "
         "engine harbor pencil mountain silver orange planet bridge candle forest").split()
SECOND_QUESTION = "What does the build script in this project do? Explain step by step."
RUNS = ("prefix", "round_robin", "round_robin-plain", "single", "single-np4")
class _Tuning(TypedDict):
    """The ``LlamaServer`` fields every server of this bench shares."""

    ubatch: int
    batch: int
    ctx_checkpoints: int
    checkpoint_min_step: int
    cache_ram: int


SERVER = _Tuning(ubatch=128, batch=512, ctx_checkpoints=32, checkpoint_min_step=256, cache_ram=0)


@dataclass
class Session:
    name: str
    folder: str
    turns: list[dict]
    title: dict
    headers: dict


@dataclass
class Result:
    run: str
    prefill: int
    per_server: list[int]
    routed: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    answers: dict[tuple[str, int], dict] = field(default_factory=dict)
    exact: tuple[int, int] | None = None  # (exact answers, compared answers)
    failures: list[str] = field(default_factory=list)
    requests: list[dict] = field(default_factory=list)  # one per request, in completion order


def _load(fixtures: Path, name: str) -> dict:
    return json.loads((fixtures / name).read_text())


def _prep(body: dict, max_tokens: int) -> dict:
    b = copy.deepcopy(body)
    b.pop("stream_options", None)
    b.update(stream=False, max_tokens=max_tokens, temperature=0, **PROBS_FIELDS)
    return b


def sessions(fixtures: Path, turns: int, user_words: int, max_tokens: int = 8) -> list[Session]:
    """The four sessions (two per folder), every turn's body fixed in advance."""
    out = []
    for folder, (agent, title) in FOLDERS.items():
        base = _prep(_load(fixtures, agent), max_tokens)
        tbody = _prep(_load(fixtures, title), max_tokens)
        for k in (1, 2):
            name = f"{folder}{k}"
            first = copy.deepcopy(base)
            if k == 2:
                u = next(i for i, m in enumerate(first["messages"]) if m["role"] == "user")
                first["messages"] = first["messages"][:u] + [{"role": "user", "content": SECOND_QUESTION}]
            rng = random.Random(f"{name}-{user_words}")
            bodies = [first]
            for t in range(1, turns):
                # a tool round: the assistant's step, then the tool's output (a file read, a listing)
                # of 1/4 to all of --user-words words
                b = copy.deepcopy(bodies[-1])
                b["messages"].append({"role": "assistant", "content": f"Step {t} of {name}: reading."})
                n = rng.randint(max(1, user_words // 4), user_words)
                text = " ".join(rng.choice(WORDS) for _ in range(n))
                b["messages"].append({"role": "user", "content": f"Output of step {t}: {text}"})
                bodies.append(b)
            out.append(Session(name, folder, bodies, tbody,
                               {"x-session-affinity": f"ses_bench_{name}", "x-session-id": f"ses_bench_{name}"}))
    return out


async def _post(s: aiohttp.ClientSession, url: str, body: dict, headers: dict) -> tuple[int, dict, dict]:
    async with s.post(url + CHAT, json=body, headers=headers) as r:
        return r.status, dict(r.headers), await r.json(content_type=None)


async def run_stream(base: str, sess: list[Session], res: Result) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as s:
        async def one(se: Session) -> None:
            for t, body in enumerate(se.turns):
                calls = [_post(s, base, body, se.headers)]
                if t == 0:  # opencode's title request runs in parallel with the first agent turn
                    calls.append(_post(s, base, se.title, se.headers))
                got = await asyncio.gather(*calls)
                for i, (status, headers, data) in enumerate(got):
                    up = headers.get("X-OCache-Upstream", "single")
                    res.routed[up] = res.routed.get(up, 0) + 1
                    tm = data.get("timings") or {} if isinstance(data, dict) else {}
                    res.requests.append({
                        "session": se.name, "step": t + 1, "title": i == 1, "upstream": up,
                        "tier": headers.get("X-OCache-Tier"), "split": headers.get("X-OCache-Split"),
                        "prompt_n": tm.get("prompt_n"), "cache_n": tm.get("cache_n"),
                        "route": headers.get("X-OCache-Route")})
                    if status != 200:
                        res.failures.append(f"{se.name} turn {t + 1}: HTTP {status} {str(data)[:200]}")
                    elif i == 0:
                        res.answers[(se.name, t)] = data

        await asyncio.gather(*(one(se) for se in sess))


async def run_once(run: str, binary: Path, model: Path, sess: list[Session], workdir: Path,
                   threads: int, ctx: int) -> Result:
    from ocache.cache import OCacheLayer
    from ocache.proxy import RUNNER_KWARGS, Proxy
    from ocache.tiers import store as store_mod

    slots = workdir / run / "slots"
    slots.mkdir(parents=True, exist_ok=True)
    n_servers, np_ = (1, 4) if run == "single-np4" else (1, 2) if run == "single" else (2, 2)
    servers = [LlamaServer(binary=binary, model=model, n_parallel=np_, ctx_size=ctx * np_,
                           slot_save_path=slots, threads=threads,
                           log_path=workdir / run / f"server{i}.log", **SERVER) for i in range(n_servers)]
    for srv in servers:
        srv.start()
    meters = [PrefillMeter(srv.url) for srv in servers]
    cfg = Config(upstream=servers[0].url, upstreams=[s.url for s in servers] if n_servers > 1 else [],
                 cache_dir=str(workdir / run / "state"),
                 route_policy="round_robin" if run.startswith("round_robin") else "prefix",
                 tiers={"resident": {"server_args": servers[0].command()[1:]}})
    if run == "round_robin-plain":
        from ocache.layer import NullLayer

        cfg.no_cache = True
        proxy = Proxy(cfg, layer_factory=NullLayer, monitor=True)
    else:
        proxy = Proxy(cfg, layer_factory=lambda u, c: OCacheLayer(u, c), monitor=True)
    app = TestServer(proxy.make_app(), host="127.0.0.1")
    res = Result(run, 0, [])
    try:
        async with aiohttp.ClientSession() as http:
            for m in meters:
                await m.sample(http)
        await app.start_server(**RUNNER_KWARGS)
        t0 = time.perf_counter()
        await run_stream(f"http://127.0.0.1:{app.port}", sess, res)
        res.wall_s = time.perf_counter() - t0
        await proxy.wait_background()
        idle = getattr(proxy.layer, "idle", None)
        if idle is not None:
            await idle()
        async with aiohttp.ClientSession() as http:
            res.per_server = [await m.sample(http) for m in meters]
        res.prefill = sum(res.per_server)
    finally:
        await app.close()
        meta = (workdir / run / "state" / "store").resolve()
        s = store_mod._SHARED.pop(meta, None)  # the next run opens its own store
        if s is not None:
            s.close()
        for srv in servers:
            srv.stop()
    return res


async def cold_answers(binary: Path, model: Path, sess: list[Session], workdir: Path, threads: int,
                       ctx: int) -> dict[tuple[str, int], dict]:
    srv = LlamaServer(binary=binary, model=model, n_parallel=1, ctx_size=ctx, threads=threads,
                      log_path=workdir / "cold.log", **SERVER).start()
    out = {}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as s:
            for se in sess:
                for t, body in enumerate(se.turns):
                    async with s.post(srv.url + CHAT, json=dict(body, cache_prompt=False, id_slot=0)) as r:
                        out[(se.name, t)] = await r.json()
    finally:
        srv.stop()
    return out


def judge(res: Result, ref: dict) -> None:
    ok = n = 0
    for key, data in res.answers.items():
        want, got = Generation.from_response(ref[key]), Generation.from_response(data)
        n += 1
        if want is None or got is None:
            res.failures.append(f"{key}: a response without log-probabilities")
            continue
        v = compare(want, got)
        ok += v.exact
        if not v.exact:
            res.failures.append(f"{key}: {describe(v)}")
    res.exact = (ok, n)


def table(results: list[Result]) -> str:
    by = {r.run: r for r in results}
    best_single = min((by[r].prefill for r in ("single", "single-np4") if r in by), default=None)
    rr = by.get("round_robin")
    plain = by.get("round_robin-plain")
    lines = ["| run | servers × -np | server prefill (tokens) | per server | requests per server | "
             "/ round robin | / round robin (no ocache) | / best single | exact | wall s |",
             "|---|---|---:|---|---|---:|---:|---:|---|---:|"]
    for r in results:
        shape = "1 × 4" if r.run == "single-np4" else "1 × 2" if r.run == "single" else "2 × 2"
        shape += " (no ocache)" if r.run.endswith("-plain") else ""
        vs_rr = f"{r.prefill / rr.prefill:.3f}" if rr and rr.prefill else "-"
        vs_plain = f"{r.prefill / plain.prefill:.3f}" if plain and plain.prefill else "-"
        vs_single = f"{r.prefill / best_single:.3f}" if best_single else "-"
        exact = f"{r.exact[0]}/{r.exact[1]}" if r.exact else "-"
        routed = ", ".join(str(v) for _, v in sorted(r.routed.items()))
        lines.append(f"| {r.run} | {shape} | {r.prefill:,} | {' + '.join(f'{p:,}' for p in r.per_server)} | "
                     f"{routed} | {vs_rr} | {vs_plain} | {vs_single} | {exact} | {r.wall_s:.1f} |")
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> int:
    from ocache.bench.run import default_fixtures, fixtures_missing
    from ocache.toolchain import engine, models

    fixtures = Path(args.fixtures) if args.fixtures else default_fixtures()
    if fixtures is None or not fixtures.is_dir():
        print(fixtures_missing(fixtures, "bench-multi"), file=sys.stderr)
        return 2
    build = engine.find(stock=False) or engine.build(stock=False)
    model = models.make(args.preset)[args.model]
    sess = sessions(fixtures, args.turns, args.user_words)
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    results = []
    with tempfile.TemporaryDirectory(prefix="ocache-bench-multi-") as tmp:
        work = Path(tmp)
        for run in runs:
            r = await run_once(run, build.binary, model, sess, work, args.threads, args.ctx)
            print(f"{run}: server prefill {r.prefill:,} ({' + '.join(map(str, r.per_server))}), "
                  f"requests {r.routed}, {r.wall_s:.1f} s", flush=True)
            results.append(r)
        if args.exact:
            ref = await cold_answers(build.binary, model, sess, work, args.threads, args.ctx)
            for r in results:
                judge(r, ref)
    report = table(results)
    print(report)
    for r in results:
        for f in r.failures:
            print(f"{r.run}: {f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench-multi.md").write_text(
        f"# bench-multi: {len(sess)} concurrent opencode sessions in 2 folders, {args.turns} turns, "
        f"{args.model} ({args.preset})\n\n{report}\n")
    (out / "bench-multi.json").write_text(json.dumps(
        [{"run": r.run, "prefill": r.prefill, "per_server": r.per_server, "routed": r.routed,
          "wall_s": r.wall_s, "exact": r.exact, "failures": r.failures, "requests": r.requests}
         for r in results], indent=1))
    return 0 if all(not r.failures for r in results) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/bench-multi", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {', '.join(RUNS)}")
    p.add_argument("--turns", type=int, default=8, help="requests per session (default 8: the first "
                   "turn, then tool rounds)")
    p.add_argument("--user-words", type=int, default=1200, help="most words of one tool output")
    p.add_argument("--model", default="dense", choices=("dense", "hybrid"))
    p.add_argument("--preset", default="tiny")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ctx", type=int, default=16384, help="context per slot (tokens)")
    p.add_argument("--exact", action=argparse.BooleanOptionalAction, default=True,
                   help="compare every agent answer with a cold run (default on)")
    p.add_argument("--fixtures", help="shared fixtures folder (default ../shared/fixtures)")
    p.add_argument("--out", default="out", help="where bench-multi.md/.json go (default ./out)")
    return asyncio.run(main_async(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
