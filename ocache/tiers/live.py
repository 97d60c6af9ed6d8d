"""Live saves: a live conversation's slot saved at idle after each completed turn, so that a crash
of the host (``kill -9``, power) loses at most the turn in flight (``tiers.session.live_save``).

Without them a conversation reaches the store, and so the remote bucket, only when it is spilled
(evicted, drained) or anchored: after a crash another host of the same bucket restores the last
anchor and prefills the rest of the conversation again.

When
    The session tier notes each completed turn (``SessionTier.admit``: the slot and its ``seq``).
    :class:`LiveSaves` then waits until no completion is in flight on this ocache (``generating``:
    the proxy brackets every completion from its arrival to its last byte relayed, on every
    upstream, ``Upstream.generation``), then ``quiet_s`` seconds more during which no request is
    planned (:meth:`LiveSaves.arrived`, called by the cache layer's plan: an agent's next request
    comes within milliseconds, so its tool loop is not saved at every step, only when it pauses).
    Then each noted slot whose content is still that ``seq``, that is not leased (a request uses
    it) and was not saved at that ``seq`` already is spilled (``SessionTier._spill`` with reason
    ``live``, the session tier's checks, budget and commit; the same content already stored is not
    written again). The committed entry supersedes the session's older spill, and the remote tier's
    sync uploads it with its session pointer (``ocache.tiers.remote``). So a conversation is saved
    at most once per turn, only when it changed, and never while a request is in flight.

Cost
    llama-server runs a save on its task loop (``SERVER_TASK_TYPE_SLOT_SAVE``,
    tools/server/server-context.cpp:2750-2800 of the pinned source: the slot's tokens serialised and
    its state written by ``llama_state_seq_save_file``, then the checkpoint sidecar; the slot itself
    is not changed, and a slot that is processing defers the task): no slot decodes meanwhile. Saves
    are therefore made only when nothing is in flight; a request that arrives during one waits at
    most that save (the figures: docs/benchmarks.md, "a crash loses at most the last turn"). A save
    prefills nothing and leaves the slot as it was, so the server's later reuse is unchanged.

A planned stop (:meth:`LiveSaves.stop`) and a server restart (:meth:`LiveSaves.forget`) end them;
the drain spills what is left as before.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

from ocache.background import Background

log = logging.getLogger("ocache.spill")

#: values of ``tiers.session.live_save``: ``remote`` (when ``store.remote`` is configured), on, off
LIVE_MODES = ("remote", "on", "off")
#: seconds a live save waits for a busy server at a time before it looks again (bounded waits)
BUSY_WAIT_S = 30.0
#: seconds a live save waits for its slot's lease (a slot leased that long is in use: skipped)
LEASE_WAIT_S = 0.5


def live_mode(value: Any) -> str:
    """``tiers.session.live_save`` as one of :data:`LIVE_MODES`: booleans and ``true``/``false``
    mean ``on``/``off``. Raises ValueError for another value."""
    if value is None:
        return "remote"
    if isinstance(value, bool):
        return "on" if value else "off"
    v = str(value).strip().lower()
    v = {"true": "on", "yes": "on", "false": "off", "no": "off"}.get(v, v)
    if v not in LIVE_MODES:
        raise ValueError(f"tiers.session.live_save: {value!r} is not one of remote, true, false")
    return v


class LiveSaves:
    """The live saves of one session tier (see the module docstring).

    ``spill(slot)``: spills ``slot`` (the caller holds its lease), returns the entry key or None;
    ``table``: the slot table (``[slot].seq``, ``lock``, ``lease``); ``quiet_s``: seconds without a
    planned request before a save; ``counters``: the tier's (``live_*`` added). Off until
    :meth:`enable`."""

    def __init__(self, spill: Callable[[int], Awaitable[str | None]], table: Any, *, quiet_s: float,
                 counters: dict[str, int]) -> None:
        self.spill = spill
        self.table = table
        self.quiet_s = max(0.0, float(quiet_s))
        self.counters = counters
        for k in ("live_saves", "live_unchanged", "live_deferred", "live_skipped_busy", "live_failed"):
            counters.setdefault(k, 0)
        self.enabled = False
        self.background = Background("session")
        self.generating: Callable[[], int] = lambda: 0
        self.quiet: Callable[[float], Awaitable[bool]] | None = None
        self._due: dict[int, int] = {}      # slot -> seq of its last completed turn, not saved yet
        self._saved: dict[int, int] = {}    # slot -> seq saved last
        self._arrival = asyncio.Event()
        self._saving = False
        self._stopped = False
        self.save_s: list[float] = []       # seconds of each live save (lease to commit spawned)

    def enable(self, generating: Callable[[], int], quiet: Callable[[float], Awaitable[bool]] | None) -> None:
        """Turn live saves on. ``generating()``: completions in flight now; ``quiet(t)``: waits
        until none is, at most ``t`` seconds (``Upstream.quiet``)."""
        self.generating, self.quiet = generating, quiet
        self.enabled = True

    def note(self, slot: int, seq: int) -> None:
        """A turn completed on ``slot``, which now holds content ``seq``: save it at the next idle
        moment unless that content was saved already."""
        if not self.enabled or self._stopped or self._saved.get(slot) == seq:
            return
        self._due[slot] = seq
        if not any(not t.done() for t in self.background.tasks):   # (a task ended, not yet discarded)
            self.background.spawn(self._run(), "live")

    def arrived(self) -> None:
        """A request is being planned: a save waiting for its quiet period starts it again."""
        self._arrival.set()

    def forget(self) -> None:
        """The server restarted: nothing noted or saved holds any more."""
        self._due.clear()
        self._saved.clear()

    def stop(self) -> None:
        """A planned stop: no live save starts from now on (one being written finishes: the drain
        takes the slot's lease after it)."""
        self._stopped = True
        self._due.clear()
        if not self._saving:
            for t in self.background.tasks:
                t.cancel()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self._due and not self._stopped:
            self._arrival.clear()
            if self.generating() > 0:
                if self.quiet is not None:
                    await self.quiet(BUSY_WAIT_S)
                else:   # (no upstream to wait on: look again after a quiet period)
                    await asyncio.sleep(max(self.quiet_s, 0.1))
                continue
            try:
                await asyncio.wait_for(self._arrival.wait(), self.quiet_s)
            except asyncio.TimeoutError:
                pass
            else:
                self.counters["live_deferred"] += 1
                continue
            # idle: every slot due, one after the other, while no request comes
            while self._due and not self._stopped and not self._arrival.is_set() and self.generating() == 0:
                slot, seq = next(iter(self._due.items()))
                del self._due[slot]
                t0 = loop.time()
                if await self._save(slot, seq):
                    self.save_s.append(loop.time() - t0)

    async def _save(self, slot: int, seq: int) -> bool:
        """Spill ``slot`` if it still holds ``seq``, is not leased and nothing is in flight; True
        when an entry now holds it."""
        try:
            if self.table[slot].seq != seq or self.table.lock(slot).locked():
                self.counters["live_skipped_busy"] += 1   # used since: its next turn is noted again
                return False
            lease = await self.table.lease(slot, LEASE_WAIT_S)
        except (TimeoutError, asyncio.TimeoutError, LookupError, ValueError):
            self.counters["live_skipped_busy"] += 1
            return False
        except Exception as exc:  # noqa: BLE001 - SlotInvalid and the like: nothing to save
            log.info("session: live save of slot %d skipped: %s", slot, exc)
            return False
        self._saving = True
        try:
            if self.table[slot].seq != seq or self.generating() > 0:
                self.counters["live_skipped_busy"] += 1
                return False
            before = self.counters.get("spill_dedup", 0)
            key = await self.spill(slot)
            if key is None:     # skipped or failed: the tier's spill_* counters say why
                return False
            self._saved[slot] = seq
            if self.counters.get("spill_dedup", 0) > before:
                self.counters["live_unchanged"] += 1
            else:
                self.counters["live_saves"] += 1
            return True
        except Exception as exc:  # noqa: BLE001 - a live save never fails a request
            self.counters["live_failed"] += 1
            log.warning("session: live save of slot %d failed: %s: %s", slot, type(exc).__name__, exc)
            return False
        finally:
            self._saving = False
            lease.release()
