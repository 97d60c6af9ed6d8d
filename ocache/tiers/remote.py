"""The remote tier: the store's entries (anchors, heads, spilled sessions) shared by several hosts
through one S3-compatible bucket, under each host's local store (issue 30; docs/decisions.md D7,
D10).

What it does
    * **Upload**, never on a request's path: a background task (:meth:`RemoteTier.start`) looks at
      the local store every ``sync_s`` seconds and uploads each committed entry the bucket does not
      hold (``ocache.tiers.remote_bucket.RemoteBucket.upload``: data objects, then the record,
      create-only). Entries of every identity are uploaded; each host serves only its own. A
      session's spill moves its session pointer; the older spill of that session this host
      uploaded, superseded locally, is then deleted from the bucket (:meth:`RemoteTier._supersede`):
      with live saves (``tiers.session.live_save``, ``ocache.tiers.live``: each live conversation
      spilled at idle after each turn) the bucket keeps one entry per conversation, its last
      completed turn, so a crashed host loses at most the turn in flight.
    * **Listing**, in the background only: every ``refresh_s`` seconds the sync lists the bucket
      (records, data and use objects: its bytes against the budget, the eviction pool, orphans;
      ``RemoteBucket.refresh``). No record is read by it, and no request waits on it.
    * **Lookup**, by key: the content addresses of the prompt's candidate lengths, where the disk
      and head tiers write entries (the harness head, the first user message, each ``grid`` line:
      :meth:`RemoteTier.candidates`), and the pointer of the request's session to its latest spill;
      one GET each, longest first, what was read kept in a bounded index and what is missing
      remembered (``RemoteBucket.entry``). So a lookup's requests grow with the prompt's candidate
      lengths, never with the bucket, and none is a listing. The offer: an entry the local store
      lacks, of the server's identity, whose token ids give the longest reuse: an anchor or head
      whose tokens are a prefix of the request, or the spilled conversation of the request's
      session (``ocache.llama.reuse.predict_reuse``, as the session tier prices it). Its cost is the
      measured download rate plus the local verify and restore rates; the planner takes it only
      when that beats the prefill it saves (``ocache.cache.plan.plan_request``).
    * **Deadlines**: a lookup waits at most the prompt's cold prefill (at the server's measured
      rate; nothing until one was measured) plus ``DEADLINE_SLACK_S``; a download at most the
      prefill its offer replaces plus the slack, less what its lookup waited. Past either, the
      request goes on without the bucket (local tiers or cold), and requests leave the bucket alone
      for a backoff (1 s, doubling to 60 s; ``Backoff.trip``).
    * **Bring**: download into the local slot directory under a temporary name, verify size, xxh3,
      identity and the token header (``RemoteBucket.fetch``), commit it to the local store (from then
      on it is a local entry the disk/session tiers find too), verify it as every local restore is
      verified (``Store.verify``) and restore it into the slot. A failed check deletes the bucket's
      entry and raises RemoteTierError before the server reads a byte; the request is then served
      from what the slot holds.
    * **Admit**: the next response's ``cache_n`` confirms the restore (within two ubatches of
      ``min(entry tokens, prompt)``, the session tier's rule); a confirmed one is a hit, written to
      the entry's use object (the bucket's eviction input).

Configuration (``store.remote`` in ocache.yaml, ``ocache.config.check_store``): ``url``
(``s3://bucket/prefix``), ``endpoint_url``, ``region``, ``profile``, ``max_gb`` (10^9 bytes this
host's own uploads may hold in the bucket, default 100), ``budget_gb`` (default ``max_gb``) and
``ttl_s`` (seconds, 0: none): the bucket-wide policy this host creates when the bucket has none
(the bucket's ``policy.json`` rules once it exists: ``ocache.tiers.remote_policy``), ``policy``
(``keep``; ``replace``: write this host's over the bucket's once at start), ``sync_s`` (1), ``refresh_s`` (10: also how long a key found missing is not
asked again), ``orphan_age_s`` (3600), ``index_max_entries`` (4096) and ``index_max_mb`` (64: the
bounds of the records kept in memory), ``fleet_key`` (or env ``OCACHE_FLEET_KEY``: the HMAC key of
the records, ``RemoteBucket``; unset: unsigned). The lookup's grid is the disk tier's
(``tiers.disk.grid``, ``disk_min_tokens``): hosts of one bucket share them.
Credentials: botocore's chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``,
``~/.aws/credentials``, ``AWS_PROFILE``, instance roles), never in the URL (refused).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import xxhash

from ocache.config import field_of as _get
from ocache.tiers.base import Offer, Rate, TierBase, TierError
from ocache.tiers.restore import restore_verified
from ocache.tiers.entry import token_bytes
from ocache.tiers.remote_bucket import (FLEET_KEY_ENV, FLEET_KEY_MIN_CHARS, INDEX_MAX_BYTES, INDEX_MAX_ENTRIES,
                                        RemoteBucket, RemoteEntry, RemoteError, session_pointer)
from ocache.tiers.remote_client import RemoteConfigError, S3Objects, shown_url
from ocache.tiers.store import Store

log = logging.getLogger(__name__)

#: seconds a download may take beyond the prefill it saves (connection set-up, the restore)
DEADLINE_SLACK_S = 1.0

#: seconds before an entry whose upload failed is tried again: the first wait, doubled after each
#: failure of that entry in a row up to the last (the other entries go on meanwhile)
UPLOAD_RETRY_FIRST_S = 5.0
UPLOAD_RETRY_MAX_S = 600.0

#: records asked for at once by a lookup (longest candidates first; the next batch only when none
#: of these matched)
LOOKUP_BATCH = 16

#: kinds whose entries are offered when their tokens are a prefix of the request
PREFIX_KINDS = ("a", "h")
SESSION_KIND = "s"


def prefix_keys(identity: str, kind: str, raw: bytes, lengths: Sequence[int]) -> dict[int, str]:
    """``entry_key(identity, kind, tokens[:n])`` for each ``n`` of ``lengths``, where ``raw`` is
    ``token_bytes(tokens)`` (int32 LE): one streaming xxh3-128 over the prompt, its state copied at
    each length, so O(prompt) for all of them together (hashing each prefix again was O(n^2 /
    grid): 0.29 s on the event loop for a 131k-token prompt's 127 grid lines)."""
    h = xxhash.xxh3_128()
    h.update(identity.encode())
    h.update(b"\0" + kind.encode() + b"\0")
    out: dict[int, str] = {}
    view = memoryview(raw)
    at = 0
    for n in sorted(set(lengths)):
        h.update(view[4 * at:4 * n])
        at = n
        out[n] = h.copy().hexdigest()
    return out


class RemoteTierError(TierError):
    """``bring`` failed; ``reason`` as ``RemoteError.reason``, or ``restore`` (the server refused
    the downloaded file) / ``upstream`` (the server could not be asked)."""

    tier = "remote"


@dataclass
class RemoteRef:
    """``Offer.ref`` of the remote tier."""

    key: str
    n_tokens: int
    bytes: int
    lookup_s: float = 0.0   # seconds the lookup that made the offer waited on the bucket


@dataclass(frozen=True)
class RemoteSettings:
    """``store.remote`` (see the module docstring); times in seconds, ``max_gb`` and ``budget_gb``
    in 10^9 bytes, ``policy`` ``keep`` or ``replace``."""

    url: str
    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    max_gb: float = 100.0
    budget_gb: float | None = None
    ttl_s: float = 0.0
    policy: str = "keep"
    sync_s: float = 1.0
    refresh_s: float = 10.0
    orphan_age_s: float = 3600.0
    index_max_entries: float = float(INDEX_MAX_ENTRIES)
    index_max_mb: float = INDEX_MAX_BYTES / 2**20
    fleet_key: str | None = field(default=None, repr=False)   # a secret: never shown

    def key(self, env: Any = None) -> bytes | None:
        """The fleet key records are signed and verified with: ``fleet_key``, else the environment's
        ``OCACHE_FLEET_KEY``, as UTF-8 bytes; None when neither is set (records unsigned). Raises
        RemoteConfigError when it is shorter than ``FLEET_KEY_MIN_CHARS`` (the message shows no key)."""
        env = os.environ if env is None else env
        k = self.fleet_key or env.get(FLEET_KEY_ENV) or None
        if k is None:
            return None
        if len(k) < FLEET_KEY_MIN_CHARS:
            where = "store.remote.fleet_key" if self.fleet_key else FLEET_KEY_ENV
            raise RemoteConfigError(f"{where}: a fleet key needs at least {FLEET_KEY_MIN_CHARS} characters "
                                    f"(e.g. `openssl rand -hex 32`)")
        return k.encode()

    @classmethod
    def of(cls, config: Any) -> "RemoteSettings | None":
        """The settings of ``config.store.remote``, None when it has no ``url``."""
        store = _get(config, "store") or {}
        remote = store.get("remote") if isinstance(store, dict) else None
        if not isinstance(remote, dict) or not remote.get("url"):
            return None
        kw = {k: remote[k] for k in cls.__dataclass_fields__ if k in remote}
        return cls(**kw)

    def objects(self) -> S3Objects:
        return S3Objects(self.url, endpoint_url=self.endpoint_url, region=self.region, profile=self.profile)


class RemoteTier(TierBase):
    """The remote tier over a :class:`RemoteBucket` and the cache layer's slot table (``table``:
    ``restore``, ``params``, ``checks_xxh3``, optional ``restore_rate``)."""

    name = "remote"

    def __init__(self, bucket: RemoteBucket, table: Any, *, sync_s: float = 1.0, refresh_s: float = 10.0,
                 download_bytes_s: float = 5e7, verify_bytes_s: float = 2e9, grid: int = 1024,
                 min_tokens: int = 0) -> None:
        self.bucket = bucket
        self.store: Store = bucket.store
        self.table = table
        self.sync_s = float(sync_s)
        self.refresh_s = float(refresh_s)
        #: where anchors are written (the disk tier's ``grid`` and ``min_tokens``): the lookup's keys
        self.grid = int(grid)
        self.min_tokens = int(min_tokens)
        self.download_rate = Rate(download_bytes_s)
        self.verify_rate = Rate(verify_bytes_s)
        shared = getattr(table, "restore_rate", None)
        self.restore_rate = shared if shared is not None else Rate(5e8)
        #: the server's measured prefill rate (tokens/s, None until measured): set by the layer
        self.prefill_tps_of: Callable[[], float | None] = lambda: None
        self.deadline_slack_s = DEADLINE_SLACK_S
        self._pending: dict[int, tuple[str, int]] = {}
        self._task: asyncio.Task | None = None
        self._refresh_task: asyncio.Task | None = None
        self._uses: set[asyncio.Task] = set()   # use-object writes in flight (never on a request's path)
        self._skip: set[str] = set()          # keys this host could not upload (logged once)
        self._retry: dict[str, tuple[int, float]] = {}   # key -> (failures in a row, monotonic retry time)
        self.owns: tuple[str, str, int] | None = None   # the _BUCKETS key when this tier opened it
        #: (identity, session) -> the key of that session's latest spill this host uploaded
        self._sessions: dict[tuple[str, str], str] = {}
        self.download_s: list[float] = []
        self.counters: dict[str, int] = {"lookups": 0, "offers": 0, "restores": 0, "hits": 0,
                                         "unconfirmed": 0, "bring_failed": 0, "sync_failed": 0,
                                         "deadline_abandoned": 0, "lookup_abandoned": 0,
                                         "lookup_failed": 0, "bucket_down": 0, "superseded_deleted": 0}

    # ------------------------------------------------------------------ background sync
    def start(self) -> None:
        """Start the background sync (idempotent; needs a running event loop)."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop(), name="ocache-remote-sync")

    async def stop(self) -> None:
        for t in (self._task, self._refresh_task, *self._uses):
            if t is not None:
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
        self._task = self._refresh_task = None

    async def _loop(self) -> None:
        last_refresh = 0.0
        while True:
            try:
                refresh = time.monotonic() - last_refresh >= self.refresh_s
                await self.sync(refresh=refresh)
                if refresh:
                    last_refresh = time.monotonic()
            except Exception as exc:  # noqa: BLE001 - the bucket may be down; retried next round
                self.counters["sync_failed"] += 1
                log.warning("remote: sync failed: %s", exc)
            await asyncio.sleep(self.sync_s)

    async def sync(self, refresh: bool = True) -> int:
        """One round: list the bucket (``refresh``), upload every local entry the bucket lacks,
        evict down to the budget, sweep orphan data objects. Returns the entries uploaded. An entry
        whose upload fails (the bucket refused it or did not answer) is counted
        (``upload_failed``), logged, and tried again after ``UPLOAD_RETRY_FIRST_S``, doubling
        to ``UPLOAD_RETRY_MAX_S``; the round goes on with the other entries. Raises what the
        bucket raises for the listing, the eviction and the sweep."""
        async with self.bucket.lock:
            if refresh:
                await self.bucket.refresh()
                await self.bucket.sweep()
            n = 0
            for e in sorted(self.store.entries(), key=lambda e: e.created):
                if self.bucket.holds(e.key) or e.key in self._skip or "remote" in e.meta:
                    continue
                fails, at = self._retry.get(e.key, (0, 0.0))
                if time.monotonic() < at:
                    continue
                try:
                    ok = await self.bucket.upload(e)
                except Exception as exc:  # noqa: BLE001 - this entry only: the others go on
                    wait = min(UPLOAD_RETRY_MAX_S, UPLOAD_RETRY_FIRST_S * 2 ** fails)
                    self._retry[e.key] = (fails + 1, time.monotonic() + wait)
                    self.bucket.counters["upload_failed"] += 1
                    log.warning("remote: upload of %s failed (%s: %s); tried again in %.0f s", e.key[:16],
                                type(exc).__name__, exc, wait)
                    continue
                self._retry.pop(e.key, None)
                if ok:
                    n += 1
                    await self._supersede(e)
                elif self.store.get(e.key) is not None:
                    self._skip.add(e.key)
            await self.bucket.make_room(0)
            return n

    async def _supersede(self, e: Any) -> None:
        """After ``e`` (a local entry) is in the bucket: when it is a session's spill (not a
        guest's) and this host uploaded an older spill of that session, which the local store
        superseded since (``SpillPolicy.superseded``), delete the older one from the bucket. Its
        session pointer names the new one now, and a session entry is found only through its
        pointer, so the old one would only take room until evicted: a conversation saved after
        every turn (``tiers.session.live_save``) keeps one entry in the bucket, not one a turn.
        Only once the pointer is read back naming ``e`` (one GET); spills of other hosts are left to
        the bucket's eviction. Raises what the bucket raises."""
        from ocache.tiers.spill import is_guest

        session = e.meta.get("session")
        if e.kind != SESSION_KIND or not session or is_guest(e.meta) or "remote" in e.meta:
            return
        sk = (str(e.identity), str(session))
        old = self._sessions.get(sk)
        self._sessions[sk] = e.key
        if old is None or old == e.key or self.store.get(old) is not None:
            return
        raw = await self.bucket.objects.get(session_pointer(sk[0], sk[1]))   # moved (not a failed write)?
        try:
            named = json.loads(raw or b"null")["key"]
        except (ValueError, KeyError, TypeError):
            named = None
        if named != e.key:
            return
        self.counters["superseded_deleted"] += 1
        await self.bucket.delete(old, "superseded by its session's newer spill")

    # ------------------------------------------------------------------ lookup / bring
    def read_cost_s(self, nbytes: int) -> float:
        """Seconds to download, verify and restore ``nbytes`` at the measured rates."""
        return (nbytes / self.download_rate.value + nbytes / self.verify_rate.value
                + nbytes / self.restore_rate.value)

    def prefill_s(self, n_tokens: int) -> float:
        """Seconds the server takes to prefill ``n_tokens`` cold, at its measured rate
        (``prefill_tps_of``, tokens/s); 0 before one was measured: a deadline is then the slack
        alone, so it errs short (a new host's first requests may give up a download that would have
        paid), never longer than the cold prefill it could not price."""
        tps = self.prefill_tps_of()
        return n_tokens / tps if tps else 0.0

    def lookup_deadline_s(self, n_tokens: int) -> float:
        """Seconds a lookup of an ``n_tokens`` prompt may wait on the bucket: its cold prefill (the
        most any offer can save) plus ``deadline_slack_s``."""
        return self.prefill_s(n_tokens) + self.deadline_slack_s

    def candidates(self, ident: str, view: Any, ctx: Any = None) -> list[tuple[int, str, str]]:
        """The anchor/head entries a prompt could extend, as ``(length, kind, key)``, longest first:
        where the disk and head tiers write them (``ocache.tiers.disk.DiskTier.anchor_lines``):
        the harness head (``view.head_end`` / ``ctx.head_len``: kinds ``h`` and ``a``), the first
        user message's start and each multiple of ``grid`` (kind ``a``, from ``min_tokens``), up to
        the prompt's length. Keys are content addresses (``entry_key``) of ``view.tokens``; pure."""
        toks: Sequence[int] = view.tokens
        n = len(toks)
        want: set[tuple[int, str]] = set()
        for h in {int(_get(view, "head_end") or 0), int(_get(ctx, "head_len") or 0)}:
            if 0 < h <= n:
                want.add((h, "h"))
                if h >= self.min_tokens:
                    want.add((h, "a"))
        users = list(_get(view, "user_starts") or [])
        if users and self.min_tokens <= int(users[0]) <= n and int(users[0]) > 0:
            want.add((int(users[0]), "a"))
        g = max(1, int(self.grid))
        for line in range(g, n + 1, g):
            if line >= self.min_tokens:
                want.add((line, "a"))
        raw = token_bytes(toks)
        keys = {kind: prefix_keys(ident, kind, raw, [m for m, k in want if k == kind]) for kind in ("a", "h")}
        return [(m, kind, keys[kind][m]) for m, kind in sorted(want, reverse=True)]

    async def lookup(self, view: Any, ctx: Any = None) -> Offer | None:
        """The bucket entry with the longest reuse for ``view.tokens`` that the local store lacks
        (see the module docstring), or None. Asks the bucket by key only: the records of
        :meth:`candidates` (cached ones and those known missing are not asked again), longest
        first, ``LOOKUP_BATCH`` at a time, stopping at the first batch with a match, and the session
        pointer of the request's session; never a listing. Waits at most
        :meth:`lookup_deadline_s` of the prompt: past it, or when the bucket fails, the lookup
        answers None and the bucket is left alone for a backoff (``Backoff.trip``)."""
        ident = self.store.identity
        if ident is None:
            return None
        if self.bucket.reach.unreachable():
            self.counters["bucket_down"] += 1
            return None
        self.counters["lookups"] += 1
        t0 = time.monotonic()
        try:
            best = await asyncio.wait_for(self._find(ident, view, ctx), self.lookup_deadline_s(len(view.tokens)))
        except asyncio.TimeoutError:
            self.counters["lookup_abandoned"] += 1
            self.bucket.reach.trip()
            log.warning("remote: lookup abandoned after %.1f s (the prompt's cold prefill); the bucket is "
                        "left alone for %.0f s", time.monotonic() - t0, self.bucket.reach.backoff_s)
            return None
        except Exception as exc:  # noqa: BLE001 - the bucket failed: local tiers or cold
            self.counters["lookup_failed"] += 1
            self.bucket.reach.trip()
            log.warning("remote: lookup failed (%s: %s); the bucket is left alone for %.0f s",
                        type(exc).__name__, exc, self.bucket.reach.backoff_s)
            return None
        self.bucket.reach.answered()
        if best is None:
            return None
        usable, r = best
        self.counters["offers"] += 1
        return Offer(tier=self.name, tokens_usable=usable, cost_s=self.read_cost_s(r.entry.bytes),
                     ref=RemoteRef(r.key, r.entry.n_tokens, r.entry.bytes, time.monotonic() - t0),
                     verified=True)

    async def _find(self, ident: str, view: Any, ctx: Any) -> tuple[int, RemoteEntry] | None:
        best, sess = await asyncio.gather(self._best_prefix(ident, view, ctx), self._best_session(ident, view, ctx))
        if sess is not None and (best is None or sess[0] > best[0]):
            best = sess
        return best

    def _candidate(self, key: str) -> bool:
        """Whether ``key`` may be offered: not refused here before, not in the local store (whose
        tiers offer it)."""
        return key not in self.bucket.quarantined and self.store.get(key) is None

    async def _best_prefix(self, ident: str, view: Any, ctx: Any) -> tuple[int, RemoteEntry] | None:
        """The longest anchor/head of :meth:`candidates` in the bucket whose token ids are a prefix
        of the request (content address, then the ids compared), as ``(usable tokens, entry)``."""
        toks: Sequence[int] = view.tokens
        todo = [c for c in self.candidates(ident, view, ctx) if self._candidate(c[2])]
        raw = token_bytes(toks) if todo else b""
        for i in range(0, len(todo), LOOKUP_BATCH):
            batch = todo[i:i + LOOKUP_BATCH]
            found = await asyncio.gather(*(self.bucket.entry(key) for _, _, key in batch))
            for (m, kind, key), r in zip(batch, found):
                if (r is not None and r.entry.kind == kind and r.entry.identity == ident
                        and self._candidate(key) and r.token_raw == raw[:4 * m]):
                    return (m if m < len(toks) else m - 1), r
        return None

    async def _best_session(self, ident: str, view: Any, ctx: Any) -> tuple[int, RemoteEntry] | None:
        """The latest spilled conversation of the request's session (its session pointer, then its
        record), with its predicted reuse."""
        if _get(ctx, "kind") == "guest":
            return None
        from ocache.llama.reuse import Checkpoint, predict_reuse
        from ocache.tiers.spill import is_guest, session_key

        skey = session_key(_get(ctx, "session"), view)
        if skey is None:
            return None
        r = await self.bucket.session_entry(ident, skey)
        # a guest's spill shares the session key of opencode's agent turns: not theirs to read
        if r is None or is_guest(r.entry.meta) or not self._candidate(r.key):
            return None
        stored = r.tokens()
        cps = [Checkpoint(int(n)) for n in (r.entry.meta.get("checkpoints") or [])]
        reuse = predict_reuse(stored, len(stored), cps, view.tokens, self.table.params)
        return (reuse.cache_n, r) if reuse.cache_n > 0 else None

    def deadline_s(self, offer: Offer) -> float:
        """Seconds the download of ``offer`` may take: the prefill it replaces
        (``offer.tokens_usable``, :meth:`prefill_s`) plus ``deadline_slack_s``, less what its
        lookup already waited on the bucket (``RemoteRef.lookup_s``), at least 0: the lookup and the
        download together wait at most the prefill the offer replaces plus the slack."""
        ref = offer.ref
        spent = float(getattr(ref, "lookup_s", 0.0) or 0.0)
        return max(0.0, self.prefill_s(offer.tokens_usable) + self.deadline_slack_s - spent)

    async def bring(self, offer: Offer, slot: int) -> None:
        """Download, verify and commit the offered entry locally, then restore it into ``slot``
        (the caller holds its lease). A download that outlasts :meth:`deadline_s` is abandoned
        (cancelled; its partial file and local reservation released; ``deadline_abandoned``) and
        the request goes on without it. Raises RemoteTierError (``deadline`` among the reasons)."""
        ref: RemoteRef = offer.ref
        t0 = time.monotonic()
        try:
            e = await asyncio.wait_for(self.bucket.fetch(ref.key), self.deadline_s(offer))
        except asyncio.TimeoutError as exc:
            self.counters["bring_failed"] += 1
            self.counters["deadline_abandoned"] += 1
            self.bucket.reach.trip()
            log.warning("remote: download of %s abandoned after %.1f s (what it saves)", ref.key[:16],
                        time.monotonic() - t0)
            raise RemoteTierError("deadline", ref.key) from exc
        except KeyError as exc:
            self.counters["bring_failed"] += 1
            raise RemoteTierError("gone", ref.key) from exc
        except RemoteError as exc:
            self.counters["bring_failed"] += 1
            raise RemoteTierError(exc.reason, str(exc)) from exc
        t1 = time.monotonic()
        self.download_rate.add(e.bytes, t1 - t0)
        self.download_s.append(t1 - t0)
        await self._restore(e.key, slot)

    async def _restore(self, key: str, slot: int) -> None:
        """Verify and restore the downloaded entry ``key`` into ``slot`` (``ocache.tiers.restore``);
        every failure counts ``bring_failed`` too. Raises RemoteTierError."""
        try:
            e = await restore_verified(self.store, self.table, key, slot, error=RemoteTierError,
                                       counters=self.counters, verify_rate=self.verify_rate)
        except RemoteTierError:
            self.counters["bring_failed"] += 1
            raise
        self.counters["restores"] += 1
        self._pending[slot] = (key, e.n_tokens)

    # ------------------------------------------------------------------ after the request
    async def admit(self, view: Any, slot: int, obs: Any) -> None:
        """Confirm a restore by the response's ``cache_n`` and record the hit in the bucket."""
        p = self._pending.pop(slot, None)
        if p is None:
            return
        cache_n = _get(_get(obs, "timings") or {}, "cache_n")
        ub = int(getattr(getattr(self.table, "params", None), "n_ubatch", 512) or 512)
        n = min(p[1], len(view.tokens)) if view is not None else p[1]
        if cache_n is not None and int(cache_n) >= n - 2 * ub - 1:
            self.counters["hits"] += 1
            task = asyncio.create_task(self.bucket.note_use(p[0]))   # in the background: a slow
            self._uses.add(task)                                      # bucket holds no response
            task.add_done_callback(self._uses.discard)
        else:
            self.counters["unconfirmed"] += 1
            log.warning("remote: restore of %d tokens into slot %d not confirmed (cache_n=%s)", p[1], slot, cache_n)

    def forget_slot(self, slot: int) -> None:
        if self._pending.pop(slot, None) is not None:
            self.counters["unconfirmed"] += 1

    async def on_upstream_restart(self) -> None:
        for slot in list(self._pending):
            self.forget_slot(slot)

    async def on_drain(self, table: Any) -> dict | None:
        """A planned stop: upload what the tiers before this one spilled and committed (the layer
        drains the tiers in order; this one is registered after the disk and session tiers)."""
        n = 0
        try:
            n = await self.sync(refresh=True)
        except Exception as exc:  # noqa: BLE001 - a drain goes on
            log.warning("remote: upload on drain failed: %s", exc)
        return {"uploaded": n}

    async def close(self) -> None:
        """Stop the background sync; the tier that opened the bucket also closes its client."""
        await self.stop()
        if self.owns is not None and _BUCKETS.get(self.owns) is self.bucket:
            del _BUCKETS[self.owns]
            with contextlib.suppress(Exception):
                await self.bucket.objects.__aexit__(None, None, None)

    async def flush(self) -> None:
        """One sync round now (tests and drains: what was committed locally is in the bucket after)."""
        try:
            await self.sync(refresh=True)
        except Exception as exc:  # noqa: BLE001
            log.warning("remote: flush failed: %s", exc)

    def stats(self) -> dict:
        xs = sorted(self.download_s)
        return {**self.counters, **self.bucket.counters, "entries": len(self.bucket.sizes),
                "index_entries": len(self.bucket.index), "index_bytes": self.bucket.index.nbytes,
                "absent_keys": len(self.bucket.absent), "bytes": self.bucket.used_bytes(), "budget_bytes": self.bucket.budget_bytes,
                "ttl_s": self.bucket.ttl_s, "policy": self.bucket.policy_source, "own_bytes": self.bucket.own_bytes(),
                "host_max_bytes": self.bucket.host_max_bytes,
                "download_bytes_s": round(self.download_rate.value),
                "download_s_p50": xs[len(xs) // 2] if xs else None,
                "download_s_max": xs[-1] if xs else None,
                # requests sent to the bucket by kind (LIST, HEAD, GET, PUT, POST, DELETE)
                "s3_requests": dict(getattr(self.bucket.objects, "requests", None) or {})}


def remote_warnings(config: Any, env: Any = None) -> list[str]:
    """``ocache doctor``'s warnings on ``store.remote`` (one line each; none shows a secret): no
    fleet key, so the bucket's records are unsigned. [] when no remote is configured."""
    settings = RemoteSettings.of(config)
    if settings is None:
        return []
    try:
        if settings.key(env) is not None:
            return []
    except RemoteConfigError:
        return []   # check_remote reports it as an error
    return [f"store.remote.fleet_key: not set (nor {FLEET_KEY_ENV}): the bucket's records are unsigned, so "
            "anyone who can write the bucket can plant entries that every host serves; set the same "
            "random key (`openssl rand -hex 32`) on every host"]


async def check_remote(config: Any) -> tuple[bool, str] | None:
    """``ocache doctor``'s check of ``store.remote``: the fleet key (if any) is long enough, the
    bucket answers with these credentials and its records can be listed; the line ends with the
    bucket's policy (``ocache.tiers.remote_policy``: its budget and TTL, none yet, or why this host
    would refuse it). Returns ``(ok, one line)``, None when no remote is configured."""
    from ocache.tiers.remote_policy import POLICY, PolicyRefused, parse_policy

    settings = RemoteSettings.of(config)
    if settings is None:
        return None
    try:
        key = settings.key()
    except RemoteConfigError as exc:
        return False, str(exc)
    where = f"{shown_url(settings.url)} at {shown_url(settings.endpoint_url) if settings.endpoint_url else 'AWS'}"
    try:
        async with settings.objects() as objects:
            await objects.check()
            n = len(await objects.list("records/"))   # (a listing: the doctor's, never a request's)
            raw = await objects.get(POLICY)
    except ImportError:
        return False, "store.remote: aiobotocore is not installed (pip install 'ocache[s3]')"
    except Exception as exc:  # noqa: BLE001 - the line says what failed
        return False, f"store.remote: {where}: {type(exc).__name__}: {exc}"
    if raw is None:
        policy = "none yet (the first host to list the bucket creates it from its budget_gb and ttl_s)"
    else:
        try:
            p, _ = parse_policy(raw, key)
            policy = f"budget {p.budget_bytes / 1e9:.3g} GB, ttl {f'{p.ttl_s:.0f} s' if p.ttl_s else 'none'}"
        except PolicyRefused as exc:
            policy = f"refused by this host ({exc}): it would keep its own config's"
    return True, f"store.remote: {where} answers ({n} entries), bucket policy: {policy}"


async def open_remote_tier(config: Any, store: Store, table: Any) -> RemoteTier | None:
    """The remote tier of ``config.store.remote`` over ``store`` (the local store of the disk and
    session tiers) for the slot table ``table``; None when not configured. The layers of several
    servers of one host share one store, so they share its :class:`RemoteBucket` too (one client,
    one index, one background sync: the first tier's); each gets its own tier for its own slots.
    Raises RemoteConfigError (bad settings), ImportError (aiobotocore missing: ``pip install
    'ocache[s3]'``)."""
    settings = RemoteSettings.of(config)
    if settings is None:
        return None
    settings.objects()   # the URLs checked first (credentials in one are refused, unshown)
    fleet_key = settings.key()
    if fleet_key is None:
        log.warning("remote tier: no fleet key (store.remote.fleet_key or %s): records are unsigned and "
                    "anyone who can write the bucket can plant entries every host serves", FLEET_KEY_ENV)
    shared_key = (str(store.meta_dir), settings.url, id(asyncio.get_running_loop()))
    # (the first index read is the sync's first round, in the background: a request never waits on it)
    bucket = _BUCKETS.get(shared_key)
    owner = bucket is None
    if bucket is None:
        objects = settings.objects()
        await objects.__aenter__()
        bucket = RemoteBucket(objects, store, budget_bytes=int((settings.budget_gb or settings.max_gb) * 1e9),
                              ttl_s=settings.ttl_s, host_max_bytes=int(settings.max_gb * 1e9),
                              replace_policy=settings.policy == "replace", orphan_age_s=settings.orphan_age_s, fleet_key=fleet_key,
                              index_max_entries=int(settings.index_max_entries),
                              index_max_bytes=int(settings.index_max_mb * 2**20),
                              absent_s=max(1.0, settings.refresh_s))
        _BUCKETS[shared_key] = bucket
    tiers = _get(config, "tiers") or {}
    dcfg = tiers.get("disk", {}) if isinstance(tiers, dict) else {}
    dcfg = dcfg if isinstance(dcfg, dict) else {}
    tier = RemoteTier(bucket, table, sync_s=settings.sync_s, refresh_s=settings.refresh_s,
                      grid=int(dcfg.get("grid", 1024)), min_tokens=int(_get(config, "disk_min_tokens", 4096)))
    if owner:
        tier.owns = shared_key
        tier.start()
        log.info("remote tier: %s (endpoint %s, this host's uploads up to %.3g GB, bucket policy proposed "
                 "%.3g GB / ttl %.0f s%s, records %s)", shown_url(settings.url),
                 shown_url(settings.endpoint_url) if settings.endpoint_url else "AWS", settings.max_gb,
                 settings.budget_gb or settings.max_gb, settings.ttl_s,
                 ", replacing the bucket's" if settings.policy == "replace" else "",
                 "signed" if fleet_key else "unsigned")
    return tier


#: (store meta_dir, bucket URL, event loop id) -> the bucket its tiers share (open_remote_tier)
_BUCKETS: dict[tuple[str, str, int], RemoteBucket] = {}
