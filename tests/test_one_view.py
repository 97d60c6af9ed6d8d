"""One token view and one lookup per tier per request, also with several servers behind the router
(``ocache/cache/prepare.py``: the prepared request is shared by the router's estimates and the
chosen server's plan; ``ocache/cache/core.py``: the estimate's lookup answers are the plan's).

Real parts: two patched llama-servers on the tiny dense model behind one in-process ocache (the
Router over one OCacheLayer per server, as ``tests/test_router.py``), real opencode request bodies.
The calls are counted by wrapping each server's ``TokenViewer.view`` and each tier's ``lookup``.
"""

from __future__ import annotations

from collections import Counter

import aiohttp
import pytest

from test_router import A1, A2, B1, body, router_config, send, through_router, two_servers
from test_spill import session_headers


def _count(obj, name: str, counts: Counter, key) -> None:
    """Wrap the coroutine method ``obj.name`` so that each call adds one to ``counts[key]``."""
    real = getattr(obj, name)

    async def counted(*args, **kwargs):
        counts[key] += 1
        return await real(*args, **kwargs)

    setattr(obj, name, counted)


@pytest.mark.server
async def test_a_routed_request_costs_one_token_view_and_one_lookup_per_tier(start_server, tmp_path):
    """Three requests estimated on both servers (a first turn, its next turn before the template
    is known append-only, another folder's first turn): for each, the two servers' layers together
    build exactly one token view, and every tier of either server is asked exactly once (the
    chosen server's plan reuses its estimate's answers). Before the shared prepared request, each
    estimate built its own view and the chosen server's plan a third, and asked its tiers again."""
    servers = two_servers(start_server)
    async with through_router(router_config(servers, tmp_path / "cache")) as (base, proxy), \
            aiohttp.ClientSession() as s:
        views: Counter = Counter()
        lookups: Counter = Counter()
        tiers = []
        for srv in proxy.layer.servers:
            layer = srv.layer
            await layer.ensure_ready()
            _count(layer.viewer, "view", views, srv.index)
            for tier in (layer.head_tier, *layer.tiers):
                _count(tier, "lookup", lookups, (srv.index, tier.name))
                tiers.append((srv.index, tier.name))
        assert {name for _, name in tiers} >= {"head", "disk"}, tiers
        first = body(A1)
        for name, b, h in (("first turn", first, session_headers(A1)),
                           ("next turn", body(A2), session_headers(A1)),
                           ("other folder", body(B1), session_headers(B1))):
            views.clear()
            lookups.clear()
            rec = await send(s, base, proxy, b, h)
            assert rec["route"].startswith("prefix"), (name, rec["route"])   # both servers estimated
            assert sum(views.values()) == 1, (name, dict(views))
            assert {k: lookups[k] for k in tiers} == {k: 1 for k in tiers}, (name, dict(lookups))
