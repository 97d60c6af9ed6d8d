"""ocache.compaction: recognising a client's compaction request and the guard, without a server (the
route on the real template: tests/test_compaction_real.py). The opencode request is the one captured
from the real client (tests/data/opencode-compaction.json)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from ocache.align import Aligned, Turn, decide
from ocache.compaction import (OPENCODE_CLOSE, OPENCODE_OPEN, continuation, entries, history_of, instruction,
                               matches, opencode_history, opencode_request, owns, parse)
from ocache.substitute import Region, owner_of

CAPTURE = json.loads((Path(__file__).parent / "data" / "opencode-compaction.json").read_text())
COMPACTION = CAPTURE["compaction"]
AGENT_MESSAGES = CAPTURE["agent_turn"]["messages"]

TOOLS = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]
CALL = {"id": "c1", "type": "function", "function": {"name": "read", "arguments": "{\"filePath\": \"a.py\"}"}}
CONVERSATION = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Read a.py."},
    {"role": "assistant", "content": "", "reasoning_content": "I read it first.", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "import os\n"},
    {"role": "assistant", "content": "It imports os."},
    {"role": "user", "content": "And b.py?"},
]
ANSWER = {"content": "b.py is empty.", "reasoning_content": "Nothing there."}
SYSTEM = COMPACTION["messages"][0]["content"]
AFTER = parse(COMPACTION).after
#: the requester of the recorded conversation and of its compaction: opencode's session header and a key
HEADERS = {"x-session-affinity": "ses_alpha", "Authorization": "Bearer sk-a"}
OWNER = owner_of(HEADERS)


def turn(**kw) -> Turn:
    base = dict(messages=tuple(CONVERSATION), fields={"tools": TOOLS}, answer=ANSWER, finish_reason="stop",
                stop=False, known=(1, 2, 3), n_prompt_eot=6, n_held=40, slot=1, owner=OWNER)
    return Turn(**{**base, **kw})


def compaction_of(messages) -> dict:
    return opencode_request(messages, SYSTEM, AFTER, model="qwen", max_tokens=64, stream=True)


def test_the_captured_opencode_compaction_is_recognised():
    """The real client's request: its compaction agent's system text, one user message with the
    history block; the user line is the agent turn's user message, as the client sent it."""
    comp = parse(COMPACTION)
    assert comp is not None and comp.client == "opencode"
    assert "tools" not in COMPACTION and [m["role"] for m in COMPACTION["messages"]] == ["system", "user"]
    assert comp.user_lines == (AGENT_MESSAGES[1]["content"],)
    assert comp.system == (SYSTEM.strip(),)
    assert comp.after.startswith("Create a new anchored summary") and OPENCODE_CLOSE not in comp.after
    assert instruction(comp) == SYSTEM.strip() + "\n\n" + comp.after


def test_the_builder_reproduces_the_captured_request():
    """``opencode_request`` of the captured session (the user message, the answer's reasoning as
    the history shows it) is the captured request byte for byte: the measure script and the
    server tests send what opencode sends."""
    text = COMPACTION["messages"][1]["content"]
    reasoning = text.split("[Assistant reasoning]: ", 1)[1].split(OPENCODE_CLOSE, 1)[0]
    msgs = [AGENT_MESSAGES[1], {"role": "assistant", "content": "", "reasoning_content": reasoning}]
    built = opencode_request(msgs, SYSTEM, AFTER)
    assert built["messages"] == COMPACTION["messages"]


def test_a_tool_loop_is_flattened_with_its_calls_and_results():
    hist = opencode_history(CONVERSATION)
    assert hist == ('[User]: Read a.py.\n\n[Assistant reasoning]: I read it first.\n'
                    '[Assistant tool call]: read({"filePath":"a.py"})\n[Tool result]: import os\n\n\n'
                    '[Assistant]: It imports os.\n\n[User]: And b.py?')
    assert parse(compaction_of(CONVERSATION)).user_lines == ("Read a.py.", "And b.py?")


@pytest.mark.parametrize("why, change", [
    ("tools", lambda b: b.update(tools=TOOLS)),
    ("a second user message", lambda b: b["messages"].append({"role": "user", "content": "hi"})),
    ("an assistant message", lambda b: b["messages"].insert(1, {"role": "assistant", "content": "x"})),
    ("no history block", lambda b: b["messages"][-1].update(content="Summarise our conversation.")),
    ("no user line", lambda b: b["messages"][-1].update(
        content=f"{OPENCODE_OPEN}[Assistant]: hello{OPENCODE_CLOSE}\n\nSummarise.")),
])
def test_other_requests_are_not_compactions(why, change):
    body = copy.deepcopy(compaction_of(CONVERSATION))
    change(body)
    assert parse(body) is None, why
    assert parse({"messages": CONVERSATION, "tools": TOOLS}) is None


def _matches(messages, t=None, owner=OWNER, **fields):
    body = compaction_of(messages) | fields
    return matches(parse(body), t or turn(), body, owner)


def test_the_guard_finds_the_conversation_by_its_whole_history():
    """The history block is the recorded conversation and its answer flattened, entry for entry
    (the reasoning aside: the client keeps it, the recorded request dropped it)."""
    answered = [*CONVERSATION, {"role": "assistant", **ANSWER}]
    assert _matches(answered) is None
    assert _matches(CONVERSATION) is None     # the answer left out of the summary
    # the client kept its newest turn out of the summary: the history is the record's first entries
    assert parse(compaction_of(CONVERSATION[:5])).user_lines == ("Read a.py.",)
    assert _matches(CONVERSATION[:5]) is None
    # the reasoning of the earlier turn dropped from the recorded request, kept by the client
    dropped = [*CONVERSATION[:2], {k: v for k, v in CONVERSATION[2].items() if k != "reasoning_content"},
               *CONVERSATION[3:]]
    assert _matches(answered, turn(messages=tuple(dropped))) is None
    # another conversation
    other = [CONVERSATION[0], dict(CONVERSATION[1], content="Read c.py."), *CONVERSATION[2:]]
    assert _matches(other) == "history differs"
    later = [*answered, {"role": "user", "content": "And c.py?"}]
    assert _matches(later) == "history differs"
    # a prompt field the continuation could not take out of the forwarded body
    assert _matches(CONVERSATION, chat_template_kwargs={"enable_thinking": False}) == "prompt fields differ"
    assert _matches(CONVERSATION, turn(messages=(CONVERSATION[0],))) == "history differs"


def test_the_flattened_history_reads_back_as_its_entries():
    """``entries`` of the captured request and of a tool loop: user, assistant, call (parsed
    arguments), tool; the reasoning aside."""
    assert entries(history_of(COMPACTION)) == (("user", AGENT_MESSAGES[1]["content"]),)
    assert entries(opencode_history(CONVERSATION)) == (
        ("user", "Read a.py."), ("call", ["read", {"filePath": "a.py"}]), ("tool", "import os"),
        ("assistant", "It imports os."), ("user", "And b.py?"))


def test_a_long_tool_output_cut_by_the_client_is_the_recorded_one():
    """opencode keeps the first 2,000 characters of a long tool output in the history, then
    ``\\n[truncated]``: that entry is the recorded output; another output's cut, or a cut that is
    not a prefix of the recorded one, is not."""
    long = "x = 1\n" * 500
    conv = [*CONVERSATION[:3], dict(CONVERSATION[3], content=long), *CONVERSATION[4:]]
    body = compaction_of(conv)
    text = body["messages"][1]["content"]
    body["messages"][1]["content"] = text.replace(long, long[:2000] + "\n[truncated]")
    t = turn(messages=tuple(conv))
    assert matches(parse(body), t, body, OWNER) is None
    other = dict(body, messages=[body["messages"][0], dict(body["messages"][1], content=text.replace(
        long, "y" + long[1:2000] + "\n[truncated]"))])
    assert matches(parse(other), t, other, OWNER) == "history differs"


#: the same first and last user lines as CONVERSATION (two projects given the same prompts), another
#: tool result and another answer in the middle
MIDDLE = [*CONVERSATION[:3], dict(CONVERSATION[3], content="import sys\n"),
          dict(CONVERSATION[4], content="It imports sys."), CONVERSATION[5]]


@pytest.mark.parametrize("what, messages", [
    ("another tool result", MIDDLE[:4] + CONVERSATION[4:]),
    ("another answer", CONVERSATION[:4] + MIDDLE[4:]),
    ("another tool call", CONVERSATION[:2] + [dict(CONVERSATION[2], tool_calls=[
        dict(CALL, function={"name": "read", "arguments": "{\"filePath\": \"b.py\"}"})])] + CONVERSATION[3:]),
    ("the tool turn left out", CONVERSATION[:2] + CONVERSATION[4:]),
])
def test_equal_first_and_last_user_lines_with_another_middle_are_not_the_conversation(what, messages):
    """Two projects given the same prompts: the first and last user lines are equal, the entries
    between them are not. Fails on the guard that compared the first and last user lines only."""
    comp = parse(compaction_of(messages))
    assert comp.user_lines == parse(compaction_of(CONVERSATION)).user_lines, what
    assert _matches(messages) == "history differs", what


@pytest.mark.parametrize("what, headers, why", [
    ("another session", {**HEADERS, "x-session-affinity": "ses_beta"}, "another session"),
    ("no session key", {"Authorization": "Bearer sk-a"}, "a session key on one side only"),
    ("another key", {**HEADERS, "Authorization": "Bearer sk-b"}, "other credentials"),
    ("no key", {"x-session-affinity": "ses_alpha"}, "other credentials"),
    ("another x-api-key", {**HEADERS, "X-Api-Key": "k"}, "other credentials"),
])
def test_only_the_requesters_own_conversation_is_continued(what, headers, why):
    """The same history from another requester: another session key, none where the record has one,
    other credentials. Fails on the guard that did not know the conversation's owner."""
    assert _matches(CONVERSATION, owner=owner_of(headers)) == why, what
    assert _matches(CONVERSATION, owner=owner_of({k.lower(): v for k, v in HEADERS.items()})) is None


def test_without_a_session_key_the_credentials_and_the_whole_history_decide():
    """A client that sends no session key: the record without one, the same credentials and the same
    history continue; a session key on the record's side only, other credentials or another middle
    do not. A record without an owner (built elsewhere) is nobody's."""
    anonymous = owner_of({"authorization": "Bearer sk-a"})
    t = turn(owner=anonymous)
    assert _matches(CONVERSATION, t, owner=anonymous) is None
    assert _matches(CONVERSATION, t, owner=OWNER) == "a session key on one side only"
    assert _matches(CONVERSATION, t, owner=owner_of({"authorization": "Bearer sk-b"})) == "other credentials"
    assert _matches(MIDDLE, t, owner=anonymous) == "history differs"
    assert owns(turn(owner=None), OWNER) == "the owner is unknown"
    # neither a session key nor credentials on either side: the whole history decides
    nobody = owner_of({})
    assert owner_of(None) == nobody and _matches(CONVERSATION, turn(owner=nobody), owner=nobody) is None
    # the session key from any of the session headers (opencode sends x-session-id beside the affinity)
    assert owner_of({"x-session-id": "ses_alpha", "authorization": "Bearer sk-a"}) == OWNER
    assert "sk-a" not in OWNER     # the credentials' digest only


def test_the_continuation_is_the_recorded_conversation_then_the_instruction():
    """The body served: the recorded prompt fields and messages, the relayed answer, one user turn
    with the client's instruction; ``decide`` finds the answer's end in its render and splices the
    slot's tokens there."""
    comp = parse(compaction_of(CONVERSATION))
    fields = continuation(turn(), comp)
    assert fields["tools"] == TOOLS
    assert fields["messages"][:-2] == CONVERSATION
    assert fields["messages"][-2] == {"role": "assistant", **ANSWER}
    assert fields["messages"][-1] == {"role": "user", "content": instruction(comp)}
    eot = 9
    # the render: 6 turns closed as the recorded prompt's were (reasoning dropped: shorter), the
    # answer closed by the 7th end of turn, the instruction turn, the generation prompt
    render = [1, 2, 3] + [5, eot] * 6 + [6, 6, eot, 4, 4, 4, eot, 7]
    # the slot: the same prompt, then the answer as generated (reasoning 30, 31, then its two ids)
    ids = (1, 2, 3) + (5, eot) * 6 + (30, 31, 6, 6)
    t = turn(ids=ids, n_held=len(ids), regions=(Region(15, len(ids), 17, eot),))
    d = decide(t, fields, render, eot)
    assert isinstance(d, Aligned)
    end = len(render) - 6
    assert d.splice.n_keep == len(ids) and d.splice.tail == tuple(render[end:]) and d.splice.checked == ids


# --- the route's log and counters, on an in-memory server (tests/fakes.py) ------------------------

async def _route_layer(turn_: Turn, viewer=None):
    """A layer over the fake server whose slot 0 holds ``turn_``'s conversation (as the aligned
    route records it), on a server with 0008 (the end-of-turn token known); ``viewer``: the
    layer's token viewer (default the fakes' own)."""
    from fakes import make_layer

    layer = make_layer(viewer=viewer)
    await layer.table.refresh()
    layer.align._probed, layer.align.eot_id = True, 9
    layer.align.records[0] = (layer.table[0].seq, turn_)
    return layer


async def _plan(layer, body: dict, headers: dict, path: str = "/v1/chat/completions"):
    from ocache.cache.prepare import Shape
    from ocache.cache.routes import continued
    from ocache.layer import ParsedRequest

    req = ParsedRequest("r1", "POST", path, body, headers, headers.get("x-session-affinity"), False)
    return await continued.plan(layer, req, Shape("r1", req.path, body, True, "guest", None, None, None))


@pytest.mark.parametrize("path, looked_at", [("/v1/chat/completions", 0), ("/v1/responses", 1)])
async def test_a_title_request_is_neither_logged_nor_counted_as_a_compaction(caplog, path, looked_at):
    """opencode's title request (no tools; its system text, then two user messages) after the first
    turn of a conversation with tools: one message more than the record, no tools. On the chat
    route the route does not look at it (a conversation continued without its tools is Codex's
    compaction, on ``/v1/responses`` only); in a Responses body's chat form it looks at it, and it
    continues nothing. Not a compaction either way: no "compaction not continued ... history
    differs" line, no ``as_sent_`` counter; ``other_requests`` counts what it looked at. The first
    answer is the reasoning alone, as in the captured session (an empty answer may be left out of
    a Codex compaction, so the request is compared with the record). Fails on the route that
    logged it as a compaction not continued."""
    first = turn(messages=tuple(CONVERSATION[:2]), answer={"content": "", "reasoning_content": "Hm."})
    layer = await _route_layer(first)
    title = {"model": "qwen", "messages": [
        {"role": "system", "content": "You are a title generator. You output only a title."},
        {"role": "user", "content": "Generate a title for this conversation:\n"}, CONVERSATION[1]]}
    caplog.set_level("DEBUG", logger="ocache.cache")
    assert await _plan(layer, title, HEADERS, path) is None
    assert not [r for r in caplog.records if "compaction" in r.getMessage()], caplog.text
    stats = layer.continued.stats()
    assert stats.get("other_requests", 0) == looked_at and not [k for k in stats if k.startswith("as_sent")], stats


async def test_another_sessions_compaction_is_logged_as_not_continued(caplog):
    """A compaction of the very conversation slot 0 holds, from another session: recognised,
    logged and counted as a compaction not continued (``as_sent_another_session``), no plan."""
    class Viewer:     # the continuation is rendered only once a record was taken for the request's
        async def view(self, *a, **k):
            raise AssertionError("another session's conversation was about to be continued")

    layer = await _route_layer(turn(), Viewer())
    body = compaction_of([*CONVERSATION, {"role": "assistant", **ANSWER}])
    caplog.set_level("INFO", logger="ocache.cache")
    assert await _plan(layer, body, {**HEADERS, "x-session-affinity": "ses_beta"}) is None
    stats = layer.continued.stats()
    assert stats["recognised"] == 1 and stats["as_sent_another_session"] == 1 and stats["requests"] == 0, stats
    assert "compaction not continued: another session" in caplog.text
