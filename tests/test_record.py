"""Recording: the JSONL writer the proxy calls, its permissions, and the --redact round trip."""

from __future__ import annotations

import stat

import pytest

from ocache.layer import Observation, ParsedRequest, Plan
from ocache.record import Recorder, RecordError, read_stream, redact
from conftest import load_fixture

SECRET = "the launch codes are 0000 and nobody must read this"


def _request(body: dict, rid: str = "r1") -> ParsedRequest:
    return ParsedRequest(request_id=rid, method="POST", path="/v1/chat/completions", body=body,
                         headers={"Authorization": "Bearer sk-123", "User-Agent": "opencode/1",
                                  "x-session-affinity": "ses_abc"},
                         session_hint="ses_abc", stream=bool(body.get("stream")))


def _obs(content: str | None = "an answer that is private too") -> Observation:
    return Observation(status=200, completed=True,
                       timings={"prompt_n": 37, "cache_n": 7169, "predicted_n": 8},
                       usage={"prompt_tokens": 7206, "completion_tokens": 8},
                       ttft_s=0.25, total_s=0.5, content=content)


def _keys(value) -> set[str]:
    if isinstance(value, dict):
        return set(value) | {k for v in value.values() for k in _keys(v)}
    if isinstance(value, list):
        return {k for v in value for k in _keys(v)}
    return set()


def _strings(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def test_record_round_trip_keeps_everything_and_is_private(tmp_path):
    body = load_fixture("opencode_agent_turn1.json")
    body["messages"][1]["content"] = SECRET
    rec = Recorder(tmp_path / "rec")
    assert rec.record(_request(body), Plan(body_updates={"id_slot": 1},
                                           headers={"X-OCache-Tier": "disk"}), _obs())
    assert rec.record(_request(body, "r2"), None, _obs(None))
    rec.close()
    assert stat.S_IMODE((tmp_path / "rec").stat().st_mode) == 0o700
    assert stat.S_IMODE(rec.path.stat().st_mode) == 0o600
    entries = read_stream(tmp_path / "rec")
    assert [e["seq"] for e in entries] == [0, 1]
    first = entries[0]
    assert first["body"] == body
    assert first["plan"] == {"body_updates": {"id_slot": 1}, "headers": {"X-OCache-Tier": "disk"}}
    assert first["obs"]["timings"]["cache_n"] == 7169
    assert first["session"] == "ses_abc"
    assert "authorization" not in first["headers"] and "sk-123" not in rec.path.read_text()
    assert entries[1]["plan"] == {}
    assert entries[0]["t"] <= entries[1]["t"]


def test_redacted_file_has_no_prompt_text_but_keeps_counts(tmp_path):
    body = load_fixture("opencode_agent_turn1.json")
    body["messages"][1]["content"] = SECRET
    rec = Recorder(tmp_path / "rec", redact=True)
    rec.record(_request(body), Plan(body_updates={"id_slot": 0}), _obs())
    rec.record(_request(body, "r2"), Plan(), _obs())
    rec.close()
    text = rec.path.read_text()
    # no text of the body survives: check every string value of 8+ characters (dict keys, e.g.
    # JSON-schema property names, are structure and kept)
    keys = _keys(body)
    for s in _strings(body):
        if len(s) >= 8 and s not in keys and s != "function":
            assert s not in text, f"redacted file leaks {s[:40]!r}"
    assert "private too" not in text and "ses_abc" not in text
    with pytest.raises(RecordError, match="redact"):
        read_stream(rec.path)
    entries = read_stream(rec.path, replayable=False)
    e = entries[0]
    assert e["redacted"] is True
    assert e["obs"]["timings"] == {"prompt_n": 37, "cache_n": 7169, "predicted_n": 8}
    assert e["obs"]["usage"]["prompt_tokens"] == 7206
    assert e["obs"]["content"] == {"chars": len("an answer that is private too")}
    assert e["plan"]["body_updates"] == {"id_slot": 0}
    msgs = e["body"]["messages"]
    assert [m["role"] for m in msgs] == [m["role"] for m in body["messages"]]
    assert msgs[1]["content"]["chars"] == len(SECRET)
    assert len(e["body"]["tools"]) == len(body["tools"])
    # equal texts hash equal within one file, so divergence points stay visible
    assert entries[0]["body"]["messages"][0] == entries[1]["body"]["messages"][0]


def test_redact_hash_is_keyed():
    a = redact({"content": "hello"}, b"k1")
    b = redact({"content": "hello"}, b"k2")
    assert a["content"]["chars"] == 5 and a["content"]["h"] != b["content"]["h"]


def test_bad_recordings_are_clear_errors(tmp_path):
    with pytest.raises(RecordError, match="no recording"):
        read_stream(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RecordError, match="no stream"):
        read_stream(tmp_path / "empty")
    bad = tmp_path / "stream-x.jsonl"
    bad.write_text('{"v": 1, "seq": 0, "body": {}}\nnot json\n{"v": 1}\n')
    with pytest.raises(RecordError, match=":2: not a JSON line"):
        read_stream(bad)
    other = tmp_path / "stream-y.jsonl"
    other.write_text('{"v": 99}\n')
    with pytest.raises(RecordError, match="schema"):
        read_stream(other)


def test_write_failure_is_counted_not_raised(tmp_path):
    rec = Recorder(tmp_path / "rec")
    rec.path = tmp_path / "rec" / "no-such-dir" / "x.jsonl"
    assert rec.record(_request({"messages": []}), Plan(), _obs()) is False
    assert rec.errors == 1
