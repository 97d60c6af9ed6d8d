"""``ocache drain``: a planned stop of a running ocache (``POST /v1/cache/drain``: spill every
conversation, then exit; the route is ``ocache.admin.make_drain_handler``)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

log = logging.getLogger("ocache.drain")


def _cmd_drain(args: argparse.Namespace) -> int:
    import urllib.error
    import urllib.request

    url = args.url.rstrip("/") + "/v1/cache/drain"
    token = args.admin_token or os.environ.get("OCACHE_ADMIN_TOKEN")
    req = urllib.request.Request(url, method="POST", data=b"{}",
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {token}"} if token else {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        msg = exc.read().decode(errors="replace")[:300]
        try:  # the route's JSON error: print its message, not the JSON
            err = json.loads(msg).get("error")
            msg = (err.get("message") if isinstance(err, dict) else err) or msg
        except (ValueError, AttributeError):
            pass
        if exc.code == 401:
            print(f"ocache drain: {msg}: pass --admin-token TOKEN or set OCACHE_ADMIN_TOKEN", file=sys.stderr)
        elif exc.code == 404:
            print(f"ocache drain: {url} answered 404 (no admin_token configured, or an ocache without "
                  f"the drain route; send SIGTERM to the ocache process instead): {msg}", file=sys.stderr)
        else:
            print(f"ocache drain: HTTP {exc.code}: {msg}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"ocache drain: cannot reach ocache at {args.url}: {getattr(exc, 'reason', exc)}",
              file=sys.stderr)
        return 2
    log.debug("drain answer: %s", body.strip())
    print(f"ocache drain: {args.url} is draining: in-flight requests finish, every conversation "
          "is spilled to disk, then it exits")
    if args.wait <= 0:
        return 0
    deadline = time.monotonic() + args.wait
    while time.monotonic() < deadline:  # poll until the listener is gone (the drain finished)
        try:
            with urllib.request.urlopen(args.url.rstrip("/") + "/v1/cache/stats", timeout=2):
                pass
        except (urllib.error.URLError, OSError):
            print("ocache drain: ocache stopped")
            return 0
        time.sleep(0.5)  # polling interval for a process we do not own, not synchronisation
    print(f"ocache drain: still running after {args.wait:.0f} s", file=sys.stderr)
    return 1


def register(subparsers) -> None:
    """Add ``ocache drain`` (planned stop of a running ocache: spill every conversation, then exit)."""
    p = subparsers.add_parser("drain", help="stop a running ocache after spilling every conversation",
                              description="POST /v1/cache/drain: the running ocache stops accepting, "
                                          "finishes in-flight requests, spills every slot's conversation "
                                          "to disk, then exits; the next start restores the most recent.")
    p.add_argument("--url", default=os.environ.get("OCACHE_URL", "http://127.0.0.1:8081"),
                   help="the running ocache (default %(default)s, env OCACHE_URL), as ocache stats, "
                   "top and warm read it")
    p.add_argument("--admin-token", "--token", dest="admin_token",
                   help="admin token (default $OCACHE_ADMIN_TOKEN)")
    p.add_argument("--wait", type=float, default=120.0, help="seconds to wait for it to exit (0: do not wait)")
    p.set_defaults(func=_cmd_drain)
