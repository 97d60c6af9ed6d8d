"""The GGUF header, read once, one reader: the file identity the cache keys on and the model's
architecture.

GGUF layout (ggml/include/gguf.h of the pinned source): ``"GGUF" | u32 version | u64 n_tensors |
u64 n_kv | kv... | tensor infos | data``; each kv is ``u64 len | key | u32 type | value``. The
header is read whole (memory-mapped); of the tensor data a bounded sample is read at once
(``data_sample``, at most a few MiB whatever the file's size), and the whole file is digested once per
file version (``file_digest``, XXH3-128 of every byte, memoised by ``os.stat``; ``ensure_digest`` runs it
on a worker thread): the weights' part of the identity.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import mmap
import os
import struct
import threading
from dataclasses import dataclass, replace
from pathlib import Path

import xxhash

#: GGUF ``general.architecture`` values whose memory cannot be rolled back partially, so the server
#: resumes from context checkpoints (src/llama-arch.cpp ``llm_arch_is_recurrent`` :1071 and
#: ``llm_arch_is_hybrid`` :1085 of the pinned source).
CHECKPOINT_ARCHS = frozenset({
    # recurrent
    "mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7",
    # hybrid
    "jamba", "falcon-h1", "plamo2", "granitehybrid", "lfm2", "lfm2moe", "nemotron_h",
    "nemotron_h_moe", "qwen3next", "kimi-linear", "bailingmoe3", "kimi-k3", "glm5-next",
    "qwen35", "qwen35moe", "qwen4exp", "deepseek4", "minimax-01",
})

_GGUF_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # ggml/include/gguf.h:53-67
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_DEFAULT_ALIGNMENT = 32  # ggml/include/gguf.h:46

log = logging.getLogger("ocache.gguf")


class GGUFError(ValueError):
    """The file is not a readable GGUF (bad magic, truncated header, unknown value type)."""


@dataclass(frozen=True)
class GGUFIdentity:
    """Identity of a GGUF file without reading its tensor data.

    ``size`` (bytes) and ``mtime_ns`` from ``os.stat``; ``header_xxh3_128``: xxh3_128 hex of the bytes
    from offset 0 up to the end of the tensor-info section (magic, version, all metadata key/values
    including the tokenizer and the embedded chat template, every tensor's name/shape/type/offset);
    ``header_bytes``: that length; ``version``, ``n_tensors``, ``n_kv`` from the header;
    ``data_xxh3_128``: xxh3_128 hex of a sample of the tensor data (:func:`data_sample`), so a file
    rewritten with other weights under the same metadata, size and mtime (``cp -p``, ``rsync -a``,
    ``touch -r``, tar, image layers) is another identity. The path and the model alias are
    deliberately not part of it: the same file under another name is the same model, another file
    under the same name is not.

    ``file_xxh3_128``: XXH3-128 hex of every byte of the file (:func:`file_digest`), "" while it is not
    known yet (``gguf_identity(..., digest=False)`` on a file version not digested before). Then
    ``pending`` holds the file version it stands for, ``(st_dev, st_ino, st_size, st_mtime_ns,
    st_ctime_ns)``: a provisional identity that no other file version shares (any write or ``utime``
    sets ``st_ctime``, which no user call can set back), so entries stored under it are never served
    for other bytes. With the digest known ``pending`` is None and the identity no longer depends on
    the path, inode or times of the copy.
    """

    size: int
    mtime_ns: int
    header_xxh3_128: str
    header_bytes: int
    version: int
    n_tensors: int
    n_kv: int
    data_xxh3_128: str = ""
    file_xxh3_128: str = ""
    pending: tuple[int, int, int, int, int] | None = None

    def as_dict(self) -> dict:
        out = {"size": self.size, "mtime_ns": self.mtime_ns, "header_xxh3_128": self.header_xxh3_128,
               "header_bytes": self.header_bytes, "version": self.version, "n_tensors": self.n_tensors,
               "n_kv": self.n_kv, "data_xxh3_128": self.data_xxh3_128, "file_xxh3_128": self.file_xxh3_128}
        if self.pending is not None:
            out["pending"] = list(self.pending)
        return out


class _Reader:
    """Walks the GGUF header in a memory map; only offsets are computed, nothing is copied."""

    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def skip(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise GGUFError(f"truncated GGUF header at byte {self.pos}")
        self.pos += n

    def read(self, n: int) -> bytes:
        start = self.pos
        self.skip(n)
        return bytes(self.buf[start:self.pos])

    def u32(self) -> int:
        return struct.unpack("<I", self.read(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.read(8))[0]

    def string(self) -> None:
        self.skip(self.u64())

    def value(self, vtype: int) -> None:
        if vtype in _GGUF_SCALAR:
            self.skip(_GGUF_SCALAR[vtype])
        elif vtype == _GGUF_STRING:
            self.string()
        elif vtype == _GGUF_ARRAY:
            itype, n = self.u32(), self.u64()
            if itype in _GGUF_SCALAR:
                self.skip(_GGUF_SCALAR[itype] * n)
            elif itype == _GGUF_STRING:
                buf, pos, unpack = self.buf, self.pos, struct.unpack_from
                for _ in range(n):
                    if pos + 8 > len(buf):
                        raise GGUFError(f"truncated GGUF header at byte {pos}")
                    pos += 8 + unpack("<Q", buf, pos)[0]
                self.pos = pos
                if pos > len(buf):
                    raise GGUFError(f"truncated GGUF header at byte {pos}")
            else:
                for _ in range(n):
                    self.value(itype)
        else:
            raise GGUFError(f"unknown GGUF value type {vtype} at byte {self.pos}")


#: Bytes read per sampled block of tensor data, and the number of blocks spread evenly over the
#: whole data section beside each tensor's first and last block (:func:`data_sample`).
SAMPLE_BLOCK = 4096
SAMPLE_SPREAD = 1024

_gguf_cache: dict[tuple[str, int, int, int, int], GGUFIdentity] = {}

#: Bytes per read of :func:`file_digest` (8 MiB).
DIGEST_READ = 8 << 20
#: A model file of at most this many bytes is digested before the first request that needs its
#: identity (1 GiB: about a second from the page cache, docs/benchmarks.md); a larger one in the
#: background while requests are served under its provisional identity.
DIGEST_INLINE_BYTES = 1 << 30
#: File versions whose digest the on-disk memo keeps (the newest ones).
DIGEST_MEMO_MAX = 64

FileVersion = tuple[int, int, int, int, int]
_digests: dict[FileVersion, str] = {}
_digest_lock = threading.Lock()
_digest_tasks: dict[FileVersion, asyncio.Future] = {}


def file_version(st: os.stat_result) -> FileVersion:
    """``(st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns)``: what tells two versions of a file
    apart without reading it. A rewrite that keeps the size and sets the old mtime back (``cp -p``,
    ``touch -r``) still changes ``st_ctime``, which only the kernel sets."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _memo_path() -> Path:
    """The on-disk digest memo: ``file-digests.json`` under ``ocache.paths.state_root()``."""
    from ocache.paths import state_root

    return state_root() / "file-digests.json"


def _memo_read() -> dict[str, str]:
    try:
        doc = json.loads(_memo_path().read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in doc.items() if isinstance(k, str) and isinstance(v, str)} if isinstance(doc, dict) else {}


def _memo_key(v: FileVersion) -> str:
    return ":".join(str(x) for x in v)


def known_digest(path: str | os.PathLike, st: os.stat_result | None = None) -> str | None:
    """The XXH3-128 hex of ``path``'s current version if it was digested before (in this process or
    in the on-disk memo), else None. Reads nothing but ``os.stat`` and the memo file."""
    v = file_version(st if st is not None else os.stat(path))
    with _digest_lock:
        if v in _digests:
            return _digests[v]
    got = _memo_read().get(_memo_key(v))
    if got:
        with _digest_lock:
            _digests[v] = got
    return got or None


def file_digest(path: str | os.PathLike) -> str:
    """XXH3-128 hex of every byte of ``path`` (xxhash's streaming hasher, ``DIGEST_READ`` bytes per
    read; blocking file I/O, about 1 s per GB from the page cache: docs/benchmarks.md), memoised in
    memory and on disk by :func:`file_version`. A file that changed while it was read (its version
    before and after differ) is digested again, at most three times, then OSError."""
    p = Path(path)
    for _ in range(3):
        v = file_version(p.stat())
        got = known_digest(p, None)
        if got and file_version(p.stat()) == v:
            return got
        h = xxhash.xxh3_128()
        with open(p, "rb", buffering=0) as f:
            buf = bytearray(DIGEST_READ)
            view = memoryview(buf)
            while n := f.readinto(buf):
                h.update(view[:n])
            after = file_version(os.fstat(f.fileno()))
        if after != v:
            continue
        digest = h.hexdigest()
        with _digest_lock:
            _digests[v] = digest
            try:
                memo = _memo_read()
                memo.pop(_memo_key(v), None)
                memo[_memo_key(v)] = digest
                keep = dict(list(memo.items())[-DIGEST_MEMO_MAX:])
                tmp = _memo_path().with_suffix(f".tmp{os.getpid()}")
                tmp.write_text(json.dumps(keep))
                os.replace(tmp, _memo_path())
            except OSError as exc:
                log.warning("file digest memo not written (%s): the digest is taken again after a restart", exc)
        return digest
    raise OSError(f"{p}: changed while it was digested (3 tries)")


async def ensure_digest(path: str | os.PathLike) -> str:
    """:func:`file_digest` on a worker thread (``asyncio.to_thread``); concurrent callers for one file
    version share one read. Raises OSError as ``file_digest`` does."""
    v = file_version(os.stat(path))
    fut = _digest_tasks.get(v)
    if fut is None or (fut.done() and fut.exception() is not None):
        fut = asyncio.ensure_future(asyncio.to_thread(file_digest, path))
        _digest_tasks[v] = fut

        def forget(f: asyncio.Future[str], v: tuple = v) -> None:
            if _digest_tasks.get(v) is f:
                _digest_tasks.pop(v, None)

        fut.add_done_callback(forget)
    return await asyncio.shield(fut)


def gguf_identity(path: str | os.PathLike, *, digest: bool = True) -> GGUFIdentity:
    """Read ``path``'s GGUF header and a sample of its tensor data (file I/O; the only I/O in this
    module) -> GGUFIdentity. With ``digest`` (the default) the whole file's XXH3-128 is taken too
    when it is not known (:func:`file_digest`, blocking); with ``digest=False`` only a known one is
    used, else the identity is provisional (``GGUFIdentity.pending``; :func:`ensure_digest` then
    takes it on a worker thread).

    Walks the layout of ggml/include/gguf.h (magic ``GGUF``, u32 version, u64 n_tensors, u64 n_kv,
    key/value pairs, tensor infos), hashes exactly those bytes with xxh3_128, then hashes the tensor
    data sample of :func:`data_sample`. Memoised per (path, size, mtime_ns, inode, ctime_ns): the
    kernel sets ``st_ctime`` on every write and on every ``utime``, and no user call can set it back,
    so a file rewritten under its old mtime is read again, and a restart of llama-server on an
    untouched file costs one ``stat``. Raises OSError if the file cannot be read and GGUFError if it
    is not a GGUF.
    """
    p = Path(path)
    st = p.stat()
    memo = (str(p.resolve()), st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)
    known = file_digest(p) if digest else known_digest(p, st)
    if known and file_version(p.stat()) != file_version(st):
        return gguf_identity(p, digest=digest)   # it changed meanwhile: all of it again
    if memo in _gguf_cache:
        return _with_digest(_gguf_cache[memo], known, st)
    with _header(p) as (mm, r, version, n_tensors, n_kv):
        header_end, data_start, offsets = _layout(r, n_tensors, n_kv)
        head_digest = xxhash.xxh3_128_hexdigest(mm[:header_end])
        data_digest = data_sample(mm, data_start, offsets)
    ident = GGUFIdentity(size=st.st_size, mtime_ns=st.st_mtime_ns, header_xxh3_128=head_digest,
                         header_bytes=header_end, version=version, n_tensors=n_tensors, n_kv=n_kv,
                         data_xxh3_128=data_digest)
    if len(_gguf_cache) > 64:
        _gguf_cache.clear()
    _gguf_cache[memo] = ident
    return _with_digest(ident, known, st)


def _with_digest(ident: GGUFIdentity, digest: str | None, st: os.stat_result) -> GGUFIdentity:
    if digest:
        return replace(ident, file_xxh3_128=digest, pending=None)
    return replace(ident, file_xxh3_128="", pending=file_version(st))


def data_sample(mm, data_start: int, offsets: list[int]) -> str:
    """xxh3_128 hex of a bounded sample of a GGUF's tensor data (the spans of :func:`sample_spans`):
    any retrained, fine-tuned, merged or requantised weights change it, since they change every
    block of the tensors they touch; an edit of a few weights may miss it (the whole file's digest,
    :func:`file_digest`, does not). ``mm``: the file's bytes (a memory map); ``data_start``: the data
    section's offset (the header's end aligned up to ``general.alignment``); ``offsets``: each
    tensor's offset within that section."""
    end = len(mm)
    h = xxhash.xxh3_128()
    h.update(struct.pack("<QQ", max(end - data_start, 0), len(offsets)))
    for a, b in sample_spans(end, data_start, offsets):
        h.update(mm[a:b])
    return h.hexdigest()


def sample_spans(end: int, data_start: int, offsets: list[int]) -> list[tuple[int, int]]:
    """The byte spans ``[a, b)`` of the file that :func:`data_sample` reads: the first and the last
    ``SAMPLE_BLOCK`` bytes of every tensor (its extent runs to the next tensor's offset, the last
    one's to ``end``, the file's size) and ``SAMPLE_SPREAD`` blocks at evenly spaced offsets over the
    whole data section: at most ``(2 * n_tensors + SAMPLE_SPREAD) * 4 KiB`` (about 16 MiB for a model
    of 1,500 tensors, whatever its size)."""
    starts = sorted(data_start + o for o in offsets if data_start + o <= end)
    spans = []
    for i, a in enumerate(starts):
        b = starts[i + 1] if i + 1 < len(starts) else end
        spans.append((a, min(a + SAMPLE_BLOCK, b)))
        spans.append((max(a, b - SAMPLE_BLOCK), b))
    total = end - data_start
    if total > 0:
        step = max(total // SAMPLE_SPREAD, 1)
        spans.extend((o, min(o + SAMPLE_BLOCK, end)) for o in range(data_start, end, step))
    return spans


def gguf_sample_spans(path: str | os.PathLike) -> list[tuple[int, int]]:
    """:func:`sample_spans` of the GGUF file ``path`` (reads its header): where the data sample looks,
    so a test or a fault row can change weights only elsewhere. Raises as :func:`gguf_identity`."""
    p = Path(path)
    with _header(p) as (mm, r, _version, n_tensors, n_kv):
        _end, data_start, offsets = _layout(r, n_tensors, n_kv)
        return sample_spans(len(mm), data_start, offsets)


def _layout(r: _Reader, n_tensors: int, n_kv: int) -> tuple[int, int, list[int]]:
    """From the first key/value on: ``(header_end, data_start, tensor offsets)`` in bytes."""
    alignment = _GGUF_DEFAULT_ALIGNMENT
    for _ in range(n_kv):
        key = r.read(r.u64())
        vtype = r.u32()
        if key == b"general.alignment" and vtype == 4:   # u32 (gguf.cpp: GGUF_KEY_GENERAL_ALIGNMENT)
            alignment = struct.unpack("<I", r.read(4))[0] or _GGUF_DEFAULT_ALIGNMENT
        else:
            r.value(vtype)
    offsets = []
    for _ in range(n_tensors):
        r.string()
        n_dims = r.u32()
        r.skip(8 * n_dims + 4)  # dims, ggml type
        offsets.append(r.u64())  # data offset, relative to the data section
    header_end = r.pos
    return header_end, -(-header_end // alignment) * alignment, offsets


def gguf_architecture(path: str | os.PathLike) -> str:
    """``general.architecture`` of a GGUF file (the metadata key/values only). Raises GGUFError (a
    ValueError) for a file that is not GGUF v2/v3 or has no such key, OSError if unreadable."""
    p = Path(path)
    with _header(p) as (_mm, r, version, _n_tensors, n_kv):
        if version < 2:
            raise GGUFError(f"{p}: GGUF version {version} unsupported")
        for _ in range(n_kv):
            key = r.read(r.u64())
            vtype = r.u32()
            if key == b"general.architecture" and vtype == _GGUF_STRING:
                return r.read(r.u64()).decode("utf-8", "replace")
            r.value(vtype)
    raise GGUFError(f"{p}: no general.architecture")


@contextlib.contextmanager
def _header(p: Path):
    """The file memory-mapped, past its fixed header: yields ``(mmap, reader, version, n_tensors,
    n_kv)`` with the reader at the first key/value. Raises OSError if unreadable, GGUFError for a
    file shorter than the fixed header or without the ``GGUF`` magic."""
    with open(p, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise GGUFError(f"{p}: not a GGUF file (only {size} bytes)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            r = _Reader(mm)
            if r.read(4) != b"GGUF":
                raise GGUFError(f"{p}: not a GGUF file (bad magic)")
            version = r.u32()
            n_tensors, n_kv = r.u64(), r.u64()
            yield mm, r, version, n_tensors, n_kv


def resumes_from_checkpoints(arch: str | None) -> bool | None:
    """Whether a model of GGUF architecture ``arch`` resumes a diverging prompt only at context
    checkpoints (its memory cannot be rolled back partially); None when ``arch`` is unknown."""
    return None if not arch else arch in CHECKPOINT_ARCHS
