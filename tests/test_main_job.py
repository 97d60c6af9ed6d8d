"""``./scripts/main`` talks to its user: the bench's progress on stdout with the runs
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
    assert verdict.progress(io.StringIO(LOG), out, log, now=lambda: next(clock), heartbeat_s=None) == 2
    lines = out.getvalue().splitlines()
    assert log.getvalue() == LOG                      # everything is kept in the log
    assert not any("ignored" in ln or "update_slots" in ln for ln in lines), lines
    assert "2 runs to do" in lines[0]
    assert "run 1/2: hybrid model, scenario growth, configuration (c)" in lines[1]
    assert "done in 104 s: the server prefilled 8,350 tokens; about 1:44 left" in lines[2]
    assert "run 2/2" in lines[3] and "left" not in lines[4], lines


def test_a_silent_stretch_gets_a_heartbeat_line_every_minute():
    """A run whose replay logs nothing for minutes: ``_Echo.beat`` (called by ``progress``'s ticker
    thread) prints the run in progress and how long it has been going once a minute of silence has
    passed, and nothing sooner. The clock is a variable the test sets."""
    t = [0.0]
    out = io.StringIO()
    echo = verdict._Echo(out, lambda: t[0], 60.0)
    echo.say("run 1/2: hybrid model, scenario growth, configuration (c) ocache", what="run 1/2 (hybrid / growth / (c))")
    for t[0], printed in ((30.0, False), (59.9, False), (60.0, True), (100.0, False), (120.0, True)):
        assert echo.beat() is printed, t[0]
    lines = out.getvalue().splitlines()
    assert lines[1:] == ["[bench 1:00] still on run 1/2 (hybrid / growth / (c)): 1:00 in",
                         "[bench 2:00] still on run 1/2 (hybrid / growth / (c)): 2:00 in"], lines
    t[0] = 130.0
    echo.raw("ocache bench: ERROR x")
    t[0] = 180.0
    assert echo.beat() is False                      # any line printed restarts the minute


def _run(prefill: list[int], ttft: list[float], alone: dict | None = None) -> dict:
    rows = [{"server_prefill": p, "prompt_n": p, "ttft_s": t} for p, t in zip(prefill, ttft)]
    return {"rows": rows, "error": None, "ocache_stats": {"layer": {"alone": alone}} if alone else None}


DATA = {"hybrid": {"growth": {"b": _run([5000, 400], [10.0, 1.0]),
                              "c": _run([5000, 100], [10.0, 0.5],
                                        {"prefill": 5400, "ocache_prefill": 5100, "saved": 290})}}}


def test_the_verdict_says_tokens_and_seconds_against_the_server_alone():
    s = verdict.verdict(DATA)
    assert s == ("Verdict: over 2 requests in 1 scenario, ocache (c) prefilled 300 fewer tokens than "
                 "llama-server alone, vs tuned (b) (6% less; 5,100 against 5,400), and clients waited "
                 "0.5 s less for their first tokens (10.5 s against 11.0 s)."), s
    worse = {"m": {"s": {"b": _run([100], [1.0]), "c": _run([150], [2.0])}}}
    assert "50 MORE tokens" in verdict.verdict(worse) and "1.0 s MORE" in verdict.verdict(worse)
    assert verdict.verdict({"m": {"s": {"b": _run([1], [1.0])}}}).startswith("No verdict")


def test_the_verdict_is_against_min_of_stock_and_tuned_per_scenario():
    """The issue's A/B/A: (b) with ``--cache-ram 0`` prefilled 17,416 tokens where stock (a)
    prefilled 8,760; (c) 7,000. Against (b) alone that read "60% less"; against min((a), (b)) it is
    20 %. In the other scenario (b) is the lower one. Seconds: the lower of the two per scenario."""
    data = {"hybrid": {
        "aba_one_slot": {"a": _run([8760], [9.0]), "b": _run([17416], [20.0]), "c": _run([7000], [7.0])},
        "growth": {"a": _run([6000, 900], [6.0, 1.0]), "b": _run([5000, 400], [4.0, 2.0]),
                   "c": _run([5000, 100], [4.0, 0.5])},
        "broken": {"a": _run([1], [1.0]), "b": {"rows": [], "error": "server died"}, "c": _run([9], [1.0])}}}
    s = verdict.verdict(data)
    base, c = 8760 + 5400, 7000 + 5100
    assert s == (f"Verdict: over 3 requests in 2 scenarios, ocache (c) prefilled {base - c:,} fewer tokens "
                 f"than llama-server alone, vs min(stock, tuned) per scenario ({(base - c) / base:.0%} less; "
                 f"{c:,} against {base:,}), and clients waited 3.5 s less for their first tokens "
                 "(11.5 s against 15.0 s)."), s
    assert "15% less" in s           # against (b) alone: (22,816 - 12,100) / 22,816 = 47%
    stock_only = {"m": {"s": {"a": _run([100], [1.0]), "c": _run([80], [1.0])}}}
    assert "than llama-server alone, vs stock (a) (20% less;" in verdict.verdict(stock_only)


def test_tuned_b_and_c_run_the_readmes_flags(tmp_path):
    """(b)'s and (c)'s llama-server argv carries each flag the README's own command lines give
    (``-fa on``, not the ``LlamaServer`` default ``-fa off``); (a) stays on stock defaults."""
    import re
    import shlex
    from pathlib import Path
    from types import SimpleNamespace

    from ocache.bench.run import Bench

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    line = next(ln for ln in readme.splitlines() if "ocache serve --port 8081 --launch -- -m model.gguf" in ln)
    cont = readme.split(line, 1)[1].splitlines()[1]
    given = shlex.split(line.split(" -- ", 1)[1].rstrip("\\") + " " + cont)
    wanted = {(f, given[i + 1]) for i, f in enumerate(given)
              if f in ("-fa", "--ctx-checkpoints", "--checkpoint-min-step", "--cache-ram")}
    assert ("-fa", "on") in wanted and len(wanted) == 4, given
    bench = Bench("tiny", [], tmp_path, configs=("a", "b", "c"))
    bench.builds = {"stock": SimpleNamespace(binary=Path("/x/stock")),
                    "patched": SimpleNamespace(binary=Path("/x/patched"))}
    bench.model_paths = {"hybrid": Path("/x/m.gguf")}
    bench.logs = tmp_path
    sc = SimpleNamespace(name="s", n_parallel=None, template=None)
    for cfg in ("b", "c"):
        argv = bench._server(cfg, "hybrid", sc, tmp_path).command()
        pairs = set(zip(argv, argv[1:]))
        assert wanted <= pairs, (cfg, sorted(wanted - pairs))
    assert "-fa" not in bench._server("a", "hybrid", sc, tmp_path).command()
    assert re.search(r"-fa on", bench.markdown(1.0, "x")), "the report names (b)'s -fa"


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
