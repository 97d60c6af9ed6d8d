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


# --------------------------------------------------------------------------- slot files with media

def _chunk(image_id: str, *, audio: bool = False, version: int = 2) -> bytes:
    """A media chunk as ``mtmd_input_chunk_save`` writes it (tools/mtmd/mtmd.cpp:2407-2446, 262-271,
    311-315, 354-371): version, type, no text tokens, then the image (or audio) tokens with the id
    and an empty batch."""
    import struct

    ident = image_id.encode()
    out = struct.pack("<QIQ", version, 2 if audio else 1, 0)
    if audio:
        out += b"\x00" + b"\x01" + struct.pack("<I", 4) + struct.pack("<Q", len(ident)) + ident
    else:
        out += b"\x01" + struct.pack("<5I", 2, 2, 0, 0, 1) + struct.pack("<Q", len(ident)) + ident
    return out + b"\x00" + struct.pack("<Q", 0) + b"\x00"   # batch: not audio, 0 entries; no audio


def _slot_file(path, tokens: list[int], media: list[tuple[int, bytes]]) -> None:
    """A slot file as llama_state_seq_save_file writes it around server_tokens::serialize
    (server-common.cpp:570-590): magic, version, n_words, then the packed words, padded."""
    import struct

    packed = struct.pack("<iiI", -1, 1, len(tokens)) + struct.pack(f"<{len(tokens)}i", *tokens)
    packed += struct.pack("<I", len(media)) + b"".join(struct.pack("<I", k) for k, _ in media)
    for _, data in media:
        packed += struct.pack("<I", len(data)) + data
    packed += b"\x00" * (-len(packed) % 4)
    path.write_bytes(struct.pack("<III", 0x67677371, 3, len(packed) // 4) + packed + b"STATE")


def test_a_media_slot_file_reads_as_the_token_view(tmp_path):
    """The header of a slot file of an image prompt reads as ocache's token view of that prompt:
    each chunk's -1 positions become media_ids of its id (two images side by side split at the
    second chunk's start); a text-only file reads as before."""
    from ocache.tiers.slotfile import read_slot_tokens

    a, b = hashlib.sha256(b"one").hexdigest(), hashlib.sha256(b"two").hexdigest()
    toks = [5, 6, -1, -1, -1, -1, -1, -1, 7]
    f = tmp_path / "m.bin"
    _slot_file(f, toks, [(2, _chunk(a)), (5, _chunk(b))])
    want = [5, 6, *media.media_ids(a, 3), *media.media_ids(b, 3), 7]
    assert read_slot_tokens(f) == want
    assert read_slot_tokens(f, limit=4) == want[:4]
    _slot_file(f, [1, 2, 3], [])
    assert read_slot_tokens(f) == [1, 2, 3]
    # an audio chunk is keyed by its id the same way
    _slot_file(f, [1, -1, -1, 2], [(1, _chunk(a, audio=True))])
    assert read_slot_tokens(f) == [1, *media.media_ids(a, 2), 2]


@pytest.mark.parametrize("damage", ["version", "no chunk", "orphan position", "short"])
def test_a_media_slot_file_ocache_cannot_read_is_refused(tmp_path, damage):
    """Never a guessed view: another chunk version, a -1 run without its chunk, a short file."""
    from ocache.tiers.slotfile import read_slot_tokens

    a = hashlib.sha256(b"one").hexdigest()
    f = tmp_path / "m.bin"
    if damage == "version":
        _slot_file(f, [5, -1, -1, 7], [(1, _chunk(a, version=3))])
    elif damage == "no chunk":
        _slot_file(f, [5, -1, -1, 7], [])
    elif damage == "orphan position":
        _slot_file(f, [5, -1, -1, 7, -1], [(1, _chunk(a))])
    else:
        _slot_file(f, [5, -1, -1, 7], [(1, _chunk(a))])
        f.write_bytes(f.read_bytes()[:24 + 16 + 6])
    with pytest.raises(ValueError):
        read_slot_tokens(f)


# --------------------------------------------------------------------------- checkpoints and media

def test_no_checkpoint_right_after_an_image_and_text_batches_end_at_one():
    """The sidecar/checkpoint rule for media (server-context.cpp:3509-3511, 3602-3603): a text
    batch ends where an image starts, the step that encodes it takes no checkpoint, later batches
    take theirs as for text. A prompt without media is simulated as before."""
    from ocache.llama.flags import ServerParams
    from ocache.llama.reuse import media_spans, predict_reuse, simulate_prefill

    p = ServerParams(n_batch=512, n_ubatch=128, ctx_checkpoints=32, checkpoint_min_step=64, checkpoints=True)
    d = hashlib.sha256(b"img").hexdigest()
    # user turns at 10 and 200; an image at [201, 217) right after the second user start
    toks = list(range(1, 202)) + media.media_ids(d, 16) + list(range(300, 600))
    N = len(toks)
    spans = media_spans(toks)
    assert spans == [(201, 217)] and media_spans(list(range(5))) == []
    text = [c.n_tokens for c in simulate_prefill([], 0, N, (10, 200), p, 1)]
    with_media = [c.n_tokens for c in simulate_prefill([], 0, N, (10, 200), p, 1, media=spans)]
    assert 217 not in with_media
    assert N - 4 in with_media and N - 4 - 128 in with_media   # the checkpoints near the end stay
    assert text == [c.n_tokens for c in simulate_prefill([], 0, N, (10, 200), p, 1, media=[])]
    # an image whose text batch would have started a user message: its checkpoint is not taken
    toks2 = list(range(1, 100)) + media.media_ids(d, 16) + list(range(300, 700))
    cps = [c.n_tokens for c in simulate_prefill([], 0, len(toks2), (115,), p, 1, media=media_spans(toks2))]
    assert 115 not in cps, cps
    assert 115 in [c.n_tokens for c in simulate_prefill([], 0, len(toks2), (115,), p, 1)]
    # predict_reuse passes the prompt's media to the simulation
    r = predict_reuse([], 0, [], toks2, p, user_starts=(115,), task=1)
    assert [c.n_tokens for c in r.checkpoints_after] == cps


def test_token_id_prefills_stop_before_the_first_image():
    """Anchors and head warm-ups are written by a token-id prefill (``/completion`` of ids), which
    cannot carry an image: the disk tier's lines stop at the prompt's first image, the plan warms
    no head holding one, and the slot table refuses such a prefill without asking the server."""
    from types import SimpleNamespace

    from ocache.cache import RequestContext, plan_request
    from ocache.llama.flags import ServerParams
    from ocache.slots import SlotError, SlotState, SlotTable
    from ocache.tiers.disk import DiskConfig, DiskTier

    d = hashlib.sha256(b"img").hexdigest()
    toks = list(range(1, 5001)) + media.media_ids(d, 16) + list(range(1, 3001))
    store = SimpleNamespace(identity="id", get=lambda key: None)
    tier = DiskTier(store, None, DiskConfig(min_tokens=1024, grid=1024, admit_after=1))
    view = SimpleNamespace(tokens=toks, head_end=2000, user_starts=[4500])
    lines = tier.anchor_lines(view)
    assert lines and all(n <= 5000 for n, _ in lines), lines
    text_view = SimpleNamespace(tokens=list(range(1, 8017)), head_end=2000, user_starts=[4500])
    assert max(n for n, _ in tier.anchor_lines(text_view)) > 5000

    params = ServerParams(n_slots=1, n_ctx_slot=16384, cache_ram=0, checkpoints=False)
    ctx = RequestContext(kind="agent", head_key="h", head_len=5100)
    img_head = plan_request(toks, [SlotState(0, n_ctx=16384)], [], ctx, params, head_resident=False)
    assert "warm_head" not in img_head.steps and img_head.predicted == 0
    ctx = RequestContext(kind="agent", head_key="h", head_len=4000)
    assert "warm_head" in plan_request(toks, [SlotState(0, n_ctx=16384)], [], ctx, params,
                                       head_resident=False).steps

    table = SlotTable(None, "http://127.0.0.1:9", params=params)
    table.slots = [SlotState(0, n_ctx=16384)]
    with pytest.raises(SlotError):
        asyncio.run(table.warm(0, toks[:5016]))


def test_the_markers_shape_without_a_media_part_is_text():
    """``has_media_parts``: only a body with a media part takes the media path; a text holding the
    marker's shape (this module's source read by an agent's tool) is text."""
    text_only = {"messages": [{"role": "user", "content": "see <__media_abc123__> in media.py"},
                              {"role": "tool", "content": [{"type": "text", "text": "<__media_x__>"}]}]}
    assert not media.has_media_parts(text_only)
    with_image = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}]}
    assert media.has_media_parts(with_image)
    assert not media.has_media_parts({"messages": "not a list"}) and not media.has_media_parts({})
