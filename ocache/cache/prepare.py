"""One request's inputs, computed once and shared by every step that reads them.

Two values, in the order a request needs them:

* :class:`Shape` — what the request is, without asking the server (no await): the body the server
  renders (an Anthropic Messages / OpenAI Responses body converted to its chat form,
  ``ocache/api/convert.py``), the route that renders it, ``kind`` (``fingerprint.classify``), the
  harness ``head``, the message keys (``tokens.message_keys``), the client's session. The known
  route (``routes/known.py``) needs only this.
* :class:`Prepared` — the shape plus its token view (``TokenViewer.view``) and the request's
  :class:`~ocache.tiers.base.RequestContext` but for its task id (a server's own counter:
  :meth:`Prepared.context`). Every other route, the router's estimate and the known route's
  completion read it.

Both live in the request's ``ParsedRequest.memo``. The view depends on nothing but the body and the
server's identity (``fingerprint.Identity``: model file, build, chat templates, state flags), so
several servers of one identity behind the router (``ocache/router.py``) share one
:class:`Prepared`: one token view per request, built by whichever server's layer prepared it first
(the router asks the server that served the session last). A server of another identity builds its
own. A body the server rejects (:func:`rejected_body`) is remembered as :class:`Rejected`; any other
failure of the view (server unreachable, loading) is raised and nothing is remembered.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Callable, Literal, Mapping, Sequence

from ocache import fingerprint as fp_mod
from ocache.api import convert
from ocache.fingerprint import Head, Identity
from ocache.layer import ParsedRequest
from ocache.tiers.base import RequestContext
from ocache.tokens import CHAT_ROUTES, MessageKeys, TokenView, TokenViewer, TokenViewError, message_keys

log = logging.getLogger("ocache.cache")

#: why a request is forwarded without a plan before anything is asked of the server:
#: ``unpinnable`` (an Anthropic request this server cannot pin to a slot), ``unrenderable`` (a
#: converted route's body the converter refuses: the server answers it with its own 400)
Refusal = Literal["unpinnable", "unrenderable"]


def session_of(req: ParsedRequest) -> str | None:
    """The session a request belongs to: its client's session key, and, when it sends credentials
    (``ocache.substitute.CREDENTIAL_HEADERS``), ``|`` and the first 16 hex of their digest
    (``ocache.substitute.credentials_of``). Two clients under one session key with other
    credentials are two sessions: the slot table's owner, the resident tier's "own" slot and the
    session tier's identity (whose spill supersedes whose) tell them apart, as the substitutions'
    ``owner_of`` does. None without a session key."""
    from ocache.substitute import CREDENTIAL_HEADERS, credentials_of

    headers = getattr(req, "headers", None)
    session = req.session_hint or fp_mod.session_key(headers)
    if session is None or not headers:
        return session
    names = {str(k).lower() for k in headers.keys()}
    if not names & set(CREDENTIAL_HEADERS):
        return session
    return f"{session}|{credentials_of(headers)[:16]}"


@dataclass(frozen=True)
class Shape:
    """A request as the cache layer reads it before its token view.

    ``path``: the route whose rendering the view follows (``/v1/chat/completions`` for a converted
    request). ``body``: the body the server renders (the converted one). ``chat``: a chat route.
    ``kind``: ``agent`` | ``guest`` | ``other`` (``other`` off the chat routes). ``head``: the
    harness head of an agent request (``fingerprint.harness_head``), else None. ``keys``:
    ``message_keys(body)`` of a chat body, else None. ``session``: the client's session key
    (``ParsedRequest.session_hint``, else ``fingerprint.session_key`` of its headers) with its
    credentials when it sends any (:func:`session_of`).
    ``cache_prompt``: the body does not switch the server's prompt cache off."""

    request_id: str
    path: str
    body: Mapping[str, Any]
    chat: bool
    kind: str
    head: Head | None
    keys: MessageKeys | None
    session: str | None
    cache_prompt: bool = True

    @property
    def digests(self) -> list[bytes]:
        """``message_keys(body)[1]``: one chained digest per message (empty off the chat routes)."""
        return self.keys[1] if self.keys is not None else []


@dataclass(frozen=True)
class Prepared:
    """A request's :class:`Shape`, its token view and its context (see the module docstring).

    ``view``: what the server will prefill (``TokenView``; ``view.tokens`` in token ids).
    ``identity``: the key of the server identity the view was built for (``Identity.key``).
    ``ctx``: the request's ``RequestContext`` with ``task`` -1: kind, session, head key (the
    harness fingerprint under that identity) and length in tokens, user starts (token indices), labels."""

    shape: Shape
    view: TokenView
    identity: str
    ctx: RequestContext

    @property
    def tokens(self) -> list[int]:
        return self.view.tokens

    @property
    def kind(self) -> str:
        return self.shape.kind

    def context(self, task: int) -> RequestContext:
        """The request's context on a server whose next task id is ``task``."""
        return replace(self.ctx, task=task)


@dataclass(frozen=True)
class Rejected:
    """The server's verdict on the body itself (:func:`rejected_body`): the forwarded request gets
    the same answer, so no plan is made. ``status``: the HTTP status of the view's failed call."""

    shape: Shape
    status: int


def rejected_body(status: int) -> bool:
    """Whether a token view's HTTP error is the server's verdict on the body itself: a 4xx, or the
    500 it answers for a message it cannot parse (``Failed to parse messages: ... key 'text' not
    found`` for an Anthropic text block without its text: the exception of common/chat.cpp:468 of
    the pinned source, answered as a server error); not a 503 (loading: a restart) or a failed
    connection (0)."""
    return 400 <= status < 500 or status == 500


def memo_of(req: ParsedRequest) -> dict:
    """The request's memo (``ParsedRequest.memo``); a fresh dict for a stand-in without one."""
    memo = getattr(req, "memo", None)
    return memo if isinstance(memo, dict) else {}


def labels_of(body: Mapping, headers: Any, kind: str) -> tuple[tuple[str, str | None], ...]:
    """``RequestContext.labels``: folder (agent requests), client, model. Never raises."""
    from ocache.fingerprint import client_of
    from ocache.warm import folder_label

    try:
        folder = folder_label(body) if kind == "agent" and isinstance(body, dict) else None
        model = body.get("model") if isinstance(body, Mapping) else None
        return (("folder", folder), ("client", client_of(headers)),
                ("model", model if isinstance(model, str) else None))
    except Exception:  # noqa: BLE001 - labels are for display only
        return ()


def anthropic_pin_ok(props: Any, n_slots: int) -> bool:
    """Whether a ``/v1/messages`` request can be pinned to a slot: one slot (nothing to pin), or a
    server whose ``/props`` (``props``) reports ``ocache.anthropic_id_slot`` (patches/0003: the
    stock converter drops ``id_slot``, server-chat.cpp:592-597; the patched build reports the
    result of running its own converter on a probe). Otherwise such requests are forwarded
    unplanned (counted as ``unpinnable``) and ``GET /slots`` tells the table what they changed."""
    caps = props.get("ocache") if isinstance(props, Mapping) else None
    if isinstance(caps, Mapping) and caps.get("anthropic_id_slot") is True:
        return True
    return n_slots == 1


def _as_chat(req: ParsedRequest, pin_ok: Callable[[], bool]) -> tuple[Mapping, str] | Refusal:
    """``(body, path)``: a ``/v1/messages`` / ``/v1/responses`` request as the chat body the server
    itself renders (path ``/v1/chat/completions``), any other as it is; or the refusal. ``pin_ok``:
    whether this server can pin an Anthropic request (``anthropic_pin_ok``). The
    converted body is kept in ``req.memo["chat"]``."""
    body, path = req.body or {}, req.path
    if path not in convert.CONVERTED_ROUTES:
        return body, path
    if path in convert.ANTHROPIC_ROUTES and not pin_ok():
        return "unpinnable"
    memo = memo_of(req)
    if "chat" not in memo:
        try:
            memo["chat"] = convert.to_chat(path, body)
        except convert.ConversionError as exc:
            log.debug("[%s] %s not converted: %s", req.request_id, path, exc)
            return "unrenderable"
    return memo["chat"], "/v1/chat/completions"


def shape_of(req: ParsedRequest, markers: Sequence[str], pin_ok: Callable[[], bool]) -> Shape | Refusal:
    """The request's :class:`Shape` (kept in ``req.memo`` per ``markers``, the config's volatile
    markers), or why it is not planned (:data:`Refusal`). No await, no call to the server."""
    got = _as_chat(req, pin_ok)
    if isinstance(got, str):
        return got
    memo = memo_of(req)
    key = ("shape", tuple(markers))
    hit = memo.get(key)
    if isinstance(hit, Shape):
        return hit
    body, path = got
    chat = path in CHAT_ROUTES
    kind = fp_mod.classify(body, markers) if chat else "other"
    head = fp_mod.harness_head(body, markers) if kind == "agent" else None
    keys = None
    if chat:
        if "keys" not in memo:
            memo["keys"] = message_keys(body)
        keys = memo["keys"]
    session = session_of(req)
    shape = Shape(req.request_id, path, body, chat, kind, head, keys, session,
                  cache_prompt=body.get("cache_prompt") is not False)
    memo[key] = shape
    return shape


async def prepare(req: ParsedRequest, shape: Shape, viewer: TokenViewer, identity: Identity) -> Prepared | Rejected:
    """The request's :class:`Prepared` for a server of ``identity`` whose viewer is ``viewer``: the
    one in ``req.memo`` for that identity, else built now (one ``viewer.view``) and kept there.
    Raises TokenViewError when the view fails for another reason than the body (nothing kept)."""
    memo = memo_of(req)
    key = ("prepared", identity.key)
    hit = memo.get(key)
    if isinstance(hit, (Prepared, Rejected)):
        return hit
    out: Prepared | Rejected
    try:
        view = await viewer.view(shape.path, shape.body, shape.head, shape.keys)
    except TokenViewError as exc:
        if not rejected_body(exc.status):
            raise
        out = Rejected(shape, exc.status)
    else:
        head_len = view.head_end or 0
        head_key = fp_mod.fingerprint(shape.head, identity) if shape.head is not None and head_len else None
        user_starts = tuple(view.user_starts) if (shape.chat or shape.body.get("message_delimiters")) else ()
        ctx = RequestContext(kind=shape.kind, session=shape.session, head_key=head_key, head_len=head_len,
                             user_starts=user_starts,
                             labels=labels_of(shape.body, getattr(req, "headers", None), shape.kind))
        out = Prepared(shape, view, identity.key, ctx)
    memo[key] = out
    return out
