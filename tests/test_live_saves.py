"""Live saves' scheduling (``ocache.tiers.live.LiveSaves``) against a stand-in slot table and
spill, no server: once a turn and only when the slot changed, never while a completion is in flight,
a request arriving in the quiet period defers it, a slot used since is not saved, a planned stop
ends them. The real save, upload and restore: tests/test_remote_crash.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from ocache.tiers.live import LiveSaves, live_mode

QUIET_S = 0.01
BOUND_S = 10.0


class Table:
    """``[slot].seq``, ``lock(slot)`` and ``lease(slot, timeout)`` of ``ocache.slots.SlotTable``."""

    def __init__(self, n: int = 2) -> None:
        self.slots = [SimpleNamespace(seq=1) for _ in range(n)]
        self.locks = [asyncio.Lock() for _ in range(n)]

    def __getitem__(self, slot: int):
        return self.slots[slot]

    def lock(self, slot: int) -> asyncio.Lock:
        return self.locks[slot]

    async def lease(self, slot: int, timeout_s: float):
        async with asyncio.timeout(timeout_s):
            await self.locks[slot].acquire()
        return SimpleNamespace(release=self.locks[slot].release)


def saves(table: Table, generating=lambda: 0, quiet=None) -> tuple[LiveSaves, list[tuple[int, int]]]:
    """Live saves over ``table`` whose spill records ``(slot, seq)`` and checks it holds the lease."""
    done: list[tuple[int, int]] = []

    async def spill(slot: int) -> str:
        assert table.lock(slot).locked()
        done.append((slot, table[slot].seq))
        return f"key-{slot}-{table[slot].seq}"

    live = LiveSaves(spill, table, quiet_s=QUIET_S, counters={})
    live.enable(generating, quiet)
    return live, done


async def settled(live: LiveSaves) -> None:
    await asyncio.wait_for(live.background.join(), BOUND_S)


async def test_a_slot_is_saved_once_a_turn_and_only_when_it_changed():
    table = Table()
    live, done = saves(table)
    table[0].seq = 2
    live.note(0, 1)
    live.note(0, 2)          # two turns before the server was quiet: one save, of the latest
    await settled(live)
    assert done == [(0, 2)] and live.counters["live_saves"] == 1
    live.note(0, 2)          # the same content noted again: nothing to write
    await settled(live)
    assert done == [(0, 2)]
    table[0].seq = 3
    live.note(0, 3)
    live.note(1, 1)
    await settled(live)
    assert sorted(done) == [(0, 2), (0, 3), (1, 1)]


async def test_a_request_arriving_in_the_quiet_period_defers_the_save():
    table = Table()
    calls = []

    def generating() -> int:
        calls.append(1)
        if len(calls) == 1:
            live.arrived()   # a request planned while the save waits for its quiet period
        return 0

    live, done = saves(table, generating)
    live.note(0, 1)
    await settled(live)
    assert live.counters["live_deferred"] == 1 and done == [(0, 1)]


async def test_no_save_while_a_completion_is_in_flight():
    table = Table()
    busy = {"n": 1}
    waited = []

    async def quiet(timeout_s: float) -> bool:
        waited.append(timeout_s)
        busy["n"] = 0        # the request in flight ended
        return True

    live, done = saves(table, lambda: busy["n"], quiet)
    live.note(0, 1)
    await settled(live)
    assert waited and done == [(0, 1)]


async def test_a_slot_used_since_or_leased_is_not_saved():
    table = Table()
    live, done = saves(table)
    table[0].seq = 2         # the next request already replaced the noted content
    live.note(0, 1)
    await settled(live)
    assert done == [] and live.counters["live_skipped_busy"] == 1
    await table.locks[1].acquire()   # a request holds the slot
    live.note(1, 1)
    await settled(live)
    table.locks[1].release()
    assert done == [] and live.counters["live_skipped_busy"] == 2


async def test_a_planned_stop_ends_them_and_a_restart_forgets():
    table = Table()
    live, done = saves(table)
    live.note(0, 1)
    await settled(live)
    live.forget()            # a new server process: the same seq is new content
    live.note(0, 1)
    await settled(live)
    assert done == [(0, 1), (0, 1)]
    live.stop()
    live.note(1, 1)
    await settled(live)
    assert done == [(0, 1), (0, 1)] and not live.background


async def test_off_until_enabled():
    table = Table()
    live = LiveSaves(lambda slot: None, table, quiet_s=QUIET_S, counters={})   # type: ignore[arg-type]
    live.note(0, 1)
    assert not live.background


def test_live_mode():
    assert [live_mode(v) for v in (None, True, False, "remote", "true", "off")] == \
        ["remote", "on", "off", "remote", "on", "off"]
    with pytest.raises(ValueError, match="live_save"):
        live_mode("sometimes")


async def test_a_request_arriving_during_a_round_stops_it():
    """Two slots due: a request arrives while the first is saved; the second waits for the next
    quiet period (the arrival seen then is cleared), it is not saved in the same round."""
    table = Table()
    seen: list[tuple[int, bool]] = []

    async def spill(slot: int) -> str:
        seen.append((slot, live._arrival.is_set()))
        if slot == 0:
            live.arrived()
        return f"key-{slot}"

    live = LiveSaves(spill, table, quiet_s=QUIET_S, counters={})
    live.enable(lambda: 0, None)
    live.note(0, 1)
    live.note(1, 1)
    await settled(live)
    assert seen == [(0, False), (1, False)], seen
