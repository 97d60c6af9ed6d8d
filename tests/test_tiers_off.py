"""Which tiers are off, said everywhere: in front of a stock llama-server (its launch
flags unknown) or one whose flags turn a tier off, ``ocache serve``'s first log lines
(``commands/serve.announce_tiers``), ``ocache stats`` (``commands/top.summary_lines``), the
dashboard's view (its top box) and ``ocache doctor --upstream URL`` each name the tiers that are
off, why, and the one-line fix. In front of the patched server (it reports its flags, patches/0009)
with no ``ocache.yaml``, every tier is on.

Before this, a stock server that saves slots got ``[ok] --slot-save-path`` from doctor, ``ocache
stats`` said nothing, and the log said it once, at the first request."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import aiohttp
import pytest

from ocache.commands import top
from ocache.commands.serve import announce_tiers
from ocache.config import Config
from ocache.llama.checks import TierOff, check, tiers_off, tiers_off_lines
from ocache.llama.flags import params_from_argv

from test_hardening_cache import A1, SERVER, body_of, hdrs, send, through_ocache


def test_a_server_that_saves_slots_without_saying_where_turns_the_file_tiers_off():
    """The stock server queried without its command line: slot actions work (the probe), but the
    folder is unknown, so the disk, session and head tiers cannot work (today's code: ``ok``)."""
    params = params_from_argv(None, {"total_slots": 2}, None)
    found = check(params, {"build_info": "b1-0c1e570"}, [{"id": 0}, {"id": 1}], argv=None,
                  metrics_ok=True, slot_actions_ok=True)
    ssp = next(f for f in found if f.flag == "--slot-save-path")
    assert ssp.level == "warning" and ssp.off == ("disk", "session", "head"), ssp
    off = tiers_off(found)
    assert [t.tier for t in off] == ["head", "disk", "session"]
    lines = tiers_off_lines(off)
    assert len(lines) == 1 and lines[0].startswith("tiers OFF: head, disk and session (--slot-save-path: ")
    assert "Fix: run the patched llama-server (`ocache engine build`" in lines[0]


def test_a_stock_server_without_its_flags_gets_one_fix_everywhere(caplog):
    """In front of a stock server with no flags given, every ``unknown`` line, the "tiers OFF"
    line and the disk and session tiers' own "off" log lines give the same fix, ``FLAGS_FIX``
    (``ocache serve --upstream URL -- ARGS``, which ``serve`` accepts: tests/test_config.py).
    Before, the log said three things: set ``tiers.resident.server_args``, set
    ``tiers.disk.slot_save_path``, and "pass the command line after `--`", which ``serve`` refused."""
    from ocache.config import Config
    from ocache.llama.checks import FLAGS_FIX
    from ocache.tiers.disk import make_disk_tier
    from ocache.tiers.spill import make_session_tier

    params = params_from_argv(None, {"total_slots": 2}, None, checkpoints=True, arch="qwen35")
    found = check(params, {"build_info": "b1-0c1e570"}, [{"id": 0}, {"id": 1}], argv=None,
                  metrics_ok=True, slot_actions_ok=True)
    unknown = [f for f in found if f.level == "unknown"]
    assert len(unknown) == 6 and all(f.message.endswith(FLAGS_FIX) for f in unknown), unknown
    (line,) = tiers_off_lines(tiers_off(found))
    assert line.endswith(f"or {FLAGS_FIX}"), line
    caplog.set_level("INFO")
    table = type("T", (), {"params": params})()
    assert make_disk_tier(Config(), table, "key") is None and make_session_tier(Config(), table, "key") is None
    off = [r.getMessage() for r in caplog.records if "tier off" in r.getMessage()]
    assert len(off) == 2 and all(FLAGS_FIX in m for m in off), off
    assert FLAGS_FIX.count("`ocache serve --upstream URL -- ARGS`") == 1


def test_each_flag_that_turns_a_tier_off_says_which_and_the_fix(tmp_path):
    argv = ["-m", "x.gguf"]             # no -np, no --slot-save-path
    p = params_from_argv(argv, {}, None, checkpoints=True, arch="qwen35", ctx_checkpoints=0)
    off = {t.tier: t for t in tiers_off(check(p, {}, None, argv=argv, slot_actions_ok=False))}
    assert set(off) == {"resident", "head", "disk", "session"}
    assert off["resident"].fix == "restart llama-server with -np 2"
    assert "--slot-save-path DIR" in off["disk"].fix
    argv = ["-np", "2", "--slot-save-path", str(tmp_path), "--metrics", "-fa", "on", "--cache-ram", "0",
            "--checkpoint-min-step", "1024"]
    p = params_from_argv(argv, {}, None, checkpoints=True, arch="qwen35")
    assert tiers_off(check(p, {"build_info": "b1+ocache.x"}, None, argv=argv, slot_actions_ok=True)) == []
    assert tiers_off_lines([]) [0].startswith("tiers: all on")
    # the stats carry TierOff as a dict: the same lines
    t = TierOff("disk", "why", "fix it")
    assert tiers_off_lines([t.__dict__]) == tiers_off_lines([t]) == ["tiers OFF: disk (why). Fix: fix it"]


@pytest.mark.server
@pytest.mark.parametrize("stock", [True, False])
async def test_serve_log_stats_and_dashboard_say_which_tiers_are_off(start_server, tmp_path, stock):
    """``ocache serve --upstream URL``, no YAML: the stock server gets one "tiers OFF" line for
    the disk, session and head tiers in the log at start (before any request), the same line in
    ``ocache stats`` under its header and in the dashboard view; the patched server: all on."""
    srv = start_server("dense", stock=stock, n_parallel=2, ctx_size=2 * 8192, **SERVER)
    config = Config(upstream=srv.url, cache_dir=str(tmp_path / "state"))
    async with through_ocache(config) as (base, proxy), aiohttp.ClientSession() as s:
        logged = await asyncio.wait_for(announce_tiers(proxy, wait_s=30), 60)
        v = await asyncio.to_thread(top.fetch_view, base, None)
        lines = top.summary_lines(v, base)
        if stock:
            assert len(logged) == 1 and logged[0].startswith("tiers OFF: head, disk and session"), logged
            assert v["tiers_off_lines"] == logged
            assert {t["tier"] for t in v["tiers_off"]} == {"head", "disk", "session"}
        else:
            assert logged == [tiers_off_lines([])[0]], logged
            assert v["tiers_off_lines"] == [] and v["tiers_checked"] is True
        assert lines[1] == (logged[0] if stock else "tiers: all on (resident, head, disk, session)"), lines
        await send(s, base, proxy, body_of(A1), hdrs(A1))   # serving does not change the answer
        v = await asyncio.to_thread(top.fetch_view, base, None)
        assert v["tiers_off_lines"] == (logged if stock else [])


def _doctor(url: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ocache", "doctor", "--upstream", url, *extra],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.server
def test_doctor_reads_the_patched_servers_flags_and_leads_with_the_tiers_off(start_server, tmp_path):
    """``ocache doctor --upstream URL`` with no command line: the stock server's first line names
    the tiers off (today: ``[ok] --slot-save-path``); the patched server reports its flags
    (``/props`` ``ocache.launch``), so nothing is ``unknown`` and every tier is on."""
    stock = start_server("dense", stock=True, n_parallel=2, ctx_size=2 * 8192, **SERVER)
    p = _doctor(stock.url)
    first = p.stdout.splitlines()[0]
    assert first.startswith("tiers OFF: head, disk and session (--slot-save-path: "), p.stdout
    assert "[warning] --slot-save-path" in p.stdout and "flags unknown" in p.stdout
    # a script can use it as a check: exit 1, and the last line says why
    assert p.returncode == 1, p.stdout + p.stderr
    assert p.stdout.splitlines()[-1] == "doctor: FAIL (tiers off: head, disk, session): exit 1", p.stdout
    patched = start_server("dense", n_parallel=2, ctx_size=2 * 8192, metrics=True, **SERVER)
    p = _doctor(patched.url, "--json")
    out = json.loads(p.stdout)
    assert out["info"]["flags"] == "server (/props ocache.launch)" and out["tiers_off"] == [], out
    levels = {f["flag"]: f["level"] for f in out["findings"]}
    assert "unknown" not in levels.values() and levels["--slot-save-path"] == "ok", levels
    assert p.returncode == 0 and out["ok"] is True, p.stdout


async def test_tiers_off_for_a_stock_server_are_built_for_the_patched_one_that_replaces_it(tmp_path):
    """``BuiltTiers.ready`` runs for each server process. A stock server reports no slot-save
    folder, so the disk and session tiers are off; the patched server that replaces it under the
    same ocache reports one, and they are built then (they stayed off until ocache restarted: the
    store was never opened and a restart after that was cold)."""
    from types import SimpleNamespace

    from ocache.cache.wiring import BuiltTiers
    from ocache.config import Config

    def table(save):
        return SimpleNamespace(params=SimpleNamespace(slot_save_path=str(save) if save else None, n_ubatch=512))

    tiers: list = []
    built = BuiltTiers(tiers)
    config = Config(cache_dir=str(tmp_path / "state"))
    kw = dict(no_save=False, prefill_tps_of=lambda: None, upstream=SimpleNamespace(generating=0))
    await built.ready(config, table(None), lambda: "ident-stock", **kw)          # the stock server
    assert built.disk is None and built.session is None and tiers == []
    save = tmp_path / "slots"
    save.mkdir()
    await built.ready(config, table(save), lambda: "ident-patched", **kw)        # the patched one
    assert built.disk is not None and built.session is not None
    assert sorted(t.name for t in tiers) == ["disk", "session"]
    await built.ready(config, table(save), lambda: "ident-patched", **kw)        # built once
    assert sorted(t.name for t in tiers) == ["disk", "session"]
