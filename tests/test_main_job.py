"""``./scripts/main`` talks to its user (issue 29): the bench's progress on stdout with the runs
done and the time left (``ocache.bench.verdict.progress``), pip and server noise kept out, and one
sentence of verdict in tokens and seconds from the bench's JSON (``verdict``); ``alone_check`` sets
the headline saving ocache reported beside the bench's (b) - (c). No server: log lines and JSON
shaped as ``ocache/bench/run.py`` writes them."""

from __future__ import annotations

import io
import itertools

from ocache.bench import verdict

LOG = """\
WARNING: Location 'file:///opt/pypi/simple/x/' is ignored: it is neither a file nor a directory.
2026-12-03 17:57:40,001 INFO ocache.bench.run: plan: 2 runs (1 model(s) x 1 scenario(s) x 2 configuration(s))
2026-12-03 17:57:40,002 INFO ocache.bench.run: hybrid / growth / (c) ocache serve (defaults) in front of (b)
srv  update_slots: all slots are idle
2026-12-03 17:59:24,003 INFO ocache.bench.run:   -> server prefill 8350 (client prompt_n 8350), oracle 9115, efficiency 1.092, 104.0 s
2026-12-03 17:59:24,004 INFO ocache.bench.run: hybrid / growth / (b) stock llama-server, the README's flags
2026-12-03 18:00:05,005 INFO ocache.bench.run:   -> server prefill 8536 (client prompt_n 8536), oracle 9115, efficiency 1.068, 41.0 s
"""


def test_progress_prints_each_run_with_the_time_left_and_keeps_the_noise_out():
    out, log = io.StringIO(), io.StringIO()
    clock = itertools.count(0, 10)
    assert verdict.progress(io.StringIO(LOG), out, log, now=lambda: next(clock)) == 2
    lines = out.getvalue().splitlines()
    assert log.getvalue() == LOG                      # everything is kept in the log
    assert not any("ignored" in ln or "update_slots" in ln for ln in lines), lines
    assert "2 runs to do" in lines[0]
    assert "run 1/2: hybrid model, scenario growth, configuration (c)" in lines[1]
    assert "done in 104 s: the server prefilled 8,350 tokens; about 1:44 left" in lines[2]
    assert "run 2/2" in lines[3] and "left" not in lines[4], lines


def _run(prefill: list[int], ttft: list[float], alone: dict | None = None) -> dict:
    rows = [{"server_prefill": p, "prompt_n": p, "ttft_s": t} for p, t in zip(prefill, ttft)]
    return {"rows": rows, "error": None, "ocache_stats": {"layer": {"alone": alone}} if alone else None}


DATA = {"hybrid": {"growth": {"b": _run([5000, 400], [10.0, 1.0]),
                              "c": _run([5000, 100], [10.0, 0.5],
                                        {"prefill": 5400, "ocache_prefill": 5100, "saved": 290})}}}


def test_the_verdict_says_tokens_and_seconds_against_the_server_alone():
    s = verdict.verdict(DATA)
    assert s == ("Verdict: over 2 requests, ocache (c) prefilled 300 fewer tokens than tuned llama-server "
                 "alone (b) (6% less), and clients waited 0.5 s less for their first tokens "
                 "(10.5 s against 11.0 s)."), s
    worse = {"m": {"s": {"b": _run([100], [1.0]), "c": _run([150], [2.0])}}}
    assert "50 MORE tokens" in verdict.verdict(worse) and "1.0 s MORE" in verdict.verdict(worse)
    assert verdict.verdict({"m": {"s": {"b": _run([1], [1.0])}}}).startswith("No verdict")


def test_alone_check_compares_the_reported_headline_with_b_minus_c():
    (row,) = verdict.alone_check(DATA)
    assert (row["measured"], row["reported"]) == (300, 290)
    assert abs(row["off"] - 10 / 300) < 1e-9 and abs(row["off_of_b"] - 10 / 5400) < 1e-9


def test_the_bench_report_sets_the_reported_headline_beside_b_minus_c(tmp_path):
    """``Bench.alone_table`` (printed by ``ocache bench`` and in ``bench-<preset>.md``): per scenario
    the headline ocache reported beside the measured (b) - (c), a miss over 5 % in bold."""
    from ocache.bench.oracle import OracleResult
    from ocache.bench.replay import Row
    from ocache.bench.run import Bench, ConfigRun

    def row(i: int, p: int) -> Row:
        return Row(index=i, label=f"t{i}", n_tokens=p, prompt_n=p, server_prefill=p, cache_n=0,
                   oracle=OracleResult(n_tokens=p, reuse=0, prefill=p, lcp=0, source=None), ttft_s=None,
                   cold_ttft_s=None, exact=None, exact_tokens=None, restart_before=False, ocache={})

    def run(cfg: str, prefill: list[int], alone: dict | None = None) -> ConfigRun:
        rows = [row(i, p) for i, p in enumerate(prefill)]
        return ConfigRun(cfg, rows, 1.0, ocache_stats={"layer": {"alone": alone}} if alone else None)

    bench = Bench("tiny", [], tmp_path, configs=("b", "c"))
    bench.results = {"hybrid": {
        "day": {"b": run("b", [5000, 400]), "c": run("c", [5000, 100], {"prefill": 5400, "ocache_prefill": 5100, "saved": 290})},
        "off": {"b": run("b", [1000]), "c": run("c", [500], {"prefill": 1000, "ocache_prefill": 900, "saved": 100})}}}
    table = bench.alone_table().splitlines()
    assert table[2] == "| hybrid | day | 5,400 | 5,100 | 300 | 290 | 5,400 / 5,100 | 3.3% | 0.2% |", table
    assert "| **80.0%** |" in table[3], table


def test_the_bench_runs_ocache_with_its_defaults_whatever_the_callers_config(tmp_path, monkeypatch):
    """(c) is ``ocache serve --upstream URL`` with no YAML: the child runs in its own folder (a
    caller's ``./ocache.yaml`` is not read) without the caller's ``OCACHE_CONFIG``, on the same code."""
    from ocache.bench.run import OCacheProcess
    from ocache.paths import checkout

    monkeypatch.setenv("OCACHE_CONFIG", str(tmp_path / "mine.yaml"))
    p = OCacheProcess("http://127.0.0.1:1", tmp_path / "cache", tmp_path / "log")
    env = p.env()
    assert "OCACHE_CONFIG" not in env and env["OCACHE_CACHE_DIR"] == str(tmp_path / "cache")
    assert "OCACHE_TIERS" not in env and "--upstream" in p.cmd
    assert env["PYTHONPATH"].split(":")[0] == str(checkout())
