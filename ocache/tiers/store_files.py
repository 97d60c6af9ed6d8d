"""The store's own files (``ocache.tiers.store``): the names of its data files, the directories
and their modes, the one-writer lock, the records, the checksummed index, ``store.json``, atomic
writes, the registry of the stores sharing one data directory, and the start-up sweep of orphan
data files.

Layout of ``meta_dir`` (mode 0700): ``records/<key>.json`` (one record per entry, the source of
truth, ``ocache.tiers.entry``), ``index.json`` (``{"version", "checksum", "entries"}``: the entries'
summaries and the xxh3-64 of their canonical JSON, for a fast start), ``store.json`` (``{"version",
"data_dir"}``: where the data files live, for the offline ``ocache cache`` commands) and ``lock``
(an exclusive ``flock``). Every write is atomic (:func:`atomic_write`). Nothing here decides a
deletion from the index: the records and the files themselves do (:func:`read_records`,
:func:`remove_orphans`).

One data directory (a llama-server ``--slot-save-path``) can serve several stores: two ``ocache
serve`` with their own ``cache_dir`` in front of one server, or a test next to a running instance.
Every name a store gives a data file carries its *tag* (:func:`store_tag`, from its meta directory):
``oc-<kind>-<tag>-<key>.bin``, ``oc-tmp-<kind>-<tag>-<key>-<hex>.bin``. Each store registers its
tag and meta directory in ``data_dir/.ocache-stores/<tag>.json`` (:func:`register`). A store's
sweep deletes a file no record of its own claims only when the name proves it its own (its tag) or
the registry proves nobody else's: a tag whose registered meta directory is gone, or an untagged
(older) name while no other store is registered (:func:`remove_orphans`). Before, a second
store's open removed a running store's slot files as orphans.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

import xxhash

from ocache.tiers.entry import PREFIX, STORE_VERSION, TMP_PREFIX, Entry, LockedError

log = logging.getLogger("ocache.tiers.store")

CKPT_SUFFIX = ".ckpt"
SIDECAR_TMP_SUFFIX = ".tmp"   # the patched server's own temp name for a sidecar being written


REGISTRY_DIR = ".ocache-stores"   # in data_dir; not an ``oc-`` name, so no sweep ever touches it
_TAGGED = re.compile(r"^oc-(?:tmp-)?[^-]+-(s[0-9a-f]{8})-")


def store_tag(meta_dir: Path) -> str:
    """The tag of the store in ``meta_dir``: ``s`` + 8 hex digits of the xxh3-64 of its resolved
    path (the ``s`` keeps it apart from a hex key)."""
    return "s" + xxhash.xxh3_64_hexdigest(str(Path(meta_dir).resolve()).encode())[:8]


def tag_of(name: str) -> str | None:
    """The store tag in a data file name, or None for an untagged (older) name."""
    m = _TAGGED.match(name)
    return m.group(1) if m else None


def final_name(kind: str, key: str, tag: str) -> str:
    """The data file name of an entry's ``.bin`` (its sidecar: + ``CKPT_SUFFIX``)."""
    return f"{PREFIX}{kind}-{tag}-{key}.bin"


def temp_name(kind: str, key: str, tag: str) -> str:
    """A fresh temporary file name (no directory) for the server's ``action=save``."""
    return f"{TMP_PREFIX}{kind}-{tag}-{key}-{secrets.token_hex(4)}.bin"


def temp_files(temp_bin: str) -> tuple[str, str, str]:
    """Every file a save to ``temp_bin`` can leave: the slot file, its sidecar, and the sidecar's own
    temporary file: the patched server writes ``<file>.ckpt.tmp`` and renames it
    (patches/0001-slot-checkpoint-sidecar.patch, ``server_ckpt_sidecar_save``), so a server killed
    during that write leaves it behind."""
    return temp_bin, temp_bin + CKPT_SUFFIX, temp_bin + CKPT_SUFFIX + SIDECAR_TMP_SUFFIX


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
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
    fsync_dir(path.parent)


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


def prepare_dirs(meta_dir: Path, records_dir: Path, data_dir: Path) -> None:
    """Create the directories; ``meta_dir`` and ``records_dir`` mode 0700, and ``data_dir`` 0700 when
    ours (slot files hold KV state of private prompts), else a warning when others can read it.
    Raises OSError."""
    for d in (meta_dir, records_dir):
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(d, 0o700)
    data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    st_data = data_dir.stat()
    if st_data.st_mode & 0o077:
        if st_data.st_uid == os.getuid():
            os.chmod(data_dir, 0o700)
        else:
            log.warning("store: %s is readable by others and not ours to chmod", data_dir)


def take_lock(meta_dir: Path) -> int:
    """An exclusive, non-blocking ``flock`` on ``meta_dir/lock``; returns its file descriptor (held
    until closed). Raises LockedError when another process holds it, an OSError when the file
    cannot be opened."""
    fd = os.open(meta_dir / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise LockedError(f"store {meta_dir} is in use by another process") from exc
        raise
    return fd


def write_store_json(meta_dir: Path, data_dir: Path) -> None:
    atomic_write(meta_dir / "store.json",
                 json.dumps({"version": STORE_VERSION, "data_dir": str(data_dir.resolve())}).encode())


def data_dir_of(meta_dir: Path) -> Path | None:
    """The data directory a store in ``meta_dir`` recorded (``store.json``), or None."""
    try:
        return Path(json.loads((Path(meta_dir) / "store.json").read_text())["data_dir"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def sweep_atomic_temps(dirs: Iterable[Path]) -> None:
    """Remove the temp files of an interrupted :func:`atomic_write` (``.<name>.tmp-<hex>``)."""
    for d in dirs:
        for p in d.glob(".*.tmp-*"):
            with contextlib.suppress(OSError):
                p.unlink()


def record_keys(records_dir: Path) -> set[str]:
    return {p.stem for p in records_dir.glob("*.json")}


def load_index(index_path: Path, keys: set[str]) -> tuple[str, dict[str, Entry]]:
    """Read ``index.json``: ``("ok", entries)`` when present, of this version, its checksum right
    and its key set equal to ``keys`` (the record files'); else ``("missing" | "corrupt" |
    "stale", {})`` and the caller rebuilds from the records."""
    try:
        raw = index_path.read_bytes()
    except FileNotFoundError:
        return "missing", {}
    try:
        doc = json.loads(raw)
        body = json.dumps(doc["entries"], sort_keys=True, separators=(",", ":")).encode()
        if doc.get("version") != STORE_VERSION or doc.get("checksum") != xxhash.xxh3_64_hexdigest(body):
            return "corrupt", {}
        entries = {k: Entry.from_dict(v, with_tokens=False) for k, v in doc["entries"].items()}
        if any(k != e.key for k, e in entries.items()):
            return "corrupt", {}
    except (ValueError, KeyError, TypeError, AttributeError):
        return "corrupt", {}
    if set(entries) != keys:
        return "stale", {}
    return "ok", entries


def write_index(index_path: Path, entries: Mapping[str, Entry]) -> None:
    summaries = {k: e.summary() for k, e in entries.items()}
    body = json.dumps(summaries, sort_keys=True, separators=(",", ":")).encode()
    doc = {"version": STORE_VERSION, "checksum": xxhash.xxh3_64_hexdigest(body), "entries": summaries}
    atomic_write(index_path, json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())


def read_records(records_dir: Path, data_dir: Path | None, tag: str = "") -> tuple[dict[str, Entry], int]:
    """Every record of ``records_dir``, in file name order, parsed and its token list checked
    against its count and hash (then dropped: loaded again on demand). Returns ``(entries by key,
    how many were unreadable)``. With ``data_dir`` an unreadable record is deleted together with the
    data files its key names (``oc-*-<key>.bin*``) that are this store's (tagged ``tag``, or untagged);
    with None (read-only) nothing is deleted."""
    entries: dict[str, Entry] = {}
    bad = 0
    last = ""
    for p in sorted(records_dir.glob("*.json")):
        try:
            e = Entry.from_dict(json.loads(p.read_bytes()), with_tokens=data_dir is not None)
            if data_dir is not None and e.key != p.stem:
                raise ValueError("record key does not match its file name")
            e.tokens = None  # checked here; loaded again on demand (Store.tokens)
            entries[e.key] = e
        except (ValueError, KeyError, TypeError, AttributeError, OSError) as exc:
            bad += 1
            if data_dir is None:
                continue
            log.debug("store: unreadable record %s (%s): removing it and its files", p.name, exc)
            last = f"{p.name}: {exc}"
            for f in data_dir.glob(f"{PREFIX}*-{p.stem}.bin*"):
                if tag_of(f.name) not in (tag, None):
                    continue
                with contextlib.suppress(OSError):
                    f.unlink()
            with contextlib.suppress(OSError):
                p.unlink()
    if bad and data_dir is not None:
        log.warning("store: deleted %d unreadable record(s) and their files (last: %s)", bad, last)
    return entries, bad


def register(data_dir: Path, tag: str, meta_dir: Path) -> None:
    """Record in ``data_dir``'s registry that the store ``tag`` lives in ``meta_dir``. Raises OSError."""
    reg = data_dir / REGISTRY_DIR
    reg.mkdir(exist_ok=True, mode=0o700)
    atomic_write(reg / f"{tag}.json", json.dumps({"meta_dir": str(Path(meta_dir).resolve())}).encode())


def registered(data_dir: Path) -> dict[str, Path | None] | None:
    """The registry of ``data_dir``: ``{tag: meta_dir}`` (None for an entry that cannot be read: it is
    taken as alive), or None when the registry itself cannot be listed (then nothing but a store's
    own tagged files may be deleted)."""
    reg = data_dir / REGISTRY_DIR
    try:
        paths = list(reg.glob("s*.json"))
    except OSError:
        return None
    out: dict[str, Path | None] = {}
    for p in paths:
        try:
            out[p.stem] = Path(json.loads(p.read_bytes())["meta_dir"])
        except (OSError, ValueError, KeyError, TypeError):
            out[p.stem] = None
    return out


def _gone(meta_dir: Path | None) -> bool:
    """Whether a registered store no longer exists (its meta directory has no ``records``)."""
    if meta_dir is None:
        return False
    try:
        return not (meta_dir / "records").is_dir()
    except OSError:
        return False


def remove_orphans(data_dir: Path, claimed: set[str], in_flight: Iterable[str], tag: str) -> tuple[int, int]:
    """Delete the ``oc-`` files of ``data_dir`` that no record of this store (``claimed``) claims and
    that are provably orphans: this store's own tag (a write killed part way), a tag whose registered
    store is gone, or an untagged name while no other live store is registered (a registry that cannot
    be read counts as one).
    The temp files of a reservation still in flight in this process (their name holds ``-<key>-`` of a
    key in ``in_flight``) are kept. Registry entries of gone stores are removed after their files.
    Returns ``(files, bytes)`` removed."""
    keys = list(in_flight)
    reg = registered(data_dir)
    others = {} if reg is None else {t: m for t, m in reg.items() if t != tag}
    gone = {t for t, m in others.items() if _gone(m)}
    live_others = reg is None or bool(set(others) - gone)
    n = nbytes = 0
    for p in data_dir.iterdir():
        name = p.name
        if not name.startswith(PREFIX) or name in claimed or not p.is_file():
            continue
        if any(f"-{k}-" in name for k in keys):
            continue
        owner = tag_of(name)
        if owner is None:
            mine = not live_others
        else:
            mine = owner == tag or owner in gone
        if not mine:
            continue
        with contextlib.suppress(OSError):
            nbytes += p.stat().st_size
            p.unlink()
            n += 1
    for t in gone:
        with contextlib.suppress(OSError):
            (data_dir / REGISTRY_DIR / f"{t}.json").unlink()
    if n:
        log.warning("store: removed %d orphan files (%d bytes) no record claims", n, nbytes)
    return n, nbytes
