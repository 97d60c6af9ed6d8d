"""The store's record codec: one stored slot state (:class:`Entry`, its files :class:`FileInfo`),
its content address, and the per-entry record ``records/<key>.json`` it is written as (the
store's source of truth, ``ocache/tiers/store.py``); and the store's errors.

A record is JSON: the :meth:`Entry.summary` fields plus ``version`` (``STORE_VERSION``), the token
ids as base64 of int32 LE (``tokens_b64``) and their xxh3-64 (``tokens_xxh3``). File names in a
record must start with ``oc-`` (never ``oc-tmp-``) and hold no ``/``: a record cannot name a file
ocache does not own.
"""

from __future__ import annotations

import base64
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

import xxhash

from ocache.tiers.slotfile import token_bytes, tokens_from_bytes

STORE_VERSION = 1
PREFIX = "oc-"
TMP_PREFIX = "oc-tmp-"

#: seconds in a day (the TTL's and the value rule's unit, ``ocache.tiers.evict``)
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

    def summary(self) -> dict:
        """The entry as the index stores it (every field but the token ids)."""
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
        """Parse a record (``with_tokens``: also decode and check its token ids) or an index
        summary. Raises ValueError (a file name ocache does not own, no ``.bin``, token ids that
        do not match their count or hash), KeyError or TypeError (a field missing or mistyped)."""
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




class TokenCache:
    """The token ids of the last ``size`` entries read (as int32 LE bytes, 4 bytes a token), least
    recently used out first: the store's prefix lookups compare stored ids element by element, and
    the record read and decode they would otherwise need each time costs milliseconds."""

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self._d: OrderedDict[str, bytes] = OrderedDict()

    def get(self, key: str) -> list[int] | None:
        raw = self._d.get(key)
        if raw is None:
            return None
        self._d.move_to_end(key)
        return tokens_from_bytes(raw)

    def put(self, key: str, tokens: Sequence[int]) -> None:
        self._d[key] = token_bytes(tokens)
        self._d.move_to_end(key)
        while len(self._d) > self.size:
            self._d.popitem(last=False)

    def pop(self, key: str) -> None:
        self._d.pop(key, None)
