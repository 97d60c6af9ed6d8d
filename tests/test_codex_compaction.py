"""Codex's local compaction served as the conversation's continuation (issue 26 item 3).

Codex 0.169.0 compacts a session by itself once its token count passes
``model_auto_compact_token_limit``: it resends the conversation's items, the answer (an empty answer
is left out) and one user item with its instructions, with ``tools: []`` and ``parallel_tool_calls:
false`` (the shape in ``tests/data/codex-compaction.json``, captured by the real-client test below).
On a template that renders the tools first that prompt shares no token with the conversation the
slot holds. ``ocache.compaction.without_tools`` recognises it; the continued route serves the
request's messages with the conversation's tools, pinned to its slot.

The guard and the collection of a Responses answer need no server; the real client's run is marked
``server`` and ``slow``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import pytest

from ocache.align import record
from ocache.api.convert import responses_to_chat
from ocache.compaction import without_tools
from ocache.substitute import owner_of
from ocache.layer import Observation
from ocache.relay import SSEObserver, observe_json

DATA = json.loads((Path(__file__).parent / "data" / "codex-compaction.json").read_text())

TOOLS = [{"type": "function", "name": "exec_command", "description": "Run a command.",
          "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}]


#: Codex's session headers and key (the names in its captured requests)
HEADERS = {"session-id": "019a-thread-a", "thread-id": "019a-thread-a", "Authorization": "Bearer sk-a"}
OWNER = owner_of(HEADERS)


def _msg(role: str, text: str) -> dict:
    kind = "output_text" if role == "assistant" else "input_text"
    return {"type": "message", "role": role, "content": [{"type": kind, "text": text}]}


def _turn(answer: str = "It prints hello.") -> tuple[dict, object]:
    """A Codex-shaped first turn (our own texts) and the record ocache keeps after its answer."""
    body = {"model": "m", "input": [_msg("developer", "You are a coding agent."), _msg("user", "<env>cwd</env>"),
                                    _msg("user", "explain main.py")],
            "tools": TOOLS, "tool_choice": "auto", "parallel_tool_calls": True, "stream": True}
    chat = responses_to_chat(body)
    turn = record(chat, list(range(100)), 7, {"content": answer}, None, 120, 0, None, None, body)
    return body, replace(turn, owner=OWNER)     # as AlignRoute.observe records it


def _compaction(body: dict, answer: str | None = "It prints hello.", **over) -> dict:
    items = list(body["input"]) + ([_msg("assistant", answer)] if answer is not None else [])
    return {**body, "input": items + [_msg("user", "Summarise the conversation for a handoff.")],
            "tools": [], "parallel_tool_calls": False, **over}


def test_a_conversation_continued_without_its_tools_is_recognised():
    body, turn = _turn()
    assert turn.raw == {"tools": TOOLS, "tool_choice": "auto", "parallel_tool_calls": True}
    comp = responses_to_chat(_compaction(body))
    msgs = without_tools(turn, comp, OWNER)
    assert isinstance(msgs, list) and msgs == comp["messages"]


@pytest.mark.parametrize("change, why", [
    (lambda b, c: {**c, "tools": TOOLS}, "the request has tools"),
    (lambda b, c: {**c, "input": c["input"][:-1] + [_msg("user", "x"), _msg("user", "y")]}, "not one turn after the answer"),
    (lambda b, c: {**c, "input": [_msg("developer", "Another agent.")] + c["input"][1:]}, "history differs"),
    (lambda b, c: {**c, "input": c["input"][:3] + [_msg("assistant", "Something else."), c["input"][-1]]}, "answer differs"),
    (lambda b, c: {**c, "input": c["input"][:-1] + [_msg("developer", "more")]}, "not one user turn after the answer"),
    (lambda b, c: {**c, "reasoning": {"effort": "high"}}, "prompt fields differ"),
])
def test_anything_else_is_not_a_continuation(change, why):
    body, turn = _turn()
    comp = responses_to_chat(change(body, _compaction(body)))
    assert without_tools(turn, comp, OWNER) == why


@pytest.mark.parametrize("what, headers, why", [
    ("another session", {**HEADERS, "session-id": "019b-thread-b", "thread-id": "019b-thread-b"}, "another session"),
    ("no session key", {"Authorization": "Bearer sk-a"}, "a session key on one side only"),
    ("another key", {**HEADERS, "Authorization": "Bearer sk-b"}, "other credentials"),
])
def test_only_the_requesters_own_conversation_is_continued(what, headers, why):
    """The same items, answer and instruction from another requester are not continued: another
    session (Codex's ``session-id``), none where the record has one, another key. Fails on the guard
    that did not know the conversation's owner."""
    body, turn = _turn()
    comp = responses_to_chat(_compaction(body))
    assert without_tools(turn, comp, owner_of(headers)) == why, what
    # a record with no session key: a request with one is not its owner either, nor one without an owner
    assert without_tools(replace(turn, owner=owner_of({"Authorization": "Bearer sk-a"})), comp, OWNER) == \
        "a session key on one side only"
    assert without_tools(replace(turn, owner=None), comp, OWNER) == "the owner is unknown"


def test_an_empty_answer_left_out_is_put_back_where_the_slot_holds_it():
    body, turn = _turn(answer="")
    comp = responses_to_chat(_compaction(body, answer=None))
    msgs = without_tools(turn, comp, OWNER)
    assert isinstance(msgs, list) and len(msgs) == len(comp["messages"]) + 1
    assert msgs[-2] == {"role": "assistant", "content": ""} and msgs[-1] == comp["messages"][-1]
    # a non-empty answer may not be left out
    body, turn = _turn()
    assert without_tools(turn, responses_to_chat(_compaction(body, answer=None)), OWNER) == \
        "not one turn after the answer"


RESPONSE = {"id": "resp_1", "object": "response", "status": "completed", "output": [
    {"id": "rs_1", "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
    {"id": "msg_1", "type": "message", "status": "completed", "role": "assistant",
     "content": [{"type": "output_text", "annotations": [], "text": "It prints hello."}]},
    {"id": "fc_1", "type": "function_call", "status": "completed", "arguments": "{\"cmd\":\"ls\"}",
     "call_id": "call_1", "name": "exec_command"}]}
MESSAGE = {"role": "assistant", "content": "It prints hello.", "reasoning_content": "think",
           "tool_calls": [{"id": "call_1", "type": "function",
                           "function": {"name": "exec_command", "arguments": "{\"cmd\":\"ls\"}"}}]}


def test_a_responses_answer_is_collected_as_the_chat_message_it_renders_as():
    """The stream's ``response.completed`` event (tools/server/server-task.cpp:600-699) gives the
    relayed answer; its finish reason stays unknown (None): the status is "completed" either way."""
    event = {"type": "response.completed", "response": RESPONSE}
    obs = SSEObserver(collect=True)
    for chunk in (b"event: response.completed\n", b"data: " + json.dumps(event).encode()[:40],
                  json.dumps(event).encode()[40:] + b"\n\n"):
        obs.feed(chunk)
    assert obs.final and obs.message == MESSAGE and obs.finish_reason is None
    # and the same answer not streamed
    o = Observation(status=200, completed=True)
    observe_json("/v1/responses", json.dumps(RESPONSE).encode(), o)
    assert o.message == MESSAGE and o.finish_reason is None
    # the recorded turn compares it with the client's echo as the aligned route does
    body, _ = _turn()
    turn = record(responses_to_chat(body), list(range(10)), 7, o.message, None, 12, 0, None, None, body)
    echo = dict(_compaction(body, answer="It prints hello."))
    echo["input"] = echo["input"][:3] + [RESPONSE["output"][0], RESPONSE["output"][1], RESPONSE["output"][2],
                                         _msg("user", "Summarise.")]
    assert isinstance(without_tools(replace(turn, owner=OWNER), responses_to_chat(echo), OWNER), list)


def test_the_stored_capture_has_the_shape_the_guard_reads():
    turn, comp = DATA["turn"], DATA["compaction"]
    assert turn["tools"] > 0 and comp["tools"] == [] and comp["parallel_tool_calls"] is False
    assert comp["tool_choice"] == turn["tool_choice"] and comp["fields"] == turn["fields"]
    n = len(turn["input"])
    assert comp["input"][:n] == turn["input"][:1] + comp["input"][1:n]   # the skills item names CODEX_HOME
    assert [i["role"] for i in comp["input"][n:]] == ["user"]            # the answer was empty: left out


# --- the real client ---------------------------------------------------------------------------

def _instruction_digest(item: dict) -> str:
    text = "".join(p.get("text", "") for p in item.get("content") or ())
    return hashlib.sha256(text.encode()).hexdigest()


@pytest.mark.server
@pytest.mark.slow
def test_the_real_codex_compaction_is_served_as_the_conversations_continuation(start_server, tmp_path, models_tiny):
    """``codex exec`` then ``codex exec resume --last`` with ``model_auto_compact_token_limit`` below
    the first turn: Codex compacts before the second turn. Through ocache that request is served
    from the conversation's slot (``X-OCache-Continued``): the server prefills the instruction turn,
    not the whole history (alone: every token of it, 4,344 when captured)."""
    from ocache.toolchain import clients
    from test_e2e_clients import OcacheProcess, _install, _wait_recorded

    binary = _install(clients.CODEX)
    # answers that end (the tiny model never ends on its own): greedy, no reasoning, the end of
    # turn made likely
    srv = start_server("hybrid", n_parallel=2, ctx_size=65536,
                       args=["--temp", "0", "--reasoning", "off", "-l", "151645+11", "-n", "256"])
    proxy = OcacheProcess(srv.url, tmp_path, server_args=srv.command()[1:])
    try:
        proxy.wait_ready()
        home = tmp_path / "home"
        home.mkdir()
        codex_home = home / ".codex"
        cfg = clients.write_codex_config(codex_home, proxy.url + "/v1", model=str(models_tiny["hybrid"]))
        cfg.write_text("model_auto_compact_token_limit = 2000\nmodel_context_window = 32768\n" + cfg.read_text())
        env = clients.codex_env(home, codex_home)
        project = tmp_path / "proj"
        project.mkdir()
        (project / "main.py").write_text("print('hello')\n")
        runs = [clients.run_codex(binary, project, "list the files and explain main.py", env, timeout=300),
                clients.run_codex(binary, project, "now explain main.py again", env, resume=True, timeout=300)]
        recs = _wait_recorded(proxy, lambda rs: len(rs) >= 3)
        stats = proxy.stats()["layer"]["continued"]
    finally:
        proxy.stop()
    report = "\n".join(r.describe(5) for r in runs) + "\n" + json.dumps(stats)
    comps = [i for i, r in enumerate(recs) if r["body"].get("tools") == []]
    assert comps, report
    i = comps[0]
    comp, turn = recs[i]["body"], recs[i - 1]["body"]
    # the shape stored: the conversation's items, no tools, one user item with the same instruction
    assert comp["parallel_tool_calls"] is False and turn["tools"], report
    assert sorted(comp) == DATA["compaction"]["fields"], report
    assert comp["input"][:len(turn["input"])] == turn["input"], report
    assert _instruction_digest(comp["input"][-1]) == DATA["compaction"]["input"][-1]["sha256"], report
    # served as the continuation: the instruction turn prefilled, the conversation reused
    hdr = recs[i]["plan"]["headers"]
    t = recs[i]["obs"]["timings"]
    assert hdr.get("X-OCache-Path") == "continued" and stats["recognised_without_tools"] >= 1, (hdr, report)
    assert t["cache_n"] >= 5000 and t["prompt_n"] < 400, (t, report)
