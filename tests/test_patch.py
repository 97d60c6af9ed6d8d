"""The llama.cpp patches (``patches/``) against the real llama-server, compared with the stock build.

Each test runs the same requests on the patched and the unpatched build of the pinned source, on the
``tiny`` generated models, and asserts what each does:

* 0001 (checkpoint sidecar): ``action=save`` writes the slot's context checkpoints to
  ``<file>.ckpt``, ``action=restore`` rebuilds them, so a restored hybrid slot resumes a prompt that
  diverges inside the saved tokens (stock: full prefill, ``docs/llama-server.md`` §15).
  Bad sidecars are dropped, the restore is still served.
* 0002 (restore pre-check): a restore of a missing or foreign file leaves the slot as it was.

The sidecar layout is parsed here from ``patches/README.md``'s description (header, entries,
XXH3-64 checksums), so these tests also pin the on-disk format.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import struct
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import xxhash

from ocache.toolchain import engine
from ocache.bench.exact import Generation, compare, describe
from ocache.llama.server import LlamaServer

from conftest import load_fixture

pytestmark = [pytest.mark.server]

#: Server flags: several checkpoints on a few-thousand-token prompt (docs/llama-server.md §14: near-end checkpoints
#: at N-4-ubatch and N-4 per turn; min-step only thins a full list).
SRV = dict(ctx_size=8192, ubatch=128, batch=512, ctx_checkpoints=32, checkpoint_min_step=256)
UBATCH = SRV["ubatch"]
N_PROMPT = 3000
TURNS = (1000, 1700, 2400, N_PROMPT)  # the conversation grows; each turn adds checkpoints near its end
GREEDY = {"temperature": 0, "top_k": 1, "seed": 1}

SIDECAR_HEADER = struct.Struct("<4sIIQQII")  # magic, version, n_tokens, tokens_hash, state_hash, n_entries, flags
SIDECAR_ENTRY = struct.Struct("<qiiQQQ")  # n_tokens, pos_min, pos_max, len_tgt, len_dft, len_spec


# ---------------------------------------------------------------------------------------------
# HTTP helpers


def call(srv: LlamaServer, path: str, body: dict | None = None, method: str | None = None) -> tuple[int, dict]:
    """Request ``path`` on ``srv``; return (HTTP status, decoded JSON body)."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(srv.url + path, data=data, method=method or ("POST" if data else "GET"),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def ok(srv: LlamaServer, path: str, body: dict | None = None) -> dict:
    status, res = call(srv, path, body)
    assert status == 200, f"{path}: {status} {res}\n{srv.log_tail()}"
    return res


def complete(srv: LlamaServer, tokens: list[int], n_predict: int = 0, cache_prompt: bool = True,
             n_probs: int = 0) -> dict:
    """Greedy ``/completion`` on raw token ids in slot 0; the response carries ``tokens`` and ``timings``
    (and the top-``n_probs`` log-probabilities per generated token when asked)."""
    return ok(srv, "/completion", {"prompt": tokens, "n_predict": n_predict, "cache_prompt": cache_prompt,
                                   "id_slot": 0, "return_tokens": True, "n_probs": n_probs, **GREEDY})


def save(srv: LlamaServer, name: str) -> dict:
    return ok(srv, "/slots/0?action=save", {"filename": name})


def restore(srv: LlamaServer, name: str) -> tuple[int, dict]:
    return call(srv, "/slots/0?action=restore", {"filename": name})


def healthy(srv: LlamaServer) -> bool:
    return call(srv, "/health")[0] == 200 and srv.proc is not None and srv.proc.poll() is None


def slot_tokens(srv: LlamaServer) -> int:
    """Tokens slot 0 holds now (``/slots`` ``n_prompt_tokens``; absent for a never-used slot, docs/llama-server.md §4)."""
    return ok(srv, "/slots")[0].get("n_prompt_tokens", 0)


# ---------------------------------------------------------------------------------------------
# prompts from real client text


def fixture_text() -> str:
    """System prompt, tool schemas and messages of captured opencode requests (real agent text)."""
    parts = []
    for name in ("opencode_agent_turn1.json", "opencode_run4_continue_turn2.json", "pi_turn1.json"):
        body = load_fixture(name)  # skips the test, with the reason, when shared/ is absent
        for m in body.get("messages", []):
            parts.append(m["content"] if isinstance(m.get("content"), str) else json.dumps(m.get("content")))
        parts.append(json.dumps(body.get("tools", []), indent=1))
    return "\n\n".join(parts)


def tokenize(srv: LlamaServer, text: str) -> list[int]:
    return ok(srv, "/tokenize", {"content": text, "add_special": False})["tokens"]


@pytest.fixture(scope="module")
def corpus(engine_stock, models_tiny, tmp_path_factory) -> list[int]:
    """At least N_PROMPT + 1000 token ids of fixture text (tokenized by the stock server)."""
    srv = LlamaServer(binary=engine_stock.binary, model=models_tiny["dense"],
                      log_path=tmp_path_factory.mktemp("tok") / "server.log").start()
    try:
        toks = tokenize(srv, fixture_text())
    finally:
        srv.stop()
    assert len(toks) >= N_PROMPT + 1000, len(toks)
    return toks


def diverging(corpus: list[int], at: int, n_new: int = 100) -> list[int]:
    """``corpus[:at]`` followed by ``n_new`` tokens from elsewhere that differ at position ``at``."""
    tail = corpus[N_PROMPT + 200:N_PROMPT + 200 + n_new]
    assert tail[0] != corpus[at]
    return corpus[:at] + tail


def build_conversation(srv: LlamaServer, corpus: list[int]) -> list[int]:
    """Grow slot 0 through TURNS (each turn strictly extends the last); return the final prompt.

    ``n_predict: 0`` leaves exactly the prompt in the slot (docs/llama-server.md §13).
    """
    for n in TURNS:
        res = complete(srv, corpus[:n])
        assert res["tokens_cached"] == n
    return corpus[:N_PROMPT]


# ---------------------------------------------------------------------------------------------
# the sidecar format (patches/README.md)


@dataclasses.dataclass
class Sidecar:
    n_tokens: int
    tokens_hash: int
    state_hash: int
    entries: list[dict]


def parse_sidecar(data: bytes) -> Sidecar:
    """Parse and fully check a ``.ckpt`` file (raises AssertionError on any mismatch)."""
    hdr = SIDECAR_HEADER.unpack_from(data, 0)
    magic, version, n_tokens, tokens_hash, state_hash, n_entries, flags = hdr
    assert (magic, version, flags) == (b"OCKP", 1, 0)
    off = SIDECAR_HEADER.size
    (header_hash,) = struct.unpack_from("<Q", data, off)
    assert header_hash == xxhash.xxh3_64_intdigest(data[:off])
    off += 8
    entries = []
    for _ in range(n_entries):
        start = off
        n, pmin, pmax, lt, ld, ls = SIDECAR_ENTRY.unpack_from(data, off)
        off += SIDECAR_ENTRY.size
        blob_off = off
        off += lt + ld + ls
        (entry_hash,) = struct.unpack_from("<Q", data, off)
        assert entry_hash == xxhash.xxh3_64_intdigest(data[start:off])
        off += 8
        entries.append(dict(n_tokens=n, pos_min=pmin, pos_max=pmax, len_tgt=lt, len_dft=ld, len_spec=ls,
                            start=start, blob_off=blob_off))
    assert off == len(data)
    return Sidecar(n_tokens, tokens_hash, state_hash, entries)


def slot_file_tokens(path: Path) -> list[int]:
    """Token ids of a slot file (docs/llama-server.md §6: 12-byte header, then -1, 1, n_tokens, tokens, n_media)."""
    data = path.read_bytes()
    magic, version, n_words = struct.unpack_from("<III", data, 0)
    words = struct.unpack_from(f"<{n_words}i", data, 12)
    assert (magic, version, words[0], words[1]) == (0x67677371, 3, -1, 1)
    return list(words[3:3 + words[2]])


def resume_point(sc: Sidecar, lcp: int) -> int:
    """Where a hybrid slot resumes for a prompt sharing ``lcp`` tokens inside it (docs/llama-server.md §15)."""
    return max((e["n_tokens"] for e in sc.entries if e["n_tokens"] <= lcp), default=0)


def variant_model(src: Path, tmp: Path) -> Path:
    """A copy of the GGUF ``src`` with other token embeddings (same shapes, so its states load).

    Flips one mantissa bit of every ``token_embd.weight`` element (located with the pinned gguf-py
    reader): the values stay finite, every hidden and recurrent state changes.
    """
    gdir = str(engine.gguf_py_dir())
    if gdir not in sys.path:
        sys.path.insert(0, gdir)
    import gguf  # noqa: PLC0415  (the pinned gguf-py, path set above)

    t = next(t for t in gguf.GGUFReader(src).tensors if t.name == "token_embd.weight")
    dtype, bit = {gguf.GGMLQuantizationType.F16: (np.uint16, 0x0100),
                  gguf.GGMLQuantizationType.F32: (np.uint32, 0x00200000)}[t.tensor_type]
    data = bytearray(src.read_bytes())
    view = np.frombuffer(data, dtype=dtype, count=int(t.n_bytes) // np.dtype(dtype).itemsize,
                         offset=int(t.data_offset))
    view ^= dtype(bit)
    dest = tmp / ("variant-" + src.name)
    dest.write_bytes(bytes(data))
    return dest


# ---------------------------------------------------------------------------------------------
# tests


def test_restore_resumes_extension_identical_and_divergent(start_server, corpus, tmp_path):
    """save → restart → restore → next turn / identical resend / prompt diverging ~100 tokens early."""
    results = {}
    for stock in (True, False):
        srv = start_server(model="hybrid", stock=stock, **SRV)
        prompt = build_conversation(srv, corpus)
        saved = save(srv, "conv.bin")
        assert saved["n_saved"] == N_PROMPT
        r = {"saved": saved}

        def restored():
            srv.restart()
            status, res = restore(srv, "conv.bin")
            assert status == 200, res
            assert res["n_restored"] == N_PROMPT
            return res

        r["restore"] = restored()
        r["extend"] = complete(srv, prompt + corpus[N_PROMPT:N_PROMPT + 64], n_predict=4)["timings"]
        restored()
        r["identical"] = complete(srv, prompt, n_predict=4)["timings"]
        restored()
        r["diverge"] = complete(srv, diverging(corpus, N_PROMPT - 100), n_predict=4)["timings"]
        assert healthy(srv)
        results[stock] = r
        srv.stop()

    stock, patched = results[True], results[False]
    sc = parse_sidecar((tmp_path / "slots" / "conv.bin.ckpt").read_bytes())

    # what was saved: every checkpoint of the grown conversation, reported and logged
    assert "n_checkpoints" not in stock["saved"]
    assert patched["saved"]["n_checkpoints"] == len(sc.entries) >= 2 * len(TURNS) - 1
    assert patched["restore"]["n_checkpoints"] == len(sc.entries)
    assert "saved %d tokens and %d context checkpoints" % (N_PROMPT, len(sc.entries)) in \
        (tmp_path / "server1.log").read_text()

    # a strict extension reuses the restored tokens on both builds (docs/llama-server.md §15)
    for r in (stock, patched):
        assert r["extend"]["cache_n"] >= N_PROMPT - UBATCH
    # an identical resend: stock re-prefills everything, patched resumes at the newest checkpoint < N
    assert stock["identical"]["cache_n"] == 0
    assert patched["identical"]["cache_n"] == resume_point(sc, N_PROMPT - 1) >= N_PROMPT - UBATCH
    # diverging 100 tokens before the end: stock full prefill, patched at the newest checkpoint ≤ 2900
    assert stock["diverge"]["cache_n"] == 0
    expect = resume_point(sc, N_PROMPT - 100)
    assert expect > 0
    assert patched["diverge"]["cache_n"] == expect
    assert patched["diverge"]["prompt_n"] == N_PROMPT - expect


def test_sidecar_layout(start_server, corpus, tmp_path):
    """The .ckpt file matches the documented layout and belongs to the slot file's tokens."""
    srv = start_server(model="hybrid", **SRV)
    build_conversation(srv, corpus)
    saved = save(srv, "conv.bin")
    slots = tmp_path / "slots"
    sc = parse_sidecar((slots / "conv.bin.ckpt").read_bytes())
    toks = slot_file_tokens(slots / "conv.bin")
    assert sc.n_tokens == len(toks) == N_PROMPT
    assert sc.tokens_hash == xxhash.xxh3_64_intdigest(struct.pack(f"<{len(toks)}i", *toks))
    assert len(sc.entries) == saved["n_checkpoints"]
    ns = [e["n_tokens"] for e in sc.entries]
    assert ns == sorted(set(ns)) and 0 < ns[0] and ns[-1] <= N_PROMPT
    for e in sc.entries:
        assert e["pos_max"] == e["n_tokens"] - 1 and 0 <= e["pos_min"] <= e["pos_max"]
        assert e["len_tgt"] == sc.entries[0]["len_tgt"] > 0  # hybrid: fixed-size recurrent state
        assert e["len_dft"] == e["len_spec"] == 0  # no draft model
    assert not list(slots.glob("*.tmp"))


def test_greedy_output_after_restore_equals_cold_prefill(start_server, corpus):
    """Restore + resume from a checkpoint gives the same greedy tokens as a cold prefill, judged by
    ``ocache.bench.exact`` (token by token up to the cold run's first near-tie, log-probabilities within
    its stated tolerance)."""
    prompt = diverging(corpus, N_PROMPT - 100)
    out = {}
    for stock in (True, False):
        srv = start_server(model="hybrid", stock=stock, **SRV)
        build_conversation(srv, corpus)
        save(srv, "conv.bin")
        srv.restart()
        assert restore(srv, "conv.bin")[0] == 200
        resumed = complete(srv, prompt, n_predict=16, n_probs=2)
        srv.restart()
        cold = complete(srv, prompt, n_predict=16, cache_prompt=False, n_probs=2)
        assert cold["timings"]["cache_n"] == 0
        out[stock] = (resumed, cold)
        srv.stop()

    (s_res, s_cold), (p_res, p_cold) = out[True], out[False]
    assert s_res["timings"]["cache_n"] == 0  # stock: the "resumed" run was a full prefill
    assert p_res["timings"]["cache_n"] > N_PROMPT // 2  # patched: really resumed from a checkpoint
    assert len(p_cold["tokens"]) == 16
    ref = Generation.from_response(p_cold)
    for name, run in (("patched, resumed", p_res), ("stock, cold", s_cold), ("stock, full prefill", s_res)):
        v = compare(ref, Generation.from_response(run))
        assert v.exact, f"{name}: {describe(v)}"
        assert v.compared >= 1


def _save_good(srv, corpus, slots: Path) -> tuple[dict, bytes]:
    build_conversation(srv, corpus)
    saved = save(srv, "good.bin")
    assert saved["n_checkpoints"] > 0
    return saved, (slots / "good.bin.ckpt").read_bytes()


def test_bad_sidecars_are_dropped_and_restore_still_served(start_server, corpus, engine_patched, models_tiny,
                                                           tmp_path):
    """Flipped byte, truncation, another token list, another model, lying positions: each dropped."""
    slots = tmp_path / "slots"
    srv = start_server(model="hybrid", **SRV)
    saved, good = _save_good(srv, corpus, slots)
    sc = parse_sidecar(good)

    # a sidecar of another token list (same length: caught by the token hash, not the count)
    other = corpus[:N_PROMPT - 200] + corpus[N_PROMPT + 300:N_PROMPT + 500]
    complete(srv, other)
    save(srv, "other.bin")
    other_ckpt = (slots / "other.bin.ckpt").read_bytes()
    srv.stop()

    # a sidecar of the same tokens written by another model of the same shapes
    variant = LlamaServer(binary=engine_patched.binary, model=variant_model(models_tiny["hybrid"], tmp_path),
                          slot_save_path=slots,
                          log_path=tmp_path / "variant.log", **SRV)
    try:
        variant.start()
        build_conversation(variant, corpus)
        assert save(variant, "variant.bin")["n_checkpoints"] > 0
    finally:
        variant.stop()
    variant_ckpt = (slots / "variant.bin.ckpt").read_bytes()
    assert parse_sidecar(variant_ckpt).tokens_hash == sc.tokens_hash  # only the state tells them apart

    # checksums intact, but entry 0 claims a position its state does not have (forged with xxhash)
    e0, e1 = sc.entries[0], sc.entries[1]
    lie = e0["n_tokens"] + (e1["n_tokens"] - e0["n_tokens"]) // 2
    forged = bytearray(good)
    SIDECAR_ENTRY.pack_into(forged, e0["start"], lie, lie - 1, lie - 1, e0["len_tgt"], 0, 0)
    end0 = e0["blob_off"] + e0["len_tgt"]
    struct.pack_into("<Q", forged, end0, xxhash.xxh3_64_intdigest(bytes(forged[e0["start"]:end0])))
    parse_sidecar(bytes(forged))  # well-formed

    flipped_blob = bytearray(good)
    flipped_blob[e1["blob_off"] + e1["len_tgt"] // 2] ^= 0x10
    flipped_header = bytearray(good)
    flipped_header[12] ^= 0x01  # inside tokens_hash

    cases = {
        "flipped_blob": (bytes(flipped_blob), "checksum mismatch"),
        "flipped_header": (bytes(flipped_header), "header checksum mismatch"),
        "truncated": (good[:len(good) // 2], "truncated"),
        "other_tokens": (other_ckpt, "another token list"),
        "other_model": (variant_ckpt, "another memory state"),
        "lying_positions": (bytes(forged), "claims"),
    }
    for name, (data, _) in cases.items():
        shutil.copy(slots / "good.bin", slots / f"{name}.bin")
        (slots / f"{name}.bin.ckpt").write_bytes(data)

    for stock in (True, False):
        srv = start_server(model="hybrid", stock=stock, **SRV)
        for name in cases:
            status, res = restore(srv, f"{name}.bin")
            assert status == 200, (name, res)
            assert res["n_restored"] == N_PROMPT, name
            if stock:
                assert "n_checkpoints" not in res
            else:
                assert res["n_checkpoints"] == 0, name
            # the slot is usable: a divergent prompt is a full prefill (no checkpoint), the server stays up
            t = complete(srv, diverging(corpus, N_PROMPT - 100), n_predict=2)["timings"]
            assert t["cache_n"] == 0, name
            assert healthy(srv), name
        # the good sidecar still restores on the patched build
        status, res = restore(srv, "good.bin")
        assert status == 200
        assert res.get("n_checkpoints", 0) == (0 if stock else saved["n_checkpoints"])
        srv.stop()  # the log is written by a background thread: read it once the server has exited
        if not stock:
            log = Path(srv.log_path).read_text(errors="replace").splitlines()
            for name, (_, why) in cases.items():
                lines = [ln for ln in log if f"{name}.bin.ckpt: " in ln]
                assert any("dropping checkpoint sidecar" in ln and why in ln for ln in lines), (name, lines)


def test_missing_sidecar_and_stale_sidecar_removed(start_server, corpus, tmp_path):
    """Old slot files (no .ckpt) restore as before; a save with no checkpoints removes an old .ckpt."""
    slots = tmp_path / "slots"
    srv = start_server(model="hybrid", **SRV)
    _save_good(srv, corpus, slots)
    shutil.copy(slots / "good.bin", slots / "plain.bin")

    status, res = restore(srv, "plain.bin")
    assert status == 200 and res["n_restored"] == N_PROMPT and res["n_checkpoints"] == 0
    # the slot now holds the tokens but no checkpoints: saving it over good.bin must not leave
    # good.bin.ckpt (written for the earlier save) attached to the new file
    assert (slots / "good.bin.ckpt").exists()
    res = save(srv, "good.bin")
    assert res["n_checkpoints"] == 0
    assert not (slots / "good.bin.ckpt").exists()
    assert healthy(srv)


def test_failed_restore_keeps_or_cleans_the_slot(start_server, corpus, tmp_path):
    """A missing/foreign file: patched keeps the slot's content, stock erases it; the server stays up.

    A file whose header passes but whose state does not load (the dense model's slot file) leaves the
    slot clean (no tokens) on both builds.
    """
    slots = tmp_path / "slots"
    dense = start_server(model="dense", **SRV)
    complete(dense, corpus[:1000])
    save(dense, "dense.bin")
    dense.stop()
    (slots / "junk.bin").write_bytes(b"not a slot file at all")

    kept = {}
    for stock in (True, False):
        srv = start_server(model="hybrid", stock=stock, **SRV)
        prompt = corpus[:1500]
        complete(srv, prompt)
        assert slot_tokens(srv) == 1500
        for name in ("missing.bin", "junk.bin"):
            status, res = restore(srv, name)
            assert status == 400 and "Unable to restore slot" in res["error"]["message"], res
            assert healthy(srv)
        kept[stock] = slot_tokens(srv)
        # the slot is consistent: the same prompt plus a turn is served (reusing what it still holds)
        t = complete(srv, prompt + corpus[1500:1550], n_predict=2)["timings"]
        assert t["cache_n"] == (0 if stock else 1500)

        status, res = restore(srv, "dense.bin")  # header and tokens fine, memory layout foreign
        assert status == 400, res
        assert healthy(srv)
        assert slot_tokens(srv) == 0  # clean, not half-written
        t = complete(srv, prompt, n_predict=2)["timings"]
        assert t["cache_n"] == 0 and t["prompt_n"] == 1500
        srv.stop()

    assert kept == {True: 0, False: 1500}


@pytest.mark.parametrize("model", ["dense", "hybrid"])
def test_restored_tokens_are_what_the_next_request_matches(start_server, corpus, model):
    """Restore into a slot that served another prompt, then send the restored prompt + a new turn.

    ``cache_n`` must count the restored tokens, not the previous task's (an upstream report of a
    dense-model restore matched against the previous task's tokens).
    """
    a = corpus[:2000]
    b = corpus[N_PROMPT:N_PROMPT + 900]  # another prompt, no common prefix with a
    assert a[0] != b[0]
    for stock in (True, False):
        srv = start_server(model=model, stock=stock, **SRV)
        complete(srv, a)
        save(srv, "a.bin")
        complete(srv, b)  # the slot now serves b
        assert restore(srv, "a.bin")[0] == 200
        t = complete(srv, a + corpus[2000:2100], n_predict=2)["timings"]
        assert t["cache_n"] >= len(a) - UBATCH, (stock, t)
        assert t["cache_n"] + t["prompt_n"] == 2100
        srv.stop()


def test_restore_keeps_the_newest_checkpoints_within_ctx_checkpoints(start_server, corpus, tmp_path):
    """A server with a smaller --ctx-checkpoints restores only the newest entries of a sidecar."""
    slots = tmp_path / "slots"
    srv = start_server(model="hybrid", **SRV)
    _save_good(srv, corpus, slots)
    sc = parse_sidecar((slots / "good.bin.ckpt").read_bytes())
    srv.stop()
    assert len(sc.entries) > 3

    small = start_server(model="hybrid", **{**SRV, "ctx_checkpoints": 3})
    status, res = restore(small, "good.bin")
    assert status == 200 and res["n_checkpoints"] == 3
    newest = [e["n_tokens"] for e in sc.entries[-3:]]
    # the oldest kept one is where a prompt diverging just after it resumes
    t = complete(small, diverging(corpus, newest[0] + 10), n_predict=2)["timings"]
    assert t["cache_n"] == newest[0]
    small.restart()
    assert restore(small, "good.bin")[1]["n_checkpoints"] == 3
    # below the oldest kept checkpoint nothing is left: full prefill
    t = complete(small, diverging(corpus, sc.entries[-4]["n_tokens"] + 10), n_predict=2)["timings"]
    assert t["cache_n"] == 0


def _metric(srv: LlamaServer, name: str) -> float:
    with urllib.request.urlopen(srv.url + "/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.mark.parametrize("model", ["dense", "hybrid"])
def test_0004_restore_reads_the_file_before_the_task_loop_runs_it(start_server, corpus, model):
    """patches/0004: the slot file of a restore is read on the HTTP thread, before the task is queued.

    Slot 0 streams a long generation, so the task loop defers a restore into it (server-context.cpp
    ``SERVER_TASK_TYPE_SLOT_RESTORE``: ``queue_tasks.defer`` while the slot is processing). Once
    ``/metrics`` counts the deferred task the file is deleted, then the stream is closed, which frees
    the slot and runs the restore. The patched build restores what its HTTP thread read (the next
    request reuses it; ``timings.read_ms`` reports that read); the stock build, which reads the file
    in the task loop, finds none.
    """
    import concurrent.futures
    import threading

    a = corpus[:2000]
    results = {}
    for stock in (True, False):
        srv = start_server(model=model, stock=stock, n_parallel=1, **SRV)
        slots = srv.slot_save_path
        complete(srv, a)
        saved = save(srv, "a.bin")
        complete(srv, corpus[N_PROMPT:N_PROMPT + 300])  # the slot now holds another prompt
        started, stop = threading.Event(), threading.Event()

        def generate() -> None:
            body = {"prompt": corpus[N_PROMPT:N_PROMPT + 300], "n_predict": 6000, "ignore_eos": True,
                    "stream": True, "id_slot": 0, "cache_prompt": True, **GREEDY}
            req = urllib.request.Request(srv.url + "/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=300) as resp:
                for line in resp:
                    if line.startswith(b"data: "):
                        started.set()
                    if stop.is_set():
                        break  # closing the connection stops the generation and frees the slot

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            gen = pool.submit(generate)
            assert started.wait(120), srv.log_tail()
            fut = pool.submit(restore, srv, "a.bin")
            for _ in range(600):  # bounded: 60 s
                if _metric(srv, "llamacpp:requests_deferred") >= 1 or fut.done():
                    break
                stop.wait(0.1)
            assert not fut.done(), fut.result()  # the restore waits for the slot
            (slots / "a.bin").unlink()
            Path(str(slots / "a.bin") + ".ckpt").unlink(missing_ok=True)
            stop.set()
            status, res = fut.result(timeout=120)
            gen.result(timeout=120)
        results[stock] = status
        if not stock:
            assert status == 200, res
            assert res["n_restored"] == len(a) and res["n_read"] == saved["n_written"]
            assert res["timings"]["read_ms"] >= 0
            t = complete(srv, a + corpus[2000:2100], n_predict=2)["timings"]
            assert t["cache_n"] >= len(a) - UBATCH, t
        else:
            assert "read_ms" not in (res.get("timings") or {})
        assert healthy(srv)
        srv.stop()
    assert results == {True: 400, False: 200}


def _boot(srv: LlamaServer, path: str) -> str | None:
    with urllib.request.urlopen(srv.url + path, timeout=30) as resp:
        resp.read()
        return resp.headers.get("X-Llama-Server-Boot")


def test_0005_every_answer_names_the_process(start_server):
    """patches/0005: every answer of the patched build carries ``X-Llama-Server-Boot``, the same id
    on ``/health`` (answered without the task queue) and ``GET /slots`` within one process, another
    one after a restart on the same port; the stock build sends none."""
    stock = start_server(stock=True, n_parallel=1, **SRV)
    assert _boot(stock, "/health") is None and _boot(stock, "/slots") is None
    stock.stop()
    srv = start_server(n_parallel=1, **SRV)
    first = _boot(srv, "/health")
    assert first is not None and len(first) == 16 and int(first, 16) >= 0
    assert _boot(srv, "/slots") == first and _boot(srv, "/health") == first
    srv.restart()
    again = _boot(srv, "/health")
    assert again is not None and again != first and _boot(srv, "/slots") == again


@pytest.mark.parametrize("model", ["dense", "hybrid"])
def test_0006_a_restore_checks_the_hash_it_is_given(start_server, corpus, tmp_path, model):
    """patches/0006: a restore that names the file's XXH3-64 (``"xxh3"``) is checked on the bytes the
    HTTP thread read, before the task is queued: the right hash restores (the next request reuses
    the state); a file with one flipped byte in its memory state is refused with 400 and the slot
    keeps what it held. ``/props`` says so (``ocache.restore_xxh3``). The stock build ignores the
    field and restores the damaged file, which is why ocache asks ``/props`` first."""
    slots = tmp_path / "slots"
    a, b = corpus[:1200], corpus[N_PROMPT:N_PROMPT + 900]
    for stock in (False, True):
        srv = start_server(model=model, stock=stock, n_parallel=1, **SRV)
        caps = (call(srv, "/props")[1] or {}).get("ocache") or {}
        assert caps.get("restore_xxh3") is (None if stock else True)
        complete(srv, a)
        save(srv, "a.bin")
        digest = xxhash.xxh3_64_hexdigest((slots / "a.bin").read_bytes())
        complete(srv, b)                       # the slot now holds b
        status, res = call(srv, "/slots/0?action=restore", {"filename": "a.bin", "xxh3": digest})
        assert status == 200 and res["n_restored"] == len(a), res
        assert complete(srv, a + corpus[1200:1250], n_predict=1)["timings"]["cache_n"] >= len(a) - UBATCH
        complete(srv, b)
        raw = bytearray((slots / "a.bin").read_bytes())
        raw[-100] ^= 0xFF                      # one byte of the memory state
        (slots / "a.bin").write_bytes(bytes(raw))
        status, res = call(srv, "/slots/0?action=restore", {"filename": "a.bin", "xxh3": digest})
        if stock:
            assert status == 200, res          # restored unchecked
        else:
            assert status == 400 and "hash mismatch" in res["error"]["message"], res
            assert slot_tokens(srv) == len(b) + 0  # untouched: still b
            t = complete(srv, b + corpus[N_PROMPT + 900:N_PROMPT + 950], n_predict=1)["timings"]
            assert t["cache_n"] >= len(b) - UBATCH, t
        assert healthy(srv)
        srv.stop()


def _prompt_tokens_total(srv: LlamaServer) -> int:
    with urllib.request.urlopen(srv.url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return int(float(next(ln.split()[-1] for ln in text.splitlines()
                          if ln.startswith("llamacpp:prompt_tokens_total"))))


def test_0007_a_request_planned_for_another_process_is_refused_before_any_work(start_server, corpus):
    """patches/0007: a request whose ``X-Llama-Server-If-Boot`` names another process than the one
    answering is refused with 412 before any handler runs (the prompt-token counter does not move),
    its unread body drained so that the next request on the same keep-alive connection is served;
    the right id, or none, is served; after a restart on the same port the old id is refused. The
    stock build ignores the header."""
    import http.client

    tokens = corpus[:300]
    # a large body (the field is ignored by the handler): refused before it is read, then drained
    body = json.dumps({"prompt": tokens, "n_predict": 1, "pad": "x" * 400_000})

    def post(conn: http.client.HTTPConnection, boot: str | None) -> tuple[int, dict, dict]:
        conn.request("POST", "/completion", body=body, headers={
            "Content-Type": "application/json", **({"X-Llama-Server-If-Boot": boot} if boot else {})})
        resp = conn.getresponse()
        return resp.status, dict(resp.headers), json.loads(resp.read())

    stock = start_server(stock=True, n_parallel=1, **SRV)
    status, _, res = post(http.client.HTTPConnection("127.0.0.1", stock.port, timeout=60), "0" * 16)
    assert status == 200 and res["timings"]["prompt_n"] == len(tokens), res
    stock.stop()

    srv = start_server(n_parallel=1, **SRV)
    boot = _boot(srv, "/health")
    with urllib.request.urlopen(srv.url + "/props", timeout=30) as resp:
        assert json.loads(resp.read())["ocache"]["if_boot"] is True
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    before = _prompt_tokens_total(srv)
    other = f"{int(boot, 16) ^ 1:016x}"
    status, headers, res = post(conn, other)
    assert status == 412 and res["error"]["type"] == "precondition_failed_error", res
    assert headers["X-Llama-Server-Boot"] == boot and other in res["error"]["message"]
    assert _prompt_tokens_total(srv) == before           # no work for it
    status, _, res = post(conn, boot)                    # the same connection, kept alive
    assert status == 200 and res["timings"]["prompt_n"] == len(tokens), res
    assert _prompt_tokens_total(srv) == before + len(tokens)
    status, _, res = post(conn, None)
    assert status == 200
    conn.close()
    srv.restart()
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    status, headers, _ = post(conn, boot)
    assert status == 412 and headers["X-Llama-Server-Boot"] != boot
    assert _prompt_tokens_total(srv) == 0
    conn.close()


# ---------------------------------------------------------------------------------------------
# 0008: a prompt that begins with the slot's own tokens ("ocache_splice")


def _xxh3(tokens: list[int]) -> str:
    """XXH3-64 (seed 0) of token ids as int32 little-endian, 16 hex digits (patches/README.md, 0008)."""
    return xxhash.xxh3_64_hexdigest(np.asarray(tokens, dtype="<i4").tobytes())


def _splice(n_keep: int, checked: list[int], tail: list[int]) -> dict:
    return {"n_keep": n_keep, "n_check": len(checked), "xxh3": _xxh3(checked),
            "n_tail": len(tail), "tail_xxh3": _xxh3(tail)}


@pytest.mark.parametrize("model", ["dense", "hybrid"])
def test_0008_a_prompt_begins_with_the_slots_own_tokens(start_server, corpus, tmp_path, model):
    """patches/0008: slot 0 holds a prompt and its generation; a request whose own prompt is a
    rewrite of that history (other tokens) plus a new part, with ``ocache_splice`` naming the slot's
    tokens (all of them, every one checked by hash) and the new part (its last tokens,
    hashed), is served as the slot's tokens + the new part: only the new part is prefilled (the
    server's counter moves by it), the prompt is that long, and the greedy output equals a cold
    prefill of that prompt. The stock build ignores the field and serves the prompt as sent."""
    head, tail = corpus[:1500], corpus[N_PROMPT + 300:N_PROMPT + 400]
    rewritten = corpus[1:1400] + tail          # the client's copy: the history rewritten, then the new part

    stock = start_server(model, stock=True, n_parallel=2, **SRV)
    ok(stock, "/completion", {"prompt": head, "n_predict": 8, "id_slot": 0, **GREEDY})
    res = ok(stock, "/completion", {"prompt": rewritten, "n_predict": 4, "id_slot": 0, **GREEDY,
                                    "ocache_splice": _splice(1500, head, tail)})
    assert res["tokens_evaluated"] == len(rewritten), res      # served as sent
    assert "ocache" not in ok(stock, "/props")
    stock.stop()

    srv = start_server(model, n_parallel=2, **SRV)
    assert ok(srv, "/props")["ocache"]["splice"] is True
    first = ok(srv, "/completion", {"prompt": head, "n_predict": 8, "id_slot": 0, **GREEDY})
    n_held = first["tokens_cached"]                            # prompt + generated - 1 (docs/llama-server.md §7)
    assert n_held == len(head) + 7
    save(srv, "held.bin")
    held = slot_file_tokens(tmp_path / "slots" / "held.bin")
    assert len(held) == n_held and held[:len(head)] == head

    before = _prompt_tokens_total(srv)
    got = ok(srv, "/completion", {"prompt": rewritten, "n_predict": 16, "id_slot": 0, "return_tokens": True,
                                  "n_probs": 2, **GREEDY, "ocache_splice": _splice(n_held, held, tail)})
    assert got["tokens_evaluated"] == n_held + len(tail), got
    assert got["timings"]["cache_n"] == n_held and got["timings"]["prompt_n"] == len(tail), got["timings"]
    assert _prompt_tokens_total(srv) - before == len(tail)
    assert "ocache_splice: prompt = %d tokens of the slot + %d of the request's %d" % (
        n_held, len(tail), len(rewritten)) in srv.log_tail(200)

    cold = ok(srv, "/completion", {"prompt": held + tail, "n_predict": 16, "id_slot": 1, "cache_prompt": False,
                                   "return_tokens": True, "n_probs": 2, **GREEDY})
    assert cold["timings"]["cache_n"] == 0 and len(cold["tokens"]) == 16
    v = compare(Generation.from_response(cold), Generation.from_response(got))
    assert v.exact and v.compared >= 1, describe(v)


def test_0008_a_splice_the_slot_does_not_hold_is_refused_and_the_slot_kept(start_server, corpus):
    """patches/0008's refusals, with no prompt token counted and the slot untouched (the next request
    that extends it reuses all of it): 412 ``precondition_failed_error`` when the slot's tokens
    hash otherwise (another conversation is there), it holds fewer tokens than named, or the new
    part's hash is not the prompt's last tokens' (the proxy then plans the request again, as for
    0007's 412); 400 for a malformed field, ``n_check`` other than ``n_keep`` (every kept token is
    checked) or no ``id_slot``. Every message starts ``ocache_splice``."""
    srv = start_server("hybrid", n_parallel=1, **SRV)
    head, tail = corpus[:1200], corpus[N_PROMPT + 300:N_PROMPT + 350]
    first = ok(srv, "/completion", {"prompt": head, "n_predict": 4, "id_slot": 0, "return_tokens": True, **GREEDY})
    n_held = first["tokens_cached"]
    prompt = corpus[5:900] + tail
    held = head + first["tokens"][:-1]           # the prompt, then every generated id but the last
    assert len(held) == n_held
    good = _splice(n_held, held, tail)
    refused = {
        "other conversation": ({**good, "xxh3": _xxh3(corpus[1:1201])}, 412),
        "longer than held": ({**good, "n_keep": n_held + 1, "n_check": n_held + 1, "xxh3": _xxh3(held + [0])}, 412),
        "tail not the prompt's": ({**good, "tail_xxh3": _xxh3(corpus[:50])}, 412),
        "check past keep": ({**good, "n_check": n_held + 1}, 400),
        # every kept token is checked: a proxy (or a client reaching the server directly) cannot
        # name slot tokens it does not know
        "check short of keep": ({**good, "n_check": n_held - 1, "xxh3": _xxh3(held[:-1])}, 400),
        "nothing checked": ({**good, "n_check": 0, "xxh3": _xxh3([])}, 400),
        "tail past prompt": ({**good, "n_tail": len(prompt) + 1}, 400),
        "hash not hex": ({**good, "xxh3": "z" * 16}, 400),
        "missing key": ({k: v for k, v in good.items() if k != "n_tail"}, 400),
    }
    before = _prompt_tokens_total(srv)
    for why, (sp, want) in refused.items():
        status, res = call(srv, "/completion", {"prompt": prompt, "n_predict": 4, "id_slot": 0, **GREEDY,
                                                "ocache_splice": sp})
        assert status == want and res["error"]["message"].startswith("ocache_splice"), (why, status, res)
        if want == 412:
            assert res["error"]["type"] == "precondition_failed_error", res
    status, res = call(srv, "/completion", {"prompt": prompt, "n_predict": 4, **GREEDY, "ocache_splice": good})
    assert status == 400 and "id_slot" in res["error"]["message"], res
    for stream in (True, False):   # a refusal at launch is an HTTP error, also for a stream
        status, res = call(srv, "/completion", {"prompt": prompt, "n_predict": 4, "id_slot": 0, "stream": stream,
                                                **GREEDY, "ocache_splice": refused["other conversation"][0]})
        assert status == 412 and "hash to" in res["error"]["message"], res
    assert _prompt_tokens_total(srv) == before
    # the slot still holds the conversation: extending it prefills only the extension
    res = ok(srv, "/completion", {"prompt": head + first["tokens"][:3] + tail, "n_predict": 1, "id_slot": 0,
                                  **GREEDY, "return_tokens": True})
    assert res["timings"]["cache_n"] == n_held, res["timings"]


# ---------------------------------------------------------------------------------------------
# 0010: the sampled ids in a chat answer's timings ("ocache_generated")


@pytest.mark.parametrize("stream", [False, True])
def test_0010_a_chat_answer_reports_the_ids_it_sampled(start_server, stream):
    """patches/0010: a chat request with ``"ocache_generated": true`` gets the ids the slot sampled
    (the end of generation last) in its final ``timings``: the slot then holds its prompt and all of
    them but the last (docs/llama-server.md §7), every id known. Without the field nothing is added;
    a non-boolean is a 400; the stock build ignores the field."""
    body = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 12, "stream": stream,
            "id_slot": 0, **GREEDY}

    def final_timings(srv: LlamaServer, extra: dict) -> dict:
        req = urllib.request.Request(srv.url + "/v1/chat/completions", data=json.dumps({**body, **extra}).encode(),
                                     headers={"Content-Type": "application/json"})
        raw = urllib.request.urlopen(req, timeout=120).read().decode()
        if not stream:
            return json.loads(raw)["timings"]
        events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
        return [e for e in events if "timings" in e][-1]["timings"]

    stock = start_server("dense", stock=True, n_parallel=1, **SRV)
    assert "ocache_generated" not in final_timings(stock, {"ocache_generated": True})
    stock.stop()
    srv = start_server("dense", n_parallel=1, **SRV)
    assert ok(srv, "/props")["ocache"]["generated_ids"] is True
    plain = final_timings(srv, {})
    assert "ocache_generated" not in plain
    t = final_timings(srv, {"ocache_generated": True})
    ids = t["ocache_generated"]
    assert len(ids) == t["predicted_n"] and all(isinstance(i, int) for i in ids)
    slots = ok(srv, "/slots")   # the slot's tokens: the prompt, then the sampled ids but the last
    assert slots[0]["n_prompt_tokens"] == t["cache_n"] + t["prompt_n"] + len(ids) - 1
    status, res = call(srv, "/v1/chat/completions", {**body, "stream": False, "ocache_generated": "yes"})
    assert status == 400 and "ocache_generated" in res["error"]["message"], res


def _props(srv: LlamaServer, key: str | None = None) -> tuple[dict, str]:
    req = urllib.request.Request(srv.url + "/props", headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(req, timeout=30) as resp:
        text = resp.read().decode()
    return json.loads(text), text


def test_0009_props_report_the_launch_without_its_secrets(start_server):
    """patches/0009: ``/props`` reports ``ocache.launch``: the argv as given (the values of
    ``--api-key``, ``-hft``/``--hf-token`` replaced), the ``LLAMA_ARG_*`` environment (no name with
    KEY or TOKEN) and the working directory, so ocache reads the flags of a server it did not start
    with its own parser. The stock build reports no ``ocache`` key."""
    from ocache.llama import flags as llama_flags

    stock = start_server(stock=True, n_parallel=1, **SRV)
    props, _ = _props(stock)
    assert "ocache" not in props
    stock.stop()
    key, token = "sk-secret-0009", "hf-secret-0009"
    srv = start_server(n_parallel=2, api_key=key, args=["--hf-token", token],
                       env={"LLAMA_ARG_N_PREDICT": "64", "LLAMA_ARG_HF_TOKEN_TEST": token}, **SRV)
    props, text = _props(srv, key)
    launch = props["ocache"]["launch"]
    assert key not in text and token not in text
    want = srv.command()
    for secret in (key, token):
        want[want.index(secret)] = "<redacted>"
    assert launch["argv"][1:] == want[1:]
    assert launch["env"].get("LLAMA_ARG_N_PREDICT") == "64" and "LLAMA_ARG_HF_TOKEN_TEST" not in launch["env"]
    assert Path(launch["cwd"]).is_dir()
    parsed = llama_flags.parse_flags(launch["argv"][1:], launch["env"])
    assert parsed["n_parallel"] == 2 and parsed["n_ubatch"] == SRV["ubatch"]
    assert Path(parsed["slot_save_path"]) == Path(srv.slot_save_path)
