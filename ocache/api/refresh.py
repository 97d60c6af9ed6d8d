"""A stored answer made fresh for a replay (the response cache, ``ocache/response_cache.py``): new
ids and timestamps, and figures that say nothing was prefilled or decoded for it.

What changes, in every JSON object of the answer (a non-streamed body, or each SSE ``data:`` line),
at any depth; everything else is the stored answer's:

* **ids**: the string value of an ``id``, ``item_id``, ``call_id`` or ``tool_call_id`` key. The
  server builds them as a prefix plus a random part (``chatcmpl-``, ``resp_``, ``rs_``, ``msg_``,
  ``fc_`` + a tool call id, and the tool call ids themselves: tools/server/server-task.cpp:153-155,
  541-583, 1175-1279 of the pinned source). The random part after the last ``-`` or ``_`` is
  replaced by a new one of the same length, the same old part always by the same new part within
  one replay, so ``fc_X`` and ``call_id: X`` still name one tool call. Integer ``id`` values (token
  ids of ``n_probs`` entries) are never touched.
* **timestamps**: a number under ``created``, ``created_at`` or ``completed_at`` (seconds since the
  epoch, server-task.cpp:395, 582) becomes the replay's ``int(time.time())``.
* **figures**: a ``timings`` object says 0 prompt tokens prefilled (``prompt_n`` 0, ``prompt_ms``
  0) and the whole prompt reused (``cache_n`` = ``n_prompt``), and 0 decoded (``predicted_n`` and
  ``predicted_ms`` 0; the per-token and per-second rates 0); a ``usage`` object keeps its token
  counts (the answer still has them: ``completion_tokens``, ``output_tokens``) but reports the whole
  prompt as cached (``prompt_tokens_details.cached_tokens``, ``input_tokens_details.cached_tokens``
  = the prompt) and, in an Anthropic usage (``cache_read_input_tokens`` present, or on
  ``/v1/messages``), ``input_tokens`` 0 and ``cache_read_input_tokens`` the prompt
  (server-task.cpp:787-790 counts ``input_tokens`` as the prompt minus the cache).

The result is re-encoded compactly (``separators=(",", ":")``, UTF-8 kept as is), as the server's
``json::dump()`` writes it; a line that is not a JSON object is kept byte for byte.
"""

from __future__ import annotations

import json
import secrets
import string
import time
from typing import Any

ID_KEYS = frozenset({"id", "item_id", "call_id", "tool_call_id"})
TIME_KEYS = frozenset({"created", "created_at", "completed_at"})
_ALPHABET = string.ascii_letters + string.digits


class Fresh:
    """One replay's rewriting: ``n_prompt`` (tokens of the request's prompt), ``anthropic`` (the
    answer's ``usage`` is Anthropic's), ``now`` (the replay's timestamp, seconds). The id map is
    kept for the whole replay (every line of one stream)."""

    def __init__(self, n_prompt: int, anthropic: bool = False, now: int | None = None) -> None:
        self.n_prompt = int(n_prompt)
        self.anthropic = anthropic
        self.now = int(time.time()) if now is None else int(now)
        self.ids: dict[str, str] = {}

    def _new_id(self, old: str) -> str:
        cut = max(old.rfind("-"), old.rfind("_")) + 1
        head, rand = old[:cut], old[cut:]
        if not rand:
            return old
        new = self.ids.get(rand)
        if new is None:
            new = self.ids[rand] = "".join(secrets.choice(_ALPHABET) for _ in rand)
        return head + new

    def timings(self, t: dict) -> dict:
        """A ``timings`` object as the replay reports it (a new dict)."""
        out = {k: v for k, v in t.items() if k != "ocache_generated"}   # ocache's own (patches/0010)
        for k, v in (("prompt_n", 0), ("prompt_ms", 0.0), ("cache_n", self.n_prompt),
                     ("predicted_n", 0), ("predicted_ms", 0.0)):
            if k in out:
                out[k] = v
        for k in ("prompt_per_token_ms", "prompt_per_second", "predicted_per_token_ms",
                  "predicted_per_second"):
            if k in out:
                out[k] = 0.0
        return out

    def _usage(self, u: dict) -> dict:
        out = {k: self.value(k, v) for k, v in u.items()}
        if self.anthropic or "cache_read_input_tokens" in out:
            if "input_tokens" in out:
                out["input_tokens"] = 0
            out["cache_read_input_tokens"] = self.n_prompt
            return out
        for details, total in (("prompt_tokens_details", "prompt_tokens"),
                               ("input_tokens_details", "input_tokens")):
            if isinstance(out.get(details), dict) and "cached_tokens" in out[details]:
                out[details] = {**out[details], "cached_tokens": out.get(total, self.n_prompt)}
        return out

    def value(self, key: str | None, v: Any) -> Any:
        """``v`` (found under ``key``) as the replay sends it."""
        if isinstance(v, dict):
            if key == "timings":
                return self.timings(v)
            if key == "usage":
                return self._usage(v)
            return {k: self.value(k, x) for k, x in v.items()}
        if isinstance(v, list):
            return [self.value(None, x) for x in v]
        if key in ID_KEYS and isinstance(v, str):
            return self._new_id(v)
        if key in TIME_KEYS and isinstance(v, (int, float)) and not isinstance(v, bool):
            return self.now
        return v

    def body(self, data: bytes) -> bytes:
        """A non-streamed JSON answer made fresh (kept as is when it is not a JSON object)."""
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return data
        if not isinstance(obj, dict):
            return data
        return _dump(self.value(None, obj))

    def stream(self, data: bytes) -> bytes:
        """A recorded SSE answer made fresh, line by line: each ``data:`` line holding a JSON object
        is rewritten, every other line (``event:``, ``data: [DONE]``, blank) kept byte for byte."""
        out = []
        for line in data.split(b"\n"):
            if line.startswith(b"data:"):
                payload = line[5:]
                text = payload.strip()
                if text.startswith(b"{"):
                    fresh = self.body(text)
                    if fresh is not text:
                        lead = payload[: len(payload) - len(payload.lstrip())]
                        line = b"data:" + lead + fresh + payload[len(payload.rstrip()):]
            out.append(line)
        return b"\n".join(out)


def _dump(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")
