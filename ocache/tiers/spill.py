"""The session tier: whole conversations spilled to disk before they are lost, restored when they
come back (docs/architecture.md §3; why the server's RAM cache is off instead: docs/decisions.md D1).

The disk tier keeps *heads* (prefixes shared by many sessions). Everything past a session's first
answer is its own state, and two events throw it away: another session taking its slot (``-np 1``,
or more live conversations than slots) and a restart. This tier saves the slot (``POST
/slots/{id}?action=save``, plus the patched server's checkpoint sidecar) into the store shared with
the disk tier (``ocache.tiers.store``, kind ``"s"``, its own byte budget) at exactly those moments:

* **eviction** (``before_evict``; the cache layer holds the slot's lock and calls it when a request
  of another conversation is about to replace this one and no other slot can take it): the slot is
  spilled when it holds at least ``min_tokens`` tokens (default 256, ``spill_min_tokens``), then
  the request is served. A **guest** (opencode's title request) is spilled when a request
  overwrites its slot (the planner's ``before_evict`` step on an unprotected slot:
  ``ocache.cache.plan.guest_spilled``) and it holds at least ``guest_min_tokens`` (256); see
  "Guests" below. The request waits for the server's save only; hashing and the commit run
  in the background (the file is complete when the save returns).
* **planned stop** (``ocache serve`` receiving SIGTERM, or ``ocache drain``): the proxy stops
  accepting, finishes in-flight requests, then ``OCacheLayer.drain`` calls ``before_evict`` on every
  live slot and this tier's :meth:`SessionTier.on_drain`, which spills what is left (at least
  ``drain_min_tokens``), waits for every commit and writes a *resume marker* naming the most recent
  conversation. The next start restores it (:meth:`SessionTier.after_start`, called by the layer
  while it gets ready, so a request arriving meanwhile waits for it: a restore never races a
  prefill).
* **live save** (``tiers.session.live_save``; default: when ``store.remote`` is configured): after
  each completed turn, once nothing is in flight and no request came for ``live_save_quiet_s``,
  the conversation is spilled with reason ``live`` (at most once a turn, only when it changed;
  ``ocache.tiers.live``), so the remote tier uploads it and a crash of the host loses at most the
  turn in flight. The slot keeps its conversation; a later eviction or drain of the same content
  writes nothing (the entry is found by its tokens).

An **interrupted** answer (the client cut a stream off, e.g. a coding agent's user pressing Esc;
``SlotTable.interrupted``) is spilled too: the slot holds what the server kept, the prompt plus the
tokens generated so far (docs/llama-server.md §7). The tier records the conversation when the cut
is observed (:meth:`SessionTier.interrupted`) and spills it once its count is known: the next
``GET /slots`` (every plan reads it) or, when the slot is evicted or drained before that,
``SlotTable.settle_interrupted`` under the slot's lock. The saved file's tokens start with the
prompt (checked, as for every spill); the next turn (the prompt plus the partial or a new answer)
restores at least the prompt part. Measured: ``pytest -s tests/test_spill.py -k interrupted``.

What is never spilled: a slot whose last response was rejected (non-200: the cache layer marks it
unknown), a cut answer whose prefill had not finished (``GET /slots`` counts fewer tokens than the
prompt: content unknown) or whose count cannot be read, a slot whose content ocache cannot name
(``foreign``), guests on a planned stop, warmed heads, and a slot the tier did not see finish or get cut (its ``seq``
differs from the one ``admit``/``interrupted`` recorded). The saved file's token header is compared
with what ocache sent the slot before the entry is committed: a mismatch is discarded, never
attributed to a session.

Session identity
    A *hint*, from what the client sends: opencode's ``x-session-affinity``/``x-session-id`` header
    (``ParsedRequest.session_hint`` → ``RequestContext.session``), else the xxh3 of the request's
    tokens up to the end of its first user turn (harness head + first user message: a function of
    the harness fingerprint and the first user turn). It names whose spill an entry is (a session's
    newer spill supersedes its older ones; a tie between two offers goes to the request's own), not
    who may read it: the *tokens are the answer*, so a request is offered the entry with the longest
    usable prefix it shares past the harness head, whichever session spilled it, and only for those
    shared tokens (computed from the stored token ids element by element, with the server's own
    reuse rules, ``ocache.llama.reuse.predict_reuse``; the server recomputes everything after them,
    so nothing of the other conversation reaches the response). A read never consumes: the entry
    stays in the store under its own session (a restore deletes nothing, and the reader's own spill
    later carries the reader's identity, so it supersedes only the reader's older spills). Without
    any identity (a raw ``/completion`` without ``message_delimiters``, whose head end may be
    unknown) the request must contain the whole prompt the conversation was last sent (within one
    ubatch), the resident tier's rule for "same conversation".

    Why any session's spill (``ocache bench --preset tiny --scenario
    opencode_pi_alternating --models hybrid``): two opencode runs sent byte-identical agent turns
    under two session keys; the server alone reused 7,247 tokens of the first run's slot while
    ocache, offered the first run's spill only for its own session, restored the 7,234-token disk
    anchor instead (+13 prefilled tokens on each of two turns, 9,729 vs 9,703, 1.003). On the
    first of them the run's title request, 50 ms ahead, evicted that conversation into the session
    tier: the agent turn's lookup came while the spill was being committed, hence the wait for
    in-flight spills (:meth:`SessionTier.before_evict`).

Guests
    A guest's slot is overwritten without a spill by llama-server too, but the server alone keeps
    the old prompt in its RAM cache (``--cache-ram``, default 8 GiB, docs/llama-server.md §10) and the
    next title, byte for byte the same system prompt every run, restores it there; ocache runs the
    server with ``--cache-ram 0`` (below), so without this tier's spill the next title was prefilled
    whole: ``ocache bench --preset tiny --template real --scenario opencode_pi_alternating
    --models hybrid,dense``, request #5 ``opencode_run2_title``: 4 tokens prefilled alone (cache_n
    537), 541 through ocache (1.031 over the scenario). So a guest is spilled like a conversation,
    apart from it: its entry's ``kind`` is ``guest`` (:func:`is_guest`); guests read only guests'
    entries, of any session, from a useful reuse on (64 tokens: a guest has no harness head the
    disk/head tiers keep), and the others never read them; a guest's spill supersedes only the
    same session's older guest spill (opencode's title shares its session key with the agent
    turns), an identical guest entry of any session is reused (two runs' titles leave the same
    state), and at most ``guest_max_entries`` (8) guest entries are kept (the least recently used
    goes). Like every spill, a guest entry never restored halves in value every hour and expires
    after 2 h (``ocache.tiers.evict.ValuePolicy``). A planned stop does not spill guests.

Reads
    ``lookup`` offers the spilled conversation whose usable prefix is longest; the planner takes it
    when it beats every resident slot and every anchor by more than its read cost
    (``ocache.cache.plan.plan_request``). ``bring`` verifies the entry (identity, each file's size and
    xxh3, the slot file's token header against the record; a failure deletes the entry and the
    request goes cold) and restores it with its checkpoints. ``admit`` confirms it by ``cache_n``.

Integrity, budget, eviction and atomicity are the store's (one store, two admission policies):
temp name → server write → fsync/hash/header check → rename → record (the commit point). A file
without a record (a spill killed part way, ``kill -9``) is never served and is swept at the next
start.

``--cache-ram`` (the engine's own RAM parking, docs/llama-server.md §10) — decision
    ocache turns it **off** (``--cache-ram 0``) for servers it plans for, and uses this tier for
    parking instead. Reasons: (1) with ``--cache-ram`` on, a request pinned to a *busy* slot can have
    that slot's in-flight state saved and overwritten by another RAM entry (docs/llama-server.md §9 "Hazard",
    the reported "one conversation's state handed to another under concurrency"); ocache itself pins
    only slots whose lock it holds, but any request that reaches the server beside ocache reopens
    that path, and with the RAM cache off it does not exist; (2) a pinned request on an empty
    slot never consults the RAM cache at all (docs/llama-server.md §9, "A pinned request on an empty slot"), so it would not serve ocache's
    A/B/A anyway, while an unpinned request's RAM swap makes ``cache_n`` unpredictable for the
    planner; (3) the RAM cache is lost on restart, the spill is not. Measured A/B/A on ``-np 1``
    (``scripts/bench-spill --aba --preset tiny --threads 1``, 2026-11-29, synthetic agent sessions of
    ~1,650 tokens parting after a 148-token head; the machine was loaded (load average 7), so the wall
    times are indicative only, the token counts are exact):

    =========  ===================================  ===================================
    request    ocache + spill, ``--cache-ram 0``    stock server, ``--cache-ram 8192``
    =========  ===================================  ===================================
    dense A2   prompt_n 27, cache_n 1657, 0.35 s    prompt_n 27, cache_n 1657, 0.12 s
    hybrid A2  prompt_n 30, cache_n 1654, 0.18 s    prompt_n 30, cache_n 1654, 0.21 s
    =========  ===================================  ===================================

    Both park A completely (the same prompt_n); the spill costs a disk write on B's arrival
    (~50 ms for 4 MB here) and a verified read on A's return where the RAM cache costs a memory copy.
    Using ``--cache-ram`` as a RAM level in front of the disk would save those milliseconds at the
    price of the hazard above and of an unpredictable ``cache_n``; the decision is to keep it off and
    let the page cache play the RAM level for recently spilled files. Revisit with the ``bench``
    models (``scripts/bench-spill --aba``) if a spill's write time ever shows in TTFT.

    Spill cost of a 16,384-token conversation (``scripts/bench-spill --spill --preset tiny
    --threads 1``, same loaded machine; the ``bench`` models were not measured because the load
    never fell under 1.5): 8.7 MB (dense) / 8.9 MB (hybrid); the evicting request waits 53-55 ms for
    the server's save, the background commit takes 117-128 ms, verify + restore 49-141 ms, against a
    30-40 s cold prefill; the next request reused 16,383 (dense) / 16,380 (hybrid) tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import xxhash

from ocache.background import Background
from ocache.tiers.base import Offer, Rate, TierBase, TierError
from ocache.tiers.restore import restore_verified, save_reserved
from ocache.config import field_of as _get, slot_save_path
from ocache.llama.checks import FLAGS_FIX
from ocache.tiers.store import sidecar_checkpoints
from ocache.tiers.store import (BudgetError, IntegrityError, LockedError, Store, StoreError, atomic_write, entry_key,
                    prefix_hash, read_slot_tokens, shared_store)
from ocache.tiers.spill_policy import SlotSeen, SpillConfig, SpillPolicy, is_guest
from ocache.tiers.live import LiveSaves, live_mode

log = logging.getLogger("ocache.spill")

KIND = "s"
RESUME_MARKER = "session-resume.json"


class SpillError(TierError):
    """``bring`` failed: ``reason`` is a store check word (``missing``, ``size``, ``hash``,
    ``identity``, ``tokens``, ``header``, ``record``; the entry was deleted), ``restore`` (the server
    refused the file; entry deleted), ``upstream`` (the server could not be asked: refused or reset
    connection, timeout, 5xx; entry kept) or ``gone`` (evicted since ``lookup``). The request goes
    cold."""

    tier = "session"


@dataclass
class SpillRef:
    """``Offer.ref`` of the session tier."""

    key: str
    n_tokens: int
    bytes: int
    lcp: int


def hint_key(hint: str | None) -> str | None:
    """Session identity from a client's session header: ``"h:" + xxh3_64(hint)`` (None if no hint)."""
    if not hint:
        return None
    return "h:" + xxhash.xxh3_64_hexdigest(hint.encode("utf-8", "surrogatepass"))


def first_turn_end(tokens: Sequence[int], user_starts: Sequence[int]) -> int | None:
    """Index just past the first user turn: the next occurrence of the turn-start token (the token at
    ``user_starts[0]``, ``<|im_start|>`` in ChatML) after the first user start, else ``len(tokens)``.
    None when the request has no user turn."""
    if not user_starts:
        return None
    u = int(user_starts[0])
    if not 0 <= u < len(tokens):
        return None
    start_tok = tokens[u]
    for i in range(u + 1, len(tokens)):
        if tokens[i] == start_tok:
            return i
    return len(tokens)


def session_key(hint: str | None, view: Any) -> str | None:
    """The session identity of a request (see the module docstring): the hint's key, else
    ``"t:" + xxh3_64`` of its tokens up to the end of the first user turn, else None."""
    k = hint_key(hint)
    if k is not None:
        return k
    toks = _get(view, "tokens") or []
    end = first_turn_end(toks, list(_get(view, "user_starts") or []))
    if end is None:
        return None
    return "t:" + prefix_hash(toks[:end])


def entry_checkpoints(e: Any) -> list:
    """The checkpoints (``ocache.llama.reuse.Checkpoint``) an entry's record lists."""
    from ocache.llama.reuse import Checkpoint

    return [Checkpoint(int(n)) for n in (e.meta.get("checkpoints") or [])]


def write_marker(path: Path, identity: str | None, resume: str, slots: dict[int, str]) -> None:
    """Write the resume marker a drained stop leaves at ``path`` (JSON: ``identity``, ``written``
    in Unix seconds, ``resume``: the entry key to restore, ``slots``: ``[{"slot", "key"}]`` of
    every committed spill). A failure is logged."""
    doc = {"identity": identity, "written": time.time(), "resume": resume,
           "slots": [{"slot": s, "key": k} for s, k in slots.items()]}
    try:
        atomic_write(path, json.dumps(doc).encode())
    except OSError as exc:
        log.warning("session: could not write the resume marker: %s", exc)


def take_marker(path: Path, identity: str | None) -> str | None:
    """The entry key the resume marker at ``path`` names for ``identity`` (None: no marker, an
    unreadable one, another identity's); the marker is consumed whatever it says."""
    try:
        doc = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("session: unreadable resume marker (%s); ignored", exc)
        doc = None
    with contextlib.suppress(OSError):
        path.unlink()
    if not isinstance(doc, dict) or doc.get("identity") != identity or not doc.get("resume"):
        return None
    return str(doc["resume"])


class SessionTier(TierBase):
    """The session tier over the shared :class:`Store` and the cache layer's ``SlotTable``.

    ``table``: ``ocache.slots.SlotTable`` (save/restore/params and the per-slot beliefs).
    ``resume_path``: where the resume marker lives (default ``store.meta_dir / session-resume.json``).
    """

    name = "session"

    def __init__(self, store: Store, table: Any, config: SpillConfig | None = None, *,
                 resume_path: Path | None = None) -> None:
        self.store = store
        self.table = table
        self.cfg = config or SpillConfig()
        self.policy = SpillPolicy(self.cfg)
        self.resume_path = Path(resume_path) if resume_path else Path(store.meta_dir) / RESUME_MARKER
        # bytes/s of a restore: the slot table's, end to end over every tier in this process
        # (ocache.slots.RestoreRate); a table without one gets the tier's own
        shared = getattr(table, "restore_rate", None)
        self._own_restore_rate = shared is None
        self.restore_rate = Rate(self.cfg.restore_bytes_s) if shared is None else shared
        self.verify_rate = Rate(self.cfg.verify_bytes_s)
        self.bytes_per_token: float = 0.0
        self._seen: dict[int, SlotSeen] = {}
        self._pending: dict[int, tuple[str, int]] = {}   # slot -> (entry key, tokens expected reused)
        self.background = Background(self.name)   # the commits of spills
        # evictions being spilled -> (their tokens, a guest's)
        self._inflight: dict[asyncio.Future, tuple[list[int], bool]] = {}
        self._recent: list[tuple[float, str, int]] = []  # (time, entry key, slot) of spills this run
        self._memo: tuple[Any, Any, Any] | None = None
        self.counters: dict[str, int] = {
            "lookups": 0, "offers": 0, "restores": 0, "hits": 0, "unconfirmed": 0,
            "verify_failed": 0, "restore_failed": 0, "spills": 0, "spill_failed": 0,
            "spill_skipped_short": 0, "spill_skipped_unsafe": 0, "spill_skipped_budget": 0,
            "spill_dedup": 0, "superseded": 0, "resumed": 0, "resume_failed": 0,
            "restore_upstream_failed": 0, "interrupted_seen": 0, "interrupted_spills": 0,
            "inflight_waits": 0, "guest_spills": 0, "guest_dropped": 0,
        }
        self.spill_s: list[float] = []     # seconds each spill held its request (the server's save)
        self.commit_s: list[float] = []    # seconds of each background commit (fsync + hash + rename)
        self.restore_s: list[float] = []   # seconds of each verify + restore
        self.spill_bytes: list[int] = []
        #: saves of live conversations at idle, spills with reason ``live`` (``ocache.tiers.live``)
        self.live = LiveSaves(lambda slot: self._spill(slot, "live"), table, quiet_s=self.cfg.live_quiet_s, counters=self.counters)

    # ------------------------------------------------------------------ helpers
    @property
    def params(self) -> Any:
        return self.table.params

    def read_cost_s(self, nbytes: int) -> float:
        """Seconds to verify and restore ``nbytes`` at the measured rates (the restore's: the slot
        table's, end to end, ``ocache.slots.RestoreRate``)."""
        return nbytes / self.verify_rate.value + nbytes / self.restore_rate.value

    def will_spill(self, slot: int) -> bool:
        """Whether :meth:`before_evict` would save ``slot``'s conversation if it were evicted now
        (``SpillPolicy.will_spill``), so the planner can count an overwrite of it as free. Pure
        (reads the table); never raises."""
        try:
            return self.policy.will_spill(self.table[slot], self._seen.get(slot))
        except Exception:  # noqa: BLE001 - an unknown slot is one we would not spill
            return False

    # ------------------------------------------------------------------ writes
    async def before_evict(self, slot: int) -> None:
        """The slot's conversation is about to be replaced (the caller holds the slot's lock): spill it
        if it is long enough (``min_tokens``) and safe (see the module docstring). Never raises.

        Until the spill is committed (or skipped) its tokens are *in flight*: a :meth:`lookup` of a
        request sharing them past its harness head waits for the commit (bounded), so a request
        that arrives while another one evicts the conversation it continues still finds it."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        st = self.table[slot]
        self._inflight[done] = (list(st.tokens), st.kind == "guest")
        before = self.background.tasks

        def finish(_: Any = None) -> None:
            self._inflight.pop(done, None)
            if not done.done():
                done.set_result(None)

        try:
            await self._spill(slot, "evict")
        finally:
            commits = [t for t in self.background.tasks - before if not t.done()]
            if commits:
                asyncio.gather(*commits, return_exceptions=True).add_done_callback(finish)
            else:
                finish()

    async def _await_inflight(self, toks: Sequence[int], floor: int, guest: bool = False) -> None:
        """Wait (at most ``inflight_wait_s`` in all) for the in-flight spills of the request's
        class (``guest`` or not: the entries :meth:`lookup` reads) that share more than ``floor``
        tokens with ``toks`` (see :meth:`before_evict`)."""
        from ocache.llama.reuse import common_prefix

        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.inflight_wait_s
        while True:
            waits = [f for f, (t, g) in list(self._inflight.items())
                     if g == guest and common_prefix(t, toks) > floor]
            left = deadline - loop.time()
            if not waits or left <= 0:
                return
            self.counters["inflight_waits"] += 1
            await asyncio.wait(waits, timeout=left)

    async def interrupted(self, view: Any, slot: int, obs: Any) -> None:
        """The response on ``slot`` was cut short after it started (see the module docstring):
        remember the conversation (session identity, ``seq``, the prompt's length) as a partial one,
        spillable once ``GET /slots`` has counted what the slot holds."""
        self._pending.pop(slot, None)   # a restore this request used is not confirmed by a cut answer
        st = self.table[slot]
        if not st.interrupted or st.tokens != list(view.tokens):
            self._seen.pop(slot, None)
            return
        self.counters["interrupted_seen"] += 1
        self._seen[slot] = SlotSeen(st.seq, session_key(st.owner, view), len(view.tokens), st.kind,
                                     st.owner, st.head_key, partial=True)

    async def _settle(self, slot: int) -> None:
        """A partial conversation whose count is still pending (no ``GET /slots`` since the cut):
        read it now (the caller holds the slot's lock; ``SlotTable.settle_interrupted``, bounded)."""
        st = self.table[slot]
        seen = self._seen.get(slot)
        if not (st.pending and st.interrupted and seen is not None and seen.partial and seen.seq == st.seq):
            return
        try:
            await asyncio.wait_for(self.table.settle_interrupted(slot), 10.0)
        except (asyncio.TimeoutError, Exception) as exc:  # noqa: BLE001 - then it is not spilled
            log.info("session: slot %d: the cut answer's length could not be read (%s)", slot, exc)

    async def _spill(self, slot: int, reason: str) -> str | None:
        """Save ``slot`` as a session entry (``reason``: ``evict``, ``drain``, ``live``; the shortest
        spilled: ``SpillPolicy.min_tokens``). Returns the entry key (also when already stored), or
        None when skipped or failed. The commit runs in the background (:meth:`flush` waits for it)."""
        await self._settle(slot)
        ok, why = self.policy.spillable(self.table[slot], self._seen.get(slot))
        if not ok:
            self.counters["spill_skipped_unsafe"] += 1
            log.info("session: slot %d not spilled (%s)", slot, why)
            return None
        st = self.table[slot]
        seen = self._seen[slot]
        n = max(int(st.n_total or 0), len(st.tokens))
        min_tokens = self.policy.min_tokens(seen.kind, reason)
        if min_tokens is None or n < min_tokens:
            self.counters["spill_skipped_short"] += 1
            return None
        # the same content already stored (a restored slot not used since, a repeated drain)
        cached = self.policy.same_content(self.store.entries(KIND), self.store.tokens, st.tokens, n, seen)
        if cached is not None:
            self.counters["spill_dedup"] += 1
            if reason != "live":   # (what a drain resumes: its own and evictions' spills)
                self._recent.append((time.time(), cached, slot))
            return cached
        pkey = "p" + prefix_hash(list(st.tokens) + [n, slot])[:15] + os.urandom(4).hex()
        # the budget is checked before the server writes anything (Store.estimate_bytes: sizes of
        # every file of this identity measured so far); room is made for it, or the spill refused
        est = self.store.estimate_bytes(n)
        if est is None:
            est = int(self.bytes_per_token * n)
        try:
            tmp, resp, took = await save_reserved(self.store, self.table, slot, pkey, KIND, est)
        except BudgetError as exc:
            self.counters["spill_skipped_budget"] += 1
            log.warning("session: no room to spill slot %d (%d tokens): %s", slot, n, exc)
            return None
        except Exception as exc:  # noqa: BLE001 - nothing reserved or written is left behind
            self.counters["spill_failed"] += 1  # the request proceeds; the conversation is lost
            log.warning("session: save of slot %d failed: %s", slot, exc)
            return None
        self.spill_s.append(took)
        self.store.note_size(n, int(resp.get("n_written", 0) or 0))  # the .bin's bytes
        try:
            tokens = await asyncio.to_thread(read_slot_tokens, self.store.path(tmp))
        except (OSError, ValueError) as exc:
            tokens = None
            log.warning("session: slot %d file unreadable: %s", slot, exc)
        except BaseException:
            self.store.release(pkey)
            self.store.discard_temp(tmp)
            raise
        if tokens is None or tokens[:len(st.tokens)] != list(st.tokens) or len(tokens) != int(resp.get("n_saved", -1)):
            self.counters["spill_failed"] += 1
            log.warning("session: slot %d holds other tokens than ocache sent it; not spilled", slot)
            self.store.release(pkey)
            self.store.discard_temp(tmp)
            return None
        key = entry_key(self.store.identity or "", KIND, tokens)
        meta = {"session": seen.session, "owner": seen.owner, "kind": seen.kind, "slot": slot,
                "prompt_n": seen.prompt_n, "reason": reason, "head_key": seen.head_key,
                **({"first_user": seen.first_user} if seen.first_user is not None else {}),
                **({"interrupted": True} if seen.partial else {}),
                **{k: v for k, v in (getattr(st, "labels", None) or {}).items() if v}}
        self.background.spawn(self._commit(pkey, tmp, tokens, meta, slot, seen.head_key), "commit")
        if reason != "live":
            self._recent.append((time.time(), key, slot))
        return key

    async def _commit(self, pkey: str, tmp: str, tokens: list[int], meta: dict, slot: int,
                      fingerprint: str | None) -> None:
        t0 = time.monotonic()
        try:
            ckpt = self.store.path(tmp + ".ckpt")
            meta["checkpoints"] = await asyncio.to_thread(sidecar_checkpoints, ckpt) if ckpt.exists() else []
            self.store.release(pkey)
            e = await asyncio.to_thread(self.store.commit, KIND, tokens, tmp, fingerprint=fingerprint, meta=meta)
        except Exception as exc:  # noqa: BLE001
            self.counters["spill_failed"] += 1
            self.store.release(pkey)
            self.store.discard_temp(tmp)
            log.warning("session: commit of slot %d (%d tokens) failed: %s", slot, len(tokens), exc)
            return
        dt = time.monotonic() - t0
        self.commit_s.append(dt)  # fsyncs and renames included: not a read rate, so not in verify_rate
        self.spill_bytes.append(e.bytes)
        self.bytes_per_token = max(self.bytes_per_token, e.bytes / max(1, e.n_tokens))
        self.counters["spills"] += 1
        if meta.get("interrupted"):
            self.counters["interrupted_spills"] += 1
        log.info("session: spilled slot %d (%s, %d tokens, %d bytes, %s)", slot, meta["reason"],
                 e.n_tokens, e.bytes, (meta.get("session") or "-")[:12])
        # a session's newer state supersedes its older spills, within its class (SpillPolicy.superseded)
        for old in self.policy.superseded(e, tokens, self.store.entries(KIND), self.store.tokens):
            self.counters["superseded"] += 1
            await asyncio.to_thread(self.store.delete, old.key, "superseded by a newer spill")
        if is_guest(meta):
            self.counters["guest_spills"] += 1
            for old in self.policy.guests_over(e, self.store.entries(KIND)):
                self.counters["guest_dropped"] += 1
                await asyncio.to_thread(self.store.delete, old.key, "more guest spills than guest_max_entries")

    async def flush(self) -> None:
        """Wait for background commits."""
        await self.background.join()

    async def on_drain(self, table: Any = None) -> dict:
        """Planned stop (after in-flight requests finished and ``before_evict`` ran on every live
        slot): spill every remaining safe conversation of at least ``drain_min_tokens``, wait for all
        commits, and write the resume marker naming the most recent one. Returns
        ``{"spilled": [keys], "resume": key | None}``. Never raises."""
        self.live.stop()
        keys: list[str] = []
        for st in list(self.table.slots):
            async with self.table.lock(st.id):
                k = await self._spill(st.id, "drain")
            if k:
                keys.append(k)
        await self.flush()
        # what was kept, not what was attempted: a spill the commit refused (budget, header) is gone
        kept = [k for k in keys if self.store.get(k) is not None]
        lost = len(keys) - len(kept)
        # the conversation to resume is an agent's or another's, never a guest's spill
        committed = [(t, k, s) for t, k, s in self._recent
                     if (e := self.store.get(k)) is not None and not is_guest(e.meta)]
        order = [st.id for st in sorted(self.table.slots, key=lambda st: st.last_used, reverse=True)]
        resume = self.policy.resume_choice(committed, order)
        if resume is not None:
            write_marker(self.resume_path, self.store.identity, resume, {s: k for _, k, s in committed})
        log.info("session: drain spilled %d conversation(s)%s; resume %s", len(kept),
                 f" ({lost} not kept)" if lost else "", resume)
        return {"spilled": kept, "resume": resume}

    # ------------------------------------------------------------------ start-up
    async def after_start(self) -> int | None:
        """After a start that follows a drain: restore the conversation the resume marker names into
        the slot it was in (modulo the slot count). The cache layer calls this while it gets ready,
        holding its ready lock, so requests wait for it. The marker is consumed whatever happens.
        Returns the slot restored, or None. Never raises."""
        if not self.cfg.resume:
            return None
        key = take_marker(self.resume_path, self.store.identity)
        e = None if key is None else self.store.get(key)
        if key is None or e is None or not len(self.table):
            return None
        slot = int(e.meta.get("slot", 0) or 0) % len(self.table)
        async with self.table.lock(slot):
            try:
                await self._restore(key, slot)
            except SpillError as exc:
                self.counters["resume_failed"] += 1
                log.warning("session: resume of %s failed: %s", key[:12], exc)
                return None
            owner, kind, head_key = e.meta.get("owner"), e.meta.get("kind") or "agent", e.meta.get("head_key")
            seq = self.table.adopt(slot, owner=owner, kind=kind, head_key=head_key)
            self._seen[slot] = SlotSeen(seq, e.meta.get("session"), int(e.meta.get("prompt_n") or 0),
                                         kind, owner, head_key)
        self.counters["resumed"] += 1
        log.info("session: resumed %d tokens into slot %d after a drained stop", e.n_tokens, slot)
        return slot

    # ------------------------------------------------------------------ reads
    async def lookup(self, view: Any, ctx: Any) -> Offer | None:
        """The spilled conversation (of any session) with the longest usable prefix, or None. A
        guest reads guests' entries only, from 64 tokens on; every other request the others'
        (module docstring, "Guests").

        ``tokens_usable``: what the server will reuse after the restore (``predict_reuse`` on the
        stored tokens and checkpoints: on a hybrid model a prompt that diverges inside the stored
        conversation resumes from a checkpoint). Offered only past the harness head (``view.head_end``:
        a head is the disk/head tiers' business) and, without a session identity, only when the request
        contains the conversation's last prompt. On equal usable prefixes: the request's own session's
        entry, then the smaller file (the cheaper read). An eviction's spill still being saved or
        committed that shares tokens past the head is waited for first (:meth:`before_evict`).
        """
        guest = _get(ctx, "kind") == "guest"
        floor = self.policy.offer_floor(guest, int(_get(view, "head_end") or 0))
        if self._inflight:
            await self._await_inflight(view.tokens, floor, guest)
        # another identity's spills (another model or build: a patched server replaced by a stock
        # one) are kept for it and never offered: each would be refused at its restore's check
        ident = self.store.identity
        entries = [e for e in self.store.entries(KIND)
                   if is_guest(e.meta) == guest and (ident is None or e.identity == ident)]
        if not entries:
            return None
        self.counters["lookups"] += 1
        toks = view.tokens
        keyset = tuple(sorted(e.key for e in entries))
        if self._memo is not None and self._memo[0] is view and self._memo[1] == keyset:
            return self._memo[2]
        skey = session_key(_get(ctx, "session"), view)
        best: tuple[tuple[int, bool, int], Any, int] | None = None
        from ocache.llama.reuse import common_prefix, predict_reuse

        for e in entries:
            try:
                stored = await asyncio.to_thread(self.store.tokens, e.key)
            except (IntegrityError, KeyError):
                continue
            lcp = common_prefix(stored, toks)
            if lcp <= floor:
                continue
            if not self.policy.matches(e, len(stored), lcp, skey):
                continue
            reuse = predict_reuse(stored, len(stored), entry_checkpoints(e), toks, self.params)
            if reuse.cache_n <= floor:
                continue
            rank = self.policy.rank(reuse.cache_n, e, skey)
            if best is None or rank > best[0]:
                best = (rank, e, lcp)
        offer = None
        if best is not None:
            (usable, _own, _nb), e, lcp = best
            self.counters["offers"] += 1
            offer = Offer(tier=self.name, tokens_usable=usable, cost_s=self.read_cost_s(e.bytes),
                          ref=SpillRef(e.key, e.n_tokens, e.bytes, lcp), verified=True)
        self._memo = (view, keyset, offer)
        return offer

    async def bring(self, offer: Offer, slot: int) -> None:
        """Verify and restore the offered conversation into ``slot`` (caller holds its lock). Raises
        SpillError (entry deleted on a failed check or a refused restore)."""
        ref: SpillRef = offer.ref
        await self._restore(ref.key, slot, expect=int(offer.tokens_usable))

    async def _restore(self, key: str, slot: int, expect: int | None = None) -> None:
        """Verify and restore entry ``key`` into ``slot``; ``admit`` then confirms it when the
        server reuses ``expect`` tokens (the offer's usable prefix; default the whole entry) within
        two ubatches. The entry stays in the store whoever reads it (a read never moves a spill
        from the session that spilled it). Raises SpillError."""
        t0 = time.monotonic()
        e = await restore_verified(self.store, self.table, key, slot, error=SpillError, counters=self.counters,
                                   verify_rate=self.verify_rate,
                                   restore_rate=self.restore_rate if self._own_restore_rate else None)
        self.restore_s.append(time.monotonic() - t0)
        self.counters["restores"] += 1
        self._pending[slot] = (key, e.n_tokens if expect is None else min(expect, e.n_tokens))
        await asyncio.to_thread(self.store.touch, key, True)

    # ------------------------------------------------------------------ after a request
    async def admit(self, view: Any, slot: int, obs: Any) -> None:
        """After a completed response on ``slot`` (the cache layer calls this only for complete 200
        responses): remember the slot's session identity and ``seq`` (what makes it spillable), and
        confirm a restore by ``cache_n``."""
        timings = _get(obs, "timings") or {}
        p = self._pending.pop(slot, None)
        if p is not None:
            cache_n = _get(timings, "cache_n")
            if cache_n is not None and int(cache_n) >= min(p[1], len(view.tokens)) - self.cfg.ubatch * 2 - 1:
                self.counters["hits"] += 1
            else:
                self.counters["unconfirmed"] += 1
                log.warning("session: restore of %d tokens into slot %d not confirmed (cache_n=%s)",
                            p[1], slot, cache_n)
        if not (_get(obs, "completed", True) and int(_get(obs, "status", 200) or 200) == 200):
            self._seen.pop(slot, None)
            return
        st = self.table[slot]
        if st.tokens != list(view.tokens):
            self._seen.pop(slot, None)
            return
        starts = getattr(view, "user_starts", None) or ()
        self._seen[slot] = SlotSeen(st.seq, session_key(st.owner, view), len(view.tokens), st.kind,
                                     st.owner, st.head_key, first_user=int(starts[0]) if starts else None)
        if st.kind != "guest":
            self.live.note(slot, st.seq)   # saved at the next idle moment (when enabled)

    async def on_upstream_restart(self) -> None:
        self.live.forget()
        self._seen.clear()
        self.counters["unconfirmed"] += len(self._pending)
        self._pending.clear()

    async def clear(self) -> dict:
        await self.flush()
        return {"deleted": await asyncio.to_thread(self.store.clear, KIND)}

    def stats(self) -> dict:
        return {**self.counters, "entries": len(self.store.entries(KIND)),
                "bytes": self.store.kind_bytes(KIND), "budget_bytes": self.store.kind_budgets.get(KIND),
                "spill_s_p50": p50(self.spill_s), "commit_s_p50": p50(self.commit_s),
                "restore_s_p50": p50(self.restore_s), "restore_bytes_s": round(self.restore_rate.value),
                "live_enabled": self.live.enabled, "live_save_s_p50": p50(self.live.save_s),
                "verify_bytes_s": round(self.verify_rate.value)}


def p50(xs: list[float]) -> float | None:
    """The median of ``xs`` (the upper one of an even count), None when empty."""
    return sorted(xs)[len(xs) // 2] if xs else None


# ---------------------------------------------------------------------- factory

def make_session_tier(config: Any, table: Any, identity: Any) -> SessionTier | None:
    """Build the session tier for ``OCacheLayer``, or None when it cannot or should not work.

    Off when ``tiers.session.enabled`` is false, when no ``--slot-save-path`` is known (the server
    cannot save slots, docs/llama-server.md §3), without a server identity, or when the store is locked by another
    process. Settings: ``spill_budget_gb``, ``spill_min_tokens`` and ``tiers.session`` keys
    ``drain_min_tokens``, ``guest_min_tokens``, ``resume``, ``live_save`` (``remote``, true, false:
    ``ocache.tiers.live.live_mode``; the layer enables the live saves it asks for,
    ``ocache.cache.wiring.BuiltTiers.ready``), ``live_save_quiet_s``. Raises ValueError for a
    ``live_save`` value it does not know. The store is the one the disk tier uses (``shared_store``).
    """
    tiers = _get(config, "tiers") or {}
    scfg = dict(tiers.get("session") or {}) if isinstance(tiers, dict) else {}
    if scfg.get("enabled") is False:
        return None
    data_dir = slot_save_path(config, _get(table, "params"))
    if data_dir is None:
        log.info("session tier off: no --slot-save-path known: %s, or use serve --launch", FLAGS_FIX)
        return None
    key = identity if isinstance(identity, str) else getattr(identity, "key", None)
    if not key:
        log.warning("session tier off: no server identity")
        return None
    budget = int(float(_get(config, "spill_budget_gb", 40.0)) * 1e9)
    if budget <= 0:
        log.info("session tier off: spill_budget_gb is 0")
        return None
    from ocache.tiers.disk import store_meta_dir

    try:
        store = shared_store(store_meta_dir(config), data_dir, key, kind=KIND, kind_budget_bytes=budget,
                             ttl_s=float(_get(config, "disk_ttl_days", 7.0)) * 86400.0)
    except (LockedError, StoreError, OSError) as exc:
        log.warning("session tier off: %s", exc)
        return None
    with contextlib.suppress(Exception):
        store.gc()  # TTL and budgets, as at every start
    cfg = SpillConfig(min_tokens=int(_get(config, "spill_min_tokens", 256)),
                      drain_min_tokens=int(scfg.get("drain_min_tokens", 1024)),
                      guest_min_tokens=int(scfg.get("guest_min_tokens", SpillConfig.guest_min_tokens)),
                      ubatch=int(_get(_get(table, "params"), "n_ubatch", 512) or 512),
                      resume=bool(scfg.get("resume", True)),
                      live_save=live_mode(scfg.get("live_save")),
                      live_quiet_s=float(scfg.get("live_save_quiet_s", SpillConfig.live_quiet_s)))
    return SessionTier(store, table, cfg)
