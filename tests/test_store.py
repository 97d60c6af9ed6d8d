"""Unit tests of the content-addressed store (ocache/tiers/store.py): no server needed.

Slot files are written here in llama-server's own layout (docs/llama-server.md §6: magic, version, n_words, then
the packed token list at byte 24, then state bytes), so the store's header checks run on the format
the real server produces; the integration tests in test_disk_tier.py use real server files.
"""

from __future__ import annotations

import json
import os
import random
import signal
import struct
import subprocess
import sys
import textwrap
from fractions import Fraction
from pathlib import Path

import pytest

from ocache.tiers import store as st
from ocache.tiers.store import BudgetError, IntegrityError, Store

from conftest import damage_file


class Clock:
    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def write_slot_file(path: Path, tokens: list[int], state_bytes: int, seed: int = 0) -> None:
    """A file in llama-server's slot save layout (docs/llama-server.md §6) with random state bytes."""
    words = [-1, 1, len(tokens), *tokens, 0]
    head = struct.pack("<III", st.SLOT_MAGIC, 3, len(words)) + struct.pack(f"<{len(words)}i", *words)
    path.write_bytes(head + random.Random(seed).randbytes(state_bytes))


def make_store(tmp_path: Path, identity: str = "id-A", clock=None, **kw) -> Store:
    s = Store(tmp_path / "meta", tmp_path / "slots", identity, clock=clock or Clock(), **kw)
    s.open()
    return s


def put(s: Store, tokens: list[int], state_bytes: int = 1000, kind: str = "a", ckpt: bool = True,
        fingerprint: str | None = "fp1", seed: int = 0) -> st.Entry:
    """Write a slot file (and sidecar) under a temp name as the server would, then commit it."""
    key = st.entry_key(s.identity, kind, tokens)
    tmp = s.temp_name(kind, key)
    write_slot_file(s.data_dir / tmp, tokens, state_bytes, seed)
    if ckpt:
        (s.data_dir / (tmp + ".ckpt")).write_bytes(b"OCKP" + random.Random(seed + 1).randbytes(64))
    return s.commit(kind, tokens, tmp, fingerprint=fingerprint)


def oc_files(s: Store) -> list[str]:
    return sorted(p.name for p in s.data_dir.iterdir() if p.name.startswith("oc-"))


def test_commit_verify_and_prefix_lookup(tmp_path):
    (tmp_path / "slots").mkdir()
    os.chmod(tmp_path / "slots", 0o755)  # as llama-server's launcher may have created it
    s = make_store(tmp_path)
    toks = list(range(100, 400))
    e = put(s, toks)
    assert e.n_tokens == 300 and set(e.files) == {"bin", "ckpt"}
    assert oc_files(s) == sorted([e.files["bin"].name, e.files["ckpt"].name])
    assert oct(os.stat(s.meta_dir).st_mode & 0o777) == "0o700"
    assert oct(os.stat(s.data_dir).st_mode & 0o777) == "0o700"
    assert all(oct(os.stat(s.data_dir / f).st_mode & 0o777) == "0o600" for f in oc_files(s))
    assert s.verify(e.key, expect_tokens=toks + [1, 2, 3]).key == e.key
    # a longer request that starts with the entry's tokens finds it; a diverging one does not
    assert [x.key for x in s.find_prefixes(toks + [5, 6])] == [e.key]
    assert s.find_prefixes(toks[:200] + [7] * 150) == []
    shorter = put(s, toks[:120], seed=3)
    assert [x.key for x in s.find_prefixes(toks + [5])] == [e.key, shorter.key]
    # a reopened store (new process) serves the same entries from the index
    s.close()
    s2 = make_store(tmp_path)
    assert s2.report.index == "ok" and {x.key for x in s2.entries()} == {e.key, shorter.key}
    assert s2.tokens(e.key) == toks


def test_commit_rejects_a_file_whose_tokens_differ(tmp_path):
    s = make_store(tmp_path)
    key = st.entry_key("id-A", "a", [1, 2, 3])
    tmp = s.temp_name("a", key)
    write_slot_file(s.data_dir / tmp, [1, 2, 4], 100)
    with pytest.raises(ValueError):
        s.commit("a", [1, 2, 3], tmp)
    assert oc_files(s) == [] and s.entries() == []


@pytest.mark.parametrize("fault", ["missing", "truncated", "zero", "bitflip", "ckpt_bitflip", "header_tokens"])
def test_verify_detects_damage_and_deletes(tmp_path, fault):
    s = make_store(tmp_path)
    other = put(s, list(range(50, 90)), seed=9)
    e = put(s, list(range(1000, 1200)), state_bytes=5000)
    p = s.data_dir / e.files["bin"].name
    data = bytearray(p.read_bytes())
    if fault == "ckpt_bitflip":
        c = s.data_dir / e.files["ckpt"].name
        cd = bytearray(c.read_bytes())
        cd[10] ^= 1
        c.write_bytes(cd)
    elif fault == "header_tokens":
        data[24 + 12 + 4 * 5] ^= 1  # a token id inside the header
        p.write_bytes(data)
    else:
        assert damage_file(p, fault, keep=Fraction(1, 2), flip=0x10)
    with pytest.raises(IntegrityError):
        s.verify(e.key)
    assert s.get(e.key) is None
    assert not s.record_path(e.key).exists()
    assert oc_files(s) == sorted(f.name for f in other.files.values())
    s.verify(other.key)  # the other entry is untouched


def test_other_identities_are_kept_at_open_and_served_when_theirs_returns(tmp_path):
    """Opening the store for model B keeps model A's entries (not served to B);
    a later open for A serves them again."""
    a = make_store(tmp_path, identity="model-A")
    ea = put(a, list(range(10, 60)))
    a.close()
    b = make_store(tmp_path, identity="model-B")
    assert b.report.other_identity == 1
    assert [e.key for e in b.entries()] == [ea.key] and oc_files(b) == sorted(f.name for f in ea.files.values())
    assert b.find_prefixes(list(range(10, 70))) == []          # never served to B
    eb = put(b, list(range(10, 60)))                           # B's own entry for the same tokens
    assert eb.key != ea.key and len(b.entries()) == 2
    b.close()
    a2 = make_store(tmp_path, identity="model-A")
    assert a2.report.other_identity == 1
    assert [e.key for e in a2.find_prefixes(list(range(10, 70)))] == [ea.key]
    a2.verify(ea.key)


def test_verify_refuses_an_entry_of_another_identity_and_keeps_it(tmp_path):
    s = make_store(tmp_path, identity="model-A")
    e = put(s, list(range(10, 60)))
    s.identity = "model-B"  # e.g. the server was restarted with other flags while running
    with pytest.raises(IntegrityError) as ei:
        s.verify(e.key)
    assert ei.value.reason == "identity"
    assert s.get(e.key) is not None and oc_files(s) == sorted(f.name for f in e.files.values())


def test_eviction_order_follows_the_value_rule(tmp_path):
    clock = Clock()
    s = make_store(tmp_path, clock=clock, budget_bytes=10**9)
    # constructed set: same bytes per entry unless stated; value = (hits+1)*tokens/bytes*0.5**days
    specs = {
        "fresh": dict(n=400, hits=0, age_days=0.0),
        "popular": dict(n=400, hits=3, age_days=0.0),
        "stale": dict(n=400, hits=0, age_days=2.0),
        "long": dict(n=800, hits=0, age_days=0.0),
        "popular_old": dict(n=400, hits=3, age_days=3.0),
    }
    keys = {}
    for i, (name, sp) in enumerate(specs.items()):
        base = 10_000 * (i + 1)
        # pad state bytes so every entry has the same total size despite different token counts
        e = put(s, list(range(base, base + sp["n"])), state_bytes=20_000 - 4 * sp["n"], ckpt=False, seed=i)
        keys[e.key] = name
        for _ in range(sp["hits"]):
            s.touch(e.key)
        s.get(e.key).last_used = clock.t - sp["age_days"] * st.DAY_S
    sizes = {e.bytes for e in s.entries()}
    assert len(sizes) == 1
    now = clock()
    expected = [keys[e.key] for e in sorted(s.entries(), key=lambda e: (e.hits + 1) * e.n_tokens
                                            * 0.5 ** ((now - e.last_used) / st.DAY_S) / e.bytes)]
    # popular_old: 4*400/8 = 200 < fresh 400: hits do not outweigh three days unused
    assert expected == ["stale", "popular_old", "fresh", "long", "popular"]
    order = []
    while s.entries():
        before = {e.key for e in s.entries()}
        assert s.evict(1) > 0
        (gone,) = before - {e.key for e in s.entries()}
        order.append(keys[gone])
    assert order == expected


def test_budget_is_never_exceeded(tmp_path):
    clock = Clock()
    budget = 60_000
    s = make_store(tmp_path, clock=clock, budget_bytes=budget)
    rng = random.Random(7)
    for i in range(40):
        clock.t += rng.uniform(0, 3600)
        n = rng.randint(20, 400)
        base = 100_000 * (i + 1)
        e = put(s, list(range(base, base + n)), state_bytes=rng.randint(1000, 20_000), seed=i)
        if rng.random() < 0.4:
            s.touch(e.key)
        on_disk = sum((s.data_dir / f).stat().st_size for f in oc_files(s))
        assert s.used_bytes() <= budget and on_disk <= budget
        assert on_disk == sum(x.bytes for x in s.entries())
    assert s.counters["evicted"] > 0
    # an entry larger than the whole budget is refused without evicting anything
    n_before = len(s.entries())
    with pytest.raises(BudgetError):
        put(s, list(range(5, 50)), state_bytes=budget + 1)
    assert len(s.entries()) == n_before and not [f for f in oc_files(s) if f.startswith("oc-tmp-")]
    with pytest.raises(BudgetError):
        s.reserve("k", budget + 1)
    assert len(s.entries()) == n_before


def test_reservation_counts_against_the_budget(tmp_path):
    s = make_store(tmp_path, budget_bytes=30_000)
    e1 = put(s, list(range(1, 100)), state_bytes=10_000, ckpt=False)
    s.reserve("pending", 15_000)
    assert s.used_bytes() == e1.bytes + 15_000
    e2 = put(s, list(range(200, 300)), state_bytes=10_000, ckpt=False, seed=2)
    assert s.get(e1.key) is None and s.get(e2.key) is not None  # e1 evicted to honour the reservation
    s.release("pending")
    assert s.used_bytes() == e2.bytes


def test_ttl_gc(tmp_path):
    clock = Clock()
    s = make_store(tmp_path, clock=clock, ttl_s=7 * st.DAY_S)
    old = put(s, list(range(1, 50)))
    clock.t += 6 * st.DAY_S
    new = put(s, list(range(100, 150)), seed=1)
    clock.t += 2 * st.DAY_S
    r = s.gc()
    assert r["expired"] == 1 and s.get(old.key) is None and s.get(new.key) is not None


@pytest.mark.parametrize("damage", ["missing", "corrupt", "checksum", "stale"])
def test_index_rebuilt_from_records(tmp_path, damage):
    s = make_store(tmp_path)
    e1 = put(s, list(range(1, 80)))
    e2 = put(s, list(range(300, 500)), seed=1)
    s.touch(e2.key)
    s.touch(e2.key)
    s.close()
    idx = tmp_path / "meta" / "index.json"
    if damage == "missing":
        idx.unlink()
    elif damage == "corrupt":
        idx.write_bytes(idx.read_bytes()[:50])
    elif damage == "checksum":
        doc = json.loads(idx.read_text())
        next(iter(doc["entries"].values()))["hits"] = 99  # edited without the checksum
        idx.write_text(json.dumps(doc))
    elif damage == "stale":
        doc = json.loads(idx.read_text())
        del doc["entries"][e1.key]  # an index written before e1's record
        body = json.dumps(doc["entries"], sort_keys=True, separators=(",", ":")).encode()
        import xxhash

        doc["checksum"] = xxhash.xxh3_64_hexdigest(body)
        idx.write_text(json.dumps(doc))
    s2 = make_store(tmp_path)
    assert s2.report.index == damage if damage != "checksum" else s2.report.index == "corrupt"
    assert {e.key for e in s2.entries()} == {e1.key, e2.key}
    assert s2.get(e2.key).hits == 2
    s2.verify(e1.key)
    s2.verify(e2.key)
    assert s2.report.orphans == 0
    assert json.loads(idx.read_text())["entries"].keys() == {e1.key, e2.key}


def test_unreadable_record_removes_only_its_entry(tmp_path):
    s = make_store(tmp_path)
    good = put(s, list(range(1, 80)))
    bad = put(s, list(range(300, 500)), seed=1)
    s.close()
    s.record_path(bad.key).write_text("{not json")
    (tmp_path / "meta" / "index.json").unlink()
    s2 = make_store(tmp_path)
    assert s2.report.bad_records == 1
    assert [e.key for e in s2.entries()] == [good.key]
    assert oc_files(s2) == sorted(f.name for f in good.files.values())


def test_second_process_cannot_take_the_lock(tmp_path):
    make_store(tmp_path)
    with pytest.raises(st.LockedError):
        Store(tmp_path / "meta", tmp_path / "slots", "id-A").open()


# --------------------------------------------------------------------------- kill -9 mid-write

CHILD = textwrap.dedent(r"""
    import os, sys, random, struct
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    from ocache.tiers import store as st
    root, stage = Path(sys.argv[2]), sys.argv[3]
    s = st.Store(root / "meta", root / "slots", "id-A")
    s.open()

    def block(msg):
        print(msg, flush=True)
        sys.stdin.read()          # parked here until the parent kills us with SIGKILL

    toks = list(range(7000, 7600))
    key = st.entry_key("id-A", "a", toks)
    tmp = s.temp_name("a", key)
    words = [-1, 1, len(toks), *toks, 0]
    head = struct.pack("<III", st.SLOT_MAGIC, 3, len(words)) + struct.pack(f"<{len(words)}i", *words)
    if stage == "data":
        # the server is half way through writing the slot file when ocache dies
        with open(s.data_dir / tmp, "wb") as f:
            f.write(head + b"x" * 5000)
            f.flush()
            block("mid-data")
    with open(s.data_dir / tmp, "wb") as f:
        f.write(head + random.Random(1).randbytes(20000))
    (s.data_dir / (tmp + ".ckpt")).write_bytes(b"OCKP" + b"y" * 100)
    real_write = st.atomic_write

    def hooked(path, data, mode=0o600):
        if path.parent == s.records_dir:
            if stage == "record":
                block("before-record")     # data files renamed to final names, no record yet
            if stage == "record-partial":
                t = path.with_name(f".{path.name}.tmp-dead")
                t.write_bytes(data[: len(data) // 2])
                block("mid-record")
        return real_write(path, data, mode)

    st.atomic_write = hooked
    s.commit("a", toks, tmp)
    block("committed")
""")


@pytest.mark.parametrize("stage", ["data", "record", "record-partial", "committed"])
def test_kill9_during_a_write_leaves_nothing_trusted(tmp_path, stage):
    s = make_store(tmp_path)
    survivor = put(s, list(range(1, 300)), state_bytes=3000)
    s.close()
    repo = str(Path(__file__).resolve().parents[1])
    child = subprocess.Popen([sys.executable, "-c", CHILD, repo, str(tmp_path), stage],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        marker = child.stdout.readline().strip()
        assert marker in {"mid-data", "before-record", "mid-record", "committed"}
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == -signal.SIGKILL
    leftovers = {p.name for p in (tmp_path / "slots").iterdir()}
    if stage != "committed":
        assert leftovers - {f.name for f in survivor.files.values()}, "the kill left no partial file to test"
    s2 = make_store(tmp_path)
    toks = list(range(7000, 7600))
    key = st.entry_key("id-A", "a", toks)
    if stage == "committed":
        assert s2.get(key) is not None
        s2.verify(key)
    else:
        assert s2.get(key) is None
        assert s2.report.orphans >= 1
        assert oc_files(s2) == sorted(f.name for f in survivor.files.values())
        assert not list(s2.records_dir.glob(".*tmp*"))
    s2.verify(survivor.key)


def test_kind_budgets_share_one_store(tmp_path):
    """Anchors ("a") and spills ("s") share one store; each kind stays within its own budget and
    filling one kind never evicts the other."""
    s = make_store(tmp_path, budget_bytes=100_000, kind_budgets={"a": 40_000, "s": 60_000})
    spills = [put(s, list(range(900_000 + 1000 * i, 900_000 + 1000 * i + 50)), state_bytes=15_000,
                  kind="s", ckpt=False, seed=100 + i) for i in range(3)]
    assert s.kind_bytes("s") <= 60_000 and len(s.entries("s")) == 3
    for i in range(6):
        put(s, list(range(1000 * i, 1000 * i + 50)), state_bytes=15_000, kind="a", ckpt=False, seed=i)
        assert s.kind_bytes("a") <= 40_000 and s.used_bytes() <= 100_000
    assert {e.key for e in s.entries("s")} == {e.key for e in spills}


def test_cache_cli_ls_gc_clear(tmp_path, capsys):
    from ocache.cli import main

    clock = Clock()
    s = make_store(tmp_path / "root", clock=clock)  # meta dir = root/meta; the CLI reads root/store
    s.close()
    root = tmp_path / "root"
    (root / "meta").rename(root / "store")
    s = Store(root / "store", root / "slots", "id-A")
    s.open()
    keep = put(s, list(range(1, 500)), state_bytes=4000)
    s.touch(keep.key)
    put(s, list(range(1000, 1100)), state_bytes=4000, kind="s", seed=1)
    (s.data_dir / "oc-tmp-a-deadbeef-0000.bin").write_bytes(b"partial")  # a killed write
    (s.data_dir / "user-file.bin").write_bytes(b"not ours")

    assert main(["cache", "ls", "--cache-dir", str(root)]) == 0
    out = capsys.readouterr().out
    assert "anchor" in out and "spill" in out and "2 entries" in out and keep.key[:16] in out
    # gc and clear refuse while the store is open in another process (here: this one's lock)
    assert main(["cache", "gc", "--cache-dir", str(root)]) == 1
    assert "in use" in capsys.readouterr().err
    s.close()
    assert main(["cache", "gc", "--cache-dir", str(root)]) == 0
    assert "removed 1 orphan" in capsys.readouterr().out
    assert not (s.data_dir / "oc-tmp-a-deadbeef-0000.bin").exists()
    assert main(["cache", "clear", "--cache-dir", str(root), "--kind", "spills"]) == 0
    assert "deleted 1" in capsys.readouterr().out
    assert main(["cache", "ls", "--cache-dir", str(root)]) == 0
    assert "1 entries" in capsys.readouterr().out
    assert (s.data_dir / "user-file.bin").exists()  # files that are not ocache's are never touched
    capsys.readouterr()
    # no store yet is not an error (a fresh machine): 0 entries, exit 0
    assert main(["cache", "ls", "--cache-dir", str(tmp_path / "nowhere")]) == 0
    assert "0 entries" in capsys.readouterr().out


def test_free_space_floor(tmp_path):
    """The data file system keeps ``free_floor_bytes`` free: entries are evicted by value to keep
    it, and an entry that cannot keep it even with everything evicted is refused untouched.
    (The file system is simulated as a 100 kB disk: free = 100 kB - what the store holds.)"""
    s = make_store(tmp_path, free_floor_bytes=50_000, budget_bytes=10**9)
    s._free_bytes = lambda: 100_000 - s.used_bytes()
    for i in range(5):
        put(s, list(range(1000 * i, 1000 * i + 40)), state_bytes=20_000, ckpt=False, seed=i)
        assert s._free_bytes() >= 50_000
    assert len(s.entries()) == 2 and s.counters["evicted"] == 3
    n = len(s.entries())
    with pytest.raises(BudgetError):
        put(s, list(range(99_000, 99_040)), state_bytes=60_000, ckpt=False)
    assert len(s.entries()) == n


def test_identity_change_while_running_keeps_the_old_entries(tmp_path):
    """A -> B -> A while running: B is served only its own entries, A's stay and serve again."""
    s = make_store(tmp_path, identity="model-A")
    ea = put(s, list(range(10, 60)))
    put(s, list(range(100, 160)), kind="s", seed=1)
    assert s.set_identity("model-A") == 0 and len(s.entries()) == 2
    assert s.set_identity("model-B") == 0           # B has no entries yet; A's two are kept
    assert len(s.entries()) == 2 and len(oc_files(s)) == 4
    assert s.find_prefixes(list(range(10, 70))) == []
    e = put(s, list(range(10, 60)))
    assert e.identity == "model-B" and s.find_prefixes(list(range(10, 70)))[0].key == e.key
    assert s.set_identity("model-A") == 2
    assert [x.key for x in s.find_prefixes(list(range(10, 70)))] == [ea.key]
    assert s.counters["identity_switches"] == 2


def test_other_identities_share_the_budget_ttl_and_value_eviction(tmp_path):
    """Entries of another identity count against the one budget and are evicted by value like any
    other; TTL applies to them too. Deletions are logged as one summary line with the reason."""
    clock = Clock()
    s = make_store(tmp_path, identity="model-A", clock=clock, budget_bytes=3 * 1300)
    old = put(s, list(range(10, 60)), state_bytes=1000, ckpt=False, seed=1)
    clock.t += 3 * st.DAY_S                           # A's entry loses value while unused
    s.set_identity("model-B")
    b1 = put(s, list(range(200, 250)), state_bytes=1000, ckpt=False, seed=2)
    b2 = put(s, list(range(300, 350)), state_bytes=1000, ckpt=False, seed=3)
    b3 = put(s, list(range(400, 450)), state_bytes=1000, ckpt=False, seed=4)  # over budget
    assert s.get(old.key) is None and {e.key for e in s.entries()} == {b1.key, b2.key, b3.key}
    s.set_identity("model-A")
    a = put(s, list(range(10, 60)), state_bytes=1000, ckpt=False, seed=5)
    assert len(s.entries()) == 3 and s.get(a.key) is not None   # a B entry made room for it
    clock.t += 8 * st.DAY_S
    assert s.gc()["expired"] == 3 and s.entries() == []


def test_deletions_are_one_summary_line_with_the_reason(tmp_path, caplog):
    clock = Clock()
    s = make_store(tmp_path, clock=clock, ttl_s=st.DAY_S)
    for i in range(6):
        put(s, list(range(100 * i, 100 * i + 50)), ckpt=False, seed=i)
    clock.t += 2 * st.DAY_S
    caplog.set_level("INFO", logger="ocache.tiers.store")
    caplog.clear()
    assert s.gc()["expired"] == 6
    lines = [r.getMessage() for r in caplog.records if "deleted" in r.getMessage() or "delete " in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("store: deleted 6 entries") and "TTL" in lines[0], lines


def test_grid_hashes_are_chained_prefix_identities():
    """``grid_hashes``: one hash per full grid line, equal exactly while the prefixes are equal."""
    from ocache.tiers.store import grid_hashes

    a = list(range(10_000))
    b = a[:5_000] + [7] + a[5_001:]
    ha, hb = grid_hashes(a, 1024), grid_hashes(b, 1024)
    assert len(ha) == 10_000 // 1024 == len(hb)
    assert ha[:4] == hb[:4]                         # lines 1..4 end before token 5,000
    assert all(x != y for x, y in zip(ha[4:], hb[4:]))
    assert grid_hashes(a[:4096], 1024) == ha[:4]    # a prefix's chain is the chain's prefix
    assert len(set(ha)) == len(ha)


def test_two_stores_sharing_a_slot_dir_never_remove_each_others_files(tmp_path):
    """Two ocaches with their own cache_dir and one ``--slot-save-path``. The second
    store's open keeps the first's committed files and its in-flight temp file (the first verifies
    them after); each removes its own orphans; a store whose meta directory is gone has its files
    removed by the registry. On the old sweep the second open removed the first's files."""
    slots = tmp_path / "slots"
    a = Store(tmp_path / "a", slots, "id-A", clock=Clock())
    a.open()
    ea = put(a, list(range(100, 300)))
    in_flight = a.temp_name("s", "k-a")          # the server is writing A's spill right now
    write_slot_file(slots / in_flight, [1, 2, 3], 100)
    a_files = set(oc_files(a))
    b = Store(tmp_path / "b", slots, "id-A", clock=Clock())
    rep = b.open()
    assert rep.orphans == 0 and a_files <= set(oc_files(b))
    assert a.verify(ea.key, expect_tokens=list(range(100, 300))).key == ea.key
    eb = put(b, list(range(100, 300)))          # the same tokens and identity: its own file
    assert eb.files["bin"].name != ea.files["bin"].name
    b_orphan = b.temp_name("a", "k-b")             # B killed during a write of its own
    write_slot_file(slots / b_orphan, [4, 5], 100)
    b.close()
    b = Store(tmp_path / "b", slots, "id-A", clock=Clock())
    assert b.open().orphans == 1 and not (slots / b_orphan).exists()
    assert (slots / in_flight).exists() and a.verify(ea.key).key == ea.key
    a.close()
    b.close()
    # A's cache_dir removed for good: the registry proves its files orphaned
    import shutil
    shutil.rmtree(tmp_path / "a")
    b = Store(tmp_path / "b", slots, "id-A", clock=Clock())
    assert b.open().orphans == len(a_files)
    assert set(oc_files(b)) == {f.name for f in eb.files.values()}
    assert b.verify(eb.key).key == eb.key


def test_unreturned_spills_decay_and_expire_so_their_bytes_stay_bounded(tmp_path):
    """Two-turn sessions spill and never come back. A spill never restored loses
    value by the hour (it goes before an older anchor of equal size) and is deleted at the first
    commit two hours after it was written, so what unreturned spills hold is bounded by the spill
    rate times two hours; a spill that was restored once keeps the day's half-life. On the old policy
    every spill stayed until the budget (40 GB) was full."""
    from ocache.tiers.evict import UNRETURNED_TTL_S, ValuePolicy

    clock = Clock()
    s = make_store(tmp_path, clock=clock)
    anchor = put(s, list(range(1000, 1400)), kind="a", seed=1)
    clock.t += 600
    back = put(s, list(range(2000, 2400)), kind="s", seed=2)
    s.touch(back.key)                                   # restored once: it came back
    gone = put(s, list(range(3000, 3400)), kind="s", seed=3)
    clock.t += 1800
    order = [e.key for e in ValuePolicy().candidates(s.entries(), clock.t)]
    assert order[0] == gone.key                          # the unreturned spill goes first
    total = 0
    for i in range(6):                                   # a spill every 30 min, none restored
        clock.t += 1800
        put(s, list(range(5000 + 500 * i, 5400 + 500 * i)), kind="s", seed=10 + i)
        spills = [e for e in s.entries("s") if e.hits == 0]
        total = max(total, len(spills))
        assert all(clock.t - e.created <= UNRETURNED_TTL_S for e in spills)
    assert total <= UNRETURNED_TTL_S / 1800 + 1           # the bound: rate x TTL
    assert s.get(gone.key) is None and s.get(back.key) is not None and s.get(anchor.key) is not None
