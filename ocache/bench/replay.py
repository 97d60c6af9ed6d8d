"""Replay recorded agent request streams against a server, then measure them against the oracle.

A **scenario** (``scenarios/*.yaml``) is a small list of steps over real request bodies: the
client captures in ``shared/fixtures`` (used by path, never copied) or a stream recorded by
``ocache serve --record`` (:mod:`ocache.record`). :func:`replay` sends them to a target URL in
order, keeping the gaps between them (scaled), running ``parallel`` groups concurrently (the
title request opencode sends beside its agent turn), restarting the llama-server process where a
step says ``restart: true`` (the harness owns that process, :class:`ocache.llama.server.LlamaServer`),
and growing sessions turn by turn from the model's own answers.

Scenario file::

    name: growth                 # defaults to the file stem
    description: one opencode session, several turns
    max_tokens: 16               # generation cap per request (tokens); replaces the client's
    gap_s: 0.5                   # default pause before each step (seconds, x --time-scale)
    n_parallel: 1                # optional: -np for the tuned configurations (b, c)
    template: real               # optional: serve the model with a template of the pinned
                                 #   source (ocache.bench.agent.resolve_template: real, a file
                                 #   name, {hybrid: ..., dense: ...}); default its own
    reasoning: keep              # optional: a turn sends the answer's reasoning back as
                                 #   reasoning_content (keep, the default) or drops it (drop)
    hosts: 2                     # optional: a day over two hosts behind a session-affine
                                 #   balancer (ocache.bench.hosts; its own runner and report)
    steps:
      - send: opencode_agent_turn1.json   # a fixture (relative to the fixtures folder) or a path
        session: main                     # remember body + answer under this name
        gap_s: 0                          # optional per-step pause
        edit: [...]                       # optional body edits, see below
      - send: {messages: [...], tools: [...]}  # or the body itself, inline
        session: loop
        grammar: tool_call                # optional: sample under ocache.bench.agent.grammar
      - turn: main                        # session main's last body + the model's answer +
        user: "go on"                     #   a tool result for each tool call it made, else a
        tool_result: "ok"                 #   user message; repeated `repeat` times
        repeat: 4
      - turn: loop                        # the answer (as generated) + a tool result even
        then: tool                        #   when no call was parsed (a call under a grammar
        tool_result: {file: docs/build.md, chars: 5200}   # stays text); the result's text
        grammar: answer                   #   from a file of the pinned source
      - restart: true                     # stop + start the llama-server process(es)
      - host_down: b                      # hosts: 2 only: host b stops (a planned stop: its
                                          #   ocache drains); its sessions move to another host
      - parallel:                         # concurrent steps; each may have `delay_s`
          - {send: opencode_title.json}
          - {send: opencode_agent_turn1.json, session: main, delay_s: 0.05}

Edits (``edit:`` on ``send`` and ``turn``), applied to message texts in order:
``{replace: REGEX, with: TEXT}`` (every match in every message string) and
``{insert: TEXT, message: I, at: F}`` (into message ``I``'s text at fraction ``F`` of its length,
moved forward to the next line start, so a block lands in the middle of a prompt).

The next request of a ``turn`` carries the answer the server generated for the session's last
request (:class:`Answer`, as llama-server parsed it: content, ``reasoning_content``, tool calls), the
way a client sends it back (``reasoning``). A ``grammar:`` name is resolved against the server
(its template's call format and whether its generation prompt opens the think block) when the
replay starts.

Every replayed body is made deterministic: ``temperature: 0`` (greedy), ``seed: 0``, and the
client's ``max_tokens``/``max_completion_tokens``/``n_predict`` replaced by the scenario's
``max_tokens``. Streaming stays as the client asked.

:func:`measure` then takes the replayed requests and, directly on the llama-server: renders and
tokenizes each prompt with the server's own template and tokenizer (``/apply-template`` +
``/tokenize``, or ``ocache.tokens.TokenViewer`` when present), runs each distinct request once
more **cold** (``cache_prompt: false``: a fresh prefill, docs/llama-server.md §8, §11) to
get the reference greedy output, its generated token ids (``return_tokens`` + ``verbose``) and a
cold TTFT, and computes the oracle (:mod:`ocache.bench.oracle`) over the stream.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable, Mapping, TypedDict

import aiohttp
import yaml

from ocache.api.convert import CONVERTED_ROUTES, ConversionError, timings_from_usage, to_chat
from ocache.bench.exact import PROBS_FIELDS, Generation, compare, describe
from ocache.bench.oracle import Oracle, OracleResult

log = logging.getLogger("ocache.bench.replay")

#: Request headers replayed from a fixture's ``headers/*.headers.json`` or a recording.
REPLAY_HEADERS = ("user-agent", "x-session-affinity", "x-session-id",
                  # Claude Code and Codex CLI session ids (ocache.fingerprint.SESSION_HEADERS)
                  "x-claude-code-session-id", "session-id", "thread-id", "anthropic-version")

GEN_LIMIT_KEYS = ("max_tokens", "max_completion_tokens", "n_predict")


class ScenarioError(ValueError):
    """A scenario file is malformed or names a fixture that does not exist (message says which)."""


class ReplayError(RuntimeError):
    """A replayed request failed in a way that makes the run meaningless (message says which)."""


# --------------------------------------------------------------------------------------------------
# scenarios


@dataclass
class Step:
    """One scenario step (see the module docstring). ``kind`` is send | turn | restart |
    host_down | parallel."""

    kind: str
    source: str | None = None           # send: fixture name or path
    body: dict | None = None            # send: the loaded body
    headers: dict = field(default_factory=dict)
    path: str = "/v1/chat/completions"
    session: str | None = None          # send: store as; turn: grow this one
    user: str = "Thanks. Now continue with the next step and keep it short."
    tool_result: str = "ok"
    then: str | None = None             # turn: "tool" or "user" after the answer (None: by calls)
    grammar: str | None = None          # a name of ocache.bench.agent.GRAMMARS
    edits: list = field(default_factory=list)
    gap_s: float | None = None
    delay_s: float = 0.0                # parallel children: offset from the group start
    children: list["Step"] = field(default_factory=list)
    label: str | None = None
    host: str | None = None             # host_down: the host's name (a, b, ...)


@dataclass
class Scenario:
    name: str
    description: str = ""
    max_tokens: int = 16
    gap_s: float = 0.5
    n_parallel: int | None = None
    steps: list[Step] = field(default_factory=list)
    source: str | None = None
    template: Any = None                # ocache.bench.agent.resolve_template's spec
    reasoning: str = "keep"             # keep | drop
    hosts: int = 1                      # > 1: ocache.bench.hosts runs it

    def n_requests(self) -> int:
        def count(s: Step) -> int:
            if s.kind == "parallel":
                return sum(count(c) for c in s.children)
            return 1 if s.kind in ("send", "turn") else 0
        return sum(count(s) for s in self.steps)


def _fixture_headers(path: Path) -> dict:
    hp = path.parent / "headers" / path.name.replace(".json", ".headers.json")
    if not hp.exists():
        return {}
    raw = json.loads(hp.read_text())
    if isinstance(raw, dict) and isinstance(raw.get("headers"), (dict, list)):
        raw = raw["headers"]
    if isinstance(raw, list):  # [[name, value], ...]
        raw = {k: v for k, v in raw}
    return {k.lower(): v for k, v in raw.items() if k.lower() in REPLAY_HEADERS}


def _check_edits(edits: Any, where: str) -> list:
    if edits is None:
        return []
    if isinstance(edits, dict):
        edits = [edits]
    if not isinstance(edits, list):
        raise ScenarioError(f"{where}: edit must be a list of edits")
    for e in edits:
        if not isinstance(e, dict) or not ({"replace", "insert"} & set(e)):
            raise ScenarioError(f"{where}: unknown edit {e!r} (use replace/with or insert/message/at)")
        if "replace" in e:
            if "with" not in e:
                raise ScenarioError(f"{where}: replace needs `with`")
            try:
                re.compile(e["replace"])
            except re.error as exc:
                raise ScenarioError(f"{where}: bad regex {e['replace']!r}: {exc}") from None
        if "insert" in e and not (0.0 <= float(e.get("at", 0.5)) <= 1.0):
            raise ScenarioError(f"{where}: insert `at` must be a fraction in [0, 1]")
    return edits


SYNTHETIC_WORDS = ("cache slot token prefix model server client request answer file folder path "
                   "build test agent session title tool result prompt state restore spill").split()


def synthetic_body(seed: int, words: int) -> dict:
    """A chat body whose one user message is ``words`` seeded random words: a context that shares
    nothing with another seed's beyond the template's first tokens (the shape of cache-pressure's
    retention contexts: unique word orders, byte-identical across runs)."""
    import random

    rng = random.Random(seed)
    text = " ".join(rng.choice(SYNTHETIC_WORDS) for _ in range(words))
    return {"messages": [{"role": "user", "content": f"Context {seed}. {text}\nSummarise it."}],
            "stream": True}


def _check_grammar(name: Any, where: str) -> str | None:
    from ocache.bench.agent import GRAMMARS

    if name is not None and name not in GRAMMARS:
        raise ScenarioError(f"{where}: grammar must be one of {', '.join(GRAMMARS)}")
    return name


def _tool_result(spec: Any, where: str) -> str:
    """A turn's tool result: the text itself, or ``{file: PATH, chars: N, offset: N}`` of the
    pinned source (``ocache.bench.agent.source_text``)."""
    if not isinstance(spec, dict):
        return str(spec)
    from ocache.bench.agent import source_text

    if set(spec) - {"file", "chars", "offset"} or "file" not in spec:
        raise ScenarioError(f"{where}: tool_result needs {{file: PATH, chars: N, offset: N}}")
    try:
        return source_text(str(spec["file"]), int(spec.get("chars", 5200)), int(spec.get("offset", 0)))
    except (OSError, ValueError) as exc:
        raise ScenarioError(f"{where}: tool_result: {exc}") from None


class _Common(TypedDict):
    """The fields every step kind takes from its mapping (``Step``'s of the same names)."""

    gap_s: float | None
    delay_s: float
    label: str | None
    grammar: str | None


def _parse_step(raw: Any, fixtures: Path, where: str) -> Step:
    if not isinstance(raw, dict):
        raise ScenarioError(f"{where}: a step must be a mapping, got {raw!r}")
    known = {"send", "turn", "restart", "parallel", "synthetic", "session", "user", "tool_result",
             "edit", "gap_s", "delay_s", "repeat", "label", "path", "headers", "then", "grammar",
             "host_down"}
    unknown = set(raw) - known
    if unknown:
        raise ScenarioError(f"{where}: unknown keys {sorted(unknown)}")
    kinds = [k for k in ("send", "turn", "restart", "parallel", "synthetic", "host_down") if k in raw]
    if len(kinds) != 1:
        raise ScenarioError(f"{where}: a step needs exactly one of "
                            "send/turn/restart/parallel/synthetic/host_down")
    kind = kinds[0]
    common = _Common(gap_s=raw.get("gap_s"), delay_s=float(raw.get("delay_s", 0.0)),
                     label=raw.get("label"), grammar=_check_grammar(raw.get("grammar"), where))
    if kind == "synthetic":
        spec = raw["synthetic"]
        if not isinstance(spec, dict) or set(spec) - {"words", "seed"} or "seed" not in spec:
            raise ScenarioError(f"{where}: synthetic needs {{seed: N, words: N}}")
        body = synthetic_body(int(spec["seed"]), int(spec.get("words", 1500)))
        return Step("send", source=f"synthetic-{spec['seed']}", body=body,
                    headers={k.lower(): v for k, v in (raw.get("headers") or {}).items()},
                    path="/v1/chat/completions", session=raw.get("session"),
                    edits=_check_edits(raw.get("edit"), where),
                    **_Common({**common, "label": common["label"] or f"context {spec['seed']}"}))
    if kind == "send" and isinstance(raw["send"], dict):
        body = copy.deepcopy(raw["send"])
        if not isinstance(body.get("messages"), list):
            raise ScenarioError(f"{where}: an inline body needs a `messages` list")
        return Step("send", source="inline", body=body,
                    headers={k.lower(): v for k, v in (raw.get("headers") or {}).items()},
                    path=raw.get("path", "/v1/chat/completions"), session=raw.get("session"),
                    edits=_check_edits(raw.get("edit"), where), **common)
    if kind == "send":
        src = raw["send"]
        p = Path(src).expanduser()
        if not p.is_absolute():
            p = fixtures / p
        if not p.exists():
            raise ScenarioError(f"{where}: request file {p} not found")
        try:
            body = json.loads(p.read_text())
        except json.JSONDecodeError as exc:
            raise ScenarioError(f"{where}: {p} is not JSON: {exc}") from None
        if not isinstance(body, dict) or not isinstance(body.get("messages", []), list):
            raise ScenarioError(f"{where}: {p} is not a chat completion body")
        headers = _fixture_headers(p) | {k.lower(): v for k, v in (raw.get("headers") or {}).items()}
        return Step("send", source=str(src), body=body, headers=headers,
                    path=raw.get("path", "/v1/chat/completions"), session=raw.get("session"),
                    edits=_check_edits(raw.get("edit"), where), **common)
    if kind == "turn":
        then = raw.get("then")
        if then not in (None, "tool", "user"):
            raise ScenarioError(f"{where}: then must be tool or user")
        return Step("turn", session=str(raw["turn"]),
                    user=str(raw.get("user", Step.user)),
                    tool_result=_tool_result(raw.get("tool_result", Step.tool_result), where),
                    then=then, edits=_check_edits(raw.get("edit"), where), **common)
    if kind == "restart":
        if raw["restart"] is not True:
            raise ScenarioError(f"{where}: restart must be `true`")
        return Step("restart", **common)
    if kind == "host_down":
        name = raw["host_down"]
        if not isinstance(name, str) or not re.fullmatch(r"[a-z]", name):
            raise ScenarioError(f"{where}: host_down names a host: a, b, ...")
        return Step("host_down", host=name, **common)
    children = raw["parallel"]
    if not isinstance(children, list) or not children:
        raise ScenarioError(f"{where}: parallel needs a non-empty list of steps")
    kids = [_parse_step(c, fixtures, f"{where}.parallel[{i}]") for i, c in enumerate(children)]
    if any(k.kind not in ("send", "turn") for k in kids):
        raise ScenarioError(f"{where}: parallel steps must be send or turn")
    return Step("parallel", children=kids, **common)


def load_scenario(path: str | Path, fixtures: str | Path) -> Scenario:
    """Parse and check a scenario YAML file; fixture bodies are loaded from ``fixtures``.

    Raises ScenarioError naming the file and step for any problem (unknown keys, missing fixture,
    a ``turn`` on a session no earlier step created, bad regex).
    """
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ScenarioError(f"{path}: {exc}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("steps"), list):
        raise ScenarioError(f"{path}: a scenario is a mapping with a `steps` list")
    unknown = set(raw) - {"name", "description", "max_tokens", "gap_s", "n_parallel", "steps",
                          "template", "reasoning", "hosts"}
    if unknown:
        raise ScenarioError(f"{path}: unknown keys {sorted(unknown)}")
    steps: list[Step] = []
    for i, s in enumerate(raw["steps"]):
        step = _parse_step(s, Path(fixtures), f"{path.name} step {i}")
        repeat = int(s.get("repeat", 1)) if isinstance(s, dict) else 1
        if repeat < 1:
            raise ScenarioError(f"{path.name} step {i}: repeat must be >= 1")
        steps.extend(copy.deepcopy(step) for _ in range(repeat))
    sessions: set[str] = set()

    def check(step: Step, where: str) -> None:
        if step.kind == "turn" and step.session not in sessions:
            raise ScenarioError(f"{path.name} {where}: turn on unknown session {step.session!r}")
        if step.kind == "send" and step.session:
            sessions.add(step.session)
        for c in step.children:
            check(c, where)

    for i, st in enumerate(steps):
        check(st, f"step {i}")
    sc = Scenario(name=str(raw.get("name") or path.stem), description=str(raw.get("description", "")),
                  max_tokens=int(raw.get("max_tokens", 16)), gap_s=float(raw.get("gap_s", 0.5)),
                  n_parallel=raw.get("n_parallel"), steps=steps, source=str(path),
                  template=raw.get("template"), reasoning=str(raw.get("reasoning", "keep")),
                  hosts=int(raw.get("hosts", 1)))
    if not 1 <= sc.hosts <= 26:
        raise ScenarioError(f"{path}: hosts must be 1 to 26")
    downs = [st.host for st in steps if st.kind == "host_down"]
    if downs and sc.hosts < 2:
        raise ScenarioError(f"{path}: host_down needs hosts: 2 or more")
    if any(ord(h or "a") - ord("a") >= sc.hosts for h in downs) or len(set(downs)) >= sc.hosts:
        raise ScenarioError(f"{path}: host_down names a host beyond `hosts`, or stops every host")
    if sc.reasoning not in ("keep", "drop"):
        raise ScenarioError(f"{path}: reasoning must be keep or drop")
    if sc.max_tokens < 1:
        raise ScenarioError(f"{path}: max_tokens must be >= 1")
    return sc


def scenario_from_recording(path: str | Path, max_tokens: int = 16,
                            max_gap_s: float = 30.0) -> Scenario:
    """A scenario that replays a recording (:mod:`ocache.record`) in order, with its gaps.

    The gap before each request is the recorded time between the previous request's end and this
    one's receipt (capped at ``max_gap_s``); requests that overlapped in the recording are sent
    when their recorded start comes. Raises ``record.RecordError`` for a redacted recording.
    """
    from ocache.record import read_stream

    entries = read_stream(path)
    steps: list[Step] = []
    prev_end = None
    for e in entries:
        t = float(e.get("t") or 0.0)
        gap = 0.0 if prev_end is None else min(max(t - prev_end, 0.0), max_gap_s)
        total = float((e.get("obs") or {}).get("total_s") or 0.0)
        prev_end = t + total if prev_end is None else max(prev_end, t + total)
        steps.append(Step("send", source=f"{Path(path).name}#{e.get('seq')}", body=e["body"],
                          headers={k: v for k, v in (e.get("headers") or {}).items()
                                   if k in REPLAY_HEADERS},
                          path=e.get("path") or "/v1/chat/completions", gap_s=gap))
    return Scenario(name=f"recording:{Path(path).stem}", description=f"recorded stream {path}",
                    max_tokens=max_tokens, gap_s=0.0, steps=steps, source=str(path))


# --------------------------------------------------------------------------------------------------
# bodies


def prepare_body(body: dict, max_tokens: int) -> dict:
    """A deterministic copy of a client body: greedy (``temperature: 0``, ``seed: 0``), the
    generation limit set to ``max_tokens`` tokens (the client's own limit keys are removed), and the
    top-2 log-probabilities of every generated token asked for, so exactness is judged per token
    (``ocache.bench.exact``; these fields shape only the response, not the prompt or the cache)."""
    out = copy.deepcopy(body)
    for k in GEN_LIMIT_KEYS:
        out.pop(k, None)
    out["max_tokens"] = int(max_tokens)
    out["temperature"] = 0.0
    out["seed"] = 0
    out.update(PROBS_FIELDS)
    return out


def _edit_text(text: str, edit: dict, index: int, msg_index: int) -> str:
    if "replace" in edit:
        return re.sub(edit["replace"], edit["with"], text)
    if "insert" in edit and int(edit.get("message", 0)) == msg_index:
        pos = int(len(text) * float(edit.get("at", 0.5)))
        nl = text.find("\n", pos)
        pos = nl + 1 if nl >= 0 else len(text)
        return text[:pos] + str(edit["insert"]) + text[pos:]
    return text


def apply_edits(body: dict, edits: Iterable[dict]) -> dict:
    """A copy of ``body`` with the edits applied to its messages' text (string content and the
    ``text`` of content parts). Raises ScenarioError if an insert names a missing message."""
    out = copy.deepcopy(body)
    msgs = out.get("messages") or []
    for n, edit in enumerate(edits):
        if "insert" in edit and not (0 <= int(edit.get("message", 0)) < len(msgs)):
            raise ScenarioError(f"edit {n}: message {edit.get('message')} out of range "
                                f"({len(msgs)} messages)")
        for i, m in enumerate(msgs):
            c = m.get("content")
            if isinstance(c, str):
                m["content"] = _edit_text(c, edit, n, i)
            elif isinstance(c, list):
                for part in c:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        part["text"] = _edit_text(part["text"], edit, n, i)
    return out


@dataclass
class Answer:
    """The assistant message a response carried (parsed by llama-server's chat parser)."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)   # [{"id", "name", "arguments"}]

    def key(self) -> tuple:
        """What exactness compares: text, reasoning and tool calls (names + arguments; the ids are
        random per response, so they are left out)."""
        return (self.content, self.reasoning,
                tuple((t.get("name") or "", t.get("arguments") or "") for t in self.tool_calls))

    def message(self, reasoning: bool = True) -> dict:
        """The assistant message a client sends back in its next request (opencode's shape), with
        its reasoning as ``reasoning_content`` or (``reasoning`` false: the client drops it) without."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning and reasoning:
            msg["reasoning_content"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = [{"id": t["id"], "type": "function",
                                  "function": {"name": t["name"], "arguments": t["arguments"]}}
                                 for t in self.tool_calls]
        return msg


def next_turn(body: dict, answer: Answer, user: str, tool_result: str, turn_no: int,
              then: str | None = None, reasoning: bool = True) -> dict:
    """The next request of a session: ``body``'s messages + the answer (with its reasoning or,
    ``reasoning`` false, without) + one tool result per tool call it made (``tool_result`` text)
    or, without tool calls, a user message (``user`` with the turn number appended so every turn
    differs). ``then``: ``"tool"`` appends a tool result even when no call was parsed (a call
    generated under a grammar stays the answer's text; its id is ``call_<turn_no>``), ``"user"``
    a user message even after calls (their results first)."""
    out = copy.deepcopy(body)
    msgs = list(out.get("messages") or [])
    msgs.append(answer.message(reasoning))
    if answer.tool_calls:
        for t in answer.tool_calls:
            msgs.append({"role": "tool", "tool_call_id": t["id"], "content": tool_result})
    elif then == "tool":
        msgs.append({"role": "tool", "tool_call_id": f"call_{turn_no}", "content": tool_result})
    if then == "user" or (then is None and not answer.tool_calls):
        msgs.append({"role": "user", "content": f"{user} (turn {turn_no})"})
    out["messages"] = msgs
    return out


# --------------------------------------------------------------------------------------------------
# HTTP


@dataclass
class Response:
    """One replayed response. Times in seconds (client side, from just before the POST)."""

    status: int
    answer: Answer
    timings: dict | None
    usage: dict | None
    ttft_s: float | None
    total_s: float
    headers: dict
    error: str | None = None
    tokens: list[int] | None = None      # generated ids (cold runs: return_tokens + verbose)
    generation: Generation | None = None  # per-token ids and top-2 log-probabilities (ocache.bench.exact)


def _merge_tool_deltas(calls: list[dict], deltas: list) -> None:
    for d in deltas or []:
        idx = d.get("index", len(calls))
        while len(calls) <= idx:
            calls.append({"id": "", "name": "", "arguments": ""})
        c = calls[idx]
        if d.get("id"):
            c["id"] = d["id"]
        fn = d.get("function") or {}
        if fn.get("name"):
            c["name"] += fn["name"]
        if fn.get("arguments"):
            c["arguments"] += fn["arguments"]


def _other_api_event(ev: dict, answer: "Answer") -> bool:
    """Fold one Anthropic or Responses stream event's generated text into ``answer``; True when it
    carried text, reasoning or tool-call arguments."""
    etype = ev.get("type")
    if etype == "content_block_delta":
        d = ev.get("delta") or {}
        if d.get("type") == "text_delta" and d.get("text"):
            answer.content += d["text"]
            return True
        if d.get("type") == "thinking_delta" and d.get("thinking"):
            answer.reasoning += d["thinking"]
            return True
        if d.get("type") == "input_json_delta" and d.get("partial_json"):
            idx = int(ev.get("index") or 0)
            _merge_tool_deltas(answer.tool_calls, [{"index": idx, "function": {"arguments": d["partial_json"]}}])
            return True
    elif etype == "content_block_start" and (ev.get("content_block") or {}).get("type") == "tool_use":
        cb = ev["content_block"]
        _merge_tool_deltas(answer.tool_calls, [{"index": int(ev.get("index") or 0), "id": cb.get("id", ""),
                                                "function": {"name": cb.get("name", "")}}])
    elif etype == "response.output_text.delta" and ev.get("delta"):
        answer.content += ev["delta"]
        return True
    elif etype == "response.reasoning_text.delta" and ev.get("delta"):
        answer.reasoning += ev["delta"]
        return True
    elif etype == "response.function_call_arguments.delta" and ev.get("delta"):
        item = str(ev.get("item_id") or "")
        call = next((c for c in answer.tool_calls if c.get("item") == item), None)
        if call is None:
            call = {"id": "", "name": "", "arguments": "", "item": item}
            answer.tool_calls.append(call)
        call["arguments"] += ev["delta"]
        return True
    return False


def _chat_deltas(ev: dict, answer: Answer) -> bool:
    """Add a chat stream chunk's deltas (content, reasoning, tool calls) to ``answer``; True when it
    carried any generated text, reasoning or a tool call."""
    got = False
    for ch in ev.get("choices") or []:
        delta = ch.get("delta") or {}
        if delta.get("content"):
            answer.content += delta["content"]
            got = True
        if delta.get("reasoning_content"):
            answer.reasoning += delta["reasoning_content"]
            got = True
        if delta.get("tool_calls"):
            _merge_tool_deltas(answer.tool_calls, delta["tool_calls"])
            got = True
    return got


def _json_answer(data: dict, answer: Answer) -> tuple[dict | None, dict | None, list[int] | None,
                                                      Generation | None]:
    """Fill ``answer`` from a JSON completion (chat, or an Anthropic message: content blocks, usage
    only); returns (timings, usage, the prompt's tokens from ``__verbose`` or None, the generation)."""
    msg = ((data.get("choices") or [{}])[0].get("message") or {})
    answer.content = msg.get("content") or ""
    answer.reasoning = msg.get("reasoning_content") or ""
    for t in msg.get("tool_calls") or []:
        fn = t.get("function") or {}
        answer.tool_calls.append({"id": t.get("id", ""), "name": fn.get("name", ""),
                                  "arguments": fn.get("arguments", "")})
    timings, usage = data.get("timings"), data.get("usage")
    if data.get("type") == "message":  # an Anthropic answer: content blocks, usage only
        for block in data.get("content") or []:
            if block.get("type") == "text":
                answer.content += block.get("text") or ""
            elif block.get("type") == "thinking":
                answer.reasoning += block.get("thinking") or ""
        timings = timings or timings_from_usage(usage)
    verbose = data.get("__verbose") or {}
    tokens = [int(x) for x in verbose["tokens"]] if isinstance(verbose.get("tokens"), list) else None
    return timings, usage, tokens, Generation.from_response(data)


#: seconds a pooled connection of the replay stays open unused: under llama-server's own keep-alive
#: timeout (``CPPHTTPLIB_KEEPALIVE_TIMEOUT_SECOND`` 5, vendor/cpp-httplib/httplib.h:26 of the pinned
#: source), as ocache's own connector (``ocache.upstream.Upstream.start``, 4 s). aiohttp's default (15
#: s) reused a connection the server was closing: the baselines' second request of a ``parallel``
#: step failed with ``ClientOSError: Can not write request body`` (``ocache bench --preset tiny
#: --template real --scenario opencode_runs_same_folder --models dense``: (a)'s #7; with
#: ``everyday_day_no_restart --models hybrid``: (b)'s #4 and #9), while ocache's own server, in front
#: of (c), keeps connections longer (``client_keepalive_s``)
REPLAY_KEEPALIVE_S = 4.0


def replay_connector() -> aiohttp.TCPConnector:
    """The replay's connection pool (see ``REPLAY_KEEPALIVE_S``)."""
    return aiohttp.TCPConnector(keepalive_timeout=REPLAY_KEEPALIVE_S)


async def post(session: aiohttp.ClientSession, url: str, body: dict,
               headers: dict | None = None) -> Response:
    """POST a completion body; read an SSE stream or a JSON answer. TTFT = time to the first event
    that carries generated text, reasoning or a tool call (the initial role-only chunk and empty
    "begin" events do not count); for a stream with no text, the time of the final event. Errors
    (connection, non-200) are returned in ``error``, never raised."""
    t0 = time.monotonic()
    answer = Answer()
    timings = usage = None
    anthropic_usage: dict | None = None
    ttft = None
    tokens = None
    generation = None
    events: list[dict] = []
    try:
        async with session.post(url, json=body, headers=headers or {}) as resp:
            rheaders = {k: v for k, v in resp.headers.items() if k.lower().startswith("x-ocache")}
            if resp.status != 200:
                text = await resp.text()
                return Response(resp.status, answer, None, None, None, time.monotonic() - t0,
                                rheaders, error=f"HTTP {resp.status}: {text[:300]}")
            if body.get("stream"):
                buf = b""
                async for chunk in resp.content.iter_any():
                    buf += chunk
                    while b"\n" in buf:
                        line, buf = buf.split(b"\n", 1)
                        line = line.strip()
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            continue
                        ev = json.loads(data)
                        events.append(ev)
                        if "error" in ev:
                            return Response(500, answer, timings, usage, ttft,
                                            time.monotonic() - t0, rheaders,
                                            error=f"stream error: {ev['error']}")
                        # chat chunks, then Anthropic Messages / OpenAI Responses events (/v1/messages,
                        # /v1/responses; tools/server/server-task.cpp:800-980, 1171-1310); both read
                        if (_chat_deltas(ev, answer) | _other_api_event(ev, answer)) and ttft is None:
                            ttft = time.monotonic() - t0
                        if ev.get("type") == "message_start" and isinstance(ev.get("message"), dict):
                            anthropic_usage = dict(ev["message"].get("usage") or {})
                        if ev.get("timings"):
                            timings = ev["timings"]
                        if ev.get("usage"):
                            usage = ev["usage"]
                if timings is None and anthropic_usage:
                    timings = timings_from_usage({**anthropic_usage, **(usage or {})})
            else:
                timings, usage, tokens, generation = _json_answer(await resp.json(content_type=None), answer)
            if events:
                generation = Generation.from_stream(events, (timings or {}).get("predicted_n"))
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, OSError,
            ValueError) as exc:
        return Response(0, answer, timings, usage, ttft, time.monotonic() - t0, {},
                        error=f"{type(exc).__name__}: {exc}")
    total = time.monotonic() - t0
    if ttft is None and body.get("stream"):
        ttft = total
    return Response(200, answer, timings, usage, ttft, total, rheaders, tokens=tokens,
                    generation=generation)


# --------------------------------------------------------------------------------------------------
# replay


@dataclass
class Sent:
    """One request as it was replayed: the exact body sent, its step, and the response."""

    index: int
    label: str
    session: str | None
    path: str
    body: dict
    headers: dict
    t_sent: float                 # seconds since the replay started
    response: Response
    restart_before: bool = False  # a restart step ran since the previous request
    step_no: int = 0              # index of the scenario step (parallel children share it)
    prefill_mark: int | None = None   # PrefillMeter total just before the step started
    server_prefill: int | None = None  # tokens the server prefilled for it (assign_server_prefill)
    host: str | None = None            # the host the balancer sent it to (Target.route)


class PrefillMeter:
    """llama-server's own count of the prompt tokens it prefilled, across restarts.

    Reads ``llamacpp:prompt_tokens_total`` from ``/metrics`` (needs ``--metrics``): "prompt tokens
    processed, excluding cached tokens" (server-task.cpp:1526), added per decoded prompt batch
    (server-context.cpp:4136). Unlike a response's ``timings.prompt_n`` it also counts prefills
    nobody's client saw: a proxy's warm-ups (``max_tokens: 0`` requests) and anything else sent
    to the server. The counter restarts at 0 with a new process: call :meth:`restarted` after a
    restart. :meth:`sample` returns the running total (tokens) since the first sample.
    """

    def __init__(self, base_url: str) -> None:
        self.url = base_url.rstrip("/") + "/metrics"
        self.total = 0
        self._last: float | None = None

    async def read(self, http: aiohttp.ClientSession) -> float:
        async with http.get(self.url) as r:
            if r.status != 200:
                raise ReplayError(f"{self.url}: HTTP {r.status} (start llama-server with --metrics)")
            for line in (await r.text()).splitlines():
                if line.startswith("llamacpp:prompt_tokens_total "):
                    return float(line.split()[1])
        raise ReplayError(f"{self.url}: no llamacpp:prompt_tokens_total")

    async def sample(self, http: aiohttp.ClientSession) -> int:
        v = await self.read(http)
        if self._last is not None:
            self.total += int(round(v - self._last)) if v >= self._last else int(round(v))
        self._last = v
        return self.total

    def restarted(self) -> None:
        """The server process was replaced: its counter starts again from 0."""
        self._last = 0.0


def assign_server_prefill(sent: list["Sent"], final_total: int) -> None:
    """Per-request server-side prefill from the meter marks taken before each step.

    A step's interval (until the next step's mark, or ``final_total``) covers its requests and any
    work done after their responses, before the next step (a proxy's admission or warm-ups). Each
    request is charged its own ``prompt_n``; the rest of the interval (prefill no response
    reported) is split over the step's requests in proportion to their prompt lengths
    (``usage.prompt_tokens``): in a parallel group, a proxy's warm-up is for the long agent
    prompt, not for the short title request beside it.
    """
    groups: dict[int, list[Sent]] = {}
    marks: dict[int, int] = {}   # step -> the mark of its first request
    for s in sent:
        if s.prefill_mark is not None:
            groups.setdefault(s.step_no, []).append(s)
            marks.setdefault(s.step_no, s.prefill_mark)
    order = sorted(groups)
    for i, g in enumerate(order):
        members = groups[g]
        start = marks[g]
        end = marks[order[i + 1]] if i + 1 < len(order) else final_total
        delta = max(int(end - start), 0)
        own = [int((m.response.timings or {}).get("prompt_n") or 0) for m in members]
        extra = delta - sum(own)
        if extra < 0:  # counter lost across a restart: fall back to what the responses said
            for m, n in zip(members, own):
                m.server_prefill = n
            continue
        weights = [int((m.response.usage or {}).get("prompt_tokens") or 0) for m in members]
        tot = sum(weights)
        left = extra
        for j, m in enumerate(members):
            if j == len(members) - 1:
                share = left
            else:
                share = extra * weights[j] // tot if tot else extra // len(members)
            m.server_prefill = own[j] + share
            left -= share


@dataclass
class Target:
    """Where requests go (``url``: llama-server or a proxy in front of it) and the hooks the
    harness needs: ``restart`` (stop + start the llama-server process(es); awaited),
    ``upstream_url`` (the llama-server itself, for tokenizing and cold runs) and ``meter`` (its
    prefill counter, sampled before every step; the caller takes the final sample; anything with
    ``sample(http)`` and ``restarted()``). Several hosts (``ocache.bench.hosts``): ``route``
    (request headers -> (host name, base URL), called once per request in the order they are
    sent; replaces ``url``) and ``host_down`` (stop one host by name; awaited)."""

    url: str
    upstream_url: str
    restart: Callable[[], Awaitable[None]] | None = None
    meter: Any = None
    route: Callable[[dict], tuple[str, str]] | None = None
    host_down: Callable[[str], Awaitable[None]] | None = None


def _uses_grammars(scenario: Scenario) -> bool:
    def uses(s: Step) -> bool:
        return bool(s.grammar) or any(uses(c) for c in s.children)
    return any(uses(s) for s in scenario.steps)


async def step_grammars(http: aiohttp.ClientSession, server_url: str) -> dict[str, str]:
    """Every ``ocache.bench.agent.grammar`` by name for the template ``server_url`` serves: its
    call format from ``/props`` ``chat_template``, and whether its generation prompt opens the think
    block (the render of a one-message conversation ends with ``<think>\n``). Raises ReplayError
    on an HTTP error."""
    from ocache.bench.agent import GRAMMARS, call_format, grammar

    async with http.get(server_url + "/props") as r:
        if r.status != 200:
            raise ReplayError(f"/props: HTTP {r.status}")
        template = (await r.json()).get("chat_template") or ""
    async with http.post(server_url + "/apply-template", json={
            "messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True}) as r:
        if r.status != 200:
            raise ReplayError(f"/apply-template: HTTP {r.status}")
        opens = (await r.json())["prompt"].endswith("<think>\n")
    return {name: grammar(name, call_format(template), opens=opens) for name in GRAMMARS}


def step_request(scenario: Scenario, step: Step, sessions: dict[str, dict], turn_counts: dict[str, int],
                 grammars: Mapping[str, str]) -> tuple[dict, dict, str, str]:
    """``(body, headers, label, path)`` of the request a ``send`` or ``turn`` step sends: a ``send``
    its own body (``prepare_body``), a ``turn`` the next turn of its session's last request and
    answer (``next_turn``; ``sessions``: name -> ``{"body", "headers", "path", "answer"}``,
    ``turn_counts`` counted up here), then the step's ``edits`` and ``grammar`` (``grammars``:
    name -> GBNF text). Raises ReplayError for a turn whose session has no answer."""
    if step.kind == "send":
        body = prepare_body(step.body or {}, scenario.max_tokens)
        headers = dict(step.headers)
        label = step.label or Path(step.source or "request").stem
        path = step.path
    else:
        name = step.session or ""
        st = sessions.get(name)
        if st is None or st["answer"] is None:
            raise ReplayError(f"{scenario.name}: turn on session {step.session!r} "
                              "whose last request failed or never ran")
        turn_counts[name] = turn_counts.get(name, 1) + 1
        body = next_turn(st["body"], st["answer"], step.user, step.tool_result,
                         turn_counts[name], then=step.then,
                         reasoning=scenario.reasoning == "keep")
        headers = dict(st["headers"])
        label = step.label or f"{name} turn {turn_counts[name]}"
        path = st["path"]
    if step.edits:
        body = apply_edits(body, step.edits)
    if step.grammar:
        body["grammar"] = grammars[step.grammar]
    return body, headers, label, path


async def replay(scenario: Scenario, target: Target, time_scale: float = 1.0,
                 timeout_s: float = 1800.0) -> list[Sent]:
    """Send the scenario's requests to ``target.url``; return them in the order they were sent.

    Gaps are ``gap_s * time_scale`` seconds of plain waiting (a scenario's pacing, not
    synchronisation). A failed request is kept (``response.error``); a ``turn`` on a session whose
    last request failed raises ReplayError (there is no answer to grow from).
    """
    sessions: dict[str, dict] = {}
    turn_counts: dict[str, int] = {}
    sent: list[Sent] = []
    t_start = time.monotonic()
    restarted = False
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_read=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=replay_connector()) as http:

        step_no = 0
        mark: int | None = None
        grammars = await step_grammars(http, target.upstream_url) if _uses_grammars(scenario) else {}

        async def run_one(step: Step) -> None:
            nonlocal restarted
            body, headers, label, path = step_request(scenario, step, sessions, turn_counts, grammars)
            host, base = target.route(headers) if target.route is not None else (None, target.url)
            rec = Sent(index=len(sent), label=label, session=step.session, path=path, body=body,
                       headers=headers, t_sent=time.monotonic() - t_start,
                       response=None, restart_before=restarted,  # type: ignore[arg-type]
                       step_no=step_no, prefill_mark=mark, host=host)
            restarted = False
            sent.append(rec)
            rec.response = await post(http, base + path, body, headers)
            if rec.response.error:
                log.warning("%s #%d %s: %s", scenario.name, rec.index, label, rec.response.error)
            if step.session:
                sessions[step.session] = {
                    "body": body, "headers": headers, "path": path,
                    "answer": None if rec.response.error else rec.response.answer}

        for step in scenario.steps:
            gap = scenario.gap_s if step.gap_s is None else step.gap_s
            if gap > 0 and time_scale > 0 and sent:
                await asyncio.sleep(gap * time_scale)
            step_no += 1
            if target.meter is not None:
                mark = await target.meter.sample(http)
            if step.kind == "restart":
                if target.restart is None:
                    raise ReplayError(f"{scenario.name}: the target cannot be restarted")
                await target.restart()
                if target.meter is not None:
                    target.meter.restarted()
                restarted = True
            elif step.kind == "host_down":
                if target.host_down is None:
                    raise ReplayError(f"{scenario.name}: the target has no hosts to stop")
                await target.host_down(step.host or "")
            elif step.kind == "parallel":
                async def delayed(child: Step) -> None:
                    if child.delay_s > 0:
                        await asyncio.sleep(child.delay_s * max(time_scale, 0.0))
                    await run_one(child)
                await asyncio.gather(*(delayed(c) for c in step.children))
            else:
                await run_one(step)
    return sent


# --------------------------------------------------------------------------------------------------
# measurement


async def prompt_tokens(http: aiohttp.ClientSession, base_url: str, path: str, body: dict,
                        viewer: Any = None) -> list[int]:
    """The token ids llama-server prefills for ``body``: its own chat template (``/apply-template``)
    then ``/tokenize`` with ``add_special`` and ``parse_special`` (docs/llama-server.md §8); for ``/completion``
    routes the ``prompt`` field (a string or token ids). ``/v1/messages`` and ``/v1/responses``
    bodies are first converted to the chat form the server renders (``ocache.api.convert.to_chat``:
    the server runs the same conversion before its template, server-chat.cpp:6-306 and 348-619; a
    raw Anthropic body at ``/apply-template`` fails with the server's "Missing tool type", a
    Responses body has no ``messages`` at all). Uses ``viewer.view(path, body, None)`` when a
    ``TokenViewer`` is given. Raises ReplayError on an HTTP error (its message carries the
    server's own, e.g. the template's ``raise_exception``) or a body the server's converter rejects."""
    if viewer is not None:
        try:
            view = await viewer.view(path, body, None)
            return list(view.tokens)
        except Exception as exc:  # the viewer is another module's; the endpoints are the truth
            log.warning("TokenViewer failed (%s); tokenizing through the endpoints", exc)
    if path in CONVERTED_ROUTES:
        try:
            body = to_chat(path, body)
        except ConversionError as exc:
            raise ReplayError(f"the server's converter rejects the body ({path}): {exc}") from exc
    if "messages" in body:
        async with http.post(base_url + "/apply-template", json=body) as r:
            if r.status != 200:
                raise ReplayError(f"/apply-template: HTTP {r.status} {await r.text()}")
            text = (await r.json())["prompt"]
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if not isinstance(prompt, str):
            raise ReplayError(f"cannot tokenize a body without messages or a string prompt ({path})")
        text = prompt
    async with http.post(base_url + "/tokenize",
                         json={"content": text, "add_special": True, "parse_special": True}) as r:
        if r.status != 200:
            raise ReplayError(f"/tokenize: HTTP {r.status} {(await r.text())[:200]}")
        return [int(t) if not isinstance(t, dict) else int(t["id"]) for t in (await r.json())["tokens"]]


def _token_viewer(base_url: str) -> Any:
    """``ocache.tokens.TokenViewer`` on this server without delta renders (its own HTTP session;
    the caller closes it) if that module is present, else None (the endpoints are called directly)."""
    try:
        from ocache.tokens import TokenViewer
    except ImportError:
        return None
    try:
        # full renders only: a delta render assumes an append-only template and is checked in the
        # background, so the first request after a history rewrite (the templates people run,
        # ocache/align.py) would be measured on a wrong prompt (seen: 5,470 tokens for the server's 5,458)
        return TokenViewer(base_url, delta=False)
    except Exception as exc:  # another module's constructor: fall back to the endpoints
        log.warning("TokenViewer unavailable (%s); tokenizing through the endpoints", exc)
        return None


def describe_mismatch(got: Answer, cold: Answer) -> str:
    """Where a replayed answer first differs from the cold run's (field, character offset, the
    few characters on each side), for the report."""
    for name, a, b in (("content", got.content, cold.content),
                       ("reasoning", got.reasoning, cold.reasoning),
                       ("tool calls", json.dumps(got.key()[2]), json.dumps(cold.key()[2]))):
        if a != b:
            i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return (f"{name} differs from the cold run at char {i}: "
                    f"{a[max(i - 8, 0):i + 8]!r} vs {b[max(i - 8, 0):i + 8]!r}")
    return "output differs from the cold run"


def judge(cold: Response, got: Response) -> tuple[bool, str, int | None]:
    """Whether ``got`` is exact against the cold run: per token with ``ocache.bench.exact.compare`` when
    both carry log-probabilities (the harness asks for them), else the parsed answers must be
    equal. Returns (exact, what differs, tokens compared; None for the text comparison)."""
    if cold.generation is not None and got.generation is not None:
        v = compare(cold.generation, got.generation)
        return v.exact, ("" if v.exact else f"{describe(v)} (tool calls and text: "
                         f"{describe_mismatch(got.answer, cold.answer)})"), v.compared
    same = got.answer.key() == cold.answer.key()
    return same, "" if same else describe_mismatch(got.answer, cold.answer), None


def cold_body(body: dict) -> dict:
    """``body`` as a cold reference run: no prompt cache (``cache_prompt: false`` = fresh prefill),
    alone on the server (the harness sends cold runs one at a time), not streamed, with the
    generated token ids (``return_tokens`` + ``verbose``) and their top-2 log-probabilities."""
    out = copy.deepcopy(body)
    out.update(PROBS_FIELDS)
    out["stream"] = False
    out.pop("stream_options", None)
    out.pop("id_slot", None)
    out["cache_prompt"] = False
    out["return_tokens"] = True
    out["verbose"] = True
    return out


def cold_request(upstream_url: str, path: str, body: dict) -> tuple[str, dict]:
    """(url, body) of the cold reference run of a request to ``path``. ``/v1/messages`` and
    ``/v1/responses`` bodies go to ``/v1/chat/completions`` in the chat form the server itself
    renders (ocache/api/convert.py): the Anthropic converter drops ``cache_prompt`` (the run would not
    be cold) and both answer in shapes ``post`` does not read when not streamed. The prompt and
    the sampling are the same, so is the greedy output."""
    from ocache.api.convert import CONVERTED_ROUTES, to_chat

    if path in CONVERTED_ROUTES:
        chat = to_chat(path, body)
        for k in ("temperature", "seed", "max_tokens"):  # Anthropic keeps temperature only
            if k in body:
                chat[k] = body[k]
        return upstream_url + "/v1/chat/completions", cold_body(chat)
    return upstream_url + path, cold_body(body)


def body_key(path: str, body: dict) -> str:
    return hashlib.sha256((path + "\0" + json.dumps(body, sort_keys=True)).encode()).hexdigest()


@dataclass
class Row:
    """One request, measured. Token counts in tokens, times in seconds."""

    index: int
    label: str
    n_tokens: int                 # prompt tokens (server template + tokenizer)
    prompt_n: int | None          # prefill the client saw (timings.prompt_n)
    server_prefill: int | None    # prefill the server did for it (PrefillMeter; None: unmetered)
    cache_n: int | None           # observed reuse (timings.cache_n)
    oracle: OracleResult          # on the server's checkpoint grid (hybrids), as specified
    ttft_s: float | None
    cold_ttft_s: float | None
    exact: bool | None            # greedy output == cold run (None: could not compare)
    exact_tokens: int | None      # tokens ocache.bench.exact compared (None: compared as text)
    restart_before: bool
    ocache: dict                  # X-OCache-* response headers
    error: str | None = None
    note: str | None = None
    oracle_exact: OracleResult | None = None   # no grid rounding: a bound no cache can beat
    #: sha256 of the prompt's token ids: two configurations' rows of one step are the same request
    #: only when these agree (a ``turn`` step is built from each configuration's own answers)
    prompt_key: str | None = None

    @property
    def ttft_ratio(self) -> float | None:
        if self.ttft_s is None or not self.cold_ttft_s:
            return None
        return self.ttft_s / self.cold_ttft_s


def cold_ttft(resp: Response) -> float | None:
    """Client TTFT of a non-streamed cold run: total time minus the decode time of every token
    after the first (``timings.predicted_per_token_ms``)."""
    t = resp.timings or {}
    n = int(t.get("predicted_n") or 0)
    per = float(t.get("predicted_per_token_ms") or 0.0) / 1000.0
    return max(resp.total_s - max(n - 1, 0) * per, 0.0)


async def measure(sent: list[Sent], upstream_url: str, grid: int | None,
                  cold_cache: dict[str, Response] | None = None, viewer: Any = None,
                  timeout_s: float = 1800.0) -> list[Row]:
    """Tokenize each replayed request on ``upstream_url``, run it cold there once per distinct
    body (``cold_cache``: body key -> cold Response, shared across calls; an entry made on another
    server is trusted only while it agrees: a mismatch is re-checked with a cold run here), and
    judge the stream with the oracle (``grid``: the hybrid checkpoint grid = the server's ubatch,
    None for dense). The oracle's answer tokens for a request are the cold run's generated ids:
    when a replay is exact they are the ids the replay generated too."""
    cold_cache = {} if cold_cache is None else cold_cache
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_read=timeout_s)
    oracle = Oracle(grid)
    rows: list[Row] = []
    own_viewer = None
    exact_oracle = Oracle(None) if grid is not None else None
    async with aiohttp.ClientSession(timeout=timeout, connector=replay_connector()) as http:
        if viewer is None:
            viewer = own_viewer = _token_viewer(upstream_url)
        try:
            return await _measure(sent, http, upstream_url, oracle, rows, cold_cache, viewer,
                                  exact_oracle)
        finally:
            close = getattr(own_viewer, "close", None)
            if close is not None:
                res = close()
                if asyncio.iscoroutine(res):
                    await res


async def _cold_run(http: aiohttp.ClientSession, upstream_url: str, s: Sent, served: list[int] | None,
                    cold_cache: dict, r: Response) -> Response:
    """The cold reference of one replayed request: of its body (once per distinct body, shared
    across configurations: a mismatch against a reference made on another server is confirmed
    on this one) or, for an aligned request, of the prompt it was served (``served``: token ids,
    ``ocache.bench.served``), keyed by those ids."""
    if served is not None:
        from ocache.bench.served import cold_completion_body

        body = cold_completion_body(s.body, served)
        key = body_key("/completion", body)
        cold = cold_cache.get(key)
        if cold is None:
            cold = await post(http, upstream_url + "/completion", body)
            if cold.tokens is None and cold.generation is not None:
                cold.tokens = list(cold.generation.tokens)
            cold_cache[key] = cold
        return cold
    key = body_key(s.path, s.body)
    cold = cold_cache.get(key)
    if cold is None:
        cold = await post(http, *cold_request(upstream_url, s.path, s.body))
        cold_cache[key] = cold
    elif not r.error and not cold.error and not judge(cold, r)[0]:
        # the shared reference came from another server (other flags): confirm a mismatch
        # against a cold run on this one before reporting it
        cold = await post(http, *cold_request(upstream_url, s.path, s.body))
    return cold


def _generated(s: Sent, cold: Response, exact: bool | None) -> list[int] | None:
    """The ids a replayed request generated: its own from a non-streamed answer (all of them, as
    many as ``predicted_n``); for a stream, whose per-token entries leave out what the reasoning
    parser consumes (``</think>``), the cold run's when the request was exact; else None."""
    r = s.response
    g = r.generation
    n = (r.timings or {}).get("predicted_n")
    if not s.body.get("stream") and g is not None and g.complete and (n is None or len(g.tokens) == int(n)):
        return list(g.tokens)
    return list(cold.tokens) if exact and cold.tokens else None


#: the note of a request the server rejected before rendering its prompt (:func:`_rejected_row`),
#: followed by the server's reason
REJECTED_NOTE = "rejected by the server, not rendered: "


def _reason(error: str) -> str:
    """The last line of the server's own message in an error text that ends with its JSON answer
    (``{"error": {"message": ...}}``, ``format_error_response``, tools/server/server-common.cpp:36), e.g.
    "Error: Jinja Exception: System message must be at the beginning."; else the text's first
    200 characters."""
    i = error.find("{")
    try:
        msg = json.loads(error[i:])["error"]["message"] if i >= 0 else None
    except (ValueError, KeyError, TypeError):
        msg = None
    lines = [ln.strip() for ln in msg.splitlines() if ln.strip()] if isinstance(msg, str) else []
    return lines[-1][:200] if lines else error[:200]


def _rejected_row(s: Sent, why: str) -> Row:
    """The row of a request the server answered with an error and whose prompt it cannot render
    either (``why``: the render's error): a body the server rejects before any prefill, e.g. a
    template's ``raise_exception`` on the client's message order (Qwen3.5's "System message must be
    at the beginning" on Claude Code's mid-conversation system message and on Codex's two
    developer items, mapped to system by common/chat.cpp:1004-1012). No prompt, no oracle, no cold
    run: the request counts as an error with the server's own answer, so a scenario the server
    cannot serve is reported request by request instead of aborted by the measurement."""
    r = s.response
    return Row(index=s.index, label=s.label, n_tokens=0, prompt_n=None, server_prefill=s.server_prefill,
               cache_n=None, oracle=OracleResult(0, 0, 0, 0, None), ttft_s=r.ttft_s, cold_ttft_s=None,
               exact=None, exact_tokens=None, restart_before=s.restart_before, ocache=r.headers,
               error=r.error, note=REJECTED_NOTE + _reason(why),
               oracle_exact=OracleResult(0, 0, 0, 0, None), prompt_key=None)


async def _measure(sent: list[Sent], http: aiohttp.ClientSession, upstream_url: str,
                   oracle: Oracle, rows: list[Row], cold_cache: dict, viewer: Any,
                   exact_oracle: Oracle | None = None) -> list[Row]:
    from ocache.bench.served import ServedPrompts

    slots = ServedPrompts()
    for s in sent:
        r = s.response
        try:
            rendered = await prompt_tokens(http, upstream_url, s.path, s.body, viewer)
        except ReplayError as exc:
            if not r.error:  # served, yet not renderable here: the bench is wrong, not the server
                raise
            rows.append(_rejected_row(s, str(exc)))
            continue
        served, unknown = slots.served(r.headers, rendered)
        tokens = rendered if served is None else served
        cold = await _cold_run(http, upstream_url, s, served, cold_cache, r)
        verdict = oracle.min_prefill(tokens)
        note = unknown
        usage_n = (r.usage or {}).get("prompt_tokens")
        if usage_n is not None and int(usage_n) != len(tokens):
            note = ((note + "; ") if note else "") + f"tokenized {len(tokens)} != server prompt_tokens {usage_n}"
        if served is not None:
            note = ((note + "; ") if note else "") + "judged on the prompt served (aligned)"
        exact = compared = None
        if not r.error and not cold.error:
            exact, why, compared = judge(cold, r)
            if not exact:
                note = ((note + "; ") if note else "") + why
        t = r.timings or {}
        rows.append(Row(index=s.index, label=s.label, n_tokens=len(tokens),
                        prompt_n=t.get("prompt_n"), server_prefill=s.server_prefill,
                        cache_n=t.get("cache_n"), oracle=verdict,
                        ttft_s=r.ttft_s, cold_ttft_s=None if cold.error else cold_ttft(cold),
                        exact=exact, exact_tokens=compared, restart_before=s.restart_before,
                        ocache=r.headers,
                        error=r.error or (f"cold run: {cold.error}" if cold.error else None),
                        note=note,
                        oracle_exact=exact_oracle.min_prefill(tokens) if exact_oracle else verdict,
                        prompt_key=hashlib.sha256(json.dumps(list(tokens)).encode()).hexdigest()))
        slots.record(r.headers, tokens, None if r.error else _generated(s, cold, exact))
        for o in (oracle, exact_oracle):
            if o is not None:
                o.add(tokens)
                if cold.tokens:
                    o.add(tokens + cold.tokens)
                    # the state the server holds after a generation: every token but the last
                    # (docs/llama-server.md §7), a whole source a next prompt may extend
                    o.add(tokens + cold.tokens[:-1])
    return rows
