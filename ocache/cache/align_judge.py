"""The declared half of the substitution gate on a live server (``ocache/substitute.py``): each span
of a proof judged on its text, and the partial splice a proof allows when the whole one is refused.

:class:`SpanJudge` detokenizes the two windows of each span (``POST /detokenize``) and asks
``ocache.substitute.declared`` whether the difference is a reasoning block dropped or re-rendered
(or, inside a generated turn, the same text split into other ids); its answers are memoised by the
two windows' ids. It receives one port: ``post(path, payload) -> dict``, the token viewer's bounded
call to llama-server (``ocache.tokens``), never the layer.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Any, Awaitable, Callable, Mapping, Sequence

from ocache.align import (MIN_PARTIAL_GAIN, Aligned, AsSent, Decision, Turn, decide_partial, partial_of)
from ocache.llama.reuse import predict_reuse
from ocache.slots import SlotTable
from ocache.substitute import Proof, declared

log = logging.getLogger("ocache.cache")

#: the server call the judge makes: ``post(path, payload)`` -> the JSON answer
Post = Callable[[str, dict], Awaitable[Any]]

#: the most (windows, generated) pairs whose verdict is memoised
MEMO_KEPT = 1024


class SpanJudge:
    """Judges proofs' spans on their text (module docstring), memoised."""

    def __init__(self, post: Callable[[], Post]) -> None:
        #: the port, read at each call (the layer's viewer may be replaced on a reconnect)
        self._post = post
        self._memo: dict[tuple[tuple[int, ...], tuple[int, ...], bool], str] = {}

    async def detokenize(self, ids: Sequence[int]) -> str:
        """The server's text of ``ids`` (``POST /detokenize``, tools/server/server-context.cpp
        ``handle_detokenize``). Raises ValueError on an answer without content."""
        if not ids:
            return ""
        got = await self._post()("/detokenize", {"tokens": list(ids)})
        text = got.get("content") if isinstance(got, Mapping) else None
        if not isinstance(text, str):
            raise ValueError("/detokenize answered without content")
        return text

    async def judge(self, ids: Sequence[int], tokens: Sequence[int], proof: Proof) -> tuple[int, tuple[str, ...]]:
        """Judge the spans of ``proof`` (the slot's ids ``ids`` against the rendering ``tokens``) in
        order up to the first that is not declared: (its index, ``len(proof.spans)`` when all are;
        the names of those before, each ``"<why>: slot a-b for render c-d"``)."""
        names: list[str] = []
        for k, sp in enumerate(proof.spans):
            sides = (tuple(ids[sp.window_slot[0]:sp.window_slot[1]]),
                     tuple(tokens[sp.window_render[0]:sp.window_render[1]]))
            key = (*sides, sp.generated)
            why = self._memo.get(key)
            if why is None:
                texts = list(await asyncio.gather(*(self.detokenize(side) for side in sides)))
                why = declared(texts[0], texts[1], generated=sp.generated) or ""
                if not why and any(t.count("<think>") != t.count("</think>") for t in texts):
                    # the windows cut a think block: widened over every equal id around the span
                    ws, wr = sp.widened()
                    texts = list(await asyncio.gather(self.detokenize(ids[ws[0]:ws[1]]),
                                                      self.detokenize(tokens[wr[0]:wr[1]])))
                    why = declared(texts[0], texts[1], generated=sp.generated) or ""
                if not why:
                    log.debug("undeclared span %s: slot %r, render %r", sp, *texts)
                if len(self._memo) >= MEMO_KEPT:
                    self._memo.pop(next(iter(self._memo)))
                self._memo[key] = why
            if not why:
                return k, tuple(names)
            names.append(f"{why}: slot {sp.slot_from}-{sp.slot_to} for render {sp.render_from}-{sp.render_to}")
        return len(proof.spans), tuple(names)

    async def whole(self, turn: Turn, tokens: Sequence[int], dec: Aligned) -> Decision:
        """``dec`` with the names of its spans when every one is declared, else why not."""
        if dec.proof is None:
            return AsSent("no proof")
        k, names = await self.judge(turn.ids, tokens, dec.proof)
        if k < len(dec.proof.spans):
            return AsSent("undeclared difference")
        return replace(dec, names=names)

    async def partial(self, table: SlotTable, slot: int, turn: Turn, tokens: Sequence[int], eot: int,
                      owner: str, has_session: bool) -> Decision:
        """A partial splice of ``turn``'s slot (``ocache.align.decide_partial``), its spans judged
        and the proof cut before the first that is not declared, or why not. A model that resumes
        at any token reuses exactly ``n_keep``; a hybrid one resumes at its newest checkpoint at or
        before it (``predict_reuse`` on the slot table's checkpoints, ``slot``), so the splice is
        made only when that point is ``MIN_PARTIAL_GAIN`` past where the request sent as is would
        resume, and ``Aligned.predicted`` is that point."""
        n_ctx = table.params.n_ctx_slot
        got = decide_partial(turn, tokens, eot, owner, has_session, n_ctx=n_ctx)
        if isinstance(got, Aligned) and got.proof is not None:
            k, names = await self.judge(turn.ids, tokens, got.proof)
            if k < len(got.proof.spans):
                got = partial_of(turn.ids, tokens, got.proof.cut(k), n_ctx)
            if isinstance(got, Aligned):
                got = replace(got, names=names[:k])
        if isinstance(got, Aligned) and table.params.checkpoints:
            st = table[slot]
            sp = got.splice
            held = list(turn.ids)
            at = predict_reuse(held, len(held), st.checkpoints, held[:sp.n_keep] + list(sp.tail), table.params).cache_n
            sent = predict_reuse(held, len(held), st.checkpoints, tokens, table.params).cache_n
            got = (replace(got, predicted=at, saved=at - sent) if at - sent >= MIN_PARTIAL_GAIN
                   else AsSent("checkpoint gains too little"))
        return got
