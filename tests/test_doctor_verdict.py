"""``ocache doctor`` as a check a script can use (``ocache.llama.checks.verdict``): exit 1 when a
tier is off or a flag is an error, said in the last line; exit 0 and "every tier can work"
otherwise. And the ``--checkpoint-min-step`` it asks for is the README's (``CHECKPOINT_MIN_STEP``).

Before: doctor printed ``tiers OFF: head, disk and session`` and exited 0, and asked for
``--checkpoint-min-step`` <= 4096 where the README's command lines give 1024.

No server: the findings of a stock server are built as ``probe`` builds them, and the CLI runs
``--offline`` on a command line (the model file need not exist: its architecture is then unknown).
The real stock server is in ``tests/test_tiers_off.py``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from ocache.llama.checks import CHECKPOINT_MIN_STEP, check, verdict
from ocache.llama.flags import params_from_argv

README = Path(__file__).resolve().parents[1] / "README.md"


def _doctor(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ocache", "doctor", *args], capture_output=True,
                          text=True, timeout=120, cwd=cwd)


def test_a_stock_server_without_its_flags_fails_and_says_which_tiers_are_off():
    """The findings ``probe`` makes of a stock server queried without its command line (slot
    actions work, the folder is unknown): the file tiers are off, so the verdict is 1."""
    params = params_from_argv(None, {"total_slots": 2}, None)
    found = check(params, {"build_info": "b1-0c1e570"}, [{"id": 0}, {"id": 1}], argv=None,
                  metrics_ok=True, slot_actions_ok=True)
    assert not any(f.level == "error" for f in found)   # only a tier off: the old code exited 0
    code, line = verdict(found)
    assert code == 1 and line == "doctor: FAIL (tiers off: head, disk, session): exit 1", line
    # a flag in error fails too, and both reasons are named
    argv = ["-m", "x.gguf"]
    p = params_from_argv(argv, {}, None, checkpoints=True, arch="qwen35")
    code, line = verdict(check(p, {"build_info": "b1"}, None, argv=argv, slot_actions_ok=False))
    assert code == 1 and "tiers off: resident, head, disk, session" in line and "errors: -np" in line, line
    # a failed remote store check fails a setup that is otherwise right
    assert verdict([], remote_ok=False)[0] == 1 and "store.remote" in verdict([], remote_ok=False)[1]


def test_a_well_set_server_passes_with_its_warnings_counted(tmp_path):
    argv = ["-np", "2", "--slot-save-path", str(tmp_path), "--metrics", "-fa", "on", "--cache-ram", "0",
            "--checkpoint-min-step", str(CHECKPOINT_MIN_STEP)]
    p = params_from_argv(argv, {}, None, checkpoints=True, arch="qwen35")
    found = check(p, {"build_info": "b1+ocache.x"}, None, argv=argv, slot_actions_ok=True)
    assert verdict(found) == (0, "doctor: OK: every tier can work, no error")
    p = params_from_argv(argv[:-2], {}, None, checkpoints=True, arch="qwen35")   # min step: stock 8192
    found = check(p, {"build_info": "b1"}, None, argv=argv[:-2], slot_actions_ok=True)
    code, line = verdict(found)
    assert code == 0 and line.endswith("(2 warnings, none turns a tier off)"), line


def test_the_cli_exits_1_on_a_tier_off_and_says_so_last(tmp_path):
    """``-np 2`` but no ``--slot-save-path``: no flag is an error, but the disk, session and head
    tiers are off. The old code exited 0 here."""
    p = _doctor("--offline", "--", "-m", str(tmp_path / "x.gguf"), "-np", "2", cwd=tmp_path)
    assert p.returncode == 1, p.stdout + p.stderr
    assert p.stdout.splitlines()[0].startswith("tiers OFF: head, disk and session"), p.stdout
    assert p.stdout.splitlines()[-1] == "doctor: FAIL (tiers off: head, disk, session): exit 1", p.stdout
    j = _doctor("--offline", "--json", "--", "-m", str(tmp_path / "x.gguf"), "-np", "2", cwd=tmp_path)
    out = json.loads(j.stdout)
    assert j.returncode == 1 and out["ok"] is False and out["verdict"].startswith("doctor: FAIL"), j.stdout
    good = _doctor("--offline", "--", "-m", str(tmp_path / "x.gguf"), "-np", "2", "--slot-save-path",
                   str(tmp_path), "--metrics", "-fa", "on", "--cache-ram", "0", cwd=tmp_path)
    assert good.returncode == 0, good.stdout + good.stderr
    assert good.stdout.splitlines()[-1].startswith("doctor: OK: every tier can work"), good.stdout


def test_doctor_asks_for_the_readmes_checkpoint_min_step(tmp_path):
    """Every ``--checkpoint-min-step`` in the README's command lines is the one doctor asks for, and
    one above it gets a warning that names it."""
    given = {int(n) for n in re.findall(r'--checkpoint-min-step"?,? "?(\d+)', README.read_text())}
    assert given == {CHECKPOINT_MIN_STEP}, given
    argv = ["-np", "2", "--checkpoint-min-step", "4096"]
    p = params_from_argv(argv, {}, None, checkpoints=True, arch="qwen35")
    (f,) = [x for x in check(p, {}, None, argv=argv) if x.flag == "--checkpoint-min-step"]
    assert f.level == "warning" and f"use <= {CHECKPOINT_MIN_STEP} (the README's value" in f.message, f
