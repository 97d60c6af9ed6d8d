"""The tiny vision projector (ocache/toolchain/vision.py) on the pinned llama-server, and what the
server's own prompt cache does with image prompts: the facts ocache's image keys rest on.

Real parts: the patched llama-server with ``--mmproj`` on the tiny dense model, real PNG bytes
(made here with zlib, two different pictures). What the test shows:

* the projector loads and an image takes ``VisionSpec.n_patches`` prompt positions (16);
* the server keys an image by its bytes (sha256 of the file, tools/mtmd/mtmd-helper.cpp:380-383):
  the same bytes under another URL (another declared media type) reuse the whole prompt up to the
  last token, while other pixels in the same place reuse nothing from the image on (the prompt
  before it: the cache stops at the image chunk, server_tokens::get_common_prefix).
"""

from __future__ import annotations

import base64
import re
import struct
import zlib

import aiohttp
import pytest

from ocache.toolchain.vision import TINY, make_projector

from conftest import through_ocache

pytestmark = pytest.mark.server

#: the media marker llama-server's /apply-template leaves where an image goes (random per process:
#: ``<__media_`` + a random string + ``__>``, tools/server/server-common.cpp:138-146)
MARKER = r"<__media_[A-Za-z0-9]+__>"


def png(width: int, height: int, seed: int) -> bytes:
    """A real RGB PNG of ``width`` x ``height`` pixels whose colours depend on ``seed``."""
    rows = b"".join(b"\x00" + bytes(((x * (5 + seed)) % 256, (y * (7 + 3 * seed)) % 256, (x + y + 40 * seed) % 256)
                                    [c] for x in range(width) for c in range(3)) for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def chat(url: str, text: str = "Describe the picture in one line.") -> dict:
    return {"messages": [{"role": "user", "content": [
                {"type": "text", "text": "Here is a picture."},
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": text}]}],
            "temperature": 0, "max_tokens": 4, "cache_prompt": True}


async def complete(s: aiohttp.ClientSession, url: str, body: dict) -> dict:
    async with s.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def test_projector_loads_and_the_server_keys_images_by_their_bytes(start_server):
    srv = start_server("dense", n_parallel=1, ctx_size=4096, args=["--mmproj", str(make_projector())])
    a, b = png(40, 32, 1), png(40, 32, 2)
    async with aiohttp.ClientSession() as s:
        async with s.get(srv.url + "/props") as r:
            assert (await r.json())["modalities"]["vision"] is True
        text_only = await complete(s, srv.url, {**chat(""), "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Here is a picture."}, {"type": "text", "text": "Describe the picture in one line."}]}]})
        first = await complete(s, srv.url, chat(data_url(a)))
        n_prompt = first["timings"]["prompt_n"] + first["timings"]["cache_n"]
        # the image's positions: the prompt with it minus the same prompt without it
        n_text = text_only["timings"]["prompt_n"] + text_only["timings"]["cache_n"]
        assert n_prompt - n_text == TINY.n_patches, (n_prompt, n_text)
        # the same bytes under another URL: everything but the last token is reused
        again = await complete(s, srv.url, chat(data_url(a, "image/jpeg")))
        assert again["timings"]["cache_n"] == n_prompt - 1, again["timings"]
        assert again["choices"][0]["message"] == first["choices"][0]["message"]
        # other pixels in the same place: nothing from the image on is reused
        other = await complete(s, srv.url, chat(data_url(b)))
        assert other["timings"]["prompt_n"] + other["timings"]["cache_n"] == n_prompt
        async with s.post(srv.url + "/apply-template", json=chat(data_url(b))) as r:
            before_image = re.split(MARKER, (await r.json())["prompt"])[0]
        async with s.post(srv.url + "/tokenize", json={"content": before_image, "add_special": True,
                                                       "parse_special": True}) as r:
            n_before = len((await r.json())["tokens"])
        assert other["timings"]["cache_n"] == n_before, (other["timings"], n_before)


async def test_token_view_keys_each_image_by_its_digest(start_server, tmp_path):
    """ocache's token view of an image prompt (ocache/media.py through TokenViewer.view) is as long
    as the server's prompt, equal for the same bytes under another URL, and different from the
    image's first position on for other pixels; through ocache the next identical request is
    predicted right (no view mismatch). On main the marker was tokenized as text: the view was
    the wrong length (this fails there)."""
    from ocache.config import Config
    from ocache.media import digest
    from ocache.tokens import TokenViewer, TokenViewError

    srv = start_server("dense", n_parallel=1, ctx_size=4096, args=["--mmproj", str(make_projector())])
    a, b = png(40, 32, 1), png(24, 24, 3)
    two = chat(data_url(a))
    two["messages"][0]["content"].append({"type": "image_url", "image_url": {"url": data_url(b)}})
    viewer = TokenViewer(srv.url)
    try:
        async with aiohttp.ClientSession() as s:
            for body in (chat(data_url(a)), two):
                view = await viewer.view("/v1/chat/completions", body)
                done = await complete(s, srv.url, {**body, "cache_prompt": False})
                assert len(view.tokens) == done["timings"]["prompt_n"] + done["timings"]["cache_n"]
            va = (await viewer.view("/v1/chat/completions", chat(data_url(a)))).tokens
            va2 = (await viewer.view("/v1/chat/completions", chat(data_url(a, "image/jpeg")))).tokens
            vb = (await viewer.view("/v1/chat/completions", chat(data_url(b)))).tokens
            assert va == va2 and digest(data_url(a)) == digest(data_url(a, "image/jpeg"))
            first = next(i for i, (x, y) in enumerate(zip(va, vb)) if x != y)
            # they part exactly where the image starts: text before it, its positions after
            assert all(t >= 0 for t in va[:first]) and all(t < 0 for t in va[first:first + TINY.n_patches])
            assert all(t < 0 for t in vb[first:first + TINY.n_patches])
            assert len([t for t in va if t < 0]) == TINY.n_patches
            # an image the server fetches itself has no digest here: no view, never a wrong one
            with pytest.raises(TokenViewError):
                await viewer.view("/v1/chat/completions", chat("http://127.0.0.1:9/x.png"))
    finally:
        await viewer.close()
    cfg = Config(upstream=srv.url, cache_dir=str(tmp_path / "cache"),
                 tiers={"resident": {"server_args": srv.command()[1:]}})
    async with through_ocache(cfg) as (base, proxy), aiohttp.ClientSession() as s:
        for url in (data_url(a), data_url(a, "image/jpeg")):
            async with s.post(base + "/v1/chat/completions", json=chat(url)) as r:
                assert r.status == 200 and "X-OCache-Fail-Open" not in r.headers
                got = await r.json()
                predicted = int(r.headers["X-OCache-Predicted-Cache"])
            await proxy.wait_background()
            await proxy.layer.idle()
        assert got["timings"]["cache_n"] == predicted, (got["timings"], predicted)
        assert proxy.layer.counters["view_mismatches"] == 0
        assert proxy.layer.counters["mispredictions"] == 0
