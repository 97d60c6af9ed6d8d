"""The replay harness: scenario parsing, body building, recordings as input, and a real replay of a
small scenario against the tiny llama-server (measured against the oracle and a cold run)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from ocache.layer import Observation, ParsedRequest, Plan
from ocache.record import Recorder
from ocache.bench.replay import (Answer, PrefillMeter, ScenarioError, Target, apply_edits,
                           assign_server_prefill, load_scenario, measure, next_turn, prepare_body,
                           replay, scenario_from_recording)
from conftest import FIXTURES, load_fixture

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str, name: str = "sc.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def smoke(tmp_path: Path, steps: str):
    """The scenario ``smoke`` (4 tokens per answer, no gaps) of ``steps`` (YAML, the items of
    ``steps:``), on the captured fixtures (skips without them)."""
    need_fixtures()
    return load_scenario(write(tmp_path, "name: smoke\nmax_tokens: 4\ngap_s: 0\nsteps:" + steps), FIXTURES)


def need_fixtures():
    if not FIXTURES.is_dir():
        # deliberate: the captures are third-party text kept in ../shared, never in the repository;
        # a clone without them still runs the rest (the full runs of .ci/run: no skip fired)
        pytest.skip(f"fixtures folder {FIXTURES} not found")


# --- no server -----------------------------------------------------------------------------------


def test_shipped_scenarios_load():
    need_fixtures()
    names = {p.stem for p in (REPO / "scenarios").glob("*.yaml")}
    assert {"growth", "title_interleave", "restart_mid_session", "aba_one_slot", "date_change",
            "mid_prompt_insertion", "new_session_same_folder",
            "new_session_other_folder",
            # every everyday pattern without a restart
            "opencode_runs_same_folder", "opencode_runs_two_folders", "opencode_pi_alternating",
            "claude_code_runs", "codex_runs", "everyday_day_no_restart"} <= names
    for p in (REPO / "scenarios").glob("*.yaml"):
        sc = load_scenario(p, FIXTURES)
        assert sc.n_requests() >= 3, p


@pytest.mark.parametrize("text, match", [
    ("steps: [{send: nope.json}]", "not found"),
    ("steps: [{turn: ghost}]", "unknown session"),
    ("steps: [{send: opencode_title.json, bogus: 1}]", "unknown keys"),
    ("steps: [{send: opencode_title.json, turn: x}]", "exactly one"),
    ("steps: [{restart: 1}]", "restart must be"),
    ("steps: [{send: opencode_title.json, edit: [{replace: '(', with: x}]}]", "bad regex"),
    ("nosteps: 1", "steps"),
    ("steps: [{parallel: [{restart: true}]}]", "send or turn"),
])
def test_bad_scenarios_are_clear_errors(tmp_path, text, match):
    need_fixtures()
    with pytest.raises(ScenarioError, match=match):
        load_scenario(write(tmp_path, text), FIXTURES)


def test_prepare_body_is_greedy_and_capped():
    body = load_fixture("pi_turn1.json")
    out = prepare_body(body, 7)
    assert out["max_tokens"] == 7 and "max_completion_tokens" not in out
    assert out["temperature"] == 0.0
    assert out["messages"] == body["messages"] and "max_completion_tokens" in body


def test_next_turn_appends_answer_and_user_or_tool_results():
    body = load_fixture("opencode_agent_turn1.json")
    plain = next_turn(body, Answer(content="hi"), "go on", "ok", 2)
    assert plain["messages"][:2] == body["messages"]
    assert plain["messages"][2] == {"role": "assistant", "content": "hi"}
    assert plain["messages"][3] == {"role": "user", "content": "go on (turn 2)"}
    calls = Answer(content="", reasoning="think", tool_calls=[
        {"id": "c1", "name": "bash", "arguments": '{"command":"ls"}'}])
    tool = next_turn(body, calls, "go on", "a.py\n", 2)
    assert tool["messages"][2]["tool_calls"][0]["function"]["name"] == "bash"
    assert tool["messages"][2]["reasoning_content"] == "think"
    assert tool["messages"][3] == {"role": "tool", "tool_call_id": "c1", "content": "a.py\n"}
    assert len(tool["messages"]) == 4


def test_edits_replace_and_insert_mid_prompt():
    body = load_fixture("opencode_agent_turn1.json")
    sysmsg = body["messages"][0]["content"]
    out = apply_edits(body, [{"replace": "Today's date: [^\\n]*", "with": "Today's date: X"}])
    assert "Today's date: X" in out["messages"][0]["content"]
    assert out["messages"][0]["content"] != sysmsg
    ins = apply_edits(body, [{"insert": "BLOCK\n", "message": 0, "at": 0.5}])
    c = ins["messages"][0]["content"]
    pos = c.index("BLOCK\n")
    assert 0.45 * len(sysmsg) < pos < 0.6 * len(sysmsg) and c[pos - 1] == "\n"
    assert c.replace("BLOCK\n", "", 1) == sysmsg
    with pytest.raises(ScenarioError, match="out of range"):
        apply_edits(body, [{"insert": "x", "message": 9}])


def test_recording_becomes_a_scenario_with_gaps(tmp_path):
    rec = Recorder(tmp_path / "rec")
    body = load_fixture("opencode_title.json")
    for i in range(3):
        req = ParsedRequest(request_id=f"r{i}", method="POST", path="/v1/chat/completions",
                            body=body, headers={"x-session-affinity": "ses_1"},
                            session_hint="ses_1", stream=True)
        rec.record(req, Plan(), Observation(status=200, completed=True, total_s=0.5),
                   t_received=rec._t0 + 2.0 * i)
    rec.close()
    sc = scenario_from_recording(tmp_path / "rec")
    assert [s.kind for s in sc.steps] == ["send"] * 3
    assert [s.gap_s for s in sc.steps] == pytest.approx([0.0, 1.5, 1.5])
    assert sc.steps[1].headers == {"x-session-affinity": "ses_1"}
    assert sc.steps[0].body == body


# --- against the real tiny llama-server -----------------------------------------------------------


@pytest.mark.server
def test_replay_tiny_scenario_against_real_server(tmp_path, start_server):
    sc = smoke(tmp_path, """
  - parallel:
      - send: opencode_title.json
      - send: opencode_agent_turn1.json
        session: main
  - turn: main
  - restart: true
  - turn: main
""")
    srv = start_server(model="hybrid", n_parallel=2, ctx_size=2 * 12288)

    async def restart():
        await asyncio.to_thread(srv.restart)

    async def go():
        meter = PrefillMeter(srv.url)
        sent = await replay(sc, Target(srv.url, srv.url, restart, meter), time_scale=0)
        import aiohttp
        async with aiohttp.ClientSession() as http:
            assign_server_prefill(sent, await meter.sample(http))
        rows = await measure(sent, srv.url, grid=srv.ubatch)
        return sent, rows

    sent, rows = asyncio.run(go())
    assert len(sent) == 4 and all(s.response.error is None for s in sent), \
        [s.response.error for s in sent]
    assert {sent[0].label, sent[1].label} == {"opencode_title", "opencode_agent_turn1"}
    assert sent[3].restart_before and not sent[2].restart_before
    # the turn grew from the model's own answer
    agent = next(s for s in sent[:2] if s.session == "main")
    assert sent[2].body["messages"][:2] == agent.body["messages"]
    assert sent[2].body["messages"][2]["role"] == "assistant"
    for r in rows:
        assert r.error is None and r.note is None, (r.error, r.note)   # tokens match the server's
        assert r.prompt_n is not None and r.prompt_n >= 1
        # a real server can never beat the oracle without grid rounding (the grid one, as
        # specified, can be beaten by checkpoints the server places off the grid)
        assert r.prompt_n >= r.oracle_exact.prefill, r
        assert r.oracle_exact.prefill <= r.oracle.prefill
        assert r.cache_n + r.prompt_n == r.n_tokens
        assert r.ttft_ratio is not None
    # first requests ran cold on a fresh server, so the oracle charges them in full
    assert all(r.oracle.reuse == 0 for r in rows[:2])
    # the growth turn extends the agent turn: the oracle reuses at least its prompt
    assert rows[2].oracle.reuse >= agent.response.usage["prompt_tokens"]
    # a cold request on a fresh server is trivially exact
    assert rows[0].exact is True and rows[1].exact is True
    # exactness was judged per token (ocache.bench.exact), and over most of the generated tokens
    assert all(r.exact_tokens is not None for r in rows), [(r.label, r.exact_tokens) for r in rows]
    assert sum(r.exact_tokens for r in rows) >= 2 * len(rows), [(r.label, r.exact_tokens) for r in rows]
    # after the restart a plain llama-server has nothing: full prefill
    assert rows[3].cache_n == 0
    # the server's own counter agrees with what the clients saw (nobody else prefilled), across
    # the restart
    assert sum(r.server_prefill for r in rows) == sum(r.prompt_n for r in rows)


@pytest.mark.server
@pytest.mark.slow
def test_bench_tiny_writes_table_and_plot(tmp_path, engine_stock, engine_patched, models_tiny):
    from ocache.bench.run import Bench

    sc = smoke(tmp_path, """
  - send: opencode_agent_turn1.json
    session: main
  - turn: main
  - restart: true
  - turn: main
""")
    bench = Bench("tiny", [sc], tmp_path / "out")
    asyncio.run(bench.run())
    md, pngs = bench.write(1.0, "test")
    text = md.read_text()
    for cfg in ("a", "b", "c"):
        run = bench.results["hybrid"]["smoke"][cfg]
        assert run.error is None, run.error
        assert len(run.rows) == 3
        assert f"| hybrid | smoke | {cfg} | 3 |" in text
        assert run.efficiency is not None and run.efficiency > 0
        # the server's own prefill counter (warm-ups included) never beats the ungridded oracle
        assert run.observed >= run.oracle_exact_total
    assert bench.results["hybrid"]["smoke"]["c"].layer
    # the rule-2 table: each configuration's server prefill and (c) / min((a), (b))
    runs = bench.results["hybrid"]["smoke"]
    ratio = runs["c"].observed / min(runs["a"].observed, runs["b"].observed)
    assert (f"| hybrid | smoke | {runs['a'].observed} | {runs['b'].observed} | "
            f"{runs['c'].observed} |") in text and f"{ratio:.3f}" in text
    assert "Requests where (c) prefilled more than (a) or (b)" in text
    # the headline ocache served beside (b) - (c); (c) was told nothing of the server
    assert "The headline saving ocache reported, against the measured (b) - (c)" in text
    alone = runs["c"].ocache_stats["layer"]["alone"]
    assert f"| {runs['b'].observed - runs['c'].observed:,} | {alone['saved']:,} |" in text
    assert alone["restarts"] == 1
    assert pngs and pngs[0].stat().st_size > 10_000
    data = json.loads((tmp_path / "out" / "bench-tiny.json").read_text())
    assert set(data["hybrid"]["smoke"]) == {"a", "b", "c"}


def test_server_prefill_is_split_by_step_and_prompt_n():
    from ocache.bench.replay import Response, Sent, assign_server_prefill

    def sent(i, step, mark, prompt_n, n_tokens):
        r = Response(200, Answer(), {"prompt_n": prompt_n}, {"prompt_tokens": n_tokens}, 0.1,
                     0.2, {})
        return Sent(i, f"r{i}", None, "/v1/chat/completions", {}, {}, 0.0, r, step_no=step,
                    prefill_mark=mark)

    # step 1: one request + 900 tokens of a proxy's warm-up; step 2: a parallel pair (a long
    # agent prompt warmed by the proxy with 7000 tokens, a short title request beside it)
    reqs = [sent(0, 1, 0, 100, 1000), sent(1, 2, 1000, 300, 7300), sent(2, 2, 1000, 500, 500)]
    assign_server_prefill(reqs, 1000 + 300 + 500 + 7000)
    assert reqs[0].server_prefill == 1000
    assert reqs[1].server_prefill == 300 + 7000 * 7300 // 7800
    assert reqs[2].server_prefill == 500 + 7000 - 7000 * 7300 // 7800
    assert sum(r.server_prefill for r in reqs) == 8800


def test_synthetic_contexts_are_seeded_and_distinct(tmp_path):
    sc = load_scenario(write(tmp_path, """
name: syn
steps:
  - synthetic: {seed: 1, words: 50}
  - synthetic: {seed: 2, words: 50}
  - synthetic: {seed: 1, words: 50}
"""), FIXTURES)
    bodies = [s.body for s in sc.steps]
    assert bodies[0] == bodies[2] != bodies[1]
    assert len(bodies[0]["messages"][0]["content"].split()) >= 50
    with pytest.raises(ScenarioError, match="synthetic"):
        load_scenario(write(tmp_path, "name: x\nsteps: [{synthetic: {words: 5}}]", "bad.yaml"), FIXTURES)


def test_bench_plots_keep_title_and_labels_inside_and_one_plot_per_scenario(tmp_path):
    """The bench PNGs: the title (wrapped) and axis labels lie inside the figure, the
    axes name their units, and each scenario gets a plot of its own besides the combined one."""
    from types import SimpleNamespace as NS

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt


    def run(prefills, oracle):
        rows = [NS(index=i, server_prefill=p, prompt_n=p, oracle=NS(prefill=o), restart_before=(i == 2))
                for i, (p, o) in enumerate(zip(prefills, oracle))]
        return NS(rows=rows)

    per = {sc: {"a": run([7000, 300, 7000], [7000, 300, 0]), "b": run([7000, 300, 7000], [7000, 300, 0]),
                "c": run([7000, 300, 20], [7000, 300, 0])} for sc in ("restart mid-session", "growth", "A/B/A")}
    from ocache.bench import plots

    figs = [plots.figure("tiny", "hybrid", per)] + [plots.scenario_figure("tiny", "hybrid", sc, r)
                                                     for sc, r in per.items()]
    for fig in figs:
        fig.canvas.draw()
        box = fig.bbox
        texts = [fig._suptitle] + [t for ax in fig.axes for t in (ax.xaxis.label, ax.yaxis.label, ax.title)
                                   if t.get_text()]
        for t in texts:
            bb = t.get_window_extent()
            assert box.x0 <= bb.x0 and bb.x1 <= box.x1 and box.y0 <= bb.y0 and bb.y1 <= box.y1, t.get_text()
        assert all("log scale" in ax.get_ylabel() for ax in fig.axes if ax.get_ylabel())
        plt.close(fig)
    paths = plots.plot({"hybrid": per}, "tiny", tmp_path)
    assert [p.name for p in paths] == ["prefill-tiny-hybrid.png", "prefill-tiny-hybrid-restart mid-session.png",
                                       "prefill-tiny-hybrid-growth.png", "prefill-tiny-hybrid-A_B_A.png"]
    assert all(p.stat().st_size > 10_000 for p in paths)


def test_rule2_report_lists_every_request_where_c_prefilled_more_and_judges_the_scenario():
    """The rule-2 report: each request where (c) prefilled more than (a) or (b),
    matched by label and occurrence (a parallel group may be sent in another order); a scenario
    fails when (c) / min((a), (b)) > 1.00 or any title request (ocache's ``guest``) is among them,
    even when an agent turn's gain keeps the total under."""
    from ocache.bench.oracle import OracleResult
    from ocache.bench.replay import Row
    from ocache.bench.rule2 import over_requests, rule2
    from ocache.bench.run import Bench, ConfigRun

    def row(i, label, prefill, kind=None):
        return Row(index=i, label=label, n_tokens=600, prompt_n=prefill, server_prefill=prefill,
                   cache_n=600 - prefill, oracle=OracleResult(n_tokens=600, reuse=600, prefill=0, lcp=600, source=0),
                   ttft_s=None, cold_ttft_s=None, exact=True, exact_tokens=None, restart_before=False,
                   ocache={"X-OCache-Kind": kind} if kind else {})

    def runs(c_rows, a_rows, b_rows):
        return {"a": ConfigRun("a", a_rows, 1.0), "b": ConfigRun("b", b_rows, 1.0),
                "c": ConfigRun("c", c_rows, 1.0)}

    alone = [row(0, "title", 541), row(1, "agent", 7251), row(2, "title", 18), row(3, "agent", 300)]
    # (c) sent run 2's agent turn before its title: matched by label, not position
    c_rows = [row(0, "title", 541, "guest"), row(1, "agent", 7251, "agent"),
              row(2, "agent", 18, "agent"), row(3, "title", 542, "guest")]
    title_lost = runs(c_rows, alone, [row(0, "title", 541), row(1, "agent", 7251),
                                      row(2, "title", 20), row(3, "agent", 250)])
    bench = Bench.__new__(Bench)
    bench.results = {"hybrid": {"runs": title_lost}}
    over = over_requests(title_lost)
    assert [(o["row"].label, o["a"], o["b"], o["c"], o["excess"], o["title"]) for o in over] == \
        [("title", 18, 20, 542, 524, True)]
    v = rule2(title_lost)
    # 8,352 against 8,062 for (b), and a title was lost
    assert v["holds"] is False and v["ratio"] == pytest.approx(8352 / 8062)
    text = bench.worse_requests()
    assert "hybrid/runs" in text and "#3 title (title): (a) 18, (b) 20, (c) 542 (+524)" in text
    assert "1 of them title requests" in text and "rule 2 fails" in text
    table = bench.never_worse_table()
    assert "| hybrid | runs | 8110 | 8062 | 8352 | **1.036** | 1 (+524 tokens) | 1 | **fails** |" in table
    # an agent turn's gain does not excuse a title's loss: total under, title over -> fails
    gain = runs([row(0, "title", 541, "guest"), row(1, "agent", 7251, "agent"),
                 row(2, "title", 60, "guest"), row(3, "agent", 10, "agent")], alone, alone)
    v = rule2(gain)
    assert v["ratio"] < 1.0 and v["holds"] is False
    # equal or lower everywhere: nothing listed, the rule holds
    same = runs([row(0, "title", 541, "guest"), row(1, "agent", 7251, "agent"),
                 row(2, "title", 18, "guest"), row(3, "agent", 290, "agent")], alone, alone)
    assert over_requests(same) == [] and rule2(same)["holds"] is True
    bench.results = {"hybrid": {"runs": same}}
    assert bench.worse_requests() == "(none)"
    # a non-title request over (a) or (b) is listed, and the total decides
    agent_over = runs([row(0, "title", 541, "guest"), row(1, "agent", 7251, "agent"),
                       row(2, "title", 18, "guest"), row(3, "agent", 310, "agent")], alone,
                      alone[:3] + [row(3, "agent", 305)])
    over = over_requests(agent_over)
    assert [(o["row"].index, o["excess"], o["title"]) for o in over] == [(3, 10, False)]
    assert rule2(agent_over)["holds"] is False      # 8,120 > 8,110 * 1.00


def test_bench_ctx_per_slot_overrides_the_presets(tmp_path):
    """``ocache bench --ctx-per-slot N``: every configuration's server gets N tokens per slot (a
    template that renders the clients' prompts longer: Claude Code's on Qwen3-Coder.jinja are
    12.3-12.4k tokens, over the tiny preset's 12,288); without it the preset's size stays."""
    from ocache.bench.run import PRESETS, Bench
    from ocache.cli import build_parser

    assert Bench("tiny", [], tmp_path, ctx_per_slot=16384).preset.ctx_per_slot == 16384
    assert Bench("tiny", [], tmp_path).preset.ctx_per_slot == PRESETS["tiny"].ctx_per_slot
    args = build_parser().parse_args(["bench", "--preset", "tiny", "--ctx-per-slot", "16384"])
    assert args.ctx_per_slot == 16384
