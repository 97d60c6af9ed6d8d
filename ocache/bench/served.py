"""The prompt a server actually served for an aligned request, and its cold reference run.

Through ocache, a request the aligned route takes (``X-OCache-Aligned: K+N``,
``ocache/cache/align_route.py``) is not served its template's rendering: the server keeps the
first ``K`` tokens its slot (``X-OCache-Slot``) holds, the previous request's served prompt and the
tokens generated for it but the last (the slot holds prompt + generated - 1,
docs/llama-server.md §7), then prefills the rendering's last ``N`` tokens (patches/0008
``ocache_splice``). The bench judges such a request on that prompt: exactness against a cold
prefill of it (``/completion`` with the token ids, ``cache_prompt: false``) and the oracle's least
prefill for it, since a cache that serves another prompt than the template's must be measured on
what it served, not credited with the template's rewrite.

:class:`ServedPrompts` follows, per slot, the tokens each replayed request left there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from ocache.bench.exact import PROBS_FIELDS

#: fields of a chat body that shape sampling and carry over to the cold ``/completion`` run
#: (the prompt's fields do not: the prompt is given as token ids)
SAMPLING_FIELDS = ("grammar", "temperature", "seed", "top_k", "top_p", "min_p", "json_schema")


def parse_aligned(headers: dict) -> tuple[int, int, int] | None:
    """(slot, K, N) from an aligned response's ``X-OCache-Aligned: K+N`` and ``X-OCache-Slot``
    headers; None for a response that was not aligned (or headers that do not parse)."""
    low = {k.lower(): v for k, v in headers.items()}
    value, slot = low.get("x-ocache-aligned"), low.get("x-ocache-slot")
    if not value or slot is None:
        return None
    try:
        k, n = (int(x) for x in str(value).split("+"))
        return int(slot), k, n
    except ValueError:
        return None


def slot_of(headers: dict) -> int | None:
    """``X-OCache-Slot`` as an int, or None."""
    v = {k.lower(): v for k, v in headers.items()}.get("x-ocache-slot")
    try:
        return None if v is None else int(v)
    except ValueError:
        return None


def cold_completion_body(body: dict, prompt: Sequence[int]) -> dict:
    """The cold reference run of an aligned request: ``/completion`` with ``prompt`` (token ids),
    the chat body's sampling fields and generation limit (``max_tokens`` -> ``n_predict``), no
    prompt cache, the generated ids and their top-2 log-probabilities (``ocache.bench.exact``)."""
    out: dict[str, Any] = {k: body[k] for k in SAMPLING_FIELDS if k in body}
    out.update(PROBS_FIELDS)
    out.update(prompt=list(prompt), n_predict=int(body.get("max_tokens") or 16), cache_prompt=False,
               return_tokens=True, stream=False)
    return out


@dataclass
class ServedPrompts:
    """Per slot, the tokens a replayed stream left there: the request's served prompt followed by
    its generated ids (the slot holds all of them but the last)."""

    held: dict[int, list[int]] = field(default_factory=dict)

    def served(self, headers: dict, rendered: Sequence[int]) -> tuple[list[int] | None, str | None]:
        """(the prompt served, None) for an aligned request whose template rendering is
        ``rendered``: the slot's first ``K`` tokens then ``rendered``'s last ``N``; (None, None) for
        one that was not aligned (it was served ``rendered``); (None, why) when the slot's tokens
        are not known here (the report says so and judges the rendering)."""
        a = parse_aligned(headers)
        if a is None:
            return None, None
        slot, k, n = a
        held = self.held.get(slot)
        if held is None or len(held) < k or n > len(rendered) or n < 1:
            return None, f"aligned {k}+{n} on slot {slot}, whose tokens the bench does not know"
        return held[:k] + list(rendered[len(rendered) - n:]), None

    def record(self, headers: dict, prompt: Sequence[int], generated: Sequence[int] | None) -> None:
        """After a request that ran on ``X-OCache-Slot``: the slot holds ``prompt`` and the
        ``generated`` ids (unknown: forgotten)."""
        slot = slot_of(headers)
        if slot is None:
            return
        if generated is None:
            self.held.pop(slot, None)
        else:
            self.held[slot] = list(prompt) + list(generated)
