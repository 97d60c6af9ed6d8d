"""The store's eviction policy: which saved slot states go first when the disk budget, a kind's
budget or the free-space floor needs room (``ocache.tiers.store.Store``), and what a use or a new
write changes about an entry's claim to stay.

The store owns the entries, the budget arithmetic and the deletions; it asks its policy three
things, always under its own lock (the same split as LMCache's storage backends and their
``update_on_hit`` / ``update_on_put`` / ``get_evict_candidates`` policy objects; the idea, not
their code):

* :meth:`EvictionPolicy.update_on_put`: an entry was just committed (``old``: the entry of the
  same key it replaces, or None);
* :meth:`EvictionPolicy.update_on_hit`: an entry was used (a restore served from it: ``hit``, or
  only touched);
* :meth:`EvictionPolicy.candidates`: the given entries in eviction order, first to go first.
  The store evicts from the front of that list until the bytes fit, and never reorders it.

A policy changes only ``hits``, ``last_used`` and ``created`` of an entry (the record fields the
store persists with every write); it deletes nothing and reads no file.

:class:`ValuePolicy` is the rule ocache uses (docs/architecture.md §3). :func:`make_room` is the
store's budget procedure over a policy's order: what is evicted, and when nothing is.
"""

from __future__ import annotations

from typing import Callable, Iterable, Protocol

from ocache.tiers.entry import DAY_S, BudgetError, Entry


class EvictionPolicy(Protocol):
    """What a :class:`~ocache.tiers.store.Store` asks of its eviction policy (see the module
    docstring). ``now``: Unix seconds (the store's clock)."""

    def update_on_put(self, entry: Entry, old: Entry | None, now: float) -> None:
        """``entry`` was just committed; ``old`` is the entry of the same key it replaces."""

    def update_on_hit(self, entry: Entry, now: float, hit: bool = True) -> None:
        """``entry`` was used at ``now``; ``hit``: a request was served from it (not only touched)."""

    def candidates(self, entries: Iterable[Entry], now: float) -> list[Entry]:
        """``entries`` in eviction order (first to go first)."""
        ...


#: store kind of the session tier's spills (``ocache.tiers.spill``)
SPILL_KIND = "s"
#: a spill never restored loses half its value every hour, and is expired two hours after it was
#: written (``ValuePolicy.expired``): most conversations that are spilled never come back (171
#: spills, 874 MB after 10 minutes of two-turn sessions, ``scripts/bench-spill``), so the bytes of the
#: unreturned ones stay below (spill rate x 2 h): ~10.5 GB at that rate, not the whole 40 GB budget
UNRETURNED_HALF_LIFE_S = 3600.0
UNRETURNED_TTL_S = 2 * 3600.0


class ValuePolicy:
    """Evict by ascending *value*: ``(hits + 1) * n_tokens / bytes * 0.5 ** (idle_s / half_life_s)``,
    the prompt tokens an entry saves per byte of disk, weighted by how often it served and halved
    for every ``half_life_s`` seconds (default one day) since its last use (docs/architecture.md
    §3); a spill never restored (kind ``SPILL_KIND``, no hit) halves every ``unreturned_half_life_s``
    instead and is expired after ``unreturned_ttl_s`` (:meth:`expired`; None: never). A use sets
    ``last_used`` (and counts a hit); a new write of a key starts its idle time again and keeps the
    hits of the entry it replaces. Entries of equal value keep the order they were given in (a
    stable sort: the store passes its entries in insertion order)."""

    def __init__(self, half_life_s: float = DAY_S, *, unreturned_half_life_s: float = UNRETURNED_HALF_LIFE_S,
                 unreturned_ttl_s: float | None = UNRETURNED_TTL_S) -> None:
        if half_life_s <= 0 or unreturned_half_life_s <= 0:
            raise ValueError(f"half lives must be > 0, not {half_life_s}, {unreturned_half_life_s}")
        self.half_life_s = float(half_life_s)
        self.unreturned_half_life_s = float(unreturned_half_life_s)
        self.unreturned_ttl_s = unreturned_ttl_s

    @staticmethod
    def unreturned(entry: Entry) -> bool:
        """A spill no request came back to (never restored)."""
        return entry.kind == SPILL_KIND and entry.hits == 0

    def value(self, entry: Entry, now: float) -> float:
        """The entry's value at ``now`` (tokens per byte, weighted; higher stays longer)."""
        half = self.unreturned_half_life_s if self.unreturned(entry) else self.half_life_s
        halvings = max(0.0, now - entry.last_used) / min(half, self.half_life_s)
        return (entry.hits + 1) * entry.n_tokens / max(1, entry.bytes) * 0.5 ** halvings

    def expired(self, entries: Iterable[Entry], now: float) -> list[Entry]:
        """The unreturned spills written more than ``unreturned_ttl_s`` seconds before ``now``
        (the store deletes them at its next commit)."""
        ttl = self.unreturned_ttl_s
        if ttl is None:
            return []
        return [e for e in entries if self.unreturned(e) and now - e.created > ttl]

    def update_on_put(self, entry: Entry, old: Entry | None, now: float) -> None:
        entry.created = entry.last_used = now
        entry.hits = old.hits if old is not None else 0

    def update_on_hit(self, entry: Entry, now: float, hit: bool = True) -> None:
        entry.last_used = now
        if hit:
            entry.hits += 1

    def candidates(self, entries: Iterable[Entry], now: float) -> list[Entry]:
        return sorted(entries, key=lambda e: self.value(e, now))


def make_room(victims: list[Entry], nbytes: int, *, kind: str | None, budget_bytes: int,
              kind_budget: int | None, floor_bytes: int, used: Callable[[], int],
              kind_used: Callable[[], int], free: Callable[[], int],
              evict: Callable[[Entry], None]) -> None:
    """Evict from the front of ``victims`` (a policy's :meth:`~EvictionPolicy.candidates`, entries
    that may go) until ``nbytes`` more bytes fit: ``used() + nbytes <= budget_bytes``, ``kind_used()
    + nbytes <= kind_budget`` (``kind``'s own budget, None: none) and ``free() - nbytes >=
    floor_bytes`` (0: no floor). ``used``/``kind_used``/``free`` are read again after each
    ``evict(entry)`` (which deletes it); bytes and free space in bytes. When only ``kind``'s budget
    is exceeded, the first victim of that kind goes, else the first of all.

    Feasibility first: raises BudgetError, before evicting anything, when even evicting every victim
    could not make the room (``nbytes`` alone larger than a budget, or the floor out of reach);
    BudgetError also when the victims run out (the measured free space fell short of the sum)."""
    evictable = sum(v.bytes for v in victims)
    if used() - evictable + nbytes > budget_bytes:
        raise BudgetError(f"{nbytes} bytes cannot fit the budget of {budget_bytes}")
    if kind_budget is not None and kind_used() - sum(v.bytes for v in victims if v.kind == kind) + nbytes > kind_budget:
        raise BudgetError(f"{nbytes} bytes cannot fit the {kind!r} budget of {kind_budget}")
    if floor_bytes and free() + evictable - nbytes < floor_bytes:
        raise BudgetError(f"{nbytes} bytes would break the free-space floor of {floor_bytes}")
    victims = list(victims)
    while True:
        over_kind = kind_budget is not None and kind_used() + nbytes > kind_budget
        over_budget = used() + nbytes > budget_bytes
        under_floor = bool(floor_bytes) and free() - nbytes < floor_bytes
        if not (over_kind or over_budget or under_floor):
            return
        pool = [v for v in victims if v.kind == kind] if over_kind and not (over_budget or under_floor) else victims
        if not pool:
            raise BudgetError(f"cannot make room for {nbytes} bytes")
        v = pool[0]
        victims.remove(v)
        evict(v)


def next_eviction(order: list[Entry], now: float) -> dict | None:
    """The first entry of a policy's ``order`` (the next to go) as ``Store.stats`` shows it: key
    (16 characters), kind, tokens, bytes, hits, seconds idle at ``now`` (Unix seconds) and its
    meta without the checkpoints; None when there is none."""
    if not order:
        return None
    e = order[0]
    return {"key": e.key[:16], "kind": e.kind, "n_tokens": e.n_tokens, "bytes": e.bytes, "hits": e.hits,
            "idle_s": round(max(0.0, now - e.last_used), 1),
            "meta": {k: v for k, v in e.meta.items() if k != "checkpoints"}}
