"""The agent loop on the chat templates people run: templates, generation grammars, tool results.

The bench and ``scripts/measure-align`` serve the tiny models with a template of the pinned source's
``models/templates/`` (``--chat-template-file``) and play an agent loop with the server's own
generations. The tiny random model says nothing sensible on its own, so each generated turn is
sampled under a grammar (:func:`grammar`): some words of reasoning, the end of thinking, then a call
of a ``read`` tool in the template's own format (a tool turn) or one sentence (the answer). Once a
grammar completes only the end-of-turn token can be sampled, so each turn ends as a real model's
does (``finish_reason: stop``). llama-server refuses a client grammar beside tools unless
``tool_choice`` is ``none`` and then does not parse calls: the call stays the turn's text, which
these templates render byte for byte as a parsed call.

Pure but for :func:`template_path` and :func:`source_text` (files of the pinned source).
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

#: the thinking template each tiny model is served with by ``template: real`` (both in the pinned
#: source: Qwen3.5's for the hybrid, like the 4B it is shaped after; Qwen3's for the dense)
REAL_TEMPLATES: Mapping[str, str] = {"hybrid": "Qwen3.5-4B.jinja", "dense": "Qwen-Qwen3-0.6B.jinja"}

#: the template the tiny models embed (ocache's append-only ``ocache/data/chat_template.jinja``)
OWN = "ocache"

#: the files the ``read`` tool may name: an enum, so the grammar keeps the generated call short
FILES = ("ocache/proxy.py", "ocache/slots.py", "ocache/tokens.py", "docs/llama-server.md")

#: the ``read`` tool of the loop (OpenAI ``tools`` entry)
READ_TOOL = {"type": "function", "function": {
    "name": "read", "description": "Read a file of the repository.",
    "parameters": {"type": "object", "properties": {"filePath": {"type": "string", "enum": list(FILES)}},
                   "required": ["filePath"]}}}

#: reasoning: words of letters, one space between, then the end of thinking
REASONING = '[a-z] [a-z]{1,9} (" " [a-z]{1,9}){%d,%d} "\\n</think>\\n\\n"'
_PATHS = "(" + " | ".join(f'"{f}"' for f in FILES) + ")"
#: the call as each template renders a ``tool_calls`` entry: Qwen3.5's (and Qwen3-Coder's) XML,
#: Qwen3's (and ocache's) JSON in ``<tool_call>`` tags
CALL_GRAMMAR = {
    "xml": ('"<tool_call>\\n<function=read>\\n<parameter=filePath>\\n" ' + _PATHS
            + ' "\\n</parameter>\\n</function>\\n</tool_call>"'),
    "json": ('"<tool_call>\\n{\\"name\\": \\"read\\", \\"arguments\\": {\\"filePath\\": \\"" ' + _PATHS
             + ' "\\"}}\\n</tool_call>"'),
}
ANSWER = '[A-Z] [a-z]{1,9} (" " [a-z]{1,9}){4,24} "."'

#: most words of reasoning per turn (at least half of them are generated)
REASONING_WORDS = 24

#: grammar names a scenario step may give (``grammar: tool_call``)
GRAMMARS = ("tool_call", "answer")


def resolve_template(spec: str | Mapping[str, str] | None, model: str) -> str | None:
    """The template file name to serve ``model`` with, from a scenario's ``template:`` (or
    ``ocache bench --template``): None or ``"ocache"``: the model's own (no flag); ``"real"``:
    :data:`REAL_TEMPLATES`; a mapping: per model (a model it lacks gets its own); else the file
    name itself. Raises ValueError for ``real`` on a model without a real template."""
    if isinstance(spec, Mapping):
        spec = spec.get(model)
    if spec is None or spec == OWN:
        return None
    if spec == "real":
        if model not in REAL_TEMPLATES:
            raise ValueError(f"no real template for model {model!r} (known: {sorted(REAL_TEMPLATES)})")
        return REAL_TEMPLATES[model]
    return str(spec)


def template_path(name: str) -> Path:
    """``models/templates/<name>`` of the pinned source (FileNotFoundError if absent)."""
    from ocache.toolchain import engine

    return engine.chat_template_file(name)


def template_args(spec: str | Mapping[str, str] | None, model: str) -> list[str]:
    """llama-server arguments that serve ``model`` with the template ``spec`` names
    (:func:`resolve_template`): ``--chat-template-file PATH``, or none for the model's own."""
    name = resolve_template(spec, model)
    return [] if name is None else ["--chat-template-file", str(template_path(name))]


def call_format(chat_template: str) -> str:
    """``"xml"`` when the template renders a tool call as ``<function=NAME>`` (Qwen3.5,
    Qwen3-Coder), else ``"json"`` (``<tool_call>{"name": ...}``: Qwen3, ocache's own). Read from
    the template's text (``/props`` ``chat_template``)."""
    return "xml" if "<function=" in chat_template else "json"


def grammar(kind: str, fmt: str, words: int = REASONING_WORDS, opens: bool = True) -> str:
    """The GBNF of a generated turn: ``kind`` ``"tool_call"`` (reasoning, then a ``read`` call in
    format ``fmt``, :func:`call_format`) or ``"answer"`` (reasoning, then one sentence), with at
    most ``words`` words of reasoning (at least half of them). ``opens``: the template's generation
    prompt opens the think block itself (Qwen3.5's ends with ``<think>\\n``), else the model writes
    ``<think>`` (Qwen3's). Raises ValueError for an unknown kind or format."""
    if kind not in GRAMMARS:
        raise ValueError(f"unknown grammar {kind!r} (known: {', '.join(GRAMMARS)})")
    if fmt not in CALL_GRAMMAR:
        raise ValueError(f"unknown call format {fmt!r}")
    start = "" if opens else '"<think>\\n" '
    return (f"root ::= reasoning {CALL_GRAMMAR[fmt] if kind == 'tool_call' else ANSWER}\n"
            f"reasoning ::= {start}{REASONING % (words // 2, words)}")


def source_text(path: str, chars: int, offset: int = 0) -> str:
    """``chars`` characters of a file of the pinned source (``path`` relative to its root, e.g.
    ``tools/server/README.md``) from ``offset``, wrapped as a read tool's result: a tool result
    that is the same text in every run (the source is pinned). Raises FileNotFoundError or
    ValueError when the file is shorter than asked."""
    from ocache.toolchain import engine

    text = (engine.source_dir() / path).read_text(errors="replace")
    if len(text) < offset + chars:
        raise ValueError(f"{path} has {len(text)} characters, fewer than {offset + chars}")
    return f"<file path=\"{path}\">\n{text[offset:offset + chars]}\n</file>"
