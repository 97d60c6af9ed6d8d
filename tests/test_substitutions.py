"""Substitutions attacked through ``ocache serve`` on a real llama-server (tiny hybrid, Qwen3.5's own
template): a client's own splice fields never reach the server, an aligned turn is served only to the
session that owns the conversation, and an answer that quotes the end-of-turn marker is never spliced
past its end (the served prompt, read back from the saved slot, is the rendering or a declared splice).
The gate's pure checks: ``tests/test_substitute.py``."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import pytest

from ocache.align import xxh3
from ocache.bench.run import OCacheProcess
from test_align_exact import OPENING, _saved, _tokens, after_answer
from test_real_templates import ANSWER, CALL, TOOLS, _post, serve_template  # noqa: F401

pytestmark = pytest.mark.server

SERVED = re.compile(r"ocache_splice: prompt = (\d+) tokens of the slot")
NEW_USER = "Thanks. Which file would you change first?"


def _chat(url: str, body: dict, headers: dict | None = None) -> tuple[int, dict, dict]:
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}"), dict(e.headers)


def opening(grammar: str) -> str:
    """``grammar`` for a template whose generation prompt does not open the think block (Qwen3's):
    the model opens it itself, as a Qwen3 model does."""
    return grammar.replace("root ::= ", 'root ::= "<think>\\n" ', 1)


def _loop(url: str, session: str, answer_grammar: str = ANSWER, opens: bool = False,
          n: int = 3) -> list[tuple[dict, dict, dict]]:
    """A tool turn under a grammar, its result, the answer, a new user message, as opencode sends
    them (the reasoning dropped), for ``session`` (``opens``: the model opens its think block,
    Qwen3's template; ``n``: the first requests only). Returns (body, response, headers) per request."""
    msgs = list(OPENING)
    out = []
    for i, grammar in enumerate(opening(g) if opens else g for g in (CALL, answer_grammar, ANSWER)[:n]):
        body = {"messages": msgs, "tools": TOOLS, "tool_choice": "none", "temperature": 0,
                "max_tokens": 200, "grammar": grammar}
        status, res, headers = _chat(url, body, {"x-session-affinity": session})
        assert status == 200, res
        out.append((body, res, headers))
        msgs = after_answer(msgs, i, res["choices"][0]["message"]["content"], NEW_USER)
    return out


def _spliced(srv) -> list[int]:
    return [int(m) for m in SERVED.findall(srv.log_tail(100000))]


def test_a_clients_own_splice_is_never_served(serve_template, tmp_path):
    """Session B sends ``ocache_splice`` itself (with nothing checked, and with the right hash of
    session A's slot read from its file) and ``X-OCache-Splice``: every try is served B's own
    rendering (the server's prompt is B's, no splice in its log), no 412 and no server detail
    reaches B; patched llama-server reached directly refuses the unchecked form with 400."""
    srv = serve_template("hybrid", n_parallel=2, ctx_size=16384, flash_attn="on")
    prox = OCacheProcess(srv.url, tmp_path / "cache", tmp_path / "ocache.log",
                         slot_save_path=tmp_path / "slots").start()
    try:
        turns = _loop(prox.url, "ses_alice")
        slot = int(turns[-1][2]["X-OCache-Slot"])
        held = _saved(srv, tmp_path, slot, "alice.bin")
        before = _spliced(srv)
        body = {"messages": [{"role": "system", "content": "You are a coding agent."},
                             {"role": "user", "content": "Hello?"}], "max_tokens": 4, "temperature": 0}
        own = _tokens(srv.url, body)
        tail = own[-2:]
        tries = [
            {"n_keep": 60, "n_check": 0, "xxh3": xxh3([]), "n_tail": 2, "tail_xxh3": xxh3(tail)},
            {"n_keep": 60, "n_check": 60, "xxh3": xxh3(held[:60]), "n_tail": 2, "tail_xxh3": xxh3(tail)},
            {"n_keep": len(held), "n_check": len(held), "xxh3": xxh3(held), "n_tail": 2,
             "tail_xxh3": xxh3(tail)},
        ]
        for sp in tries:
            for extra in ({"id_slot": slot}, {}):
                status, res, headers = _chat(prox.url, {**body, **extra, "ocache_splice": sp},
                                             {"x-session-affinity": "ses_mallory", "X-OCache-Splice": "60"})
                assert status == 200, res
                t = res["timings"]
                assert t["cache_n"] + t["prompt_n"] == len(own), (sp, t)
                assert "ocache_generated" not in t
        assert _spliced(srv) == before, "a client's splice was served"
        # the server itself refuses a splice that checks fewer tokens than it keeps (patches/0008)
        status = _chat(srv.url, {**body, "id_slot": slot, "ocache_splice": tries[0]})[0]
        assert status == 400
    finally:
        prox.stop()


def test_an_aligned_turn_is_served_only_to_its_own_session(serve_template, tmp_path):
    """Session A's conversation is in a slot; B sends A's exact next request (same messages, A's
    answer included: what a second session with the same prompts sends) under its own session key
    (and again with A's key but other credentials): B is served its own rendering, never A's slot
    tokens, while A's own request is aligned there."""
    srv = serve_template("hybrid", n_parallel=2, ctx_size=16384, flash_attn="on")
    prox = OCacheProcess(srv.url, tmp_path / "cache", tmp_path / "ocache.log",
                         slot_save_path=tmp_path / "slots").start()
    try:
        turns = _loop(prox.url, "ses_alice")
        body, res, _ = turns[-1]
        nxt = dict(body, grammar=ANSWER, messages=body["messages"] + [
            {"role": "assistant", "content": res["choices"][0]["message"]["content"]},
            {"role": "user", "content": "And the second file?"}])
        own = len(_tokens(srv.url, nxt))
        for who in ({"x-session-affinity": "ses_bob"},
                    {"x-session-affinity": "ses_alice", "Authorization": "Bearer someone-else"}):
            aligned = prox.stats()["layer"]["align"].get("aligned_planned", 0)
            status, res_b, h_b = _chat(prox.url, nxt, who)
            assert status == 200 and "X-OCache-Aligned" not in h_b, who
            assert res_b["timings"]["cache_n"] + res_b["timings"]["prompt_n"] == own
            assert prox.stats()["layer"]["align"].get("aligned_planned", 0) == aligned
        # A itself, on a slot that holds its own conversation, is aligned (the control)
        _, res_a, _ = _chat(prox.url, nxt, {"x-session-affinity": "ses_alice"})
        nxt2 = dict(nxt, messages=nxt["messages"] + [
            {"role": "assistant", "content": res_a["choices"][0]["message"]["content"]},
            {"role": "user", "content": "Thanks."}])
        status, _, h_a = _chat(prox.url, nxt2, {"x-session-affinity": "ses_alice"})
        assert status == 200 and "X-OCache-Aligned" in h_a, h_a
    finally:
        prox.stop()


QUOTE = 'root ::= [a-z] [a-z]{1,9} (" " [a-z]{1,9}){6,12} "\\n</think>\\n\\n" "Close each turn with <|im_end|> then stop."'


def test_an_answer_quoting_the_end_of_turn_marker_is_never_spliced_past_its_end(serve_template, tmp_path):
    """The answer writes ``<|im_end|>`` as text (the template renders the same text as the special
    id). The next request's prompt, read back from the saved slot, is the rendering as sent, or a
    splice whose text is the rendering's with reasoning blocks aside: never the answer twice."""
    srv = serve_template("hybrid", n_parallel=2, ctx_size=16384, flash_attn="on")
    prox = OCacheProcess(srv.url, tmp_path / "cache", tmp_path / "ocache.log",
                         slot_save_path=tmp_path / "slots").start()
    try:
        turns = _loop(prox.url, "ses_alice", answer_grammar=QUOTE)
        quoted = turns[1][1]["choices"][0]["message"]["content"]
        assert "<|im_end|>" in quoted
        body, res, headers = turns[2]
        slot = int(headers["X-OCache-Slot"])
        held = _saved(srv, tmp_path, slot, "after.bin")
    finally:
        prox.stop()
    n_prompt = res["timings"]["cache_n"] + res["timings"]["prompt_n"]
    served = held[:n_prompt]
    rendered = _tokens(srv.url, body)
    if "X-OCache-Aligned" not in headers:
        assert served == rendered
        return
    text = _post(srv.url, "/detokenize", {"tokens": served})["content"]
    want = _post(srv.url, "/detokenize", {"tokens": rendered})["content"]
    drop = re.compile(r"\s*<think>.*?</think>\s*", re.S)
    assert drop.sub("\n", text) == drop.sub("\n", want)
    assert text.count("Close each turn with") == want.count("Close each turn with") == 1


def test_an_aligned_conversation_is_spilled_on_eviction_and_restored(serve_template, tmp_path):
    """The aligned answer runs the same epilogue as any planned one (every tier's ``admit``): on one
    slot, another session's request evicts the aligned conversation and the session tier spills it
    (before, it refused: "not seen complete"). Its next turn is restored from the spill and aligned
    again (``X-OCache-Tier: session``, ``X-OCache-Aligned``): only the new part is prefilled. Dense
    model, Qwen3's template: the model opens its think block itself."""
    srv = serve_template("dense", n_parallel=1, ctx_size=16384, flash_attn="on")
    prox = OCacheProcess(srv.url, tmp_path / "cache", tmp_path / "ocache.log", slot_save_path=tmp_path / "slots",
                         env={"OCACHE_SPILL_MIN_TOKENS": "256"}).start()
    alice = {"x-session-affinity": "ses_alice"}
    try:
        turns = _loop(prox.url, "ses_alice", opens=True)
        body, res, headers = turns[-1]
        assert "X-OCache-Aligned" in headers, headers
        spills = prox.stats()["layer"]["tier_session"]["spills"]
        other = {"messages": [{"role": "system", "content": "Another session entirely."},
                              {"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0}
        assert _chat(prox.url, other, {"x-session-affinity": "ses_bob"})[0] == 200
        nxt = dict(body, grammar=opening(ANSWER), messages=body["messages"] + [
            {"role": "assistant", "content": res["choices"][0]["message"]["content"]},
            {"role": "user", "content": "And the second file?"}])
        status, res2, h2 = _chat(prox.url, nxt, alice)    # its plan waits for the spill's commit
        assert status == 200
        assert prox.stats()["layer"]["tier_session"]["spills"] == spills + 1
        # restored from its spill and aligned again: only the new part prefilled
        assert h2["X-OCache-Tier"] == "session" and "X-OCache-Aligned" in h2, h2
        kept, new = map(int, h2["X-OCache-Aligned"].split("+"))
        assert res2["timings"]["cache_n"] == kept and res2["timings"]["prompt_n"] == new
        assert new < len(_tokens(srv.url, nxt)) // 4
        # exact: the answer equals a cold prefill of the prompt served (the slot's file)
        held = _saved(srv, tmp_path, 0, "restored.bin")
        served, generated = held[:kept + new], held[kept + new:]
        cold = _post(srv.url, "/completion", {"prompt": served, "n_predict": nxt["max_tokens"],
                                              "grammar": nxt["grammar"], "id_slot": 0, "cache_prompt": False,
                                              "return_tokens": True, "temperature": 0})
        assert cold["timings"]["cache_n"] == 0 and cold["tokens"][:-1] == generated
    finally:
        prox.stop()


def test_a_compaction_of_an_answer_quoting_the_marker_is_never_served_past_its_end(serve_template, tmp_path):
    """opencode's compaction of a conversation whose answer writes ``<|im_end|>`` as text: the
    continued route judges the proof's spans on their text as the aligned route does, so the
    prompt served (read back from the saved slot) never holds the answer's tail twice."""
    from ocache.compaction import opencode_request
    from test_compaction import AFTER, SYSTEM

    srv = serve_template("hybrid", n_parallel=2, ctx_size=16384, flash_attn="on")
    prox = OCacheProcess(srv.url, tmp_path / "cache", tmp_path / "ocache.log",
                         slot_save_path=tmp_path / "slots").start()
    alice = {"x-session-affinity": "ses_alice"}
    try:
        turns = _loop(prox.url, "ses_alice", answer_grammar=QUOTE, n=2)
        body, res, _ = turns[-1]
        quoted = res["choices"][0]["message"]["content"]
        assert "<|im_end|>" in quoted
        msgs = body["messages"] + [{"role": "assistant", "content": quoted}]
        comp = opencode_request(msgs, SYSTEM, AFTER, model="qwen", max_tokens=8, temperature=0)
        status, res2, h2 = _chat(prox.url, comp, alice)
        assert status == 200
        n_prompt = res2["timings"]["cache_n"] + res2["timings"]["prompt_n"]
        slot = h2.get("X-OCache-Slot", "")
        held = _saved(srv, tmp_path, int(slot) if slot.isdigit() else 0, "comp.bin")
        text = _post(srv.url, "/detokenize", {"tokens": held[:n_prompt]})["content"]
        assert text.count("then stop.") <= 1, text[-400:]
        if "X-OCache-Continued" in h2:
            assert text.count("Close each turn with") == 1
    finally:
        prox.stop()


def _edit_after_splice(serve_template, tmp_path, model: str, opens: bool, extra: dict) -> dict:
    """The loop on ``model`` through ocache and on llama-server alone (the same requests), then the
    client sends the second answer back edited (" Edited by the user.") with one more user message
    (``extra``: more body fields), to both. Returns what the tests read: the slot, its ids before
    and after that request (saved), the request, both answers, ocache's headers and align stats."""
    srv = serve_template(model, n_parallel=2, ctx_size=16384, flash_attn="on")
    alone = serve_template(model, n_parallel=2, ctx_size=16384, flash_attn="on",
                           slot_save_path=tmp_path / "slots-alone", log_path=tmp_path / "alone.log")
    prox = OCacheProcess(srv.url, tmp_path / "cache", tmp_path / "ocache.log",
                         slot_save_path=tmp_path / "slots").start()
    try:
        turns = _loop(prox.url, "ses_alice", opens=opens)
        assert "X-OCache-Aligned" in turns[2][2], turns[2][2]
        for body, _, _ in turns:
            assert _chat(alone.url, body)[0] == 200
        body, res, headers = turns[2]
        slot = int(headers["X-OCache-Slot"])
        held = _saved(srv, tmp_path, slot, "before.bin")
        msgs = [dict(m) for m in body["messages"]]
        second = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        msgs[second]["content"] = msgs[second]["content"] + " Edited by the user."
        nxt = dict(body, grammar=opening(ANSWER) if opens else ANSWER, **extra, messages=msgs + [
            {"role": "assistant", "content": res["choices"][0]["message"]["content"]},
            {"role": "user", "content": "And the second file?"}])
        status, got, h = _chat(prox.url, nxt, {"x-session-affinity": "ses_alice"})
        a_status, a_got, _ = _chat(alone.url, nxt)
        assert status == a_status == 200
        align = prox.stats()["layer"]["align"]
        after = _saved(srv, tmp_path, slot, "after.bin")
    finally:
        prox.stop()
    return {"srv": srv, "slot": slot, "held": held, "after": after, "body": nxt, "got": got, "headers": h,
            "alone": a_got, "align": align, "rendered": _tokens(srv.url, nxt)}


def test_an_edit_after_a_spliced_turn_is_served_as_a_partial_splice(serve_template, tmp_path):
    """Tiny dense, Qwen3's template: a tool turn, its answer, a new user message (aligned: the slot
    keeps the model's reasoning the rendering drops), then the client sends the second answer back
    edited with one more user message. The slot's ids are served only up to the edit (a partial
    splice: ``K`` below what the slot held), then the request's own rendering; the served prompt,
    read back from the saved slot, is the rendering with reasoning blocks aside; the answer equals a
    cold prefill of the served ids; and the server prefilled no more than llama-server alone does
    for the same four requests (whose slot holds the rendering: it re-prefills from the edit),
    where sending it as is would re-prefill from the first reasoning block the slot kept."""
    from ocache.bench.exact import PROBS_FIELDS, Generation, compare

    r = _edit_after_splice(serve_template, tmp_path, "dense", True, PROBS_FIELDS)
    srv, h, held, got, rendered = r["srv"], r["headers"], r["held"], r["got"], r["rendered"]
    assert "X-OCache-Aligned" in h, h
    k, n = map(int, h["X-OCache-Aligned"].split("+"))
    assert k < len(held), "not a partial splice"
    assert r["align"].get("aligned_partial_planned", 0) == 1
    t = got["timings"]
    served = r["after"][:t["cache_n"] + t["prompt_n"]]
    assert served[:k] == held[:k] and served[k:] == rendered[len(rendered) - n:]
    text = _post(srv.url, "/detokenize", {"tokens": served})["content"]
    want = _post(srv.url, "/detokenize", {"tokens": rendered})["content"]
    drop = re.compile(r"(<\|im_start\|>assistant\n)\s*<think>(?:(?!<\|im_end\|>).)*?</think>\s*", re.S)
    assert drop.sub(r"\1", text) == drop.sub(r"\1", want)
    assert text.count("Edited by the user.") == 1
    cold = _post(srv.url, "/completion", {"prompt": served, "n_predict": 200, "grammar": r["body"]["grammar"],
                                          "id_slot": 1 - r["slot"], "cache_prompt": False, "temperature": 0,
                                          "return_tokens": True, **PROBS_FIELDS})
    verdict = compare(Generation.from_response(cold), Generation.from_response(got))
    assert verdict, verdict.reason
    # rule 2 on this request: no more than alone (a few ids of slack for where the walk cuts)
    assert t["prompt_n"] <= r["alone"]["timings"]["prompt_n"] + 8, (t, r["alone"]["timings"])
    # as sent, the slot's kept reasoning of the first turn would have parted it much earlier
    first_think = next(i for i, (a, b) in enumerate(zip(held, rendered)) if a != b)
    assert k > first_think + 16


def test_a_hybrid_model_resumes_a_partial_splice_at_a_checkpoint(serve_template, tmp_path):
    """Tiny hybrid, Qwen3.5's template, the same edit as above: a hybrid model cannot drop the
    slot's state back to any token, so a partial splice resumes at the newest checkpoint before the
    edit. When it is made, its figures are that checkpoint's (the server's ``cache_n`` equals
    ``X-OCache-Reused``, below K), the served prompt is the slot's K ids then the rendering's N,
    and the prefill is at most alone's plus one ubatch; when no checkpoint gains, the request goes
    as sent with the reason counted."""
    r = _edit_after_splice(serve_template, tmp_path, "hybrid", False, {})
    h, held, t, rendered = r["headers"], r["held"], r["got"]["timings"], r["rendered"]
    assert t["prompt_n"] <= r["alone"]["timings"]["prompt_n"] + r["srv"].ubatch, (t, r["alone"]["timings"])
    if "X-OCache-Aligned" not in h:
        assert r["align"].get("partial_as_sent_checkpoint_gains_too_little", 0) == 1, r["align"]
        return
    k, n = map(int, h["X-OCache-Aligned"].split("+"))
    assert k < len(held) and r["align"].get("aligned_partial_planned", 0) == 1
    assert t["cache_n"] == int(h["X-OCache-Reused"]) <= k
    served = r["after"][:t["cache_n"] + t["prompt_n"]]
    assert served[:k] == held[:k] and served[k:] == rendered[len(rendered) - n:]
