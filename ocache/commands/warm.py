"""``ocache warm DIR``: ask a running ocache to warm a project folder's head (``POST
/v1/cache/warm``, ``ocache/warm.py``) and print its progress."""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from typing import Any


def _cli(args: argparse.Namespace) -> int:
    folder = os.path.abspath(os.path.expanduser(args.dir))
    url = args.url.rstrip("/") + "/v1/cache/warm"
    headers = {"Content-Type": "application/json"}
    token = args.token or os.environ.get("OCACHE_ADMIN_TOKEN")
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=json.dumps({"dir": folder}).encode(), headers=headers, method="POST")
    try:
        resp = urllib.request.urlopen(req, timeout=args.timeout)
    except urllib.error.HTTPError as exc:
        try:
            msg = json.loads(exc.read()).get("error", "")
            if isinstance(msg, dict):  # ocache's error shape (ocache/admin.py)
                msg = msg.get("message", "")
        except (ValueError, AttributeError):
            msg = ""
        hint = ": pass --token TOKEN or set OCACHE_ADMIN_TOKEN" if exc.code == 401 else ""
        print(f"ocache warm: {msg or f'HTTP {exc.code} from {url}'}{hint}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"ocache warm: cannot reach ocache at {args.url} ({getattr(exc, 'reason', exc)}); is "
              "`ocache serve` running?", file=sys.stderr)
        return 2
    rc = 1
    with resp:
        for line in resp:
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if obj.get("done"):
                if obj.get("error"):
                    print(f"ocache warm: failed: {obj['error']}", file=sys.stderr)
                    rc = 1
                else:
                    print(f"warm: {folder}: {obj['tokens']} tokens in slot {obj['slot']} from {obj['source']} "
                          f"in {obj['seconds']:.2f} s")
                    rc = 0
            else:
                stage = obj.pop("stage", "?")
                print(f"  {stage}: " + ", ".join(f"{k}={v}" for k, v in obj.items()), flush=True)
    return rc


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("warm", help="warm a project folder's head in a running ocache",
                              description="Put the head of DIR (tools + system prompt of the last agent "
                              "request ocache saw there) into a slot: restored from the disk tier, or "
                              "prefilled and saved. Exits 1 if ocache never saw the folder.")
    p.add_argument("dir", metavar="DIR", help="project folder (as the agent reports it as its working directory)")
    p.add_argument("--url", default=os.environ.get("OCACHE_URL", "http://127.0.0.1:8081"),
                   help="the running ocache (default %(default)s, env OCACHE_URL)")
    p.add_argument("--admin-token", "--token", dest="token", default=None,
                   help="admin bearer token, when the server has admin_token set (env OCACHE_ADMIN_TOKEN)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds (default %(default)s)")
    p.set_defaults(func=_cli)
