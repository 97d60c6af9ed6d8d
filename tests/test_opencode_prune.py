"""opencode's prune (old tool outputs replaced by "[Old tool result content cleared]") on the real
Qwen3.5 template, tiny hybrid, the server's own generations, alone and through ocache.

The sequence is ``scripts/measure-compaction --prune`` (``prune_sequence``): user turns of tool turns
and an answer, opencode 1.18.33's prune rule applied after each answer (``opencode_prune``), then the
pruned request and the turns after it. Not the real client: opencode prunes only past 60k estimated
tokens of tool output (``PRUNE_PROTECT`` 40,000 + ``PRUNE_MINIMUM`` 20,000, constants), far beyond
what the tiny models play in a test's time, so the thresholds are scaled down here (the request's
shape is the same: the oldest outputs cleared, the last two user turns kept)."""

from __future__ import annotations

import importlib.util
from importlib.machinery import SourceFileLoader
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "measure-compaction"


def _load_script():
    loader = SourceFileLoader("measure_compaction", str(SCRIPT))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


MC = _load_script()

#: 4 user turns of 2 tool turns: before the 4th, the 1st turn's two outputs (1,300 estimated tokens
#: each) are past a protection of 1,000 and add up to more than 2,000, so both are cleared
USERS, TURNS, CHARS, PROTECT, MINIMUM = 4, 2, 5200, 1000, 2000


def _msgs(outputs: list[list[str]]) -> list[dict]:
    """A history of user turns, each with tool outputs of the given texts, and a closing answer."""
    msgs: list[dict] = [{"role": "system", "content": "s"}]
    for u, outs in enumerate(outputs):
        msgs.append({"role": "user", "content": f"u{u}"})
        for i, out in enumerate(outs):
            msgs += [{"role": "assistant", "content": f"call {u}.{i}"},
                     {"role": "tool", "tool_call_id": f"c{u}{i}", "content": out}]
        msgs.append({"role": "assistant", "content": "done"})
    return msgs


def test_prune_rule_keeps_the_last_two_user_turns_and_the_newest_outputs():
    """opencode's rule, read from its source: the last two user turns are never touched, the newest
    ``protect`` estimated tokens of the rest are kept, the older ones cleared only when they add up
    to more than ``minimum``; a walk stops at an output already cleared."""
    big = "x" * 4000                                    # 1,000 estimated tokens
    msgs = _msgs([[big, big], [big], [big, big], [big]])
    out = MC.opencode_prune(msgs, protect=1500, minimum=1000)
    cleared = [i for i, m in enumerate(out) if m["role"] == "tool" and m["content"] == MC.CLEARED]
    tools = [i for i, m in enumerate(msgs) if m["role"] == "tool"]
    # turns 3 and 4 (the last two) kept; of turns 1-2 (3,000) the newest 1,000 within 1,500 kept,
    # the next pushes past 1,500: it and the one before it (2,000 > 1,000) cleared
    assert cleared == tools[:2]
    assert MC.opencode_prune(msgs, protect=1500, minimum=2000) == msgs       # 2,000 is not more
    assert MC.opencode_prune(_msgs([[big], [big]]), protect=0, minimum=0) == _msgs([[big], [big]])
    again = out + [{"role": "user", "content": "u4"}, {"role": "assistant", "content": "call"},
                   {"role": "tool", "tool_call_id": "n", "content": big}, {"role": "assistant", "content": "x"}]
    # the walk stops at the first cleared output it meets (turn 2's output is the newest unpruned one)
    assert MC.opencode_prune(again, protect=0, minimum=0)[tools[2]]["content"] == MC.CLEARED
    assert MC.estimate("abcdef") == 2 and MC.estimate("abcdefghij") == 3   # Math.round(2.5) is 3


@pytest.mark.server
def test_pruned_sequence_prefills_no_more_than_alone_and_answers_as_a_cold_prefill(tmp_path):
    """Alone and through ocache, each on its own fresh llama-server (``-np 2``, the README's flags,
    ``Qwen3.5-4B.jinja``): over the whole sequence ocache's server prefills no more than alone's
    (the server's ``llamacpp:prompt_tokens_total`` deltas), the pruned request included; the pruned
    request's answer through ocache equals a cold prefill of its own body (what alone answers to
    that prompt: it is served as sent, the cleared text shown to the model)."""
    template = MC.LOOP.TEMPLATES["hybrid"]
    runs = {path: MC.run_prune("hybrid", template, tmp_path, path, USERS, TURNS, CHARS, PROTECT, MINIMUM,
                               32768, cold=path == "ocache")
            for path in ("alone", "ocache")}
    for path, rows in runs.items():
        pruned = [r for r in rows if r["pruned"]]
        assert [r["label"] for r in pruned] == [f"u{USERS} t1"], (path, [r["label"] for r in rows])
        assert pruned[0]["cleared"] == TURNS
    total = {path: sum(r["prefill"] for r in rows) for path, rows in runs.items()}
    per = [(a["label"], a["prefill"], o["prefill"]) for a, o in zip(runs["alone"], runs["ocache"])]
    print(f"\nprefill per request (alone, ocache): {per}\ntotal alone {total['alone']}, ocache {total['ocache']}")
    assert total["ocache"] <= total["alone"], per
    pruned = next(r for r in runs["ocache"] if r["pruned"])
    assert "X-OCache-Aligned" not in pruned["headers"] and "X-OCache-Continued" not in pruned["headers"]
    assert pruned["content"] == pruned["cold_content"]
