"""``ocache cache ls|gc|clear``: look after the store offline (README "Commands").

These commands work on the files directly (``ocache.tiers.store``), without a running ocache:

* ``ls``   a table of entries (kind, project folder, client, model, tokens, size, hits, last use,
  eviction order, reason, key), read-only
  (safe next to a running ocache: no lock taken, nothing written);
* ``gc``   remove entries past the TTL, evict by value down to the budget, remove orphan files
  (takes the store's lock: refuses while ocache runs, use the admin route then);
* ``clear`` delete every entry (or one kind: ``--kind anchors|spills|heads``).

No store yet (a fresh machine: nothing saved) is not an error: each says so and exits 0.

The store lives in ``<cache dir>/store`` (records, index); the slot files in the server's
``--slot-save-path``, which the store recorded in ``store.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from ocache.textsafe import term
from ocache.tiers.evict import ValuePolicy
from ocache.tiers.store import DAY_S, LockedError, Store, data_dir_of

KINDS = {"anchors": "a", "spills": "s", "heads": "h", "all": None}
KIND_NAMES = {"a": "anchor", "s": "spill", "h": "head"}
#: REASON as ``ls`` shows it, where the recorded word reads like something else: an anchor the disk
#: tier saved at a conversation's first user message records ``session`` (``DiskTier.anchor_lines``,
#: ocache/tiers/disk.py), which beside the spills (kind ``spill``, the session tier) read as one.
#: One word, so the columns after it split on whitespace from the end as before.
REASON_LABELS = {("a", "session"): "session-start"}


def reason_label(kind: str, reason: str) -> str:
    """The REASON column for an entry of ``kind`` (``a``/``s``/``h``) saved for ``reason``: an
    anchor's ``head`` (the harness head), ``session-start`` (the prefix up to the first user
    message), ``repeat`` (a repeated grid line); a spill's ``evict`` / ``drain``; a head's ``head``."""
    return REASON_LABELS.get((kind, reason), reason)


def _meta_dir(args: argparse.Namespace) -> Path:
    """``<root>/store``, the root resolved as ``ocache serve`` does: ``--cache-dir``, else
    ``cache_dir`` of the config (``--config`` / ``$OCACHE_CONFIG`` / ``./ocache.yaml``), else
    ``$OCACHE_STATE_DIR``, ``$OCACHE_CACHE_DIR``, ``~/.cache/ocache`` (ocache/paths.py)."""
    if args.cache_dir:
        return Path(args.cache_dir).expanduser() / "store"
    from ocache import config as config_mod

    try:
        cfg = config_mod.load(getattr(args, "config", None))
    except config_mod.ConfigError as exc:
        print(f"ocache cache: config ignored ({exc})", file=sys.stderr)
        cfg = None
    if cfg is not None and cfg.cache_dir:
        return Path(cfg.cache_dir).expanduser() / "store"
    from ocache.paths import state_root

    return state_root() / "store"


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def _ago(t: float, now: float) -> str:
    d = max(0.0, now - t)
    if d < 3600:
        return f"{d / 60:.0f}m"
    if d < DAY_S:
        return f"{d / 3600:.1f}h"
    return f"{d / DAY_S:.1f}d"


def _open(args: argparse.Namespace, readonly: bool) -> Store | None:
    """The store of ``args`` opened, or None (the path printed) when there is none yet: a fresh
    machine, nothing saved; an empty store, not an error (the callers exit 0)."""
    meta = _meta_dir(args)
    data = Path(args.slot_dir) if args.slot_dir else data_dir_of(meta)
    if data is None or not (meta / "records").is_dir():
        print(f"no store at {term(meta)} (nothing saved yet): 0 entries")
        return None
    budget_gb, ttl_days = getattr(args, "budget_gb", None), getattr(args, "ttl_days", None)
    s = Store(meta, data, None, lock=not readonly,  # 0 is a value here (`gc --ttl-days 0`), not "unset"
              budget_bytes=int(budget_gb * 1e9) if budget_gb is not None else 50 * 10**9,
              ttl_s=ttl_days * DAY_S if ttl_days is not None else 7 * DAY_S)
    s.open(readonly=readonly)
    return s


COLUMNS = ("KIND", "FOLDER", "CLIENT", "MODEL", "SERVER", "TOKENS", "SIZE", "HITS", "CREATED", "USED",
           "EVICT", "REASON", "KEY")
_LEFT = {0, 1, 2, 3, 4, 11, 12}


def table(entries: list, now: float) -> str:
    """The ``ls`` table: one line per entry, in eviction order (``EVICT`` 1 goes first: lowest
    value, ``ocache.tiers.evict.ValuePolicy``, the store's default policy). FOLDER/CLIENT/MODEL come from the entry's meta (the request that
    made it: MODEL is the name the client asked for; ``-`` where the request named none, or for
    entries written before ocache recorded them); SERVER is the first 8 hex digits of the server
    identity the state belongs to (model file, build, template, state flags), on every row. Text
    from requests is escaped for the terminal (``ocache.textsafe.term``)."""
    rows = [COLUMNS]
    for rank, e in enumerate(ValuePolicy().candidates(entries, now), 1):
        m = e.meta
        rows.append((term(KIND_NAMES.get(e.kind, e.kind)), term(m.get("folder") or "-"),
                     term(m.get("client") or "-"), term(m.get("model") or "-"), term(e.identity[:8] or "-"),
                     f"{e.n_tokens:,}", _human(e.bytes), str(e.hits), _ago(e.created, now),
                     _ago(e.last_used, now), str(rank), term(reason_label(e.kind, str(m.get("reason", "")))),
                     term(e.key[:16])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) if i in _LEFT else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in rows)


def cmd_ls(args: argparse.Namespace) -> int:
    s = _open(args, readonly=True)
    if s is None:
        return 0
    now = time.time()
    entries = s.entries(KINDS[args.kind])
    print(f"store {term(s.meta_dir)}  files {term(s.data_dir)}  index {term(s.report.index)}")
    if entries:
        print(table(entries, now))
    total = sum(e.bytes for e in entries)
    print(f"{len(entries)} entries, {_human(total)}; eviction takes EVICT 1 first (lowest (hits+1) x "
          f"tokens/byte x 0.5^days unused)")
    return 0


def _open_to_write(args: argparse.Namespace, action: str, when_locked: str) -> Store | int:
    """The store opened for writing, or the exit status when there is nothing to do (no store: 0)
    or a running ocache holds it (1, with ``when_locked`` said on stderr)."""
    try:
        s = _open(args, readonly=False)
    except LockedError as exc:
        print(f"ocache cache {action}: {exc}; {when_locked}", file=sys.stderr)
        return 1
    return 0 if s is None else s


def cmd_gc(args: argparse.Namespace) -> int:
    s = _open_to_write(args, "gc", "a running ocache does this itself")
    if isinstance(s, int):
        return s
    rep = s.report
    r = s.gc()
    print(f"gc: index {rep.index}; removed {rep.orphans} orphan files ({_human(rep.orphan_bytes)}), "
          f"{rep.bad_records} unreadable records, {r['expired']} expired, {r['evicted']} evicted; "
          f"{len(s.entries())} entries, {_human(s.used_bytes())} kept")
    s.close()
    return 0


def cmd_clear(args: argparse.Namespace) -> int:
    s = _open_to_write(args, "clear", "use POST /v1/cache/clear on the running ocache")
    if isinstance(s, int):
        return s
    n = s.clear(KINDS[args.kind])
    print(f"clear: deleted {n} entries ({args.kind})")
    s.close()
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("cache", help="list, collect or clear the on-disk cache (offline)",
                              description="List, collect or clear ocache's on-disk store (disk anchors "
                              "and spilled sessions) without a running ocache.")
    sub = p.add_subparsers(dest="cache_command", metavar="ACTION", required=True)

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--cache-dir", default=None, help="ocache's state root, as `cache_dir` in "
                       "ocache.yaml (default: cache_dir of --config, else $OCACHE_STATE_DIR, "
                       "$OCACHE_CACHE_DIR, ~/.cache/ocache)")
        q.add_argument("--config", metavar="FILE", default=None,
                       help="the ocache.yaml whose cache_dir to use (default ./ocache.yaml)")
        q.add_argument("--slot-dir", default=None, help="the server's --slot-save-path (default: as "
                       "recorded by the store)")
        q.add_argument("--kind", choices=sorted(KINDS), default="all", help="which entries (default all)")

    q = sub.add_parser("ls", help="table of stored entries (read-only)")
    common(q)
    q.set_defaults(func=cmd_ls)
    q = sub.add_parser("gc", help="expire, evict to the budget, remove orphan files")
    common(q)
    q.add_argument("--budget-gb", type=float, default=50.0, help="byte budget in GB (default %(default)s)")
    q.add_argument("--ttl-days", type=float, default=7.0, help="unused entries older than this go "
                   "(default %(default)s)")
    q.set_defaults(func=cmd_gc)
    q = sub.add_parser("clear", help="delete every entry (of --kind)")
    common(q)
    q.set_defaults(func=cmd_clear)
