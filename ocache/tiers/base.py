"""The tier interface: what every cache tier (resident, disk, session) offers the planner.

A tier answers one question before a request (``lookup``: how many leading tokens of this prompt
can I put into a slot, and at what cost), does one thing when chosen (``bring``: make it
resident), and gets three callbacks around the request's life: ``admit`` after it (decide what to
keep), ``before_evict`` before a slot's conversation is replaced (the session tier spills it
there), ``evict`` when the store needs bytes. How to add a tier:
``docs/architecture.md`` §4.

The resident tier (``ocache.tiers.resident``) is the server's slots themselves: its ``bring`` is a
no-op and its ``lookup`` is the routing decision. The disk and session tiers plug into the same
planner (``ocache.cache.plan_request``) through this protocol without changes to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


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


@runtime_checkable
class Tier(Protocol):
    """A cache tier. ``ctx`` in ``lookup`` is the planner's per-request context (a
    ``ocache.cache.RequestContext``: kind, session key, fingerprint); ``obs`` in ``admit`` is the
    proxy's ``Observation``."""

    name: str

    async def lookup(self, view: Any, ctx: Any) -> Offer | None:
        """The best this tier can offer for ``view`` (a ``TokenView``), or None."""
        ...

    async def bring(self, offer: Offer, slot: int) -> None:
        """Make ``offer`` resident in ``slot`` (the caller holds the slot's lock). Raises on failure;
        the slot must then be treated as cold (a failed restore erases it, docs/llama-server.md §5)."""
        ...

    async def admit(self, view: Any, slot: int, obs: Any) -> None:
        """After a request served from ``slot``: decide what to keep (called off the client's path)."""
        ...

    async def before_evict(self, slot: int) -> None:
        """``slot``'s conversation is about to be replaced by another one (the caller holds the lock)."""
        ...

    async def evict(self, bytes_needed: int) -> int:
        """Free at least ``bytes_needed`` bytes if possible; returns bytes freed."""
        ...


class Rate:
    """An exponentially weighted mean of a rate (units/s) with an initial guess."""

    def __init__(self, guess: float, alpha: float = 0.3) -> None:
        self.value = guess
        self.n = 0
        self.alpha = alpha

    def add(self, units: float, seconds: float) -> None:
        if units <= 0 or seconds <= 0:
            return
        r = units / seconds
        self.value = r if self.n == 0 else (1 - self.alpha) * self.value + self.alpha * r
        self.n += 1
