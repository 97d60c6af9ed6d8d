"""``ocache engine build``: build the patched (or stock) llama-server into the cache."""

from __future__ import annotations

import argparse

from ocache.toolchain import engine


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("engine", help="build the patched llama-server from the pinned source")
    esub = p.add_subparsers(dest="engine_cmd", metavar="ACTION", required=True)
    b = esub.add_parser("build", help="build (or find cached) llama-server; prints its path")
    b.add_argument("--stock", action="store_true", help="build without patches/ (for comparison)")
    b.add_argument("--backend", default="cpu", choices=sorted(engine.BACKENDS),
                   help="GPU backend; only cpu is built and tested in CI")
    b.add_argument("-j", "--jobs", type=int, default=None, help="parallel compile jobs")
    b.set_defaults(func=_build)
    w = esub.add_parser("path", help="print the installed binary's path (exit 1 if not built)")
    w.add_argument("--stock", action="store_true")
    w.add_argument("--backend", default="cpu", choices=sorted(engine.BACKENDS),
                   help="the build of this backend (as built by `engine build --backend`)")
    w.set_defaults(func=_path)


def _build(args: argparse.Namespace) -> int:
    built = engine.build(stock=args.stock, backend=args.backend, jobs=args.jobs)
    print(built.binary)
    return 0


def _path(args: argparse.Namespace) -> int:
    found = engine.find(stock=args.stock, backend=args.backend)
    if not found:
        return 1
    print(found.binary)
    return 0
