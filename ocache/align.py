"""Alignment: serve a rewritten history from the slot's own tokens (docs/benchmarks.md, "Rewritten histories"; ``scripts/measure-align``).

The chat templates people run rewrite the history: Qwen3/3.5 render an assistant turn's reasoning
only after the last user message (``loop.index0 > ns.last_query_index`` in
``models/templates/Qwen3.5-4B.jinja`` of the pinned source), so a new user message re-renders every
assistant turn since the previous one; clients drop the reasoning (opencode for models not marked
``interleaved``, the llama.cpp web UI), re-inject it as ``<think>`` text in the content (Open WebUI)
or send it back. Each time the prompt parts from what the slot holds at the first rewritten turn and
everything after it is prefilled again (``scripts/measure-align``: 5,522 tokens alone for 33 new).

The slot holds the conversation as the model generated it. When a request is the conversation ocache
recorded and relayed for that slot, except for those rewrites, followed by something new, ocache
serves "the slot's tokens up to the end of its last generation, then the request's new part"
through patch 0008 (``ocache_splice``, patches/README.md): only the new part is prefilled. The model
then sees its own earlier reasoning (what some templates offer for agents themselves:
``clear_thinking: false`` in GLM-4.7-Flash's, ``preserve_thinking`` in LFM2.5's), so the prompt is no
longer the template's byte for byte; config ``tiers.resident.align: false`` turns it off.

This module is the decision only, pure (no I/O): :func:`decide` takes what was recorded for the
slot's last turn (:class:`Turn`) and the new request (its body and the token ids the server renders
for it, ``ocache.tokens.TokenView.tokens``) and returns an :class:`Aligned` splice or :class:`AsSent`
with the reason. :func:`record` builds the :class:`Turn` to keep after a response.

The guard, every condition required (anything else is forwarded as sent):

* the fields besides the messages that shape the prompt (``PROMPT_FIELDS``: tools, template
  arguments, ...) are the recorded ones: the slot's head was rendered with them;
* the request's messages begin with the recorded request's messages and then the relayed answer,
  each equal *reasoning aside* (:func:`canonical`: ``reasoning_content`` / ``reasoning`` /
  ``thinking`` dropped, a leading ``<think>...</think>`` block taken out of an assistant's content,
  an assistant's content compared stripped, tool calls by name and parsed arguments, not by id,
  calls the server relayed as text in the template's form the same as those calls sent back parsed),
  and at least one message follows them (the new part);
* the relayed answer ended with the model's end of turn (``finish_reason`` ``stop`` or
  ``tool_calls``, no client stop strings): the slot then holds the prompt and every generated token
  but that last one (docs/llama-server.md §7);
* the conversation is the requester's (``Turn.owner``, ``ocache.substitute.owned``: its session key
  and credentials);
* every id the slot holds is known (``Turn.ids``: the prompts served, then the ids the server
  reported it sampled, patches/0010, adding up to ``n_held``), and the slot's ids and the new
  prompt's are walked token by token (``ocache.substitute.compare``): where the answer ends is read
  from the last generated span, never counted; each difference is a span the caller judges on its
  text (``ocache.substitute.declared``); the spans applied to the slot's ids give the prompt up to
  the answer's end exactly (``ocache.substitute.check``);
* the server checks all ``n_held`` kept ids (0008's ``xxh3``, ``n_check == n_keep``) and refuses the
  splice otherwise (412): the request then goes as sent.

A request that already extends what the slot holds (its first ``n_held`` ids are the slot's) needs
no splice: :class:`AsSent` ``extends``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import xxhash

from ocache.substitute import Proof, Refused, Region, check, compare, owned

#: request fields besides ``messages`` that change the rendered prompt (a subset of
#: ``ocache.tokens.RENDER_FIELDS``: grammar, json_schema, response_format and reasoning_format
#: only constrain or parse the output)
PROMPT_FIELDS: tuple[str, ...] = (
    "tools", "tool_choice", "parallel_tool_calls", "add_generation_prompt", "continue_final_message",
    "chat_template_kwargs", "reasoning_effort",
)

#: the request fields that say which tools the model may call (a client's compaction may leave
#: them out: ``ocache.compaction.without_tools``)
TOOL_FIELDS: tuple[str, ...] = ("tools", "tool_choice", "parallel_tool_calls")

#: message keys that carry reasoning (OpenAI-compatible servers and clients use all three)
REASONING_KEYS = frozenset({"reasoning_content", "reasoning", "thinking"})

#: finish reasons of a generation that ended with the model's end-of-turn token
ENDED = frozenset({"stop", "tool_calls"})

_THINK = re.compile(r"^\s*<think>.*?</think>", re.S)


def xxh3(tokens: Sequence[int]) -> str:
    """XXH3-64 (seed 0) of token ids as int32 little-endian, 16 hex digits: patch 0008's hash."""
    return xxhash.xxh3_64_hexdigest(np.asarray(tokens, dtype="<i4").tobytes())


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text")
    return json.dumps(content, sort_keys=True)


def _args(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_XML_FUNCTION = re.compile(r"<function=([^>\n]+)>\s*(.*?)\s*</function>", re.S)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


def _value(text: str) -> Any:
    """An XML call's parameter value: JSON when it parses as a number, object, array, bool or null
    (what the client then sends back as that JSON value), else the text itself."""
    try:
        v = json.loads(text)
    except ValueError:
        return text
    return text if isinstance(v, str) else v


def _one_call(inner: str) -> list | None:
    """[name, arguments] of one ``<tool_call>`` block's inside, in the JSON form (Qwen3, Hermes:
    ``{"name": ..., "arguments": {...}}``) or the XML one (Qwen3.5, Qwen3-Coder: ``<function=NAME>``
    with ``<parameter=KEY>`` value ``</parameter>`` lines); None when it is neither, whole."""
    if inner.startswith("{"):
        try:
            obj = json.loads(inner)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        return [obj["name"], _args(obj.get("arguments", {}))]
    m = _XML_FUNCTION.fullmatch(inner)
    if m is None:
        return None
    args = {}
    pos = 0
    for p in _XML_PARAMETER.finditer(m.group(2)):
        if m.group(2)[pos:p.start()].strip():
            return None
        args[p.group(1)] = _value(p.group(2))
        pos = p.end()
    if m.group(2)[pos:].strip():
        return None
    return [m.group(1), args]


def text_calls(text: str) -> tuple[str, list] | None:
    """An answer whose text ends with tool calls in the template's own form (what the server
    relays when it does not parse them: ``tool_choice: none``, a client grammar; the text of
    ``ocache.bench.agent.CALL_GRAMMAR``) as (the text before the first ``<tool_call>``, the calls as
    [name, arguments]); None when the text holds no call or anything but calls follows the first.
    A client sends such an answer back parsed, as ``tool_calls`` (the newcomer's loop, /tmp/nc
    ``loop.py``), and the template renders that entry as the same text (Qwen3.5-4B.jinja,
    Qwen-Qwen3-0.6B.jinja of the pinned source)."""
    at = text.find("<tool_call>")
    if at < 0:
        return None
    rest = text[at:]
    calls = []
    pos = 0
    for m in _CALL_BLOCK.finditer(rest):
        call = _one_call(m.group(1)) if not rest[pos:m.start()].strip() else None
        if call is None:
            return None
        calls.append(call)
        pos = m.end()
    if not calls or rest[pos:].strip():
        return None
    return text[:at], calls


def canonical(message: Mapping) -> dict:
    """``message`` with what a template or client rewrites taken out, for comparison: the reasoning
    keys dropped; for an assistant, the content as text without a leading ``<think>...</think>``
    block, stripped, and tool calls as (name, parsed arguments) without ids; calls written in the
    content in the template's form (:func:`text_calls`, a message without ``tool_calls``) count as
    its tool calls, the text before them as its content. Other roles keep their content exactly
    (as text)."""
    role = message.get("role")
    out: dict = {k: v for k, v in message.items() if k not in REASONING_KEYS and k not in ("content", "tool_calls")}
    if role == "assistant":
        content = _THINK.sub("", _text(message.get("content")), count=1)
        calls = []
        for c in message.get("tool_calls") or ():
            fn = c.get("function") or c
            calls.append([fn.get("name"), _args(fn.get("arguments"))])
        in_text = None if calls else text_calls(content)
        if in_text is not None:
            content, calls = in_text
        out["content"] = content.strip()
        out["tool_calls"] = calls
    else:
        out["content"] = _text(message.get("content"))
    return out


def _generated(message: Mapping) -> dict:
    """What the model generated of an assistant message, :func:`canonical`: role, content, tool
    calls (a client's own keys beside them, an id or a provider's metadata, are not the model's)."""
    c = canonical(message)
    return {k: c.get(k) for k in ("role", "content", "tool_calls")}


@dataclass(frozen=True)
class Turn:
    """What ocache recorded and relayed for the last turn of a conversation that a slot holds.

    ``messages``: the request's messages as the client sent them; ``fields``: its ``PROMPT_FIELDS``;
    ``answer``: the assistant message relayed to the client (``content``, ``reasoning_content``,
    ``tool_calls``), ``finish_reason`` its finish reason; ``stop``: whether the request had stop
    strings; ``known``: the slot's first token ids as ocache knows them; ``n_prompt_eot``: the
    end-of-turn tokens in the request's own rendered prompt; ``n_held``: the tokens the slot holds
    after the answer (prompt + generated - 1); ``slot``: its id; ``segments``: the slot's tokens
    ocache knows, as (position, ids) pieces in order (the first prompt sent as is, then each
    aligned request's new part; the generated ids between them are not known), for
    :func:`upper_lcp` (empty: ``known`` at 0); ``raw``: for a request the server converted (a
    Responses body, ``ocache.api.convert``), the client's own fields among ``TOOL_FIELDS`` as it
    sent them (a continuation sent on that route carries them back, ``routes/continued.py``);
    ``owner``: who sent the request (``ocache.substitute.owner_of``: its session key and the sha256
    of its credentials, set by ``AlignRoute.observe``; None: unknown, a compaction never continues it)."""

    messages: tuple[Mapping, ...]
    fields: Mapping[str, Any]
    answer: Mapping
    finish_reason: str | None
    stop: bool
    known: tuple[int, ...]
    n_prompt_eot: int
    n_held: int
    slot: int
    segments: tuple[tuple[int, tuple[int, ...]], ...] = ()
    raw: Mapping[str, Any] = field(default_factory=dict)
    #: every id the slot holds (``n_held`` of them: the prompts served, then the ids the server
    #: reported it sampled, patches/0010), () when the server did not report them
    ids: tuple[int, ...] = ()
    #: the generated spans inside ``ids`` (``ocache.substitute.Region``), in order
    regions: tuple[Region, ...] = ()
    #: who the conversation belongs to (``ocache.substitute.owner_of`` of its requests' headers)
    owner: str | None = None


def upper_lcp(tokens: Sequence[int], segments: Sequence[tuple[int, Sequence[int]]], n_held: int) -> int:
    """The most tokens ``tokens`` can share from the start with a slot that holds ``n_held`` tokens
    of which ``segments`` ((position, ids), in order) are known: the first position where ``tokens``
    differs from a known id (an unknown id, a generated one, may match). So the tokens a server
    would prefill again for ``tokens`` sent as is to that slot are at least ``end - upper_lcp``."""
    n = min(len(tokens), n_held)
    for start, ids in segments:
        if start >= n:
            break
        for i, t in enumerate(ids[:n - start]):
            if tokens[start + i] != t:
                return start + i
    return n


@dataclass(frozen=True)
class Splice:
    """Patch 0008's request: keep the slot's first ``n_keep`` tokens (the first ``len(checked)``
    checked by hash), then ``tail``, the request's own last tokens."""

    n_keep: int
    checked: tuple[int, ...]
    tail: tuple[int, ...]

    def field(self) -> dict:
        """The body's ``ocache_splice`` object."""
        return {"n_keep": self.n_keep, "n_check": len(self.checked), "xxh3": xxh3(self.checked),
                "n_tail": len(self.tail), "tail_xxh3": xxh3(self.tail)}

    @property
    def n_prompt(self) -> int:
        """Tokens of the prompt the server will serve."""
        return self.n_keep + len(self.tail)


@dataclass(frozen=True)
class Aligned:
    """``splice`` to send; ``saved``: tokens of the request's own prompt from the first point where
    it differs from a token ocache knows the slot holds (:func:`upper_lcp`) to its new part, which
    the request sent as is would prefill again at least (it may part earlier, inside a generated
    turn whose ids are not known; a hybrid model resumes at a checkpoint before that point: more)."""

    splice: Splice
    saved: int
    #: the gate's proof (``ocache.substitute.compare``): the answer's end and the declared spans
    proof: Proof | None = None
    #: a partial splice (:func:`decide_partial`): the slot's first ``n_keep`` ids only
    partial: bool = False
    #: the slot's ids the server reuses when fewer than ``n_keep``: a hybrid model resumes a
    #: partial splice at its newest checkpoint at or before ``n_keep`` and prefills the kept ids
    #: after it again (``ocache.llama.reuse.predict_reuse``); None: ``n_keep``
    predicted: int | None = None
    #: each declared span, named (``ocache.cache.align_judge.SpanJudge.judge``), for the debug record
    names: tuple[str, ...] = ()

    @property
    def reused(self) -> int:
        """The slot tokens the server reuses (its ``cache_n``)."""
        return self.splice.n_keep if self.predicted is None else self.predicted


@dataclass(frozen=True)
class AsSent:
    reason: str


Decision = Aligned | AsSent


#: the user text of the probe conversation :func:`turn_end_marker` renders
PROBE = "ocache-turn-end-probe"


def turn_end_marker(rendered: str) -> str | None:
    """The template's end-of-turn text, read from its render of ``[{"role": "user", "content":
    PROBE}]`` without a generation prompt: what follows the user text up to the next whitespace
    (``<|im_end|>`` for ChatML, ``<|eot_id|>`` for Llama 3, ``<|end|>`` for harmony). None when the
    render does not show one. The model's EOS (``/props`` ``eos_token``) may be another token
    (``<|endoftext|>`` in the Qwen vocab): the generation stops at either, and what follows the
    answer in a prompt is the template's."""
    at = rendered.find(PROBE)
    if at < 0:
        return None
    rest = rendered[at + len(PROBE):]
    marker = rest.split(None, 1)[0] if rest.strip() else ""
    return marker or None


def fields_of(body: Mapping) -> dict:
    return {k: body[k] for k in PROMPT_FIELDS if k in body}


def decide(turn: Turn | None, body: Mapping, tokens: Sequence[int], eot_id: int,
           n_ctx: int | None = None, owner: str | None = None) -> Decision:
    """Whether ``body`` (its prompt tokenized as ``tokens``) is ``turn``'s conversation, rewritten,
    plus a new part, and if so the splice (module docstring: the guard). ``eot_id``: the template's
    end-of-turn token (:func:`turn_end_marker`, tokenized: ``<|im_end|>`` for ChatML); ``n_ctx``: the slot's context in
    tokens, if known (a splice that would not fit is not made); ``owner``: the requester
    (``ocache.substitute.owner_of``; None: not checked, the caller proves it otherwise). The
    token-level proof is ``ocache.substitute.compare`` on the slot's ids (``Turn.ids``): where the
    answer ends is read from the generated span, never counted; the spans it declares are checked
    on their text by the caller (``ocache.cache.align_judge.SpanJudge``)."""
    if turn is None:
        return AsSent("no record")
    if turn.finish_reason not in ENDED or turn.stop:
        return AsSent("answer not ended by end of turn")
    if fields_of(body) != dict(turn.fields):
        return AsSent("prompt fields differ")
    msgs = body.get("messages")
    if not isinstance(msgs, list):
        return AsSent("no messages")
    n = len(turn.messages)
    if len(msgs) < n + 2:
        return AsSent("nothing new after the answer")
    try:
        if any(canonical(a) != canonical(b) for a, b in zip(msgs[:n], turn.messages)):
            return AsSent("history differs")
        if _generated(msgs[n]) != _generated({"role": "assistant", **turn.answer}):
            return AsSent("answer differs")
    except (AttributeError, TypeError):
        return AsSent("malformed message")
    if owner is not None and not owned(turn.owner, owner):
        return AsSent("not the requester's conversation")
    ids = turn.ids
    if not ids or len(ids) != turn.n_held or not turn.regions:
        return AsSent("slot tokens unknown")
    if len(tokens) > len(ids) and tuple(tokens[:len(ids)]) == ids:
        return AsSent("extends")
    ends = frozenset(t for t in (eot_id, turn.regions[-1].eog) if t >= 0)
    proof = compare(ids, turn.regions, tokens, ends)
    if isinstance(proof, Refused):
        return AsSent(proof.reason)
    if not check(ids, tokens, proof):
        return AsSent("invariant not verified")
    tail = tuple(tokens[proof.end:])
    if len(tail) < 2:
        return AsSent("nothing new after the answer")
    splice = Splice(n_keep=len(ids), checked=ids, tail=tail)
    if n_ctx is not None and splice.n_prompt > n_ctx:
        return AsSent("splice exceeds the context")
    return Aligned(splice, saved=max(0, proof.end - lcp(ids, tokens)), proof=proof)


#: the fewest slot tokens a partial splice must keep beyond what the request sent as is would
#: reuse (its common prefix with the slot): below it, the request goes as sent
MIN_PARTIAL_GAIN = 16

#: the reasons of :func:`decide` after which a partial splice is not tried: nothing of the slot may
#: be served (not the requester's, not known), or the request sent as is reuses the whole slot
NO_PARTIAL = frozenset({"no record", "not the requester's conversation", "slot tokens unknown", "extends",
                        "no messages", "malformed message", "splice exceeds the context"})


def lcp(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the common prefix of ``a`` and ``b``."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def decide_partial(turn: Turn | None, tokens: Sequence[int], eot_id: int, owner: str,
                   has_session: bool, n_ctx: int | None = None) -> Decision:
    """A partial splice of ``turn``'s slot for a request (its prompt ``tokens``) that :func:`decide`
    sent as is: the slot's ids up to where they part for good from the rendering
    (``ocache.substitute.compare(partial=True)``), then the rest of the rendering. Only for the
    requester's own conversation, named by a session key (``has_session``: without one, two
    sessions with equal prompts are one owner), and only when it keeps at least
    ``MIN_PARTIAL_GAIN`` tokens more than the request's common prefix with the slot (what it would
    reuse sent as is). The proof's spans are still to be declared on their text by the caller,
    which cuts the proof before a span that is not (``Proof.cut``)."""
    if turn is None:
        return AsSent("no record")
    if not has_session or not owned(turn.owner, owner):
        return AsSent("not the requester's conversation")
    ids = turn.ids
    if not ids or len(ids) != turn.n_held or not turn.regions:
        return AsSent("slot tokens unknown")
    ends = frozenset(t for t in (eot_id, turn.regions[-1].eog) if t >= 0)
    proof = compare(ids, turn.regions, tokens, ends, partial=True)
    if isinstance(proof, Refused):
        return AsSent(proof.reason)
    return partial_of(ids, tokens, proof, n_ctx)


def partial_of(ids: Sequence[int], tokens: Sequence[int], proof: Proof, n_ctx: int | None = None) -> Decision:
    """The partial splice of ``proof`` (its first ``n_keep`` slot ids ``ids``, then ``tokens`` from
    ``end``), or why not: it must keep ``MIN_PARTIAL_GAIN`` more than the common prefix, hold the
    invariant (``ocache.substitute.check``), leave a new part and fit ``n_ctx``."""
    common = lcp(ids, tokens)
    if proof.n_keep - common < MIN_PARTIAL_GAIN:
        return AsSent("partial gains too little")
    if not check(ids, tokens, proof):
        return AsSent("invariant not verified")
    tail = tuple(tokens[proof.end:])
    if not tail:
        return AsSent("nothing new after the answer")
    splice = Splice(n_keep=proof.n_keep, checked=tuple(ids[:proof.n_keep]), tail=tail)
    if n_ctx is not None and splice.n_prompt > n_ctx:
        return AsSent("splice exceeds the context")
    return Aligned(splice, saved=proof.n_keep - common, proof=proof, partial=True)


def generated_region(start: int, generated: Sequence[int], think_close: int | None) -> Region:
    """The :class:`~ocache.substitute.Region` of ``generated`` (the ids the server sampled, the end
    of generation last) sampled into a slot from position ``start``: its content starts after the
    last ``think_close`` id (``</think>``) among them, at ``start`` when there is none."""
    held = list(generated[:-1])
    content = start
    if think_close is not None and think_close in held:
        content = start + len(held) - held[::-1].index(think_close)
    return Region(start, start + len(held), content, int(generated[-1]) if generated else -1)


def sampled_ids(timings: Mapping | None) -> list[int] | None:
    """The ids the server reported it sampled for a response (``timings.ocache_generated``,
    patches/0010), None when absent or not a non-empty list of ints."""
    ids = (timings or {}).get("ocache_generated")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        return None
    return ids


def record(body: Mapping, tokens: Sequence[int], eot_id: int, answer: Mapping, finish_reason: str | None,
           n_held: int, slot: int, decision: Decision | None, previous: Turn | None,
           raw: Mapping[str, Any] | None = None, generated: Sequence[int] | None = None,
           think_close: int | None = None, owner: str | None = None) -> Turn:
    """The :class:`Turn` to keep after ``body`` was answered (``answer``, ``finish_reason``) and the
    slot holds ``n_held`` tokens: ``tokens`` are the request's own prompt tokens; ``decision`` what
    :func:`decide` said for it (an :class:`Aligned` request leaves the slot's first ids as they were
    known before, ``previous.known``; one sent as is makes them its own prompt); ``raw``: the
    client's own body when the server converted it (``Turn.raw`` keeps its ``TOOL_FIELDS``);
    ``generated``: the ids the server sampled (:func:`sampled_ids`): with them the turn knows every
    id of the slot (``Turn.ids``: the prompt served, then those ids but the last) when their count
    agrees with ``n_held``; ``owner``: the requester (``ocache.substitute.owner_of``)."""
    msgs = body.get("messages") or []
    if isinstance(decision, Aligned) and previous is not None:
        known = previous.known
        sp = decision.splice
        kept = tuple((start, ids[:sp.n_keep - start]) for start, ids in (previous.segments or ((0, known),))
                     if start < sp.n_keep)
        segments = kept + ((sp.n_keep, sp.tail),)
        prompt = tuple(previous.ids[:sp.n_keep]) + tuple(sp.tail) if len(previous.ids) >= sp.n_keep else ()
        # a partial splice keeps the generated spans before its n_keep (one cut there ends at it)
        regions = tuple(Region(g.start, min(g.end, sp.n_keep), min(g.content, sp.n_keep), g.eog)
                        for g in previous.regions if g.start < sp.n_keep)
    else:
        known = tuple(tokens)
        segments = ((0, known),)
        prompt = tuple(tokens)
        regions = ()
    ids: tuple[int, ...] = ()
    if prompt and generated and len(prompt) + len(generated) - 1 == n_held:
        region = generated_region(len(prompt), generated, think_close)
        ids = prompt + tuple(int(t) for t in generated[:-1])
        regions = tuple(regions) + (region,)
    else:
        regions = ()
    return Turn(messages=tuple(msgs), fields=fields_of(body),
                answer={k: answer[k] for k in ("content", "reasoning_content", "tool_calls") if k in answer},
                finish_reason=finish_reason, stop=bool(body.get("stop")), known=known,
                n_prompt_eot=sum(1 for t in tokens if t == eot_id), n_held=n_held, slot=slot,
                segments=segments, raw={k: raw[k] for k in TOOL_FIELDS if k in raw} if raw else {},
                ids=ids, regions=regions, owner=owner)
