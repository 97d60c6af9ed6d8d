"""A spilled conversation is read by whichever session shares its longest usable prefix.

``SessionTier.lookup`` (``ocache/tiers/spill.py``) offered a spill only to the session that spilled
it. Two `opencode run` in one folder with the same first message send byte-identical agent turns
under two session keys (``shared/fixtures``: ``opencode_agent_turn1.json`` and
``opencode_run2_agent_turn1.json`` have equal messages and tools), so the second run was served from
the 7,234-token disk anchor while the first run's spill held 7,247 usable tokens, which the server
alone reuses from its slot (``ocache bench --preset tiny --scenario opencode_pi_alternating --models
hybrid``: 9,729 vs 9,703 server prefill, +13 tokens on each of two turns). The offer tests fail on
that code (the unit test gets no offer for the other session, the server test gets ``disk``); the
wait test fails without ``SessionTier._await_inflight`` (the lookup ran while the title request's
eviction was still committing the spill, so it found nothing).

What must stay true: a read never consumes the entry (it stays under its own session and is
restored again when that session comes back); a request without any session identity still reads
only a spill whose last prompt it contains; on equal usable prefixes the request's own spill wins.
"""

from __future__ import annotations

from types import SimpleNamespace

import aiohttp
import pytest

from ocache.llama.flags import ServerParams
from ocache.tiers import spill as spill_mod

from test_spill import SERVER, UB, body_of, make_config, n_prompt, send, session_headers, through_ocache, tier_of
from test_store import make_store, write_slot_file

# --------------------------------------------------------------------------- lookup (no server)

HEAD = list(range(1, 101))            # a 100-token harness head
TURN = list(range(500, 560))          # a first user message both sessions share


def spill_entry(store, tokens: list[int], session: str | None, prompt_n: int, state_bytes: int = 1000):
    """Commit a session-tier entry (kind ``s``) for ``tokens`` as ``SessionTier._commit`` does."""
    tmp = store.temp_name(spill_mod.KIND, "t" + str(len(store.entries())))
    write_slot_file(store.data_dir / tmp, tokens, state_bytes)
    return store.commit(spill_mod.KIND, tokens, tmp,
                        meta={"session": session, "prompt_n": prompt_n, "kind": "agent", "checkpoints": []})


def tier_over(store) -> spill_mod.SessionTier:
    table = SimpleNamespace(params=ServerParams(n_ubatch=128, checkpoints=False), restore_rate=None)
    return spill_mod.SessionTier(store, table, spill_mod.SpillConfig(ubatch=128))


def view(tokens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(tokens=tokens, head_end=len(HEAD), user_starts=[len(HEAD)])


async def test_another_sessions_spill_is_offered_for_the_prefix_it_shares(tmp_path):
    store = make_store(tmp_path)
    tier = tier_over(store)
    a_conv = HEAD + TURN + list(range(900, 1000))          # session A: its turn, the answer, a tool result
    ea = spill_entry(store, a_conv, spill_mod.hint_key("ses_A"), prompt_n=len(a_conv) - 10)
    # session B sends A's first turn byte for byte (a new `opencode run` with the same message)
    req = HEAD + TURN + [7, 8, 9]
    offer = await tier.lookup(view(req), SimpleNamespace(session="ses_B", kind="agent"))
    assert offer is not None, "another session's spill holding the longest usable prefix was not offered"
    assert offer.ref.key == ea.key and offer.tokens_usable == len(HEAD) + len(TURN)

    # a read consumes nothing: A's entry is there, still A's
    assert [e.meta["session"] for e in store.entries(spill_mod.KIND)] == [spill_mod.hint_key("ses_A")]

    # B's own spill of the same usable length wins the tie; a longer one of A's still wins
    own = HEAD + TURN + [1000, 1001]
    eb = spill_entry(store, own, spill_mod.hint_key("ses_B"), prompt_n=len(own))
    offer = await tier.lookup(view(req), SimpleNamespace(session="ses_B", kind="agent"))
    assert offer is not None and offer.ref.key == eb.key
    longer = await tier.lookup(view(HEAD + TURN + list(range(900, 950)) + [3]),
                               SimpleNamespace(session="ses_B", kind="agent"))
    assert longer is not None and longer.ref.key == ea.key and longer.tokens_usable == len(HEAD) + len(TURN) + 50

    # nothing past the harness head in common: no offer (the head is the head/disk tiers' business)
    none = await tier.lookup(view(HEAD + [42] * 40), SimpleNamespace(session="ses_B", kind="agent"))
    assert none is None


async def test_without_an_identity_only_a_spill_whose_last_prompt_it_contains(tmp_path):
    store = make_store(tmp_path)
    tier = tier_over(store)
    conv = HEAD + TURN + list(range(900, 1400))            # last prompt: 640 of its 660 tokens
    spill_entry(store, conv, None, prompt_n=len(conv) - 20)
    anon = SimpleNamespace(session=None, kind="other")
    bare = SimpleNamespace(tokens=HEAD + TURN + [5], head_end=None, user_starts=[])
    assert await tier.lookup(bare, anon) is None             # shares 160 tokens: not its conversation
    again = SimpleNamespace(tokens=conv + [5, 6], head_end=None, user_starts=[])
    offer = await tier.lookup(again, anon)
    assert offer is not None and offer.tokens_usable == len(conv)


# --------------------------------------------------------------------------- the real server

@pytest.mark.server
@pytest.mark.parametrize("model", ["hybrid", "dense"])
async def test_a_new_session_with_the_same_first_turn_restores_the_other_sessions_spill(start_server, tmp_path, model):
    """-np 1: session A (turn 1, then the turn after its tool call), then pi takes the only slot (A is
    spilled), then a second `opencode run` sends A's first turn byte for byte under its own session
    key: it is restored from A's spill and prefills at most one ubatch (+ a few tokens), as the server
    alone would from A's slot; A's entry is still there, still A's, also once C's own spill exists."""
    srv = start_server(model, n_parallel=1, ctx_size=16384, **SERVER)
    a1, a2 = body_of("opencode_agent_turn1.json"), body_of("opencode_agent_turn1_after_tool.json")
    c1 = body_of("opencode_run2_agent_turn1.json")
    ha, hc = session_headers("opencode_agent_turn1.json"), session_headers("opencode_run2_agent_turn1.json")
    assert a1["messages"] == c1["messages"] and a1["tools"] == c1["tools"] and ha != hc
    na1, na2 = await n_prompt(srv.url, a1), await n_prompt(srv.url, a2)
    assert na1 == await n_prompt(srv.url, c1) >= 2000
    cfg = make_config(srv, tmp_path / "cache", 2000)
    async with through_ocache(cfg) as (base, proxy), aiohttp.ClientSession() as s:
        await send(s, base, proxy, a1, ha)
        tier = tier_of(proxy)
        await send(s, base, proxy, a2, ha)
        await send(s, base, proxy, body_of("pi_turn1.json"))
        await tier.flush()
        [ea] = [e for e in tier.store.entries("s") if e.meta["session"] == spill_mod.hint_key(ha["x-session-affinity"])]
        assert ea.n_tokens > na2

        rec = await send(s, base, proxy, c1, hc)
        await tier.flush()
        assert rec["tier"] == "session", rec
        t = rec["timings"]
        assert t["prompt_n"] <= UB + 8 and abs(t["cache_n"] - rec["predicted"]) <= UB, (t, rec["predicted"])
        assert tier.counters["hits"] == 1 and tier.counters["unconfirmed"] == 0, tier.stats()
        # read, not consumed: A's entry is the same file under A's session
        kept = tier.store.get(ea.key)
        assert kept is not None and kept.meta["session"] == ea.meta["session"]

        # A comes back (one more user message) and takes the only slot again (C is spilled): C's
        # spill supersedes none of A's, and A prefills only its new tokens (+ one ubatch) whichever
        # of the two the plan reads
        a3 = body_of("opencode_agent_turn1_after_tool.json")
        a3["messages"].append({"role": "user", "content": "and one more thing"})
        na3 = await n_prompt(srv.url, a3)
        rec = await send(s, base, proxy, a3, ha)
        await tier.flush()
        assert rec["timings"]["prompt_n"] <= (na3 - na2) + UB, (rec["timings"], na2, na3)
        sessions = {e.key: e.meta["session"] for e in tier.store.entries("s")}
        assert sessions.get(ea.key) == ea.meta["session"], sessions
        assert spill_mod.hint_key(hc["x-session-affinity"]) in sessions.values(), sessions


class SlowSaveTable:
    """The slot table's surface ``SessionTier`` spills through, with a server save that waits for
    ``release`` (the file is written in llama-server's layout when it returns)."""

    def __init__(self, store, tokens: list[int]) -> None:
        import asyncio

        self.params = ServerParams(n_ubatch=128, checkpoints=False)
        self.restore_rate = None
        self.store = store
        self.release = asyncio.Event()
        self.saving = asyncio.Event()
        self.slot = SimpleNamespace(id=0, tokens=tokens, n_total=len(tokens), foreign=False, pending=False,
                                    interrupted=False, kind="agent", origin=None, seq=1, owner="ses_A",
                                    head_key=None, labels={}, last_used=0.0)

    def __getitem__(self, i: int):
        return self.slot

    async def save(self, slot: int, name: str) -> dict:
        self.saving.set()
        await self.release.wait()
        write_slot_file(self.store.path(name), self.slot.tokens, 1000)
        return {"n_written": 1000, "n_saved": len(self.slot.tokens)}


async def test_a_lookup_waits_for_the_spill_of_the_conversation_it_continues(tmp_path):
    """A title request evicts session A's conversation while A's first turn, sent again by a new
    session 50 ms later, is being planned: its lookup waits for that spill's commit and is offered
    it; a request sharing only the harness head with it does not wait."""
    import asyncio

    store = make_store(tmp_path)
    conv = HEAD + TURN + list(range(900, 1000))
    table = SlowSaveTable(store, conv)
    tier = spill_mod.SessionTier(store, table, spill_mod.SpillConfig(min_tokens=10, ubatch=128))
    await tier.admit(view(conv), 0, SimpleNamespace(timings={}, completed=True, status=200))
    evict = asyncio.create_task(tier.before_evict(0))
    await asyncio.wait_for(table.saving.wait(), 10)
    unrelated = await asyncio.wait_for(tier.lookup(view(HEAD + [42] * 40), SimpleNamespace(session="ses_C", kind="agent")), 10)
    assert unrelated is None and tier.counters["inflight_waits"] == 0
    look = asyncio.create_task(tier.lookup(view(HEAD + TURN + [7]), SimpleNamespace(session="ses_B", kind="agent")))
    await asyncio.sleep(0)          # let the lookup start; the save has not returned
    assert not look.done()
    table.release.set()
    offer = await asyncio.wait_for(look, 10)
    await asyncio.wait_for(evict, 10)
    assert offer is not None and offer.tokens_usable == len(HEAD) + len(TURN), offer
    assert tier.counters["inflight_waits"] >= 1 and tier.counters["spills"] == 1
    assert not tier._inflight


async def test_another_identitys_spill_is_not_offered(tmp_path):
    """A spill of another identity (a patched server replaced by a stock one: another build) is
    kept for it and not offered: offered, it was refused at its restore's check on every request
    (a warning each time) and the request planned again."""
    store = make_store(tmp_path, identity="id-patched")
    conv = HEAD + TURN + list(range(900, 1000))
    spill_entry(store, conv, spill_mod.hint_key("ses_A"), prompt_n=len(conv) - 10)
    req = HEAD + TURN + [7, 8, 9]
    ctx = SimpleNamespace(session="ses_A", kind="agent")
    assert await tier_over(store).lookup(view(req), ctx) is not None
    store.set_identity("id-stock")         # the server that replaced it (wiring.sync_store_identity)
    assert await tier_over(store).lookup(view(req), ctx) is None
    assert len(store.entries(spill_mod.KIND)) == 1 and store.counters["verify_failed"] == 0
