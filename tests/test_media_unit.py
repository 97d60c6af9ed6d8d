"""ocache/media.py without a server: the bytes and digest the server would key an image by, the
order of the media parts, and the pairing of markers with parts (the real-server checks are
tests/test_images.py)."""

from __future__ import annotations

import asyncio
import base64
import hashlib

import pytest

from ocache import media


def test_digest_is_the_sha256_of_the_file_bytes_whatever_the_url_says():
    raw = b"\x89PNG fake bytes"
    b64 = base64.b64encode(raw).decode()
    want = hashlib.sha256(raw).hexdigest()
    assert media.digest(f"data:image/png;base64,{b64}") == want
    assert media.digest(f"data:image/jpeg;base64,{b64}") == want      # another URL, same bytes
    assert media.digest(b64) == want                                  # a raw base64 string
    assert media.digest(f"data:image/png;base64,{base64.b64encode(raw + b'!').decode()}") != want
    for url in ("http://host/x.png", "https://host/x.png", "file:///tmp/x.png", "data:a,b,c"):
        with pytest.raises(media.MediaError):
            media.digest(url)


def test_parts_in_server_order_and_markers_paired():
    def img(tag: str) -> dict:
        return {"type": "image_url", "image_url": {"url": "data:image/png;base64," +
                                                   base64.b64encode(tag.encode()).decode()}}
    body = {"messages": [{"role": "system", "content": "s"},
                         {"role": "user", "content": [{"type": "text", "text": "a"}, img("1"), img("2")]},
                         {"role": "user", "content": [img("3")]}]}
    urls = media.media_parts(body)
    assert [base64.b64decode(u.split(",")[1]) for u in urls] == [b"1", b"2", b"3"]
    text = "A<__media_x1__>B<__media_x1__><__media_x1__>C"
    calls = []

    async def tok(part: str, first: bool) -> list[int]:
        calls.append((part, first))
        return [ord(c) for c in part]

    async def positions(url: str, dig: str) -> int:
        return 2

    out = asyncio.run(media.media_tokens(text, body, tok, positions))
    d = [media.digest(u) for u in urls]
    assert out == [65, *media.media_ids(d[0], 2), 66, *media.media_ids(d[1], 2),
                   *media.media_ids(d[2], 2), 67]
    assert calls == [("A", True), ("B", False), ("C", False)]
    assert all(-(1 << 31) <= t < -1 for t in media.media_ids(d[0], 100))
    with pytest.raises(media.MediaError, match="markers"):
        asyncio.run(media.media_tokens("A<__media_x1__>B", body, tok, positions))
    with pytest.raises(media.MediaError, match="input_audio"):
        media.media_parts({"messages": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": "AA=="}}]}]})
