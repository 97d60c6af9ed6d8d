"""``ocache bench``'s command line: the arguments, and which runner takes the run (the replay of
``ocache.bench.run``, a day over several hosts in ``ocache.bench.hosts``, the ``long`` preset in
``ocache.bench.long``)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

from ocache.bench import run
from ocache.bench.replay import scenario_from_recording
from ocache.bench.run import (CONFIGS, GOAL, PRESETS, Bench, default_fixtures, fixtures_missing,
                              load_scenarios, recorded_days, scenarios_dir)


def _cmd(args: argparse.Namespace) -> int:
    fixtures = Path(args.fixtures) if args.fixtures else default_fixtures()
    day_notes: list[str] = []
    if args.preset != "long" and args.recording:
        scenarios = [scenario_from_recording(r) for r in args.recording]
    elif fixtures is None or not fixtures.is_dir():
        print(fixtures_missing(fixtures), file=sys.stderr)
        return 2
    elif args.preset == "long":  # real sizes, ocache vs direct: its own runner and report
        from ocache.bench.long import run_long

        return run_long(args, fixtures)
    else:
        names = args.scenario
        if names is None and not args.all_scenarios:
            names = list(PRESETS[args.preset].scenarios or []) or None
        scenarios = load_scenarios(Path(args.scenarios), fixtures, names)
        if names is None:  # a day over several hosts runs only when named (ocache/bench/hosts.py)
            scenarios = [sc for sc in scenarios if sc.hosts == 1]
        if args.scenario is None and not args.no_recordings:
            days, day_notes = recorded_days(PRESETS[args.preset].recordings)
            scenarios += days
            for n in day_notes:
                print(f"ocache bench: {n}", file=sys.stderr)
    configs = tuple(c.strip() for c in args.configs.split(",") if c.strip())
    bad = set(configs) - set(CONFIGS)
    if bad:
        print(f"ocache bench: unknown configurations {sorted(bad)} (a, b, c)", file=sys.stderr)
        return 2
    models = tuple(m.strip() for m in args.models.split(",")) if args.models else None
    out = Path(args.out)
    command = "ocache bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else [])
    # a day over several hosts has its own runner and report (ocache/bench/hosts.py)
    several = [sc for sc in scenarios if sc.hosts > 1]
    scenarios = [sc for sc in scenarios if sc.hosts == 1]
    rc = 0
    if several:
        from ocache.bench.hosts import run_hosts

        rc = run_hosts(Bench(args.preset, several, out, configs=("b", "c"), models=models,
                             time_scale=args.time_scale, threads=args.threads, template=args.template),
                       several, command.strip())
        if not scenarios:
            return rc
    bench = Bench(args.preset, scenarios, out, configs=configs, models=models,
                  time_scale=args.time_scale, threads=args.threads, template=args.template,
                  ctx_per_slot=args.ctx_per_slot)
    bench.notes.extend(day_notes)
    t0 = time.monotonic()
    asyncio.run(bench.run())
    wall = time.monotonic() - t0
    md, pngs = bench.write(wall, command.strip())
    print(bench.summary_table())
    if "c" in configs:
        print(f"\nNever worse than llama-server alone:\n{bench.never_worse_table()}")
        print(f"\nRequests where (c) prefilled more than (a) or (b):\n{bench.worse_requests()}")
        print(f"\nWhere (c) is below {GOAL} efficiency or not exact:\n{bench.shortfalls()}")
    if {"b", "c"} <= set(configs):
        print(f"\nThe headline saving ocache reported against the measured (b) - (c):\n{bench.alone_table()}")
    print(f"\nwrote {md}" + "".join(f", {p}" for p in pngs) + f" ({wall / 60:.1f} min)")
    failed = any(run.error for per in bench.results.values() for runs in per.values()
                 for run in runs.values())
    return 1 if failed or rc else 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "bench", help="replay agent sessions: stock vs tuned llama-server vs ocache, vs the oracle",
        description=(run.__doc__ or "").split("\n\n")[0])
    p.add_argument("--preset", choices=sorted([*PRESETS, "long"]), default="bench",
                   help="model sizes and server threads (tiny: a ~1-2 minute smoke run; long: "
                   "32k/64k/128k-token conversations, ocache vs direct, ocache/bench/long.py)")
    p.add_argument("--long-sizes", metavar="N,N", help="long: prompt sizes in tokens "
                   "(default 32768,65536,126000)")
    p.add_argument("--long-turns", type=int, default=3, help="long: warm next turns after the growth")
    p.add_argument("--long-max-tokens", type=int, default=32, help="long: tokens per answer")
    p.add_argument("--scenarios", default=str(scenarios_dir()), metavar="DIR",
                   help="folder of scenario YAML files (default: the shipped scenarios/, %(default)s)")
    p.add_argument("--scenario", action="append", metavar="NAME",
                   help="run only this scenario (file stem); repeatable. A scenario with `hosts: 2` "
                   "(two_hosts_day) runs over two hosts with and without the shared tier and on one "
                   "host (ocache/bench/hosts.py; bench-<preset>-hosts.md)")
    p.add_argument("--all-scenarios", action="store_true",
                   help="run every one-host scenario in the folder (the tiny preset runs four by "
                   "default; a `hosts: 2` scenario runs only when --scenario names it)")
    p.add_argument("--recording", action="append", metavar="PATH",
                   help="replay a stream recorded by `ocache serve --record` instead of scenarios")
    p.add_argument("--no-recordings", action="store_true",
                   help="leave out the preset's recorded real-client days (tiny: an opencode day, "
                   "recorded once with the real opencode from npm; `--scenario` leaves them out too)")
    p.add_argument("--fixtures", metavar="DIR", help="client request captures (default "
                   "$OCACHE_SHARED/fixtures, else ../shared/fixtures beside the checkout)")
    p.add_argument("--configs", default="a,b,c", help="configurations to run (default a,b,c)")
    p.add_argument("--models", help="comma-separated: hybrid,dense (default: the preset's)")
    p.add_argument("--time-scale", type=float, default=None,
                   help="multiply scenario gaps (default: the preset's; 0 = no gaps)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="llama-server -t/-tb (default: the preset's, 1; use 2 only on an idle "
                   "machine with more cores than servers)")
    p.add_argument("--template", metavar="NAME", default=None,
                   help="serve every scenario's model with this chat template of the pinned source's "
                   "models/templates/ (a file name; 'real': Qwen3.5-4B.jinja on hybrid, "
                   "Qwen-Qwen3-0.6B.jinja on dense; 'ocache': the models' own), for (a), (b) and (c) "
                   "alike; default: each scenario's `template:`, else the models' own")
    p.add_argument("--ctx-per-slot", type=int, default=None, metavar="N",
                   help="llama-server context per slot in tokens, every configuration (default: the "
                   "preset's, 12288)")
    p.add_argument("--out", default="out", metavar="DIR", help="output folder (default ./out)")
    p.set_defaults(func=_cmd)
