"""Figures that tell the truth: the reuse a response reports, corrected for the
prefill ocache did itself for that same request.

Why a correction is needed: before forwarding a request, ocache may prefill part of its prompt in
separate steps on the pinned slot — the harness head warm-up (``HeadTier.warm_in``, ocache/tiers/head.py) and the
disk tier's anchor split (``DiskTier.write_anchors``: ``/completion`` of exactly ``tokens[:L]`` with
``n_predict: 0``, then ``action=save``). The server then reports, for the forwarded request,
``timings.cache_n`` = everything the slot already held, including the tokens those steps prefilled
moments earlier; ``usage.prompt_tokens_details.cached_tokens`` is the same number
(``n_prompt_tokens_cache``, tools/server/server-task.cpp:365-371). Those tokens were paid for by
this request, not reused.

Given ``split`` = tokens ocache's own steps prefilled for the request (the sum of their
``timings.prompt_n``; each step is counted in the server's ``llamacpp:prompt_tokens_total`` too,
server-context.cpp:4131-4137) and ``split_ms`` = their ``timings.prompt_ms``:

* ``cache_n`` and ``cached_tokens`` become ``max(0, value - split)``: the tokens reused from before
  this request;
* ``prompt_n`` becomes ``prompt_n + split`` (every token the server prefilled for this request,
  ocache's steps included), ``prompt_ms`` becomes ``prompt_ms + split_ms`` and
  ``prompt_per_second``/``prompt_per_token_ms`` are recomputed from both (the fields of
  ``server_slot_stats::to_json``, tools/server/server-common.cpp:84-97);
* in an Anthropic ``usage`` (``/v1/messages``: ``cache_read_input_tokens`` is the server's
  ``n_prompt_tokens_cache``, ``input_tokens`` the prompt minus it, server-task.cpp:787-790,
  1343-1346), ``cache_read_input_tokens`` loses the split and ``input_tokens`` gains it; the
  Responses API's ``input_tokens_details.cached_tokens`` is corrected like ``cached_tokens``;
* everything else is byte for byte the server's.

So ``cache_n + prompt_n`` still equals the prompt length, and for every planned request
``cached_tokens == prompt_tokens - (delta of llamacpp:prompt_tokens_total)`` (tests/test_figures.py).

The rewrite is textual, on the server's compact JSON (nlohmann ``dump()``): only the number after
``"cache_n":``, ``"cached_tokens":``, ``"prompt_n":``, ``"prompt_ms":``, ``"prompt_per_second":``
and ``"prompt_per_token_ms":`` changes. Inside a JSON string a ``"`` is always escaped (``\\"``), so
generated text can never match those patterns.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

_NUM = rb"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?"
_PATTERN = re.compile(rb'"(cache_n|cached_tokens|prompt_n|prompt_ms|prompt_per_second)"(\s*:\s*)(' + _NUM + rb")")
#: An object that carries ``prompt_n`` and ``prompt_ms`` (llama-server's ``timings``): the span
#: in which ``prompt_per_second`` is recomputed.
_TIMINGS = re.compile(rb'"timings"\s*:\s*\{[^{}]*\}')
#: A flat ``usage`` object (Anthropic's carries ``cache_read_input_tokens``).
_USAGE = re.compile(rb'"usage"\s*:\s*\{[^{}]*\}')


@dataclass(frozen=True)
class Figures:
    """What one plan tells of its request, written once by the route that planned it
    (``Plan.figures``) and read as values: the response's ``X-OCache-*`` headers (:meth:`headers`,
    the header names in ``ocache/cache/orchestrator.py``'s module docstring), the log line and the
    ``last_completions`` record (``ocache/finish.py``), the stats by tier, the router's queued
    prefill (``ocache/router.py``). None: the figure is not known (not sent).

    ``tier``: where the reused prefix came from (``resident``, ``head``, ``disk``, ``session``,
    ``cold``, ``none``, ``response``); ``kind``: the request class (``agent``, ``guest``,
    ``other``); ``slot``: the slot pinned, or ``"server"`` when the server places it; tokens:
    ``predicted_cache`` (the forwarded request's predicted ``cache_n`` less ``split``), ``split``
    (what ocache prefilled itself in ``n_predict: 0`` steps), ``prefilled`` (what the server
    prefills for the request, ``split`` included), ``reused`` (from before the request);
    ``restore_ms``: milliseconds the restore of the reused prefix took (0.1 ms resolution)."""

    tier: str | None = None
    kind: str | None = None
    slot: int | str | None = None
    predicted_cache: int | None = None
    split: int | None = None
    prefilled: int | None = None
    reused: int | None = None
    restore_ms: float | None = None

    #: field -> header, in the order the headers are sent
    HEADERS = (("slot", "X-OCache-Slot"), ("predicted_cache", "X-OCache-Predicted-Cache"),
               ("tier", "X-OCache-Tier"), ("kind", "X-OCache-Kind"), ("split", "X-OCache-Split"),
               ("prefilled", "X-OCache-Prefilled"), ("reused", "X-OCache-Reused"),
               ("restore_ms", "X-OCache-Restore-Ms"))

    #: the only ocache headers an error answer (status >= 400: a refused key, a bad body) carries:
    #: nothing was reused or prefilled for it, and what the plan found (the slot, the tier, the
    #: tokens a held slot shares with the body) is not told to a client the server refused (a
    #: second engineer's attack read a held conversation's length off a 401's X-OCache-Predicted-Cache)
    ERROR_HEADERS = frozenset({"x-ocache-request-id", "x-ocache-fail-open"})

    def headers(self) -> dict[str, str]:
        """The figures as response headers (the known ones only)."""
        out = {}
        for name, header in self.HEADERS:
            v = getattr(self, name)
            if v is not None:
                out[header] = f"{v:.1f}" if name == "restore_ms" else str(v)
        return out


def _fmt(x: float) -> bytes:
    return repr(float(x)).encode()


def correct_timings(timings: Mapping | None, split: int, split_ms: float = 0.0) -> dict | None:
    """``timings`` with the correction applied (a new dict; None stays None)."""
    if timings is None:
        return None
    t = dict(timings)
    if split <= 0:
        return t
    if isinstance(t.get("cache_n"), (int, float)):
        t["cache_n"] = max(0, int(t["cache_n"]) - split)
    if isinstance(t.get("prompt_n"), (int, float)):
        t["prompt_n"] = int(t["prompt_n"]) + split
    if isinstance(t.get("prompt_ms"), (int, float)):
        t["prompt_ms"] = float(t["prompt_ms"]) + float(split_ms)
        if t["prompt_ms"] > 0 and "prompt_per_second" in t:
            t["prompt_per_second"] = t["prompt_n"] / t["prompt_ms"] * 1000.0
        if t["prompt_n"] > 0 and "prompt_per_token_ms" in t:
            t["prompt_per_token_ms"] = t["prompt_ms"] / t["prompt_n"]
    return t


#: the sampled ids ocache asked for (``"ocache_generated": [...]`` inside ``timings``,
#: patches/0010), with the comma that joins them to the object; a ``"`` inside a JSON string is
#: always escaped, so generated text cannot match
_GENERATED = re.compile(rb',"ocache_generated":\[[0-9,]*\]|"ocache_generated":\[[0-9,]*\],?')


def strip_generated(data: bytes) -> bytes:
    """``data`` without the sampled ids the server added for ocache (patches/0010): the client
    reads the server's answer as it would without ocache."""
    return _GENERATED.sub(b"", data) if b'"ocache_generated"' in data else data


def rewrite(data: bytes, split: int, split_ms: float = 0.0) -> bytes:
    """A response body or one SSE line with the correction applied (see the module docstring) and
    the sampled ids taken out (:func:`strip_generated`); ``data`` unchanged when ``split <= 0`` or
    no figure occurs in it."""
    data = strip_generated(data)
    if split <= 0 or (b'"cache_n"' not in data and b'"cached_tokens"' not in data
                      and b'"cache_read_input_tokens"' not in data):
        return data

    def number(m: re.Match) -> bytes:
        key, sep, raw = m.group(1), m.group(2), m.group(3)
        if key in (b"cache_n", b"cached_tokens"):
            v = max(0, int(float(raw)) - split)
        elif key == b"prompt_n":
            v = int(float(raw)) + split
        elif key == b"prompt_ms":
            return b'"' + key + b'"' + sep + _fmt(float(raw) + float(split_ms))
        else:
            return m.group(0)  # prompt_per_second: recomputed per timings object below
        return b'"' + key + b'"' + sep + str(v).encode()

    out = _PATTERN.sub(number, data)

    def rate(m: re.Match) -> bytes:
        obj = m.group(0)
        n = re.search(rb'"prompt_n"\s*:\s*(' + _NUM + rb")", obj)
        ms = re.search(rb'"prompt_ms"\s*:\s*(' + _NUM + rb")", obj)
        if not n or not ms or float(ms.group(1)) <= 0 or float(n.group(1)) <= 0:
            return obj
        pn, pms = float(n.group(1)), float(ms.group(1))
        obj = re.sub(rb'("prompt_per_second"\s*:\s*)' + _NUM, lambda k: k.group(1) + _fmt(pn / pms * 1000.0), obj)
        return re.sub(rb'("prompt_per_token_ms"\s*:\s*)' + _NUM, lambda k: k.group(1) + _fmt(pms / pn), obj)

    out = _TIMINGS.sub(rate, out)

    def anthropic(m: re.Match) -> bytes:
        obj = m.group(0)
        if b'"cache_read_input_tokens"' not in obj:
            return obj  # an OpenAI/Responses usage: its input/prompt_tokens are the whole prompt

        def fix(k: re.Match) -> bytes:
            v = int(float(k.group(3)))
            v = max(0, v - split) if k.group(1) == b"cache_read_input_tokens" else v + split
            return b'"' + k.group(1) + b'"' + k.group(2) + str(v).encode()

        return re.sub(rb'"(cache_read_input_tokens|input_tokens)"(\s*:\s*)(' + _NUM + rb")", fix, obj)

    return _USAGE.sub(anthropic, out)


class LineRewriter:
    """Applies :func:`rewrite` to an SSE stream line by line: ``feed(chunk)`` returns the bytes to
    send now (every complete line, corrected), holding back an unterminated last line until the
    next chunk completes it; ``flush()`` returns what is left at the end of the stream. With
    llama-server every event arrives whole in one chunk, so nothing is held back in practice."""

    __slots__ = ("split", "split_ms", "_tail")

    def __init__(self, split: int, split_ms: float = 0.0) -> None:
        self.split = split
        self.split_ms = split_ms
        self._tail = b""

    def feed(self, chunk: bytes) -> bytes:
        buf = self._tail + chunk if self._tail else chunk
        nl = buf.rfind(b"\n")
        if nl < 0:
            self._tail = buf
            if len(buf) > (16 << 20):  # a pathological unterminated line: pass it on as is
                self._tail = b""
                return buf
            return b""
        self._tail = buf[nl + 1:]
        return rewrite(buf[: nl + 1], self.split, self.split_ms)

    @property
    def holding(self) -> bool:
        """An unterminated line is held back (not yet sent)."""
        return bool(self._tail)

    def flush(self) -> bytes:
        tail, self._tail = self._tail, b""
        return rewrite(tail, self.split, self.split_ms) if tail else b""
