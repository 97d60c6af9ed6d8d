"""The substitution gate: every prompt ocache serves in place of the client's own rendering is
checked here, per request, before it is sent (docs/usage.md "Substitutions").

A *substitution* serves other tokens than the request's own rendering ``R`` (the ids llama-server
renders and tokenizes for it): the aligned route (a rewritten history served from the slot's own
tokens), the continued route (a compaction served as the conversation's next turn). The invariant,
for a slot that holds ``S`` (``n_held`` token ids, every one known: the prompts ocache sent, then
the ids the server reported it sampled, ``patches/0010``)::

    served = S[0, K) + R[E, len(R))        K = len(S)

and three conditions, each required:

* **owned** (:func:`owner_of`, :func:`owned`): the conversation in the slot was recorded for the
  requester: the same session key (``ocache.fingerprint.session_key``) and the same credentials
  (a SHA-256 of ``Authorization`` / ``x-api-key``; llama-server's ``--api-key`` accepts either,
  tools/server/server-http.cpp ``validate_api_key``). Equal prompts of two sessions are not enough.
* **compared** (:func:`compare`): ``S`` and ``R[0, E)`` are walked token by token. Outside the
  slot's generated spans (where the tokens are prompts ocache sent) they must be equal; a generated
  span may differ from the rendering only as one **declared span**: its reasoning block (the ids
  from the span's start up to its content, ``S[a, c)``) replaced in the rendering by a short
  filler (``R[j, f)``, at most ``MAX_FILLER`` tokens), its content ``S[c, b)`` equal to ``R[f, e)``
  token by token, and the rendering's turn end at ``e``. Where the generated span ends is known
  from the sampled ids, never from counting end-of-turn markers: an answer that writes
  ``<|im_end|>`` as text differs from its rendering (where the same text is one special token) in
  its content, and is refused.
* **declared** (:class:`Span`, checked by the caller with the text of both sides,
  :func:`declared_text`): the slot's side of a span is a reasoning block (``<think>`` ...
  ``</think>`` and whitespace) and the rendering's side is empty markup (think tags and whitespace)
  or the same reasoning text: reasoning the client *altered* is not declared and the request goes as
  sent.

:func:`compare` is pure (no I/O): the caller (``ocache/cache/align_route.py``) detokenizes the spans'
two sides and calls :func:`declared_text` on each pair. :func:`served` rebuilds the served prompt
and :func:`check` verifies the invariant on it (the spans applied to ``S`` give ``R[0, E)``), so a
bug in the walk refuses, never serves.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Mapping, Sequence

from ocache.fingerprint import session_key

#: the most tokens a template writes in place of a dropped reasoning block (Qwen3.5's
#: ``<think>\n\n</think>\n\n`` is 4 tokens in the Qwen vocab; Kimi's ``<think></think>`` 2)
MAX_FILLER = 16

#: request headers that carry a client's credentials to llama-server (``Authorization: Bearer``,
#: ``x-api-key``: tools/server/server-http.cpp, the api-key middleware)
CREDENTIAL_HEADERS: tuple[str, ...] = ("authorization", "x-api-key")


def credentials_of(headers: Mapping[str, str] | None) -> str:
    """SHA-256 hex of the request's credential headers (``CREDENTIAL_HEADERS``, names lower-cased,
    in that order); the hash of nothing for a request without any. The secret itself is never kept."""
    h = hashlib.sha256()
    for name in CREDENTIAL_HEADERS:
        value = None
        if headers is not None:
            value = headers.get(name)
            if value is None:
                value = headers.get(name.title())
        h.update(name.encode() + b"\0" + (value or "").encode("utf-8", "surrogatepass") + b"\0")
    return h.hexdigest()


def owner_of(headers: Mapping[str, str] | None) -> str:
    """Who a conversation belongs to: the session key and the credentials, one opaque string
    (``session|sha256``); two requests are the same owner only when both are equal."""
    return f"{session_key(headers) or ''}|{credentials_of(headers)}"


def owned(recorded: str | None, requester: str) -> bool:
    """Whether a conversation recorded for ``recorded`` may be served to ``requester``."""
    return recorded is not None and recorded == requester


@dataclass(frozen=True)
class Region:
    """A generated span of the slot: ``S[start, end)`` are ids the server reported it sampled
    (the last sampled id, the end of generation, is not in the slot); ``content``: where its
    content starts (after the reasoning block; ``start`` when the turn has none or it is not
    known); ``eog``: the id that ended the generation (``-1``: not known)."""

    start: int
    end: int
    content: int
    eog: int = -1


@dataclass(frozen=True)
class Span:
    """One declared difference: the slot's ``S[slot_from, slot_to)`` (a generated turn's reasoning
    block) stands where the rendering has ``R[render_from, render_to)``; ``region``: the index of
    the generated span in the slot's regions."""

    region: int
    slot_from: int
    slot_to: int
    render_from: int
    render_to: int


@dataclass(frozen=True)
class Proof:
    """What :func:`compare` found: the rendering's answer end ``end`` (``R[end]`` is the token
    that follows the slot's last generated one), the declared ``spans`` (those whose two sides
    differ), and ``n_keep`` = ``len(S)``."""

    end: int
    spans: tuple[Span, ...]
    n_keep: int


@dataclass(frozen=True)
class Refused:
    reason: str


def _common_suffix(a: Sequence[int], a_from: int, a_to: int, b: Sequence[int], b_from: int, b_to: int) -> int:
    n = 0
    while a_to - n > a_from and b_to - n > b_from and a[a_to - n - 1] == b[b_to - n - 1]:
        n += 1
    return n


def compare(slot: Sequence[int], regions: Sequence[Region], render: Sequence[int],
            ends: frozenset[int]) -> Proof | Refused:
    """Walk the slot's ids ``slot`` and the rendering ``render`` (module docstring). ``regions``:
    the slot's generated spans, in order, inside ``slot``; ``ends``: the ids that may follow the
    last generated span in the rendering (the template's end of turn, the id that ended that
    generation). A difference may start before a generated span only inside its generation prompt
    (after the slot's last end-of-turn id, at most ``MAX_FILLER`` tokens back: Qwen3.5's prompt ends
    with ``<think>\\n``, its render of a past turn has ``<think>\\n\\n``) and must end at that span's
    content, which is the rendering's token for token up to the turn's end. Returns the
    :class:`Proof` or why not."""
    n = len(slot)
    i = j = 0
    spans: list[Span] = []
    for k, reg in enumerate(regions):
        if not (i <= reg.start <= reg.content <= reg.end <= n):
            return Refused("slot record inconsistent")
        while i < reg.start and j < len(render) and slot[i] == render[j]:
            i += 1
            j += 1
        # before the span only the generation prompt's own tail may differ: past the turn's opening,
        # after the last end-of-turn id of the slot (the user's and tools' turns are never in a span)
        opened = max((p for p in range(max(0, reg.start - MAX_FILLER), reg.start) if slot[p] in ends),
                     default=reg.start - MAX_FILLER - 1)
        if i < reg.start and i <= opened:
            return Refused("differs outside a generated turn")
        last = k == len(regions) - 1
        follow = frozenset((slot[reg.end],)) if reg.end < n else ends
        need = reg.end - reg.content           # the content's ids, compared whole
        lo = j + need
        hi = min(len(render) - 1, j + (reg.content - i) + MAX_FILLER + need)
        found = -1
        for e in range(lo, hi + 1):
            if render[e] in follow and _common_suffix(slot, i, reg.end, render, j, e) >= need:
                found = e
                break
        if found < 0:
            return Refused("answer end not found" if last else "a generated turn differs")
        f = found - need
        if tuple(slot[i:reg.content]) != tuple(render[j:f]):
            spans.append(Span(k, i, reg.content, j, f))
        i, j = reg.end, found
    m = n - i
    if tuple(render[j:j + m]) != tuple(slot[i:n]):
        return Refused("differs outside a generated turn")
    return Proof(end=j + m, spans=tuple(spans), n_keep=n)


def served(slot: Sequence[int], render: Sequence[int], proof: Proof) -> list[int]:
    """The prompt the server will serve: ``S[0, K)`` then ``R[end, ...)``."""
    return list(slot[:proof.n_keep]) + list(render[proof.end:])


def check(slot: Sequence[int], render: Sequence[int], proof: Proof) -> bool:
    """The invariant, verified on the ids: ``S`` with each declared span's slot side replaced by
    its rendering side is ``R[0, end)``, token for token."""
    out: list[int] = []
    pos = 0
    for sp in proof.spans:
        if sp.slot_from < pos:
            return False
        out.extend(slot[pos:sp.slot_from])
        out.extend(render[sp.render_from:sp.render_to])
        pos = sp.slot_to
    out.extend(slot[pos:proof.n_keep])
    return out == list(render[:proof.end])


_TAGS = re.compile(r"</?think>")


def declared_text(slot_text: str, render_text: str) -> str | None:
    """Why a span's two sides (their detokenized text) are a declared difference, or None when they
    are not: the slot's side must be (the rest of) one reasoning block, ending with ``</think>``
    and whitespace, or whitespace alone; the rendering's side either think tags and whitespace alone
    (``"reasoning dropped"``) or the same reasoning text, whitespace aside (``"reasoning
    re-rendered"``). Anything else, reasoning the client altered included, is not declared."""
    if "</think>" in slot_text:
        before, _, after = slot_text.rpartition("</think>")
        if after.strip():
            return None
        reasoning = _TAGS.sub(" ", before)
    elif slot_text.strip():
        return None
    else:
        reasoning = ""
    rendered = _TAGS.sub(" ", render_text)
    if not rendered.strip():
        return "reasoning dropped"
    if rendered.split() == reasoning.split():
        return "reasoning re-rendered"
    return None
