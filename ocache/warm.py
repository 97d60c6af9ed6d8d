"""Warming a project folder's head into a slot before its first turn: the folder journal and the
``POST /v1/cache/warm`` route (the ``ocache warm DIR`` command, ``ocache/commands/warm.py``, calls it;
README "Commands").

The *folder head* is everything an agent's first request in that folder shares with the next one:
tools + the whole system message (harness head, ``<env>`` with the folder and date, AGENTS.md
instructions, skills) + the template's glue, up to where the first user message starts. To rebuild
it, ocache keeps a small **folder journal** under the cache directory (mode 0700, one file of mode
0600 per folder): for the last agent request seen in each folder, its ``tools``, its system
message(s) and the few top-level fields that change the rendering (``tool_choice``,
``chat_template_kwargs``, ``reasoning_format``, ``parallel_tool_calls``, ``model``). User and
assistant messages are never written: no prompt is logged. The system message does contain the
folder path and the AGENTS.md text the client sent; that is why the journal is private (0700).

The folder comes from the request's system text: opencode's ``<env>`` block (``Working directory:
/abs/path``) or pi's ``Current working directory: /abs/path`` (see ``shared/fixtures``).

Warming (``warm_folder``): render the journaled head with a placeholder user turn, tokenize it
(``ocache.tokens``), cut at the user turn's start, then restore the longest anchor the disk tier
has for it; if that does not cover the whole head, prefill the rest (``/completion`` with
``n_predict: 0``) and save it as an anchor. Progress is reported stage by stage.

The running ocache serves it at ``POST /v1/cache/warm`` with body ``{"dir": "/abs/path"}``; the
answer is ``application/x-ndjson``: one JSON object per stage (``{"stage": "render", ...}``), the
last one ``{"done": true, "slot": n, "tokens": n, "source": "disk"|"prefill"|"resident", ...}`` or
``{"done": true, "error": "..."}``. An unknown folder answers 404, a ``dir`` that is not an absolute
path (or holds a NUL byte) 400, both at once in ocache's error shape (``ocache/admin.py``).
The handler is :func:`make_warm_handler`; the proxy mounts it (admin route).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping

import xxhash

from ocache import admin

log = logging.getLogger(__name__)

#: Lines that name the working folder in the system text (``shared/fixtures``): opencode 1.18
#: ``<env>`` block, pi 0.73 closing lines.
FOLDER_PATTERNS = (
    re.compile(r"^\s*Working directory:\s*(\S.*?)\s*$", re.M),
    re.compile(r"^\s*Current working directory:\s*(\S.*?)\s*$", re.M),
)
#: Top-level body fields kept in the journal because they change how the head renders.
RENDER_FIELDS = ("model", "tool_choice", "chat_template_kwargs", "reasoning_format", "parallel_tool_calls")
PLACEHOLDER_USER = "ocache-warm"


class NotSeenError(LookupError):
    """ocache never saw an agent request for the folder."""


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def folder_of(body: Mapping) -> str | None:
    """The working folder named in the request's system message(s), or None."""
    msgs = body.get("messages")
    if not isinstance(msgs, list):
        return None
    for m in msgs:
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer"):
            continue
        hit = _first_match(FOLDER_PATTERNS, m)
        if hit:
            return hit
    return None


def _first_match(patterns: tuple[re.Pattern[str], ...], message: Mapping) -> str | None:
    """The folder the first of ``patterns`` that matches ``message``'s text names, or None."""
    text = _text(message.get("content"))
    for pat in patterns:
        hit = pat.search(text)
        if hit:
            return hit.group(1)
    return None


#: Where Claude Code (system: "- Primary working directory: DIR") and Codex (its first user
#: message's ``<environment_context>``: ``<cwd>DIR</cwd>``) name the folder (tests/fixtures
#: ``claude_run1_agent_turn1.json``, ``codex_run1_turn1.json``); for display only (``folder_label``):
#: the journal keeps to ``FOLDER_PATTERNS``, whose heads ``ocache warm`` knows how to render.
LABEL_PATTERNS = (
    re.compile(r"^\s*-?\s*Primary working directory:\s*(\S.*?)\s*$", re.M),
    re.compile(r"<cwd>\s*(\S[^<]*?)\s*</cwd>"),
)


def folder_label(body: Mapping) -> str | None:
    """The folder a request works in, for display (``cache ls``, the dashboard's folder table):
    ``folder_of``, else a ``LABEL_PATTERNS`` match in a system/developer message or a user message
    before the first assistant turn; None when no message names one."""
    found = folder_of(body)
    msgs = body.get("messages")
    if found or not isinstance(msgs, list):
        return found
    for m in msgs:
        if not isinstance(m, dict) or m.get("role") == "assistant":
            break
        hit = _first_match(LABEL_PATTERNS, m)
        if hit:
            return hit
    return None


def normalize(folder: str) -> str:
    return os.path.normpath(folder)


def head_body(entry: Mapping) -> dict:
    """A chat body that renders the folder head followed by a placeholder user turn."""
    body = {k: entry[k] for k in RENDER_FIELDS if k in entry}
    body["tools"] = entry.get("tools") or []
    body["messages"] = list(entry["system"]) + [{"role": "user", "content": PLACEHOLDER_USER}]
    return body


class FolderJournal:
    """The folder journal: ``dir/<xxh3 of the folder>.json`` per folder (see the module docstring).

    ``dir`` is created with mode 0700. :meth:`note` is cheap when nothing changed (an in-memory hash
    per folder) and writes atomically otherwise.
    """

    def __init__(self, dir: Path) -> None:
        self.dir = Path(dir)
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.dir, 0o700)
        self._seen: dict[str, str] = {}

    def path(self, folder: str) -> Path:
        return self.dir / f"{xxhash.xxh3_64_hexdigest(normalize(folder).encode())}.json"

    def note(self, body: Mapping, fingerprint: str | None = None) -> str | None:
        """Journal an agent request's head (never its user/assistant messages). Returns the folder
        or None when the body names none."""
        folder = folder_of(body)
        if folder is None:
            return None
        folder = normalize(folder)
        system = [m for m in body.get("messages", []) if isinstance(m, dict)
                  and m.get("role") in ("system", "developer")]
        entry = {k: body[k] for k in RENDER_FIELDS if k in body}
        entry.update({"folder": folder, "tools": body.get("tools") or [], "system": system,
                      "fingerprint": fingerprint})
        digest = xxhash.xxh3_64_hexdigest(json.dumps(entry, sort_keys=True).encode())
        if self._seen.get(folder) == digest:
            return folder
        entry["seen"] = time.time()
        from ocache.tiers.store import atomic_write

        atomic_write(self.path(folder), json.dumps(entry).encode(), mode=0o600)
        self._seen[folder] = digest
        return folder

    def get(self, folder: str) -> dict:
        """The journal entry for ``folder`` (also tried with symlinks resolved). Raises NotSeenError."""
        for f in dict.fromkeys([normalize(folder), normalize(os.path.realpath(folder))]):
            try:
                return json.loads(self.path(f).read_text())
            except (OSError, ValueError):
                continue
        raise NotSeenError(f"ocache has never seen an agent request for {folder}; run one turn of the "
                           "agent there first")

    def folders(self) -> list[dict]:
        out = []
        for p in sorted(self.dir.glob("*.json")):
            try:
                e = json.loads(p.read_text())
                out.append({"folder": e["folder"], "seen": e.get("seen"), "fingerprint": e.get("fingerprint")})
            except (OSError, ValueError, KeyError):
                continue
        return out


def journal_for(config: Any = None) -> FolderJournal:
    """The folder journal under the configured cache dir (``<cache dir>/journal``, mode 0700)."""
    from ocache.paths import state_root

    cache_dir = getattr(config, "cache_dir", None)
    root = Path(cache_dir).expanduser() if cache_dir else state_root()
    return FolderJournal(root / "journal")


Progress = Callable[[dict], Awaitable[None]]


async def warm_folder(folder: str, *, journal: FolderJournal, viewer: Any, tier: Any, slots: Any,
                      slot: int, progress: Progress | None = None) -> dict:
    """Make ``slot`` hold ``folder``'s head. The caller holds the slot's lock.

    ``viewer``: an ``ocache.tokens.TokenViewer``; ``tier``: the ``DiskTier`` (may be None: prefill
    only); ``slots``: the ``SlotTable``. Returns ``{"slot", "tokens", "source", "seconds",
    "restored", "prefilled"}`` where ``source`` is ``disk`` (an anchor covered the head), ``prefill``
    (prefilled, possibly on top of a shorter anchor, then saved) or ``resident`` (already there).
    Raises NotSeenError, and whatever the view/slot calls raise.
    """
    from ocache.fingerprint import harness_head

    async def say(**kw: Any) -> None:
        if progress is not None:
            await progress(kw)

    t0 = time.monotonic()
    entry = journal.get(folder)
    await say(stage="journal", folder=entry["folder"], seen=entry.get("seen"))
    body = head_body(entry)
    try:
        view = await viewer.view("/v1/chat/completions", body, harness_head(body))
    except Exception as exc:  # noqa: BLE001
        # render + tokenize are idempotent: one retry when the connection dropped (status 0; seen
        # right after an upstream restart: a pooled keep-alive connection closed by the server)
        if getattr(exc, "status", None) != 0:
            raise
        await say(stage="retry", error=str(exc))
        view = await viewer.view("/v1/chat/completions", body, harness_head(body))
    if not view.user_starts:
        raise ValueError("the journaled head renders no user turn start")
    n = view.user_starts[-1]
    head = list(view.tokens[:n])
    await say(stage="render", tokens=n, head_end=view.head_end)
    # already resident in some slot (this one or another): nothing to do, and no second copy
    for i in ([slot] + [j for j in range(len(slots)) if j != slot] if hasattr(slots, "__len__") else [slot]):
        have = list(getattr(slots[i], "tokens", None) or []) if hasattr(slots, "__getitem__") else []
        if have[:len(head)] == head:   # the head alone, or a conversation that starts with it
            await say(stage="resident", slot=i)
            return {"slot": i, "tokens": n, "source": "resident", "seconds": time.monotonic() - t0,
                    "restored": 0, "prefilled": 0}
    restored = 0
    if tier is not None:
        offer = await tier.lookup(view, None)
        if offer is not None:
            await say(stage="restore", tokens=offer.ref.n_tokens, bytes=offer.ref.bytes)
            try:
                await tier.bring(offer, slot)
                restored = offer.ref.n_tokens
            except Exception as exc:  # noqa: BLE001 - a bad anchor is deleted; prefill instead
                await say(stage="restore_failed", error=str(exc))
    if restored >= n:
        await say(stage="restored", tokens=restored, seconds=round(time.monotonic() - t0, 3))
        return {"slot": slot, "tokens": n, "source": "disk", "seconds": time.monotonic() - t0,
                "restored": restored, "prefilled": 0}
    await say(stage="prefill", tokens=n - restored, from_token=restored)
    users = [u for u in view.user_starts if u < n]
    t1 = time.monotonic()
    timings = await slots.warm(slot, head, message_delimiters=[{"role": "user", "delimiter": "<|im_start|>user"}],
                               user_starts=users)
    await say(stage="prefilled", cache_n=timings.get("cache_n"), prompt_n=timings.get("prompt_n"),
              seconds=round(time.monotonic() - t1, 3))
    if tier is not None:
        saved = await tier.save_slot(slot, head, fingerprint=entry.get("fingerprint"), reason="warm",
                                     labels=(("folder", entry.get("folder")), ("client", "ocache warm"),
                                             ("model", entry.get("model"))))
        await tier.flush()
        await say(stage="saved" if saved else "not_saved", tokens=n)
    return {"slot": slot, "tokens": n, "source": "prefill", "seconds": time.monotonic() - t0,
            "restored": restored, "prefilled": n - restored}


@dataclass
class WarmDeps:
    """What the warm route needs from the running cache layer (the lead wires these)."""

    journal: FolderJournal
    viewer: Any
    tier: Any
    slots: Any
    pick_slot: Callable[[], Awaitable[int]]   # an idle slot to warm into (e.g. the LRU one)
    #: run under the slot's lock before the warm-up replaces what it holds: the tiers'
    #: ``before_evict`` when that is a live conversation (the session tier spills it)
    prepare_slot: Callable[[int], Awaitable[None]] | None = None


def make_warm_handler(get_deps: Callable[[], WarmDeps | None], admin_token: str | None = None):
    """An aiohttp handler for ``POST /v1/cache/warm`` ``{"dir": "/abs/path"}`` (see the module
    docstring). ``get_deps()`` returns None when the cache layer is off (answers 503)."""
    from aiohttp import web

    async def handler(request: web.Request) -> web.StreamResponse:
        if admin_token and not request.get(admin.ADMIN):
            # behind the proxy its guard checked already (request[admin.ADMIN]); mounted on its
            # own with a token, the same check (ocache/admin.py): warming replaces a slot's content
            refused = admin.denied(request, admin_token)
            if refused is not None:
                return refused
        try:
            body = await request.json()
            folder = body["dir"]
            if not isinstance(folder, str) or not folder:
                raise ValueError
        except (ValueError, KeyError, TypeError, RecursionError):
            return admin.error(400, 'body must be {"dir": "/absolute/path"}', "invalid_request_error")
        if "\x00" in folder or not os.path.isabs(folder):
            return admin.error(400, f"dir must be an absolute path without NUL bytes, got {folder!r}",
                               "invalid_request_error")
        deps = get_deps()
        if deps is None:
            return admin.error(503, "the cache layer is off", "unavailable_error")
        try:
            deps.journal.get(folder)
        except NotSeenError as exc:
            return admin.error(404, str(exc), "not_found_error")
        except (OSError, ValueError) as exc:
            return admin.error(400, f"dir {folder!r}: {exc}", "invalid_request_error")
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)

        async def progress(obj: dict) -> None:
            await resp.write((json.dumps(obj) + "\n").encode())

        try:
            slot = await deps.pick_slot()
            async with deps.slots.lock(slot):
                if deps.prepare_slot is not None:
                    await deps.prepare_slot(slot)
                result = await warm_folder(folder, journal=deps.journal, viewer=deps.viewer, tier=deps.tier,
                                           slots=deps.slots, slot=slot, progress=progress)
            await progress({"done": True, **result})
            log.info("warm %s: %d tokens in slot %d from %s", folder, result.get("tokens", 0),
                     result.get("slot", -1), result.get("source"))
        except Exception as exc:  # noqa: BLE001 - reported to the client, logged
            log.warning("warm %s failed: %s", folder, exc)
            await progress({"done": True, "error": str(exc)})
        await resp.write_eof()
        return resp

    return handler
