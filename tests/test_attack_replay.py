"""A second engineer's attacks on what a substitution leaves behind, each turned into a test that
failed before its fix: the response cache replaying an aligned answer (computed on the owner's
slot tokens) to another session; a body asking for several completions on an aligned turn (the
splice serves one: the patched server's 400 reached the client); an error answer telling a client
the server refused what ocache's plan had found (the slot, the tier, the tokens a held
conversation shares with the body). Real llama-server, the models' own templates (tiny hybrid on
Qwen3.5's, tiny dense on Qwen3's), ``ocache serve`` in a child process."""

from __future__ import annotations

import pytest

from ocache.bench.run import OCacheProcess
from test_real_templates import serve_template  # noqa: F401  (the fixture)
from test_substitutions import _chat, _loop

pytestmark = pytest.mark.server

K1, K2 = "key-one", "key-two"


def _next(body: dict, res: dict, user: str = "And the second file?") -> dict:
    """The conversation's next request: the answer as the client keeps it, one more user message."""
    return dict(body, messages=body["messages"] + [
        {"role": "assistant", "content": res["choices"][0]["message"]["content"]},
        {"role": "user", "content": user}])


def _content(res: dict) -> str:
    return res["choices"][0]["message"]["content"]


@pytest.mark.parametrize("model", ["hybrid", "dense"])
def test_the_response_cache_replays_no_answer_computed_on_a_substituted_prompt(serve_template, tmp_path, model):
    """Response cache on. Alice's third turn is served aligned (her slot's own reasoning kept in
    place of the template's rendering). Bob (another session key), then a client without one (the
    same, empty, credentials) send that exact body: each is answered from its own rendering (the
    text of a cold greedy run of it), never replayed Alice's (before: both were, byte for byte).
    The cache itself works: Alice's first turn, sent as is, is replayed to Bob (the control)."""
    srv = serve_template(model, n_parallel=2, ctx_size=16384, flash_attn="on")
    prox = OCacheProcess(srv.url, tmp_path / "cache", tmp_path / "ocache.log", slot_save_path=tmp_path / "slots",
                         env={"OCACHE_RESPONSE_CACHE": '{"enabled": true}'}).start()
    try:
        turns = _loop(prox.url, "ses_alice", opens=(model == "dense"))
        body, res_a, h_a = turns[-1]
        assert "X-OCache-Aligned" in h_a, h_a           # the substituted answer
        seen = {}
        for who in ("ses_bob", None):
            status, res_b, h_b = _chat(prox.url, body, {"x-session-affinity": who} if who else {})
            assert status == 200, res_b
            seen[who] = (h_b.get("X-OCache-Tier"), h_b.get("X-OCache-Aligned"), _content(res_b))
        # Bob's own answer: a cold greedy run of his rendering on the server itself (after his
        # requests: it takes a slot of the server's choosing)
        cold = _content(_chat(srv.url, dict(body, cache_prompt=False))[1])
        # the control: an answer to the client's own rendering is replayed to another session
        status, first_b, h_first = _chat(prox.url, turns[0][0], {"x-session-affinity": "ses_bob"})
        assert status == 200 and h_first.get("X-OCache-Tier") == "response", h_first
        assert _content(first_b) == _content(turns[0][1])
    finally:
        prox.stop()
    # each is answered from its own rendering (served, or replayed once the first of them stored
    # its answer): the text of a cold run, not Alice's (hers came from her slot's tokens)
    for who, (tier, aligned, text) in seen.items():
        assert aligned is None and text == cold, (who, seen, cold[:80], _content(res_a)[:80])


def test_several_completions_on_an_aligned_turn_go_as_sent(serve_template, tmp_path):
    """Alice's own next turn would be aligned; she asks for two completions (``n``, then its
    spelling ``n_cmpl``). The splice serves one, so the request goes as sent and gets what the
    server alone answers (two choices), not the patched server's 400 (before: 400 "ocache_splice
    serves one completion")."""
    srv = serve_template("hybrid", n_parallel=2, ctx_size=16384, flash_attn="on")
    prox = OCacheProcess(srv.url, tmp_path / "cache", tmp_path / "ocache.log",
                         slot_save_path=tmp_path / "slots").start()
    try:
        turns = _loop(prox.url, "ses_alice")
        assert "X-OCache-Aligned" in turns[-1][2], turns[-1][2]
        nxt = _next(*turns[-1][:2])
        got = {}
        for extra in ({"n": 2}, {"n_cmpl": 2}):
            status, res, h = _chat(prox.url, dict(nxt, **extra), {"x-session-affinity": "ses_alice"})
            got[str(extra)] = (status, len(res.get("choices") or []), h.get("X-OCache-Aligned"), res.get("error"))
    finally:
        prox.stop()
    assert all(v[:3] == (200, 2, None) for v in got.values()), got


def test_an_error_answer_tells_a_refused_client_nothing_the_plan_found(serve_template, tmp_path):
    """``--api-key`` on the server, ocache holding its key. After Alice's two turns, a client with
    a wrong key sends her next turn, then the same with its first question changed: both get the
    server's 401, and among ocache's headers only the request id: not the slot, the tier, nor the
    tokens a held conversation shares with the body (``X-OCache-Predicted-Cache`` told them apart).
    Nor is anything planned for them (``ocache/credentials.py``): the server's refusal is known
    before a slot is leased."""
    srv = serve_template("hybrid", n_parallel=2, ctx_size=16384, flash_attn="on", api_key=f"{K1},{K2}",
                         slot_save_path=tmp_path / "slots")
    prox = OCacheProcess(srv.url, tmp_path / "cache", tmp_path / "ocache.log", slot_save_path=tmp_path / "slots",
                         env={"OCACHE_UPSTREAM_API_KEY": K1}).start()
    alice = {"Authorization": f"Bearer {K1}"}
    try:
        turns = []
        body = {"messages": [{"role": "system", "content": "You are a coding agent."},
                             {"role": "user", "content": "Read a file, then say what it does."}],
                "temperature": 0, "max_tokens": 16}
        for _ in range(2):
            status, res, h = _chat(prox.url, body, alice)
            assert status == 200, res
            turns.append((body, res, h))
            body = _next(body, res)
        seen = body
        unseen = dict(seen, messages=[dict(m) for m in seen["messages"]])
        unseen["messages"][1] = {"role": "user", "content": "A different first question."}
        probes = {}
        for name, b in (("seen", seen), ("unseen", unseen)):
            status, res, h = _chat(prox.url, b, {"Authorization": "Bearer wrong"})
            probes[name] = (status, sorted(k for k in h if k.lower().startswith("x-ocache-")))
        status, _res, h = _chat(prox.url, seen, alice)     # the control: Alice's own is planned
        assert status == 200 and "X-OCache-Slot" in h, h
        # the server's other key (not the one ocache holds) is accepted, so it is planned
        status, _res, h = _chat(prox.url, unseen, {"X-Api-Key": K2})
        assert status == 200 and "X-OCache-Slot" in h, h
        stats = prox.stats()
    finally:
        prox.stop()
    assert probes["seen"] == probes["unseen"] == (401, ["X-OCache-Request-Id"]), probes
    # and nothing was planned for the refused ones (no slot leased, nothing restored or spilled)
    assert stats["unplannable"].get("credentials") == 2, stats["unplannable"]
