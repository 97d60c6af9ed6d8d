"""The head tier: warmed harness heads, their slot files, and the origin slot that keeps one warm.

Warm-up: the first agent request of a new harness fingerprint prefills its stable head
(``tokens[:head_end]``) with a no-generation request in the slot it will use anyway (it costs the
request nothing: it would prefill the same tokens; :meth:`HeadTier.warm_in`), and the head's state is
saved to a slot file (``oc-h-<key>.bin``, an entry of the verified store) when the server has
``--slot-save-path`` and the store is open (:func:`open_head_store`). A request that lands on a slot
without the head gets it restored first when that is cheaper than prefilling it (``lookup``/``bring``).
With ``-np >= 2`` one idle empty slot keeps the head as the shared *origin*
(:meth:`HeadTier.maintain_origin`, config ``tiers.resident.keep_origin``), so a new session in any
folder resumes from the head.

Counters: the tier's own (``stats()``, ``tier_head`` in ``/v1/cache/stats``) and the layer's
``warmups``, ``warmup_tokens``, ``head_saves``, ``head_restores``, ``origin_rebuilds``,
``origin_skipped``, ``user_splits`` (the ``events`` dict, shown at the top of the stats).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from ocache.background import Background
from ocache.llama.reuse import Checkpoint
from ocache.slots import SlotError, SlotNotSupported, SlotTable
from ocache.tiers.base import Offer, TierBase, TierError
from ocache.tiers.resident import RequestContext

log = logging.getLogger("ocache.cache")

#: store kind of the head tier's entries (``oc-h-<key>.bin``; ``ocache.tiers.store``)
HEAD_KIND = "h"


class HeadTierError(TierError):
    """A head restore failed; the request goes cold. ``reason``: a store check word (``missing``,
    ``size``, ``hash``, ``identity``, ``tokens``, ``header``, ``record``: the entry was deleted),
    ``restore`` (the server refused the file: deleted), ``upstream`` (the server could not be asked:
    the entry is kept) or ``gone`` (the entry was evicted or cleared)."""

    tier = "head"


@dataclass
class HeadRecord:
    """A warmed harness head: its token ids, the store entry holding its state (None: not saved),
    and the checkpoints a restore brings back (the patched build's sidecar; [] on a stock build)."""

    key: str
    tokens: list[int]
    entry: str | None = None
    checkpoints: list[Checkpoint] = field(default_factory=list)
    restore_s: float = 0.05
    last_used: float = 0.0


class HeadTier(TierBase):
    """Offers a known harness head to any slot by restoring its slot file (a Tier).

    The files go through the verified store (``ocache.tiers.store``, kind ``"h"``) like anchors and
    spills: the server saves to a temp name, the store fsyncs, hashes, checks the token header and
    commits (mode 0600, within the ``tiers.head.budget_gb`` budget, TTL ``disk_ttl_days``, listed by
    ``ocache cache ls``, deleted by ``clear``/``gc``), and every restore is verified first (size,
    xxh3, token header, identity); a failed check deletes the entry and the request goes cold.
    ``store``: None while no store is open (no ``--slot-save-path`` known, the store cannot open, or
    a budget of 0): heads are then kept warm by prefill only and nothing is saved.
    """

    name = "head"

    def __init__(self, table: SlotTable, store: Any = None, *, events: dict[str, int] | None = None,
                 keep_origin: bool = True) -> None:
        self.table = table
        self.store = store
        self.heads: dict[str, HeadRecord] = {}
        #: the layer's counters this tier's events increment (see the module docstring)
        self.events: dict[str, int] = events if events is not None else {}
        for k in ("warmups", "warmup_tokens", "head_saves", "head_restores", "origin_rebuilds",
                  "origin_skipped", "user_splits"):
            self.events.setdefault(k, 0)
        self.keep_origin = keep_origin
        #: the most recently warmed head: the one an origin slot keeps
        self.origin_key: str | None = None
        #: the server cannot save slots (no ``--slot-save-path``): heads are kept warm by prefill only
        self.no_save = False
        self._store_off = False  # the store could not be opened (open_head_store): not tried again
        self._maint_lock = asyncio.Lock()
        self.background = Background(self.name)   # the commits of saved slot files
        self.counters: dict[str, int] = {
            "saves": 0, "save_failed": 0, "skipped_budget": 0, "restores": 0, "verify_failed": 0,
            "restore_failed": 0, "restore_upstream_failed": 0,
        }

    def _entry(self, rec: HeadRecord) -> Any:
        if self.store is None or rec.entry is None:
            return None
        e = self.store.get(rec.entry)
        if e is None:
            rec.entry = None  # evicted, expired or cleared since
        return e

    async def lookup(self, view: Any, ctx: RequestContext) -> Offer | None:
        rec = self.heads.get(ctx.head_key or "")
        if rec is None or self._entry(rec) is None:
            return None
        n = len(rec.tokens)
        if len(view.tokens) <= n or view.tokens[:n] != rec.tokens:
            return None
        return Offer("head", n, rec.restore_s, ref=rec, verified=True)

    async def bring(self, offer: Offer, slot: int) -> None:
        await self.restore_into(slot, offer.ref)
        rec: HeadRecord = offer.ref
        self.table.mark_head(slot, rec.key, len(rec.tokens))

    async def restore_into(self, slot: int, rec: HeadRecord) -> None:
        """Verify the head's entry, then restore it into ``slot`` (the caller holds the slot's lease).
        Raises HeadTierError (see there for what is deleted and what is kept)."""
        from ocache.tiers.restore import restore_verified

        if self._entry(rec) is None or rec.entry is None:
            raise HeadTierError("gone", rec.key)
        t0 = time.monotonic()
        try:
            e = await restore_verified(self.store, self.table, rec.entry, slot, error=HeadTierError,
                                       counters=self.counters, expect=rec.tokens, checkpoints=rec.checkpoints)
        except HeadTierError as exc:
            if exc.reason != "upstream":    # gone, or deleted by the store or here
                rec.entry = None
            raise
        rec.restore_s = time.monotonic() - t0
        rec.last_used = time.monotonic()
        self.counters["restores"] += 1
        await asyncio.to_thread(self.store.touch, e.key, True)

    async def save_from(self, slot: int, rec: HeadRecord, rid: str = "-") -> bool:
        """Save the head the locked ``slot`` holds exactly (``rec.tokens``) as a store entry: the
        budget first (room made for the estimated size, or refused: nothing is written), then the
        server's ``action=save`` to a temp name; hashing and the commit run in the background
        (:meth:`flush`). Returns True when the save call succeeded or the entry exists already.
        Raises SlotNotSupported (no ``--slot-save-path``); other failures are logged and counted."""
        from ocache.tiers.restore import save_reserved
        from ocache.tiers.store import BudgetError, entry_key

        store = self.store
        if store is None or store.identity is None:
            return False
        key = entry_key(store.identity, HEAD_KIND, rec.tokens)
        if store.get(key) is not None:
            rec.entry = key
            e = store.get(key)
            rec.checkpoints = [Checkpoint(int(n)) for n in (e.meta.get("checkpoints") or [])] if e else []
            return True
        est = store.estimate_bytes(len(rec.tokens)) or 0
        try:
            tmp, saved, _ = await save_reserved(store, self.table, slot, key, HEAD_KIND, est)
        except BudgetError as exc:
            self.counters["skipped_budget"] += 1
            log.info("[%s] no room for head %s (%d tokens): %s", rid, rec.key, len(rec.tokens), exc)
            return False
        except SlotError as exc:
            if isinstance(exc, SlotNotSupported):
                raise
            self.counters["save_failed"] += 1
            log.warning("[%s] saving head %s failed: %s", rid, rec.key, exc)
            return False
        if int(saved.get("n_saved", -1)) != len(rec.tokens):
            self.counters["save_failed"] += 1
            store.release(key)
            store.discard_temp(tmp)
            log.warning("[%s] head %s: slot %d saved %s tokens, expected %d; discarded", rid, rec.key,
                        slot, saved.get("n_saved"), len(rec.tokens))
            return False
        store.note_size(len(rec.tokens), int(saved.get("n_written", 0) or 0))  # the .bin's bytes
        n_ck = saved.get("n_checkpoints")  # patched build: checkpoints in the sidecar
        st = self.table[slot]
        cps = (list(st.checkpoints)[-int(n_ck):] if n_ck else []) if n_ck is not None else []
        self.background.spawn(self._commit(rec, key, tmp, cps, rid), "commit")
        return True

    async def _commit(self, rec: HeadRecord, key: str, tmp: str, cps: list[Checkpoint], rid: str) -> None:
        try:
            e = await asyncio.to_thread(self.store.commit, HEAD_KIND, rec.tokens, tmp, fingerprint=rec.key,
                                        meta={"reason": "head", "checkpoints": [c.n_tokens for c in cps]})
        except Exception as exc:  # noqa: BLE001 - the head stays warm by prefill
            self.counters["save_failed"] += 1
            log.warning("[%s] commit of head %s failed: %s", rid, rec.key, exc)
            return
        if rec.tokens == self.heads.get(rec.key, rec).tokens:
            rec.entry, rec.checkpoints = e.key, cps
        self.counters["saves"] += 1

    async def flush(self) -> None:
        """Wait for background commits."""
        await self.background.join()

    def pending_commits(self) -> list:
        """The background commits running now (:meth:`TierBase.pending_commits`)."""
        return list(self.background.tasks)

    async def clear(self) -> dict:
        """Forget every head and delete the head entries. Returns ``{"deleted": heads + entries}``."""
        await self.flush()
        n = len(self.heads)
        self.heads.clear()
        self.origin_key = None
        if self.store is not None:
            n += await asyncio.to_thread(self.store.clear, HEAD_KIND)
        return {"deleted": n}

    def knows(self, head_key: str | None) -> bool:
        """Whether the head ``head_key`` was warmed (some slot or file holds it)."""
        return head_key in self.heads

    # -- the warm-up step and the origin slot ----------------------------------------------------

    async def warm_in(self, slot: int, head_tokens: list[int], key: str | None, rid: str = "-") -> dict:
        """Prefill ``head_tokens`` into the leased ``slot`` (the ``warm_head`` step, ``ocache warm``)
        and save them to a head file if the server can (``--slot-save-path``). Records the head;
        the slot becomes the origin. Returns the warm-up's ``timings``. Raises SlotError."""
        table = self.table
        t = await table.warm(slot, head_tokens)
        self.events["warmups"] += 1
        self.events["warmup_tokens"] += int(t.get("prompt_n") or 0)
        table.mark_origin(slot, key, len(head_tokens))
        if key is None:
            return t
        rec = self.heads.get(key) or HeadRecord(key, list(head_tokens))
        rec.tokens = list(head_tokens)
        rec.last_used = time.monotonic()
        self.heads[key] = rec
        self.origin_key = key
        if rec.entry is None and not self.no_save and self.store is not None:
            try:
                if await self.save_from(slot, rec, rid):
                    self.events["head_saves"] += 1
            except SlotNotSupported:
                self.no_save = True
                log.info("[%s] no --slot-save-path: heads are kept warm by prefill only", rid)
        return t

    def _first_user(self, tokens: list[int], ctx: RequestContext) -> int | None:
        """The first user message's start after the head (token index) when the split applies:
        a model that resumes only at checkpoints, at least one ubatch past the head, more than 8
        tokens before the prompt's end; else None."""
        if not self.table.params.checkpoints or not ctx.head_len:
            return None
        u = next((u for u in ctx.user_starts if u > ctx.head_len), None)
        if u is None or u - ctx.head_len < self.table.params.n_ubatch or len(tokens) - u <= 8:
            return None
        return u

    async def split_at_first_user(self, slot: int, tokens: list[int], ctx: RequestContext, rid: str) -> None:
        """After a head warm-up in ``slot``, prefill on to the first user message after the head
        (``tokens[:u]``, no generation) when the model resumes only at checkpoints.

        Why: llama-server takes a checkpoint at the first user message of a prompt only while the
        slot holds none (tools/server/server-context.cpp:3530-3537 of the pinned source); the
        warm-up left some at the head's end, so without this split the request would keep none
        between the head and ``len - 4 - ubatch``, and a later session that shares more than the
        head (Codex in another folder: up to its AGENTS.md item) would fall back to the head. The
        split's own prompt end gets the server's near-end checkpoints (``u - 4 - ubatch``,
        ``u - 4``), and the disk tier may save the slot as it is there (a session-start anchor);
        :meth:`checkpoint_first_user` then puts one at ``u`` itself. It prefills nothing extra
        (those tokens are the request's own) and costs one round trip; it is skipped on dense
        models, within one ubatch of the head, or when the user message starts in the prompt's last
        8 tokens. A failure is logged and the request goes on from whatever the slot holds."""
        u = self._first_user(tokens, ctx)
        if u is None:
            return
        try:
            await self.table.warm(slot, tokens[:u])
            self.events["user_splits"] += 1
        except SlotError as exc:
            log.warning("[%s] split at the first user message (token %d) in slot %d failed: %s",
                        rid, u, slot, exc)

    async def checkpoint_first_user(self, slot: int, tokens: list[int], ctx: RequestContext, rid: str) -> None:
        """After :meth:`split_at_first_user` (and the anchors step), when the slot still holds exactly
        ``tokens[:u]``: prefill 4 tokens on (``tokens[:u + 4]``). That prefill's checkpoint "4 tokens
        before the prompt's end" (docs/llama-server.md §14) sits at ``u``, where llama-server alone
        puts its first-user-turn checkpoint; without it the nearest sat at ``u - 4``, and Codex's
        next folder on the hybrid model prefilled 4 tokens more than alone. Nothing extra is
        prefilled (the request's own tokens); one round trip. Failures are logged."""
        u = self._first_user(tokens, ctx)
        if u is None or self.table.held_exactly(slot) != list(tokens[:u]):
            return
        try:
            await self.table.warm(slot, tokens[:u + 4])
        except SlotError as exc:
            log.warning("[%s] checkpoint at the first user message (token %d) in slot %d failed: %s",
                        rid, u, slot, exc)

    async def maintain_origin(self) -> None:
        """With ``-np >= 2``: keep the most recent harness head warm in one *empty* idle slot, by
        restoring its saved head file (run in the background after each response).

        Never over another state (a title request's slot holds what the next title reuses: the
        server alone keeps it; measured 541 tokens (tests/test_e2e_clients.py, everyday day)
        prefilled per title when ocache overwrote it) and never by prefilling the head again (that
        is prefill the server alone would not do). A slot without the head gets it restored on
        demand from the same file (``lookup``/``bring``). Skips are counted in ``origin_skipped``.
        """
        table = self.table
        if not self.keep_origin or self.origin_key is None or len(table) < 2:
            return
        async with self._maint_lock:
            rec = self.heads.get(self.origin_key)
            if rec is None:
                return
            snap = table.snapshot()
            if any(s.busy for s in snap):
                return  # only when the server is idle
            if any(s.origin and s.head_key == rec.key for s in snap):
                return
            free = [s for s in snap if not s.busy and not s.tokens and not s.foreign
                    and not s.n_total and not s.origin]
            if not free or self._entry(rec) is None:
                self.events["origin_skipped"] += 1
                return
            target = min(free, key=lambda s: s.last_used)
            lock = table.lock(target.id)
            if lock.locked():
                return
            async with lock:
                try:
                    await self.restore_into(target.id, rec)   # verified first
                    self.events["head_restores"] += 1
                except (HeadTierError, SlotError) as exc:
                    log.warning("re-establishing head %s in slot %d failed: %s", rec.key, target.id, exc)
                    return
                table.mark_origin(target.id, rec.key, len(rec.tokens), last_used=0.0)
                self.events["origin_rebuilds"] += 1
                log.info("head %s re-established in slot %d (%d tokens)", rec.key, target.id, len(rec.tokens))

    def stats(self) -> dict:
        return {**self.counters, "heads": len(self.heads),
                "entries": len(self.store.entries(HEAD_KIND)) if self.store is not None else 0,
                "bytes": self.store.kind_bytes(HEAD_KIND) if self.store is not None else 0,
                "budget_bytes": self.store.kind_budgets.get(HEAD_KIND) if self.store is not None else None}


def open_head_store(tier: HeadTier, config: Any, params: Any, identity_key: str | None) -> None:
    """Open the store for the head tier's files once (kind ``"h"``; budget ``tiers.head.budget_gb``,
    default 10 GB; TTL ``disk_ttl_days``), where the server's ``--slot-save-path`` is known
    (``ocache.config.slot_save_path``). Off (heads kept warm by prefill only, nothing saved)
    without it, with a budget of 0, or when the store cannot be opened. Once open, a new server
    identity switches the store to it. Files of the unverified head tier of earlier versions
    (``ocache-head-*.bin``) are removed once."""
    if tier.store is not None:
        if identity_key and identity_key != tier.store.identity:  # the server came back with another identity
            tier.store.set_identity(identity_key)
        return
    if tier._store_off:
        return
    tier._store_off = True
    from ocache.config import field_of, slot_save_path
    from ocache.tiers.disk import store_meta_dir
    from ocache.tiers.store import StoreError, shared_store

    tiers = field_of(config, "tiers") or {}
    hcfg = dict(tiers.get("head") or {}) if isinstance(tiers, dict) else {}
    budget = int(float(hcfg.get("budget_gb", 10.0)) * 1e9)
    data_dir = slot_save_path(config, params)
    if data_dir is None or not identity_key or budget <= 0:
        log.info("head files off (%s): heads are kept warm by prefill only",
                 "no --slot-save-path known" if data_dir is None else "no identity" if not identity_key
                 else "tiers.head.budget_gb is 0")
        return
    try:
        store = shared_store(store_meta_dir(config), data_dir, identity_key, kind=HEAD_KIND,
                             kind_budget_bytes=budget,
                             ttl_s=float(field_of(config, "disk_ttl_days", 7.0)) * 86400.0)
    except (StoreError, OSError) as exc:
        log.warning("head files off: the store cannot be opened (%s); heads are kept warm by "
                    "prefill only", exc)
        return
    for p in data_dir.glob("ocache-head-*.bin*"):
        with contextlib.suppress(OSError):
            p.unlink()
            log.info("removed unverified head file %s of an earlier version", p.name)
    tier.store = store
    tier._store_off = False
