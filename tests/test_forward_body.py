"""The forwarded body: ``id_slot`` spliced into the client's bytes (``ocache.proxy.with_fields``)."""

from __future__ import annotations

import json

import pytest

from ocache.proxy import parse_body, with_fields


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
