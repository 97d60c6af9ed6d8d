"""``ocache doctor``: print the checks of ``ocache/llama/checks.py`` for a running server or a
command line (README "Commands").

Exit status (``ocache.llama.checks.verdict``, said again in the last line, so a script can use
doctor as a check): 0 when every tier can work and no flag is an error; 1 when a tier is off, a flag
is an error, or the configured remote store failed its check; 2 when there is nothing to check (no
server and no command line, or the URL is not llama-server). With ``--json`` the same status, and
the JSON carries ``ok`` and ``verdict`` (the last line's text)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from ocache.llama.checks import FLAGS_FIX, NotLlamaServer, offline, probe, tiers_off, tiers_off_lines, verdict
from ocache.textsafe import term


def _cmd(args: argparse.Namespace) -> int:
    argv = list(args.server_args) if args.server_args else None
    upstream = args.upstream
    if upstream is None or argv is None:
        try:
            from ocache.config import load

            cfg = load(args.config) if args.config else load()
            upstream = upstream or cfg.upstream
            if argv is None and cfg.launch:
                argv = list(cfg.launch)
            server_args = ((cfg.tiers or {}).get("resident") or {}).get("server_args")
            if argv is None and server_args:  # the README's way to declare an external server's flags
                argv = [str(a) for a in server_args]
        except Exception as exc:  # no config: defaults
            print(f"(config not read: {exc})", file=sys.stderr)
            upstream = upstream or "http://127.0.0.1:8080"
    where = f"llama-server {upstream}"
    if args.offline:
        if argv is None:
            print("ocache doctor --offline needs the llama-server command line after `--`", file=sys.stderr)
            return 2
        findings, info = offline(argv, args.head_tokens)
        where = "command line (offline)"
    else:
        try:
            findings, info = asyncio.run(probe(upstream, argv, args.api_key, args.head_tokens))
        except NotLlamaServer as exc:
            print(term(f"[error] upstream: {upstream} is not llama-server ({exc})"))
            return 2
        except Exception as exc:
            if argv is None:
                print(term(f"cannot query llama-server at {upstream}: {exc}"), file=sys.stderr)
                return 2
            print(term(f"(cannot query llama-server at {upstream}: {exc}; checking the command line "
                       "only)"), file=sys.stderr)
            findings, info = offline(argv, args.head_tokens)
            where = "command line (offline)"
    off = tiers_off(findings)
    if args.json:
        code, last = verdict(findings)
        print(json.dumps({"info": info, "findings": [f.__dict__ for f in findings],
                          "tiers_off": [t.__dict__ for t in off], "ok": code == 0, "verdict": last},
                         indent=1))
        return code
    print("\n".join(term(x) for x in tiers_off_lines(off)))
    print(term(f"{where}: " + ", ".join(f"{k} {v}" for k, v in info.items())))
    if info.get("flags") == "unknown":
        print(f"  (launch flags unknown: {FLAGS_FIX}, to check them too)")
    for f in findings:
        print(f"  {term(f)}")
    code, last = verdict(findings, _remote_check(args))
    print(last)
    return code


def _remote_check(args: argparse.Namespace) -> bool | None:
    """Print the check of ``store.remote`` (``ocache.tiers.remote.check_remote``) when the config
    names one; returns whether it passed (None: no remote configured, or no config)."""
    from ocache.config import ConfigError, load

    try:
        cfg = load(args.config) if args.config else load()
    except ConfigError as exc:   # a refused store.remote is a failed check (its message shows no secret)
        if str(exc).startswith("store.remote"):
            print(f"  [error] {term(str(exc))}")
            return False
        return None
    except Exception:
        return None
    from ocache.tiers.remote import check_remote, remote_warnings

    got = asyncio.run(check_remote(cfg))
    if got is None:
        return None
    print(f"  [{'ok' if got[0] else 'error'}] {term(got[1])}")
    for line in remote_warnings(cfg):
        print(f"  [warn] {term(line)}")
    return got[0]


def register(subparsers: Any) -> None:
    """``ocache doctor [--upstream URL] [-- LLAMA-SERVER-ARGS...]``."""
    p = subparsers.add_parser("doctor", help="check the llama-server flags each cache tier needs")
    p.add_argument("--upstream", help="llama-server base URL (default: the config's upstream)")
    p.add_argument("--config", help="ocache.yaml to read upstream/launch from")
    p.add_argument("--api-key", help="llama-server --api-key, if set")
    p.add_argument("--head-tokens", type=int, help="harness head length (tokens) to size --checkpoint-min-step")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--offline", action="store_true",
                   help="check the command line after `--` alone, without querying a server")
    p.add_argument("server_args", nargs=argparse.REMAINDER, help="-- then the llama-server arguments")
    p.set_defaults(func=_doctor_entry)


def _doctor_entry(args: argparse.Namespace) -> int:
    if args.server_args and args.server_args[0] == "--":
        args.server_args = args.server_args[1:]
    return _cmd(args)
