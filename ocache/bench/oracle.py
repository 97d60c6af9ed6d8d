"""The grid oracle: the prefill of a cache that resumes each request from the longest prefix it shares
with anything the server produced before, at the positions a hybrid server can resume from (the
ubatch grid). Not a lower bound on hybrids: a cache that keeps states off the grid (ocache's head
anchors) can prefill less; ``grid=None`` gives the LCP bound, which nothing can beat.

For a request with prompt tokens ``T`` (``len(T) = n``), every token sequence the server already
*produced* before it is a candidate source of reuse: each earlier request's prompt, and each
earlier prompt followed by the answer tokens generated for it. The oracle's reuse is the longest
common prefix (LCP) of ``T`` with any source, and its prefill is ``n - reuse`` (at least 1: the
server always evaluates one prompt token to get logits, ``llama-server-api.md`` §2.3,
``server-context.cpp`` TAG_PROMPT_LOGITS).

On a hybrid (recurrent) model a cached state can only be resumed at a position where a state was
kept: the end of a source (its state existed when the server finished it) or a context
checkpoint, and the server cuts checkpoints at ubatch boundaries (docs/llama-server.md §14,
§15: a resume point is a checkpoint, and checkpoints sit where a batch starts). So for a source
the new prompt diverges *inside*, the reuse is rounded down to a
multiple of ``grid`` (the server's ``-ub``); a prompt that strictly extends a whole source reuses
all of it. Dense models (``grid=None``) can truncate their KV cache at any position.

Pure and I/O free: token ids in, token counts out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np


def common_prefix(a: Sequence[int] | np.ndarray, b: Sequence[int] | np.ndarray) -> int:
    """Length (tokens) of the longest common prefix of two token sequences."""
    x = np.asarray(a, dtype=np.int64)
    y = np.asarray(b, dtype=np.int64)
    m = min(x.size, y.size)
    if m == 0:
        return 0
    diff = np.flatnonzero(x[:m] != y[:m])
    return int(diff[0]) if diff.size else m


@dataclass(frozen=True)
class OracleResult:
    """The oracle's verdict for one request.

    ``n_tokens``: prompt length (tokens); ``reuse``: tokens any cache could serve from earlier work;
    ``prefill``: ``n_tokens - reuse`` (>= 1 for a non-empty prompt); ``lcp``: the raw longest common
    prefix before hybrid grid rounding; ``source``: index (in order of :meth:`Oracle.add`) of the
    sequence that gives ``reuse``, or None when nothing is reusable.
    """

    n_tokens: int
    reuse: int
    prefill: int
    lcp: int
    source: int | None


class Oracle:
    """Collects produced token sequences and answers, per new prompt, the minimum prefill.

    ``grid``: the checkpoint grid in tokens for hybrid models (the server's ubatch, ``-ub``);
    None for dense models. Raises ValueError for a grid < 1.
    """

    def __init__(self, grid: int | None = None) -> None:
        if grid is not None and grid < 1:
            raise ValueError(f"grid must be a positive token count or None, got {grid!r}")
        self.grid = grid
        self._sources: list[np.ndarray] = []

    def __len__(self) -> int:
        return len(self._sources)

    def add(self, tokens: Sequence[int]) -> int:
        """Record a produced sequence (a prompt, or a prompt + generated answer); return its index."""
        self._sources.append(np.asarray(tokens, dtype=np.int64))
        return len(self._sources) - 1

    def usable(self, tokens: Sequence[int] | np.ndarray, source: np.ndarray) -> tuple[int, int]:
        """(reuse, lcp) of ``tokens`` against one source, with hybrid grid rounding applied."""
        lcp = common_prefix(tokens, source)
        if self.grid is None or lcp == source.size:
            return lcp, lcp
        return (lcp // self.grid) * self.grid, lcp

    def min_prefill(self, tokens: Sequence[int]) -> OracleResult:
        """The least prefill (tokens) for ``tokens`` given every sequence added so far."""
        t = np.asarray(tokens, dtype=np.int64)
        n = int(t.size)
        best, best_lcp, best_src = 0, 0, None
        for i, src in enumerate(self._sources):
            reuse, lcp = self.usable(t, src)
            if reuse > best or (reuse == best and lcp > best_lcp):
                best, best_lcp, best_src = reuse, lcp, i
        if n == 0:
            return OracleResult(0, 0, 0, 0, None)
        reuse = min(best, n - 1)  # the last prompt token is always evaluated
        return OracleResult(n, reuse, n - reuse, best_lcp, best_src if reuse > 0 else None)


def replay_oracle(stream: Iterable[tuple[Sequence[int], Sequence[int] | None]],
                  grid: int | None = None) -> list[OracleResult]:
    """Oracle results for a whole stream, in order.

    ``stream`` yields ``(prompt_tokens, answer_tokens)`` per request, in the order the requests
    were sent; ``answer_tokens`` are the generated token ids (None or empty if unknown). Each
    request is judged against everything produced *before* it; then its prompt and its
    prompt + answer become sources for later requests.
    """
    oracle = Oracle(grid)
    out = []
    for prompt, answer in stream:
        out.append(oracle.min_prefill(prompt))
        oracle.add(prompt)
        if answer:
            oracle.add(list(prompt) + list(answer))
    return out


def efficiency(oracle_prefill: int, observed_prefill: int) -> float | None:
    """Prefill efficiency = oracle tokens / observed ``prompt_n`` (1.0 = as good as any cache).

    Both in tokens, summed over a scenario. None when nothing was observed (0 tokens).
    """
    if observed_prefill <= 0:
        return None
    return oracle_prefill / observed_prefill
