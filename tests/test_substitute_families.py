"""The substitution gate's text rule (``ocache.substitute.declared``) on the reasoning markup of
each template family, as ``/detokenize`` renders a span's two windows (special tokens as their
text). The windows are the ones the gate logged on the tiny family models
(``scripts/measure-families``): gpt-oss's analysis message dropped from a past turn
(``openai-gpt-oss-120b.jinja``), Gemma 4's empty thought channel that its generation prompt writes
and its past turns do not (``google-gemma-4-31B-it.jinja``). A difference in content beside a
block, a block left open and an altered block stay undeclared."""

from ocache.substitute import declared

#: gpt-oss: what the slot holds of a generation (analysis, then the final channel) and the template's
#: render of that turn once past
H_SLOT = ("what it does.<|end|><|start|>assistant<|channel|>analysis<|message|>I should read a.py"
          "<|end|><|start|>assistant<|channel|>final<|message|>I will read a.py.")
H_RENDER = "what it does.<|end|><|start|>assistant<|channel|>final<|message|>I will read a.py."


def test_a_harmony_analysis_message_dropped_from_a_past_turn_is_declared():
    assert declared(H_SLOT, H_RENDER, generated=True) == "reasoning dropped"
    # the client sent the reasoning back and the template rendered it (a tool-call turn)
    assert declared(H_SLOT, H_SLOT.replace("a.py<|end|>", "a.py <|end|>"), generated=True) == "reasoning re-rendered"


def test_a_harmony_span_that_differs_in_content_or_leaves_a_channel_open_is_not_declared():
    assert declared(H_SLOT, H_RENDER.replace("a.py.", "b.py."), generated=True) is None
    # the final message dropped with the analysis: the rest differs
    assert declared(H_SLOT, "what it does.<|end|><|start|>assistant", generated=True) is None
    # an analysis message without its end: the tag stays in the rest
    assert declared("<|start|>assistant<|channel|>analysis<|message|>I should", "<|start|>assistant",
                    generated=True) is None
    # the rendering's analysis is not the slot's
    assert declared(H_SLOT, H_SLOT.replace("I should read a.py", "I should delete a.py"), generated=True) is None
    # another channel is not reasoning: commentary dropped is a difference in content
    commentary = H_SLOT.replace("<|channel|>analysis", "<|channel|>commentary")
    assert declared(commentary, H_RENDER, generated=True) is None


G_SLOT = "it does.<turn|>\n<|turn>model\n<|channel>thought\n<channel|>I will read b.py.<turn|>\n"
G_RENDER = "it does.<turn|>\n<|turn>model\nI will read b.py.<turn|>\n"


def test_gemma_4s_empty_thought_channel_from_the_generation_prompt_is_declared():
    assert declared(G_SLOT, G_RENDER) == "reasoning dropped"
    thought = G_SLOT.replace("thought\n<channel|>", "thought\nI should read<channel|>")
    assert declared(thought, G_RENDER, generated=True) == "reasoning dropped"


def test_a_gemma_4_span_that_differs_beside_its_channel_or_leaves_it_open_is_not_declared():
    assert declared(G_SLOT, G_RENDER.replace("b.py", "a.py")) is None
    assert declared(G_SLOT.replace("<channel|>", ""), G_RENDER) is None
    # a harmony-looking channel is not Gemma's thought channel and vice versa
    assert declared(G_SLOT.replace("<|channel>thought", "<|channel>answer"), G_RENDER) is None


def test_the_think_rule_is_unchanged_beside_the_other_markups():
    w = "<|im_start|>assistant\n"
    assert declared(w + "<think>\nr\n</think>\n\nok", w + "<think>\n\n</think>\n\nok") == "reasoning dropped"
    assert declared(w + "<think>\nr\n</think>\n\nok", w + "<think>\n\n</think>\n\nnot ok") is None
    # a think block and a harmony block in one window, each dropped
    assert declared(w + "<think>\nr\n</think>\n\n" + H_SLOT, w + H_RENDER) == "reasoning dropped"
