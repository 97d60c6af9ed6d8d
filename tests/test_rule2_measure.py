"""Rule 2's measure compares the same requests (dense *growth* 1.001 where (c) = (b)).

A ``turn`` step is built from each configuration's own answers. On the tiny dense model the stock
flags' (a) answered turn 4 differently at a near-tie (``ocache bench --preset tiny --scenario growth
--models dense``: turn 5 was 7,468 tokens under (a), 7,469 under (b) and (c)), so (a)'s turn 5 was
another prompt: it prefilled 39 where (b) and (c) prefilled 48 of theirs, and the report listed
(c) as over (a) and judged the scenario 7,488 / 7,481 = 1.001. Matched by the prompt's token ids
(``Row.prompt_key``), that row is left out of the per-request list and counts in (a)'s total with
(b)'s prefill of (c)'s prompt. This test fails on the code before ``rule2.matched``.
"""

from __future__ import annotations

import pytest

from ocache.bench.oracle import OracleResult
from ocache.bench.replay import Row
from ocache.bench.rule2 import over_requests, rule2
from ocache.bench.run import Bench, ConfigRun


def row(i: int, prefill: int, key: str) -> Row:
    return Row(index=i, label=f"turn {i}", n_tokens=7400, prompt_n=prefill, server_prefill=prefill,
               cache_n=7400 - prefill, oracle=OracleResult(n_tokens=7400, reuse=7400, prefill=0, lcp=7400, source=0),
               ttft_s=None, cold_ttft_s=None, exact=True, exact_tokens=None, restart_before=False,
               ocache={"X-OCache-Kind": "agent"}, prompt_key=key)


def growth(a_last_key: str) -> dict[str, ConfigRun]:
    """The measured dense growth rows: (a) differs on the last-but-one request only."""
    firsts = [row(0, 7251, "k0"), row(1, 55, "k1"), row(2, 39, "k2"), row(3, 39, "k3")]
    return {"a": ConfigRun("a", firsts + [row(4, 39, a_last_key), row(5, 58, "a5")], 1.0),
            "b": ConfigRun("b", firsts + [row(4, 48, "k4"), row(5, 56, "k5")], 1.0),
            "c": ConfigRun("c", firsts + [row(4, 48, "k4"), row(5, 56, "k5")], 1.0)}


def test_a_baselines_request_of_another_prompt_is_not_compared():
    bench = Bench.__new__(Bench)
    runs = growth("a4")
    bench.results = {"dense": {"growth": runs}}
    assert [r.observed for r in runs.values()] == [7481, 7488, 7488]
    v = rule2(runs)
    assert over_requests(runs) == [] and v["swapped"] == 2
    assert v["ratio"] == pytest.approx(1.0) and v["holds"] is True
    assert "2 baseline request(s) of another prompt" in bench.never_worse_table()
    # the same prompt under (a): compared, listed, and the rule fails as before
    runs = growth("k4")
    runs["a"].rows[5] = row(5, 56, "k5")
    same = rule2(runs)
    assert [(o["row"].index, o["excess"]) for o in same["over"]] == [(4, 9)]
    assert same["holds"] is False and same["swapped"] == 0


def test_a_baselines_request_without_an_answer_is_not_compared():
    """``ocache bench --preset tiny --template real --scenario opencode_runs_same_folder --models
    dense``: (a)'s 8th request ended in ``ClientOSError: Can not write request body`` (server
    prefill 0) where (b) and (c) prefilled its 13 new tokens; the report listed (c) +13 over (a) and
    failed the scenario at 1.002. Not compared now, and (a)'s total counts (b)'s 13 for it. Fails
    on the code before ``Row.error`` was read by ``rule2.matched``."""
    bench = Bench.__new__(Bench)
    firsts = [row(0, 7258, "k0"), row(1, 11, "k1")]
    failed = row(2, 0, "k2")
    failed.error = "ClientOSError: [Errno None] Can not write request body"
    runs = {"a": ConfigRun("a", firsts + [failed], 1.0),
            "b": ConfigRun("b", firsts + [row(2, 13, "k2")], 1.0),
            "c": ConfigRun("c", firsts + [row(2, 13, "k2")], 1.0)}
    bench.results = {"dense": {"opencode_runs_same_folder": runs}}
    v = rule2(runs)
    assert over_requests(runs) == [] and v["swapped"] == 1
    assert v["ratio"] == pytest.approx(1.0) and v["holds"] is True
