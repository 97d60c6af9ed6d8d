"""The prefill oracle on constructed token sequences (no server)."""

from __future__ import annotations

import pytest

from ocache.bench.oracle import Oracle, common_prefix, efficiency, replay_oracle


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_common_prefix_edges():
    assert common_prefix([], [1, 2]) == 0
    assert common_prefix([1, 2, 3], [1, 2, 3]) == 3
    assert common_prefix([1, 2, 3], [1, 2]) == 2
    assert common_prefix([1, 9, 3], [1, 2, 3]) == 1
    assert common_prefix([7], [8]) == 0


def test_first_request_is_all_prefill():
    o = Oracle()
    r = o.min_prefill(seq(0, 100))
    assert (r.n_tokens, r.reuse, r.prefill, r.source) == (100, 0, 100, None)


def test_dense_reuses_exact_prefix_of_any_earlier_request():
    o = Oracle()
    a = seq(0, 1000)
    b = seq(5000, 300)
    o.add(a)
    o.add(b)
    # diverges from a at 737: dense resumes exactly there
    new = a[:737] + seq(9000, 50)
    r = o.min_prefill(new)
    assert r.reuse == 737 and r.prefill == 50 and r.source == 0
    # the best source wins, not the latest
    r2 = o.min_prefill(b[:200] + [1])
    assert r2.reuse == 200 and r2.source == 1


def test_hybrid_rounds_down_to_ubatch_grid_inside_a_source():
    o = Oracle(grid=512)
    a = seq(0, 3000)
    o.add(a)
    new = a[:1700] + seq(9000, 100)  # diverges inside a at 1700 -> grid 1536
    r = o.min_prefill(new)
    assert r.lcp == 1700
    assert r.reuse == 1536
    assert r.prefill == len(new) - 1536


def test_hybrid_full_extension_of_a_source_is_not_rounded():
    o = Oracle(grid=512)
    a = seq(0, 1700)
    o.add(a)
    new = a + seq(9000, 40)  # strictly extends a: the state at 1700 existed
    r = o.min_prefill(new)
    assert r.reuse == 1700 and r.prefill == 40


def test_identical_prompt_still_evaluates_one_token():
    for grid in (None, 512):
        o = Oracle(grid=grid)
        a = seq(0, 1024)
        o.add(a)
        r = o.min_prefill(a)
        assert r.prefill == 1 and r.reuse == 1023


def test_answers_count_as_produced():
    prompt1 = seq(0, 600)
    answer1 = seq(20000, 30)
    turn2 = prompt1 + answer1 + seq(30000, 25)  # history replays the answer, then a new user turn
    with_answer = replay_oracle([(prompt1, answer1), (turn2, None)], grid=None)
    without = replay_oracle([(prompt1, None), (turn2, None)], grid=None)
    assert with_answer[1].prefill == 25
    assert without[1].prefill == 55
    # hybrid: the answer sequence is fully extended, so no rounding either
    hybrid = replay_oracle([(prompt1, answer1), (turn2, None)], grid=256)
    assert hybrid[1].prefill == 25


def test_answer_that_does_not_round_trip_stops_reuse_at_the_divergence():
    prompt1 = seq(0, 600)
    answer1 = seq(20000, 30)
    echoed = answer1[:10] + [99999] + answer1[11:]  # the client re-tokenized the answer differently
    turn2 = prompt1 + echoed + seq(30000, 5)
    dense = replay_oracle([(prompt1, answer1), (turn2, None)], grid=None)
    assert dense[1].reuse == 610
    hybrid = replay_oracle([(prompt1, answer1), (turn2, None)], grid=256)
    # LCP 610 lies inside the answer source -> 512; but the prompt1 source is fully extended -> 600
    assert hybrid[1].reuse == 600


def test_oracle_only_sees_the_past():
    a = seq(0, 400)
    results = replay_oracle([(a, None), (a + [1, 2], None)])
    assert results[0].prefill == 400
    assert results[1].prefill == 2


def test_bad_grid_and_efficiency():
    with pytest.raises(ValueError):
        Oracle(grid=0)
    assert efficiency(50, 100) == 0.5
    assert efficiency(0, 0) is None


def test_long_bench_oracle_counts_only_tokens_no_earlier_prompt_shared():
    from ocache.bench.long import oracle_new

    a = list(range(100))
    assert oracle_new([], a) == 100                        # nothing before: all of it
    assert oracle_new([a], a + [7, 8]) == 2                # a next turn: its new tokens
    assert oracle_new([a, a[:40] + [999] * 10], a[:40] + [999] * 10 + [5]) == 1
    assert oracle_new([a], a) == 1                         # identical: the last token is evaluated
    assert oracle_new([a[:30], a], a[:60] + [1, 2]) == 2   # the longest shared prefix counts
