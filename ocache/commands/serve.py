"""``ocache serve``: run the proxy (``ocache.proxy.serve``) with the configuration from
``ocache.yaml``, the environment and these flags (``--help-config`` lists every key)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from ocache import config as config_mod
from ocache.config import Config
from ocache.proxy import serve


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
    elif args.launch_args:
        raise config_mod.ConfigError("llama-server arguments given without --launch "
                                     "(use: ocache serve --launch -- ARGS)")
    if getattr(args, "verbose", False):
        overrides["log_level"] = "debug"
    return config_mod.load(args.config, overrides=overrides)


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
        asyncio.run(serve(cfg))
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
    p.add_argument("--admin-token", help="token for POST /v1/cache/clear")
    p.add_argument("--record", metavar="DIR", help="record each completion request (JSON lines, ocache/record.py) in DIR")
    p.add_argument("--redact", action="store_true",
                   help="with --record: keep structure and counts, drop all text (ocache/record.py)")
    p.add_argument("--no-cache", action="store_true", help="forward everything untouched (NullLayer)")
    p.add_argument("--launch", action="store_true",
                   help="start llama-server as a child with the arguments after `--`")
    p.add_argument("--help-config", action="store_true", help="print the config schema and exit")
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help="debug logging")
    p.add_argument("launch_args", nargs="*", metavar="-- LLAMA_SERVER_ARGS",
                   help="llama-server arguments (with --launch)")
    p.set_defaults(func=_cmd_serve)
