"""Unit tests of the store's eviction policy (``ocache/tiers/evict.py``) and of the store's use of
the policy object it is given: no server. Entries are plain :class:`ocache.tiers.entry.Entry`
values for the pure parts; the store tests write slot files in llama-server's layout
(``tests/test_store.py`` helpers)."""

from __future__ import annotations

import pytest

from ocache.tiers.entry import DAY_S, BudgetError, Entry, FileInfo
from ocache.tiers.evict import ValuePolicy, make_room
from test_store import Clock, make_store, put

NOW = 1_700_000_000.0


def entry(name: str, *, n: int = 400, nbytes: int = 8_000, hits: int = 0, idle_days: float = 0.0,
          kind: str = "a") -> Entry:
    return Entry(key=name, kind=kind, identity="id-A", fingerprint=None, n_tokens=n,
                 files={"bin": FileInfo(f"oc-{kind}-{name}.bin", nbytes, "0" * 16)},
                 created=NOW - 10 * DAY_S, last_used=NOW - idle_days * DAY_S, hits=hits)


# ------------------------------------------------------------------------------ the value rule


def test_candidates_go_in_ascending_value():
    p = ValuePolicy()
    es = [entry("fresh"), entry("popular", hits=3), entry("stale", idle_days=2.0),
          entry("long", n=800), entry("popular_old", hits=3, idle_days=3.0), entry("fat", nbytes=32_000)]
    # (hits + 1) * tokens / bytes * 0.5 ** days: fresh 0.05, popular 0.2, stale 0.0125,
    # long 0.1, popular_old 0.025, fat 0.0125 (ties with stale: given order kept)
    assert [e.key for e in p.candidates(es, NOW)] == ["stale", "fat", "popular_old", "fresh", "long", "popular"]
    assert p.value(es[0], NOW) == pytest.approx(400 / 8_000)
    assert p.value(es[2], NOW) == pytest.approx(400 / 8_000 / 4)


def test_a_hit_raises_the_value_and_an_unused_day_halves_it():
    p = ValuePolicy()
    a, b = entry("a"), entry("b")
    assert [e.key for e in p.candidates([a, b], NOW)] == ["a", "b"]      # a tie: given order
    v0 = p.value(a, NOW)
    p.update_on_hit(a, NOW)
    assert a.hits == 1 and a.last_used == NOW
    assert p.value(a, NOW) == pytest.approx(2 * v0)
    assert [e.key for e in p.candidates([a, b], NOW)] == ["b", "a"]
    assert p.value(a, NOW + DAY_S) == pytest.approx(p.value(a, NOW) / 2)
    # a touch that is not a hit restarts the idle time and counts nothing
    p.update_on_hit(b, NOW + DAY_S, hit=False)
    assert b.hits == 0 and b.last_used == NOW + DAY_S
    assert p.value(b, NOW + DAY_S) == pytest.approx(v0)


def test_ties_keep_the_given_order_and_a_shorter_half_life_weighs_idle_time_more():
    p = ValuePolicy()
    es = [entry(f"e{i}") for i in range(5)]
    assert [e.key for e in p.candidates(es, NOW)] == ["e0", "e1", "e2", "e3", "e4"]
    assert [e.key for e in p.candidates(es[::-1], NOW)] == ["e4", "e3", "e2", "e1", "e0"]
    popular_old, fresh = entry("popular_old", hits=3, idle_days=1.0), entry("fresh")
    # a day's half-life: 4 * 0.5 = 2 > 1, the popular entry stays; an hour's: 4 * 0.5 ** 24 < 1
    assert [e.key for e in ValuePolicy().candidates([popular_old, fresh], NOW)] == ["fresh", "popular_old"]
    assert [e.key for e in ValuePolicy(3600.0).candidates([popular_old, fresh], NOW)] == ["popular_old", "fresh"]
    with pytest.raises(ValueError):
        ValuePolicy(0)


def test_a_new_write_keeps_the_hits_of_the_entry_it_replaces():
    p = ValuePolicy()
    old, new = entry("k", hits=5, idle_days=3.0), entry("k", idle_days=9.0)
    p.update_on_put(new, old, NOW)
    assert (new.hits, new.created, new.last_used) == (5, NOW, NOW)
    first = entry("j", hits=2)
    p.update_on_put(first, None, NOW)
    assert first.hits == 0


# ------------------------------------------------------------------------------ the budget procedure


class Disk:
    """The state ``make_room`` reads back after each eviction: entries held, bytes used, free space."""

    def __init__(self, entries: list[Entry], free: int = 10**12) -> None:
        self.held = {e.key: e for e in entries}
        self.free_bytes = free
        self.evicted: list[str] = []

    def used(self) -> int:
        return sum(e.bytes for e in self.held.values())

    def kind_used(self, kind: str):
        return lambda: sum(e.bytes for e in self.held.values() if e.kind == kind)

    def free(self) -> int:
        return self.free_bytes

    def evict(self, e: Entry) -> None:
        del self.held[e.key]
        self.free_bytes += e.bytes
        self.evicted.append(e.key)


def room(disk: Disk, nbytes: int, budget: int, *, kind: str | None = None, kind_budget: int | None = None,
         floor: int = 0) -> None:
    victims = ValuePolicy().candidates(list(disk.held.values()), NOW)
    make_room(victims, nbytes, kind=kind, budget_bytes=budget, kind_budget=kind_budget, floor_bytes=floor,
              used=disk.used, kind_used=disk.kind_used(kind or ""), free=disk.free, evict=disk.evict)


def test_make_room_evicts_the_front_of_the_order_until_the_bytes_fit():
    disk = Disk([entry("fresh"), entry("stale", idle_days=2.0), entry("popular", hits=3), entry("old", idle_days=1.0)])
    room(disk, 9_000, budget=40_000)                 # 32,000 used: 1,000 over -> one entry goes
    assert disk.evicted == ["stale"]
    room(disk, 20_000, budget=40_000)                # 24,000 used: 4,000 over -> the next one only
    assert disk.evicted == ["stale", "old"]
    assert disk.used() + 20_000 <= 40_000
    room(disk, 0, budget=40_000)                     # fits: nothing goes
    assert disk.evicted == ["stale", "old"]


def test_make_room_refuses_before_evicting_when_it_cannot_fit():
    disk = Disk([entry("a"), entry("b")])
    with pytest.raises(BudgetError):
        room(disk, 40_001, budget=40_000)            # larger than the whole budget
    with pytest.raises(BudgetError):
        room(disk, 1_000, budget=40_000, floor=disk.free_bytes + 16_001)   # floor out of reach
    assert disk.evicted == [] and set(disk.held) == {"a", "b"}


def test_make_room_keeps_a_kinds_budget_by_evicting_that_kind_first():
    disk = Disk([entry("anchor_low", idle_days=3.0), entry("spill_1", kind="s"), entry("spill_2", kind="s", hits=1)])
    # only the session kind is over its own budget: its lowest goes, not the lower anchor
    room(disk, 8_000, budget=100_000, kind="s", kind_budget=16_000)
    assert disk.evicted == ["spill_1"]
    with pytest.raises(BudgetError):
        room(disk, 16_001, budget=100_000, kind="s", kind_budget=16_000)
    assert disk.evicted == ["spill_1"]


def test_make_room_keeps_the_free_space_floor():
    disk = Disk([entry("a", idle_days=1.0), entry("b"), entry("c", hits=1)], free=20_000)
    room(disk, 10_000, budget=10**9, floor=18_000)   # 20,000 - 10,000 < 18,000: 8,000 more needed
    assert disk.evicted == ["a"]
    assert disk.free() - 10_000 >= 18_000


# ------------------------------------------------------------------------------ the store's policy object


class NewestFirst(ValuePolicy):
    """A policy that evicts the most recently created entry first, and records what it was told."""

    def __init__(self) -> None:
        super().__init__()
        self.puts: list[tuple[str, bool]] = []
        self.hits: list[str] = []

    def update_on_put(self, entry: Entry, old: Entry | None, now: float) -> None:
        super().update_on_put(entry, old, now)
        self.puts.append((entry.key, old is not None))

    def update_on_hit(self, entry: Entry, now: float, hit: bool = True) -> None:
        super().update_on_hit(entry, now, hit)
        self.hits.append(entry.key)

    def candidates(self, entries, now):
        return sorted(entries, key=lambda e: -e.created)


def test_the_store_evicts_in_the_order_of_the_policy_it_is_given(tmp_path):
    clock = Clock()
    policy = NewestFirst()
    s = make_store(tmp_path, clock=clock, budget_bytes=3 * 6_000, policy=policy)
    es = []
    for i in range(3):
        clock.t += 60
        es.append(put(s, list(range(1000 * (i + 1), 1000 * (i + 1) + 100)), state_bytes=5_000, ckpt=False, seed=i))
    assert [k for k, _ in policy.puts] == [e.key for e in es]
    s.touch(es[0].key)
    assert policy.hits == [es[0].key] and s.get(es[0].key).hits == 1
    # the value rule would evict the untouched oldest (es[1]); this policy evicts the newest
    assert s.stats()["next_eviction"]["key"] == es[2].key[:16]
    clock.t += 60
    e4 = put(s, list(range(9000, 9100)), state_bytes=5_000, ckpt=False, seed=9)
    assert s.get(es[2].key) is None and all(s.get(e.key) is not None for e in (es[0], es[1], e4))
    assert s.used_bytes() <= s.budget_bytes
    assert s.evict(1) == e4.bytes and s.get(e4.key) is None


def test_the_default_policy_is_the_value_rule(tmp_path):
    s = make_store(tmp_path)
    assert type(s.policy) is ValuePolicy and s.policy.half_life_s == DAY_S


def test_a_session_spill_supersedes_its_older_spill_of_the_same_mode_only():
    """``SpillPolicy.superseded``: a session's newer agent spill deletes its older one when both
    share the part before the older one's first user message (the system prompt and tools), and
    keeps one of another mode (another tool set: the client may switch back); a spill recorded
    without ``first_user`` (an older store) is superseded by the session alone, as before."""
    from ocache.tiers.spill_policy import SpillConfig, SpillPolicy

    def spill(key, tokens, **meta):
        return Entry(key, "s", "id", None, len(tokens), {}, 0.0, 0.0,
                     meta={"session": "S", "kind": "agent", **meta}, tokens=list(tokens))

    mode_a = list(range(100))
    mode_b = list(range(40)) + [999] * 60
    old_same = spill("o1", mode_a + [1, 2, 3], first_user=50)
    old_other = spill("o2", mode_b + [4, 5], first_user=50)
    old_unknown = spill("o3", mode_b + [6])
    other_session = spill("o4", mode_a + [7], first_user=50, session="T")
    new = spill("n", mode_a + [1, 2, 3, 8, 9], first_user=50)
    toks = {e.key: e.tokens for e in (old_same, old_other, old_unknown, other_session, new)}
    gone = SpillPolicy(SpillConfig()).superseded(new, new.tokens, [old_same, old_other, old_unknown, other_session, new],
                                                toks.__getitem__)
    assert sorted(e.key for e in gone) == ["o1", "o3"]
