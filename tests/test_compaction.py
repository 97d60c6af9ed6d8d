"""ocache.compaction: recognising a client's compaction request and the guard, without a server (the
route on the real template: tests/test_compaction_real.py). The opencode request is the one captured
from the real client (tests/data/opencode-compaction.json)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from ocache.align import Aligned, Turn, decide
from ocache.substitute import Region
from ocache.compaction import (OPENCODE_CLOSE, OPENCODE_OPEN, continuation, instruction, matches,
                               opencode_history, opencode_request, parse)

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


def turn(**kw) -> Turn:
    base = dict(messages=tuple(CONVERSATION), fields={"tools": TOOLS}, answer=ANSWER, finish_reason="stop",
                stop=False, known=(1, 2, 3), n_prompt_eot=6, n_held=40, slot=1)
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


def test_the_guard_finds_the_conversation_by_its_first_and_last_user_lines():
    comp = parse(compaction_of(CONVERSATION))
    assert matches(comp, turn(), compaction_of(CONVERSATION)) is None
    # the client kept its newest turn out of the summary: the last line is an earlier user message
    older = parse(compaction_of(CONVERSATION[:5]))
    assert older.user_lines == ("Read a.py.",) and matches(older, turn(), {}) is None
    # another conversation
    other = [dict(CONVERSATION[1], content="Read c.py."), *CONVERSATION[2:]]
    assert matches(parse(compaction_of(other)), turn(), {}) == "first user line differs"
    later = [*CONVERSATION, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "And c.py?"}]
    assert matches(parse(compaction_of(later)), turn(), {}) == "last user line not in the record"
    # a prompt field the continuation could not take out of the forwarded body
    body = compaction_of(CONVERSATION) | {"chat_template_kwargs": {"enable_thinking": False}}
    assert matches(comp, turn(), body) == "prompt fields differ"
    assert matches(comp, turn(messages=(CONVERSATION[0],)), {}) == "no user message in the record"


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
