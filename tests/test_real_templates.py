"""The tiny models served with the chat templates users run (the pinned source's
``models/templates/``), beside ocache's own append-only one.

``serve_template`` starts a tiny model with ``--chat-template-file``; the tests here show the
history rewrite that makes a new user message re-prefill a whole agent loop on those templates and
not on ocache's. The measurement of that loop with the server's own generations is
``scripts/measure-align``.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from ocache.toolchain import engine

#: the thinking template each tiny model is served with (both in the pinned source)
TEMPLATES = {"hybrid": "Qwen3.5-4B.jinja", "dense": "Qwen-Qwen3-0.6B.jinja"}


@pytest.fixture
def serve_template(start_server):
    """Factory: ``serve_template(model, template=None, **LlamaServer fields)``: ``start_server``
    with ``--chat-template-file`` of the pinned source's ``models/templates/<template>`` (default:
    ``TEMPLATES[model]``); ``template="ocache"`` serves the model's own template."""
    def _serve(model: str = "hybrid", template: str | None = None, **kw):
        name = template or TEMPLATES[model]
        args = list(kw.pop("args", []))
        if name != "ocache":
            args += ["--chat-template-file", str(engine.chat_template_file(name))]
        return start_server(model, args=args, **kw)
    return _serve


def _post(url: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _render(url: str, messages: list[dict]) -> str:
    return _post(url, "/apply-template", {"messages": messages})["prompt"]


CONVERSATION = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Read the proxy."},
    {"role": "assistant", "content": "", "reasoning_content": "I should read the file first.",
     "tool_calls": [{"id": "c1", "type": "function",
                     "function": {"name": "read", "arguments": "{\"filePath\": \"ocache/proxy.py\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "import asyncio\n"},
    {"role": "assistant", "content": "It relays requests.", "reasoning_content": "The file is short."},
]


@pytest.mark.parametrize("model", ["hybrid", "dense"])
def test_a_new_user_message_rewrites_the_loop_on_the_real_template_only(serve_template, model):
    """On Qwen3.5's and Qwen3's templates the prompt of a new user message no longer holds the
    previous turn's prompt: the reasoning of every assistant turn since the last user message is
    dropped (``loop.index0 > ns.last_query_index``), so the prompt parts at the first of them. On
    ocache's template it is a byte extension. The served template is the file's (``/props``)."""
    name = TEMPLATES[model]
    srv = serve_template(model)
    with urllib.request.urlopen(srv.url + "/props", timeout=30) as r:
        props = json.loads(r.read())
    assert props["chat_template"] == engine.chat_template_file(name).read_text()
    before = _render(srv.url, CONVERSATION[:-1])
    after = _render(srv.url, CONVERSATION + [{"role": "user", "content": "Thanks."}])
    assert "I should read the file first." in before
    assert "I should read the file first." not in after
    assert not after.startswith(before)
    # where the two part: inside the first assistant turn after the user message
    common = next(i for i, (a, b) in enumerate(zip(before, after)) if a != b)
    assert before[:common].endswith("Read the proxy.<|im_end|>\n<|im_start|>assistant\n<t")

    own = serve_template(model, template="ocache")
    before = _render(own.url, CONVERSATION[:-1])
    after = _render(own.url, CONVERSATION + [{"role": "user", "content": "Thanks."}])
    assert after.startswith(before.removesuffix("<|im_start|>assistant\n<think>\n"))


# ---------------------------------------------------------------------------------------------
# alignment through ocache (ocache/align.py, ocache/cache/align_route.py, patches/0008)

TOOLS = [{"type": "function", "function": {
    "name": "read", "description": "Read a file.",
    "parameters": {"type": "object", "properties": {"filePath": {"type": "string", "enum": ["a.py", "b.py"]}},
                   "required": ["filePath"]}}}]
WORDS = '[a-z] [a-z]{1,9} (" " [a-z]{1,9}){6,12} "\\n</think>\\n\\n"'
#: the generated turns (the tiny model under a grammar, so that each ends with end of turn):
#: Qwen3.5's generation prompt opens the think block, the call is its XML format
CALL = ('root ::= ' + WORDS + ' "<tool_call>\\n<function=read>\\n<parameter=filePath>\\n" ("a.py" | "b.py") '
        '"\\n</parameter>\\n</function>\\n</tool_call>"')
ANSWER = 'root ::= ' + WORDS + ' [A-Z] [a-z]{1,9} (" " [a-z]{1,9}){3,8} "."'


def _chat(url: str, body: dict) -> tuple[dict, dict]:
    """One chat request; a streamed one (``"stream": true``) is read whole and given back in the
    non-streamed shape (the message from the deltas, the last chunk's ``timings`` and ``usage``)."""
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        raw, headers = r.read(), dict(r.headers)
    if not body.get("stream"):
        return json.loads(raw), headers
    msg: dict = {"role": "assistant", "content": ""}
    out: dict = {"choices": [{"message": msg}]}
    for line in raw.decode().splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        obj = json.loads(line[6:])
        for c in obj.get("choices") or ():
            d = c.get("delta") or {}
            for k in ("content", "reasoning_content"):
                if d.get(k):
                    msg[k] = msg.get(k, "") + d[k]
            if c.get("finish_reason"):
                out["choices"][0]["finish_reason"] = c["finish_reason"]
        for k in ("timings", "usage"):
            if obj.get(k):
                out[k] = obj[k]
    return out, headers


def answered_as_cold(srv, slots: Path, slot: int, n_prompt: int) -> list[int]:
    """Save ``slot`` (to ``slots``) and check that what it generated after the ``n_prompt`` tokens
    served is what a cold prefill of the same tokens in the other slot generates. Returns the tokens
    it generated."""
    from test_patch import slot_file_tokens

    _post(srv.url, f"/slots/{slot}?action=save", {"filename": "served.bin"})
    held = slot_file_tokens(slots / "served.bin")
    served, generated = held[:n_prompt], held[n_prompt:]
    cold = _post(srv.url, "/completion", {"prompt": served, "n_predict": len(generated), "id_slot": 1 - slot,
                                          "cache_prompt": False, "return_tokens": True, "temperature": 0})
    assert cold["timings"]["cache_n"] == 0 and cold["tokens"] == generated
    return generated


def switched_off(serve_template, tmp_path: Path, monkeypatch, tiers: str):
    """A new hybrid server (two slots, no slot folder) and ``ocache serve`` in front of it with
    ``OCACHE_TIERS=tiers`` (a feature switched off), started: (the server, the ocache process)."""
    from ocache.bench.run import OCacheProcess

    monkeypatch.setenv("OCACHE_TIERS", tiers)
    srv = serve_template("hybrid", n_parallel=2, ctx_size=16384, flash_attn="on", slot_save_path=None)
    return srv, OCacheProcess(srv.url, tmp_path / "cache-off", tmp_path / "ocache-off.log").start()


def _prefilled(url: str) -> int:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return int(float(next(ln.split()[-1] for ln in text.splitlines()
                          if ln.startswith("llamacpp:prompt_tokens_total"))))


def _loop(url: str, server: str, stream: bool = False) -> list[tuple[dict, dict, int]]:
    """A tool turn, its result, the answer, a new user message: the client drops the reasoning and
    sends every turn back as it came. Returns (answer, headers, the server's prefill) per request."""
    msgs = [{"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "Read a file, then say what it does."}]
    out = []
    for grammar, max_tokens in ((CALL, 200), (ANSWER, 200), (None, 12)):
        body = {"messages": msgs, "tools": TOOLS, "tool_choice": "none", "temperature": 0, "max_tokens": max_tokens,
                "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
        if grammar:
            body["grammar"] = grammar
        before = _prefilled(server)
        res, headers = _chat(url, body)
        out.append((res, headers, _prefilled(server) - before))
        msg = res["choices"][0]["message"]
        if grammar is CALL:
            msgs = msgs + [{"role": "assistant", "content": msg["content"]},
                           {"role": "tool", "tool_call_id": "c1", "content": engine.chat_template_file(
                               TEMPLATES["hybrid"]).read_text()[:1500]}]
        elif grammar is ANSWER:
            msgs = msgs + [{"role": "assistant", "content": msg["content"]},
                           {"role": "user", "content": "Thanks. Which file would you change first?"}]
    return out


def test_a_rewritten_history_is_served_from_the_slots_own_tokens_through_ocache(serve_template, tmp_path,
                                                                                monkeypatch):
    """Alignment on the real Qwen3.5 template, tiny hybrid, the server's own generations: through
    ocache each turn after the first is aligned (``X-OCache-Aligned``: the slot's tokens + the new
    part) and the server prefills only the new part (its counter moves by ``prompt_n``, tens of
    tokens for the new user message where alone the template's rewrite re-prefills the whole
    prompt); the answer equals a cold prefill of the prompt actually served (the slot's file: that
    prompt + the tokens generated but the last). With ``tiers.resident.align: false`` nothing is
    aligned and the prompt is the template's."""
    from ocache.bench.run import OCacheProcess

    srv = serve_template("hybrid", n_parallel=2, ctx_size=16384, flash_attn="on")
    alone = _loop(srv.url, srv.url)
    # alone: everything from the first rewritten turn on again (the server resumes at its
    # checkpoint at the user message before it)
    assert alone[2][2] > 300
    srv.stop()

    srv = serve_template("hybrid", n_parallel=2, ctx_size=16384, flash_attn="on")
    prox = OCacheProcess(srv.url, tmp_path / "cache", tmp_path / "ocache.log", slot_save_path=tmp_path / "slots").start()
    try:
        turns = _loop(prox.url, srv.url)
        stats = (prox.stats() or {})["layer"]["align"]
    finally:
        prox.stop()
    assert "X-OCache-Aligned" not in turns[0][1]
    for res, headers, prefilled in turns[1:]:
        kept, new = map(int, headers["X-OCache-Aligned"].split("+"))
        t = res["timings"]
        assert t["cache_n"] == kept and t["prompt_n"] == new == prefilled, (headers, t)
        assert res["usage"]["prompt_tokens"] == kept + new
    last, headers, prefilled = turns[2]
    assert prefilled <= 40, (prefilled, alone[2][2])
    assert stats["aligned"] == 2

    # the answer equals a cold prefill of the prompt served (saved from the slot it ran on)
    generated = answered_as_cold(srv, tmp_path / "slots", int(headers["X-OCache-Slot"]),
                                 last["usage"]["prompt_tokens"])
    assert len(generated) == last["timings"]["predicted_n"] - 1 >= 8
    srv.stop()

    # alignment off: every prompt is the template's (the client's render), byte for byte
    srv, prox = switched_off(serve_template, tmp_path, monkeypatch, "{resident: {align: false}}")
    try:
        off = _loop(prox.url, srv.url)
    finally:
        prox.stop()
    assert all("X-OCache-Aligned" not in h for _, h, _ in off)
    assert [r["usage"]["prompt_tokens"] for r, _, _ in off] == [r["usage"]["prompt_tokens"] for r, _, _ in alone]
    assert off[2][2] > 300


def test_a_streamed_conversation_is_aligned_too(serve_template, tmp_path):
    """The same loop streamed (as opencode and most agents ask): ocache builds each relayed answer
    from the stream's deltas (``Observation.message``) and aligns the next turns."""
    from ocache.bench.run import OCacheProcess

    srv = serve_template("hybrid", n_parallel=2, ctx_size=16384, flash_attn="on")
    prox = OCacheProcess(srv.url, tmp_path / "cache", tmp_path / "ocache.log", slot_save_path=tmp_path / "slots").start()
    try:
        turns = _loop(prox.url, srv.url, stream=True)
    finally:
        prox.stop()
    assert "X-OCache-Aligned" not in turns[0][1]
    for res, headers, prefilled in turns[1:]:
        kept, new = map(int, headers["X-OCache-Aligned"].split("+"))
        assert res["timings"]["prompt_n"] == new == prefilled and res["timings"]["cache_n"] == kept
    assert turns[2][2] <= 40


@pytest.mark.server
@pytest.mark.parametrize("model", ["hybrid", "dense"])
async def test_the_token_view_renders_a_rewritten_history_in_full(serve_template, model):
    """A delta render (the previous turn's text + the new messages alone, ``TokenViewer.render``)
    is only sound on an append-only template: on Qwen3.5's and Qwen3's own it would keep the
    reasoning the server's render drops at a new user message, a wrong token view for the very
    request alignment plans. The viewer probes the template once per set of render fields and
    renders in full there; on ocache's own template the same turn is still a delta."""
    from ocache.tokens import TokenViewer

    # the tool turn (ends with the tool result: the server adds the generation prompt), then the
    # answer and a new user message, which drops the tool turn's reasoning on the real template
    turns = [CONVERSATION[:4], CONVERSATION + [{"role": "user", "content": "Thanks."}]]
    for template, deltas in ((None, 0), ("ocache", 1)):
        srv = serve_template(model, template=template)
        viewer = TokenViewer(srv.url, verify_first=100)
        try:
            for msgs in turns:
                assert await viewer.render({"messages": msgs}) == _render(srv.url, msgs)
            await viewer.wait_verified()
            assert viewer.counters["delta_renders"] == deltas, template
            assert viewer.counters["delta_mismatch"] == 0
        finally:
            await viewer.close()


# ---------------------------------------------------------------------------------------------
# Claude Code and Codex on Qwen3.5's template: the server rejects their message order

#: (fixture, route) of one request of each client whose converted messages Qwen3.5's template
#: rejects: Claude Code 2.1.328 puts a ``system`` message after the user message, Codex 0.169.0
#: sends two ``developer`` items, which the server maps to ``system`` (common/chat.cpp:1004-1012)
REJECTED = [("claude_run1_agent_turn1.json", "/v1/messages"), ("codex_run1_turn1.json", "/v1/responses")]
REJECTION = "System message must be at the beginning."


def _raw(url: str, path: str, body: dict) -> tuple[int, bytes]:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_claude_code_and_codex_get_the_servers_own_error_through_ocache(serve_template, tmp_path):
    """On the tiny hybrid with Qwen3.5's template llama-server alone answers every Claude Code
    and Codex request with HTTP 500, the template's ``raise_exception`` (line 85): nothing is
    prefilled, so there is nothing for ocache to plan. Through ocache the client gets that answer,
    status and bytes, streamed or not (fail open: bad input gets the upstream's answer)."""
    from conftest import load_fixture
    from ocache.bench.run import OCacheProcess

    srv = serve_template("hybrid", n_parallel=2, ctx_size=16384)
    prox = OCacheProcess(srv.url, tmp_path / "cache", tmp_path / "ocache.log",
                         slot_save_path=tmp_path / "slots").start()
    try:
        for name, path in REJECTED:
            for stream in (False, True):
                body = {**load_fixture(name), "stream": stream, "max_tokens": 4}
                alone = _raw(srv.url, path, body)
                assert alone[0] == 500 and REJECTION in json.loads(alone[1])["error"]["message"], alone
                assert _raw(prox.url, path, body) == alone, (name, stream)
    finally:
        prox.stop()


async def test_the_bench_reports_requests_the_server_rejects_instead_of_aborting(serve_template,
                                                                                tmp_path):
    """The bench on that setup: every request is answered with the server's 500, and the
    measurement records each as an error row carrying the server's reason. Before, the
    measurement tokenized the raw Anthropic body at ``/apply-template`` after the token view failed
    ("Failed to parse tools: Missing tool type", a message of the bench's own making) and the raw
    Responses body not at all ("cannot tokenize a body without messages"), and aborted the scenario."""
    from conftest import FIXTURES
    from ocache.bench.replay import Target, load_scenario, measure, replay

    (tmp_path / "sc.yaml").write_text("name: rejected\nmax_tokens: 4\ngap_s: 0\nsteps:\n" + "".join(
        f"  - send: {name}\n    path: {path}\n" for name, path in REJECTED))
    if not FIXTURES.is_dir():
        # deliberate: the captures are third-party text kept in ../shared, never in the repository;
        # a clone without them still runs the rest (every full run of this stop: no skip fired)
        pytest.skip(f"fixtures folder {FIXTURES} not found")
    sc = load_scenario(tmp_path / "sc.yaml", FIXTURES)
    srv = serve_template("hybrid", n_parallel=2, ctx_size=16384)
    sent = await replay(sc, Target(srv.url, srv.url), time_scale=0)
    rows = await measure(sent, srv.url, grid=srv.ubatch)
    assert [r.label for r in rows] == [name.removesuffix(".json") for name, _ in REJECTED]
    for r in rows:
        assert r.error and r.error.startswith("HTTP 500") and "System message must be" in r.error, r.error
        assert r.n_tokens == 0 and r.exact is None and REJECTION in (r.note or ""), r.note
    # the report's summary says why
    from ocache.bench.run import Bench, ConfigRun

    bench = Bench.__new__(Bench)
    bench.results = {"hybrid": {"rejected": {"a": ConfigRun("a", rows, 1.0)}}}
    assert ("| 2 request errors (2 rejected by the server itself: Error: Jinja Exception: "
            f"{REJECTION}) |") in bench.summary_table()


@pytest.mark.parametrize("name,path", REJECTED)
async def test_the_bench_tokenizes_anthropic_and_responses_bodies_without_the_viewer(serve_template,
                                                                                   name, path):
    """``prompt_tokens`` without a token view (its fallback when the view fails) converts the
    body as the server does before rendering it: on Qwen3's template, which accepts both
    clients' message order, it gives the server's own count (``/v1/messages/count_tokens``,
    ``/v1/responses/input_tokens``) and the view's tokens. Before, it raised."""
    import aiohttp

    from conftest import load_fixture
    from ocache.bench.replay import prompt_tokens
    from ocache.tokens import TokenViewer

    body = load_fixture(name)
    srv = serve_template("dense")
    count = "/v1/messages/count_tokens" if path == "/v1/messages" else "/v1/responses/input_tokens"
    n = _post(srv.url, count, body)["input_tokens"]
    viewer = TokenViewer(srv.url, delta=False)
    try:
        async with aiohttp.ClientSession() as http:
            tokens = await prompt_tokens(http, srv.url, path, body)
        assert len(tokens) == n
        assert tokens == list((await viewer.view(path, body)).tokens)
    finally:
        await viewer.close()
