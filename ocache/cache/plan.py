"""The pure planner: which slot a request takes and the steps before it is forwarded.

``plan_request`` reads a snapshot of the slot table (``SlotTable.snapshot``), the answers of the
lookup phase (every tier's ``lookup``, once per request; the disk tier's anchor lines) and the
request's context; it changes nothing and awaits nothing, so it is tested with literal numbers
(``tests/test_slots.py``) and may run again after the request waited for its slot's lease.
The resident ranking and the protection rule it applies live in ``ocache/tiers/resident.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Collection, Sequence

from ocache.llama.flags import ServerParams
from ocache.tiers.base import Offer
from ocache.tiers.resident import RequestContext, SlotChoice, eviction_choice, overwrite_choice, rank_slots


@dataclass(frozen=True)
class Decision:
    """The plan for one request (a plain value: logged, tested, shown in ``X-OCache-*``).

    ``slot``: the slot to pin. ``tier``: where the reused prefix comes from (``resident``, an
    offer's tier, ``head`` for a warm-up in place, ``cold``). ``predicted``/``upper``: the predicted
    ``cache_n`` and the most the server may reuse (see ``ocache.llama.reuse.Reuse``). ``steps``: what to do
    before forwarding, in order: ``before_evict``, ``bring`` or ``warm_head``, ``anchors``.
    ``evicts``: the slot holds another live conversation. ``choice``: the resident ranking entry of
    the slot. ``anchors``: the disk tier's anchor lines ``((length, reason), ...)``
    (``DiskTier.anchor_lines``), split off the prefill by the ``anchors`` step (the lines the
    prefill passes cold after the steps before it: ``DiskTier.lines_above``).
    """

    slot: int
    tier: str
    predicted: int
    upper: int
    steps: tuple[str, ...]
    evicts: bool
    choice: SlotChoice
    offer: Offer | None = None
    warnings: tuple[str, ...] = ()
    anchors: tuple[tuple[int, str], ...] = ()


def plan_request(tokens: Sequence[int], slots: Sequence[Any], offers: Sequence[Offer | None],
                 ctx: RequestContext, params: ServerParams, *, head_resident: bool = True,
                 prefill_tps: float | None = None, forced_slot: int | None = None,
                 can_spill: bool | Collection[int] = False,
                 anchors: Sequence[tuple[int, str]] | None = None) -> Decision:
    """Choose a slot and the steps for a request of ``tokens`` (pure).

    ``slots``: ``SlotTable.snapshot()``. ``offers``: non-resident tiers' ``lookup`` answers.
    ``head_resident``: some slot (or tier) already has ``ctx``'s head; False on the first agent
    request of a new fingerprint, which then warms its head in the chosen slot (``warm_head``).
    ``prefill_tps``: measured prefill rate (tokens/s) to weigh an offer's ``cost_s`` against the
    prefill it saves (None: an offer is taken when it saves at least one ubatch).
    ``forced_slot``: plan for this slot only (re-planning after waiting for its lock).
    ``can_spill``: the slot ids whose conversation the session tier would save before it is
    evicted (its ``before_evict`` hook; ``SessionTier.will_spill``), or True for every slot.
    ``anchors``: the disk tier's anchor lines (``DiskTier.anchor_lines``), None without a disk
    tier; when given, the plan ends with the ``anchors`` step.

    Another live conversation's slot is protected, but not at any price: see
    ``ocache.tiers.resident.overwrite_choice`` (the protection rule), which here also prices what
    taking a guest's slot instead destroys (:func:`guest_loss`).
    Raises ValueError when there is no slot.
    """
    ranked = rank_slots(tokens, slots, ctx, params)
    if not ranked:
        raise ValueError("no slots")
    if forced_slot is not None:
        ranked = [c for c in ranked if c.slot == forced_slot] or ranked
    choice = ranked[0]
    if forced_slot is None and not choice.protected:
        choice = overwrite_choice(ranked, slots, offers, can_spill, guest_loss(slots, can_spill),
                                  kept=lambda c: guest_spilled(c, slots, can_spill)) or choice
    elif forced_slot is None:
        choice = eviction_choice(ranked, slots, can_spill) or choice
    warnings: list[str] = []
    evicts = choice.protected
    if evicts and ctx.kind == "guest":
        warnings.append("guest_on_agent_slot")
    elif evicts:
        warnings.append("conversation_evicted")
    reuse = choice.reuse
    steps: list[str] = []
    if evicts or guest_spilled(choice, slots, can_spill):
        # another live conversation, or a guest the session tier keeps (guest_loss priced it free)
        steps.append("before_evict")
    tier = "resident" if reuse.cache_n > 0 else "cold"
    predicted, upper = reuse.cache_n, reuse.upper
    ub = params.n_ubatch
    # the longest offer; on a tie the verified one (its file is checked before the restore), then
    # the cheaper one
    best = max((o for o in offers if o is not None and (o.slot is None or o.slot == choice.slot)),
               key=lambda o: (o.tokens_usable, o.verified, -o.cost_s), default=None)
    take_offer = False
    if best is not None and best.tokens_usable > predicted:
        gain = best.tokens_usable - predicted
        if prefill_tps:
            take_offer = gain / prefill_tps > best.cost_s
        else:
            take_offer = gain >= ub
    if take_offer and best is not None:
        steps.append("bring")
        tier, predicted = best.tier, best.tokens_usable
        upper = max(upper, predicted)
    elif (ctx.kind == "agent" and ctx.head_len > 0 and not head_resident
          and predicted < ctx.head_len - ub and len(tokens) > ctx.head_len
          and min(tokens[:ctx.head_len]) >= 0):   # an image in the head: a token-id prefill cannot carry it
        steps.append("warm_head")
        tier, predicted = "head", ctx.head_len
        upper = max(upper, predicted)
    if anchors is not None:
        steps.append("anchors")
    return Decision(choice.slot, tier, predicted, upper, tuple(steps), evicts, choice,
                    best if take_offer else None, tuple(warnings), tuple(anchors or ()))


def _guest_held(slots: Sequence[Any]) -> dict[int, int]:
    """Slot id -> tokens held (the server's count when known, so the answer counts too) of every
    slot holding a guest's prompt (not a kept head, not foreign content)."""
    return {s.id: (s.n_total if s.n_total is not None else len(s.tokens))
            for s in slots if s.kind == "guest" and not s.origin and not s.foreign}


def _spills(can_spill: bool | Collection[int], slot: int) -> bool:
    return can_spill if isinstance(can_spill, bool) else slot in can_spill


def guest_spilled(choice: SlotChoice, slots: Sequence[Any], can_spill: bool | Collection[int]) -> bool:
    """Whether taking ``choice``'s slot spills the guest it holds first (the plan's
    ``before_evict`` step on an unprotected slot). Pure.

    When the slot holds another guest's prompt (role ``guest``: not the request's own), the session
    tier would save it (``can_spill``, ``SessionTier.will_spill``: at least ``guest_min_tokens``,
    its response seen complete), and the overwrite destroys at least ``choice.min_useful`` (64)
    tokens of it: a guest that repeats the title's prompt and differs only in its user message or
    answer keeps the prompt in the slot, and a spill of it would keep nothing more worth a restore.
    """
    held = _guest_held(slots).get(choice.slot)
    return (held is not None and choice.role == "guest" and not choice.protected
            and _spills(can_spill, choice.slot) and held - choice.reuse.lcp >= choice.min_useful)


def guest_loss(slots: Sequence[Any], can_spill: bool | Collection[int] = False) -> Callable[[SlotChoice], int]:
    """``loss(choice)``: tokens an overwrite of an unprotected slot destroys that no tier keeps, for
    the protection rule's other side (``overwrite_choice``'s ``free_loss``). Pure.

    A slot holding a guest (``kind == "guest"``: opencode's title request, Open WebUI's title/tags)
    loses its tokens beyond the common prefix with the request (``held - lcp``, ``held`` = the
    server's count when known, so the answer counts too), unless the session tier spills it first
    (:func:`guest_spilled`, ``can_spill`` as in :func:`plan_request`): then nothing, as for a
    protected conversation it spills. The next guest of the same client repeats that prompt
    (opencode sends a byte-identical title system prompt every run; shared/fixtures README). Any
    other unprotected slot loses nothing here (empty, unknown, a kept head the head tier restores;
    a harness head's own loss is already in the ranking's score).

    Why (``ocache bench --preset tiny --scenario opencode_runs_same_folder --models
    hybrid``): on the next ``opencode run`` in a folder the agent turn reused 7,234 tokens in the
    previous run's slot (its checkpoint at the user message) and the disk tier offered the same
    7,234 for the title's slot; the tie went to the title's slot, the title's 541 tokens were lost,
    and every later title was prefilled in full (10,076 tokens against 7,980 for the server alone,
    1.263). Priced, the previous run's slot wins: 7,234 against 7,234 - 558.
    """
    held = _guest_held(slots)

    def loss(c: SlotChoice) -> int:
        if guest_spilled(c, slots, can_spill):
            return 0
        return max(held.get(c.slot, 0) - c.reuse.lcp, 0)

    return loss


@dataclass(frozen=True)
class Estimate:
    """One server's answer to the router's "what could you reuse for this request?"
    (``OCacheLayer.estimate``). ``n_tokens``: the prompt in tokens; ``usable``: the predicted
    ``cache_n`` there (resident, or what the head/disk/session tiers would restore first), in tokens;
    ``tier``: where it would come from; ``slot``/``busy``: the slot the plan would take and whether
    a request is running in it; ``destroys``: tokens of another live conversation the plan would
    overwrite there without the session tier saving them first (0: none); ``evicts``: tokens of
    another live conversation the plan would overwrite there, saved first or not (0: none);
    ``full``: it overwrites one there and every slot holds another live conversation, or that
    slot is busy (the plan would wait for its request); ``room``: some slot there is empty or
    holds only the kept harness head (``origin``): a conversation moving in overwrites none;
    ``restore_s``: the chosen offer's estimated read time (seconds); ``own_session``: a slot holds
    this request's session; ``prefill_tps``: this server's measured prefill rate (tokens/s, None
    before the first measurement); ``head_key``: the harness fingerprint; ``warm``: the plan would
    prefill the head itself first (no server holds it yet); ``prefix_key``: a hash of the first
    ``prefix_len`` tokens: 256 past the harness head (``head_len``) when the plan reuses less than
    that, else 256 past ``usable`` (just 256 when that is below 256; None when the prompt ends
    before) (in-process only: requests that would prefill the same next tokens, e.g. two sessions
    of one folder past the shared head); ``ubatch``: the server's ``-ub`` (tokens)."""

    n_tokens: int
    usable: int
    tier: str
    slot: int
    busy: bool
    destroys: int
    restore_s: float
    kind: str
    own_session: bool
    head_len: int
    prefill_tps: float | None
    head_key: str | None = None
    warm: bool = False
    prefix_key: int | None = None
    prefix_len: int = 256
    ubatch: int = 512
    evicts: int = 0
    full: bool = False
    room: bool = True
