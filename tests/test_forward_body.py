"""The forwarded body: ``id_slot`` spliced into the client's bytes (``ocache.proxy.with_fields``), and a
client's own steering fields and ``X-OCache-*`` headers never forwarded (``ocache.wire.STEERING``)."""

from __future__ import annotations

import json

import pytest

from multidict import CIMultiDict

from ocache.proxy import parse_body, with_fields
from ocache.wire import NULL_DROPS, STEERING, forward_request_headers, other_body, unplanned_body


@pytest.mark.parametrize("raw", [
    b'{"messages":[{"role":"user","content":"hi \\u00e9 \xc3\xa9"}],"stream":true}',
    b'  {\n "model": "m", "messages": []}\n',
    b'{}',
    b'{ }',
])
def test_splice_keeps_the_client_bytes_and_adds_the_field(raw):
    obj = parse_body(raw)
    out = with_fields(raw, obj, {"id_slot": 3})
    assert json.loads(out) == {**obj, "id_slot": 3}
    assert raw.replace(b" ", b"").replace(b"\n", b"") in out.replace(b" ", b"").replace(b"\n", b"").replace(b'"id_slot":3,', b"").replace(b'"id_slot":3', b"")


def test_a_field_the_client_set_is_replaced_not_duplicated():
    raw = b'{"id_slot": 0, "prompt": "x"}'
    out = with_fields(raw, parse_body(raw), {"id_slot": 2})
    assert out.count(b"id_slot") == 1 and json.loads(out) == {"id_slot": 2, "prompt": "x"}


# a client's own steering fields (wire.STEERING): never forwarded as it sent them
SPLICE = {"n_keep": 60, "n_check": 0, "xxh3": "0" * 16, "n_tail": 1, "tail_xxh3": "0" * 16}


def test_a_clients_splice_is_dropped_beside_the_plans_slot():
    raw = json.dumps({"messages": [], "ocache_splice": SPLICE, "id_slot": 1}).encode()
    out = json.loads(with_fields(raw, parse_body(raw), {"id_slot": 0}))
    assert out == {"messages": [], "id_slot": 0}


def test_a_plan_without_fields_still_drops_the_clients_steering_fields():
    """The server-placed route forwards without ``id_slot``: a client's own was forwarded as sent."""
    raw = json.dumps({"messages": [], "ocache_splice": SPLICE, "id_slot": 1}).encode()
    assert json.loads(with_fields(raw, parse_body(raw), {})) == {"messages": []}
    # without a cache layer only ours is dropped: llama-server's own id_slot passes as without ocache
    assert json.loads(with_fields(raw, parse_body(raw), {}, NULL_DROPS)) == {"messages": [], "id_slot": 1}
    plain = b'{"messages": []}'
    assert with_fields(plain, parse_body(plain), {}) is plain


@pytest.mark.parametrize("raw", [
    json.dumps({"prompt": "x", "ocache_splice": SPLICE}).encode(),
    json.dumps({"prompt": "x", "id_slot": 1, "ocache_splice": SPLICE}).encode(),
])
def test_an_unplanned_body_never_carries_a_steering_field(raw):
    out = unplanned_body(raw, parse_body(raw))
    assert out is not None and not set(json.loads(out)) & set(STEERING)


@pytest.mark.parametrize("raw", [
    b'\xef\xbb\xbf{"prompt": "x", "ocache_splice": {}}',          # a BOM: not parsed by ocache
    b'\xef\xbb\xbf{"prompt": "x", "\\u006fcache_splice": {}}',    # the key spelled with an escape
])
def test_an_unparsed_body_that_may_spell_a_steering_key_is_refused(raw):
    assert unplanned_body(raw, None) is None
    assert unplanned_body(b'\xef\xbb\xbf{"prompt": "x"}', None) is not None


@pytest.mark.parametrize("raw", [
    json.dumps({"input_prefix": "a", "id_slot": 0, "ocache_splice": SPLICE}).encode(),
    json.dumps({"input_prefix": "a", "ocache_generated": True}).encode(),
    b'{"input_prefix": "a", "\\u0069d_slot": 0}',                # the key spelled with an escape
    b'{"id_slot": 1, "input_prefix": "a", "id_slot": 0}',         # twice: both parsers keep the last
])
def test_a_post_to_a_route_ocache_does_not_plan_carries_no_steering_field(raw):
    """``/infill``, ``/embeddings``, ...: llama-server reads the same fields there."""
    out = other_body(raw)
    assert out is not None and json.loads(out)["input_prefix"] == "a"
    assert not set(json.loads(out)) & set(STEERING)
    # without a cache layer the server's own id_slot passes, the patches' fields do not
    kept = other_body(raw, NULL_DROPS)
    assert kept is not None and not set(json.loads(kept)) & set(NULL_DROPS)


def test_a_post_body_that_cannot_steer_goes_byte_for_byte():
    for raw in (b'{"content": "def f(): pass"}', b"", b"not json", b'[1, 2]'):
        assert other_body(raw) is raw
    # unparsed and possibly spelling a key: refused (ocache's 400), never forwarded
    assert other_body(b'\xef\xbb\xbf{"id_slot": 0}') is None
    assert other_body(b'[{"id_slot": 0}]') is None


def test_a_clients_x_ocache_headers_are_not_forwarded():
    h = CIMultiDict({"X-OCache-Splice": "60", "x-ocache-anything": "1", "Authorization": "Bearer k"})
    out = forward_request_headers(h)
    assert dict(out) == {"Authorization": "Bearer k"}
