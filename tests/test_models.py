"""The generated GGUF models (``ocache.toolchain.models``) and the shipped chat template.

Unit part: presets are valid, bad specs are refused, generation is cached and byte-deterministic.
Server part: both ``tiny`` models load in the real llama-server of the pinned source (the stock
build: the models do not depend on ocache's patches), answer a real opencode tools request,
render every captured client request with the embedded template, agree with ``/tokenize`` on the
prompt length the server reports, and produce greedy output that depends on early context.
"""

from __future__ import annotations

import hashlib
import json
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest

from ocache.toolchain import models
from ocache.paths import cache_root, repo_root
from ocache.llama.server import LlamaServer

from conftest import FIXTURES, load_fixture


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _post(url: str, body: dict, timeout: float = 300.0) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


# --------------------------------------------------------------------------------- unit tests

def test_presets_are_valid_and_hybrid_has_attention_every_fourth_layer():
    for preset, specs in models.PRESETS.items():
        assert set(specs) == set(models.KINDS), preset
        for kind, spec in specs.items():
            spec.validate()
            assert spec.arch == {"dense": "qwen3", "hybrid": "qwen35"}[kind]
            assert spec.n_ctx_train >= 131072
    tiny = models.PRESETS["tiny"]["hybrid"]
    assert [tiny.is_recurrent(il) for il in range(tiny.n_layer)] == [True, True, True, False] * 2
    bench = models.PRESETS["bench"]["hybrid"]
    assert sum(not bench.is_recurrent(il) for il in range(bench.n_layer)) == 2


@pytest.mark.parametrize("change, message", [
    ({"ssm_v_heads": 3}, "multiple of ssm_groups"),
    ({"n_layer": 6}, "full_attention_interval"),
    ({"rope_sections": (4, 4, 4, 0)}, "rope_sections"),
    ({"arch": "llama"}, "unsupported arch"),
])
def test_bad_specs_are_refused(change, message):
    spec = replace(models.PRESETS["tiny"]["hybrid"], **change)
    with pytest.raises(ValueError, match=message):
        spec.validate()


def test_unknown_preset_is_a_clear_error():
    with pytest.raises(models.ModelError, match="unknown preset"):
        models.make("huge")


def test_make_is_cached_outside_the_repo(models_tiny):
    again = models.make("tiny")
    assert again == models_tiny
    for kind, path in models_tiny.items():
        assert path.is_file() and path.stat().st_size > 1_000_000, kind
        assert path.is_relative_to(cache_root() / "models")
        assert not path.resolve().is_relative_to(repo_root())
        meta = json.loads((path.parent / "model.json").read_text())
        assert meta["sha256"] == _sha256(path)


@pytest.mark.parametrize("kind", models.KINDS)
def test_generation_is_byte_deterministic(models_tiny, tmp_path, kind):
    """Writing the same spec again (fresh process state, other path) gives the same bytes."""
    seed = models.PRESETS["tiny"][kind].seed
    dest = models.write_reseeded("tiny", kind, tmp_path / "again.gguf", seed)   # the same seed: the same spec
    assert _sha256(dest) == _sha256(models_tiny[kind])
    # and a different seed gives a different file (the seed reaches the weights)
    other = models.write_reseeded("tiny", kind, tmp_path / "other.gguf", seed + 1)
    assert _sha256(other) != _sha256(dest)


@pytest.mark.parametrize("kind", models.KINDS)
def test_a_reseeded_model_has_the_same_header_and_size_and_other_weights(models_tiny, tmp_path, kind):
    """``write_reseeded`` (scripts/faults' replaced-model row): the header bytes (metadata, tensor
    infos) and the size equal the preset's file, the tensor data does not."""
    from ocache.llama.gguf import gguf_identity

    other = models.write_reseeded("tiny", kind, tmp_path / "other.gguf", seed=2001)
    a, b = gguf_identity(models_tiny[kind]), gguf_identity(other)
    assert (b.size, b.header_bytes, b.header_xxh3_128) == (a.size, a.header_bytes, a.header_xxh3_128)
    assert b.data_xxh3_128 != a.data_xxh3_128 and _sha256(other) != _sha256(models_tiny[kind])


def test_cli_prints_paths(models_tiny, capsys):
    from ocache.cli import main

    assert main(["models", "make", "--preset", "tiny"]) == 0
    out = capsys.readouterr().out
    for path in models_tiny.values():
        assert str(path) in out
    # the template line says it is in the models already (users passed it as a flag)
    (line,) = [ln for ln in out.splitlines() if ln.startswith("template\t")]
    assert line.split("\t")[1] == str(models.template_path()) and "already embedded" in line, line
    assert main(["models", "path", "--template"]) == 0
    assert capsys.readouterr().out.strip() == str(models.template_path())
    assert main(["models", "path", "--preset", "tiny", "--kind", "hybrid"]) == 0
    assert capsys.readouterr().out.strip() == str(models_tiny["hybrid"])


# ------------------------------------------------------------------------------- server tests

@pytest.fixture(scope="module")
def servers(engine_stock, models_tiny, tmp_path_factory):
    """``servers(kind) -> LlamaServer``: one server per tiny model, started on first use and kept
    for the module (-t 1, one slot, 16k context, the stock build of the pinned source)."""
    started: dict[str, LlamaServer] = {}

    def get(kind: str) -> LlamaServer:
        if kind not in started:
            logdir = tmp_path_factory.mktemp(f"models-{kind}")
            srv = LlamaServer(binary=engine_stock.binary, model=models_tiny[kind], ctx_size=16384,
                              n_parallel=1, threads=1, log_path=logdir / "server.log",
                              slot_save_path=logdir / "slots")
            started[kind] = srv
            srv.start()
        return started[kind]

    yield get
    for srv in started.values():
        srv.stop()


def _apply(srv: LlamaServer, body: dict) -> str:
    status, data = _post(srv.url + "/apply-template", body)
    assert status == 200, data
    return data["prompt"]


def _n_tokens(srv: LlamaServer, text: str) -> int:
    status, data = _post(srv.url + "/tokenize", {"content": text, "add_special": True})
    assert status == 200, data
    return len(data["tokens"])


@pytest.mark.server
@pytest.mark.parametrize("kind", models.KINDS)
def test_model_loads_with_our_template(servers, kind):
    srv = servers(kind)
    props = _get(srv.url + "/props")
    # (the server trims the trailing newline of the file)
    assert props["chat_template"].strip() == models.template_path().read_text(encoding="utf-8").strip()
    assert props["default_generation_settings"]["n_ctx"] == 16384
    meta = _get(srv.url + "/v1/models")
    assert meta["data"][0]["meta"]["n_vocab"] == 151936
    assert meta["data"][0]["meta"]["n_ctx_train"] == 131072


@pytest.mark.server
@pytest.mark.parametrize("kind", models.KINDS)
def test_tools_request_answers_and_prompt_length_matches_tokenize(servers, kind):
    """A real opencode agent turn (10 tools) through /v1/chat/completions returns 200, and the
    server's prompt_n + cache_n equals /tokenize(add_special) of /apply-template's render."""
    srv = servers(kind)
    for name in ("opencode_agent_turn1.json", "opencode_agent_turn1_after_tool.json"):
        body = load_fixture(name)
        body.update(stream=False, max_tokens=4)
        body.pop("stream_options", None)
        n_prompt = _n_tokens(srv, _apply(srv, body))
        assert n_prompt > 3000, (name, n_prompt)  # realistic length: tools + ~10 KB system prompt
        status, data = _post(srv.url + "/v1/chat/completions", body)
        assert status == 200, data
        assert data["choices"][0]["message"]["role"] == "assistant"
        t = data["timings"]
        assert t["prompt_n"] + t["cache_n"] == n_prompt, (name, t, n_prompt)


@pytest.mark.server
def test_every_captured_request_renders(servers):
    """Every opencode/pi fixture renders: tools block before the system text, tool calls and
    results in Qwen form, pi's content arrays flattened, null content accepted."""
    srv = servers("dense")  # the template is the same in both models
    names = sorted(p.name for p in FIXTURES.glob("*.json")
                   if p.name.startswith(("opencode_", "pi_")))
    assert len(names) >= 10
    for name in names:
        body = load_fixture(name)
        prompt = _apply(srv, body)
        msgs = body["messages"]
        system = msgs[0]["content"] if msgs[0]["role"] == "system" else None
        if body.get("tools"):
            assert prompt.startswith("<|im_start|>system\n# Tools\n"), name
            tools_end = prompt.index("\n</tools>\n")
            for tool in body["tools"]:
                assert prompt.index(f'"name": "{tool["function"]["name"]}"') < tools_end, name
            if system:
                assert prompt.index(system) > tools_end, name
        elif system:
            assert prompt.startswith("<|im_start|>system\n" + system + "<|im_end|>\n"), name
        for m in msgs:
            if m["role"] == "user":
                text = m["content"] if isinstance(m["content"], str) else "\n".join(
                    p["text"] for p in m["content"] if p.get("type") == "text")
                assert f"<|im_start|>user\n{text}<|im_end|>\n" in prompt, name
            for call in m.get("tool_calls") or []:
                assert f'<tool_call>\n{{"name": "{call["function"]["name"]}", "arguments": ' in prompt
            if m["role"] == "tool":
                assert f"<tool_response>\n{m['content']}\n</tool_response>" in prompt, name
            if m.get("reasoning_content"):
                assert f"<think>\n{m['reasoning_content'].strip()}\n</think>\n\n" in prompt, name
        assert prompt.endswith("<|im_start|>assistant\n<think>\n"), name


@pytest.mark.server
def test_template_edge_cases(servers):
    """Several leading system messages merge after the tools; a later system message stays in
    place; object arguments render as JSON; enable_thinking=false closes the think block."""
    srv = servers("dense")  # the template is the same in both models
    tools = load_fixture("pi_turn1.json")["tools"]
    body = {"tools": tools, "messages": [
        {"role": "system", "content": "HEAD one"},
        {"role": "system", "content": [{"type": "text", "text": "HEAD two"}]},
        {"role": "user", "content": "question"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "bash", "arguments": {"command": "ls"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
        {"role": "system", "content": "LATE note"},
        {"role": "user", "content": "next"},
    ], "chat_template_kwargs": {"enable_thinking": False}}
    prompt = _apply(srv, body)
    assert prompt.index("\n</tools>\n") < prompt.index("HEAD one\n\nHEAD two<|im_end|>\n")
    assert prompt.count("<|im_start|>system\n") == 2
    assert "<|im_start|>system\nLATE note<|im_end|>\n<|im_start|>user\nnext" in prompt
    assert '"arguments": {"command":' in prompt and '"ls"}}\n</tool_call>' in prompt
    assert "<|im_start|>user\n<tool_response>\na.txt\n</tool_response><|im_end|>\n" in prompt
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.server
@pytest.mark.parametrize("thinking", [False, True])
def test_render_is_append_only(servers, thinking):
    """The prompt of turn N plus the generated reply is a prefix of turn N+1's render (the
    documented reasoning rule), with and without thinking."""
    srv = servers("dense")  # the template is the same in both models
    base = load_fixture("opencode_agent_turn1.json")
    kwargs = {"chat_template_kwargs": {"enable_thinking": thinking}}
    turn1 = _apply(srv, {"messages": base["messages"], "tools": base["tools"], **kwargs})
    reply = {"role": "assistant", "content": "Here are the files."}
    generated = "Here are the files."
    if thinking:
        reply["reasoning_content"] = "List them."
        generated = "List them.\n</think>\n\nHere are the files."
    turn2 = _apply(srv, {"messages": [*base["messages"], reply, {"role": "user", "content": "ok"}],
                         "tools": base["tools"], **kwargs})
    assert turn2.startswith(turn1 + generated + "<|im_end|>\n")


def _greedy(srv: LlamaServer, prompt: list[int], n: int = 16) -> list[int]:
    status, data = _post(srv.url + "/completion", {
        "prompt": prompt, "n_predict": n, "temperature": 0, "return_tokens": True})
    assert status == 200, data
    return data["tokens"]


def _tokens(srv: LlamaServer, text: str) -> list[int]:
    status, data = _post(srv.url + "/tokenize", {"content": text})
    assert status == 200, data
    return data["tokens"]


@pytest.mark.server
@pytest.mark.parametrize("kind", models.KINDS)
def test_greedy_output_depends_on_early_context(servers, kind):
    """Prompts of ~3,000 tokens that differ only in their first words continue differently (the
    weight-scaling trap of docs/decisions.md D4: otherwise a broken cache looks like a working
    one), while the same prompt repeats exactly (greedy is deterministic)."""
    srv = servers(kind)
    body = load_fixture("opencode_agent_turn1.json")
    tail = _tokens(srv, body["messages"][0]["content"] + json.dumps(body["tools"]))[:3000]
    runs = {}
    for head in ("Alpha team report. ", "Omega group memo. ", "x"):
        runs[head] = _greedy(srv, _tokens(srv, head) + tail)
    assert _greedy(srv, _tokens(srv, "x") + tail) == runs["x"]
    assert len({tuple(r) for r in runs.values()}) == 3, (kind, runs)
    assert all(len(set(r)) > 1 for r in runs.values()), (kind, runs)  # not one token repeated


NOISE_WORDS = "alpha beta gamma delta file path read write test build cache slot token model".split()


@pytest.mark.server
@pytest.mark.parametrize("kind", models.KINDS)
def test_batching_noise_is_far_below_the_margin(start_server, kind):
    """The generated models' next-token choice is robust: 8 prompts run alone, then all 8 batched
    on -np 4, give the same greedy tokens up to the reference's first near-tie, the largest
    log-probability difference of a token between the two runs (the batching noise) is far below
    ``ocache.bench.exact.TOL_NATS``, and near-ties (top-1 margin < TOL_NATS) are rare, so exactness checks
    compare most generated tokens. This is the measurement behind ``TOL_NATS``; on the F16 models
    of generator version 1 (logits 0.16 nats wide over 151k tokens) the median margin was 0.025
    nats, 40x below the tolerance, and 1 answer of 8 flipped under batching."""
    import asyncio
    import random

    import aiohttp

    from ocache.bench.exact import TOL_NATS, Generation, compare, describe

    srv = start_server(kind, n_parallel=4, ctx_size=4 * 4096)
    prompts = [" ".join(random.Random(i).choice(NOISE_WORDS) for _ in range(300 + 37 * i))
               for i in range(8)]

    async def go():
        async with aiohttp.ClientSession() as s:
            async def one(p):
                body = {"prompt": p, "n_predict": 32, "cache_prompt": False, "temperature": 0,
                        "top_k": 1, "n_probs": 2}
                async with s.post(srv.url + "/completion", json=body) as r:
                    assert r.status == 200
                    return Generation.from_response(await r.json())
            alone = [await one(p) for p in prompts]
            batched = await asyncio.gather(*(one(p) for p in prompts))
            return alone, batched

    alone, batched = asyncio.run(go())
    noise, margins, compared = 0.0, [], 0
    for a, b in zip(alone, batched):
        v = compare(a, b)
        assert v.exact, describe(v)
        compared += v.compared
        for i in range(min(len(a.tokens), len(b.tokens))):
            if a.tokens[:i + 1] != b.tokens[:i + 1]:
                break
            noise = max(noise, abs(a.logprobs[i] - b.logprobs[i]))
        margins += a.margins
    margins.sort()
    ties = sum(m < TOL_NATS for m in margins) / len(margins)
    median = margins[len(margins) // 2]
    print(f"{kind}: batching noise max {noise:.2e} nats, margin median {median:.3f}, "
          f"near-ties {ties:.1%}, tokens compared {compared}/{len(margins)}")
    assert noise < TOL_NATS / 3, noise
    assert median > 5 * TOL_NATS, median
    assert ties < 0.10, ties
    assert compared >= len(margins) // 2


def test_a_waiter_for_a_held_build_lock_is_told_and_then_gets_it(tmp_path):
    """``file_lock(waiting=...)``: `ocache engine build` says it waits on another build's lock
    (silent for minutes before), and goes on once the holder lets go."""
    import threading

    from ocache.paths import file_lock

    lock = tmp_path / ".build.lock"
    held, release, told = threading.Event(), threading.Event(), threading.Event()

    def holder() -> None:
        with file_lock(lock):
            held.set()
            release.wait(30)

    t = threading.Thread(target=holder)
    t.start()
    assert held.wait(30)
    notes: list[float] = []

    def waiting(s: float) -> None:
        notes.append(s)
        told.set()
        release.set()  # the other build finishes once we were told

    with file_lock(lock, waiting=waiting):
        got = True
    t.join(30)
    assert got and told.is_set() and notes[0] == pytest.approx(0, abs=1)
    with file_lock(lock, waiting=lambda s: notes.append(-1)):  # free: no note
        pass
    assert -1 not in notes
