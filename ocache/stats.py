"""Counters of the proxy: JSON for ``GET /v1/cache/stats`` and Prometheus text for
``GET /v1/cache/metrics`` (prometheus_client, with its own CollectorRegistry so that several
proxies in one process, e.g. tests, do not collide).

Metric families (all prefixed ``ocache_``):

| name | type | labels | meaning |
|---|---|---|---|
| requests_total | counter | route, status | requests answered (route = a known path or ``other``) |
| completions_total | counter | route, tier | completions relayed (tier = the plan's X-OCache-Tier or ``none``) |
| prompt_tokens_total | counter | route, tier, kind | kind=``cached``: reused from before the request (the corrected ``timings.cache_n``); ``processed``: prefilled by the server for the request, ocache's own split/warm-up steps included (the corrected ``prompt_n``); ``split``: of those, by ocache's own steps |
| saved_tokens_total | counter | route | prompt tokens minus tokens prefilled, per request (what a cold prefill would have cost more; a request that cost more than cold adds 0 and counts in ``extra_prefill_tokens_total``) |
| extra_prefill_tokens_total | counter | route | tokens prefilled beyond the prompt (ocache's steps re-done by the server) |
| predicted_tokens_total | counter | route | timings.predicted_n |
| ttft_seconds | histogram | route | wall time from request receipt to the first generated token relayed (SSE: first `data:` event, not a keep-alive comment; otherwise the first byte) |
| client_disconnects_total | counter | route | client went away before the response ended |
| upstream_unavailable_total | counter | | requests answered 503 because llama-server was down |
| upstream_restarts_total | counter | | new upstream processes detected (epoch changes) |
| layer_errors_total | counter | stage | cache-layer exceptions (plan: request forwarded untouched) |
| unplannable_total | counter | reason | completion bodies forwarded byte for byte, never planned (``body``: not UTF-8 JSON object / lone surrogate; ``nesting``: too deep for the layer; ``size``: more bytes than the slot context can hold) |
| unparsed_total | counter | route, status | answers to those bodies, by the upstream's status: never counted in ``completions_total``, the token counters or ``ttft_seconds`` (ocache neither planned nor read them; the JSON view's ``unparsed``) |
| held_loading_total | counter | | requests held while llama-server loaded its model |
| figures_late_total | counter | | known-conversation answers sent before their figures were ready (``X-OCache-Figures: late``; the figures then reach the log line and ``last_completions``) |
| stale_plans_total | counter | | plans the server refused because it was another process than the one they were made for (412 to ``X-Llama-Server-If-Boot``, patches/0007: a restart since the slot table's last ``GET /slots``); each request was planned again |
| layer_stat | gauge | key | numeric leaves of ``layer.stats()`` (flattened with dots) |
"""

from __future__ import annotations

import time
from collections import Counter as _Counter
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from ocache.layer import COMPLETION_ROUTES

#: Paths that keep their own label; everything else is counted as ``other`` (bounded cardinality).
KNOWN_ROUTES = COMPLETION_ROUTES | {
    "/health", "/v1/health", "/props", "/slots", "/metrics", "/models", "/v1/models",
    "/tokenize", "/detokenize", "/apply-template", "/v1/messages/count_tokens",
    "/v1/responses/input_tokens", "/responses/input_tokens", "/v1/cache/stats",
    "/v1/cache/metrics", "/v1/cache/clear",
}

def route_label(path: str) -> str:
    if path in KNOWN_ROUTES:
        return path
    if path.startswith("/slots/"):
        return "/slots/{id}"
    return "other"


def _flatten(d: dict, prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, bool):
            out[key] = float(v)
        elif isinstance(v, (int, float)):
            out[key] = float(v)
        elif isinstance(v, dict):
            out.update(_flatten(v, key + "."))
    return out


class _LayerCollector:
    def __init__(self, source: Callable[[], dict]):
        self.source = source

    def collect(self):
        g = GaugeMetricFamily("ocache_layer_stat", "numeric values of the cache layer's stats()",
                              labels=["key"])
        try:
            flat = _flatten(self.source() or {})
        except Exception:  # the layer's stats must never break the metrics page
            flat = {}
        for k, v in sorted(flat.items()):
            g.add_metric([k], v)
        yield g


class Stats:
    """All counters of one proxy. ``layer_stats`` is a callable returning the layer's stats()."""

    def __init__(self, layer_stats: Callable[[], dict] | None = None) -> None:
        self.started = time.time()
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("ocache_requests_total", "requests answered", ["route", "status"],
                                registry=r)
        self.completions = Counter("ocache_completions_total", "completions relayed",
                                   ["route", "tier"], registry=r)
        self.prompt_tokens = Counter("ocache_prompt_tokens_total",
                                     "prompt tokens: cached (cache_n) or processed (prompt_n)",
                                     ["route", "tier", "kind"], registry=r)
        self.predicted_tokens = Counter("ocache_predicted_tokens_total", "tokens generated",
                                        ["route"], registry=r)
        self.saved_tokens = Counter("ocache_saved_tokens_total",
                                    "prompt tokens not prefilled, against a cold prefill", ["route"],
                                    registry=r)
        self.extra_prefill = Counter("ocache_extra_prefill_tokens_total",
                                     "tokens prefilled beyond the prompt length", ["route"], registry=r)
        self.ttft = Histogram("ocache_ttft_seconds", "request receipt to the first token relayed",
                              ["route"], registry=r,
                              buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60,
                                       120, 300))
        self.disconnects = Counter("ocache_client_disconnects_total",
                                   "client disconnected before the response ended", ["route"],
                                   registry=r)
        self.unavailable = Counter("ocache_upstream_unavailable_total",
                                   "answered 503 because the upstream was down", registry=r)
        self.restarts = Counter("ocache_upstream_restarts_total",
                                "new upstream processes detected", registry=r)
        self.layer_errors = Counter("ocache_layer_errors_total", "cache-layer exceptions",
                                    ["stage"], registry=r)
        self.unplannable_c = Counter("ocache_unplannable_total", "completion bodies forwarded byte "
                                     "for byte without a plan", ["reason"], registry=r)
        self.unparsed_c = Counter("ocache_unparsed_total", "answers to completion bodies ocache could "
                                  "not parse (forwarded byte for byte; not completions)",
                                  ["route", "status"], registry=r)
        self.figures_late_c = Counter("ocache_figures_late_total", "known-conversation answers sent "
                                      "before their figures were ready", registry=r)
        self.stale_plans_c = Counter("ocache_stale_plans_total", "plans refused by a restarted "
                                     "llama-server (412) and made again", registry=r)
        self.held_loading_c = Counter("ocache_held_loading_total", "requests held while "
                                      "llama-server loaded its model", registry=r)
        if layer_stats is not None:
            r.register(_LayerCollector(layer_stats))
        # plain mirrors for the JSON view
        self._requests: _Counter = _Counter()
        self._request_children: dict = {}
        self._completion_children: dict = {}
        self._completions: _Counter = _Counter()
        self._unparsed: _Counter = _Counter()
        self._tokens: _Counter = _Counter()
        self._misc: _Counter = _Counter()
        self.last_completions: list[dict] = []

    # --- recording ----------------------------------------------------------------------------
    def request(self, path: str, status: int) -> None:
        route = route_label(path)
        key = (route, status)
        child = self._request_children.get(key)
        if child is None:  # labels() takes a lock and builds a tuple: look it up once per key
            child = self._request_children[key] = self.requests.labels(route, str(status))
        child.inc()
        self._requests[key] += 1

    def _children(self, route: str, tier: str) -> tuple:
        key = (route, tier)
        c = self._completion_children.get(key)
        if c is None:
            c = self._completion_children[key] = (
                self.completions.labels(route, tier), self.ttft.labels(route),
                self.prompt_tokens.labels(route, tier, "cached"),
                self.prompt_tokens.labels(route, tier, "processed"),
                self.predicted_tokens.labels(route),
                self.prompt_tokens.labels(route, tier, "split"),
                self.saved_tokens.labels(route), self.extra_prefill.labels(route))
        return c

    def completion(self, path: str, tier: str, timings: dict | None, ttft_s: float | None,
                   record: dict, split: int = 0) -> None:
        """Count one completion. ``timings``: the figures the client read (already corrected for
        ``split``, the tokens ocache prefilled itself for the request: ocache/api/figures.py)."""
        route = route_label(path)
        completions, ttft, cached, processed, predicted, split_c, saved_c, extra_c = self._children(route, tier)
        completions.inc()
        self._completions[(route, tier)] += 1
        if ttft_s is not None:
            ttft.observe(ttft_s)
        if timings:
            cache_n = int(timings.get("cache_n") or 0)
            prompt_n = int(timings.get("prompt_n") or 0)
            predicted_n = int(timings.get("predicted_n") or 0)
            cached.inc(cache_n)
            processed.inc(prompt_n)
            predicted.inc(predicted_n)
            split_c.inc(max(0, split))
            # prompt length = the server's cache_n + prompt_n (= the corrected pair's sum)
            n_prompt = record.get("n_prompt")
            saved = (int(n_prompt) if n_prompt is not None else cache_n + prompt_n) - prompt_n
            saved_c.inc(max(0, saved))
            extra_c.inc(max(0, -saved))
            self._tokens["cache_n"] += cache_n
            self._tokens["prompt_n"] += prompt_n
            self._tokens["predicted_n"] += predicted_n
            self._tokens["prefilled"] += prompt_n
            self._tokens["split"] += max(0, split)
            self._tokens["saved_vs_cold"] += saved
            self._tokens[f"tier.{tier}.cache_n"] += cache_n
        self.last_completions.append(record)
        del self.last_completions[:-20]

    def unparsed(self, path: str, status: int) -> None:
        """Count the answer to a completion body ocache could not parse (``unplannable``: forwarded
        byte for byte, never planned). Not a completion: its figures (if the upstream sent any) are
        not ocache's to report, so it stays out of ``completions``, the token totals, the TTFT
        histogram and ``last_completions``. ``status``: the upstream's (0: no answer)."""
        route = route_label(path)
        self.unparsed_c.labels(route, str(status)).inc()
        self._unparsed[(route, status)] += 1

    def _count(self, counter: Counter, key: str) -> None:
        """One more of ``counter`` (a Prometheus counter, labelled already where it has labels)
        and of ``key`` in the JSON stats."""
        counter.inc()
        self._misc[key] += 1

    def disconnect(self, path: str) -> None:
        self._count(self.disconnects.labels(route_label(path)), "client_disconnects")

    def figures_late(self) -> None:
        self._count(self.figures_late_c, "figures_late")

    def stale_plan(self) -> None:
        self._count(self.stale_plans_c, "stale_plans")

    def upstream_unavailable(self) -> None:
        self._count(self.unavailable, "upstream_unavailable")

    def upstream_restart(self) -> None:
        self._count(self.restarts, "upstream_restarts")

    def layer_error(self, stage: str) -> None:
        self._count(self.layer_errors.labels(stage), f"layer_errors.{stage}")

    def unplannable(self, reason: str) -> None:
        self._count(self.unplannable_c.labels(reason), f"unplannable.{reason}")

    def held_loading(self) -> None:
        self._count(self.held_loading_c, "held_loading")

    # --- views --------------------------------------------------------------------------------
    def prometheus(self) -> bytes:
        return generate_latest(self.registry)

    def to_dict(self) -> dict:
        requests: dict[str, dict[str, int]] = {}
        for (route, status), n in sorted(self._requests.items()):
            requests.setdefault(route, {})[str(status)] = n
        completions: dict[str, dict[str, int]] = {}
        for (route, tier), n in sorted(self._completions.items()):
            completions.setdefault(route, {})[tier] = n
        unparsed: dict[str, dict[str, int]] = {}
        for (route, status), n in sorted(self._unparsed.items()):
            unparsed.setdefault(route, {})[str(status)] = n
        layer_errors = {k.split(".", 1)[1]: v for k, v in self._misc.items()
                        if k.startswith("layer_errors.")}
        return {
            "uptime_s": round(time.time() - self.started, 3),
            "requests": requests,
            "completions": completions,
            "unparsed": unparsed,
            "tokens": dict(self._tokens),
            "client_disconnects": self._misc["client_disconnects"],
            "upstream_unavailable": self._misc["upstream_unavailable"],
            "upstream_restarts": self._misc["upstream_restarts"],
            "layer_errors": layer_errors,
            "fail_open": layer_errors.get("plan", 0),
            "unplannable": {k.split(".", 1)[1]: v for k, v in self._misc.items()
                            if k.startswith("unplannable.")},
            "held_loading": self._misc["held_loading"],
            "figures_late": self._misc["figures_late"],
            "stale_plans": self._misc["stale_plans"],
            "last_completions": list(self.last_completions),
        }
