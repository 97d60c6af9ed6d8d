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
