"""The cache half behind the proxy, one module per step of a request's path
(``docs/architecture.md`` §1):

* ``prepare.py`` — the request's shape and its prepared form (token view, context), once per request;
* ``routes/`` — one module per request route (``known``, ``server_placed``, ``usual``), tried in order;
* ``core.py`` — the planning core the routes share (lookup phase, decision, context, headers);
* ``plan.py`` — the pure planner (``Decision``, ``plan_request``);
* ``execute.py`` — the executor: the plan's steps on the leased slot (``execute``, ``PlanContext``);
* ``observe.py`` — after the response: mispredictions, the slot's new content, every tier's admit;
* ``estimate.py`` — the router's read-only question "what could this server reuse?";
* ``warmup.py`` — warm-ups off a request's path (a harness head, ``ocache warm DIR``);
* ``report.py`` — stats and clear; ``stopping.py`` — quiesce and drain;
* ``wiring.py`` — the layer's options, the server's identity, tiers built from the config;
* ``orchestrator.py`` — ``OCacheLayer``, the dispatcher the proxy loads.

The head tier and its origin slot live in ``ocache/tiers/head.py``.
"""

from ocache.cache.execute import PlanContext, ServerPlaced
from ocache.cache.observe import PREFILL_RATE_MIN_TOKENS
from ocache.cache.orchestrator import CHAT_ROUTES, OCacheLayer
from ocache.cache.plan import Decision, Estimate, plan_request
from ocache.cache.prepare import Prepared, Shape
from ocache.tiers.base import RequestContext
from ocache.tiers.head import HEAD_KIND, HeadRecord, HeadTier, HeadTierError

__all__ = ["CHAT_ROUTES", "Decision", "Estimate", "PREFILL_RATE_MIN_TOKENS", "ServerPlaced", "HEAD_KIND", "HeadRecord", "HeadTier", "HeadTierError", "OCacheLayer",
           "PlanContext", "Prepared", "RequestContext", "Shape", "plan_request"]
