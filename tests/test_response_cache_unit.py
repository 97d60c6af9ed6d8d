"""The response cache's pure parts (ocache/response_cache.py, ocache/api/refresh.py): the greedy
gate, the key, the store's budget and expiry, and the fresh ids/timestamps/figures of a replay.
The real-server behaviour is tests/test_response_cache.py."""

from __future__ import annotations

import json

import pytest

from ocache import config as cfg_mod
from ocache.api.refresh import Fresh
from ocache.response_cache import Entry, ResponseCache, credentials_of, greedy, key_of

#: the pinned server's default sampling parameters as /props reports them (the parts the gate reads)
DEFAULTS = {"temperature": 0.8, "top_k": 40, "dynatemp_range": 0.0, "mirostat": 0,
            "xtc_probability": 0.0, "seed": 4294967295,
            "samplers": ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc",
                         "temperature"]}
CHAT = "/v1/chat/completions"
#: the credentials of a request without any key
NOKEY = credentials_of({})


@pytest.mark.parametrize("body,expected", [
    ({"temperature": 0}, True),
    ({"temperature": 0.0, "seed": 7}, True),            # a greedy chain never draws: the seed is moot
    ({"top_k": 1, "temperature": 1.0}, True),
    ({}, False),                                          # the server's default temperature 0.8
    ({"temperature": 0.7}, False),
    ({"temperature": 0, "mirostat": 2}, False),           # mirostat draws
    ({"temperature": 0, "xtc_probability": 0.5}, False),  # XTC drops top tokens at random
    ({"temperature": 0, "dynatemp_range": 0.5}, False),   # the temperature is then up to 0.5
    ({"temperature": 0, "samplers": ["top_k", "top_p"]}, False),  # no temperature sampler
    ({"temperature": 0, "samplers": "kt"}, False),        # letters: not read, not cached
    ({"temperature": 0, "samplers": ["top-k", "temp"]}, True),
    ({"temperature": 0, "samplers": ["adaptive_p", "temperature"]}, False),
    ({"temperature": 0, "t_max_predict_ms": 500}, False),  # a time limit
    ({"temperature": "0"}, False),
])
def test_greedy_gate(body, expected):
    assert greedy(CHAT, body, DEFAULTS) is expected


def test_greedy_needs_the_server_defaults_and_reads_them():
    assert not greedy(CHAT, {"temperature": 0}, None)
    assert not greedy(CHAT, {"temperature": 0}, {**DEFAULTS, "xtc_probability": 0.3})
    assert greedy(CHAT, {}, {**DEFAULTS, "temperature": 0.0})
    # /v1/messages: the converter drops every sampling field but temperature/top_p/top_k, so a body's
    # xtc_probability 0 does not switch off the server's XTC
    assert greedy("/v1/messages", {"temperature": 0, "xtc_probability": 0}, DEFAULTS)
    assert not greedy("/v1/messages", {"temperature": 0, "xtc_probability": 0},
                      {**DEFAULTS, "xtc_probability": 0.3})


def test_key_covers_identity_defaults_tokens_and_every_field():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0,
            "max_tokens": 8}
    k = key_of("id1", DEFAULTS, CHAT, [1, 2, 3], body, credentials=NOKEY)
    assert k == key_of("id1", DEFAULTS, CHAT, [1, 2, 3], dict(reversed(list(body.items()))), credentials=NOKEY)
    # the prompt is keyed by its tokens: the messages' JSON itself is not in the key
    assert k == key_of("id1", DEFAULTS, CHAT, [1, 2, 3], {**body, "messages": []}, credentials=NOKEY)
    others = [key_of("id2", DEFAULTS, CHAT, [1, 2, 3], body, credentials=NOKEY),
              key_of("id1", {**DEFAULTS, "repeat_penalty": 1.1}, CHAT, [1, 2, 3], body, credentials=NOKEY),
              key_of("id1", DEFAULTS, "/chat/completions", [1, 2, 3], body, credentials=NOKEY),
              key_of("id1", DEFAULTS, CHAT, [1, 2, 4], body, credentials=NOKEY)]
    for field, value in [("max_tokens", 9), ("stream", True), ("n_probs", 2), ("stop", ["x"]),
                         ("grammar", "root ::= \"a\""), ("tools", [{"type": "function"}]), ("seed", 1)]:
        others.append(key_of("id1", DEFAULTS, CHAT, [1, 2, 3], {**body, field: value}, credentials=NOKEY))
    assert len({k, *others}) == len(others) + 1


def test_an_image_keys_the_prompt_as_json():
    """Image rows are placeholder tokens, the same for every image (seed §13.11): a request with an
    image part keys its messages' JSON, so another image is another key."""
    def body(url: str) -> dict:
        return {"temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is it"}, {"type": "image_url", "image_url": {"url": url}}]}]}
    assert key_of("i", DEFAULTS, CHAT, [5], body("data:a"), credentials=NOKEY) != \
        key_of("i", DEFAULTS, CHAT, [5], body("data:b"), credentials=NOKEY)


def test_key_differs_with_the_credentials():
    """The requester's ``Authorization`` and ``X-Api-Key`` (llama-server's ``--api-key`` headers)
    are in the key: no key, a wrong key, the key in the other header, and the key sent in both are
    each another key; header names match without case; the digest does not hold the key."""
    from multidict import CIMultiDict

    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0}

    def key(headers) -> str:
        return key_of("id1", DEFAULTS, CHAT, [1, 2, 3], body, credentials=credentials_of(headers))

    valid = key({"Authorization": "Bearer K"})
    assert valid == key({"authorization": "Bearer K"}) == key(CIMultiDict({"AUTHORIZATION": "Bearer K"}))
    assert valid == key(CIMultiDict([("Authorization", "Bearer K"), ("Content-Type", "application/json")]))
    others = [key({}), key({"Authorization": "Bearer wrong"}), key({"Authorization": "K"}),
              key({"X-Api-Key": "K"}), key({"Authorization": "Bearer wrong", "X-Api-Key": "K"}),
              key({"Authorization": "Bearer K", "X-Api-Key": "K"}),
              key(CIMultiDict([("Authorization", "Bearer K"), ("Authorization", "Bearer x")])),
              key({"Authorization": ""})]
    assert len({valid, *others}) == len(others) + 1
    digest = credentials_of({"Authorization": "Bearer sekret-value"})
    assert len(digest) == 64 and "sekret" not in digest
    assert credentials_of({"X-Api-Key": "K"}) == credentials_of(CIMultiDict({"x-api-key": "K"}))


async def test_a_follower_waits_only_on_a_leader_with_its_credentials():
    """Coalescing goes by the key: while a request with key K answers upstream (its ``Lead``
    registered), an identical request without a key does not wait for it (it answers its own key
    upstream: a ``Lead`` of its own, at once), and one with K does (``followed``, ``coalesced``)."""
    import asyncio
    import types

    from aiohttp.test_utils import make_mocked_request

    from ocache.response_cache import Lead

    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    prepared = types.SimpleNamespace(identity="id1", tokens=[1, 2, 3])

    async def prepare_request(preq):
        return prepared

    proxy = types.SimpleNamespace(
        upstream=types.SimpleNamespace(state="ready", props={"default_generation_settings": {"params": DEFAULTS}}),
        layer=types.SimpleNamespace(prepare_request=prepare_request),
        config=types.SimpleNamespace(upstream_read_timeout_s=60.0))

    def att(headers: dict):
        return types.SimpleNamespace(
            preq=types.SimpleNamespace(path=CHAT, body=body, request_id="r"),
            request=make_mocked_request("POST", CHAT, headers=headers),
            timeout=types.SimpleNamespace(sock_read=60.0), keep=None)

    cache = ResponseCache()
    leader = await cache.serve(proxy, att({"Authorization": "Bearer K"}))
    assert isinstance(leader, Lead) and cache.stats()["answering"] == 1
    followed = asyncio.create_task(cache.followed.wait())
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-Api-Key": "K"}):
        other = asyncio.create_task(cache.serve(proxy, att(headers)))
        done, _ = await asyncio.wait({other, followed}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        assert other in done and followed not in done, (headers, "waited on the K request's answer")
        lead = other.result()
        assert isinstance(lead, Lead) and lead.key != leader.key, headers
    assert cache.counters["coalesced"] == 0 and cache.stats()["answering"] == 4
    same = asyncio.create_task(cache.serve(proxy, att({"Authorization": "Bearer K"})))
    await asyncio.wait_for(followed, 30)          # the request with K waits on the K answer
    assert cache.counters["coalesced"] == 1 and not same.done()
    leader.done.set_result(None)                  # not stored: the follower goes upstream itself
    assert await asyncio.wait_for(same, 30) is None


def _entry(size: int, at: float = 0.0) -> Entry:
    return Entry(200, (("Content-Type", "application/json"),), b"x" * size, False, CHAT, 3, at)


def test_store_budget_lru_and_ttl(monkeypatch):
    import ocache.response_cache as rc

    now = [1000.0]
    monkeypatch.setattr(rc.time, "monotonic", lambda: now[0])
    c = ResponseCache(ttl_s=10, max_mb=1)
    one = _entry(400_000, now[0])
    assert c.put("a", one) and c.put("b", _entry(400_000, now[0]))
    assert c.get("a") is one                  # a is now the most recently used
    assert c.put("c", _entry(400_000, now[0]))
    assert set(c.entries) == {"a", "c"} and c.counters["evicted"] == 1
    assert not c.put("big", _entry(2 << 20, now[0])) and c.counters["too_big"] == 1
    assert c.bytes == sum(e.size for e in c.entries.values())
    now[0] += 11
    assert c.get("a") is None and c.counters["expired"] == 1
    assert c.clear() == {"tier": "response", "cleared": 1} and c.bytes == 0


def test_fresh_ids_timestamps_and_figures():
    stored = {"id": "chatcmpl-AbCd1234", "created": 100, "object": "chat.completion",
              "choices": [{"message": {"role": "assistant", "content": "id: x",
                                       "tool_calls": [{"id": "Zz9", "type": "function"}]},
                           "logprobs": {"content": [{"id": 42, "token": "a"}]}}],
              "usage": {"prompt_tokens": 30, "completion_tokens": 4, "total_tokens": 34,
                        "prompt_tokens_details": {"cached_tokens": 2}},
              "timings": {"cache_n": 2, "prompt_n": 28, "prompt_ms": 9.5, "prompt_per_second": 3.0,
                          "predicted_n": 4, "predicted_ms": 2.0}}
    out = json.loads(Fresh(30, now=555).body(json.dumps(stored).encode()))
    assert out["id"].startswith("chatcmpl-") and out["id"] != stored["id"] and len(out["id"]) == len(stored["id"])
    assert out["created"] == 555
    assert out["choices"][0]["message"]["content"] == "id: x"
    assert out["choices"][0]["message"]["tool_calls"][0]["id"] != "Zz9"
    assert out["choices"][0]["logprobs"]["content"][0]["id"] == 42      # a token id stays
    assert out["usage"] == {**stored["usage"], "prompt_tokens_details": {"cached_tokens": 30}}
    assert out["timings"] == {"cache_n": 30, "prompt_n": 0, "prompt_ms": 0.0, "prompt_per_second": 0.0,
                              "predicted_n": 0, "predicted_ms": 0.0}


def test_fresh_stream_keeps_one_id_map_and_other_lines():
    f = Fresh(10, anthropic=True, now=7)
    sse = (b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_Q1","usage":'
           b'{"input_tokens":6,"cache_read_input_tokens":4}}}\n\n'
           b'event: content_block_start\ndata: {"type":"content_block_start","content_block":'
           b'{"type":"tool_use","id":"call_Q1"}}\n\ndata: [DONE]\n\n')
    out = f.stream(sse)
    lines = out.split(b"\n")
    assert lines[0] == b"event: message_start" and lines[-3] == b"data: [DONE]"
    start = json.loads(lines[1][5:])
    block = json.loads(lines[4][5:])
    assert start["message"]["usage"] == {"input_tokens": 0, "cache_read_input_tokens": 10}
    # the same random part gets the same new one within a replay
    assert start["message"]["id"][4:] == block["content_block"]["id"][5:] != "Q1"


@pytest.mark.parametrize("value,ok", [({"enabled": True, "ttl_s": 5, "max_mb": 0.5}, True),
                                      ({"enabled": "yes"}, False), ({"ttl": 5}, False),
                                      ({"max_mb": 0}, False), ({"ttl_s": True}, False)])
def test_config_keys_checked(value, ok):
    if ok:
        cfg = cfg_mod.load(env={}, overrides={"response_cache": value})
        assert ResponseCache.from_config(cfg) is not None
    else:
        with pytest.raises(cfg_mod.ConfigError, match="response_cache"):
            cfg_mod.load(env={}, overrides={"response_cache": value})
    assert ResponseCache.from_config(cfg_mod.Config()) is None        # off by default
