"""One content-addressed store for saved slot states, shared by the disk tier (kind ``"a"``), the
session tier (``"s"``) and the cache layer's head tier (``"h"``, ``ocache.tiers.head.HeadTier``): every
slot file ocache restores is an entry here.

What an entry is
    A group of data files that llama-server wrote with ``POST /slots/{id}?action=save`` (the slot
    file ``.bin`` and, from the patched build, its checkpoint sidecar ``.bin.ckpt``) plus ocache's own
    *record*: the token ids the slot held, the harness fingerprint and identity key it belongs to, the
    byte size and xxh3-64 of each file, created / last-use times (Unix seconds) and hits.

Where things live
    * data files: flat in the server's ``--slot-save-path`` (``data_dir``). llama-server refuses a
      filename with ``/`` (``fs_validate_filename``, common/common.cpp:796-868, docs/llama-server.md §5), so there
      are no subdirectories; every name ocache owns starts with ``oc-`` and is built from a content
      hash, never from a client string: ``oc-<kind>-<tag>-<key>.bin`` (+ ``.ckpt``), where ``key`` is
      the xxh3-128 of (identity key, kind, token ids) and ``tag`` names the store (several stores can
      share one data directory: ``store_files``). Files in ``data_dir`` that do not start with
      ``oc-`` are never touched (but for the registry ``.ocache-stores/``).
    * records and the index: ``meta_dir`` (mode 0700): ``records/<key>.json`` (one per entry, the
      source of truth), ``index.json`` (a checksummed summary for a fast start), ``store.json`` (where
      the data files live, for the offline ``ocache cache`` commands) and ``lock`` (one writer).

Atomicity and trust (a corrupt or stale index must never decide a deletion)
    * The server writes a slot file in place (not atomically, docs/llama-server.md §5), so it is asked to write a
      temporary name ``oc-tmp-...``; :meth:`Store.commit` then fsyncs it, hashes it, checks the token
      ids in its header, renames it to the final name, fsyncs the directory, and only then writes the
      record (temp + fsync + rename). The record is the commit point: a file without a record is
      never served and is removed as an orphan at the next :meth:`Store.open`.
    * The index is written the same way and carries an xxh3 checksum of its body. A missing,
      corrupt or stale index (its key set differs from the record files) is rebuilt from the
      records; no deletion is ever decided from the index — start-up deletions (orphans,
      unreadable records) are decided from the files and records themselves, and eviction runs
      only on entries whose record was read and parsed in this process.
    * Before a restore the caller runs :meth:`Store.verify`: every file exists with the recorded size
      and xxh3, the identity matches, and the token ids in the slot file header (byte 24 on,
      docs/llama-server.md §6) equal the record's. A failure deletes the entry (:meth:`Store.delete`) and raises.

Identities coexist
    Every entry records the identity key (``ocache.fingerprint.identity``: GGUF, build, template,
    state-shaping flags) of the server that wrote it. Only entries of the store's *current* identity
    are found and served (``find_prefixes``, ``verify``); entries of other identities stay on disk
    (another model under llama-swap or Ollama, another flag set) under the same budget, TTL and
    value eviction, and serve again once that identity is current again (:meth:`Store.set_identity`).
    Nothing is deleted because its identity is not the current one.

Budget and eviction (the disk eviction rule, docs/architecture.md §3)
    A byte budget over all entries (in-flight reservations included), a TTL for unused entries and a
    free-space floor on the data file system. When over, entries go in the order of the store's
    eviction policy (``Store(policy=...)``, ``ocache.tiers.evict``), by default ascending *value*:
    ``(hits + 1) * n_tokens / bytes * 0.5 ** days_unused`` (``ValuePolicy``). The budget is checked *before* the server
    writes: a tier reserves :meth:`Store.estimate_bytes` (a line through the sizes of every file
    measured so far: entries, the ``n_written`` of each save, and files the commit refused) and
    the reservation makes room by eviction or raises BudgetError, so nothing is written to be thrown
    away once a size is known; :meth:`Store.commit` checks the real size again. Deletions are
    logged as one summary line per operation with its reason (``store: deleted 6 entries (...):
    unused for longer than the TTL``), each entry at DEBUG.

Every method is synchronous and thread-safe (a re-entrant lock); hashing large files should be run
off the event loop by async callers (``asyncio.to_thread``).

Modules of the store: this one (the entries in memory, the write path, verification, budget and
deletions), ``ocache.tiers.entry`` (the record codec and the errors), ``ocache.tiers.slotfile``
(llama-server's slot file and sidecar headers), ``ocache.tiers.store_files`` (file names, the
meta directory, lock, index and start-up sweep) and ``ocache.tiers.evict`` (the eviction policy and
the budget procedure). The names of the first four are importable from here too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

# the names of the record codec, the slot file format and the meta files are re-exported: the tiers,
# the maintenance commands and the tests import them from here
from ocache.tiers.entry import (DAY_S, PREFIX, STORE_VERSION, TMP_PREFIX, BudgetError, Entry,  # noqa: F401
                                FileInfo, IntegrityError, LockedError, StoreError, TokenCache, entry_key,
                                grid_hashes, prefix_hash)
from ocache.tiers.evict import EvictionPolicy, ValuePolicy, make_room, next_eviction
from ocache.tiers.slotfile import (SIDECAR_ENTRY, SIDECAR_HEADER, SLOT_MAGIC, TOKENS_OFFSET,  # noqa: F401
                                   file_xxh3, read_slot_tokens, sidecar_checkpoints, token_bytes,
                                   tokens_from_bytes)
from ocache.tiers import store_files as sf
from ocache.tiers.store_files import CKPT_SUFFIX, SIDECAR_TMP_SUFFIX, OpenReport, atomic_write, data_dir_of  # noqa: F401

log = logging.getLogger(__name__)



class Store:
    """The content-addressed store (see the module docstring).

    ``identity``: the identity key of the running server (weights, build, template, flags): only its
    entries are served; entries of other identities are kept (see the module docstring). None
    (offline maintenance) serves nothing.
    ``budget_bytes``: upper bound on the sum of entry bytes plus reservations; ``kind_budgets``: an
    optional tighter bound per kind (``{"a": disk tier bytes, "s": session tier bytes}``: one store,
    two admission policies, each within its own budget). ``ttl_s``: entries unused
    this long are removed by :meth:`gc`. ``free_floor_bytes``: free space the data file system keeps.
    ``lock``: take an exclusive ``flock`` on ``meta_dir/lock`` (raises LockedError if held elsewhere).
    ``clock``: Unix time source (tests pass a fake one). ``policy``: the eviction policy that orders
    the victims and keeps hits and use times (``ocache.tiers.evict``; default :class:`ValuePolicy`,
    the rule of docs/architecture.md §3).
    """

    def __init__(self, meta_dir: Path, data_dir: Path, identity: str | None, *,
                 budget_bytes: int = 50 * 10**9, kind_budgets: dict[str, int] | None = None,
                 ttl_s: float = 7 * DAY_S,
                 free_floor_bytes: int = 0, lock: bool = True,
                 clock: Callable[[], float] = time.time, policy: EvictionPolicy | None = None) -> None:
        self.meta_dir = Path(meta_dir)
        self.data_dir = Path(data_dir)
        self.records_dir = self.meta_dir / "records"
        self.index_path = self.meta_dir / "index.json"
        self.identity = identity
        self.budget_bytes = int(budget_bytes)
        self.kind_budgets = {k: int(v) for k, v in (kind_budgets or {}).items()}
        self.ttl_s = float(ttl_s)
        self.free_floor_bytes = int(free_floor_bytes)
        self.clock = clock
        self.policy: EvictionPolicy = policy if policy is not None else ValuePolicy()
        self._lock = threading.RLock()
        self._entries: dict[str, Entry] = {}
        self._reserved: dict[str, tuple[str | None, int]] = {}  # key -> (kind, bytes)
        self._sizes = SlotSizes()   # (tokens, bytes) of the files commit measured
        self._tok_cache = TokenCache()
        self._lock_fd: int | None = None
        self._want_lock = lock
        self.report = OpenReport()
        self.tag = sf.store_tag(self.meta_dir)  # in every data file name (store_files: shared data dirs)
        self.counters: dict[str, int] = {"evicted": 0, "evicted_bytes": 0, "expired": 0,
                                         "verify_failed": 0, "committed": 0, "commit_failed": 0,
                                         "identity_switches": 0}

    # ------------------------------------------------------------------ paths
    def record_path(self, key: str) -> Path:
        return self.records_dir / f"{key}.json"

    def final_name(self, kind: str, key: str) -> str:
        """The data file name of an entry's ``.bin``, tagged with this store (``store_files``)."""
        return sf.final_name(kind, key, self.tag)

    def temp_name(self, kind: str, key: str) -> str:
        """A fresh temp name for the server's ``action=save``, tagged with this store."""
        return sf.temp_name(kind, key, self.tag)

    def path(self, name: str) -> Path:
        if "/" in name or not name.startswith(PREFIX):
            raise ValueError(f"not a store file name: {name!r}")
        return self.data_dir / name

    # ------------------------------------------------------------------ open / index
    def open(self, readonly: bool = False) -> OpenReport:
        """Create the directories (0700), take the lock, load or rebuild the index, sweep.

        Start-up deletions are decided from records and files only: records that cannot be parsed
        (with their key-named files) and ``oc-`` files that no record claims and that are provably
        orphans (this store's tag, or the data directory's registry says their store is gone:
        ``store_files.remove_orphans``; another store's files in a shared ``--slot-save-path`` are
        never touched). Entries of other identities are kept. Returns the :class:`OpenReport`.
        Raises LockedError if another process holds the lock. ``readonly``: no lock, no write and
        no deletion (``ocache cache ls`` next to a running ocache): the index is loaded or rebuilt in
        memory only.
        """
        with self._lock:
            if readonly and not self.records_dir.is_dir():
                raise StoreError(f"no store at {self.meta_dir}")
            if not readonly:
                sf.prepare_dirs(self.meta_dir, self.records_dir, self.data_dir)
                if self._want_lock and self._lock_fd is None:
                    self._lock_fd = sf.take_lock(self.meta_dir)   # raises LockedError
                sf.write_store_json(self.meta_dir, self.data_dir)
                try:
                    sf.register(self.data_dir, self.tag, self.meta_dir)
                except OSError as exc:  # unregistered: others keep our files all the same (not "gone")
                    log.warning("store: cannot register in %s: %s", self.data_dir, exc)
                sf.sweep_atomic_temps((self.meta_dir, self.records_dir))
            rep = OpenReport()
            rep.index, self._entries = sf.load_index(self.index_path, sf.record_keys(self.records_dir))
            if rep.index != "ok":
                self._entries, rep.bad_records = sf.read_records(self.records_dir,
                                                                    None if readonly else self.data_dir,
                                                                    self.tag)
            if readonly:
                rep.entries = len(self._entries)
                self.report = rep
                return rep
            if self.identity is not None:
                rep.other_identity = sum(1 for e in self._entries.values() if e.identity != self.identity)
            claimed = {f.name for e in self._entries.values() for f in e.files.values()}
            rep.orphans, rep.orphan_bytes = sf.remove_orphans(self.data_dir, claimed, self._reserved,
                                                                   self.tag)
            rep.entries = len(self._entries)
            self._write_index()
            self.report = rep
            log.info("store %s: %s", self.meta_dir, rep)
            return rep

    def set_identity(self, identity: str) -> int:
        """The server now has another identity (restarted with other weights, build, template or
        flags): from now on only its entries are served. Entries of every other identity are kept
        (they serve again when theirs returns). Returns how many entries of ``identity`` the store
        holds (0 when unchanged or none)."""
        with self._lock:
            if identity == self.identity:
                return 0
            mine = sum(1 for e in self._entries.values() if e.identity == identity)
            log.info("store: identity %s -> %s (%d entries of it, %d of other identities kept)",
                     self.identity, identity, mine, len(self._entries) - mine)
            self.identity = identity
            self._sizes = SlotSizes()  # another model or KV layout: old sizes say nothing
            self.counters["identity_switches"] += 1
            return mine

    def close(self) -> None:
        with self._lock:
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None

    def _write_index(self) -> None:
        sf.write_index(self.index_path, self._entries)

    # ------------------------------------------------------------------ queries
    def entries(self, kind: str | None = None) -> list[Entry]:
        with self._lock:
            return [e for e in self._entries.values() if kind is None or e.kind == kind]

    def get(self, key: str) -> Entry | None:
        with self._lock:
            return self._entries.get(key)

    def used_bytes(self) -> int:
        """Bytes of all entries plus in-flight reservations."""
        with self._lock:
            return sum(e.bytes for e in self._entries.values()) + sum(n for _, n in self._reserved.values())

    def kind_bytes(self, kind: str) -> int:
        """Bytes of entries of ``kind`` plus its reservations."""
        with self._lock:
            return (sum(e.bytes for e in self._entries.values() if e.kind == kind)
                    + sum(n for k, n in self._reserved.values() if k == kind))

    def tokens(self, key: str) -> list[int]:
        """The entry's token ids, loaded from its record. Raises IntegrityError (and deletes the
        entry) if the record is gone or unreadable, KeyError if the key is unknown."""
        with self._lock:
            self._entries[key]
            cached = self._tok_cache.get(key)
            if cached is not None:
                return cached
            try:
                full = Entry.from_dict(json.loads(self.record_path(key).read_bytes()), with_tokens=True)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                e = self._entries.get(key)
                self._delete_locked(key, f"record unreadable: {exc}")
                log_deleted([e], f"record unreadable: {exc}")
                self.counters["verify_failed"] += 1
                raise IntegrityError(key, "record", str(exc)) from exc
            toks = full.tokens or []   # with_tokens: always the checked list
            self._tok_cache.put(key, toks)
            return toks

    def find_prefixes(self, tokens: Sequence[int], kind: str | None = None,
                      fingerprint: str | None = None) -> list[Entry]:
        """Entries of this identity whose token list is a prefix of ``tokens`` (longest first).

        Candidates are found by content address (one xxh3 per distinct stored length), then the
        stored token ids are compared element by element — a hash is a hint, never an answer.
        """
        if self.identity is None:
            return []
        with self._lock:
            lengths = sorted({e.n_tokens for e in self._entries.values()
                              if (kind is None or e.kind == kind) and e.n_tokens <= len(tokens)},
                             reverse=True)
            kinds = [kind] if kind else sorted({e.kind for e in self._entries.values()})
            out = []
            for n in lengths:
                for k in kinds:
                    e = self._entries.get(entry_key(self.identity, k, tokens[:n]))
                    if e is None or (fingerprint is not None and e.fingerprint not in (None, fingerprint)):
                        continue
                    try:
                        if self.tokens(e.key) == list(tokens[:n]):  # element by element
                            out.append(e)
                    except IntegrityError:
                        continue
            return out

    # ------------------------------------------------------------------ verify
    def verify(self, key: str, expect_tokens: Sequence[int] | None = None, *,
               server_hash: bool = False) -> Entry:
        """Check an entry before any byte reaches the engine; delete it and raise on failure.

        Checks: identity equals the store's; each file exists with the recorded size and xxh3-64;
        the ``.bin`` header's token ids equal the record's (and ``expect_tokens[:n]`` if given).
        Reads every byte of every file (seconds ≈ bytes / disk read rate; the read also warms the page
        cache for the server's own read). ``server_hash``: the ``.bin``'s xxh3 is left to the server,
        which checks it on its own read before the state reaches a slot (the caller passes
        ``files["bin"].xxh3`` with the restore, patches/0006): that file's size and header are
        checked here, its bytes read once, by the server. Raises IntegrityError (entry deleted,
        except an entry of another identity, which is kept for it), KeyError (unknown).
        """
        e = self.get(key)
        if e is None:
            raise KeyError(key)
        if self.identity is not None and e.identity != self.identity:
            # not damaged, just not this server's: kept for its own identity (never deleted here)
            self.counters["verify_failed"] += 1
            raise IntegrityError(key, "identity", f"{e.identity} != {self.identity}")
        try:
            toks = self.tokens(key)
            if expect_tokens is not None and list(expect_tokens[:e.n_tokens]) != toks:
                raise IntegrityError(key, "tokens", "stored token ids differ from the request's")
            check_files(e, self.path, toks, server_hash=server_hash)
        except IntegrityError as exc:
            log.warning("store: %s; deleting the entry", exc)
            self.counters["verify_failed"] += 1
            self.delete(key, exc.reason)
            raise
        return e

    # ------------------------------------------------------------------ write path
    def reserve(self, key: str, nbytes: int, kind: str | None = None) -> None:
        """Reserve ``nbytes`` for an entry about to be written (under its temp names), evicting by
        value until budget and free-space floor allow it. Raises BudgetError (nothing evicted when
        the entry alone exceeds the budget)."""
        with self._lock:
            self._make_room(nbytes, kind, exclude={key})
            self._reserved[key] = (kind, nbytes)

    def release(self, key: str) -> None:
        with self._lock:
            self._reserved.pop(key, None)

    def note_size(self, n_tokens: int, nbytes: int) -> None:
        """Record the bytes a saved slot state of ``n_tokens`` tokens took (``SlotSizes.note``)."""
        with self._lock:
            self._sizes.note(n_tokens, nbytes)

    def estimate_bytes(self, n_tokens: int) -> int | None:
        """Estimated bytes of a slot state of ``n_tokens`` tokens before it is written
        (``SlotSizes.estimate`` over this identity's entries), or None when nothing of this
        identity was ever measured (then the first write measures it)."""
        with self._lock:
            return self._sizes.estimate([(e.n_tokens, e.bytes) for e in self._entries.values()
                                         if e.n_tokens > 0 and (self.identity is None or e.identity == self.identity)],
                                        n_tokens)

    def _free_bytes(self) -> int:
        return shutil.disk_usage(self.data_dir).free

    def _make_room(self, nbytes: int, kind: str | None = None, exclude: Iterable[str] = ()) -> None:
        """Evict in the policy's order (``EvictionPolicy.candidates``, by default ascending value)
        until ``nbytes`` more fit the total budget, ``kind``'s budget and the free-space floor
        (``ocache.tiers.evict.make_room``). Raises BudgetError, before evicting anything, when
        they cannot."""
        excl = set(exclude)
        victims = self.policy.candidates([e for e in self._entries.values() if e.key not in excl],
                                         self.clock())
        gone: list[Entry] = []
        try:
            make_room(victims, nbytes, kind=kind, budget_bytes=self.budget_bytes,
                      kind_budget=self.kind_budgets.get(kind) if kind is not None else None,
                      floor_bytes=self.free_floor_bytes, used=self.used_bytes,
                      kind_used=lambda: self.kind_bytes(kind) if kind is not None else 0,
                      free=self._free_bytes, evict=lambda v: self._evict_one(v, gone))
        finally:
            log_deleted(gone, f"evicted by value to make room for {nbytes} bytes"
                        + (f" of kind {kind!r}" if kind else ""))

    def commit(self, kind: str, tokens: Sequence[int], temp_bin: str, *, fingerprint: str | None = None,
               meta: dict | None = None) -> Entry:
        """Make a freshly written slot file (``temp_bin`` in data_dir, plus ``temp_bin + '.ckpt'`` if
        present) a trusted entry for ``tokens``.

        Steps: fsync, hash, check the header's token ids equal ``tokens``, rename to the final names,
        fsync the directory, write the record (the commit point), update the index. The budget is
        checked with the actual sizes (evicting by value). On any failure the temp files are removed
        and the error re-raised (ValueError for a header mismatch, BudgetError, OSError).
        Returns the new Entry (replacing an older one with the same key).
        """
        if self.identity is None:
            raise StoreError("a store opened without an identity cannot commit")
        key = entry_key(self.identity, kind, tokens)
        tmp_bin = self.path(temp_bin)
        tmp_ckpt = self.path(temp_bin + CKPT_SUFFIX)
        final = self.final_name(kind, key)
        try:
            files = seal_files(tokens, (("bin", tmp_bin, final), ("ckpt", tmp_ckpt, final + CKPT_SUFFIX)))
            nbytes = sum(f.size for f in files.values())
            now = self.clock()
            with self._lock:
                self.note_size(len(tokens), nbytes)  # also when it does not fit: the next is refused early
                self._reserved.pop(key, None)
                old = self._entries.get(key)
                self._make_room(nbytes - (old.bytes if old else 0), kind, exclude={key})
                install_files(self.path, files, old, tmp_bin, tmp_ckpt)
                sf.fsync_dir(self.data_dir)
                e = Entry(key=key, kind=kind, identity=self.identity, fingerprint=fingerprint,
                          n_tokens=len(tokens), files=files, created=now, last_used=now,
                          meta=dict(meta or {}))
                self.policy.update_on_put(e, old, now)
                atomic_write(self.record_path(key), json.dumps(e.record(tokens)).encode())
                self._tok_cache.put(key, tokens)
                self._entries[key] = e
                self._expire_unreturned(now)
                self._write_index()
                self.counters["committed"] += 1
                return e
        except BaseException:
            self.counters["commit_failed"] += 1
            self.release(key)
            self.discard_temp(temp_bin)
            raise

    def _expire_unreturned(self, now: float) -> None:
        """Delete what the policy says expired (``ValuePolicy.expired``: spills never restored within
        their TTL), at each commit: their bytes stay bounded by the write rate times that TTL."""
        expired = getattr(self.policy, "expired", None)
        gone = expired(list(self._entries.values()), now) if expired is not None else []
        for e in gone:
            self._delete_locked(e.key, "unreturned")
        self.counters["expired"] += len(gone)
        log_deleted(gone, "spills no request came back to within their TTL")

    def discard_temp(self, temp_bin: str) -> None:
        """Remove a temp slot file that will not be committed, with its sidecar and the sidecar's own
        temporary file (``store_files.temp_files``). Any file type is removed (``unlink``)."""
        for name in sf.temp_files(temp_bin):
            with contextlib.suppress(OSError, ValueError):
                self.path(name).unlink()

    # ------------------------------------------------------------------ use / delete / gc
    def touch(self, key: str, hit: bool = True) -> None:
        """Record a use (the policy's ``update_on_hit``: last use now, one more hit if ``hit``), in
        the record and the index."""
        with self._lock:
            e = self._entries.get(key)
            if e is None:
                return
            self.policy.update_on_hit(e, self.clock(), hit)
            try:
                atomic_write(self.record_path(key), json.dumps(e.record(self.tokens(key))).encode())
                self._write_index()
            except (IntegrityError, OSError) as exc:
                log.warning("store: could not record a use of %s: %s", key, exc)

    def delete(self, key: str, reason: str = "") -> bool:
        with self._lock:
            e = self._entries.get(key)
            found = self._delete_locked(key, reason)
            if found:
                log_deleted([e], reason or "deleted")
                self._write_index()
            return found

    def _delete_locked(self, key: str, reason: str) -> bool:
        e = self._entries.pop(key, None)
        self._tok_cache.pop(key)
        if e is None:
            return False
        log.debug("store: delete %s (%s, %d tokens, %d bytes): %s", key, e.kind, e.n_tokens, e.bytes, reason)
        # record first: from then on nothing trusts the files, whatever happens next
        with contextlib.suppress(FileNotFoundError):
            self.record_path(key).unlink()
        for f in e.files.values():
            with contextlib.suppress(FileNotFoundError):
                self.path(f.name).unlink()
        return True

    def _evict_one(self, e: Entry, gone: list[Entry]) -> None:
        self.counters["evicted"] += 1
        self.counters["evicted_bytes"] += e.bytes
        self._delete_locked(e.key, "evicted")
        gone.append(e)

    def gc(self) -> dict:
        """Remove entries unused for longer than the TTL, then evict by value down to the budget and
        the free-space floor. Returns {"expired": n, "evicted": n, "bytes": freed}."""
        with self._lock:
            now = self.clock()
            before = self.used_bytes()
            expired = [e for e in self._entries.values() if now - e.last_used > self.ttl_s]
            for e in expired:
                self._delete_locked(e.key, "ttl")
            log_deleted(expired, f"unused for longer than the TTL ({self.ttl_s / DAY_S:g} days)")
            self.counters["expired"] += len(expired)
            ev0 = self.counters["evicted"]
            with contextlib.suppress(BudgetError):
                self._make_room(0)
                for k in self.kind_budgets:
                    self._make_room(0, k)
            self._write_index()
            return {"expired": len(expired), "evicted": self.counters["evicted"] - ev0,
                    "bytes": before - self.used_bytes()}

    def evict(self, bytes_needed: int) -> int:
        """Free at least ``bytes_needed`` bytes in the policy's order (lowest value first). Returns
        bytes freed."""
        with self._lock:
            now = self.clock()
            freed = 0
            gone: list[Entry] = []
            for e in self.policy.candidates(list(self._entries.values()), now):
                if freed >= bytes_needed:
                    break
                freed += e.bytes
                self._evict_one(e, gone)
            log_deleted(gone, f"evicted by value to free {bytes_needed} bytes")
            self._write_index()
            return freed

    def clear(self, kind: str | None = None) -> int:
        """Delete every entry (of ``kind`` if given). Returns how many."""
        with self._lock:
            gone = [e for e in self._entries.values() if kind is None or e.kind == kind]
            for e in gone:
                self._delete_locked(e.key, "clear")
            log_deleted(gone, "cleared" + (f" (kind {kind!r})" if kind else ""))
            self._write_index()
            return len(gone)

    def stats(self) -> dict:
        """Counts and bytes; ``by_kind``: ``{kind: {"entries", "bytes", "hits"}}`` (bytes of the
        committed files, without reservations); ``by_folder``: the same per (project folder,
        client, model) of the entries' meta (None where not recorded), largest first, with the
        latest ``last_used``; ``next_eviction``: the entry :meth:`evict` would remove first
        (the first of the policy's order: lowest value), or None."""
        with self._lock:
            now = self.clock()
            by_kind, by_folder = usage(self._entries.values())
            nxt = next_eviction(self.policy.candidates(list(self._entries.values()), now), now)
            return {"entries": len(self._entries), "bytes": self.used_bytes(),
                    "budget_bytes": self.budget_bytes, "index": self.report.index, **self.counters,
                    "by_kind": by_kind, "next_eviction": nxt,
                    "by_folder": by_folder}


def log_deleted(gone: Sequence[Entry | None], reason: str) -> None:
    """One log line for a batch of deletions (None items skipped)."""
    done = [e for e in gone if e is not None]
    if done:
        log.info("store: deleted %d entr%s (%d tokens, %d bytes): %s", len(done),
                 "y" if len(done) == 1 else "ies", sum(e.n_tokens for e in done),
                 sum(e.bytes for e in done), reason)


def install_files(path: Callable[[str], Path], files: dict[str, FileInfo], old: Entry | None,
                  tmp_bin: Path, tmp_ckpt: Path) -> None:
    """Rename a commit's sealed temp files to their final names (``files``, :func:`seal_files`):
    first remove the files of ``old`` (the entry of the same key) that the new one does not
    reuse, and a stale sidecar when the new entry has none. Raises OSError."""
    if old is not None:
        for name in {f.name for f in old.files.values()} - {f.name for f in files.values()}:
            with contextlib.suppress(OSError):
                path(name).unlink()
    if "ckpt" not in files:
        with contextlib.suppress(FileNotFoundError):
            path(files["bin"].name + CKPT_SUFFIX).unlink()
    else:
        os.replace(tmp_ckpt, path(files["ckpt"].name))
    os.replace(tmp_bin, path(files["bin"].name))


def check_files(e: Entry, path: Callable[[str], Path], toks: Sequence[int], *, server_hash: bool) -> None:
    """Check ``e``'s files (``path``: file name -> its path in the data directory): each exists with
    the recorded size and xxh3-64 (the ``.bin``'s size only with ``server_hash``: the server
    hashes it on its own read, patches/0006), and the ``.bin`` header's token ids equal ``toks``
    (docs/llama-server.md §6). Reads every byte it hashes. Raises IntegrityError (reason
    ``missing``, ``size``, ``hash``, ``header`` or ``tokens``); deletes nothing."""
    for role, f in e.files.items():
        p = path(f.name)
        try:
            if server_hash and role == "bin":
                size, digest = p.stat().st_size, f.xxh3
            else:
                size, digest = file_xxh3(p)
        except FileNotFoundError as exc:
            raise IntegrityError(e.key, "missing", f.name) from exc
        if size != f.size:
            raise IntegrityError(e.key, "size", f"{f.name}: {size} != {f.size}")
        if digest != f.xxh3:
            raise IntegrityError(e.key, "hash", f.name)
    try:
        head = read_slot_tokens(path(e.bin_name))
    except ValueError as exc:
        raise IntegrityError(e.key, "header", str(exc)) from exc
    if head != list(toks):
        raise IntegrityError(e.key, "tokens", "slot file header differs from the record")


def seal_files(tokens: Sequence[int], roles: Iterable[tuple[str, Path, str]]) -> dict[str, FileInfo]:
    """Check that the first file (the ``.bin``) holds ``tokens`` in its header, then for each
    ``(role, written file, final name)`` whose file exists: fsync it, make it 0600 and hash it.
    Returns ``{role: FileInfo(final name, bytes, xxh3-64)}``. Raises ValueError (the header's
    token ids differ, or it is no slot file header), OSError."""
    roles = list(roles)
    head = read_slot_tokens(roles[0][1])
    if head != list(tokens):
        raise ValueError(f"slot file holds {len(head)} tokens that differ from the {len(tokens)} expected")
    out: dict[str, FileInfo] = {}
    for role, src, name in roles:
        if not src.exists():
            continue
        sf.fsync_file(src)
        os.chmod(src, 0o600)
        size, digest = file_xxh3(src)
        out[role] = FileInfo(name, size, digest)
    return out


class SlotSizes:
    """The bytes saved slot states took, by token count: the last 64 files :meth:`Store.commit`
    measured (``.bin`` + ``.ckpt``, kept or not), and the estimate of a state before it is
    written. Not thread-safe: the store calls it under its lock."""

    KEEP = 64

    def __init__(self) -> None:
        self.points: list[tuple[int, int]] = []

    def note(self, n_tokens: int, nbytes: int) -> None:
        """One measured file of ``n_tokens`` tokens and ``nbytes`` bytes (ignored when either is 0)."""
        if n_tokens > 0 and nbytes > 0:
            self.points.append((int(n_tokens), int(nbytes)))
            del self.points[:-self.KEEP]

    def estimate(self, entries: Sequence[tuple[int, int]], n_tokens: int) -> int | None:
        """Estimated bytes of a slot state of ``n_tokens`` tokens, from ``entries`` (``(tokens,
        bytes)`` of the committed entries of the identity) and the files measured; None without any.

        A slot file is a fixed part (header, recurrent state of a hybrid model, the sidecar's
        checkpoints) plus the KV cache of each token (llama_state_seq_save_file,
        docs/llama-server.md §6), so the estimate is the least-squares line ``a + b * n_tokens``
        (a, b >= 0) through those sizes (:func:`fit_bytes`); one point gives ``b = bytes /
        tokens``. The slot files of one identity share one KV layout, so anchors, spills and heads
        inform each other. The commit still checks the real size."""
        return fit_bytes([*entries, *self.points], n_tokens)


def fit_bytes(points: Sequence[tuple[int, int]], n_tokens: int) -> int | None:
    """Bytes of a slot state of ``n_tokens`` tokens on the least-squares line ``a + b * n`` (a, b >=
    0) through ``points`` (``(tokens, bytes)`` measured); one distinct token count gives ``b =
    the largest bytes / tokens``, no points None (:meth:`Store.estimate_bytes`)."""
    if not points:
        return None
    ns = {n for n, _ in points}
    if len(ns) == 1:
        n0 = next(iter(ns))
        per = max(b for n, b in points) / n0
        return int(per * n_tokens)
    k = len(points)
    mx = sum(n for n, _ in points) / k
    my = sum(b for _, b in points) / k
    sxx = sum((n - mx) ** 2 for n, _ in points)
    slope = max(0.0, sum((n - mx) * (b - my) for n, b in points) / sxx)
    icept = max(0.0, my - slope * mx)
    return int(icept + slope * n_tokens)


def usage(entries: Iterable[Entry]) -> tuple[dict[str, dict[str, int]], list[dict[str, Any]]]:
    """``(by_kind, by_folder)`` of :meth:`Store.stats`: entries, bytes and hits per kind, and the
    same per (folder, client, model) of the entries' meta with the latest ``last_used``, largest
    first."""
    by_kind: dict[str, dict[str, int]] = {}
    by_folder: dict[tuple, dict[str, Any]] = {}
    for e in entries:
        k = by_kind.setdefault(e.kind, {"entries": 0, "bytes": 0, "hits": 0})
        k["entries"] += 1
        k["bytes"] += e.bytes
        k["hits"] += e.hits
        labels = (e.meta.get("folder"), e.meta.get("client"), e.meta.get("model"))
        f = by_folder.setdefault(labels, {"folder": labels[0], "client": labels[1],
                                          "model": labels[2], "entries": 0, "bytes": 0,
                                          "hits": 0, "last_used": 0.0})
        f["entries"] += 1
        f["bytes"] += e.bytes
        f["hits"] += e.hits
        f["last_used"] = max(f["last_used"], e.last_used)
    return by_kind, sorted(by_folder.values(), key=lambda f: -f["bytes"])


async def reserve_async(store: Store, key: str, nbytes: int, kind: str | None = None) -> None:
    """:meth:`Store.reserve` off the event loop (it may delete evicted files). A caller cancelled
    while it runs never leaves the reservation behind: the cancellation waits for the thread (a
    dictionary update and a few unlinks), releases, then propagates; cancelled again meanwhile, the
    release runs when the thread is done. Raises BudgetError as ``reserve`` does."""
    import asyncio

    fut = asyncio.ensure_future(asyncio.to_thread(store.reserve, key, nbytes, kind))
    try:
        await asyncio.shield(fut)
    except asyncio.CancelledError:
        try:
            await asyncio.shield(fut)
        except BaseException:  # noqa: BLE001 - BudgetError, or cancelled again
            pass
        if fut.done():
            store.release(key)
        else:
            fut.add_done_callback(lambda f: store.release(key))
        raise


_SHARED: dict[Path, Store] = {}
_SHARED_LOCK = threading.Lock()


def shared_store(meta_dir: Path, data_dir: Path, identity: str, *, kind: str, kind_budget_bytes: int,
                 ttl_s: float = 7 * DAY_S, free_floor_bytes: int = 0) -> Store:
    """The one Store of this process for ``meta_dir`` (the disk and session tiers share it; the
    store's flock allows one opener per process). Each tier registers its kind's budget; the total
    budget is the sum of the kinds'. Opened on first use; a store whose ``open`` failed is not kept,
    so every tier asking for it gets the same error (and stays off) instead of an unopened store.
    Asked for with another identity, the store switches to it (``Store.set_identity``: the other
    identities' entries stay). Raises StoreError when the same meta_dir is asked for with another
    data_dir, LockedError/OSError when it cannot be opened."""
    meta_dir = Path(meta_dir).resolve()
    with _SHARED_LOCK:
        s = _SHARED.get(meta_dir)
        if s is None:
            s = Store(meta_dir, data_dir, identity, budget_bytes=0, ttl_s=ttl_s,
                      free_floor_bytes=free_floor_bytes)
            s.kind_budgets[kind] = int(kind_budget_bytes)
            s.budget_bytes = sum(s.kind_budgets.values())
            s.open()  # raises (LockedError, OSError): then nothing is kept, the next caller fails too
            _SHARED[meta_dir] = s
            return s
        if Path(data_dir).resolve() != s.data_dir.resolve():
            raise StoreError(f"store {meta_dir} is already open for {s.data_dir}")
        s.set_identity(identity)
        with s._lock:
            s.kind_budgets[kind] = int(kind_budget_bytes)
            s.budget_bytes = sum(s.kind_budgets.values())
            s.free_floor_bytes = max(s.free_floor_bytes, int(free_floor_bytes))
        return s
