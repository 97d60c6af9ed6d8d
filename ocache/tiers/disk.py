"""The disk tier: prefix *anchors* on local disk that survive restarts (docs/decisions.md D2).

An anchor is a slot file the (patched) server wrote with ``POST /slots/{id}?action=save`` (plus the
``<file>.ckpt`` checkpoint sidecar the patch writes) holding *exactly* a prefix of a prompt, and
ocache's record of it (``ocache.tiers.store``). A later request whose tokens start with an anchor's
tokens can restore it into a slot and prefill only the rest.

Admission (which prefixes become anchors) is decided *before* the prefill, from the token view:

* **head**: the stable harness head (``view.head_end`` tokens: tools + system head + template glue)
  of every fingerprint — every new session in any folder parts after it;
* **session start**: a session's first long request (one user turn) gets an anchor just below where
  its user message starts — the next session in the same folder parts there (docs/architecture.md §3);
* **repeat**: a grid line (multiples of ``grid`` tokens) that was prefilled cold before and is about
  to be prefilled cold again (lines counted by prefix hash after each response, from ``cache_n``).

Prompts shorter than ``min_tokens`` (default 4,096) get nothing. An anchor is written by splitting
the coming prefill at its line: ``/completion`` of exactly ``tokens[:L]`` with ``n_predict: 0`` in the
chosen slot (docs/llama-server.md §13: the slot then holds exactly those tokens), ``action=save`` to a temporary
name, then the real request continues from there (it strictly extends the anchor, which is what a
hybrid model needs, docs/llama-server.md §15). The prefill work is the same as without the split; the request is
delayed by the save itself (measured: ``stats()["save_s"]``); hashing and the commit run afterwards in
the background. The lines are the plan's ``anchors`` step (:meth:`DiskTier.anchor_lines`, computed
once per request in the lookup phase); the executor runs it (:meth:`DiskTier.write_anchors`) after
``bring`` / the head warm-up and before forwarding, holding the slot's lease.

Lookup/restore (``lookup``/``bring``): the longest anchor whose tokens are a prefix of the request,
offered when its read (verify + restore, at the measured bytes/s) costs less than the prefill it saves (at the measured prefill tokens/s). Before any byte reaches the
engine the store verifies identity, every file's size and xxh3 and the token ids in the slot file's
header against the request's; a failure deletes the entry and ``bring`` raises (the request then goes
cold). The restore is confirmed by the next response's ``cache_n`` (≥ anchor tokens − one ubatch) in
``admit``; an unconfirmed restore is a counted miss (``stats()["unconfirmed"]``).

Wiring in the cache layer (``ocache.cache.OCacheLayer``, ``ocache/cache/wiring.py``): register
``make_disk_tier(config, table, identity, ubatch=...)`` with ``add_tier``; the layer passes
``anchor_lines(view)`` to the planner, the executor calls ``write_anchors(view, slot, lines,
cached_n, ctx)`` after the plan's other steps, then re-predicts the slot's reuse (the slot then
holds the last anchor); ``on_upstream_restart`` voids unconfirmed restores. States a
speculative/verify round wrote are never saved: the tier saves only slots it just filled with a
``/completion`` of exact token ids (``n_predict: 0``), or that the slot table says hold exactly a
wanted prefix.

Measured with ``scripts/bench-disk`` (bench models, 8,192 tokens, ``-t 2``, one other tiny server
running): cold prefill 85.8 s dense / 73.8 s hybrid; restore from disk 0.082 s / 0.027 s wall
(x1,041 / x2,704 faster), at 0.97 / 0.71 of the disk's sequential read rate measured in the same run
(0.86 / 1.13 GB/s); save 0.076 s / 0.044 s; the next request's cache_n = 8,192 (all reused).
Measured (tiny models, 2-core machine, a real opencode turn of 7,328 tokens, ``-t 1``): each anchor
save delays its request by 11-102 ms (two anchors on a session's first request); after a restart the
next turn restores a 7,234-token anchor in 18-29 ms (verify + restore) and prefills 94 tokens,
against a 3.4-4.1 s cold prefill of the same request.

Compression: none. zstandard measured on real slot files (``scripts/bench-disk``, bench models, 8,192
tokens): ratio 1.11 (dense, 67 MB) and 1.09 (hybrid, 27 MB) at levels 1-3, decompression 435-490
MB/s, while the server restores the same files at 0.8 GB/s from disk and 1-2.3 GB/s from the page
cache: decompressing would cost more time than the ~10 % of bytes it saves (KV of random weights;
re-measure on real weights with the script before changing this).

Anchors are self-contained (one slot file each, no chain), so "deleting every anchor that depends on
a failed file" is deleting that entry's files (the ``.bin`` and its ``.ckpt``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from ocache.background import Background
from ocache.tiers.base import Offer, Rate, TierBase, TierError
from ocache.tiers.restore import restore_verified, save_reserved
from ocache.config import field_of as _get, slot_save_path
from ocache.llama.checks import FLAGS_FIX
from ocache.tiers.store import BudgetError, Store, entry_key, grid_hashes, shared_store
from ocache.llama.reuse import media_spans

log = logging.getLogger(__name__)

KIND = "a"
#: ``message_delimiters`` for raw ``/completion`` warm-ups, so the server places context checkpoints
#: at user-turn starts as it does on chat routes (docs/llama-server.md §8, §14). ChatML (the Qwen templates).
USER_DELIMITERS = [{"role": "user", "delimiter": "<|im_start|>user"}]


class DiskTierError(TierError):
    """``bring`` failed (verification or the server's restore); the request must go cold.

    ``reason``: ``missing``/``size``/``hash``/``identity``/``tokens``/``header``/``record`` (a file
    check, entry deleted), ``restore`` (the server refused the file: the slot was erased,
    docs/llama-server.md §5, and the entry deleted), ``upstream`` (the server could not be asked or
    failed otherwise: connection refused or reset, timeout, 5xx; the entry is kept) or ``gone`` (the
    entry was evicted since ``lookup``)."""

    tier = "disk"


class SlotOps(Protocol):
    """What the disk tier needs from ``ocache.slots`` (the only module that talks to slots).

    Each returns the server's JSON answer (docs/llama-server.md §5: save → ``n_saved``, ``n_written``,
    ``timings.save_ms``; restore → ``n_restored``, ``n_read``, ``timings.restore_ms``; warm → the
    ``/completion`` answer with ``timings``) and raises on an HTTP error.
    """

    #: the server checks a restore's ``xxh3`` itself (patches/0006, ``SlotTable.checks_xxh3``)
    checks_xxh3: bool

    async def save(self, slot: int, filename: str) -> dict: ...
    async def restore(self, slot: int, filename: str, tokens: Sequence[int] | None = None,
                      checkpoints: Sequence[Any] | None = None, xxh3: str | None = None) -> dict: ...
    async def warm(self, slot: int, tokens: Sequence[int], *, message_delimiters: list | None = None,
                   user_starts: Sequence[int] = ()) -> dict: ...
    def held_exactly(self, slot: int) -> list[int] | None: ...


@dataclass
class DiskConfig:
    """Disk tier settings. Token counts in tokens, rates as noted."""

    min_tokens: int = 4096          # shortest prefix worth an anchor
    grid: int = 1024                # grid for counting repeated cold prefills (tokens)
    ubatch: int = 512               # server -ub: tolerance when confirming a restore by cache_n
    admit_after: int = 2            # a grid line prefilled cold this many times gets an anchor
    max_anchors_per_request: int = 2
    head: bool = True
    session_start: bool = True
    repeat: bool = True
    prefill_tok_s: float = 2000.0   # initial guess until measured (tokens/s)
    restore_bytes_s: float = 5e8    # initial guess until measured (bytes/s, server restore)
    verify_bytes_s: float = 2e9     # initial guess until measured (bytes/s, xxh3 of the files)
    line_memory: int = 200_000      # how many grid-line counters are remembered (LRU)


@dataclass
class AnchorRef:
    """``Offer.ref`` of the disk tier: which entry, and the request tokens it must match."""

    key: str
    n_tokens: int
    bytes: int
    expect: list[int] = field(repr=False, default_factory=list)


@dataclass
class _Pending:
    key: str
    n_tokens: int
    t: float


class DiskTier(TierBase):
    """The anchor tier over a :class:`Store` (see the module docstring).

    ``slots``: a :class:`SlotOps`. ``identity``: optional callable returning the server's current
    identity (an ``Identity`` or its key); checked before every lookup and write, so an upstream that
    came back with other weights/build/template/flags never gets another identity's state (the
    store serves the current identity's entries only and keeps the others for when theirs returns,
    ``Store.set_identity``).
    """

    name = "disk"

    def __init__(self, store: Store, slots: SlotOps, config: DiskConfig | None = None,
                 identity: Callable[[], Any] | None = None) -> None:
        self.store = store
        self.identity_fn = identity
        self.slots = slots
        self.cfg = config or DiskConfig()
        self.prefill = Rate(self.cfg.prefill_tok_s)
        # bytes/s of a restore: the slot table's, measured end to end over every tier's restores in
        # this process (ocache.slots.RestoreRate); a SlotOps without one gets the tier's own
        shared = getattr(slots, "restore_rate", None)
        self._own_restore_rate = shared is None
        self.restore_rate = Rate(self.cfg.restore_bytes_s) if shared is None else shared
        self.verify_rate = Rate(self.cfg.verify_bytes_s)
        self.bytes_per_token: float | None = None
        self.fixed_bytes: float = 0.0
        self._lines: OrderedDict[str, int] = OrderedDict()
        self._pending: dict[int, _Pending] = {}
        self.background = Background(self.name)   # the commits of saved slot files
        self.counters: dict[str, int] = {
            "lookups": 0, "offers": 0, "restores": 0, "hits": 0, "unconfirmed": 0,
            "verify_failed": 0, "restore_failed": 0, "anchors_written": 0, "save_failed": 0,
            "skipped_budget": 0, "skipped_short": 0, "restore_upstream_failed": 0,
        }
        self.save_s: list[float] = []       # seconds each save delayed its request (the save call)
        self.restore_s: list[float] = []    # seconds of each verify + restore

    # ------------------------------------------------------------------ admission
    def anchor_lines(self, view: Any) -> tuple[tuple[int, str], ...]:
        """The prefix lengths worth an anchor for this request, before any slot is chosen: the
        ``"anchors"`` step of the plan (``ocache.cache.Decision.anchors``), computed once per
        request in the lookup phase.

        ``view``: a TokenView (``tokens``, ``head_end``, ``user_starts``). Returns ``((length,
        reason), ...)`` ascending, each ``min_tokens <= length < len(tokens)``, not already stored;
        :func:`lines_above` later keeps those the prefill will pass cold. Reads the store index and
        the grid-line counters; changes nothing but the ``skipped_short`` counter.
        """
        toks: Sequence[int] = view.tokens
        n = len(toks)
        if n < self.cfg.min_tokens:
            self.counters["skipped_short"] += 1
            return ()
        want: dict[int, str] = {}
        head_end = _get(view, "head_end")
        if self.cfg.head and head_end:
            want.setdefault(int(head_end), "head")
        users = list(_get(view, "user_starts") or [])
        if self.cfg.session_start and len(users) == 1:
            want.setdefault(int(users[0]), "session")
        if self.cfg.repeat:
            # the highest repeated grid line; with a cached prefix c, the search of lines above c
            # finds the same line or none (lines_above drops it then)
            g = self.cfg.grid
            chain = grid_hashes(toks, g)
            for line in range((n - 1) // g * g, 0, -g):
                if self._lines.get(chain[line // g - 1], 0) >= self.cfg.admit_after - 1:
                    want.setdefault(line, "repeat")
                    break
        # an anchor is written by a token-id prefill, which cannot carry an image: only lines up
        # to the prompt's first image (ocache.llama.reuse.media_spans; its positions are restored
        # from the session tier's spills, which the server saves with their media chunks)
        spans = media_spans(toks)
        top = spans[0][0] if spans else n
        out = []
        for length, reason in sorted(want.items()):
            if not (length < n and length >= self.cfg.min_tokens and length <= top):
                continue
            if self.store.identity is None or self.store.get(entry_key(self.store.identity, KIND, toks[:length])):
                continue
            out.append((length, reason))
        return tuple(out)

    def lines_above(self, lines: Sequence[tuple[int, str]], cached_n: int) -> list[tuple[int, str]]:
        """Of :meth:`anchor_lines`' answer, the lines the coming prefill passes cold (``cached_n``:
        tokens the slot reuses), at most ``max_anchors_per_request`` (the highest). Pure."""
        return [ln for ln in lines if ln[0] > cached_n][-self.cfg.max_anchors_per_request:]

    def plan_anchors(self, view: Any, cached_n: int, ctx: Any = None) -> list[tuple[int, str]]:
        """Which prefix lengths the coming prefill should be split at to write anchors:
        ``lines_above(anchor_lines(view), cached_n)``. ``cached_n``: tokens the chosen slot will
        reuse (what the prefill does not pass cold). Returns ``[(length, reason)]`` ascending, each
        with ``cached_n < length < len(tokens)`` and ``length >= min_tokens``, not already stored,
        at most ``max_anchors_per_request``."""
        return self.lines_above(self.anchor_lines(view), cached_n)

    async def prepare(self, view: Any, slot: int, cached_n: int, ctx: Any = None) -> list[int]:
        """:meth:`write_anchors` with the lines :meth:`anchor_lines` finds now (tests and tools;
        the cache layer plans the lines once per request and runs the ``"anchors"`` step)."""
        return await self.write_anchors(view, slot, self.anchor_lines(view), cached_n, ctx)

    async def write_anchors(self, view: Any, slot: int, lines: Sequence[tuple[int, str]], cached_n: int,
                            ctx: Any = None) -> list[int]:
        """The ``"anchors"`` step: write the anchors of ``lines`` the prefill passes cold
        (:meth:`lines_above` ``cached_n``) by splitting the coming prefill in ``slot``.

        The caller holds the slot's lease and forwards the request right after; the slot then holds
        exactly the last anchor's tokens, which the request strictly extends. When the slot already
        holds exactly a wanted prefix (the head warm-up left it), that is saved as it is (costs the
        save only). Failures are logged and counted, never raised (the request proceeds; at worst
        the slot's reuse is what the last successful warm left, always a prefix of the request).
        Returns the lengths saved.
        """
        done = []
        await asyncio.to_thread(self._check_identity)
        held = self._held(slot)
        why = self._save_held(view, held) if held is not None else None
        if held is not None and why:
            # the slot holds exactly a wanted prefix already (e.g. the layer's head warm-up): the
            # prefill will not pass that line, so save it as it is (costs the save only)
            if await self.save_slot(slot, list(held), fingerprint=_get(ctx, "head_key"),
                                    reason=why, labels=_get(ctx, "labels")):
                done.append(len(held))
        # a line stored since the plan (the held save above, another request) is not written again
        todo = [ln for ln in lines if self.store.identity is not None
                and not self.store.get(entry_key(self.store.identity, KIND, view.tokens[:ln[0]]))]
        for length, reason in self.lines_above(todo, cached_n):
            prefix = list(view.tokens[:length])
            users = [u for u in (_get(view, "user_starts") or []) if u < length]
            try:
                await self.slots.warm(slot, prefix, message_delimiters=USER_DELIMITERS, user_starts=users)
            except Exception as exc:  # noqa: BLE001 - fail open, the request proceeds
                log.warning("disk: warm of a %d-token %s anchor in slot %d failed: %s", length, reason, slot, exc)
                self.counters["save_failed"] += 1
                break
            fpr = _get(ctx, "head_key")
            if await self.save_slot(slot, prefix, fingerprint=fpr, reason=reason, labels=_get(ctx, "labels")):
                done.append(length)
        return done

    def _held(self, slot: int) -> list[int] | None:
        """The token ids the slot table believes ``slot`` holds exactly, or None when unknown
        (``SlotOps.held_exactly``)."""
        try:
            return self.slots.held_exactly(slot)
        except Exception:  # noqa: BLE001 - an unknown slot: nothing to vouch for
            return None

    def _save_held(self, view: Any, held: Sequence[int]) -> str | None:
        """The reason to anchor the slot's current content as it is, or None."""
        n = len(held)
        toks = view.tokens
        if n < self.cfg.min_tokens or n >= len(toks) or list(toks[:n]) != list(held):
            return None
        if self.store.identity is None or self.store.get(entry_key(self.store.identity, KIND, held)):
            return None
        users = list(_get(view, "user_starts") or [])
        if self.cfg.head and _get(view, "head_end") == n:
            return "head"
        if self.cfg.session_start and len(users) == 1 and users[0] == n:
            return "session"
        return None

    async def save_slot(self, slot: int, tokens: list[int], *, fingerprint: str | None = None,
                        reason: str = "", labels: Any = None) -> bool:
        """Save ``slot`` (which must hold exactly ``tokens``) as an anchor: reserve room, ``action=save``
        to a temp name, then hash + commit in the background. Returns True if the save call succeeded
        (the commit may still fail; counted). Never raises. ``labels``: ``RequestContext.labels``
        (folder, client, model), kept in the entry's meta for ``ocache cache ls`` and the dashboard."""
        key = entry_key(self.store.identity or "", KIND, tokens)
        if self.store.get(key):
            return True
        # the budget is checked before the server writes anything: room is made for the estimated
        # size, or the anchor is refused (Store.estimate_bytes learns from every file it measured)
        est = self.store.estimate_bytes(len(tokens))
        if est is None:
            est = int(self.fixed_bytes + (self.bytes_per_token or 0) * len(tokens))
        try:
            tmp, resp, took = await save_reserved(self.store, self.slots, slot, key, KIND, est)
        except BudgetError as exc:
            log.info("disk: no room for a %d-token anchor: %s", len(tokens), exc)
            self.counters["skipped_budget"] += 1
            return False
        except Exception as exc:  # noqa: BLE001 - nothing reserved or written is left behind
            log.warning("disk: save of slot %d failed: %s", slot, exc)
            self.counters["save_failed"] += 1
            return False
        self.save_s.append(took)
        self.store.note_size(len(tokens), int(_get(resp, "n_written", 0) or 0))  # the .bin's bytes
        if int(_get(resp, "n_saved", -1)) != len(tokens):
            log.warning("disk: slot %d saved %s tokens, expected %d; discarded", slot, _get(resp, "n_saved"), len(tokens))
            self.counters["save_failed"] += 1
            self.store.release(key)
            self.store.discard_temp(tmp)
            return False
        meta = {"reason": reason, **{k: v for k, v in dict(labels or ()).items() if v}}
        self.background.spawn(self._commit(tokens, tmp, fingerprint, meta, int(_get(resp, "n_written", 0))), "commit")
        return True

    async def _commit(self, tokens: list[int], tmp: str, fingerprint: str | None, meta: dict,
                      n_written: int) -> None:
        t0 = time.monotonic()
        reason = meta.get("reason", "")
        try:
            e = await asyncio.to_thread(self.store.commit, KIND, tokens, tmp, fingerprint=fingerprint,
                                        meta=meta)
        except Exception as exc:  # noqa: BLE001
            log.warning("disk: commit of a %d-token anchor failed: %s", len(tokens), exc)
            self.counters["save_failed"] += 1
            return
        self.verify_rate.add(e.bytes, time.monotonic() - t0)
        self.counters["anchors_written"] += 1
        self._learn_size(len(tokens), e.bytes)
        log.info("disk: anchor %s (%s, %d tokens, %d bytes)", e.key[:12], reason, e.n_tokens, e.bytes)

    def _learn_size(self, n_tokens: int, nbytes: int) -> None:
        """Keep an upper-bound estimate of bytes per token for reservations."""
        per = nbytes / max(1, n_tokens)
        self.bytes_per_token = max(per, self.bytes_per_token or 0.0)

    async def flush(self) -> None:
        """Wait for background commits (tests, drain)."""
        await self.background.join()

    def pending_commits(self) -> list:
        """The background commits running now (:meth:`TierBase.pending_commits`)."""
        return list(self.background.tasks)

    # ------------------------------------------------------------------ lookup / bring
    def read_cost_s(self, nbytes: int) -> float:
        """Seconds to verify and restore ``nbytes`` at the measured rates (the verify's xxh3 reads the
        file, at the disk's rate when it is not in the page cache; the restore's rate is the slot
        table's, end to end, ``ocache.slots.RestoreRate``)."""
        return nbytes / self.verify_rate.value + nbytes / self.restore_rate.value

    def _check_identity(self) -> None:
        if self.identity_fn is None:
            return
        cur = self.identity_fn()
        key = cur if isinstance(cur, str) else getattr(cur, "key", None)
        if key and key != self.store.identity:
            self.store.set_identity(key)
            self.counters["identity_switches"] = self.counters.get("identity_switches", 0) + 1

    async def lookup(self, view: Any, ctx: Any = None) -> Offer | None:
        """The longest anchor that is a prefix of ``view.tokens`` and pays for its read (the prefill
        it saves, at the measured rate, is longer than its verify + restore), or None.
        ``tokens_usable``: the anchor's length when the request extends it, one less when the request
        is identical (the server re-evaluates the last token, docs/llama-server.md §11).
        """
        self.counters["lookups"] += 1
        await asyncio.to_thread(self._check_identity)
        toks = view.tokens
        resident = 0  # the planner weighs the offer against each slot's own reuse (plan_request)
        cands = await asyncio.to_thread(self.store.find_prefixes, toks, KIND)
        for e in cands:
            usable = e.n_tokens if e.n_tokens < len(toks) else e.n_tokens - 1
            if usable <= resident:
                return None
            cost = self.read_cost_s(e.bytes)
            saved = (usable - resident) / self.prefill.value
            if cost >= saved:
                continue
            self.counters["offers"] += 1
            return Offer(tier=self.name, tokens_usable=usable, cost_s=cost, verified=True,
                         ref=AnchorRef(e.key, e.n_tokens, e.bytes, list(toks[:e.n_tokens])))
        return None

    async def bring(self, offer: Offer, slot: int) -> None:
        """Verify the anchor, then restore it into ``slot`` (``ocache.tiers.restore``). Raises
        DiskTierError (entry deleted; after a server-side failure the slot is empty,
        docs/llama-server.md §5)."""
        ref: AnchorRef = offer.ref
        t0 = time.monotonic()
        e = await restore_verified(self.store, self.slots, ref.key, slot, error=DiskTierError, counters=self.counters,
                               verify_rate=self.verify_rate,
                               restore_rate=self.restore_rate if self._own_restore_rate else None,
                               expect=ref.expect)
        self.restore_s.append(time.monotonic() - t0)
        self.counters["restores"] += 1
        self._pending[slot] = _Pending(e.key, e.n_tokens, time.monotonic())
        await asyncio.to_thread(self.store.touch, e.key, False)

    # ------------------------------------------------------------------ after the request
    async def admit(self, view: Any, slot: int, obs: Any) -> None:
        """Learn from a finished request: prefill rate, restore confirmation, cold grid lines."""
        timings = _get(obs, "timings") or {}
        cache_n = _get(timings, "cache_n")
        prompt_n = int(_get(timings, "prompt_n", 0) or 0)
        prompt_ms = float(_get(timings, "prompt_ms", 0.0) or 0.0)
        if prompt_n >= 64 and prompt_ms > 0:
            self.prefill.add(prompt_n, prompt_ms / 1000.0)
        p = self._pending.pop(slot, None)
        if p is not None:  # no timings (e.g. an upstream error) also leaves the restore unconfirmed
            if cache_n is not None and int(cache_n) >= p.n_tokens - self.cfg.ubatch:
                self.counters["hits"] += 1
                await asyncio.to_thread(self.store.touch, p.key, True)
            else:
                self.counters["unconfirmed"] += 1
                log.warning("disk: restore of %d tokens into slot %d not confirmed (cache_n=%s)",
                            p.n_tokens, slot, cache_n)
        if cache_n is None or view is None:
            return
        toks = view.tokens
        g = self.cfg.grid
        start = (int(cache_n) // g + 1) * g
        chain = grid_hashes(toks, g)
        for line in range(start, len(toks), g):
            h = chain[line // g - 1]
            self._lines[h] = self._lines.get(h, 0) + 1
            self._lines.move_to_end(h)
        while len(self._lines) > self.cfg.line_memory:
            self._lines.popitem(last=False)

    def forget_slot(self, slot: int) -> None:
        """The slot's content was replaced before a response confirmed a restore (e.g. an upstream
        restart): count the pending restore as unconfirmed."""
        if self._pending.pop(slot, None) is not None:
            self.counters["unconfirmed"] += 1

    async def on_upstream_restart(self) -> None:
        for slot in list(self._pending):
            self.forget_slot(slot)

    async def clear(self) -> dict:
        await self.flush()
        return {"deleted": await asyncio.to_thread(self.store.clear, KIND)}

    def stats(self) -> dict:
        def pct(xs: list[float], q: float) -> float | None:
            if not xs:
                return None
            s = sorted(xs)
            return s[min(len(s) - 1, int(q * len(s)))]

        return {
            **self.counters,
            "store": self.store.stats(),
            "prefill_tok_s": round(self.prefill.value, 1),
            "restore_bytes_s": round(self.restore_rate.value),
            "verify_bytes_s": round(self.verify_rate.value),
            "save_s_p50": pct(self.save_s, 0.5), "save_s_max": max(self.save_s, default=None),
            "restore_s_p50": pct(self.restore_s, 0.5),
        }


# ---------------------------------------------------------------------- factory

def store_meta_dir(config: Any = None) -> Path:
    """ocache's own 0700 directory for the store's records and index."""
    from ocache.paths import state_root

    root = Path(_get(config, "cache_dir")) if _get(config, "cache_dir") else state_root()
    return root / "store"


def make_disk_tier(config: Any, slots: SlotOps, identity: Any, *, ubatch: int | None = None) -> DiskTier | None:
    """Build the disk tier from an ``ocache.config.Config``, or None when it cannot work.

    The slot-save-path: ``ocache.config.slot_save_path``; without one the server cannot save slots (docs/llama-server.md §3) and the tier is off.
    ``identity``: an ``ocache.fingerprint.Identity`` (its ``key``), a key string, or a callable
    returning either (e.g. ``OCacheLayer.identity``: re-read before every lookup/write, so a restarted
    server with another identity is served only its own entries; the others stay). Other settings:
    ``disk_budget_gb``, ``disk_ttl_days``, ``disk_min_tokens`` and ``tiers["disk"]`` keys ``grid``,
    ``free_floor_gb``, ``admit_after``. Opens the store (other identities' entries are kept).
    """
    tiers = _get(config, "tiers") or {}
    dcfg = tiers.get("disk", {}) if isinstance(tiers, dict) else {}
    if isinstance(dcfg, dict) and dcfg.get("enabled") is False:
        log.info("disk tier off: tiers.disk.enabled is false")
        return None
    data_dir = slot_save_path(config, _get(slots, "params"))
    if data_dir is None:
        log.warning("disk tier off: no --slot-save-path known: %s, or use serve --launch", FLAGS_FIX)
        return None
    ident_fn = identity if callable(identity) else None
    cur = identity() if ident_fn else identity
    key = cur if isinstance(cur, str) else getattr(cur, "key", None)
    if not key:
        log.warning("disk tier off: no server identity")
        return None
    store = shared_store(store_meta_dir(config), data_dir, key, kind=KIND,
                         kind_budget_bytes=int(float(_get(config, "disk_budget_gb", 50.0)) * 1e9),
                         ttl_s=float(_get(config, "disk_ttl_days", 7.0)) * 86400.0,
                         free_floor_bytes=int(float(dcfg.get("free_floor_gb", 0)) * 1e9))
    with contextlib.suppress(Exception):
        store.gc()
    cfg = DiskConfig(min_tokens=int(_get(config, "disk_min_tokens", 4096)),
                     grid=int(dcfg.get("grid", 1024)),
                     admit_after=int(dcfg.get("admit_after", 2)))
    if ubatch:
        cfg.ubatch = int(ubatch)
    return DiskTier(store, slots, cfg, identity=ident_fn)
