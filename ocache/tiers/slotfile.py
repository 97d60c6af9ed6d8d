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
#: then the packed server_tokens [-1, 1, n_tokens, tokens..., n_media, ...] (read_slot_tokens).
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
    """The token ids stored in a llama-server slot file, read from its header only, in the form of
    ocache's token view: a media chunk's positions (``-1``, ``LLAMA_TOKEN_NULL``, in the file) as
    :func:`ocache.media.media_ids` of the chunk's id (the SHA-256 of the image's bytes), so a slot
    file of an image prompt holds exactly the view's tokens of that prompt.

    Layout (docs/llama-server.md §6): magic, version, n_words, then the packed ``server_tokens``
    (tools/server/server-common.cpp:570-590 ``serialize``): ``-1, 1, n_tokens, token[0..n_tokens)``,
    ``u32 n_media``, ``n_media`` u32 start indices, then per media chunk ``u32 n_bytes`` and the
    bytes of ``mtmd_input_chunk_save`` (:func:`media_chunk_id`). A text-only file has ``n_media``
    0. Raises ValueError for a file that is not a slot file of that layout (or a media chunk that
    cannot be read), OSError if it cannot be read. ``limit`` caps how many ids are returned.
    """
    with open(path, "rb") as f:
        head = f.read(TOKENS_OFFSET)
        if len(head) < TOKENS_OFFSET:
            raise ValueError("short header")
        magic, _version, n_words, marker, state_ver, n_tok = struct.unpack("<IIIiii", head)
        if magic != SLOT_MAGIC:
            raise ValueError(f"bad magic {magic:#x}")
        if marker != -1 or state_ver != 1:
            raise ValueError("not a packed server_tokens header (legacy file)")
        if n_tok < 0 or n_tok + 4 > n_words:
            raise ValueError(f"token count {n_tok} does not fit n_words {n_words}")
        raw = f.read(4 * n_tok)
        if len(raw) != 4 * n_tok:
            raise ValueError("short token list")
        tokens = tokens_from_bytes(raw)
        if -1 in tokens:
            # the media part of the packed words: read only when there are media positions
            rest = f.read(4 * (n_words - 3 - n_tok))
            tokens = _media_view(tokens, rest)
        return tokens if limit is None else tokens[:limit]


def _media_view(tokens: list[int], rest: bytes) -> list[int]:
    """``tokens`` with each media chunk's run of ``-1`` replaced by the view's ids of its chunk id
    (server_tokens ``map_idx_to_media``: the start index of each chunk, server-common.cpp:576-588;
    a chunk's positions run from its start to the next start or the first text token)."""
    from ocache.media import media_ids   # noqa: PLC0415 (pure; imported where media is read)

    if len(rest) < 4:
        raise ValueError("no media count after the token list")
    (n_media,) = struct.unpack_from("<I", rest, 0)
    off = 4
    if n_media > (len(rest) - off) // 8:
        raise ValueError(f"media count {n_media} does not fit the header")
    starts = list(struct.unpack_from(f"<{n_media}I", rest, off))
    off += 4 * n_media
    out = list(tokens)
    for i, start in enumerate(starts):
        if off + 4 > len(rest):
            raise ValueError("short media chunk")
        (size,) = struct.unpack_from("<I", rest, off)
        off += 4
        chunk = rest[off:off + size]
        if len(chunk) != size:
            raise ValueError("short media chunk")
        off += size
        end = start
        stop = starts[i + 1] if i + 1 < len(starts) else len(tokens)
        while end < stop and tokens[end] == -1:
            end += 1
        if not (0 <= start < end):
            raise ValueError(f"media chunk at {start} holds no media position")
        out[start:end] = media_ids(media_chunk_id(chunk), end - start)
    if -1 in out:
        raise ValueError("a media position without its chunk")
    return out


#: ``MTMD_SERIALIZATION_VERSION`` of the pinned source (tools/mtmd/mtmd.cpp:30)
MTMD_CHUNK_VERSION = 2


def media_chunk_id(data: bytes) -> str:
    """The id of a media chunk saved by ``mtmd_input_chunk_save`` (tools/mtmd/mtmd.cpp:2407-2446):
    ``u64 version (2)``, ``u32 type``, ``u64 n_text`` + ``i32`` text tokens, ``u8 has_image`` then
    the image tokens (``u32 nx, ny, pos, image_idx, n_temporal_merge``, ``u64 len`` + the id;
    mtmd.cpp:262-271), else ``u8 has_audio`` then ``u32 n_tokens``, ``u64 len`` + the id
    (mtmd.cpp:311-315); the chunk's own layout: mtmd.cpp:354-371. The id of an image is the SHA-256 hex of its file's bytes
    (tools/mtmd/mtmd-helper.cpp:380-383). Raises ValueError for another layout."""
    try:
        version, _type, n_text = struct.unpack_from("<QIQ", data, 0)
        if version != MTMD_CHUNK_VERSION:
            raise ValueError(f"media chunk version {version}")
        off = 20 + 4 * n_text
        (has_image,) = struct.unpack_from("<B", data, off)
        off += 1
        if has_image:
            off += 20
        else:
            (has_audio,) = struct.unpack_from("<B", data, off)
            if not has_audio:
                raise ValueError("a media chunk with neither image nor audio")
            off += 1 + 4
        (n,) = struct.unpack_from("<Q", data, off)
        raw = data[off + 8:off + 8 + n]
    except struct.error as exc:
        raise ValueError(f"unreadable media chunk: {exc}") from None
    if len(raw) != n or not n:
        raise ValueError("media chunk without an id")
    return raw.decode("ascii", "replace")


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


