"""The slot table: what each llama-server slot holds, and the slot calls that change it.

llama-server reuses a prompt only against the slot it lands on (``docs/llama-server.md``
§9-§11; the § numbers below refer to that file), so ocache keeps its own belief of every slot:

* ``tokens``: the prompt token ids ocache last sent to the slot (or warmed/restored into it). The
  server holds these plus the generated tokens minus the last one (docs/llama-server.md §7); ocache never sees
  the generated ids, so they are only counted (``n_total``).
* ``n_total``: tokens the server says the slot holds (``GET /slots`` ``n_prompt_tokens``,
  docs/llama-server.md §4) or ``len(prompt) + predicted_n - 1`` from a response's ``timings``; ``None`` = unknown
  (a restored slot reports no ``n_prompt_tokens`` at all: unknown, not 0).
* ``checkpoints``: the *predicted* context-checkpoint positions of a hybrid/recurrent model,
  simulated with the server's own placement rules (docs/llama-server.md §14, server-context.cpp:3501-3616 and
  ``create_checkpoint`` :2290-2354). They decide how much of a slot a diverging prompt can reuse
  (docs/llama-server.md §15). The server never reports them; the prediction is checked against every response's
  ``cache_n`` by the cache layer.
* owner session key, request kind (agent / guest / other / head), last use, one ``asyncio.Lock``.

The table is the only writer of this state: the cache layer and the tiers change a slot through
its slot calls (``warm``, ``save``, ``restore``, ``erase``) and its verbs (``assign``, ``finish``,
``interrupted``, ``mark_origin``, ``mark_head``, ``adopt``, ``mark_unknown``, ``forget``).

Only a slot whose lock ocache holds is ever pinned with ``id_slot`` (a pinned *busy* slot with the
RAM cache on can be overwritten by the server, docs/llama-server.md §9 "Hazard"). The table is reconciled with
``GET /slots`` and voided on a new upstream epoch (a restart empties every slot).

The HTTP of those calls (``GET /slots``, ``POST /slots/{id}?action=save|restore|erase``, the
warm-up's ``POST /completion``, ``GET /health``) and the errors they answer live apart in
``ocache/llama/slot_api.py`` (``SlotClient``, which holds no belief; its names are importable from
here too); the model of the server's reuse rules (``predict_reuse``, ``simulate_prefill``), pure,
in ``ocache/llama/reuse.py``; the launch parameters in ``ocache/llama/flags.py``.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

import aiohttp

from ocache.llama.flags import ServerParams
from ocache.llama.reuse import Checkpoint, predict_reuse
# the slot calls' HTTP, its constants and errors: re-exported, importers use ocache.slots
from ocache.llama.slot_api import (BOOT_CHECK_TIMEOUT_S, BOOT_HEADER, IF_BOOT_HEADER,  # noqa: F401
                                   SlotClient, SlotError, SlotFileError, SlotHashMismatch, SlotInvalid,
                                   SlotNotSupported, TaskIds, UpstreamError, check_filename,
                                   error_from_response, file_refused)
from ocache.rate import Rate

log = logging.getLogger("ocache.slots")


# ----------------------------------------------------------------------------------------------
# the table


@dataclass
class SlotState:
    """ocache's belief about one slot (see the module docstring). Only this module writes it (the
    table's slot calls, its reconcile and its verbs; ``tests/test_owners.py``). ``seq`` increments
    whenever the slot's content is replaced (``clear``): a response or a spill belongs to the content
    it was planned for only while ``seq`` is unchanged; ``version`` counts every write. ``origin``: the slot holds a warmed harness
    head (``head_key``) that no conversation has consumed yet. ``foreign``: the server reported
    something ocache did not send (content unknown)."""

    id: int
    n_ctx: int = 0
    tokens: list[int] = field(default_factory=list)
    n_total: int | None = 0
    checkpoints: list[Checkpoint] = field(default_factory=list)
    user_starts: list[int] = field(default_factory=list)
    owner: str | None = None
    kind: str | None = None
    head_key: str | None = None
    head_len: int = 0
    origin: bool = False
    last_used: float = 0.0
    seq: int = 0
    busy: bool = False
    pending: bool = False   # a request is in flight: n_total will be known after it
    #: the last request ocache sent was cut short after its prefill may have finished (client gone
    #: mid-stream, ``SlotTable.interrupted``): the slot holds the prompt plus the tokens generated
    #: so far, counted by the next ``GET /slots``; cleared by anything that replaces the content
    interrupted: bool = False
    foreign: bool = False
    #: ``RequestContext.labels`` of the conversation held (folder, client, model), for spills
    labels: dict = field(default_factory=dict)
    #: the slot file the content was restored from (``restore``), until anything replaces it
    restored_from: str | None = None
    #: the message key (``ocache.tokens.message_keys``: render fields + the first ``n_msgs``
    #: messages) of the chat request whose prompt ``tokens`` are; None when the content did not come
    #: from one (warm-up, restore, prompt route). The next turn of that conversation repeats these
    #: messages, so it is recognised before its token view (``known_conversation_slot``).
    msg_key: bytes | None = None
    n_msgs: int = 0
    #: bumped by every write of any other field (``busy`` aside: a snapshot's view of the lock), so a
    #: planner that waited for the slot's lease can tell whether the slot changed meanwhile
    #: (``SlotTable.version``)
    version: int = 0

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name not in ("version", "busy"):
            object.__setattr__(self, "version", getattr(self, "version", 0) + 1)

    def clear(self) -> None:
        """The slot is empty (erase, restart, failed restore)."""
        self.tokens = []
        self.n_total = 0
        self.checkpoints = []
        self.user_starts = []
        self.owner = None
        self.kind = None
        self.head_key = None
        self.head_len = 0
        self.origin = False
        self.foreign = False
        self.pending = False
        self.interrupted = False
        self.labels = {}
        self.restored_from = None
        self.msg_key = None
        self.n_msgs = 0
        self.seq += 1

    def unknown(self, n_total: int | None) -> None:
        """The slot holds something ocache cannot name (foreign use, restored elsewhere)."""
        self.clear()
        self.n_total = n_total
        self.foreign = True


    def hold(self, tokens: Sequence[int], n_total: int | None, *, checkpoints: Sequence[Checkpoint] = (),
             user_starts: Sequence[int] = (), pending: bool = False, owner: str | None = None,
             kind: str | None = None, labels: Mapping | None = None, head_key: str | None = None,
             head_len: int = 0, msg_key: bytes | None = None, n_msgs: int = 0) -> None:
        """The slot's content is replaced (``clear``, a new ``seq``) by ``tokens`` (the prompt ids
        ocache sent or restored), ``n_total`` tokens by the server's count (None: unknown until a
        response, ``pending``), with these checkpoints, user-turn starts, owner, kind, labels, head
        and message key; used now."""
        self.clear()
        self.tokens = list(tokens)
        self.n_total = n_total
        self.pending = pending
        self.checkpoints = list(checkpoints)
        self.user_starts = list(user_starts)
        self.owner, self.kind, self.labels = owner, kind, dict(labels or {})
        self.head_key, self.head_len = head_key, head_len
        self.msg_key, self.n_msgs = msg_key, n_msgs
        self.last_used = time.monotonic()

    def reconcile(self, entry: Mapping) -> str | None:
        """Reconcile the belief about an idle slot with its ``GET /slots`` entry (docs/llama-server.md
        §4 caveats). Returns the table counter the finding counts in (``interrupted_busy``,
        ``foreign_busy``, ``reconcile_mismatch``), None when the belief stands or only got the
        count it waited for."""
        if entry.get("is_processing"):
            if self.interrupted and self.pending:
                # ocache's own request, cut short: the server is still cancelling it (it notices
                # the closed connection within HTTP_POLLING_SECONDS, see settle_interrupted); the
                # count is read by a later GET /slots
                return "interrupted_busy"
            self.unknown(None)
            return "foreign_busy"
        n = entry.get("n_prompt_tokens")
        if n is None:
            # never ran a task: empty, or restored (restore does not set the key). ocache knows
            # which when it did the restore itself (n_total set, foreign False).
            if self.tokens and self.n_total == len(self.tokens) and not self.pending:
                return None
            if self.tokens or self.n_total:
                self.unknown(None)
                return "reconcile_mismatch"
            return None
        n = int(n)
        if self.pending or self.n_total is None:
            if n >= len(self.tokens):
                self.n_total = n
                self.pending = False
                return None
        elif n == self.n_total:
            return None
        if n == 0:
            mismatch = bool(self.tokens or self.n_total)
            self.clear()
            return "reconcile_mismatch" if mismatch else None
        log.info("slot %d: server holds %d tokens, ocache believed %s; content now unknown",
                 self.id, n, self.n_total)
        self.unknown(n)
        return "reconcile_mismatch"


class RestoreRate(Rate):
    """Bytes/s of this process's slot restores, measured end to end: the wall time of
    :meth:`SlotTable.restore` (HTTP round trip, the wait for the server's task loop, the file read
    wherever the build does it, the copy into the slot), divided by the server's ``n_read`` bytes.

    Owned by the :class:`SlotTable` (one per process, every tier restores through it), so the disk,
    session and head tiers price a restore with the same measured rate. The server's own
    ``timings.restore_ms`` is not used: with patches/0004 it covers only the task loop's copy, not the
    file read (``timings.read_ms``, done before on an HTTP thread). ``value``: the exponentially
    weighted mean of :class:`ocache.rate.Rate` (weight ``alpha`` per measurement), ``guess``
    (bytes/s) until the first one.
    """

    def __init__(self, guess: float = 5e8, alpha: float = 0.3) -> None:
        super().__init__(float(guess), alpha)

    def cost_s(self, nbytes: float) -> float:
        """Seconds a restore of ``nbytes`` bytes is expected to take at the measured rate."""
        return max(0.0, float(nbytes)) / self.value




class SlotLease:
    """Ownership of one slot: holds the slot's ``asyncio.Lock`` from :meth:`SlotTable.lease` until
    :meth:`release`, which is idempotent and synchronous, so every exit path (a return, an
    exception, ``asyncio.CancelledError`` at any await) can release it without awaiting; also an
    async context manager. ``held``: the lock is still owned by this lease. ``on_release``: called
    once, by the release that frees the lock (the table counts the leases held)."""

    __slots__ = ("slot", "_lock", "held", "_on_release")

    def __init__(self, slot: int, lock: asyncio.Lock, on_release: Callable[[], None] | None = None) -> None:
        self.slot = slot
        self._lock = lock
        self.held = True
        self._on_release = on_release

    def release(self) -> None:
        if self.held:
            self.held = False
            self._lock.release()
            if self._on_release is not None:
                self._on_release()

    async def __aenter__(self) -> "SlotLease":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.release()


class SlotStates:
    """The table of slot states and leases: one :class:`SlotState` and one ``asyncio.Lock`` per
    llama-server slot, the queries the planner and the tiers read (``snapshot``, ``held_exactly``,
    ``needs_reconcile``, ``precondition``), the verbs that record what a request did to a slot, and
    the reconcile of a ``GET /slots`` entry with the belief. No HTTP: :class:`SlotTable` adds the
    slot calls. ``params``: the server's launch parameters (``ServerParams``)."""

    def __init__(self, params: ServerParams | None = None) -> None:
        self.params = params or ServerParams()
        self.slots: list[SlotState] = []
        self._locks: list[asyncio.Lock] = []
        self.epoch: Any = None
        self.reconciled_at: float = 0.0
        #: the ``X-Llama-Server-Boot`` header (``BOOT_HEADER``, patches/0005) of the ``GET /slots``
        #: answer last reconciled: the process the table's beliefs are about; None on a stock build
        self.boot: str | None = None
        #: the server refuses a request whose ``IF_BOOT_HEADER`` names another process (``/props``
        #: ``ocache.if_boot``, patches/0007; set by the cache layer): :meth:`precondition`
        self.if_boot: bool = False
        self.counters: dict[str, int] = {"reconcile_mismatch": 0, "foreign_busy": 0, "restarts": 0,
                                         "restarts_seen_in_slots": 0, "interrupted_busy": 0,
                                         "boot_checks": 0, "boot_changed": 0,
                                         # live: SlotLeases held now (0 when idle)
                                         "leases_held": 0,
                                         # every token ocache itself prefilled (:meth:`warm`): head
                                         # warm-ups, anchor and user splits, `ocache warm`; those of
                                         # a request are its split too (the dashboard's "vs cold")
                                         "own_prefill_tokens": 0}
        #: the highest ``id_task`` each slot reported (``GET /slots``): a restart shows in it
        self._tasks = TaskIds()
        self._task_seq = 0
        #: per slot: set by :meth:`finish` (what :meth:`wait_settled` waits for)
        self._finished: dict[int, asyncio.Event] = {}

    def next_task(self) -> int:
        """A fresh request id for the checkpoint model's per-task eviction rule."""
        self._task_seq += 1
        return self._task_seq

    def _ensure(self, n: int, n_ctx: int | None = None) -> None:
        while len(self.slots) < n:
            self.slots.append(SlotState(id=len(self.slots), n_ctx=n_ctx or self.params.n_ctx_slot))
            self._locks.append(asyncio.Lock())
        if n_ctx:
            for s in self.slots:
                if s.n_ctx != n_ctx:   # a write bumps SlotState.version: only a real change
                    s.n_ctx = n_ctx

    def lock(self, slot: int) -> asyncio.Lock:
        self._check(slot)
        return self._locks[slot]

    async def lease(self, slot: int, timeout_s: float | None = None) -> SlotLease:
        """Wait for ``slot``'s lock and return the lease that owns it; at most ``timeout_s`` seconds
        (None: no bound), then ``TimeoutError``. A cancellation or timeout while waiting leaves the
        lock as it was (``asyncio.Lock.acquire`` takes it only when the wait succeeded)."""
        lock = self.lock(slot)
        async with asyncio.timeout(timeout_s):
            await lock.acquire()
        self.counters["leases_held"] += 1
        return SlotLease(slot, lock, self._lease_returned)

    def _lease_returned(self) -> None:
        self.counters["leases_held"] -= 1

    def _check(self, slot: int) -> None:
        if not 0 <= slot < len(self.slots):
            raise SlotInvalid(f"slot {slot} outside 0..{len(self.slots) - 1}", slot=slot)

    def __getitem__(self, slot: int) -> SlotState:
        self._check(slot)
        return self.slots[slot]

    def version(self, slot: int) -> int:
        """``slot``'s write counter (``SlotState.version``): equal values mean nothing about the slot
        changed in between."""
        self._check(slot)
        return self.slots[slot].version

    def __len__(self) -> int:
        return len(self.slots)

    def snapshot(self, held: int | None = None) -> list[SlotState]:
        """Copies of every slot's state (for the pure planner); ``busy`` = ocache holds its lock,
        except for ``held``, the slot whose lease the caller itself holds."""
        out = []
        for s, lk in zip(self.slots, self._locks):
            c = copy.copy(s)
            # read-only use of tokens; lists are replaced, never mutated in place
            object.__setattr__(c, "checkpoints", list(s.checkpoints))
            object.__setattr__(c, "busy", lk.locked() and s.id != held)
            out.append(c)
        return out

    def needs_reconcile(self, max_age_s: float) -> bool:
        """Whether a plan should read ``GET /slots`` first: the table was never reconciled or not
        for ``max_age_s`` seconds (a restart or foreign use may have happened since), or a slot
        ocache does not hold the lock of has a count the table cannot vouch for (a response
        pending or cut short)."""
        if not self.reconciled_at or time.monotonic() - self.reconciled_at > max_age_s:
            return True
        return self.unvouched()

    def unvouched(self) -> bool:
        """Whether a slot ocache does not hold the lock of has a count the table cannot vouch for
        (a response pending or cut short)."""
        return any((s.pending or s.n_total is None) and not lk.locked() for s, lk in zip(self.slots, self._locks))

    def precondition(self) -> str | None:
        """The boot id a request pinned on the table's beliefs can carry as ``IF_BOOT_HEADER``
        instead of asking :meth:`same_process` first: the server (patches/0007) then refuses it with
        412, before any work, if it is not the process whose ``GET /slots`` the table last
        reconciled, and serves it otherwise; no round trip. None when the server cannot check it
        (stock build, an older patched one), the table was never reconciled, or a slot's count is
        unvouched (then ``GET /slots`` is needed anyway)."""
        if not self.if_boot or self.boot is None or not self.reconciled_at or self.unvouched():
            return None
        return self.boot

    def held_exactly(self, slot: int) -> list[int] | None:
        """The token ids ``slot`` holds exactly as far as the table can vouch (its content is known,
        no response pending, the server's count equals the ids), else None."""
        st = self[slot]
        if not st.tokens or st.pending or st.foreign or (st.n_total is not None and st.n_total != len(st.tokens)):
            return None
        return list(st.tokens)


    # -- the verbs that change what a slot holds (the only writers of SlotState besides the
    #    slot calls of SlotTable and the reconcile with GET /slots) -------------------------------

    def assign(self, slot: int, tokens: Sequence[int], *, checkpoints: Sequence[Checkpoint] = (),
               user_starts: Sequence[int] = (), owner: str | None = None, kind: str | None = None,
               labels: Mapping | None = None, head_key: str | None = None, head_len: int = 0,
               msg_key: bytes | None = None, n_msgs: int = 0) -> int:
        """What a request forwarded to ``slot`` (whose lease the caller holds) will leave there: its
        prompt ``tokens`` with the predicted ``checkpoints``, the server's count unknown until the
        response (``pending``); ``msg_key``/``n_msgs``: the request's message key (``TokenView``).
        Returns the slot's new ``seq``, for :meth:`finish`."""
        st = self[slot]
        st.hold(tokens, None, pending=True, checkpoints=checkpoints, user_starts=user_starts, owner=owner,
                kind=kind, labels=labels, head_key=head_key, head_len=head_len, msg_key=msg_key, n_msgs=n_msgs)
        return st.seq

    def finish(self, slot: int, seq: int, n_total: int, checkpoints: Sequence[Checkpoint] | None = None) -> bool:
        """The request :meth:`assign` returned ``seq`` for finished: the slot holds ``n_total``
        tokens (prompt + generated - 1), and ``checkpoints`` when the prediction was corrected.
        Returns False (nothing changed) when the slot was assigned again since."""
        st = self[slot]
        if st.seq != seq:
            return False
        st.n_total = n_total
        st.pending = False
        if checkpoints is not None:
            st.checkpoints = list(checkpoints)
        ev = self._finished.pop(slot, None)
        if ev is not None:
            ev.set()
        return True

    async def wait_settled(self, slot: int, timeout_s: float) -> bool:
        """Wait until ``slot``'s lease is free and its last response is recorded (not ``pending``:
        :meth:`finish` ran), at most ``timeout_s`` seconds; whether it settled. The window this
        covers: a response's last byte has reached the client, which sends its next turn at once,
        while the proxy still releases the plan and observes the response (ms). Takes the lock only
        to learn it is free (released at once, no await in between)."""
        lock = self.lock(slot)
        try:
            async with asyncio.timeout(timeout_s):
                while lock.locked() or self[slot].pending:
                    if lock.locked():
                        await lock.acquire()
                        lock.release()
                    else:
                        await self._finished.setdefault(slot, asyncio.Event()).wait()
        except TimeoutError:
            return False
        return True

    def predict_checkpoints(self, slot: int, seq: int, checkpoints: Sequence[Checkpoint]) -> bool:
        """The checkpoints the content :meth:`learn_placement` or :meth:`assign` returned ``seq``
        for has, as predicted from the response. False when the slot was assigned again since."""
        st = self[slot]
        if st.seq != seq:
            return False
        st.checkpoints = list(checkpoints)
        return True

    def interrupted(self, slot: int, seq: int) -> bool:
        """The request :meth:`assign` returned ``seq`` for started but was cut short (client gone,
        upstream error mid-stream): the slot holds the prompt if its prefill finished; the count is
        unknown until ``GET /slots`` says. False when the slot was assigned again since."""
        st = self[slot]
        if st.seq != seq:
            return False
        st.n_total, st.pending, st.interrupted = None, True, True
        return True

    def mark_origin(self, slot: int, head_key: str | None, head_len: int, *, last_used: float | None = None) -> None:
        """``slot`` holds exactly a warmed harness head (``head_len`` tokens, fingerprint
        ``head_key``) that no conversation has consumed yet: the shared *origin*."""
        st = self[slot]
        st.kind, st.head_key, st.head_len, st.origin = "head", head_key, head_len, True
        if last_used is not None:
            st.last_used = last_used

    def mark_head(self, slot: int, head_key: str, head_len: int) -> None:
        """``slot``'s content starts with the harness head ``head_key`` (``head_len`` tokens)."""
        st = self[slot]
        st.head_key, st.head_len = head_key, head_len

    def adopt(self, slot: int, *, owner: str | None, kind: str | None, head_key: str | None) -> int:
        """``slot`` (restored from a conversation's file) belongs to that conversation: its session
        ``owner``, request ``kind`` and head. Returns the slot's ``seq``."""
        st = self[slot]
        st.owner, st.kind, st.head_key = owner, kind, head_key
        return st.seq

    def mark_unknown(self, slot: int, n_total: int | None = None) -> None:
        """``slot`` holds something ocache cannot name (a step stopped part way, a rejected request);
        ``n_total``: the server's count when known."""
        self[slot].unknown(n_total)

    def forget(self, slot: int) -> None:
        """``slot`` is empty (as far as ocache knows)."""
        self[slot].clear()

    def reset_all(self, epoch: Any = None) -> None:
        """A new upstream process: every slot is empty (docs/llama-server.md §16 restart detection)."""
        for s in self.slots:
            s.clear()
        self._tasks.clear()   # its task ids start again: the next GET /slots is the new baseline
        self.epoch = epoch
        self.counters["restarts"] += 1


    # -- what GET /slots says ---------------------------------------------------------------------

    def task_ids(self) -> dict[int, int]:
        """The highest ``id_task`` each slot reported so far (``GET /slots``); compared before and
        after a request the server placed itself, it names the slot the server chose."""
        return dict(self._tasks.ids)

    def _restarted(self, data: list[dict], boot: str | None = None) -> bool:
        """Whether ``GET /slots`` comes from another process than the last one: its boot id
        (``boot``, patches/0005) differs from the table's, or a slot's ``id_task`` vanished or went
        back (``TaskIds``); records the ids either way."""
        return self._tasks.record(data, restarted=boot is not None and self.boot is not None and boot != self.boot)

    def reconcile_one(self, st: SlotState, entry: Mapping) -> None:
        """Reconcile one idle slot's belief with its ``GET /slots`` entry (``SlotState.reconcile``)
        and count what it found."""
        found = st.reconcile(entry)
        if found is not None:
            self.counters[found] += 1


class SlotTable(SlotStates):
    """The slot table: :class:`SlotStates` plus the slot calls that change what a slot holds
    (``refresh``, ``learn_placement``, ``settle_interrupted``, ``warm``, ``save``, ``restore``,
    ``erase``, ``same_process``), each an HTTP call of its :class:`SlotClient` (``client``) and
    what its answer means for the states.

    ``session``/``base_url``/``headers``/``timeout_s``: the upstream, for ``client``. Call
    ``refresh()`` once before use (it sizes the table from ``GET /slots``).

    The caller must hold ``lock(slot)`` around ``warm``/``save``/``restore``/``erase`` and any
    request it pins to the slot: that is what makes "pin only idle slots" true.
    """

    def __init__(self, session: aiohttp.ClientSession, base_url: str, params: ServerParams | None = None,
                 *, headers: Mapping[str, str] | None = None, timeout_s: float = 3600.0) -> None:
        super().__init__(params)
        self.client = SlotClient(session, base_url, headers=headers, timeout_s=timeout_s)
        #: the server checks a restore's ``xxh3`` itself (``/props`` ``ocache.restore_xxh3``,
        #: patches/0006; set by the cache layer): the store's verify then leaves the slot file's
        #: hash to it, so the file is read once, by the server (:meth:`restore`)
        self.checks_xxh3: bool = False
        #: per slot: (tokens, ms) ocache itself prefilled there with :meth:`warm`, cumulative
        #: (``timings.prompt_n``/``prompt_ms``); the cache layer takes the delta over a request's
        #: steps to correct the figures that request reports (ocache/api/figures.py)
        self.own_prefill: dict[int, tuple[int, float]] = {}
        #: bytes/s of :meth:`restore`, end to end (what the tiers price a restore with)
        self.restore_rate = RestoreRate()

    @property
    def session(self) -> aiohttp.ClientSession:
        """The aiohttp session the slot calls use (the cache layer sets it per upstream epoch)."""
        return self.client.session

    @session.setter
    def session(self, session: aiohttp.ClientSession) -> None:
        self.client.session = session

    @property
    def calls_inflight(self) -> int:
        """Slot HTTP calls sent and not answered yet (``SlotClient.calls_inflight``)."""
        return self.client.calls_inflight

    async def wait_calls(self, timeout_s: float) -> int:
        """Wait until no slot call is in flight, at most ``timeout_s`` seconds; returns how many
        still are (0 when none)."""
        return await self.client.wait_calls(timeout_s)

    async def same_process(self) -> bool:
        """Whether the server is still the process whose ``GET /slots`` the table last reconciled
        (``boot``), asked with one ``GET /health``: llama-server answers it on its HTTP thread
        without the task queue (tools/server/server-context.cpp ``get_health``), so it does not
        wait for a decode step the way ``GET /slots`` does; the patched build names its process in
        every answer (``BOOT_HEADER``, patches/0005). False on a stock build (no header), when the
        table was never reconciled, on any failure or after ``BOOT_CHECK_TIMEOUT_S``, and when the
        id differs (a restart: the caller's ``GET /slots`` then sees it too). Never raises."""
        if self.boot is None or not self.reconciled_at:
            return False
        try:
            boot = await self.client.health_boot()
        except (SlotError, asyncio.TimeoutError):
            return False
        self.counters["boot_checks"] += 1
        if boot is None:
            return False
        if boot != self.boot:
            self.counters["boot_changed"] += 1
            return False
        return True

    async def fetch_slots(self, meta: dict | None = None) -> list[dict]:
        """``GET /slots`` (docs/llama-server.md §4); ``meta["boot"]``: the answering process's boot
        id (patches/0005) or None. Raises SlotNotSupported (501, ``--no-slots``) or UpstreamError."""
        return await self.client.get_slots(meta)

    async def refresh(self) -> list[dict]:
        """``GET /slots`` and reconcile: size the table, then for each slot ocache does not hold the
        lock for, compare ``n_prompt_tokens`` with the belief. A missing key means "never ran a
        task": unknown content if ocache thinks it holds something restored, else empty. A slot the
        server reports processing without ocache's lock is foreign use (content unknown)."""
        versions = [s.version for s in self.slots]
        meta: dict = {}
        data = await self.fetch_slots(meta)
        n_ctx = int(data[0].get("n_ctx") or 0) if data else 0
        self._ensure(len(data), n_ctx or None)
        if self._restarted(data, meta.get("boot")):
            # a restart the upstream's probe has not seen yet (it polls every 2 s): a restored
            # slot of the old process looks exactly like a fresh empty one, so trust nothing but
            # what a request ocache sent to the new process left (the slot reports a task of the
            # new process and the count ocache recorded when that request finished)
            by_id = {int(e.get("id", -1)): e for e in data}
            kept = 0
            for st, lk in zip(self.slots, self._locks):
                e = by_id.get(st.id) or {}
                if (not lk.locked() and st.tokens and not st.pending and st.n_total is not None
                        and e.get("id_task") is not None and e.get("n_prompt_tokens") == st.n_total):
                    kept += 1
                    continue
                st.clear()
            log.warning("GET /slots shows a new llama-server process (its boot id changed, or a "
                        "slot's id_task vanished or went back): every slot is empty%s",
                        f" but {kept} a request of the new process filled" if kept else "")
            self.counters["restarts_seen_in_slots"] += 1
            self.counters["restarts"] += 1
            versions = [s.version for s in self.slots]
        if data and (self.params.n_slots != len(data) or (n_ctx and self.params.n_ctx_slot != n_ctx)):
            self.params = replace(self.params, n_slots=len(data), n_ctx_slot=n_ctx or self.params.n_ctx_slot)
        for entry in data:
            sid = int(entry.get("id", -1))
            if not 0 <= sid < len(self.slots):
                continue
            if self._locks[sid].locked():
                continue  # ocache is using it; its belief is being updated by the user of the lock
            if sid < len(versions) and self.slots[sid].version != versions[sid]:
                continue  # changed while GET /slots was in flight: the answer is older than the belief
            st = self.slots[sid]
            self.reconcile_one(st, entry)
        self.reconciled_at = time.monotonic()
        self.boot = meta.get("boot")
        return data

    async def learn_placement(self, before: Mapping[int, int], tokens: Sequence[int], *,
                              owner: str | None, kind: str, user_starts: Sequence[int] = (),
                              labels: Mapping | None = None, slot: int | None = None) -> int | None:
        """After a request forwarded without ``id_slot`` (the server chose its slot by its own
        prompt similarity, docs/llama-server.md §9): ``GET /slots``, find the one slot whose
        ``id_task`` grew since ``before`` (``task_ids()`` taken while ocache held every slot's
        lock, so no other request ran) and record that it now holds ``tokens`` (+ the generated
        tail the server reports in ``n_prompt_tokens``). Returns the slot, or None when no single
        slot can be named (the request failed, or other clients used the server). The caller holds
        every slot's lock, or, with ``slot`` (the one :meth:`placed_slot` named while the request
        ran), that slot's: then only its entry is read. Raises SlotError when ``GET /slots`` fails."""
        meta: dict = {}
        data = await self.fetch_slots(meta)
        self._restarted(data, meta.get("boot"))
        grown = [e for e in _grown(data, before) if slot is None or int(e.get("id", -1)) == slot]
        if len(grown) != 1 or not 0 <= int(grown[0].get("id", -1)) < len(self.slots):
            return None
        e = grown[0]
        st = self.slots[int(e["id"])]
        n = e.get("n_prompt_tokens")
        # no checkpoints: those the server kept are not reported; those this prefill made are
        # predicted when the answer's cache_n is known (OCacheLayer.observe)
        st.hold(tokens, int(n) if n is not None else None, user_starts=user_starts, owner=owner, kind=kind,
                labels=labels)
        return st.id

    async def placed_slot(self, before: Mapping[int, int], wait_s: float, poll_s: float = 0.05) -> int | None:
        """While a request forwarded without ``id_slot`` runs (the caller holds every slot's lock,
        ``before`` = ``task_ids()`` then): ``GET /slots`` every ``poll_s`` seconds until one slot's
        ``id_task`` grew (the server placed the request there: it takes the task when it starts its
        prompt), at most ``wait_s`` seconds. Returns that slot, or None (not placed yet, several
        grew, or ``GET /slots`` failed). The caller can then let the other slots go: holding every
        lease to the end made a 4-token chat wait 6.56 s behind a 1,500-token generation."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                grown = _grown(await self.fetch_slots(), before)
            except SlotError:
                return None
            if len(grown) == 1 and 0 <= int(grown[0].get("id", -1)) < len(self.slots):
                return int(grown[0]["id"])
            if grown or time.monotonic() >= deadline:
                return None
            await asyncio.sleep(poll_s)  # bounded poll of the server's state (wait_s), not a test sync

    async def settle_interrupted(self, slot: int, wait_s: float = 3.0, poll_s: float = 0.1) -> bool:
        """For a slot whose last request was cut short (``interrupted``, count still pending) and
        whose lock the caller holds: ``GET /slots`` until the server has finished cancelling that
        request (``is_processing`` false), at most ``wait_s`` seconds, then reconcile the slot with
        that entry (``reconcile_one``: the prompt plus the tokens generated so far when
        ``n_prompt_tokens`` covers the prompt, else unknown). The server notices a client gone from
        a stream on its next write or within ``HTTP_POLLING_SECONDS`` (1 s, tools/server/
        server-context.cpp:40; the reader polls ``should_stop`` at that interval,
        server-queue.cpp:550-560) and then cancels the task. Returns True when the slot's count is
        known after it (``pending`` false and the content still ocache's). Raises SlotError when
        ``GET /slots`` fails."""
        st = self[slot]
        if not (st.interrupted and st.pending):
            return not st.pending and not st.foreign
        deadline = time.monotonic() + wait_s
        while True:
            data = await self.fetch_slots()
            entry = next((e for e in data if int(e.get("id", -1)) == slot), None)
            if entry is None:
                return False
            if not entry.get("is_processing") or time.monotonic() >= deadline:
                break
            await asyncio.sleep(poll_s)  # bounded poll of the server's state (wait_s), not a test sync
        if self._restarted(data):
            st.clear()   # another process: the slot is empty (the upstream's probe resets the rest)
            return False
        self.reconcile_one(st, entry)
        return not st.pending and not st.foreign and bool(st.tokens)

    async def save(self, slot: int, filename: str) -> dict:
        """``POST /slots/{slot}?action=save`` -> ``{"n_saved": tokens, "n_written": bytes, ...}``
        (docs/llama-server.md §5). Does not change what the slot holds. Raises SlotNotSupported (no
        ``--slot-save-path``), SlotFileError, UpstreamError."""
        check_filename(filename)
        self._check(slot)
        return await self.client.action(slot, "save", {"filename": filename})

    async def restore(self, slot: int, filename: str, tokens: Sequence[int] | None = None,
                      checkpoints: Sequence[Checkpoint] | None = None, xxh3: str | None = None) -> dict:
        """``POST /slots/{slot}?action=restore`` -> ``{"n_restored": tokens, "n_read": bytes, ...}``.

        ``tokens``: the token ids the file holds (the caller knows them from its index or the file
        header), recorded as the slot's content; ``checkpoints``: the checkpoints the slot had when
        the file was saved; the patched server's sidecar restores the newest ``n_checkpoints`` of
        them, a stock build none (docs/llama-server.md §6). On failure a stock server has erased the slot
        (docs/llama-server.md §5), the patched pre-check leaves it untouched; the table follows ``GET /slots``.
        A successful restore's wall time and ``n_read`` feed :attr:`restore_rate`.
        ``xxh3``: the file's XXH3-64 (hex), checked by a server that :attr:`checks_xxh3` on the bytes
        it reads, before the state reaches the slot (a mismatch: 400, the slot untouched); the
        tiers send it only then (a stock build ignores the field).
        """
        check_filename(filename)
        self._check(slot)
        st = self.slots[slot]
        t0 = time.monotonic()
        payload = {"filename": filename}
        if xxh3 is not None:
            payload["xxh3"] = xxh3
        try:
            data = await self.client.action(slot, "restore", payload)
        except SlotError:
            # stock: the slot was erased; patched (0002-restore-precheck): a file rejected by the
            # pre-check leaves the slot as it was. Ask the server which one happened.
            before = st.n_total
            try:
                entry = (await self.fetch_slots())[slot]
                held = entry.get("n_prompt_tokens")
            except (SlotError, IndexError):
                held = None
            if not (before and held == before):
                st.clear()
            raise
        n = int(data.get("n_restored", 0))
        self.restore_rate.add(float(data.get("n_read") or 0), time.monotonic() - t0)
        if tokens is not None and len(tokens) == n:
            # the patched build reports how many checkpoints its sidecar brought back (the newest
            # ones); a stock build restores none (docs/llama-server.md §6)
            n_ck = data.get("n_checkpoints")
            st.hold(tokens, n, checkpoints=list(checkpoints or [])[-int(n_ck):] if n_ck else [])
        else:
            st.unknown(n)
            st.last_used = time.monotonic()
        st.restored_from = filename
        return data

    async def erase(self, slot: int) -> dict:
        """``POST /slots/{slot}?action=erase`` -> ``{"n_erased": tokens}``; the slot is empty after."""
        self._check(slot)
        data = await self.client.action(slot, "erase", None)
        self.slots[slot].clear()
        return data

    async def warm(self, slot: int, tokens: Sequence[int], *, message_delimiters: list | None = None,
                   user_starts: Sequence[int] = ()) -> dict:
        """Prefill ``tokens`` into ``slot`` without generating: ``POST /completion`` with the token ids
        as prompt, ``n_predict: 0``, ``id_slot`` pinned, ``cache_prompt: true``. The server samples
        one token but never decodes it, so the slot then holds exactly ``tokens`` (docs/llama-server.md §13).

        Returns the response's ``timings`` (``cache_n``/``prompt_n`` tokens, ``prompt_ms``).
        Raises UpstreamError (e.g. 400 ``exceed_context_size_error``) with the slot left as the
        server left it (content unknown); SlotError, without asking the server, for tokens that hold
        an image's positions (negative ids of the token view, ``ocache.media``: a token-id prompt
        cannot carry the image).
        """
        self._check(slot)
        st = self.slots[slot]
        tokens = list(tokens)
        if tokens and min(tokens) < 0:
            raise SlotError("a token-id prefill cannot carry an image's positions", slot=slot)
        task = self.next_task()
        pred = predict_reuse(st.tokens, st.n_total, st.checkpoints, tokens, self.params,
                             user_starts=user_starts if message_delimiters else (), task=task)
        body: dict[str, Any] = {"prompt": tokens, "n_predict": 0, "id_slot": slot, "cache_prompt": True,
                                "stream": False}
        if message_delimiters:
            body["message_delimiters"] = message_delimiters
        try:
            data = await self.client.complete(slot, body)
        except SlotError as exc:
            if exc.status:   # the server answered (not a lost connection): it left the slot unknown
                st.unknown(None)
            raise
        st.hold(tokens, len(tokens), checkpoints=pred.checkpoints_after, user_starts=user_starts)
        timings = dict(data.get("timings") or {})
        n0, ms0 = self.own_prefill.get(slot, (0, 0.0))
        self.own_prefill[slot] = (n0 + int(timings.get("prompt_n") or 0), ms0 + float(timings.get("prompt_ms") or 0.0))
        self.counters["own_prefill_tokens"] += int(timings.get("prompt_n") or 0)
        timings["predicted_cache_n"] = pred.cache_n
        cached = data.get("tokens_cached")
        if cached is not None and int(cached) != len(tokens):
            log.warning("warm slot %d: server holds %s tokens, expected %d", slot, cached, len(tokens))
            st.n_total = int(cached)
        return timings


def _grown(data: list[dict], before: Mapping[int, int]) -> list[dict]:
    """The ``GET /slots`` entries whose ``id_task`` grew since ``before`` (slot -> id_task)."""
    return [e for e in data if e.get("id_task") is not None
            and int(e["id_task"]) > before.get(int(e.get("id", -1)), -1)]
