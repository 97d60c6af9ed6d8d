"""A second engineer's attacks on the routes ocache does not plan and on the order of its checks,
each turned into a test that failed before its fix: a client's ``id_slot`` and ``ocache_splice``
on ``/infill`` (llama-server runs a completion there too, reading the same fields: the splice's
refusal told the client another session's slot length and the hash of its first tokens, enough to
read its prompt back token by token; ``id_slot`` ran on that slot and emptied it); a key the
restarted server no longer accepts replayed a stored answer; a refused client made ocache build
token views; a client without a session key got another's conversation summarised by sending its
first question as a compaction's history; a chat turn that dropped its tools had them put back.
Real patched llama-server (tiny dense, with fill-in-the-middle tokens for ``/infill``; tiny hybrid
on Qwen3.5's template), ``ocache serve`` in a child process."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from ocache.align import xxh3
from ocache.bench.run import OCacheProcess
from ocache.compaction import pi_request
from ocache.llama.server import LlamaServer
from ocache.toolchain import models
from test_real_templates import serve_template  # noqa: F401  (the fixture)
from test_substitutions import _chat, _loop

pytestmark = pytest.mark.server

#: an ``ocache_splice`` (patches/0008) no slot can satisfy: the server refuses it with 412 naming
#: what the slot holds
SPLICE = {"n_keep": 1 << 30, "n_check": 1 << 30, "xxh3": "0000000000000000", "n_tail": 0,
          "tail_xxh3": xxh3([])}


def _post(url: str, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def test_a_clients_steering_fields_on_infill_never_reach_the_server(engine_patched, tmp_path):
    """Alice's conversation is in a slot. Bob sends ``/infill`` (a route ocache forwards without a
    plan) with her slot's ``id_slot`` and an ``ocache_splice``, then with ``ocache_generated``, then
    with her ``id_slot`` alone:
    each gets what the server answers the same body without them (before: the splice's 412, "the
    slot holds N tokens", and the sampled ids in the timings), and Alice's next turn still reuses
    her slot (before: Bob's ``id_slot`` emptied it and her turn went cold)."""
    srv = LlamaServer(binary=engine_patched.binary, model=models.make_fim(), n_parallel=2, ctx_size=8192,
                      slot_save_path=tmp_path / "slots", log_path=tmp_path / "server.log").start()
    prox = OCacheProcess(srv.url, tmp_path / "cache", tmp_path / "ocache.log",
                         slot_save_path=tmp_path / "slots").start()
    alice = {"x-session-affinity": "ses_alice"}
    try:
        body = {"messages": [{"role": "system", "content": "You are a coding agent. " * 20},
                             {"role": "user", "content": "The deployment password is hunter2. Summarise."}],
                "temperature": 0, "max_tokens": 8}
        status, res, h = _chat(prox.url, body, alice)
        assert status == 200 and h.get("X-OCache-Slot", "").isdigit(), (status, h)
        slot = int(h["X-OCache-Slot"])
        infill = {"input_prefix": "def add(a, b):\n    return ", "input_suffix": "\n", "n_predict": 4,
                  "temperature": 0, "cache_prompt": False}
        got = {}
        for name, extra in (("splice", {"id_slot": slot, "ocache_splice": SPLICE}),
                            ("generated", {"ocache_generated": True}), ("slot", {"id_slot": slot})):
            got[name] = _post(prox.url, "/infill", {**infill, **extra}, {"x-session-affinity": "ses_bob"})
        nxt = dict(body, messages=body["messages"] + [
            {"role": "assistant", "content": res["choices"][0]["message"]["content"]},
            {"role": "user", "content": "Thanks."}])
        status, res2, _h2 = _chat(prox.url, nxt, alice)
        assert status == 200, res2
        # the server's own answer to the body as the client could send it without ocache's fields
        # (direct, last: it takes a slot of the server's choosing)
        ref = _post(srv.url, "/infill", infill)
    finally:
        prox.stop()
        srv.stop()
    assert ref[0] == 200, ref          # the model serves /infill (its FIM tokens)
    for name, (status, answer) in got.items():
        assert status == 200, (name, status, answer)
        assert answer["content"] == ref[1]["content"], (name, answer, ref)
        assert "ocache_generated" not in answer.get("timings", {}), (name, answer["timings"])
    # Alice's slot kept her conversation: her next turn reused her first prompt
    first = res["timings"]["prompt_n"] + res["timings"]["cache_n"]
    assert res2["timings"]["cache_n"] >= first - 8, (res["timings"], res2["timings"])


def _wait_restart(prox: OCacheProcess, seen: int, bound_s: float = 120.0) -> None:
    """Until ocache has seen a new server process (``upstream_restarts`` above ``seen``)."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        st = prox.stats() or {}
        if st.get("upstream_restarts", 0) > seen:
            return
        time.sleep(0.2)   # polling ocache's stats until its probe has seen the new process
    raise AssertionError("ocache never saw the restarted server")


def test_no_stored_answer_for_credentials_the_server_refuses_now(start_server, tmp_path):
    """``--api-key okey,vkey``, ocache holding ``okey``, the response cache on. A refused key's
    requests get the server's 401 without the cache looking them up (before: a token view of each
    refused body). Then the server restarts with ``--api-key okey``: ``vkey``'s stored answer is not
    replayed to it, it gets the server's 401 (before: the stored 200 until the entry expired)."""
    srv = start_server("dense", n_parallel=2, ctx_size=8192, api_key="okey,vkey")
    prox = OCacheProcess(srv.url, tmp_path / "cache", tmp_path / "ocache.log", slot_save_path=tmp_path / "slots",
                         env={"OCACHE_UPSTREAM_API_KEY": "okey",
                              "OCACHE_RESPONSE_CACHE": '{"enabled": true}'}).start()
    body = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 8,
            "temperature": 0}
    vkey = {"Authorization": "Bearer vkey"}
    try:
        tiers = [_chat(prox.url, body, vkey)[2].get("X-OCache-Tier") for _ in range(2)]
        assert tiers[1] == "response", tiers            # the cache is on and keyed for vkey
        before = dict((prox.stats() or {}).get("response_cache") or {})
        refused = [_chat(prox.url, body, {"Authorization": "Bearer nope"})[0] for _ in range(2)]
        after = dict((prox.stats() or {}).get("response_cache") or {})
        restarts = (prox.stats() or {}).get("upstream_restarts", 0)
        srv.stop()
        srv.api_key = "okey"
        srv.start()
        _wait_restart(prox, restarts)
        revoked = _chat(prox.url, body, vkey)
        control = _chat(prox.url, body, {"Authorization": "Bearer okey"})
    finally:
        prox.stop()
    assert refused == [401, 401], refused
    counted = ("hits", "misses", "coalesced", "not_keyed", "not_greedy")
    assert {k: after.get(k) for k in counted} == {k: before.get(k) for k in counted}, (before, after)
    assert revoked[0] == 401 and revoked[2].get("X-OCache-Tier") != "response", revoked
    assert control[0] == 200, control


def test_a_chat_turn_without_the_conversations_tools_is_served_as_sent(serve_template, tmp_path):
    """Alice's conversation offered a tool; her next chat request drops ``tools`` and
    ``tool_choice`` (a client that stops offering them). It is served her own rendering, which has
    no tool block (before: continued, the recorded tools put back in the prompt and the body, as
    only Codex's compaction on ``/v1/responses`` is)."""
    srv = serve_template("hybrid", n_parallel=2, ctx_size=16384, flash_attn="on")
    prox = OCacheProcess(srv.url, tmp_path / "cache", tmp_path / "ocache.log",
                         slot_save_path=tmp_path / "slots").start()
    try:
        turns = _loop(prox.url, "ses_alice", n=2)
        body, res, _h = turns[-1]
        nxt = {k: v for k, v in body.items() if k not in ("tools", "tool_choice", "grammar")}
        nxt["messages"] = body["messages"] + [
            {"role": "assistant", "content": res["choices"][0]["message"]["content"]},
            {"role": "user", "content": "Thanks. Which file would you change first?"}]
        status, got, h = _chat(prox.url, nxt, {"x-session-affinity": "ses_alice"})
        own = _post(srv.url, "/tokenize", {"content": _post(srv.url, "/apply-template",
                                                            {"messages": nxt["messages"]})[1]["prompt"],
                                            "add_special": True, "parse_special": True})[1]["tokens"]
    finally:
        prox.stop()
    assert status == 200, got
    assert h.get("X-OCache-Path") != "continued", h
    assert got["timings"]["cache_n"] + got["timings"]["prompt_n"] == len(own), (got["timings"], len(own))


def test_a_compaction_without_a_session_key_must_hold_half_the_conversation(serve_template, tmp_path):
    """Alice, without a session key (as pi), has a conversation whose system prompt and second
    message hold secrets. Mallory, without one either, sends pi's compaction of its first question
    only (``hi``, which anybody can guess): it goes as sent, its own prompt (before: served from
    Alice's slot, the summary written from her whole conversation). Alice's own compaction of the
    whole conversation is continued (the control)."""
    srv = serve_template("hybrid", n_parallel=2, ctx_size=16384, flash_attn="on",
                         args=["--temp", "0", "--reasoning", "off"])
    prox = OCacheProcess(srv.url, tmp_path / "cache", tmp_path / "ocache.log",
                         slot_save_path=tmp_path / "slots").start()
    conv: list[dict] = [{"role": "system", "content": "Working directory: /home/alice/zebra-secret"},
                        {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    try:
        for user, said in (("The deploy password is pluto. Plan the release.", "Hello. What next?"),
                           (None, "Plan: tag, build, ship.")):
            status, res, _h = _chat(prox.url, {"messages": conv, "max_tokens": 64,
                                               "grammar": f'root ::= "{said}"'})
            assert status == 200 and res["choices"][0]["finish_reason"] == "stop", res
            conv = conv + [{"role": "assistant", "content": res["choices"][0]["message"]["content"]}]
            if user:
                conv.append({"role": "user", "content": [{"type": "text", "text": user}]})
        summarise = dict(model="qwen", max_completion_tokens=16)
        attack = pi_request(conv[:2], "You summarise.", "Summarise the conversation.", **summarise)
        a_status, _a_res, a_h = _chat(prox.url, attack)
        own = pi_request(conv, "You summarise.", "Summarise the conversation.", **summarise)
        o_status, _o_res, o_h = _chat(prox.url, own)
        continued = (prox.stats() or {}).get("layer", {}).get("continued", {})
    finally:
        prox.stop()
    assert o_status == 200 and o_h.get("X-OCache-Path") == "continued", (o_h, continued)
    assert a_status == 200 and a_h.get("X-OCache-Path") != "continued", (a_h, continued)
    assert continued.get("as_sent_no_session_key,_and_none_of_the_model's_entries_sent") == 1, continued
