"""Rule 2 of ``ocache bench`` (``ocache.bench.run``): on every scenario, ocache (c) prefills no
more than the lower of llama-server stock (a) and tuned (b), in the server's own prefill
(``Row.server_prefill``, tokens), and no title request (ocache's ``guest``) prefills more than
either. The bench's report tables read these functions (``Bench.never_worse_table``,
``Bench.worse_requests``); ``runs`` is one scenario's ``{"a"|"b"|"c": ConfigRun}``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ocache.bench.replay import Row

if TYPE_CHECKING:
    from ocache.bench.results import ConfigRun

#: Rule 2, never worse than llama-server alone: the most (c) / min((a), (b)) may be per scenario
#: (<= 1.00 on every scenario without a restart)
RULE2_MAX = 1.00


def server_prefill(r: Row) -> int:
    """The tokens the server prefilled for ``r`` (``Row.server_prefill``, else its ``prompt_n``)."""
    return r.server_prefill if r.server_prefill is not None else (r.prompt_n or 0)


def over_requests(runs: dict[str, ConfigRun]) -> list[dict]:
    """Every request of one scenario where (c)'s server prefill exceeded (a)'s or (b)'s for the
    same request. Requests are matched by label and occurrence (the k-th ``opencode_title`` of
    (c) with the k-th of (a) and of (b): a parallel group may be sent in another order).
    Each entry: ``row`` ((c)'s Row), ``a``/``b`` (their prefill, None when absent), ``c``,
    ``excess`` (tokens over min((a), (b))), ``title`` (ocache classed it a guest: opencode's
    title request). A baseline's row of another prompt (:func:`matched`) is left out."""
    out = []
    for r, vals, _other in matched(runs):
        mine = server_prefill(r)
        if vals and mine > min(vals.values()):
            out.append({"row": r, "a": vals.get("a"), "b": vals.get("b"), "c": mine,
                        "excess": mine - min(vals.values()),
                        "title": r.ocache.get("X-OCache-Kind") == "guest"})
    return out


def matched(runs: dict[str, ConfigRun]) -> list[tuple[Row, dict[str, int], dict[str, int]]]:
    """(c)'s rows, each with the prefill of (a)'s and (b)'s row of the same request (label and
    occurrence) where that row's prompt is (c)'s token for token (``Row.prompt_key``), and of
    those whose prompt differs: a ``turn`` step is built from each configuration's own
    answers, and the stock flags' answer may differ at a near-tie (dense *growth*, turn 5:
    7,468 tokens under (a), 7,469 under (b) and (c)), so that row is another request. A
    baseline's row that failed (``Row.error``: no answer) is not compared either: the server
    prefilled nothing of it, or an unknown part (``ocache bench --preset tiny --template real
    --scenario opencode_runs_same_folder --models dense``: (a)'s request #7 ended in
    ``ClientOSError: Can not write request body``, server prefill 0, and (c) was listed +13
    over it, 1.002 for the scenario, where (b) and (c) prefilled the 13 new tokens the grid
    oracle asks for)."""
    c = runs.get("c")
    others: dict[str, ConfigRun] = {k: runs[k] for k in ("a", "b") if k in runs}
    if c is None or not others:
        return []
    index: dict[str, dict[tuple[str, int], Row]] = {}
    for k, run in others.items():
        seen: dict[str, int] = {}
        for r in run.rows:
            n = seen.get(r.label, 0)
            seen[r.label] = n + 1
            index.setdefault(k, {})[(r.label, n)] = r
    out = []
    seen_c: dict[str, int] = {}
    for r in c.rows:
        n = seen_c.get(r.label, 0)
        seen_c[r.label] = n + 1
        theirs = {k: index.get(k, {}).get((r.label, n)) for k in others}
        same = {k: rr for k, rr in theirs.items() if rr is not None and rr.error is None and
                (rr.prompt_key is None or r.prompt_key is None or rr.prompt_key == r.prompt_key)}
        out.append((r, {k: server_prefill(rr) for k, rr in same.items()},
                    {k: server_prefill(rr) for k, rr in theirs.items() if rr is not None and k not in same}))
    return out


def rule2(runs: dict[str, ConfigRun]) -> dict:
    """Rule 2 on one scenario: ``ratio`` = (c) / min((a), (b)) of the server's own prefill
    (None without (c) or a baseline), ``over`` = :func:`over_requests`, ``holds`` = ratio <=
    ``RULE2_MAX`` and no title request in ``over`` (None when there is no ratio)."""
    obs = {c: runs[c].observed for c in ("a", "b", "c") if c in runs}
    # a baseline's request whose prompt is not (c)'s (its own answers differed, see
    # :func:`matched`) counts with the prefill of the baseline that sent (c)'s prompt, else
    # with (c)'s own: the totals compare the same requests
    swapped = 0
    for r, same, other in matched(runs):
        for k, v in other.items():
            if k in obs:
                obs[k] += (min(same.values()) if same else server_prefill(r)) - v
                swapped += 1
    base = min((obs[c] for c in ("a", "b") if c in obs), default=None)
    ratio = obs["c"] / base if base and "c" in obs else None
    over = over_requests(runs)
    holds = None if ratio is None else (ratio <= RULE2_MAX and not any(o["title"] for o in over))
    return {"ratio": ratio, "over": over, "holds": holds, "swapped": swapped}
