"""Text from requests is escaped for the terminal: a project folder named with
``ESC ] 0 ; … BEL`` (retitle) and ``ESC [ 2 J`` (clear) must print as escapes in ``ocache cache ls``,
``ocache stats`` and ``ocache top``, and ``[...]`` must not become rich markup."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

from rich.console import Console

from ocache import dashboard
from ocache.commands import maintenance, top
from ocache.textsafe import term

EVIL = "/home/u/\x1b]0;pwned\x07\x1b[2J[red]proj[/red]\u202e"


def test_term_escapes_controls_and_keeps_printable_text():
    assert term("/home/ü/項目 x") == "/home/ü/項目 x"
    out = term(EVIL)
    assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out
    assert out == "/home/u/\\x1b]0;pwned\\x07\\x1b[2J[red]proj[/red]\\u202e"
    assert term("a\x1bb") != term("a\x1cb")     # nothing dropped: distinct names stay distinct


def test_cache_ls_table_escapes_request_text():
    e = SimpleNamespace(kind="a", meta={"folder": EVIL, "client": "opencode\x1b[31m", "model": "m\x07",
                                        "reason": "r\x9b"},
                        identity="id-0123456789", n_tokens=1200, bytes=4000, hits=1, created=0.0,
                        last_used=0.0, key="k" * 32, value=lambda now: 1.0)
    out = maintenance.table([e], now=10.0)
    assert not any(c in out for c in "\x1b\x07\x9b\u202e")
    assert "\\x1b]0;pwned\\x07" in out and "opencode\\x1b[31m" in out


def _view(owner: str) -> dict:
    stats = {"uptime_s": 1.0, "completions": {}, "tokens": {"cache_n": 0, "prompt_n": 0}, "fail_open": 0,
             "inflight": 0, "last_completions": [{"request_id": "r\x1b[2J", "tier": "disk", "prompt_n": 3,
                                                  "cache_n": 7, "status": 200, "slot": 0, "kind": "[b]x",
                                                  "time": 1.0}],
             "upstream": {"state": "ready", "epoch": 1, "restarts": 0, "build_info": "b\x1b]0;t\x07"},
             "layer": {"slots": [{"id": 0, "tokens": 7, "kind": "agent", "owner": owner, "head_len": 0,
                                  "checkpoints": 0, "busy": False, "origin": False, "idle_s": 1.0}],
                       "setup_warnings": ["warn \x1b[2J"]}}
    return dashboard.view(stats, admin=True)


def test_stats_and_top_escape_request_text():
    v = _view(EVIL)
    lines = "\n".join(top.summary_lines(v, "http://127.0.0.1:8081"))
    assert not any(c in lines for c in "\x1b\x07\u202e") and "\\x1b]0;pwned" in lines
    buf = io.StringIO()
    Console(file=buf, width=300, force_terminal=False, color_system=None).print(
        top.top_renderable(v, "http://127.0.0.1:8081"))
    out = buf.getvalue()
    assert not any(c in out for c in "\x1b\x07\u202e")
    assert "[red]proj[/red]" in out and "[b]x" in out      # shown as typed, not as markup


def test_stats_without_the_token_name_no_folder_or_path():
    """``/v1/cache/stats`` and the view without the admin token named project folders
    and the state directory; ``admin.redact`` drops them (string values only: a counter keeps its
    number)."""
    from ocache import admin

    stats = {"layer": {"tier_disk": {"store": {"by_folder": [{"folder": "/home/u/secret-proj", "client": "opencode",
                                                              "entries": 2}]}},
                       "slots": [{"owner": "ses_1", "tokens": 9}], "path": 3},
             "journal": [{"folder": "/home/u/secret-proj", "seen": 1.0}], "cache_dir": "/home/u/.cache/ocache",
             "upstream": {"props": {"model_path": "/home/u/models/m.gguf"}}}
    out = json.dumps(admin.redact(stats))
    assert "/home/u" not in out and "ses_1" not in out
    assert '"entries": 2' in out and '"tokens": 9' in out and '"path": 3' in out
