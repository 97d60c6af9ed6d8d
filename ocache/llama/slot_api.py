"""llama-server's slot endpoints over HTTP: ``GET /slots``, ``POST /slots/{id}?action=save|restore|
erase``, the warm-up's ``POST /completion`` and ``GET /health`` (docs/llama-server.md §4, §5, §13; the
§ numbers below refer to that file), with the errors they answer mapped to exceptions.

:class:`SlotClient` sends the calls and reads their answers; it holds no belief about what a slot
holds: the slot table (``ocache/slots.py``, the only writer of slot state) calls it and records
what each answer means. Every call passes :meth:`SlotClient.request` (tests answer that one method
from memory, ``tests/fakes.py``), which counts the calls in flight for a planned stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
from typing import Any, Mapping, Sequence

import aiohttp

#: response header of the patched llama-server naming its process: 16 hex digits drawn at start,
#: sent with every answer (patches/0005-health-boot-id.patch)
BOOT_HEADER = "X-Llama-Server-Boot"
#: a request header naming the process a request was planned for: the patched build refuses the
#: request with 412 before any work when it is another process (patches/0007-if-boot-precondition.patch)
IF_BOOT_HEADER = "X-Llama-Server-If-Boot"
#: seconds :meth:`SlotTable.same_process` waits for ``GET /health`` (answered at once by a live
#: server, without the task queue); past it the caller falls back to ``GET /slots``
BOOT_CHECK_TIMEOUT_S = 2.0


# what llama-server's answers mean (read by ocache/upstream.py and the setup checks)

def json_or_none(data: bytes) -> Any:
    """``data`` as JSON, or None when it is not."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return None


def is_loading(obj: Any) -> bool:
    """llama-server's 503 while it loads: ``{"error": {"message": "Loading model", "type":
    "unavailable_error", "code": 503}}`` (tools/server/server-http.cpp:307-327)."""
    err = obj.get("error") if isinstance(obj, dict) else None
    return isinstance(err, dict) and (err.get("message") == "Loading model"
                                      or err.get("type") == "unavailable_error")


def is_llama_props(props: Any) -> bool:
    """Whether ``props`` (a ``GET /props`` answer) is llama-server's."""
    return isinstance(props, dict) and ("build_info" in props or "total_slots" in props
                                        or "default_generation_settings" in props)


# ----------------------------------------------------------------------------------------------
# errors


class SlotError(RuntimeError):
    """A slot call failed. ``status``: HTTP status (0 = transport error); ``type``/``message``:
    llama-server's error body ``{"error":{"code","message","type"}}`` (server-common.cpp:36-78)."""

    def __init__(self, message: str, status: int = 0, type: str | None = None, slot: int | None = None):
        super().__init__(message)
        self.status = status
        self.type = type
        self.slot = slot


class SlotNotSupported(SlotError):
    """501: the server runs without ``--slot-save-path`` (save/restore/erase are off, docs/llama-server.md §3)
    or without the ``/slots`` endpoint (``--no-slots``)."""


class SlotFileError(SlotError):
    """400 on save/restore: invalid filename, or the file could not be restored (missing, corrupt,
    another model, does not fit). **After a failed restore the slot is erased** (docs/llama-server.md §5)."""


class SlotHashMismatch(SlotFileError):
    """400 from a server that checked the restore's ``xxh3`` (patches/0006) and found the file's
    bytes differ (or could not read them for the check): the file is damaged; the slot is untouched
    (the check runs before the restore is queued)."""


class SlotInvalid(SlotError):
    """400 ``Invalid slot ID`` / ``Invalid action``, or a slot id outside the table."""


class UpstreamError(SlotError):
    """The server answered with an unexpected status (5xx, 503 while loading) or not at all."""


def file_refused(exc: BaseException) -> bool:
    """True when a failed restore means the *file* is bad (delete the entry), False when the server
    could not be asked or failed for another reason (keep it: the file is still valid).

    Only the server's own answer about the file counts: ``SlotFileError`` (400 ``Unable to restore
    slot: ...`` from the patched pre-check or the stock restore, 400 ``Invalid filename``;
    docs/llama-server.md §5). A refused or reset connection, a timeout (``UpstreamError`` with status 0: llama-server
    killed or restarting), a 5xx/503 (loading), ``SlotInvalid`` and ``SlotNotSupported`` say
    nothing about the file."""
    return isinstance(exc, SlotFileError)


def error_from_response(status: int, body: Any, slot: int | None, what: str) -> SlotError:
    """Map a llama-server error response to the matching ``SlotError`` subclass (docs/llama-server.md §5 table)."""
    err = body.get("error") if isinstance(body, dict) else None
    msg = (err or {}).get("message") if isinstance(err, dict) else None
    typ = (err or {}).get("type") if isinstance(err, dict) else None
    text = f"{what} slot {slot}: HTTP {status}: {msg or body!r}"
    if status == 501:
        return SlotNotSupported(text, status, typ, slot)
    if status == 400 and msg and ("slot ID" in msg or "Invalid action" in msg):
        return SlotInvalid(text, status, typ, slot)
    if status == 400 and msg and ("slot file hash mismatch" in msg or "for its hash check" in msg):
        return SlotHashMismatch(text, status, typ, slot)
    if status == 400 and msg and ("filename" in msg or "restore" in msg):
        return SlotFileError(text, status, typ, slot)
    if status == 500 and msg and "Unable to save slot" in msg:
        return SlotFileError(text, status, typ, slot)
    return UpstreamError(text, status, typ, slot)


def check_filename(filename: str) -> None:
    """The subset of ``fs_validate_filename`` (common.cpp:796-868) that ocache's own names could
    break; the server checks the rest (400 ``Invalid filename`` -> SlotFileError)."""
    bad = set(':*?"<>|/\\')
    if (not filename or len(filename.encode()) > 255 or any(c in bad or ord(c) < 32 for c in filename)
            or ".." in filename or filename.endswith(".") or filename != filename.strip(" ")):
        raise SlotFileError(f"invalid slot file name {filename!r}", 400)


class TaskIds:
    """The highest ``id_task`` each slot reported in ``GET /slots``: within one server process it
    only grows and never disappears (``task_prev`` is kept, tools/server/server-context.cpp
    ``server_slot::to_json``), so a slot that loses or lowers it is on a new process."""

    def __init__(self) -> None:
        self.ids: dict[int, int] = {}

    def record(self, data: Sequence[Mapping], restarted: bool = False) -> bool:
        """Whether ``data`` (a ``GET /slots`` answer) comes from a new process: ``restarted`` (known
        otherwise, e.g. by its boot id) or a slot's ``id_task`` vanished or went back since the
        last answer. Records the ids either way (from scratch after a restart)."""
        seen = {int(e.get("id", -1)): e.get("id_task") for e in data}
        back = restarted or any(sid in self.ids and (t is None or int(t) < self.ids[sid])
                                for sid, t in seen.items())
        if back:
            self.ids.clear()
        for sid, t in seen.items():
            if t is not None:
                self.ids[sid] = max(int(t), self.ids.get(sid, -1))
        return back

    def clear(self) -> None:
        self.ids.clear()


class SlotClient:
    """The slot HTTP calls to one llama-server: ``session``/``base_url`` (an aiohttp session and
    ``http://host:port``), ``headers`` (e.g. ``Authorization`` for ``--api-key``), ``timeout_s``:
    the limit of a call (seconds; a restore of a large file reads it first).

    ``calls_inflight``: calls sent and not answered yet; a planned stop waits for them before
    llama-server gets SIGTERM (:meth:`wait_calls`)."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, *,
                 headers: Mapping[str, str] | None = None, timeout_s: float = 3600.0) -> None:
        self.session = session
        self.base_url = base_url.rstrip("/")
        self.headers = dict(headers or {})
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.calls_inflight = 0
        self._calls_idle = asyncio.Event()
        self._calls_idle.set()

    async def get_slots(self, meta: dict | None = None) -> list[dict]:
        """``GET /slots`` (docs/llama-server.md §4): one dict per slot; ``meta["boot"]``: the
        answering process's boot id (patches/0005) or None. Raises SlotNotSupported (501,
        ``--no-slots``) or UpstreamError."""
        status, body = await self.request("GET", "/slots", what="GET /slots", meta=meta)
        if status != 200 or not isinstance(body, list):
            raise error_from_response(status, body, None, "GET /slots")
        return body

    async def action(self, slot: int, action: str, body: dict | None) -> dict:
        """``POST /slots/{slot}?action=...`` (save, restore, erase; docs/llama-server.md §5): the
        answer's JSON. Raises the ``SlotError`` subclass of the answer (``error_from_response``)."""
        status, data = await self.request("POST", f"/slots/{slot}?action={action}", json_body=body,
                                          slot=slot, what=action)
        if status != 200 or not isinstance(data, dict):
            raise error_from_response(status, data, slot, action)
        return data

    async def complete(self, slot: int, body: dict) -> dict:
        """``POST /completion`` pinned to ``slot`` (the warm-up, docs/llama-server.md §13): the
        answer's JSON. Raises the ``SlotError`` of the answer (e.g. 400 ``exceed_context_size_error``)."""
        status, data = await self.request("POST", "/completion", json_body=body, slot=slot, what="warm")
        if status != 200 or not isinstance(data, dict):
            raise error_from_response(status, data, slot, "warm")
        return data

    async def health_boot(self) -> str | None:
        """``GET /health`` within ``BOOT_CHECK_TIMEOUT_S``: the answering process's boot id
        (``BOOT_HEADER``, patches/0005), None from a stock build or a status other than 200.
        llama-server answers it on its HTTP thread without the task queue
        (tools/server/server-context.cpp ``get_health``). Raises SlotError, asyncio.TimeoutError."""
        meta: dict = {}
        status, _ = await self.request("GET", "/health", what="GET /health", meta=meta,
                                       timeout=aiohttp.ClientTimeout(total=BOOT_CHECK_TIMEOUT_S))
        return meta.get("boot") if status == 200 else None

    async def wait_calls(self, timeout_s: float) -> int:
        """Wait until no slot call is in flight, at most ``timeout_s`` seconds; returns how many
        still are (0 when none)."""
        if self.calls_inflight:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._calls_idle.wait(), timeout_s)
        return self.calls_inflight

    async def request(self, method: str, path: str, *, json_body: Any = None, slot: int | None = None,
                      what: str = "slot call", meta: dict | None = None,
                      timeout: aiohttp.ClientTimeout | None = None) -> tuple[int, Any]:
        """Every slot call's one way to the server: ``method path`` with ``json_body``, counted in
        ``calls_inflight`` until answered; ``(HTTP status, JSON body)`` (a body that is not JSON as
        ``{"error": {"message": its first 500 characters}}``); ``meta["boot"]``: the answer's
        ``BOOT_HEADER`` (None from a stock build). ``what``/``slot`` name the call in errors.
        Raises UpstreamError (status 0) when no answer came."""
        self.calls_inflight += 1
        self._calls_idle.clear()
        try:
            return await self._request_once(method, path, json_body=json_body, slot=slot, what=what,
                                            meta=meta, timeout=timeout)
        finally:
            self.calls_inflight -= 1
            if self.calls_inflight <= 0:
                self.calls_inflight = 0
                self._calls_idle.set()

    async def _request_once(self, method: str, path: str, *, json_body: Any = None, slot: int | None = None,
                            what: str = "slot call", meta: dict | None = None,
                            timeout: aiohttp.ClientTimeout | None = None) -> tuple[int, Any]:
        """One slot call (retried once on a dead keep-alive connection): ``(status, JSON body)``;
        ``meta["boot"]`` gets the answer's ``BOOT_HEADER`` (None from a stock build)."""
        url = self.base_url + path
        for attempt in (0, 1):
            try:
                async with self.session.request(method, url, json=json_body, headers=self.headers,
                                                timeout=timeout or self.timeout) as resp:
                    if meta is not None:
                        meta["boot"] = resp.headers.get(BOOT_HEADER)
                    try:
                        body = await resp.json(content_type=None)
                    except (ValueError, aiohttp.ContentTypeError):
                        body = {"error": {"message": (await resp.text())[:500]}}
                    return resp.status, body
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientConnectionResetError) as exc:
                # llama-server closes idle keep-alive connections; a pooled one can be dead before
                # the request is read. Every slot call is safe to send again (save/restore/erase
                # replace state, a warm-up prefills the same tokens), so retry once.
                if attempt == 0:
                    continue
                raise UpstreamError(f"{what} {method} {path}: {exc!r}", 0, None, slot) from exc
            except aiohttp.ClientOSError as exc:
                # the same dead keep-alive connection, seen as ECONNRESET/EPIPE on the send (seen
                # once: ClientOSError(104, 'Connection reset by peer') on a spill's save in
                # tests/test_hardening_cache.py on a loaded machine)
                if attempt == 0 and exc.errno in (errno.ECONNRESET, errno.EPIPE):
                    continue
                raise UpstreamError(f"{what} {method} {path}: {exc!r}", 0, None, slot) from exc
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                raise UpstreamError(f"{what} {method} {path}: {exc!r}", 0, None, slot) from exc
        raise AssertionError("unreachable")
