"""Chat templates of every family on a tiny model of their own vocabulary, through ``ocache serve``
and alone (``scripts/measure-families``, ``tests/test_template_families.py``).

Each :class:`Family` names a template of the pinned source (``models/templates/<file>``, read by
path) and a family model (``ocache.toolchain.models.make_family``: the tiny dense model with that
family's vocabulary). :func:`play` runs the loop of ``tests/test_real_templates.py`` on it twice, on
a fresh llama-server each time (``-np 2 -c 16384 -fa on``, ``--chat-template-file``): alone, then
behind ``ocache serve``. The loop: a turn the model writes under a grammar (the family's reasoning
markup, some words, then a sentence naming the file it reads), the tool's result (the ``tool`` role,
or a ``user`` message where the template refuses a tool result without a parsed call: gpt-oss),
the answer (same grammar), a new user message (answered under the same grammar: a harmony
parser refuses free text, HTTP 500). The client sends each
answer back as the server relayed it, ``content`` only: the reasoning is dropped.

What a row records (:class:`Row`): per request the server's own prefill (the delta of
``llamacpp:prompt_tokens_total`` on ``/metrics``, tokens) alone and through ocache, whether ocache
aligned it (``X-OCache-Aligned``), ``/v1/cache/stats`` ``layer.align`` (``off`` and the
``as_sent_*`` counters), and for an aligned last request whether its greedy answer equals a cold
prefill of the prompt served (the slot's file, ``/slots/N?action=save``: that prompt, then the ids
generated but the last; a ``/completion`` of those ids on the other slot with ``cache_prompt:
false``), up to the cold run's first near-tie (gpt-oss's template writes the day's date, so its
answers change with the day; on 2026-12-06 a tie of 0.011 nats at the 11th token flipped).
"""

from __future__ import annotations

import json
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from ocache.toolchain import engine, models

#: the tool the loop declares (the model "calls" it in text: a client grammar beside tools needs
#: ``tool_choice: none``, tools/server/server-common.cpp, and then the server parses no call)
TOOLS = [{"type": "function", "function": {
    "name": "read", "description": "Read a file.",
    "parameters": {"type": "object", "properties": {"filePath": {"type": "string", "enum": ["a.py", "b.py"]}},
                   "required": ["filePath"]}}}]
#: some words of reasoning (GBNF)
WORDS = '[a-z] [a-z]{1,9} (" " [a-z]{1,9}){6,12}'
CALL_TEXT = '"I will read " ("a.py" | "b.py") "."'
ANSWER_TEXT = '[A-Z] [a-z]{1,9} (" " [a-z]{1,9}){3,8} "."'
USER = "Thanks. Which file would you change first?"
#: the loop's first prompts
START = [{"role": "system", "content": "You are a coding agent."},
         {"role": "user", "content": "Read a file, then say what it does."}]


def _lit(text: str) -> str:
    """``text`` as a GBNF string literal."""
    return json.dumps(text)


@dataclass(frozen=True)
class Family:
    """``template``: the file in the pinned source's ``models/templates/``; ``vocab``: the family
    model (``ocache.toolchain.models.FAMILY_VOCABS``); ``think``: (what the model writes to open its
    reasoning after the template's generation prompt, what closes it and opens the answer), None
    for a family without reasoning markup; ``wrap``: what the model writes before and after its
    answer's text (the server's parser wants it: Command R's response markers); ``tool_role``: the tool's result goes as a ``tool``
    message (else ``user``: the template raises on a tool message after a turn without a parsed
    call: gpt-oss; or renders none: Gemma 4 drops it, Phi-3.5 has no tool role)."""

    name: str
    template: str
    vocab: str
    think: tuple[str, str] | None = None
    tool_role: bool = True
    wrap: tuple[str, str] = ("", "")

    def grammar(self, text: str) -> str:
        """The GBNF of a turn whose answer is ``text`` (GBNF) in the family's markup."""
        if any(self.wrap):
            text = f"{_lit(self.wrap[0])} {text} {_lit(self.wrap[1])}"
        body = text if self.think is None else f"{_lit(self.think[0])} {WORDS} {_lit(self.think[1])} {text}"
        return "root ::= " + body


FAMILIES: tuple[Family, ...] = (
    Family("Qwen3.5", "Qwen3.5-4B.jinja", "qwen35", ("", "\n</think>\n\n")),
    Family("Qwen3", "Qwen-Qwen3-0.6B.jinja", "qwen2", ("<think>\n", "\n</think>\n\n")),
    Family("DeepSeek-R1 (Qwen)", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", "qwen2", ("", "\n</think>\n\n")),
    Family("Llama 3.1", "meta-llama-Llama-3.1-8B-Instruct.jinja", "llama-bpe"),
    Family("Llama 3.3", "meta-llama-Llama-3.3-70B-Instruct.jinja", "llama-bpe"),
    Family("DeepSeek-R1 (Llama)", "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja", "llama-bpe", ("", "\n</think>\n\n")),
    Family("Gemma 4", "google-gemma-4-31B-it.jinja", "gemma-4", tool_role=False),
    Family("Phi-3.5", "microsoft-Phi-3.5-mini-instruct.jinja", "phi-3", tool_role=False),
    Family("Command R+", "CohereForAI-c4ai-command-r-plus-tool_use.jinja", "command-r"),
    Family("Command R7B", "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja", "command-r",
           wrap=("<|START_RESPONSE|>", "<|END_RESPONSE|>")),
    Family("gpt-oss", "openai-gpt-oss-120b.jinja", "harmony",
           ("<|channel|>analysis<|message|>", "<|end|><|start|>assistant<|channel|>final<|message|>"),
           tool_role=False),
)


def by_name(name: str) -> Family:
    return next(f for f in FAMILIES if f.name == name)


@dataclass
class Row:
    """One family's result: ``alone`` and ``ocache``: the server's prefill per request (tokens);
    ``aligned``: per request through ocache, ``X-OCache-Aligned`` (``kept+new``) or None; ``align``:
    ``/v1/cache/stats`` ``layer.align``; ``exact``: the aligned last answer equals a cold prefill
    of the prompt served, up to its first near-tie (None: the last request was not aligned); ``error``: why the loop did not
    run (a template that refuses the conversation)."""

    family: Family
    alone: list[int] = field(default_factory=list)
    ocache: list[int] = field(default_factory=list)
    aligned: list[str | None] = field(default_factory=list)
    align: dict = field(default_factory=dict)
    exact: bool | None = None
    error: str | None = None
    ubatch: int = 512

    @property
    def why_not(self) -> str:
        """Why the new user message was not aligned: ``align.off``, else the ``as_sent_*`` reasons."""
        if self.align.get("off"):
            return f"off: {self.align['off']}"
        reasons = sorted(k.removeprefix("as_sent_").replace("_", " ") for k, v in self.align.items()
                         if k.startswith("as_sent_") and v)
        return ", ".join(reasons) or "-"


def _post(url: str, path: str, body: dict, timeout: float = 600) -> tuple[dict, dict]:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read()), dict(r.headers)


def _prefilled(server: str) -> int:
    with urllib.request.urlopen(server + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return int(float(next(ln.split()[-1] for ln in text.splitlines()
                          if ln.startswith("llamacpp:prompt_tokens_total"))))


def loop(fam: Family, url: str, server: str) -> list[tuple[dict, dict, dict, int]]:
    """The loop (module docstring) through ``url`` against llama-server ``server``: (body,
    response, headers, the server's prefill) per request."""
    tool = engine.chat_template_file("Qwen3.5-4B.jinja").read_text()[:1500]
    msgs = list(START)
    out = []
    for grammar in (fam.grammar(CALL_TEXT), fam.grammar(ANSWER_TEXT), fam.grammar(ANSWER_TEXT)):
        body = {"messages": msgs, "tools": TOOLS, "tool_choice": "none", "temperature": 0,
                "max_tokens": 200, "grammar": grammar}
        before = _prefilled(server)
        res, headers = _post(url, "/v1/chat/completions", body)
        out.append((body, res, headers, _prefilled(server) - before))
        content = res["choices"][0]["message"].get("content") or ""
        if len(out) == 1:
            result = ({"role": "tool", "tool_call_id": "c1", "content": tool} if fam.tool_role
                      else {"role": "user", "content": "The file a.py:\n" + tool})
            msgs = msgs + [{"role": "assistant", "content": content}, result]
        elif len(out) == 2:
            msgs = msgs + [{"role": "assistant", "content": content}, {"role": "user", "content": USER}]
    return out


#: top log-probabilities asked to find both candidates of a near-tie under a grammar (the server
#: reports them before the grammar, so the tokens it allows may rank low)
NEAR_TIE_PROBS = 3000


def _exact(srv, slots: Path, body: dict, res: dict, headers: dict) -> bool:
    """Whether the aligned answer ``res`` to ``body`` equals a cold prefill of the prompt it was
    served, under the same grammar (module docstring), token by token up to the cold run's first
    near-tie (``ocache.bench.exact``): where the two runs part, the two tokens' log-probabilities
    after the agreed prefix, read from a cold run without the grammar, must be within
    ``TOL_NATS`` (batching noise flipped a tie; a wrong state moves them by whole nats)."""
    from ocache.bench.exact import TOL_NATS
    from ocache.tiers.slotfile import read_slot_tokens

    slot = int(headers["X-OCache-Slot"])
    n_prompt = res["usage"]["prompt_tokens"]
    _post(srv.url, f"/slots/{slot}?action=save", {"filename": "served.bin"})
    held = read_slot_tokens(slots / "served.bin")
    served, generated = held[:n_prompt], held[n_prompt:]
    if len(generated) != res["timings"]["predicted_n"] - 1 or not generated:
        return False
    cold, _ = _post(srv.url, "/completion", {"prompt": served, "n_predict": len(generated), "id_slot": 1 - slot,
                                             "cache_prompt": False, "return_tokens": True, "temperature": 0,
                                             "grammar": body["grammar"]})
    if cold["timings"]["cache_n"] != 0:
        return False
    ref = list(cold["tokens"])
    i = next((k for k, (a, b) in enumerate(zip(ref, generated)) if a != b), None)
    if i is None:
        return ref == generated
    after, _ = _post(srv.url, "/completion", {"prompt": served + ref[:i], "n_predict": 1, "id_slot": 1 - slot,
                                              "cache_prompt": False, "temperature": 0, "n_probs": NEAR_TIE_PROBS})
    lp = {p["id"]: p["logprob"] for p in after["completion_probabilities"][0]["top_logprobs"]}
    return ref[i] in lp and generated[i] in lp and abs(lp[ref[i]] - lp[generated[i]]) < TOL_NATS


def play(fam: Family, work: Path | None = None) -> Row:
    """Run the loop for ``fam`` alone and through ocache (module docstring); a :class:`Row`."""
    from ocache.bench.run import OCacheProcess
    from ocache.llama.server import LlamaServer

    build = engine.find()
    if build is None:
        raise RuntimeError("the patched llama-server is not built: ocache engine build")
    work = Path(tempfile.mkdtemp(prefix="ocache-fam-")) if work is None else work
    model = models.make_family(fam.vocab)
    args = ["--chat-template-file", str(engine.chat_template_file(fam.template))]
    row = Row(fam)

    def server(tag: str) -> LlamaServer:
        return LlamaServer(binary=build.binary, model=model, n_parallel=2, ctx_size=16384, flash_attn="on",
                           slot_save_path=work / f"slots-{tag}", log_path=work / f"server-{tag}.log",
                           args=args).start()

    srv = server("alone")
    row.ubatch = srv.ubatch
    try:
        row.alone = [p for *_, p in loop(fam, srv.url, srv.url)]
    except urllib.error.HTTPError as exc:
        row.error = f"HTTP {exc.code}: {exc.read()[:200].decode(errors='replace')}"
        return row
    finally:
        srv.stop()
    srv = server("ocache")
    prox = OCacheProcess(srv.url, work / "cache", work / "ocache.log", slot_save_path=work / "slots-ocache").start()
    try:
        turns = loop(fam, prox.url, srv.url)
        row.align = {k: v for k, v in ((prox.stats() or {}).get("layer") or {}).get("align", {}).items()
                     if k != "last"}
        row.ocache = [p for *_, p in turns]
        row.aligned = [h.get("X-OCache-Aligned") for _, _, h, _ in turns]
        if row.aligned[-1]:
            body, res, headers, _ = turns[-1]
            row.exact = _exact(srv, work / "slots-ocache", body, res, headers)
    finally:
        prox.stop()
        srv.stop()
    return row


def table(rows: list[Row]) -> str:
    """The markdown table of ``docs/benchmarks.md`` ("Template families on their own vocabularies")."""
    out = ["| family | template | vocab | aligns? / why not | new user message prefill: ocache / alone (tokens) "
           "| all requests: ocache / alone | exact |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        f = r.family
        vocab = models.FAMILY_VOCABS[f.vocab]
        v = vocab.vocab + (" + gpt-oss specials" if vocab.extra else "")
        if r.error:
            out.append(f"| {f.name} | `{f.template}` | {v} | template refuses the loop: {r.error} | - | - | - |")
            continue
        aligns = ("yes (" + ", ".join("-" if a is None else a for a in r.aligned) + ")") if r.aligned[-1] else \
            f"no: {r.why_not}"
        exact = "-" if r.exact is None else ("yes" if r.exact else "**no**")
        out.append(f"| {f.name} | `{f.template}` | {v} | {aligns} | {r.ocache[-1]} / {r.alone[-1]} "
                   f"| {'/'.join(map(str, r.ocache))} vs {'/'.join(map(str, r.alone))} | {exact} |")
    return "\n".join(out)
