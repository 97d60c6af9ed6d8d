"""The substitution gate's pure checks (ocache/substitute.py) on token ids laid out as the Qwen
templates lay them out: the walk finds the answer's end from the generated span, never by counting
end-of-turn ids, and refuses every difference it cannot name."""

from ocache.substitute import (MAX_FILLER, Proof, Refused, Region, check, compare, credentials_of,
                               declared_text, owned, owner_of, served)

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


def test_dropped_reasoning_is_one_declared_span_and_the_end_comes_from_the_generated_ids():
    prompt = user(5) + gen_prompt()
    slot, reg = slot_of(prompt, [200, 201, NL, ENDTHINK, NN, 300, 301, EOT])
    render = user(5) + rendered_turn([300, 301]) + user(6) + gen_prompt()
    proof = compare(slot, [reg], render, frozenset({EOT}))
    assert isinstance(proof, Proof)
    assert len(proof.spans) == 1
    sp = proof.spans[0]
    assert slot[sp.slot_from:sp.slot_to][-1] == ENDTHINK and 300 not in slot[sp.slot_from:sp.slot_to]
    assert render[proof.end] == EOT and render[proof.end - 2:proof.end] == [300, 301]
    assert check(slot, render, proof)
    out = served(slot, render, proof)
    assert out[:len(slot)] == slot and out[len(slot):] == render[proof.end:]
    assert out.count(300) == 1       # the answer once


def test_an_answer_quoting_the_end_of_turn_marker_is_refused():
    """The model wrote "<|im_end|>" as text inside its answer; the template renders the same text as
    the special id, so the content differs from the slot's and no end is found (counting end-of-turn
    ids would splice the rest of the answer in twice)."""
    prompt = user(5) + gen_prompt()
    slot, reg = slot_of(prompt, [200, ENDTHINK, NN, 300, *IM_END_TEXT, 301, EOT])
    render = user(5) + rendered_turn([300, EOT, 301]) + user(6) + gen_prompt()
    out = compare(slot, [reg], render, frozenset({EOT}))
    assert isinstance(out, Refused) and out.reason == "answer end not found"


def test_a_retokenised_answer_is_refused():
    prompt = user(5) + gen_prompt()
    slot, reg = slot_of(prompt, [200, ENDTHINK, NN, 300, 301, 302, EOT])
    render = user(5) + rendered_turn([300, 399, 302]) + user(6) + gen_prompt()   # 301 split otherwise
    assert isinstance(compare(slot, [reg], render, frozenset({EOT})), Refused)


def test_a_change_outside_the_generated_turns_is_refused():
    prompt = user(5) + gen_prompt()
    slot, reg = slot_of(prompt, [200, ENDTHINK, NN, 300, EOT])
    render = user(7) + rendered_turn([300]) + user(6) + gen_prompt()
    out = compare(slot, [reg], render, frozenset({EOT}))
    assert isinstance(out, Refused) and out.reason == "differs outside a generated turn"


def test_a_tool_loop_of_two_generations_gives_two_spans():
    p1 = user(5) + gen_prompt()
    slot, r1 = slot_of(p1, [200, ENDTHINK, NN, 300, EOT])
    tail = [EOT, NL, START, 40, 41, EOT, NL] + gen_prompt()          # the tool result, served as a tail
    p2 = slot + tail
    slot, r2 = slot_of(p2, [210, 211, ENDTHINK, NN, 310, EOT])
    render = user(5) + rendered_turn([300])[:-2] + tail + rendered_turn([310])[3:] + user(6) + gen_prompt()
    render = user(5) + [START, ASSIST, NL, THINK, NN, ENDTHINK, NN, 300] + tail[:-2] + \
        [THINK, NN, ENDTHINK, NN, 310, EOT, NL] + user(6) + gen_prompt()
    proof = compare(slot, [r1, r2], render, frozenset({EOT}))
    assert isinstance(proof, Proof) and len(proof.spans) == 2 and check(slot, render, proof)


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


def test_declared_text_names_dropped_and_rerendered_reasoning_and_refuses_altered():
    assert declared_text("\nI should list files\n</think>", "\n\n</think>") == "reasoning dropped"
    assert declared_text("\nI should list files\n</think>", "") == "reasoning dropped"
    assert declared_text("<think>\nI should  list files\n</think>\n\n",
                         "<think>\nI should list files\n</think>\n\n") == "reasoning re-rendered"
    assert declared_text("\nI should list files\n</think>", "\nI should delete files\n</think>") is None
    assert declared_text("\nreasoning\n</think>\n\nHello", "") is None       # content on the slot side
    assert declared_text("", "<think>\n\n</think>\n\n") == "reasoning dropped"


def test_owner_is_session_and_credentials():
    a = owner_of({"x-session-affinity": "ses_a", "Authorization": "Bearer k1"})
    assert owned(a, owner_of({"x-session-affinity": "ses_a", "Authorization": "Bearer k1"}))
    assert not owned(a, owner_of({"x-session-affinity": "ses_b", "Authorization": "Bearer k1"}))
    assert not owned(a, owner_of({"x-session-affinity": "ses_a", "Authorization": "Bearer k2"}))
    assert not owned(a, owner_of({"x-session-affinity": "ses_a"}))
    assert not owned(None, a)
    assert credentials_of({"x-api-key": "s"}) != credentials_of({})
    assert "k1" not in a
