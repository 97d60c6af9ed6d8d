"""The tier interface: what every cache tier (resident, disk, session) offers the planner.

A tier answers one question before a request (``lookup``: how many leading tokens of this prompt
can I put into a slot, and at what cost), does one thing when chosen (``bring``: make it
resident), and gets callbacks around the request's life: ``admit`` after it (decide what to keep),
``before_evict`` before a slot's conversation is replaced (the session tier spills it there), and
the declared optional hooks of :class:`TierBase` (drain, restart, flush, clear, stats). How to add
a tier: ``docs/architecture.md`` §4.

The resident tier is the server's slots themselves: no ``Tier`` object, the planner ranks the
slots directly (``ocache.tiers.resident.rank_slots``, the protection rule there). The head, disk and
session tiers plug into the same planner (``ocache.cache.plan.plan_request``) through this
interface without changes to it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ocache.rate import Rate  # noqa: F401 (re-exported: the tiers' measured rates)

log = logging.getLogger("ocache.tiers")


@dataclass
class Offer:
    """One tier's answer to "how much of this prompt can you provide?".

    ``tier``: the tier's name (``resident``, ``disk``, ``session``). ``tokens_usable``: how many
    leading tokens of the request's prompt the server will reuse after ``bring`` (a *usable*
    prefix: for hybrid models already rounded down to a context checkpoint, so it is directly
    comparable with the server's ``cache_n``). ``cost_s``: estimated seconds ``bring`` takes
    (0 for resident). ``ref``: opaque to the planner, handed back to the same tier's ``bring``.
    ``slot``: the slot the offer is tied to (resident: the slot holding the prefix), or None when
    the tier can bring it into any slot (disk, session). ``verified``: ``bring`` checks the file
    against the store's record (size, xxh3, token header, identity) before any byte reaches the
    engine; on a tie in ``tokens_usable`` the planner prefers a verified offer, then the cheaper one.
    """

    tier: str
    tokens_usable: int
    cost_s: float = 0.0
    ref: Any = None
    slot: int | None = None
    verified: bool = False


@dataclass(frozen=True)
class RequestContext:
    """What the planner and the tiers know about a request besides its tokens (built once per
    request by the cache layer; every field a tier reads is here).

    ``kind``: ``agent`` | ``guest`` | ``other`` (``ocache.fingerprint.classify``). ``session``: the
    client's session key (opencode ``x-session-affinity``) or None. ``head_key``/``head_len``: the
    harness fingerprint and the head length in tokens, if the request has a known head. ``task``:
    the request's id in the checkpoint model. ``user_starts``: token positions of user-message
    starts *as the server will see them* (empty on raw routes without ``message_delimiters``).
    """

    kind: str = "other"
    session: str | None = None
    head_key: str | None = None
    head_len: int = 0
    task: int = -1
    user_starts: tuple[int, ...] = ()
    #: what the request is about, for the store's entries and the dashboard: ``folder`` (the
    #: project folder named in the system prompt, agent requests only), ``client``
    #: (``fingerprint.client_of``), ``model`` (the body's ``model`` alias); values may be None
    labels: tuple[tuple[str, str | None], ...] = ()


class TierError(RuntimeError):
    """A tier's ``bring`` failed; the request goes cold. ``reason``: a word the tier's error type
    documents (``ocache.tiers.restore``: ``gone``, a store check word, ``restore``, ``upstream``;
    the remote tier adds its download's). Each tier subclasses it with its ``tier`` name, the
    message's prefix."""

    tier = "cache"

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{self.tier} tier: {reason}{': ' + detail if detail else ''}")
        self.reason = reason


class TierBase:
    """A cache tier (the head, disk and session tiers subclass it; ``docs/architecture.md`` §4).

    Required: ``name`` (the value of ``X-OCache-Tier`` when the request's prefix came from it),
    :meth:`lookup` and :meth:`bring`. Every other hook has a default that does nothing, so the cache
    layer calls each hook on every tier (no ``hasattr``). The slot table is the only writer of slot
    state: a tier changes a slot only through the table's slot calls (``save``/``restore``/``warm``)
    and verbs (``ocache/slots.py``).
    """

    name: str = ""

    async def lookup(self, view: Any, ctx: RequestContext) -> Offer | None:
        """The best this tier can offer for ``view`` (a ``TokenView``), or None. Called once per
        request, before the slot is chosen; must not change what the tier holds."""
        return None

    async def bring(self, offer: Offer, slot: int) -> None:
        """Make ``offer`` (this tier's own, from :meth:`lookup`) resident in ``slot`` (the caller
        holds the slot's lease). Raises on failure; the slot then holds what the failed restore
        left (``SlotTable.restore`` asks the server) and the request is served from that."""
        raise NotImplementedError(f"tier {self.name!r} offers nothing to bring")

    async def admit(self, view: Any, slot: int, obs: Any) -> None:
        """After a request served from ``slot`` (``obs``: the proxy's ``Observation``): decide what
        to keep (called off the client's path)."""
        return None

    async def interrupted(self, view: Any, slot: int, obs: Any) -> None:
        """After a request on ``slot`` that started (status 200) but was cut short (client gone
        mid-stream, upstream error mid-response): ``SlotTable.interrupted`` has marked the slot (the
        prompt ``view.tokens`` plus the tokens generated so far, counted by the next ``GET
        /slots``). Called off the client's path."""
        return None

    def will_spill(self, slot: int) -> bool:
        """Whether :meth:`before_evict` would save ``slot``'s conversation if it were evicted now
        (the planner then counts an overwrite of it as free). Pure."""
        return False

    async def before_evict(self, slot: int) -> None:
        """``slot``'s conversation is about to be replaced by another one (the caller holds the lease)."""
        return None

    async def on_drain(self, table: Any) -> dict | None:
        """Planned stop (in-flight requests finished): by default :meth:`before_evict` on every slot
        holding a live conversation (``agent``/``other``), under its lock. Returns what the tier
        did (a tier's own summary dict) or None."""
        for st in list(table.slots):
            if st.tokens and st.kind in ("agent", "other"):
                async with table.lock(st.id):
                    try:
                        await self.before_evict(st.id)
                    except Exception:  # noqa: BLE001 - a drain goes on
                        log.exception("tier %s before_evict(slot %d) on drain failed", self.name, st.id)
        return None

    async def on_upstream_restart(self) -> None:
        """A new llama-server process: forget per-slot beliefs about the old one."""
        return None

    async def flush(self) -> None:
        """Wait for background work (commits)."""
        return None

    def pending_commits(self) -> list:
        """The background commits running now (``asyncio.Task``s; awaiting them waits for what was
        saved so far, not for later saves as :meth:`flush` does)."""
        return []

    async def clear(self) -> dict:
        """Delete what this tier keeps (``POST /v1/cache/clear?tier=<name>``). Returns
        ``{"deleted": n}``."""
        return {"deleted": 0}

    def stats(self) -> dict:
        """This tier's figures (``tier_<name>`` in ``/v1/cache/stats``)."""
        return {}
