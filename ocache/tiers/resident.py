"""The resident tier: the server's own slots. Routing = choosing which slot a request lands on.

llama-server matches a prompt only against the slot it is given (docs/llama-server.md §9, §11), so the cheapest
cache there is is sending a request to the slot that already holds most of it. For every slot the
tier predicts the *usable* prefix (``ocache.llama.reuse.predict_reuse``: the common prefix, on a hybrid
model rounded down to a context checkpoint unless the request strictly extends the slot) and ranks
the slots by what the request gains minus what it destroys:

* a continuation of the slot's own conversation (same session key, or — without session keys —
  a prompt that contains everything the slot was sent) destroys nothing;
* an empty slot, a slot of unknown content, or a guest's slot destroys nothing worth keeping;
* a warmed harness head (the shared *origin*) is destroyed only when the request does not start
  with that head (an agent of the same harness consumes it, a guest would throw it away);
* another live conversation (agent/other) is *protected*: it is chosen when every slot is
  protected (``-np 1``, or more conversations than slots), or when overwriting it is worth more
  than it destroys (:func:`overwrite_choice`, the protection rule), and then the ``before_evict``
  hooks of every tier run first (the session tier spills it there).

Ties go to the least recently used slot. Guests (opencode's title request, Open WebUI's title/tags
requests) therefore land on a side slot when ``-np >= 2`` and never overwrite an agent conversation
(the guest rule, docs/architecture.md §3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Collection, Sequence

from ocache.llama.reuse import Reuse, predict_reuse
from ocache.llama.flags import ServerParams
from ocache.slots import SlotState
from ocache.tiers.base import RequestContext  # noqa: F401 - re-exported for callers of the ranking

#: Tie order of slot roles (higher first) when two slots offer the same score.
ROLE_RANK = {"own": 5, "empty": 4, "unknown": 3, "guest": 3, "origin": 2, "other": 0}


@dataclass(frozen=True)
class SlotChoice:
    """One slot as a candidate. ``reuse``: the predicted reuse there; ``role``: see ``ROLE_RANK``;
    ``loss``: tokens of cached value the request would destroy (a head origin it does not use);
    ``protected``: another live conversation (always ranked after unprotected slots); ``score``: ``reuse.cache_n - loss``."""

    slot: int
    reuse: Reuse
    role: str
    loss: int
    protected: bool
    busy: bool
    last_used: float

    min_useful: int = 64

    @property
    def score(self) -> int:
        """Reuse minus loss; a reuse below ``min_useful`` tokens (a shared ``<|im_start|>system``)
        counts as none, so it never outweighs an idle slot."""
        gain = self.reuse.cache_n if self.reuse.cache_n >= self.min_useful else 0
        return gain - self.loss

    def key(self) -> tuple:
        return (not self.protected, self.score, not self.busy, ROLE_RANK.get(self.role, 0), -self.last_used)


def ram_swap_possible(s: SlotState, lcp: int, n_prompt: int, params: ServerParams) -> bool:
    """Whether the server may swap a RAM-cache entry into this pinned slot (docs/llama-server.md §9 step 4:
    ``--cache-ram`` on, slot non-empty, ``f_keep = LCP/len(slot) < 0.5`` or ``f_sim <= sps``)."""
    if not params.cache_ram:
        return False
    size = s.n_total if s.n_total is not None else len(s.tokens)
    if size <= 0:
        return False
    f_sim = lcp / max(n_prompt, 1)
    if params.slot_prompt_similarity and f_sim <= params.slot_prompt_similarity:
        return True
    return lcp / size < 0.5


def departs_before_user(lcp: int, held: int, user_starts: Sequence[int]) -> bool:
    """Whether a request of first user message at ``user_starts[0]`` (token position) departs from
    a slot holding ``held`` tokens, ``lcp`` of them shared, before that message: the slot holds
    another system prompt or tool set. False without user starts (a raw route) or when the request
    shares the whole slot. Pure."""
    return bool(user_starts) and lcp < held and lcp < int(user_starts[0])


def classify_slot(s: SlotState, reuse: Reuse, ctx: RequestContext, params: ServerParams) -> SlotChoice:
    """Role, loss and protection of one slot for one request (see the module docstring)."""
    held = len(s.tokens)
    size = s.n_total if s.n_total is not None else held
    empty = held == 0 and not size and not s.foreign
    if empty:
        role, loss, protected = "empty", 0, False
    elif s.foreign or held == 0:
        role, loss, protected = "unknown", 0, False
    else:
        if ctx.session is not None and s.owner is not None:
            # opencode's title request shares the session key with the agent turns: a guest is
            # never the same conversation as an agent slot
            same = ctx.session == s.owner and (ctx.kind == "guest") == (s.kind == "guest")
            # a request of another kind in the same session (a compaction, a side question: no
            # tools, beside an agent turn) that does not continue the slot's conversation would
            # destroy it: priced like any other overwrite (before, it overwrote the live
            # conversation without a spill, and the next turn prefilled 112 tokens, not 19-22)
            same = same and (ctx.kind == s.kind or reuse.lcp >= held - params.n_ubatch)
            # the same session in another *mode*: the request departs from the slot before its
            # first user message (its system prompt or tools changed: opencode's build and plan
            # agents, a tool set switched). The slot's conversation is not superseded: the client
            # may switch back, as the server alone keeps it on its other slot (its similarity
            # rule, docs/llama-server.md §9), so it is priced as another live conversation
            # (protected; spilled before an overwrite). Measured: scripts/fuzz-substitutions
            # --configs dense-ocache --cases 88 --seed 11, case 87 (tools changed, then back)
            # prefilled 1,355 tokens, 838 alone, when the changed turn superseded it.
            same = same and not departs_before_user(reuse.lcp, held, ctx.user_starts)
        else:
            # without a session key: the same conversation when the request shares the slot's
            # prompt but for its tail (a template re-renders the last turn's end: up to a ubatch),
            # never less than half of it: a short slot (under a ubatch) would otherwise count as
            # the same conversation as any request (lcp >= held - n_ubatch holds for lcp 0), and
            # two short chats took turns on one slot, each cold, while the other slot stayed
            # empty (tiny hybrid, -np 2, chats A, B, A, B: 130 tokens, 113 alone)
            same = reuse.lcp >= held - min(params.n_ubatch, held // 2) and s.kind == ctx.kind
        if same and not s.origin:
            role, loss, protected = "own", 0, False
        elif s.origin:
            consumes = (ctx.kind == "agent" and ctx.head_key is not None and ctx.head_key == s.head_key
                        and reuse.cache_n >= s.head_len - params.n_ubatch)
            role, loss, protected = "origin", (0 if consumes else s.head_len), False
        elif s.kind == "guest":
            role, loss, protected = "guest", 0, False
        else:
            # another live conversation: ranked after every unprotected slot; among such slots
            # the reuse decides, then the least recently used goes (recency predicts the next turn)
            role, loss, protected = "other", 0, True
    return SlotChoice(s.id, reuse, role, loss, protected, s.busy, s.last_used,
                      min(64, params.n_ubatch))


def rank_slots(tokens: Sequence[int], slots: Sequence[SlotState], ctx: RequestContext,
               params: ServerParams) -> list[SlotChoice]:
    """Every slot as a candidate for ``tokens``, best first (pure)."""
    out = []
    for s in slots:
        reuse = predict_reuse(s.tokens, s.n_total, s.checkpoints, tokens, params,
                              user_starts=ctx.user_starts, task=ctx.task, ram_swap=False)
        if s.foreign or ram_swap_possible(s, reuse.lcp, len(tokens), params):
            # unknown content (or a RAM-cache swap): any reuse up to N-1 is consistent
            reuse = predict_reuse(s.tokens, s.n_total, s.checkpoints, tokens, params,
                                  user_starts=ctx.user_starts, task=ctx.task, ram_swap=True)
        out.append(classify_slot(s, reuse, ctx, params))
    out.sort(key=SlotChoice.key, reverse=True)
    return out


def _loss_fn(slots: Sequence[SlotState], can_spill: bool | Collection[int]):
    """``loss(choice)``: tokens an overwrite of ``choice``'s slot destroys (nothing when the session
    tier spills it first, see :func:`overwrite_choice`)."""
    held = {s.id: (s.n_total if s.n_total is not None else len(s.tokens)) for s in slots}

    def loss(c: SlotChoice) -> int:
        spilled = can_spill if isinstance(can_spill, bool) else c.slot in can_spill
        return 0 if spilled else max(held.get(c.slot, 0) - c.reuse.lcp, 0)

    return loss


def eviction_choice(ranked: Sequence[SlotChoice], slots: Sequence[SlotState],
                    can_spill: bool | Collection[int]) -> SlotChoice | None:
    """When every slot holds another live conversation (all protected): the one to overwrite, by
    its ``score`` (useful reuse) minus :func:`overwrite_choice`'s loss, then free before busy, then
    least recently used.
    Pure. None (the ranking's own order: reuse, then LRU) unless ``can_spill`` names some slots and
    not others; then a slot the session tier would not spill keeps its conversation while a
    spillable one can be taken
    (cache-pressure 0.6.3, ``scripts/bench-retention``, tiny hybrid model: the LRU slot held an
    8,000-token context "not seen complete", the other a spillable one; LRU overwrote the first,
    and it was the first context the bench missed, 5/10)."""
    prot = [c for c in ranked if c.protected]
    if not prot or len(prot) != len(ranked) or isinstance(can_spill, bool) or not can_spill:
        return None  # all or none spillable: the ranking's own order
    loss = _loss_fn(slots, can_spill)
    return max(prot, key=lambda c: (c.score - loss(c), not c.busy, -c.last_used))


def overwrite_choice(ranked: Sequence[SlotChoice], slots: Sequence[SlotState],
                     offers: Sequence[Any], can_spill: bool | Collection[int],
                     free_loss: Callable[[SlotChoice], int] | None = None,
                     kept: Callable[[SlotChoice], bool] | None = None) -> SlotChoice | None:
    """The protection rule: the protected slot (another live conversation) worth overwriting for
    this request, or None. Pure.

    A protected slot is taken when the request reuses more there than at any unprotected slot
    (what an offer could bring into it included: ``offers`` are ``Offer`` values with ``tokens_usable``
    and ``slot``) by more than the overwrite destroys, its *loss*: the slot's tokens beyond the
    common prefix (its owner, if it returns, reuses the shared prefix from the new content and
    prefills only those), or nothing when the session tier saves it before the eviction:
    ``can_spill`` is the set of slot ids it would spill now (``SessionTier.will_spill``), or True
    for every slot. A conversation the session tier refuses (its response not seen complete, a
    guest, shorter than ``spill_min_tokens``) is lost whole by an overwrite: with cache-pressure
    0.6.3 (``scripts/bench-retention``, tiny dense model) an 8,000-token context whose client had
    closed right after ``[DONE]`` was overwritten for its 14-token system prompt while the other
    slot was empty, and it was the one context of 10 the bench then missed. That is llama-server's own longest-common-prefix choice wherever protecting would
    cost more prefill now than it can save later, and protection where it pays. Measured with the
    real opencode (``tests/test_e2e_clients.py``, an everyday day): a new ``opencode run`` in the same
    folder shares the previous run's whole first turn (7,2xx tokens) against a 6,942-token head and
    destroys its 64-token answer; protecting it cost 7,212 tokens per run (head warm-up) and the
    title slot, 9,640 tokens against 7,972 for the server alone; with this rule 8,028.

    ``free_loss(choice)``: tokens an overwrite of an *unprotected* slot destroys that no tier keeps
    (a guest's prompt: ``ocache.cache.plan.guest_loss``); the best unprotected slot is then worth
    its reach minus that, and a protected slot its reach too (what an offer could bring into it),
    so both sides of the comparison are priced alike (None: nothing, as before). Offers fit any
    slot (``slot`` None), so without a guest's loss this takes no other slot than before.

    ``kept(choice)``: the unprotected slot loses nothing only because a tier saves what it holds
    first (a guest the session tier spills: ``ocache.cache.plan.guest_spilled``). On a tie with
    such slots, reached there only through an offer's restore, a protected slot whose own content
    reaches as far (nothing to restore) and whose loss is nothing too is taken: llama-server's own
    choice (the slot sharing the longest prefix), no read, and the guest stays for the next guest.
    Measured (``ocache bench --preset tiny --template real --scenario opencode_runs_same_folder
    --models hybrid,dense``): without it, each run's agent turn spilled the new title and restored
    the previous run's 7,350-token spill into its slot, beside the previous run's slot that held
    those 7,350 tokens, and the next title was restored in turn (the same prefill, a spill and a
    restore of 9-51 ms more per request).
    """
    loss = _loss_fn(slots, can_spill)

    def reach(c: SlotChoice) -> int:
        brought = [o.tokens_usable for o in offers
                   if o is not None and (o.slot is None or o.slot == c.slot)]
        return max([c.reuse.cache_n, *brought])

    def free_reach(c: SlotChoice) -> int:
        return reach(c) - (free_loss(c) if free_loss is not None else 0)

    free = [c for c in ranked if not c.protected]
    best_free = max((free_reach(c) for c in free), default=0)
    # the tie rule (``kept``): every unprotected slot that reaches best_free keeps its content only
    # through a tier's save and gets the prefix only through an offer
    tie_to_resident = kept is not None and any(free_reach(c) == best_free for c in free) and all(
        kept(c) and c.reuse.cache_n < best_free for c in free if free_reach(c) == best_free)

    def gain(c: SlotChoice) -> int:
        return reach(c) if free_loss is not None else c.reuse.cache_n

    def wins(c: SlotChoice) -> bool:
        margin = gain(c) - best_free - loss(c)
        return margin > 0 or (tie_to_resident and margin == 0 and loss(c) == 0
                              and c.reuse.cache_n >= gain(c))

    # a reuse below ``min_useful`` (a shared ``<|im_start|>system`` line) is none, as in the ranking
    taken = [c for c in ranked if c.protected and not c.busy and gain(c) >= c.min_useful and wins(c)]
    if not taken:
        return None
    return max(taken, key=lambda c: (gain(c) - loss(c), -c.last_used))


def server_should_choose(ranked: Sequence[SlotChoice], slots: Sequence[SlotState],
                         min_useful: int = 64) -> bool:
    """Whether to forward this request without ``id_slot`` and let llama-server choose the slot.

    True when some idle slot holds content ocache cannot see (``foreign``: a server that ran before
    this ocache started, a client that bypassed it, a known turn whose token view failed after it
    was forwarded) of at least ``min_useful`` tokens, and no slot whose content ocache knows gives a
    usable reuse, or less than such a slot holds by ``min_useful`` tokens or more. Then only the
    server can tell whether that content is this request's prefix: it picks the slot by prompt
    similarity (docs/llama-server.md §9), exactly as it would without ocache, so the request
    prefills no more than the server alone (rule 2; measured: ocache restarted in front of a warm
    server routed a 13k-token turn to the wrong slot and prefilled 6,085 tokens where the server
    alone prefilled 1; a known turn whose view failed, then its next turn: 6,942 reused from the
    kept head where the unnamed slot held 7,291, ``tests/test_known_turn.py``).
    """
    by_id = {s.id: s for s in slots}
    foreign = [c for c in ranked if by_id[c.slot].foreign and not c.busy
               and (by_id[c.slot].n_total or 0) >= min_useful]
    if not foreign:
        return False
    known_best = max((c.reuse.cache_n for c in ranked if not by_id[c.slot].foreign), default=0)
    held = max(by_id[c.slot].n_total or 0 for c in foreign)
    return known_best < min_useful or known_best + min_useful <= held


def known_conversation_slot(slots: Sequence[SlotState], digests: Sequence[bytes], session: str | None,
                            kind: str, extensions: bool = True) -> int | None:
    """The slot that holds the previous turn of this request's conversation, recognised from its
    messages alone (before the request's token view exists), or None. Pure.

    ``digests``: ``ocache.tokens.message_keys(body)[1]`` of the request (one chained digest per
    message). A slot qualifies when its content came from a chat request (``SlotState.msg_key``)
    whose render fields and ``n_msgs`` messages this request repeats unchanged
    (``digests[n_msgs - 1] == msg_key``), of the same session and kind (the ranking's ``own`` role:
    :func:`classify_slot`), idle, vouched for by the table (the response finished and the server's
    count is known: not ``pending``, not ``foreign``, ``n_total`` set), and not a kept head
    (``origin``). Two qualifying slots with the same message count: None (let the planner decide).
    ``extensions`` False: only a slot whose request had exactly these messages (a resend: the same
    prompt whatever the template), for a template not yet checked append-only.

    Why the planner would choose that slot (``ocache.cache.orchestrator`` forwards such a request to
    it at once, ``tiers.resident.known``): the slot holds a prompt rendered from a prefix of this
    request's messages, and with an append-only template (the token view's delta renders check it:
    ``TokenViewer.delta_ok``) that prompt is a prefix of this request's prompt; so the slot reuses at
    least that whole prompt, more than any other slot or tier can hold of this conversation, and
    overwrites nothing. On a hybrid (recurrent) model the slot resumes from its whole state when the
    request strictly extends it, else from the server's last context checkpoint before the point
    where the request departs from it (inside the previous answer, as the template renders it);
    another tier could then only do better with a disk anchor between that checkpoint and that
    point, which the caller counts after the fact (``known_other_plan``).
    """
    best: SlotState | None = None
    tie = False
    n = len(digests)
    for s in slots:
        if (s.msg_key is None or not 0 < s.n_msgs <= n or digests[s.n_msgs - 1] != s.msg_key
                or (not extensions and s.n_msgs != n)
                or s.busy or s.pending or s.foreign or s.origin or s.n_total is None
                or not s.tokens or s.owner != session or s.kind != kind):
            continue
        if best is None or s.n_msgs > best.n_msgs:
            best, tie = s, False
        elif s.n_msgs == best.n_msgs:
            tie = True
    return None if best is None or tie else best.id
