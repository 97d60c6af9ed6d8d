"""The substitution gate's pure checks (ocache/substitute.py) on token ids laid out as the Qwen
templates lay them out: the walk finds the answer's end from the generated span, never by counting
end-of-turn ids, and refuses every difference it cannot name."""

from ocache.substitute import (MAX_FILLER, Proof, Refused, Region, check, compare, credentials_of,
                               declared, owned, owner_of, served)

THINK, ENDTHINK, EOT, START, NL, NN, ASSIST = 100, 101, 102, 103, 10, 11, 3
IM_END_TEXT = [60, 61, 62, 63]          # "<|im_end|>" written as text: four ordinary ids


def user(*ids):
    return [START, 1, *ids, EOT, NL]


def gen_prompt():
    return [START, ASSIST, NL, THINK, NL]          # Qwen3.5: the prompt opens the think block


def slot_of(prompt, generated):
    """The slot after ``prompt`` and ``generated`` (its last id, the end of generation, is not held)."""
    ids = prompt + generated[:-1]
    content = len(prompt) + generated.index(ENDTHINK) + 1 if ENDTHINK in generated else len(prompt)
    return ids, Region(len(prompt), len(ids), content, generated[-1])


def rendered_turn(content):
    """The template's render of a past assistant turn whose reasoning it dropped."""
    return [START, ASSIST, NL, THINK, NN, ENDTHINK, NN, *content, EOT, NL]


def test_dropped_reasoning_is_one_span_and_the_end_comes_from_the_generated_ids():
    prompt = user(5) + gen_prompt()
    slot, reg = slot_of(prompt, [200, 201, NL, ENDTHINK, NN, 300, 301, EOT])
    render = user(5) + rendered_turn([300, 301]) + user(6) + gen_prompt()
    proof = compare(slot, [reg], render, frozenset({EOT}))
    assert isinstance(proof, Proof)
    assert len(proof.spans) == 1
    sp = proof.spans[0]
    assert slot[sp.slot_from:sp.slot_to] == [NL, 200, 201, NL] and render[sp.render_from:sp.render_to] == [NN]
    assert render[proof.end] == EOT and render[proof.end - 2:proof.end] == [300, 301]
    assert check(slot, render, proof)
    out = served(slot, render, proof)
    assert out[:len(slot)] == slot and out[len(slot):] == render[proof.end:]
    assert out.count(300) == 1       # the answer once


def test_the_template_dropping_an_empty_block_it_rendered_before_is_one_span():
    """Qwen3.5 renders an assistant turn after the last user message with ``<think>\\n\\n</think>``
    and without it once a user message follows: a difference in a prompt the slot was served."""
    prompt = user(5) + [START, ASSIST, NL, THINK, NN, ENDTHINK, NN, 300, EOT, NL] + [START, 40, EOT, NL] \
        + gen_prompt()
    slot, reg = slot_of(prompt, [ENDTHINK, NN, 310, 311, 312, 313, 314, 315, 316, 317, EOT])
    render = user(5) + [START, ASSIST, NL, 300, EOT, NL] + [START, 40, EOT, NL] \
        + rendered_turn([310, 311, 312, 313, 314, 315, 316, 317]) + user(6) + gen_prompt()
    proof = compare(slot, [reg], render, frozenset({EOT}))
    assert isinstance(proof, Proof) and len(proof.spans) == 2 and check(slot, render, proof)


def test_an_answer_quoting_the_end_of_turn_marker_is_not_served_past_its_end():
    """The model wrote "<|im_end|>" as text inside its answer; the template renders the same text as
    the special id. Counting end-of-turn ids would splice the rest of the answer in twice; the walk
    either refuses or reports a span that holds the quoted text, which :func:`declared` refuses on
    its text (the route then sends the request as it is)."""
    prompt = user(5) + gen_prompt()
    slot, reg = slot_of(prompt, [200, ENDTHINK, NN, 300, *IM_END_TEXT, 301, EOT])
    render = user(5) + rendered_turn([300, EOT, 301]) + user(6) + gen_prompt()
    out = compare(slot, [reg], render, frozenset({EOT}))
    if isinstance(out, Proof):
        # the walk's span holds the quoted text (the slot's) against the rendering's special id or
        # nothing: its windows are judged on their text below, and refused
        assert check(slot, render, out)
        assert any(IM_END_TEXT[0] in slot[sp.slot_from:sp.slot_to] for sp in out.spans)
    assert declared("<think>\nr\n</think>\n\nA<|im_end|>B", "<think>\n\n</think>\n\nA") is None


def test_a_retokenised_answer_differs_in_its_content():
    prompt = user(5) + gen_prompt()
    slot, reg = slot_of(prompt, [200, ENDTHINK, NN, 300, 301, 302, EOT])
    render = user(5) + rendered_turn([300, 399, 302]) + user(6) + gen_prompt()   # 301 split otherwise
    out = compare(slot, [reg], render, frozenset({EOT}))
    assert isinstance(out, Refused) or any(301 in slot[sp.slot_from:sp.slot_to] for sp in out.spans)
    assert declared("<think>\nr\n</think>\n\nhello world", "<think>\n\n</think>\n\nhello world!") is None


def test_a_change_in_a_user_turn_is_a_span_that_is_not_declared():
    prompt = user(5) + gen_prompt()
    slot, reg = slot_of(prompt, [200, ENDTHINK, NN, 300, EOT])
    render = user(7) + rendered_turn([300]) + user(6) + gen_prompt()
    out = compare(slot, [reg], render, frozenset({EOT}))
    assert isinstance(out, Refused) or out.spans[0].slot_from < len(user(5))
    assert declared("<|im_start|>user\nfix a\n<|im_end|>", "<|im_start|>user\nfix b\n<|im_end|>") is None
    assert declared("user\na\n\nb", "user\na\nb") is None     # whitespace alone is no reasoning


def test_the_slot_must_end_with_a_generated_turn_followed_by_an_end_of_turn():
    prompt = user(5) + gen_prompt()
    slot, reg = slot_of(prompt, [200, ENDTHINK, NN, 300, EOT])
    render = user(5) + rendered_turn([300])
    assert isinstance(compare(slot, [reg], render + user(6), frozenset({EOT})), Proof)
    assert compare(slot, [Region(0, len(slot) - 1, 0)], render + user(6), frozenset({EOT})) == \
        Refused("the slot does not end with a generated turn")
    assert compare(slot, [reg], render[:-2] + [77, 78], frozenset({EOT})) == Refused("no agreement after a difference")


def test_a_tool_loop_of_two_generations_gives_a_span_each():
    p1 = user(5) + gen_prompt()
    slot, r1 = slot_of(p1, [200, ENDTHINK, NN, 300, 301, 302, 303, 304, 305, 306, 307, EOT])
    tail = [EOT, NL, START, 40, 41, EOT, NL] + gen_prompt()          # the tool result, served as a tail
    slot, r2 = slot_of(slot + tail, [210, 211, ENDTHINK, NN, 310, EOT])
    render = user(5) + [START, ASSIST, NL, THINK, NN, ENDTHINK, NN, 300, 301, 302, 303, 304, 305, 306, 307] \
        + tail[:-2] + [THINK, NN, ENDTHINK, NN, 310, EOT, NL] + user(6) + gen_prompt()
    proof = compare(slot, [r1, r2], render, frozenset({EOT}))
    assert isinstance(proof, Proof) and len(proof.spans) == 2 and check(slot, render, proof)
    assert render[proof.end - 1] == 310


def test_the_filler_is_bounded():
    prompt = user(5) + gen_prompt()
    slot, reg = slot_of(prompt, [200, ENDTHINK, NN, 300, EOT])
    render = user(5) + [START, ASSIST, NL, THINK] + [NN] * (MAX_FILLER + 40) + [ENDTHINK, NN, 300, EOT, NL] \
        + user(6) + gen_prompt()
    assert isinstance(compare(slot, [reg], render, frozenset({EOT})), Refused)


def test_check_fails_on_a_wrong_proof():
    prompt = user(5) + gen_prompt()
    slot, reg = slot_of(prompt, [200, ENDTHINK, NN, 300, EOT])
    render = user(5) + rendered_turn([300]) + user(6) + gen_prompt()
    proof = compare(slot, [reg], render, frozenset({EOT}))
    assert isinstance(proof, Proof)
    assert not check(slot, render, Proof(proof.end + 1, proof.spans, proof.n_keep))
    assert not check(slot, render, Proof(proof.end, (), proof.n_keep))


def test_declared_names_dropped_and_rerendered_reasoning_and_refuses_altered():
    w = "<|im_start|>assistant\n"
    assert declared(w + "<think>\nI should list files\n</think>\n\nok", w + "<think>\n\n</think>\n\nok") \
        == "reasoning dropped"
    assert declared(w + "<think>\n\n</think>\n\n<tool_call>", w + "<tool_call>") == "reasoning dropped"
    assert declared(w + "<think>\nI should  list files\n</think>\n\nok",
                    w + "<think>\nI should list files\n</think>\n\nok") == "reasoning re-rendered"
    assert declared(w + "<think>\nI should list files\n</think>\n\nok",
                    w + "<think>\nI should delete files\n</think>\n\nok") is None
    assert declared(w + "<think>\nr\n</think>\n\nok", w + "<think>\n\n</think>\n\nnot ok") is None
    assert declared(w + "<think>\nr\n</think>\n\nok", w + "</think>\n\nok") is None       # a lone tag


def test_owner_is_session_and_credentials():
    a = owner_of({"x-session-affinity": "ses_a", "Authorization": "Bearer k1"})
    assert owned(a, owner_of({"x-session-affinity": "ses_a", "Authorization": "Bearer k1"}))
    assert not owned(a, owner_of({"x-session-affinity": "ses_b", "Authorization": "Bearer k1"}))
    assert not owned(a, owner_of({"x-session-affinity": "ses_a", "Authorization": "Bearer k2"}))
    assert not owned(a, owner_of({"x-session-affinity": "ses_a"}))
    assert not owned(None, a)
    assert credentials_of({"x-api-key": "s"}) != credentials_of({})
    assert "k1" not in a


def test_a_span_knows_the_equal_ids_around_it_to_widen_its_windows():
    """A whitespace change inside a long reasoning block the template re-rendered: the ``CONTEXT``
    windows cut the block, the widened ones hold both tags (the route judges those)."""
    long_reasoning = list(range(400, 440))
    prompt = user(5) + gen_prompt()
    slot, reg = slot_of(prompt, [*long_reasoning, NL, ENDTHINK, NN, 300, 301, 302, 303, 304, 305, 306, 307, EOT])
    render = user(5) + [START, ASSIST, NL, THINK, NN, *long_reasoning, NL, ENDTHINK, NN,
                        300, 301, 302, 303, 304, 305, 306, 307, EOT, NL] + user(6) + gen_prompt()
    proof = compare(slot, [reg], render, frozenset({EOT}))
    assert isinstance(proof, Proof) and len(proof.spans) == 1 and check(slot, render, proof)
    sp = proof.spans[0]
    (a, b), (c, d) = sp.widened()
    assert THINK in slot[a:b] and ENDTHINK in slot[a:b] and THINK in render[c:d] and ENDTHINK in render[c:d]
    assert ENDTHINK not in slot[sp.window_slot[0]:sp.window_slot[1]]     # cut by CONTEXT
    assert slot[a:b][len(slot[a:sp.slot_from]):] == slot[sp.slot_from:b]


def test_a_partial_proof_is_cut_before_the_first_span_not_declared():
    """Two generated turns, the first's reasoning dropped by the rendering, then the client edits
    the second turn's answer (another id): the walk reports the edit as a second span (inside a
    generated turn: judged on its text, where it is not the same text, so not declared); the proof
    cut before it keeps the slot's ids up to the edit (the first turn's span declared), and the
    served prompt is those ids, then the rendering's own."""
    from ocache.align import partial_of, MIN_PARTIAL_GAIN

    p1 = user(5) + gen_prompt()
    g1 = [200, 201, NL, ENDTHINK, NN, 300, 301, EOT]
    s1, r1 = slot_of(p1, g1)
    p2 = s1 + [EOT, NL] + user(*range(20, 20 + MIN_PARTIAL_GAIN)) + gen_prompt()
    g2 = [ENDTHINK, NN, 310, 311, 312, 313, EOT]
    slot, r2 = slot_of(p2, g2)
    edited = [310, 311, 999, 313]                   # the client changed the second answer
    render = user(5) + rendered_turn([300, 301]) + user(*range(20, 20 + MIN_PARTIAL_GAIN)) \
        + [START, ASSIST, NL, THINK, NN, ENDTHINK, NN, *edited, EOT, NL] + user(6) + gen_prompt()
    proof = compare(slot, [r1, r2], render, frozenset({EOT}), partial=True)
    assert isinstance(proof, Proof) and len(proof.spans) >= 2
    assert check(slot, render, proof)
    k = next(i for i, sp in enumerate(proof.spans) if 999 in render[sp.render_from:sp.render_to])
    assert declared("A B C D", "A B X D", generated=True) is None     # its text: not declared
    part = proof.cut(k)
    assert k >= 1 and part.spans == proof.spans[:k] and part.n_keep >= proof.spans[0].slot_to
    assert slot[:part.n_keep] != render[:part.end] and check(slot, render, part)
    assert 999 in render[part.end:]
    dec = partial_of(slot, render, part)
    assert getattr(dec, "partial", False), dec
    out = served(slot, render, part)
    assert out == slot[:part.n_keep] + render[part.end:] and out.count(999) == 1
    # cut before the first span: nothing of the slot's reasoning is kept, and it gains nothing
    first = proof.cut(0)
    assert first.spans == () and check(slot, render, first) and slot[:first.n_keep] == render[:first.end]
    assert getattr(partial_of(slot, render, first), "reason", "") == "partial gains too little"


def test_decide_partial_needs_the_requesters_own_conversation_named_by_a_session():
    from ocache.align import AsSent, Turn, decide_partial

    p1 = user(5) + gen_prompt()
    slot, reg = slot_of(p1, [200, ENDTHINK, NN, 300, EOT])
    turn = Turn(messages=(), fields={}, answer={}, finish_reason="stop", stop=False, known=tuple(p1),
                n_prompt_eot=1, n_held=len(slot), slot=0, ids=tuple(slot), regions=(reg,), owner="s|x")
    render = user(5) + rendered_turn([300]) + user(6) + gen_prompt()
    for owner, has in (("t|x", True), ("s|y", True), ("s|x", False)):
        got = decide_partial(turn, render, EOT, owner, has)
        assert isinstance(got, AsSent) and got.reason == "not the requester's conversation"
