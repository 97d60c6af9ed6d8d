"""``ocache stats`` (a readable summary) and ``ocache top`` (the dashboard in the terminal, ``rich``).

Both read ``GET /ocache/api/view`` of a running ocache (the figures of ``ocache/dashboard.py``,
made from ``/v1/cache/stats``); with the admin token (``--token`` / ``$OCACHE_ADMIN_TOKEN``) the slots'
session ids are shown. Counters run since that ocache started (its uptime is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from ocache.textsafe import rich_text, term


class FetchError(RuntimeError):
    """The running ocache could not be read (message says why, for the user)."""


def fetch_view(url: str, token: str | None, timeout: float = 10.0) -> dict:
    """``GET {url}/ocache/api/view``. Raises FetchError (unreachable, a wrong token, not an ocache)."""
    req = urllib.request.Request(url.rstrip("/") + "/ocache/api/view",
                                 headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            v = json.loads(r.read())
    except urllib.error.HTTPError as exc:
        raise FetchError(f"{url}: HTTP {exc.code} from /ocache/api/view (is this an ocache?)") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise FetchError(f"no ocache at {url} ({reason}); start it with `ocache serve` or pass --url") from None
    except ValueError:
        raise FetchError(f"{url}: /ocache/api/view did not answer JSON (is this an ocache?)") from None
    if v.get("token_rejected"):  # the guard serves a redacted view to a wrong token (ocache/admin.py)
        raise FetchError(f"{url}: wrong admin token (--token / OCACHE_ADMIN_TOKEN)")
    return v


def n(v: Any) -> str:
    return "–" if v is None else f"{int(round(v)):,}"


def human_bytes(v: float | None) -> str:
    if v is None:
        return "–"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(v) < 1000 or unit == "TB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1000
    return str(v)


def secs(s: float | None) -> str:
    if s is None:
        return "–"
    if s < 1:
        return f"{s * 1e3:.0f} ms"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def tier_lines(v: dict) -> list[str]:
    """The view's ``tiers_off_lines``; "all on" once checked; "not checked yet" before the layer's
    first setup checks; nothing without a cache layer (``tiers_checked`` None)."""
    if v.get("tiers_off_lines"):
        return list(v["tiers_off_lines"])
    if v.get("tiers_checked") is None:
        return []
    if v["tiers_checked"]:
        return ["tiers: all on (resident, head, disk, session)"]
    return ["tiers: not checked yet (llama-server has not been ready since ocache started)"]


def alone_lines(t: dict, rate: str) -> list[str]:
    """The headline: the saving against llama-server alone with the same flags (none without a
    cache layer)."""
    if t.get("saved_vs_alone") is None:
        return []
    return [f"saved   {n(t['saved_vs_alone'])} tokens = {secs(t.get('saved_vs_alone_s'))} of prefill{rate} "
            f"against llama-server alone with the same flags (it would have prefilled "
            f"{n(t['alone_prefill'])}, through ocache it prefilled {n(t['ocache_prefill'])})"]


def summary_lines(v: dict, url: str) -> list[str]:
    """``ocache stats``: the view as a few plain lines."""
    t, u, tr, st = v["totals"], v["upstream"], v["tiers"], v["store"]
    rate = f" at the measured {n(t['prefill_tok_s'])} tokens/s" if t["prefill_tok_s"] else ""
    by_tier = ", ".join(f"{k} {n(x)}" for k, x in sorted(t.get("reused_by_tier", {}).items(),
                                                        key=lambda kv: -kv[1])) or "–"
    lines = [
        f"ocache {url}: llama-server {u['state']}, epoch {u['epoch']} ({u['restarts']} restarts), "
        f"{term(u['build_info'] or 'build unknown')}; up {secs(v['uptime_s'])}",
        *(term(x) for x in tier_lines(v)),
        *alone_lines(t, rate),
        f"vs cold {n(t['saved'])} tokens = {secs(t['saved_s'])} of prefill saved against a cold prefill "
        f"of every request (reused {n(t['reused'])} minus {n(t.get('own_outside', 0))} ocache prefilled outside "
        f"the requests; the {n(t.get('split', 0))} it split for them are in prefilled, counted once)",
        f"served  {n(t['completions'])} completions: prefilled {n(t['prefilled'])}, reused {n(t['reused'])}"
        f" tokens; reused by source: {by_tier}"
        + (f"; {n(t['unparsed'])} unparsed bodies forwarded as they were (not counted)"
           if t.get("unparsed") else ""),
        f"tiers   head {n(tr['head']['saves'])} saved / {n(tr['head']['restores'])} restored; disk "
        f"{n(tr['disk']['anchors'])} anchors, {n(tr['disk']['restores'])} restores"
        f" (p50 {secs(tr['disk']['restore_s_p50'])}); session {n(tr['session']['spills'])} spills, "
        f"{n(tr['session']['restores'])} restores (p50 {secs(tr['session']['restore_s_p50'])})",
        f"store   {n(st['entries'])} entries, {human_bytes(st['bytes'])} of "
        f"{human_bytes(st['budget_bytes'])}: " + (", ".join(
            f"{k} {n(x['entries'])} / {human_bytes(x['bytes'])}" for k, x in st["by_kind"].items()) or "empty"),
    ]
    nx = st.get("next_eviction")
    if nx:
        lines.append(f"        evicted first: {'anchor' if nx['kind'] == 'a' else 'spill'} {nx['key']} "
                     f"({n(nx['n_tokens'])} tokens, {human_bytes(nx['bytes'])}, {nx['hits']} hits)")
    for s in v["slots"]:
        who = s.get("owner") or ("(session: --token)" if s["owner_hidden"] else "")
        lines.append(f"slot {s['id']}  {term(s['kind'] or ('empty' if not s['tokens'] else 'unknown')):7} "
                     f"{n(s['tokens']):>8} tokens  idle {secs(s['idle_s'])}  {term(who)}".rstrip())
    lines.append(f"fail-open {n(t['fail_open'])}, mispredictions {n(t['mispredictions'])}, "
                 f"in flight {n(t['inflight'])}")
    for w in v.get("setup_warnings") or []:
        lines.append(f"warning: {term(w)}")
    return lines


def top_renderable(v: dict, url: str, rows: int = 12) -> Group:
    """``ocache top``: header, totals, slots, last requests, tiers, events."""
    t, u = v["totals"], v["upstream"]
    head = Text.assemble(("ocache ", "bold"), f"{term(url)}  llama-server ",
                         (str(u["state"]), "bold green" if u["state"] == "ready" else "bold red"),
                         f"  epoch {u['epoch']}  restarts {u['restarts']}  up {secs(v['uptime_s'])}")
    totals = Text.assemble(
        ("saved vs llama-server alone ", "dim"), (n(t.get("saved_vs_alone")), "bold"), " tokens ",
        ("= ", "dim"), (secs(t.get("saved_vs_alone_s")), "bold"),
        ("   vs a cold prefill ", "dim"), n(t["saved"]), " = ", secs(t["saved_s"]),
        ("   reused ", "dim"), n(t["reused"]), ("   prefilled ", "dim"), n(t["prefilled"]),
        ("   completions ", "dim"), n(t["completions"]), ("   disk ", "dim"), human_bytes(t["disk_bytes"]),
        ("   fail-open ", "dim"), n(t["fail_open"]))
    slots = Table(title="slots", title_justify="left", expand=True)
    for c in ("slot", "holds", "tokens", "head", "session", "idle"):
        slots.add_column(c, justify="right" if c in ("slot", "tokens", "head", "idle") else "left")
    for s in v["slots"]:
        slots.add_row(str(s["id"]), rich_text(("busy " if s["busy"] else "") + (s["kind"] or ("empty" if not s["tokens"] else "unknown"))),
                      n(s["tokens"]), n(s["head_len"]),
                      rich_text(s.get("owner") or ("(--token)" if s["owner_hidden"] else "–")), secs(s["idle_s"]))
    reqs = Table(title="last requests", title_justify="left", expand=True)
    for c in ("request", "kind", "slot", "from", "prefilled", "reused", "restore", "ttft"):
        reqs.add_column(c, justify="right" if c in ("slot", "prefilled", "reused", "restore", "ttft") else "left")
    for r in list(reversed(v["requests"]))[:rows]:
        reqs.add_row(rich_text(r["request_id"]), rich_text(r["kind"] or "–"), "–" if r["slot"] is None else str(r["slot"]),
                     rich_text(r["tier"] or "–"), n(r["prefilled"]), n(r["reused"]),
                     "–" if r["restore_ms"] is None else f"{r['restore_ms']:.1f} ms",
                     "–" if r["ttft_ms"] is None else f"{r['ttft_ms']:.0f} ms")
    tr = v["tiers"]
    tiers = Text(f"head {tr['head']['saves']} saved/{tr['head']['restores']} restored · disk "
                 f"{tr['disk']['anchors']} anchors/{tr['disk']['restores']} restores · session "
                 f"{tr['session']['spills']} spills/{tr['session']['restores']} restores · store "
                 f"{v['store']['entries']} entries {human_bytes(v['store']['bytes'])}")
    ev = Text("\n".join(f"{time.strftime('%H:%M:%S', time.localtime(e['time']))} {term(e['source'])}: {term(e['message'])}"
                        for e in (v.get("events") or [])[-6:]), style="dim")
    return Group(head, totals, slots, reqs, tiers, ev)


def _defaults(args: argparse.Namespace) -> tuple[str, str | None]:
    return args.url, args.token or os.environ.get("OCACHE_ADMIN_TOKEN") or None


def _first_view(command: str, url: str, token: str | None) -> dict | None:
    """The stats view from ``url``, or None after saying on stderr why it could not be read."""
    try:
        return fetch_view(url, token)
    except FetchError as exc:
        print(f"ocache {command}: {exc}", file=sys.stderr)
        return None


def cmd_stats(args: argparse.Namespace) -> int:
    url, token = _defaults(args)
    v = _first_view("stats", url, token)
    if v is None:
        return 1
    if args.json:
        print(json.dumps(v, indent=2))
    else:
        print("\n".join(summary_lines(v, url)))
    return 0


def piped_width(console: Console, view: Any, at_least: int = 80) -> int:
    """The width ``ocache top --once`` prints at when its output is not a terminal: as wide as
    ``view``'s widest line (rich would cut every line at 80 columns there: its default width
    without a terminal, unless ``$COLUMNS`` says more), never under ``at_least`` or ``$COLUMNS``."""
    from rich.measure import Measurement

    widest = Measurement.get(console, console.options.update(max_width=100_000), view).maximum
    return max(at_least, console.width, widest)


def cmd_top(args: argparse.Namespace) -> int:
    from rich.live import Live

    url, token = _defaults(args)
    console = Console()
    v = _first_view("top", url, token)
    if v is None:
        return 1
    if args.once:
        view = top_renderable(v, url)
        if not console.is_terminal:
            console = Console(width=piped_width(console, view))
        console.print(view)
        return 0
    try:
        with Live(top_renderable(v, url), console=console, screen=True, auto_refresh=False) as live:
            while True:
                time.sleep(args.interval)  # the refresh period of a terminal view
                try:
                    v = fetch_view(url, token)
                    live.update(top_renderable(v, url), refresh=True)
                except FetchError as exc:
                    live.update(Text(f"ocache top: {exc} (retrying every {args.interval:g} s)",
                                     style="bold red"), refresh=True)
    except KeyboardInterrupt:
        return 0


def register(subparsers: Any) -> None:
    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--url", default=os.environ.get("OCACHE_URL", "http://127.0.0.1:8081"),
                       help="the running ocache (default %(default)s, env OCACHE_URL)")
        p.add_argument("--admin-token", "--token", dest="token", default=None,
                       help="admin token: shows the slots' session ids (env OCACHE_ADMIN_TOKEN)")

    p = subparsers.add_parser("stats", help="a readable summary of a running ocache",
                              description="Tokens saved, hit sources, slots, tiers and the store of a "
                              "running ocache (since it started).")
    common(p)
    p.add_argument("--json", action="store_true", help="the figures as JSON (GET /ocache/api/view)")
    p.set_defaults(func=cmd_stats)
    p = subparsers.add_parser("top", help="live view of a running ocache in the terminal",
                              description="The dashboard (http://127.0.0.1:8081/ocache/) in the "
                              "terminal; Ctrl-C quits.")
    common(p)
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default %(default)s)")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.set_defaults(func=cmd_top)
