"""No file-system path in ``GET /v1/cache/stats`` or ``GET /ocache/api/view`` without the admin token
(``admin.redact`` with ``AdminRoutes.private_paths``): the state directory reads ``<state>``, the
slot folder ``<slots>``, any other absolute path ``<path>``; with the token, the full text.

Before, the view's ``events[].message`` (the ``ocache`` log lines, ``dashboard.install_event_log``)
named the state folder, and the stats' ``tiers_off`` / ``setup_warnings`` the slot folder, to anyone
who could reach the port.

The first test needs no server: the layer reports the findings the real checks make for a
``--slot-save-path`` that is not a directory here, and the events are log lines in the formats
ocache's modules write. The second runs ocache in front of the real tiny server."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from ocache import admin, dashboard
from ocache.config import Config
from ocache.layer import NullLayer
from ocache.llama.checks import check, tiers_off
from ocache.llama.flags import params_from_argv
from ocache.proxy import RUNNER_KWARGS, Proxy

TOKEN = "paths-token"


def _routes_json(body: dict) -> str:
    return json.dumps(body)


async def _get(s: aiohttp.ClientSession, url: str, token: str | None) -> dict:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with s.get(url, headers=headers) as r:
        assert r.status == 200, await r.text()
        return await r.json()


def test_scrub_text_keeps_routes_and_rates_and_hides_folders():
    known = [("/srv/oc/state", "<state>"), ("/srv/oc/state/slots", "<slots>")]
    got = admin.redact({"m": "store /srv/oc/state/store: 2 entries; restore '/srv/oc/state/slots/oc-1.bin' "
                             "failed; POST /v1/chat/completions at http://127.0.0.1:8080/v1, 300 tokens/s; "
                             "warm /home/me/proj failed; (a) / (b); /slots/0?action=save",
                        "/home/me/proj": 1}, known)
    assert got == {"m": "store <state>/store: 2 entries; restore '<slots>/oc-1.bin' failed; POST "
                        "/v1/chat/completions at http://127.0.0.1:8080/v1, 300 tokens/s; warm <path> "
                        "failed; (a) / (b); /slots/0?action=save", "<path>": 1}, got


async def test_stats_and_view_hold_no_path_without_the_token(tmp_path, caplog):
    state, slots = tmp_path / "state", tmp_path / "slot-files"     # slots: not a directory here
    argv = ["-np", "2", "--slot-save-path", str(slots), "--metrics", "-fa", "on", "--cache-ram", "0"]
    findings = check(params_from_argv(argv, {}, None, checkpoints=False), {"build_info": "b1+ocache.x"},
                     None, argv=argv, slot_actions_ok=True)

    class Layer(NullLayer):
        def stats(self) -> dict:   # what ocache/cache/report.py shows of these findings
            return {"layer": "ocache", "setup_warnings": [str(f) for f in findings if f.level != "ok"],
                    "tiers_off": [t.__dict__ for t in tiers_off(findings)], "tiers_checked": True}

    config = Config(upstream="http://127.0.0.1:9", cache_dir=str(state), admin_token=TOKEN,
                    tiers={"resident": {"server_args": argv}})
    proxy = Proxy(config, layer_factory=Layer, monitor=False)
    server = TestServer(proxy.make_app(), host="127.0.0.1")
    await server.start_server(**RUNNER_KWARGS)
    dashboard.install_event_log()
    caplog.set_level(logging.INFO, logger="ocache")   # as `ocache serve` logs: INFO lines are events
    # log lines in the formats of ocache/tiers/store.py, ocache/tiers/spill.py and ocache/warm.py
    logging.getLogger("ocache.tiers.store").info("store %s: %s", state / "store", {"entries": 2})
    logging.getLogger("ocache.tiers.spill").warning(
        "session: slot %d file unreadable: %s", 0,
        FileNotFoundError(2, "No such file or directory", str(slots / "oc-0.bin")))
    logging.getLogger("ocache.warm").warning("warm %s failed: %s", "/home/someone/project", "no slot")
    base = f"http://127.0.0.1:{server.port}"
    try:
        async with aiohttp.ClientSession() as s:
            full_stats = await _get(s, base + "/v1/cache/stats", TOKEN)
            full_view = await _get(s, base + "/ocache/api/view", TOKEN)
            anon_stats = await _get(s, base + "/v1/cache/stats", None)
            anon_view = await _get(s, base + "/ocache/api/view", None)
            wrong_view = await _get(s, base + "/ocache/api/view", "wrong")
    finally:
        await server.close()
    # the paths are there to hide: the admin sees them
    assert str(slots) in _routes_json(full_stats), full_stats["layer"]
    assert str(state) in _routes_json(full_view) and "/home/someone/project" in _routes_json(full_view)
    for body in (anon_stats, anon_view, wrong_view):
        text = _routes_json(body)
        for secret in (str(state), str(slots), str(tmp_path), "/home/someone"):
            assert secret not in text, (secret, text)
    msgs = [e["message"] for e in anon_view["events"]]
    assert any(m.startswith("store <state>/store: ") for m in msgs), msgs
    assert any("<slots>/oc-0.bin" in m for m in msgs) and any(m.startswith("warm <path> failed") for m in msgs)
    assert any("<slots>" in w for w in anon_stats["layer"]["setup_warnings"]), anon_stats["layer"]
    assert "paths hidden" in anon_stats["redacted"]


@pytest.mark.server
async def test_no_path_in_the_routes_of_a_real_ocache(start_server, tmp_path, caplog):
    """ocache in front of the real tiny server, its slot folder known (``server_args``), after an
    opencode turn and its follow-up (anchors written, the store opened: log lines that name the
    state folder): neither route names the state or slot folder without the token."""
    from test_hardening_cache import A1, A2, body_of, hdrs, send, through_ocache

    srv = start_server("dense", n_parallel=2, ctx_size=2 * 8192)
    state = tmp_path / "state"
    config = Config(upstream=srv.url, cache_dir=str(state), admin_token=TOKEN, disk_min_tokens=1024,
                    tiers={"resident": {"server_args": srv.command()[1:]}})
    dashboard.install_event_log()
    caplog.set_level(logging.INFO, logger="ocache")   # as `ocache serve` logs: INFO lines are events
    async with through_ocache(config) as (base, proxy), aiohttp.ClientSession() as s:
        for name in (A1, A2):
            await send(s, base, proxy, body_of(name), hdrs(name))
        full = _routes_json(await _get(s, base + "/v1/cache/stats", TOKEN)) + \
            _routes_json(await _get(s, base + "/ocache/api/view", TOKEN))
        anon = [await _get(s, base + "/v1/cache/stats", None), await _get(s, base + "/ocache/api/view", None)]
    slots = Path(srv.slot_save_path)
    assert str(state) in full or str(slots) in full, "nothing to hide: the test shows nothing"
    for body in anon:
        text = _routes_json(body)
        for secret in (str(state), str(slots), str(tmp_path)):
            assert secret not in text, (secret, text)
