"""Exact mode (``tiers.resident.align: exact``) on Qwen3.5's own template (tiny hybrid): every prompt
is the template's rendering, and after a turn that ended without a tool call ocache prefills the
next prompt's prefix while the server is idle, so the new user message prefills only its own
tokens. Checked from the saved slot: the prompt served is the rendering, token for token."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from ocache.bench.run import OCacheProcess
from test_align_exact import _saved, _tokens
from test_real_templates import serve_template  # noqa: F401
from test_substitutions import ANSWER, _chat, _loop

pytestmark = pytest.mark.server


def _align_stats(prox: OCacheProcess) -> dict:
    with urllib.request.urlopen(prox.url + "/v1/cache/stats", timeout=30) as r:
        return json.loads(r.read())["layer"]["align"]


def _metric(url: str) -> int:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return int(float(next(ln.split()[-1] for ln in text.splitlines()
                          if ln.startswith("llamacpp:prompt_tokens_total"))))


def test_the_next_user_message_prefills_only_its_own_tokens_on_the_templates_prompt(
        serve_template, tmp_path, monkeypatch):
    monkeypatch.setenv("OCACHE_TIERS", "{resident: {align: exact}}")
    srv = serve_template("hybrid", n_parallel=2, ctx_size=16384, flash_attn="on")
    prox = OCacheProcess(srv.url, tmp_path / "cache", tmp_path / "ocache.log").start()
    try:
        turns = _loop(prox.url, "ses_alice", n=2)     # a tool turn, its result, the answer (ended)
        assert all("X-OCache-Aligned" not in h for _, _, h in turns)
        # the user reads the answer: the idle warm-up runs (its count is the user's think time, bounded)
        for _ in range(300):
            st = _align_stats(prox)
            if st.get("exact_warms") or st.get("exact_skipped_busy") or st.get("exact_failed"):
                break
            time.sleep(0.1)     # polling the counter it waits for, at most 30 s
        assert st.get("exact_warms") == 1 and st.get("exact_warm_tokens", 0) > 0, st
        body, res, _ = turns[-1]
        nxt = dict(body, grammar=ANSWER, messages=body["messages"] + [
            {"role": "assistant", "content": res["choices"][0]["message"]["content"]},
            {"role": "user", "content": "And the second file?"}])
        rendered = _tokens(srv.url, nxt)
        before = _metric(srv.url)
        status, res2, h2 = _chat(prox.url, nxt, {"x-session-affinity": "ses_alice"})
        prefilled = _metric(srv.url) - before
        assert status == 200 and "X-OCache-Aligned" not in h2
        t = res2["timings"]
        assert t["cache_n"] + t["prompt_n"] == len(rendered)
        assert prefilled == t["prompt_n"] <= 64, t          # the user turn alone, not the history
        held = _saved(srv, tmp_path, int(h2["X-OCache-Slot"]), "exact.bin")
        assert held[:len(rendered)] == rendered              # the template's prompt, token for token
    finally:
        prox.stop()
