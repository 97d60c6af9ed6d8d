"""One save flow and one restore flow for every tier that keeps slot files in the store (disk
anchors, session spills, remote entries once downloaded, heads). Save (:func:`save_reserved`):
reserve the bytes, have the server write the slot to a temp name, give both back on any failure.
Restore (:func:`restore_verified`): verify the files, restore them into the slot, classify a
failure, count it. The tiers differ only in what they offer and how an entry reaches the local
store; from the store to the slot the path is this one.

Classification of a failure (the tier's error type, a :class:`ocache.tiers.base.TierError`):
``gone`` (the entry was evicted since the lookup), a store check word (``missing``, ``size``,
``hash``, ``identity``, ``tokens``, ``header``, ``record``: ``Store.verify`` deleted the entry),
``restore`` (the server refused the file: the slot was erased, docs/llama-server.md §5, and the entry
is deleted here), ``upstream`` (the server could not be asked or failed otherwise: connection
refused or reset, timeout, 5xx; the verified file is kept for the next request).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, MutableMapping, Sequence

from ocache.config import field_of as _get
from ocache.rate import Rate
from ocache.slots import SlotHashMismatch, file_refused
from ocache.tiers.base import TierError
from ocache.tiers.entry import Entry, IntegrityError
from ocache.tiers.store import Store, reserve_async, sidecar_checkpoints


def entry_checkpoints(store: Store, e: Entry) -> list:
    """The context checkpoints (``ocache.llama.reuse.Checkpoint``) of an entry: its record's
    ``checkpoints`` list, else its checkpoint sidecar's positions, else none."""
    from ocache.llama.reuse import Checkpoint

    if e.meta.get("checkpoints"):
        return [Checkpoint(int(n)) for n in e.meta["checkpoints"]]
    if "ckpt" in e.files:
        return [Checkpoint(n) for n in sidecar_checkpoints(store.path(e.files["ckpt"].name))]
    return []


async def save_reserved(store: Store, table: Any, slot: int, key: str, kind: str,
                        est_bytes: int) -> tuple[str, dict, float]:
    """Reserve ``est_bytes`` in the store for entry ``key`` of ``kind`` (room made by its eviction
    policy), then have the server save ``slot`` (``POST /slots/{id}?action=save``, through the slot
    table) to a temp name. Returns ``(temp name, the save's answer, seconds the save took)``; the
    caller commits the temp file or releases ``key`` and discards it. Raises
    ``ocache.tiers.store.BudgetError`` (nothing reserved) or what the save raised, cancellation
    included (the reservation released and the temp file discarded first)."""
    await reserve_async(store, key, est_bytes, kind)
    tmp = store.temp_name(kind, key)
    t0 = time.monotonic()
    try:
        resp = await table.save(slot, tmp)
    except BaseException:
        store.release(key)
        store.discard_temp(tmp)
        raise
    return tmp, resp, time.monotonic() - t0


def _count(counters: MutableMapping[str, int], name: str) -> None:
    counters[name] = counters.get(name, 0) + 1


async def restore_verified(store: Store, table: Any, key: str, slot: int, *, error: type[TierError],
                           counters: MutableMapping[str, int], verify_rate: Rate | None = None,
                           restore_rate: Rate | None = None, expect: Sequence[int] | None = None,
                           checkpoints: list | None = None) -> Entry:
    """Verify entry ``key`` (``Store.verify``, with the server's own hash check where the patched
    build has it: ``table.checks_xxh3``) and restore it into ``slot`` through the slot table
    (``table.restore``; the caller holds the slot's lock or lease). ``expect``: the token ids the
    entry must hold (an anchor's prefix, a head), else its stored ids; ``checkpoints``: the
    slot's context checkpoints after the restore, else :func:`entry_checkpoints`. Counts ``verify_failed``,
    ``restore_failed``, ``restore_upstream_failed`` in ``counters``; adds the verify rate (bytes/s)
    and, when given, the restore rate. Returns the entry. Raises ``error`` (module docstring)."""
    t0 = time.monotonic()
    try:
        if expect is not None:
            e = await asyncio.to_thread(store.verify, key, list(expect), server_hash=table.checks_xxh3)
        else:
            e = await asyncio.to_thread(store.verify, key, server_hash=table.checks_xxh3)
    except KeyError as exc:
        raise error("gone", key) from exc
    except IntegrityError as exc:
        _count(counters, "verify_failed")
        raise error(exc.reason, str(exc)) from exc
    t1 = time.monotonic()
    if verify_rate is not None:
        verify_rate.add(e.bytes, t1 - t0)
    toks = list(expect) if expect is not None else await asyncio.to_thread(store.tokens, key)
    try:
        resp = await table.restore(slot, e.bin_name, tokens=toks, checkpoints=entry_checkpoints(store, e) if checkpoints is None else checkpoints,
                                   xxh3=e.files["bin"].xxh3 if table.checks_xxh3 else None)
    except Exception as exc:  # noqa: BLE001
        if not isinstance(exc, SlotHashMismatch):
            # a damaged file the server's own check refused (patches/0006) counts as verify_failed
            # below, as the store's check counts it on a stock build
            _count(counters, "restore_failed")
        if not file_refused(exc):
            # llama-server gone, restarting or failing otherwise: the file was just verified, keep it
            _count(counters, "restore_upstream_failed")
            raise error("upstream", str(exc)) from exc
        if isinstance(exc, SlotHashMismatch):     # the integrity check, run by the server
            _count(counters, "verify_failed")
        await asyncio.to_thread(store.delete, key, f"server refused the restore: {exc}")
        raise error("restore", str(exc)) from exc
    if int(_get(resp, "n_restored", -1)) != e.n_tokens:
        _count(counters, "restore_failed")     # the table holds what restore found (unknown)
        await asyncio.to_thread(store.delete, key, "restored token count differs")
        raise error("restore", f"n_restored={_get(resp, 'n_restored')} != {e.n_tokens}")
    if restore_rate is not None:
        restore_rate.add(float(_get(resp, "n_read", e.bytes) or e.bytes), time.monotonic() - t1)
    return e
