"""The ``ocache`` command line.

Each concern's module registers its own subcommands through a ``register(subparsers)`` function
(one concern per module; this file only collects them). A registered subcommand sets
``func(args) -> int`` on its parser.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from ocache import __version__

#: Modules that contribute subcommands, in help order. A module missing a ``register`` is skipped.
COMMAND_MODULES = [
    "ocache.commands.serve",
    "ocache.commands.top",
    "ocache.commands.warm",
    "ocache.commands.drain",
    "ocache.commands.engine",
    "ocache.toolchain.models",
    "ocache.commands.doctor",
    "ocache.commands.maintenance",
    "ocache.bench.command",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ocache",
        description="A prefix/KV cache proxy for llama-server: clients change only their base URL.",
    )
    parser.add_argument("--version", action="version", version=f"ocache {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue
            raise
        register = getattr(mod, "register", None)
        if register is not None:
            register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # name the (sub)subcommand's usage, not the top-level one (`ocache serve --bogus`)
        target = parser
        while True:
            sub = next((a for a in target._actions if isinstance(a, argparse._SubParsersAction)), None)
            if sub is None:
                break
            name = getattr(args, sub.dest, None)
            if name not in sub.choices:
                break
            target = sub.choices[name]
        target.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 0
    try:
        return int(func(args) or 0)
    except BrokenPipeError:
        # the reader went away (`ocache serve --help-config | head`): stop quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
