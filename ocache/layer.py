"""What the proxy asks of the cache layer: the request it parsed, the plan it gets back, the
observation it reports after the response.

The proxy (``ocache/proxy.py``) is thin: it parses a request, asks ``CacheLayer.plan`` what to
change (only ``body_updates`` to the JSON body, e.g. ``{"id_slot": 1}``), forwards, relays the
response as it arrives, and hands an ``Observation`` to ``CacheLayer.observe`` off the client's
path. Everything the cache does (slots, anchors, spill) lives behind this protocol; ``NullLayer``
is the empty cache (forward as is).

Contract (the proxy's side):

* ``plan`` is called only for completion routes (``COMPLETION_ROUTES``) whose body parsed as a JSON
  object. Any exception from it is logged with the request id and the request is forwarded
  untouched (fail-open); ``release`` of a plan that failed is never called because there is none.
* ``plan`` may be cancelled (``asyncio.CancelledError``) when the client disconnects while it runs
  (the proxy cancels the handler at once): it must leave its state consistent (locks released).
* ``release`` (if set) is called exactly once when the response is over: success, upstream error,
  client disconnect or proxy error. It runs before ``observe``, in a background task. The proxy
  calls it only through the plan's ``Receipt`` (``ReceiptLedger.take``): spent once, a second
  spend is a counted, logged no-op, never a second call into the layer.
* ``observe`` runs in a background task after the response was relayed; it must not raise (an
  exception is logged and counted, nothing else).
* ``on_upstream_restart`` is called when ``Upstream`` sees a new llama-server process (a new
  epoch): slots are empty, every resident assumption is void.
* ``drain`` is called on a planned stop, after in-flight requests finished and before the
  upstream child (if launched) is stopped.
* Optional, looked up with ``getattr`` (``NullLayer`` has no-op ones): ``begin_stop()`` when a
  planned stop begins (start no more background work against the server), ``quiesce(timeout_s)
  -> int`` last, before the proxy closes its connections and the child gets SIGTERM (wait, bounded,
  for background work and slot calls in flight; returns those still in flight) and
  ``calls_inflight() -> int``.

Plan header conventions the proxy understands (all optional, set by the layer in ``Plan.headers``
and sent to the client as is): ``X-OCache-Tier`` (where the reused prefix came from: ``resident``,
``head``, ``disk``, ``session``, ``cold`` or ``none``) becomes the ``tier`` label of the proxy's
per-tier counters;
``X-OCache-Slot`` is informational (the slot used is read from ``body_updates["id_slot"]``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Mapping, Protocol, runtime_checkable

from ocache.api.figures import Figures   # a value, pure (no I/O, no other ocache module)

if TYPE_CHECKING:  # the contract imports no other runtime module
    from ocache.upstream import UpstreamPort

log = logging.getLogger("ocache.layer")

#: POST routes that run a completion on llama-server (OpenAI chat/text, the native route, and the
#: Anthropic Messages / OpenAI Responses routes the server converts to chat: ocache/api/convert.py).
#: Their token-counting siblings (``/v1/messages/count_tokens``, ``/v1/responses/input_tokens``)
#: are not here: forwarded as they are, they never take or evict a slot.
COMPLETION_ROUTES = frozenset({
    "/v1/chat/completions",
    "/chat/completions",
    "/v1/completions",
    "/completions",
    "/completion",
    "/v1/messages",
    "/v1/responses",
    "/responses",
})


@dataclass
class ParsedRequest:
    """A client request as the cache layer sees it.

    ``body`` is the parsed JSON object (None when the body is not a JSON object: such a request is
    forwarded byte for byte and never planned). ``session_hint`` is the client's
    ``x-session-affinity`` or ``x-session-id`` header (opencode sends both), if any.
    """

    request_id: str
    method: str
    path: str
    body: dict | None
    headers: Mapping[str, str]
    session_hint: str | None
    stream: bool
    #: values the cache layer computes once per request and reuses (``message_keys`` of its chat
    #: body: the router and the chosen server's layer both read them)
    memo: dict = field(default_factory=dict)


@dataclass
class Plan:
    """What the cache layer wants done to one request.

    ``body_updates``: top-level fields to set in the forwarded JSON body (e.g. ``{"id_slot": 1}``);
    an empty dict forwards the client's bytes unchanged. ``headers``: ``X-OCache-*`` response
    headers describing what the layer did. ``context``: opaque, handed back in ``observe``.
    ``release``: awaited once when the response is over (e.g. frees a per-slot lock), through the
    plan's ``Receipt`` (``ReceiptLedger.take``; a wrapper set later, as the router's, is the one
    called).
    ``split_tokens``/``split_ms``: tokens (and their prefill milliseconds) the layer prefilled
    itself for this request before forwarding it (head warm-up, anchor split); when > 0 the proxy
    corrects the reuse figures of the response, its log line and its stats (ocache/api/figures.py).
    ``upstream``: the base URL of the server to forward to when several serve behind one ocache
    (``ocache/router.py`` sets it); None: the proxy's one (first healthy) upstream.
    ``completion``: a task that finishes the plan while the forwarded request runs (a known
    conversation's next turn: ``ocache.cache.routes.known.complete``); it fills ``headers`` and ``context``.
    The answer does not wait for it (``proxy.FIGURES_WAIT_S``, 0): its figures go into the response
    headers only if it is done when the server's answer begins; the log line, the stats record,
    ``observe`` and ``release`` wait for it (``ocache.finish.PLAN_COMPLETION_WAIT_S``).
    ``upstream_headers``: request headers added to the forwarded request (``X-Llama-Server-If-Boot``:
    the process the plan was made for, patches/0007); a server that is another process answers 412
    before any work, and the proxy releases the plan and plans the request again
    (``Attempts._stale``, ocache/attempts.py).
    """

    body_updates: dict = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    context: Any = None
    release: Callable[[], Awaitable[None]] | None = None
    split_tokens: int = 0
    split_ms: float = 0.0
    upstream: str | None = None
    completion: Any = None
    upstream_headers: dict[str, str] = field(default_factory=dict)
    #: what the plan tells of the request (``ocache.api.figures.Figures``), written once: given
    #: here or by :meth:`set_figures`, which sends them as ``headers``; read with :meth:`read_figures`
    figures: Figures | None = None
    #: the plan's one release receipt, once taken (``ReceiptLedger.take``)
    _receipt: Receipt | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.figures is not None:
            self.headers.update(self.figures.headers())

    @property
    def substitutes(self) -> bool:
        """Whether the server is served a prompt other than the client's own rendering (patch
        0008's ``ocache_splice``: the aligned and continued routes, ``ocache/substitute.py``)."""
        return "ocache_splice" in self.body_updates

    def set_figures(self, figures: Figures) -> None:
        """The plan's figures, now known (a known turn's completion): kept, and added to
        ``headers`` (the ones sent when the answer begins)."""
        self.figures = figures
        self.headers.update(figures.headers())

    def read_figures(self) -> Figures:
        """The plan's figures (every route writes them as a value; a plan without any: none known).
        Header strings are never parsed back."""
        return self.figures if self.figures is not None else Figures()


class Receipt:
    """The right to release one plan, spent exactly once (the layer's contract: ``release`` is
    called exactly once; SGLang's ``inc_lock_ref`` hands out the receipt ``dec_lock_ref`` spends).

    ``spend()`` marks the receipt spent *before* it awaits ``plan.release`` (read at that moment,
    so a wrapper the router set after the inner layer made the plan is the one called): a release
    cancelled or failing part way is still spent, and every later spend returns False at once,
    counted in the ledger's ``repeats`` and logged at WARNING, with no call into the layer (a
    second release of a known turn would mark its slot unknown without holding its lease)."""

    __slots__ = ("plan", "spent", "_ledger")

    def __init__(self, plan: Plan, ledger: ReceiptLedger) -> None:
        self.plan = plan
        self.spent = False
        self._ledger = ledger

    async def spend(self, rid: str = "") -> bool:
        """Release the plan: True the first time (after ``plan.release``, if set, returned;
        raises what it raises), False for every later spend (a no-op)."""
        if self.spent:
            self._ledger.repeats += 1
            log.warning("[%s] a plan released again: the receipt was spent already (no second "
                        "release; %d so far)", rid, self._ledger.repeats)
            return False
        self.spent = True
        self._ledger.held -= 1
        release = self.plan.release
        if release is not None:
            await release()
        return True


class ReceiptLedger:
    """The receipts of the plans the proxy holds. ``held``: plans taken and not released yet (0
    when no request is in flight and every release ran); ``repeats``: spends of a spent receipt
    (each a no-op; any is a proxy bug)."""

    def __init__(self) -> None:
        self.held = 0
        self.repeats = 0

    def take(self, plan: Plan) -> Receipt:
        """The receipt of ``plan``: made (and counted held) the first time, the same one after."""
        if plan._receipt is None:
            plan._receipt = Receipt(plan, self)
            self.held += 1
        return plan._receipt

    def to_dict(self) -> dict[str, int]:
        return {"held": self.held, "repeated_releases": self.repeats}


@dataclass
class Observation:
    """What happened upstream for one completion.

    ``timings``: llama-server's ``timings`` object (``prompt_n``, ``cache_n``, ``prompt_ms``,
    ``predicted_n``, ... in tokens and milliseconds; top-level in a non-streamed response, on the
    last SSE chunk that carries it in a stream; docs/llama-server.md §12). ``ttft_s``: seconds
    from request receipt to the first response byte relayed to the client. ``total_s``: seconds
    from receipt to the end of the response. ``completed``: the whole response was relayed (False
    when the client disconnected or the upstream failed mid-response). ``content``: the assistant
    text of a non-streamed response (None for streams).
    """

    status: int
    completed: bool
    timings: dict | None = None
    usage: dict | None = None
    ttft_s: float | None = None
    total_s: float = 0.0
    content: str | None = None
    #: [align] the assistant message and finish reason of a chat answer: a non-streamed one's, or a
    #: stream's collected from its deltas when the layer's ``wants_message`` is true (None otherwise)
    message: dict | None = None
    finish_reason: str | None = None


@runtime_checkable
class CacheLayer(Protocol):
    """The cache behind the proxy (see the module docstring for the call contract)."""

    async def plan(self, req: ParsedRequest) -> Plan: ...

    async def observe(self, req: ParsedRequest, plan: Plan, obs: Observation) -> None: ...

    async def on_upstream_restart(self) -> None: ...

    async def drain(self) -> None: ...

    def stats(self) -> dict: ...

    async def clear(self, tier: str) -> dict: ...


class NullLayer:
    """The empty cache: every request is forwarded as is, nothing is kept."""

    def __init__(self, upstream: UpstreamPort | None = None, config: Any = None) -> None:
        self.upstream = upstream
        self.config = config

    async def plan(self, req: ParsedRequest) -> Plan:
        return Plan()

    async def observe(self, req: ParsedRequest, plan: Plan, obs: Observation) -> None:
        return None

    async def on_upstream_restart(self) -> None:
        return None

    async def drain(self) -> None:
        return None

    def begin_stop(self) -> None:
        return None

    async def quiesce(self, timeout_s: float) -> int:
        return 0

    def calls_inflight(self) -> int:
        return 0

    def stats(self) -> dict:
        return {"layer": "null"}

    async def clear(self, tier: str) -> dict:
        return {"tier": tier, "cleared": 0}
