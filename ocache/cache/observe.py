"""Observe: after the response, what the server did against what the plan predicted.

A ``cache_n`` outside ``[predicted - ubatch, upper + ubatch]`` is a counted misprediction (a bug
in the reuse model, ``ocache/llama/reuse.py``); a prompt length (``cache_n + prompt_n``) other than
the token view's is a counted ``view_mismatches`` (the view was wrong: nothing is recorded from it);
the prefill rate is measured from ``timings``; the
slot's new content is recorded through the slot table's verbs (``finish``, ``interrupted``,
``mark_unknown``); then every tier's ``admit`` runs (disk: anchor bookkeeping; session: the
conversation it may spill later), or, for a response cut short, every tier's ``interrupted``
(session: the partial conversation it may spill once ``GET /slots`` counted it).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, Callable, Sequence

from ocache.api import convert
from ocache.cache.execute import PlanContext, ServerPlaced
from ocache.layer import Observation, ParsedRequest
from ocache.llama.alone import AloneModel
from ocache.llama.flags import ServerParams
from ocache.llama.reuse import media_spans, simulate_prefill
from ocache.slots import SlotTable
from ocache.tiers.base import TierBase

log = logging.getLogger("ocache.cache")

#: prefills shorter than this (tokens) do not enter the measured prefill rate: their fixed costs
#: (one ubatch at least, the sampling of the first token) dominate the per-token figure
PREFILL_RATE_MIN_TOKENS = 512


class Observer:
    """The observe step and what it measures. ``counters``: the layer's (``observed``,
    ``mispredictions``, token totals, ...). ``prefill_tps``: the measured prefill rate (tokens/s,
    an exponential mean over responses that prefilled >= 64 tokens; None until measured), which the
    planner weighs offers with. ``recent_mispredictions``: the last 20, for the stats."""

    def __init__(self, counters: dict[str, int],
                 on_view_mismatch: Callable[[PlanContext], None] | None = None) -> None:
        self.counters = counters
        self.prefill_tps: float | None = None
        self.recent_mispredictions: deque = deque(maxlen=20)
        #: called with the plan context when the server's prompt length differs from the token view's
        self.on_view_mismatch = on_view_mismatch

    async def observe(self, table: SlotTable, tiers: Sequence[TierBase], req: ParsedRequest, pctx: PlanContext,
                      obs: Observation) -> bool:
        """Record one response. Returns True when it completed with ``timings`` (then every tier
        admitted it), False otherwise (the slot's content is then unknown or pending)."""
        mine = table[pctx.slot].seq == pctx.seq
        timings = obs.timings or {}
        # the final timings arrived: the server finished, even if the client then closed the
        # stream before its last bytes (Codex CLI closes as soon as it has response.completed)
        ok = obs.status == 200 and (obs.completed or ("cache_n" in timings and req.path in
                                                      convert.CONVERTED_ROUTES)) and "cache_n" in timings
        if not ok:
            await self._failed(table, tiers, pctx, obs, mine)
            return False
        cache_n = int(timings["cache_n"])
        prompt_n = int(timings.get("prompt_n") or 0)
        if "prompt_n" in timings and cache_n + prompt_n != pctx.n_prompt:
            # the server's own prompt length (cache_n + prompt_n: every prompt token is reused or
            # prefilled) is not the token view's: the view was wrong (a template that stopped being
            # append-only after the delta-render checks, say). Nothing is recorded from it: the
            # slot's content is for GET /slots, and no tier admits tokens the server never saw
            # (an anchor or spill keyed by them would restore a wrong state)
            self.counters["view_mismatches"] += 1
            log.warning("[%s] the server's prompt was %d tokens, ocache's view %d: slot %d is "
                        "reconciled, nothing admitted, delta renders off", pctx.request_id,
                        cache_n + prompt_n, pctx.n_prompt, pctx.slot)
            if mine and not table.lock(pctx.slot).locked():
                table.mark_unknown(pctx.slot)
            if self.on_view_mismatch is not None:
                self.on_view_mismatch(pctx)
            return False
        self.counters["observed"] += 1
        ub = table.params.n_ubatch
        self.counters["predicted_tokens"] += pctx.predicted
        self.counters["observed_cache_tokens"] += cache_n   # the server's, split included (vs predicted)
        self.counters["prompt_tokens"] += pctx.n_prompt
        # what the client was told (figures.py): reuse from before the request, all prefill
        self.counters["reused_tokens"] += max(0, cache_n - pctx.split)
        self.counters["prefilled_tokens"] += prompt_n + pctx.split
        self._judge(pctx, cache_n, ub)
        # the prefill rate (tokens/s): from every prefill long enough to be dominated by its tokens,
        # the forwarded request's and ocache's own steps alike (a cold request is mostly a split:
        # measured 1,060 tok/s from a 94-token tail where the 7,251-token cold prefill ran at 7,526)
        for n, ms in ((prompt_n, timings.get("prompt_ms")), (pctx.split, pctx.split_ms)):
            if n >= PREFILL_RATE_MIN_TOKENS and ms:
                tps = n / (float(ms) / 1000.0)
                self.prefill_tps = tps if self.prefill_tps is None else 0.8 * self.prefill_tps + 0.2 * tps
        if mine:
            gen = int(timings.get("predicted_n") or 0)
            corrected = None
            if cache_n != pctx.predicted and table.params.checkpoints:
                kept = [c for c in pctx.checkpoints_before if c.n_tokens - 1 <= cache_n + 1]
                corrected = simulate_prefill(kept, cache_n, pctx.n_prompt, pctx.ctx.user_starts,
                                             table.params, pctx.ctx.task,
                                             media=media_spans(pctx.view.tokens) if pctx.view is not None else ())
            table.finish(pctx.slot, pctx.seq, pctx.n_prompt + max(gen, 1) - 1, corrected)
        for tier in tiers:
            try:
                await tier.admit(pctx.view, pctx.slot, obs)
            except Exception:
                log.exception("[%s] tier %s admit failed", pctx.request_id, tier.name)
        return True

    async def _failed(self, table: SlotTable, tiers: Sequence[TierBase], pctx: PlanContext, obs: Observation,
                      mine: bool) -> None:
        """A response that did not complete with ``timings``: counted; when the slot still holds
        this plan's content and no request holds it, a cut-short answer is recorded as
        interrupted (and every tier's ``interrupted`` runs), a rejected one as unknown content."""
        self.counters["failed_responses"] += 1
        if not mine or table.lock(pctx.slot).locked():
            return
        if obs.status != 200:
            table.mark_unknown(pctx.slot)  # rejected: content unknown until reconciled
            return
        # started but cut short (client gone, upstream error mid-stream): the slot holds the prompt
        # if its prefill finished; GET /slots tells before the next plan
        if table.interrupted(pctx.slot, pctx.seq):
            for tier in tiers:
                try:
                    await tier.interrupted(pctx.view, pctx.slot, obs)
                except Exception:
                    log.exception("[%s] tier %s interrupted failed", pctx.request_id, tier.name)

    def _judge(self, pctx: PlanContext, cache_n: int, ub: int) -> None:
        """Count and keep a misprediction: ``cache_n`` (tokens) outside ``[predicted - ub, upper +
        ub]`` (``ub``: the server's ubatch)."""
        low = cache_n < pctx.predicted - ub
        high = cache_n > pctx.upper + ub
        if not (low or high):
            return
        self.counters["mispredictions"] += 1
        self.counters["mispredict_low" if low else "mispredict_high"] += 1
        d = pctx.decision
        rec = {"request_id": pctx.request_id, "slot": pctx.slot, "n_prompt": pctx.n_prompt,
               "predicted": pctx.predicted, "upper": pctx.upper, "observed": cache_n,
               "reason": d.choice.reuse.reason, "tier": d.tier, "kind": pctx.ctx.kind}
        self.recent_mispredictions.append(rec)
        log.warning("[%s] cache_n misprediction on slot %d: predicted %d (upper %d), observed %d, "
                    "prompt %d tokens (%s)", pctx.request_id, pctx.slot, pctx.predicted, pctx.upper,
                    cache_n, pctx.n_prompt, d.choice.reuse.reason)

    def observe_placed(self, table: SlotTable, placed: ServerPlaced, obs: Observation) -> None:
        """The checkpoints a server-placed request's prefill made (hybrid models), from its
        ``cache_n``; those the slot had before are not known and not counted on."""
        cache_n = (obs.timings or {}).get("cache_n")
        if placed.slot is None or cache_n is None or not table.params.checkpoints:
            return
        table.predict_checkpoints(placed.slot, placed.seq,
                                  simulate_prefill([], int(cache_n), len(placed.tokens), placed.ctx.user_starts,
                                                   table.params, placed.ctx.task, media=media_spans(placed.tokens)))


class AloneTally:
    """The saving against llama-server alone (``report.stats`` ``alone``): ``model`` is the server
    alone with the same flags (``ocache.llama.alone.AloneModel``), fed every answered request;
    ``ocache_prefill`` the tokens the server prefilled through ocache for them (the answer's
    ``prompt_n`` plus ocache's own steps for it)."""

    def __init__(self) -> None:
        self.model = AloneModel()
        self.ocache_prefill = 0

    @property
    def prefill(self) -> int:
        """Tokens the server alone would have prefilled so far."""
        return self.model.prefill

    def restart(self) -> None:
        """A new server process: the server alone would have lost every slot too."""
        self.model.restart()

    def stats(self) -> dict:
        return {**self.model.stats(), "ocache_prefill": self.ocache_prefill,
                "saved": self.model.prefill - self.ocache_prefill}

    def feed(self, pctx: Any, obs: Observation, params: ServerParams) -> int | None:
        """Feed the model an answered request: its prompt tokens (the plan's token view, the aligned
        request's own render, a server-placed request's tokens) and the server's prefill for it
        through ocache (the answer's raw ``prompt_n`` plus the tokens ocache prefilled on the slot
        for it first, ``PlanContext.split``). Returns the tokens the server alone would have
        prefilled for it (None: not modelled). Never raises."""
        from ocache.cache.align_route import AlignContext

        timings = obs.timings or {}
        if obs.status != 200 or "prompt_n" not in timings:
            return None
        if isinstance(pctx, PlanContext):
            view = getattr(pctx, "view", None)
            tokens, starts, split = getattr(view, "tokens", None), pctx.ctx.user_starts, pctx.split
        elif isinstance(pctx, (AlignContext, ServerPlaced)):
            tokens, split = pctx.tokens, 0
            starts = pctx.ctx.user_starts if isinstance(pctx, ServerPlaced) else ()
        else:
            return None
        if not tokens:
            return None
        try:   # a figure for the dashboard: never in the way of the request's own bookkeeping
            alone = self.model.serve(tokens, params, starts or (), int(timings.get("predicted_n") or 0))
        except Exception:
            log.debug("server-alone model failed", exc_info=True)
            return None
        self.ocache_prefill += int(timings.get("prompt_n") or 0) + int(split or 0)
        return alone
