"""The cache half behind the proxy, one module per step of a request's path
(``docs/architecture.md`` §1):

* ``plan.py`` — the pure planner (``Decision``, ``plan_request``);
* ``execute.py`` — the executor: the plan's steps on the leased slot (``execute``, ``PlanContext``);
* ``observe.py`` — after the response: mispredictions, the slot's new content, every tier's admit;
* ``wiring.py`` — the layer's options, the server's identity, tiers built from the config;
* ``orchestrator.py`` — ``OCacheLayer``, the thin orchestrator the proxy loads.

The head tier and its origin slot live in ``ocache/tiers/head.py``.
"""

from ocache.cache.execute import PlanContext, ServerPlaced
from ocache.cache.observe import PREFILL_RATE_MIN_TOKENS
from ocache.cache.orchestrator import CHAT_ROUTES, OCacheLayer
from ocache.cache.plan import Decision, Estimate, plan_request
from ocache.tiers.base import RequestContext
from ocache.tiers.head import HEAD_KIND, HeadRecord, HeadTier, HeadTierError

__all__ = ["CHAT_ROUTES", "Decision", "Estimate", "PREFILL_RATE_MIN_TOKENS", "ServerPlaced", "HEAD_KIND", "HeadRecord", "HeadTier", "HeadTierError", "OCacheLayer",
           "PlanContext", "RequestContext", "plan_request"]
