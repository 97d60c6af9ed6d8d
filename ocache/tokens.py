"""The token view: exactly the token ids llama-server will prefill for a request.

The cache layer reasons in tokens, not JSON. For chat routes the prompt is rendered by the
server's own template (``POST /apply-template``, which runs the same ``oaicompat_chat_params_parse``
as the chat route: tools/server/server-context.cpp:5041-5051, server-common.cpp:1224-1450) and
tokenized as the completion handler does (``POST /tokenize`` with ``add_special: true,
parse_special: true``: the handler calls ``tokenize_input_prompts(..., add_special=true,
parse_special=true)``, server-context.cpp:4280; ``/tokenize`` runs the same ``tokenize_mixed``,
server-common.cpp:867-901). For ``/completion``-style routes the ``prompt`` is tokenized directly
(string or mixed string/token array) or taken as is (token array). The Anthropic Messages and
OpenAI Responses routes (``/v1/messages``, ``/v1/responses``) are first converted to the chat form
exactly as the server converts them (``ocache.api.convert``), then rendered like a chat request; the
token count equals the server's own ``/v1/messages/count_tokens`` and ``/v1/responses/input_tokens``
(tests/test_convert.py).

Costs are kept off the hot path by two LRU caches bounded by bytes (``TextCache``, ``TokenCache``:
8 + 8 MiB by default, several 128k-token conversations' latest turns; so ocache's memory stays flat
however long a conversation grows, where entry counts let it grow by every turn's full text and
token list):

* body -> rendered text, keyed by a chained xxh3_128 of the render-relevant fields
  (``RENDER_FIELDS``) and each message; a body that extends a rendered conversation is rendered
  as a *delta* (only its new messages go to ``/apply-template``; ``TokenViewer.render``), checked
  against full renders in the background;
* rendered text -> tokens, keyed by xxh3_128 of the text, plus an index of the text's prefixes
  that end right before a special *boundary* token (``<|im_start|>`` for ChatML). llama.cpp splits
  the text on special tokens before BPE (``tokenizer_st_partition`` in src/llama-vocab.cpp), so
  ``tokens(A + B) == tokens(A) + tokens(B, add_special=False)`` whenever ``B`` starts with a special
  token. A growing conversation therefore only tokenizes the part after the longest cached prefix
  (the new turns), not the 7k-token harness head every time. ``tests/test_tokens.py`` checks the
  equality against a full ``/tokenize``. The scheme is switched off by itself when a probe shows
  the vocab breaks the rule (a boundary that is not one special token, or an appended EOS).

``head_end`` is where the stable harness head (``ocache.fingerprint.Head``) ends in tokens: the
request is rendered a second time with its system message cut at the volatile marker, the two
texts are compared, and the common part is backed off to a *hard boundary* (right after a newline
that is followed by a non-space character: no pre-tokenizer rule of the Qwen/Llama-3 BPE family
joins a newline with a following non-space character, so no token can straddle it). The head's
tokens are then checked to be a prefix of the request's tokens; if not, ``head_end`` is None. The
result is cached per head key, so the second render happens once per harness head.

Cost (``python -m ocache.tokens bench --url http://127.0.0.1:PORT [bodies...]``; tiny dense model,
``-t 1``, 2-core machine under load, opencode run4 turn2 + follow-up, ~7.4k tokens each), seconds per
10k prompt tokens: ``/apply-template`` 0.03-0.035, full ``/tokenize`` 0.04-0.05; a cold view 0.16-0.17
(two renders and two tokenizations: the head is computed once per harness head); a follow-up turn
through the cache 0.034 (the render dominates; only the new turns are tokenized); an identical
body 0.001. A prefill of 10k tokens takes tens of seconds on this machine, so the view costs <1%.
Those figures predate delta renders, which make a follow-up turn's render proportional to its new
messages; the whole request path at 8k-126k tokens is measured by ``scripts/bench-long``.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import logging
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import xxhash

from ocache.api.convert import CONVERTED_ROUTES, ConversionError, to_chat
from ocache.fingerprint import Head, cut_body
from ocache.media import MARKER as MEDIA_MARKER, has_media_parts
from ocache.upstream import UpstreamPort

log = logging.getLogger("ocache.tokens")

#: Seconds a token view may wait beyond the prefill it could save (``ViewCalls.bound_s``; config
#: ``view_slack_s`` overrides it): a view call that gets no answer costs a short prompt ~5 s before
#: it goes as sent, while a loaded machine's slow view of a long prompt still has the prompt's own
#: prefill time. The test suite widens it (tests/conftest.py): no test depends on how fast a loaded
#: machine answers.
VIEW_SLACK_S = 5.0
#: Request-body bytes per prompt token, as ``ViewCalls.bound_s`` estimates a prompt before its
#: view: BPE text runs 3-4 bytes per token and JSON adds its escapes and field names, so 2 errs on
#: the side of more tokens (a longer bound).
BYTES_PER_TOKEN = 2.0
#: Prefill rate (tokens/s) a view's bound prices the prompt at before the server's rate was
#: measured: a slow GPU's (the remote tier's ``UNMEASURED_PREFILL_TPS``), so an unmeasured bound
#: errs long.
UNMEASURED_PREFILL_TPS = 1000.0

#: The stand-in first message of a delta render (see ``TokenViewer.render``).
_STUB = {"role": "user", "content": "x"}
#: Fields dropped from a delta render's body: the tools block renders at the start of the prompt
#: (it is part of the cached prefix) and tool_choice without tools is refused by the server.
_DELTA_DROP = ("tools", "tool_choice", "parallel_tool_calls")

#: Body fields that oaicompat_chat_params_parse reads to render the prompt (server-common.cpp:1224-1450).
#: Only these are sent to /apply-template and hashed for the render cache.
RENDER_FIELDS: tuple[str, ...] = (
    "messages", "tools", "tool_choice", "json_schema", "grammar", "response_format",
    "parallel_tool_calls", "add_generation_prompt", "continue_final_message", "reasoning_format",
    "chat_template_kwargs", "reasoning_effort",
)

CHAT_ROUTES = frozenset({"/v1/chat/completions", "/chat/completions"})
PROMPT_ROUTES = frozenset({"/v1/completions", "/completions", "/completion"})


class TokenViewError(RuntimeError):
    """The upstream could not render or tokenize the request (``status`` = its HTTP status, or 0
    when it was unreachable). The proxy forwards the request untouched (fail open)."""

    def __init__(self, message: str, status: int = 0, timed_out: bool = False):
        super().__init__(message)
        self.status = status
        #: the server gave no answer within the call's or the view's bound
        self.timed_out = timed_out


@dataclass
class TokenView:
    """What llama-server will prefill for one request.

    ``tokens``: the token ids (rendered by the server's template, tokenized with add_special=True,
    parse_special=True). ``head_end``: ``tokens[:head_end]`` is the stable harness head (tools +
    system head + template glue), None without a head. ``user_starts``: token index of every
    ``<|im_start|>user`` (each user or tool-result turn). ``text``: the rendered prompt ("" for a
    token-id prompt).
    """

    tokens: list[int]
    head_end: int | None
    user_starts: list[int]
    text: str
    stats: dict = field(default_factory=dict)  # how the view was built: render_hit, tokenized, ...
    #: the request's message key (``message_keys``: the chained digest over its render fields and
    #: every message) and its message count; None / 0 for a prompt route. The slot table records
    #: them with the slot's content, so the next turn of the conversation is recognised before its
    #: view is built (``ocache.tiers.resident.known_conversation_slot``).
    msg_key: bytes | None = None
    n_msgs: int = 0
    #: the ``TokenViewer`` that built it (several servers of one identity share a view:
    #: ``ocache/cache/prepare.py``); its ``distrust`` is called when a response shows the view wrong
    source: Any = field(default=None, repr=False, compare=False)


def _xxh128(data: bytes) -> bytes:
    return xxhash.xxh3_128_digest(data)


def _key_bytes(obj: Any) -> bytes:
    """Compact JSON of ``obj``, what the message keys hash (keys live in memory only: one encoder
    per process is all they need). orjson: 0.10 ms for the 31 messages of a 569 KB Claude Code
    capture grown with this repository's source, where the standard encoder's fastest path took
    1.69 ms (best of 20, this machine). What orjson refuses (a lone surrogate, an integer past 64
    bits, a non-string key) is encoded by the standard encoder behind a NUL byte, which no orjson
    output starts with."""
    try:
        return orjson.dumps(obj)
    except TypeError:   # orjson.JSONEncodeError is a TypeError
        return b"\x00" + json.dumps(obj, separators=(",", ":")).encode("ascii")


#: ``message_keys(body)``: (render payload, one chained digest per message, render cache key)
MessageKeys = tuple[dict, list[bytes], bytes]


def message_keys(body: Mapping) -> MessageKeys:
    """``(payload, digests, key)`` of a chat body: ``payload`` = its render fields
    (``RENDER_FIELDS``), ``digests[k]`` = xxh3_128 chained over the fields other than the messages
    and ``messages[:k + 1]`` (each message as compact JSON), ``key`` = the render cache key (the last
    digest; without messages, the hash of the payload). Two bodies share ``digests[k]`` exactly
    when their render fields and first ``k + 1`` messages are equal. Cost: one ``json.dumps`` of each
    message and one pass of xxh3 (``_key_bytes``)."""
    payload = {k: body[k] for k in RENDER_FIELDS if k in body}
    msgs = payload.get("messages")
    digests: list[bytes] = []
    if isinstance(msgs, list) and msgs:
        meta = {k: v for k, v in payload.items() if k != "messages"}
        h = xxhash.xxh3_128(_key_bytes(meta))
        for m in msgs:
            h.update(b"\x1e" + _key_bytes(m))
            digests.append(h.digest())
        return payload, digests, digests[-1]
    return payload, digests, _xxh128(_key_bytes(payload))


def find_seq(tokens: Sequence[int], seq: Sequence[int]) -> list[int]:
    """Start index of every occurrence of ``seq`` in ``tokens`` (non-overlapping scan)."""
    if not seq:
        return []
    first, n = seq[0], len(seq)
    out: list[int] = []
    i = 0
    seq = list(seq)
    while True:
        try:
            i = tokens.index(first, i)
        except ValueError:
            return out
        if list(tokens[i:i + n]) == seq:
            out.append(i)
            i += n
        else:
            i += 1


def hard_boundary(text: str, limit: int) -> int:
    """The largest ``b <= limit`` where ``text[b-1] == "\\n"`` and ``text[b]`` is not whitespace, or 0.

    No token of a Qwen2/Llama-3-style BPE pre-tokenizer spans such a position, so the tokens of
    ``text[:b]`` are a prefix of the tokens of any text that continues it.
    """
    b = min(limit, len(text) - 1)
    while b > 0:
        nl = text.rfind("\n", 0, b)
        if nl < 0:
            return 0
        if not text[nl + 1].isspace():
            return nl + 1
        b = nl
    return 0


@dataclass
class _Rec:
    tokens: list[int]
    prefixes: list[bytes]
    bidx: list[int] | None = None  # index of every boundary token in ``tokens``, ascending


def rec_bytes(n_tokens: int, n_prefixes: int) -> int:
    """Bytes held by a cached token list of ``n_tokens`` ids with ``n_prefixes`` boundary
    prefixes: the list itself (``sys.getsizeof``: 56 + 8 per slot; its int objects are shared with
    the record it was extended from, so only the new tail's ids are new objects, not counted) plus
    ~160 bytes per prefix (the 16-byte digest as a bytes object, 49 bytes, and its dict entry)."""
    return 56 + 8 * n_tokens + 160 * n_prefixes


class TokenCache:
    """Bounded LRU: text hash -> tokens, plus boundary-prefix hash -> (record, token count).

    ``max_bytes`` bounds the memory held (``rec_bytes`` summed over records: what keeps ocache's
    RSS flat over a long conversation, whose every turn adds a full-length token list);
    ``max_tokens`` the token ids held, ``max_entries`` the records.
    """

    def __init__(self, max_entries: int = 256, max_tokens: int = 4_000_000, max_bytes: int = 8 << 20):
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self.max_bytes = max_bytes
        self.records: OrderedDict[bytes, _Rec] = OrderedDict()
        self.prefix_index: dict[bytes, tuple[bytes, int]] = {}
        self.n_tokens = 0
        self.n_bytes = 0

    def get(self, key: bytes) -> list[int] | None:
        rec = self.records.get(key)
        if rec is None:
            return None
        self.records.move_to_end(key)
        return rec.tokens

    def prefix(self, pkey: bytes) -> list[int] | None:
        hit = self.prefix_with_boundaries(pkey)
        return None if hit is None else hit[0]

    def prefix_with_boundaries(self, pkey: bytes) -> tuple[list[int], list[int] | None] | None:
        """(tokens of the prefix, indices of the boundary tokens in it or None if not recorded)."""
        hit = self.prefix_index.get(pkey)
        if hit is None:
            return None
        rec = self.records.get(hit[0])
        if rec is None:
            return None
        self.records.move_to_end(hit[0])
        n = hit[1]
        bidx = None if rec.bidx is None else rec.bidx[: bisect.bisect_left(rec.bidx, n)]
        return rec.tokens[:n], bidx

    def put(self, key: bytes, tokens: list[int], prefixes: list[tuple[bytes, int]],
            bidx: list[int] | None = None) -> None:
        if key in self.records:
            self.records.move_to_end(key)
            return
        self.records[key] = _Rec(tokens, [p for p, _ in prefixes], bidx)
        self.n_tokens += len(tokens)
        self.n_bytes += rec_bytes(len(tokens), len(prefixes) + len(bidx or ()))
        for pkey, n in prefixes:
            self.prefix_index[pkey] = (key, n)
        while self.records and (len(self.records) > self.max_entries or self.n_tokens > self.max_tokens
                                or self.n_bytes > self.max_bytes):
            old_key, old = self.records.popitem(last=False)
            self.n_tokens -= len(old.tokens)
            self.n_bytes -= rec_bytes(len(old.tokens), len(old.prefixes) + len(old.bidx or ()))
            for pkey in old.prefixes:
                if self.prefix_index.get(pkey, (None,))[0] == old_key:
                    del self.prefix_index[pkey]

    def clear(self) -> None:
        self.records.clear()
        self.prefix_index.clear()
        self.n_tokens = 0
        self.n_bytes = 0


class TextCache:
    """Bounded LRU: render key -> rendered text, bounded by ``max_bytes`` (``sys.getsizeof`` of
    each string) and ``max_entries``."""

    def __init__(self, max_entries: int = 256, max_bytes: int = 8 << 20):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.items: OrderedDict[bytes, str] = OrderedDict()
        self.n_bytes = 0

    def get(self, key: bytes) -> str | None:
        text = self.items.get(key)
        if text is not None:
            self.items.move_to_end(key)
        return text

    def put(self, key: bytes, text: str) -> None:
        old = self.items.pop(key, None)
        if old is not None:
            self.n_bytes -= sys.getsizeof(old)
        self.items[key] = text
        self.n_bytes += sys.getsizeof(text)
        while self.items and (len(self.items) > self.max_entries or self.n_bytes > self.max_bytes):
            _, gone = self.items.popitem(last=False)
            self.n_bytes -= sys.getsizeof(gone)

    def __len__(self) -> int:
        return len(self.items)

    def clear(self) -> None:
        self.items.clear()
        self.n_bytes = 0


class ViewCalls:
    """The token view's calls to one llama-server: ``POST /tokenize``, ``/apply-template`` and the
    token-count routes, each idempotent and read-only, and the vocab probe built on them.

    Where these calls can wait, in the pinned source (tools/server/): each is answered on the HTTP
    thread that read it, with no task for the task loop, so none waits for a batch being decoded or
    prefilled: ``/apply-template`` runs ``oaicompat_chat_params_parse`` in the handler
    (server-context.cpp:5418-5428), ``/tokenize`` runs ``tokenize_mixed`` on the vocab
    (server-context.cpp:5442-5481), ``/v1/chat/completions/input_tokens`` does both
    (server-context.cpp:5901-5950); only ``GET /slots`` (not a view call) posts a task and waits for
    the loop to take it between two ``update_slots`` batches (server-context.cpp:5094-5101,
    server-queue.cpp:299-310): at most one batch, which the forwarded request's own task waits for
    as well (its task is taken at the same point, after the ``GET /slots`` task: high priority).
    Every connection gets a thread: ``n_threads_http`` fixed threads (``max(-np + 4, cores - 1)``
    unless ``--threads-http``, server-http.cpp:162-166) plus up to 1024 more made on demand when
    none is idle (server-http.cpp:572-574; cpp-httplib ``ThreadPool::enqueue``,
    vendor/cpp-httplib/httplib.cpp:7179-7198), so other clients' streams and idle keep-alive
    connections do not hold the view back either (measured: ``scripts/measure-second-ocache``,
    docs/benchmarks.md). What is left that can hold a view call: the server's CPU (the handler
    tokenizes on a thread that competes with the decode threads; 0.04-0.05 s per 10k tokens
    idle), a server that sleeps (``--sleep-idle-seconds``: every route but /health, /metrics,
    /props and /models waits for the model to be loaded again, ``create_response`` ->
    ``server_res_generator``, server-context.cpp:4511-4517, 5012-5030, 5162, 5430), and a stopped
    or hung process (no answer at all). Each is bounded by what the view buys: :meth:`bound_s` for
    a view, :meth:`call_timeout` for each call (also those made outside a view).

    ``upstream``: an ``ocache.upstream.Upstream`` (its shared ``session``, ``base_url``, ``api_key``
    and ``epoch`` are used) or a base URL string (a private aiohttp session is created; call
    ``close()``). ``timeout_s``: seconds one call may take at most (aiohttp's total, connection
    included); ``view_timeout_s``, ``view_slack_s``, ``prefill_tps_of``: what :meth:`bound_s` prices
    a view and :meth:`call_timeout` a call at. ``boundary``/``user_delimiter``: as
    :class:`TokenViewer`'s, for :meth:`probe`.
    """

    counters: dict[str, int]

    def __init__(self, upstream: UpstreamPort | str, *, api_key: str | None, boundary: str,
                 user_delimiter: str, timeout_s: float, view_timeout_s: float | None = None,
                 view_slack_s: float | None = None, prefill_tps_of: Callable[[], float | None] | None = None):
        if isinstance(upstream, str):
            self._upstream = None
            self.base_url = upstream.rstrip("/")
            self.api_key = api_key
        else:
            self._upstream = upstream
            self.base_url = upstream.base_url
            self.api_key = api_key if api_key is not None else getattr(upstream, "api_key", None)
        self._own_session: aiohttp.ClientSession | None = None
        self.boundary = boundary
        self.user_delimiter = user_delimiter
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        #: the most seconds one view may take in all, whatever it could save (None: no bound of a
        #: view, each call bounded by ``timeout_s`` only); :meth:`bound_s` is the bound
        self.view_timeout_s = view_timeout_s
        #: the server's measured prefill rate (tokens/s; None before one was measured), what
        #: :meth:`bound_s` prices the prefill a view can save at (``OCacheLayer.prefill_tps``)
        self.prefill_tps_of = prefill_tps_of
        #: seconds beyond that prefill (None: ``VIEW_SLACK_S``, read when a view starts)
        self.view_slack_s = view_slack_s
        self._probe: dict | None = None

    # --- HTTP -----------------------------------------------------------------------------------
    def _session(self) -> aiohttp.ClientSession:
        shared = getattr(self._upstream, "session", None)   # None: no upstream, or no session yet
        if shared is not None:
            return shared
        if self._own_session is None or self._own_session.closed:
            self._own_session = aiohttp.ClientSession()
        return self._own_session

    async def close(self) -> None:
        if self._own_session is not None:
            await self._own_session.close()
            self._own_session = None

    async def post(self, path: str, payload: dict) -> dict:
        """POST to a read-only endpoint (``/tokenize``, ``/apply-template``); one retry when the
        connection drops before an answer: after a llama-server restart on the same port the
        session's pooled keep-alive connection still points at the dead process, and its first use
        fails with "Server disconnected" (seen in ``tests/test_disk_tier.py`` under load). Both
        endpoints are idempotent. Raises TokenViewError (also once the shared session is closed:
        ocache is stopping, and a background check still running then is only skipped). Each try
        is bounded by :meth:`call_timeout`; one that outlasts it is counted ``call_timeouts``."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        timeout = self.call_timeout(payload)
        for attempt in (0, 1):
            session = self._session()
            if session.closed:
                raise TokenViewError(f"{path}: the HTTP session is closed (ocache is stopping)")
            try:
                async with session.post(self.base_url + path, json=payload, headers=headers,
                                        timeout=timeout) as resp:
                    raw = await resp.read()
                    if resp.status != 200:
                        raise TokenViewError(f"{path}: HTTP {resp.status}: "
                                             f"{raw[:500].decode('utf-8', 'replace')}", resp.status)
                    return json.loads(raw)
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                if attempt == 0:
                    continue
                raise TokenViewError(f"{path}: upstream unreachable: {exc or type(exc).__name__}") from exc
            except asyncio.TimeoutError as exc:
                self.counters["call_timeouts"] = self.counters.get("call_timeouts", 0) + 1
                raise TokenViewError(f"{path}: no answer within {timeout.total:.3g} s (what the call "
                                     f"could save; the server is stopped, asleep or starved)",
                                     timed_out=True) from exc
            except aiohttp.ClientError as exc:
                raise TokenViewError(f"{path}: upstream unreachable: {exc or type(exc).__name__}") from exc
        raise AssertionError("unreachable")

    def bound_s(self, body: Mapping) -> tuple[float, int, float] | None:
        """``(seconds, tokens, tokens/s)``: how long ``TokenViewer.view`` may wait for ``body``'s view, or
        None when unbounded (``view_timeout_s`` None). The most a plan can save is the prefill of the
        whole prompt: ``tokens`` = the body's bytes (compact JSON) / ``BYTES_PER_TOKEN``, at the
        server's measured prefill rate (``prefill_tps_of``; ``UNMEASURED_PREFILL_TPS`` before one
        was measured), plus :attr:`slack_s`, and never more than ``view_timeout_s``. Past it, the
        request goes as sent: waiting longer would cost more than any reuse gives back."""
        if self.view_timeout_s is None:
            return None
        try:
            n_bytes = len(_key_bytes(body))
        except (TypeError, ValueError):   # not JSON-encodable: priced by the slack alone
            n_bytes = 0
        tps = (self.prefill_tps_of() if self.prefill_tps_of is not None else None) or UNMEASURED_PREFILL_TPS
        tokens = int(n_bytes / BYTES_PER_TOKEN)
        return min(self.view_timeout_s, self.slack_s + tokens / tps), tokens, tps

    def call_timeout(self, payload: Any) -> aiohttp.ClientTimeout:
        """One call's bound: :meth:`bound_s` of what it sends (at most ``timeout_s``; ``timeout_s``
        alone without ``view_timeout_s``). It covers the
        calls made outside a view as well: the alignment route's once-a-process probe of the
        template's end-of-turn token (``AlignRoute.eot``: an ``/apply-template`` and a
        ``/tokenize`` on the first request) waited for the 120 s ``timeout_s`` in front of a server
        that did not answer them, and the first request with it (121 s,
        ``scripts/measure-second-ocache --held 1``)."""
        bound = self.bound_s(payload)
        if bound is None:
            return self.timeout
        total = self.timeout.total
        return aiohttp.ClientTimeout(total=min(total, bound[0]) if total else bound[0])

    @property
    def slack_s(self) -> float:
        """Seconds a view may take beyond the prefill it could save: ``view_slack_s``, else
        ``VIEW_SLACK_S``."""
        return VIEW_SLACK_S if self.view_slack_s is None else self.view_slack_s

    async def tokenize_remote(self, content: Any, add_special: bool) -> list[int]:
        self.counters["tokenize_calls"] += 1
        if isinstance(content, str):
            self.counters["tokenized_chars"] += len(content)
        data = await self.post("/tokenize", {"content": content, "add_special": add_special,
                                              "parse_special": True})
        return list(data["tokens"])

    async def probe(self) -> dict:
        """Token ids of the boundary and the user delimiter, and whether incremental tokenization
        is sound for this vocab: the boundary must be one special token (one id with
        parse_special, several without) and add_special must add nothing after the text."""
        if self._probe is None:
            b_sp, b_raw, u_sp, a_sp, a_raw = await asyncio.gather(
                self.post("/tokenize", {"content": self.boundary, "add_special": False, "parse_special": True}),
                self.post("/tokenize", {"content": self.boundary, "add_special": False, "parse_special": False}),
                self.post("/tokenize", {"content": self.user_delimiter, "add_special": False,
                                         "parse_special": True}),
                self.post("/tokenize", {"content": "a b", "add_special": True, "parse_special": True}),
                self.post("/tokenize", {"content": "a b", "add_special": False, "parse_special": True}),
            )
            bid, braw, uid = b_sp["tokens"], b_raw["tokens"], u_sp["tokens"]
            with_sp, without = a_sp["tokens"], a_raw["tokens"]
            n_bos = len(with_sp) - len(without)
            ok = (len(bid) == 1 and len(braw) > 1 and n_bos >= 0 and with_sp[n_bos:] == without)
            self._probe = {"boundary_id": bid[0] if len(bid) == 1 else None, "user_ids": list(uid),
                           "n_bos": n_bos, "incremental": ok}
        return self._probe


class TokenViewer(ViewCalls):
    """Builds TokenViews through the upstream's ``/apply-template`` and ``/tokenize``.

    ``upstream``: an ``ocache.upstream.Upstream`` (its shared ``session``, ``base_url``, ``api_key``
    and ``epoch`` are used; a new epoch clears every cache, since a restarted server may have
    another template or vocab) or a base URL string (a private aiohttp session is created; call
    ``close()``). ``boundary``: the special token that starts a turn (ChatML ``<|im_start|>``);
    ``user_delimiter``: the text that starts a user turn. Cache sizes: ``max_renders`` bodies,
    ``max_texts`` rendered texts / ``max_tokens`` token ids.
    """

    def __init__(self, upstream: UpstreamPort | str, *, api_key: str | None = None, boundary: str = "<|im_start|>",
                 user_delimiter: str = "<|im_start|>user", max_renders: int = 256, max_texts: int = 256,
                 max_tokens: int = 4_000_000, timeout_s: float = 120.0,
                 max_render_bytes: int = 8 << 20, max_token_bytes: int = 8 << 20,
                 delta: bool = True, verify_first: int = 8, verify_every: int = 16,
                 verify_wait_s: float = 60.0, view_timeout_s: float | None = None,
                 view_slack_s: float | None = None,
                 prefill_tps_of: Callable[[], float | None] | None = None):
        super().__init__(upstream, api_key=api_key, boundary=boundary, user_delimiter=user_delimiter,
                         timeout_s=timeout_s, view_timeout_s=view_timeout_s, view_slack_s=view_slack_s,
                         prefill_tps_of=prefill_tps_of)
        self.renders = TextCache(max_renders, max_render_bytes)
        self.max_renders = max_renders
        self.texts = TokenCache(max_texts, max_tokens, max_token_bytes)
        # delta render state: digest of (render fields, messages[:k]) -> (render key of a text that
        # starts with that prefix's render, its length in characters); bounded with the renders
        self.msg_prefixes: OrderedDict[bytes, tuple[bytes, int]] = OrderedDict()
        self.stubs: dict[bytes, tuple[str, str]] = {}  # delta-body key -> (stub text Q, gen prompt G)
        self.rewriting: set[bytes] = set()  # delta-body keys whose template is not append-only (_appends)
        self.delta = delta
        self.delta_ok = True
        self.verify_first, self.verify_every = verify_first, verify_every
        self.verify_wait_s = verify_wait_s
        self._n_delta = 0
        self._verifying: set[asyncio.Task] = set()
        # head.key -> (head prefix text, its tokens); a few harnesses at a time, so a small LRU
        self.heads: OrderedDict[str, tuple[str, list[int]]] = OrderedDict()
        self.max_heads = 32
        #: image digest (ocache/media.py) -> prompt positions the server gives it, this epoch
        self.media_positions: dict[str, int] = {}
        self._epoch = getattr(upstream, "epoch", None)
        self.counters = {"renders": 0, "render_hits": 0, "tokenize_calls": 0, "tokenized_chars": 0,
                         "text_hits": 0, "prefix_hits": 0, "head_renders": 0, "head_mismatch": 0,
                         "delta_renders": 0, "delta_verified": 0, "delta_mismatch": 0, "delta_refused": 0,
                         "delta_verify_late": 0, "view_timeouts": 0, "call_timeouts": 0}

    async def close(self) -> None:
        for task in list(self._verifying):
            task.cancel()
        await self.wait_verified()
        await super().close()

    def _check_epoch(self) -> None:
        epoch = getattr(self._upstream, "epoch", None)
        if epoch != self._epoch:
            self.clear()
            self._epoch = epoch

    def clear(self) -> None:
        """Drop every cache (called on a new upstream epoch; also by hand)."""
        self.renders.clear()
        self.texts.clear()
        self.heads.clear()
        self.msg_prefixes.clear()
        self.stubs.clear()
        self.rewriting.clear()
        self.media_positions.clear()
        self.delta_ok = True
        self._n_delta = 0
        self._probe = None

    # --- render + tokenize ----------------------------------------------------------------------
    async def render(self, body: Mapping, keys: tuple[dict, list[bytes], bytes] | None = None) -> str:
        """The prompt text the chat route renders for ``body`` (``/apply-template``), cached.

        A body that extends a conversation rendered before (the same render fields and the same
        first ``k`` messages) is rendered as a *delta*: the known prefix text (the earlier render
        without its generation prompt) + the server's render of only the new messages, behind a
        one-message stand-in (``_STUB``) whose own render is cut off again. This holds when the
        template is append-only: the render of ``messages[:k]`` (without generation prompt) is a
        prefix of the render of any longer ``messages`` (``ocache/data/chat_template.jinja``, rule
        list at its top; Qwen3's own templates are not, they drop past reasoning). The claim is
        checked on real bodies: the first ``verify_first`` delta renders and every
        ``verify_every``-th after them are compared with a full render in the background (off the
        request's path, and once no completion is in flight on the server: ``Upstream.quiet``, at
        most ``verify_wait_s``; a check that waited that long runs anyway, counted
        ``delta_verify_late``; a full render of a 32k-token conversation is 60-160 ms of the server's
        CPU, which made a concurrent answer's ``predicted_ms`` longer on 2 cores); one difference switches delta renders off until the next epoch and is
        counted (``delta_mismatch``). A wrong text can only cost a misprediction (the server renders
        the forwarded request itself). Cost: proportional to the new messages, plus hashing and
        one ``json.dumps`` of each message (C speed)."""
        self._check_epoch()
        payload, digests, key = keys if keys is not None else message_keys(body)
        msgs = payload.get("messages")
        text = self.renders.get(key)
        if text is not None:
            self.counters["render_hits"] += 1
            return text
        text = None
        if digests and isinstance(msgs, list) and self.delta and self.delta_ok and not payload.get("continue_final_message"):
            try:
                text = await self._render_delta(payload, msgs, digests, key)
            except TokenViewError as exc:  # the server refused the short body: render in full
                log.debug("delta render refused (%s): full render", exc)
                self.counters["delta_refused"] += 1
                text = None
        if text is None:
            self.counters["renders"] += 1
            text = await self.render_full(payload)
        self.renders.put(key, text)
        if digests:
            await self._remember_prefix(payload, digests[-1], key, text)
        return text

    async def render_full(self, payload: Mapping) -> str:
        """The server's own rendering of ``payload`` (``POST /apply-template``, whole, not the
        incremental view's); raises TokenViewError when the answer holds no prompt string."""
        data = await self.post("/apply-template", dict(payload))
        text = data.get("prompt")
        if not isinstance(text, str):
            raise TokenViewError("/apply-template returned no prompt string")
        return text

    async def _stub(self, meta: dict) -> tuple[bytes, str, str]:
        """(key, Q, G) for the delta body's fields ``meta``: Q = the render of the stand-in alone
        without generation prompt, G = what the generation prompt adds to it."""
        skey = _xxh128(_key_bytes(meta))
        if skey in self.rewriting:
            raise TokenViewError("the template rewrites earlier turns at a new user message")
        hit = self.stubs.get(skey)
        if hit is None:
            q = await self.render_full({**meta, "messages": [_STUB], "add_generation_prompt": False})
            g = await self.render_full({**meta, "messages": [_STUB], "add_generation_prompt": True})
            if not g.startswith(q):
                raise TokenViewError("generation prompt is not appended to the render")
            if not await self._appends(meta):
                self.rewriting.add(skey)
                raise TokenViewError("the template rewrites earlier turns at a new user message")
            hit = (q, g[len(q):])
            self.stubs[skey] = hit
            while len(self.stubs) > 64:
                self.stubs.pop(next(iter(self.stubs)))
        return skey, hit[0], hit[1]

    async def _appends(self, meta: dict) -> bool:
        """Whether the template renders a conversation's earlier turns the same once a user message
        follows them: the render of [user, assistant with reasoning] (no generation prompt) is a
        prefix of the render with one more user message. Qwen3's and Qwen3.5's own templates
        (``models/templates/Qwen-Qwen3-0.6B.jinja``, ``Qwen3.5-4B.jinja`` of the pinned source) render
        an assistant turn's ``<think>`` block only after the last user message
        (``loop.index0 > ns.last_query_index``), so a delta render would keep reasoning the full
        render drops: delta renders are refused for them (``delta_refused``) and every render is
        the server's full one. Costs two ``/apply-template`` calls per set of render fields."""
        turn = [_STUB, {"role": "assistant", "content": "y", "reasoning_content": "z"}]
        a = await self.render_full({**meta, "messages": turn, "add_generation_prompt": False})
        b = await self.render_full({**meta, "messages": [*turn, {"role": "user", "content": "w"}],
                                     "add_generation_prompt": False})
        return b.startswith(a)

    def _delta_meta(self, payload: Mapping) -> dict:
        return {k: v for k, v in payload.items() if k != "messages" and k not in _DELTA_DROP}

    async def _remember_prefix(self, payload: Mapping, digest: bytes, key: bytes, text: str) -> None:
        """Record that ``text[:n]`` is the render of this body's messages without the generation
        prompt, so the next turn of the conversation can be rendered as a delta."""
        if not self.delta or not self.delta_ok:
            return
        n = len(text)
        if payload.get("add_generation_prompt", True):  # the server's default (server-common.cpp)
            try:
                _, _, gen = await self._stub(self._delta_meta(payload))
            except TokenViewError:
                return
            if not text.endswith(gen):
                return
            n -= len(gen)
        self.msg_prefixes[digest] = (key, n)
        self.msg_prefixes.move_to_end(digest)
        while len(self.msg_prefixes) > max(self.max_renders, len(self.renders)):
            self.msg_prefixes.popitem(last=False)

    async def _render_delta(self, payload: dict, msgs: list, digests: list[bytes],
                            key: bytes) -> str | None:
        """The render of ``payload`` from the longest remembered message prefix, or None."""
        for k in range(len(msgs) - 1, 0, -1):
            hit = self.msg_prefixes.get(digests[k - 1])
            if hit is None:
                continue
            base = self.renders.get(hit[0])
            if base is None:
                return None
            new = msgs[k:]
            role = new[0].get("role") if isinstance(new[0], Mapping) else None
            prev = msgs[k - 1].get("role") if isinstance(msgs[k - 1], Mapping) else None
            # the template joins a run of tool results into one turn, and opening system messages
            # into one system turn: a delta must not start inside either
            if role == "system" or (role == "tool" and prev == "tool"):
                return None
            meta = self._delta_meta(payload)
            _, q, _ = await self._stub(meta)
            out = await self.render_full({**meta, "messages": [_STUB, *new]})
            if not out.startswith(q):
                return None
            text = base[: hit[1]] + out[len(q):]
            self.counters["delta_renders"] += 1
            self._n_delta += 1
            n = self._n_delta
            if n <= self.verify_first or (self.verify_every and (n - self.verify_first) % self.verify_every == 0):
                task = asyncio.get_running_loop().create_task(self._verify(dict(payload), key, text))
                self._verifying.add(task)
                task.add_done_callback(self._verifying.discard)
                track = getattr(self._upstream, "track_background", None)
                if track is not None:
                    track(task)
            return text
        return None

    async def _verify(self, payload: dict, key: bytes, text: str) -> None:
        """Compare a delta render with the full render (background); on a difference the full
        render replaces it in the cache."""
        epoch = self._epoch
        quiet = getattr(self._upstream, "quiet", None)
        if quiet is not None and not await quiet(self.verify_wait_s):
            self.counters["delta_verify_late"] += 1
        if epoch != self._epoch:
            return
        try:
            full = await self.render_full(payload)
        except TokenViewError as exc:
            log.debug("delta render check skipped: %s", exc)
            return
        if epoch != self._epoch:
            return
        if full == text:
            self.counters["delta_verified"] += 1
            return
        self.counters["delta_mismatch"] += 1
        self.delta_ok = False
        self.msg_prefixes.clear()
        self.renders.put(key, full)
        n = 0
        while n < min(len(full), len(text)) and full[n] == text[n]:
            n += 1
        log.warning("the chat template is not append-only for this conversation (delta render "
                    "differs from the full render at character %d of %d): delta renders off until "
                    "the server restarts", n, len(full))

    def distrust(self, why: str) -> None:
        """Delta renders off until the next epoch, every remembered message prefix and cached render
        dropped (tokenizations stay: they are right for their text): a response showed a view wrong
        (``why``, logged). Counted ``delta_mismatch``."""
        if self.delta_ok:
            log.warning("delta renders off until the server restarts: %s", why)
        self.counters["delta_mismatch"] += 1
        self.delta_ok = False
        self.msg_prefixes.clear()
        self.renders.clear()

    @property
    def append_only(self) -> bool:
        """Whether the template has shown itself append-only: delta renders are on and at least one
        was checked equal to a full render, none different (``_verify``). What a message-level
        match of two requests (``message_keys``) says of their prompts relies on it."""
        return self.delta and self.delta_ok and self.counters["delta_verified"] > 0

    async def wait_verified(self) -> None:
        """Wait until every background delta check has finished (tests, shutdown)."""
        while self._verifying:
            await asyncio.gather(*list(self._verifying), return_exceptions=True)

    async def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` exactly as the server prefills a prompt string (add_special=True,
        parse_special=True), reusing the tokens of the longest cached prefix that ends before a
        boundary token. Returns a fresh list."""
        self._check_epoch()
        raw = text.encode("utf-8")
        key = _xxh128(raw)
        hit = self.texts.get(key)
        if hit is not None:
            self.counters["text_hits"] += 1
            return list(hit)
        probe = await self.probe()
        if not probe["incremental"]:
            whole = await self.tokenize_remote(text, True)
            self.texts.put(key, whole, [])
            return list(whole)
        bnd = self.boundary.encode("utf-8")
        positions, pos = [], raw.find(bnd, 1)
        while pos >= 0:
            positions.append(pos)
            pos = raw.find(bnd, pos + 1)
        # hash of raw[:p] for every boundary p, in one streaming pass
        h, last, pkeys = xxhash.xxh3_128(), 0, []
        for p in positions:
            h.update(raw[last:p])
            pkeys.append(h.digest())
            last = p
        tokens: list[int] | None = None
        bid = probe["boundary_id"]
        all_idx: list[int] | None = None
        for p, pkey in zip(reversed(positions), reversed(pkeys)):
            found = self.texts.prefix_with_boundaries(pkey)
            if found is not None:
                head, head_idx = found
                self.counters["prefix_hits"] += 1
                tail = await self.tokenize_remote(raw[p:].decode("utf-8"), False)
                tokens = head + tail
                if head_idx is not None:  # only the new tail is scanned for boundary tokens
                    n = len(head)
                    all_idx = head_idx + [n + i for i, t in enumerate(tail) if t == bid]
                break
        if tokens is None:
            tokens = await self.tokenize_remote(text, True)
        # token count at each boundary: the k-th boundary id <-> the k-th boundary text occurrence
        if all_idx is None:
            all_idx = [i for i, t in enumerate(tokens) if t == bid]
        idx = all_idx
        starts_at_0 = raw.startswith(bnd)
        if starts_at_0:
            idx = idx[1:]
        prefixes = list(zip(pkeys, idx)) if len(idx) == len(positions) else []
        self.texts.put(key, tokens, prefixes, all_idx if prefixes else None)
        return list(tokens)

    async def head_end(self, body: Mapping, text: str, tokens: list[int], head: Head) -> int | None:
        """Token index where ``head`` ends in ``tokens`` (see the module docstring), or None."""
        cached = self.heads.get(head.key)
        if cached is None or not text.startswith(cached[0]):
            self.counters["head_renders"] += 1
            cut_text = await self.render(cut_body(body, head))
            n = 0
            limit = min(len(text), len(cut_text))
            while n < limit and text[n] == cut_text[n]:  # common prefix (chars)
                n += 1
            b = hard_boundary(text, n)
            if b == 0:
                return None
            prefix = text[:b]
            head_tokens = await self.tokenize_remote(prefix, True)
            cached = (prefix, head_tokens)
            self.heads[head.key] = cached
            while len(self.heads) > self.max_heads:
                self.heads.popitem(last=False)
        else:
            self.heads.move_to_end(head.key)
        head_tokens = cached[1]
        if tokens[: len(head_tokens)] != head_tokens:
            self.counters["head_mismatch"] += 1
            return None
        return len(head_tokens)

    async def view(self, path: str, body: Mapping, head: Head | None = None,
                   keys: tuple[dict, list[bytes], bytes] | None = None) -> TokenView:
        """The TokenView of a completion request. ``keys``: ``message_keys(body)`` of a chat body when
        the caller computed it already. Raises TokenViewError (render/tokenize failed or an
        unsupported prompt shape; status 0 also when the view took longer than :meth:`bound_s`:
        its HTTP calls are cancelled; or when one call outlasted its own bound, :meth:`call_timeout`;
        both counted ``view_timeouts``, ``timed_out`` set) and ValueError (a route that is not
        a completion route).

        The bound holds whoever else the server is serving (the calls never wait for the task
        loop: :class:`ViewCalls`); it stands for what the server cannot promise, a loaded CPU, a
        sleeping or stopped process. Before it, a second ocache's first request waited 121.5 s for
        ``/tokenize`` (the 120 s ``timeout_s``), then was forwarded as sent anyway."""
        bound = self.bound_s(body)
        if bound is None:
            return await self._view(path, body, head, keys)
        try:
            async with asyncio.timeout(bound[0]):
                return await self._view(path, body, head, keys)
        except TokenViewError as exc:
            if exc.timed_out:   # one of its calls outlasted the call's own bound (call_timeout)
                self.counters["view_timeouts"] += 1
            raise
        except TimeoutError as exc:
            self.counters["view_timeouts"] += 1
            raise TokenViewError(
                f"{path}: no token view within {bound[0]:.3g} s (what it could save: ~{bound[1]} prompt "
                f"tokens at {bound[2]:.0f} tokens/s, + {self.slack_s:g} s; at most view_timeout_s "
                f"{self.view_timeout_s:g} s): forwarded as sent", timed_out=True) from exc

    async def _view(self, path: str, body: Mapping, head: Head | None,
                    keys: tuple[dict, list[bytes], bytes] | None) -> TokenView:
        self._check_epoch()
        t0 = time.perf_counter()
        c0 = dict(self.counters)
        if path in CONVERTED_ROUTES:
            try:
                body = to_chat(path, body)
            except ConversionError as exc:  # the server rejects it the same way (HTTP 400)
                raise TokenViewError(f"{path}: {exc}", 400) from exc
            path = "/v1/chat/completions"
        msg_key, n_msgs = None, 0
        if path in CHAT_ROUTES:
            if keys is None:
                keys = message_keys(body)
            if keys[1]:
                msg_key, n_msgs = keys[2], len(keys[1])
            text = await self.render(body, keys)
            # images: each keyed by its digest (ocache/media.py); the marker's shape in a text
            # without a media part is text (media.has_media_parts)
            if MEDIA_MARKER.search(text) and has_media_parts(body):
                tokens = await self._media_tokens(text, body)
            else:
                tokens = await self.tokenize(text)
        elif path in PROMPT_ROUTES:
            if "prompt" not in body:
                raise TokenViewError("no prompt in a completion request")
            tokens, text = await prompt_tokens(self, body["prompt"])
            head = None
        else:
            raise ValueError(f"not a completion route: {path}")
        probe = await self.probe()
        head_end = await self.head_end(body, text, tokens, head) if head is not None else None
        stats: dict[str, float] = {k: self.counters[k] - c0[k] for k in self.counters}
        stats["seconds"] = time.perf_counter() - t0
        return TokenView(tokens=tokens, head_end=head_end, user_starts=find_seq(tokens, probe["user_ids"]),
                         text=text, stats=stats, msg_key=msg_key, n_msgs=n_msgs, source=self)


    async def _media_tokens(self, text: str, body: Mapping) -> list[int]:
        """``ocache.media.media_tokens`` of a rendered prompt with media markers, through this
        viewer: the positions of each image from the server's count (one-image message minus an
        empty one, ``/v1/chat/completions/input_tokens``), once per digest and epoch. Raises
        TokenViewError, status 415 for media ocache cannot key (the request is then not planned)."""
        from ocache import media  # noqa: PLC0415 (a module of its own; the marker is imported above)

        async def tok(part: str, first: bool) -> list[int]:
            return await self.tokenize(part) if first else await self.tokenize_remote(part, False)

        async def positions(url: str, dig: str) -> int:
            n = self.media_positions.get(dig)
            if n is None:
                counts = []
                for content in ([{"type": "image_url", "image_url": {"url": url}}], [{"type": "text", "text": ""}]):
                    got = await self.post("/v1/chat/completions/input_tokens",
                                           {"messages": [{"role": "user", "content": content}]})
                    counts.append(int(got["input_tokens"]))
                n = self.media_positions[dig] = counts[0] - counts[1]
            return n

        try:
            return await media.media_tokens(text, body, tok, positions)
        except media.MediaError as exc:
            raise TokenViewError(f"media not viewed: {exc}", 415) from exc


async def prompt_tokens(viewer: "TokenViewer", prompt: Any) -> tuple[list[int], str]:
    """``(tokens, text)`` of a ``/completion``-style ``prompt`` through ``viewer`` (tokenize_input_subprompt,
    server-common.cpp:981-1013): a string, a token array, a mixed array, or {"prompt_string"}."""
    if isinstance(prompt, Mapping) and "prompt_string" in prompt:
        if "multimodal_data" in prompt:
            raise TokenViewError("multimodal prompts are not viewed")
        prompt = prompt["prompt_string"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, Mapping)):
        return await prompt_tokens(viewer, prompt[0])
    if isinstance(prompt, str):
        return await viewer.tokenize(prompt), prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt), ""
        if all(isinstance(t, (int, str)) and not isinstance(t, bool) for t in prompt):
            if any(isinstance(t, int) for t in prompt):  # one mixed prompt (tokenize_mixed)
                return await viewer.tokenize_remote(prompt, True), ""
        raise TokenViewError("a prompt array of several prompts runs several tasks; not viewed")
    raise TokenViewError("prompt must be a string, a token array or a mixed array")


# --- benchmark: cost per 10k tokens (a script, not a test) ---------------------------------------

async def bench(url: str, bodies: Sequence[dict], repeat: int = 3) -> dict:
    """Time the token view over ``bodies`` (chat requests of one conversation, in order) against a
    running llama-server; best of ``repeat`` rounds, in seconds per 10k prompt tokens:

    * ``render``: ``/apply-template`` alone, cold; ``tokenize``: a full ``/tokenize`` of the text;
    * ``cold_view``: a fresh viewer per body (render + tokenize + the one-time head computation);
    * ``incremental_view``: bodies 2.. through a viewer that saw the earlier turns (only the new
      turns are tokenized; the head is known);
    * ``cached_view``: an identical body again (hash lookups only).
    """
    from ocache.fingerprint import harness_head

    best: dict[str, float] = {}
    n_all = sum_next = 0
    for _ in range(repeat):
        acc = {"render": 0.0, "tokenize": 0.0, "cold_view": 0.0, "incremental_view": 0.0, "cached_view": 0.0}
        n_all = n_next = 0
        v = TokenViewer(url)
        try:
            await v.probe()
            for i, b in enumerate(bodies):
                head = harness_head(b)
                fresh = TokenViewer(url)
                try:
                    await fresh.probe()
                    t = time.perf_counter()
                    text = await fresh.render(b)
                    acc["render"] += time.perf_counter() - t
                    t = time.perf_counter()
                    tokens = await fresh.tokenize_remote(text, True)
                    acc["tokenize"] += time.perf_counter() - t
                    fresh.clear()
                    await fresh.probe()
                    t = time.perf_counter()
                    await fresh.view("/v1/chat/completions", b, head)
                    acc["cold_view"] += time.perf_counter() - t
                finally:
                    await fresh.close()
                n_all += len(tokens)
                t = time.perf_counter()
                await v.view("/v1/chat/completions", b, head)
                if i > 0:
                    acc["incremental_view"] += time.perf_counter() - t
                    n_next += len(tokens)
                t = time.perf_counter()
                await v.view("/v1/chat/completions", b, head)
                acc["cached_view"] += time.perf_counter() - t
        finally:
            await v.close()
        for k, secs in acc.items():
            n = n_next if k == "incremental_view" else n_all
            if n:
                best[k] = min(best.get(k, float("inf")), secs / n * 1e4)
        sum_next = n_next
    return {"tokens": n_all, "tokens_after_first": sum_next,
            **{f"{k}_s_per_10k": round(x, 5) for k, x in best.items()}}


def _main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ocache.tokens", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench", help="cost of render + tokenize per 10k tokens, cold and cached")
    b.add_argument("--url", required=True, help="llama-server base URL")
    b.add_argument("--repeat", type=int, default=3)
    b.add_argument("bodies", nargs="*", help="chat request JSON files in conversation order "
                   "(default: the opencode session fixtures in shared/fixtures)")
    args = ap.parse_args(argv)
    paths = args.bodies
    if not paths:
        from pathlib import Path
        fx = Path(__file__).resolve().parents[2] / "shared" / "fixtures"
        paths = [str(fx / n) for n in ("opencode_run4_continue_turn2.json",
                                       "opencode_run4_continue_turn2_after_tool.json")]
    bodies = [json.loads(open(p).read()) for p in paths]
    res = asyncio.run(bench(args.url, bodies, args.repeat))
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
