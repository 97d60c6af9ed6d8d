"""``ocache.bench.compare``: two bench runs compared step by step, a parallel group by its sum."""

from __future__ import annotations

import copy

from ocache.bench.compare import compare, report, step_of_rows
from ocache.bench.replay import Scenario, Step

SCENARIO = Scenario(name="day", steps=[
    Step("send", label="first"),
    Step("parallel", children=[Step("send", label="title"), Step("send", label="turn1")]),
    Step("restart"),
    Step("turn", label="after"),
])


def _run(prefills: list[int], tokens: list[int]) -> dict:
    rows = [{"index": i, "label": f"r{i}", "server_prefill": p, "n_tokens": n}
            for i, (p, n) in enumerate(zip(prefills, tokens))]
    return {"hybrid": {"day": {"c": {"rows": rows}}}}


def test_rows_map_to_steps_a_parallel_group_one_step():
    assert step_of_rows(SCENARIO) == [0, 1, 1, 3]


def test_a_race_within_a_group_is_equal_and_a_change_is_not():
    a = _run([100, 540, 4, 30], [100, 541, 7000, 7100])
    raced = _run([100, 4, 540, 30], [100, 541, 7000, 7100])          # the title went first this time
    c = compare(a, raced, {"day": SCENARIO})
    assert len(c.steps) == 3 and not c.differing and not c.missing

    worse = copy.deepcopy(raced)
    worse["hybrid"]["day"]["c"]["rows"][3]["server_prefill"] = 31     # the step after: one token more
    c = compare(a, worse, {"day": SCENARIO})
    assert [(s.step, s.prefill) for s in c.differing] == [(3, (30, 31))]
    assert c.explained_by_races()              # the first step with a row after the group (a restart between)
    lines = report(c)
    assert lines[0].startswith("steps equal: 2 of 3") and "prefill 30 -> 31" in lines[1]


def test_a_differing_step_after_a_plain_step_is_not_a_race():
    a = _run([100, 540, 4, 30], [100, 541, 7000, 7100])
    b = _run([101, 540, 4, 30], [100, 541, 7000, 7100])
    c = compare(a, b, {"day": SCENARIO})
    assert [s.step for s in c.differing] == [0] and not c.explained_by_races()


def test_another_prompt_differs_and_a_missing_run_is_named():
    a = _run([100, 540, 4, 30], [100, 541, 7000, 7100])
    b = _run([100, 540, 4, 30], [100, 541, 7000, 7104])              # an answer differed: another prompt
    assert [s.tokens for s in compare(a, b, {"day": SCENARIO}).differing] == [(7100, 7104)]
    c = compare(a, {"hybrid": {}}, {"day": SCENARIO})
    assert c.missing == ["hybrid/day/(c): 4 rows against 0"]


def test_an_unknown_scenario_counts_a_step_per_row():
    a = _run([100, 540, 4, 30], [100, 541, 7000, 7100])
    b = _run([100, 4, 540, 30], [100, 541, 7000, 7100])
    assert len(compare(a, b, {}).differing) == 2
