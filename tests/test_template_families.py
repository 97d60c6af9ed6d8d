"""Templates of every family on a tiny model of their own vocabulary (``ocache.bench.families``):
the loop of ``tests/test_real_templates.py`` (a turn under a grammar, the tool's result, the
answer, a new user message; the client drops the reasoning) alone and through ``ocache serve``.

Per family: alignment applies (``X-OCache-Aligned`` on the new user message, which then prefills
at most ``NEW_MAX`` tokens and whose answer equals a cold prefill of the prompt served), or it is
off for the reason named (``/v1/cache/stats`` ``layer.align``: ``off``, or the ``as_sent_*``
reason); either way no request prefills more than alone plus one ubatch. The table of
docs/benchmarks.md is ``scripts/measure-families``."""

from __future__ import annotations

import pytest

from ocache.bench import families

pytestmark = pytest.mark.server

#: the new user message's prefill wherever the family aligns (tokens)
NEW_MAX = 400

#: what each family does: "aligned", or the reason it is not (``Row.why_not``)
EXPECTED = {
    "Qwen3.5": "aligned",
    "Qwen3": "aligned",
    # user turns are not closed (``<｜User｜>`` text ``<｜Assistant｜>``): no end-of-turn token to find
    "DeepSeek-R1 (Qwen)": "off: the template shows no single end-of-turn token",
    "DeepSeek-R1 (Llama)": "off: the template shows no single end-of-turn token",
    "Llama 3.1": "aligned",
    "Llama 3.3": "aligned",
    "Gemma 4": "aligned",
    # SPM's space prefix: the rendering's answer begins with "▁I" where the model sampled "I"
    "Phi-3.5": "undeclared difference",
    # the probe's render goes on past the turn end (R+: a system turn of tool instructions after the
    # last message; R7B: the next chatbot header whatever add_generation_prompt says)
    "Command R+": "off: the template shows no single end-of-turn token",
    "Command R7B": "off: the template shows no single end-of-turn token",
    "gpt-oss": "aligned",
}


#: families the table has that repeat another here (the same markup and outcome, a longer run:
#: Command R7B's first prompt is 1,360 tokens of a 256k vocabulary), left to the script
TABLE_ONLY = ("Llama 3.3", "Command R7B")


def test_every_family_has_an_expectation():
    assert set(EXPECTED) == {f.name for f in families.FAMILIES}


@pytest.mark.parametrize("name", [f.name for f in families.FAMILIES if f.name not in TABLE_ONLY])
def test_a_family_aligns_or_is_provably_off(engine_patched, tmp_path, name):
    row = families.play(families.by_name(name), tmp_path)
    assert row.error is None, row.error
    assert len(row.alone) == len(row.ocache) == 3
    for ours, alone in zip(row.ocache, row.alone):
        assert ours <= alone + row.ubatch, (row.ocache, row.alone)
    if EXPECTED[name] == "aligned":
        assert all(row.aligned[1:]), row.aligned
        kept, new = map(int, row.aligned[-1].split("+"))
        assert new == row.ocache[-1] <= NEW_MAX
        assert row.align["aligned"] == 2 and row.exact is True
    else:
        assert row.aligned[-1] is None and row.exact is None
        assert row.why_not == EXPECTED[name], row.align
        assert not row.align.get("aligned")
