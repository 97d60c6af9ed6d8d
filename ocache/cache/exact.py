"""Exact mode's idle warm-up (``tiers.resident.align: exact``, docs/decisions.md D11): after a turn
that ended without a tool call, the next request's predictable prefix is prefilled on the slot while
the server is idle, so the new user message prefills only its own tokens and every prompt served is
the template's. Owned by the align route (``AlignRoute.warmups``), which schedules it from its
``observe``; the layer cancels it when any request arrives."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any, Callable, Mapping

from ocache.align import fields_of
from ocache.cache.ports import PlanningServices
from ocache.slots import SlotTable

log = logging.getLogger("ocache.cache")

#: the user text of the probe turn exact mode renders to find where the next user message starts
EXACT_PROBE = "ocache-next-user-probe"
#: seconds without a request after an ended turn before exact mode warms the next prompt (an agent
#: sends its next request within milliseconds; a person reads the answer first)
EXACT_QUIET_S = 1.0


class ExactWarmups:
    """The warm-ups in flight, one per slot at most. ``counters``: the align route's (``exact_*``);
    ``forget_record(slot)``: drops the align route's record of a slot the warm-up rewrote."""

    def __init__(self, counters: Counter[str], forget_record: Callable[[int], object]) -> None:
        self.counters = counters
        self.forget_record = forget_record
        self._warms: dict[int, asyncio.Task[None]] = {}

    def schedule(self, layer: PlanningServices, slot: int, seq: int, body: Mapping, message: Mapping) -> None:
        """Start :meth:`warm` for ``slot`` unless one runs there already."""
        if slot in self._warms:
            return
        task = asyncio.ensure_future(self.warm(layer, slot, seq, body, message))
        self._warms[slot] = task

        def done(_t: asyncio.Task[None], s: int = slot) -> None:
            self._warms.pop(s, None)

        task.add_done_callback(done)

    async def warm(self, layer: PlanningServices, slot: int, seq: int, body: Mapping, message: Mapping) -> None:
        """Exact mode, after a turn that ended without a tool call on ``slot`` (whose content was
        ``seq``): render the next request's predictable prefix (the conversation, the answer as
        content alone, a new user message up to its text: the templates that rewrite a history drop
        past reasoning at a new user message, whoever sends it) and prefill it on the slot, so the
        next user message prefills only its own tokens and the prompt served is the template's.
        Priced like any warm-up: only while no slot is busy, never when the slot changed, cancelled
        by an arriving request (:meth:`cancel`), counted (``exact_warm_tokens``: the server
        prefilled them, its counter too). Never raises."""
        table: SlotTable | None = layer.table
        if table is None:
            return
        try:
            # the client's own next request (an agent's) comes at once: only a quiet server is
            # taken for the user's think time (a policy delay, cancelled by any request)
            await asyncio.sleep(EXACT_QUIET_S)
            msgs = list(body.get("messages") or []) + [{"role": "assistant", "content": message.get("content") or ""},
                                                      {"role": "user", "content": EXACT_PROBE}]
            payload = {**fields_of(body), "messages": msgs, "add_generation_prompt": True}
            text = (await layer.viewer.post("/apply-template", payload)).get("prompt")
            at = text.find(EXACT_PROBE) if isinstance(text, str) else -1
            if not isinstance(text, str) or at <= 0:
                self.counters["exact_skipped_render"] += 1
                return
            tokens = await layer.viewer.tokenize(text[:at])
            st = table[slot]
            if st.seq != seq or st.pending or any(s.busy for s in table.snapshot()):
                self.counters["exact_skipped_busy"] += 1
                return
            lease = await table.lease(slot, 0.5)
        except (asyncio.CancelledError, TimeoutError):
            self.counters["exact_skipped_busy"] += 1
            return
        except Exception as exc:   # noqa: BLE001 - a warm-up never fails a request
            self.counters["exact_failed"] += 1
            log.warning("exact: the next prompt of slot %d was not warmed: %s: %s", slot, type(exc).__name__, exc)
            return
        try:
            st = table[slot]
            if st.seq != seq:
                self.counters["exact_skipped_busy"] += 1
                return
            owner, kind, head_key = st.owner, st.kind, st.head_key
            timings = await table.warm(slot, tokens, user_starts=[u for u in st.user_starts if u < len(tokens)])
            table.adopt(slot, owner=owner, kind=kind, head_key=head_key)
            self.forget_record(slot)    # the slot holds the template's prompt now, not the record's ids
            self.counters["exact_warms"] += 1
            self.counters["exact_warm_tokens"] += int(timings.get("prompt_n") or 0)
            log.info("exact: slot %d holds the next prompt's %d-token prefix (prefilled %s at idle)",
                     slot, len(tokens), timings.get("prompt_n"))
        except asyncio.CancelledError:
            table.mark_unknown(slot)        # stopped part way: GET /slots says what it holds
            self.counters["exact_cancelled"] += 1
            raise
        except Exception as exc:   # noqa: BLE001
            table.mark_unknown(slot)
            self.counters["exact_failed"] += 1
            log.warning("exact: warming slot %d failed: %s: %s", slot, type(exc).__name__, exc)
        finally:
            lease.release()

    async def cancel(self) -> None:
        """An arriving request cancels every exact-mode warm-up in flight (bounded wait for each
        to let its slot go)."""
        tasks = [t for t in self._warms.values() if not t.done()]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
