"""Request fingerprints: what kind of request this is, its stable harness head, and the server identity.

Pure functions over a parsed request body (no network I/O). The only file I/O is ``gguf_identity``,
which reads a GGUF file's header once and is kept apart from everything else.

Three parts (the "fingerprint" step of docs/architecture.md §1):

* ``classify(body)`` - *agent* turn (a tools array and a system message: opencode, pi), *guest* (no
  tools, short or a known side-task prompt: opencode's title generator, Open WebUI's ``### Task:``
  title/tags requests), or *other*.
* ``harness_head(body)`` - the **stable harness head**: the tools array verbatim (canonical compact
  JSON of the parsed array, key order and tool order kept, because the template renders them as
  given) plus the first system message cut at the first *volatile marker* (``DEFAULT_MARKERS``;
  configuration, not code). Everything after the marker changes per folder, day, model alias, MCP
  or skills set and must never be part of a fingerprint (docs/architecture.md §3). A system prompt in which
  no marker occurs is an unknown layout: ``None`` (fail open, the request is forwarded as is).
* ``identity(...)`` - what makes a KV state reusable apart from the tokens: the GGUF file identity,
  the server build, the chat template and the state-shaping launch flags (a state restored under
  another template or other flags would not match the tokens' meaning, docs/llama-server.md §6).

``fingerprint(head, identity)`` combines both into 16 hex chars. All hashing is xxhash (xxh3).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import xxhash

from ocache.llama.flags import identity_flags
from ocache.llama.gguf import GGUFIdentity, gguf_identity

Kind = Literal["agent", "guest", "other"]

# --------------------------------------------------------------------------------------------------
# Configuration: volatile markers and guest prompts (defaults; callers pass their own tuple)
# --------------------------------------------------------------------------------------------------

#: Volatile markers, matched at the start of a line of the system text; the head is cut before the
#: earliest one. Sources (read from ``shared/fixtures``, opencode 1.18.33 and pi 0.73.1):
DEFAULT_MARKERS: tuple[str, ...] = (
    # opencode: "You are powered by the model named qwen. The exact model ID is local/qwen" - the
    # line names the *client's* model alias, so two aliases of one GGUF would otherwise split the
    # head; it sits right before the <env> block (fixtures/opencode_agent_turn1.json @ ~8.6k chars).
    "You are powered by the model named",
    # opencode: working directory, workspace root, git yes/no, platform, today's date.
    "<env>",
    # opencode: AGENTS.md blocks (global first), each "Instructions from: <abs path>".
    "Instructions from:",
    # opencode: MCP server instructions; mutates every turn (tests/test_fingerprint.py).
    "<mcp_instructions>",
    # opencode: the skills block ("Skills provide specialized instructions ..." / <available_skills>).
    "Skills provide",
    "<available_skills>",
    # pi: "# Project Context" (AGENTS.md files with absolute paths), then the date and cwd lines
    # at the very end (fixtures/pi_turn1.json).
    "# Project Context",
    "Current date:",
    "Current working directory:",
    # Claude Code 2.1.328 (/v1/messages, system blocks joined without a separator by the server's
    # converter, ocache/api/convert.py): the first block is "x-anthropic-billing-header:
    # cc_version=2.1.328.<3 hex>; cc_entrypoint=sdk-cli;" whose suffix changes with the *prompt*
    # (fixtures/claude_run6_otherprompt_agent_turn1.json vs claude_run1_agent_turn1.json: first
    # differing token 7,862); with a tools-first template the head is then the tools block alone.
    "x-anthropic-billing-header:",
    # Claude Code: "# Memory" + the memory folder, which holds HOME and the project path (other
    # folder: first differing token 8,638; CLAUDE_CODE_ATTRIBUTION_HEADER=0 bodies cut here).
    "# Memory",
)

#: Side-task prompts that mark a *guest* request however long it is (matched at the start of the
#: first system or user text, after leading whitespace).
DEFAULT_GUEST_MARKERS: tuple[str, ...] = (
    "You are a title generator",  # opencode's title request (fixtures/opencode_title.json)
    "### Task:",  # Open WebUI task prompts: title, tags, follow-ups, query generation
)

#: A request without tools whose message text is at most this many characters is a guest. The
#: opencode title request is ~2.2k characters (fixtures/opencode_title.json).
DEFAULT_GUEST_MAX_CHARS = 6000

#: Request fields that change how the template renders the head, folded into ``Head.key``
#: (oaicompat_chat_params_parse, tools/server/server-common.cpp:1224-1450 of the pinned source).
HEAD_RENDER_FIELDS: tuple[str, ...] = (
    "tool_choice", "parallel_tool_calls", "chat_template_kwargs", "reasoning_effort",
    "reasoning_format",
)


def client_of(headers: Mapping[str, str] | None) -> str | None:
    """The client program named by a request's ``User-Agent`` (its first product token), e.g.
    ``opencode`` (``opencode/1.18.33 ai-sdk/...``), ``claude-cli``, ``codex_exec``, ``OpenAI`` (pi,
    through the OpenAI JS SDK): the captured headers in ``shared/fixtures/headers``. None without one."""
    ua = (headers or {}).get("User-Agent") or (headers or {}).get("user-agent")
    if not ua:
        return None
    token = ua.strip().split(" ", 1)[0].split("/", 1)[0]
    return token[:40] or None


def _dumps(obj: Any) -> str:
    """Canonical compact JSON that keeps key order (the template renders keys in the given order)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _dumps_sorted(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), sort_keys=True, default=str)


def _xxh64(text: str) -> str:
    return xxhash.xxh3_64_hexdigest(text.encode("utf-8"))


# --------------------------------------------------------------------------------------------------
# Message text helpers
# --------------------------------------------------------------------------------------------------

def content_text(content: Any) -> str | None:
    """The text of a message ``content``: a string, ``None`` (-> ""), or an array of parts.

    Text parts are joined with ``"\\n"`` as llama-server does when it flattens typed content for a
    string-only template (``concat_content_parts``, common/chat.cpp:511-530 of the pinned source).
    Returns None if a part is not a text part (media) or the shape is unknown.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                return None
            texts.append(part["text"])
        return "\n".join(texts)
    return None


def _messages(body: Mapping) -> list | None:
    msgs = body.get("messages") if isinstance(body, Mapping) else None
    return msgs if isinstance(msgs, list) else None


def _tools(body: Mapping) -> list:
    tools = body.get("tools")
    return tools if isinstance(tools, list) else []


def find_marker(text: str, markers: Sequence[str]) -> tuple[int, str] | None:
    """Earliest line-start occurrence of any marker in ``text``: ``(char offset, marker)`` or None.

    A marker counts only at offset 0 or right after a ``"\\n"``, so prose that merely mentions
    ``<env>`` mid-line does not cut the head.
    """
    best: tuple[int, str] | None = None
    for marker in markers:
        if not marker:
            continue
        start = 0
        while True:
            pos = text.find(marker, start)
            if pos < 0:
                break
            if pos == 0 or text[pos - 1] == "\n":
                if best is None or pos < best[0]:
                    best = (pos, marker)
                break
            start = pos + 1
    return best


# --------------------------------------------------------------------------------------------------
# Classification
# --------------------------------------------------------------------------------------------------

def classify(
    body: Mapping,
    markers: Sequence[str] = DEFAULT_MARKERS,
    guest_max_chars: int = DEFAULT_GUEST_MAX_CHARS,
    guest_markers: Sequence[str] = DEFAULT_GUEST_MARKERS,
) -> Kind:
    """Classify a chat request body.

    * ``"agent"``: a non-empty ``tools`` array and a system message (an agent harness turn).
    * ``"guest"``: no tools, and either the first system/user text starts with a guest marker
      (opencode title generator, Open WebUI ``### Task:``), or the message text totals at most
      ``guest_max_chars`` characters and its system text carries none of the harness ``markers``
      (a short request with its own prompt: it must not displace an agent conversation).
    * ``"other"``: everything else (no ``messages`` array, a long plain chat, tools without a
      system message, a no-tools request that carries the harness system prompt).

    Never raises on odd bodies; unknown shapes are ``"other"``.
    """
    msgs = _messages(body)
    if not msgs:
        return "other"
    tools = _tools(body)
    roles = [m.get("role") if isinstance(m, Mapping) else None for m in msgs]
    has_system = any(r in ("system", "developer") for r in roles)
    if tools:
        return "agent" if has_system else "other"
    texts = []
    for m in msgs:
        if not isinstance(m, Mapping):
            return "other"
        t = content_text(m.get("content"))
        texts.append(t if t is not None else "")
    first = next((t for t, r in zip(texts, roles) if r in ("system", "developer", "user")), "")
    if any(first.lstrip().startswith(g) for g in guest_markers if g):
        return "guest"
    system_text = "\n".join(t for t, r in zip(texts, roles) if r in ("system", "developer"))
    if find_marker(system_text, markers) is not None:
        return "other"
    if sum(len(t) for t in texts) <= guest_max_chars:
        return "guest"
    return "other"


# --------------------------------------------------------------------------------------------------
# Stable harness head
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Head:
    """The stable harness head of an agent request.

    ``tools_json``: canonical compact JSON of the parsed tools array (order kept; ``"[]"`` if none).
    ``system_head``: the first system message's text (parts joined with ``"\\n"``) cut before
    ``marker``; the whole text when ``marker`` is None (only with ``require_marker=False``).
    ``cut``: offset of the cut in the system text (characters) = ``len(system_head)``.
    ``knobs_json``: the render-affecting request fields (``HEAD_RENDER_FIELDS``) as sorted JSON.
    ``key``: xxh3_64 hex of (tools_json, system_head, knobs_json).
    """

    tools_json: str
    system_head: str
    marker: str | None
    key: str
    knobs_json: str = "{}"
    #: the head is the whole first message (Codex's base-instructions item, see ``harness_head``):
    #: ``cut_body`` then drops the later messages instead of cutting the text
    whole: bool = False

    @property
    def cut(self) -> int:
        return len(self.system_head)


def harness_head(
    body: Mapping,
    markers: Sequence[str] = DEFAULT_MARKERS,
    require_marker: bool = True,
) -> Head | None:
    """The stable harness head of ``body``, or None for an unknown layout (fail open).

    Only ``messages[0]`` counts as the harness system prompt (role ``system`` or ``developer``,
    content a string or an array of text parts). Later system messages come after the first turn
    boundary in every template (or make the template reject the request, cases C11), so they
    never belong to the head. Returns None when: there is no ``messages`` array, ``messages[0]``
    is not a system message or holds non-text parts, the tools array is not a list of objects, or
    (with ``require_marker``, the default) no volatile marker starts a line of the system text -
    such a prompt may carry per-session text ocache does not know about, and a head that differs
    per session would only waste warm-ups.

    One structural rule instead of a marker (Codex CLI 0.169.0 through ``/v1/responses``, converted
    by ocache/api/convert.py): when ``messages[0]`` is a ``developer`` message with no marker and
    ``messages[1]`` is another ``system``/``developer`` message, the whole first message is the
    head (``Head.whole``). Codex sends its base instructions as that first item, byte-identical
    across sessions, folders and days, and every volatile part as later items (skills with the
    CODEX_HOME path, AGENTS.md with the cwd, ``<environment_context>`` with the date;
    fixtures/codex_run1_turn1.json vs codex_run4_proj2_turn1.json).
    """
    msgs = _messages(body)
    if not msgs or not isinstance(msgs[0], Mapping) or msgs[0].get("role") not in ("system", "developer"):
        return None
    text = content_text(msgs[0].get("content"))
    if text is None:
        return None
    tools = body.get("tools")
    if tools is None:
        tools = []
    if not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools):
        return None
    found = find_marker(text, markers)
    whole = False
    if found is None:
        whole = (msgs[0].get("role") == "developer" and len(msgs) > 1 and isinstance(msgs[1], Mapping)
                 and msgs[1].get("role") in ("system", "developer"))
        if require_marker and not whole:
            return None
        system_head, marker = text, None
    else:
        system_head, marker = text[: found[0]], found[1]
    tools_json = _dumps(tools)
    knobs = {k: body[k] for k in HEAD_RENDER_FIELDS if k in body and body[k] is not None}
    if knobs.get("tool_choice") == "auto":  # the server's default (server-common.cpp:1234)
        del knobs["tool_choice"]
    knobs_json = _dumps_sorted(knobs)
    key = _xxh64(_dumps([tools_json, system_head, knobs_json]))
    return Head(tools_json=tools_json, system_head=system_head, marker=marker, key=key, knobs_json=knobs_json,
                whole=whole)


def cut_body(body: Mapping, head: Head) -> dict:
    """A copy of ``body`` whose first system message is cut to ``head.system_head``.

    Rendering it with the server's template and comparing with the full render shows where the
    head ends in the prompt text (``ocache.tokens``). A string content becomes the cut string; an
    array of text parts keeps the parts before the cut and shortens the one that holds it (parts
    are joined with ``"\\n"``, see ``content_text``). For a ``Head.whole`` head the first message
    is kept whole and every later message is replaced by one empty user message, so the render
    parts right after the head's text. Raises ValueError if ``body`` does not have the head's layout.
    """
    msgs = _messages(body)
    if not msgs or not isinstance(msgs[0], Mapping):
        raise ValueError("body has no system message to cut")
    if head.whole:
        if content_text(msgs[0].get("content")) != head.system_head:
            raise ValueError("body's first message is not the head")
        return {**body, "messages": [msgs[0], {"role": "user", "content": ""}]}
    content = msgs[0].get("content")
    text = content_text(content)
    if text is None or not text.startswith(head.system_head):
        raise ValueError("body's system text does not start with the head")
    n = head.cut
    if isinstance(content, list):
        parts, pos = [], 0
        for part in content:
            t = part["text"]
            if pos + len(t) <= n:
                parts.append(dict(part))
            elif pos < n:
                parts.append({**part, "text": t[: n - pos]})
            pos += len(t) + 1  # the "\n" joining parts
            if pos > n:
                break
        new_content: Any = parts
    else:
        new_content = text[:n]
    out = dict(body)
    out["messages"] = [{**msgs[0], "content": new_content}, *msgs[1:]]
    return out


# --------------------------------------------------------------------------------------------------
# Identity: GGUF file, server build, chat template, state-shaping flags
# --------------------------------------------------------------------------------------------------




@dataclass(frozen=True)
class Identity:
    """What a KV state depends on besides its tokens. ``key``: xxh3_64 hex of ``fields`` (sorted JSON).

    ``fields``:
    * ``gguf``: ``GGUFIdentity.as_dict()`` (``gguf_identity``: os.stat + header hash) or None when
      the model file is not local (then the build and template still pin most of it);
    * ``build_info``: ``/props.build_info`` = ``llama_build_info()`` ("b<N>-<commit>", also
      ``system_fingerprint`` in every response; common/build-info.cpp.in);
    * ``chat_template_xxh3_64``: hash of ``/props.chat_template`` (the template the server renders
      with; ``/props.chat_template_tool_use`` folded in when present);
    * ``flags``: the effective state-shaping launch flags (``identity_flags`` of the
      ``state_flags`` / ``parse_flags`` output: flags that do not shape a state are ignored).
    """

    key: str
    fields: dict = field(default_factory=dict)


def identity(
    gguf: GGUFIdentity | Mapping | str | os.PathLike | None,
    build_info: str,
    chat_template: str,
    flags: Mapping[str, Any],
    chat_template_tool_use: str | None = None,
) -> Identity:
    """Build the Identity. ``gguf`` is a GGUFIdentity (or its dict) - pure - or a path, in which
    case ``gguf_identity(path)`` reads the header (I/O; raises OSError/GGUFError). ``flags``: any
    flags dict; only ``identity_flags(flags)`` enters the identity. Raises ValueError on a
    malformed ``flash_attn`` value."""
    if isinstance(gguf, (str, os.PathLike)):
        gguf = gguf_identity(gguf)
    if isinstance(gguf, GGUFIdentity):
        gguf_fields: dict | None = gguf.as_dict()
    elif gguf is None:
        gguf_fields = None
    else:
        gguf_fields = dict(gguf)
    tmpl = chat_template if chat_template_tool_use is None else chat_template + "\x00" + chat_template_tool_use
    fields = {
        "gguf": gguf_fields,
        "build_info": build_info,
        "chat_template_xxh3_64": xxhash.xxh3_64_hexdigest(tmpl.encode("utf-8")),
        "flags": identity_flags(flags),
    }
    return Identity(key=_xxh64(_dumps_sorted(fields)), fields=fields)


def fingerprint(head: Head, ident: Identity) -> str:
    """16 hex chars (xxh3_64) naming the prefix state of ``head`` under ``ident``."""
    return _xxh64(head.key + "/" + ident.key)


# --------------------------------------------------------------------------------------------------
# Session identity from request headers
# --------------------------------------------------------------------------------------------------

#: Request headers that name a client session, in the order they are tried (header names are
#: case-insensitive). opencode: ``x-session-affinity`` / ``x-session-id`` (``ses_…``, kept by
#: ``-c``); Claude Code 2.1.328: ``X-Claude-Code-Session-Id`` (kept by ``--continue``); Codex CLI
#: 0.169.0: ``session-id`` = ``thread-id`` (kept by ``exec resume``). Sources: shared/fixtures/headers/.
SESSION_HEADERS: tuple[str, ...] = ("x-session-affinity", "x-session-id", "x-claude-code-session-id",
                                    "session-id", "thread-id")


def session_key(headers: Mapping[str, str] | None) -> str | None:
    """The client's session id from ``headers`` (``SESSION_HEADERS``, first non-empty), or None.

    ``headers`` may be any mapping; names are compared case-insensitively. Values longer than 256
    characters are ignored (an id, not a payload)."""
    if not headers:
        return None
    getter = getattr(headers, "get", None)
    for name in SESSION_HEADERS:
        value = None
        if getter is not None:
            value = getter(name)
            if value is None and not hasattr(headers, "getall"):  # a plain dict: try every case
                value = next((v for k, v in headers.items() if isinstance(k, str) and k.lower() == name), None)
        if isinstance(value, str) and value.strip() and len(value) <= 256:
            return value.strip()
    return None
