"""Claude Code's re-prefill of ~2.3k tokens a request, on the real client.

Claude Code 2.1.328 sends its environment (cwd, OS, model id, deferred tools, agent types, skills,
the date) as a ``role: system`` message right after the first user message, keeps no answer cut at
the output limit, and asks again with a note merged into the last user message; until an answer is
kept every later prompt is merged into the first user message as well. So each such request
changes the text *before* the environment block, which is rendered and prefilled again, alone and
through ocache alike (nothing of the slot can be spliced: the cut answer is not in the request). With
answers that end, the next prompt extends the previous one and only the new turn is prefilled
(docs/usage.md, "Claude Code and Codex CLI"; ``scripts/measure-clients`` measures both, alone too).
These tests pin what that explanation rests on, so a Claude Code that changes it fails them.
"""

from __future__ import annotations

import pytest

from ocache.toolchain import clients
from test_e2e_clients import OcacheProcess, _install, _wait_recorded

pytestmark = [pytest.mark.server, pytest.mark.slow]


def _texts(message: dict) -> list[str]:
    c = message["content"]
    return [p.get("text", "") for p in c] if isinstance(c, list) else [c]


def _run(start_server, tmp_path, models_tiny, server_args: list[str], max_out: int, prompts: list[str]):
    binary = _install(clients.CLAUDE)
    srv = start_server("hybrid", n_parallel=2, ctx_size=65536, args=server_args)
    proxy = OcacheProcess(srv.url, tmp_path, server_args=srv.command()[1:])
    try:
        proxy.wait_ready()
        project = tmp_path / "proj"
        project.mkdir()
        (project / "main.py").write_text("print('hi')\n")
        env = clients.claude_env(tmp_path / "home", proxy.url, output_tokens=max_out,
                                 extra={"CLAUDE_CODE_ATTRIBUTION_HEADER": "0"})
        runs = [clients.run_claude(binary, project, p, env, model=str(models_tiny["hybrid"]),
                                   args=("--continue",) if i else (), timeout=300) for i, p in enumerate(prompts)]
        recs = _wait_recorded(proxy, lambda rs: len(rs) >= len(prompts))
    finally:
        proxy.stop()
    return runs, [r for r in recs if r["path"].startswith("/v1/messages")]


def test_a_cut_answer_is_asked_again_before_the_environment_block(start_server, tmp_path, models_tiny):
    runs, recs = _run(start_server, tmp_path, models_tiny, ["-n", "32"], 32, ["list the files and explain main.py"])
    report = "\n".join(r.describe(5) for r in runs)
    assert len(recs) >= 2, report
    first, retry = recs[0]["body"], recs[1]["body"]
    # the environment follows the first user message; the retry keeps no answer and merges its
    # note into that message, before the environment block, which is the same text
    assert [m["role"] for m in first["messages"]] == ["user", "system"] == [m["role"] for m in retry["messages"]]
    assert "# Environment" in _texts(first["messages"][1])[0] and _texts(first["messages"][1]) == _texts(retry["messages"][1])
    before, after = _texts(first["messages"][0]), _texts(retry["messages"][0])
    # (the note says which: "Output token limit hit ..." after visible text, "[Your previous response
    # had no visible output ...]" after reasoning alone)
    assert len(after) > len(before) and after[:len(before) - 1] == before[:-1], (before[-1:], after[-2:])
    assert after[-1].startswith(("Output token limit hit", "[Your previous response")), after[-1:]
    # so the server resumes where that user turn starts and prefills the environment block again
    t = recs[1]["obs"]["timings"]
    assert t["prompt_n"] > 2000 and t["cache_n"] > 9000, t


def test_answers_that_end_are_kept_and_the_next_prompt_extends_the_last(start_server, tmp_path, models_tiny):
    runs, recs = _run(start_server, tmp_path, models_tiny,
                      ["--temp", "0", "--reasoning", "off", "-l", "151645+11", "-n", "256"], 4096,
                      ["list the files and explain main.py", "now explain it again"])
    report = "\n".join(r.describe(5) for r in runs)
    assert len(recs) == 2 and all(r.returncode == 0 for r in runs), report
    msgs = recs[1]["body"]["messages"]
    assert [m["role"] for m in msgs] == ["user", "system", "assistant", "user"], report
    first = recs[0]["body"]["messages"]
    assert [_texts(m) for m in msgs[:2]] == [_texts(m) for m in first], report
    t = recs[1]["obs"]["timings"]
    assert t["prompt_n"] < 200 and t["cache_n"] > 11000, t
