"""The real opencode's compaction request, captured through ``ocache serve --record`` (issue 26 item 3).

opencode 1.18.33 (npm, ``ocache/toolchain/clients.py``) runs one ``opencode run`` against ocache in
front of llama-server (tiny hybrid model, the pinned source's ``Qwen3.5-4B.jinja``) with its model's
``limit.context`` set below what the first agent turn uses: after that turn opencode compacts the
session by itself (``SessionCompaction.isOverflow``), then continues and compacts again until the
run is stopped. The request it sends is the one stored in ``tests/data/opencode-compaction.json``
(``tests/test_compaction.py`` reads that file): this test is how it was captured and checks that
the client still sends it. The tiny random model's answers are cut at ``max_tokens``, so the
continued route finds the conversation but forwards the compaction as sent (an answer not ended by
the model's end of turn: the slot does not hold that end); the served continuation is
``tests/test_compaction_real.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ocache.compaction import parse, user_texts
from ocache.toolchain import clients
from test_e2e_clients import OcacheProcess, _install, _wait_recorded
from test_real_templates import serve_template  # noqa: F401

pytestmark = [pytest.mark.server, pytest.mark.slow]

CAPTURE = json.loads((Path(__file__).parent / "data" / "opencode-compaction.json").read_text())

#: the model's context limit given to opencode (tokens): its first agent turn is ~7.3k on this template
CONTEXT_LIMIT = 7000
#: how long the run is let go on (seconds): the first compaction came ~15 s after the start when captured
RUN_S = 75.0


def test_the_real_opencode_sends_the_captured_compaction(serve_template, tmp_path):
    binary = _install(clients.OPENCODE)
    srv = serve_template("hybrid", n_parallel=2, ctx_size=32768, args=["-n", "64"])
    proxy = OcacheProcess(srv.url, tmp_path)
    try:
        proxy.wait_ready()
        project = tmp_path / "proj"
        project.mkdir()
        (project / "main.py").write_text("print('hi')\n")
        clients.write_opencode_config(project, proxy.url + "/v1", context_tokens=CONTEXT_LIMIT, output_tokens=64)
        run = clients.run_opencode(binary, project, "list the files here", clients.isolated_env(tmp_path / "home"),
                                   timeout=RUN_S)
        recs = _wait_recorded(proxy, lambda rs: any(parse(r["body"]) for r in rs))
        stats = proxy.stats()["layer"]["continued"]
    finally:
        proxy.stop()
    comps = [r for r in recs if parse(r["body"]) is not None]
    assert comps, run.describe()
    body = comps[0]["body"]
    comp = parse(body)
    stored = parse(CAPTURE["compaction"])
    # the shape stored: no tools, the compaction agent's system text, the history block, the instructions
    assert "tools" not in body and [m["role"] for m in body["messages"]] == ["system", "user"]
    assert body["messages"][0] == CAPTURE["compaction"]["messages"][0]
    assert comp.after == stored.after
    assert sorted(k for k in body if k != "messages") == sorted(k for k in CAPTURE["compaction"] if k != "messages")
    # its user line is the agent turn's user message, as the client sent it
    agent = next(r["body"] for r in recs if r["body"].get("tools"))
    assert comp.user_lines == tuple(user_texts(agent["messages"])) == stored.user_lines
    # the route recognised it and found the conversation's record; the tiny model's cut answer
    # keeps it from being continued
    assert stats["recognised"] >= 1 and stats.get("as_sent_answer_not_ended_by_end_of_turn", 0) >= 1, stats


def test_claude_codes_compaction_extends_the_prefix_and_is_served_from_the_slot(start_server, tmp_path,
                                                                                models_tiny):
    """Claude Code 2.1.328's ``/compact`` (``claude -p /compact --continue`` after three turns)
    resends the conversation with its tools and adds its instructions to the last user message:
    a prefix extension of the previous request, so ocache serves it from the slot as it is (the
    server reuses the conversation up to its last user turn and prefills that turn with the
    instructions); no continuation is needed (issue 26 item 3: "check it already hits")."""
    import yaml

    binary = _install(clients.CLAUDE)
    srv = start_server("hybrid", n_parallel=1, ctx_size=32768, args=["--logit-bias", "151645+100", "-n", "64"])
    cfg = tmp_path / "ocache.yaml"
    cfg.write_text(yaml.safe_dump({"tiers": {"resident": {"server_args": srv.command()[1:]},
                                             "disk": {"enabled": False}}}))
    proxy = OcacheProcess(srv.url, tmp_path, ("--config", str(cfg)))
    try:
        proxy.wait_ready()
        project = tmp_path / "proj"
        project.mkdir()
        (project / "main.py").write_text("print('hi')\n")
        env = clients.claude_env(tmp_path / "home", proxy.url)
        runs = []
        for prompt, args in (("list the files and explain main.py", ()), ("now explain it again", ("--continue",)),
                             ("and once more", ("--continue",)), ("/compact", ("--continue",))):
            runs.append(clients.run_claude(binary, project, prompt, env, model=str(models_tiny["hybrid"]),
                                           args=args, timeout=300))
        recs = _wait_recorded(proxy, lambda rs: any("CRITICAL: Respond with TEXT ONLY" in json.dumps(r["body"])
                                                    for r in rs))
    finally:
        proxy.stop()
    report = "\n".join(r.describe(5) for r in runs)
    i = next((i for i, r in enumerate(recs) if "CRITICAL: Respond with TEXT ONLY" in json.dumps(r["body"])), None)
    assert i, report
    comp, prev = recs[i], recs[i - 1]
    assert comp["body"].get("tools") == prev["body"].get("tools") and comp["body"].get("system") == prev["body"].get("system")
    t, t_prev = comp["obs"]["timings"], prev["obs"]["timings"]
    assert comp["plan"]["headers"].get("X-OCache-Tier") == "resident", comp["plan"]["headers"]
    # the same messages, the instructions added to the last user message's parts (each part's
    # text ends with a newline now)
    texts = [[p.get("text").strip() for p in m["content"]] if isinstance(m["content"], list) else [m["content"]]
             for m in (prev["body"]["messages"][-1], comp["body"]["messages"][-1])]
    assert len(comp["body"]["messages"]) == len(prev["body"]["messages"]) and texts[1][:len(texts[0])] == texts[0]
    # served from the slot: everything up to the last user turn (the hybrid model resumes at the
    # checkpoint where that turn starts, as for the previous request), then the instructions
    assert t["cache_n"] >= t_prev["cache_n"] > 9000 and t["prompt_n"] < 2000, (t, t_prev)
