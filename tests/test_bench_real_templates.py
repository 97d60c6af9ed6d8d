"""The bench on the templates people run: scenario keys, the turns built from the
server's generations, the prompt an aligned request was served, the dashboard's align figures.
No server: the pieces are pure (``ocache/bench/agent.py``, ``served.py``, ``replay.py``,
``ocache/dashboard.py``); the runs themselves are ``ocache bench --scenario real_template_agent_keep
--scenario real_template_agent_drop --models hybrid,dense`` (docs/benchmarks.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ocache import dashboard
from ocache.bench import agent
from ocache.bench.replay import Answer, ScenarioError, load_scenario, next_turn
from ocache.bench.served import ServedPrompts, cold_completion_body, parse_aligned

ROOT = Path(__file__).resolve().parents[1]


def test_templates_resolve_per_model_and_real_names_the_pinned_sources():
    assert agent.resolve_template("real", "hybrid") == "Qwen3.5-4B.jinja"
    assert agent.resolve_template("real", "dense") == "Qwen-Qwen3-0.6B.jinja"
    assert agent.resolve_template(None, "dense") is None and agent.resolve_template("ocache", "hybrid") is None
    assert agent.resolve_template({"dense": "GLM-4.7-Flash.jinja"}, "dense") == "GLM-4.7-Flash.jinja"
    assert agent.resolve_template({"dense": "GLM-4.7-Flash.jinja"}, "hybrid") is None
    with pytest.raises(ValueError):
        agent.resolve_template("real", "bench")


def test_grammars_follow_the_templates_call_format_and_think_opening():
    assert agent.call_format("{{ '<function=' + tool_call.name + '>' }}") == "xml"
    assert agent.call_format('{"name": {{ tool_call.name | tojson }}}') == "json"
    xml = agent.grammar("tool_call", "xml", opens=True)
    assert "<function=read>" in xml and '"<think>' not in xml
    js = agent.grammar("answer", "json", opens=False)
    assert js.startswith("root ::= reasoning [A-Z]") and '"<think>\\n"' in js
    with pytest.raises(ValueError):
        agent.grammar("essay", "xml")


@pytest.mark.parametrize("mode", ["keep", "drop"])
def test_the_real_template_scenarios_load(mode, tmp_path):
    sc = load_scenario(ROOT / "scenarios" / f"real_template_agent_{mode}.yaml", tmp_path)
    assert sc.template == "real" and sc.reasoning == mode and sc.n_requests() == 7
    assert [s.grammar for s in sc.steps] == ["tool_call"] * 3 + ["answer", "tool_call", "answer", "answer"]
    assert [s.then for s in sc.steps[1:]] == ["tool", "tool", "tool", "user", "tool", "user"]
    # the tool results: the pinned source's own text, ~1.7k tokens each, all different
    results = [s.tool_result for s in sc.steps if s.then == "tool"]
    assert all(len(r) > 5200 and r.startswith('<file path="tools/server/README.md">') for r in results)
    assert len(set(results)) == 4
    assert sc.steps[0].body["stream"] is False


def test_a_scenario_with_an_unknown_grammar_or_reasoning_is_refused(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps:\n  - {send: {messages: []}, grammar: poem}\n")
    with pytest.raises(ScenarioError, match="grammar"):
        load_scenario(bad, tmp_path)
    bad.write_text("reasoning: sometimes\nsteps:\n  - {send: {messages: []}}\n")
    with pytest.raises(ScenarioError, match="reasoning"):
        load_scenario(bad, tmp_path)


def test_the_next_turn_carries_the_generated_answer_with_or_without_its_reasoning():
    body = {"messages": [{"role": "user", "content": "go"}]}
    ans = Answer(content="<tool_call>\n<function=read>...</tool_call>", reasoning="look first")
    keep = next_turn(body, ans, "more", "FILE", 2, then="tool")
    assert keep["messages"][1] == {"role": "assistant", "content": ans.content, "reasoning_content": "look first"}
    assert keep["messages"][2] == {"role": "tool", "tool_call_id": "call_2", "content": "FILE"}
    drop = next_turn(body, ans, "more", "FILE", 3, then="user", reasoning=False)
    assert drop["messages"][1] == {"role": "assistant", "content": ans.content}
    assert drop["messages"][2] == {"role": "user", "content": "more (turn 3)"}
    # without `then`: as before (no parsed call: a user message)
    assert next_turn(body, ans, "more", "FILE", 4)["messages"][2]["role"] == "user"


def test_the_prompt_an_aligned_request_was_served_is_the_slots_tokens_then_the_new_part():
    slots = ServedPrompts()
    slots.record({"X-OCache-Slot": "1"}, [1, 2, 3, 4], [50, 51, 52])       # the slot holds 1..4 50 51
    rendered = [1, 2, 9, 9, 9, 50, 51, 7, 8]    # the template rewrote the turn; new part 7, 8
    served, why = slots.served({"X-OCache-Aligned": "6+2", "X-OCache-Slot": "1"}, rendered)
    assert why is None and served == [1, 2, 3, 4, 50, 51, 7, 8]
    assert slots.served({"X-OCache-Slot": "1"}, rendered) == (None, None)        # not aligned
    served, why = slots.served({"X-OCache-Aligned": "6+2", "X-OCache-Slot": "0"}, rendered)
    assert served is None and "slot 0" in why                                    # unknown slot
    assert parse_aligned({"x-ocache-aligned": "12+3", "x-ocache-slot": "0"}) == (0, 12, 3)
    body = cold_completion_body({"grammar": "root ::= \"a\"", "max_tokens": 40, "temperature": 0,
                                 "messages": [], "tools": []}, served or [5])
    assert body["prompt"] == [5] and body["n_predict"] == 40 and body["cache_prompt"] is False
    assert "messages" not in body and body["grammar"] == "root ::= \"a\"" and body["n_probs"] == 2


def test_the_dashboard_view_shows_aligned_requests_and_the_tokens_each_saved():
    last = [{"request_id": "r7", "time": 1.0, "slot": 0, "kept": 5663, "new": 38, "saved": 4700,
             "saved_vs_alone": 1500}]
    v = dashboard.view({"layer": {"align": {"enabled": True, "records": 1, "aligned": 3,
                                            "aligned_saved_tokens": 9000, "aligned_saved_vs_alone": 2866,
                                            "aligned_refused": 1, "as_sent_extends": 4, "last": last}}})
    # "saved" is against llama-server alone; the counterfactual of each request sent as is to its
    # slot is kept apart, named as what it is (the newcomer's loop: 6,800 for a saving of 2,866)
    assert v["align"] == {"enabled": True, "aligned": 3, "saved": 2866, "saved_vs_slot": 9000, "refused": 1,
                          "requests": [{"request_id": "r7", "time": 1.0, "slot": 0, "kept": 5663,
                                        "new": 38, "saved": 1500, "saved_vs_slot": 4700}]}
    assert dashboard.view({})["align"] == {"enabled": False, "aligned": 0, "saved": 0, "saved_vs_slot": 0,
                                           "refused": 0, "requests": []}
