"""Compaction served as a continuation: the guard, pure (seed 000 §13.9).

A client compacts a long conversation by asking the model for a summary of it. opencode 1.18.33
(``SessionCompaction.process`` in its ``session/compaction.ts``; the request captured from the real
client by ``tests/test_compaction_capture.py``, stored in ``tests/data/opencode-compaction.json``)
sends no tools, its compaction agent's system prompt and one user message that holds the whole
history flattened as text::

    Here is the conversation so far:

    <conversation>
    [User]: <the user's text>

    [Assistant reasoning]: <reasoning>
    [Assistant]: <text>
    [Assistant tool call]: read({"filePath": "a.py"})
    [Tool result]: <output>

    [User]: ...
    </conversation>

    Create a new anchored summary from the conversation history in the <conversation> tags above ...

(messages joined by a blank line, the parts of one message by a newline; a user's attachments
follow its text as ``[Attached <mime>: <name>]`` lines). That text shares no token with the
conversation the server holds, so sent as is it is a cold prefill of the whole history exactly when
the history is longest.

What ocache serves instead (``ocache/cache/routes/continued.py``): the conversation the slot holds
(its tokens up to the end of its last generation: the recorded request, the relayed answer) and one
user turn with the client's instruction (:func:`instruction`: its system text, then its text after
the history block), so the server prefills only that turn. The model summarises the conversation as
it read it, with its tools and system prompt above; the instruction's words about "the
<conversation> tags above" then name the conversation above.

The guard (:func:`matches`), every condition required, anything else is forwarded as sent:

* the request is one of a known client's compactions (:func:`parse`: no tools, system messages then
  one user message whose text holds the history block of that client's shape) and names at least
  one user message;
* the conversation is the requester's own (:func:`owns`): the recorded request and the compaction
  carry the same session key (``ocache.fingerprint.session_key`` of the headers, or neither has
  one) and the same credentials (``Authorization`` / ``x-api-key``, compared by their sha256): the
  record keeps them as ``Turn.owner`` (``ocache.substitute.owner_of``, the substitution gate's
  owner, set by ``AlignRoute.observe``);
* its history is the recorded conversation's, entry for entry (:func:`entries`: every user,
  assistant text, tool call and tool result entry, each compared whole, whitespace at the ends
  aside, a long tool output as the client cuts it: :func:`same_entry`; the reasoning entries
  aside, which the client keeps and the recorded request may have dropped): the conversation
  flattened as the client flattens it (:func:`opencode_history` of the recorded messages and the
  relayed answer) begins with exactly those entries (a client may leave its newest turns out of the
  summary: opencode keeps ``compaction.preserve_recent_tokens`` of them verbatim after it). Two
  projects given the same prompts share their first and last user lines; their tool results and
  answers differ;
* the fields the prompt is rendered with (``ocache.align.PROMPT_FIELDS``) that the request sets are
  the recorded ones (the continuation is rendered with the recorded ones: a field the client set
  otherwise could not be taken out of the forwarded body).

The rest of the decision is the aligned route's: :func:`ocache.align.decide` on the continuation
(:func:`continuation`), a request that is the recorded conversation plus one new user turn.

pi 0.73.1 (``generateSummary`` in its ``dist/core/compaction/compaction.js``; captured from the real
client by ``tests/test_pi_compaction.py``, its shape in ``tests/data/pi-compaction.json``) sends the
same kind of request: no tools, its summariser's system prompt, one user message (one text part)
that *opens* with ``<conversation>\n``, the history serialised its own way (``serializeConversation``
in ``dist/core/compaction/utils.js``: ``[User]: ``, ``[Assistant thinking]: ``, ``[Assistant]: ``,
``[Assistant tool calls]: read(path="a.py"); ...``, ``[Tool result]: `` cut at 2,000 UTF-16 code
units, entries joined by a blank line), ``\n</conversation>\n\n`` and its instructions. :func:`parse`
reads it as ``client == "pi"``; the guard is the same but for the history (:func:`pi_matches`): its
entries, thinking aside, are the first entries of the recorded conversation and its answer
(:func:`pi_history`), each equal, a tool result as pi cuts it (:func:`pi_truncated`). pi leaves the
newest ``keepRecentTokens`` out of the summary; when its cut falls inside a turn it sends a second
request in parallel with that turn's prefix (``generateTurnPrefixSummary``), whose history starts
later in the conversation: not the conversation's first entries, so it goes as sent.

Codex 0.169.0 compacts otherwise (its local compaction, ``codex exec`` with
``model_auto_compact_token_limit`` below the conversation; captured from the real client by
``tests/test_codex_compaction.py``, its shape in ``tests/data/codex-compaction.json``): it resends the
conversation's items as they were, the answer, and one user item with its instructions, but with
``tools: []`` (and ``parallel_tool_calls: false``). On a template that renders the tools first
(ocache's, Qwen3.5's) that prompt parts from the conversation at its first tokens: a cold prefill of
it all. :func:`without_tools` is that guard: the request is the recorded conversation, message for
message (reasoning aside, as the aligned route compares), then the relayed answer, then exactly one
user message, with no tools where the conversation had some, from the conversation's owner
(:func:`owns`); the served continuation is the request's own messages rendered with the
conversation's tools (``TOOL_FIELDS``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ocache.align import PROMPT_FIELDS, TOOL_FIELDS, Turn, _args, _generated, _text, canonical
from ocache.substitute import owned

#: opencode's history block: what opens and closes it in the user message
OPENCODE_OPEN = "<conversation>\n"
OPENCODE_CLOSE = "\n</conversation>"

#: the entries of opencode's flattened history (``[User]: ``, ``[Assistant]: ``, ...), each at the
#: start of the block or after a newline
_ENTRY = re.compile(r"(?:^|\n)\[(User|Assistant|Assistant reasoning|Assistant tool call|Tool result|Tool error)\]: ")
#: a user's attachment lines after its text
_ATTACHED = re.compile(r"(?:\n\[Attached [^\]\n]*\])+\s*$")
#: an ``[Assistant tool call]: `` entry's text: ``name({json arguments})``
_CALL = re.compile(r"([^(\n]*)\((.*)\)", re.S)
#: what opencode puts after the part it keeps of a long tool output in the history (it keeps the
#: first 2,000 characters: ``TOOL_OUTPUT_MAX_CHARS`` and ``truncate`` in its ``session/compaction.ts``)
TRUNCATED = "\n[truncated]"


@dataclass(frozen=True)
class Compaction:
    """A client's compaction request as :func:`parse` read it: ``client`` (``"opencode"`` or
    ``"pi"``), ``user_lines``: the texts of the history's user entries in order (stripped),
    ``system``: the request's system texts, ``after``: the user message's text after the history
    block (stripped), the client's instructions; ``history``: the text inside the history block."""

    client: str
    user_lines: tuple[str, ...]
    system: tuple[str, ...]
    after: str
    history: str = ""


def _user_lines(history: str) -> tuple[str, ...]:
    """The texts of the ``[User]: `` entries of an opencode history (each runs to the next entry)."""
    found = list(_ENTRY.finditer(history))
    out = []
    for i, m in enumerate(found):
        if m.group(1) != "User":
            continue
        end = found[i + 1].start() if i + 1 < len(found) else len(history)
        out.append(_ATTACHED.sub("", history[m.end():end]).strip())
    return tuple(out)


def parse(body: Mapping) -> Compaction | None:
    """``body`` (a chat request) read as a known client's compaction request, or None: no tools,
    its messages system messages then one user message whose text holds opencode's history block
    (``OPENCODE_OPEN`` ... ``OPENCODE_CLOSE``) or opens with pi's (``PI_OPEN`` ... ``PI_CLOSE``),
    with at least one user entry."""
    if body.get("tools"):
        return None
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        return None
    last = msgs[-1]
    if not isinstance(last, Mapping) or last.get("role") != "user":
        return None
    if any(not isinstance(m, Mapping) or m.get("role") not in ("system", "developer") for m in msgs[:-1]):
        return None
    try:
        text = _text(last.get("content"))
        system = tuple(_text(m.get("content")).strip() for m in msgs[:-1])
    except (AttributeError, TypeError):
        return None
    if text.startswith(PI_OPEN):
        return _parse_pi(text, system)
    start = text.find(OPENCODE_OPEN)
    end = text.rfind(OPENCODE_CLOSE)
    if start < 0 or end < start:
        return None
    lines = _user_lines(text[start + len(OPENCODE_OPEN):end])
    if not lines:
        return None
    return Compaction("opencode", lines, tuple(s for s in system if s),
                      text[end + len(OPENCODE_CLOSE):].strip())


def user_texts(messages: Sequence[Mapping]) -> list[str]:
    """The texts of the user messages of ``messages`` (text parts joined by newlines), stripped."""
    return [_text(m.get("content")).strip() for m in messages if m.get("role") == "user"]


def owns(turn: Turn, owner: str | None) -> str | None:
    """None when the conversation ``turn`` records is the requester's (``owner``:
    ``ocache.substitute.owner_of`` of the request's headers, ``session|sha256 of the credentials``;
    ``ocache.substitute.owned``): recorded with the same session key, or neither with one, and the
    same credentials; else why not. A record without an owner (``Turn.owner`` None) is nobody's."""
    if turn.owner is None or owner is None:
        return "the owner is unknown"
    if owned(turn.owner, owner):
        return None
    (r_session, _, r_creds), (session, _, creds) = turn.owner.rpartition("|"), owner.rpartition("|")
    if bool(r_session) != bool(session):
        return "a session key on one side only"
    if r_session != session:
        return "another session"
    return "other credentials"


#: the entries the model wrote: an answer's text, its calls (opencode ``call``, pi ``calls``)
MODEL_ENTRIES = frozenset({"assistant", "call", "calls"})


def vouched(sent: Sequence[tuple[str, Any]], recorded: Sequence[tuple[str, Any]], owner: str | None) -> str | None:
    """None when a requester that sent the first ``sent`` entries of the ``recorded`` conversation
    may be served all of it (the continuation holds every recorded entry, the conversation's system
    prompt and tools too), else why not. A session key vouches for it (:func:`owns` matched the
    record's). Without one (pi sends none) anybody with the same credentials is the same owner, so
    the requester must show it read the conversation: at least half of its entries, one of them
    the model's own (an answer or a call, text a client only has from the answers) unless it sent
    them all. A history holding only a first question, which anybody can guess, is served as sent."""
    session = (owner or "").rpartition("|")[0]
    if session:
        return None
    if len(sent) < len(recorded) and not any(kind in MODEL_ENTRIES for kind, _ in sent):
        return "no session key, and none of the model's entries sent"
    if 2 * len(sent) < len(recorded):
        return "no session key, and less than half the conversation sent"
    return None


def entries(history: str) -> tuple[tuple[str, Any], ...]:
    """An opencode history (the text inside the history block) as its entries in order, the
    reasoning aside: ``("user", text)`` (its attachment lines aside), ``("assistant", text)``,
    ``("call", [name, arguments])`` (the JSON arguments parsed), ``("tool", output)`` (a result or
    an error), each text stripped."""
    found = list(_ENTRY.finditer(history))
    out: list[tuple[str, Any]] = []
    for i, m in enumerate(found):
        kind = m.group(1)
        end = found[i + 1].start() if i + 1 < len(found) else len(history)
        text = history[m.end():end]
        if kind == "User":
            out.append(("user", _ATTACHED.sub("", text).strip()))
        elif kind == "Assistant":
            out.append(("assistant", text.strip()))
        elif kind == "Assistant tool call":
            call = _CALL.fullmatch(text.strip())
            out.append(("call", [call.group(1), _args(call.group(2))] if call else text.strip()))
        elif kind in ("Tool result", "Tool error"):
            out.append(("tool", text.strip()))
    return tuple(out)


def same_entry(sent: tuple[str, Any], recorded: tuple[str, Any]) -> bool:
    """Whether an entry of the client's history (:func:`entries`) is the recorded one: equal, or a
    tool output the client cut (its first characters, then ``TRUNCATED``)."""
    if sent == recorded:
        return True
    if sent[0] != "tool" or recorded[0] != "tool" or not sent[1].endswith(TRUNCATED):
        return False
    kept = sent[1][:-len(TRUNCATED)]
    return bool(kept) and len(recorded[1]) > len(kept) and recorded[1].startswith(kept)


def history_of(body: Mapping) -> str:
    """The text inside the history block of a compaction request :func:`parse` recognised."""
    text = _text(body["messages"][-1].get("content"))
    return text[text.find(OPENCODE_OPEN) + len(OPENCODE_OPEN):text.rfind(OPENCODE_CLOSE)]


def matches(comp: Compaction, turn: Turn, body: Mapping, owner: str | None) -> str | None:
    """None when ``comp`` (of ``body``, sent by ``owner``: ``ocache.substitute.owner_of``) is the
    compaction of ``turn``'s conversation (module docstring: the guard), else why not."""
    miss = owns(turn, owner)
    if miss is not None:
        return miss
    for k in PROMPT_FIELDS:
        if k in body and turn.fields.get(k) != body[k]:
            return "prompt fields differ"
    if comp.client == "pi":
        return pi_matches(comp, turn, owner)
    try:
        sent = entries(history_of(body))
        recorded = entries(opencode_history([*turn.messages, {"role": "assistant", **turn.answer}]))
    except (AttributeError, TypeError, ValueError):
        return "malformed message"
    if not sent or len(sent) > len(recorded) or not all(map(same_entry, sent, recorded)):
        return "history differs"
    return vouched(sent, recorded, owner)


def instruction(comp: Compaction) -> str:
    """The one user turn served after the conversation: the client's system texts, then its
    instructions after the history block, separated by blank lines."""
    return "\n\n".join(p for p in (*comp.system, comp.after) if p)


def continuation(turn: Turn, comp: Compaction) -> dict[str, Any]:
    """The body fields of the continuation: the recorded request's prompt fields and its messages,
    the relayed answer, one user turn with :func:`instruction`. ``ocache.align.decide(turn, <these
    fields>, <their render>)`` finds where the conversation the slot holds ends in it."""
    messages = [*turn.messages, {"role": "assistant", **turn.answer},
                {"role": "user", "content": instruction(comp)}]
    return {**dict(turn.fields), "messages": messages}


def opencode_history(messages: Sequence[Mapping]) -> str:
    """A chat conversation (``messages``: user, assistant with ``reasoning_content`` / ``content`` /
    ``tool_calls``, tool results) flattened as opencode 1.18.33 flattens its session for a
    compaction (module docstring; ``tests/data/opencode-compaction.json``): for the tests and
    ``scripts/measure-compaction``. System messages are left out (opencode's are not session
    messages); a tool's output is not truncated (opencode cuts very long ones)."""
    results = {m.get("tool_call_id"): _text(m.get("content")) for m in messages if m.get("role") == "tool"}
    called = {c.get("id") for m in messages for c in (m.get("tool_calls") or ())}
    blocks: list[str] = []
    for m in messages:
        role = m.get("role")
        if role == "tool" and m.get("tool_call_id") not in called and blocks:
            # a result whose call is the assistant's text (a call the server did not parse)
            blocks[-1] += f"\n[Tool result]: {_text(m.get('content'))}"
        elif role == "user":
            blocks.append(f"[User]: {_text(m.get('content'))}")
        elif role == "assistant":
            lines = []
            if m.get("reasoning_content"):
                lines.append(f"[Assistant reasoning]: {m['reasoning_content']}")
            if _text(m.get("content")):
                lines.append(f"[Assistant]: {_text(m.get('content'))}")
            for c in m.get("tool_calls") or ():
                fn = c.get("function") or {}
                args = fn.get("arguments")
                args = json.dumps(json.loads(args) if isinstance(args, str) else args, separators=(",", ":"),
                                  ensure_ascii=False)
                lines.append(f"[Assistant tool call]: {fn.get('name')}({args})")
                if c.get("id") in results:
                    lines.append(f"[Tool result]: {results[c['id']]}")
            if lines:
                blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def opencode_request(messages: Sequence[Mapping], system: str, after: str, **fields: Any) -> dict:
    """opencode's compaction request of the conversation ``messages``: its compaction agent's
    ``system`` text, one user message with the history block and ``after`` (the instructions),
    ``fields`` beside them (``max_tokens``, ``stream``, ...)."""
    text = (f"Here is the conversation so far:\n\n{OPENCODE_OPEN}{opencode_history(messages)}"
            f"{OPENCODE_CLOSE}\n\n{after}")
    return {**fields, "messages": [{"role": "system", "content": system}, {"role": "user", "content": text}]}


def without_tools(turn: Turn, body: Mapping, owner: str | None) -> list | str:
    """The continuation's messages when ``body`` (a chat body, or the chat form of a Responses body)
    is ``turn``'s conversation followed by the relayed answer and exactly one user message, sent
    without the tools the conversation had (module docstring: Codex's compaction), else why not. An
    empty answer (no text, no call) may be missing from the request (Codex leaves it out): the
    continuation then has it where the slot holds it. The fields the prompt is rendered with besides
    the tools (``PROMPT_FIELDS`` less ``TOOL_FIELDS``) must be the recorded ones, and the requester
    (``owner``, ``ocache.substitute.owner_of``) the conversation's (:func:`owns`)."""
    if body.get("tools"):
        return "the request has tools"
    if not turn.fields.get("tools"):
        return "the conversation had no tools"
    miss = owns(turn, owner)
    if miss is not None:
        return miss
    if any(body.get(k) != turn.fields.get(k) for k in PROMPT_FIELDS if k not in TOOL_FIELDS):
        return "prompt fields differ"
    msgs = body.get("messages")
    n = len(turn.messages)
    answer = {"role": "assistant", **turn.answer}
    empty = not _text(answer.get("content")).strip() and not answer.get("tool_calls")
    if not isinstance(msgs, list) or not (len(msgs) == n + 2 or (empty and len(msgs) == n + 1)):
        return "not one turn after the answer"
    try:
        if any(canonical(a) != canonical(b) for a, b in zip(msgs[:n], turn.messages)):
            return "history differs"
        if len(msgs) == n + 2 and _generated(msgs[n]) != _generated(answer):
            return "answer differs"
        last = msgs[-1]
        if last.get("role") != "user" or not _text(last.get("content")).strip():
            return "not one user turn after the answer"
    except (AttributeError, TypeError):
        return "malformed message"
    return list(msgs) if len(msgs) == n + 2 else [*msgs[:n], answer, last]


# --- pi ---------------------------------------------------------------------------------------------

#: pi's history block: the user text opens with ``PI_OPEN``, and ``PI_CLOSE`` ends the history before
#: the instructions (pi 0.73.1, ``generateSummary`` and ``generateTurnPrefixSummary`` in its
#: ``dist/core/compaction/compaction.js``)
PI_OPEN = "<conversation>\n"
PI_CLOSE = "\n</conversation>\n\n"
#: the entries of pi's serialised history (``serializeConversation`` in its
#: ``dist/core/compaction/utils.js``), joined by a blank line
_PI_ENTRY = re.compile(r"(?:^|\n\n)\[(User|Assistant thinking|Assistant|Assistant tool calls|Tool result)\]: ")
_PI_KINDS = {"User": "user", "Assistant": "assistant", "Assistant tool calls": "calls", "Tool result": "tool"}
#: the UTF-16 code units of a tool result pi keeps in the history (``TOOL_RESULT_MAX_CHARS``, utils.js)
PI_TOOL_RESULT_MAX = 2000


def _parse_pi(text: str, system: tuple[str, ...]) -> Compaction | None:
    """pi's compaction request (its user ``text`` opens with ``PI_OPEN``), or None when its history
    block does not close or names no user entry."""
    end = text.find(PI_CLOSE, len(PI_OPEN) - 1)
    if end < 0:
        return None
    history = text[len(PI_OPEN):end]
    lines = tuple(t.strip() for k, t in pi_entries(history) if k == "user")
    if not lines:
        return None
    return Compaction("pi", lines, tuple(s for s in system if s), text[end + len(PI_CLOSE):].strip(), history)


def pi_entries(history: str) -> tuple[tuple[str, str], ...]:
    """pi's serialised history (the text inside its history block) as its entries in order, the
    thinking aside: ``("user", text)``, ``("assistant", text)``, ``("calls", "name(k=json, ...); ...")``,
    ``("tool", output)``, each text exactly as written (pi writes them unchanged)."""
    found = list(_PI_ENTRY.finditer(history))
    if not found or found[0].start() != 0:
        return ()
    out = []
    for i, m in enumerate(found):
        end = found[i + 1].start() if i + 1 < len(found) else len(history)
        if m.group(1) in _PI_KINDS:
            out.append((_PI_KINDS[m.group(1)], history[m.end():end]))
    return tuple(out)


def _utf16(text: str) -> int:
    """``text``'s length in UTF-16 code units (JavaScript's ``length``)."""
    return len(text.encode("utf-16-le", "surrogatepass")) // 2


def pi_truncated(text: str) -> str:
    """A tool result as pi keeps it in the history (``truncateForSummary``, utils.js): its first
    ``PI_TOOL_RESULT_MAX`` UTF-16 code units, then a line saying how many more there were."""
    n = _utf16(text)
    if n <= PI_TOOL_RESULT_MAX:
        return text
    kept = text.encode("utf-16-le", "surrogatepass")[:2 * PI_TOOL_RESULT_MAX].decode("utf-16-le", "surrogatepass")
    return f"{kept}\n\n[... {n - PI_TOOL_RESULT_MAX} more characters truncated]"


def _js_json(value: Any) -> str:
    """``JSON.stringify(value)`` of a value parsed from JSON (no spaces, non-ASCII as is)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def pi_history(messages: Sequence[Mapping]) -> tuple[tuple[str, str], ...]:
    """The entries pi's history holds for a chat conversation as pi sends it (``messages``: pi's
    system prompt, user messages with text parts, assistant messages with ``content`` and
    ``tool_calls``, ``tool`` results; pi-ai's ``openai-completions`` provider), thinking aside, as
    :func:`pi_entries` reads them: system messages left out, a message without text none, the text
    parts of a user message joined as pi joins them (nothing between), a call's arguments written
    ``key=<JSON value>`` in their order. A tool result is its whole output (pi cuts long ones:
    :func:`pi_truncated`). Raises ValueError for arguments that are not a JSON object."""
    out: list[tuple[str, str]] = []
    for m in messages:
        role, content = m.get("role"), m.get("content")
        if isinstance(content, list):
            text = "".join(p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text")
        else:
            text = content if isinstance(content, str) else ""
        if role == "user" and text:
            out.append(("user", text))
        elif role == "assistant":
            if text:
                out.append(("assistant", text))
            calls = []
            for c in m.get("tool_calls") or ():
                fn = c.get("function") or {}
                args = _args(fn.get("arguments"))
                if not isinstance(args, dict):
                    raise ValueError("tool call arguments are not an object")
                calls.append(f"{fn.get('name')}({', '.join(f'{k}={_js_json(v)}' for k, v in args.items())})")
            if calls:
                out.append(("calls", "; ".join(calls)))
        elif role == "tool" and text:
            out.append(("tool", text))
    return tuple(out)


def pi_matches(comp: Compaction, turn: Turn, owner: str | None = None) -> str | None:
    """None when pi's compaction ``comp`` re-states ``turn``'s conversation: its history's entries
    (:func:`pi_entries`, thinking aside) are the first entries of the recorded conversation and the
    relayed answer (:func:`pi_history`), each equal, a tool result as pi cuts it
    (:func:`pi_truncated`); else why not. pi leaves its newest messages out of the summary
    (``keepRecentTokens``); a history that starts later in the conversation (the prefix of a split
    turn, ``generateTurnPrefixSummary``) is not these entries and goes as sent. A later compaction
    (its instructions open with the previous summary, :func:`pi_previous_summary`) of a conversation
    that opens with a user message ending in that summary in ``<summary>`` tags (pi's compaction
    summary, ``convertToLlm`` in its ``dist/core/messages.js``) compares its history with the
    entries after that message. ``owner`` (the requester's, ``ocache.substitute.owner_of``) must be
    vouched for (:func:`vouched`): without a session key, half the conversation sent."""
    try:
        recorded = pi_history([*turn.messages, {"role": "assistant", **turn.answer}])
    except (AttributeError, TypeError, ValueError):
        return "malformed message"
    sent = pi_entries(comp.history)
    prev = pi_previous_summary(comp.after)
    if prev is not None and recorded and recorded[0][0] == "user" and \
            recorded[0][1].endswith(f"{PI_SUMMARY_OPEN}{prev}{PI_SUMMARY_CLOSE}"):
        # a later compaction: the conversation opens with the previous compaction's summary, which
        # the request re-states in its previous-summary block; its history starts after it
        recorded = recorded[1:]
    if not sent or len(sent) > len(recorded):
        return "history differs"
    for (kind, text), (r_kind, r_text) in zip(sent, recorded):
        if kind != r_kind or (text != r_text and not (kind == "tool" and text == pi_truncated(r_text))):
            return "history differs"
    return vouched(sent, recorded, owner)


#: how pi's compaction summary message ends (``COMPACTION_SUMMARY_PREFIX`` / ``_SUFFIX`` in its
#: ``dist/core/messages.js``: the summary between these tags, at the end of a user message)
PI_SUMMARY_OPEN = "<summary>\n"
PI_SUMMARY_CLOSE = "\n</summary>"
#: the block a later compaction's instructions open with (``generateSummary``)
PI_PREVIOUS_OPEN = "<previous-summary>\n"
PI_PREVIOUS_CLOSE = "\n</previous-summary>"


def pi_previous_summary(after: str) -> str | None:
    """The previous summary a later pi compaction re-states (the text of the ``<previous-summary>``
    block its instructions ``after`` open with), or None."""
    if not after.startswith(PI_PREVIOUS_OPEN):
        return None
    end = after.find(PI_PREVIOUS_CLOSE, len(PI_PREVIOUS_OPEN) - 1)
    return after[len(PI_PREVIOUS_OPEN):end] if end >= 0 else None


def pi_request(messages: Sequence[Mapping], system: str, after: str, previous: str | None = None,
               **fields: Any) -> dict:
    """pi's compaction request of the conversation ``messages`` (for the tests): its summariser's
    ``system`` text, one user message (one text part) with the history block (:func:`pi_history`,
    tool results cut as pi cuts them), the ``previous`` summary's block if any, and ``after`` (the
    instructions), ``fields`` beside them."""
    if previous is not None:
        after = f"{PI_PREVIOUS_OPEN}{previous}{PI_PREVIOUS_CLOSE}\n\n{after}"
    parts = []
    for kind, text in pi_history(messages):
        tag = {"user": "User", "assistant": "Assistant", "calls": "Assistant tool calls", "tool": "Tool result"}[kind]
        parts.append(f"[{tag}]: {pi_truncated(text) if kind == 'tool' else text}")
    text = PI_OPEN + "\n\n".join(parts) + PI_CLOSE + after
    return {**fields, "messages": [{"role": "system", "content": system},
                                   {"role": "user", "content": [{"type": "text", "text": text}]}]}
