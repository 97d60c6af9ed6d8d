"""In-memory stand-ins for llama-server's slot endpoints, for tests of the cache layer's own logic
(planner, executor, observe, the tiers' wiring) that need no real server: ``pytest -m "not server"``
runs them in seconds. What only the server decides (reuse, checkpoints, slot files) stays in the
real-server tests (``tests/test_resident.py``, ``test_disk_tier.py``, ``test_spill.py``).

``FakeSlotTable`` is the real ``ocache.slots.SlotTable`` with its client's one HTTP method
(``SlotClient.request``) answered from memory (``_request``), so every verb of the table (refresh,
warm, save, restore, erase) runs its own code. The fake server holds token ids per slot, keeps slot files in a dict, and answers a forwarded
completion (:meth:`FakeSlotTable.complete`) with llama-server's ``timings`` for a dense model (reuse =
the common prefix, at most ``len(prompt) - 1``: docs/llama-server.md §11).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
import asyncio
from typing import Any, Callable, Sequence

from ocache.llama.flags import ServerParams
from ocache.llama.reuse import common_prefix
from ocache.slots import SlotTable
from ocache.tiers.base import Offer, TierBase
from ocache.tokens import TokenView


@dataclass
class FakeUpstream:
    """What ``OCacheLayer`` reads of ``ocache.upstream.Upstream``."""

    epoch: Any = 1
    props: dict = field(default_factory=dict)
    base_url: str = "http://fake-llama-server"
    session: Any = None
    api_key: str | None = None


class FakeSlotTable(SlotTable):
    """``SlotTable`` over an in-memory server of ``n_slots`` slots of ``n_ctx`` tokens each.

    ``calls``: every ``(method, path)`` the table sent, in order. ``held[slot]``: the token ids the
    fake server's slot holds. ``files``: slot files saved (name -> token ids). ``fail_restore``:
    file names whose restore the server refuses (400, the slot left untouched as with the patched
    pre-check)."""

    def __init__(self, n_slots: int = 2, n_ctx: int = 8192, params: ServerParams | None = None) -> None:
        super().__init__(None, "http://fake-llama-server",  # type: ignore[arg-type]
                         params or ServerParams(n_slots=n_slots, n_ctx_slot=n_ctx, cache_ram=0,
                                                checkpoints=False))
        self.n_slots = n_slots
        self.n_ctx = n_ctx
        self.held: list[list[int]] = [[] for _ in range(n_slots)]
        self.ran: list[bool] = [False] * n_slots
        self.id_tasks: list[int | None] = [None] * n_slots
        self.files: dict[str, list[int]] = {}
        self.fail_restore: set[str] = set()
        self.calls: list[tuple[str, str]] = []
        self._next_task = 0
        self.boots = 1
        self.client.request = self._request   # type: ignore[method-assign]  # every slot call ends here

    def _task(self, slot: int) -> None:
        self._next_task += 1
        self.id_tasks[slot] = self._next_task

    async def _request(self, method: str, path: str, *, json_body: Any = None, slot: int | None = None,
                       what: str = "slot call", meta: dict | None = None, timeout: Any = None) -> tuple[int, Any]:
        self.calls.append((method, path))
        if meta is not None:
            meta["boot"] = f"{self.boots:016x}"   # the patched build's process id (patches/0005)
        if method == "GET" and path == "/health":
            return 200, {"status": "ok"}
        if method == "GET" and path == "/slots":
            out = []
            for i in range(self.n_slots):
                e: dict[str, Any] = {"id": i, "n_ctx": self.n_ctx, "is_processing": False,
                                     "id_task": self.id_tasks[i] if self.id_tasks[i] is not None else -1}
                if self.ran[i]:
                    e["n_prompt_tokens"] = len(self.held[i])
                out.append(e)
            return 200, out
        m = re.fullmatch(r"/slots/(\d+)\?action=(\w+)", path)
        if method == "POST" and m:
            sid, action = int(m.group(1)), m.group(2)
            name = (json_body or {}).get("filename")
            if action == "save":
                self.files[name] = list(self.held[sid])
                n = len(self.held[sid])
                return 200, {"id_slot": sid, "filename": name, "n_saved": n, "n_written": 16 * n + 64,
                             "timings": {"save_ms": 1.0}}
            if action == "restore":
                if name not in self.files or name in self.fail_restore:
                    return 400, {"error": {"code": 400, "message": "Unable to restore slot, no available space",
                                           "type": "invalid_request_error"}}
                self.held[sid] = list(self.files[name])
                self.ran[sid] = False   # a restore does not set n_prompt_tokens (docs/llama-server.md §4)
                n = len(self.held[sid])
                return 200, {"id_slot": sid, "filename": name, "n_restored": n, "n_read": 16 * n + 64,
                             "timings": {"restore_ms": 1.0}}
            if action == "erase":
                n = len(self.held[sid])
                self.held[sid] = []
                self.ran[sid] = False
                return 200, {"id_slot": sid, "n_erased": n}
        if method == "POST" and path == "/completion":
            sid = int(json_body["id_slot"])
            t = self._prefill(sid, list(json_body["prompt"]))
            return 200, {"content": "", "tokens_cached": len(self.held[sid]), "timings": t}
        return 404, {"error": {"code": 404, "message": f"no fake for {method} {path}", "type": "not_found_error"}}

    def _prefill(self, slot: int, prompt: list[int], generated: int = 0) -> dict:
        """The dense model's reuse rule: the common prefix, at most ``len(prompt) - 1``."""
        cache_n = min(common_prefix(self.held[slot], prompt), max(len(prompt) - 1, 0))
        self.held[slot] = prompt + [0] * max(generated - 1, 0)
        self.ran[slot] = True
        self._task(slot)
        prompt_n = len(prompt) - cache_n
        return {"cache_n": cache_n, "prompt_n": prompt_n, "prompt_ms": float(prompt_n),
                "predicted_n": generated, "predicted_ms": float(generated)}

    def complete(self, slot: int, prompt: Sequence[int], generated: int = 1) -> dict:
        """The forwarded request pinned to ``slot``: returns its ``timings``."""
        return self._prefill(slot, list(prompt), generated)

    def restart(self) -> None:
        """A new server process: every slot empty, task ids start again."""
        self.held = [[] for _ in range(self.n_slots)]
        self.ran = [False] * self.n_slots
        self.id_tasks = [None] * self.n_slots
        self._next_task = 0
        self.boots += 1


class FakeViewer:
    """``TokenViewer.view`` for ``/completion`` bodies whose ``prompt`` is token ids; ``head_end`` and
    ``user_starts`` from the body's test-only keys ``_head_end`` / ``_user_starts``."""

    def __init__(self) -> None:
        self.views = 0

    async def view(self, path: str, body: dict, head: Any = None, keys: Any = None) -> TokenView:
        self.views += 1
        return TokenView(list(body["prompt"]), body.get("_head_end"), list(body.get("_user_starts") or []), "")


class CountingTier(TierBase):
    """A tier that offers nothing and counts its hooks (``lookups`` etc.)."""

    name = "counting"

    def __init__(self) -> None:
        self.lookups = 0
        self.admits = 0
        self.evicts: list[int] = []

    async def lookup(self, view: Any, ctx: Any) -> Offer | None:
        self.lookups += 1
        return None

    async def bring(self, offer: Offer, slot: int) -> None:
        raise AssertionError("offers nothing, never brought")

    async def admit(self, view: Any, slot: int, obs: Any) -> None:
        self.admits += 1

    async def before_evict(self, slot: int) -> None:
        self.evicts.append(slot)


def make_layer(n_slots: int = 2, n_ctx: int = 8192, tiers: Sequence[Any] = (), config: Any = None,
               viewer: Any = None) -> Any:
    """An ``OCacheLayer`` over a :class:`FakeSlotTable` (``layer.table``) and ``viewer`` (default a
    :class:`FakeViewer`)."""
    from ocache.cache import OCacheLayer

    layer = OCacheLayer(FakeUpstream(), config, viewer=viewer or FakeViewer(), tiers=list(tiers),
                        table=FakeSlotTable(n_slots, n_ctx))
    layer.param_overrides = {**layer.param_overrides, "cache_ram": 0, "checkpoints": False}
    return layer


def request(tokens: Sequence[int], rid: str = "r", session: str | None = None, **extra: Any) -> Any:
    """A ``ParsedRequest`` for ``POST /completion`` with token ids as its prompt."""
    from ocache.layer import ParsedRequest

    return ParsedRequest(rid, "POST", "/completion", {"prompt": list(tokens), **extra}, {}, session, False)


async def serve(layer: Any, req: Any, generated: int = 1) -> tuple[Any, dict]:
    """Plan ``req``, run the forwarded request on the fake server, release, observe. Returns the
    plan and the timings."""
    from ocache.layer import Observation

    plan = await layer.plan(req)
    slot = plan.body_updates["id_slot"]
    timings = layer.table.complete(slot, req.body["prompt"], generated)
    if plan.release is not None:
        await plan.release()
    await layer.observe(req, plan, Observation(200, True, timings))
    return plan, timings


async def until(cond: Callable[[], object], what: str, bound: int = 10_000) -> None:
    """Yield to the event loop until ``cond()`` holds (bounded by a number of loop turns, not
    seconds: no timing on a loaded machine); AssertionError naming ``what`` when it never does."""
    for _ in range(bound):
        if cond():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never happened: {what}")


async def cold_chat(url: str, body: dict) -> dict:
    """The real server's own answer to a chat ``body`` without any cache: a cold prefill in slot 0
    (``cache_prompt: false``), asserted 200 with ``cache_n`` 0; the reference an exactness check
    compares a cached answer with."""
    import aiohttp

    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/chat/completions", json=dict(body, cache_prompt=False, id_slot=0)) as r:
            data = await r.json()
            assert r.status == 200, data
    assert data["timings"]["cache_n"] == 0
    return data
