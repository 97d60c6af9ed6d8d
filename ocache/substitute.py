"""The substitution gate: every prompt ocache serves in place of the client's own rendering is
checked here, per request, before it is sent (docs/usage.md "Substitutions").

A *substitution* serves other tokens than the request's own rendering ``R`` (the ids llama-server
renders and tokenizes for it): the aligned route (a rewritten history served from the slot's own
tokens), the continued route (a compaction served as the conversation's next turn). The invariant,
for a slot that holds ``S`` (``n_held`` token ids, every one known: the prompts ocache sent, then
the ids the server reported it sampled, ``patches/0010``)::

    served = S[0, K) + R[E, len(R))        K = len(S), or less for a partial splice

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
  :func:`declared`): the slot's side of a span is a reasoning block in a family's markup
  (``MARKUPS``: ``<think>`` ... ``</think>`` and whitespace; gpt-oss's analysis message; Gemma 4's
  thought channel) and the rendering's side is empty markup or the same reasoning text: reasoning the client *altered* is not declared and the request goes as
  sent.

A *partial* splice keeps less of the slot: ``K`` is where the slot and the rendering part for
good (an edited or removed message, an answer the client changed) and ``E`` the rendering's
position there; everything before is proven as above (owned, compared, declared), everything after
is the request's own rendering. It is made only for a requester with a session key, when it keeps
more of the slot than the request sent as is would (``ocache.align.decide_partial``): the slot
holds a spliced history, and the client's edit would otherwise re-prefill from the first reasoning
block the slot kept, where llama-server alone, whose slot holds the template's rendering, reuses up
to the edit.

:func:`compare` is pure (no I/O): the caller (``ocache/cache/align_judge.py``) detokenizes the spans'
two sides and calls :func:`declared` on each pair. :func:`served` rebuilds the served prompt
and :func:`check` verifies the invariant on it (the spans applied to ``S`` give ``R[0, E)``), so a
bug in the walk refuses, never serves.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from ocache.fingerprint import session_key

#: the most tokens a template writes in place of a dropped reasoning block (Qwen3.5's
#: ``<think>\n\n</think>\n\n`` is 4 tokens in the Qwen vocab; Kimi's ``<think></think>`` 2)
MAX_FILLER = 16

#: the request headers llama-server reads a client's key from (``Authorization: Bearer``, then
#: ``X-Api-Key``: tools/server/server-http.cpp:260-305 of the pinned source, the api-key middleware)
CREDENTIAL_HEADERS: tuple[str, ...] = ("authorization", "x-api-key")


def one_completion(body: Mapping[str, Any]) -> bool:
    """Whether ``body`` asks for one completion, the only kind patch 0008's splice serves (the
    patched server answers 400 "ocache_splice serves one completion" otherwise): ``n_cmpl``, or
    its alias ``n`` (tools/server/server-schema.cpp, field ``n_cmpl``), absent or 1. A body asking
    for more goes as sent: the server alone answers it."""
    for name in ("n_cmpl", "n"):
        if name in body:
            v = body[name]
            return isinstance(v, (int, float)) and not isinstance(v, bool) and v == 1
    return True


def credentials_of(headers: Mapping[str, str] | None) -> str:
    """The requester's credentials as a hex SHA-256: every value of each of ``CREDENTIAL_HEADERS``
    in ``headers`` (an aiohttp ``CIMultiDictProxy``, or any mapping: names matched without case),
    in order, the header's name with them. No credential header gives one fixed digest. The values
    are hashed as sent (``Bearer K`` and ``X-Api-Key: K`` are two digests, as are two spellings of
    one key): a request only matches what was stored for exactly its own headers. The secret itself
    is never kept. The one definition for every substitution (the response cache's key too)."""
    headers = headers or {}
    getall = getattr(headers, "getall", None)
    parts = []
    for name in CREDENTIAL_HEADERS:
        values = (list(getall(name, [])) if getall is not None
                  else [v for k, v in headers.items() if k.lower() == name.lower()])
        parts.append([name.lower(), values])
    raw = json.dumps(parts, ensure_ascii=True, separators=(",", ":"))   # lone surrogates escaped
    return hashlib.sha256(b"ocache-credentials\0" + raw.encode("ascii")).hexdigest()


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
    """One difference between the slot's ids and the rendering: the slot's ``S[slot_from, slot_to)``
    stands where the rendering has ``R[render_from, render_to)``; ``window_slot`` and
    ``window_render``: the same span widened by up to ``CONTEXT`` equal ids on both sides, whose
    text (``/detokenize``) :func:`declared` judges."""

    slot_from: int
    slot_to: int
    render_from: int
    render_to: int
    window_slot: tuple[int, int]
    window_render: tuple[int, int]
    #: the slot's side lies inside a generated turn (ids the model sampled, which may split a text
    #: otherwise than the tokenizer does: a grammar's output, a re-tokenised answer)
    generated: bool = False
    #: the equal ids on each side of the span, up to the previous span and the next difference (at
    #: most ``WIDEST``): a window may widen that far when ``CONTEXT`` cuts a think block in two
    equal_before: int = 0
    equal_after: int = 0

    def widened(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """``window_slot`` and ``window_render`` widened over every equal id around the span."""
        b, a = self.equal_before, self.equal_after
        return ((self.slot_from - b, self.slot_to + a), (self.render_from - b, self.render_to + a))


@dataclass(frozen=True)
class Proof:
    """What :func:`compare` found: the rendering's answer end ``end`` (``R[end]`` is the end of turn
    that follows the slot's last generated id), the ``spans`` where the two differ (each still to be
    :func:`declared`), and ``n_keep`` = ``len(S)``; for a partial proof (``compare(partial=True)``)
    ``n_keep`` < ``len(S)`` and ``end`` are where the two parted."""

    end: int
    spans: tuple[Span, ...]
    n_keep: int

    def cut(self, k: int) -> "Proof":
        """The partial proof that stops before span ``k`` (one :func:`declared` refused): the slot
        and the rendering agree up to that span's start, but for the spans before it."""
        sp = self.spans[k]
        return Proof(end=sp.render_from, spans=self.spans[:k], n_keep=sp.slot_from)


@dataclass(frozen=True)
class Refused:
    reason: str


#: ids of equal run that end a difference (a shorter run only at the end of the slot, followed by
#: an end of turn in the rendering)
RUN = 8
#: equal ids kept on each side of a span for its text check (a think tag is at most a few ids)
CONTEXT = 8
#: the most equal ids a window widens over (a reasoning block cut by ``CONTEXT``)
WIDEST = 8192


def _find(hay: bytes, needle: bytes, start: int, stop: int) -> int:
    """The first id position in [``start``, ``stop``] where ``needle`` (int32 ids) begins in
    ``hay``, -1."""
    at = start * 4
    end = min(len(hay), stop * 4 + len(needle))
    while True:
        at = hay.find(needle, at, end)
        if at < 0:
            return -1
        if at % 4 == 0:
            return at // 4
        at += 4 - at % 4


def _opened(slot: Sequence[int], reg: Region, ends: frozenset[int]) -> int:
    """The last position before ``reg`` that cannot belong to its turn: its slot's last end-of-turn
    id within ``CONTEXT`` ids before it (a generation prompt follows it), or ``CONTEXT`` + 1 back."""
    for p in range(reg.start - 1, max(-1, reg.start - CONTEXT - 1), -1):
        if slot[p] in ends:
            return p
    return reg.start - CONTEXT - 1


def _resync(slot: Sequence[int], r: list[int], hay: bytes, regions: Sequence[Region], reg: Region | None,
            ends: frozenset[int], i: int, j: int, j_max: int, s_hi: int) -> tuple[int, int] | None:
    """Where the slot and the rendering agree again after parting at (``i``, ``j``): the first
    rendering position up to ``j_max`` whose ``RUN`` ids occur in the slot at ``i..s_hi``; failing
    that, a shorter run that reaches the next generated turn's start; failing that, inside the last
    generated turn, its last ids then an end of turn. Weaker evidence only where the stronger finds
    nothing (a one-id run matches almost anywhere). (slot position, rendering position) or None."""
    n = len(slot)
    stop = min(len(r), j_max + 1)
    for j2 in range(j, stop):
        gram = r[j2:j2 + RUN]
        if len(gram) < RUN:
            break
        i2 = _find(hay, np.asarray(gram, dtype="<i4").tobytes(), i, s_hi)
        if i2 >= 0:
            return i2, j2
    nxt = next((g.start for g in regions if g.start > i and g is not reg), None)
    if nxt is not None:
        for m in range(min(RUN - 1, nxt - i), 0, -1):
            for j2 in range(j, stop):
                if list(slot[nxt - m:nxt]) == r[j2:j2 + m]:
                    return nxt - m, j2
    if reg is regions[-1]:
        for j2 in range(j, stop):
            for k in range(min(RUN - 1, n - i), -1, -1):
                if j2 + k < len(r) and r[j2 + k] in ends and list(slot[n - k:n]) == r[j2:j2 + k]:
                    return n - k, j2
    return None


def compare(slot: Sequence[int], regions: Sequence[Region], render: Sequence[int],
            ends: frozenset[int], partial: bool = False) -> Proof | Refused:
    """Walk the slot's ids ``slot`` (``S``) and the rendering ``render`` (``R``) token by token.
    Where they part, the next point where they agree again is the first rendering position ``j2``
    (at most ``MAX_FILLER`` ids on: a template's markup; inside a generated turn, as far as the
    turn's own length more) from which ``RUN`` ids occur in the slot at ``i2`` >= the parting point,
    or a shorter run that reaches the next generated turn's start, or (inside the last generated
    turn) the slot's last ids up to its end and then an end-of-turn id of ``ends``; the two sides
    between are a :class:`Span`. The slot must end with
    its last generated span (``regions[-1]``, ids the server reported it sampled) and the rendering
    continue there with an id of ``ends``: that is where the answer ends, read from the generated
    ids, never counted. Returns the :class:`Proof` (its spans still to be :func:`declared`) or why
    not.

    ``partial``: where the walk would refuse (the two part for good: an edited message, an answer
    the client changed), the proof of the longest part that agrees instead: ``n_keep`` the slot
    position and ``end`` the rendering position where they parted, ``S[0, n_keep)`` equal to
    ``R[0, end)`` but for the spans found before (a *partial* splice: the rest of the rendering
    from there is the request's own)."""
    n = len(slot)
    if not regions or regions[-1].end != n:
        return Refused("the slot does not end with a generated turn")
    hay = np.asarray(slot, dtype="<i4").tobytes()
    r = list(render)
    i = j = 0
    last_end = 0     # the slot position where the previous span ended (equal ids since)
    spans: list[Span] = []
    while True:
        while i < n and j < len(r) and slot[i] == r[j]:
            i += 1
            j += 1
        if i == n:
            if j < len(r) and r[j] in ends:
                break
            if partial:
                return Proof(end=j, spans=tuple(spans), n_keep=i)
            return Refused("answer end not found")
        # inside a generated turn (or its generation prompt) the rendering may write the turn's
        # text in other ids all along it; elsewhere only a template's markup stands in between
        reg = next((g for g in regions if _opened(slot, g, ends) < i < g.end), None)
        j_max, s_hi = (j + (reg.end - i) + MAX_FILLER, reg.end) if reg is not None else (j + MAX_FILLER, n)
        got = _resync(slot, r, hay, regions, reg, ends, i, j, j_max, s_hi)
        if got is None:
            if partial:
                return Proof(end=j, spans=tuple(spans), n_keep=i)
            return Refused("no agreement after a difference")
        i2, j2 = got
        before = min(CONTEXT, i, j)
        equal_after = 0
        while equal_after < WIDEST and i2 + equal_after < n and j2 + equal_after < len(r) \
                and slot[i2 + equal_after] == r[j2 + equal_after]:
            equal_after += 1
        after = min(CONTEXT, equal_after)
        spans.append(Span(i, i2, j, j2, (i - before, i2 + after), (j - before, j2 + after),
                          generated=reg is not None and i2 <= reg.end,
                          equal_before=min(WIDEST, i - last_end), equal_after=equal_after))
        i, j = i2, j2
        last_end = i2
    return Proof(end=j, spans=tuple(spans), n_keep=n)


def served(slot: Sequence[int], render: Sequence[int], proof: Proof) -> list[int]:
    """The prompt the server will serve: ``S[0, K)`` then ``R[end, ...)``."""
    return list(slot[:proof.n_keep]) + list(render[proof.end:])


def check(slot: Sequence[int], render: Sequence[int], proof: Proof) -> bool:
    """The invariant, verified on the ids: ``S`` with each span's slot side replaced by its
    rendering side is ``R[0, end)``, token for token."""
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


@dataclass(frozen=True)
class Markup:
    """One family's reasoning markup, as text (``/detokenize`` renders special tokens): ``block``
    matches one reasoning block (group 1: its text), ``joint`` is what a block and its ``block``
    match stand for when the rest of both sides is compared, ``tags`` the texts that open or close
    a block (one left outside a whole block: not declared)."""

    name: str
    block: re.Pattern[str]
    joint: str
    tags: tuple[str, ...]


#: the reasoning markups :func:`declared` knows, each from a template of the pinned source
#: (``models/templates/``), applied in this order
MARKUPS: tuple[Markup, ...] = (
    # Qwen3/3.5, DeepSeek-R1, Kimi, MiniMax, GLM: a <think> block, the whitespace around it one line
    # break (Qwen3.5-4B.jinja writes "<think>\n" + reasoning + "\n</think>\n\n")
    Markup("think", re.compile(r"\s*<think>(.*?)</think>\s*", re.S), "\n", ("<think>", "</think>")),
    # gpt-oss (harmony, openai-gpt-oss-120b.jinja): the generation's analysis message and the header
    # of the assistant's next message; past turns render "<|start|>assistant<|channel|>final<|message|>"
    # + content + "<|end|>", the analysis dropped
    Markup("harmony analysis",
           re.compile(r"<\|channel\|>analysis<\|message\|>(.*?)<\|end\|><\|start\|>assistant", re.S), "",
           ("<|channel|>analysis",)),
    # Gemma 4 (google-gemma-4-31B-it.jinja): the thought channel; its generation prompt writes an
    # empty one ("<|channel>thought\n<channel|>") that past turns do not render
    Markup("thought channel", re.compile(r"<\|channel>thought\n(.*?)<channel\|>", re.S), "",
           ("<|channel>", "<channel|>")),
)


def _cut(text: str) -> tuple[list[str], str]:
    """The reasoning blocks of ``text`` (each markup of ``MARKUPS``) and the rest (each block as
    its markup's ``joint``)."""
    blocks: list[str] = []
    for m in MARKUPS:
        blocks += [b.group(1) for b in m.block.finditer(text)]
        text = m.block.sub(m.joint, text)
    return blocks, text


def declared(slot_text: str, render_text: str, generated: bool = False) -> str | None:
    """Why a span's two windows (the text of ``Span.window_slot`` and ``Span.window_render``) are a
    declared difference, or None when they are not. Both are cut into their reasoning blocks (a
    ``<think>`` ... ``</think>`` block, a harmony analysis message, a Gemma 4 thought channel:
    ``MARKUPS``; a tag without its partner: not declared) and the rest; declared when at least one
    block is involved, the rest is the same text on both sides (each block standing for its
    markup's ``joint``), and every block of the rendering is empty (``"reasoning dropped"``, a
    template's empty markup) or the same text, whitespace aside, as a block of the slot
    (``"reasoning re-rendered"``). So a content that differs, an answer's text re-tokenised or
    quoting a template's marker, and reasoning the client altered are not; except, for a span
    inside a generated turn (``generated``), the same text split into other ids (``"answer
    re-tokenised"``: the model's own ids for the text the template renders; a grammar samples text
    piece by piece)."""
    blocks_s, rest_s = _cut(slot_text)
    blocks_r, rest_r = _cut(render_text)
    if not blocks_s and not blocks_r:
        return "answer re-tokenised" if generated and slot_text == render_text else None
    if any(t in rest for rest in (rest_s, rest_r) for m in MARKUPS for t in m.tags):
        return None
    if rest_s != rest_r:
        return None
    kept = [b.split() for b in blocks_s]
    if all(not b.strip() for b in blocks_r):
        return "reasoning dropped"
    if all(not b.strip() or b.split() in kept for b in blocks_r):
        return "reasoning re-rendered"
    return None
