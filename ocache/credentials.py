"""Whether llama-server accepts a request's credentials, asked before ocache plans anything for it.

A server started with ``--api-key`` answers 401 to a request without one of its keys, and does
nothing else for it. ocache plans a completion before forwarding it (a slot leased, a prefix
restored, another conversation spilled to make room), so without this check a client the server
refuses would still make ocache work on the server's slots, and ocache's plan would tell it what
they hold. With ``upstream_api_key`` configured (ocache's sign that the server checks keys), each
request's credentials are checked once per server process, then remembered; a request whose
credentials the server refuses is forwarded unplanned and gets the server's own 401.

The check costs the server no work: llama-server validates the key in its pre-routing handler,
before any route (tools/server/server-http.cpp, ``middleware_validate_api_key`` in
``set_pre_routing_handler``: ``Authorization``, else ``X-Api-Key``, a ``Bearer `` prefix removed),
so ``GET`` of a path no route serves answers 401 for a refused key and 404 for an accepted one
(any answer below 500 but 401 and 403 has passed the check).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from typing import Mapping

import aiohttp

log = logging.getLogger("ocache.proxy")

#: a path no llama-server route serves (the answer is 404 once the key is accepted)
CHECK_PATH = "/ocache-credentials-check"
#: the request headers llama-server reads a key from (server-http.cpp, as above)
KEY_HEADERS = ("Authorization", "X-Api-Key")
#: credentials remembered per server process (least recently used out)
MAX_REMEMBERED = 256
#: seconds the check may take; past it the request is forwarded unplanned (the server judges it)
CHECK_TIMEOUT_S = 5.0


class CredentialCheck:
    """The verdicts of one proxy's checks, keyed by the server's URL and process (``epoch``) and a
    SHA-256 of the key headers (the keys themselves are not kept). ``counters``: ``checks``
    (questions asked), ``refused`` (requests refused), ``failed`` (checks without an answer)."""

    def __init__(self) -> None:
        self._seen: OrderedDict[tuple[str, int, str], bool] = OrderedDict()
        self.counters = {"checks": 0, "refused": 0, "failed": 0}

    async def accepted(self, session: aiohttp.ClientSession, base_url: str, epoch: int,
                       headers: Mapping[str, str]) -> bool:
        """Whether the server at ``base_url`` (process ``epoch``) accepts the credentials in
        ``headers``; False also when the check got no answer it can read (the request then goes
        unplanned, as the server alone would see it). Never raises but CancelledError."""
        sent = {h: headers[h] for h in KEY_HEADERS if headers.get(h)}
        digest = hashlib.sha256("\0".join(f"{h}:{v}" for h, v in sent.items()).encode("utf-8", "surrogatepass")).hexdigest()
        key = (base_url, epoch, digest)
        verdict = self._seen.get(key)
        if verdict is None:
            verdict = await self._ask(session, base_url, sent)
            if verdict is None:
                self.counters["failed"] += 1
                return False
            self._seen[key] = verdict
            while len(self._seen) > MAX_REMEMBERED:
                self._seen.popitem(last=False)
        else:
            self._seen.move_to_end(key)
        if not verdict:
            self.counters["refused"] += 1
        return verdict

    async def _ask(self, session: aiohttp.ClientSession, base_url: str, sent: dict[str, str]) -> bool | None:
        self.counters["checks"] += 1
        try:
            async with session.get(base_url + CHECK_PATH, headers=sent,
                                   timeout=aiohttp.ClientTimeout(total=CHECK_TIMEOUT_S)) as r:
                status = r.status
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            log.warning("the server's key check got no answer (%s): the request goes unplanned", exc)
            return None
        if status in (401, 403):
            return False
        if status >= 500:   # loading (503), or failing: no verdict
            log.warning("the server's key check answered %s: the request goes unplanned", status)
            return None
        return True   # past the key check (404: no such route, as expected)
