"""The bucket side of the remote tier (``ocache.tiers.remote``): the object layout, the index of
the bucket's records, uploads of local entries, verified downloads into the local store, and
eviction under the bucket-wide policy (``ocache.tiers.remote_policy``; docs/decisions.md D7, D10).

Layout under the location's prefix (``ocache.tiers.remote_client.Location``)
    * ``data/<key>-<role>-<xxh3>``: one object per file of an entry (``bin``, ``ckpt``), named by
      its content hash, so two hosts that upload the same entry with other bytes never overwrite
      each other's files;
    * ``records/<key>.json``: ``{"version", "record", "objects", "host", "uploaded"[, "sig"]}``: ``record``
      is the local store's record (``Entry.record``: kind, identity, token ids, each file's size
      and xxh3, hits, times), ``objects`` the data object of each role. It is put **last** and
      **create-only** (``If-None-Match: *``): the commit point. A host that dies mid-upload leaves
      data objects and no record, which nothing restores; :meth:`RemoteBucket.sweep` deletes such
      objects once older than ``orphan_age_s``. The second host to upload an entry gets 412 and
      deletes its own data objects unless the winner's record names them;
    * ``use/<key>.json``: ``{"hits", "last_used"}``, overwritten by the host that confirmed a hit:
      the eviction policy's inputs (last writer wins: a lost count only shifts an eviction);
    * ``sessions/<xxh3-128 of identity and session key>.json``: ``{"key"}``, the record key of the
      session's latest spill (kind ``s``, not a guest's), overwritten by each upload of one: how a
      lookup finds a conversation by key. It only points: the record it names is checked as any
      (its session, identity and signature), so a wrong pointer costs one GET, never a wrong restore;
    * ``policy.json``: the bucket-wide budget and TTL every host keeps to (``ocache.tiers.remote_policy``).

Index: entries are looked up **by key** (:meth:`RemoteBucket.entry`: one GET of
``records/<key>.json``), never by listing the bucket on a request's path. What was read is kept in
``index`` (:class:`BoundedIndex`: at most ``index_max_entries`` records and ``index_max_bytes`` of
token ids, least recently used dropped first); a key the bucket lacks is remembered for
``absent_s`` seconds (``absent``, bounded too). The background sync lists ``records/``, ``data/``
and ``use/`` every ``refresh_s`` (``catalog``: key, size, time and ETag of each record; with the data
and use listings ~470 bytes a record, measured at 10,000 by scripts/bench-remote-deadlines: the one
structure that grows with the bucket; no record is read by it): the bucket's bytes for its budget,
the eviction pool, orphans.

Trust: nothing downloaded reaches a slot before :meth:`RemoteBucket.fetch` checked it: the
record parses (token ids against their count and hash), its key is the content address of its
identity, kind and tokens, its identity is the store's, every file's size and xxh3 match the
record, and the local store's commit checks the token ids in the slot file header (then the tiers
restore it as any local entry, after ``Store.verify``). A failed check raises RemoteError and
quarantines the entry on this host only (``RemoteBucket.quarantined``: never offered again here,
counted, logged once); it is not deleted for the fleet, since the fault may be this host's.

Signatures: with a fleet key (``store.remote.fleet_key`` or ``OCACHE_FLEET_KEY``) each record's
``sig`` is :func:`record_mac`, an HMAC-SHA256 over the record with its files' sizes and xxh3, and a
host reads only records whose ``sig`` verifies with its key: one without ``sig`` or with another
key's is held (quarantined here, left in the bucket, never evicted by this host). Without a fleet
key records are written unsigned and read unverified: anyone who can write the bucket can plant
an entry (data plus a record with matching hashes) that every host serves.

Versions: a record's ``version`` is the layout it was written in (:data:`LAYOUT_VERSION` here).
A record of a higher version, from a newer ocache, is held (:class:`HeldRecord`): neither served,
counted, evicted nor swept by this host, so hosts of two versions share one bucket while a fleet
upgrades; any layout change that older hosts cannot read raises the version.

Eviction (``ocache.tiers.remote_policy.BucketRules``, a base of :class:`RemoteBucket`): to the
bucket-wide policy's budget, by the local store's value rule (``ocache.tiers.evict.ValuePolicy``)
over the index, with the hits and last use of the use objects; entries past the policy's TTL; this
host's own uploads to its own ``max_gb``. A victim's record is deleted first (from then on no host
restores it), then its data and use objects; a host does not upload again an entry that left the
bucket.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable

import xxhash

from ocache.tiers.entry import Entry, entry_key, token_bytes, tokens_from_bytes
from ocache.tiers.evict import EvictionPolicy, ValuePolicy
from ocache.tiers.remote_client import ObjectInfo, S3Objects
from ocache.tiers.remote_policy import BucketRules
from ocache.tiers.slotfile import CHUNK
from ocache.tiers.store import BudgetError, Store, reserve_async

log = logging.getLogger(__name__)

LAYOUT_VERSION = 1
RECORDS = "records/"
DATA = "data/"
USE = "use/"
SESSIONS = "sessions/"

#: defaults of the in-memory index's bounds (``store.remote.index_max_entries`` / ``index_max_mb``)
INDEX_MAX_ENTRIES = 4096
INDEX_MAX_BYTES = 64 << 20
#: bytes an indexed entry is charged beyond its token ids (its parsed record: a rough upper bound)
ENTRY_OVERHEAD_BYTES = 2048
#: most keys remembered as absent from the bucket
ABSENT_MAX = 65536
#: records read (and use objects) per round of eviction when the bucket is over its budget
EVICTION_POOL = 64
#: seconds the tier leaves a bucket alone after a lookup or download it abandoned or that failed:
#: the first backoff, doubled on each failure in a row up to the last (``Backoff.trip``)
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 60.0


#: the environment variable a fleet key is read from when ``store.remote.fleet_key`` is unset
FLEET_KEY_ENV = "OCACHE_FLEET_KEY"
#: fewest characters of a fleet key
FLEET_KEY_MIN_CHARS = 16
#: what the MAC covers before the record's canonical JSON (another use of the key signs other bytes)
_SIG_DOMAIN = b"ocache remote record\n"


def record_mac(doc: dict, fleet_key: bytes) -> str:
    """HMAC-SHA256 (hex, 64 characters) with ``fleet_key`` over a record document without its
    ``sig``: its canonical JSON (sorted keys, no spaces, ASCII), so the layout version, the local
    record (identity, kind, token ids, each file's size and xxh3) and the data object names are
    all covered."""
    body = {k: v for k, v in doc.items() if k != "sig"}
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    return hmac.new(fleet_key, _SIG_DOMAIN + canon, hashlib.sha256).hexdigest()


class SignatureError(ValueError):
    """A record this host cannot verify with its fleet key: ``reason`` ``unsigned`` (no ``sig``)
    or ``signature`` (a MAC of another key or of other bytes)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"record {'is not signed' if reason == 'unsigned' else 'signature does not verify'}")
        self.reason = reason


class NewerLayout(ValueError):
    """A record of a layout version above :data:`LAYOUT_VERSION` (written by a newer ocache): not
    readable here, and not this host's to delete."""


class RemoteError(RuntimeError):
    """A download was refused or failed. ``reason``: ``record`` (unparsable or mislabelled
    record), ``identity``, ``size``, ``hash``, ``header`` (a failed check: the bucket entry was
    deleted), ``missing`` (a data object is gone), ``budget`` (no local room), ``io`` (the bucket or
    the local disk failed: kept)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"remote: {reason}{': ' + detail if detail else ''}")
        self.reason = reason


@dataclass
class HeldRecord:
    """A record this host neither serves nor deletes: ``reason`` ``newer`` (a newer layout
    version), ``unsigned`` / ``signature`` (it fails this host's fleet key: quarantined); ``etag`` of the record read (a changed record is read again); ``objects``: the data
    object names it gives, if any (never swept as orphans)."""

    reason: str
    etag: str
    objects: frozenset[str] = frozenset()


def named_objects(raw: bytes) -> frozenset[str]:
    """The ``data/`` object names a record of any layout gives in its ``objects`` mapping (empty
    when it has none or does not parse)."""
    try:
        objs = json.loads(raw).get("objects")
        return frozenset(str(o) for o in dict(objs).values() if str(o).startswith(DATA))
    except (ValueError, TypeError, AttributeError):
        return frozenset()


@dataclass
class RemoteEntry:
    """One entry of the bucket's index: the parsed record (``entry``, its ``tokens`` None), the
    token ids as int32 LE bytes, and the data object of each role."""

    entry: Entry
    token_raw: bytes = field(repr=False)
    objects: dict[str, str]
    host: str = ""

    @property
    def key(self) -> str:
        return self.entry.key

    def tokens(self) -> list[int]:
        return tokens_from_bytes(self.token_raw)


def parse_record(name_key: str, raw: bytes, fleet_key: bytes | None = None) -> RemoteEntry:
    """A record object's bytes as a RemoteEntry. With a ``fleet_key``, its ``sig`` must be
    :func:`record_mac` of it under that key. Raises NewerLayout (an integer ``version`` above
    :data:`LAYOUT_VERSION`), SignatureError (no ``sig``, or one that does not verify),
    ValueError (another version, key that is not the content address of the record's identity,
    kind and token ids, a role without its object), KeyError, TypeError."""
    doc = json.loads(raw)
    version = doc.get("version")
    if isinstance(version, int) and not isinstance(version, bool) and version > LAYOUT_VERSION:
        raise NewerLayout(f"layout version {version} (this ocache reads {LAYOUT_VERSION})")
    if fleet_key is not None:
        sig = doc.get("sig")
        if not isinstance(sig, str) or not sig:
            raise SignatureError("unsigned")
        if not hmac.compare_digest(sig, record_mac(doc, fleet_key)):
            raise SignatureError("signature")
    if version != LAYOUT_VERSION:
        raise ValueError(f"layout version {version!r}")
    e = Entry.from_dict(doc["record"], with_tokens=True)
    toks = e.tokens or []
    if e.key != name_key or entry_key(e.identity, e.kind, toks) != e.key:
        raise ValueError("record key is not the content address of its tokens")
    objects = {str(r): str(o) for r, o in dict(doc["objects"]).items()}
    if set(objects) != set(e.files) or any(not o.startswith(DATA) for o in objects.values()):
        raise ValueError("record objects do not match its files")
    e.tokens = None
    return RemoteEntry(e, token_bytes(toks), objects, str(doc.get("host") or ""))


def session_pointer(identity: str, session: str) -> str:
    """The object key (relative to the location) of the pointer to a session's latest spill:
    ``sessions/`` + xxh3-128 hex of ``identity`` and ``session`` (the session tier's key)."""
    digest = xxhash.xxh3_128_hexdigest(identity.encode() + b"\0" + session.encode())
    return f"{SESSIONS}{digest}.json"


def data_key_of(name: str) -> str:
    """The entry key a ``data/<key>-<role>-<xxh3>`` object belongs to ('' for another name)."""
    return name[len(DATA):].split("-", 1)[0] if name.startswith(DATA) else ""


class BoundedIndex(OrderedDict):
    """The records this host read: entry key -> :class:`RemoteEntry`, least recently used first.
    At most ``max_entries`` entries and ``max_bytes`` bytes (each entry's token ids plus
    ``ENTRY_OVERHEAD_BYTES``); adding beyond either drops the least recently used. ``get`` and
    ``[]`` do not reorder; :meth:`touch` does."""

    def __init__(self, max_entries: int = INDEX_MAX_ENTRIES, max_bytes: int = INDEX_MAX_BYTES) -> None:
        super().__init__()
        self.max_entries = max(1, int(max_entries))
        self.max_bytes = max(1, int(max_bytes))
        self.nbytes = 0
        self.dropped = 0

    @staticmethod
    def cost(r: "RemoteEntry") -> int:
        return len(r.token_raw) + ENTRY_OVERHEAD_BYTES

    def __setitem__(self, key: str, r: "RemoteEntry") -> None:
        old = super().get(key)
        if old is not None:
            self.nbytes -= self.cost(old)
        super().__setitem__(key, r)
        self.move_to_end(key)
        self.nbytes += self.cost(r)
        while len(self) > 1 and (len(self) > self.max_entries or self.nbytes > self.max_bytes):
            self.popitem(last=False)
            self.dropped += 1

    def __delitem__(self, key: str) -> None:
        r = super().get(key)
        super().__delitem__(key)
        if r is not None:
            self.nbytes -= self.cost(r)

    def pop(self, key: str, *default: Any) -> Any:
        if key in self:
            r = super().get(key)
            del self[key]
            return r
        if default:
            return default[0]
        raise KeyError(key)

    def popitem(self, last: bool = True) -> tuple[str, "RemoteEntry"]:
        key, r = super().popitem(last=last)
        self.nbytes -= self.cost(r)
        return key, r

    def clear(self) -> None:
        super().clear()
        self.nbytes = 0

    def touch(self, key: str) -> None:
        if key in self:
            self.move_to_end(key)


def open_checked(path: Path, size: int, xxh3: str) -> BinaryIO:
    """``path`` opened for reading, its bytes checked against ``size`` and ``xxh3`` through the
    same handle and the handle rewound: what is uploaded from it is what was checked (a local file
    replaced meanwhile is a new inode; this handle keeps reading the old one). Raises ValueError
    (it differs from its record), OSError."""
    fh = open(path, "rb")
    try:
        h = xxhash.xxh3_64()
        n = 0
        while chunk := fh.read(CHUNK):
            h.update(chunk)
            n += len(chunk)
        if n != size or h.hexdigest() != xxh3:
            raise ValueError(f"{path.name} differs from its record")
        fh.seek(0)
        return fh
    except BaseException:
        fh.close()
        raise


class Backoff:
    """Whether requests leave the bucket alone: a lookup or download on a request's path that was
    abandoned or failed :meth:`trip` s it for ``backoff_s`` (``BACKOFF_FIRST_S``, doubled on each
    trip in a row, at most ``BACKOFF_MAX_S``); the first lookup after it asks again. The background
    sync is not held back by it (its own failures are retried by its next round)."""

    def __init__(self) -> None:
        self.backoff_s = 0.0
        self.down_until = 0.0

    def trip(self) -> None:
        self.backoff_s = min(BACKOFF_MAX_S, max(BACKOFF_FIRST_S, 2 * self.backoff_s))
        self.down_until = time.monotonic() + self.backoff_s

    def answered(self) -> None:
        """The bucket answered a request's lookup: the backoff starts from the first again."""
        self.backoff_s = 0.0

    def unreachable(self) -> bool:
        return time.monotonic() < self.down_until


class AbsentKeys:
    """Keys found missing, each not asked again for ``seconds`` (monotonic), at most
    ``ABSENT_MAX`` of them (the oldest dropped)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = float(seconds)
        self._at: OrderedDict[str, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._at)

    def recent(self, key: str) -> bool:
        """Whether ``key`` was found missing less than ``seconds`` ago (no request)."""
        t = self._at.get(key)
        if t is not None and time.monotonic() - t < self.seconds:
            return True
        self._at.pop(key, None)
        return False

    def mark(self, key: str) -> None:
        self._at[key] = time.monotonic()
        self._at.move_to_end(key)
        while len(self._at) > ABSENT_MAX:
            self._at.popitem(last=False)

    def discard(self, key: str) -> None:
        self._at.pop(key, None)


async def point_session(objects: S3Objects, absent: AbsentKeys, e: Entry) -> None:
    """After a session spill's record is in the bucket: its session's pointer
    (:func:`session_pointer`) names it, and the pointer is no longer remembered absent (best
    effort: the entry is uploaded either way; a failure is logged)."""
    from ocache.tiers.spill import is_guest

    session = e.meta.get("session")
    if e.kind != "s" or not session or is_guest(e.meta) or not e.identity:
        return
    ptr = session_pointer(e.identity, str(session))
    try:
        await objects.put(ptr, json.dumps({"key": e.key}).encode())
        absent.discard(ptr)
    except Exception as exc:  # noqa: BLE001 - the entry is uploaded; only its pointer is missing
        log.info("remote: session pointer of %s not written: %s", e.key[:16], exc)


class RemoteBucket(BucketRules):
    """The bucket of a remote tier, in front of one host's local :class:`Store`.

    ``objects``: an open :class:`S3Objects`. ``budget_bytes`` / ``ttl_s``: the bucket-wide policy
    this host proposes (``store.remote.budget_gb``, ``ttl_s``; the bucket's own policy object, once
    read, rules: ``ocache.tiers.remote_policy``); ``host_max_bytes``: most bytes of this host's own
    uploads in the bucket (``store.remote.max_gb``; None: no bound of its own); ``replace_policy``:
    write the proposal over the bucket's policy once. ``host``: this host's name in the records.
    ``orphan_age_s``: data objects no record names are deleted by :meth:`sweep` once this old.
    ``fleet_key``: the key records are signed with on upload and verified with on read (None: records
    are written unsigned and read unverified). ``index_max_entries`` / ``index_max_bytes``: the
    bounds of ``index``; ``absent_s``: seconds a key found missing is not asked again (a listing
    that shows it ends that sooner). Counters in ``counters``; every method is a coroutine of the
    event loop (file reads and hashing run in threads)."""

    def __init__(self, objects: S3Objects, store: Store, *, budget_bytes: int, host: str = "",
                 orphan_age_s: float = 3600.0, clock: Callable[[], float] = time.time,
                 policy: EvictionPolicy | None = None, fleet_key: bytes | None = None,
                 index_max_entries: int = INDEX_MAX_ENTRIES, index_max_bytes: int = INDEX_MAX_BYTES,
                 absent_s: float = 10.0, ttl_s: float = 0.0, host_max_bytes: int | None = None,
                 replace_policy: bool = False) -> None:
        self.objects = objects
        self.store = store
        self.host = host or os.uname().nodename
        self.orphan_age_s = float(orphan_age_s)
        self.clock = clock
        self.policy: EvictionPolicy = policy or ValuePolicy()
        self._fleet_key = fleet_key or None     # never logged, printed or counted
        self.index = BoundedIndex(index_max_entries, index_max_bytes)
        self.absent = AbsentKeys(absent_s)
        #: records the last listing showed (and those a HEAD before an upload found since): key -> info
        self.catalog: dict[str, ObjectInfo] = {}
        #: bytes of each entry believed in the bucket and not held (the record's files when read,
        #: else the listed data objects under its key): the budget's arithmetic
        self.sizes: dict[str, int] = {}
        self._data: dict[str, list[ObjectInfo]] = {}   # entry key -> its listed data objects
        self._uses: dict[str, ObjectInfo] = {}         # entry key -> its listed use object
        self.held: dict[str, HeldRecord] = {}   # records kept out of the index and never deleted
        self.quarantined: dict[str, str] = {}   # index key -> the check its download failed: not offered
        self.lock = asyncio.Lock()             # one sync round or refresh at a time (its tiers')
        self._etags: dict[str, str] = {}       # record key -> etag of the record read
        self._use_etags: dict[str, str] = {}
        self._quarantined_etags: dict[str, str] = {}   # key -> etag of the record it was quarantined under
        self.refreshed_at = 0.0
        #: whether requests leave the bucket alone now (a lookup or download abandoned)
        self.reach = Backoff()
        self.counters: dict[str, int] = {
            "uploads": 0, "upload_bytes": 0, "upload_lost_race": 0, "upload_failed": 0,
            "downloads": 0, "download_bytes": 0, "verify_failed": 0, "download_failed": 0,
            "evicted": 0, "evicted_bytes": 0, "orphans_deleted": 0, "bad_records": 0,
            "skipped_budget": 0, "newer_records": 0, "quarantined": 0,
            "record_gets": 0, "record_absent": 0, "lists": 0,
        }
        self._init_rules(budget_bytes, ttl_s, host_max_bytes, replace_policy)

    # ------------------------------------------------------------------ index
    def holds(self, key: str) -> bool:
        """Whether the last listing, an upload or a read since showed a record of ``key`` (no
        request)."""
        return key in self.sizes or key in self.index

    def _forget(self, key: str) -> None:
        """Drop ``key`` from what this host believes the bucket holds (its record is gone)."""
        self.index.pop(key, None)
        self._etags.pop(key, None)
        self.sizes.pop(key, None)
        self.catalog.pop(key, None)

    async def entry(self, key: str, *, fresh: bool = False) -> RemoteEntry | None:
        """The bucket's record of ``key``, by key: from ``index`` (no request), else None when it
        was found missing within ``absent_s`` or is held, else one GET of ``records/<key>.json``,
        parsed and checked (:func:`parse_record`) and kept in ``index``. ``fresh``: ask the bucket
        whatever is cached. A record of a newer layout or that fails the fleet key is held (None);
        one that does not parse is deleted from the bucket (it can never be served). Raises what the
        bucket raises."""
        if not fresh:
            r = self.index.get(key)
            if r is not None:
                self.index.touch(key)
                return r
            if key in self.held or self.absent.recent(key):
                return None
        self.counters["record_gets"] += 1
        got = await self.objects.get_tagged(f"{RECORDS}{key}.json")
        if got is None:
            self.counters["record_absent"] += 1
            self._forget(key)
            self.held.pop(key, None)
            self.absent.mark(key)
            return None
        self.absent.discard(key)
        raw, etag = got
        return await self._parsed(key, raw, etag)

    async def _parsed(self, k: str, raw: bytes, etag: str) -> RemoteEntry | None:
        """Index (or hold, or delete) the record ``raw`` of key ``k`` read with ``etag``."""
        try:
            r = parse_record(k, raw, self._fleet_key)
        except NewerLayout as exc:
            self.index.pop(k, None)
            self._etags.pop(k, None)
            self.sizes.pop(k, None)
            if k not in self.held:
                self.counters["newer_records"] += 1
                log.info("remote: record %s is of a newer ocache (%s): left to the hosts that read it",
                         k[:16], exc)
            self.held[k] = HeldRecord("newer", etag, named_objects(raw))
            return None
        except SignatureError as exc:
            self.index.pop(k, None)
            self._etags.pop(k, None)
            self.sizes.pop(k, None)
            if k not in self.held:
                self.counters["quarantined"] += 1
                log.warning("remote: record %s quarantined on this host: %s with the fleet key "
                            "(not served; left in the bucket)", k[:16], exc)
            self.held[k] = HeldRecord(exc.reason, etag, named_objects(raw))
            return None
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            self.counters["bad_records"] += 1
            log.warning("remote: record %s does not parse (%s); deleting it", k[:16], exc)
            self._forget(k)
            await self.objects.delete(f"{RECORDS}{k}.json")
            return None
        self.index[k] = r
        self._etags[k] = etag
        self.sizes[k] = r.entry.bytes
        self.held.pop(k, None)
        if k in self.quarantined and self._quarantined_etags.get(k) != etag:
            self.quarantined.pop(k, None)    # a new record under the key: checked afresh
            self._quarantined_etags.pop(k, None)
        return r

    async def session_entry(self, identity: str, session: str) -> RemoteEntry | None:
        """The latest spill of ``session`` (the session tier's key) for ``identity``, by key: the
        session pointer (one GET), then its record (:meth:`entry`); None when either is missing or
        the record is not that session's agent spill of that identity. Raises what the bucket
        raises."""
        ptr = session_pointer(identity, session)
        if self.absent.recent(ptr):
            return None
        self.counters["record_gets"] += 1
        raw = await self.objects.get(ptr)
        if raw is None:
            self.absent.mark(ptr)
            return None
        try:
            key = str(json.loads(raw)["key"])
        except (ValueError, KeyError, TypeError):
            return None
        r = await self.entry(key)
        if r is None or r.entry.kind != "s" or r.entry.identity != identity or r.entry.meta.get("session") != session:
            return None
        return r

    async def refresh(self) -> None:
        """List the bucket (``records/``, ``data/``, ``use/``: the background sync's view, never a
        request's): the catalog of records, each entry's bytes, and the use objects. Records gone
        from the listing leave the index; one whose ETag changed is read again when next asked
        for; a listed key is no longer remembered as absent. No record is read here: an entry's
        bytes are its record's when this host read it, else its listed data objects'. The use
        objects of indexed entries whose ETag changed are read (hits, last use). Then the bucket's
        policy is read (:meth:`load_policy`)."""
        listed = await self.objects.list(RECORDS)
        data = await self.objects.list(DATA)
        uses = await self.objects.list(USE)
        self.counters["lists"] += 3
        catalog = {o.key[len(RECORDS):-5]: o for o in listed if o.key.endswith(".json")}
        by_key: dict[str, list[ObjectInfo]] = {}
        for o in data:
            by_key.setdefault(data_key_of(o.key), []).append(o)
        self._data = by_key
        self._uses = {o.key[len(USE):-5]: o for o in uses if o.key.endswith(".json")}
        for k in list(self.index):
            if k not in catalog or (self._etags.get(k) and self._etags[k] != catalog[k].etag):
                self.index.pop(k, None)
                self._etags.pop(k, None)
        for k in list(self.held):
            if k not in catalog or self.held[k].etag != catalog[k].etag:
                del self.held[k]
        sizes = {}
        for k in catalog:
            self.absent.discard(k)
            if k in self.held:
                continue
            r = self.index.get(k)
            sizes[k] = r.entry.bytes if r is not None else sum(o.size for o in by_key.get(k, ()))
        for k in self.sizes.keys() - catalog.keys():
            self.mark_left(k)
        self.catalog, self.sizes = catalog, sizes
        if any(k not in catalog for k in self.mine):    # this host's uploads deleted by another
            self.mine = {k: n for k, n in self.mine.items() if k in catalog}
            await self.save_mine()
        for k in list(self.quarantined):
            if k not in catalog:
                del self.quarantined[k]
        await self._read_uses([k for k in self._uses if k in self.index])
        await self.load_policy()
        self.refreshed_at = time.monotonic()

    async def _read_uses(self, keys: Iterable[str]) -> None:
        """Read the listed use objects of ``keys`` (indexed entries) whose ETag changed."""
        for k in keys:
            o = self._uses.get(k)
            r = self.index.get(k)
            if o is None or r is None or self._use_etags.get(k) == o.etag:
                continue
            raw = await self.objects.get(o.key)
            try:
                doc = json.loads(raw or b"{}")
                r.entry.hits = max(r.entry.hits, int(doc.get("hits", 0)))
                r.entry.last_used = max(r.entry.last_used, float(doc.get("last_used", 0.0)))
                self._use_etags[k] = o.etag
            except (ValueError, TypeError, AttributeError):
                continue

    # ------------------------------------------------------------------ upload
    async def upload(self, e: Entry) -> bool:
        """Upload a local entry: make room under this host's own bound (its own entries only,
        :meth:`make_own_room`) and, from a fresh listing of ``data/`` (:meth:`fresh_usage`), under
        the bucket-wide budget (:meth:`make_room`); put its data objects (the bytes read and
        checked against the local record first), then its record, create-only, then (a session's
        spill) its session pointer. Returns True when the bucket holds the entry afterwards (ours
        or another host's), False when it was skipped (larger than either budget, it left the
        bucket before, its local files changed or went). Whether the bucket has it already is
        asked by key (one HEAD) unless known. Raises what the bucket raises."""
        if self.holds(e.key):
            return True
        if e.key in self.held:    # a newer ocache's or a quarantined record holds the key
            return False
        if e.key in self.left:    # evicted or expired from the bucket: not put back
            return False
        own = self.budget_bytes if self.host_max_bytes is None else self.host_max_bytes
        if e.bytes > min(self.budget_bytes, own):
            self.counters["skipped_budget"] += 1
            return False
        found = await self.objects.head(f"{RECORDS}{e.key}.json")
        if found is not None:
            self.catalog[e.key] = found
            self.sizes[e.key] = e.bytes
            return True
        files: dict[str, BinaryIO] = {}
        try:
            try:
                toks = await asyncio.to_thread(self.store.tokens, e.key)
                for role, f in e.files.items():
                    files[role] = await asyncio.to_thread(open_checked, self.store.path(f.name), f.size, f.xxh3)
            except (OSError, KeyError, ValueError) as exc:   # evicted or changed meanwhile
                log.info("remote: %s not uploaded: %s", e.key[:16], exc)
                return False
            await self.make_own_room(e.bytes)      # this host's own bound: only its own entries
            await self.fresh_usage()               # the bucket's bytes now, others' uploads in flight included
            await self.make_room(e.bytes)          # the bucket-wide budget
            objects = {role: f"{DATA}{e.key}-{role}-{f.xxh3}" for role, f in e.files.items()}
            for role, name in objects.items():
                await self.objects.put(name, files[role])
        finally:
            for fh in files.values():
                fh.close()
        rec: dict[str, Any] = {"version": LAYOUT_VERSION, "record": e.record(toks), "objects": objects,
                               "host": self.host, "uploaded": self.clock()}
        if self._fleet_key is not None:
            rec["sig"] = record_mac(rec, self._fleet_key)
        if not await self.objects.put(f"{RECORDS}{e.key}.json", json.dumps(rec).encode(), create_only=True):
            self.counters["upload_lost_race"] += 1
            theirs = await self.entry(e.key, fresh=True)
            keep = set(theirs.objects.values()) if theirs is not None else set()
            for name in set(objects.values()) - keep:
                await self.objects.delete(name)
            return theirs is not None
        self.index[e.key] = RemoteEntry(Entry.from_dict(e.summary(), with_tokens=False),
                                        token_bytes(toks), objects, self.host)
        self.sizes[e.key] = e.bytes
        self.mine[e.key] = e.bytes
        await self.save_mine()
        self.absent.discard(e.key)
        self.counters["uploads"] += 1
        self.counters["upload_bytes"] += e.bytes
        log.info("remote: uploaded %s (%s, %d tokens, %d bytes)", e.key[:16], e.kind, e.n_tokens, e.bytes)
        await point_session(self.objects, self.absent, e)
        return True

    # ------------------------------------------------------------------ eviction
    async def delete(self, key: str, reason: str) -> None:
        """Delete an entry from the bucket: its record first, then its data objects (the record's
        and any listed under its key) and use object."""
        r = self.index.get(key)
        names = set(r.objects.values()) if r is not None else set()
        names.update(o.key for o in self._data.pop(key, ()))
        self._forget(key)
        self.quarantined.pop(key, None)
        self._uses.pop(key, None)
        self.mark_left(key)
        if self.mine.pop(key, None) is not None:
            await self.save_mine()
        log.info("remote: deleting %s: %s", key[:16], reason)
        await self.objects.delete(f"{RECORDS}{key}.json")
        for name in sorted(names):
            await self.objects.delete(name)
        await self.objects.delete(f"{USE}{key}.json")
        self.absent.mark(key)

    # ------------------------------------------------------------------ download
    async def fetch(self, key: str) -> Entry:
        """Download an entry into the local store, verified (see the module docstring), and return
        the local Entry. Raises RemoteError; KeyError when the bucket has no record of the key (read
        by key when not indexed: :meth:`entry`)."""
        r = self.index.get(key) or await self.entry(key)
        if r is None:
            raise KeyError(key)
        e = r.entry
        if key in self.quarantined:
            raise RemoteError("quarantined", self.quarantined[key])
        if e.identity != self.store.identity:
            raise RemoteError("identity", f"{e.identity} != {self.store.identity}")
        local = self.store.get(key)
        if local is not None:
            return local
        try:
            await reserve_async(self.store, key, e.bytes, e.kind)
        except BudgetError as exc:
            raise RemoteError("budget", str(exc)) from exc
        tmp = self.store.temp_name(e.kind, key)
        try:
            for role, f in e.files.items():
                name = tmp if role == "bin" else tmp + ".ckpt"
                await self._download(r, role, self.store.path(name))
            local = await asyncio.to_thread(self.store.commit, e.kind, r.tokens(), tmp,
                                            fingerprint=e.fingerprint, meta={**e.meta, "remote": r.host})
        except RemoteError as exc:
            self.store.release(key)
            self.store.discard_temp(tmp)
            await self._refused(key, exc)
            raise
        except ValueError as exc:         # commit: the slot file header holds other token ids
            self.store.release(key)
            err = RemoteError("header", str(exc))
            await self._refused(key, err)
            raise err from exc
        except OSError as exc:
            self.store.release(key)
            self.store.discard_temp(tmp)
            self.counters["download_failed"] += 1
            raise RemoteError("io", str(exc)) from exc
        except asyncio.CancelledError:    # abandoned (its deadline): nothing of it stays behind
            self.store.release(key)
            self.store.discard_temp(tmp)
            raise
        self.counters["downloads"] += 1
        self.counters["download_bytes"] += local.bytes
        return local

    async def _refused(self, key: str, exc: RemoteError) -> None:
        if exc.reason in ("size", "hash", "header", "record"):
            # quarantined here, not deleted for the fleet: what failed may be this host's transfer
            # or disk; the entry stays in the index (counted in the budget, evicted by value: it
            # earns no hits) until a new record replaces it
            self.counters["verify_failed"] += 1
            if key not in self.quarantined:
                self.counters["quarantined"] += 1
                log.warning("remote: %s refused: %s; quarantined on this host (left in the bucket)", key[:16], exc)
            self.quarantined[key] = exc.reason
            self._quarantined_etags[key] = self._etags.get(key, "")
        else:
            self.counters["download_failed"] += 1
            if exc.reason == "missing":   # being evicted by another host: read again when next asked
                self._forget(key)

    async def _download(self, r: RemoteEntry, role: str, dest: Any) -> None:
        """Stream one data object into ``dest`` (created 0600, never overwritten), hashing as it
        goes; raises RemoteError (``missing``, ``size``, ``hash``, ``io``)."""
        want = r.entry.files[role]
        h = xxhash.xxh3_64()
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            def sink(part: bytes) -> None:
                if fh.tell() + len(part) > want.size:
                    raise RemoteError("size", f"{r.objects[role]} is longer than {want.size} bytes")
                fh.write(part)
                h.update(part)

            try:
                n = await self.objects.stream(r.objects[role], sink)
            except FileNotFoundError as exc:
                raise RemoteError("missing", r.objects[role]) from exc
            except RemoteError:
                raise
            except Exception as exc:  # noqa: BLE001 - the bucket failed: the entry is kept
                raise RemoteError("io", f"{r.objects[role]}: {exc}") from exc
        if n != want.size:
            raise RemoteError("size", f"{r.objects[role]}: {n} != {want.size} bytes")
        if h.hexdigest() != want.xxh3:
            raise RemoteError("hash", r.objects[role])

    async def note_use(self, key: str) -> None:
        """Record a confirmed hit of ``key`` in its use object (best effort: logged on failure)."""
        try:
            r = self.index.get(key) or await self.entry(key)
        except Exception as exc:  # noqa: BLE001
            log.info("remote: could not record a use of %s: %s", key[:16], exc)
            return
        if r is None:
            return
        r.entry.hits += 1
        r.entry.last_used = self.clock()
        body = json.dumps({"hits": r.entry.hits, "last_used": r.entry.last_used}).encode()
        try:
            await self.objects.put(f"{USE}{key}.json", body)
        except Exception as exc:  # noqa: BLE001
            log.info("remote: could not record a use of %s: %s", key[:16], exc)
