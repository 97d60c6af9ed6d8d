"""The slot table: what each llama-server slot holds, and every slot HTTP call ocache makes.

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

The model of the server's reuse rules (``predict_reuse``, ``simulate_prefill``) lives apart, pure,
in ``ocache/llama/reuse.py``; the launch parameters in ``ocache/llama/flags.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import errno
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

import aiohttp

from ocache.llama.flags import ServerParams
from ocache.llama.reuse import Checkpoint, predict_reuse
from ocache.tiers.base import Rate

log = logging.getLogger("ocache.slots")

#: response header of the patched llama-server naming its process: 16 hex digits drawn at start,
#: sent with every answer (patches/0005-health-boot-id.patch)
BOOT_HEADER = "X-Llama-Server-Boot"
#: a request header naming the process a request was planned for: the patched build refuses the
#: request with 412 before any work when it is another process (patches/0007-if-boot-precondition.patch)
IF_BOOT_HEADER = "X-Llama-Server-If-Boot"
#: seconds :meth:`SlotTable.same_process` waits for ``GET /health`` (answered at once by a live
#: server, without the task queue); past it the caller falls back to ``GET /slots``
BOOT_CHECK_TIMEOUT_S = 2.0


# ----------------------------------------------------------------------------------------------
# errors


class SlotError(RuntimeError):
    """A slot call failed. ``status``: HTTP status (0 = transport error); ``type``/``message``:
    llama-server's error body ``{"error":{"code","message","type"}}`` (server-common.cpp:36-78)."""

    def __init__(self, message: str, status: int = 0, type: str | None = None, slot: int | None = None):
        super().__init__(message)
        self.status = status
        self.type = type
        self.slot = slot


class SlotNotSupported(SlotError):
    """501: the server runs without ``--slot-save-path`` (save/restore/erase are off, docs/llama-server.md §3)
    or without the ``/slots`` endpoint (``--no-slots``)."""


class SlotBusy(SlotError):
    """The slot is processing (or locked by ocache) and the call would wait or race."""


class SlotFileError(SlotError):
    """400 on save/restore: invalid filename, or the file could not be restored (missing, corrupt,
    another model, does not fit). **After a failed restore the slot is erased** (docs/llama-server.md §5)."""


class SlotHashMismatch(SlotFileError):
    """400 from a server that checked the restore's ``xxh3`` (patches/0006) and found the file's
    bytes differ (or could not read them for the check): the file is damaged; the slot is untouched
    (the check runs before the restore is queued)."""


class SlotInvalid(SlotError):
    """400 ``Invalid slot ID`` / ``Invalid action``, or a slot id outside the table."""


class UpstreamError(SlotError):
    """The server answered with an unexpected status (5xx, 503 while loading) or not at all."""


def file_refused(exc: BaseException) -> bool:
    """True when a failed restore means the *file* is bad (delete the entry), False when the server
    could not be asked or failed for another reason (keep it: the file is still valid).

    Only the server's own answer about the file counts: ``SlotFileError`` (400 ``Unable to restore
    slot: ...`` from the patched pre-check or the stock restore, 400 ``Invalid filename``;
    docs/llama-server.md §5). A refused or reset connection, a timeout (``UpstreamError`` with status 0: llama-server
    killed or restarting), a 5xx/503 (loading), ``SlotInvalid`` and ``SlotNotSupported`` say
    nothing about the file."""
    return isinstance(exc, SlotFileError)


def error_from_response(status: int, body: Any, slot: int | None, what: str) -> SlotError:
    """Map a llama-server error response to the matching ``SlotError`` subclass (docs/llama-server.md §5 table)."""
    err = body.get("error") if isinstance(body, dict) else None
    msg = (err or {}).get("message") if isinstance(err, dict) else None
    typ = (err or {}).get("type") if isinstance(err, dict) else None
    text = f"{what} slot {slot}: HTTP {status}: {msg or body!r}"
    if status == 501:
        return SlotNotSupported(text, status, typ, slot)
    if status == 400 and msg and ("slot ID" in msg or "Invalid action" in msg):
        return SlotInvalid(text, status, typ, slot)
    if status == 400 and msg and ("slot file hash mismatch" in msg or "for its hash check" in msg):
        return SlotHashMismatch(text, status, typ, slot)
    if status == 400 and msg and ("filename" in msg or "restore" in msg):
        return SlotFileError(text, status, typ, slot)
    if status == 500 and msg and "Unable to save slot" in msg:
        return SlotFileError(text, status, typ, slot)
    return UpstreamError(text, status, typ, slot)


# ----------------------------------------------------------------------------------------------
# server parameters



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


class RestoreRate(Rate):
    """Bytes/s of this process's slot restores, measured end to end: the wall time of
    :meth:`SlotTable.restore` (HTTP round trip, the wait for the server's task loop, the file read
    wherever the build does it, the copy into the slot), divided by the server's ``n_read`` bytes.

    Owned by the :class:`SlotTable` (one per process, every tier restores through it), so the disk,
    session and head tiers price a restore with the same measured rate. The server's own
    ``timings.restore_ms`` is not used: with patches/0004 it covers only the task loop's copy, not the
    file read (``timings.read_ms``, done before on an HTTP thread). ``value``: the exponentially
    weighted mean of :class:`ocache.tiers.base.Rate` (weight ``alpha`` per measurement), ``guess``
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
    async context manager. ``held``: the lock is still owned by this lease."""

    __slots__ = ("slot", "_lock", "held")

    def __init__(self, slot: int, lock: asyncio.Lock) -> None:
        self.slot = slot
        self._lock = lock
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self._lock.release()

    async def __aenter__(self) -> "SlotLease":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.release()


class SlotTable:
    """One entry and one ``asyncio.Lock`` per llama-server slot, plus the slot HTTP calls.

    ``session``/``base_url``: the upstream (an aiohttp session and ``http://host:port``).
    ``headers``: extra request headers (e.g. ``Authorization`` for ``--api-key``). Call
    ``refresh()`` once before use (it sizes the table from ``GET /slots``).

    The caller must hold ``lock(slot)`` around ``warm``/``save``/``restore``/``erase`` and any
    request it pins to the slot: that is what makes "pin only idle slots" true.
    """

    def __init__(self, session: aiohttp.ClientSession, base_url: str, params: ServerParams | None = None,
                 *, headers: Mapping[str, str] | None = None, timeout_s: float = 3600.0) -> None:
        self.session = session
        self.base_url = base_url.rstrip("/")
        self.params = params or ServerParams()
        self.headers = dict(headers or {})
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.slots: list[SlotState] = []
        self._locks: list[asyncio.Lock] = []
        self.epoch: Any = None
        self.reconciled_at: float = 0.0
        #: the server checks a restore's ``xxh3`` itself (``/props`` ``ocache.restore_xxh3``,
        #: patches/0006; set by the cache layer): the store's verify then leaves the slot file's
        #: hash to it, so the file is read once, by the server (:meth:`restore`)
        self.checks_xxh3: bool = False
        #: the ``X-Llama-Server-Boot`` header (``BOOT_HEADER``, patches/0005) of the ``GET /slots``
        #: answer last reconciled: the process the table's beliefs are about; None on a stock build
        self.boot: str | None = None
        #: the server refuses a request whose ``IF_BOOT_HEADER`` names another process (``/props``
        #: ``ocache.if_boot``, patches/0007; set by the cache layer): :meth:`precondition`
        self.if_boot: bool = False
        self.counters: dict[str, int] = {"reconcile_mismatch": 0, "foreign_busy": 0, "restarts": 0,
                                         "restarts_seen_in_slots": 0, "interrupted_busy": 0,
                                         "boot_checks": 0, "boot_changed": 0}
        # highest ``id_task`` each slot reported (GET /slots): within one server process it only
        # grows and never disappears (``task_prev`` is kept, tools/server/server-context.cpp
        # ``server_slot::to_json``), so a slot that loses or lowers it is on a new process
        self._id_task: dict[int, int] = {}
        self._task_seq = 0
        #: per slot: set by :meth:`finish` (what :meth:`wait_settled` waits for)
        self._finished: dict[int, asyncio.Event] = {}
        #: per slot: (tokens, ms) ocache itself prefilled there with :meth:`warm`, cumulative
        #: (``timings.prompt_n``/``prompt_ms``); the cache layer takes the delta over a request's
        #: steps to correct the figures that request reports (ocache/api/figures.py)
        self.own_prefill: dict[int, tuple[int, float]] = {}
        #: bytes/s of :meth:`restore`, end to end (what the tiers price a restore with)
        self.restore_rate = RestoreRate()
        #: slot HTTP calls (``GET /slots``, save/restore/erase, warm-ups) sent and not answered yet;
        #: a planned stop waits for them before llama-server gets SIGTERM (:meth:`wait_calls`)
        self.calls_inflight = 0
        self._calls_idle = asyncio.Event()
        self._calls_idle.set()

    # -- table ----------------------------------------------------------------------------------

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

    async def lease(self, slot: int) -> SlotLease:
        """Wait for ``slot``'s lock and return the lease that owns it. A cancellation while waiting
        leaves the lock as it was (``asyncio.Lock.acquire`` takes it only when the wait succeeded)."""
        lock = self.lock(slot)
        await lock.acquire()
        return SlotLease(slot, lock)

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
            meta: dict = {}
            status, _ = await self._request("GET", "/health", what="GET /health", meta=meta,
                                            timeout=aiohttp.ClientTimeout(total=BOOT_CHECK_TIMEOUT_S))
        except (SlotError, asyncio.TimeoutError):
            return False
        self.counters["boot_checks"] += 1
        if status != 200 or meta.get("boot") is None:
            return False
        if meta["boot"] != self.boot:
            self.counters["boot_changed"] += 1
            return False
        return True

    def held_exactly(self, slot: int) -> list[int] | None:
        """The token ids ``slot`` holds exactly as far as the table can vouch (its content is known,
        no response pending, the server's count equals the ids), else None."""
        st = self[slot]
        if not st.tokens or st.pending or st.foreign or (st.n_total is not None and st.n_total != len(st.tokens)):
            return None
        return list(st.tokens)

    # -- the verbs that change what a slot holds (the only writers of SlotState besides the
    #    slot calls below and the reconcile with GET /slots) -------------------------------------

    def assign(self, slot: int, tokens: Sequence[int], *, checkpoints: Sequence[Checkpoint] = (),
               user_starts: Sequence[int] = (), owner: str | None = None, kind: str | None = None,
               labels: Mapping | None = None, head_key: str | None = None, head_len: int = 0,
               msg_key: bytes | None = None, n_msgs: int = 0) -> int:
        """What a request forwarded to ``slot`` (whose lease the caller holds) will leave there: its
        prompt ``tokens`` with the predicted ``checkpoints``, the server's count unknown until the
        response (``pending``); ``msg_key``/``n_msgs``: the request's message key (``TokenView``).
        Returns the slot's new ``seq``, for :meth:`finish`."""
        st = self[slot]
        st.clear()
        st.tokens = list(tokens)
        st.n_total = None
        st.pending = True
        st.checkpoints = list(checkpoints)
        st.user_starts = list(user_starts)
        st.owner = owner
        st.kind = kind
        st.labels = dict(labels or {})
        st.head_key = head_key
        st.head_len = head_len
        st.msg_key, st.n_msgs = msg_key, n_msgs
        st.last_used = time.monotonic()
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
        self._id_task.clear()   # its task ids start again: the next GET /slots is the new baseline
        self.epoch = epoch
        self.counters["restarts"] += 1

    # -- HTTP -----------------------------------------------------------------------------------

    async def wait_calls(self, timeout_s: float) -> int:
        """Wait until no slot call is in flight, at most ``timeout_s`` seconds; returns how many
        still are (0 when none)."""
        if self.calls_inflight:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._calls_idle.wait(), timeout_s)
        return self.calls_inflight

    async def _request(self, method: str, path: str, *, json_body: Any = None, slot: int | None = None,
                       what: str = "slot call", meta: dict | None = None,
                       timeout: aiohttp.ClientTimeout | None = None) -> tuple[int, Any]:
        self.calls_inflight += 1
        self._calls_idle.clear()
        try:
            return await self._request_once(method, path, json_body=json_body, slot=slot, what=what,
                                            meta=meta, timeout=timeout)
        finally:
            self.calls_inflight -= 1
            if self.calls_inflight <= 0:
                self.calls_inflight = 0
                self._calls_idle.set()

    async def _request_once(self, method: str, path: str, *, json_body: Any = None, slot: int | None = None,
                            what: str = "slot call", meta: dict | None = None,
                            timeout: aiohttp.ClientTimeout | None = None) -> tuple[int, Any]:
        """One slot call (retried once on a dead keep-alive connection): ``(status, JSON body)``;
        ``meta["boot"]`` gets the answer's ``BOOT_HEADER`` (None from a stock build)."""
        url = self.base_url + path
        for attempt in (0, 1):
            try:
                async with self.session.request(method, url, json=json_body, headers=self.headers,
                                                timeout=timeout or self.timeout) as resp:
                    if meta is not None:
                        meta["boot"] = resp.headers.get(BOOT_HEADER)
                    try:
                        body = await resp.json(content_type=None)
                    except (ValueError, aiohttp.ContentTypeError):
                        body = {"error": {"message": (await resp.text())[:500]}}
                    return resp.status, body
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientConnectionResetError) as exc:
                # llama-server closes idle keep-alive connections; a pooled one can be dead before
                # the request is read. Every slot call is safe to send again (save/restore/erase
                # replace state, a warm-up prefills the same tokens), so retry once.
                if attempt == 0:
                    continue
                raise UpstreamError(f"{what} {method} {path}: {exc!r}", 0, None, slot) from exc
            except aiohttp.ClientOSError as exc:
                # the same dead keep-alive connection, seen as ECONNRESET/EPIPE on the send (seen
                # once: ClientOSError(104, 'Connection reset by peer') on a spill's save in
                # tests/test_hardening_cache.py on a loaded machine)
                if attempt == 0 and exc.errno in (errno.ECONNRESET, errno.EPIPE):
                    continue
                raise UpstreamError(f"{what} {method} {path}: {exc!r}", 0, None, slot) from exc
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                raise UpstreamError(f"{what} {method} {path}: {exc!r}", 0, None, slot) from exc
        raise AssertionError("unreachable")

    async def fetch_slots(self, meta: dict | None = None) -> list[dict]:
        """``GET /slots`` (docs/llama-server.md §4); ``meta["boot"]``: the answering process's boot
        id (patches/0005) or None. Raises SlotNotSupported (501, ``--no-slots``) or UpstreamError."""
        status, body = await self._request("GET", "/slots", what="GET /slots", meta=meta)
        if status != 200 or not isinstance(body, list):
            raise error_from_response(status, body, None, "GET /slots")
        return body

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

    def task_ids(self) -> dict[int, int]:
        """The highest ``id_task`` each slot reported so far (``GET /slots``); compared before and
        after a request the server placed itself, it names the slot the server chose."""
        return dict(self._id_task)

    async def learn_placement(self, before: Mapping[int, int], tokens: Sequence[int], *,
                              owner: str | None, kind: str, user_starts: Sequence[int] = (),
                              labels: Mapping | None = None) -> int | None:
        """After a request forwarded without ``id_slot`` (the server chose its slot by its own
        prompt similarity, docs/llama-server.md §9): ``GET /slots``, find the one slot whose
        ``id_task`` grew since ``before`` (``task_ids()`` taken while ocache held every slot's
        lock, so no other request ran) and record that it now holds ``tokens`` (+ the generated
        tail the server reports in ``n_prompt_tokens``). Returns the slot, or None when no single
        slot can be named (the request failed, or other clients used the server). The caller holds
        every slot's lock. Raises SlotError when ``GET /slots`` fails."""
        meta: dict = {}
        data = await self.fetch_slots(meta)
        self._restarted(data, meta.get("boot"))
        grown = [e for e in data if e.get("id_task") is not None
                 and int(e["id_task"]) > before.get(int(e.get("id", -1)), -1)]
        if len(grown) != 1 or not 0 <= int(grown[0].get("id", -1)) < len(self.slots):
            return None
        e = grown[0]
        st = self.slots[int(e["id"])]
        st.clear()
        st.tokens = list(tokens)
        n = e.get("n_prompt_tokens")
        st.n_total = int(n) if n is not None else None
        st.user_starts = list(user_starts)
        st.owner, st.kind = owner, kind
        st.labels = dict(labels or {})
        st.last_used = time.monotonic()
        if self.params.checkpoints:
            # the checkpoints the server kept are not reported; those this prefill made are
            # predicted when the answer's cache_n is known (OCacheLayer.observe)
            st.checkpoints = []
        return st.id

    def _restarted(self, data: list[dict], boot: str | None = None) -> bool:
        """Whether ``GET /slots`` comes from another process than the last one: its boot id
        (``boot``, patches/0005) differs from the table's, or a slot's ``id_task`` vanished or went
        back (see ``_id_task``); records the ids either way."""
        seen = {int(e.get("id", -1)): e.get("id_task") for e in data}
        restarted = any(sid in self._id_task and (t is None or int(t) < self._id_task[sid])
                        for sid, t in seen.items())
        if boot is not None and self.boot is not None and boot != self.boot:
            restarted = True
        if restarted:
            self._id_task.clear()
        for sid, t in seen.items():
            if t is not None:
                self._id_task[sid] = max(int(t), self._id_task.get(sid, -1))
        return restarted

    def reconcile_one(self, st: SlotState, entry: Mapping) -> None:
        """Reconcile one idle slot's belief with its ``GET /slots`` entry (docs/llama-server.md §4 caveats)."""
        if entry.get("is_processing"):
            if st.interrupted and st.pending:
                # ocache's own request, cut short: the server is still cancelling it (it notices
                # the closed connection within HTTP_POLLING_SECONDS, see settle_interrupted); the
                # count is read by a later GET /slots
                self.counters["interrupted_busy"] += 1
                return
            self.counters["foreign_busy"] += 1
            st.unknown(None)
            return
        n = entry.get("n_prompt_tokens")
        if n is None:
            # never ran a task: empty, or restored (restore does not set the key). ocache knows
            # which when it did the restore itself (n_total set, foreign False).
            if st.tokens and st.n_total == len(st.tokens) and not st.pending:
                return
            if st.tokens or st.n_total:
                self.counters["reconcile_mismatch"] += 1
                st.unknown(None)
            return
        n = int(n)
        if st.pending or st.n_total is None:
            if n >= len(st.tokens):
                st.n_total = n
                st.pending = False
                return
        elif n == st.n_total:
            return
        if n == 0:
            if st.tokens or st.n_total:
                self.counters["reconcile_mismatch"] += 1
            st.clear()
            return
        self.counters["reconcile_mismatch"] += 1
        log.info("slot %d: server holds %d tokens, ocache believed %s; content now unknown",
                 st.id, n, st.n_total)
        st.unknown(n)

    async def _slot_action(self, slot: int, action: str, body: dict | None) -> dict:
        self._check(slot)
        status, data = await self._request("POST", f"/slots/{slot}?action={action}", json_body=body,
                                           slot=slot, what=action)
        if status != 200 or not isinstance(data, dict):
            raise error_from_response(status, data, slot, action)
        return data

    @staticmethod
    def _check_filename(filename: str) -> None:
        """The subset of ``fs_validate_filename`` (common.cpp:796-868) that ocache's own names could
        break; the server checks the rest (400 ``Invalid filename`` -> SlotFileError)."""
        bad = set(':*?"<>|/\\')
        if (not filename or len(filename.encode()) > 255 or any(c in bad or ord(c) < 32 for c in filename)
                or ".." in filename or filename.endswith(".") or filename != filename.strip(" ")):
            raise SlotFileError(f"invalid slot file name {filename!r}", 400)

    async def save(self, slot: int, filename: str) -> dict:
        """``POST /slots/{slot}?action=save`` -> ``{"n_saved": tokens, "n_written": bytes, ...}``
        (docs/llama-server.md §5). Does not change what the slot holds. Raises SlotNotSupported (no
        ``--slot-save-path``), SlotFileError, UpstreamError."""
        self._check_filename(filename)
        return await self._slot_action(slot, "save", {"filename": filename})

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
        self._check_filename(filename)
        st = self.slots[slot]
        t0 = time.monotonic()
        payload = {"filename": filename}
        if xxh3 is not None:
            payload["xxh3"] = xxh3
        try:
            data = await self._slot_action(slot, "restore", payload)
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
        st.clear()
        if tokens is not None and len(tokens) == n:
            st.tokens = list(tokens)
            st.n_total = n
            # the patched build reports how many checkpoints its sidecar brought back (the newest
            # ones); a stock build restores none (docs/llama-server.md §6)
            n_ck = data.get("n_checkpoints")
            ck = list(checkpoints or [])
            st.checkpoints = (ck[-int(n_ck):] if n_ck else []) if n_ck is not None else []
        else:
            st.unknown(n)
        st.restored_from = filename
        st.last_used = time.monotonic()
        return data

    async def erase(self, slot: int) -> dict:
        """``POST /slots/{slot}?action=erase`` -> ``{"n_erased": tokens}``; the slot is empty after."""
        data = await self._slot_action(slot, "erase", None)
        self.slots[slot].clear()
        return data

    async def warm(self, slot: int, tokens: Sequence[int], *, message_delimiters: list | None = None,
                   user_starts: Sequence[int] = ()) -> dict:
        """Prefill ``tokens`` into ``slot`` without generating: ``POST /completion`` with the token ids
        as prompt, ``n_predict: 0``, ``id_slot`` pinned, ``cache_prompt: true``. The server samples
        one token but never decodes it, so the slot then holds exactly ``tokens`` (docs/llama-server.md §13).

        Returns the response's ``timings`` (``cache_n``/``prompt_n`` tokens, ``prompt_ms``).
        Raises UpstreamError (e.g. 400 ``exceed_context_size_error``) with the slot left as the
        server left it (content unknown).
        """
        self._check(slot)
        st = self.slots[slot]
        tokens = list(tokens)
        task = self.next_task()
        pred = predict_reuse(st.tokens, st.n_total, st.checkpoints, tokens, self.params,
                             user_starts=user_starts if message_delimiters else (), task=task)
        body: dict[str, Any] = {"prompt": tokens, "n_predict": 0, "id_slot": slot, "cache_prompt": True,
                                "stream": False}
        if message_delimiters:
            body["message_delimiters"] = message_delimiters
        status, data = await self._request("POST", "/completion", json_body=body, slot=slot, what="warm")
        if status != 200 or not isinstance(data, dict):
            st.unknown(None)
            raise error_from_response(status, data, slot, "warm")
        st.clear()
        st.tokens = tokens
        st.n_total = len(tokens)
        st.checkpoints = list(pred.checkpoints_after)
        st.user_starts = list(user_starts)
        st.last_used = time.monotonic()
        timings = dict(data.get("timings") or {})
        n0, ms0 = self.own_prefill.get(slot, (0, 0.0))
        self.own_prefill[slot] = (n0 + int(timings.get("prompt_n") or 0), ms0 + float(timings.get("prompt_ms") or 0.0))
        timings["predicted_cache_n"] = pred.cache_n
        cached = data.get("tokens_cached")
        if cached is not None and int(cached) != len(tokens):
            log.warning("warm slot %d: server holds %s tokens, expected %d", slot, cached, len(tokens))
            st.n_total = int(cached)
        return timings
