"""The fleet simulation (``ocache/bench/fleet.py``, ``scripts/sim-fleet``) on 3 hosts in 2 worker
processes against a real SeaweedFS on loopback (``s3_bucket``, tests/conftest.py), and the S3
client's request counters it reads. No llama-server."""

from __future__ import annotations

from ocache.bench.fleet import FleetConfig, run, schedule, split_hosts
from ocache.tiers.remote import RemoteSettings


async def test_the_client_counts_each_request_by_kind(s3_bucket):
    async with RemoteSettings(**s3_bucket).objects() as o:
        assert await o.put("records/a.json", b"x", create_only=True)
        assert not await o.put("records/a.json", b"y", create_only=True)      # refused: still a request
        assert await o.get("records/a.json") == b"x"
        assert await o.get("records/none.json") is None
        assert (await o.head("records/a.json")).size == 1
        assert [x.key for x in await o.list("records/")] == ["records/a.json"]
        await o.delete("records/a.json")
        assert dict(o.requests) == {"PUT": 2, "GET": 2, "HEAD": 1, "LIST": 1, "DELETE": 1}


def test_the_day_is_a_function_of_the_seed():
    cfg = FleetConfig(hosts=3, seed=5, sessions=8)
    a = [(t, what, s.sid if s else None) for t, what, s in schedule(cfg, 2)]
    b = [(t, what, s.sid if s else None) for t, what, s in schedule(cfg, 2)]
    assert a == b and a and all(0 <= t < cfg.day_s for t, _, _ in a)
    assert [(t, w) for t, w, _ in a] != [(t, w) for t, w, _ in schedule(FleetConfig(hosts=3, seed=6, sessions=8), 2)]
    first = next(s for _, what, s in schedule(cfg, 2) if what == "turn")
    again = next(s for _, what, s in schedule(cfg, 2) if what == "turn")
    assert first.next_prompt() == again.next_prompt()          # the same tokens, turn by turn
    assert first.next_prompt() == again.next_prompt()
    assert split_hosts(5, 2) == [[0, 2, 4], [1, 3]] and split_hosts(2, 4) == [[0], [1]]


def test_three_hosts_look_up_by_key_and_find_each_others_entries(tmp_path, s3_bucket):
    """A compressed day of 3 hosts (2 workers): no lookup sends a LIST and each sends at most one
    GET per candidate length plus two (its session's pointer and record); every record a host
    committed is read by key by another host; restarts on an empty disk bring their sessions'
    spills back from the bucket; the budget is never exceeded by the end."""
    cfg = FleetConfig(hosts=3, workers=2, duration_s=12, seed=3, sessions=8, turns=4, restarts=1.5,
                      projects=3, refresh_s=2, sync_s=0.2, probe_timeout_s=20, open_timeout_s=120)
    r = run(cfg, s3_bucket, tmp_path / "hosts")

    assert len(r.hosts) == 3 and sum(h["turns"] for h in r.hosts) > 20
    lk = r.lookups
    assert lk and sum(x[3] for x in lk) == 0                       # no LIST on a lookup
    assert r.requests("lookup")["LIST"] == 0 and r.requests("fetch")["LIST"] == 0
    assert all(x[2] <= x[1] + 2 for x in lk), [x[:3] for x in lk if x[2] > x[1] + 2]
    assert r.requests("background")["LIST"] > 0                    # the sync does list

    cv = r.convergence()
    assert cv["commits"] > 0 and cv["lost"] == [], cv["lost"]
    assert len(cv["found"]) + len(cv["lost_deleted"]) == cv["commits"]

    assert sum(h["restarts"] for h in r.hosts) > 0
    assert sum(h["hits"] for h in r.hosts) > 0                      # downloads restored and confirmed
    assert sum(sum(h["bring_failed"].values()) for h in r.hosts) == 0
    assert not any(k.startswith("sim_error") for h in r.hosts for k in h["counters"]), [h["counters"] for h in r.hosts]
    assert r.raw["bucket"] and r.raw["bucket"][-1][2] <= cfg.budget_bytes // cfg.scale
    table = r.table()
    assert "| a lookup (request path): total | 0 |" in table
