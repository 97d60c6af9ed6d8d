"""ocache.align: the alignment decision, without a server (the splice it makes is served by patch
0008: tests/test_patch.py; on the real templates: tests/test_real_templates.py)."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from ocache.align import Aligned, AsSent, Splice, Turn, canonical, decide, record, xxh3
from ocache.substitute import Region, check

EOT = 9  # the end-of-turn token id of these token lists

SYSTEM = {"role": "system", "content": "You are a coding agent."}
USER = {"role": "user", "content": "Read the proxy."}
TOOLS = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]
CALL = {"id": "c1", "type": "function", "function": {"name": "read", "arguments": "{\"filePath\": \"a.py\"}"}}
ANSWER = {"content": "It relays requests.", "reasoning_content": "The file is short.", "tool_calls": []}
TOOL_RESULT = {"role": "tool", "tool_call_id": "c1", "content": "import asyncio\n"}

# the previous request: system + user + a tool turn + its result; its prompt closed 4 turns
PREV_MSGS = (SYSTEM, USER, {"role": "assistant", "content": "", "reasoning_content": "read it", "tool_calls": [CALL]},
             TOOL_RESULT)
PREV_TOKENS = (1, 2, EOT, 3, 4, EOT, 5, 6, 7, EOT, 8, 8, EOT, 1, 5)   # 4 end-of-turn tokens, then the generation prompt
GENERATED = (20, 21, 22, 6, 6, EOT)                                    # reasoning, the answer's 2 ids, the end
N_GEN = len(GENERATED)
IDS = PREV_TOKENS + GENERATED[:-1]                                     # every id the slot holds
N_HELD = len(IDS)
REGION = Region(len(PREV_TOKENS), N_HELD, len(PREV_TOKENS) + 3, EOT)


def turn(**kw) -> Turn:
    base = dict(messages=PREV_MSGS, fields={"tools": TOOLS}, answer=ANSWER, finish_reason="stop", stop=False,
                known=PREV_TOKENS, n_prompt_eot=4, n_held=N_HELD, slot=0, ids=IDS, regions=(REGION,))
    return Turn(**{**base, **kw})


def new_prompt(rewritten_answer: int = 2) -> list[int]:
    """The next request's prompt as the template renders it: the history rewritten (the past turn's
    reasoning id 6 dropped), the answer in ``rewritten_answer`` ids without its reasoning, its end of
    turn, a new user turn and the generation prompt."""
    return [1, 2, EOT, 3, 4, EOT, 5, 7, EOT, 8, 8, EOT, 1, 5] + [6] * rewritten_answer + [EOT, 3, 4, 4, EOT, 1, 5]


def body(messages, **kw) -> dict:
    return {"messages": list(messages), "tools": TOOLS, **kw}


def follow_up(answer: dict | None = None) -> list[dict]:
    return [*PREV_MSGS, {"role": "assistant", **(answer or {"content": "It relays requests."})},
            {"role": "user", "content": "Thanks."}]


def test_a_client_that_drops_the_reasoning_is_served_the_slots_tokens_then_the_new_part():
    toks = new_prompt()
    d = decide(turn(), body(follow_up()), toks, EOT)
    assert isinstance(d, Aligned), d
    end = toks.index(EOT, 14)                      # the end of turn after the answer's ids
    assert d.splice == Splice(n_keep=N_HELD, checked=IDS, tail=tuple(toks[end:]))   # every kept id checked
    assert d.splice.tail[0] == EOT and d.splice.n_prompt == N_HELD + len(toks) - end
    assert d.saved == end - 7                     # the prompt parts from the slot's ids at token 7
    # the proof: two spans (the past turn's reasoning, the answer's), the rest token for token
    assert d.proof is not None and d.proof.end == end and len(d.proof.spans) == 2
    assert check(IDS, toks, d.proof)


@pytest.mark.parametrize("answer", [
    {"content": "It relays requests.", "reasoning_content": "Other words, re-rendered."},   # sent back, re-rendered
    {"content": "<think>\nThe file is short.\n</think>\n\nIt relays requests."},            # Open WebUI: in the content
    {"content": "  It relays requests.\n", "reasoning": "x"},                               # whitespace, other key
    {"content": [{"type": "text", "text": "It relays requests."}]},                         # content parts
    {"content": "It relays requests.", "id": "msg_1", "providerOptions": {"x": 1}},         # the client's own keys
])
def test_reasoning_sent_back_rewritten_or_in_the_content_is_aligned(answer):
    assert isinstance(decide(turn(), body(follow_up(answer)), new_prompt(), EOT), Aligned)


def test_the_splice_field_is_patch_0008s():
    sp = Splice(n_keep=20, checked=(1, 2, 3), tail=(EOT, 4))
    f = sp.field()
    assert f == {"n_keep": 20, "n_check": 3, "xxh3": xxh3([1, 2, 3]), "n_tail": 2, "tail_xxh3": xxh3([EOT, 4])}
    assert f["xxh3"] == xxhash.xxh3_64_hexdigest(np.array([1, 2, 3], dtype="<i4").tobytes())
    assert len(f["xxh3"]) == 16 and int(f["xxh3"], 16) >= 0


@pytest.mark.parametrize("why,kw,msgs,expect", [
    ("no record", None, follow_up(), "no record"),
    ("cut by max_tokens", {"finish_reason": "length"}, follow_up(), "answer not ended by end of turn"),
    ("client stop strings", {"stop": True}, follow_up(), "answer not ended by end of turn"),
    ("a user message edited", {}, [SYSTEM, {"role": "user", "content": "Read the slots."}, *follow_up()[2:]],
     "history differs"),
    ("a tool result changed", {}, [*PREV_MSGS[:3], {**TOOL_RESULT, "content": "x"}, *follow_up()[4:]],
     "history differs"),
    ("a past tool call's arguments changed", {},
     [SYSTEM, USER, {"role": "assistant", "content": "", "tool_calls": [
         {**CALL, "function": {"name": "read", "arguments": "{\"filePath\": \"b.py\"}"}}]}, *follow_up()[3:]],
     "history differs"),
    ("the answer edited", {}, follow_up({"content": "It caches prompts."}), "answer differs"),
    ("the answer turned into a tool call", {}, follow_up({"content": "It relays requests.", "tool_calls": [CALL]}),
     "answer differs"),
    ("a message dropped", {}, [SYSTEM, USER, *follow_up()[3:], {"role": "user", "content": "And?"}],
     "history differs"),
    ("nothing after the answer", {}, follow_up()[:-1], "nothing new after the answer"),
    ("no ids known", {"ids": ()}, follow_up(), "slot tokens unknown"),
    ("ids that do not add up", {"n_held": N_HELD + 1}, follow_up(), "slot tokens unknown"),
    ("another session's conversation", {"owner": "ses_b|x"}, follow_up(), "not the requester's conversation"),
])
def test_the_guard_forwards_anything_else_as_sent(why, kw, msgs, expect):
    d = decide(None if kw is None else turn(**{"owner": "ses_a|x", **kw}), body(msgs), new_prompt(), EOT,
               owner="ses_a|x")
    assert d == AsSent(expect), why


def test_other_tools_or_template_arguments_are_forwarded_as_sent():
    assert decide(turn(), body(follow_up(), tools=[]), new_prompt(), EOT) == AsSent("prompt fields differ")
    assert decide(turn(), body(follow_up(), chat_template_kwargs={"enable_thinking": False}), new_prompt(),
                  EOT) == AsSent("prompt fields differ")
    # what only constrains or parses the output does not matter
    assert isinstance(decide(turn(), body(follow_up(), grammar="root ::= \"x\"", reasoning_format="none"),
                             new_prompt(), EOT), Aligned)


def test_the_answers_end_must_be_in_the_prompt_and_the_splice_fit():
    short = [1, 2, EOT, 3, 4, EOT, 5, 7, EOT, 8, 8]          # the answer's turn is not in the prompt
    assert isinstance(decide(turn(), body(follow_up()), short, EOT), AsSent)
    toks = new_prompt()
    assert decide(turn(), body(follow_up()), toks, EOT, n_ctx=N_HELD + 3) == AsSent("splice exceeds the context")
    assert isinstance(decide(turn(), body(follow_up()), toks, EOT, n_ctx=N_HELD + 8), Aligned)


def test_a_prompt_that_already_extends_the_slot_needs_no_splice():
    """ocache's own template: the history renders as it was served, the answer to as many tokens as
    were generated: the server's prefix match serves it, no splice."""
    toks = list(IDS) + [EOT, 3, 4, EOT, 1, 5]
    assert decide(turn(), body(follow_up()), toks, EOT) == AsSent("extends")
    toks[N_HELD - 1] = 7          # the answer's last id otherwise: not the slot's, compared (was counted equal)
    d = decide(turn(), body(follow_up()), toks, EOT)
    assert d != AsSent("extends")
    if isinstance(d, Aligned):    # a span the route judges on its text (ocache.substitute.declared)
        assert d.proof is not None and any(sp.slot_to == N_HELD for sp in d.proof.spans)


def test_record_keeps_what_the_next_decision_needs_through_a_chain():
    b1 = body(follow_up())
    t1 = new_prompt()
    d1 = decide(turn(), b1, t1, EOT)
    assert isinstance(d1, Aligned)
    served = d1.splice.n_prompt
    r1 = record(b1, t1, EOT, {"content": "Sure.", "reasoning_content": "ok", "id": "x"}, "stop",
                n_held=served + 3, slot=0, decision=d1, previous=turn(), generated=(30, 31, 6, EOT))
    assert r1.known == PREV_TOKENS                          # the slot's first ids are still these
    assert r1.n_prompt_eot == t1.count(EOT) and r1.n_held == served + 3
    # every id the slot holds: what it held, the tail served, the ids sampled but the end
    assert r1.ids == IDS + d1.splice.tail + (30, 31, 6) and len(r1.ids) == r1.n_held
    assert r1.regions == (REGION, Region(served, served + 3, served, EOT))
    # the sampled ids must add up to the server's count, else nothing is known
    assert record(b1, t1, EOT, {"content": "Sure."}, "stop", n_held=served + 4, slot=0, decision=d1,
                  previous=turn(), generated=(30, 31, 6, EOT)).ids == ()
    assert r1.answer == {"content": "Sure.", "reasoning_content": "ok"}
    assert r1.messages == tuple(b1["messages"]) and r1.fields == {"tools": TOOLS}
    # the next request: the same history (reasoning dropped again), the new answer, one more message
    b2 = body([*b1["messages"], {"role": "assistant", "content": "Sure."}, {"role": "user", "content": "More."}])
    t2 = t1 + [6, EOT, 3, 3, EOT, 1, 5]
    d2 = decide(r1, b2, t2, EOT)
    assert isinstance(d2, Aligned), d2
    assert d2.splice.n_keep == served + 3 and d2.splice.checked == r1.ids
    assert d2.splice.tail == tuple(t2[len(t1) + 1:])
    # a request sent as is makes its own prompt the known ids
    r2 = record(b2, t2, EOT, {"content": "x"}, "stop", n_held=40, slot=1, decision=AsSent("extends"), previous=r1)
    assert r2.known == tuple(t2) and r2.slot == 1


def test_canonical_drops_what_is_rewritten_and_keeps_the_rest():
    a = canonical({"role": "assistant", "content": "<think>r</think>\n\nx ", "reasoning_content": "r",
                   "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]})
    b = canonical({"role": "assistant", "content": "x", "tool_calls": [{"id": "2", "function": {"name": "f",
                                                                                               "arguments": {"a": 1}}}]})
    assert a == b == {"role": "assistant", "content": "x", "tool_calls": [["f", {"a": 1}]]}
    # user, system and tool content is compared exactly (only its form: text parts joined)
    assert canonical({"role": "user", "content": " x"}) != canonical({"role": "user", "content": "x"})
    assert canonical({"role": "user", "content": "<think>a</think>x"})["content"] == "<think>a</think>x"


def test_the_turn_end_marker_is_read_from_the_templates_render():
    from ocache.align import PROBE, turn_end_marker

    assert turn_end_marker(f"<|im_start|>user\n{PROBE}<|im_end|>\n") == "<|im_end|>"
    assert turn_end_marker(f"<|start_header_id|>user<|end_header_id|>\n\n{PROBE}<|eot_id|>") == "<|eot_id|>"
    assert turn_end_marker(f"<|start|>user<|message|>{PROBE}<|end|>") == "<|end|>"
    assert turn_end_marker(f"user: {PROBE}\n") is None and turn_end_marker("nothing") is None


def test_saved_counts_only_what_differs_from_a_token_known_in_the_slot():
    """``Aligned.saved`` is a lower bound of what the request sent as is would prefill again: the
    prompt is compared with every piece of the slot ocache knows (the first prompt sent as is, each
    aligned request's new part), the generated ids between them counting as matches. Before, only
    the first prompt was compared, so in a chain of aligned requests every later one claimed all
    tokens from that first prompt's end as saved."""
    from ocache.align import upper_lcp

    segments = [(0, (1, 2)), (4, (5, 9))]                   # positions 2, 3: generated, not known
    assert upper_lcp([1, 2, 7, 7, 5, 6, 1], segments, 10) == 5
    assert upper_lcp([1, 3], segments, 10) == 1
    assert upper_lcp([1, 2, 7, 7, 5, 9, 1, 1], segments, 7) == 7    # no more than the slot holds
    b1 = body(follow_up())
    d1 = decide(turn(), b1, new_prompt(), EOT)
    assert isinstance(d1, Aligned)
    r1 = record(b1, new_prompt(), EOT, {"content": "Sure."}, "stop", n_held=d1.splice.n_prompt + 3, slot=0,
                decision=d1, previous=turn())
    assert r1.segments == ((0, PREV_TOKENS), (N_HELD, d1.splice.tail))
    # a next prompt that holds every known prompt token and parts inside the last new part
    toks = list(PREV_TOKENS) + [6] * (N_GEN - 1) + [d1.splice.tail[0], 4, 4, 4]
    assert upper_lcp(toks, r1.segments, r1.n_held) == N_HELD + 1


XML_CALL = "<tool_call>\n<function=read>\n<parameter=filePath>\na.py\n</parameter>\n</function>\n</tool_call>"
JSON_CALL = "<tool_call>\n{\"name\": \"read\", \"arguments\": {\"filePath\": \"a.py\"}}\n</tool_call>"


@pytest.mark.parametrize("text", [XML_CALL, JSON_CALL])
def test_a_call_relayed_as_text_and_sent_back_parsed_is_the_same_answer(text):
    """The server relays a call it did not parse (``tool_choice: none`` beside a grammar) as the
    turn's text; a client sends it back as ``tool_calls`` (content stripped, reasoning kept). The
    guard answered "answer differs" and the request went server-placed (the newcomer's loop, issue
    26 follow-up: 2,620 prefilled where the server alone prefilled 858)."""
    relayed = {"content": text, "reasoning_content": "read it", "tool_calls": []}
    sent = {"content": "", "reasoning_content": "read it", "tool_calls": [CALL]}
    msgs = [*PREV_MSGS, {"role": "assistant", **sent}, TOOL_RESULT]
    d = decide(turn(answer=relayed), body(msgs), new_prompt(), EOT)
    assert isinstance(d, Aligned)
    # and the other way round: a call relayed parsed, sent back as the template's text
    d = decide(turn(answer=sent), body([*PREV_MSGS, {"role": "assistant", "content": text}, TOOL_RESULT]),
               new_prompt(), EOT)
    assert isinstance(d, Aligned)


@pytest.mark.parametrize("content", [
    XML_CALL.replace("a.py", "b.py"),                     # another argument
    XML_CALL.replace("read", "write"),                    # another tool
    XML_CALL + "\nand then some text",                    # text after the call
    XML_CALL.replace("</parameter>", ""),                 # not a whole call
    "Let me read it.\n" + XML_CALL,                       # text before the call the client dropped
])
def test_a_call_in_the_text_that_is_not_the_one_sent_back_differs(content):
    relayed = {"content": content, "tool_calls": []}
    sent = {"content": "", "tool_calls": [CALL]}
    d = decide(turn(answer=relayed), body([*PREV_MSGS, {"role": "assistant", **sent}, TOOL_RESULT]), new_prompt(), EOT)
    assert d == AsSent("answer differs")


async def test_an_end_of_turn_probe_without_answer_costs_one_request_not_the_process():
    """The route's once-per-process probe of the template's end-of-turn token (``AlignRoute.eot``)
    whose call gets no answer (a loaded or stopped server: the view's calls are bounded) leaves
    alignment off for that request only, says why, and probes again on the next one."""
    from types import SimpleNamespace

    from ocache.cache.align_route import AlignRoute
    from ocache.tokens import TokenViewError

    class Viewer:
        calls = 0

        async def post(self, path, payload):
            Viewer.calls += 1
            if Viewer.calls == 1:
                raise TokenViewError(f"{path}: no answer within 5 s")
            return {"prompt": "<|im_start|>user\nocache-turn-end-probe<|im_end|>\n"}

        async def tokenize_remote(self, text, special):
            return [7] if text == "<|im_end|>" else [8]

    route = AlignRoute()
    layer = SimpleNamespace(upstream=SimpleNamespace(props={"ocache": {"splice": True, "generated_ids": True}}),
                            viewer=Viewer())
    assert await route.eot(layer) is None and "probed again" in (route.off_why or "")
    assert await route.eot(layer) == 7 and route.off_why is None and route.think_close == 8
