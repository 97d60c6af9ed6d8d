"""ocache.tokens: the token view against the real llama-server (tiny dense model), plus unit tests of
the pure helpers.

The integration tests compare the view with what the server itself reports for the same request:
``len(view.tokens) == timings.prompt_n + timings.cache_n`` (the server's prompt length), the
incremental tokenization with a full ``/tokenize``, and the head tokens of two opencode sessions
in different folders with each other.
"""

from __future__ import annotations

import asyncio
import copy
import tracemalloc
import types

import aiohttp
import pytest

from conftest import load_fixture
from ocache import fingerprint as fp
from ocache.tokens import (TextCache, TokenCache, TokenViewer, TokenViewError, find_seq, hard_boundary,
                           rec_bytes)

CHAT = "/v1/chat/completions"


# --- pure helpers ------------------------------------------------------------------------------

def test_hard_boundary_is_after_a_newline_before_a_non_space():
    text = "ab\n\ncd\n ef\nX"
    assert hard_boundary(text, len(text)) == text.index("X")
    assert hard_boundary(text, 9) == 4  # "\n " at 6-7 is skipped: a space may join the newline run
    assert hard_boundary(text, 3) == 0
    assert hard_boundary("no newline", 10) == 0
    assert hard_boundary("x\n\n\n", 4) == 0


def test_find_seq():
    assert find_seq([1, 2, 3, 1, 2, 1, 2, 3], [1, 2]) == [0, 3, 5]
    assert find_seq([1, 2, 3], [2, 4]) == []
    assert find_seq([1, 2], []) == []


def test_token_cache_lru_and_prefix_index():
    c = TokenCache(max_entries=2, max_tokens=100)
    c.put(b"a", [1, 2, 3], [(b"a1", 1)])
    c.put(b"b", [4, 5], [(b"b1", 1)])
    assert c.prefix(b"a1") == [1] and c.get(b"a") == [1, 2, 3]  # "a" is now the most recent
    c.put(b"c", [6], [])
    assert c.get(b"b") is None and c.prefix(b"b1") is None  # LRU "b" evicted with its prefixes
    assert c.get(b"a") == [1, 2, 3] and c.n_tokens == 4
    c.put(b"big", list(range(99)), [])
    assert c.n_tokens <= 100 and c.get(b"big") is not None


def test_view_caches_are_bounded_by_bytes_over_a_long_conversation():
    """A 128k-token conversation adds a full-length token list and text every turn; the caches
    must hold at most their byte budgets however many turns pass (issue 17: RSS flat), measured
    with tracemalloc, not only by their own accounting."""
    budget_tokens, budget_text = 8 << 20, 4 << 20
    tc, rc = TokenCache(max_bytes=budget_tokens), TextCache(max_bytes=budget_text)
    base = list(range(1000, 1000 + 120_000))
    text = "x" * 400_000
    tracemalloc.start()
    try:
        peaks = []
        for turn in range(40):
            # a new full-length list every turn (head + tail), whose 300 new ids are new objects
            tokens = base + [200_000 + turn * 300 + j for j in range(300)]
            tc.put(turn.to_bytes(4, "big"), tokens, [(b"p%d" % turn, 10)])
            rc.put(turn.to_bytes(4, "big"), text + str(turn))
            assert tc.n_bytes <= budget_tokens and rc.n_bytes <= budget_text
            peaks.append(tracemalloc.get_traced_memory()[0])
        # what stays allocated after turn 10 no longer grows with the turns
        assert max(peaks[10:]) <= budget_tokens + budget_text + (2 << 20)
        assert max(peaks[20:]) - min(peaks[20:]) <= 256 << 10
    finally:
        tracemalloc.stop()
    assert len(tc.records) < 40 and len(rc) < 40
    assert tc.get((39).to_bytes(4, "big")) is not None and tc.get((0).to_bytes(4, "big")) is None
    assert rec_bytes(100, 2) == 56 + 800 + 320


# --- against the real server --------------------------------------------------------------------

def _grown_conversation() -> list[dict]:
    """An opencode conversation growing turn by turn, with the shapes the template treats
    specially: reasoning, string and object arguments, two tool results in one turn, a user turn
    in the middle, a later system message."""
    body = load_fixture("opencode_agent_turn1.json")
    out = [copy.deepcopy(body)]

    def add(*msgs):
        body["messages"] += list(msgs)
        out.append(copy.deepcopy(body))

    def call(i, args, content="", reasoning=None):
        m = {"role": "assistant", "content": content,
             "tool_calls": [{"id": f"c{i}", "type": "function", "function": {"name": "read", "arguments": args}}]}
        if reasoning:
            m["reasoning_content"] = reasoning
        return m

    add(call(1, '{"filePath":"/a.py"}', reasoning="look at a"), {"role": "tool", "tool_call_id": "c1",
                                                                 "content": "def a():\n    return 1\n"})
    add(call(2, {"filePath": "/b.py"}, content="Reading b."),
        {"role": "tool", "tool_call_id": "c2", "content": "ünïcödé ✓ <tool_call> in a file\n"})
    m = call(3, '{"filePath":"/c.py"}')
    m["tool_calls"].append({"id": "c4", "type": "function", "function": {"name": "read", "arguments": '{"filePath":"/d.py"}'}})
    add(m, {"role": "tool", "tool_call_id": "c3", "content": "c"}, {"role": "tool", "tool_call_id": "c4", "content": "d"})
    add({"role": "assistant", "content": "Done."}, {"role": "user", "content": "now test it"})
    add({"role": "system", "content": "a later system message"}, {"role": "user", "content": "go"})
    add(call(5, '{"filePath":"/e.py"}'), {"role": "tool", "tool_call_id": "c5", "content": "e" * 3000})
    return out


async def test_a_view_after_the_shared_session_closed_is_a_view_error():
    """ocache closes the upstream's HTTP session while it stops; a background full-render check
    (``_verify``) still running then must end as a ``TokenViewError`` (skipped, logged at debug),
    not an aiohttp ``RuntimeError('Session is closed')`` left in a task nobody awaits."""
    session = aiohttp.ClientSession()
    await session.close()
    viewer = TokenViewer(types.SimpleNamespace(base_url="http://127.0.0.1:9", session=session, epoch=1))
    with pytest.raises(TokenViewError, match="session is closed"):
        await viewer.post("/apply-template", {"messages": []})
    await viewer._verify({"messages": []}, b"k", "text")    # returns: the check is skipped


@pytest.mark.server
async def test_delta_render_equals_the_full_render(start_server):
    """Each turn of a growing conversation is rendered from the previous turn's text plus the new
    messages alone, and equals the server's full render of the whole body."""
    srv = start_server("dense")
    viewer = TokenViewer(srv.url, verify_first=100)
    try:
        bodies = _grown_conversation()
        for i, body in enumerate(bodies):
            payload = {k: body[k] for k in ("messages", "tools", "tool_choice") if k in body}
            text = await viewer.render(body)
            assert text == await viewer.render_full(payload), i
        await viewer.wait_verified()
        # every turn after the first is a delta, except the one that starts with a system message
        assert viewer.counters["delta_renders"] == len(bodies) - 2
        assert viewer.counters["delta_verified"] == len(bodies) - 2
        assert viewer.counters["delta_mismatch"] == 0 and viewer.delta_ok
    finally:
        await viewer.close()


@pytest.mark.server
async def test_the_full_render_check_waits_until_no_completion_is_in_flight(start_server):
    """The background check of a delta render asks the server for a full render of the whole
    conversation (60-160 ms of its CPU at 32k tokens): it runs only once no completion is in
    flight on the upstream (``Upstream.generation``), so it never competes with a decode; after
    ``verify_wait_s`` of completions without a pause it runs anyway, counted ``delta_verify_late``."""
    from ocache.upstream import Upstream

    srv = start_server("dense")
    up = Upstream(srv.url)
    await up.start(monitor=False)
    viewer = TokenViewer(up, verify_first=100)
    full_renders = []
    render_full = viewer.render_full

    async def counted(payload):
        full_renders.append(len(payload.get("messages") or ()))
        return await render_full(payload)

    viewer.render_full = counted
    try:
        b0, b1, b2 = _grown_conversation()[:3]
        await viewer.render(b0)
        full_renders.clear()
        with up.generation():  # the request of b1 is in flight (planned, then streaming)
            await viewer.render(b1)  # (the delta's own render: the stub and the new messages)
            assert viewer.counters["delta_renders"] == 1 and len(viewer._verifying) == 1
            full_renders.clear()
            # let the check run up to where it waits (loop turns, not time)
            for _ in range(1000):
                if up._quiet._waiters:
                    break
                await asyncio.sleep(0)
            assert up._quiet._waiters, "the check did not wait for the completion in flight"
            assert full_renders == [] and viewer.counters["delta_verified"] == 0
        await viewer.wait_verified()  # the completion ended: the check ran
        assert full_renders == [len(b1["messages"])] and viewer.counters["delta_verified"] == 1
        assert viewer.counters["delta_verify_late"] == 0
        # completions without a pause: the check runs after verify_wait_s, counted late
        viewer.verify_wait_s = 0.05
        with up.generation():
            await viewer.render(b2)
            await viewer.wait_verified()
        assert viewer.counters["delta_verified"] == 2 and viewer.counters["delta_verify_late"] == 1
    finally:
        await viewer.close()
        await up.close()


@pytest.mark.server
async def test_a_wrong_delta_render_is_found_and_switches_deltas_off(dense):
    """The append-only claim is checked in the background: a delta that differs from the full
    render (here: a remembered prefix made one character short) is counted, replaced by the full
    render in the cache, and later turns are rendered in full."""
    _, viewer = dense
    b0, b1, b2 = _grown_conversation()[:3]
    await viewer.render(b0)
    (digest, (key, n)), = viewer.msg_prefixes.items()
    viewer.msg_prefixes[digest] = (key, n - 1)
    wrong = await viewer.render(b1)
    await viewer.wait_verified()
    full = await viewer.render_full({k: b1[k] for k in ("messages", "tools", "tool_choice")})
    assert wrong != full
    assert viewer.counters["delta_mismatch"] == 1 and not viewer.delta_ok
    assert await viewer.render(b1) == full  # the cache now holds the full render
    renders = viewer.counters["renders"]
    assert await viewer.render(b2) == await viewer.render_full(
        {k: b2[k] for k in ("messages", "tools", "tool_choice")})
    assert viewer.counters["renders"] == renders + 1 and viewer.counters["delta_renders"] == 1


@pytest.fixture
async def dense(start_server):
    """(the tiny dense model's server, a TokenViewer of it); the viewer is closed after the test."""
    srv = start_server("dense")
    viewer = TokenViewer(srv.url)
    yield srv, viewer
    await viewer.close()


async def _chat(url: str, body: dict) -> dict:
    """The same request, non-streamed with one generated token; returns the response JSON."""
    b = copy.deepcopy(body)
    for k in ("stream_options", "max_completion_tokens"):
        b.pop(k, None)
    b.update(stream=False, max_tokens=1)
    async with aiohttp.ClientSession() as s:
        async with s.post(url + CHAT, json=b) as r:
            assert r.status == 200, await r.text()
            return await r.json()


async def _full_tokenize(url: str, text: str) -> list[int]:
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/tokenize", json={"content": text, "add_special": True,
                                                   "parse_special": True}) as r:
            assert r.status == 200
            return (await r.json())["tokens"]


async def _detokenize(url: str, tokens: list[int]) -> str:
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/detokenize", json={"tokens": tokens}) as r:
            return (await r.json())["content"]


@pytest.mark.server
@pytest.mark.parametrize("model", ["dense", "hybrid"])
async def test_view_length_equals_what_the_server_prefills(start_server, model):
    srv = start_server(model, n_parallel=1, ctx_size=16384)
    viewer = TokenViewer(srv.url)
    try:
        # in this order, so later requests also hit a partly cached slot (cache_n > 0)
        for name in ("opencode_agent_turn1.json", "opencode_agent_turn1_after_tool.json",
                     "opencode_title.json", "opencode_run4_continue_turn2_after_tool.json",
                     "pi_turn1.json", "pi_turn1_after_tool.json"):
            body = load_fixture(name)
            view = await viewer.view(CHAT, body, fp.harness_head(body))
            res = await _chat(srv.url, body)
            t = res["timings"]
            assert len(view.tokens) == t["prompt_n"] + t["cache_n"], name
            assert len(view.tokens) == res["usage"]["prompt_tokens"], name
    finally:
        await viewer.close()


@pytest.mark.server
async def test_view_of_raw_completion_prompts(dense):
    srv, viewer = dense
    body = load_fixture("pi_turn1.json")
    text = await viewer.render(body)
    v = await viewer.view("/completion", {"prompt": text, "n_predict": 1})
    assert v.tokens == await _full_tokenize(srv.url, text) and v.head_end is None
    assert (await viewer.view("/completion", {"prompt": v.tokens[:50]})).tokens == v.tokens[:50]
    mixed = await viewer.view("/completion", {"prompt": [v.tokens[0], "hello world"]})
    assert mixed.tokens[0] == v.tokens[0] and len(mixed.tokens) > 1
    async with aiohttp.ClientSession() as s:
        async with s.post(srv.url + "/completion", json={"prompt": text, "n_predict": 1}) as r:
            t = (await r.json())["timings"]
    assert len(v.tokens) == t["prompt_n"] + t["cache_n"]
    with pytest.raises(TokenViewError):
        await viewer.view("/completion", {"prompt": ["a", "b"]})  # two prompts = two tasks
    with pytest.raises(TokenViewError) as err:
        await viewer.view(CHAT, {"messages": "nope"})
    assert err.value.status == 400


@pytest.mark.server
async def test_incremental_tokenization_equals_a_full_tokenize(dense):
    srv, viewer = dense
    probe = await viewer.probe()
    assert probe["incremental"] and probe["n_bos"] == 0  # Qwen vocab: no BOS, no EOS added
    conversation = ["opencode_agent_turn1.json", "opencode_agent_turn1_after_tool.json",
                    "opencode_run4_continue_turn2.json", "opencode_run4_continue_turn2_after_tool.json",
                    "pi_turn1.json", "pi_turn1_after_tool.json"]
    for name in conversation:
        text = await viewer.render(load_fixture(name))
        before = viewer.counters["tokenized_chars"]
        tokens = await viewer.tokenize(text)
        assert tokens == await _full_tokenize(srv.url, text), name
        if name.endswith("after_tool.json"):
            # only the part after the longest cached boundary prefix went to /tokenize
            assert viewer.counters["tokenized_chars"] - before < len(text) // 4, name
    assert viewer.counters["prefix_hits"] >= 3
    # a continuation that starts right at a cached boundary, and one that starts with one
    text = await viewer.render(load_fixture("opencode_agent_turn1_after_tool.json"))
    cut = text.rindex("<|im_start|>")
    for t in (text[:cut] + "<|im_start|>user\nünïcödé ✓ <tool_call>\n", "<|im_start|>system\nx"):
        assert await viewer.tokenize(t) == await _full_tokenize(srv.url, t)


@pytest.mark.server
async def test_head_end_tokens_are_identical_for_sessions_in_two_folders(dense):
    srv, viewer = dense
    views, heads = {}, {}
    for name in ("opencode_run2_agent_turn1.json", "opencode_run3_proj2_agent_turn1.json",
                 "opencode_run3_proj2_agent_turn1_after_tool.json"):
        body = load_fixture(name)
        heads[name] = fp.harness_head(body)
        views[name] = await viewer.view(CHAT, body, heads[name])
    a, b, c = views.values()
    assert a.head_end is not None and a.head_end == b.head_end == c.head_end
    assert a.tokens[: a.head_end] == b.tokens[: b.head_end] == c.tokens[: c.head_end]
    assert a.tokens != b.tokens
    assert viewer.counters["head_renders"] == 1  # the cut render is done once per head
    # the head is the tools block plus the system text up to the first marker
    head_text = await _detokenize(srv.url, a.tokens[: a.head_end])
    assert a.text.startswith(head_text)
    assert a.text[len(head_text):].startswith(heads["opencode_run2_agent_turn1.json"].marker)
    assert head_text.endswith(heads["opencode_run2_agent_turn1.json"].system_head)
    assert '"name":"webfetch"' in head_text.replace(" ", "")
    # the first differing token (the folder, inside <env>) lies after the head
    lcp = next(i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y)
    assert lcp >= a.head_end


@pytest.mark.server
async def test_user_starts_and_pi_head(dense):
    _, viewer = dense
    body = load_fixture("pi_turn1_after_tool.json")
    view = await viewer.view(CHAT, body, fp.harness_head(body))
    probe = await viewer.probe()
    turns = sum(1 for i, m in enumerate(body["messages"])
                if m["role"] == "user" or (m["role"] == "tool" and body["messages"][i - 1]["role"] != "tool"))
    assert len(view.user_starts) == turns >= 2
    for i in view.user_starts:
        assert view.tokens[i: i + len(probe["user_ids"])] == probe["user_ids"]
    assert view.head_end is not None and view.head_end < view.user_starts[0]
    other = copy.deepcopy(body)
    other["messages"][0]["content"] = other["messages"][0]["content"].replace("2026-11-29", "2027-02-03")
    other_view = await viewer.view(CHAT, other, fp.harness_head(other))
    assert other_view.head_end == view.head_end
    assert other_view.tokens[: view.head_end] == view.tokens[: view.head_end]
    unknown = copy.deepcopy(body)
    unknown["messages"][0]["content"] = "A harness without markers."
    assert fp.harness_head(unknown) is None
    assert (await viewer.view(CHAT, unknown, None)).head_end is None


@pytest.mark.server
async def test_new_upstream_epoch_clears_the_caches_and_api_key_is_sent(start_server):
    srv = start_server("dense", api_key="sekret")
    upstream = types.SimpleNamespace(base_url=srv.url, session=None, api_key="sekret", epoch=1)
    viewer = TokenViewer(upstream)
    try:
        body = load_fixture("pi_turn1.json")
        first = await viewer.view(CHAT, body)
        await viewer.view(CHAT, body)
        assert viewer.counters["renders"] == 1 and viewer.counters["render_hits"] == 1
        upstream.epoch = 2  # a restarted server may render or tokenize differently
        again = await viewer.view(CHAT, body)
        assert viewer.counters["renders"] == 2 and again.tokens == first.tokens
        anonymous = TokenViewer(srv.url)
        with pytest.raises(TokenViewError) as err:
            await anonymous.view(CHAT, body)
        assert err.value.status == 401
        await anonymous.close()
    finally:
        await viewer.close()
