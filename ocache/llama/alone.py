"""llama-server alone: what the same server, with the same flags and no ocache in front, would have
prefilled for the requests ocache served, so that the headline saving is against it, not against a
cold prefill of every request (against a cold prefill, the dashboard once said 117,420 tokens saved where llama-server
alone would have prefilled 21,148 more than through ocache).

A model, fed each request's prompt tokens in the order ocache saw their answers (``serve``): the
server's own slot choice (``get_available_slot``, tools/server/server-context.cpp:1738-1816 of the
patched source, docs/llama-server.md §9: the idle non-empty slot with the best ``f_sim`` = common
prefix / prompt length above ``--slot-prompt-similarity``, else the least recently used slot, ties
to the highest id), then ``ocache.llama.reuse.predict_reuse`` on what that slot would hold (its last
prompt, the generated tokens as an unknown tail, the checkpoints the prefill left). A restart of
the server empties every slot (``restart``).

Approximations, each of which makes the server alone look no worse than it is, so the saving is
not overstated: requests are taken one at a time (a request that would have waited for a busy slot,
or found one busy and taken another, is not modelled); the RAM prompt cache (``--cache-ram`` > 0,
docs/llama-server.md §10) is not modelled (the README's flags set it to 0). Pure, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from ocache.llama.flags import ServerParams
from ocache.llama.reuse import Checkpoint, common_prefix, predict_reuse


@dataclass
class _Slot:
    tokens: list[int] = field(default_factory=list)
    n_total: int = 0
    checkpoints: tuple[Checkpoint, ...] = ()
    last_used: int = -1


class AloneModel:
    """The server alone (module docstring). ``prefill``: tokens it would have prefilled in all,
    ``requests``: requests modelled, ``restarts``: restarts seen."""

    def __init__(self) -> None:
        self.slots: list[_Slot] = []
        self.seq = 0
        self.prefill = 0
        self.requests = 0
        self.restarts = 0

    def restart(self) -> None:
        """The server restarted: every slot is empty (the counters stay)."""
        self.slots = [_Slot() for _ in self.slots]
        self.restarts += 1

    def pick(self, tokens: Sequence[int], params: ServerParams) -> int:
        """The slot llama-server alone would take for a prompt of ``tokens`` (all slots idle)."""
        if len(self.slots) != max(1, params.n_slots):
            self.slots = [_Slot() for _ in range(max(1, params.n_slots))]
        best, best_sim = None, 0.0
        if params.slot_prompt_similarity and tokens:
            for i, s in enumerate(self.slots):
                if not s.tokens:
                    continue
                sim = common_prefix(s.tokens, tokens) / len(tokens)
                if sim > best_sim and sim > params.slot_prompt_similarity:
                    best, best_sim = i, sim
        if best is None:
            t_last = None
            for i, s in enumerate(self.slots):
                if t_last is None or s.last_used <= t_last:
                    best, t_last = i, s.last_used
        assert best is not None
        return best

    def serve(self, tokens: Sequence[int], params: ServerParams, user_starts: Sequence[int] = (),
              generated: int = 0, generated_ids: Sequence[int] | None = None, id_slot: object = None) -> int:
        """Model one request of ``tokens`` (prompt token ids) whose answer had ``generated``
        tokens, their ids ``generated_ids`` when the server reported them (``timings.ocache_generated``,
        patches/0010: then the slot's content is known exactly); returns the tokens the server
        alone would have prefilled for it (at least 1 for a non-empty prompt: the server evaluates
        one token for the logits). ``id_slot``: the slot the client asked for; the server alone
        takes it (modulo the slot count, server-context.cpp ``get_slot_by_id``), where ocache
        places the request itself."""
        i = self.pick(tokens, params)
        if isinstance(id_slot, int) and not isinstance(id_slot, bool) and id_slot >= 0:
            i = id_slot % len(self.slots)
        s = self.slots[i]
        self.seq += 1
        r = predict_reuse(s.tokens, s.n_total if s.tokens else 0, s.checkpoints, tokens, params,
                          user_starts=user_starts, task=self.seq)
        # the answer's tokens are not known here. On a dense model a prompt that continues into
        # them reuses as far as they match, so the server alone is taken to reuse them all
        # (``Reuse.upper``: at most the answer's length too many). Predicting no reuse there made
        # it look worse than it is (ocache bench --preset tiny --models dense --configs b,c
        # --scenario growth --scenario mid_prompt_insertion --scenario title_interleave: the saving
        # reported 45, 15 and 30 tokens where 0 was measured; now -30, -15, -15: alone is taken to
        # reuse a few tokens more than it does, the side the module docstring keeps). A hybrid
        # resumes at a checkpoint when the prompt departs inside them, but reuses the whole slot
        # when the prompt runs past all it holds: a prompt that extends the known prompt that far
        # is taken to continue into the answer exactly (the tiny hybrid's title_interleave: a turn
        # reported 50 where the server prefilled 31, 19 tokens claimed)
        # (with the answer's ids known, ``generated_ids``, the slot has no unknown tail: the
        # prediction is exact either way)
        if not params.checkpoints:
            reused = min(r.upper, max(len(tokens) - 1, 0))
        elif s.tokens and r.lcp == len(s.tokens) and len(tokens) > s.n_total:
            reused = max(r.cache_n, s.n_total)
        else:
            reused = r.cache_n
        prefill = len(tokens) - reused
        # the slot then holds the prompt and the answer but its last token, which is sampled and
        # never evaluated (prompt + generated - 1, as SlotTable.finish counts it)
        held = list(tokens) + list(generated_ids or ())[:-1]
        self.slots[i] = _Slot(held, max(len(held), len(tokens) + max(0, int(generated) - 1)),
                              r.checkpoints_after, self.seq)
        self.prefill += prefill
        self.requests += 1
        return prefill

    def stats(self) -> dict:
        return {"prefill": self.prefill, "requests": self.requests, "restarts": self.restarts}
