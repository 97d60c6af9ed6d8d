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
      hash, never from a client string: ``oc-<kind>-<key>.bin`` (+ ``.ckpt``), where ``key`` is the
      xxh3-128 of (identity key, kind, token ids). Files in ``data_dir`` that do not start with
      ``oc-`` are never touched.
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
    free-space floor on the data file system. When over, entries go in ascending *value*:
    ``(hits + 1) * n_tokens / bytes * 0.5 ** days_unused``. The budget is checked *before* the server
    writes: a tier reserves :meth:`Store.estimate_bytes` (a line through the sizes of every file
    measured so far: entries, the ``n_written`` of each save, and files the commit refused) and
    the reservation makes room by eviction or raises BudgetError, so nothing is written to be thrown
    away once a size is known; :meth:`Store.commit` checks the real size again. Deletions are
    logged as one summary line per operation with its reason (``store: deleted 6 entries (...):
    unused for longer than the TTL``), each entry at DEBUG.

Every method is synchronous and thread-safe (a re-entrant lock); hashing large files should be run
off the event loop by async callers (``asyncio.to_thread``).
"""

from __future__ import annotations

import base64
import contextlib
import errno
import fcntl
import json
import logging
import os
import secrets
import shutil
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import xxhash

log = logging.getLogger(__name__)

STORE_VERSION = 1
PREFIX = "oc-"
TMP_PREFIX = "oc-tmp-"
CKPT_SUFFIX = ".ckpt"
SIDECAR_TMP_SUFFIX = ".tmp"   # the patched server's own temp name for a sidecar being written
CHUNK = 4 << 20

#: Slot file header (docs/llama-server.md §6, include/llama.h:43-49): u32 magic 'ggsq', u32 version, u32 n_words,
#: then the packed server_tokens [-1, 1, n_tokens, tokens...] for a text-only slot.
SLOT_MAGIC = 0x67677371
TOKENS_OFFSET = 24

DAY_S = 86400.0


class StoreError(RuntimeError):
    """Base class of store errors."""


class IntegrityError(StoreError):
    """An entry failed verification (missing/short file, hash, identity or token mismatch).

    ``reason`` is a short machine-readable word (``missing``, ``size``, ``hash``, ``identity``,
    ``tokens``, ``header``) used in stats and logs.
    """

    def __init__(self, key: str, reason: str, detail: str = "") -> None:
        super().__init__(f"entry {key}: {reason}{': ' + detail if detail else ''}")
        self.key = key
        self.reason = reason


class BudgetError(StoreError):
    """The entry cannot fit: larger than the budget, or the free-space floor cannot be kept."""


class LockedError(StoreError):
    """Another process holds the store's lock (a running ocache)."""


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian int32 bytes (the slot file's own encoding)."""
    return struct.pack(f"<{len(tokens)}i", *tokens)


def tokens_from_bytes(raw: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(raw) // 4}i", raw))


def entry_key(identity: str, kind: str, tokens: Sequence[int]) -> str:
    """Content address of an entry: xxh3-128 hex (32 chars) of identity, kind and token ids."""
    h = xxhash.xxh3_128()
    h.update(identity.encode())
    h.update(b"\0" + kind.encode() + b"\0")
    h.update(token_bytes(tokens))
    return h.hexdigest()


def grid_hashes(tokens: Sequence[int], grid: int) -> list[str]:
    """Chained xxh3-64 (hex) of every full grid line of ``tokens``: ``out[k - 1]`` identifies
    ``tokens[:k * grid]``, as ``xxh3(out[k - 2] digest + the line's token bytes)``. O(n) for all
    lines together, where hashing each prefix again was O(n^2 / grid): at 131k tokens and a
    1,024-token grid 5.8 ms instead of 305 ms on the event loop (measured on a loaded 2-core
    machine, ``tests/test_store.py::test_grid_hashes_are_chained_prefix_identities`` checks the
    identities). The same chaining as vLLM's block hashes. Equal prefixes give equal chains."""
    data = token_bytes(tokens)
    step = 4 * grid
    out: list[str] = []
    prev = b""
    for end in range(step, len(data) + 1, step):
        prev = xxhash.xxh3_64_digest(prev + data[end - step:end])
        out.append(prev.hex())
    return out


def prefix_hash(tokens: Sequence[int]) -> str:
    """xxh3-64 hex of a token list (used for counting grid lines and quick index lookups)."""
    return xxhash.xxh3_64_hexdigest(token_bytes(tokens))


def file_xxh3(path: Path) -> tuple[int, str]:
    """(bytes, xxh3-64 hex) of a file, read in 4 MiB chunks. Raises OSError."""
    h = xxhash.xxh3_64()
    n = 0
    with open(path, "rb") as f:
        while True:
            buf = f.read(CHUNK)
            if not buf:
                break
            h.update(buf)
            n += len(buf)
    return n, h.hexdigest()


def read_slot_tokens(path: Path, limit: int | None = None) -> list[int]:
    """The token ids stored in a llama-server slot file, read from its header only.

    Layout (docs/llama-server.md §6; tools/server/server-common.cpp:570-590): magic, version, n_words, then
    ``-1, 1, n_tokens, token[0..n_tokens)``. Raises ValueError for a file that is not a text-only
    slot file of that layout, OSError if it cannot be read. ``limit`` caps how many ids are read.
    """
    with open(path, "rb") as f:
        head = f.read(TOKENS_OFFSET)
        if len(head) < TOKENS_OFFSET:
            raise ValueError("short header")
        magic, _version, n_words, marker, state_ver, n_tok = struct.unpack("<IIIiii", head)
        if magic != SLOT_MAGIC:
            raise ValueError(f"bad magic {magic:#x}")
        if marker != -1 or state_ver != 1:
            raise ValueError("not a packed server_tokens header (legacy or media file)")
        if n_tok < 0 or n_tok + 4 > n_words:
            raise ValueError(f"token count {n_tok} does not fit n_words {n_words}")
        n = n_tok if limit is None else min(n_tok, limit)
        raw = f.read(4 * n)
        if len(raw) != 4 * n:
            raise ValueError("short token list")
        return tokens_from_bytes(raw)


#: Checkpoint sidecar ``<file>.ckpt`` written by patches/0001 (layout: patches/README.md):
#: header ``"OCKP" u32 version u32 n_tokens u64 tokens_hash u64 state_hash u32 n_entries u32 flags
#: u64 header_hash``; each entry ``i64 n_tokens i32 pos_min i32 pos_max u64 len_tgt u64 len_dft
#: u64 len_spec`` + blobs + ``u64`` entry hash.
SIDECAR_HEADER = struct.Struct("<4sIIQQIIQ")
SIDECAR_ENTRY = struct.Struct("<qiiQQQ")


def sidecar_checkpoints(path: Path) -> list[int]:
    """``n_tokens`` of each context checkpoint in a patched server's ``<file>.ckpt`` sidecar, read
    from the headers only. [] for a missing or unreadable sidecar (the server validates every hash
    itself on restore, patches/0001)."""
    out: list[int] = []
    try:
        with open(path, "rb") as f:
            head = f.read(SIDECAR_HEADER.size)
            if len(head) < SIDECAR_HEADER.size:
                return []
            magic, _ver, _n_tok, _th, _sh, n_entries, _flags, _hh = SIDECAR_HEADER.unpack(head)
            if magic != b"OCKP":
                return []
            for _ in range(min(n_entries, 4096)):
                eh = f.read(SIDECAR_ENTRY.size)
                if len(eh) < SIDECAR_ENTRY.size:
                    return []
                n_tok, _pmin, _pmax, lt, ld, ls = SIDECAR_ENTRY.unpack(eh)
                out.append(int(n_tok))
                f.seek(lt + ld + ls + 8, 1)
    except OSError:
        return []
    return out


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write ``data`` to ``path`` atomically: a temp file in the same directory, fsync, rename, fsync dir."""
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


@dataclass
class FileInfo:
    name: str          # file name inside data_dir
    size: int          # bytes
    xxh3: str          # xxh3-64 hex of the whole file


@dataclass
class Entry:
    """One stored slot state. Times are Unix seconds; ``tokens`` may be None when not loaded."""

    key: str
    kind: str                       # "a" anchor (disk tier), "s" spilled session (session tier), "h" head
    identity: str
    fingerprint: str | None
    n_tokens: int
    files: dict[str, FileInfo]      # role ("bin", "ckpt") -> file
    created: float
    last_used: float
    hits: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    tokens: list[int] | None = None

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    @property
    def bin_name(self) -> str:
        return self.files["bin"].name

    def value(self, now: float) -> float:
        """Eviction value (docs/architecture.md §3): (hits + 1) × tokens saved per byte, halved per day unused."""
        days = max(0.0, now - self.last_used) / DAY_S
        return (self.hits + 1) * self.n_tokens / max(1, self.bytes) * 0.5 ** days

    def summary(self) -> dict:
        d = {
            "key": self.key, "kind": self.kind, "identity": self.identity,
            "fingerprint": self.fingerprint, "n_tokens": self.n_tokens,
            "files": {r: vars(f) for r, f in self.files.items()},
            "created": self.created, "last_used": self.last_used, "hits": self.hits,
            "meta": self.meta,
        }
        return d

    def record(self, tokens: Sequence[int]) -> dict:
        """The per-entry record (summary + the token ids, base64 of int32 LE, and their xxh3)."""
        d = self.summary()
        d["version"] = STORE_VERSION
        d["tokens_b64"] = base64.b64encode(token_bytes(tokens)).decode()
        d["tokens_xxh3"] = prefix_hash(tokens)
        return d

    @classmethod
    def from_dict(cls, d: dict, with_tokens: bool) -> "Entry":
        files = {r: FileInfo(str(f["name"]), int(f["size"]), str(f["xxh3"])) for r, f in d["files"].items()}
        for f in files.values():
            if not f.name.startswith(PREFIX) or "/" in f.name or f.name.startswith(TMP_PREFIX):
                raise ValueError(f"bad file name {f.name!r}")
        if "bin" not in files:
            raise ValueError("no bin file")
        tokens = None
        if with_tokens:
            tokens = tokens_from_bytes(base64.b64decode(d["tokens_b64"]))
            if len(tokens) != int(d["n_tokens"]) or prefix_hash(tokens) != d["tokens_xxh3"]:
                raise ValueError("token list does not match its count/hash")
        return cls(key=str(d["key"]), kind=str(d["kind"]), identity=str(d["identity"]),
                   fingerprint=d.get("fingerprint"), n_tokens=int(d["n_tokens"]), files=files,
                   created=float(d["created"]), last_used=float(d["last_used"]),
                   hits=int(d.get("hits", 0)), meta=dict(d.get("meta") or {}), tokens=tokens)


@dataclass
class OpenReport:
    """What :meth:`Store.open` found and did (counts), for logs and ``ocache cache ls``."""

    index: str = "ok"            # ok | missing | corrupt | stale  (the last three mean: rebuilt)
    entries: int = 0
    other_identity: int = 0      # entries of other identities, kept (served when theirs is current)
    bad_records: int = 0         # unreadable records removed with their files
    orphans: int = 0             # data/temp files without a record removed
    orphan_bytes: int = 0

    def __str__(self) -> str:
        """For log lines: ``3 entries (index ok)``, plus what was removed, when anything was."""
        text = f"{self.entries} entries (index {self.index})"
        if self.other_identity:
            text += f", {self.other_identity} of other models/flags kept"
        done = [f"{n} {what}" for n, what in (
                                               (self.bad_records, "unreadable records removed"),
                                               (self.orphans, f"orphan files removed ({self.orphan_bytes} bytes)"))
                if n]
        return text + ("; " + ", ".join(done) if done else "")


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
    ``clock``: Unix time source (tests pass a fake one).
    """

    def __init__(self, meta_dir: Path, data_dir: Path, identity: str | None, *,
                 budget_bytes: int = 50 * 10**9, kind_budgets: dict[str, int] | None = None,
                 ttl_s: float = 7 * DAY_S,
                 free_floor_bytes: int = 0, lock: bool = True,
                 clock: Callable[[], float] = time.time) -> None:
        self.meta_dir = Path(meta_dir)
        self.data_dir = Path(data_dir)
        self.identity = identity
        self.budget_bytes = int(budget_bytes)
        self.kind_budgets = {k: int(v) for k, v in (kind_budgets or {}).items()}
        self.ttl_s = float(ttl_s)
        self.free_floor_bytes = int(free_floor_bytes)
        self.clock = clock
        self._lock = threading.RLock()
        self._entries: dict[str, Entry] = {}
        self._reserved: dict[str, tuple[str | None, int]] = {}  # key -> (kind, bytes)
        self._sizes: list[tuple[int, int]] = []  # (tokens, bytes) of files commit measured
        self._tok_cache: OrderedDict[str, bytes] = OrderedDict()
        self._lock_fd: int | None = None
        self._want_lock = lock
        self.report = OpenReport()
        self.counters: dict[str, int] = {"evicted": 0, "evicted_bytes": 0, "expired": 0,
                                         "verify_failed": 0, "committed": 0, "commit_failed": 0,
                                         "identity_switches": 0}

    # ------------------------------------------------------------------ paths
    @property
    def records_dir(self) -> Path:
        return self.meta_dir / "records"

    @property
    def index_path(self) -> Path:
        return self.meta_dir / "index.json"

    def record_path(self, key: str) -> Path:
        return self.records_dir / f"{key}.json"

    @staticmethod
    def final_name(kind: str, key: str) -> str:
        return f"{PREFIX}{kind}-{key}.bin"

    @staticmethod
    def temp_name(kind: str, key: str) -> str:
        """A fresh temporary file name (no directory) for the server's ``action=save``."""
        return f"{TMP_PREFIX}{kind}-{key}-{secrets.token_hex(4)}.bin"

    def path(self, name: str) -> Path:
        if "/" in name or not name.startswith(PREFIX):
            raise ValueError(f"not a store file name: {name!r}")
        return self.data_dir / name

    # ------------------------------------------------------------------ open / index
    def open(self, readonly: bool = False) -> OpenReport:
        """Create the directories (0700), take the lock, load or rebuild the index, sweep.

        Start-up deletions are decided from records and files only: records that cannot be parsed
        (with their key-named files) and ``oc-`` files that no record claims (a write killed part
        way). Entries of other identities are kept. Returns the :class:`OpenReport`.
        Raises LockedError if another process holds the lock. ``readonly``: no lock, no write and
        no deletion (``ocache cache ls`` next to a running ocache): the index is loaded or rebuilt in
        memory only.
        """
        if readonly:
            with self._lock:
                if not self.records_dir.is_dir():
                    raise StoreError(f"no store at {self.meta_dir}")
                rep = OpenReport(index=self._load_index())
                if rep.index != "ok":
                    self._entries = {}
                    for p in sorted(self.records_dir.glob("*.json")):
                        try:
                            e = Entry.from_dict(json.loads(p.read_bytes()), with_tokens=False)
                            self._entries[e.key] = e
                        except (ValueError, KeyError, TypeError, OSError):
                            rep.bad_records += 1
                rep.entries = len(self._entries)
                self.report = rep
                return rep
        with self._lock:
            for d in (self.meta_dir, self.records_dir):
                d.mkdir(parents=True, exist_ok=True, mode=0o700)
                os.chmod(d, 0o700)
            self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            st_data = self.data_dir.stat()
            if st_data.st_mode & 0o077:
                if st_data.st_uid == os.getuid():
                    os.chmod(self.data_dir, 0o700)  # slot files hold KV state of private prompts
                else:
                    log.warning("store: %s is readable by others and not ours to chmod", self.data_dir)
            if self._want_lock and self._lock_fd is None:
                fd = os.open(self.meta_dir / "lock", os.O_RDWR | os.O_CREAT, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError as exc:
                    os.close(fd)
                    if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                        raise LockedError(f"store {self.meta_dir} is in use by another process") from exc
                    raise
                self._lock_fd = fd
            atomic_write(self.meta_dir / "store.json",
                         json.dumps({"version": STORE_VERSION, "data_dir": str(self.data_dir.resolve())}).encode())
            for d in (self.meta_dir, self.records_dir):  # temp files of an interrupted atomic_write
                for p in d.glob(".*.tmp-*"):
                    with contextlib.suppress(OSError):
                        p.unlink()
            rep = OpenReport()
            rep.index = self._load_index()
            if rep.index != "ok":
                rep.bad_records = self._rebuild()
            if self.identity is not None:
                rep.other_identity = sum(1 for e in self._entries.values() if e.identity != self.identity)
            rep.orphans, rep.orphan_bytes = self._remove_orphans()
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
            self._sizes.clear()  # another model or KV layout: old sizes say nothing
            self.counters["identity_switches"] += 1
            return mine

    def _summary(self, gone: list, reason: str) -> None:
        """One log line for a batch of deletions."""
        gone = [e for e in gone if e is not None]
        if gone:
            log.info("store: deleted %d entr%s (%d tokens, %d bytes): %s", len(gone),
                     "y" if len(gone) == 1 else "ies", sum(e.n_tokens for e in gone),
                     sum(e.bytes for e in gone), reason)

    def close(self) -> None:
        with self._lock:
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None

    def _record_keys(self) -> set[str]:
        return {p.stem for p in self.records_dir.glob("*.json")}

    def _load_index(self) -> str:
        """Load index.json if present, checksummed and consistent with the record files."""
        try:
            raw = self.index_path.read_bytes()
        except FileNotFoundError:
            return "missing"
        try:
            doc = json.loads(raw)
            body = json.dumps(doc["entries"], sort_keys=True, separators=(",", ":")).encode()
            if doc.get("version") != STORE_VERSION or doc.get("checksum") != xxhash.xxh3_64_hexdigest(body):
                return "corrupt"
            entries = {k: Entry.from_dict(v, with_tokens=False) for k, v in doc["entries"].items()}
            if any(k != e.key for k, e in entries.items()):
                return "corrupt"
        except (ValueError, KeyError, TypeError, AttributeError):
            return "corrupt"
        if set(entries) != self._record_keys():
            return "stale"
        self._entries = entries
        return "ok"

    def _rebuild(self) -> int:
        """Rebuild the in-memory index from the record files; unreadable records are deleted
        together with the data files their key names. Returns how many were unreadable."""
        self._entries = {}
        bad = 0
        last = ""
        for p in sorted(self.records_dir.glob("*.json")):
            try:
                e = Entry.from_dict(json.loads(p.read_bytes()), with_tokens=True)
                if e.key != p.stem:
                    raise ValueError("record key does not match its file name")
                e.tokens = None  # checked here; loaded again on demand (Store.tokens)
                self._entries[e.key] = e
            except (ValueError, KeyError, TypeError, AttributeError, OSError) as exc:
                log.debug("store: unreadable record %s (%s): removing it and its files", p.name, exc)
                last = f"{p.name}: {exc}"
                bad += 1
                key = p.stem
                for f in self.data_dir.glob(f"{PREFIX}*-{key}.bin*"):
                    with contextlib.suppress(OSError):
                        f.unlink()
                with contextlib.suppress(OSError):
                    p.unlink()
        if bad:
            log.warning("store: deleted %d unreadable record(s) and their files (last: %s)", bad, last)
        return bad

    def _remove_orphans(self) -> tuple[int, int]:
        claimed = {f.name for e in self._entries.values() for f in e.files.values()}
        n = nbytes = 0
        for p in self.data_dir.iterdir():
            name = p.name
            if not name.startswith(PREFIX) or name in claimed or not p.is_file():
                continue
            # temp files of a reservation still in flight in this process are not orphans
            if any(f"-{k}-" in name for k in self._reserved):
                continue
            with contextlib.suppress(OSError):
                nbytes += p.stat().st_size
                p.unlink()
                n += 1
        if n:
            log.warning("store: removed %d orphan files (%d bytes) no record claims", n, nbytes)
        return n, nbytes

    def _write_index(self) -> None:
        entries = {k: e.summary() for k, e in self._entries.items()}
        body = json.dumps(entries, sort_keys=True, separators=(",", ":")).encode()
        doc = {"version": STORE_VERSION, "checksum": xxhash.xxh3_64_hexdigest(body), "entries": entries}
        atomic_write(self.index_path, json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())

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
                self._tok_cache.move_to_end(key)
                return tokens_from_bytes(cached)
            try:
                full = Entry.from_dict(json.loads(self.record_path(key).read_bytes()), with_tokens=True)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                e = self._entries.get(key)
                self._delete_locked(key, f"record unreadable: {exc}")
                self._summary([e], f"record unreadable: {exc}")
                self.counters["verify_failed"] += 1
                raise IntegrityError(key, "record", str(exc)) from exc
            self._cache_tokens(key, full.tokens)
            return full.tokens

    def _cache_tokens(self, key: str, tokens: Sequence[int]) -> None:
        """Keep a few entries' token ids (as int32 bytes: 4 bytes a token) in memory."""
        self._tok_cache[key] = token_bytes(tokens)
        self._tok_cache.move_to_end(key)
        while len(self._tok_cache) > 64:
            self._tok_cache.popitem(last=False)

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
            for role, f in e.files.items():
                p = self.path(f.name)
                try:
                    if server_hash and role == "bin":
                        size, digest = p.stat().st_size, f.xxh3
                    else:
                        size, digest = file_xxh3(p)
                except FileNotFoundError as exc:
                    raise IntegrityError(key, "missing", f.name) from exc
                if size != f.size:
                    raise IntegrityError(key, "size", f"{f.name}: {size} != {f.size}")
                if digest != f.xxh3:
                    raise IntegrityError(key, "hash", f.name)
            try:
                head = read_slot_tokens(self.path(e.bin_name))
            except ValueError as exc:
                raise IntegrityError(key, "header", str(exc)) from exc
            if head != toks:
                raise IntegrityError(key, "tokens", "slot file header differs from the record")
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
        """Record the bytes a saved slot state of ``n_tokens`` tokens took (``.bin`` + ``.ckpt``), for
        :meth:`estimate_bytes`. Called by :meth:`commit` for every file it sees, kept or not."""
        if n_tokens > 0 and nbytes > 0:
            with self._lock:
                self._sizes.append((int(n_tokens), int(nbytes)))
                del self._sizes[:-64]

    def estimate_bytes(self, n_tokens: int) -> int | None:
        """Estimated bytes of a slot state of ``n_tokens`` tokens before it is written, or None when
        nothing of this identity was ever measured (then the first write measures it).

        A slot file is a fixed part (header, recurrent state of a hybrid model, the sidecar's
        checkpoints) plus the KV cache of each token (llama_state_seq_save_file, docs/llama-server.md §6), so the
        estimate is the least-squares line ``a + b * n_tokens`` (a, b >= 0) through the sizes of this
        identity's entries and of the files :meth:`commit` measured (also the ones it refused); one
        point gives ``b = bytes / tokens``. The slot files of one identity share one KV layout, so
        anchors, spills and heads inform each other. The commit still checks the real size.
        """
        with self._lock:
            pts = [(e.n_tokens, e.bytes) for e in self._entries.values()
                   if e.n_tokens > 0 and (self.identity is None or e.identity == self.identity)]
            pts += self._sizes
        if not pts:
            return None
        ns = {n for n, _ in pts}
        if len(ns) == 1:
            n0 = next(iter(ns))
            per = max(b for n, b in pts) / n0
            return int(per * n_tokens)
        k = len(pts)
        mx = sum(n for n, _ in pts) / k
        my = sum(b for _, b in pts) / k
        sxx = sum((n - mx) ** 2 for n, _ in pts)
        slope = max(0.0, sum((n - mx) * (b - my) for n, b in pts) / sxx)
        icept = max(0.0, my - slope * mx)
        return int(icept + slope * n_tokens)

    def _free_bytes(self) -> int:
        return shutil.disk_usage(self.data_dir).free

    def _make_room(self, nbytes: int, kind: str | None = None, exclude: Iterable[str] = ()) -> None:
        """Evict by ascending value until ``nbytes`` more fit the total budget, ``kind``'s budget and
        the free-space floor. Raises BudgetError, before evicting anything, when they cannot."""
        excl = set(exclude)
        now = self.clock()
        victims = sorted((e for e in self._entries.values() if e.key not in excl),
                         key=lambda e: e.value(now))
        kb = self.kind_budgets.get(kind) if kind is not None else None
        # feasibility first: never evict anything for an entry that cannot fit anyway
        evictable = sum(v.bytes for v in victims)
        if self.used_bytes() - evictable + nbytes > self.budget_bytes:
            raise BudgetError(f"{nbytes} bytes cannot fit the budget of {self.budget_bytes}")
        if kb is not None and self.kind_bytes(kind) - sum(v.bytes for v in victims if v.kind == kind) + nbytes > kb:
            raise BudgetError(f"{nbytes} bytes cannot fit the {kind!r} budget of {kb}")
        if self.free_floor_bytes and self._free_bytes() + evictable - nbytes < self.free_floor_bytes:
            raise BudgetError(f"{nbytes} bytes would break the free-space floor of {self.free_floor_bytes}")
        gone: list[Entry] = []
        try:
            while True:
                over_kind = kb is not None and self.kind_bytes(kind) + nbytes > kb
                over_budget = self.used_bytes() + nbytes > self.budget_bytes
                under_floor = bool(self.free_floor_bytes) and self._free_bytes() - nbytes < self.free_floor_bytes
                if not (over_kind or over_budget or under_floor):
                    return
                pool = [v for v in victims if v.kind == kind] if over_kind and not (over_budget or under_floor) else victims
                if not pool:
                    raise BudgetError(f"cannot make room for {nbytes} bytes")
                v = pool[0]
                victims.remove(v)
                self.counters["evicted"] += 1
                self.counters["evicted_bytes"] += v.bytes
                self._delete_locked(v.key, "evicted")
                gone.append(v)
        finally:
            self._summary(gone, f"evicted by value to make room for {nbytes} bytes"
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
            head = read_slot_tokens(tmp_bin)
            if head != list(tokens):
                raise ValueError(f"slot file holds {len(head)} tokens that differ from the {len(tokens)} expected")
            files: dict[str, FileInfo] = {}
            for role, src, name in (("bin", tmp_bin, final), ("ckpt", tmp_ckpt, final + CKPT_SUFFIX)):
                if not src.exists():
                    continue
                _fsync_file(src)
                os.chmod(src, 0o600)
                size, digest = file_xxh3(src)
                files[role] = FileInfo(name, size, digest)
            nbytes = sum(f.size for f in files.values())
            now = self.clock()
            with self._lock:
                self.note_size(len(tokens), nbytes)  # also when it does not fit: the next is refused early
                self._reserved.pop(key, None)
                old = self._entries.get(key)
                self._make_room(nbytes - (old.bytes if old else 0), kind, exclude={key})
                if old is not None:
                    stale = {f.name for f in old.files.values()} - {f.name for f in files.values()}
                    for name in stale:
                        with contextlib.suppress(OSError):
                            self.path(name).unlink()
                if "ckpt" not in files:
                    with contextlib.suppress(FileNotFoundError):
                        self.path(final + CKPT_SUFFIX).unlink()
                else:
                    os.replace(tmp_ckpt, self.path(files["ckpt"].name))
                os.replace(tmp_bin, self.path(final))
                _fsync_dir(self.data_dir)
                e = Entry(key=key, kind=kind, identity=self.identity, fingerprint=fingerprint,
                          n_tokens=len(tokens), files=files, created=now, last_used=now,
                          hits=old.hits if old else 0, meta=dict(meta or {}))
                atomic_write(self.record_path(key), json.dumps(e.record(tokens)).encode())
                self._cache_tokens(key, tokens)
                self._entries[key] = e
                self._write_index()
                self.counters["committed"] += 1
                return e
        except BaseException:
            self.counters["commit_failed"] += 1
            self.release(key)
            self.discard_temp(temp_bin)
            raise

    def discard_temp(self, temp_bin: str) -> None:
        """Remove a temp slot file that will not be committed, with its sidecar and the sidecar's own
        temporary file: the patched server writes ``<file>.ckpt.tmp`` and renames it
        (patches/0001-slot-checkpoint-sidecar.patch, ``server_ckpt_sidecar_save``), so a server killed
        during that write leaves it behind. Any file type is removed (``unlink``)."""
        for name in (temp_bin, temp_bin + CKPT_SUFFIX, temp_bin + CKPT_SUFFIX + SIDECAR_TMP_SUFFIX):
            with contextlib.suppress(OSError, ValueError):
                self.path(name).unlink()

    # ------------------------------------------------------------------ use / delete / gc
    def touch(self, key: str, hit: bool = True) -> None:
        """Record a use (last_used = now; hits += 1 if ``hit``), in the record and the index."""
        with self._lock:
            e = self._entries.get(key)
            if e is None:
                return
            e.last_used = self.clock()
            if hit:
                e.hits += 1
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
                self._summary([e], reason or "deleted")
                self._write_index()
            return found

    def _delete_locked(self, key: str, reason: str) -> bool:
        e = self._entries.pop(key, None)
        self._tok_cache.pop(key, None)
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

    def gc(self) -> dict:
        """Remove entries unused for longer than the TTL, then evict by value down to the budget and
        the free-space floor. Returns {"expired": n, "evicted": n, "bytes": freed}."""
        with self._lock:
            now = self.clock()
            before = self.used_bytes()
            expired = [e for e in self._entries.values() if now - e.last_used > self.ttl_s]
            for e in expired:
                self._delete_locked(e.key, "ttl")
            self._summary(expired, f"unused for longer than the TTL ({self.ttl_s / DAY_S:g} days)")
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
        """Free at least ``bytes_needed`` bytes by value (lowest first). Returns bytes freed."""
        with self._lock:
            now = self.clock()
            freed = 0
            gone: list[Entry] = []
            for e in sorted(self._entries.values(), key=lambda e: e.value(now)):
                if freed >= bytes_needed:
                    break
                freed += e.bytes
                self.counters["evicted"] += 1
                self.counters["evicted_bytes"] += e.bytes
                self._delete_locked(e.key, "evicted")
                gone.append(e)
            self._summary(gone, f"evicted by value to free {bytes_needed} bytes")
            self._write_index()
            return freed

    def clear(self, kind: str | None = None) -> int:
        """Delete every entry (of ``kind`` if given). Returns how many."""
        with self._lock:
            gone = [e for e in self._entries.values() if kind is None or e.kind == kind]
            for e in gone:
                self._delete_locked(e.key, "clear")
            self._summary(gone, "cleared" + (f" (kind {kind!r})" if kind else ""))
            self._write_index()
            return len(gone)

    def stats(self) -> dict:
        """Counts and bytes; ``by_kind``: ``{kind: {"entries", "bytes", "hits"}}`` (bytes of the
        committed files, without reservations); ``by_folder``: the same per (project folder,
        client, model) of the entries' meta (None where not recorded), largest first, with the
        latest ``last_used``; ``next_eviction``: the entry :meth:`evict` would remove first
        (lowest value), or None."""
        with self._lock:
            now = self.clock()
            by_kind: dict[str, dict[str, int]] = {}
            by_folder: dict[tuple, dict[str, Any]] = {}
            for e in self._entries.values():
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
            low = min(self._entries.values(), key=lambda e: e.value(now), default=None)
            nxt = None if low is None else {
                "key": low.key[:16], "kind": low.kind, "n_tokens": low.n_tokens, "bytes": low.bytes,
                "hits": low.hits, "idle_s": round(max(0.0, now - low.last_used), 1),
                "meta": {k: v for k, v in low.meta.items() if k != "checkpoints"}}
            return {"entries": len(self._entries), "bytes": self.used_bytes(),
                    "budget_bytes": self.budget_bytes, "index": self.report.index, **self.counters,
                    "by_kind": by_kind, "next_eviction": nxt,
                    "by_folder": sorted(by_folder.values(), key=lambda f: -f["bytes"])}


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


def data_dir_of(meta_dir: Path) -> Path | None:
    """The data directory a store in ``meta_dir`` recorded (``store.json``), or None."""
    try:
        return Path(json.loads((Path(meta_dir) / "store.json").read_text())["data_dir"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


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
