"""Greedy exactness, judged where it is defined: token by token, up to the reference's first near-tie.

Rule 1 of the project ("a restored state gives the same greedy tokens as a cold prefill") cannot be
checked by comparing two answers' text: the server's arithmetic depends on how a prompt is cut into
ubatches and which other sequences share them (llama-server batches slots together;
``tools/server/server-context.cpp`` ``update_slots``), and on the CPU's kernels, so two correct
runs of the same tokens give logits that differ by a little (*batching noise*). Where the reference's
best and second-best next tokens are closer than that noise, the argmax of a correct run may flip,
and every token after it differs. A text comparison then fails on noise (it did, on some
machines; docs/decisions.md D5) and a check loosened until it passes would also pass a wrong restore.

So both runs ask for their top-2 log-probabilities (``n_probs: 2``, accepted on every completion
route; the OpenAI spelling ``logprobs``/``top_logprobs`` is refused with tools + stream,
``tools/server/server-common.cpp`` around line 1431), and :func:`compare` walks the generated
tokens:

* at every position the chosen tokens' log-probabilities must be within ``tol`` of each other
  (both are the maximum of nearly the same distribution, even where a near-tie flipped the choice);
* the tokens must be equal, except at a *near-tie* of the reference (top-1 minus top-2
  log-probability below ``tol``), where the other run may have taken the runner-up: then the
  comparison stops, since what follows is no longer defined by the state alone. A near-tie that
  both runs resolved the same way is compared through.

``tol`` (:data:`TOL_NATS`) is stated, not tuned per test: 0.05 nats, about 10x the largest batching
noise measured on the generated models (max |delta log-prob| of the same token over 8 prompts x 32
tokens, each run alone vs all 8 batched: 3.3e-3 hybrid, 4.8e-3 dense; command:
``tests/test_models.py::test_batching_noise_is_far_below_the_margin``). The models are generated so
that near-ties are rare (``ocache/toolchain/models.py``: F32 weights, logits scaled to a peaked distribution;
median top-1 margin 0.6 nats, 1st percentile 0.014), so a comparison nearly always runs the whole answer.
A wrong state moves the logits by whole nats and fails at the first token
(``tests/test_exact.py`` restores another conversation's slot file and checks that it does).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

#: The stated tolerance in nats (natural-log probability), see the module docstring.
TOL_NATS = 0.05

#: Request fields that make a response carry what :func:`compare` needs (top-2 log-probabilities
#: per generated token). The OpenAI routes copy unknown llama.cpp fields through to the sampler
#: (``server-common.cpp``, "Copy remaining properties to llama_params") and answer in their own
#: shape (``choices[0].logprobs.content``, streamed per delta).
PROBS_FIELDS = {"n_probs": 2}


@dataclass(frozen=True)
class Generation:
    """The generated tokens of one response with, per position, the chosen token's log-probability,
    the margin (top-1 minus top-2 log-probability, nats) and the two best token ids. Lengths are
    equal."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    margins: tuple[float, ...]
    top2: tuple[tuple[int, int], ...] = ()
    complete: bool = True   # False: a prefix of the generation (a stream that held tokens back)

    @classmethod
    def from_entries(cls, entries: list[dict]) -> "Generation":
        """From the server's per-token entries (``completion_probabilities`` of ``/completion`` or
        ``choices[0].logprobs.content`` of chat completions): ``{"id", "logprob", "top_logprobs":
        [{"id", "logprob"}, ...]}``. Raises ValueError when an entry has fewer than 2 candidates."""
        toks, lps, margins, top2 = [], [], [], []
        for e in entries:
            top = e.get("top_logprobs") or []
            if len(top) < 2:
                raise ValueError("exactness needs the top-2 log-probabilities of every token "
                                 "(request logprobs/top_logprobs >= 2 or n_probs >= 2)")
            toks.append(int(e["id"]))
            lps.append(float(e["logprob"]))
            best = sorted(top, key=lambda t: float(t["logprob"]), reverse=True)
            margins.append(float(best[0]["logprob"]) - float(best[1]["logprob"]))
            top2.append((int(best[0]["id"]), int(best[1]["id"])))
        return cls(tuple(toks), tuple(lps), tuple(margins), tuple(top2))

    @classmethod
    def from_response(cls, data: dict) -> "Generation | None":
        """From a non-streamed response of ``/completion``, ``/v1/completions`` or
        ``/v1/chat/completions``; None when it carries no log-probabilities."""
        if isinstance(data.get("completion_probabilities"), list):
            return cls.from_entries(data["completion_probabilities"])
        choices = data.get("choices") or []
        lp = (choices[0].get("logprobs") if choices else None) or {}
        if isinstance(lp.get("content"), list):
            return cls.from_entries(lp["content"])
        return None

    @classmethod
    def from_stream(cls, events: list[dict], n_generated: int | None = None) -> "Generation | None":
        """From the parsed ``data:`` events of a streamed response (each delta's
        ``choices[0].logprobs.content`` or ``completion_probabilities``, in order); None when they
        carry none. With fewer entries than ``n_generated`` (``timings.predicted_n``) the result is
        marked incomplete: the server holds back the bytes of a character split across tokens at
        the end of a stream (and the text of a tool call being parsed), and their entries may never
        be sent, so only the prefix that came is compared."""
        entries: list[dict] = []
        seen = False
        for ev in events:
            if isinstance(ev.get("completion_probabilities"), list):
                entries += ev["completion_probabilities"]
                seen = True
            for ch in ev.get("choices") or []:
                content = (ch.get("logprobs") or {}).get("content")
                if isinstance(content, list):
                    entries += content
                    seen = True
        if not seen:
            return None
        gen = cls.from_entries(entries)
        if n_generated is not None and len(entries) < int(n_generated):
            gen = cls(gen.tokens, gen.logprobs, gen.margins, gen.top2, complete=False)
        return gen


@dataclass(frozen=True)
class Verdict:
    """The outcome of :func:`compare`. ``compared``: positions checked (tokens); ``tie_at``: the
    reference position where the comparison stopped at a near-tie (None: it ran to the end);
    ``diverged_at``: the first position that failed (None when ``exact``)."""

    exact: bool
    compared: int
    tie_at: int | None
    diverged_at: int | None
    reason: str

    def __bool__(self) -> bool:
        return self.exact


def compare(ref: Generation, got: Generation, tol: float = TOL_NATS) -> Verdict:
    """Judge ``got`` against the reference ``ref`` (see the module docstring). Both must come from
    the same prompt tokens and sampling settings (greedy)."""
    n = min(len(ref.tokens), len(got.tokens))
    for i in range(n):
        d = abs(ref.logprobs[i] - got.logprobs[i])
        if d > tol:
            return Verdict(False, i, None, i, f"token {i}: log-probability differs by {d:.4f} "
                                              f"> {tol} nats")
        if ref.tokens[i] == got.tokens[i]:
            continue
        if ref.margins[i] < tol and (not ref.top2 or got.tokens[i] in ref.top2[i]):
            return Verdict(True, i + 1, i, None, f"near-tie at token {i} (margin "
                                                 f"{ref.margins[i]:.4f} < {tol} nats) resolved "
                                                 f"the other way: compared {i + 1}")
        return Verdict(False, i, None, i, f"token {i}: {got.tokens[i]} != {ref.tokens[i]} "
                                          f"(reference margin {ref.margins[i]:.3f} nats)")
    if len(ref.tokens) != len(got.tokens):
        shorter = got if len(got.tokens) < len(ref.tokens) else ref
        if not shorter.complete:
            return Verdict(True, n, None, None, f"all {n} tokens that came equal (the stream held "
                                                f"back the rest)")
        return Verdict(False, n, None, n, f"lengths differ: {len(got.tokens)} vs "
                                          f"{len(ref.tokens)} tokens")
    return Verdict(True, n, None, None, f"all {n} tokens equal")


def describe(v: Verdict) -> str:
    """One line for a report or an assertion message."""
    return ("exact: " if v.exact else "NOT exact: ") + v.reason


def dumps(gen: Generation) -> str:
    """A compact JSON form (for bench output files)."""
    return json.dumps({"tokens": gen.tokens, "margins": [round(m, 4) for m in gen.margins]})
