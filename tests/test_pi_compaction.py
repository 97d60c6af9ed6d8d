"""pi's compaction served as the conversation's continuation.

pi 0.73.1 compacts a session once its context passes ``contextWindow - compaction.reserveTokens``
(``_checkCompaction`` in its ``dist/core/agent-session.js``) with a standalone request
(``generateSummary`` in ``dist/core/compaction/compaction.js``): no tools, its summariser's system
prompt, one user message of one text part that opens with ``<conversation>\\n``, the history
serialised (``serializeConversation``, ``dist/core/compaction/utils.js``: ``[User]: ``,
``[Assistant thinking]: ``, ``[Assistant]: ``, ``[Assistant tool calls]: name(k=<JSON>, ...)``,
``[Tool result]: `` cut at 2,000 UTF-16 code units, entries joined by a blank line), then
``\\n</conversation>\\n\\n`` and its instructions. The history is the conversation up to the cut
(``keepRecentTokens`` of the newest messages are kept verbatim). When the cut falls inside a turn
it sends two such requests in parallel: the history before that turn and the turn's prefix
(``generateTurnPrefixSummary``). The shapes are in ``tests/data/pi-compaction.json``, captured by
the real-client test below.

``ocache.compaction.parse`` reads pi's shape (``client == "pi"``); ``pi_matches`` is the guard: the
history's entries must be the first entries of the recorded conversation. The turn's prefix starts
later in the conversation and goes as sent, on another slot.

The guard needs no server; the real client's run is marked ``server`` and ``slow``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from ocache.align import Turn
from ocache.compaction import (PI_CLOSE, PI_OPEN, continuation, instruction, matches, parse, pi_entries,
                               pi_history, pi_request, pi_truncated)
from ocache.substitute import owner_of

DATA = json.loads((Path(__file__).parent / "data" / "pi-compaction.json").read_text())

#: our own texts in pi's places (pi's are left out of the checkout)
SYSTEM = "You summarise conversations."
AFTER = "The messages above are a conversation to summarise."
TOOLS = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]
CALL = {"id": "c1", "type": "function",
        "function": {"name": "read", "arguments": "{\"path\":\"a.py\",\"offset\":2,\"opts\":{\"raw\":true}}"}}
#: a conversation as pi sends it: user text parts, the answer's content a string, tool results
CONVERSATION = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": [{"type": "text", "text": "Read a.py."}]},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "import os\n"},
    {"role": "assistant", "content": "It imports os."},
    {"role": "user", "content": [{"type": "text", "text": "And b.py?"}]},
]
ANSWER = {"content": "b.py is empty.", "reasoning_content": "Nothing there."}
#: pi sends no session header: the credentials and the whole history decide
OWNER = owner_of({"authorization": "Bearer sk-local"})


def turn(messages=CONVERSATION, **kw) -> Turn:
    base = dict(messages=tuple(messages), fields={"tools": TOOLS}, answer=ANSWER, finish_reason="stop",
                stop=False, known=(1, 2, 3), n_prompt_eot=6, n_held=40, slot=0, owner=OWNER)
    return Turn(**{**base, **kw})


def request(messages, **fields) -> dict:
    return pi_request(messages, SYSTEM, AFTER, model="qwen", stream=True, max_completion_tokens=64, **fields)


def _matches(body, t=None, owner=OWNER):
    return matches(parse(body), t or turn(), body, owner)


def test_the_captured_shape_is_the_one_the_parser_reads():
    """The real client's two requests: no tools, a system message, one user message of one text
    part that opens with the history block; the history request's entries begin with the
    conversation's first user message, the turn prefix's are that turn's user message alone."""
    history, prefix = DATA["compaction"]
    for c in (history, prefix):
        assert "tools" not in c["fields"] and [m["role"] for m in c["messages"]] == ["system", "user"]
        part, = c["messages"][1]["content"]
        assert part["type"] == "text" and part["opens"] == PI_OPEN and part["closes"] == PI_CLOSE
    assert history["messages"][0]["sha256"] == prefix["messages"][0]["sha256"]      # one summariser prompt
    assert history["messages"][1]["content"][0]["after"] != prefix["messages"][1]["content"][0]["after"]
    assert history["messages"][1]["content"][0]["history_entries"][0] == "user"
    assert prefix["messages"][1]["content"][0]["history_entries"] == ["user"]
    # the budgets: 0.8 and 0.5 of reserveTokens (3000 in the capture)
    assert (history["max_completion_tokens"], prefix["max_completion_tokens"]) == (2400, 1500)
    # the conversation pi sent before: its text parts are what the history block re-states
    assert DATA["turn"]["tools"] > 0 and DATA["turn"]["messages"][0]["role"] == "system"


def test_a_pi_request_is_read_as_pis_not_opencodes():
    body = request(CONVERSATION)
    comp = parse(body)
    assert comp is not None and comp.client == "pi"
    assert comp.user_lines == ("Read a.py.", "And b.py?") and comp.system == (SYSTEM,) and comp.after == AFTER
    assert instruction(comp) == SYSTEM + "\n\n" + AFTER
    text = body["messages"][1]["content"][0]["text"]
    assert text == (PI_OPEN + '[User]: Read a.py.\n\n[Assistant tool calls]: read(path="a.py", offset=2, '
                    'opts={"raw":true})\n\n[Tool result]: import os\n\n\n[Assistant]: It imports os.\n\n'
                    "[User]: And b.py?" + PI_CLOSE + AFTER)
    # with tools it is an agent turn, not a compaction; a block that never closes is no history
    assert parse({**body, "tools": TOOLS}) is None
    assert parse({**body, "messages": [body["messages"][0], {"role": "user", "content": text[:-len(PI_CLOSE + AFTER)]}]}) is None


def test_the_history_reads_back_as_the_conversations_entries():
    """``pi_entries`` of the block pi writes gives ``pi_history`` of the conversation, thinking aside."""
    hist = pi_history([*CONVERSATION, {"role": "assistant", **ANSWER}])
    assert hist == (("user", "Read a.py."), ("calls", 'read(path="a.py", offset=2, opts={"raw":true})'),
                    ("tool", "import os\n"), ("assistant", "It imports os."), ("user", "And b.py?"),
                    ("assistant", "b.py is empty."))
    text = request(CONVERSATION)["messages"][1]["content"][0]["text"]
    block = text[len(PI_OPEN):text.index(PI_CLOSE)]
    assert pi_entries(block) == hist[:-1]
    thought = block.replace("[Assistant]: It imports os.", "[Assistant thinking]: hmm\n\n[Assistant]: It imports os.")
    assert pi_entries(thought) == hist[:-1]


def test_the_guard_takes_the_conversations_first_entries():
    """The history pi summarises is the conversation up to its cut: the whole of it, the answer
    too, or its first turns. Another conversation, a history that starts later (a split turn's
    prefix) or one entry more than the record holds is not."""
    answered = [*CONVERSATION, {"role": "assistant", **ANSWER}]
    assert _matches(request(answered)) is None
    assert _matches(request(CONVERSATION)) is None
    assert _matches(request(CONVERSATION[:5])) is None          # the last turn kept out of the summary
    assert _matches(request(CONVERSATION[:2])) is None
    # the split turn's prefix: the last turn's user message alone
    assert _matches(request([CONVERSATION[0], CONVERSATION[5]])) == "history differs"
    # another middle, another call, one more turn than recorded
    other = [*CONVERSATION[:3], dict(CONVERSATION[3], content="import sys\n"), *CONVERSATION[4:]]
    assert _matches(request(other)) == "history differs"
    moved = dict(CALL, function={"name": "read", "arguments": "{\"offset\":2,\"path\":\"a.py\",\"opts\":{\"raw\":true}}"})
    assert _matches(request([*CONVERSATION[:2], dict(CONVERSATION[2], tool_calls=[moved]), *CONVERSATION[3:]])) == \
        "history differs"
    assert _matches(request([*answered, {"role": "user", "content": "And c.py?"}])) == "history differs"
    # a prompt field the continuation could not take out of the forwarded body
    assert _matches(request(CONVERSATION, chat_template_kwargs={"enable_thinking": False})) == "prompt fields differ"


def test_an_answer_pi_left_out_is_no_entry():
    """pi sends no assistant message for an empty answer (pi-ai's ``openai-completions`` provider),
    and its history has no entry for one: the record's empty answer is none either."""
    conv = [CONVERSATION[0], CONVERSATION[1], {"role": "user", "content": [{"type": "text", "text": "Again."}]}]
    t = turn(conv, answer={"content": ""})
    assert _matches(request(conv), t) is None


def test_a_tool_result_pi_cut_is_the_recorded_one():
    """pi keeps the first 2,000 UTF-16 code units of a tool result, then a line with how many more
    there were: that entry is the recorded result (a character outside the BMP counts two, and the
    cut may fall between its halves); another result's cut is not."""
    long = "x = 1\n" * 400 + "\U0001f600" * 10
    cut = pi_truncated(long)
    assert cut == long[:2000] + "\n\n[... 420 more characters truncated]"
    odd = "y" * 1999 + "\U0001f600" + "z"
    assert pi_truncated(odd) == "y" * 1999 + "\ud83d" + "\n\n[... 2 more characters truncated]"
    conv = [*CONVERSATION[:3], dict(CONVERSATION[3], content=long), *CONVERSATION[4:]]
    assert _matches(request(conv), turn(conv)) is None
    other = [*CONVERSATION[:3], dict(CONVERSATION[3], content="y" + long[1:]), *CONVERSATION[4:]]
    assert _matches(request(other), turn(conv)) == "history differs"


@pytest.mark.parametrize("what, owner, why", [
    ("another key", owner_of({"authorization": "Bearer sk-b"}), "other credentials"),
    ("a session key", owner_of({"x-session-affinity": "s", "authorization": "Bearer sk-local"}),
     "a session key on one side only"),
])
def test_only_the_requesters_own_conversation_is_continued(what, owner, why):
    assert _matches(request(CONVERSATION), owner=owner) == why, what


def test_the_continuation_is_the_recorded_conversation_then_the_instruction():
    comp = parse(request(CONVERSATION))
    fields = continuation(turn(), comp)
    assert fields["tools"] == TOOLS and fields["messages"][:-2] == CONVERSATION
    assert fields["messages"][-2:] == [{"role": "assistant", **ANSWER},
                                       {"role": "user", "content": SYSTEM + "\n\n" + AFTER}]


# --- the real client ---------------------------------------------------------------------------
