"""Claude Code's compaction, ``/compact`` and auto-compaction, on the real client.

Claude Code 2.1.328 compacts a session (``claude -p /compact --continue``, or by itself once the
context passes ``CLAUDE_AUTOCOMPACT_PCT_OVERRIDE`` percent of ``CLAUDE_CODE_AUTO_COMPACT_WINDOW``,
which it reads as at least 100,000 tokens) with the conversation's own request (the same system
blocks, tools and messages, the last answer as it came) and one user message more: its compaction
instructions (6,912 characters, a text part). When the answer lacks its summary tags it asks again
with one paragraph appended to that message. Both extend the prompt the slot holds, so the server's
own prefix match serves them from the slot, alone and through ocache alike: what is prefilled is
the instruction turn (~1,460 tokens on the tiny model's vocabulary, more than the 1,000 a
continuation's instruction turn takes elsewhere: the text is Claude Code's), then the appended
paragraph. The shapes (sizes and sha256, no text) are in ``tests/data/claude-compaction.json``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

DATA = json.loads((Path(__file__).parent / "data" / "claude-compaction.json").read_text())

#: answers that end (the tiny model never ends on its own), greedy, no reasoning
SERVER_ARGS = ["--temp", "0", "--reasoning", "off", "-l", "151645+11", "-n", "256"]
#: tokens a hybrid model's restore may fall short of a prefix (it resumes at its checkpoints and
#: ocache's head split; measured: 4 on the compaction, 2 on the next turn)
REWIND = 64
#: the server's ubatch (``ocache.llama.server.LlamaServer``): a retry resumes at a checkpoint of
#: the instruction turn's prefill
UBATCH = 512
#: prompts: a first turn, then ~6,000 characters of ocache's own source per turn
N_REVIEWS = 7


def _text(message: dict) -> str:
    c = message["content"]
    return c if isinstance(c, str) else "".join(p.get("text", "") for p in c)


def _texts(messages: list[dict]) -> list[tuple[str, str]]:
    return [(m["role"], _text(m)) for m in messages]


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _compactions(recs: list[dict]) -> list[int]:
    """The indices of the records whose last user message is Claude Code's compaction instruction
    (the first ask, by its sha256 in the capture)."""
    want = DATA["compaction"]["instruction"]["sha256"]
    return [i for i, r in enumerate(recs) if r["body"].get("messages") and _digest(_text(r["body"]["messages"][-1])) == want]


def _counts(rec: dict) -> dict | None:
    """The server's own counts for one answer, as recorded: ``prompt_n``, ``cache_n``,
    ``predicted_n`` (a non-streamed Anthropic answer, which Claude Code sends after a failed stream,
    has them derived from its ``usage``: ocache/relay.py). None for an answer without them (an
    error, a stream the client gave up on)."""
    t = (rec.get("obs") or {}).get("timings")
    return {k: t.get(k) for k in ("prompt_n", "cache_n", "predicted_n")} if t else None


def _done(rec: dict) -> bool:
    """A request answered whole with the server's counts (a stream the client gave up on, or an
    error, has none: Claude Code then sends the same request again)."""
    obs = rec.get("obs") or {}
    return obs.get("status") == 200 and bool(obs.get("completed")) and _counts(rec) is not None


def _table(recs: list[dict]) -> str:
    """One line per record (for a failure's message): seq, status, messages, last text's start, timings."""
    rows = []
    for r in recs:
        obs, msgs = r.get("obs") or {}, r["body"].get("messages") or []
        t = obs.get("timings") or {}
        rows.append(f"{r.get('seq')} {r['path']} status={obs.get('status')} completed={obs.get('completed')} "
                    f"messages={len(msgs)} prompt_n={t.get('prompt_n')} cache_n={t.get('cache_n')} "
                    f"last={_text(msgs[-1])[:40]!r}" if msgs else f"{r.get('seq')} {r['path']}")
    return "\n".join(rows)


def _session(binary, proxy, tmp_path: Path, name: str, auto: bool, model: str):
    from ocache.toolchain import clients
    from test_e2e_clients import _wait_recorded

    project = tmp_path / f"proj-{name}"
    project.mkdir()
    (project / "main.py").write_text("print('hi')\n")
    extra = {"CLAUDE_CODE_ATTRIBUTION_HEADER": "0"}
    if auto:
        extra.update(CLAUDE_CODE_AUTO_COMPACT_WINDOW="100000", CLAUDE_AUTOCOMPACT_PCT_OVERRIDE="24")
    env = clients.claude_env(tmp_path / f"home-{name}", proxy.url, output_tokens=4096, extra=extra)
    sources = sorted((Path(__file__).resolve().parent.parent / "ocache").glob("*.py"))
    reviews = [f"Review this code:\n\n{p.read_text()[:6000]}" for p in sources if p.stat().st_size > 6000]
    prompts = ["list the files and explain main.py"] + reviews[:N_REVIEWS]
    prompts += ["what next?"] if auto else ["/compact", "what next?"]
    runs = []
    for i, prompt in enumerate(prompts):
        runs.append(clients.run_claude(binary, project, prompt, env, model=model,
                                       args=("--continue",) if i else (), timeout=300))
        assert runs[-1].returncode == 0, runs[-1].describe(5)
    # Claude Code compacts by itself once its own estimate of the context passes the threshold,
    # and the tiny model's answers (their lengths) decide on which turn: a few more turns, at
    # most three, until it has. Each is another ~1,500-token review, so the context grows past the
    # threshold whatever the answers (three short "what next?" turns once left it under)
    for more in reviews[N_REVIEWS:N_REVIEWS + 3] if auto else []:
        if _compactions(_wait_recorded(proxy, lambda rs: len(rs) >= len(runs) + 1)):
            break
        runs.append(clients.run_claude(binary, project, more, env, model=model,
                                       args=("--continue",), timeout=300))
        assert runs[-1].returncode == 0, runs[-1].describe(5)
    # the last record (the turn after the compaction) can trail the client's exit
    return runs, _wait_recorded(proxy, lambda rs: _next_turn(rs) is not None, timeout=60.0)


def _next_turn(recs: list[dict]) -> dict | None:
    """The first request after the first compaction that is not the compaction asked again (its
    instruction, with or without the retry's paragraph) and was answered whole; None before it is."""
    comps = _compactions(recs)
    if not comps:
        return None
    instruction = _text(recs[comps[0]]["body"]["messages"][-1])
    return next((r for r in recs[comps[0] + 1:] if _done(r) and r["body"].get("messages")
                 and not _text(r["body"]["messages"][-1]).startswith(instruction)), None)


@pytest.mark.server
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["compact", "auto"])
def test_the_real_claude_code_compaction_is_served_from_the_slot(start_server, tmp_path, models_tiny, mode):
    """The same Claude Code session through ``ocache serve --no-cache`` (llama-server alone, recorded
    with its timings) and through ocache, each on its own llama-server (tiny hybrid, ``-np 2``):
    ``/compact`` after a ~22k-token conversation (``mode`` compact), or auto-compaction (``auto``).
    The compaction request is the conversation's last request, its answer and the instruction
    turn; on both it is served from the conversation's slot: the previous prompt is reused and the
    answer and the instruction turn are prefilled (~1,450 tokens, Claude Code's text: above the
    1,000 a continuation's instruction turn takes elsewhere); the retry, when the answer lacked
    its summary tags and Claude Code asked again, prefills its appended paragraph; the next turn
    reuses as much as alone. Measured (prefilled: the compaction, the
    retry, the next turn): ``compact`` after 22,813 tokens alone 1,479, 599, 2,715, through ocache
    (22,621) 1,432, 590, 2,677; ``auto`` after 21,217 alone 1,432, 599, 4,055, through ocache
    (21,173) 1,499, 223, 4,127. The answers differ (the hybrid model's numerics follow where a
    prefill resumed), so do the prompts after them: the next turn reused 9,360 to 9,364 tokens on
    either side."""
    from ocache.toolchain import clients
    from test_e2e_clients import _install, side

    binary = _install(clients.CLAUDE)
    figures = {}
    for name in ("alone", "ocache"):
        with side(start_server, tmp_path, name, SERVER_ARGS) as proxy:
            runs, recs = _session(binary, proxy, tmp_path, name, mode == "auto", str(models_tiny["hybrid"]))
        recs = [r for r in recs if r["path"].startswith("/v1/messages")]
        report = "\n".join(r.describe(3) for r in runs[-2:])
        report += "\n" + _table(recs)
        # the compaction answered whole (Claude Code sends a request again when its stream failed,
        # as it was or without streaming: seen on the loaded machine, on llama-server alone too),
        # and the turn before it: the last one answered whole that is not the compaction
        comps = [j for j in _compactions(recs) if _done(recs[j])]
        assert comps, report
        i = comps[0]
        asked = {_digest(_text(recs[j]["body"]["messages"][-1])) for j in _compactions(recs)}
        turn = next((r for r in reversed(recs[:i]) if _done(r)
                     and _digest(_text(r["body"]["messages"][-1])) not in asked), None)
        assert turn is not None, report
        comp, prev = recs[i]["body"], turn["body"]
        # the shape stored: the previous request, its answer, the instruction turn; the same fields
        assert sorted(comp) == DATA["compaction"]["fields"], sorted(comp)
        assert comp["system"] == prev["system"] and comp["tools"] == prev["tools"], report
        # (the same texts: only where ``cache_control`` stands, and so a text part or a string, moves)
        assert _texts(comp["messages"][:-2]) == _texts(prev["messages"]), report
        assert comp["messages"][-2]["role"] == "assistant"
        # the retry (the instruction with one paragraph appended) comes only when the answer lacks
        # its summary tags: the model's answer decides, so it is looked for, not assumed; Claude
        # Code may also send the compaction again as it was
        instruction = _text(comp["messages"][-1])
        later = recs[i + 1:]
        retries = [j for j, r in enumerate(later, i + 1) if _done(r) and _text(r["body"]["messages"][-1]).startswith(instruction)
                   and _digest(_text(r["body"]["messages"][-1])[len(instruction):]) == DATA["retry"]["appended"]["sha256"]]
        for j in retries[:1]:
            assert _texts(recs[j]["body"]["messages"][:-1]) == _texts(comp["messages"][:-1])
        nxt = _next_turn(recs)
        assert nxt is not None, report
        steps = [("turn", turn), ("compaction", recs[i]), ("next", nxt)]
        if retries:
            steps.append(("retry", recs[retries[0]]))
        t = {k: _counts(r) for k, r in steps}
        figures[name] = {k: {"prompt_n": v["prompt_n"], "cache_n": v["cache_n"]} for k, v in t.items() if v}
        figures[name]["turn"]["predicted_n"] = t["turn"]["predicted_n"]
    print("\n" + json.dumps(figures, indent=1))
    alone, oc = figures["alone"], figures["ocache"]
    for name, f in figures.items():
        held = f["turn"]["prompt_n"] + f["turn"]["cache_n"]
        assert held > 20000, figures
        # served from the slot: the previous request's whole prompt is reused (the hybrid model
        # resumes at a checkpoint: a few tokens early), then the instruction turn is prefilled;
        # the retry reuses that and prefills the appended paragraph
        assert f["compaction"]["cache_n"] >= held - REWIND, (name, figures)
        if "retry" in f:
            assert f["retry"]["cache_n"] >= f["compaction"]["prompt_n"] + f["compaction"]["cache_n"] - 2 * UBATCH, \
                (name, figures)
    # the next turn (the summary, then the new prompt) reuses the system blocks and tools as alone
    # does: the two prompts differ by the summary the model wrote, so the reuse is compared
    assert oc["next"]["cache_n"] >= alone["next"]["cache_n"] - REWIND, figures
