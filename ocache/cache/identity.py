"""The server's identity for the cache layer: computed once per epoch, and again once the model
file's digest is known (``docs/architecture.md`` §3, "what makes a state reusable besides tokens").

While the model file's version was never digested the identity is provisional
(``GGUFIdentity.pending``: keyed by that version's ``os.stat``, so nothing stored under it is
served for other bytes); :meth:`IdentityKeeper.digest_first` takes the digest inline for a small
file and in the background for a large one, then hands the new key to the layer's stores.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from ocache.cache import wiring
from ocache.fingerprint import Identity
from ocache.llama import gguf as llama_gguf

log = logging.getLogger("ocache.cache")


class IdentityKeeper:
    """The layer's ``Identity`` (``wiring.server_identity``). ``props_of``: the upstream's current
    ``/props`` (a mapping or None); ``argv_of``: the launch flags in force; ``lock``: the layer's
    ready lock (a background digest switches the identity under it); ``on_digested(key)``: hands
    a digested identity's key to the stores (called under ``lock``)."""

    def __init__(self, props_of: Callable[[], Any], argv_of: Callable[[], list[str] | None],
                 lock: asyncio.Lock, on_digested: Callable[[str], None]) -> None:
        self._props_of = props_of
        self._argv_of = argv_of
        self._lock = lock
        self._on_digested = on_digested
        self._identity: Identity | None = None
        #: the model file's full digest being taken in the background (``_take_digest``; None: none
        #: yet), and the file versions logged
        self.digest_task: asyncio.Task | None = None
        self._logged: set[tuple] = set()

    def current(self) -> Identity:
        """The identity, computed when first asked after :meth:`forget`."""
        if self._identity is None:
            self._identity = wiring.server_identity(self._props_of(), self._argv_of())
        return self._identity

    def forget(self) -> None:
        """A new epoch (or a digest now known): the next :meth:`current` computes it again."""
        self._identity = None

    def _pending(self) -> Any:
        return (self.current().fields.get("gguf") or {}).get("pending")

    async def digest_first(self) -> None:
        """When the identity is provisional, take the model file's XXH3-128 (``gguf.ensure_digest``,
        a worker thread): awaited here for a file of at most ``gguf.DIGEST_INLINE_BYTES`` (under a
        second once per file version), else in the background (``_take_digest``, logged once per
        file version) while requests are served under the provisional identity."""
        pending = self._pending()
        path = (self._props_of() or {}).get("model_path")
        if not pending or not path:
            return
        if pending[2] <= llama_gguf.DIGEST_INLINE_BYTES:
            try:
                await llama_gguf.ensure_digest(path)
            except OSError as exc:
                log.warning("model file %s not digested (%s): entries stay under its provisional identity",
                            path, exc)
                return
            self.forget()
            pending = self._pending()
            if not pending:
                return
        if self.digest_task is not None and not self.digest_task.done():
            return
        if tuple(pending) not in self._logged:
            self._logged.add(tuple(pending))
            log.info("model file %s (%.2f GB) not digested before: its XXH3-128 is taken in the background; "
                     "until then entries are stored and served only for this version of the file (its "
                     "device, inode, size, mtime and ctime)", path, pending[2] / 1e9)
        self.digest_task = asyncio.get_running_loop().create_task(self._take_digest(path, list(pending)))

    async def _take_digest(self, path: str, pending: list) -> None:
        """The digest of ``path`` (``gguf.ensure_digest``), then the identity computed again and
        handed to ``on_digested``, if the server still serves that file version."""
        t0 = time.monotonic()
        try:
            await llama_gguf.ensure_digest(path)
        except OSError as exc:
            log.warning("model file %s not digested (%s): entries stay under its provisional identity", path, exc)
            return
        async with self._lock:
            cur = self._identity
            if cur is None or (cur.fields.get("gguf") or {}).get("pending") != pending:
                return
            self.forget()
            new = self.current()
            self._on_digested(new.key)
            log.info("model file %s digested in %.1f s: identity %s -> %s", path, time.monotonic() - t0,
                     cur.key, new.key)
