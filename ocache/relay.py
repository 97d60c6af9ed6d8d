"""The answer on its way back: relayed to the client as it arrives, and read on the way for what
the cache layer observes (``timings``/``usage``, the assistant text, the stream's final event).

``relay_stream`` writes each chunk before looking at it (``SSEObserver.feed``), so observation
never delays a byte; ``observe_json`` reads an answer the proxy read whole. They fill the request's
``Observation`` (``ocache/layer.py``): ``ttft_s``, ``completed``, ``timings``, ``usage``,
``content``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Callable

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from ocache.api import figures
from ocache.api.convert import timings_from_usage
from ocache.layer import Observation

log = logging.getLogger("ocache.proxy")


class SSEObserver:
    """Reads ``timings``/``usage`` from SSE ``data:`` lines as chunks pass by (never delays them),
    and notices the stream's *final event*.

    ``final`` turns True once a line of the final event was fed (the proxy feeds a chunk only after
    writing it to the client, so the client then has the whole answer): ``data: [DONE]`` (chat and
    text completions, tools/server/server-context.cpp:4525), a ``data:`` object with ``timings``
    that ends the answer — ``"stop": true`` (native ``/completion``, server-task.cpp:346), a non-null
    ``finish_reason`` or a ``usage`` chunk (OpenAI routes; the final chunk carries ``timings``,
    server-task.cpp:503-518; partial chunks carry ``timings`` only with ``timings_per_token``, and
    then with ``finish_reason: null``) — or a Responses API ``response.completed`` event
    (server-task.cpp:689), or an Anthropic ``message_stop``. A client that closes its socket right
    after that (python-requests ``iter_lines()`` + ``break``) has received a complete response.

    ``first_at``: ``time.perf_counter()`` when the first ``data:`` event that is not a prompt
    progress report passed (the first generated token): not the server's keep-alive comment
    ``":\n\n"``, sent while a prefill outlasts ``sse_ping_interval`` (default 30 s;
    tools/server/server-context.cpp:4535-4548, common/common.h:626)."""

    __slots__ = ("_buf", "timings", "usage", "events", "_anthropic", "first_at", "final", "message",
                 "finish_reason", "keep")

    def __init__(self, collect: bool = False, keep: bytearray | None = None) -> None:
        # ``keep``: every chunk fed is appended to it (the response cache's record of the stream)
        self.keep = keep
        # ``collect``: also build the chat answer from the deltas (``message``, for the aligned
        # route, ocache/cache/align_route.py); None: not collected
        self.message: dict | None = {"role": "assistant", "content": ""} if collect else None
        self.finish_reason: str | None = None
        self._anthropic: dict | None = None
        self._buf = b""
        self.timings: dict | None = None
        self.usage: dict | None = None
        self.events = 0
        self.first_at: float | None = None
        self.final = False

    def feed(self, chunk: bytes) -> None:
        if self.keep is not None:
            self.keep += chunk
        buf = self._buf + chunk if self._buf else chunk
        start = 0
        while True:
            nl = buf.find(b"\n", start)
            if nl < 0:
                break
            line = buf[start:nl]
            start = nl + 1
            if line.startswith(b"data:"):
                self.events += 1
                if self.first_at is None and b'"prompt_progress"' not in line:
                    self.first_at = time.perf_counter()
                if self.message is not None and b'"choices"' in line:
                    self._delta(line[5:])
                if (b'"timings"' in line or b'"usage"' in line or b"response.completed" in line
                        or b"message_stop" in line):
                    self._parse(line[5:])
                elif line[5:].strip() == b"[DONE]":
                    self.final = True
            elif line.startswith(b"event:") and line[6:].strip() in (b"response.completed", b"message_stop"):
                self.final = True
        self._buf = buf[start:] if start < len(buf) else b""
        if len(self._buf) > (16 << 20):  # a pathological unterminated line: stop observing it
            self._buf = b""

    def _delta(self, data: bytes) -> None:
        """Add one chat chunk's delta (content, reasoning, tool calls by index) to ``message``; a
        chunk that does not parse ends the collection (``message`` None)."""
        try:
            choices = json.loads(data)["choices"]
            if not choices:   # the usage chunk of stream_options.include_usage
                return
            choice = choices[0]
            delta = choice.get("delta") or {}
            msg = self.message
            assert msg is not None
            for key in ("content", "reasoning_content"):
                if isinstance(delta.get(key), str):
                    msg[key] = msg.get(key, "") + delta[key]
            for tc in delta.get("tool_calls") or ():
                calls = msg.setdefault("tool_calls", [])
                i = int(tc.get("index", len(calls)))
                while len(calls) <= i:
                    calls.append({"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
                fn = tc.get("function") or {}
                calls[i]["id"] = tc.get("id") or calls[i]["id"]
                calls[i]["function"]["name"] += fn.get("name") or ""
                calls[i]["function"]["arguments"] += fn.get("arguments") or ""
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        except (ValueError, KeyError, IndexError, TypeError, AttributeError, RecursionError, AssertionError):
            self.message = None

    def _parse(self, data: bytes) -> None:
        try:
            obj = json.loads(data)
        except (ValueError, RecursionError):
            return
        if isinstance(obj, dict):
            if isinstance(obj.get("timings"), dict):
                self.timings = obj["timings"]
                if obj.get("stop") is True or isinstance(obj.get("usage"), dict) or any(
                        isinstance(c, dict) and c.get("finish_reason") is not None
                        for c in (obj.get("choices") or ())):
                    self.final = True
            if isinstance(obj.get("usage"), dict):
                self.usage = obj["usage"]
            # Anthropic stream (no timings): message_start's usage has the prompt counts, the final
            # message_delta's the output count (ocache/api/convert.py timings_from_usage)
            start = obj.get("message") if obj.get("type") == "message_start" else None
            if isinstance(start, dict) and isinstance(start.get("usage"), dict):
                self._anthropic = dict(start["usage"])
            elif obj.get("type") == "message_delta" and self.timings is None and self._anthropic:
                self.timings = timings_from_usage({**self._anthropic, **(self.usage or {})})
            if obj.get("type") in ("response.completed", "message_stop"):
                self.final = True
            if obj.get("type") == "response.completed" and self.message is not None:
                self.message = responses_message(obj.get("response"))
                # a Responses answer does not say whether the model ended it: its status is
                # "completed" after an end of turn and after a token limit alike
                # (tools/server/server-task.cpp:689-699 of the pinned source)
                self.finish_reason = None


def responses_message(response: object) -> dict | None:
    """The chat-shaped assistant message of a Responses answer (``response.output`` of its
    ``response.completed`` event, tools/server/server-task.cpp:600-686): the ``output_text`` of its
    ``message`` items as ``content``, its ``function_call`` items as ``tool_calls``, a ``reasoning``
    item's text as ``reasoning_content``; None when ``response`` has no output list."""
    out = response.get("output") if isinstance(response, dict) else None
    if not isinstance(out, list):
        return None
    msg: dict = {"role": "assistant", "content": ""}
    for item in out:
        if not isinstance(item, dict):
            return None
        kind = item.get("type")
        if kind == "message":
            msg["content"] += "".join(p.get("text", "") for p in item.get("content") or ()
                                      if isinstance(p, dict) and p.get("type") == "output_text")
        elif kind == "function_call":
            msg.setdefault("tool_calls", []).append({
                "id": item.get("call_id", ""), "type": "function",
                "function": {"name": item.get("name", ""), "arguments": item.get("arguments", "")}})
        elif kind == "reasoning":
            parts = item.get("content") or ()
            if parts and isinstance(parts[0], dict):
                msg["reasoning_content"] = parts[0].get("text", "")
    return msg


def content_of(path: str, obj: dict) -> str | None:
    """The assistant text of a completion answer (native ``content``, chat ``message.content``,
    text ``text``), or None when it has none of them."""
    try:
        if path == "/completion":
            return obj.get("content")
        choice = obj["choices"][0]
        if "message" in choice:
            return choice["message"].get("content")
        return choice.get("text")
    except (KeyError, IndexError, TypeError, AttributeError):
        return None


def observe_json(path: str, data: bytes, obs: Observation) -> None:
    """Fill ``obs`` from a JSON answer read whole: ``timings``, ``usage`` (an Anthropic answer
    carries usage only: its timings are derived, ocache/api/convert.py), and for a 200 the
    assistant text. A body that is not a JSON object leaves ``obs`` as it is."""
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return
    if not isinstance(obj, dict):
        return
    if isinstance(obj.get("timings"), dict):
        obs.timings = obj["timings"]
    if isinstance(obj.get("usage"), dict):
        obs.usage = obj["usage"]
        if obs.timings is None:  # an Anthropic answer carries usage only
            obs.timings = timings_from_usage(obs.usage)
    if obs.status == 200:
        obs.content = content_of(path, obj)
        # the chat answer as relayed, for the aligned route (ocache/cache/align_route.py)
        choices = obj.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices else None
        if isinstance(choice, dict) and isinstance(choice.get("message"), dict):
            obs.message, obs.finish_reason = choice["message"], choice.get("finish_reason")
        elif obj.get("object") == "response":   # a Responses answer (no finish reason: see SSEObserver)
            obs.message, obs.finish_reason = responses_message(obj), None


def collects(layer: object, path: str) -> bool:
    """Whether a streamed chat or Responses answer's message is collected for the layer (its
    ``wants_message``: the aligned route is on; a Responses answer for the continued route's
    compactions without tools, ocache/cache/routes/continued.py)."""
    return bool(getattr(layer, "wants_message", False)) and path in (
        "/v1/chat/completions", "/chat/completions", "/v1/responses", "/responses")


async def relay_stream(request: web.Request, up_resp: aiohttp.ClientResponse,
                       headers: CIMultiDict[str], obs: Observation, t0: float,
                       observer: SSEObserver | None, *, idle_s: float | None = None,
                       rewriter: figures.LineRewriter | None = None,
                       on_upstream_failed: Callable[[], None] | None = None) -> web.StreamResponse:
    """Relay the body of ``up_resp`` to the client chunk by chunk as it arrives (``t0``: the
    request's receipt, ``time.perf_counter()`` seconds, for ``obs.ttft_s``). Between chunks the
    upstream's silence is bounded by the request's ``sock_read``; ``idle_s``: also by a per-chunk
    timer of that many seconds, applied to an SSE answer only (``stream_idle_timeout_s`` for an
    answer to a request whose body did not say ``"stream": true``, so whose ``sock_read`` is the
    longer read timeout). ``rewriter``: corrects the reuse figures line by line
    (ocache/api/figures.py); the observer still reads the server's. An upstream that fails
    mid-answer (an aiohttp client error, a timeout) closes the client's connection without a clean
    end and calls ``on_upstream_failed``; a client that went away raises from the write (not
    caught here)."""
    sse = observer is not None or headers.get("Content-Type", "").startswith("text/event-stream")
    resp = web.StreamResponse(status=up_resp.status, reason=up_resp.reason, headers=headers)
    if sse:
        resp.headers["X-Accel-Buffering"] = "no"
    elif up_resp.content_length is not None:
        resp.content_length = up_resp.content_length
    await resp.prepare(request)
    chunks = up_resp.content.iter_any()
    idle = idle_s if sse else None
    try:
        while True:
            try:
                if idle is None:
                    chunk = await chunks.__anext__()
                else:
                    async with asyncio.timeout(idle):
                        chunk = await chunks.__anext__()
            except StopAsyncIteration:
                break
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                # The upstream died, hung (stream_idle_timeout_s) or sent invalid framing
                # mid-response: end the client's connection without a clean end-of-stream so
                # it cannot mistake a truncated answer for a complete one.
                log.warning("[%s] upstream failed mid-response: %s", headers.get("X-OCache-Request-Id"),
                            "no chunk in time (stream_idle_timeout_s / upstream_read_timeout_s)"
                            if isinstance(exc, asyncio.TimeoutError)
                            else f"{type(exc).__name__}: {exc}")
                if on_upstream_failed is not None:
                    on_upstream_failed()
                if request.transport is not None:
                    request.transport.close()
                return resp
            out = rewriter.feed(chunk) if rewriter is not None else chunk
            try:
                if out:
                    await resp.write(out)  # a client that went away raises here (not caught)
            finally:
                # observed even when the client left during this write: it is what the server
                # did (Codex CLI closes right after response.completed, the chunk with timings);
                # the server's own figures, for the cache layer
                if observer is not None:
                    observer.feed(chunk)
            if obs.ttft_s is None:
                first = time.perf_counter() if observer is None else observer.first_at
                if first is not None:
                    obs.ttft_s = first - t0
            if observer is not None and observer.final and (rewriter is None or not rewriter.holding):
                # the final event was written: complete, even if the client closes now
                obs.completed = True
    finally:
        if observer is not None:
            obs.timings, obs.usage = observer.timings, observer.usage
            if observer.message is not None:   # the aligned route's record of the answer
                obs.message, obs.finish_reason = observer.message, observer.finish_reason
    if rewriter is not None and rewriter.holding:
        await resp.write(rewriter.flush())
    await resp.write_eof()
    obs.completed = True
    return resp

