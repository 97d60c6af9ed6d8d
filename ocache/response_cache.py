"""The response cache: the stored answer of an identical greedy request, replayed without the server
(seed §13.2: "the tokens of an identical greedy request", memory, off by default).

Config ``response_cache: {enabled, ttl_s, max_mb}`` (``ocache/config.py``, off by default).

**Which requests.** A completion (``layer.COMPLETION_ROUTES``) whose sampling is greedy
(:func:`greedy`): ``temperature`` <= 0 with the temperature sampler in the chain and no dynamic
temperature, or ``top_k`` 1 with the top-k sampler in the chain (llama-sampler.cpp:270-284: a
temperature <= 0 keeps only the largest logit; common/sampling.cpp:340-398: the chain, then ``dist``,
which then has one candidate); and nothing random before it: ``mirostat`` 0 (its samplers draw,
sampling.cpp:401-406), ``xtc_probability`` 0 (XTC removes top tokens at random, sampling.cpp:369),
no ``adaptive_p`` sampler, no ``t_max_predict_ms`` (a time limit). A field the body does not set is
the server's default, read from ``GET /props`` ``default_generation_settings.params``
(server-context.cpp:4949-4957); on ``/v1/messages`` only the fields the server's converter carries
count (``temperature``, ``top_p``, ``top_k``: server-chat.cpp:592-597), the rest is the server's
default. No props: no request is cached. The seed is not asked for: a greedy chain never draws.

**The key** (:func:`key_of`), a SHA-256 of: the requester's credentials (:func:`credentials_of`:
a SHA-256 of the request's ``Authorization`` and ``X-Api-Key`` headers, every value, in order; the
raw header values are kept nowhere), the server's identity (``fingerprint.Identity.key``:
model file, build, chat templates, state flags), its default sampling parameters (the props
above: a restart with ``--repeat-penalty 1.1`` is another key), the route, the rendered prompt
tokens (the request's token view, ``ocache/cache/prepare.py``, built once per request and shared
with the plan), and every other body field, canonical JSON (``n_probs``, grammar, tools,
``max_tokens``, stop strings, ``stream``, ``stream_options``, ``id_slot``, ``model``, ...). The
prompt fields themselves (``messages``; Anthropic ``system``; Responses ``input``,
``instructions``) are left to the tokens, unless a message has a part that is not text (an image:
its rows are placeholder tokens, the same for every image, seed §13.11), when they are keyed as
JSON too; ``/completion`` and ``/v1/completions`` key their ``prompt`` as JSON as well.

**Why the credentials.** llama-server started with ``--api-key`` answers 401 to a request whose
key it does not accept (server-http.cpp:260-305: the ``Authorization`` header, ``Bearer ``
stripped, else ``X-Api-Key``; every route but ``/health``, ``/v1/health`` and the web UI's files,
251-258). An entry is stored only from the server's 200 answer, so an entry keyed with
credentials C exists only if the server accepted C; a request with other credentials (none, a
wrong key, the right key in the other header) never matches it, nor waits on a request answering
it (coalescing goes by the key), and goes upstream for the server's own answer. ocache does not know which keys the server accepts (or
whether it checks any), so clients with different credentials never share an entry, even on a
server without ``--api-key``.

**Stored**: only a complete 200 answer (a JSON object without ``error``; a stream whose final
event arrived and with no ``error`` object), at most ``max_mb`` MiB in all (least recently used
first out), each for ``ttl_s`` seconds. Never an error, a cut stream, an answer the client left
before its final event.

**Replayed** streamed or not as the request asked (``stream`` is in the key): the stored bytes
with fresh ids and timestamps and figures that say so (``ocache/api/refresh.py``: ``cache_n`` the
whole prompt, 0 prefilled, 0 decoded; ``cached_tokens`` the prompt), headers ``X-OCache-Tier:
response``, ``X-OCache-Prefilled: 0``, ``X-OCache-Reused``: the prompt, ``X-OCache-Split: 0``.

**Coalesced**: a request whose key (credentials included) is being answered upstream waits for
that answer (at most the read timeout of its own forward) and is replayed from it; when that
answer is not stored (an error, a 401, the client gone) it goes upstream itself.

**Its cost**: a greedy request's token view is built before it is planned (the known route,
which otherwise forwards a conversation's next turn before its view, then waits for it); the plan
reuses that view (``ParsedRequest.memo``). Off by default, so nothing changes unless it is on.

Works with the cache layer (``OCacheLayer``, or the router's first ready server's): the layer's
``prepare_request`` builds the token view. Under ``no_cache`` (the NullLayer) nothing is cached.
Stats: ``GET /v1/cache/stats`` ``response_cache`` (:meth:`ResponseCache.stats`); ``POST
/v1/cache/clear?tier=response`` empties it (``tier=all`` too).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from aiohttp import web

from ocache.api.convert import ANTHROPIC_ROUTES, RESPONSES_ROUTES
from ocache.api.figures import Figures
from ocache.api.refresh import Fresh
from ocache.config import field_of
from ocache.layer import Observation, Plan
from ocache.substitute import CREDENTIAL_HEADERS, credentials_of  # noqa: F401 (re-exported)
from ocache.wire import forward_response_headers

if TYPE_CHECKING:
    from ocache.attempts import Attempt
    from ocache.ports import ProxyPorts

log = logging.getLogger("ocache.response")

#: the body fields that carry the prompt, per route: keyed by their rendered tokens
PROMPT_FIELDS: dict[str, frozenset[str]] = {
    "/v1/chat/completions": frozenset({"messages"}), "/chat/completions": frozenset({"messages"}),
    "/v1/messages": frozenset({"messages", "system"}),
    "/v1/responses": frozenset({"input", "instructions"}), "/responses": frozenset({"input", "instructions"}),
}
#: message part types that are text (anything else, e.g. an image, keys the prompt as JSON too)
TEXT_PARTS = frozenset({"text", "input_text", "output_text", "refusal", "reasoning", "thinking",
                        "redacted_thinking", "tool_use", "tool_result", "function_call",
                        "function_call_output", "message", "summary_text", "reasoning_text"})
#: the sampling fields the Anthropic converter carries (server-chat.cpp:592-597)
ANTHROPIC_SAMPLING = frozenset({"temperature", "top_p", "top_k"})
#: final events of a stream (relay.SSEObserver): chat/text ``[DONE]``, Anthropic, Responses
FINAL_MARKERS = (b"data: [DONE]", b"message_stop", b"response.completed")


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _sampler_names(v: Any) -> set[str] | None:
    """A ``samplers`` list as canonical names without ``-``/``_`` (``top-k``, ``topk`` ->
    ``topk``; ``temp`` -> ``temperature``: common/sampling.cpp:834-870); None for another form
    (a string of sampler letters is not read: treated as not greedy)."""
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        return None
    names = {x.lower().replace("-", "").replace("_", "") for x in v}
    return {"temperature" if n == "temp" else n for n in names}


def greedy(path: str, body: Mapping[str, Any], defaults: Mapping[str, Any] | None) -> bool:
    """Whether ``body`` on ``path`` samples greedily on a server whose default sampling parameters
    are ``defaults`` (``/props`` ``default_generation_settings.params``; None: unknown, False).
    See the module docstring for the rule and its sources."""
    if not isinstance(defaults, Mapping):
        return False
    carried = ANTHROPIC_SAMPLING if path in ANTHROPIC_ROUTES else None

    def eff(key: str) -> Any:
        if key in body and (carried is None or key in carried):
            return body[key]
        return defaults.get(key)

    def num(key: str) -> float | None:
        """The field as a number: 0 when neither the body nor the defaults set it, None when it
        is not a number (not read: not greedy)."""
        v = eff(key)
        return 0.0 if v is None else _num(v)

    samplers = _sampler_names(body["samplers"] if "samplers" in body and carried is None
                              else defaults.get("samplers"))
    if samplers is None or "adaptivep" in samplers:
        return False
    xtc, t_max = num("xtc_probability"), num("t_max_predict_ms") if carried is None else 0.0
    if num("mirostat") != 0 or xtc is None or xtc > 0 or t_max is None or t_max > 0:
        return False
    temp = _num(eff("temperature")) if eff("temperature") is not None else None
    dyn = num("dynatemp_range")
    if temp is not None and temp <= 0 and dyn is not None and dyn <= 0 and "temperature" in samplers:
        return True
    top_k = _num(eff("top_k")) if eff("top_k") is not None else None
    return top_k == 1 and "topk" in samplers


def _has_media(value: Any) -> bool:
    """Whether a prompt value holds a part whose ``type`` is not text (an image, audio, a file)."""
    if isinstance(value, dict):
        t = value.get("type")
        if isinstance(t, str) and t not in TEXT_PARTS:
            return True
        return any(_has_media(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_media(v) for v in value)
    return False


def key_of(identity: str, defaults: Mapping[str, Any] | None, path: str, tokens: Sequence[int],
           body: Mapping[str, Any], *, credentials: str) -> str:
    """The response cache key (hex SHA-256) of a request: see the module docstring.
    ``credentials``: :func:`credentials_of` the request's headers."""
    prompt = PROMPT_FIELDS.get(path, frozenset())
    rest = {k: v for k, v in body.items() if k not in prompt}
    if prompt and any(_has_media(body.get(k)) for k in prompt):
        rest = dict(body)   # placeholder tokens do not name an image: the prompt is keyed as JSON
    head = json.dumps([credentials, identity, dict(defaults or {}), path, rest], sort_keys=True,
                      ensure_ascii=False, separators=(",", ":"), default=str)
    h = hashlib.sha256(head.encode("utf-8", "surrogatepass"))
    h.update(b"\0tokens\0")
    h.update(array("q", tokens).tobytes())
    return h.hexdigest()


@dataclass
class Entry:
    """One stored answer: ``status`` (200), ``headers`` (the upstream's end-to-end headers, without
    length and date), ``data`` (the body, or the SSE bytes as relayed), ``sse``, ``path``,
    ``n_prompt`` (tokens of the prompt, the server's ``cache_n + prompt_n``), ``stored_at``
    (``time.monotonic()`` seconds)."""

    status: int
    headers: tuple[tuple[str, str], ...]
    data: bytes
    sse: bool
    path: str
    n_prompt: int
    stored_at: float

    @property
    def size(self) -> int:
        return len(self.data) + sum(len(k) + len(v) for k, v in self.headers) + 256


@dataclass
class Lead:
    """A request that answers its key upstream; ``done`` gets the stored :class:`Entry` (or None:
    not stored) when it is over (:meth:`ResponseCache.settle`)."""

    key: str
    n_prompt: int
    done: asyncio.Future = field(repr=False)


#: headers of the upstream's answer that are not replayed (the replay sets its own)
_DROP = frozenset({"content-length", "date", "transfer-encoding", "connection", "keep-alive"})


class ResponseCache:
    """The stored answers of one proxy and the requests answering a key now (see the module
    docstring). ``ttl_s``: seconds an entry is served; ``max_bytes``: the budget of all entries."""

    def __init__(self, ttl_s: float = 600.0, max_mb: float = 64.0) -> None:
        self.ttl_s = float(ttl_s)
        self.max_bytes = int(float(max_mb) * (1 << 20))
        self.entries: OrderedDict[str, Entry] = OrderedDict()
        self.bytes = 0
        self.leads: dict[str, Lead] = {}
        #: set each time a request starts waiting for another's answer (tests wait on it)
        self.followed = asyncio.Event()
        self.counters: dict[str, int] = dict.fromkeys(
            ("hits", "misses", "stored", "coalesced", "not_greedy", "not_keyed", "not_stored",
             "too_big", "expired", "evicted", "cleared"), 0)

    @classmethod
    def from_config(cls, config: Any) -> ResponseCache | None:
        """The cache the config asks for (``response_cache.enabled``), else None."""
        rc = field_of(config, "response_cache") or {}
        if not isinstance(rc, Mapping) or not rc.get("enabled"):
            return None
        return cls(ttl_s=rc.get("ttl_s", 600.0), max_mb=rc.get("max_mb", 64.0))

    # --- the store ------------------------------------------------------------------------------
    def get(self, key: str) -> Entry | None:
        """The live entry of ``key`` (an expired one is dropped), made most recently used."""
        e = self.entries.get(key)
        if e is None:
            return None
        if time.monotonic() - e.stored_at > self.ttl_s:
            self._drop(key)
            self.counters["expired"] += 1
            return None
        self.entries.move_to_end(key)
        return e

    def put(self, key: str, entry: Entry) -> bool:
        """Store ``entry`` (False when it alone is over the budget); the least recently used go."""
        if entry.size > self.max_bytes:
            self.counters["too_big"] += 1
            return False
        if key in self.entries:
            self._drop(key)
        self.entries[key] = entry
        self.bytes += entry.size
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self.entries)))
            self.counters["evicted"] += 1
        self.counters["stored"] += 1
        return True

    def _drop(self, key: str) -> None:
        e = self.entries.pop(key)
        self.bytes -= e.size

    def clear(self) -> dict[str, Any]:
        """Forget every entry; ``{"tier": "response", "cleared": N}``."""
        n = len(self.entries)
        self.entries.clear()
        self.bytes = 0
        self.counters["cleared"] += n
        return {"tier": "response", "cleared": n}

    def stats(self) -> dict[str, Any]:
        """``GET /v1/cache/stats`` ``response_cache``: entries, bytes, budget, the counters."""
        return {"entries": len(self.entries), "bytes": self.bytes, "max_bytes": self.max_bytes,
                "ttl_s": self.ttl_s, "answering": len(self.leads), **self.counters}

    # --- the request path -------------------------------------------------------------------------
    async def serve(self, proxy: ProxyPorts, att: Attempt) -> web.StreamResponse | Lead | None:
        """Before a completion is planned: the replayed answer (a hit, or the answer of an identical
        request in flight), a :class:`Lead` (this request answers its key: ``att.keep`` records its
        answer; :meth:`settle` it when it is over), or None (not cached: not greedy, no key)."""
        preq = att.preq
        body = preq.body if preq is not None else None
        if preq is None or body is None or proxy.upstream.state != "ready":
            return None
        props = proxy.upstream.props or {}
        gen = props.get("default_generation_settings") if isinstance(props, Mapping) else None
        defaults = gen.get("params") if isinstance(gen, Mapping) else None
        if not greedy(preq.path, body, defaults):
            self.counters["not_greedy"] += 1
            return None
        prep = await _prepared(proxy.layer, preq)
        if prep is None:
            self.counters["not_keyed"] += 1
            return None
        key = key_of(prep.identity, defaults, preq.path, prep.tokens, body,
                     credentials=credentials_of(att.request.headers))
        wait_s = att.timeout.sock_read or proxy.config.upstream_read_timeout_s
        while True:
            entry = self.get(key)
            if entry is not None:
                self.counters["hits"] += 1
                return await self.replay(proxy, att, entry)
            lead = self.leads.get(key)
            if lead is None:
                break
            self.counters["coalesced"] += 1
            self.followed.set()
            done, _ = await asyncio.wait({lead.done}, timeout=wait_s)
            if not done or lead.done.result() is None:
                return None       # the other answer was not stored (or too slow): go upstream
        self.counters["misses"] += 1
        lead = Lead(key, len(prep.tokens), asyncio.get_running_loop().create_future())
        self.leads[key] = lead
        att.keep = bytearray()
        return lead

    def settle(self, lead: Lead, att: Attempt) -> None:
        """The leading request is over: store its answer if it is a complete 200 (the module
        docstring), and hand it (or None) to the requests waiting for it. Never raises."""
        entry = None
        try:
            entry = self._entry(lead, att)
            if entry is not None and not self.put(lead.key, entry):
                entry = None
            elif entry is None:
                self.counters["not_stored"] += 1
        except Exception:  # noqa: BLE001 - the client's answer is sent already
            log.exception("[%s] response cache: storing the answer failed", att.rid)
            entry = None
        finally:
            att.keep = None
            if self.leads.get(lead.key) is lead:
                del self.leads[lead.key]
            if not lead.done.done():
                lead.done.set_result(entry)

    def _entry(self, lead: Lead, att: Attempt) -> Entry | None:
        obs, up, data = att.obs, att.up_resp, att.keep
        if obs.status != 200 or not obs.completed or up is None or data is None or not data:
            return None
        if att.plan is not None and att.plan.substitutes:
            # the answer to a prompt other than the rendering the key names (the requester's own
            # slot tokens spliced in): another session sending the same body would be answered
            # from this owner's conversation (a second engineer's attack: replayed to another
            # session key, and to a client without one)
            return None
        ctype = up.headers.get("Content-Type", "")
        sse = ctype.startswith("text/event-stream")
        if not _complete(bytes(data), sse):
            return None
        headers = tuple((k, v) for k, v in forward_response_headers(up.headers).items()
                        if k.lower() not in _DROP and not k.lower().startswith("x-ocache-"))
        t = obs.timings or {}
        n_prompt = int(t.get("cache_n") or 0) + int(t.get("prompt_n") or 0) if obs.timings else lead.n_prompt
        return Entry(200, headers, bytes(data), sse, att.path, n_prompt or lead.n_prompt, time.monotonic())

    async def replay(self, proxy: ProxyPorts, att: Attempt, entry: Entry) -> web.StreamResponse:
        """Send ``entry`` to the client as this request's answer (fresh ids, timestamps, figures)
        and do the request's bookkeeping (stats, log line, record) as for a relayed one."""
        fresh = Fresh(entry.n_prompt, anthropic=att.path in ANTHROPIC_ROUTES)
        data = fresh.stream(entry.data) if entry.sse else fresh.body(entry.data)
        plan = Plan(headers={"X-OCache-Request-Id": att.rid},
                    figures=Figures(tier="response", split=0, prefilled=0, reused=entry.n_prompt,
                                    predicted_cache=entry.n_prompt))
        obs = att.obs
        obs.status = entry.status
        resp = web.StreamResponse(status=entry.status, headers=dict(entry.headers))
        resp.headers.update(plan.headers)
        if entry.sse:
            resp.headers["X-Accel-Buffering"] = "no"
        else:
            resp.content_length = len(data)
        try:
            await resp.prepare(att.request)
            await resp.write(data)
            obs.ttft_s = time.perf_counter() - att.t0
            await resp.write_eof()
            obs.completed = True
        finally:
            obs.total_s = time.perf_counter() - att.t0
            obs.timings = fresh.timings({"cache_n": 0, "prompt_n": 0, "predicted_n": 0,
                                         **(_timings_of(entry) or {})})
            _book(proxy, att, plan, obs)
        return resp


def _book(proxy: ProxyPorts, att: Attempt, plan: Plan, obs: Observation) -> None:
    """A replay's stats, ``last_completions`` record and log line (``ocache/finish.py`` for a
    relayed answer; no plan to release, nothing for the layer to observe)."""
    from ocache.finish import request_line

    preq = att.preq
    assert preq is not None
    proxy.stats.request(att.path, obs.status)
    record = proxy.finisher.record(preq, plan, obs, obs.timings, 0)
    if obs.completed:
        proxy.stats.completion(att.path, "response", obs.timings, obs.ttft_s, record)
    log.info("[%s] %s", att.rid, request_line(record, preq.method, not obs.completed))
    recorder = proxy.recorder
    if recorder is not None:
        proxy.spawn(asyncio.to_thread(recorder.record, preq, plan, obs), "record")


def _timings_of(entry: Entry) -> dict | None:
    """The stored answer's ``timings`` (a non-streamed body's, or the stream's last), if any."""
    lines = [entry.data] if not entry.sse else [
        ln[5:].strip() for ln in entry.data.split(b"\n") if ln.startswith(b"data:") and b'"timings"' in ln]
    for raw in reversed(lines):
        try:
            obj = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):
            continue
        if isinstance(obj, dict) and isinstance(obj.get("timings"), dict):
            return obj["timings"]
    return None


def _complete(data: bytes, sse: bool) -> bool:
    """Whether a recorded answer is a whole success: a JSON object without ``error``; a stream
    with its final event (``FINAL_MARKERS``) and no ``data:`` object carrying ``error``."""
    if not sse:
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return False
        return isinstance(obj, dict) and "error" not in obj
    if not any(m in data for m in FINAL_MARKERS):
        return False
    for line in data.split(b"\n"):
        if line.startswith(b"data:") and b'"error"' in line:
            try:
                obj = json.loads(line[5:])
            except (ValueError, UnicodeDecodeError, RecursionError):
                continue
            if isinstance(obj, dict) and ("error" in obj or obj.get("type") == "error"):
                return False
    return True


async def _prepared(layer: Any, preq: Any) -> Any:
    """The request's ``Prepared`` (token view and identity) from the cache layer: its own
    ``prepare_request``, or the router's first ready server's; None when there is no view (the
    NullLayer, a refused or rejected body, the server unreachable)."""
    target = layer
    if getattr(layer, "prepare_request", None) is None:
        ready = getattr(layer, "ready_servers", None)
        servers = ready() if ready is not None else []
        target = servers[0].layer if servers else None
    prepare = getattr(target, "prepare_request", None)
    if prepare is None:
        return None
    try:
        return await prepare(preq)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - not cached; the request goes its usual way
        log.debug("[%s] response cache: no token view (%s: %s)", preq.request_id,
                  type(exc).__name__, exc)
        return None


__all__ = ["Entry", "Lead", "ResponseCache", "credentials_of", "greedy", "key_of", "RESPONSES_ROUTES"]
