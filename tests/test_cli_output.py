"""What the terminal commands print for a user: ``ocache top --once`` piped keeps
every line whole (it was cut at 80 columns, rich's width without a terminal), and ``ocache cache
ls`` names the folder of Claude Code and Codex requests (it showed ``-``: their folder is said
elsewhere than opencode's) and keeps the model a client asked for apart from the server identity
(MODEL fell back to ``id <hash>`` in the same column)."""

from __future__ import annotations

from types import SimpleNamespace

from ocache import dashboard
from ocache.api import convert
from ocache.commands import maintenance, top
from ocache.warm import folder_label, folder_of

from conftest import load_fixture

OWNER = "ses_" + "0123456789abcdef" * 8     # a 132-character session id: the row is wider than 80


def _view() -> dict:
    stats = {"uptime_s": 1.0, "completions": {}, "tokens": {"cache_n": 0, "prompt_n": 0}, "fail_open": 0,
             "inflight": 0, "last_completions": [], "upstream": {"state": "ready", "epoch": 1, "restarts": 0},
             "layer": {"slots": [{"id": 0, "tokens": 7, "kind": "agent", "owner": OWNER, "head_len": 0,
                                  "checkpoints": 0, "busy": False, "origin": False, "idle_s": 1.0}]}}
    return dashboard.view(stats, admin=True)


def test_top_once_piped_prints_whole_lines(monkeypatch, capsys):
    monkeypatch.setattr(top, "fetch_view", lambda url, token: _view())
    monkeypatch.delenv("COLUMNS", raising=False)
    args = SimpleNamespace(url="http://127.0.0.1:8081", token=None, once=True, interval=1.0)
    assert top.cmd_top(args) == 0
    out = capsys.readouterr().out
    assert OWNER in out, out                  # one line, not wrapped or cut with an ellipsis
    assert max(len(ln) for ln in out.splitlines()) > 80


def test_the_folder_of_claude_code_and_codex_requests_is_named():
    for name, conv, folder in (("claude_run1_agent_turn1.json", convert.anthropic_to_chat, "/home/user/proj"),
                               ("claude_run4_proj2_agent_turn1.json", convert.anthropic_to_chat, "/home/user/proj2"),
                               ("codex_run1_turn1.json", convert.responses_to_chat, "/home/user/proj"),
                               ("codex_run4_proj2_turn1.json", convert.responses_to_chat, "/home/user/proj2")):
        body = conv(load_fixture(name))
        assert folder_of(body) is None          # the journal's patterns: unchanged
        assert folder_label(body) == folder, name
    assert folder_label(load_fixture("opencode_agent_turn1.json")) == "/home/user/proj"
    assert folder_label(load_fixture("opencode_title.json")) is None


def test_cache_ls_keeps_the_model_name_apart_from_the_server_identity():
    def entry(meta):
        return SimpleNamespace(kind="a", meta=meta, identity="0123456789abcdef", n_tokens=1200, bytes=4000,
                               hits=1, created=0.0, last_used=0.0, key="k" * 32)
    out = maintenance.table([entry({"folder": "/p", "client": "claude-cli", "model": "qwen"}), entry({})],
                            now=10.0).splitlines()
    assert out[0].split()[:5] == ["KIND", "FOLDER", "CLIENT", "MODEL", "SERVER"]
    rows = sorted(ln.split()[:5] for ln in out[1:])
    assert rows == [["anchor", "-", "-", "-", "01234567"], ["anchor", "/p", "claude-cli", "qwen", "01234567"]]


def test_cache_commands_on_a_fresh_machine_exit_0(tmp_path, capsys):
    """No store yet (nothing saved) is not an error: ``cache ls`` says so and exits 0 (it exited 1),
    and so do ``gc`` and ``clear`` (nothing to collect or delete)."""
    from ocache import cli

    for action in ("ls", "gc", "clear"):
        assert cli.main(["cache", action, "--cache-dir", str(tmp_path / "fresh")]) == 0, action
        out = capsys.readouterr().out
        assert "nothing saved yet" in out and str(tmp_path / "fresh") in out, (action, out)
    assert not (tmp_path / "fresh").exists()      # looking made nothing


def test_cache_ls_labels_an_anchor_at_a_session_start_apart_from_a_spill():
    """An anchor the disk tier saved at a conversation's first user message records the reason
    ``session``; ``ls`` showed it as REASON ``session`` beside spill entries (the session tier's).
    It reads ``session-start``; a spill's reasons and the other anchors' are as recorded."""
    def entry(kind, reason, key):
        return SimpleNamespace(kind=kind, meta={"reason": reason}, identity="0123456789abcdef", n_tokens=1200,
                               bytes=4000, hits=1, created=0.0, last_used=0.0, key=key * 32)
    out = maintenance.table([entry("a", "session", "a"), entry("a", "head", "b"), entry("s", "evict", "c"),
                             entry("s", "drain", "d")], now=10.0).splitlines()
    got = {ln.split()[-1][0]: (ln.split()[0], ln.split()[-2]) for ln in out[1:]}
    assert got == {"a": ("anchor", "session-start"), "b": ("anchor", "head"), "c": ("spill", "evict"),
                   "d": ("spill", "drain")}, out
    # one word: the columns read from the end stay where they were (EVICT third from the end,
    # as tests/test_dashboard.py reads it)
    assert sorted(int(ln.split()[-3]) for ln in out[1:]) == [1, 2, 3, 4], out
