"""``flags.argv_from_launch``: the launch of a patched llama-server as /props reports it
(patches/0009 ``ocache.launch``) read back into one command line with ocache's own parser."""

from __future__ import annotations

import aiohttp

from ocache.llama import flags


def test_env_first_argv_overrides_and_relative_paths_resolve_against_the_server_cwd():
    launch = {"argv": ["/opt/llama-server", "-m", "models/m.gguf", "--slot-save-path", "slots",
                       "-np", "2", "--ctx-checkpoints=8", "--lora", "/abs/a.gguf"],
              "env": {"LLAMA_ARG_N_PARALLEL": "4", "LLAMA_ARG_UBATCH": "256", "LLAMA_ARG_KV_UNIFIED": "0",
                      "LLAMA_ARG_SWA_FULL": "1", "LLAMA_ARG_CACHE_RAM": "0"},
              "cwd": "/srv/llm"}
    argv = flags.argv_from_launch(launch)
    got = flags.parse_flags(argv)
    assert got["n_parallel"] == 2                       # the command line wins over LLAMA_ARG_N_PARALLEL
    assert got["n_ubatch"] == 256 and got["cache_ram"] == 0 and got["swa_full"] is True
    assert got["kv_unified"] is False and got["ctx_checkpoints"] == 8
    assert got["slot_save_path"] == "/srv/llm/slots" and got["model_path"] == "/srv/llm/models/m.gguf"
    assert got["lora"] == ["/abs/a.gguf"]
    p = flags.params_from_argv(argv)
    assert p.slot_save_path == "/srv/llm/slots" and p.n_ubatch == 256 and p.n_slots == 2


def test_a_server_without_the_report_or_a_malformed_one_gives_no_flags():
    assert flags.argv_from_launch(None) is None
    assert flags.argv_from_launch({"argv": "llama-server -np 2"}) is None
    assert flags.argv_from_launch({"argv": ["x", 3]}) is None
    assert flags.argv_from_launch({"argv": ["llama-server"], "env": "junk", "cwd": 5}) == []


import pytest  # noqa: E402

from test_hardening_cache import A1, A2, SERVER, body_of, hdrs, send, through_ocache  # noqa: E402

from ocache.config import Config  # noqa: E402


@pytest.mark.server
@pytest.mark.parametrize("stock", [False, True])
async def test_serve_upstream_alone_reads_the_patched_servers_flags(start_server, tmp_path, stock):
    """``ocache serve --upstream URL`` with no ``ocache.yaml`` (``Config`` defaults but the
    upstream and the state folder) in front of the patched server reads its launch flags from
    ``/props`` (patches/0009): the disk tier is on, and after a llama-server restart the next
    opencode turn (the tiny hybrid: it resumes only where a state was saved) restores at least the
    harness head from disk. In front of the stock server the flags stay unknown: no disk tier, the
    turn is prefilled whole (as before this patch, and as the README's first code block gave every
    user: the issue's 0)."""
    srv = start_server("hybrid", stock=stock, n_parallel=2, ctx_size=2 * 16384, **SERVER)
    config = Config(upstream=srv.url, cache_dir=str(tmp_path / "state"))
    async with through_ocache(config) as (base, proxy), aiohttp.ClientSession() as s:
        first = await send(s, base, proxy, body_of(A1), hdrs(A1))
        layer = proxy.layer
        assert (layer.table.params.slot_save_path is not None) is (not stock)
        assert (layer.disk_tier is not None) is (not stock)
        if layer.disk_tier is not None:
            await layer.disk_tier.flush()
        srv.restart()
        rec = await send(s, base, proxy, body_of(A2), hdrs(A2))
        assert (rec["tier"] == "disk") is (not stock), rec["tier"]
        reused = int(rec["data"]["timings"]["cache_n"])
        if stock:
            assert reused == 0, rec["data"]["timings"]
        else:   # at least the head: opencode's system prompt and tools, 6,942 of turn 1's 7,251 tokens
            assert reused >= 0.9 * int(first["data"]["timings"]["prompt_n"]), rec["data"]["timings"]
