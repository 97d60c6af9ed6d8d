"""Unit tests of the pure parts: the model of llama-server's reuse rules (``ocache.slots``), the
resident ranking (``ocache.tiers.resident``), the planner (``ocache.cache.plan.plan_request``), the
error mapping, the ``/slots`` reconciliation and ``ocache doctor``'s checks. No server needed; the
integration tests in ``tests/test_resident.py`` check the same model against the real server.
"""

from __future__ import annotations

import random
import struct
from pathlib import Path

import pytest

from ocache.cache import plan_request
from ocache.llama.checks import check
from ocache.llama.reuse import Checkpoint, common_prefix, predict_reuse, simulate_prefill
from ocache.llama.flags import ServerParams, params_from_argv, given_flags
from ocache.slots import (SlotFileError, SlotInvalid, SlotNotSupported, SlotState, SlotTable, UpstreamError, check_filename,
                          error_from_response)
from ocache.llama.gguf import gguf_architecture
from ocache.tiers.base import Offer
from ocache.tiers.resident import RequestContext, rank_slots

DENSE = ServerParams(n_slots=2, n_ctx_slot=65536, n_batch=2048, n_ubatch=512, checkpoints=False)
HYBRID = ServerParams(n_slots=2, n_ctx_slot=65536, n_batch=2048, n_ubatch=512, ctx_checkpoints=32,
                      checkpoint_min_step=8192, checkpoints=True, cache_ram=0)


def toks(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


# --- common_prefix ---------------------------------------------------------------------------

@pytest.mark.parametrize("n,cut", [(0, 0), (1, 0), (255, 100), (256, 256), (1000, 513), (3000, 2999)])
def test_common_prefix_matches_naive(n, cut):
    a = toks(n)
    b = a[:cut] + [x + 1 for x in a[cut:]]
    naive = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    assert common_prefix(a, b) == naive == cut
    assert common_prefix(a, a[:cut]) == cut


# --- checkpoint placement (docs/llama-server.md §14) -------------------------------------------

def test_cold_prefill_checkpoints_land_before_the_end():
    # docs/llama-server.md §14: a cold 10,000-token prompt, -b 2048 -ub 512, no user-turn marks:
    # checkpoints after 9,484 and 9,996 tokens
    cps = simulate_prefill([], 0, 10000, (), HYBRID, task=1)
    assert [c.n_tokens for c in cps] == [9484, 9996]


def test_short_extension_checkpoints_old_end_and_n_minus_4():
    cps = simulate_prefill([Checkpoint(9484, 1), Checkpoint(9996, 1)], 10000, 10100, (), HYBRID, task=2)
    # the new region starts near the end: its first batch is checkpointed, then N-4
    assert [c.n_tokens for c in cps] == [9484, 9996, 10000, 10096]


def test_user_starts_break_batches_and_get_checkpoints():
    p = ServerParams(n_batch=256, n_ubatch=128, ctx_checkpoints=32, checkpoint_min_step=256, checkpoints=True)
    cps = simulate_prefill([], 0, 3000, (700, 2000, 2600), p, task=1)
    got = [c.n_tokens for c in cps]
    assert 2000 in got and 2600 in got        # user starts (min-step apart, the last one always)
    assert 700 in got                          # first checkpoint of an empty list
    assert got[-2:] == [3000 - 4 - 128, 2996]  # N-4-ubatch, N-4
    assert got == sorted(got)


def _reference_simulate(cps, n_past, N, user_starts, params, task):
    """The server's batching loop token by token (server-context.cpp:3504-3616), as a reference."""
    from ocache.llama.reuse import _create_checkpoint

    cps, starts = list(cps), set(user_starts)
    last_user = max(starts) if starts else -1
    offsets = [min(params.n_batch, 4 + params.n_ubatch), min(params.n_batch, 4)]
    cur = n_past
    while cur < N:
        start, count = cur, 0
        while cur < N and count < params.n_batch:
            cur += 1
            count += 1
            if cur in starts and (cur == last_user or not cps or cur > cps[-1].n_tokens + params.checkpoint_min_step):
                break
            if any(N == cur + off for off in offsets):
                break
        near_end = N < cur + params.n_ubatch
        do = not (cur != N and start not in starts and not near_end) and start > 0
        do = do and (not cps or start == last_user or near_end or start > cps[-1].n_tokens + params.checkpoint_min_step)
        if do:
            cps = _create_checkpoint(cps, start, task, params)
    return cps


def test_simulation_matches_the_token_by_token_loop():
    rng = random.Random(5)
    for _ in range(300):
        p = ServerParams(n_batch=rng.choice([64, 128, 512, 2048]), n_ubatch=rng.choice([32, 64, 128, 512]),
                         ctx_checkpoints=rng.choice([2, 4, 32]), checkpoint_min_step=rng.choice([0, 100, 256, 8192]),
                         checkpoints=True)
        p = ServerParams(**{**p.__dict__, "n_ubatch": min(p.n_ubatch, p.n_batch)})
        N = rng.randrange(1, 6000)
        n_past = rng.randrange(0, N)
        starts = sorted(rng.sample(range(1, N + 1), k=min(N, rng.randrange(0, 12))))
        prior = [Checkpoint(n, 0) for n in sorted(rng.sample(range(1, n_past + 2), k=min(n_past + 1, rng.randrange(0, 4))))]
        assert simulate_prefill(prior, n_past, N, starts, p, 1) == _reference_simulate(prior, n_past, N, starts, p, 1)


def test_checkpoint_list_is_capped():
    p = ServerParams(n_batch=64, n_ubatch=32, ctx_checkpoints=3, checkpoint_min_step=0, checkpoints=True)
    cps = simulate_prefill([], 0, 2000, tuple(range(100, 2000, 100)), p, task=1)
    assert len(cps) == 3
    assert cps[-1].n_tokens == 1996


# --- reuse prediction (docs/llama-server.md §11, §15) ------------------------------------------

def test_dense_rules():
    a = toks(1000)
    assert predict_reuse(a, 1000, [], a, DENSE).cache_n == 999          # identical: N-1
    assert predict_reuse(a, 1000, [], a + toks(50, 1), DENSE).cache_n == 1000
    b = a[:600] + toks(100, 2)
    r = predict_reuse(a, 1000, [], b, DENSE)
    assert (r.cache_n, r.lcp) == (600, 600)
    assert predict_reuse([], 0, [], a, DENSE).cache_n == 0


def test_hybrid_strict_extension_needs_no_checkpoint():
    head = toks(3000)
    r = predict_reuse(head, 3000, [], head + toks(500, 1), HYBRID)   # a warmed or restored head
    assert (r.cache_n, r.reason) == (3000, "extends")


def test_hybrid_divergence_resumes_from_newest_checkpoint_at_or_below():
    a = toks(5000)
    cps = [Checkpoint(1000), Checkpoint(4484), Checkpoint(4996)]
    b = a[:4700] + toks(300, 3)
    r = predict_reuse(a, 5000, cps, b, HYBRID)
    assert (r.cache_n, r.checkpoint, r.reason) == (4484, 4484, "checkpoint")
    assert all(c.n_tokens <= 4485 for c in r.checkpoints_after[:2])
    # no checkpoint below the divergence: full re-prefill
    r = predict_reuse(a, 5000, [], b, HYBRID)
    assert (r.cache_n, r.reason) == (0, "no-checkpoint")


def test_hybrid_identical_prompt_uses_a_checkpoint_below_n():
    a = toks(5000)
    r = predict_reuse(a, 5000, [Checkpoint(4484), Checkpoint(4996)], a, HYBRID)
    assert r.cache_n == 4996
    assert predict_reuse(a, 5000, [], a, HYBRID).cache_n == 0           # a restored slot, stock


def test_generated_tail_is_unknown_but_bounded():
    prompt = toks(2000)
    nxt = prompt + toks(300, 4)        # next turn: the reply re-rendered, then a new user turn
    # slot holds prompt + 40 generated tokens: the next prompt diverges inside the slot
    r = predict_reuse(prompt, 2040, [Checkpoint(1484), Checkpoint(1996)], nxt, HYBRID)
    assert r.cache_n == 1996 and r.upper == 2040
    r = predict_reuse(prompt, 2040, [], nxt, DENSE)
    assert r.cache_n == 2000 and r.upper == 2040


def test_ram_cache_swap_widens_the_band():
    a = toks(1000)
    r = predict_reuse(a, 1000, [], toks(800, 9), DENSE, ram_swap=True)
    assert r.cache_n == 0 and r.upper == 799


# --- argv / GGUF ---------------------------------------------------------------------------------

def test_parse_server_argv():
    f = given_flags(["-np", "2", "--ctx-checkpoints=8", "-ub", "128", "--metrics", "-kvu",
                           "--slot-save-path", "/x", "--unknown", "v"])
    assert f == {"n_parallel": 2, "ctx_checkpoints": 8, "n_ubatch": 128, "metrics": True,
                 "kv_unified": True, "slot_save_path": "/x"}
    with pytest.raises(ValueError):
        given_flags(["-ub"])
    with pytest.raises(ValueError):
        given_flags(["-ub", "many"])
    p = params_from_argv(["-m", "/nonexistent.gguf"], {"total_slots": 4}, None)
    assert p.n_parallel_explicit is False and p.kv_unified is True and p.metrics is False


def _gguf(path, kvs):
    def s(b):
        return struct.pack("<Q", len(b)) + b
    out = b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs))
    for key, typ, payload in kvs:
        out += s(key.encode()) + struct.pack("<I", typ) + payload
    path.write_bytes(out)


def test_gguf_architecture(tmp_path):
    p = tmp_path / "m.gguf"
    arr = struct.pack("<IQ", 8, 2) + struct.pack("<Q", 1) + b"a" + struct.pack("<Q", 2) + b"bc"
    _gguf(p, [("general.name", 8, struct.pack("<Q", 3) + b"abc"), ("x.arr", 9, arr),
              ("x.u32", 4, struct.pack("<I", 7)), ("general.architecture", 8, struct.pack("<Q", 6) + b"qwen35")])
    assert gguf_architecture(p) == "qwen35"
    assert params_from_argv(["-np", "2", "-m", str(p)]).checkpoints is True
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"nope" * 10)
    with pytest.raises(ValueError):
        gguf_architecture(bad)


# --- error mapping -------------------------------------------------------------------------------

def test_errors_map_to_exceptions():
    e = lambda code, msg, t="invalid_request_error": {"error": {"code": code, "message": msg, "type": t}}
    assert isinstance(error_from_response(501, e(501, "This server does not support slots action. Start it with `--slot-save-path`", "not_supported_error"), 0, "save"), SlotNotSupported)
    assert isinstance(error_from_response(400, e(400, "Invalid filename"), 0, "save"), SlotFileError)
    assert isinstance(error_from_response(400, e(400, "Unable to restore slot: No available space in KV cache or invalid slot save file"), 0, "restore"), SlotFileError)
    assert isinstance(error_from_response(400, e(400, "Invalid slot ID"), 0, "erase"), SlotInvalid)
    assert isinstance(error_from_response(500, e(500, "Unable to save slot", "server_error"), 0, "save"), SlotFileError)
    assert isinstance(error_from_response(503, e(503, "Loading model", "unavailable_error"), 0, "save"), UpstreamError)
    with pytest.raises(SlotFileError):
        check_filename("../etc")


# --- reconciliation with GET /slots (docs/llama-server.md §4) ----------------------------------

def test_reconcile():
    t = SlotTable(None, "http://x", DENSE)
    t._ensure(2)
    s = t.slots[0]
    s.tokens, s.n_total = toks(10), 15
    t.reconcile_one(s, {"id": 0, "n_prompt_tokens": 15, "is_processing": False})
    assert len(s.tokens) == 10                      # agrees
    t.reconcile_one(s, {"id": 0, "n_prompt_tokens": 0, "is_processing": False})
    assert s.tokens == [] and s.n_total == 0        # cleared by the server
    s.tokens, s.n_total, s.pending = toks(10), None, True
    t.reconcile_one(s, {"id": 0, "n_prompt_tokens": 31})
    assert s.n_total == 31 and not s.pending         # the generated tail is now counted
    t.reconcile_one(s, {"id": 0, "n_prompt_tokens": 7})
    assert s.foreign and s.tokens == [] and s.n_total == 7
    # a slot that never ran a task reports no n_prompt_tokens: unknown, not 0 ...
    s.clear(); s.tokens, s.n_total = toks(10), 10      # ... which is fine for a slot ocache restored
    t.reconcile_one(s, {"id": 0})
    assert len(s.tokens) == 10
    s.tokens, s.n_total = toks(10), 25
    t.reconcile_one(s, {"id": 0})
    assert s.foreign and s.n_total is None
    s2 = t.slots[1]
    s2.tokens, s2.n_total = toks(5), 5
    t.reconcile_one(s2, {"id": 1, "is_processing": True, "n_prompt_tokens": 5})
    assert s2.foreign                                 # busy without ocache's lock: someone else's


def test_reconcile_an_interrupted_answer():
    """A request ocache sent was cut short (``interrupted``): while the server still cancels it
    (``is_processing``) the belief waits; then the count covers the prompt plus the partial answer;
    a count below the prompt (cut during the prefill) is content ocache cannot name."""
    t = SlotTable(None, "http://x", DENSE)
    t._ensure(1)
    seq = t.assign(0, toks(10))
    assert t.interrupted(0, seq)
    s = t.slots[0]
    assert s.interrupted and s.pending and s.n_total is None
    t.reconcile_one(s, {"id": 0, "is_processing": True, "n_prompt_tokens": 12})
    assert s.pending and not s.foreign and len(s.tokens) == 10 and t.counters["interrupted_busy"] == 1
    t.reconcile_one(s, {"id": 0, "is_processing": False, "n_prompt_tokens": 17})
    assert not s.pending and s.n_total == 17 and s.interrupted and s.seq == seq
    seq = t.assign(0, toks(10))
    assert not t.slots[0].interrupted                  # new content clears the mark
    t.interrupted(0, seq)
    t.reconcile_one(s, {"id": 0, "is_processing": False, "n_prompt_tokens": 6})
    assert s.foreign and not s.interrupted and s.tokens == []


# --- ranking and planning ----------------------------------------------------------------------------

def slot(i, tokens=(), n_total=None, kind=None, owner=None, last=0.0, origin=False, head_key=None,
         head_len=0, checkpoints=()):
    s = SlotState(id=i, tokens=list(tokens), n_total=len(tokens) if n_total is None else n_total,
                  kind=kind, owner=owner, last_used=last, origin=origin, head_key=head_key,
                  head_len=head_len, checkpoints=list(checkpoints))
    return s


HEAD = toks(3000, 100)


def conv(seed, n=800):
    return HEAD + toks(n, seed)


def test_guest_takes_a_side_slot_never_the_agent_conversation():
    a = conv(1)
    slots = [slot(0, a, len(a) + 30, "agent", "A", last=5), slot(1)]
    title = toks(200, 50)
    ranked = rank_slots(title, slots, RequestContext(kind="guest", session="A"), HYBRID)
    assert ranked[0].slot == 1 and not ranked[0].protected
    # even when the agent slot shares a prefix with the guest
    guest = a[:100] + toks(50, 51)
    assert rank_slots(guest, slots, RequestContext(kind="guest", session="A"), DENSE)[0].slot == 1


def test_guest_with_one_slot_is_served_and_flagged():
    a = conv(1)
    dec = plan_request(toks(200, 50), [slot(0, a, None, "agent", "A")], [],
                       RequestContext(kind="guest", session="A"), HYBRID)
    assert dec.slot == 0 and dec.evicts and "guest_on_agent_slot" in dec.warnings
    assert dec.steps == ("before_evict",)


def test_continuation_wins_and_other_sessions_are_protected():
    a, b = conv(1), conv(2)
    slots = [slot(0, a, len(a) + 20, "agent", "A", last=1), slot(1, b, len(b) + 20, "agent", "B", last=2)]
    nxt_a = a + toks(100, 7)
    assert rank_slots(nxt_a, slots, RequestContext(kind="agent", session="A"), DENSE)[0].slot == 0
    nxt_b = b + toks(100, 8)
    assert rank_slots(nxt_b, slots, RequestContext(kind="agent", session="B"), DENSE)[0].slot == 1
    # a third session must evict one: the one offering most, ties to the least recently used
    c = conv(3)
    d = plan_request(c, slots, [], RequestContext(kind="agent", session="C"), DENSE)
    assert d.evicts and d.slot == 0 and d.predicted == 3000


def test_eviction_takes_the_least_recently_used_conversation():
    big, small = conv(1, 5000), conv(2, 300)
    slots = [slot(0, big, None, "agent", "A", last=1), slot(1, small, None, "agent", "B", last=9)]
    other = toks(4000, 77)                      # shares nothing with either
    d = plan_request(other, slots, [], RequestContext(kind="agent", session="C"), DENSE)
    assert d.slot == 0 and d.evicts


def test_new_session_consumes_the_origin_not_another_conversation():
    a = conv(1)
    slots = [slot(0, a, len(a) + 20, "agent", "A", last=3),
             slot(1, HEAD, None, "head", None, last=0, origin=True, head_key="h", head_len=len(HEAD))]
    b = conv(2)
    d = plan_request(b, slots, [], RequestContext(kind="agent", session="B", head_key="h",
                                                  head_len=len(HEAD)), HYBRID)
    assert d.slot == 1 and d.predicted == len(HEAD) and not d.evicts
    # a guest does not take the origin when an empty slot exists
    slots.append(slot(2))
    assert rank_slots(toks(100, 5), slots, RequestContext(kind="guest"), HYBRID)[0].slot == 2


def test_same_prompt_same_folder_other_session_takes_the_slot_it_shares_nearly_all_of():
    """Not a continuation (another session key), but it reuses 3,799 tokens there and destroys
    only A's 20-token answer (A, if it returns, reuses the shared prompt from B's content): the
    server alone would choose that slot too. A long A is kept (the next test)."""
    a = conv(1)
    slots = [slot(0, a, len(a) + 20, "agent", "A", last=3), slot(1)]
    d = plan_request(a, slots, [], RequestContext(kind="agent", session="B"), DENSE)
    assert d.slot == 0 and d.evicts and d.predicted == len(a) - 1


def test_a_long_conversation_stays_protected_against_a_session_sharing_only_its_head():
    a = conv(1, 3000)
    slots = [slot(0, a, len(a) + 20, "agent", "A", last=3),
             slot(1, HEAD, None, "head", None, origin=True, head_key="h", head_len=len(HEAD))]
    b = conv(2, 300)
    d = plan_request(b, slots, [], RequestContext(kind="agent", session="B", head_key="h",
                                                  head_len=len(HEAD)), DENSE)
    assert d.slot == 1 and not d.evicts


def test_a_new_session_sharing_more_with_a_conversation_than_the_head_takes_it_when_it_can_spill():
    """Same folder, new session: it shares the previous session's start (head + system + first
    user turn) beyond the head. With the session tier there (the conversation is spilled before
    eviction) the planner takes that slot, as llama-server's own longest-prefix choice would;
    without it, the conversation stays protected and the head is brought to a side slot."""
    start = HEAD + toks(250, 9)                  # head + the folder's volatile system text
    a = start + toks(400, 1)
    # the side slot is empty: a guest's prompt there would be lost too (priced since ``tests/test_guest_placement.py``,
    # ``tests/test_guest_placement.py``)
    slots = [slot(0, a, len(a) + 20, "agent", "A", last=3), slot(1, last=4)]
    b = start + toks(300, 2)
    head_offer = Offer("head", len(HEAD), 0.02)
    ctx = RequestContext(kind="agent", session="B", head_key="h", head_len=len(HEAD))
    d = plan_request(b, slots, [head_offer], ctx, DENSE, can_spill=True)
    assert d.slot == 0 and d.evicts and d.steps[0] == "before_evict" and d.predicted == len(start)
    # without a spill, the overwrite loses A's 400-token tail: more than the 250 it saves
    d = plan_request(b, slots, [head_offer], ctx, DENSE, can_spill=False)
    assert d.slot == 1 and not d.evicts and d.tier == "head"
    # A's return: its own spill offers more than B's slot shares with it -> no overwrite
    slots[0] = slot(0, b, len(b) + 20, "agent", "B", last=5)
    back = a + toks(50, 3)
    d = plan_request(back, slots, [head_offer, Offer("session", len(a), 0.05)],
                     RequestContext(kind="agent", session="A", head_key="h", head_len=len(HEAD)),
                     DENSE, can_spill=True)
    assert d.slot == 1 and not d.evicts and d.tier == "session"


def test_a_session_in_another_mode_keeps_its_conversation_on_its_slot():
    """The same session, its system prompt or tools changed (the request departs from its slot
    before its first user message): the slot's conversation is another live one, so the request
    takes the free slot and a switch back finds it (the server alone's slot choice); an edit after
    the first user message (a cleared tool result) still replaces it on its own slot."""
    a = conv(1)
    slots = [slot(0, a, len(a) + 30, "agent", "A", last=5), slot(1)]
    other_tools = toks(40, 90) + a[40:]                       # departs at token 40
    ctx = RequestContext(kind="agent", session="A", user_starts=(len(HEAD),))
    d = plan_request(other_tools, slots, [], ctx, DENSE)
    assert d.slot == 1 and not d.evicts
    edited = a[:len(HEAD) + 50] + toks(300, 91)               # departs after the first user message
    d = plan_request(edited, slots, [], ctx, DENSE)
    assert d.slot == 0 and not d.evicts
    # with no other slot, the overwrite is an eviction: the session tier spills it first
    d = plan_request(other_tools, slots[:1], [], ctx, DENSE, can_spill=True)
    assert d.slot == 0 and d.evicts and "before_evict" in d.steps


def test_lru_breaks_ties():
    slots = [slot(0, toks(10, 1), None, "guest", last=9), slot(1, toks(10, 2), None, "guest", last=1)]
    assert rank_slots(toks(50, 3), slots, RequestContext(kind="guest"), DENSE)[0].slot == 1


def test_warm_head_on_a_new_fingerprint_and_offers():
    b = conv(2)
    ctx = RequestContext(kind="agent", session="B", head_key="h", head_len=len(HEAD))
    d = plan_request(b, [slot(0), slot(1)], [], ctx, HYBRID, head_resident=False)
    assert d.steps == ("warm_head",) and d.predicted == len(HEAD) and d.tier == "head"
    d = plan_request(b, [slot(0), slot(1)], [], ctx, HYBRID, head_resident=True)
    assert d.steps == () and d.predicted == 0 and d.tier == "cold"
    # a disk/session offer that saves more than one ubatch is taken
    d = plan_request(b, [slot(0), slot(1)], [Offer("disk", 3500, 0.1)], ctx, HYBRID)
    assert d.steps == ("bring",) and d.tier == "disk" and d.predicted == 3500
    # ... unless it costs more than the prefill it saves
    d = plan_request(b, [slot(0), slot(1)], [Offer("disk", 3500, 100.0)], ctx, HYBRID, prefill_tps=1000.0)
    assert d.steps == ()


# --- doctor ----------------------------------------------------------------------------------------

def test_doctor_findings(tmp_path):
    argv = ["-m", "x.gguf"]
    p = params_from_argv(argv, {}, None, checkpoints=True, arch="qwen35")
    f = {x.flag: x for x in check(p, {"build_info": "b1-0c1e570"}, None, argv=argv)}
    assert f["-np"].level == "error"
    assert f["--slot-save-path"].level == "warning"
    assert f["--checkpoint-min-step"].level == "warning"
    assert f["build"].level == "warning"
    assert f["--metrics"].level == "warning"
    # the default --cache-ram (8192 MiB) is a warning with its reason (README's flag list, D1), not info
    assert f["--cache-ram"].level == "warning" and "8192 MiB (the default)" in f["--cache-ram"].message
    assert "--cache-ram 0 (docs/decisions.md D1)" in f["--cache-ram"].message and not f["--cache-ram"].off
    argv = ["-np", "2", "--slot-save-path", str(tmp_path), "--metrics", "--checkpoint-min-step", "1024", "-fa", "off"]
    p = params_from_argv(argv, {}, None, checkpoints=True, arch="qwen35", cache_ram=0)
    levels = {x.flag: x.level for x in check(p, {"build_info": "b1-0c1e570+ocache.abcd1234"}, None, argv=argv)}
    assert all(v in ("ok", "info") for v in levels.values()), levels
    p = params_from_argv(argv[:2], {}, None, checkpoints=True, ctx_checkpoints=0)
    assert any(x.flag == "--ctx-checkpoints" and x.level == "error" for x in check(p, {}, None, argv=argv[:2]))


def test_a_slot_whose_id_task_vanishes_or_goes_back_means_a_new_server_process():
    """``GET /slots`` of a new llama-server process: a slot that reported an ``id_task`` reports
    none (or a lower one). A restored slot of the old process looks exactly like a fresh empty one,
    so this is how the per-request refresh sees a restart before the upstream probe does."""
    from ocache.llama.slot_api import TaskIds

    t = TaskIds()   # the slot table's record of them (SlotTable.refresh)
    assert not t.record([{"id": 0, "id_task": 5}, {"id": 1}])
    assert not t.record([{"id": 0, "id_task": 9}, {"id": 1, "id_task": 12}])
    assert t.record([{"id": 0}, {"id": 1}])                   # both vanished
    assert not t.record([{"id": 0, "id_task": 1}, {"id": 1}])
    assert t.record([{"id": 0, "id_task": 0}, {"id": 1}])     # went back
    assert t.record([{"id": 0, "id_task": 4}], restarted=True) and t.ids == {0: 4}   # another boot id


def test_a_conversation_the_session_tier_will_not_spill_is_not_overwritten_for_a_shared_system_prompt():
    """cache-pressure 0.6.3's shape (``scripts/bench-retention``): slot 0 holds an
    8,000-token context that the session tier would not spill (its client closed right after
    ``[DONE]``: "not seen complete"), slot 1 is empty. The next context shares only the 14-token
    system prompt with it: overwriting slot 0 destroys 7,986 tokens to save 14, so it goes to the
    empty slot. ``can_spill`` names the slots the session tier would spill; a slot it would spill
    costs nothing to overwrite, but 14 shared tokens are below ``min_useful``: no gain either."""
    system = toks(14, 3)
    x = system + toks(7986, 4)
    slots = [slot(0, x, len(x) + 1, "other", "X", last=3), slot(1)]
    y = system + toks(7986, 5)
    ctx = RequestContext(kind="other", session="Y")
    d = plan_request(y, slots, [], ctx, DENSE, can_spill=frozenset({1}))
    assert d.slot == 1 and not d.evicts
    d = plan_request(y, slots, [], ctx, DENSE, can_spill=frozenset())
    assert d.slot == 1 and not d.evicts
    d = plan_request(y, slots, [], ctx, DENSE, can_spill=frozenset({0, 1}))
    assert d.slot == 1 and not d.evicts
    assert plan_request(y, slots, [], ctx, DENSE, can_spill=True).slot == 1


def test_with_every_slot_protected_the_one_the_session_tier_would_spill_is_overwritten():
    """Both slots hold other conversations; the least recently used one (slot 0) would not be
    spilled ("not seen complete"), slot 1 would: slot 1 is overwritten, slot 0 keeps its context
    (cache-pressure on the tiny hybrid model, ``scripts/bench-retention``). With both spillable: LRU, as before."""
    system = toks(14, 3)
    x0, x1 = system + toks(7986, 4), system + toks(7986, 6)
    slots = [slot(0, x0, len(x0) + 1, "other", "X0", last=1), slot(1, x1, len(x1) + 1, "other", "X1", last=2)]
    y = system + toks(7986, 5)
    ctx = RequestContext(kind="other", session="Y")
    d = plan_request(y, slots, [], ctx, DENSE, can_spill=frozenset({1}))
    assert d.slot == 1 and d.evicts and d.steps[0] == "before_evict"
    assert plan_request(y, slots, [], ctx, DENSE, can_spill=frozenset({0, 1})).slot == 0
    assert plan_request(y, slots, [], ctx, DENSE, can_spill=True).slot == 0
    assert plan_request(y, slots, [], ctx, DENSE, can_spill=frozenset()).slot == 0


def test_a_few_shared_template_tokens_never_justify_an_overwrite():
    """Two unrelated contexts share only the template's first tokens: even when the session tier
    would spill the conversation, the new one takes the empty slot (a reuse below ``min_useful``
    counts as none, as in the ranking)."""
    a = toks(14, 1) + toks(2000, 2)
    slots = [slot(0, a, len(a) + 4, "other", None, last=3), slot(1)]
    b = toks(14, 1) + toks(2000, 3)
    d = plan_request(b, slots, [], RequestContext(kind="other"), DENSE, can_spill=True)
    assert d.slot == 1 and not d.evicts


# --- the restore cost model (ocache.slots.RestoreRate) ---------------------------------------

def test_restore_rate_is_the_measured_mean_and_prices_a_restore():
    from ocache.slots import RestoreRate

    r = RestoreRate(guess=1e9, alpha=0.5)
    assert r.cost_s(2e9) == pytest.approx(2.0)          # the guess until measured
    r.add(0, 1.0)
    r.add(1e6, 0.0)                                     # nothing measured: ignored
    assert (r.n, r.value) == (0, 1e9)
    r.add(4e8, 1.0)                                     # the first measurement replaces the guess
    assert (r.n, r.value) == (1, 4e8)
    r.add(8e8, 1.0)
    assert r.value == pytest.approx(6e8)                # then an exponentially weighted mean
    assert r.cost_s(1.2e9) == pytest.approx(2.0)


def test_tiers_price_restores_with_the_slot_tables_measured_rate():
    """The disk and session tiers read one rate, the slot table's (measured end to end on every
    restore of the process), not a per-tier guess fed by the server's ``restore_ms``."""
    from ocache.tiers.disk import DiskTier
    from ocache.tiers.spill import SessionTier

    table = SlotTable(None, "http://127.0.0.1:9")
    disk, session = DiskTier(None, table), SessionTier(None, table, resume_path=Path("/nonexistent"))
    table.restore_rate.add(1e8, 1.0)                   # a slow restore measured once: 100 MB/s
    for tier in (disk, session):
        verify = 1e9 / tier.verify_rate.value
        assert tier.read_cost_s(1e9) == pytest.approx(verify + 10.0)
