"""A fleet of remote-tier hosts on one bucket, without llama-server: ``scripts/sim-fleet``.

Each *host* is what one ``ocache serve`` keeps of the remote tier: its own local store (meta and
slot directories under the run's folder), its own S3 client (:class:`~ocache.tiers.remote_client.S3Objects`,
one aiobotocore session and connection pool), its own :class:`~ocache.tiers.remote_bucket.RemoteBucket`
and :class:`~ocache.tiers.remote.RemoteTier` with the tier's background sync running (uploads every
``sync_s``, a listing every ``refresh_s``, eviction under the budget). Nothing of the tier is
replaced: the simulation drives its public calls (``lookup``, ``bring``, ``admit``, ``on_drain``,
``start``/``stop``) as the cache layer does, with a slot table stub whose ``restore`` answers that
every token was restored (no server reads the files).

How it runs: ``workers`` processes (``multiprocessing``, spawn), each one asyncio event loop with
``hosts / workers`` hosts (the first workers one more when it does not divide). The parent process
starts nothing but the workers and an observer that lists the bucket every ``sample_s`` (its
bytes against the budget; not counted as any host's). It relays each host's commits to another
host for the convergence probe (below).

The day: ``day_s`` simulated seconds (86,400) run in ``duration_s`` wall seconds; every event is
scheduled at its simulated time divided by ``compression = day_s / duration_s`` (a host that falls
behind runs its events late: ``lag`` in the results). Per host, from ``seed`` and the host's number:

* **new sessions**: Poisson, ``sessions`` a day on average, in a daytime profile (most between 8h
  and 19h); each in one of ``projects`` folders (Zipf-like popularity: the first folders are shared
  by many hosts), whose harness head is 4,000-12,000 tokens;
* **next turns**: a session has ``1 + Geometric`` turns (mean ``turns``), ``think_s`` apart on
  average; each turn adds a tool output or user message (log-normal, median 800 tokens, at most
  ``max_tokens`` in all) after the previous answer (200 tokens);
* **slots**: ``slots`` per host; a turn of a session not in a slot takes the least recently used
  one, and the conversation there is **spilled** (a kind ``s`` entry of the session, its older
  spill deleted locally), as the session tier does on an eviction; the first turn of a folder's head
  on a host commits its **anchor** (kind ``a`` at the head's end), as the disk tier does;
* **restarts**: Poisson, ``restarts`` a day on average: a planned stop (each slot spilled, the tier's
  ``on_drain`` uploads), then the host comes back on an **empty disk** with a new client, bucket
  and tier: its sessions' next turns find their spills only in the bucket (session pointer, record,
  download).

Every turn calls ``lookup`` (the layer asks every tier on every request); an offer longer than what
the host has locally (its slot, its local spill or anchor) is brought (download, verify, the stub's
restore) and admitted as a confirmed hit (its use object written, in the background). A key found
missing is remembered ``absent_s`` (default the production's 10 s divided by the compression, so
that a session's next turn asks the bucket again as it would in production).

Sizes, scaled: the slot files keep llama-server's layout and its 4-byte token ids, but their state is
``state_bytes_per_token`` (32) a token where an 8B model's fp16 KV cache is 131,072 (32 layers x 8
KV heads x 128 x 2 x 2 bytes): 1/4096. Budgets are given in the production's bytes and divided
by the same ``scale`` (4096).

Measured, per host: requests to the bucket by kind (LIST, HEAD, GET, PUT, POST, DELETE) and by
path: ``lookup`` (a request's lookup), ``fetch`` (a download a request waits for), ``after`` (the
use object written after a hit), ``background`` (the sync: listings, uploads, eviction),
``drain`` (the uploads of a planned stop), ``probe``; each lookup's seconds, candidate lengths and
requests; memory (RSS of each worker at its start, with its hosts open and along the day; each host's
index, absent keys and catalog sizes); convergence (from the record's create-only PUT answering on
host X to a read of the key answering on another host Y that the parent told of it: the relay's
delay included); the bucket's bytes over time.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import json
import logging
import math
import os
import random
import shutil
import struct
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Sequence

log = logging.getLogger(__name__)

IDENTITY = "sim-fleet-identity"
IM_START = 151644          # the turn-start token of the generated conversations
ANSWER_TOKENS = 200
KINDS = ("LIST", "HEAD", "GET", "PUT", "POST", "DELETE")
PATHS = ("lookup", "fetch", "after", "background", "drain", "probe")

#: which path a request to the bucket is on (set in the task that sends it; tasks inherit it)
PATH: contextvars.ContextVar[str] = contextvars.ContextVar("sim_fleet_path", default="background")


@dataclass
class FleetConfig:
    """A run's parameters (times in seconds; ``*_bytes`` in the production's bytes, divided by
    ``scale`` in the simulation)."""

    hosts: int = 100
    workers: int = 4
    duration_s: float = 300.0
    day_s: float = 86400.0
    seed: int = 1
    projects: int = 20
    sessions: float = 4.0
    turns: float = 5.0
    think_s: float = 90.0
    slots: int = 2
    restarts: float = 0.3
    max_tokens: int = 48_000
    grid: int = 1024
    min_tokens: int = 4096
    state_bytes_per_token: int = 32
    scale: int = 4096
    budget_bytes: int = 500 * 10**9
    local_budget_bytes: int = 200 * 10**9
    sync_s: float = 1.0
    refresh_s: float = 10.0
    absent_s: float | None = None       # None: the production's 10 s, compressed like the day
    prefill_tps: float = 1000.0
    probe_interval_s: float = 0.05
    probe_timeout_s: float = 30.0
    sample_s: float = 5.0
    open_timeout_s: float = 600.0

    @property
    def compression(self) -> float:
        return self.day_s / self.duration_s

    def absent_seconds(self) -> float:
        return self.absent_s if self.absent_s is not None else max(0.001, 10.0 / self.compression)


# ---------------------------------------------------------------------------------------- the day
@dataclass
class Session:
    """One conversation on one host: its folder's head, then turns; ``tokens`` the prompt so far
    (the last answer included once a turn ran)."""

    sid: str
    project: int
    head: list[int]
    rng: random.Random
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    turns_done: int = 0

    def next_prompt(self) -> list[int]:
        """The next turn's prompt: the head and a first user message, or the last answer and a new
        tool output / user message (log-normal, median 800 tokens)."""
        if not self.tokens:
            self.tokens = list(self.head)
        elif self.turns_done:
            self.tokens += [self.rng.randrange(1000, 150000) for _ in range(ANSWER_TOKENS)]
        room = max(16, self.max_tokens - len(self.tokens))
        n = min(room, max(16, int(self.rng.lognormvariate(math.log(800), 0.9))))
        self.tokens += [IM_START] + [self.rng.randrange(1000, 150000) for _ in range(n - 1)]
        return self.tokens

    def hint(self) -> str:
        return f"sim-{self.sid}"


def project_head(seed: int, project: int) -> list[int]:
    """The harness head of folder ``project``: 4,000-12,000 tokens, the same on every host."""
    r = random.Random(f"{seed}-head-{project}")
    return [r.randrange(1000, 150000) for _ in range(r.randrange(4000, 12001))]


def daytime(r: random.Random, day_s: float) -> float:
    """A time of the day (simulated seconds) drawn from the activity profile: weight 0.1 at night,
    rising to 1 at 13h, most between 8h and 19h."""
    while True:
        t = r.uniform(0, day_s)
        h = 24.0 * t / day_s
        w = 0.1 + 0.9 * max(0.0, math.sin(math.pi * (h - 7.0) / 12.0)) if 7.0 <= h <= 19.0 else 0.1
        if r.random() < w:
            return t


def poisson(r: random.Random, mean: float) -> int:
    n, p, limit = 0, 1.0, math.exp(-mean)
    while True:
        p *= r.random()
        if p < limit:
            return n
        n += 1


def schedule(cfg: FleetConfig, host: int) -> list[tuple[float, str, Any]]:
    """The host's events, by simulated time: ``(t, "turn", session)`` and ``(t, "restart", None)``."""
    r = random.Random(f"{cfg.seed}-host-{host}")
    events: list[tuple[float, str, Any]] = []
    weights = [1.0 / (p + 1) for p in range(cfg.projects)]
    for i in range(poisson(r, cfg.sessions)):
        project = r.choices(range(cfg.projects), weights)[0]
        s = Session(f"{host}-{i}", project, project_head(cfg.seed, project), random.Random(f"{cfg.seed}-{host}-{i}"),
                    cfg.max_tokens)
        t = daytime(r, cfg.day_s)
        n = 1
        while r.random() > 1.0 / max(1.0, cfg.turns):
            n += 1
        for _ in range(n):
            if t >= cfg.day_s:
                break
            events.append((t, "turn", s))
            t += r.expovariate(1.0 / cfg.think_s)
    for _ in range(poisson(r, cfg.restarts)):
        events.append((r.uniform(0, cfg.day_s), "restart", None))
    events.sort(key=lambda e: (e[0], e[1]))
    return events


# ---------------------------------------------------------------------------------------- a host
def rss_bytes() -> int:
    """This process's resident set (``/proc/self/statm``), bytes; 0 where there is none."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def write_entry(store: Any, kind: str, tokens: Sequence[int], state_bytes: int, meta: dict | None = None) -> Any:
    """Commit an entry of ``tokens`` to ``store``: a slot file in llama-server's layout
    (docs/llama-server.md §6) with ``state_bytes`` of random state. Returns the Entry; raises what
    ``Store.commit`` raises."""
    from ocache.tiers import store as st

    key = st.entry_key(store.identity or "", kind, tokens)
    tmp = store.temp_name(kind, key)
    words = [-1, 1, len(tokens), *tokens, 0]
    head = struct.pack("<III", st.SLOT_MAGIC, 3, len(words)) + struct.pack(f"<{len(words)}i", *words)
    (store.data_dir / tmp).write_bytes(head + os.urandom(state_bytes))
    return store.commit(kind, tokens, tmp, meta=meta)


class SlotStub:
    """The slot table as the remote tier sees it: default server parameters, no server-side hash
    check, and a ``restore`` that answers every token restored."""

    def __init__(self) -> None:
        from ocache.llama.flags import ServerParams

        self.params = ServerParams()
        self.checks_xxh3 = False

    async def restore(self, slot: int, name: str, *, tokens: Sequence[int], checkpoints: Any = None,
                      xxh3: Any = None) -> dict:
        return {"n_restored": len(tokens)}


def traced_objects(settings: dict, on_commit: Any, on_delete: Any) -> Any:
    """An :class:`S3Objects` of ``settings`` (``store.remote``'s url, endpoint_url, region) whose
    requests are also counted by path (:data:`PATH`) in ``by_path[(path, kind)]``, and that calls
    ``on_commit(key)`` when a record's create-only PUT succeeded and ``on_delete(key)`` when a
    record is deleted."""
    from ocache.tiers.remote_bucket import RECORDS
    from ocache.tiers.remote_client import S3Objects

    class Traced(S3Objects):
        def __init__(self) -> None:
            super().__init__(settings["url"], endpoint_url=settings.get("endpoint_url"),
                             region=settings.get("region"))
            self.by_path: Counter = Counter()

        def _count(self, kind: str) -> None:
            super()._count(kind)
            self.by_path[(PATH.get(), kind)] += 1

        async def put(self, key: str, body: Any, *, create_only: bool = False) -> bool:
            ok = await super().put(key, body, create_only=create_only)
            if ok and create_only and key.startswith(RECORDS):
                on_commit(key[len(RECORDS):-len(".json")])
            return ok

        async def delete(self, key: str) -> None:
            await super().delete(key)
            if key.startswith(RECORDS):
                on_delete(key[len(RECORDS):-len(".json")])

    return Traced()


async def on_path(path: str, coro: Any) -> Any:
    """Await ``coro`` in a task whose requests count under ``path``."""
    async def run() -> Any:
        PATH.set(path)
        return await coro
    return await asyncio.create_task(run())


class Host:
    """One simulated host (see the module docstring)."""

    def __init__(self, n: int, cfg: FleetConfig, settings: dict, root: Path, events: list) -> None:
        self.n = n
        self.cfg = cfg
        self.settings = settings
        self.root = root
        self.events: list[tuple] = []     # ("commit"|"delete"|"offer", key, wall time, extra)
        self.by_path: Counter = Counter()   # of the clients this host closed (restarts)
        self.outbox = events
        #: (seconds, candidate lengths, requests, LISTs among them, prompt tokens, wall time)
        self.lookups: list[tuple[float, int, int, int, int, float]] = []
        self.bring_s: list[float] = []
        self.bring_failed: Counter = Counter()
        self.hits = 0
        self.spills = 0
        self.anchors = 0
        self.restarts = 0
        self.turns = 0
        self.new_sessions = 0
        self.counters: Counter = Counter()   # tier and bucket counters of closed tiers
        self.peak = {"index_entries": 0, "index_bytes": 0, "absent_keys": 0, "catalog": 0}
        self.slots: list[Session | None] = [None] * cfg.slots
        self.used: list[float] = [0.0] * cfg.slots
        self.spilled: dict[str, str] = {}      # session id -> key of its latest local spill
        self.generation = 0
        self.tier: Any = None
        self.active_s = 0.0       # wall seconds this host's tiers were open, every generation
        self._opened_at = 0.0

    def note(self, what: str, key: str, extra: Any = None) -> None:
        ev = (what, key, time.time(), self.n, extra)
        self.events.append(ev)
        if what == "commit":
            self.outbox.append(ev)

    async def open(self) -> None:
        from ocache.tiers.remote import RemoteTier
        from ocache.tiers.remote_bucket import RemoteBucket
        from ocache.tiers.store import Store

        cfg = self.cfg
        d = self.root / f"host-{self.n:03d}-{self.generation}"
        self.store = Store(d / "meta", d / "slots", IDENTITY, budget_bytes=cfg.local_budget_bytes // cfg.scale)
        self.store.open()
        self.objects = traced_objects(self.settings, lambda k: self.note("commit", k),
                                      lambda k: self.note("delete", k))
        await self.objects.__aenter__()
        self.bucket = RemoteBucket(self.objects, self.store, budget_bytes=cfg.budget_bytes // cfg.scale,
                                   host=f"host-{self.n}", absent_s=cfg.absent_seconds())
        self.tier = RemoteTier(self.bucket, SlotStub(), sync_s=cfg.sync_s, refresh_s=cfg.refresh_s,
                               grid=cfg.grid, min_tokens=cfg.min_tokens)
        self.tier.prefill_tps_of = lambda: cfg.prefill_tps
        self._opened_at = time.monotonic()
        self.tier.start()

    async def close(self, wipe: bool) -> None:
        await self.tier.stop()
        st = self.tier.stats()
        for k, v in st.items():
            if isinstance(v, int) and not isinstance(v, bool) and k not in ("budget_bytes",):
                self.counters[k] += v
        self.by_path.update(self.objects.by_path)
        self.objects.by_path = Counter()
        self.active_s += time.monotonic() - self._opened_at
        await self.objects.__aexit__(None, None, None)
        self.store.close()
        if wipe:
            shutil.rmtree(self.root / f"host-{self.n:03d}-{self.generation}", ignore_errors=True)

    def requests(self) -> Counter:
        out = Counter(self.by_path)
        if self.tier is not None:
            out.update(self.objects.by_path)
        return out

    def sample_memory(self) -> None:
        b = self.bucket
        for k, v in (("index_entries", len(b.index)), ("index_bytes", b.index.nbytes),
                     ("absent_keys", len(b.absent)), ("catalog", len(b.catalog))):
            self.peak[k] = max(self.peak[k], v)

    # -------------------------------------------------------------- events
    def _slot_for(self, s: Session) -> tuple[int, bool]:
        for i, held in enumerate(self.slots):
            if held is s:
                return i, True
        for i, held in enumerate(self.slots):
            if held is None:
                return i, False
        return min(range(len(self.slots)), key=lambda i: self.used[i]), False

    async def spill(self, slot: int) -> None:
        """The conversation in ``slot`` committed locally as its session's spill (the older one
        deleted), as the session tier does before an eviction."""
        s = self.slots[slot]
        if s is None or not s.tokens:
            return
        from ocache.tiers.spill import hint_key

        meta: dict[str, Any] = {"session": hint_key(s.hint()), "kind": "agent", "checkpoints": []}
        toks = list(s.tokens)
        old = self.spilled.get(s.sid)
        e = await asyncio.to_thread(write_entry, self.store, "s", toks,
                                    len(toks) * self.cfg.state_bytes_per_token, meta)
        if old and old != e.key:
            await asyncio.to_thread(self.store.delete, old, "superseded by a newer spill")
        self.spilled[s.sid] = e.key
        self.spills += 1
        self.slots[slot] = None

    def _local_usable(self, s: Session, prompt: list[int], slot: int, resident: bool) -> int:
        if resident:
            return len(prompt) - 1
        best = 0
        key = self.spilled.get(s.sid)
        mine = self.store.get(key) if key else None
        if mine is not None:
            best = mine.n_tokens
        from ocache.tiers.store import entry_key

        if self.store.get(entry_key(IDENTITY, "a", s.head)) is not None:
            best = max(best, len(s.head))
        return best

    async def turn(self, s: Session) -> None:
        from ocache.tiers.remote import RemoteTierError
        from ocache.tiers.store import entry_key

        first = not s.tokens
        self.turns += 1
        self.new_sessions += first
        prompt = s.next_prompt()
        view = SimpleNamespace(tokens=prompt, head_end=len(s.head), user_starts=[len(s.head)])
        ctx = SimpleNamespace(kind="agent", session=s.hint(), head_len=len(s.head))
        before = Counter(self.objects.by_path)
        t0 = time.perf_counter()
        offer = await on_path("lookup", self.tier.lookup(view, ctx))
        spent = time.perf_counter() - t0
        delta = self.objects.by_path - before
        n_cands = len(self.tier.candidates(IDENTITY, view, ctx))
        self.lookups.append((spent, n_cands, sum(v for (p, _), v in delta.items() if p == "lookup"),
                             delta[("lookup", "LIST")], len(prompt), time.time()))
        slot, resident = self._slot_for(s)
        if not resident and self.slots[slot] is not None:
            await self.spill(slot)
        local = self._local_usable(s, prompt, slot, resident)
        if offer is not None:
            self.note("offer", offer.ref.key, offer.tokens_usable)
        if offer is not None and offer.tokens_usable > local:
            t1 = time.perf_counter()
            try:
                await on_path("fetch", self.tier.bring(offer, slot))
                self.bring_s.append(time.perf_counter() - t1)
                await on_path("after", self.tier.admit(view, slot, {"timings": {"cache_n": offer.tokens_usable}}))
                self.hits += 1
            except RemoteTierError as exc:
                self.bring_failed[exc.reason] += 1
        self.slots[slot] = s
        self.used[slot] = time.monotonic()
        s.turns_done += 1
        if first and len(s.head) >= self.cfg.min_tokens and self.store.get(entry_key(IDENTITY, "a", s.head)) is None:
            await asyncio.to_thread(write_entry, self.store, "a", s.head,
                                    len(s.head) * self.cfg.state_bytes_per_token)
            self.anchors += 1

    async def restart(self) -> None:
        """A planned stop (every slot spilled, the tier's drain uploads them), then the host back
        on an empty disk."""
        for i in range(len(self.slots)):
            await self.spill(i)
        await on_path("drain", self.tier.on_drain(None))
        self.sample_memory()
        await self.close(wipe=True)
        self.generation += 1
        self.spilled.clear()
        self.restarts += 1
        await self.open()

    async def probe(self, key: str, t_commit: float) -> None:
        """Read ``key`` by key (``RemoteBucket.entry``, what a lookup asks) until it answers, every
        ``probe_interval_s``, at most ``probe_timeout_s``; notes ``found`` with ``[seconds since
        t_commit (wall), reads it took]``, or ``lost``."""
        end = time.monotonic() + self.cfg.probe_timeout_s
        tries = 0
        while True:
            tries += 1
            try:
                r = await on_path("probe", self.bucket.entry(key))
            except Exception as exc:  # noqa: BLE001 - noted, asked again
                log.info("probe %s: %s", key[:12], exc)
                r = None
            if r is not None:
                self.note("found", key, [time.time() - t_commit, tries])
                return
            if time.monotonic() > end:
                self.note("lost", key, time.time() - t_commit)
                return
            await asyncio.sleep(self.cfg.probe_interval_s)


# ---------------------------------------------------------------------------------------- a worker
def worker_main(cfg_d: dict, worker: int, host_ids: list[int], settings: dict, root: str, conn: Any) -> None:
    """A worker process: its hosts on one event loop; talks with the parent over ``conn``
    (sends ``("ready",)``, then commits ``("commit", key, t, host)`` as they happen and
    ``("done", results)``; receives ``("go", t0)`` and ``("probe", host, key, t_commit)``)."""
    logging.basicConfig(level=logging.WARNING, format=f"worker {worker}: %(levelname)s %(name)s: %(message)s")
    cfg = FleetConfig(**cfg_d)
    try:
        asyncio.run(_worker(cfg, worker, host_ids, settings, Path(root), conn))
    except BaseException as exc:
        import traceback

        conn.send(("failed", worker, "".join(traceback.format_exception(exc))[-4000:]))
        raise


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: Counter = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        self.seen[str(record.msg)[:90]] += 1     # by message template


async def _worker(cfg: FleetConfig, worker: int, host_ids: list[int], settings: dict, root: Path, conn: Any) -> None:
    await _Worker(cfg, worker, host_ids, settings, root, conn).run()


class _Worker:
    """One worker's hosts and its side of the parent's pipe (see :func:`worker_main`)."""

    def __init__(self, cfg: FleetConfig, worker: int, host_ids: list[int], settings: dict, root: Path,
                 conn: Any) -> None:
        self.cfg, self.worker, self.conn = cfg, worker, conn
        self.outbox: list = []
        self.hosts = {n: Host(n, cfg, settings, root, self.outbox) for n in host_ids}
        self.probes: set[asyncio.Task] = set()
        self.lags: list[float] = []
        self.samples: list[tuple[float, int]] = []
        self.t0 = 0.0

    def readable(self) -> None:
        """The parent's messages: ``go`` (the day's start), ``probe``, ``end`` (no more probes)."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                if not self.conn.poll():
                    return
                msg = self.conn.recv()
            except (EOFError, OSError):      # the parent is gone: nothing more to wait for
                loop.remove_reader(self.conn.fileno())
                for f in self.waits.values():
                    if not f.done():
                        f.set_exception(RuntimeError("sim-fleet: the parent closed its pipe"))
                return
            if msg[0] in ("go", "end") and not self.waits[msg[0]].done():
                self.waits[msg[0]].set_result(msg[1] if len(msg) > 1 else None)
            elif msg[0] == "probe":
                t = loop.create_task(self.hosts[msg[1]].probe(msg[2], msg[3]))
                self.probes.add(t)
                t.add_done_callback(self.probes.discard)

    async def run_host(self, h: Host) -> None:
        cfg = self.cfg
        for t, what, arg in schedule(cfg, h.n):
            wait = self.t0 + t / cfg.compression - time.time()
            if wait > 0:
                await asyncio.sleep(wait)
            else:
                self.lags.append(-wait)
            try:
                await (h.turn(arg) if what == "turn" else h.restart())
            except Exception as exc:  # noqa: BLE001 - counted; the day goes on
                h.counters[f"sim_error_{type(exc).__name__}"] += 1
                log.warning("host %d %s: %s: %s", h.n, what, type(exc).__name__, exc)

    async def background(self) -> None:
        """Commits to the parent as they happen; memory sampled every ``sample_s``."""
        next_sample = 0.0
        while True:
            while self.outbox:
                self.conn.send(self.outbox.pop(0))
            if time.monotonic() >= next_sample:
                self.samples.append((time.time() - self.t0, rss_bytes()))
                for h in self.hosts.values():
                    h.sample_memory()
                next_sample = time.monotonic() + self.cfg.sample_s
            await asyncio.sleep(0.02)

    async def run(self) -> None:
        cfg, conn = self.cfg, self.conn
        warnings = _Warnings()
        logging.getLogger().addHandler(warnings)
        rss = {"start": rss_bytes()}
        for h in self.hosts.values():
            await h.open()
        rss["open"] = rss_bytes()
        loop = asyncio.get_running_loop()
        self.waits = {"go": loop.create_future(), "end": loop.create_future()}
        loop.add_reader(conn.fileno(), self.readable)
        conn.send(("ready", self.worker))
        self.t0 = float(await asyncio.wait_for(self.waits["go"], cfg.open_timeout_s))
        bg = loop.create_task(self.background())
        await asyncio.gather(*(self.run_host(h) for h in self.hosts.values()))
        # the day is over: the last uploads, then the probes of what they committed, until the
        # parent's ("end",) once every worker flushed
        for h in self.hosts.values():
            await on_path("drain", h.tier.flush())
            h.sample_memory()
        self.samples.append((time.time() - self.t0, rss_bytes()))
        bg.cancel()
        while self.outbox:
            conn.send(self.outbox.pop(0))
        conn.send(("flushed", self.worker))
        # (the slowest worker may flush much later: the parent's own bound for the day)
        await asyncio.wait_for(self.waits["end"], cfg.duration_s * 3 + 300 + cfg.probe_timeout_s)
        if self.probes:
            await asyncio.wait(set(self.probes), timeout=cfg.probe_timeout_s + 10)
        loop.remove_reader(conn.fileno())
        out: dict[str, Any] = {"worker": self.worker, "rss": rss, "rss_samples": self.samples, "lags": self.lags,
                               "hosts": [], "warnings": dict(warnings.seen.most_common(8))}
        for h in self.hosts.values():
            await h.close(wipe=False)
            out["hosts"].append({
                "n": h.n, "requests": [[p, k, v] for (p, k), v in h.requests().items()],
                "lookups": h.lookups, "bring_s": h.bring_s, "bring_failed": dict(h.bring_failed),
                "hits": h.hits, "spills": h.spills, "anchors": h.anchors, "restarts": h.restarts,
                "turns": h.turns, "new_sessions": h.new_sessions, "counters": dict(h.counters),
                "active_s": h.active_s, "peak": h.peak, "events": h.events})
        conn.send(("done", out))


# ---------------------------------------------------------------------------------------- the parent
async def _observe(settings: dict, budget: int, t0: float, every: float, out: list) -> None:
    """List the bucket every ``every`` seconds: ``(wall s since t0, records, data bytes)``."""
    from ocache.tiers.remote_bucket import DATA, RECORDS
    from ocache.tiers.remote_client import S3Objects

    async with S3Objects(settings["url"], endpoint_url=settings.get("endpoint_url"),
                         region=settings.get("region")) as o:
        while True:
            try:
                recs = await o.list(RECORDS)
                data = await o.list(DATA)
                out.append((time.time() - t0, len(recs), sum(x.size for x in data)))
            except Exception as exc:  # noqa: BLE001 - a missed sample
                log.warning("observer: %s", exc)
            await asyncio.sleep(every)


def split_hosts(hosts: int, workers: int) -> list[list[int]]:
    """Host numbers 0..hosts-1 dealt to ``workers`` (at most ``hosts``) in turn."""
    workers = max(1, min(workers, hosts))
    return [list(range(w, hosts, workers)) for w in range(workers)]


class _Relay:
    """The parent's side of the workers' pipes: who is ready, flushed and done, the commits (each
    relayed at once to a random other host as a ``probe``), a worker's failure. Every message of a
    worker is read in order, so its commits are relayed before its ``flushed``."""

    def __init__(self, cfg: FleetConfig, groups: list[list[int]], conns: list) -> None:
        self.cfg, self.groups, self.conns = cfg, groups, conns
        self.where = {n: w for w, g in enumerate(groups) for n in g}
        self.rng = random.Random(f"{cfg.seed}-probes")
        self.ready: set[int] = set()
        self.flushed: set[int] = set()
        self.done: dict[int, dict] = {}
        self.commits: list[tuple[str, float, int]] = []
        self.failed: list[str] = []
        self.changed = asyncio.Event()
        self.loop = asyncio.get_running_loop()
        for w, c in enumerate(conns):
            self.loop.add_reader(c.fileno(), self.readable, w)

    def readable(self, w: int) -> None:
        c = self.conns[w]
        try:
            while c.poll():
                msg = c.recv()
                if msg[0] == "ready":
                    self.ready.add(w)
                elif msg[0] == "commit":
                    _, key, t, host, _ = msg
                    self.commits.append((key, t, host))
                    if self.cfg.hosts > 1:
                        other = self.rng.choice([n for n in range(self.cfg.hosts) if n != host])
                        self.conns[self.where[other]].send(("probe", other, key, t))
                elif msg[0] == "flushed":
                    self.flushed.add(w)
                elif msg[0] == "done":
                    self.done[w] = msg[1]
                    self.loop.remove_reader(c.fileno())
                elif msg[0] == "failed":
                    self.failed.append(msg[2])
                    self.loop.remove_reader(c.fileno())
                self.changed.set()
        except (EOFError, OSError):
            self.loop.remove_reader(c.fileno())
            self.failed.append(f"worker {w}: its pipe closed")
            self.changed.set()

    async def until(self, cond: Any, timeout: float, what: str) -> None:
        """Wait until ``cond()`` holds, at most ``timeout`` seconds (TimeoutError); RuntimeError at
        once when a worker failed."""
        end = time.monotonic() + timeout
        while not cond():
            if self.failed:
                raise RuntimeError("a worker failed:\n" + "\n".join(self.failed))
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"sim-fleet: {what} not within {timeout:.0f} s")
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), min(left, 1.0))
            except asyncio.TimeoutError:
                pass

    def send(self, msg: tuple) -> None:
        for c in self.conns:
            c.send(msg)

    def close(self) -> None:
        for c in self.conns:
            try:
                self.loop.remove_reader(c.fileno())
            except (ValueError, OSError):
                pass


async def _conduct(cfg: FleetConfig, settings: dict, root: Path) -> dict:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    groups = split_hosts(cfg.hosts, cfg.workers)
    conns, procs = [], []
    for w, g in enumerate(groups):
        mine, theirs = ctx.Pipe()
        p = ctx.Process(target=worker_main, args=(dataclasses.asdict(cfg), w, g, settings, str(root), theirs),
                        name=f"sim-fleet-{w}", daemon=True)
        p.start()
        theirs.close()
        conns.append(mine)
        procs.append(p)
    relay = _Relay(cfg, groups, conns)
    samples: list = []
    observer = None
    try:
        t_open = time.time()
        await relay.until(lambda: len(relay.ready) == len(groups), cfg.open_timeout_s, "the hosts' start")
        opened_s = time.time() - t_open
        log.warning("sim-fleet: %d hosts open in %d workers after %.0f s; the day starts (%.0f s)", cfg.hosts,
                    len(groups), opened_s, cfg.duration_s)
        t0 = time.time() + 0.5
        load0 = os.getloadavg()
        relay.send(("go", t0))
        observer = asyncio.create_task(_observe(settings, cfg.budget_bytes // cfg.scale, t0, cfg.sample_s, samples))
        await relay.until(lambda: len(relay.flushed) == len(groups), cfg.duration_s * 3 + 300, "the day")
        day_wall = time.time() - t0
        load1 = os.getloadavg()
        log.warning("sim-fleet: the day ran in %.0f s; %d records committed; waiting for the last probes",
                    day_wall, len(relay.commits))
        relay.send(("end",))
        await relay.until(lambda: len(relay.done) == len(groups), cfg.probe_timeout_s + 300, "the workers' results")
    finally:
        if observer is not None:
            observer.cancel()
        relay.close()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    return {"config": dataclasses.asdict(cfg), "groups": groups, "opened_s": opened_s, "day_wall_s": day_wall,
            "t0": t0, "load": [load0, load1], "workers": [relay.done[w] for w in sorted(relay.done)],
            "commits": relay.commits, "bucket": samples}


def run(cfg: FleetConfig, settings: dict, root: Path) -> "FleetResult":
    """Run the fleet's day against the bucket of ``settings`` (``store.remote``: url, endpoint_url,
    region; its credentials in the environment, which the workers inherit), the hosts' stores
    under ``root``. Returns the measurements (:class:`FleetResult`). Raises RuntimeError (a worker
    failed: its traceback), TimeoutError (a phase past its bound: the hosts' start
    ``open_timeout_s``, the day ``3 x duration_s + 300`` s)."""
    root.mkdir(parents=True, exist_ok=True)
    return FleetResult(asyncio.run(_conduct(cfg, settings, root)))


# ---------------------------------------------------------------------------------------- results
def pct(xs: Sequence[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


class FleetResult:
    """The raw results of :func:`run` (``raw``, JSON-able) and what the table reads from them."""

    def __init__(self, raw: dict) -> None:
        self.raw = raw
        self.cfg = FleetConfig(**raw["config"])
        self.hosts = [h for w in raw["workers"] for h in w["hosts"]]

    def requests(self, path: str | None = None) -> Counter:
        """Requests to the bucket by kind, over every host (``path``: only that path's)."""
        out: Counter = Counter()
        for h in self.hosts:
            for p, k, v in h["requests"]:
                if path is None or p == path:
                    out[k] += v
        return out

    def per_host(self, path: str, kind: str) -> list[int]:
        return [sum(v for p, k, v in h["requests"] if p == path and k == kind) for h in self.hosts]

    @property
    def lookups(self) -> list[list]:
        return [lk for h in self.hosts for lk in h["lookups"]]

    def events(self, what: str) -> list[tuple]:
        return [tuple(e) for h in self.hosts for e in h["events"] if e[0] == what]

    def convergence(self) -> dict:
        """Commits, probes answered (``found``: delays in s; ``retried``: how many needed more than
        one read) or not (``lost``, ``lost_deleted``:
        the record was deleted, by eviction, before the probe read it), and the first offer of a
        committed entry by another host (wall s after the commit)."""
        found = [e[4][0] for e in self.events("found")]
        retried = sum(1 for e in self.events("found") if e[4][1] > 1)
        deleted = {e[1] for e in self.events("delete")}
        lost = [e for e in self.events("lost")]
        commits = {c[0]: (c[1], c[2]) for c in self.raw["commits"]}
        first: dict[str, float] = {}
        for _, key, t, host, _ in self.events("offer"):
            c = commits.get(key)
            if c is not None and host != c[1] and t >= c[0]:
                first[key] = min(first.get(key, math.inf), t - c[0])
        return {"commits": len(self.raw["commits"]), "found": found, "retried": retried,
                "lost": [e for e in lost if e[1] not in deleted], "lost_deleted": [e for e in lost if e[1] in deleted],
                "first_offer": list(first.values())}

    def table(self) -> str:
        """The markdown tables of the run (see ``scripts/sim-fleet``): the run, requests by kind and
        path, lookups, memory, convergence, the bucket over time."""
        parts = [self._summary(), self._requests(), self._lookups(), self._memory(), self._convergence(),
                 self._bucket()]
        return "\n".join(line for p in parts for line in p)

    def _summary(self) -> list[str]:
        """How the run went and what the hosts did."""
        cfg, raw = self.cfg, self.raw
        wall = raw["day_wall_s"]
        lines: list[str] = []
        hosts = len(self.hosts)
        tot = lambda key: sum(h[key] for h in self.hosts)   # noqa: E731
        lags = [x for w in raw["workers"] for x in w["lags"]]
        lines.append(f"{hosts} hosts in {len(raw['workers'])} worker processes "
                     f"({', '.join(str(len(g)) for g in raw['groups'])} hosts), one SeaweedFS; a day of "
                     f"{cfg.day_s / 3600:.0f} h in {wall:.0f} s of wall time (x{cfg.compression:.0f}; scheduled "
                     f"{cfg.duration_s:.0f} s; events late by p50 {pct(lags, .5):.2f} s, p95 {pct(lags, .95):.2f} s, "
                     f"max {max(lags, default=0):.2f} s); hosts opened in {raw['opened_s']:.0f} s; load average "
                     f"(1, 5, 15 min) {', '.join(f'{x:.1f}' for x in raw['load'][0])} at the start, "
                     f"{', '.join(f'{x:.1f}' for x in raw['load'][1])} at the end.")
        lines.append("")
        lines.append(f"Requests: {tot('turns')} turns ({tot('new_sessions')} new sessions, "
                     f"{tot('turns') - tot('new_sessions')} next turns), {tot('restarts')} restarts on an empty disk; "
                     f"{tot('spills')} spills and {tot('anchors')} anchors committed locally; "
                     f"{sum(h['counters'].get('uploads', 0) for h in self.hosts)} uploads committed, "
                     f"{tot('hits')} downloads restored and confirmed "
                     f"({sum(sum(h['bring_failed'].values()) for h in self.hosts)} failed: "
                     f"{dict(sum((Counter(h['bring_failed']) for h in self.hosts), Counter()))}).")
        lines.append("")
        return lines

    def _requests(self) -> list[str]:
        """Requests to the bucket by kind and path."""
        lines: list[str] = []
        lk = self.lookups
        paths = [("lookup", "a lookup (request path)"), ("fetch", "a download (request path)"),
                 ("after", "after a hit (use object)"), ("background", "background sync"),
                 ("drain", "drains and the last flush"), ("probe", "convergence probes")]
        n_look = max(1, len(lk))
        n_fetch = max(1, sum(len(h["bring_s"]) + sum(h["bring_failed"].values()) for h in self.hosts))
        lines.append("| requests | " + " | ".join(KINDS) + " |")
        lines.append("|---|" + "---:|" * len(KINDS))
        for p, label in paths:
            c = self.requests(p)
            lines.append(f"| {label}: total | " + " | ".join(f"{c[k]:,}" for k in KINDS) + " |")
            if p == "lookup":
                lines.append(f"| per lookup ({len(lk):,}) | " + " | ".join(f"{c[k] / n_look:.2f}" for k in KINDS) + " |")
            if p == "fetch":
                lines.append(f"| per download ({n_fetch:,}) | " + " | ".join(f"{c[k] / n_fetch:.2f}" for k in KINDS) + " |")
            if p in ("fetch", "background"):
                label = "request path (lookups and downloads)" if p == "fetch" else "background"
                act = [max(1e-9, h["active_s"]) for h in self.hosts]
                per = [[v / a for v, a in zip(self.per_host(p, k) if p == "background" else
                                              [x + y for x, y in zip(self.per_host("lookup", k), self.per_host("fetch", k))],
                                              act)] for k in KINDS]
                lines.append(f"| {label}, per host per second open: mean / max host | "
                             + " | ".join(f"{sum(x) / max(1, len(x)):.2f} / {max(x, default=0):.2f}" for x in per) + " |")
        allc = self.requests()
        span = max(h["active_s"] for h in self.hosts)
        lines.append(f"| every host, per second of the run ({span:.0f} s, what the bucket served) | "
                     + " | ".join(f"{allc[k] / span:.1f}" for k in KINDS) + " |")
        lines.append("")
        return lines

    def _lookups(self) -> list[str]:
        """Lookups by prompt length and by the bucket's size when they ran."""
        raw = self.raw
        lines: list[str] = []
        lk = self.lookups
        lines.append("| lookups | n | p50 ms | p95 ms | max ms | candidate lengths: mean / max | requests: mean / max | LISTs |")
        lines.append("|---|---:|---:|---:|---:|---:|---:|---:|")
        bins = [("all", lambda x: True)]
        bins += [(f"prompt {lo // 1000}k-{hi // 1000}k tokens" if hi < 10**9 else f"prompt {lo // 1000}k tokens or more", (lambda lo, hi: lambda x: lo <= x[4] < hi)(lo, hi))
                 for lo, hi in ((0, 8000), (8000, 16000), (16000, 32000), (32000, 10**9))]
        samples = raw["bucket"]
        t0 = raw["t0"]

        def records_at(t: float) -> int:
            n = 0
            for ts, recs, _ in samples:
                if t0 + ts > t:
                    break
                n = recs
            return n

        sizes = sorted(records_at(x[5]) for x in lk)
        mid = sizes[len(sizes) // 2] if sizes else 0
        bins.append((f"bucket below {mid:,} records", lambda x: records_at(x[5]) < mid))
        bins.append((f"bucket at {mid:,} records or more", lambda x: records_at(x[5]) >= mid))
        for label, f in bins:
            xs = [x for x in lk if f(x)]
            if not xs:
                continue
            s = [x[0] for x in xs]
            lines.append(f"| {label} | {len(xs):,} | {pct(s, .5) * 1e3:.1f} | {pct(s, .95) * 1e3:.1f} | "
                         f"{max(s) * 1e3:.1f} | {sum(x[1] for x in xs) / len(xs):.1f} / {max(x[1] for x in xs)} | "
                         f"{sum(x[2] for x in xs) / len(xs):.1f} / {max(x[2] for x in xs)} | {sum(x[3] for x in xs)} |")
        lines.append("")
        return lines

    def _memory(self) -> list[str]:
        """RSS per worker and host; the largest of each host's structures."""
        raw = self.raw
        wall = raw["day_wall_s"]
        lines: list[str] = []
        rs = raw["workers"]
        per_host_open = [(w["rss"]["open"] - w["rss"]["start"]) / max(1, len(w["hosts"])) for w in rs]
        per_host_end = [(max(r for _, r in w["rss_samples"]) - w["rss"]["start"]) / max(1, len(w["hosts"])) for w in rs]
        quarter = []
        for w in rs:
            ss = w["rss_samples"]
            q = [r for t, r in ss if t >= wall / 4]
            quarter.append((q[0] if q else ss[-1][1], ss[-1][1]))
        mb = 1e6
        lines.append("| memory | value |")
        lines.append("|---|---|")
        starts = ", ".join(f"{w['rss']['start'] / mb:.0f}" for w in rs)
        lines.append(f"| RSS of a worker before its hosts (imports) | {starts} MB |")
        lines.append(f"| RSS per host, hosts open (worker's growth / its hosts) | {', '.join(f'{x / mb:.1f}' for x in per_host_open)} MB |")
        lines.append(f"| RSS per host, the day's peak | {', '.join(f'{x / mb:.1f}' for x in per_host_end)} MB |")
        lines.append(f"| RSS of each worker at a quarter of the day -> its end | "
                     f"{', '.join(f'{a / mb:.0f} -> {b / mb:.0f}' for a, b in quarter)} MB |")
        pk = lambda k: max((h["peak"][k] for h in self.hosts), default=0)   # noqa: E731
        lines.append(f"| a host's index, the day's largest | {pk('index_entries')} entries, "
                     f"{pk('index_bytes') / mb:.2f} MB (bounds: 4,096 entries, 64 MiB) |")
        lines.append(f"| a host's absent keys / catalog, the day's largest | {pk('absent_keys'):,} keys (bound 65,536) / "
                     f"{pk('catalog'):,} records (~470 bytes each) |")
        lines.append("")
        return lines

    def _convergence(self) -> list[str]:
        """From a record's commit to its read on another host."""
        cfg, raw = self.cfg, self.raw
        wall = raw["day_wall_s"]
        lines: list[str] = []
        cv = self.convergence()
        f = cv["found"]
        lines.append("| convergence of a new entry | value |")
        lines.append("|---|---|")
        lines.append(f"| records committed (create-only PUT answered) | {cv['commits']:,} |")
        lines.append(f"| read by key on another host (probe), from the commit | {len(f):,}: p50 {pct(f, .5) * 1e3:.0f} ms, "
                     f"p95 {pct(f, .95) * 1e3:.0f} ms, max {max(f, default=float('nan')) * 1e3:.0f} ms; "
                     f"{len(f) - cv['retried']:,} at the first read, {cv['retried']} after more |")
        lines.append(f"| not read within {cfg.probe_timeout_s:.0f} s | {len(cv['lost'])} (and {len(cv['lost_deleted'])} "
                     f"evicted before the probe read them) |")
        fo = cv["first_offer"]
        lines.append(f"| offered to another host's request, from the commit | {len(fo):,} entries: p50 "
                     f"{pct(fo, .5):.1f} s wall ({pct(fo, .5) * cfg.compression / 60:.0f} simulated min) |")
        lines.append("")
        return lines

    def _bucket(self) -> list[str]:
        """The bucket's bytes against its budget over time; evictions; warnings."""
        cfg, raw = self.cfg, self.raw
        wall = raw["day_wall_s"]
        lines: list[str] = []
        mb = 1e6
        budget = cfg.budget_bytes / cfg.scale
        lines.append(f"| wall s | simulated hour (as scheduled) | records | data MB | of the budget ({budget / mb:.0f} MB) |")
        lines.append("|---:|---:|---:|---:|---:|")
        samples = raw["bucket"]
        step = max(1, len(samples) // 12)
        for i, (t, n, b) in enumerate(samples):
            if i % step and i != len(samples) - 1:
                continue
            hour = min(cfg.day_s, t * cfg.compression) / 3600
            lines.append(f"| {t:.0f} | {hour:.1f} | {n:,} | {b / mb:.1f} | {b / budget:.0%} |")
        if samples:
            peak = max(samples, key=lambda s: s[2])
            lines.append(f"| the peak, at {peak[0]:.0f} s | | {peak[1]:,} | {peak[2] / mb:.1f} | {peak[2] / budget:.0%} |")
        evicted = sum(h["counters"].get("evicted", 0) for h in self.hosts)
        lines.append("")
        dels = self.events("delete")
        lines.append(f"Evicted for the budget, as the hosts count it: {evicted} entries "
                     f"({sum(h['counters'].get('evicted_bytes', 0) for h in self.hosts) / mb:.1f} MB) by "
                     f"{sum(1 for h in self.hosts if h['counters'].get('evicted', 0))} hosts; the records "
                     f"deleted: {len(dels)} DELETEs of {len({e[1] for e in dels})} distinct entries, by "
                     f"{len({e[3] for e in dels})} hosts.")
        warns: Counter = Counter()
        for w in raw["workers"]:
            warns.update(w["warnings"])
        if warns:
            lines.append("")
            lines.append("Warnings logged: " + "; ".join(f"{k!r} x{v}" for k, v in warns.most_common(5)))
        return lines

    def dump(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.raw))
