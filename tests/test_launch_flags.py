"""``flags.argv_from_launch``: the launch of a patched llama-server as /props reports it
(patches/0009 ``ocache.launch``) read back into one command line with ocache's own parser."""

from __future__ import annotations

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
