"""``ocache serve``: run the proxy (``ocache.serving.serve``) with the configuration from
``ocache.yaml``, the environment and these flags (``--help-config`` lists every key)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import Any

from ocache import config as config_mod
from ocache.config import Config
from ocache.serving import serve

log = logging.getLogger("ocache.serve")

#: seconds ``announce_tiers`` waits for llama-server to be ready (a large model loads for minutes;
#: past this the tiers are still checked, at the first request, and logged then)
ANNOUNCE_WAIT_S = 300.0
_announcing: set[asyncio.Task] = set()


async def announce_tiers(proxy: Any, wait_s: float = ANNOUNCE_WAIT_S) -> list[str]:
    """Check the server's setup as soon as it is ready, before any request, and log which tiers
    are off, why and the one-line fix (``ocache.llama.checks.tiers_off_lines``; every tier on: one
    info line). Returns the lines logged ([] when there is no cache layer to check, e.g.
    ``--no-cache``, the server was not ready within ``wait_s`` seconds, or a launched child exited
    at each start until the supervisor gave up: that is logged with its exit status, not as a
    timeout). Never raises."""
    from ocache.cache.report import tiers_off
    from ocache.llama.checks import tiers_off_lines

    layer = proxy.layer
    layers = [s.layer for s in layer.servers] if hasattr(layer, "servers") else [layer]
    out: list[str] = []
    for one in layers:
        if not hasattr(one, "ensure_ready"):
            continue
        up = one.upstream
        try:
            if not await up.wait_ready(wait_s):
                why = getattr(up, "abandoned_why", None)
                if why:  # a launched child that cannot start: it exited, no time ran out
                    log.warning("tiers not checked: %s (%s)", why, up.base_url)
                else:
                    log.warning("llama-server %s not ready after %.0f s: its tiers are checked at the "
                                "first request", up.base_url, wait_s)
                continue
            await one.ensure_ready()
        except Exception as exc:  # the first request checks again; never stop serving for this
            log.warning("tiers not checked at start (%s): they are at the first request", exc)
            continue
        lines = tiers_off_lines(tiers_off(one))
        for line in lines:
            (log.info if line.startswith("tiers: all on") else log.warning)(
                "%s%s", f"{up.base_url}: " if len(layers) > 1 else "", line)
        out += lines
    return out


def _announce_when_listening(proxy: Any, port: int) -> None:
    """``serve``'s ``ready`` callback: ``announce_tiers`` in the background."""
    task = asyncio.get_running_loop().create_task(announce_tiers(proxy))
    _announcing.add(task)
    task.add_done_callback(_announcing.discard)


def build_config(args: argparse.Namespace) -> Config:
    ups = args.upstream if isinstance(args.upstream, list) else ([args.upstream] if args.upstream else [])
    overrides = {
        "host": args.host, "port": args.port, "upstream": ups[0] if ups else None,
        "upstreams": ups if len(ups) > 1 else None,
        "launch_replicas": getattr(args, "replicas", None),
        "admin_token": args.admin_token, "record_dir": args.record,
        "no_cache": True if args.no_cache else None,
        "record_redact": True if args.redact else None,
    }
    if args.launch:
        if not args.launch_args:
            raise config_mod.ConfigError("--launch needs the llama-server arguments after `--` "
                                         "(ocache serve --launch -- -m model.gguf ...)")
        overrides["launch"] = list(args.launch_args)
    if getattr(args, "verbose", False):
        overrides["log_level"] = "debug"
    cfg = config_mod.load(args.config, overrides=overrides)
    if getattr(args, "replicas", None) is not None and not cfg.launch:
        raise config_mod.ConfigError("--replicas starts llama-server children: it needs --launch -- ARGS "
                                     "(or `launch` in the config); for servers already running, give "
                                     "--upstream once per server")
    if args.launch_args and not args.launch:
        if cfg.launch:
            raise config_mod.ConfigError("the config launches llama-server (`launch`), so the arguments "
                                         "after `--` would be ignored: use ocache serve --launch -- ARGS")
        # a server ocache does not launch: `-- ARGS` are its flags, as tiers.resident.server_args
        # (this flag wins over the YAML's, like every flag); the other tiers' keys are kept
        tiers = dict(cfg.tiers or {})
        tiers["resident"] = {**(tiers.get("resident") or {}), "server_args": list(args.launch_args)}
        cfg.tiers = tiers
    return cfg


def _cmd_serve(args: argparse.Namespace) -> int:
    if args.help_config:
        print(config_mod.describe())
        return 0
    try:
        cfg = build_config(args)
    except config_mod.ConfigError as exc:
        print(f"ocache serve: config error: {exc}", file=sys.stderr)
        return 2
    logging.getLogger().setLevel(cfg.log_level.upper())
    if cfg.cache_dir:
        os.environ["OCACHE_STATE_DIR"] = cfg.cache_dir  # ocache.paths.state_root() reads it
    try:
        asyncio.run(serve(cfg, ready=_announce_when_listening))
    except OSError as exc:
        print(f"ocache serve: cannot listen on {cfg.host}:{cfg.port}: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # LaunchError and the like: a clear message, not a traceback
        from ocache.supervisor import LaunchError

        if isinstance(exc, LaunchError):
            print(f"ocache serve: {exc}", file=sys.stderr)
            return 1
        raise
    return 0


def register(subparsers) -> None:
    """Add ``ocache serve`` to the CLI."""
    p = subparsers.add_parser(
        "serve", help="run the caching proxy in front of llama-server",
        description="Run the ocache proxy. Config: ocache.yaml < env OCACHE_* < these flags "
                    "(--help-config lists every key).")
    p.add_argument("--config", metavar="FILE", help="YAML config file (default ./ocache.yaml)")
    p.add_argument("--host", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (default 8081)")
    p.add_argument("--upstream", metavar="URL", action="append",
                   help="llama-server URL (default http://127.0.0.1:8080); repeat it for several "
                        "servers of one model (config `upstreams`, ocache/router.py)")
    p.add_argument("--replicas", type=int, metavar="N",
                   help="with --launch: start N llama-server children (config launch_replicas; "
                        "launch_devices gives each its CUDA_VISIBLE_DEVICES)")
    p.add_argument("--admin-token", help="bearer token of the admin routes (POST /v1/cache/clear, "
                   "/v1/cache/warm, /v1/cache/drain; config admin_token)")
    p.add_argument("--record", metavar="DIR", help="record each completion request (JSON lines, ocache/record.py) in DIR")
    p.add_argument("--redact", action="store_true",
                   help="with --record: keep structure and counts, drop all text (ocache/record.py)")
    p.add_argument("--no-cache", action="store_true", help="forward everything untouched (NullLayer)")
    p.add_argument("--launch", action="store_true",
                   help="start llama-server as a child with the arguments after `--` (without "
                        "--launch, the arguments after `--` are the flags of the server at "
                        "--upstream: config tiers.resident.server_args)")
    p.add_argument("--help-config", action="store_true", help="print the config schema and exit")
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help="debug logging")
    p.add_argument("launch_args", nargs="*", metavar="-- LLAMA_SERVER_ARGS",
                   help="llama-server arguments: the child's (--launch), else those the server "
                        "at --upstream was started with")
    p.set_defaults(func=_cmd_serve)
