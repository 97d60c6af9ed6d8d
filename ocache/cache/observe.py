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
from typing import Any, Awaitable, Callable, Coroutine, Sequence

from ocache.align import sampled_ids
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


#: what a request's prompt is to the server-alone model: its token ids, the positions where user
#: messages start (a hybrid's checkpoints), tokens ocache prefilled on the slot for it first
Fed = tuple[Sequence[int], Sequence[int], int]
#: an answered request waiting to be fed: its prompt (or what learns it), the answer, the server's
#: flags, the ``id_slot`` the client asked for
_Queued = tuple["Fed | None | Awaitable[Fed | None]", Observation, ServerParams, object]


class AloneTally:
    """The saving against llama-server alone (``report.stats`` ``alone``): ``model`` is the server
    alone with the same flags (``ocache.llama.alone.AloneModel``), fed every answered request in
    the order ocache saw the answers; ``ocache_prefill`` the tokens the server prefilled through
    ocache for them (the answer's ``prompt_n`` plus ocache's own steps for it).

    A request whose prompt tokens the plan did not learn (forwarded untouched after the plan
    failed: the token view timed out on a starved server, say) is fed when they are learned, after
    the answer (``feed_later``); the requests answered after it wait behind it, so the model sees
    them in order. Left out, its prefill counted on neither side while the model's slots missed
    its prompt, so the next turn looked cold to the server alone: measured on a loaded machine
    (``ocache bench --preset tiny --scenario title_interleave --models hybrid --configs b,c
    --no-recordings``), the headline said 7,266 tokens saved where (b) - (c) was 0. A prompt
    never learned (not renderable, the server gone) counts its ``prompt_n`` on both sides (no
    saving claimed for it) and leaves the model's slots as they were."""

    def __init__(self) -> None:
        self.model = AloneModel()
        self.ocache_prefill = 0
        #: answered requests not yet fed, oldest first: their prompt (or what learns it), answer
        #: and the server's flags; non-empty only while a ``feed_later`` is pending
        self._queue: deque[_Queued] = deque()
        self.unknown = 0

    @property
    def prefill(self) -> int:
        """Tokens the server alone would have prefilled so far."""
        return self.model.prefill

    @property
    def pending(self) -> int:
        """Answered requests waiting for a prompt to be learned before they are fed."""
        return len(self._queue)

    def restart(self) -> None:
        """A new server process: the server alone would have lost every slot too."""
        self.model.restart()

    def stats(self) -> dict:
        return {**self.model.stats(), "ocache_prefill": self.ocache_prefill,
                "saved": self.model.prefill - self.ocache_prefill, "unknown_prompts": self.unknown}

    @staticmethod
    def fed(pctx: Any) -> Fed | None:
        """What the model is fed for a plan's context (the plan's token view, the aligned
        request's own render, a server-placed request's tokens); None when it holds no tokens."""
        from ocache.cache.align_route import AlignContext

        if isinstance(pctx, PlanContext):
            view = getattr(pctx, "view", None)
            tokens, starts, split = getattr(view, "tokens", None), pctx.ctx.user_starts, pctx.split
        elif isinstance(pctx, (AlignContext, ServerPlaced)):
            tokens, split = pctx.tokens, 0
            starts = pctx.ctx.user_starts if isinstance(pctx, ServerPlaced) else ()
        else:
            return None
        return (tokens, starts or (), int(split or 0)) if tokens else None

    def feed(self, pctx: Any, obs: Observation, params: ServerParams, id_slot: object = None) -> int | None:
        """Feed the model an answered request whose plan holds its prompt tokens (``fed``;
        ``id_slot``: the slot the client's body asked for, which the server alone honours).
        Returns the tokens the server alone would have prefilled for it; None when it is not
        modelled (no tokens, not a 200 with ``timings.prompt_n``) or waits behind a
        ``feed_later`` (then it is fed in turn). Never raises."""
        if not self._answered(obs):
            return None
        got = self.fed(pctx)
        if got is None:
            return None
        if self._queue:
            self._queue.append((got, obs, params, id_slot))
            return None
        return self._apply(got, obs, params, id_slot)

    def feed_later(self, learn: Awaitable[Fed | None], obs: Observation, params: ServerParams,
                   spawn: Callable[[Coroutine[Any, Any, None], str], Any], id_slot: object = None) -> bool:
        """Queue an answered request whose prompt ``learn`` finds (None: it cannot); the queue is
        fed in order by a task ``spawn`` runs (``Background.spawn``). Whether it was queued (not
        for an answer the model does not count); ``learn`` is closed unawaited then."""
        if not self._answered(obs):
            close = getattr(learn, "close", None)
            if close is not None:
                close()
            return False
        self._queue.append((learn, obs, params, id_slot))
        if len(self._queue) == 1:
            spawn(self._drain(), "alone")
        return True

    @staticmethod
    def _answered(obs: Observation) -> bool:
        return obs.status == 200 and "prompt_n" in (obs.timings or {})

    async def _drain(self) -> None:
        while self._queue:
            item, obs, params, id_slot = self._queue[0]
            got: Fed | None
            if isinstance(item, tuple) or item is None:
                got = item
            else:
                try:
                    got = await item
                except Exception:
                    log.debug("a prompt for the server-alone model was not learned", exc_info=True)
                    got = None
            self._queue.popleft()
            self._apply(got, obs, params, id_slot)

    def _apply(self, got: Fed | None, obs: Observation, params: ServerParams, id_slot: object) -> int | None:
        timings = obs.timings or {}
        prompt_n = int(timings.get("prompt_n") or 0)
        if got is None:
            # no prompt: as much as through ocache on both sides, the model's slots unchanged
            self.unknown += 1
            self.model.prefill += prompt_n
            self.ocache_prefill += prompt_n
            return None
        tokens, starts, split = got
        try:   # a figure for the dashboard: never in the way of the request's own bookkeeping
            alone = self.model.serve(tokens, params, starts, int(timings.get("predicted_n") or 0),
                                     sampled_ids(timings), id_slot)
        except Exception:
            log.debug("server-alone model failed", exc_info=True)
            return None
        self.ocache_prefill += prompt_n + split
        return alone
