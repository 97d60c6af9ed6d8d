"""What the admin routes see of the layer and do to it: ``GET /v1/cache/stats``
(``OCacheLayer.stats``) and ``POST /v1/cache/clear`` (``OCacheLayer.clear``)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ocache.slots import SlotNotSupported

if TYPE_CHECKING:
    from ocache.cache.ports import PlanningServices


def background(layer: PlanningServices) -> dict[str, dict[str, int]]:
    """The background work pending now (``ocache.background.Background.pending``), by owner: the
    layer's (reconcile, origin) and each tier's (commits)."""
    owners = [layer.background] + [b for t in (layer.head_tier, *layer.tiers)
                                   if (b := getattr(t, "background", None)) is not None]
    return {b.owner: b.pending() for b in owners}


def stats(layer: PlanningServices) -> dict[str, Any]:
    """The layer's counters, per-tier plan counts, the background work pending by owner, measured prefill rate (tokens/s), recent
    mispredictions, setup warnings, each slot (tokens, kind, owner, idle seconds), the table's
    counters, the warmed heads and every tier's own stats (an error there is reported, never
    raised)."""
    table = layer.table
    out: dict[str, Any] = {"layer": "ocache", **layer.counters, "by_tier": dict(layer.by_tier),
                           "prefill_tokens_per_s": layer.prefill_tps,
                           "recent_mispredictions": list(layer.recent_mispredictions),
                           "setup_warnings": [str(f) for f in layer.findings if f.level != "ok"],
                           "tiers_off": [t.__dict__ for t in tiers_off(layer)],
                           "tiers_checked": bool(layer.findings),
                           "alone": layer.alone.stats(),
                           "align": layer.align.stats(), "continued": layer.continued.stats(),
                           "background": background(layer)}
    counters = getattr(layer.current_viewer, "counters", None)
    if counters is not None:
        # the token view's counters: ``view_timeouts`` are views that outlasted their bound
        # (``ViewCalls.bound_s``, ``call_timeout``) and went as sent (each also a ``fail_open``)
        out["view"] = dict(counters)
    if table is not None and layer.head_tier is not None:
        out["slots"] = [{"id": s.id, "tokens": len(s.tokens), "n_total": s.n_total, "kind": s.kind,
                         "owner": s.owner, "origin": s.origin, "checkpoints": len(s.checkpoints),
                         "busy": table.lock(s.id).locked(), "head_len": s.head_len,
                         "idle_s": round(time.monotonic() - s.last_used, 1) if s.last_used else None}
                        for s in table.slots]
        out["table"] = dict(table.counters)
        out["heads"] = {k: {"tokens": len(r.tokens), "entry": r.entry}
                        for k, r in layer.head_tier.heads.items()}
        out["tier_head"] = layer.head_tier.stats()
    for tier in layer.tiers:
        try:
            out[f"tier_{tier.name}"] = tier.stats()
        except Exception as exc:  # stats must never break the route
            out[f"tier_{tier.name}"] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def tiers_off(layer: PlanningServices) -> list[Any]:
    """The tiers the setup checks turn off (``ocache.llama.checks.tiers_off``: ``TierOff``, with
    why and the one-line fix) that are off in this layer too (a tier the configuration turned on
    anyway, e.g. by ``tiers.disk.slot_save_path``, is not listed). Empty before the first checks."""
    from ocache.llama.checks import tiers_off as off_by_findings

    head = layer.head_tier
    on = {"disk": layer.disk_tier is not None, "session": layer.session_tier is not None,
          "head": head is not None and getattr(head, "store", None) is not None and not head.no_save}
    return [t for t in off_by_findings(layer.findings) if not on.get(t.tier, False)]


async def clear(layer: PlanningServices, tier: str) -> dict[str, Any]:
    """``resident`` (or ``all``): erase every slot ocache knows; ``head``: forget warmed heads and
    their files; ``disk``/``session``: delete that tier's store entries. Returns
    ``{"tier", "cleared"}``."""
    known = {"resident", "head", "all", *(t.name for t in layer.tiers)}
    if tier not in known:
        raise ValueError(f"unknown tier {tier!r}; one of {sorted(known)}")
    cleared = 0
    if tier in ("resident", "all"):
        layer.align.forget()   # the slots' records of the aligned route go with their content
    if tier in ("resident", "all") and layer.table is not None:
        for st in layer.table.slots:
            async with layer.table.lock(st.id):
                try:
                    await layer.table.erase(st.id)
                except SlotNotSupported:
                    layer.table.mark_unknown(st.id, st.n_total)   # no --slot-save-path: the server keeps it
                    continue
                cleared += 1
    for t in (layer.head_tier, *layer.tiers):  # head files, disk anchors, spilled sessions
        if t is not None and tier in (t.name, "all"):
            cleared += int((await t.clear()).get("deleted", 0))
    return {"tier": tier, "cleared": cleared}
