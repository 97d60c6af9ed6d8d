"""The session tier's policy: which slot is spilled and when, which spill supersedes which, which
entry a request is offered, and which conversation a drained stop resumes
(``ocache.tiers.spill.SessionTier``, docs/architecture.md §3).

The same split as the store's eviction policy (``ocache.tiers.evict``): the tier owns the slot
calls, the files and the counters; it asks its :class:`SpillPolicy`, which reads what it is given
(a slot's ``SlotState``, store entries, token lists) and decides, with no I/O, no await and no
counter of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from ocache.llama.reuse import common_prefix
from ocache.tiers.entry import Entry, IntegrityError

#: what ``tokens_of`` raises for an entry it cannot read (that entry is passed over)
UNREADABLE = (IntegrityError, KeyError)


@dataclass
class SpillConfig:
    """Session tier settings (tokens, bytes/s as noted)."""

    # eviction: shortest conversation worth a spill. By cost, not by size: writing a slot costs
    # 2-3 orders of magnitude less than prefilling it (README "Measured": 16k tokens, bench models,
    # save 0.16-0.23 s vs 56-103 s prefill; tiny models 53 ms vs 30-40 s), so every conversation a
    # client may resume is worth it; below ~1k tokens a prefill is as fast as a save + restore
    # round trip. Was 16,384: cache-pressure's 8k contexts were then lost (docs/decisions.md D3).
    min_tokens: int = 256
    drain_min_tokens: int = 1024     # planned stop: shortest conversation worth a spill
    # a guest's slot (opencode's title request: 541 tokens on the tiny models, 524 of them its
    # fixed system prompt) is spilled when a request overwrites it and it holds at least this many
    # tokens. Not ``min_tokens``: a guest comes back byte for byte (the same title prompt every
    # run), and llama-server alone keeps it in its RAM cache when its slot is overwritten
    # (``--cache-ram``, default 8 GiB; docs/llama-server.md §10): without the spill the next title
    # prefilled 541 tokens where the server alone prefilled 4 (``ocache bench --preset tiny
    # --template real --scenario opencode_pi_alternating --models hybrid``). 256 lets a title
    # in and keeps out the few-dozen-token guests a prefill serves as fast as a restore.
    guest_min_tokens: int = 256
    # guests' entries: one per session and guest (a session's newer guest spill supersedes its
    # older one, never its agent spill), at most this many in all (the least recently used goes):
    # a client's guests share their system prompt, so a few entries serve every later one
    guest_max_entries: int = 8
    ubatch: int = 512                # server -ub: tolerance when confirming a restore by cache_n
    restore_bytes_s: float = 5e8     # initial guess until measured (server restore)
    verify_bytes_s: float = 2e9      # initial guess until measured (xxh3 of the files)
    resume: bool = True              # restore the most recent conversation after a drained stop
    # live saves (ocache.tiers.live): "remote" (when store.remote is configured), "on" or "off"
    live_save: str = "remote"
    # seconds without a planned request after a turn before its live save: an agent's next request
    # comes within milliseconds (its tool loop is not saved at every step), a person reads first;
    # the same wait as exact mode's idle warm-up (ocache.cache.exact.EXACT_QUIET_S)
    live_quiet_s: float = 1.0
    # a lookup waits at most this long for an eviction's spill of tokens it shares (the save plus
    # the commit: 53-55 ms + 117-128 ms for 16k tokens on the tiny models, measured in
    # ocache/tiers/spill.py's module docstring)
    inflight_wait_s: float = 5.0


@dataclass
class SlotSeen:
    """What ``admit`` saw on a slot: the slot table's ``seq`` then, the session identity, and the
    prompt length (tokens) the conversation was last sent."""

    seq: int
    session: str | None
    prompt_n: int
    kind: str | None
    owner: str | None
    head_key: str | None
    #: the response was cut short (``SessionTier.interrupted``): the slot holds the prompt plus a
    #: partial answer
    partial: bool = False
    #: token position of the prompt's first user message (None: unknown, a raw route): what
    #: precedes it is the conversation's *mode* (system prompt, tools)
    first_user: int | None = None


def is_guest(meta: Any) -> bool:
    """Whether a session entry's record (``Entry.meta``) is a guest's spill (``kind`` ``guest``):
    guests' entries are read by guests only and the others' by the others (``SessionTier.lookup``),
    and each class supersedes only its own (``SpillPolicy.superseded``)."""
    return isinstance(meta, dict) and meta.get("kind") == "guest"


class SpillPolicy:
    """The session tier's rules over ``cfg`` (:class:`SpillConfig`). ``st``: a slot's
    ``ocache.slots.SlotState``; ``seen``: the tier's :class:`SlotSeen` of that slot (None: not
    seen); ``tokens_of(key)``: an entry's stored token ids (raises one of ``UNREADABLE`` when it cannot be
    read)."""

    def __init__(self, cfg: SpillConfig) -> None:
        self.cfg = cfg

    def spillable(self, st: Any, seen: SlotSeen | None) -> tuple[bool, str]:
        """Whether the slot may be spilled, and why not: unknown or foreign content, an unfinished
        response (or a cut one whose length ``GET /slots`` has not read yet), a warmed head or
        origin, a slot the tier did not see finish (its ``seq`` differs from ``seen``'s)."""
        if not st.tokens or st.foreign:
            return False, "unknown content"
        if st.pending:
            if st.interrupted and seen is not None and seen.partial and seen.seq == st.seq:
                return False, "answer cut short, its length not read yet (GET /slots)"
            return False, "response not finished"
        if st.kind not in ("agent", "other", "guest") or st.origin:
            return False, f"kind {st.kind}"
        if seen is None or seen.seq != st.seq:
            return False, "not seen complete"
        return True, ""

    def min_tokens(self, kind: str | None, reason: str) -> int | None:
        """The shortest slot of ``kind`` worth a spill for ``reason`` (``evict``/``drain``/``live``),
        or None when it is never spilled then: a guest only on eviction, from ``guest_min_tokens`` (a
        planned stop loses the guest as it loses the server's own RAM cache; a live save is for the
        conversation a crash would lose); a live save from ``min_tokens``, as an eviction."""
        if kind == "guest":
            return self.cfg.guest_min_tokens if reason == "evict" else None
        return self.cfg.min_tokens if reason in ("evict", "live") else self.cfg.drain_min_tokens

    def will_spill(self, st: Any, seen: SlotSeen | None) -> bool:
        """Whether an eviction now would spill the slot (spillable and at least ``min_tokens``
        long, ``guest_min_tokens`` for a guest)."""
        least = self.min_tokens(st.kind, "evict")
        return (self.spillable(st, seen)[0] and least is not None
                and max(int(st.n_total or 0), len(st.tokens)) >= least)

    def same_content(self, entries: Iterable[Entry], tokens_of: Callable[[str], list[int]],
                     slot_tokens: Sequence[int], n: int, seen: SlotSeen) -> str | None:
        """The key of an entry holding exactly the slot's ``n`` tokens (``slot_tokens`` what ocache
        sent it): the same session's (same class), or for a guest any guest's (two runs' identical
        title requests leave the same state); None when there is none."""
        guest = seen.kind == "guest"
        for e in entries:
            if e.n_tokens != n or is_guest(e.meta) != guest:
                continue
            if not guest and e.meta.get("session") != seen.session:
                continue
            try:
                toks = tokens_of(e.key)
            except UNREADABLE:
                continue
            if toks[:len(slot_tokens)] == list(slot_tokens) and len(toks) == n:
                return e.key
        return None

    def superseded(self, new: Entry, tokens: Sequence[int], entries: Iterable[Entry],
                   tokens_of: Callable[[str], list[int]]) -> list[Entry]:
        """The older spills a newly committed one (``new``, its ``tokens``) supersedes: its
        session's (same identity; without one, only an older spill whose tokens are a prefix of
        it), within its class: a guest's spill (opencode's title shares its session key with the
        agent turns) never supersedes the session's agent spill, nor the other way round. An agent
        spill of the same session in another mode (the two part before the older one's first user
        message, ``meta["first_user"]``: another system prompt or tool set) is not superseded: the
        client may switch back (``ocache.tiers.resident.departs_before_user``)."""
        guest, session = is_guest(new.meta), new.meta.get("session")
        out = []
        for old in entries:
            if old.key == new.key or is_guest(old.meta) != guest:
                continue
            same = session is not None and old.meta.get("session") == session
            if same and not guest and old.meta.get("first_user") is not None:
                try:
                    same = common_prefix(tokens_of(old.key), tokens) >= int(old.meta["first_user"])
                except UNREADABLE:
                    same = False
            if not same and old.meta.get("session") is None and session is None:
                try:
                    same = tokens_of(old.key) == list(tokens[:old.n_tokens])
                except UNREADABLE:
                    same = False
            if same:
                out.append(old)
        return out

    def guests_over(self, new: Entry, entries: Iterable[Entry]) -> list[Entry]:
        """The guests' spills to drop once ``new`` (a guest's) is kept: the least recently used
        beyond ``guest_max_entries`` in all."""
        guests = sorted((x for x in entries if is_guest(x.meta) and x.key != new.key), key=lambda x: x.last_used)
        return guests[:max(0, len(guests) + 1 - self.cfg.guest_max_entries)]

    def offer_floor(self, guest: bool, head_end: int) -> int:
        """Tokens a spill must reuse past to be offered: a request's harness head (``head_end``: a
        head is the disk/head tiers' business); a guest has none the other tiers keep, so its floor
        is a useful reuse (the resident ranking's ``SlotChoice.min_useful``), below which a shared
        ``<|im_start|>system`` line would be offered."""
        return min(64, self.cfg.ubatch) if guest else head_end

    def matches(self, e: Entry, stored_n: int, lcp: int, skey: str | None) -> bool:
        """Without a session identity (``skey`` None) a request must contain the whole prompt the
        conversation was last sent, within one ubatch (the resident tier's "same conversation");
        ``lcp``: the tokens it shares with entry ``e`` (``stored_n`` tokens)."""
        return skey is not None or lcp >= int(e.meta.get("prompt_n") or stored_n) - self.cfg.ubatch

    @staticmethod
    def rank(usable: int, e: Entry, skey: str | None) -> tuple[int, bool, int]:
        """An offer's rank (the highest is offered): the longest usable prefix (``usable``, tokens);
        on a tie the request's own session's entry, then the smaller file (the cheaper read)."""
        return (usable, skey is not None and e.meta.get("session") == skey, -e.bytes)

    @staticmethod
    def resume_choice(recent: Sequence[tuple[float, str, int]], slots_by_use: Sequence[int]) -> str | None:
        """The conversation a drained stop resumes: of the committed non-guest spills ``recent``
        (``(time, key, slot)``, in spill order), the one of the slot used last (``slots_by_use``:
        slot ids, most recently used first), else the latest spill; None when there is none."""
        if not recent:
            return None
        by_slot = {s: k for _, k, s in recent}
        return next((by_slot[s] for s in slots_by_use if s in by_slot), recent[-1][1])
