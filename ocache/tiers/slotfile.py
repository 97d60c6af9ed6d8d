"""llama-server's slot file format, read by the store: the ``.bin`` a ``POST /slots/{id}?action=save``
writes and the patched build's checkpoint sidecar ``.bin.ckpt``; both are read from their headers
only (the state bytes are the server's). Also the xxh3-64 of a whole file, the hash the store
records and verifies.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Sequence

import xxhash

CHUNK = 4 << 20

#: Slot file header (docs/llama-server.md §6, include/llama.h:43-49): u32 magic 'ggsq', u32 version, u32 n_words,
#: then the packed server_tokens [-1, 1, n_tokens, tokens...] for a text-only slot.
SLOT_MAGIC = 0x67677371
TOKENS_OFFSET = 24

def token_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian int32 bytes (the slot file's own encoding)."""
    return struct.pack(f"<{len(tokens)}i", *tokens)


def tokens_from_bytes(raw: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(raw) // 4}i", raw))


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


