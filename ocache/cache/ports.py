"""What the cache half's rooms receive of the layer: ``PlanningServices``.

The routes (``ocache/cache/routes/``), the planning core (``core.py``), the router's estimate
(``estimate.py``), the warm-ups (``warmup.py``), stats and clear (``report.py``) and the stop
(``stopping.py``) are handed the ``OCacheLayer`` (``ocache/cache/orchestrator.py``) but depend on
this port instead: the slot table, the token view, the tiers, the rates, the counters and each
route's record, each one public. The layer imports its rooms; none of them imports the layer.
Every type here is a value or a protocol of a module below the cache half's rooms, so that this
module stays a leaf of it.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Any, Awaitable, Callable, Mapping, Protocol, Sequence

from ocache.align import Turn
from ocache.background import Background
from ocache.cache.align_judge import SpanJudge
from ocache.cache.prepare import Prepared, Rejected, Shape
from ocache.config import Config
from ocache.fingerprint import Identity
from ocache.layer import ParsedRequest, Plan
from ocache.llama.checks import Finding
from ocache.slots import SlotTable
from ocache.tiers.base import TierBase
from ocache.tiers.disk import DiskTier
from ocache.tiers.head import HeadTier
from ocache.tiers.spill import SessionTier
from ocache.tokens import TokenViewer
from ocache.upstream import UpstreamPort
from ocache.warm import FolderJournal


class Tally(Protocol):
    """A record with its own stats (``observe.AloneTally``)."""

    def stats(self) -> dict[str, Any]: ...


class AlignRecord(Protocol):
    """The aligned route's record (``align_route.AlignRoute``) as the continued route and the
    report read it: its switch, the conversations it recorded per slot (slot -> (the table's
    ``seq`` when recorded, the turn)), its counters, the template's end-of-turn token, its span
    judge and its wait for the slots' pending observes."""

    on: bool
    records: dict[int, tuple[int, Turn]]
    counters: Counter[str]

    async def eot(self, layer: PlanningServices) -> int | None: ...

    async def plan(self, layer: PlanningServices, req: ParsedRequest, body: Mapping, path: str, kind: str,
                   head: Any, keys: Any, view_of: Callable[[], Awaitable[Any]] | None = None,
                   prepared_of: Callable[[], Awaitable[Any]] | None = None) -> Plan | None: ...

    def judge_of(self, layer: PlanningServices) -> SpanJudge: ...

    async def settle(self, table: SlotTable, keys: Any) -> None: ...

    def stats(self) -> dict: ...

    def forget(self) -> None: ...


class ContinuedRecord(Protocol):
    """The continued route's record (``routes.continued.ContinueRoute``): its switch, counters
    and stats."""

    on: bool
    counters: Counter[str]

    def stats(self) -> dict: ...


class PlanningServices(Protocol):
    """The layer (``ocache.cache.orchestrator.OCacheLayer``) as its rooms see it.

    ``align`` and ``continued`` are the two routes' own records (``align_route.AlignRoute``,
    ``routes.continued.ContinueRoute``): those modules import the planning core, so they are
    named here by the protocols of what other rooms read of them."""

    # -- the server and the configuration
    @property
    def config(self) -> Config | None: ...

    @property
    def upstream(self) -> UpstreamPort: ...

    @property
    def markers(self) -> Sequence[str]: ...

    @property
    def opt_warm(self) -> bool: ...

    @property
    def opt_reconcile(self) -> bool: ...

    @property
    def opt_known(self) -> bool: ...

    @property
    def ready(self) -> bool: ...

    def identity(self) -> Identity: ...

    async def ensure_ready(self) -> None: ...

    async def refresh(self, rid: str) -> bool: ...

    # -- the slot table and the token view
    @property
    def table(self) -> SlotTable | None: ...

    @property
    def ready_table(self) -> SlotTable: ...

    @property
    def viewer(self) -> TokenViewer: ...

    @property
    def current_viewer(self) -> TokenViewer | None: ...

    @property
    def template_append_only(self) -> bool: ...

    async def prepare(self, req: ParsedRequest, shape: Shape) -> Prepared | Rejected: ...

    async def prepare_request(self, req: ParsedRequest) -> Prepared | None: ...

    # -- the tiers
    @property
    def tiers(self) -> list[TierBase]: ...

    @property
    def head_tier(self) -> HeadTier | None: ...

    @property
    def ready_head(self) -> HeadTier: ...

    @property
    def disk_tier(self) -> DiskTier | None: ...

    @property
    def session_tier(self) -> SessionTier | None: ...

    @property
    def journal(self) -> FolderJournal | None: ...

    # -- rates, counters, records
    @property
    def prefill_tps(self) -> float | None: ...

    @property
    def recent_mispredictions(self) -> deque: ...

    @property
    def counters(self) -> dict[str, int]: ...

    @property
    def by_tier(self) -> dict[str, int]: ...

    @property
    def findings(self) -> list[Finding]: ...

    @property
    def alone(self) -> Tally: ...

    @property
    def align(self) -> AlignRecord: ...

    @property
    def continued(self) -> ContinuedRecord: ...

    # -- background work and the stop
    @property
    def background(self) -> Background: ...

    async def idle(self) -> None: ...

    def begin_stop(self) -> None: ...
