"""``ocache.background.Background``: background work under a named owner, each task named by what it
does, so that a stop and the stats see what is pending. No server needed."""

from __future__ import annotations

import asyncio

from ocache.background import Background


async def test_pending_by_name_and_join_waits_for_work_spawned_meanwhile():
    bg = Background("layer")
    gate = asyncio.Event()
    done: list[str] = []

    async def work(what: str) -> None:
        await gate.wait()
        done.append(what)
        if what == "reconcile":
            bg.spawn(asyncio.sleep(0), "origin")   # spawned while join waits: joined too

    async def fails() -> None:
        raise RuntimeError("its own business")

    t = bg.spawn(work("reconcile"), "reconcile")
    bg.spawn(work("commit"), "commit")
    bg.spawn(fails(), "commit")
    assert t.get_name() == "layer:reconcile"
    assert bg.pending() == {"reconcile": 1, "commit": 2} and len(bg) == 3 and bg
    await bg.wait(0.01)                      # bounded: the gated tasks are still pending
    assert bg.pending() == {"reconcile": 1, "commit": 1}
    gate.set()
    await bg.join()
    assert not bg and bg.pending() == {} and sorted(done) == ["commit", "reconcile"]
