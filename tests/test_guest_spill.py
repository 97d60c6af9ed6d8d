"""Guests parked by the session tier (rule 2 on the models' real chat templates).

``ocache bench --preset tiny --template real --scenario opencode_pi_alternating --models
hybrid,dense`` (report /tmp/runs/bench-real/bench-tiny.md of the lead's run): pi's first turn took
the slot of opencode's title request (541 tokens) without a spill (``SessionTier._spillable``
refused kind ``guest``; ``guest_loss`` priced the overwrite as the whole title), and the second
run's title, byte for byte the first one's, prefilled 541 tokens where llama-server alone
(``--cache-ram`` on by default) restored 537 from its RAM cache and prefilled 4: 10,258 against
9,953 for the scenario (1.031).

What must hold now: an overwrite of a guest the session tier keeps is free and planned with a
``before_evict`` step; the guest's spill lives apart from its session's agent spill (neither
supersedes the other); guests read guests' entries of any session, agents never read them; the
guest entries are bounded; a planned stop does not spill guests. The pure and fake-table tests
here fail on the old code (no step, a priced loss, no spill, no offer); the server test fails there
too (the second title is prefilled whole).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import aiohttp
import pytest

from ocache.cache import plan_request
from ocache.cache.plan import guest_loss
from ocache.llama.flags import ServerParams
from ocache.slots import SlotState
from ocache.tiers import spill as spill_mod
from ocache.tiers.resident import RequestContext, rank_slots

from test_guest_placement import DENSE, HYBRID, agent_slot, title, title_slot, toks
from test_store import make_store, write_slot_file

# --------------------------------------------------------------------------- the planner (pure)

PI = toks(1529, 40)      # pi's first turn: shares nothing with opencode's title or agent turn


@pytest.mark.parametrize("params", [HYBRID, DENSE], ids=["hybrid", "dense"])
def test_an_overwrite_of_a_guest_the_session_tier_keeps_is_free_and_spills_it(params):
    """pi's turn on two slots: run 1's agent conversation (protected) and run 1's title. The title's
    slot is taken either way; when the session tier would keep the title (``can_spill``) the plan
    spills it first (``before_evict``, no live conversation evicted) and prices it free."""
    slots = [agent_slot(1, params, last=2.0), title_slot(1, busy=False, last=1.0)]
    ctx = RequestContext(kind="agent", session=None)
    d = plan_request(PI, slots, [], ctx, params, can_spill=frozenset({0, 1}))
    assert d.slot == 1 and not d.evicts and d.steps == ("before_evict",), d
    ranked = {c.slot: c for c in rank_slots(PI, slots, ctx, params)}
    assert guest_loss(slots, frozenset({0, 1}))(ranked[1]) == 0
    # a title the session tier would not keep (too short, not seen complete): lost, priced whole
    d = plan_request(PI, slots, [], ctx, params, can_spill=frozenset({0}))
    assert d.slot == 1 and d.steps == () and not d.evicts
    assert guest_loss(slots, frozenset({0}))(ranked[1]) == len(title(1)) + 16


def test_a_title_that_keeps_the_titles_prompt_spills_nothing():
    """Run 2's title on run 1's title slot: it reuses the 524-token system prompt there and
    destroys only the other user message and answer (33 tokens, under ``min_useful``): no spill."""
    slots = [agent_slot(1, DENSE, last=2.0), title_slot(1, busy=False, last=1.0)]
    d = plan_request(title(2), slots, [], RequestContext(kind="guest", session="ses_run2"), DENSE,
                     can_spill=True)
    assert d.slot == 1 and d.steps == () and d.predicted >= 524


def test_a_guest_that_continues_its_own_guest_spills_nothing():
    """A guest of the same session that extends the slot's guest (its ``own`` role) destroys
    nothing: no spill step, even where the session tier would keep the slot."""
    done = [agent_slot(1, DENSE, last=2.0), title_slot(1, busy=False, last=1.0)]
    again = title(1) + toks(30, 5)
    d = plan_request(again, done, [], RequestContext(kind="guest", session="ses_run1"), DENSE, can_spill=True)
    assert d.slot == 1 and d.choice.role == "own" and d.steps == ()


# --------------------------------------------------------------------------- the session tier (fake table)

UB = 128
TITLE_SYS = list(range(3000, 3524))          # the title request's fixed system prompt
AGENT_HEAD = list(range(1, 301))


class FakeTable:
    """The slot table's surface the session tier uses: slot states (``SimpleNamespace``), ``save``
    writing the slot's tokens in llama-server's layout, a lock per slot."""

    def __init__(self, store, n: int = 2) -> None:
        self.params = ServerParams(n_ubatch=UB, checkpoints=False)
        self.restore_rate = None
        self.store = store
        self.slots = [SimpleNamespace(id=i, tokens=[], n_total=0, foreign=False, pending=False,
                                      interrupted=False, kind=None, origin=False, seq=0, owner=None,
                                      head_key=None, labels={}, last_used=0.0) for i in range(n)]
        self._locks = [asyncio.Lock() for _ in range(n)]

    def __getitem__(self, i: int):
        return self.slots[i]

    def __len__(self) -> int:
        return len(self.slots)

    def lock(self, i: int) -> asyncio.Lock:
        return self._locks[i]

    def fill(self, i: int, tokens: list[int], kind: str, owner: str | None, answer: int = 16) -> None:
        s = self.slots[i]
        s.tokens, s.n_total, s.kind, s.owner, s.seq = list(tokens), len(tokens) + answer, kind, owner, s.seq + 1

    async def save(self, slot: int, name: str) -> dict:
        s = self.slots[slot]
        full = s.tokens + list(range(9000, 9000 + s.n_total - len(s.tokens)))
        write_slot_file(self.store.path(name), full, 1000)
        return {"n_written": 1000, "n_saved": len(full)}


def tview(tokens: list[int], head_end: int | None = None) -> SimpleNamespace:
    """A token view: an agent's first user message right after its head, a title's after its
    system prompt."""
    return SimpleNamespace(tokens=tokens, head_end=head_end, user_starts=[head_end or len(TITLE_SYS)])


OK = SimpleNamespace(timings={}, completed=True, status=200)


async def finished(tier, table, slot: int, tokens: list[int], kind: str, owner: str | None,
                   head_end: int | None = None) -> None:
    """A complete response on ``slot`` as the cache layer records it, then ``admit``."""
    table.fill(slot, tokens, kind, owner)
    await tier.admit(tview(tokens, head_end), slot, OK)


def make_tier(tmp_path, clock=None, **cfg):
    store = make_store(tmp_path, clock=clock)
    table = FakeTable(store)
    tier = spill_mod.SessionTier(store, table, spill_mod.SpillConfig(min_tokens=400, ubatch=UB, **cfg))
    return store, table, tier


async def test_a_guest_is_spilled_apart_from_its_sessions_agent_spill(tmp_path):
    store, table, tier = make_tier(tmp_path)
    ses = "ses_oc1"
    title1 = TITLE_SYS + list(range(100, 117))
    agent = AGENT_HEAD + list(range(500, 700))
    await finished(tier, table, 0, agent, "agent", ses, head_end=len(AGENT_HEAD))
    await finished(tier, table, 1, title1, "guest", ses)
    assert tier.will_spill(1), "a 557-token title seen complete is kept by the session tier"

    await tier.before_evict(0)              # the agent conversation, then the title
    await tier.before_evict(1)
    await tier.flush()
    by_kind = {e.meta["kind"]: e for e in store.entries(spill_mod.KIND)}
    assert set(by_kind) == {"agent", "guest"}, "the guest's spill superseded its session's agent spill"
    assert by_kind["guest"].meta["session"] == by_kind["agent"].meta["session"] == spill_mod.hint_key(ses)
    assert tier.counters["guest_spills"] == 1

    # the session's next agent spill supersedes its agent spill only
    await finished(tier, table, 0, agent + [7, 8, 9], "agent", ses, head_end=len(AGENT_HEAD))
    await tier.before_evict(0)
    await tier.flush()
    kinds = sorted(e.meta["kind"] for e in store.entries(spill_mod.KIND))
    assert kinds == ["agent", "guest"] and tier.counters["superseded"] == 1

    # another run's title (another session, the same system prompt) is offered the guest entry;
    # an agent request is never offered it, a guest never the agent's
    title2 = TITLE_SYS + list(range(200, 217))
    offer = await tier.lookup(tview(title2), SimpleNamespace(session="ses_oc2", kind="guest"))
    assert offer is not None and offer.ref.key == by_kind["guest"].key
    assert offer.tokens_usable == len(TITLE_SYS)
    agent_offer = await tier.lookup(tview(TITLE_SYS + [1], 0), SimpleNamespace(session="ses_oc2", kind="agent"))
    assert agent_offer is None
    guest_on_agent = await tier.lookup(tview(agent + [5]), SimpleNamespace(session="ses_x", kind="guest"))
    assert guest_on_agent is None


async def test_guest_limits(tmp_path):
    """Shorter than ``guest_min_tokens``: not spilled. The same content again (another session's
    identical title): the stored entry is reused. At most ``guest_max_entries`` guest entries; a
    planned stop spills no guest (and the resume marker never names one)."""
    from test_store import Clock

    clock = Clock()
    store, table, tier = make_tier(tmp_path, clock, guest_max_entries=2, drain_min_tokens=100)
    short = list(range(3000, 3100))
    await finished(tier, table, 1, short, "guest", "ses_s")
    assert not tier.will_spill(1)
    await tier.before_evict(1)
    assert tier.counters["spill_skipped_short"] == 1 and not store.entries(spill_mod.KIND)

    title1 = TITLE_SYS + list(range(100, 117))
    await finished(tier, table, 1, title1, "guest", "ses_a")
    await tier.before_evict(1)
    await tier.flush()
    await finished(tier, table, 1, title1, "guest", "ses_b")     # byte for byte the same title
    await tier.before_evict(1)
    await tier.flush()
    assert len(store.entries(spill_mod.KIND)) == 1 and tier.counters["spill_dedup"] == 1

    for i, ses in enumerate(("ses_c", "ses_d", "ses_e")):
        await finished(tier, table, 1, TITLE_SYS + list(range(300 + 20 * i, 317 + 20 * i)), "guest", ses)
        await tier.before_evict(1)
        await tier.flush()
        clock.t += 60.0
    guests = [e for e in store.entries(spill_mod.KIND) if spill_mod.is_guest(e.meta)]
    assert len(guests) == 2 and tier.counters["guest_dropped"] == 2
    assert {e.meta["session"] for e in guests} == {spill_mod.hint_key("ses_d"), spill_mod.hint_key("ses_e")}

    # a planned stop: the agent conversation is spilled and named, the guest is not spilled
    await finished(tier, table, 0, AGENT_HEAD + list(range(500, 700)), "agent", "ses_f", head_end=len(AGENT_HEAD))
    await finished(tier, table, 1, TITLE_SYS + list(range(800, 817)), "guest", "ses_f")
    table.slots[1].last_used = 5.0
    out = await tier.on_drain(table)
    assert len(out["spilled"]) == 1 and out["resume"] == out["spilled"][0]
    assert not spill_mod.is_guest(store.get(out["resume"]).meta)


# --------------------------------------------------------------------------- the real server

@pytest.mark.server
@pytest.mark.parametrize("model", ["hybrid", "dense"])
async def test_the_second_runs_title_restores_the_first_runs_title(start_server, tmp_path, model):
    """The bench's opencode_pi_alternating bodies on two slots, one request at a time: run 1's
    title and agent turns, pi's two turns (pi takes the title's slot: the title is spilled), then
    run 2's title (another session, the same title request) is restored from run 1's title and
    prefills at most one ubatch, as the server alone does from its RAM cache."""
    from test_spill import SERVER, UB as SUB, body_of, make_config, n_prompt, send, session_headers, through_ocache, tier_of

    srv = start_server(model, n_parallel=2, ctx_size=2 * 12288, **SERVER)
    h1 = session_headers("opencode_agent_turn1.json")
    h2 = session_headers("opencode_run2_title.json")
    assert h1 != h2
    t2 = body_of("opencode_run2_title.json")
    nt2 = await n_prompt(srv.url, t2)
    cfg = make_config(srv, tmp_path / "cache", 1024)
    async with through_ocache(cfg) as (base, proxy), aiohttp.ClientSession() as s:
        first = await send(s, base, proxy, body_of("opencode_title.json"), h1)
        for name in ("opencode_agent_turn1.json", "opencode_agent_turn1_after_tool.json"):
            await send(s, base, proxy, body_of(name), h1)
        pi = await send(s, base, proxy, body_of("pi_turn1.json"))
        assert pi["slot"] == first["slot"], (pi["slot"], first["slot"])
        await send(s, base, proxy, body_of("pi_turn1_after_tool.json"))
        tier = tier_of(proxy)
        await tier.flush()

        rec = await send(s, base, proxy, t2, h2)
        await tier.flush()
        t = rec["timings"]
        assert rec["tier"] == "session" and t["cache_n"] >= nt2 - SUB, (rec["tier"], t, nt2)
        assert tier.counters["guest_spills"] == 1, tier.stats()
        print(f"\n{model}: run 1's title prefilled {first['timings']['prompt_n']} tokens cold in "
              f"{first['timings']['prompt_ms']:.0f} ms; its spill (pi's eviction) held pi "
              f"{tier.spill_s[0] * 1e3:.0f} ms (the server's save); run 2's title: verify + restore "
              f"{tier.restore_s[0] * 1e3:.0f} ms, prefilled {t['prompt_n']} ({t['prompt_ms']:.0f} ms), "
              f"reused {t['cache_n']} of {nt2}")
        assert tier.counters["hits"] >= 1 and tier.counters["unconfirmed"] == 0, tier.stats()
        # the guest's spill and run 1's agent spill both stand, under the same session key
        kinds = sorted(e.meta["kind"] for e in tier.store.entries("s")
                       if e.meta["session"] == spill_mod.hint_key(h1["x-session-affinity"]))
        assert kinds == ["agent", "guest"], kinds


@pytest.mark.parametrize("params", [HYBRID, DENSE], ids=["hybrid", "dense"])
def test_on_a_tie_the_slot_holding_the_prefix_beats_a_restore_over_a_kept_title(params):
    """Run 2's agent turn: slot 0 holds run 1's agent turn (7,234 shared, spillable), slot 1 run 2's
    title (spillable now). A session offer would restore the same 7,234 into the title's slot.
    Equal prefill either way: the slot that holds the prefix is taken (no read; the title stays
    for run 3's title), as llama-server alone chooses. On the first guest-spilling code the title
    was spilled and the offer restored over it (``ocache bench --preset tiny --template real
    --scenario opencode_runs_same_folder``: a spill and a restore more on every request)."""
    from test_guest_placement import ANCHOR, SYSTEM_END, agent_turn

    slots = [agent_slot(1, params, last=1.0), title_slot(2, busy=False, last=2.0)]
    ctx = RequestContext(kind="agent", session="ses_run2")
    offer = ANCHOR.__class__("session", SYSTEM_END, cost_s=0.02, verified=True)
    d = plan_request(agent_turn(2), slots, [offer], ctx, params, can_spill=frozenset({0, 1}))
    assert d.slot == 0 and d.tier == "resident" and d.steps == ("before_evict",) and d.evicts, d
    # an offer that brings more than the slot holds still goes over the kept title
    longer = ANCHOR.__class__("session", SYSTEM_END + 17, cost_s=0.02, verified=True)
    d = plan_request(agent_turn(2), slots, [longer], ctx, params, can_spill=frozenset({0, 1}))
    assert d.slot == 1 and d.steps == ("before_evict", "bring") and not d.evicts, d
