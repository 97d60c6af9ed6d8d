"""Background work, owned: every task ocache runs off a request's path is spawned through a
:class:`Background` of the component that owns it (the proxy, the cache layer, the router, each
tier), under a name that says what it does (``reconcile``, ``origin``, ``commit``...), so that a
stop (``stopping.quiesce``, ``Lifecycle.drain``), ``flush`` and the stats see what is pending.

A task's exception is the task's own business (each logs its own); :meth:`Background.join`
returns only when none is pending, including tasks spawned while it waits.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from typing import Any, Coroutine


async def cancel_and_wait(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` and wait until it has ended; its ``CancelledError`` stops here."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


class Background:
    """The pending background tasks of one ``owner`` (a name: ``proxy``, ``layer``, ``router``,
    ``head``, ``disk``, ``session``). A task is named ``owner:what`` (``asyncio.Task.get_name``)."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], what: str) -> asyncio.Task[Any]:
        """Run ``coro`` as a task named ``owner:what``; it is pending until it ends."""
        task = asyncio.get_running_loop().create_task(coro, name=f"{self.owner}:{what}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    @property
    def tasks(self) -> set[asyncio.Task[Any]]:
        """The pending tasks (a copy)."""
        return set(self._tasks)

    def __len__(self) -> int:
        return len(self._tasks)

    def __bool__(self) -> bool:
        return bool(self._tasks)

    def pending(self) -> dict[str, int]:
        """How many tasks are pending, by what they do (``what`` of :meth:`spawn`)."""
        return dict(Counter(t.get_name().split(":", 1)[-1] for t in self._tasks))

    async def join(self) -> None:
        """Wait until no task is pending (those spawned meanwhile too); never raises what a task
        raised."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def wait(self, timeout_s: float) -> None:
        """Wait for the tasks pending now, at most ``timeout_s`` seconds; never raises what a task
        raised."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=max(0.0, timeout_s))
