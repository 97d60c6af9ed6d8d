"""Exactness of alignment (issue 26, item 5), on the real Qwen3.5 template, tiny hybrid, the
server's own generations (the loop of ``tests/test_real_templates.py``: a tool turn under a
grammar, its result, the answer, a new user message; the client drops the reasoning).

* ``tiers.resident.align: false``: every prompt the server receives is byte for byte the
  template's rendering: the slot's tokens after each answer (its file, ``/slots/N?action=save``)
  begin with the tokens of ``/apply-template`` + ``/tokenize`` of the request as sent.
* on: every aligned request's greedy output equals a cold prefill of the prompt actually served
  (the slot's file: that prompt, then the tokens generated but the last), the same grammar and
  limit; and that prompt is the slot's previous content followed by the rendering's new part.
"""

from __future__ import annotations

import json
import urllib.request

from ocache.bench.run import OCacheProcess
from test_patch import slot_file_tokens
from test_real_templates import ANSWER, CALL, TOOLS, _chat, _post, serve_template  # noqa: F401
from ocache.toolchain import engine

USER = "Thanks. Which file would you change first?"


def _tokens(url: str, body: dict) -> list[int]:
    """The request's prompt as the server renders and tokenizes it (what a cold server prefills)."""
    prompt = _post(url, "/apply-template", {k: body[k] for k in ("messages", "tools") if k in body})["prompt"]
    return _post(url, "/tokenize", {"content": prompt, "add_special": True, "parse_special": True})["tokens"]


def _saved(srv, tmp_path, slot: int, name: str) -> list[int]:
    _post(srv.url, f"/slots/{slot}?action=save", {"filename": name})
    return slot_file_tokens(tmp_path / "slots" / name)


#: the loop's first messages: a coding agent's system prompt and a task that starts with a tool call
OPENING = [{"role": "system", "content": "You are a coding agent."},
           {"role": "user", "content": "Read a file, then say what it does."}]


def after_answer(msgs: list[dict], i: int, content: str, user: str) -> list[dict]:
    """The loop's messages after answer ``i`` (``content``): the first answer (a tool call) gets
    the tool's result (a chat template's text), later ones the user message ``user``."""
    if i == 0:
        return msgs + [{"role": "assistant", "content": content},
                       {"role": "tool", "tool_call_id": "c1",
                        "content": engine.chat_template_file("Qwen3.5-4B.jinja").read_text()[:1500]}]
    return msgs + [{"role": "assistant", "content": content}, {"role": "user", "content": user}]


def _play(url: str, srv, tmp_path, grammar_last: str | None):
    """The loop through ``url``; after each answer the slot it ran on is saved. Yields per request
    (body, response, headers, the slot's tokens)."""
    msgs = list(OPENING)
    for i, grammar in enumerate((CALL, ANSWER, grammar_last)):
        body = {"messages": msgs, "tools": TOOLS, "tool_choice": "none", "temperature": 0,
                "max_tokens": 200 if grammar else 12}
        if grammar:
            body["grammar"] = grammar
        res, headers = _chat(url, body)
        slot = int(headers["X-OCache-Slot"])
        yield body, res, headers, _saved(srv, tmp_path, slot, f"turn{i}.bin")
        msgs = after_answer(msgs, i, res["choices"][0]["message"]["content"], USER)


def test_with_alignment_off_every_prompt_is_the_templates_byte_for_byte(serve_template, tmp_path, monkeypatch):
    monkeypatch.setenv("OCACHE_TIERS", "{resident: {align: false}}")
    srv = serve_template("hybrid", n_parallel=2, ctx_size=16384, flash_attn="on")
    # ocache is not told the slot folder: no disk or session tier, the slots are the test's to save
    prox = OCacheProcess(srv.url, tmp_path / "cache", tmp_path / "ocache.log").start()
    try:
        turns = list(_play(prox.url, srv, tmp_path, None))
        stats = (prox.stats() or {})["layer"]["align"]
    finally:
        prox.stop()
    assert stats["enabled"] is False and not stats.get("aligned")
    for body, res, headers, held in turns:
        assert "X-OCache-Aligned" not in headers
        rendered = _tokens(srv.url, body)
        n_prompt = res["usage"]["prompt_tokens"]
        assert n_prompt == len(rendered)
        assert held[:n_prompt] == rendered
        assert len(held) == n_prompt + res["timings"]["predicted_n"] - 1


def test_every_aligned_answer_equals_a_cold_prefill_of_the_prompt_served(serve_template, tmp_path):
    srv = serve_template("hybrid", n_parallel=2, ctx_size=16384, flash_attn="on")
    prox = OCacheProcess(srv.url, tmp_path / "cache", tmp_path / "ocache.log",
                         slot_save_path=tmp_path / "slots").start()
    try:
        turns = list(_play(prox.url, srv, tmp_path, ANSWER))
        view = json.loads(urllib.request.urlopen(prox.url + "/ocache/api/view", timeout=30).read())
    finally:
        prox.stop()
    aligned = 0
    for (body, res, headers, held), (_, _, _, before) in zip(turns[1:], turns):
        kept, new = map(int, headers["X-OCache-Aligned"].split("+"))
        aligned += 1
        n_prompt = res["usage"]["prompt_tokens"]
        served, generated = held[:n_prompt], held[n_prompt:]
        # the prompt served: the slot's previous tokens, then the rendering's new part
        rendered = _tokens(srv.url, body)
        assert n_prompt == kept + new and served == before[:kept] + rendered[-new:]
        # README's header table: what the server prefilled and reused for it (the answer's timings)
        assert (int(headers["X-OCache-Prefilled"]), int(headers["X-OCache-Reused"]), headers["X-OCache-Split"]) == (
            res["timings"]["prompt_n"], res["timings"]["cache_n"], "0") == (new, kept, "0")
        assert served != rendered   # the template rewrote the history: this is not its prompt
        assert len(generated) == res["timings"]["predicted_n"] - 1 >= 8
        slot = int(headers["X-OCache-Slot"])
        cold = _post(srv.url, "/completion", {"prompt": served, "n_predict": body["max_tokens"],
                                              "grammar": body["grammar"], "id_slot": 1 - slot,
                                              "cache_prompt": False, "return_tokens": True,
                                              "temperature": 0})
        assert cold["timings"]["cache_n"] == 0
        assert cold["tokens"][:-1] == generated and len(cold["tokens"]) == len(generated) + 1
    assert aligned == 2
    # the dashboard's figures: both aligned requests, the tokens each kept and prefilled
    al = view["align"]
    assert al["aligned"] == 2 and [(r["kept"], r["new"]) for r in al["requests"]] == [
        tuple(map(int, h["X-OCache-Aligned"].split("+"))) for _, _, h, _ in turns[1:]]
    assert al["saved"] == sum(r["saved"] for r in al["requests"]) > 0
    assert al["saved_vs_slot"] == sum(r["saved_vs_slot"] for r in al["requests"]) > 0


def test_after_an_aligned_answer_the_table_keeps_the_slot_and_plans_new_chats_itself(serve_template, tmp_path):
    """Issue 26 follow-up (a newcomer's finding): after an aligned answer the slot table showed the
    slot empty (``tokens 0``, content unknown), so every new conversation went server-placed
    (``X-OCache-Slot: server``, ``X-OCache-Tier: none``) and two of them ran one after the other
    on one slot. The table must keep the conversation there: the ids ocache knows (the whole
    prompt served), the server's count, the owner; a new chat is planned by ocache, on the other
    slot."""
    srv = serve_template("hybrid", n_parallel=2, ctx_size=16384, flash_attn="on")
    prox = OCacheProcess(srv.url, tmp_path / "cache", tmp_path / "ocache.log").start()
    try:
        turns = list(_play(prox.url, srv, tmp_path, ANSWER))
        _, res, headers, held = turns[-1]
        assert "X-OCache-Aligned" in headers
        slot = int(headers["X-OCache-Slot"])
        row = next(s for s in prox.stats()["layer"]["slots"] if s["id"] == slot)
        # every id of the prompt served is known (the slot's ids, then the request's new part)
        assert row["tokens"] == res["usage"]["prompt_tokens"] == int(headers["X-OCache-Reused"]) + int(
            headers["X-OCache-Prefilled"])
        assert row["n_total"] == len(held) and row["kind"] == "agent"
        # refused on the aligned slot (the answer edited): the usual route plans it, on that slot,
        # not the server-placed route (which it took while the table had the slot unknown)
        body = dict(turns[-1][0], grammar=ANSWER, messages=turns[-1][0]["messages"] + [
            {"role": "assistant", "content": "Edited by the client."}, {"role": "user", "content": "And?"}])
        r, h = _chat(prox.url, body)
        assert "X-OCache-Aligned" not in h and (h["X-OCache-Slot"], h["X-OCache-Tier"]) == (str(slot), "resident")
        # what it reuses there, the first prompt's checkpoint, predicted (it was predicted 0: no checkpoints kept)
        assert int(h["X-OCache-Reused"]) == r["timings"]["cache_n"] > 0
        assert prox.stats()["layer"]["align"]["as_sent_answer_differs"] == 1
        other = {"messages": [{"role": "system", "content": "Another session entirely."},
                              {"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0}
        _, h = _chat(prox.url, other)
    finally:
        prox.stop()
    assert h["X-OCache-Slot"] == str(1 - slot) and h["X-OCache-Tier"] != "none"


def _agent_loop(url: str):
    """A tool loop as opencode or pi play it, streamed, on the server's own generations: a call,
    its result, the answer, a new user message, a call, its result, the answer. The client sends
    each call back parsed (``tool_calls``, the content before the call stripped) with its reasoning
    (``reasoning_content``). Yields per request (response, headers)."""
    msgs = [{"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "Read a file, then say what it does."}]
    tool_text = engine.chat_template_file("Qwen3.5-4B.jinja").read_text()
    for i, grammar in enumerate((CALL, ANSWER, CALL, ANSWER)):
        body = {"messages": msgs, "tools": TOOLS, "tool_choice": "none", "temperature": 0, "stream": True,
                "max_tokens": 200, "grammar": grammar}
        res, headers = _chat(url, body)
        yield res, headers
        msg = res["choices"][0]["message"]
        content = msg["content"]
        if grammar == CALL:
            path = content.split("<parameter=filePath>\n", 1)[1].split("\n", 1)[0]
            msgs = msgs + [{"role": "assistant", "content": content[:content.index("<tool_call>")].strip(),
                            "reasoning_content": msg.get("reasoning_content", ""),
                            "tool_calls": [{"id": f"c{i}", "type": "function", "function": {
                                "name": "read", "arguments": json.dumps({"filePath": path})}}]},
                           {"role": "tool", "tool_call_id": f"c{i}", "content": tool_text[i * 1500:(i + 1) * 1500]}]
        else:
            msgs = msgs + [{"role": "assistant", "content": content,
                            "reasoning_content": msg.get("reasoning_content", "")}]
            if i == 1:
                msgs.append({"role": "user", "content": USER})


def test_a_call_sent_back_parsed_after_an_aligned_turn_is_aligned_and_never_above_alone(serve_template, tmp_path):
    """The newcomer's request 4 (issue 26 follow-up): after an aligned turn (a new user message) the
    next tool result came with the call the server relayed as text sent back parsed; the guard said
    "answer differs", the request went server-placed and prefilled 2,620 tokens where the server
    alone prefilled 858. It is aligned now, prefills only its new part, and the loop prefills no
    more than llama-server alone with the same flags (``llamacpp:prompt_tokens_total``)."""
    srv = serve_template("hybrid", n_parallel=2, ctx_size=16384, flash_attn="on")
    alone = serve_template("hybrid", n_parallel=2, ctx_size=16384, flash_attn="on")
    prox = OCacheProcess(srv.url, tmp_path / "cache", tmp_path / "ocache.log").start()
    try:
        through = list(_agent_loop(prox.url))
        stats = (prox.stats() or {})["layer"]["align"]
    finally:
        prox.stop()
    direct = list(_agent_loop(alone.url))
    assert not stats.get("as_sent_answer_differs"), stats
    _, h3 = through[2]
    res4, h4 = through[3]
    assert "X-OCache-Aligned" in h3 and "X-OCache-Aligned" in h4, (h3, h4)
    assert res4["timings"]["prompt_n"] == int(h4["X-OCache-Aligned"].split("+")[1])
    oc = sum(r["timings"]["prompt_n"] for r, _ in through)
    al = sum(r["timings"]["prompt_n"] for r, _ in direct)
    print(f"prefilled per request through ocache {[r['timings']['prompt_n'] for r, _ in through]} = {oc}, "
          f"alone {[r['timings']['prompt_n'] for r, _ in direct]} = {al}")
    assert oc <= al, ([r["timings"] for r, _ in through], [r["timings"] for r, _ in direct])
