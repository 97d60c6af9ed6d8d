"""The request routes of the cache layer, one module each, tried in order by
``OCacheLayer.plan`` over the shared planning core (``ocache/cache/core.py``):

* ``BEFORE_VIEW`` — routes that decide on the request's :class:`~ocache.cache.prepare.Shape`
  alone, before its token view is built: ``known`` (the next turn of a conversation a slot holds,
  forwarded at once, viewed while the server works), ``aligned`` (a rewritten history served from
  the slot's own tokens plus the new part, ``ocache/align.py``), ``continued`` (a client's compaction of a
  conversation a slot holds, served as its continuation, ``ocache/compaction.py``);
* ``AFTER_VIEW`` — routes that need the :class:`~ocache.cache.prepare.Prepared` request (view and
  context on this server): ``server_placed`` (the server chooses the slot), ``usual`` (the planner
  chooses slot and steps; it plans every request it is given, so it comes last).

Each entry answers a ``Plan`` or None (not this route's request: the next one is asked). A new
route is one module here and one line in one of the two tuples.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Awaitable, Callable

from ocache.cache.prepare import Prepared, Shape
from ocache.cache.routes import aligned, continued, known, server_placed, usual
from ocache.layer import ParsedRequest, Plan
from ocache.tiers.base import RequestContext

if TYPE_CHECKING:
    from ocache.cache.ports import PlanningServices

EarlyRoute = Callable[["PlanningServices", ParsedRequest, Shape], Awaitable["Plan | None"]]
Route = Callable[["PlanningServices", ParsedRequest, Prepared, RequestContext], Awaitable["Plan | None"]]

BEFORE_VIEW: tuple[EarlyRoute, ...] = (
    known.plan,
    aligned.plan,
    continued.plan,
)
AFTER_VIEW: tuple[Route, ...] = (
    server_placed.plan,
    usual.plan,
)
