"""pi's compaction served as the conversation's continuation.

pi 0.73.1 compacts a session once its context passes ``contextWindow - compaction.reserveTokens``
(``_checkCompaction`` in its ``dist/core/agent-session.js``) with a standalone request
(``generateSummary`` in ``dist/core/compaction/compaction.js``): no tools, its summariser's system
prompt, one user message of one text part that opens with ``<conversation>\\n``, the history
serialised (``serializeConversation``, ``dist/core/compaction/utils.js``: ``[User]: ``,
``[Assistant thinking]: ``, ``[Assistant]: ``, ``[Assistant tool calls]: name(k=<JSON>, ...)``,
``[Tool result]: `` cut at 2,000 UTF-16 code units, entries joined by a blank line), then
``\\n</conversation>\\n\\n`` and its instructions. The history is the conversation up to the cut
(``keepRecentTokens`` of the newest messages are kept verbatim). When the cut falls inside a turn
it sends two such requests in parallel: the history before that turn and the turn's prefix
(``generateTurnPrefixSummary``). The shapes are in ``tests/data/pi-compaction.json``, captured by
the real-client test below.

``ocache.compaction.parse`` reads pi's shape (``client == "pi"``); ``pi_matches`` is the guard: the
history's entries must be the first entries of the recorded conversation. The turn's prefix starts
later in the conversation and goes as sent, on another slot.

The guard needs no server; the real client's run is marked ``server`` and ``slow``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from ocache.align import Turn
from ocache.compaction import (PI_CLOSE, PI_OPEN, continuation, instruction, matches, parse, pi_entries,
                               pi_history, pi_previous_summary, pi_request, pi_truncated)
from ocache.substitute import owner_of

DATA = json.loads((Path(__file__).parent / "data" / "pi-compaction.json").read_text())

#: our own texts in pi's places (pi's are left out of the checkout)
SYSTEM = "You summarise conversations."
AFTER = "The messages above are a conversation to summarise."
TOOLS = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]
CALL = {"id": "c1", "type": "function",
        "function": {"name": "read", "arguments": "{\"path\":\"a.py\",\"offset\":2,\"opts\":{\"raw\":true}}"}}
#: a conversation as pi sends it: user text parts, the answer's content a string, tool results
CONVERSATION = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": [{"type": "text", "text": "Read a.py."}]},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "import os\n"},
    {"role": "assistant", "content": "It imports os."},
    {"role": "user", "content": [{"type": "text", "text": "And b.py?"}]},
]
ANSWER = {"content": "b.py is empty.", "reasoning_content": "Nothing there."}
#: pi sends no session header: the credentials and the whole history decide
OWNER = owner_of({"authorization": "Bearer sk-local"})
#: a client that sends one (the guard's other case)
KEYED = owner_of({"x-session-affinity": "ses_1", "authorization": "Bearer sk-local"})


def turn(messages=CONVERSATION, **kw) -> Turn:
    base = dict(messages=tuple(messages), fields={"tools": TOOLS}, answer=ANSWER, finish_reason="stop",
                stop=False, known=(1, 2, 3), n_prompt_eot=6, n_held=40, slot=0, owner=OWNER)
    return Turn(**{**base, **kw})


def request(messages, **fields) -> dict:
    return pi_request(messages, SYSTEM, AFTER, model="qwen", stream=True, max_completion_tokens=64, **fields)


def _matches(body, t=None, owner=OWNER):
    return matches(parse(body), t or turn(), body, owner)


def test_the_captured_shape_is_the_one_the_parser_reads():
    """The real client's two requests: no tools, a system message, one user message of one text
    part that opens with the history block; the history request's entries begin with the
    conversation's first user message, the turn prefix's are that turn's user message alone."""
    history, prefix = DATA["compaction"]
    for c in (history, prefix):
        assert "tools" not in c["fields"] and [m["role"] for m in c["messages"]] == ["system", "user"]
        part, = c["messages"][1]["content"]
        assert part["type"] == "text" and part["opens"] == PI_OPEN and part["closes"] == PI_CLOSE
    assert history["messages"][0]["sha256"] == prefix["messages"][0]["sha256"]      # one summariser prompt
    assert history["messages"][1]["content"][0]["after"] != prefix["messages"][1]["content"][0]["after"]
    assert history["messages"][1]["content"][0]["history_entries"][0] == "user"
    assert prefix["messages"][1]["content"][0]["history_entries"] == ["user"]
    # the budgets: 0.8 and 0.5 of reserveTokens (3000 in the capture)
    assert (history["max_completion_tokens"], prefix["max_completion_tokens"]) == (2400, 1500)
    # the conversation pi sent before: its text parts are what the history block re-states
    assert DATA["turn"]["tools"] > 0 and DATA["turn"]["messages"][0]["role"] == "system"


def test_a_pi_request_is_read_as_pis_not_opencodes():
    body = request(CONVERSATION)
    comp = parse(body)
    assert comp is not None and comp.client == "pi"
    assert comp.user_lines == ("Read a.py.", "And b.py?") and comp.system == (SYSTEM,) and comp.after == AFTER
    assert instruction(comp) == SYSTEM + "\n\n" + AFTER
    text = body["messages"][1]["content"][0]["text"]
    assert text == (PI_OPEN + '[User]: Read a.py.\n\n[Assistant tool calls]: read(path="a.py", offset=2, '
                    'opts={"raw":true})\n\n[Tool result]: import os\n\n\n[Assistant]: It imports os.\n\n'
                    "[User]: And b.py?" + PI_CLOSE + AFTER)
    # with tools it is an agent turn, not a compaction; a block that never closes is no history
    assert parse({**body, "tools": TOOLS}) is None
    assert parse({**body, "messages": [body["messages"][0], {"role": "user", "content": text[:-len(PI_CLOSE + AFTER)]}]}) is None


def test_the_history_reads_back_as_the_conversations_entries():
    """``pi_entries`` of the block pi writes gives ``pi_history`` of the conversation, thinking aside."""
    hist = pi_history([*CONVERSATION, {"role": "assistant", **ANSWER}])
    assert hist == (("user", "Read a.py."), ("calls", 'read(path="a.py", offset=2, opts={"raw":true})'),
                    ("tool", "import os\n"), ("assistant", "It imports os."), ("user", "And b.py?"),
                    ("assistant", "b.py is empty."))
    text = request(CONVERSATION)["messages"][1]["content"][0]["text"]
    block = text[len(PI_OPEN):text.index(PI_CLOSE)]
    assert pi_entries(block) == hist[:-1]
    thought = block.replace("[Assistant]: It imports os.", "[Assistant thinking]: hmm\n\n[Assistant]: It imports os.")
    assert pi_entries(thought) == hist[:-1]


def test_the_guard_takes_the_conversations_first_entries():
    """The history pi summarises is the conversation up to its cut: the whole of it, the answer
    too, or its first turns. Another conversation, a history that starts later (a split turn's
    prefix) or one entry more than the record holds is not."""
    answered = [*CONVERSATION, {"role": "assistant", **ANSWER}]
    assert _matches(request(answered)) is None
    assert _matches(request(CONVERSATION)) is None
    assert _matches(request(CONVERSATION[:5])) is None          # the last turn kept out of the summary
    # its first question only: pi sends no session key, so the requester must show it read the
    # conversation (half its entries, one of the model's); with a session key that vouches for it
    assert _matches(request(CONVERSATION[:2])) == "no session key, and none of the model's entries sent"
    assert _matches(request(CONVERSATION[:2]), turn(owner=KEYED), owner=KEYED) is None
    # the split turn's prefix: the last turn's user message alone
    assert _matches(request([CONVERSATION[0], CONVERSATION[5]])) == "history differs"
    # another middle, another call, one more turn than recorded
    other = [*CONVERSATION[:3], dict(CONVERSATION[3], content="import sys\n"), *CONVERSATION[4:]]
    assert _matches(request(other)) == "history differs"
    moved = dict(CALL, function={"name": "read", "arguments": "{\"offset\":2,\"path\":\"a.py\",\"opts\":{\"raw\":true}}"})
    assert _matches(request([*CONVERSATION[:2], dict(CONVERSATION[2], tool_calls=[moved]), *CONVERSATION[3:]])) == \
        "history differs"
    assert _matches(request([*answered, {"role": "user", "content": "And c.py?"}])) == "history differs"
    # a prompt field the continuation could not take out of the forwarded body
    assert _matches(request(CONVERSATION, chat_template_kwargs={"enable_thinking": False})) == "prompt fields differ"


def test_an_answer_pi_left_out_is_no_entry():
    """pi sends no assistant message for an empty answer (pi-ai's ``openai-completions`` provider),
    and its history has no entry for one: the record's empty answer is none either."""
    conv = [CONVERSATION[0], CONVERSATION[1], {"role": "user", "content": [{"type": "text", "text": "Again."}]}]
    t = turn(conv, answer={"content": ""})
    assert _matches(request(conv), t) is None


def test_a_tool_result_pi_cut_is_the_recorded_one():
    """pi keeps the first 2,000 UTF-16 code units of a tool result, then a line with how many more
    there were: that entry is the recorded result (a character outside the BMP counts two, and the
    cut may fall between its halves); another result's cut is not."""
    long = "x = 1\n" * 400 + "\U0001f600" * 10
    cut = pi_truncated(long)
    assert cut == long[:2000] + "\n\n[... 420 more characters truncated]"
    odd = "y" * 1999 + "\U0001f600" + "z"
    assert pi_truncated(odd) == "y" * 1999 + "\ud83d" + "\n\n[... 2 more characters truncated]"
    conv = [*CONVERSATION[:3], dict(CONVERSATION[3], content=long), *CONVERSATION[4:]]
    assert _matches(request(conv), turn(conv)) is None
    other = [*CONVERSATION[:3], dict(CONVERSATION[3], content="y" + long[1:]), *CONVERSATION[4:]]
    assert _matches(request(other), turn(conv)) == "history differs"


def test_a_later_compaction_starts_after_the_previous_summary():
    """After a compaction pi's conversation opens with the summary (a user message, the summary in
    ``<summary>`` tags at its end); its next compaction leaves that message out of the history and
    re-states the summary in a previous-summary block before its instructions. That is the
    conversation's history after its first message; another summary, or none, is not."""
    summary = "## Goal\nReview a.py."
    wrapped = {"role": "user", "content": [{"type": "text", "text": f"Earlier:\n\n<summary>\n{summary}\n</summary>"}]}
    conv = [CONVERSATION[0], wrapped, *CONVERSATION[1:]]
    t = turn(conv)
    assert _matches(request(CONVERSATION, previous=summary), t) is None
    assert _matches(request(CONVERSATION[:4], previous=summary), t) is None
    assert _matches(request(CONVERSATION[:3], previous=summary), t) == \
        "no session key, and less than half the conversation sent"
    assert parse(request(CONVERSATION, previous=summary)).after.startswith("<previous-summary>\n")
    assert _matches(request(CONVERSATION, previous="## Goal\nSomething else."), t) == "history differs"
    assert _matches(request(CONVERSATION), t) == "history differs"
    # a previous summary the conversation does not open with: compared from its first message
    assert _matches(request(CONVERSATION, previous=summary)) is None
    # (pi never serialises the summary message itself: a history that holds it again is not pi's)
    assert _matches(request(conv, previous=summary), t) == "history differs"


@pytest.mark.parametrize("what, owner, why", [
    ("another key", owner_of({"authorization": "Bearer sk-b"}), "other credentials"),
    ("a session key", owner_of({"x-session-affinity": "s", "authorization": "Bearer sk-local"}),
     "a session key on one side only"),
])
def test_only_the_requesters_own_conversation_is_continued(what, owner, why):
    assert _matches(request(CONVERSATION), owner=owner) == why, what


def test_a_requester_without_a_session_key_must_have_read_the_conversation():
    """A second client without a session key (pi sends none; the same credentials, or none, on a
    local server) sends a compaction whose history is the conversation's first question only,
    which anybody can guess: before, it was served the whole conversation (the system prompt, every
    later turn: a password in the second one), summarised for it. Now it goes as sent, as does one
    with the first answer but less than half the entries; half of them, an answer among them, is
    pi's own cut (``keepRecentTokens`` of the newest left out)."""
    secret = [*CONVERSATION[:5], {"role": "user", "content": [{"type": "text", "text": "The password is pluto."}]},
              {"role": "assistant", "content": "Noted."}, {"role": "user", "content": [{"type": "text", "text": "Deploy."}]}]
    t = turn(secret)
    assert _matches(request(secret[:2]), t) == "no session key, and none of the model's entries sent"
    assert _matches(request(secret[:3]), t) == "no session key, and less than half the conversation sent"
    assert _matches(request(secret[:5]), t) is None
    assert _matches(request(secret), t) is None


def test_the_continuation_is_the_recorded_conversation_then_the_instruction():
    comp = parse(request(CONVERSATION))
    fields = continuation(turn(), comp)
    assert fields["tools"] == TOOLS and fields["messages"][:-2] == CONVERSATION
    assert fields["messages"][-2:] == [{"role": "assistant", **ANSWER},
                                       {"role": "user", "content": SYSTEM + "\n\n" + AFTER}]


# --- the real client ---------------------------------------------------------------------------

#: pi's settings for the run: compaction once the context passes 24000 - 3000 tokens; keep 8 tokens
#: (estimated as characters / 4), so the cut falls inside the last turn and pi sends both requests
PI_WINDOW, PI_RESERVE, PI_KEEP = 24000, 3000, 8
#: the server: answers that end (the tiny model never ends on its own: the end of turn made likely,
#: and room to reach it: an answer cut by the limit leaves no end of turn in the slot, and its
#: compaction goes as sent), greedy, no reasoning
MAX_OUT = 512
SERVER_ARGS = ["--temp", "0", "--reasoning", "off", "-l", "151645+11", "-n", str(MAX_OUT)]


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _compactions(recs: list[dict]) -> list[dict]:
    return [r for r in recs if not r["body"].get("tools") and getattr(parse(r["body"]), "client", None) == "pi"]


def _pi_session(binary, proxy, tmp_path: Path, name: str):
    """pi in a fresh home and project against ``proxy`` (``ocache serve --record``): ``pi -p`` then
    ``pi -c -p`` with ~6,000-character prompts (ocache's own source files) until pi has compacted
    (at most 24 runs; the records read after each run), then one more turn. Returns the runs and
    the proxy's records once every request of the runs is recorded."""
    from ocache.toolchain import clients
    from test_e2e_clients import _wait_recorded

    home, project = tmp_path / f"home-{name}", tmp_path / f"proj-{name}"
    project.mkdir()
    env = clients.isolated_env(home)
    clients.write_pi_models(home, proxy.url + "/v1", output_tokens=MAX_OUT, context_tokens=PI_WINDOW)
    (home / ".pi" / "agent" / "settings.json").write_text(json.dumps(
        {"compaction": {"reserveTokens": PI_RESERVE, "keepRecentTokens": PI_KEEP}}))
    sources = sorted((Path(__file__).resolve().parent.parent / "ocache").glob("*.py"))
    prompts = [f"Review this code:\n\n{p.read_text()[:6000]}" for p in sources if p.stat().st_size > 6000][:24]
    runs: list = []
    proxy_records: list[dict] = []
    for i, prompt in enumerate(prompts):
        argv = [str(binary), "--model", "local/qwen", *(["-c"] if i else []), "-p", prompt]
        runs.append(clients._run(argv, project, env, 300))
        assert runs[-1].returncode == 0, runs[-1].describe(5)
        proxy_records = _wait_recorded(proxy, lambda rs: len(rs) >= len(runs))
        if len(_compactions(proxy_records)) >= 2:
            break
    argv = [str(binary), "--model", "local/qwen", "-c", "-p", "Now list what we reviewed."]
    runs.append(clients._run(argv, project, env, 300))
    n = len(proxy_records) + 1
    return runs, _wait_recorded(proxy, lambda rs: len(rs) >= n)


@pytest.mark.server
@pytest.mark.slow
def test_the_real_pi_compaction_is_served_as_the_conversations_continuation(start_server, tmp_path):
    """The same pi session twice, through ``ocache serve --no-cache`` (llama-server alone, every
    request forwarded untouched, recorded with the server's timings) and through ocache, each on
    its own llama-server (tiny hybrid, ``-np 2``): once the conversation passes 21,000 tokens pi
    compacts it with two requests in parallel (a split turn). Alone the history request prefills
    all of it. Through ocache it is served from the conversation's slot (``X-OCache-Continued``):
    the server prefills the instruction turn only (<= 1,000 tokens); the turn's prefix goes as
    sent, on the other slot; and pi's next turn prefills no more than alone."""
    from ocache.toolchain import clients
    from test_e2e_clients import _install, side

    binary = _install(clients.PI)
    got = {}
    for name in ("alone", "ocache"):
        with side(start_server, tmp_path, name, SERVER_ARGS) as proxy:
            runs, recs = _pi_session(binary, proxy, tmp_path, name)
            stats = proxy.stats()["layer"]
        got[name] = runs, recs, stats
    figures, bodies = {}, {}
    for name, (runs, recs, stats) in got.items():
        comps = _compactions(recs)
        report = "\n".join(r.describe(3) for r in runs[-2:]) + "\n" + json.dumps(stats.get("continued"))
        # pi splits the turn in two parallel requests when its cut lands inside the last turn, which
        # the model's answers decide (one loaded run did not): the prefix request is checked when sent
        assert len(comps) in (1, 2), (name, report)
        history, prefix = (sorted(comps, key=lambda r: -r["body"]["max_completion_tokens"]) + [None])[:2]
        after = recs.index(max(comps, key=lambda r: recs.index(r))) + 1
        nxt = next(r for r in recs[after:] if r["body"].get("tools"))
        before = [r for r in recs[:recs.index(min(comps, key=lambda r: recs.index(r)))] if r["body"].get("tools")][-1]
        bodies[name] = {"next": nxt["body"]["messages"]}
        figures[name] = {k: {"prompt_n": r["obs"]["timings"]["prompt_n"], "cache_n": r["obs"]["timings"]["cache_n"],
                             "headers": {h: v for h, v in (r.get("plan") or {}).get("headers", {}).items()
                                         if h in ("X-OCache-Path", "X-OCache-Continued", "X-OCache-Slot")}}
                         for k, r in (("turn", before), ("history", history), ("prefix", prefix), ("next", nxt))
                         if r is not None}
        # the shape stored: the fields, the summariser's prompt, each request's instructions
        for r, stored in ((history, DATA["compaction"][0]), (prefix, DATA["compaction"][1])):
            if r is None:
                continue
            body = r["body"]
            text = body["messages"][1]["content"][0]["text"]
            assert sorted(body) == stored["fields"], (name, sorted(body))
            assert _digest(body["messages"][0]["content"]) == stored["messages"][0]["sha256"]
            assert _digest(text[text.index(PI_CLOSE) + len(PI_CLOSE):]) == \
                stored["messages"][1]["content"][0]["after"]["sha256"]
        if prefix is not None:
            assert [k for k, _ in pi_entries(parse(prefix["body"]).history)] == ["user"]
    print("\n" + json.dumps(figures, indent=1))
    alone, oc = figures["alone"], figures["ocache"]
    # the conversation is long: more than 20,000 tokens held before the compaction
    assert oc["turn"]["prompt_n"] + oc["turn"]["cache_n"] > 20000, figures
    # alone the history request prefills all of it
    assert alone["history"]["prompt_n"] > 15000, figures
    # through ocache: continued from the conversation's slot, the instruction turn prefilled
    h = oc["history"]
    assert h["headers"].get("X-OCache-Path") == "continued", (figures, got["ocache"][2].get("continued"))
    assert h["prompt_n"] <= 1000 and h["cache_n"] > 20000, figures
    # the turn's prefix as sent, kept off the conversation's slot
    if "prefix" in oc:
        p = oc["prefix"]
        assert p["headers"].get("X-OCache-Path") != "continued"
        assert p["headers"].get("X-OCache-Slot") != h["headers"].get("X-OCache-Slot"), figures
    # the next turn prefills no more than alone. Its prompt holds the summary the model wrote, and
    # the two runs' summaries differ (the hybrid model's numerics follow where a prefill resumed:
    # one loaded run wrote 2,985 tokens more through ocache), so what ocache's next turn prefilled
    # beyond its longer prompt is compared. Its reuse is compared directly only when both runs sent
    # the same next turn: with other summaries the prompts part after the system and tools (one
    # loaded run: 1,581 tokens through ocache, 1,341 reused; 4,677 alone, 1,385 reused, as pi kept
    # the last turn whole there and cut it through ocache), and what each reuses past that point
    # is its own text's
    n_oc = oc["next"]["prompt_n"] + oc["next"]["cache_n"]
    n_alone = alone["next"]["prompt_n"] + alone["next"]["cache_n"]
    assert oc["next"]["prompt_n"] - max(0, n_oc - n_alone) <= alone["next"]["prompt_n"], figures
    if bodies["alone"]["next"] == bodies["ocache"]["next"]:
        assert oc["next"]["cache_n"] >= alone["next"]["cache_n"], figures
    assert got["ocache"][2]["continued"]["requests"] == 1, got["ocache"][2]["continued"]


@pytest.mark.server
@pytest.mark.slow
def test_the_real_pis_later_compaction_is_continued_too(start_server, tmp_path):
    """pi with a small window (``contextWindow`` 8000, ``reserveTokens`` 2000, ``keepRecentTokens``
    600: no split turn) compacts at least twice in eight turns through ocache. The second compaction's
    history starts after the first one's summary, which its instructions re-state: both are served
    from the conversation's slot, each prefilling its instruction turn only. Measured: three
    compactions, 270, 380 and 402 tokens prefilled (as sent: 3,482, 4,891 and 3,593)."""
    from ocache.toolchain import clients
    from test_e2e_clients import OcacheProcess, _install, _wait_recorded

    binary = _install(clients.PI)
    srv = start_server("hybrid", n_parallel=2, ctx_size=65536, args=SERVER_ARGS)
    proxy = OcacheProcess(srv.url, tmp_path, server_args=srv.command()[1:])
    try:
        proxy.wait_ready()
        home, project = tmp_path / "home", tmp_path / "proj"
        project.mkdir()
        env = clients.isolated_env(home)
        clients.write_pi_models(home, proxy.url + "/v1", output_tokens=MAX_OUT, context_tokens=8000)
        (home / ".pi" / "agent" / "settings.json").write_text(json.dumps(
            {"compaction": {"reserveTokens": 2000, "keepRecentTokens": 600}}))
        sources = sorted((Path(__file__).resolve().parent.parent / "ocache").glob("*.py"))
        prompts = [f"Review this code:\n\n{p.read_text()[:6000]}" for p in sources if p.stat().st_size > 6000][:8]
        runs = []
        for i, prompt in enumerate(prompts):
            argv = [str(binary), "--model", "local/qwen", *(["-c"] if i else []), "-p", prompt]
            runs.append(clients._run(argv, project, env, 300))
            assert runs[-1].returncode == 0, runs[-1].describe(5)
        recs = _wait_recorded(proxy, lambda rs: len(rs) >= len(runs) + 2)
        stats = proxy.stats()["layer"]["continued"]
    finally:
        proxy.stop()
    comps = _compactions(recs)
    figures = [(r["plan"]["headers"].get("X-OCache-Continued"), r["obs"]["timings"]["prompt_n"],
                pi_previous_summary(parse(r["body"]).after) is not None) for r in comps]
    assert len(comps) >= 2 and figures[1][2], (figures, stats)
    for r in comps:
        t = r["obs"]["timings"]
        assert r["plan"]["headers"].get("X-OCache-Path") == "continued", (figures, stats)
        assert t["prompt_n"] <= 1000 and t["cache_n"] > 4000, (figures, stats)
