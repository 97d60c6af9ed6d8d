"""The planner's placement of guests and of the agent turn beside them, pure inputs.

The shape is the one ``ocache bench --preset tiny --scenario opencode_runs_same_folder --models
hybrid`` showed (the bench's logs, before the fix): ``opencode run`` twice in one folder with
different prompts. After run 1, slot 0 holds run 1's agent turn (7,251 prompt tokens + a 16-token
answer; the hybrid server's checkpoints at 6,735, at the user message 7,234 and at 7,247:
docs/llama-server.md §14) and slot 1 run 1's title request (541 + 16). Run 2's agent turn shares the
7,234 tokens up to its user message with slot 0; the disk tier offers its 7,234-token anchor for any
slot. No server: ``plan_request`` is pure.
"""

from __future__ import annotations

import random

import pytest

from ocache.cache import plan_request
from ocache.llama.flags import ServerParams
from ocache.llama.reuse import Checkpoint
from ocache.slots import SlotState
from ocache.tiers.base import Offer
from ocache.tiers.resident import RequestContext, rank_slots

HYBRID = ServerParams(n_slots=2, n_ctx_slot=16384, n_batch=2048, n_ubatch=512, ctx_checkpoints=32,
                      checkpoint_min_step=4096, checkpoints=True, cache_ram=0)
DENSE = ServerParams(n_slots=2, n_ctx_slot=16384, n_batch=2048, n_ubatch=512, checkpoints=False)

SYSTEM_END = 7234     # tokens before the user message (the anchor's length)
ANSWER = 16


def toks(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 2000) for _ in range(n)]


PREFIX = toks(SYSTEM_END, 1)              # tools + system prompt of the folder
TITLE_SYSTEM = toks(524, 7)               # the title request's fixed system prompt


def agent_turn(run: int) -> list[int]:
    return PREFIX + toks(17, 100 + run)   # + the run's own user message


def title(run: int) -> list[int]:
    return TITLE_SYSTEM + toks(17, 200 + run)


def agent_slot(run: int, params: ServerParams, *, last: float) -> SlotState:
    p = agent_turn(run)
    cps = [Checkpoint(len(p) - 4 - 512), Checkpoint(SYSTEM_END), Checkpoint(len(p) - 4)] \
        if params.checkpoints else []
    return SlotState(id=0, tokens=p, n_total=len(p) + ANSWER, checkpoints=cps, kind="agent",
                     owner=f"ses_run{run}", last_used=last)


def title_slot(run: int, *, busy: bool, last: float) -> SlotState:
    t = title(run)
    # a hybrid server's checkpoints there: 4 + ubatch before the end, the last user message, 4
    # before the end (the bench's title requests reuse 524 of 541-544 on the tiny hybrid model)
    cps = [Checkpoint(len(t) - 4 - 512), Checkpoint(len(TITLE_SYSTEM)), Checkpoint(len(t) - 4)]
    s = SlotState(id=1, tokens=t, n_total=None if busy else len(t) + ANSWER, checkpoints=cps,
                  kind="guest", owner=f"ses_run{run}", last_used=last, pending=busy)
    s.busy = busy
    return s


ANCHOR = Offer("disk", SYSTEM_END, cost_s=0.02, verified=True)


@pytest.mark.parametrize("params", [HYBRID, DENSE], ids=["hybrid", "dense"])
@pytest.mark.parametrize("title_busy", [False, True], ids=["title-done", "title-in-flight"])
@pytest.mark.parametrize("can_spill", [frozenset({0}), frozenset()], ids=["spilled", "not-spilled"])
def test_next_run_agent_turn_takes_the_previous_runs_slot_not_the_titles(params, title_busy, can_spill):
    """Run 2's agent turn reuses 7,234 tokens in run 1's slot (hybrid: the checkpoint at the user
    message; dense: the common prefix) and the disk anchor would bring the same 7,234 into the
    title's slot. Before, the guest's slot counted as free: the agent turn took it (a
    restore, waiting for the title when it was in flight), the title's 541 tokens were lost, and
    every later title was prefilled in full. Now the title's tokens are priced: slot 0."""
    slots = [agent_slot(1, params, last=2.0), title_slot(2 if title_busy else 1, busy=title_busy, last=1.0)]
    ctx = RequestContext(kind="agent", session="ses_run2")
    d = plan_request(agent_turn(2), slots, [ANCHOR], ctx, params, can_spill=can_spill)
    assert d.slot == 0, d
    assert d.tier == "resident" and "bring" not in d.steps
    assert d.predicted >= SYSTEM_END
    assert d.evicts and d.steps[0] == "before_evict"


def test_the_title_request_goes_where_its_own_prefix_is():
    """Run 3's title, after run 2's agent turn took run 1's slot: slot 1 holds run 2's title, so it
    reuses the title's system prompt there (the server's own similarity choice), never cold."""
    slots = [agent_slot(2, HYBRID, last=3.0), title_slot(2, busy=False, last=2.0)]
    d = plan_request(title(3), slots, [], RequestContext(kind="guest", session="ses_run3"), HYBRID)
    assert d.slot == 1 and not d.evicts
    assert d.predicted >= len(TITLE_SYSTEM) - HYBRID.n_ubatch and d.tier == "resident"


def test_a_restore_worth_more_than_the_title_takes_the_titles_slot_unless_a_spill_keeps_both():
    """The pricing works both ways. Run 1's slot holds a conversation of another folder that shares
    only the harness head's 3,000 tokens; the anchor brings 7,234. The session tier would not
    spill that conversation: overwriting it loses its 4,267 other tokens, the title's slot only
    557: the title's slot is taken. When the session tier would spill it (nothing lost), the
    anchor is restored into that slot and the title kept (what the server alone keeps too: its
    RAM cache saves the slot it replaces, docs/llama-server.md §9, §10; a restore does not)."""
    other = PREFIX[:3000] + toks(4251, 9)
    a = SlotState(id=0, tokens=other, n_total=len(other) + ANSWER, kind="agent", owner="ses_other",
                  last_used=2.0)
    slots = [a, title_slot(1, busy=False, last=1.0)]
    ctx = RequestContext(kind="agent", session="ses_run2")
    d = plan_request(agent_turn(2), slots, [ANCHOR], ctx, DENSE, can_spill=frozenset())
    assert d.slot == 1 and d.tier == "disk" and d.steps == ("bring",) and not d.evicts
    d = plan_request(agent_turn(2), slots, [ANCHOR], ctx, DENSE, can_spill=frozenset({0}))
    assert d.slot == 0 and d.tier == "disk" and d.steps == ("before_evict", "bring") and d.evicts


def test_without_a_guest_an_offer_never_moves_a_request_onto_a_protected_slot():
    """An offer fits any slot, so on its own it is no reason to overwrite a conversation: with an
    empty side slot the anchor goes there, spillable or not (the protection rule as before)."""
    other = PREFIX[:3000] + toks(4251, 9)
    a = SlotState(id=0, tokens=other, n_total=len(other) + ANSWER, kind="agent", owner="ses_other",
                  last_used=2.0)
    for spill in (frozenset(), frozenset({0}), True):
        d = plan_request(agent_turn(2), [a, SlotState(id=1)], [ANCHOR],
                         RequestContext(kind="agent", session="ses_run2"), DENSE, can_spill=spill)
        assert d.slot == 1 and d.tier == "disk" and not d.evicts, spill


def test_guest_loss_prices_a_guest_slot_only():
    """``guest_loss``: a guest's tokens beyond the common prefix; nothing for an empty slot or a
    kept harness head (the head tier keeps it; its loss is in the ranking's score)."""
    from ocache.cache.plan import guest_loss

    head = SlotState(id=2, tokens=PREFIX[:3000], n_total=3000, kind="head", origin=True,
                     head_key="h", head_len=3000)
    slots = [SlotState(id=0), title_slot(1, busy=False, last=1.0), head]
    ranked = {c.slot: c for c in rank_slots(agent_turn(2), slots, RequestContext(kind="agent", session="ses_run2"),
                                            DENSE)}
    loss = guest_loss(slots)
    assert loss(ranked[0]) == 0
    assert loss(ranked[1]) == len(title(1)) + ANSWER
    assert loss(ranked[2]) == 0
    # a guest repeating the title's system prompt loses only what it does not share
    ranked = {c.slot: c for c in rank_slots(title(2), slots, RequestContext(kind="guest", session="ses_run2"),
                                            DENSE)}
    assert loss(ranked[1]) == len(title(1)) + ANSWER - len(TITLE_SYSTEM)


def test_a_guest_goes_where_its_own_prefix_is_unless_that_destroys_more_than_it_saves():
    """A guest that repeats a conversation (Open WebUI's title and tags requests resend the chat
    and add an instruction) reuses the chat where the conversation's slot holds it, as the
    server's own similarity choice would: overwriting there destroys only the conversation's
    30-token answer (its next turn reuses the shared chat from the guest's content). When the
    conversation holds 2,000 tokens past the chat the guest shares, the guest prefills on the
    empty side slot instead, unless the session tier would spill that conversation first."""
    chat = toks(2000, 30)
    guest = chat + toks(50, 31)
    conv = SlotState(id=0, tokens=chat, n_total=len(chat) + 30, kind="other", owner="webui",
                     last_used=2.0)
    ctx = RequestContext(kind="guest", session="webui-title")
    d = plan_request(guest, [conv, SlotState(id=1)], [], ctx, DENSE, can_spill=frozenset())
    assert d.slot == 0 and d.predicted == len(chat) and d.evicts
    long_conv = SlotState(id=0, tokens=chat + toks(2000, 32), n_total=len(chat) + 2030, kind="other",
                          owner="webui", last_used=2.0)
    d = plan_request(guest, [long_conv, SlotState(id=1)], [], ctx, DENSE, can_spill=frozenset())
    assert d.slot == 1 and not d.evicts
    d = plan_request(guest, [long_conv, SlotState(id=1)], [], ctx, DENSE, can_spill=frozenset({0}))
    assert d.slot == 0 and d.evicts and d.steps[0] == "before_evict"


def test_a_side_request_of_the_same_session_is_priced_like_another_conversation():
    """A long no-tools request of the agent's own session (a compaction, a side
    question: kind ``other``) sharing only the head's 3,000 tokens with the session's live agent turn.
    It is not the slot's own conversation, so the overwrite is priced: when the session tier would
    spill the agent turn, it is taken after ``before_evict`` (the spill); when it would not, the
    4,267 tokens it destroys outweigh the 3,000 it reuses and the empty slot is taken. On the old
    ranking the agent slot was the request's ``own``: overwritten at once, no spill step."""
    agent = agent_slot(1, DENSE, last=2.0)
    side = PREFIX[:3000] + toks(3000, 55)
    ctx = RequestContext(kind="other", session="ses_run1")
    d = plan_request(side, [agent, SlotState(id=1)], [], ctx, DENSE, can_spill=frozenset({0}))
    assert d.slot == 0 and d.evicts and d.steps[0] == "before_evict"
    d = plan_request(side, [agent, SlotState(id=1)], [], ctx, DENSE, can_spill=frozenset())
    assert d.slot == 1 and not d.evicts
    # the session's next agent turn still continues its own slot
    nxt = agent_turn(1) + toks(40, 77)
    d = plan_request(nxt, [agent, SlotState(id=1)], [], RequestContext(kind="agent", session="ses_run1"),
                     DENSE, can_spill=frozenset({0}))
    assert d.slot == 0 and not d.evicts
