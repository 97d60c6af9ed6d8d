"""Unit tests for ocache.fingerprint (no server): classification, stable harness head, identity.

Inputs are the real opencode/pi request bodies in shared/fixtures (skipped when absent), edited
where a test needs a variant the captures do not contain.
"""

from __future__ import annotations

import copy
import json
import os
import struct

import pytest

from ocache import fingerprint as fp
from ocache.llama import flags as llama_flags, gguf as llama_gguf
from conftest import load_fixture

OPENCODE_AGENT = [
    "opencode_agent_turn1.json", "opencode_agent_turn1_after_tool.json",
    "opencode_nongit_noagents_agent_turn1.json", "opencode_run2_agent_turn1.json",
    "opencode_run3_proj2_agent_turn1.json", "opencode_run3_proj2_agent_turn1_after_tool.json",
    "opencode_run4_continue_turn2.json", "opencode_run4_continue_turn2_after_tool.json",
]
PI = ["pi_turn1.json", "pi_turn1_after_tool.json", "pi_run2_turn1.json", "pi_run2_turn1_after_tool.json"]
TITLES = ["opencode_title.json", "opencode_run2_title.json", "opencode_run3_proj2_title.json",
          "opencode_opts_title.json", "opencode_nosmallmodel_title.json"]


def _ident(**over):
    flags = llama_flags.parse_flags(["llama-server", "-np", "2", "-c", "8192", "-fa", "off", "-ub", "512"])
    args = dict(gguf={"size": 1000, "mtime_ns": 1, "header_xxh3_128": "ab" * 16}, build_info="b1-0c1e570",
                chat_template="{{ messages }}", flags=flags)
    args.update(over)
    return fp.identity(**args)


def _system(body: dict) -> str:
    return body["messages"][0]["content"]


def _with_system(body: dict, text: str) -> dict:
    out = copy.deepcopy(body)
    out["messages"][0]["content"] = text
    return out


# --- classification -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", OPENCODE_AGENT + PI)
def test_agent_fixtures_are_agent_turns(name):
    assert fp.classify(load_fixture(name)) == "agent"


@pytest.mark.parametrize("name", TITLES)
def test_title_requests_are_guests(name):
    assert fp.classify(load_fixture(name)) == "guest"


def test_open_webui_task_request_is_guest_even_when_long():
    history = "USER: " + "explain the parser " * 2000
    body = {"messages": [{"role": "user", "content": "### Task:\nGenerate 1-3 broad tags.\n<chat_history>\n"
                          + history + "\n</chat_history>"}]}
    assert len(body["messages"][0]["content"]) > fp.DEFAULT_GUEST_MAX_CHARS
    assert fp.classify(body) == "guest"


def test_long_plain_chat_is_other_and_short_one_is_guest():
    short = {"messages": [{"role": "user", "content": "hi"}]}
    long = {"messages": [{"role": "user", "content": "x" * (fp.DEFAULT_GUEST_MAX_CHARS + 1)}]}
    assert fp.classify(short) == "guest"
    assert fp.classify(long) == "other"
    assert fp.classify(long, guest_max_chars=10 ** 6) == "guest"


def test_tools_without_system_and_odd_bodies_are_other():
    agent = load_fixture("opencode_agent_turn1.json")
    no_system = copy.deepcopy(agent)
    no_system["messages"] = no_system["messages"][1:]
    assert fp.classify(no_system) == "other"
    assert fp.classify({}) == "other"
    assert fp.classify({"prompt": "hello"}) == "other"
    assert fp.classify({"messages": "not a list"}) == "other"


def test_short_request_with_the_harness_system_prompt_is_not_a_guest():
    agent = load_fixture("opencode_agent_turn1.json")
    body = {"messages": agent["messages"][:1] + [{"role": "user", "content": "summarize"}]}
    limit = 2 * len(_system(agent))  # short enough to be a guest by length alone
    assert fp.classify({"messages": [{"role": "system", "content": "be brief"}, body["messages"][1]]},
                       guest_max_chars=limit) == "guest"
    assert fp.classify(body, guest_max_chars=limit) == "other"


# --- stable harness head ----------------------------------------------------------------------

def test_head_is_tools_plus_system_cut_before_the_first_marker():
    body = load_fixture("opencode_agent_turn1.json")
    head = fp.harness_head(body)
    assert head is not None
    assert head.tools_json == json.dumps(body["tools"], ensure_ascii=False, separators=(",", ":"))
    assert json.loads(head.tools_json) == body["tools"]
    text = _system(body)
    assert text.startswith(head.system_head)
    assert text[head.cut:].startswith(head.marker)
    # the cut is before every volatile part of opencode's system prompt
    for volatile in ("<env>", "Working directory", "Today's date", "Instructions from:", "<available_skills>",
                     "The exact model ID"):
        assert volatile in text and volatile not in head.system_head
    assert len(head.system_head) > 8000  # the fixed base prompt (~8.5 KB) stays in the head
    assert len(head.key) == 16


def test_changed_date_and_cwd_in_env_keep_head_and_fingerprint():
    body = load_fixture("opencode_agent_turn1.json")
    text = _system(body)
    assert "Today's date: Sun Nov 29 2026" in text and "/home/user/proj" in text
    other = _with_system(body, text.replace("Today's date: Sun Nov 29 2026", "Today's date: Mon Nov 30 2026")
                         .replace("/home/user/proj", "/srv/elsewhere/x"))
    h1, h2 = fp.harness_head(body), fp.harness_head(other)
    assert h1 == h2
    ident = _ident()
    assert fp.fingerprint(h1, ident) == fp.fingerprint(h2, ident)


def test_model_alias_mcp_and_skills_changes_keep_the_head():
    body = load_fixture("opencode_agent_turn1.json")
    text = _system(body)
    variant = (text.replace("model named qwen. The exact model ID is local/qwen",
                            "model named qwen-fast. The exact model ID is local/qwen-fast")
               .replace("<available_skills>", "<available_skills>\n  <skill><name>new</name></skill>")
               + "\n<mcp_instructions>\nserver foo: turn 7\n</mcp_instructions>")
    assert fp.harness_head(_with_system(body, variant)) == fp.harness_head(body)


def test_sessions_in_two_folders_share_the_head():
    run2 = fp.harness_head(load_fixture("opencode_run2_agent_turn1.json"))
    proj2 = fp.harness_head(load_fixture("opencode_run3_proj2_agent_turn1.json"))
    nongit = fp.harness_head(load_fixture("opencode_nongit_noagents_agent_turn1.json"))
    follow = fp.harness_head(load_fixture("opencode_run3_proj2_agent_turn1_after_tool.json"))
    assert run2 is not None and run2 == proj2 == nongit == follow
    assert _system(load_fixture("opencode_run2_agent_turn1.json")) != _system(
        load_fixture("opencode_run3_proj2_agent_turn1.json"))


@pytest.mark.parametrize("edit", ["description", "order", "added", "removed"])
def test_changed_tool_changes_head_and_fingerprint(edit):
    body = load_fixture("opencode_agent_turn1.json")
    other = copy.deepcopy(body)
    tools = other["tools"]
    if edit == "description":
        tools[0]["function"]["description"] += " (v2)"
    elif edit == "order":
        tools[0], tools[1] = tools[1], tools[0]
    elif edit == "added":
        tools.append({"type": "function", "function": {"name": "mcp_x", "description": "d",
                                                        "parameters": {"type": "object", "properties": {}}}})
    else:
        tools.pop()
    h1, h2 = fp.harness_head(body), fp.harness_head(other)
    assert h1.system_head == h2.system_head
    assert h1.key != h2.key
    ident = _ident()
    assert fp.fingerprint(h1, ident) != fp.fingerprint(h2, ident)


def test_tool_json_key_order_is_kept():
    body = load_fixture("pi_turn1.json")
    other = copy.deepcopy(body)
    fn = other["tools"][0]["function"]
    other["tools"][0]["function"] = dict(reversed(list(fn.items())))  # same dict, other key order
    assert other["tools"] == body["tools"]
    assert fp.harness_head(body).key != fp.harness_head(other).key  # the template renders key order


def test_render_knobs_are_part_of_the_head_key():
    body = load_fixture("pi_turn1.json")
    thinking = {**body, "chat_template_kwargs": {"enable_thinking": False}}
    auto = {**body, "tool_choice": "auto"}
    assert fp.harness_head(thinking).key != fp.harness_head(body).key
    assert fp.harness_head(auto).key == fp.harness_head(body).key  # "auto" is the server default


def test_unknown_system_layout_yields_no_head_and_leaves_the_request_alone():
    body = load_fixture("opencode_agent_turn1.json")
    text = _system(body)
    unknown = _with_system(body, text[: fp.harness_head(body).cut] + "Some other harness tail, no markers.")
    before = copy.deepcopy(unknown)
    assert fp.harness_head(unknown) is None
    assert unknown == before  # nothing mutated: the proxy forwards it as it came
    assert fp.classify(unknown) == "agent"  # still routed as an agent turn, just without a head
    head = fp.harness_head(unknown, require_marker=False)
    assert head is not None and head.marker is None and head.system_head == _system(unknown)


@pytest.mark.parametrize("messages", [
    [],
    [{"role": "user", "content": "hi"}, {"role": "system", "content": "<env>\n</env>"}],
    [{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    [{"role": "system", "content": 42}],
])
def test_layouts_without_a_leading_text_system_message_yield_no_head(messages):
    assert fp.harness_head({"messages": messages, "tools": []}) is None


def test_malformed_tools_yield_no_head():
    body = load_fixture("opencode_agent_turn1.json")
    assert fp.harness_head({**body, "tools": "bash"}) is None
    assert fp.harness_head({**body, "tools": [1, 2]}) is None


def test_markers_are_configuration():
    body = load_fixture("opencode_agent_turn1.json")
    default = fp.harness_head(body)
    env_only = fp.harness_head(body, markers=("<env>",))
    assert env_only.marker == "<env>" and env_only.cut > default.cut
    assert env_only.key != default.key
    assert fp.harness_head(body, markers=("no such marker",)) is None


def test_marker_must_start_a_line():
    body = {"messages": [{"role": "system", "content": "Base prompt mentions <env> inline.\n<env>\nx\n</env>"}]}
    head = fp.harness_head(body)
    assert head.system_head == "Base prompt mentions <env> inline.\n"


def test_pi_head_cuts_project_context_date_and_cwd():
    body = load_fixture("pi_turn1.json")
    text = _system(body)
    head = fp.harness_head(body)
    assert head.marker == "# Project Context"
    for volatile in ("/home/user/piproj", "Current date:", "Current working directory:"):
        assert volatile not in head.system_head
    # another day and folder, same head
    moved = text.replace("2026-11-29", "2027-01-02").replace("/home/user/piproj", "/tmp/other")
    assert fp.harness_head(_with_system(body, moved)) == head
    # without AGENTS.md there is no project context block: the date line is the cut
    bare = text[: head.cut] + "Current date: 2026-11-29\nCurrent working directory: /x"
    assert fp.harness_head(_with_system(body, bare)).system_head == head.system_head
    assert fp.harness_head(load_fixture("pi_run2_turn1_after_tool.json")) == head


def test_system_content_as_text_parts_equals_the_string_form():
    body = load_fixture("pi_turn1.json")
    text = _system(body)
    cut = fp.harness_head(body).cut
    nl = text.index("\n", 100)
    parts = _with_system(body, [{"type": "text", "text": text[:nl]}, {"type": "text", "text": text[nl + 1:]}])
    # parts are joined with "\n" (common/chat.cpp concat_content_parts)
    assert fp.harness_head(parts) == fp.harness_head(body)
    cut_parts = fp.cut_body(parts, fp.harness_head(parts))
    assert fp.content_text(cut_parts["messages"][0]["content"]) == text[:cut]


def test_multiple_system_messages_use_the_first_only():
    body = load_fixture("opencode_agent_turn1.json")
    two = copy.deepcopy(body)
    two["messages"].insert(1, {"role": "system", "content": "second system message"})
    assert fp.harness_head(two) == fp.harness_head(body)


def test_cut_body_cuts_only_the_system_message():
    body = load_fixture("opencode_agent_turn1_after_tool.json")
    head = fp.harness_head(body)
    cut = fp.cut_body(body, head)
    assert cut["messages"][0]["content"] == head.system_head
    assert cut["messages"][1:] == body["messages"][1:] and cut["tools"] == body["tools"]
    assert body["messages"][0]["content"] != head.system_head  # the original is untouched
    with pytest.raises(ValueError):
        fp.cut_body(_with_system(body, "unrelated"), head)


# --- identity ------------------------------------------------------------------------------------

def test_changed_template_build_gguf_or_flag_changes_the_fingerprint():
    head = fp.harness_head(load_fixture("opencode_agent_turn1.json"))
    base = fp.fingerprint(head, _ident())
    assert base == fp.fingerprint(head, _ident())  # deterministic
    assert len(base) == 16 and int(base, 16) >= 0
    assert fp.fingerprint(head, _ident(chat_template="{{ messages }} ")) != base
    assert fp.fingerprint(head, _ident(chat_template_tool_use="x")) != base
    assert fp.fingerprint(head, _ident(build_info="b2-deadbee")) != base
    assert fp.fingerprint(head, _ident(gguf={"size": 1000, "mtime_ns": 2, "header_xxh3_128": "ab" * 16})) != base
    assert fp.fingerprint(head, _ident(gguf=None)) != base


@pytest.mark.parametrize("extra", [
    ["-ctk", "q8_0"], ["-ctv", "q4_0"], ["-fa", "on"], ["-fa", "auto"], ["--swa-full"],
    ["--rope-freq-base", "20000"], ["--lora", "a.gguf"], ["--override-kv", "a=int:1"],
])
def test_each_state_shaping_flag_changes_the_identity(extra):
    head = fp.harness_head(load_fixture("opencode_agent_turn1.json"))
    argv = ["llama-server", "-np", "2", "-c", "8192", "-fa", "off", "-ub", "512"]
    a = llama_flags.parse_flags(argv)
    b = llama_flags.parse_flags(argv + extra)
    assert a != b
    assert fp.fingerprint(head, _ident(flags=a)) != fp.fingerprint(head, _ident(flags=b))


@pytest.mark.parametrize("extra", [
    ["-c", "16384"], ["-np", "4"], ["-ub", "128"], ["-b", "1024"], ["--ctx-checkpoints", "8"],
    ["-cms", "4096"], ["-kvu"], ["-nkvo"], ["-fa", "enabled"], ["--flash-attn=on"],
    ["-ctk", "F16"], ["--rope-freq-base", "10000.0"],
])
def test_flags_that_do_not_shape_a_saved_state_keep_the_identity(extra):
    """Slot count, context size, batch sizes, checkpoint spacing, unified KV and
    offload do not change what a slot file holds; aliases and spellings of the same value are one."""
    argv = ["llama-server", "-np", "2", "-c", "8192", "-fa", "on", "-ub", "512", "--rope-freq-base", "10000"]
    a = llama_flags.parse_flags(argv)
    b = llama_flags.parse_flags(argv + extra)
    assert _ident(flags=a).key == _ident(flags=b).key


def test_defaults_are_filled_in_and_props_sizes_ignored():
    """The README's ocache.yaml (no -fa, no -c) and the README's --launch line describe one
    identity; so do /props' resolved sizes."""
    yaml_args = ["-np", "2", "-ub", "512", "--ctx-checkpoints", "32", "--checkpoint-min-step", "1024",
                 "--slot-save-path", "/x", "--cache-ram", "0"]
    launch = ["-m", "model.gguf", "-np", "2", "-fa", "on", "--slot-save-path", "/x",
              "--ctx-checkpoints", "32", "--checkpoint-min-step", "1024", "--cache-ram", "0", "--metrics",
              "--host", "127.0.0.1", "--port", "9999"]
    p1 = {"default_generation_settings": {"n_ctx": 4096}, "total_slots": 2}
    p2 = {"default_generation_settings": {"n_ctx": 8192}, "total_slots": 2}
    assert _ident(flags=llama_flags.state_flags(yaml_args, p1)).key == _ident(flags=llama_flags.state_flags(launch, p2)).key
    assert _ident(flags={}).key == _ident(flags=llama_flags.state_flags(launch, p1)).key


def test_flags_that_do_not_shape_state_do_not_change_it():
    argv = ["llama-server", "-np", "2", "-c", "8192"]
    more = llama_flags.parse_flags(
        argv + ["--port", "8080", "-t", "1", "--metrics", "--slot-save-path", "/tmp/x", "--host", "127.0.0.1"])
    assert more["port"] == 8080 and more["metrics"] is True and more["slot_save_path"] == "/tmp/x"
    assert llama_flags.identity_flags(llama_flags.parse_flags(argv)) == llama_flags.identity_flags(more)


def test_parse_server_flags_defaults_aliases_and_env():
    d = llama_flags.parse_flags(["llama-server", "-m", "m.gguf"])
    assert d["n_parallel"] == -1 and d["kv_unified"] is True  # server.cpp:156-161 auto slots
    assert (d["n_batch"], d["n_ubatch"], d["ctx_checkpoints"], d["checkpoint_min_step"]) == (2048, 512, 32, 8192)
    assert (d["cache_type_k"], d["cache_type_v"], d["flash_attn"], d["swa_full"]) == ("f16", "f16", "auto", False)
    a = llama_flags.parse_flags(["--parallel=3", "--ctx-size", "100", "--swa-checkpoints", "4",
                               "--checkpoint-min-step=0", "--flash-attn", "enabled", "--no-kv-unified"])
    assert (a["n_parallel"], a["ctx_size"], a["ctx_checkpoints"], a["checkpoint_min_step"]) == (3, 100, 4, 0)
    assert a["flash_attn"] == "on" and a["kv_unified"] is False
    e = llama_flags.parse_flags(["-np", "2"], env={"LLAMA_ARG_CTX_CHECKPOINTS": "5", "LLAMA_ARG_N_PARALLEL": "7"})
    assert e["ctx_checkpoints"] == 5 and e["n_parallel"] == 2  # the command line overrides env
    with pytest.raises(ValueError):
        llama_flags.parse_flags(["-np"])
    with pytest.raises(ValueError):
        llama_flags.parse_flags(["-c", "lots"])
    with pytest.raises(ValueError):
        llama_flags.parse_flags(["-fa", "maybe"])


def test_state_flags_take_per_slot_context_from_props():
    props = {"default_generation_settings": {"n_ctx": 4096}, "total_slots": 2}
    flags = llama_flags.state_flags(["-np", "2", "-c", "8192"], props=props, config={"cache_type_k": "q8_0"})
    assert flags["n_ctx_slot"] == 4096 and flags["total_slots"] == 2 and flags["cache_type_k"] == "q8_0"


# --- GGUF identity -------------------------------------------------------------------------------

def _gguf_str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _write_gguf(path, name="tiny", template="{{ x }}", data=b"\x00" * 64):
    kv = [
        _gguf_str("general.name") + struct.pack("<I", 8) + _gguf_str(name),
        _gguf_str("tokenizer.chat_template") + struct.pack("<I", 8) + _gguf_str(template),
        _gguf_str("general.alignment") + struct.pack("<I", 4) + struct.pack("<I", 32),
        _gguf_str("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 3) + b"".join(map(_gguf_str, "abc")),
        _gguf_str("x.scores") + struct.pack("<IIQ", 9, 6, 3) + struct.pack("<3f", 0.1, 0.2, 0.3),
    ]
    tensor = _gguf_str("w") + struct.pack("<I", 2) + struct.pack("<QQ", 4, 4) + struct.pack("<I", 0) + struct.pack("<Q", 0)
    header = b"GGUF" + struct.pack("<IQQ", 3, 1, len(kv)) + b"".join(kv) + tensor
    pad = (-len(header)) % 32
    path.write_bytes(header + b"\x00" * pad + data)
    return len(header)


def test_gguf_identity_hashes_the_header_not_the_path(tmp_path):
    a = tmp_path / "a.gguf"
    n = _write_gguf(a)
    ia = llama_gguf.gguf_identity(a)
    assert ia.header_bytes == n and ia.n_kv == 5 and ia.n_tensors == 1 and ia.version == 3
    assert ia.size == a.stat().st_size
    b = tmp_path / "renamed-alias.gguf"
    b.write_bytes(a.read_bytes())
    os.utime(b, ns=(a.stat().st_atime_ns, a.stat().st_mtime_ns))
    assert llama_gguf.gguf_identity(b) == ia  # another path or alias, same file: same identity
    c = tmp_path / "c.gguf"
    _write_gguf(c, template="{{ y }}")  # same size, other metadata
    os.utime(c, ns=(a.stat().st_atime_ns, a.stat().st_mtime_ns))
    ic = llama_gguf.gguf_identity(c)
    assert ic.size == ia.size and ic.header_xxh3_128 != ia.header_xxh3_128
    os.utime(b, ns=(1, 10 ** 18))  # touched: mtime differs
    assert llama_gguf.gguf_identity(b) != ia
    assert fp.identity(str(a), "b1", "t", {}).key == fp.identity(ia, "b1", "t", {}).key


def test_gguf_identity_changes_with_the_weights_under_the_same_header_size_and_mtime(tmp_path):
    """A model regenerated with other weights but the same metadata, copied over the served
    path with its old mtime (``cp -p``, ``rsync -a``, ``touch -r``), is another identity. Before the data
    sample the identity was (size, mtime, header hash) and memoised on (path, size, mtime): equal."""
    a = tmp_path / "model.gguf"
    _write_gguf(a, data=bytes(range(64)) * 200)
    st = a.stat()
    ia = llama_gguf.gguf_identity(a)
    for offset in (0, 6400, 12799):     # a weight in the first, a middle and the last block
        with open(a, "r+b") as f:
            f.seek(ia.header_bytes + (-ia.header_bytes) % 32 + offset)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
        os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns))   # the old mtime, as cp -p leaves it
        assert a.stat().st_size == st.st_size and a.stat().st_mtime_ns == st.st_mtime_ns
        ib = llama_gguf.gguf_identity(a)
        assert ib.header_xxh3_128 == ia.header_xxh3_128 and ib.data_xxh3_128 != ia.data_xxh3_128, offset
        assert fp.identity(ib, "b1", "t", {}).key != fp.identity(ia, "b1", "t", {}).key
        ia = ib


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_identity_covers_every_byte_outside_the_sample(tmp_path):
    """One weight changed where the data sample reads nothing (``data_sample``: each tensor's first and
    last ``SAMPLE_BLOCK`` and ``SAMPLE_SPREAD`` blocks spread over the data; here the middle of the
    gap between two spread blocks), the size kept and the old mtime set back (``os.utime``, as
    ``cp -p`` leaves it): another identity, by the whole file's XXH3-128. On the sampled identity
    (no ``file_xxh3_128``) the two were one identity: ocache restored the old model's anchor."""
    a = tmp_path / "model.gguf"
    data = os.urandom(llama_gguf.SAMPLE_SPREAD * 4 * llama_gguf.SAMPLE_BLOCK)   # 16 MiB, gaps of 12 KiB
    _write_gguf(a, data=data)
    st = a.stat()
    ia = llama_gguf.gguf_identity(a)
    data_start = ia.header_bytes + (-ia.header_bytes) % 32
    _flip(a, data_start + 5 * (len(data) // llama_gguf.SAMPLE_SPREAD) + 2 * llama_gguf.SAMPLE_BLOCK)
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (a.stat().st_size, a.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    ib = llama_gguf.gguf_identity(a)
    assert (ib.header_xxh3_128, ib.data_xxh3_128) == (ia.header_xxh3_128, ia.data_xxh3_128)  # outside the sample
    assert ib.file_xxh3_128 != ia.file_xxh3_128
    assert fp.identity(ib, "b1", "t", {}).key != fp.identity(ia, "b1", "t", {}).key


def test_a_file_version_never_digested_has_its_own_provisional_identity(tmp_path, monkeypatch):
    """``gguf_identity(path, digest=False)`` (what the layer computes, ``wiring.server_identity``)
    takes no digest: for a file version never digested it is provisional, keyed by (st_dev, st_ino,
    st_size, st_mtime_ns, st_ctime_ns), so a rewrite under the old size and mtime is another
    provisional identity at once; once ``file_digest`` ran, the digest is known from memory and from
    the on-disk memo (by that version only), and the identity no longer names the inode."""
    a = tmp_path / "model.gguf"
    _write_gguf(a, data=os.urandom(1 << 16))
    st = a.stat()
    p = llama_gguf.gguf_identity(a, digest=False)
    assert p.file_xxh3_128 == "" and p.pending == llama_gguf.file_version(st)
    full = llama_gguf.gguf_identity(a)
    assert full.pending is None and len(full.file_xxh3_128) == 32
    assert fp.identity(p, "b1", "t", {}).key != fp.identity(full, "b1", "t", {}).key
    assert llama_gguf.gguf_identity(a, digest=False) == full
    monkeypatch.setattr(llama_gguf, "_digests", {})          # a new process: the on-disk memo
    assert llama_gguf.gguf_identity(a, digest=False) == full
    b = tmp_path / "copy.gguf"                                # another inode, the same bytes and mtime
    b.write_bytes(a.read_bytes())
    os.utime(b, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert llama_gguf.gguf_identity(b, digest=False).pending is not None
    assert llama_gguf.gguf_identity(b) == full
    _flip(a, a.stat().st_size - 100)
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns))
    q = llama_gguf.gguf_identity(a, digest=False)
    assert q.pending is not None and q.pending != p.pending and q.pending[2:4] == p.pending[2:4]
    assert fp.identity(q, "b1", "t", {}).key not in (fp.identity(p, "b1", "t", {}).key,
                                                     fp.identity(full, "b1", "t", {}).key)


async def test_ensure_digest_reads_on_a_worker_thread_once_per_version(tmp_path, monkeypatch):
    """Concurrent ``ensure_digest`` calls for one file version share one read, on a thread other than
    the event loop's."""
    import asyncio
    import threading

    a = tmp_path / "model.gguf"
    _write_gguf(a, data=os.urandom(1 << 16))
    threads = []
    real = llama_gguf.file_digest

    def counting(path):
        threads.append(threading.get_ident())
        return real(path)

    monkeypatch.setattr(llama_gguf, "file_digest", counting)
    d1, d2 = await asyncio.gather(llama_gguf.ensure_digest(a), llama_gguf.ensure_digest(a))
    assert d1 == d2 == llama_gguf.known_digest(a)
    assert len(threads) == 1 and threads[0] != threading.get_ident()


def test_gguf_data_sample_is_bounded_and_covers_every_tensor(tmp_path):
    """The sample reads each tensor's first and last block and SAMPLE_SPREAD blocks over the data, not
    the file: a 64 MiB data section is sampled in at most (2 * 1 + 1024) * 4 KiB."""
    reads = []

    class Counting(bytes):
        def __getitem__(self, k):
            if isinstance(k, slice):
                reads.append(k.stop - k.start)
            return bytes.__getitem__(self, k)

    data = os.urandom(1 << 20) * 64
    blob = Counting(b"\x00" * 64 + data)
    llama_gguf.data_sample(blob, 64, [0])
    assert sum(reads) <= (2 + llama_gguf.SAMPLE_SPREAD) * llama_gguf.SAMPLE_BLOCK
    assert len(reads) == 2 + llama_gguf.SAMPLE_SPREAD


def test_gguf_identity_rejects_non_gguf_files(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + b"\x00" * 100)
    with pytest.raises(llama_gguf.GGUFError):
        llama_gguf.gguf_identity(bad)
    short = tmp_path / "short.gguf"
    full = tmp_path / "full.gguf"
    _write_gguf(full)
    short.write_bytes(full.read_bytes()[:40])
    with pytest.raises(llama_gguf.GGUFError):
        llama_gguf.gguf_identity(short)
    with pytest.raises(OSError):
        llama_gguf.gguf_identity(tmp_path / "missing.gguf")


def test_gguf_identity_of_the_generated_models(models_tiny):
    dense, hybrid = llama_gguf.gguf_identity(models_tiny["dense"]), llama_gguf.gguf_identity(models_tiny["hybrid"])
    for path, ident in ((models_tiny["dense"], dense), (models_tiny["hybrid"], hybrid)):
        assert ident.version == 3 and ident.n_tensors > 0 and ident.n_kv > 0
        assert 0 < ident.header_bytes < ident.size == os.path.getsize(path)
        # the header holds the 151,936-token vocab; the tensor data (the rest) is not read
        assert ident.header_bytes > 1_000_000
    assert dense.header_xxh3_128 != hybrid.header_xxh3_128
