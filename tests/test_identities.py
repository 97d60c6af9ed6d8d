"""Identities coexist: entries of another server identity (another GGUF, other
state-shaping flags) stay on disk and serve again when that identity returns; the identity is
computed from the *effective* flags, so a server configured by hand (the README's ``ocache.yaml``)
and the same server under ``serve --launch`` are one identity.

Real parts: the patched llama-server on the tiny dense and hybrid models (restarted on the same
port and ``--slot-save-path`` with the other model), the in-process proxy with OCacheLayer and its
disk tier, real opencode request bodies (helpers of tests/test_spill.py; ``-ub 128``).
"""

from __future__ import annotations

import os
import shutil

import aiohttp
import pytest

from ocache import fingerprint as fp
from ocache.llama import flags as llama_flags, gguf as llama_gguf
from ocache.config import Config

from test_spill import SERVER, UB, body_of, forget_store, send, session_headers, through_ocache


def readme_yaml_args(srv) -> list[str]:
    """``tiers.resident.server_args`` as the README's ocache.yaml writes them (no -fa, no -c, no -b),
    with this server's values."""
    return ["-np", str(srv.n_parallel), "-ub", str(srv.ubatch), "--ctx-checkpoints", str(srv.ctx_checkpoints),
            "--checkpoint-min-step", str(srv.checkpoint_min_step), "--slot-save-path", str(srv.slot_save_path),
            "--cache-ram", "0"]


def manual_config(srv, cache_dir) -> Config:
    return Config(upstream=srv.url, cache_dir=str(cache_dir),
                  tiers={"resident": {"server_args": readme_yaml_args(srv)}})


def server_config(srv, cache_dir) -> Config:
    """ocache in front of ``srv``, told the flags the server was started with."""
    return Config(upstream=srv.url, cache_dir=str(cache_dir),
                  tiers={"resident": {"server_args": srv.command()[1:]}})


async def committed_turn(s, base, proxy, body: dict, headers: dict) -> tuple[dict, object, str]:
    """``send`` one turn and wait for its anchors' commits: (its record, the disk tier, the
    identity key the layer has now)."""
    rec = await send(s, base, proxy, body, headers)
    disk = proxy.layer.disk_tier
    await disk.flush()
    return rec, disk, proxy.layer.identity().key


def launch_config(srv, cache_dir) -> Config:
    # what `ocache serve --launch -- ARGS` hands the layer: the arguments after `--` (the
    # supervisor adds --host/--port/--metrics; here the server is already running with them)
    return Config(upstream=srv.url, cache_dir=str(cache_dir), launch=srv.command()[1:])


async def restart_seen(proxy, srv, model=None) -> None:
    """Stop the server, let the proxy see it down, start it (with the GGUF ``model``), let the proxy
    see the new process: deterministic restart detection without the 2 s monitor."""
    srv.stop()
    assert await proxy.upstream.probe() == "down"
    if model is not None:
        srv.model = model
    srv.start()
    assert await proxy.upstream.probe() == "ready"


@pytest.mark.server
async def test_manual_yaml_and_launch_are_one_identity(start_server, tmp_path):
    """The README's ocache.yaml (manual mode) and ``serve --launch`` with the same server: one
    identity. Anchors written in manual mode serve the next ocache in launch mode after a server
    restart (X-OCache-Tier: disk), instead of being deleted as "foreign identity"."""
    srv = start_server("dense", n_parallel=2, ctx_size=32768, flash_attn="on", **SERVER)
    t1 = body_of("opencode_agent_turn1.json")
    t2 = body_of("opencode_agent_turn1_after_tool.json")
    h = session_headers("opencode_agent_turn1.json")
    cache = tmp_path / "cache"
    async with through_ocache(manual_config(srv, cache)) as (base, proxy), aiohttp.ClientSession() as s:
        _, disk, manual_key = await committed_turn(s, base, proxy, t1, h)
        anchors = sorted(e.n_tokens for e in disk.store.entries("a"))
        assert anchors, disk.stats()
    forget_store(cache)
    srv.restart()  # empty slots: only the disk can serve the next turn
    async with through_ocache(launch_config(srv, cache)) as (base, proxy), aiohttp.ClientSession() as s:
        await proxy.layer.ensure_ready()
        assert proxy.layer.identity().key == manual_key
        assert sorted(e.n_tokens for e in proxy.layer.disk_tier.store.entries("a")) == anchors
        rec = await send(s, base, proxy, t2, h)
        assert rec["tier"] == "disk", (rec["tier"], proxy.layer.disk_tier.stats())
        assert rec["timings"]["cache_n"] >= anchors[-1] - UB, (rec["timings"], anchors)


@pytest.mark.server
async def test_model_switch_a_b_a_reuses_a_from_disk(start_server, tmp_path, models_tiny):
    """A (dense) -> B (hybrid) -> A on one port and one --slot-save-path. While B runs, A's anchors
    stay on disk (B is not served them, and B's own are written); the next ocache, after the switch
    back to A, serves A's next turn from A's anchors: cache_n >= head - one ubatch."""
    srv = start_server("dense", n_parallel=1, ctx_size=16384, **SERVER)
    a1, a2 = body_of("opencode_agent_turn1.json"), body_of("opencode_agent_turn1_after_tool.json")
    b1 = body_of("opencode_run3_proj2_agent_turn1.json")
    ha, hb = session_headers("opencode_agent_turn1.json"), session_headers("opencode_run3_proj2_agent_turn1.json")
    cache = tmp_path / "cache"
    cfg = server_config(srv, cache)
    async with through_ocache(cfg) as (base, proxy), aiohttp.ClientSession() as s:
        _, disk, key_a = await committed_turn(s, base, proxy, a1, ha)
        a_entries = {e.key for e in disk.store.entries("a")}
        head_a = max(e.n_tokens for e in disk.store.entries("a") if e.meta.get("reason") == "head")
        assert a_entries

        await restart_seen(proxy, srv, models_tiny["hybrid"])
        rec, _, key_b = await committed_turn(s, base, proxy, b1, hb)
        assert key_b != key_a and disk.store.identity == key_b
        assert rec["tier"] != "disk"                       # A's anchors are never offered to B
        assert a_entries <= {e.key for e in disk.store.entries("a")}, "A's anchors were deleted"
        b_entries = {e.key for e in disk.store.entries("a") if e.identity == key_b}
        assert b_entries

    forget_store(cache)
    srv.stop()
    srv.model = models_tiny["dense"]
    srv.start()
    async with through_ocache(cfg) as (base, proxy), aiohttp.ClientSession() as s:
        rec = await send(s, base, proxy, a2, ha)
        disk = proxy.layer.disk_tier
        assert proxy.layer.identity().key == key_a
        assert rec["tier"] == "disk", (rec["tier"], disk.stats())
        assert rec["timings"]["cache_n"] >= head_a - UB, (rec["timings"], head_a)
        print(f"A's return after A -> B -> A: tier {rec['tier']}, cache_n {rec['timings']['cache_n']}, "
              f"prompt_n {rec['timings']['prompt_n']}, A's head {head_a} tokens")
        assert b_entries <= {e.key for e in disk.store.entries("a")}, "B's anchors were deleted"


@pytest.mark.server
async def test_flash_attn_auto_is_on_for_saved_states(start_server, tmp_path):
    """The fact behind ``identity_flags``' ``-fa auto`` = ``on``: a slot file written by a server
    with ``-fa on`` restores into the same server restarted with ``-fa auto`` (and is reused), and
    is refused with ``-fa off`` (the other V layout). The identities say the same."""
    srv = start_server("dense", n_parallel=1, ctx_size=4096, flash_attn="on", **SERVER)
    prompt = " ".join(f"t{i}" for i in range(300))

    async def complete() -> dict:
        async with aiohttp.ClientSession() as s:  # a fresh connection per call: the server restarts
            async with s.post(srv.url + "/completion", json={"prompt": prompt, "n_predict": 1, "id_slot": 0,
                                                               "cache_prompt": True, "temperature": 0}) as r:
                assert r.status == 200
                return (await r.json())["timings"]

    async def slot_action(action: str) -> int:
        async with aiohttp.ClientSession() as s:
            async with s.post(srv.url + f"/slots/0?action={action}", json={"filename": "fa-probe.bin"}) as r:
                await r.read()
                return r.status

    await complete()
    assert await slot_action("save") == 200
    keys = {}
    for fa in ("auto", "off"):
        srv.stop()
        srv.flash_attn = fa
        srv.start()
        keys[fa] = fp.identity(None, "b", "t", llama_flags.parse_flags(srv.command())).key
        if fa == "auto":
            assert await slot_action("restore") == 200
            assert (await complete())["cache_n"] > 250
        else:
            assert await slot_action("restore") != 200
    on = fp.identity(None, "b", "t", llama_flags.parse_flags([*srv.command(), "-fa", "on"])).key
    assert keys["auto"] == on != keys["off"]


def unsampled_offset(path) -> int:
    """The middle of the widest stretch of ``path``'s tensor data that the identity's data sample
    never reads (``gguf.gguf_sample_spans``): a weight there is outside every sampled block."""
    spans = sorted(llama_gguf.gguf_sample_spans(path))
    gaps = [(b2 - a1, a1, b2) for (_, a1), (b2, _) in zip(spans, spans[1:]) if b2 > a1]
    width, start, end = max(gaps)
    assert width > 1024, spans[:4]
    return (start + end) // 2


@pytest.mark.server
async def test_weights_changed_outside_the_sample_are_served_cold(start_server, tmp_path, models_tiny):
    """One weight of the served GGUF changed outside every block the data sample reads, written in
    place with the old size and mtime set back (``os.utime``), then the server restarted: the layer's
    identity changes (the whole file's XXH3-128, taken once per file version before the first
    request, under a second for a file under ``gguf.DIGEST_INLINE_BYTES``), so the old model's
    anchors are kept but never offered, and the next turn is not restored from the disk. On the
    sampled identity it was one identity and the turn came back from the old model's anchor."""
    served = tmp_path / "model.gguf"
    shutil.copy2(models_tiny["dense"], served)
    srv = start_server("dense", n_parallel=1, ctx_size=16384, **SERVER)
    srv.stop()
    srv.model = served
    srv.start()
    t1, t2 = body_of("opencode_agent_turn1.json"), body_of("opencode_agent_turn1_after_tool.json")
    h = session_headers("opencode_agent_turn1.json")
    cfg = server_config(srv, tmp_path / "cache")
    async with through_ocache(cfg) as (base, proxy), aiohttp.ClientSession() as s:
        _, disk, old_key = await committed_turn(s, base, proxy, t1, h)
        old_entries = {e.key for e in disk.store.entries("a") if e.identity == old_key}
        assert old_entries, disk.stats()

        st = served.stat()
        srv.stop()
        offset = unsampled_offset(served)
        with open(served, "r+b") as f:       # in place, as cp -p over the file does
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0x01]))
        os.utime(served, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert (served.stat().st_size, served.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
        await restart_seen(proxy, srv)
        rec, _, new_key = await committed_turn(s, base, proxy, t2, h)
        assert rec["tier"] != "disk", (rec["tier"], disk.stats())
        assert new_key != old_key and disk.store.identity == new_key
        assert proxy.layer.identity().fields["gguf"]["file_xxh3_128"]      # digested before the turn
        assert old_entries <= {e.key for e in disk.store.entries("a")}, "the old model's anchors were deleted"


@pytest.mark.server
async def test_a_model_over_the_inline_bound_is_digested_in_the_background(start_server, tmp_path, monkeypatch):
    """A model file larger than ``gguf.DIGEST_INLINE_BYTES`` (here the bound is 0) is not waited for:
    the layer is ready under the provisional identity of that file version (``pending``: its stat),
    which the stores use meanwhile, and once the worker thread's digest is in, the identity and the
    stores switch to the digested one, under which the next turn's anchors are written."""
    monkeypatch.setattr(llama_gguf, "DIGEST_INLINE_BYTES", 0)
    monkeypatch.setattr(llama_gguf, "_digests", {})     # a file never digested in this process
    srv = start_server("dense", n_parallel=1, ctx_size=16384, **SERVER)
    cfg = server_config(srv, tmp_path / "cache")
    async with through_ocache(cfg) as (base, proxy), aiohttp.ClientSession() as s:
        await proxy.layer.ensure_ready()
        provisional = proxy.layer.identity()
        assert provisional.fields["gguf"]["pending"] and not provisional.fields["gguf"]["file_xxh3_128"]
        disk = proxy.layer.disk_tier
        assert disk.store.identity == provisional.key
        await proxy.layer.ids.digest_task
        ident = proxy.layer.identity()
        assert "pending" not in ident.fields["gguf"]
        assert ident.fields["gguf"]["file_xxh3_128"] == llama_gguf.known_digest(srv.model)
        assert disk.store.identity == ident.key != provisional.key
        await send(s, base, proxy, body_of("opencode_agent_turn1.json"), session_headers("opencode_agent_turn1.json"))
        await disk.flush()
        assert {e.identity for e in disk.store.entries("a")} == {ident.key}
