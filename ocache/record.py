"""Request-stream recording (``ocache serve --record DIR [--redact]``), and reading it back.

Prompts are private data, so recording is off by default. When on, the proxy calls
:meth:`Recorder.record` once per completion request, after the response, with what it parsed, what
the cache layer planned and what happened upstream. Each proxy process appends to its own file
``DIR/stream-<UTC time>-<pid>.jsonl`` (one JSON object per line); the folder is created with mode
0700 and the file with mode 0600. ``ocache bench --recording FILE`` replays such a file
(:mod:`ocache.bench.replay`), keeping the order and the gaps between requests.

A line (schema version 1)::

    {"v": 1, "seq": 0, "t": 12.345,                 # seq: 0.. per file; t: seconds since the
                                                    #   recorder started, at request receipt
     "wall": "2026-11-29T10:00:00.123Z", "request_id": "...",
     "method": "POST", "path": "/v1/chat/completions", "stream": true, "session": "ses_...",
     "headers": {"user-agent": "...", "x-session-affinity": "..."},   # an allow-list, never auth
     "body": {...},                                 # the client's JSON body (redacted: see below)
     "plan": {"body_updates": {"id_slot": 1}, "headers": {"X-OCache-Tier": "disk", ...}},
     "obs": {"status": 200, "completed": true, "ttft_s": 0.41, "total_s": 2.3,
             "timings": {"prompt_n": 37, "cache_n": 7169, ...}, "usage": {...},
             "content": "..."},                     # redacted: {"chars": N}
     "redacted": false}

``--redact`` keeps the structure and every count (message roles and order, number of tools,
``timings``/``usage`` token counts, lengths of every text in characters) but drops all text: every
string in the body except a few structural keys (``role``, ``type``, ``model``, ``tool_choice``,
``finish_reason``) becomes ``{"redacted": true, "chars": N, "h": <16 hex>}``. ``h`` is a keyed hash
(xxh3-64 with a random key held only in memory for the life of the recorder), so equal texts within
one file can be recognised as equal — enough to see where two requests diverge — while a guessed
text cannot be confirmed from the file. A redacted stream cannot be replayed (the text is gone);
:func:`read_stream` says so.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import secrets
import threading
import time
from pathlib import Path
from typing import Any, Iterator, TextIO

import xxhash

from ocache.config import field_of as _field

log = logging.getLogger("ocache.record")

SCHEMA_VERSION = 1

#: Request headers worth keeping for a replay (session affinity, client identity). Authorization,
#: cookies and anything else are never written.
KEEP_HEADERS = ("user-agent", "x-session-affinity", "x-session-id", "content-type",
                # Claude Code (/v1/messages) and Codex CLI (/v1/responses): session ids, API version
                "x-claude-code-session-id", "session-id", "thread-id", "anthropic-version",
                "anthropic-beta")
#: Kept headers that carry a session id (hashed by ``--redact``, like ``session``).
SESSION_HEADERS = frozenset({"x-session-affinity", "x-session-id", "x-claude-code-session-id",
                             "session-id", "thread-id"})

#: Body keys whose string values are structure, not user text (kept by ``--redact``).
STRUCTURAL_KEYS = frozenset({"role", "type", "model", "tool_choice", "finish_reason", "object"})


class RecordError(ValueError):
    """A recording cannot be read or replayed (bad line, unknown schema, redacted text)."""


def _redact_value(value: Any, key: str | None, hkey: bytes) -> Any:
    if isinstance(value, str):
        if key in STRUCTURAL_KEYS:
            return value
        h = xxhash.xxh3_64_hexdigest(hkey + value.encode("utf-8", "surrogatepass"))
        return {"redacted": True, "chars": len(value), "h": h}
    if isinstance(value, dict):
        return {k: _redact_value(v, k, hkey) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact_value(v, key, hkey) for v in value]
    return value


def redact(body: Any, key: bytes = b"") -> Any:
    """A copy of a JSON value with every non-structural string replaced by its length and a keyed
    hash (see the module docstring). Numbers, booleans, nulls, keys and list lengths are kept."""
    return _redact_value(body, None, key)


class Recorder:
    """Appends one JSON line per completion request to ``DIR/stream-<time>-<pid>.jsonl``.

    ``directory`` is created (parents too) with mode 0700 and re-chmodded to 0700 if it existed;
    the file is opened lazily on the first record with mode 0600. ``redact`` drops all text (module
    docstring). :meth:`record` never raises: a write failure (disk full, folder removed) is logged,
    counted in ``errors``, and serving goes on. Thread-safe; each call is one ``write`` + ``flush``
    of a single line (no fsync: a crash may lose the last lines, never corrupt earlier ones).
    """

    def __init__(self, directory: str | os.PathLike, redact: bool = False) -> None:
        self.directory = Path(directory).expanduser()
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.directory, 0o700)
        self.redact = redact
        self._key = secrets.token_bytes(16) if redact else b""
        stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
        self.path = self.directory / f"stream-{stamp}-{os.getpid()}.jsonl"
        self._t0 = time.monotonic()
        self._lock = threading.Lock()
        self._fh: TextIO | None = None
        self.seq = 0
        self.errors = 0

    def _open(self) -> TextIO:
        if self._fh is None:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            self._fh = os.fdopen(fd, "a", encoding="utf-8")
        return self._fh

    def entry(self, req: Any, plan: Any, obs: Any, t_received: float | None = None) -> dict:
        """The JSON object :meth:`record` writes (without ``seq``).

        ``req``: a ``ParsedRequest``; ``plan``: a ``Plan`` or None (the layer failed); ``obs``: an
        ``Observation``; ``t_received``: ``time.monotonic()`` at request receipt (default: now minus
        ``obs.total_s``).
        """
        total_s = float(_field(obs, "total_s") or 0.0)
        if t_received is None:
            t_received = time.monotonic() - total_s
        headers = {k.lower(): v for k, v in dict(getattr(req, "headers", {}) or {}).items()}
        kept = {k: headers[k] for k in KEEP_HEADERS if k in headers}
        plan_d = {}
        if plan is not None:
            plan_d = {"body_updates": dict(_field(plan, "body_updates") or {}),
                      "headers": dict(_field(plan, "headers") or {})}
        body = getattr(req, "body", None)
        content = _field(obs, "content")
        obs_out = {k: _field(obs, k) for k in ("status", "completed", "ttft_s", "total_s",
                                                "timings", "usage")}
        session = getattr(req, "session_hint", None) or next(
            (headers[k] for k in KEEP_HEADERS if k in SESSION_HEADERS and headers.get(k)), None)
        if self.redact:
            body = redact(body, self._key)
            plan_d = redact(plan_d, self._key)
            # session ids are pseudonymous, but still hash them so files cannot be joined
            kept = {k: (redact(v, self._key) if k in SESSION_HEADERS else v)
                    for k, v in kept.items()}
            obs_out["content"] = None if content is None else {"chars": len(content)}
            session = redact(session, self._key) if session else None
        else:
            obs_out["content"] = content
        return {
            "v": SCHEMA_VERSION,
            "t": round(t_received - self._t0, 6),
            "wall": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds"),
            "request_id": getattr(req, "request_id", None),
            "method": getattr(req, "method", "POST"),
            "path": getattr(req, "path", None),
            "stream": bool(getattr(req, "stream", False)),
            "session": session,
            "headers": kept,
            "body": body,
            "plan": plan_d,
            "obs": obs_out,
            "redacted": self.redact,
        }

    def record(self, req: Any, plan: Any, obs: Any, t_received: float | None = None) -> bool:
        """Append one request; return True if written, False if it failed (logged, counted)."""
        try:
            entry = self.entry(req, plan, obs, t_received)
            with self._lock:
                entry = {"seq": self.seq, **entry}
                line = json.dumps(entry, ensure_ascii=False, separators=(",", ":")) + "\n"
                fh = self._open()
                fh.write(line)
                fh.flush()
                self.seq += 1
            return True
        except Exception as exc:  # recording must never break serving
            self.errors += 1
            log.warning("recording request %s to %s failed: %s",
                        getattr(req, "request_id", "?"), self.path, exc)
            return False

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                try:
                    self._fh.close()
                finally:
                    self._fh = None


def iter_stream(path: str | os.PathLike) -> Iterator[dict]:
    """Yield the entries of one recording file in order. Raises RecordError on a malformed line
    (naming the file and line number) or an unknown schema version. A truncated last line (the
    process died mid-write) is skipped with a warning."""
    p = Path(path)
    lines = p.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as exc:
            if i == len(lines):
                log.warning("%s:%d: truncated last line skipped (%s)", p, i, exc)
                return
            raise RecordError(f"{p}:{i}: not a JSON line ({exc})") from None
        if not isinstance(entry, dict) or entry.get("v") != SCHEMA_VERSION:
            raise RecordError(f"{p}:{i}: unknown recording schema "
                              f"{entry.get('v') if isinstance(entry, dict) else type(entry).__name__}"
                              f" (this ocache reads version {SCHEMA_VERSION})")
        yield entry


def stream_files(path: str | os.PathLike) -> list[Path]:
    """The recording files at ``path``: the file itself, or every ``stream-*.jsonl`` in a folder
    (sorted by name, i.e. by start time). Raises RecordError if there are none."""
    p = Path(path).expanduser()
    if p.is_dir():
        files = sorted(p.glob("stream-*.jsonl"))
    elif p.is_file():
        files = [p]
    else:
        raise RecordError(f"no recording at {p}")
    if not files:
        raise RecordError(f"no stream-*.jsonl files in {p}")
    return files


def read_stream(path: str | os.PathLike, replayable: bool = True) -> list[dict]:
    """All entries of a recording file or folder, in order. With ``replayable`` (the default),
    raises RecordError for a redacted recording (its text is gone) or an entry without a body."""
    out: list[dict] = []
    for f in stream_files(path):
        for entry in iter_stream(f):
            if replayable and entry.get("redacted"):
                raise RecordError(f"{f}: recorded with --redact; the prompts were not kept, so it "
                                  "cannot be replayed (its counts can still be read)")
            if replayable and not isinstance(entry.get("body"), dict):
                raise RecordError(f"{f}: entry seq={entry.get('seq')} has no JSON body to replay")
            out.append(entry)
    return out
