"""The bucket-wide rules of the remote tier (``ocache.tiers.remote_bucket``): one policy for the
whole bucket, stored in it, and what every host does to keep it: eviction to the bucket's budget,
TTL expiry, the bound on each host's own uploads, and the sweep of orphaned objects.

The policy object: ``policy.json`` under the location's prefix::

    {"version": 1, "budget_bytes": int > 0, "ttl_s": float >= 0 (0: no TTL),
     "set_by": host name, "set_at": Unix seconds[, "sig": hex HMAC-SHA256]}

    * **created** create-only (``If-None-Match: *``, as records are) by the first host that finds
      the bucket without one, from its config: ``store.remote.budget_gb`` (default its
      ``max_gb``) and ``store.remote.ttl_s``. Every host reads it at each background listing
      (one GET) and keeps to it: the budget and the TTL in effect are the bucket's, whatever the
      host's own config says;
    * **replaced** only deliberately: ``store.remote.policy: replace`` makes the host write its
      config's values over the bucket's once, at its first read after it starts;
    * **forward compatible**: fields this host does not know are ignored; a policy of a higher
      ``version`` (a newer ocache) is respected for the fields it knows (``budget_bytes``,
      ``ttl_s``: a newer version keeps their meaning or renames them) and is never overwritten by
      this host, not even with ``policy: replace``;
    * **signed** with the fleet key when one is set (``sig``: :func:`policy_mac`, another domain
      than the records' MAC). A host with a key refuses a policy that is unsigned, signed with
      another key, malformed, or whose budget is not a positive integer (``policy_refused``,
      logged once per object): it keeps the last policy it verified, else its own config's, and
      never overwrites or deletes the refused object (the fault may be this host's key; an
      operator replaces it with ``policy: replace``). So a bucket writer without the key cannot
      shrink the fleet's budget: the worst it does is leave each host on its own config, the
      behaviour before the policy existed. Without a fleet key the policy is as trustworthy as
      the bucket's writers, who can delete entries directly anyway; a budget of 0 or below, or a
      negative TTL, is refused there too. Whatever the policy says, each host's own bound (below)
      still holds, so a budget set too large leaves the bucket at most the sum of those bounds.

A host's own ``max_gb`` (``host_max_bytes``) bounds only the bytes of the entries it uploaded and
that the bucket still holds (``mine``: key -> bytes, kept in the local store's meta directory so
a restart does not forget them): before an upload the host evicts its own lowest-value entries
until the new one fits, never another host's. The fleet's budget is enforced by every host on all
entries it can read (records of a newer layout and records that fail the fleet key are neither
counted nor evicted by it).

The overshoot of concurrent uploads: before each upload the host lists ``data/`` afresh (one LIST,
paged) and asks by key (HEAD) for the record of any data it does not know, so the entries other
hosts recorded since its last listing count (and can be evicted), then evicts until the new entry
fits. Data of no record (an upload in flight) is not counted: its uploader makes room for it.
Hosts uploading at the same moment still overshoot, by at most one entry per other host uploading
then; the next listing round of any host evicts the excess. Measured: 3, 8 and 16 hosts all
uploading at once peaked at +1.5, +6.5 and +14.5 entries over an 8.5-entry budget
(``scripts/bench-remote-budget``, docs/benchmarks.md 60).

TTL: an entry whose record and use object were both last written more than ``ttl_s`` ago (their
``LastModified`` in the listing, the server's wall clock) is deleted by the next listing round of
any host. Orphans: data objects of no record, and use objects of no record (a hit recorded while
another host evicted the entry), are deleted once older than ``orphan_age_s``.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import math
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import xxhash

if TYPE_CHECKING:
    from ocache.tiers.evict import EvictionPolicy
    from ocache.tiers.remote_bucket import HeldRecord, RemoteEntry
    from ocache.tiers.remote_client import ObjectInfo, S3Objects
    from ocache.tiers.store import Store

log = logging.getLogger(__name__)

POLICY = "policy.json"
POLICY_VERSION = 1
#: what the policy's MAC covers before its canonical JSON (a record's MAC has another domain)
_POLICY_DOMAIN = b"ocache remote policy\n"
#: data/use object prefixes (as ``ocache.tiers.remote_bucket``)
_DATA, _USE = "data/", "use/"
#: entries read per round of eviction (as ``remote_bucket.EVICTION_POOL``)
POOL = 64
#: most keys remembered as having left the bucket
LEFT_MAX = 65536


@dataclass(frozen=True)
class Policy:
    """The bucket-wide rules: ``budget_bytes`` (most bytes of entries in the bucket), ``ttl_s``
    (seconds an entry is kept after its last use; 0: no TTL)."""

    budget_bytes: int
    ttl_s: float = 0.0


class PolicyRefused(ValueError):
    """A policy object this host does not follow: ``reason`` ``unsigned``, ``signature`` (it
    fails the fleet key) or ``invalid`` (not JSON, not a mapping, a version that is not a
    positive integer, a budget that is not a positive integer, a TTL that is not a number >= 0)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"policy {reason}{': ' + detail if detail else ''}")
        self.reason = reason


def policy_mac(doc: dict, fleet_key: bytes) -> str:
    """HMAC-SHA256 (hex) with ``fleet_key`` over the policy document without its ``sig``: its
    canonical JSON (sorted keys, no spaces, ASCII) after a domain line of its own."""
    body = {k: v for k, v in doc.items() if k != "sig"}
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    return hmac.new(fleet_key, _POLICY_DOMAIN + canon, hashlib.sha256).hexdigest()


def policy_doc(p: Policy, host: str, now: float, fleet_key: bytes | None) -> dict:
    """The object written for ``p``: this layout's fields, signed when a key is given."""
    doc: dict[str, Any] = {"version": POLICY_VERSION, "budget_bytes": int(p.budget_bytes),
                           "ttl_s": float(p.ttl_s), "set_by": host, "set_at": now}
    if fleet_key is not None:
        doc["sig"] = policy_mac(doc, fleet_key)
    return doc


def policy_version(raw: bytes) -> int | None:
    """The ``version`` of a policy object, None when it has no integer one or does not parse."""
    try:
        v = json.loads(raw).get("version")
    except (ValueError, AttributeError):
        return None
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def parse_policy(raw: bytes, fleet_key: bytes | None) -> tuple[Policy, int]:
    """``(policy, version)`` of a policy object's bytes; with a ``fleet_key`` its ``sig`` must be
    :func:`policy_mac` under that key. Fields other than ``budget_bytes`` and ``ttl_s`` (absent:
    0) are ignored, whatever the version. Raises PolicyRefused."""
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise PolicyRefused("invalid", "not JSON") from exc
    if not isinstance(doc, dict):
        raise PolicyRefused("invalid", "not a mapping")
    if fleet_key is not None:
        sig = doc.get("sig")
        if not isinstance(sig, str) or not sig:
            raise PolicyRefused("unsigned")
        if not hmac.compare_digest(sig, policy_mac(doc, fleet_key)):
            raise PolicyRefused("signature")
    version, budget, ttl = doc.get("version"), doc.get("budget_bytes"), doc.get("ttl_s", 0)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise PolicyRefused("invalid", f"version {version!r}")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget <= 0:
        raise PolicyRefused("invalid", f"budget_bytes {budget!r}")
    if (not isinstance(ttl, (int, float)) or isinstance(ttl, bool) or not math.isfinite(ttl)
            or ttl < 0):
        raise PolicyRefused("invalid", f"ttl_s {ttl!r}")
    return Policy(budget, float(ttl)), version


def ledger_path(store: "Store", objects: Any) -> Path:
    """Where a host keeps the keys and bytes it uploaded to one location: the store's meta
    directory, ``remote-uploads-<xxh3-64 of the location>.json``."""
    loc = getattr(objects, "location", None)
    where = f"{getattr(loc, 'bucket', '')}/{getattr(loc, 'prefix', '')}"
    return Path(store.meta_dir) / f"remote-uploads-{xxhash.xxh3_64_hexdigest(where.encode())}.json"


class BucketRules:
    """What :class:`ocache.tiers.remote_bucket.RemoteBucket` does to keep the bucket-wide policy
    (a base class of it; see the module docstring). ``proposed``: this host's config's policy;
    ``rules`` the one in effect (``budget_bytes``, ``ttl_s`` mirror it); ``policy_source``:
    ``config`` (none read yet), ``bucket``, ``created``, ``replaced``, ``refused`` (the bucket's is
    refused: the last one verified, else ``proposed``, in effect);
    ``host_max_bytes``: the bound of ``mine`` (None: none but the bucket's budget); ``wall``:
    Unix seconds to compare with the listing's ``LastModified`` (tests shift it)."""

    if TYPE_CHECKING:
        objects: S3Objects
        store: Store
        host: str
        orphan_age_s: float
        clock: Callable[[], float]
        policy: EvictionPolicy
        _fleet_key: bytes | None
        index: Any
        catalog: dict[str, ObjectInfo]
        sizes: dict[str, int]
        held: dict[str, HeldRecord]
        _data: dict[str, list[ObjectInfo]]
        _uses: dict[str, ObjectInfo]
        counters: dict[str, int]

        async def entry(self, key: str, *, fresh: bool = False) -> RemoteEntry | None: ...
        async def delete(self, key: str, reason: str) -> None: ...
        async def _read_uses(self, keys: Any) -> None: ...

    def _init_rules(self, budget_bytes: int, ttl_s: float, host_max_bytes: int | None, replace: bool) -> None:
        self.proposed = Policy(int(budget_bytes), float(ttl_s))
        self.rules = self.proposed
        self.policy_source = "config"
        self.host_max_bytes = None if host_max_bytes is None else int(host_max_bytes)
        self.wall: Callable[[], float] = time.time
        self._replace = bool(replace)
        self._verified: Policy | None = None
        self._refused_etag = ""
        self._ledger = ledger_path(self.store, self.objects)
        self.mine: dict[str, int] = self._load_mine()
        #: keys that left the bucket (evicted or expired, by any host) while this host watched: not
        #: uploaded again from its local store (else the budget and the TTL would only churn)
        self.left: OrderedDict[str, None] = OrderedDict()
        for k in ("record_heads", "policy_reads", "policy_created", "policy_replaced", "policy_refused", "expired",
                  "expired_bytes", "evicted_own", "uses_swept"):
            self.counters[k] = 0

    @property
    def budget_bytes(self) -> int:
        """Most bytes of entries in the bucket: the bucket-wide policy's (this host's proposal
        until one was read)."""
        return self.rules.budget_bytes

    @budget_bytes.setter
    def budget_bytes(self, n: int) -> None:
        """Set this host's configured budget: the proposal, and the budget in effect until the
        bucket's policy is read next."""
        self.proposed = Policy(int(n), self.proposed.ttl_s)
        self.rules = Policy(int(n), self.rules.ttl_s)

    @property
    def ttl_s(self) -> float:
        return self.rules.ttl_s

    def used_bytes(self) -> int:
        """Bytes of the entries this host believes the bucket holds (held records not counted)."""
        return sum(self.sizes.values())

    def mark_left(self, key: str) -> None:
        """Remember that ``key`` left the bucket (at most ``LEFT_MAX`` keys, the oldest dropped)."""
        self.left[key] = None
        self.left.move_to_end(key)
        while len(self.left) > LEFT_MAX:
            self.left.popitem(last=False)

    def own_bytes(self) -> int:
        """Bytes of this host's uploads the bucket still holds, as far as it knows."""
        return sum(self.mine.values())

    # ------------------------------------------------------------------ the policy object
    async def load_policy(self) -> Policy:
        """Read ``policy.json`` (one GET) and put it in effect; create it from ``proposed`` when
        the bucket has none (create-only; the loser of a race reads the winner's), or write
        ``proposed`` over it once when this host was configured to replace it. Returns the policy
        in effect. Raises what the bucket raises."""
        self.counters["policy_reads"] += 1
        got = await self.objects.get_tagged(POLICY)
        if got is None:
            doc = policy_doc(self.proposed, self.host, self.wall(), self._fleet_key)
            if await self.objects.put(POLICY, json.dumps(doc).encode(), create_only=True):
                self.counters["policy_created"] += 1
                self._replace = False
                log.info("remote: bucket policy created: budget %d bytes, ttl %.0f s", self.proposed.budget_bytes,
                         self.proposed.ttl_s)
                return self._adopt(self.proposed, "created")
            got = await self.objects.get_tagged(POLICY)
            if got is None:
                return self.rules
        raw, etag = got
        version = policy_version(raw)
        if self._replace and (version is None or version <= POLICY_VERSION):
            self._replace = False
            try:
                current: Policy | None = parse_policy(raw, self._fleet_key)[0]
            except PolicyRefused:
                current = None
            if current != self.proposed:
                doc = policy_doc(self.proposed, self.host, self.wall(), self._fleet_key)
                await self.objects.put(POLICY, json.dumps(doc).encode())
                self.counters["policy_replaced"] += 1
                log.warning("remote: bucket policy replaced by this host's (store.remote.policy: replace): "
                            "budget %d bytes, ttl %.0f s", self.proposed.budget_bytes, self.proposed.ttl_s)
                return self._adopt(self.proposed, "replaced")
        elif self._replace:
            self._replace = False
            log.warning("remote: store.remote.policy: replace ignored: the bucket's policy is of a newer "
                        "ocache (version %s)", version)
        try:
            p, _ = parse_policy(raw, self._fleet_key)
        except PolicyRefused as exc:
            if etag != self._refused_etag:
                self._refused_etag = etag
                self.counters["policy_refused"] += 1
                log.warning("remote: the bucket's policy is refused (%s): this host keeps %s (left in the bucket)",
                            exc, "the last one it verified" if self._verified else "its own config's")
            self.rules, self.policy_source = self._verified or self.proposed, "refused"
            return self.rules
        return self._adopt(p, "bucket")

    def _adopt(self, p: Policy, source: str) -> Policy:
        self.rules, self._verified, self.policy_source = p, p, source
        return p

    # ------------------------------------------------------------------ this host's uploads
    def _load_mine(self) -> dict[str, int]:
        try:
            doc = json.loads(self._ledger.read_text())
            return {str(k): int(v) for k, v in dict(doc).items()}
        except (OSError, ValueError, TypeError):
            return {}

    async def save_mine(self) -> None:
        """Write ``mine`` to its file (atomically; a failure is logged, the bound kept in memory)."""
        body, path = json.dumps(self.mine), self._ledger

        def write() -> None:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(body)
            os.replace(tmp, path)

        try:
            await asyncio.to_thread(write)
        except OSError as exc:
            log.info("remote: %s not written: %s", path, exc)

    async def make_own_room(self, nbytes: int) -> int:
        """Evict this host's own uploads by value (lowest first) until ``nbytes`` more fit
        ``host_max_bytes``; another host's entries are never touched here. Returns the bytes
        freed. Raises what the bucket raises."""
        if self.host_max_bytes is None:
            return 0
        freed = 0
        while self.mine and self.own_bytes() + nbytes > self.host_max_bytes:
            pool = []
            for k in list(self.mine)[:POOL]:
                r = await self.entry(k)
                if r is None:                       # gone, or no longer readable here: not ours to count
                    self.mine.pop(k, None)
                elif r.host == self.host:
                    pool.append(r)
                else:
                    self.mine.pop(k, None)
            await self._read_uses([r.key for r in pool])
            for victim in self.policy.candidates([r.entry for r in pool], self.clock()):
                if self.own_bytes() + nbytes <= self.host_max_bytes:
                    break
                freed += victim.bytes
                await self.delete(victim.key, "evicted by value for this host's own upload bound (max_gb)")
                self.counters["evicted_own"] += 1
            if not pool:
                break
        return freed

    # ------------------------------------------------------------------ the bucket's bytes
    async def fresh_usage(self) -> int:
        """List ``data/`` now (one LIST, paged) and return the bytes of the entries in the bucket:
        the known ones (their listed data when this host did not read their record; one whose data
        is gone is no longer counted: a delete removes the record first), and those another host
        recorded since the last listing: data of no known record is asked for by key (one HEAD
        each, at most ``POOL``); one with its record is counted (and evictable) from then on, one
        without is an upload in flight, left to its uploader, which makes room for it (counting it
        here too would evict for it twice), or an orphan. Raises what the bucket raises."""
        data = await self.objects.list(_DATA)
        self.counters["lists"] += 1
        by_key: dict[str, list[ObjectInfo]] = {}
        for o in data:
            by_key.setdefault(o.key[len(_DATA):].split("-", 1)[0], []).append(o)
        self._data = by_key
        for k in list(self.sizes):
            if k not in by_key:       # its data is gone, so its record went first (being evicted)
                del self.sizes[k]
                self.mark_left(k)
            elif k not in self.index:
                self.sizes[k] = sum(o.size for o in by_key[k])
        named = {o for h in self.held.values() for o in h.objects}
        new = [k for k, objs in by_key.items() if k not in self.sizes and k not in self.held and k not in self.left
               and any(o.key not in named for o in objs)]
        for k in new[:POOL]:
            info = await self.objects.head(f"records/{k}.json")
            self.counters["record_heads"] += 1
            if info is not None:
                self.catalog[k] = info
                self.sizes[k] = sum(o.size for o in by_key[k])
        return self.used_bytes()

    # ------------------------------------------------------------------ eviction, TTL, orphans
    def _last_active(self, k: str) -> float:
        r = self.index.get(k)
        if r is not None:
            return max(r.entry.last_used, r.entry.created)
        u = self._uses.get(k)
        c = self.catalog.get(k)
        return max(u.modified if u is not None else 0.0, c.modified if c is not None else 0.0)

    async def make_room(self, nbytes: int) -> int:
        """Evict by value (lowest first) until ``nbytes`` more fit the bucket-wide budget: the
        policy ranks a pool of the ``POOL`` least recently active entries (their records and use
        objects read by key, at most that many each round), then the next pool while still over.
        Returns the bytes freed. Raises what the bucket raises."""
        freed = 0
        tried: set[str] = set()
        while self.used_bytes() + nbytes > self.budget_bytes:
            keys = sorted((k for k in self.sizes if k not in tried), key=self._last_active)[:POOL]
            if not keys:
                break
            tried.update(keys)
            pool = []
            for k in keys:
                r = await self.entry(k)
                if r is not None:
                    pool.append(r)
            await self._read_uses([r.key for r in pool])
            for victim in self.policy.candidates([r.entry for r in pool], self.clock()):
                if self.used_bytes() + nbytes <= self.budget_bytes:
                    break
                freed += victim.bytes
                await self.delete(victim.key, "evicted by value for the bucket's budget")
                self.counters["evicted"] += 1
                self.counters["evicted_bytes"] += victim.bytes
        return freed

    async def expire(self) -> int:
        """Delete the listed entries whose record and use object were both last written more than
        ``ttl_s`` ago (``LastModified``, against :attr:`wall`); none when ``ttl_s`` is 0. Call
        after :meth:`refresh`. Returns how many."""
        if self.ttl_s <= 0:
            return 0
        now, gone = self.wall(), 0
        for k in [k for k in self.sizes if k in self.catalog]:
            u = self._uses.get(k)
            last = max(self.catalog[k].modified, u.modified if u is not None else 0.0)
            if now - last > self.ttl_s:
                n = self.sizes.get(k, 0)
                await self.delete(k, f"expired: last used {now - last:.0f} s ago (ttl {self.ttl_s:.0f} s)")
                self.counters["expired"] += 1
                self.counters["expired_bytes"] += n
                gone += 1
        return gone

    async def sweep(self) -> int:
        """Expire entries past the TTL (:meth:`expire`), then delete orphans older than
        ``orphan_age_s``: data objects of no record (a host died between its data and its record;
        one uploading now has its data younger than that) and use objects of no record (a hit
        recorded while the entry was evicted). A data object is kept while a record of its key is
        listed, indexed or held. Call after :meth:`refresh` (whose listings it reads). Returns how
        many data objects it deleted."""
        await self.expire()
        named = {o for r in self.index.values() for o in r.objects.values()}
        named.update(o for h in self.held.values() for o in h.objects)
        now = self.wall()   # the server's LastModified is wall time, whatever ``clock`` says
        gone = 0
        for k, objs in list(self._data.items()):
            if k in self.catalog or k in self.sizes or k in self.index or k in self.held:
                continue
            for o in list(objs):
                if o.key not in named and now - o.modified >= self.orphan_age_s:
                    await self.objects.delete(o.key)
                    objs.remove(o)
                    gone += 1
            if not objs:
                self._data.pop(k, None)
        for k, u in list(self._uses.items()):
            if k in self.catalog or k in self.sizes or k in self.index or k in self.held:
                continue
            if now - u.modified >= self.orphan_age_s:
                await self.objects.delete(u.key)
                del self._uses[k]
                self.counters["uses_swept"] += 1
        self.counters["orphans_deleted"] += gone
        return gone
