"""Images in a chat prompt as ocache's token view sees them: each image's positions keyed by the
image's digest as llama-server computes it (seed §13.11).

What the server does (the pinned source): it replaces each media part of a message
(``image_url``, ``input_audio``, ``input_video``/``video_url``; messages in order, parts in order,
tools/server/server-common.cpp:1155-1205, 1295-1314) by one media marker, ``<__media_`` + a random
string fixed per process + ``__>`` (server-common.cpp:138-146), renders the template, then splits
the text at the markers: each text part is tokenized (``parse_special``; a BOS, when the vocabulary
adds one, only at the very start: tools/mtmd/mtmd.cpp:1270-1330) and each media part becomes a
chunk of positions whose id is the SHA-256 (hex) of the file's bytes (tools/mtmd/mtmd-helper.cpp:
380-383): a ``data:`` URL's base64 payload decoded (server-common.cpp:1127-1150). Its prompt cache
compares a media chunk by that id, so the same bytes under another URL are the same image and new
pixels under the same URL are another one.

ocache's view: the text parts' tokens as the server's, and for each image its positions as
:func:`media_ids` of its digest (negative ids, never a vocabulary id, the same for the same bytes
and different for other bytes). The number of positions an image takes is the server's own count:
``/v1/chat/completions/input_tokens`` of a one-image message minus that of an empty one
(server-context.cpp ``handle_count_tokens``, counted with the image in placeholder mode), once per
digest and server process. An image the server fetches itself (``http``, ``file://``) has no digest
here: the view raises ``MediaError`` (the request is then not viewed).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from typing import Any, Awaitable, Callable, Iterator, Mapping

#: the media marker of the rendered prompt (server-common.cpp:138-146)
MARKER = re.compile(r"<__media_[A-Za-z0-9]+__>")
#: content part types the server loads as media (server-common.cpp:1155-1205)
MEDIA_PARTS = {"image_url": "image_url", "input_audio": "input_audio", "input_video": "input_video",
               "video_url": "video_url"}


class MediaError(ValueError):
    """A media part ocache cannot key as the server does (a URL the server fetches, bad base64)."""


def _url_of(part: Mapping[str, Any]) -> str:
    t = part.get("type")
    inner = part.get(MEDIA_PARTS[t]) if isinstance(t, str) else None
    if not isinstance(inner, Mapping):
        return ""
    if t == "image_url":
        url = inner.get("url", "")
    else:
        url = inner.get("data", inner.get("url", ""))
    return url if isinstance(url, str) else ""


def file_bytes(url: str) -> bytes:
    """The bytes the server loads for a media URL: a ``data:`` URL's or a raw base64 string's
    payload (server-common.cpp:1127-1150). Raises MediaError for a URL the server fetches itself."""
    if url.startswith("http") or url.startswith("file://"):
        raise MediaError("the server fetches this media itself: no digest here")
    payload = url
    if url.startswith("data:"):
        parts = url.split(",")
        if len(parts) != 2:
            raise MediaError("invalid data URL")
        payload = parts[1]
    try:
        return base64.b64decode(payload + "=" * (-len(payload) % 4))
    except (binascii.Error, ValueError) as exc:
        raise MediaError(f"invalid base64 media: {exc}") from None


def has_media_parts(body: Mapping[str, Any]) -> bool:
    """Whether a chat body has a media content part. A rendered prompt's text can hold the
    marker's shape without one (a user pasting ``<__media_x__>``, a tool reading this module): the
    server's marker is random per process (``get_media_marker``, tools/server/server-common.cpp:138-148
    of the pinned source), so without a media part such text is text."""
    return any(part.get("type") in MEDIA_PARTS for part in _content_parts(body))


def media_parts(body: Mapping[str, Any]) -> list[str]:
    """The URL of every media part of a chat body, in the order the server loads them. Raises
    MediaError for audio and video parts (not viewed yet)."""
    out: list[str] = []
    for part in _content_parts(body):
        if part.get("type") in MEDIA_PARTS:
            if part.get("type") != "image_url":
                raise MediaError(f"{part.get('type')} parts are not viewed (images only)")
            out.append(_url_of(part))
    return out


def _content_parts(body: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """Every content part (a mapping) of a chat body's messages, in order; a string content has none."""
    msgs = body.get("messages")
    for msg in msgs if isinstance(msgs, list) else ():
        content = msg.get("content") if isinstance(msg, Mapping) else None
        if isinstance(content, list):
            yield from (part for part in content if isinstance(part, Mapping))


def digest(url: str) -> str:
    """The server's id of the media at ``url``: SHA-256 hex of its file bytes."""
    return hashlib.sha256(file_bytes(url)).hexdigest()


def media_ids(dig: str, n: int) -> list[int]:
    """The view's ids of an image's ``n`` positions: negative (no vocabulary id), from ``dig``."""
    base = int(dig[:14], 16)
    return [-(2 + ((base + k) % ((1 << 31) - 3))) for k in range(n)]   # int32, below -1


async def media_tokens(text: str, body: Mapping[str, Any],
                       tokenize: Callable[[str, bool], Awaitable[list[int]]],
                       positions: Callable[[str, str], Awaitable[int]]) -> list[int]:
    """The token view of a rendered chat ``text`` that holds media markers: its text parts through
    ``tokenize(part, first)`` (the first part as a whole prompt, the others without specials), each
    media part as :func:`media_ids` of its digest, ``positions(url, digest)`` long. Raises
    MediaError when the markers and the body's media parts do not pair up or a part has no digest."""
    parts = MARKER.split(text)
    urls = media_parts(body)
    if len(urls) != len(parts) - 1:
        raise MediaError(f"{len(parts) - 1} media markers for {len(urls)} media parts")
    out: list[int] = []
    for i, part in enumerate(parts):
        if part or i == 0:
            out += await tokenize(part, i == 0)
        if i < len(urls):
            dig = digest(urls[i])
            out += media_ids(dig, await positions(urls[i], dig))
    return out
