"""The end of a proxied completion: its record, its log line, its plan released and observed.

``Finisher.finish`` runs once per completion request when the answer is over (relayed, failed, or
the client gone): the ``last_completions`` record and the per-tier counters (``Stats``), one log
line at INFO (``request_line``), then in a background task the plan's release (its ``Receipt``,
spent once: ``ocache/layer.py``), ``layer.observe`` and the recorder. A plan whose ``completion``
still runs (a known conversation's turn) is finished once that is done, at most
``PLAN_COMPLETION_WAIT_S``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from ocache.api import figures
from ocache.api.figures import Figures
from ocache.layer import Observation, ParsedRequest, Plan

if TYPE_CHECKING:
    from ocache.ports import ProxyPorts

log = logging.getLogger("ocache.proxy")

#: seconds the proxy's bookkeeping after an answer (the log line, the stats record, ``observe``) waits
#: for a plan's ``completion`` (``Plan.completion``: the token view and the figures of a known
#: conversation's turn, computed while the server works); the answer itself never waits for it
PLAN_COMPLETION_WAIT_S = 30.0


class Finisher:
    """The proxy's after-the-answer steps (``proxy``: the ``Proxy`` whose layer, stats, recorder,
    receipts and background tasks they use)."""

    def __init__(self, proxy: ProxyPorts) -> None:
        self.proxy = proxy

    def finish(self, preq: ParsedRequest, plan: Plan | None, obs: Observation,
               disconnected: bool, observe: bool = True) -> None:
        """The request's log line, stats record and ``after`` (release, observe, recorder); for a
        plan whose ``completion`` is still running, once it is done (``_plan_completed``)."""
        if plan is not None and plan.completion is not None and not plan.completion.done():
            self.proxy.spawn(self._finish_completed(preq, plan, obs, disconnected, observe), "finish")
            return
        if plan is not None and plan.completion is not None:
            self.completion_failed(preq.request_id, plan.completion)
        self._finish_now(preq, plan, obs, disconnected, observe)

    async def _finish_completed(self, preq: ParsedRequest, plan: Plan, obs: Observation,
                                disconnected: bool, observe: bool) -> None:
        await self._plan_completed(preq.request_id, plan)
        self._finish_now(preq, plan, obs, disconnected, observe)

    async def _plan_completed(self, rid: str, plan: Plan) -> None:
        """Wait for ``plan.completion`` (bounded by ``PLAN_COMPLETION_WAIT_S``); a late or failed one
        is logged and counted, and the request's log line and record carry no figures."""
        task = plan.completion
        done, _ = await asyncio.wait({task}, timeout=PLAN_COMPLETION_WAIT_S)
        if not done:
            log.warning("[%s] the plan's figures were not ready in %g s: relayed without them",
                        rid, PLAN_COMPLETION_WAIT_S)
            self.proxy.stats.layer_error("plan_late")
        else:
            self.completion_failed(rid, task)

    def completion_failed(self, rid: str, task: asyncio.Task[Any]) -> None:
        """Log and count a finished ``Plan.completion`` that failed (its figures are missing)."""
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            log.warning("[%s] the plan's figures failed (%s: %s): relayed without them",
                        rid, type(exc).__name__, exc)
            self.proxy.stats.layer_error("plan_completion")

    def _finish_now(self, preq: ParsedRequest, plan: Plan | None, obs: Observation,
                    disconnected: bool, observe: bool = True) -> None:
        stats = self.proxy.stats
        split = plan.split_tokens if plan is not None and obs.status == 200 else 0
        # the figures the client read: reuse from before this request only (ocache/api/figures.py)
        timings = figures.correct_timings(obs.timings, split, plan.split_ms if plan is not None and split
                                          else 0.0)
        record = self.record(preq, plan, obs, timings, split)
        if preq.body is None:
            # a body ocache could not parse (forwarded byte for byte, counted as unplannable at
            # parse): the upstream's answer is relayed, but it is no completion of ocache's
            stats.unparsed(preq.path, obs.status)
        elif obs.completed or disconnected:
            stats.completion(preq.path, record["tier"], timings, obs.ttft_s, record, split=split)
        log.info("[%s] %s", preq.request_id, request_line(record, preq.method, disconnected))
        self.proxy.spawn(self.after(preq, plan, obs, observe), "after")

    def record(self, preq: ParsedRequest, plan: Plan | None, obs: Observation, timings: dict | None,
               split: int) -> dict[str, Any]:
        """The ``last_completions`` record of one request (``split``: tokens ocache prefilled
        itself, counted only for a 200; ``timings``: as corrected for them)."""
        up = self.proxy.upstream
        slot = None
        if plan is not None and isinstance(plan.body_updates.get("id_slot"), int):
            slot = plan.body_updates["id_slot"]
        elif preq.body is not None and isinstance(preq.body.get("id_slot"), int) \
                and preq.body["id_slot"] >= 0:
            slot = preq.body["id_slot"]
        fig = plan.read_figures() if plan is not None else Figures()
        t = timings or {}
        record = {
            "request_id": preq.request_id, "path": preq.path, "status": obs.status,
            "stream": preq.stream, "slot": slot, "tier": fig.tier or "none",
            "kind": fig.kind, "split": split,
            "n_prompt": (int((obs.timings or {}).get("cache_n") or 0)
                         + int((obs.timings or {}).get("prompt_n") or 0)) if obs.timings else None,
            "prompt_n": t.get("prompt_n"), "cache_n": t.get("cache_n"),
            "prompt_ms": t.get("prompt_ms"), "predicted_n": t.get("predicted_n"),
            "restore_ms": fig.restore_ms,
            "predicted": fig.predicted_cache,
            "ttft_s": obs.ttft_s, "total_s": round(obs.total_s, 6), "completed": obs.completed,
            "epoch": up.epoch, "time": time.time(),
        }
        if len(self.proxy.upstreams) > 1:
            record["upstream"] = up.base_url
        return record

    async def release(self, rid: str, plan: Plan) -> None:
        """Spend ``plan``'s receipt (its ``release``, once; a repeat is a counted no-op,
        ``ocache/layer.py``); a release that raises is logged and counted, never raised."""
        try:
            await self.proxy.receipts.take(plan).spend(rid)
        except Exception:
            self.proxy.stats.layer_error("release")
            log.exception("[%s] cache layer release() failed", rid)

    async def after(self, preq: ParsedRequest, plan: Plan | None, obs: Observation,
                    observe: bool = True) -> None:
        """Release the plan, then ``layer.observe`` (not for a request that was never shown to the
        layer because the upstream was loading or not llama-server), then the recorder."""
        layer, stats = self.proxy.layer, self.proxy.stats
        if plan is not None:
            await self.release(preq.request_id, plan)
        if plan is not None or (preq.body is not None and observe):
            # fail-open or no plan: the layer still learns what happened under an empty plan
            try:
                await layer.observe(preq, plan if plan is not None else Plan(), obs)
            except Exception:
                stats.layer_error("observe")
                log.exception("[%s] cache layer observe() failed", preq.request_id)
        recorder = self.proxy.recorder
        if recorder is not None:
            await asyncio.to_thread(recorder.record, preq, plan, obs)


def request_line(rec: dict, method: str, disconnected: bool = False) -> str:
    """The per-request log line, from a ``last_completions`` record (``_finish``), e.g.
    ``POST /v1/chat/completions 200 agent slot 0: prefilled 77, reused 7,251 from resident,
    restore 18.2 ms; generated 4; ttft 329 ms, total 329 ms``. ``prefilled`` is the server's
    ``timings.prompt_n``, ``reused`` its ``cache_n`` (tokens; both as corrected for ``split``, the
    tokens ocache prefilled itself for the request, ocache/api/figures.py), ``from`` the X-OCache-Tier; without
    timings (an error, a non-llama-server answer) only status and times are shown."""
    def n(v: Any) -> str:
        return f"{int(v):,}" if isinstance(v, (int, float)) else "?"

    if disconnected:
        state = " (client closed after the final event)" if rec.get("completed") else " DISCONNECTED"
    else:
        state = "" if rec.get("completed") else " INCOMPLETE"
    head = (f"{method} {rec['path']}{' stream' if rec.get('stream') else ''} {rec['status']}{state}"
            f" {rec.get('kind') or 'other'}"
            f" slot {'?' if rec.get('slot') is None else rec['slot']}"
            + (f" on {rec['upstream'].split('://', 1)[-1]}" if rec.get("upstream") else ""))
    parts = []
    if rec.get("prompt_n") is not None or rec.get("cache_n") is not None:
        reuse = f"prefilled {n(rec.get('prompt_n'))}, reused {n(rec.get('cache_n'))}"
        if rec.get("tier") not in (None, "none", "cold"):
            reuse += f" from {rec['tier']}"
        if rec.get("split"):  # ocache's own split/warm-up steps: counted in prefilled, not reused
            reuse += f" (split {n(rec['split'])}: prefilled by ocache's own steps)"
        if rec.get("restore_ms") is not None:
            reuse += f", restore {rec['restore_ms']:.1f} ms"
        parts.append(reuse)
        if rec.get("predicted_n") is not None:
            parts.append(f"generated {n(rec['predicted_n'])}")
    ttft = rec.get("ttft_s")
    parts.append(f"ttft {'-' if ttft is None else f'{ttft * 1e3:.0f} ms'}, "
                 f"total {rec['total_s'] * 1e3:.0f} ms")
    return f"{head}: {'; '.join(parts)}"
