"""The model of llama-server's prefix reuse and context checkpoints: pure functions, no I/O.

What a prompt sent to a slot will reuse (``predict_reuse``: the server's ``cache_n``) and which
context checkpoints its prefill leaves (``simulate_prefill``), mirroring the pinned source's rules
(tools/server/server-context.cpp, ``docs/llama-server.md`` §11, §14, §15). The planner and its unit
tests use them directly; every response's ``cache_n`` checks the prediction (a difference is a
counted misprediction, a bug).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Sequence

if TYPE_CHECKING:
    from ocache.llama.flags import ServerParams


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists (``server_tokens::get_common_prefix``
    for text, server-common.cpp:697-745). Compares 256-token slices at C speed, then scans."""
    n = min(len(a), len(b))
    i = 0
    step = 256
    while i + step <= n and a[i:i + step] == b[i:i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(frozen=True)
class Checkpoint:
    """A predicted context checkpoint: the state after the first ``n_tokens`` tokens
    (pos_min = pos_max = n_tokens - 1 for a hybrid model, docs/llama-server.md §15). ``task``: ocache's id of the
    request that created it (the server evicts other tasks' close checkpoints first, :2298-2311)."""

    n_tokens: int
    task: int = -1


@dataclass(frozen=True)
class Reuse:
    """The predicted outcome of sending ``n_prompt`` tokens to a slot.

    ``cache_n``: tokens the server will reuse (its ``timings.cache_n``); ``upper``: the most it could
    reuse if the slot's unknown tail (generated tokens ocache did not see, or a RAM-cache swap)
    also matches — an observation in ``[cache_n - ubatch, upper + ubatch]`` is consistent.
    ``lcp``: common prefix with what ocache knows the slot holds. ``checkpoint``: the checkpoint
    resumed from (hybrid) or None. ``reason``: ``cold`` | ``extends`` | ``prefix`` |
    ``checkpoint`` | ``no-checkpoint`` (a hybrid full re-prefill) | ``identical``.
    ``checkpoints_after``: the predicted checkpoint list after the request's prefill.
    """

    cache_n: int
    upper: int
    lcp: int
    n_prompt: int
    checkpoint: int | None
    reason: str
    checkpoints_after: tuple[Checkpoint, ...] = ()


def predict_reuse(slot_tokens: Sequence[int], n_total: int | None, checkpoints: Sequence[Checkpoint],
                  new_tokens: Sequence[int], params: ServerParams, *, user_starts: Iterable[int] = (),
                  task: int = -1, ram_swap: bool = False) -> Reuse:
    """Predict ``cache_n`` for ``new_tokens`` on a slot holding ``slot_tokens`` (+ an unknown tail up
    to ``n_total`` tokens in all; None = unknown length ≥ ``len(slot_tokens)``), and the checkpoint
    list the request's prefill leaves behind.

    Rules (server-context.cpp:3196-3395, docs/llama-server.md §11, §15):
    * ``n_past = LCP(slot, new)``; the unknown tail is assumed not to match (``upper`` allows it);
    * hybrid/recurrent (``params.checkpoints``): if the prompt diverges inside the slot
      (``n_past < slot size``) or is identical, resume from the newest checkpoint with
      ``n_tokens <= n_past`` (``< n_past`` when identical), else from 0; a prompt that strictly
      extends everything the slot holds reuses it all;
    * checkpoints beyond the resume point are erased;
    * at least one token is evaluated: an identical prompt gives ``N - 1`` [TAG_PROMPT_LOGITS].
    ``ram_swap``: the server may swap in a RAM-cache entry (``--cache-ram`` on and the slot's
    ``f_keep < 0.5``, docs/llama-server.md §9 step 4): ``upper`` becomes ``N - 1``.
    """
    N = len(new_tokens)
    held = len(slot_tokens)
    lcp = common_prefix(slot_tokens, new_tokens)
    n_past = lcp
    tail_unknown = n_total is None or n_total > held
    slot_size = held if n_total is None else max(n_total, held)
    if n_total is None and held > 0:
        slot_size = held + 1  # unknown: assume the usual generated tail (at least one token)
    ckpts = list(checkpoints)
    used: int | None = None
    reason = "cold" if lcp == 0 else "prefix"
    upper = lcp
    if tail_unknown and lcp == held and held > 0:
        # the new prompt may continue into the generated tokens ocache never saw
        upper = min(n_total if n_total is not None else N, N)

    if params.checkpoints and n_past > 0 and n_past <= slot_size:
        has_new = n_past < N
        thold = n_past if has_new else n_past - 1
        pos_min = slot_size - 1
        if pos_min >= thold:
            found = None
            for c in reversed(ckpts):
                if c.n_tokens - 1 > n_past:   # cur.pos_max > pos_next
                    continue
                if c.n_tokens - 1 < thold or c.n_tokens - 1 == 0:
                    found = c
                    break
            if found is None:
                n_past = 0
                reason = "no-checkpoint"
            else:
                n_past = min(n_past, found.n_tokens)
                used = found.n_tokens
                reason = "checkpoint"
        else:
            reason = "extends"
    elif n_past > 0 and n_past == held and n_past < N:
        reason = "extends"
    pos_next = n_past
    ckpts = [c for c in ckpts if c.n_tokens - 1 <= pos_next]
    if n_past == N and N > 0:
        n_past -= 1
        reason = "identical"
    if ram_swap:
        upper = max(upper, N - 1)
    upper = max(upper, n_past)
    if params.checkpoints and params.ctx_checkpoints > 0:
        after = simulate_prefill(ckpts, n_past, N, user_starts, params, task, media=media_spans(new_tokens))
    else:
        after = ckpts
    return Reuse(n_past, upper, lcp, N, used, reason, tuple(after))


def media_spans(tokens: Sequence[int]) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of media positions in a token view (negative ids,
    ``ocache.media.media_ids``; two images side by side are one run: the server encodes both before
    the next text batch, server-context.cpp:3458-3499). [] for a text prompt (checked at C speed)."""
    if not tokens or min(tokens) >= 0:
        return []
    out: list[tuple[int, int]] = []
    i, n = 0, len(tokens)
    while i < n:
        if tokens[i] < 0:
            j = i
            while j < n and tokens[j] < 0:
                j += 1
            out.append((i, j))
            i = j
        else:
            i += 1
    return out


def simulate_prefill(checkpoints: Sequence[Checkpoint], n_past: int, n_prompt: int,
                     user_starts: Iterable[int], params: ServerParams, task: int = -1, *,
                     media: Sequence[tuple[int, int]] = ()) -> list[Checkpoint]:
    """The checkpoint list after prefilling tokens ``[n_past, n_prompt)`` on a hybrid model.

    Mirrors the batching loop of server-context.cpp:3504-3616 for one slot with the batch to
    itself: a batch ends at ``n_batch`` tokens, at a user-message start (if it is the last user
    message, the list is empty, or it is more than ``min_step`` past the last checkpoint), and so
    that the last ``4 + n_ubatch`` and ``4`` tokens start batches of their own; a checkpoint of the
    state *before* a batch is taken when the batch starts a user message or is near the prompt end
    (``N < batch_end + n_ubatch``), never at position 0, and only if the list is empty, it is the
    last user message, near the end, or more than ``min_step`` past the last one. The list is
    capped by ``create_checkpoint``'s eviction (:2290-2354). Concurrent prefills on other slots
    share the server batch and can move batch breaks; that is a known source of small error.

    Media (``media``: :func:`media_spans` of the prompt): a text batch ends where a media chunk
    starts (server-context.cpp:3509-3511); the next step encodes the chunk(s) (:3458-3499) and
    its text batch takes **no checkpoint** ("do not checkpoint after mtmd chunks", :3602-3603),
    so no checkpoint is ever at the position right after an image; later batches take theirs as
    for text.
    """
    cps = list(checkpoints)
    if params.ctx_checkpoints <= 0:
        return cps
    starts = set(user_starts)
    last_user = max(starts) if starts else -1
    n_batch, n_ubatch, min_step = params.n_batch, params.n_ubatch, params.checkpoint_min_step
    offsets = [min(n_batch, 4 + n_ubatch), min(n_batch, 4)]
    N = n_prompt
    cur = n_past
    if cur >= N:
        return cps
    ordered = sorted(starts)
    breaks = sorted({N - off for off in offsets})
    spans = sorted(m for m in media if m[1] > n_past)
    media_starts = [m[0] for m in spans]
    while cur < N:
        after_media = False
        for m0, m1 in spans:
            if m0 <= cur < m1:
                cur, after_media = m1, True
        if cur >= N:
            break
        start = cur
        # the server pushes one token at a time and ends the batch at the first position that is
        # a qualifying user start or leaves exactly an offset's worth of tokens; computed directly
        # (the per-token loop costs ~0.3 s per 100k tokens in Python)
        end = min(N, start + n_batch)
        for p in breaks:
            if start < p <= end:
                end = p
                break
        k = bisect.bisect_right(media_starts, start)
        if k < len(media_starts) and media_starts[k] < end:
            end = media_starts[k]
        i = bisect.bisect_right(ordered, start)
        while i < len(ordered) and ordered[i] <= end:
            u = ordered[i]
            if u == last_user or not cps or u > cps[-1].n_tokens + min_step:
                end = min(end, u)
                break
            i += 1
        cur = end
        near_end = N < cur + n_ubatch
        is_user_start = start in starts
        do = True
        if cur != N and not is_user_start and not near_end:
            do = False
        if start <= 0 or after_media:  # pos_min < 0: nothing to checkpoint; media in this step
            do = False
        do = do and (not cps or start == last_user or near_end or start > cps[-1].n_tokens + min_step)
        if do:
            cps = _create_checkpoint(cps, start, task, params)
    return cps


def _create_checkpoint(cps: list[Checkpoint], n_tokens: int, task: int, params: ServerParams) -> list[Checkpoint]:
    """``create_checkpoint`` (server-context.cpp:2290-2354): when full, drop other tasks'
    checkpoints within min-step of the previous kept one, then the oldest; supersede an entry at
    the same position; append."""
    cap = params.ctx_checkpoints
    out = list(cps)
    last = -1
    i = 0
    while len(out) + 1 >= cap and i < len(out):
        c = out[i]
        if c.task != task and last >= 0 and c.n_tokens <= last + params.checkpoint_min_step:
            del out[i]
            continue
        last = c.n_tokens
        i += 1
    while len(out) >= cap:
        out.pop(0)
    out = [c for c in out if c.n_tokens != n_tokens]
    out.append(Checkpoint(n_tokens, task))
    return out
