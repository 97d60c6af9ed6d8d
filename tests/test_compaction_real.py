"""The continued route on the real Qwen3.5 template, tiny hybrid, the server's own generations
(issue 26 item 3): an agent conversation (a tool turn, its result, the answer) through ocache, then
opencode's compaction of it, in the shape the real client sends (``ocache.compaction.opencode_request``,
checked against the capture in tests/test_compaction.py). The 20k-token measurement is
``scripts/measure-compaction``."""

from __future__ import annotations

import json
import urllib.request

import pytest

from ocache.compaction import opencode_request
from test_compaction import AFTER, SYSTEM
from test_real_templates import (ANSWER, CALL, TEMPLATES, TOOLS, _chat, _post, _prefilled,  # noqa: F401
                                 answered_as_cold, serve_template, switched_off)
from ocache.toolchain import engine

pytestmark = pytest.mark.server

#: the summary's length (tokens): the tiny model does not stop on its own
SUMMARY_TOKENS = 12


def _chat_as(url: str, body: dict, headers: dict | None) -> tuple[dict, dict]:
    """``_chat`` of a non-streamed body with the client's ``headers`` (a session key) added."""
    if not headers:
        return _chat(url, body)
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **headers})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read()), dict(r.headers)


def _conversation(url: str, server: str, keep: bool = False,
                  headers: dict | None = None) -> tuple[list[dict], list[dict]]:
    """A tool turn and the answer, each sent back as it came (the reasoning dropped, as opencode
    does for a model not marked ``interleaved``; ``keep``: sent back), with the client's
    ``headers``. Returns the messages with the answer and the response headers per request."""
    msgs = [{"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "Read a file, then say what it does."}]
    heads = []
    for grammar in (CALL, ANSWER):
        body = {"messages": msgs, "tools": TOOLS, "tool_choice": "none", "temperature": 0, "max_tokens": 200,
                "grammar": grammar}
        res, got = _chat_as(url, body, headers)
        heads.append(got)
        choice = res["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        msgs = msgs + [{"role": "assistant", "content": choice["message"]["content"]}]
        if keep and choice["message"].get("reasoning_content"):
            msgs[-1]["reasoning_content"] = choice["message"]["reasoning_content"]
        if grammar is CALL:
            msgs.append({"role": "tool", "tool_call_id": "c1",
                         "content": engine.chat_template_file(TEMPLATES["hybrid"]).read_text()[:3000]})
    return msgs, heads


def _compaction(url: str, server: str, msgs: list[dict], headers: dict | None = None) -> tuple[dict, dict, int, int]:
    """opencode's compaction of ``msgs`` with the client's ``headers``: (the answer, its headers, the
    server's prefill, the tokens of the request's own prompt as the server renders it)."""
    body = opencode_request(msgs, SYSTEM, AFTER, model="qwen", max_tokens=SUMMARY_TOKENS, temperature=0)
    prompt = _post(server, "/apply-template", {"messages": body["messages"]})["prompt"]
    n_sent = len(_post(server, "/tokenize", {"content": prompt, "add_special": True, "parse_special": True})["tokens"])
    before = _prefilled(server)
    res, got = _chat_as(url, body, headers)
    return res, got, _prefilled(server) - before, n_sent


def test_a_compaction_is_served_as_the_conversations_continuation(serve_template, tmp_path, monkeypatch):
    """Alone the compaction prefills its whole prompt (it shares no token with the conversation).
    Through ocache it is continued (``X-OCache-Continued: K+N``, ``X-OCache-Path: continued``): the
    server keeps the slot's K tokens and prefills only the instruction turn's N (its counter moves
    by N); the answer equals a cold prefill of the prompt actually served (the slot's file). With
    ``tiers.resident.continue_compaction: false`` it is forwarded as sent: the same prompt as alone.
    Fails on the code before the route: the compaction prefilled its whole prompt."""
    from ocache.bench.run import OCacheProcess

    srv = serve_template("hybrid", n_parallel=2, ctx_size=16384, flash_attn="on")
    msgs, _ = _conversation(srv.url, srv.url)
    alone, _, alone_prefill, n_alone = _compaction(srv.url, srv.url, msgs)
    assert alone["usage"]["prompt_tokens"] == n_alone
    assert alone_prefill >= n_alone - 16, (alone_prefill, n_alone)   # all of it (a ubatch's rounding aside)
    srv.stop()

    srv = serve_template("hybrid", n_parallel=2, ctx_size=16384, flash_attn="on")
    prox = OCacheProcess(srv.url, tmp_path / "cache", tmp_path / "ocache.log",
                         slot_save_path=tmp_path / "slots").start()
    try:
        got, _ = _conversation(prox.url, srv.url)     # its answer is aligned: the model saw its reasoning
        res, headers, prefilled, n_sent = _compaction(prox.url, srv.url, got)
        layer = (prox.stats() or {})["layer"]
        stats = layer["continued"]
    finally:
        prox.stop()
    # the table keeps the conversation in its slot (not marked unknown: that showed it empty and
    # sent every new request server-placed, as after an aligned answer before)
    row = next(s for s in layer["slots"] if str(s["id"]) == headers.get("X-OCache-Slot"))
    assert row["tokens"] > 0 and row["kind"] == "agent" and row["n_total"] >= n_sent - 600, row
    assert headers.get("X-OCache-Path") == "continued", (headers, open(tmp_path / "ocache.log").read()[-3000:])
    kept, new = map(int, headers["X-OCache-Continued"].split("+"))
    t = res["timings"]
    assert t["cache_n"] == kept and t["prompt_n"] == new == prefilled, (headers, t)
    assert new < 600 < n_sent and kept > n_sent // 2, (kept, new, n_sent)
    assert stats["requests"] == 1 and stats["saved_tokens"] == n_sent - new, stats

    # the answer equals a cold prefill of the prompt served (saved from the slot it ran on)
    n_prompt = res["usage"]["prompt_tokens"]
    assert n_prompt == kept + new
    generated = answered_as_cold(srv, tmp_path / "slots", int(headers["X-OCache-Slot"]), n_prompt)
    assert len(generated) == t["predicted_n"] - 1 >= SUMMARY_TOKENS - 1
    srv.stop()

    # switched off: forwarded as sent, the prompt the client's
    srv, prox = switched_off(serve_template, tmp_path, monkeypatch, "{resident: {continue_compaction: false}}")
    try:
        got, _ = _conversation(prox.url, srv.url)
        off, headers, off_prefill, n_off = _compaction(prox.url, srv.url, got)
    finally:
        prox.stop()
    assert "X-OCache-Continued" not in headers and headers.get("X-OCache-Path") != "continued"
    assert off["usage"]["prompt_tokens"] == n_off and off_prefill >= n_off - 16


def test_on_ocaches_own_template_too(serve_template, tmp_path):
    """On ocache's own template (past reasoning kept), a client that sends the reasoning back: the
    compaction is continued the same way (the server keeps the slot's K tokens and prefills the
    instruction turn)."""
    from ocache.bench.run import OCacheProcess

    srv = serve_template("hybrid", template="ocache", n_parallel=2, ctx_size=16384, flash_attn="on")
    prox = OCacheProcess(srv.url, tmp_path / "cache", tmp_path / "ocache.log",
                         slot_save_path=tmp_path / "slots").start()
    try:
        msgs, _ = _conversation(prox.url, srv.url, keep=True)
        res, headers, prefilled, n_sent = _compaction(prox.url, srv.url, msgs)
    finally:
        prox.stop()
    assert headers.get("X-OCache-Path") == "continued", (headers, (tmp_path / "ocache.log").read_text()[-3000:])
    kept, new = map(int, headers["X-OCache-Continued"].split("+"))
    assert res["timings"]["cache_n"] == kept and res["timings"]["prompt_n"] == new == prefilled < 600 < n_sent


def test_another_sessions_compaction_is_not_served_from_the_slot(serve_template, tmp_path):
    """Two opencode sessions (``x-session-affinity``) given the same first prompt: the greedy model
    gives the second the very history the first has (the case where every entry is equal: only the
    session tells them apart). The first session's compaction is continued from its slot; the
    second's, sent after it with its own session key, is forwarded as sent: the server prefills its
    whole prompt, and the log says why. Fails on the guard that compared the first and last user
    lines only: the second session's compaction came back ``X-OCache-Path: continued`` from the
    first's slot (as two opencode projects did with the same prompts)."""
    from ocache.bench.run import OCacheProcess

    alpha, beta = {"x-session-affinity": "ses_alpha"}, {"x-session-affinity": "ses_beta"}
    srv = serve_template("hybrid", n_parallel=2, ctx_size=16384, flash_attn="on")
    prox = OCacheProcess(srv.url, tmp_path / "cache", tmp_path / "ocache.log",
                         slot_save_path=tmp_path / "slots").start()
    try:
        msgs, _ = _conversation(prox.url, srv.url, headers=alpha)
        _, own, _, _ = _compaction(prox.url, srv.url, msgs, alpha)
        res, other, prefilled, n_sent = _compaction(prox.url, srv.url, msgs, beta)
        stats = (prox.stats() or {})["layer"]["continued"]
    finally:
        prox.stop()
    log = (tmp_path / "ocache.log").read_text()
    # the owner's compaction is continued (the record was there to be taken)
    assert own.get("X-OCache-Path") == "continued", (own, log[-3000:])
    # the other session's is not: no continuation from the first's slot, its own prompt prefilled
    assert other.get("X-OCache-Path") != "continued" and "X-OCache-Continued" not in other, (other, log[-3000:])
    assert res["usage"]["prompt_tokens"] == n_sent and prefilled >= n_sent - 64, (res["timings"], n_sent)
    assert stats["requests"] == 1 and stats.get("as_sent_another_session") == 1, stats
    assert "compaction not continued: another session" in log
