"""``ocache bench --preset long``: real-size conversations (32k / 64k / 128k tokens) on the tiny models,
ocache vs llama-server alone, side by side in one run.

Per model and size, two identically configured llama-servers (the tuned flags of configuration (b) in
``ocache.bench.run``: ``-np 2 -fa on --ctx-checkpoints 32 --checkpoint-min-step 1024 --cache-ram 0``,
``-c`` = 2 × the size + room): **direct** (clients talk to it) and **ocache** (``ocache serve`` with
its defaults in front of it, on the patched build, ``--slot-save-path`` given). Both get the same
requests, interleaved request by request (which path goes first alternates). The conversation is a
real opencode request (``opencode_agent_turn1.json`` from the shared fixtures) grown with this
repository's own source files as ``read`` tool calls + results up to the size; a second session
grows the same head with the files in another order. Steps (what the scenarios in ``scenarios/``
name them):

1. ``growth``: session A grown to the size (its prefill), then ``--turns`` warm next turns (one more
   small tool call + result each);
2. ``two sessions`` / ``A/B/A``: session B grown to the size (the other slot), then A, B, A next turns;
3. ``restart``: both llama-servers restarted (every slot empty) and the slot files dropped from the
   page cache (fsync + ``posix_fadvise(DONTNEED)``, no root needed), then A's next turn (ocache
   restores it from its disk/session tier, direct prefills it all) and one more turn.

Reported per size (``bench-long.md``, ``.json``, ``long-<model>.png``):

* added TTFT: time to first token through ocache minus direct, median of the warm-turn pairs in
  which both servers prefilled the same tokens (ms; the proxy's own cost), and the ratio of the
  medians (the per-request table shows the turns where the cache saved a prefill);
* decode tokens/s ratio: ocache / direct, median over the warm turns, at the client (SSE content
  events after the first, per second; each answer is ``max_tokens`` tokens, ``ignore_eos``) and the
  server's own ``timings.predicted_per_second``;
* restore bytes/s vs the disk's sequential read (cold): the state file ocache restored after the
  restart (named by llama-server's log line ``restored N tokens ... from FILE``) over its
  ``X-OCache-Restore-Ms`` (verify + restore), against a fresh same-size file read cold;
* prefill efficiency vs the oracle: oracle tokens (what an ideal cache prefills: a request's tokens
  beyond the longest prefix any earlier request shared, so only new tokens, the second session's
  head shared, and nothing lost at the restart) / tokens the ocache path's server prefilled
  (``llamacpp:prompt_tokens_total``, ocache's own warm-ups and splits included); the same for direct;
* ocache RSS (``VmRSS``) after every request (min / max over the size);
* bytes written per turn: ``write_bytes`` of ``/proc/PID/io`` of llama-server + ocache, per request
  (the slot files the server writes on ocache's saves, ocache's records).

Run time (2 cores, -t 1, loaded): 4.8 min at 32k, 30 min at 64k (a 64k prefill: 170-250 s; there the
direct side prefilled the whole conversation 6 times: B took A's slot), 24.9 min at 126k (a 126k
prefill: 240-345 s; B went to the other slot);
``--models dense`` is the default; ``--long-sizes`` picks sizes (``8192`` checks it in under a
minute). Not part of the test suite.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp

from ocache.llama.server import LlamaServer
from ocache.paths import repo_root

#: prompt tokens per size ("128k" is 126,000: it and its turns fit the 131,072 per slot)
SIZES = (32768, 65536, 126000)
RESTORED = re.compile(r"restored (\d+) tokens and \d+ context checkpoints from (\S+) \(")


def drop_cache(path: Path) -> None:
    """Evict ``path`` from the page cache (fsync + ``POSIX_FADV_DONTNEED``; no root needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def seq_read_cold_bps(dir: Path, nbytes: int) -> float:
    """Bytes/s of a sequential read (8 MiB reads) of a fresh ``nbytes`` file dropped from the page cache."""
    p = dir / "seqread.tmp"
    block = os.urandom(1 << 20)
    with open(p, "wb") as f:
        for _ in range(max(1, -(-nbytes // (1 << 20)))):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    drop_cache(p)
    t0 = time.perf_counter()
    n = 0
    with open(p, "rb", buffering=0) as f:
        while b := f.read(8 << 20):
            n += len(b)
    dt = time.perf_counter() - t0
    p.unlink()
    return n / dt


def proc_written(pid: int | None) -> int:
    """``write_bytes`` of ``/proc/PID/io`` (bytes the process caused to be written to storage), 0 if gone."""
    if not pid:
        return 0
    try:
        for line in Path(f"/proc/{pid}/io").read_text().splitlines():
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def rss_mib(pid: int | None) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def source_chunks(lines_per: int, seed: int = 0) -> list[tuple[str, str]]:
    """(path, numbered text) pieces of this repository's own files; ``seed`` rotates their order."""
    root = repo_root()
    files = sorted([*root.glob("ocache/**/*.py"), *root.glob("tests/*.py"), *root.glob("docs/*.md"),
                    *root.glob("patches/*.patch")])
    out = []
    for f in files:
        lines = f.read_text(errors="replace").splitlines(keepends=True)
        for i in range(0, len(lines), lines_per):
            out.append((str(f.relative_to(root)),
                        "".join(f"{i + j + 1:5d}\t{ln}" for j, ln in enumerate(lines[i:i + lines_per]))))
    k = (seed * 7919) % max(1, len(out))
    return out[k:] + out[:k]


class Conversation:
    """An opencode body that grows by assistant ``read`` calls and their results."""

    def __init__(self, base: dict, seed: int, max_tokens: int) -> None:
        self.body = copy.deepcopy(base)
        self.body.update(max_tokens=max_tokens, temperature=0, stream=True, ignore_eos=True,
                         stream_options={"include_usage": True})
        self.n = 0
        self.big = source_chunks(400, seed)
        self.small = source_chunks(30, seed + 1)
        self.bi = self.si = 0

    def add(self, path: str, text: str) -> None:
        self.n += 1
        cid = f"call_{self.n:05d}"
        self.body["messages"] += [
            {"role": "assistant", "content": "", "tool_calls": [{"id": cid, "type": "function", "function": {
                "name": "read", "arguments": json.dumps({"filePath": path, "offset": 1})}}]},
            {"role": "tool", "tool_call_id": cid, "content": f"<file>\n{text}</file>"}]

    def add_big(self) -> int:
        path, text = self.big[self.bi % len(self.big)]
        self.bi += 1
        self.add(path, text)
        return len(text)

    def add_small(self) -> None:
        path, text = self.small[self.si % len(self.small)]
        self.si += 1
        self.add(path, text)


async def count_tokens(s: aiohttp.ClientSession, base: str, body: dict) -> int:
    payload = {k: body[k] for k in ("messages", "tools", "tool_choice") if k in body}
    async with s.post(base + "/apply-template", json=payload) as r:
        prompt = (await r.json())["prompt"]
    async with s.post(base + "/tokenize", json={"content": prompt, "add_special": True,
                                                 "parse_special": True}) as r:
        return len((await r.json())["tokens"])


async def grow(s: aiohttp.ClientSession, base: str, conv: Conversation, target: int) -> int:
    """Add big pieces until the prompt is about ``target`` tokens (~3 characters per token of source,
    corrected by the server's count; each round aims at 80 % of what is missing, so the growth
    ends within one piece above ``target - 1500``); returns the prompt's tokens."""
    n = await count_tokens(s, base, conv.body)
    while n < target - 1500:
        chars = 0
        while chars / 3.0 < (target - n) * 0.8 and chars < 600_000:
            chars += conv.add_big()
        n = await count_tokens(s, base, conv.body)
    return n


async def metric(s: aiohttp.ClientSession, base: str, name: str) -> float:
    async with s.get(base + "/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return 0.0


async def chat(s: aiohttp.ClientSession, base: str, body: dict) -> dict:
    """One streamed chat request: TTFT, decode tokens/s (client side), the server's timings, headers."""
    for attempt in (0, 1):  # llama-server may close a kept-alive connection after a stream
        try:
            return await _chat(s, base, body)
        except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
            if attempt:
                raise
    raise AssertionError("unreachable")


async def _chat(s: aiohttp.ClientSession, base: str, body: dict) -> dict:
    t0 = time.perf_counter()
    times: list[float] = []
    timings: dict = {}
    async with s.post(base + "/v1/chat/completions", json=body,
                      timeout=aiohttp.ClientTimeout(total=7200)) as r:
        if r.status != 200:
            raise RuntimeError(f"{base}: HTTP {r.status}: {(await r.read())[:300]!r}")
        headers = {k: v for k, v in r.headers.items() if k.lower().startswith("x-ocache")}
        buf = b""
        async for chunk in r.content.iter_any():
            now = time.perf_counter()
            buf += chunk
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                if not ev.startswith(b"data: ") or ev == b"data: [DONE]":
                    continue
                obj = json.loads(ev[6:])
                if any((c.get("delta") or {}).get("content") or (c.get("delta") or {}).get("tool_calls")
                       or (c.get("delta") or {}).get("reasoning_content") for c in obj.get("choices") or ()):
                    times.append(now)
                timings = obj.get("timings") or timings
    if not times:
        raise RuntimeError(f"{base}: no token in the stream")
    rate = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 2 and times[-1] > times[0] else None
    return {"ttft_s": times[0] - t0, "decode_tps": rate, "server_decode_tps": timings.get("predicted_per_second"),
            "prompt_n": timings.get("prompt_n"),
            "cache_n": timings.get("cache_n"), "prompt_ms": timings.get("prompt_ms"), "headers": headers}


class Side:
    """One path: its llama-server, and ``ocache serve`` in front of it or not."""

    def __init__(self, name: str, binary: Path, model: Path, ctx: int, work: Path, threads: int,
                 proxy: bool) -> None:
        from ocache.bench.run import OCacheProcess

        self.name = name
        self.slots = work / f"{name}-slots"
        self.log = work / f"{name}-llama-server.log"
        self.srv = LlamaServer(binary=binary, model=model, n_parallel=2, ctx_size=ctx, threads=threads,
                               flash_attn="on", ctx_checkpoints=32, checkpoint_min_step=1024, cache_ram=0,
                               slot_save_path=self.slots if proxy else None, log_path=self.log)
        self.proxy = (OCacheProcess(self.srv.url, work / f"{name}-cache", work / f"{name}-ocache.log",
                                    slot_save_path=self.slots) if proxy else None)

    @property
    def url(self) -> str:
        return self.proxy.url if self.proxy else self.srv.url

    def pids(self) -> list[int]:
        return [p.pid for p in (self.srv.proc, self.proxy.proc if self.proxy else None) if p]

    def start(self) -> None:
        self.srv.start(timeout=600)
        if self.proxy:
            self.proxy.start()

    def stop(self) -> None:
        if self.proxy:
            self.proxy.stop()
        self.srv.stop()


def oracle_new(prompts: list[list[int]], tokens: list[int]) -> int:
    """Tokens an ideal cache prefills for ``tokens``: those beyond the longest prefix shared with any
    earlier prompt in ``prompts`` (pure; at least 1: the server always evaluates the last token)."""
    from ocache.llama.reuse import common_prefix

    best = max((common_prefix(p, tokens) for p in prompts), default=0)
    return max(1, len(tokens) - best)


async def tokens_of(s: aiohttp.ClientSession, base: str, body: dict) -> list[int]:
    payload = {k: body[k] for k in ("messages", "tools", "tool_choice") if k in body}
    async with s.post(base + "/apply-template", json=payload) as r:
        prompt = (await r.json())["prompt"]
    async with s.post(base + "/tokenize", json={"content": prompt, "add_special": True,
                                                 "parse_special": True}) as r:
        return (await r.json())["tokens"]


class Steps:
    """The requests of one size's run (``run_size``), each sent to both sides in turn (which side
    goes first alternates) and measured: the tokens, the grid oracle's new tokens
    (``oracle_new``), and per side the answer (``chat``), the server's prefill
    (``llamacpp:prompt_tokens_total``, tokens), the bytes its processes wrote and ocache's RSS (MiB).
    ``rows``: one dict per request; ``srv_url``: the stock server that tokenizes (set again after
    a restart)."""

    def __init__(self, http: aiohttp.ClientSession, sides: list[Side], size: int) -> None:
        self.http, self.sides, self.size = http, sides, size
        self.srv_url = sides[0].srv.url
        self.rows: list[dict] = []
        self.prompts: list[list[int]] = []
        self.order = 0

    async def step(self, label: str, conv: Conversation, warm: bool) -> None:
        s = self.http
        toks = await tokens_of(s, self.srv_url, conv.body)
        row: dict[str, Any] = {"label": label, "tokens": len(toks), "warm": warm,
                               "oracle": oracle_new(self.prompts, toks)}
        self.prompts.append(toks)
        seq = self.sides if self.order % 2 == 0 else self.sides[::-1]
        self.order += 1
        for sd in seq:
            p0 = await metric(s, sd.srv.url, "llamacpp:prompt_tokens_total")
            w0 = sum(proc_written(p) for p in sd.pids())
            res = await chat(s, sd.url, conv.body)
            res["prefilled"] = await metric(s, sd.srv.url, "llamacpp:prompt_tokens_total") - p0
            res["written"] = sum(proc_written(p) for p in sd.pids()) - w0
            if sd.proxy:
                proc = sd.proxy.proc
                res["rss_mib"] = rss_mib(proc.pid if proc is not None else None)
            row[sd.name] = res
        d, o = row["direct"], row["ocache"]
        self.rows.append(row)
        print(f"  {self.size:>6} {label:22} {len(toks):7d} tok  prefilled d/o/oracle "
              f"{d['prefilled']:7.0f}/{o['prefilled']:7.0f}/{row['oracle']:6d}  ttft d/o "
              f"{d['ttft_s'] * 1e3:8.1f}/{o['ttft_s'] * 1e3:8.1f} ms  tier {o['headers'].get('X-OCache-Tier')}"
              f"  rss {o.get('rss_mib', 0):.0f} MiB  written {o['written'] / 1e6:.1f} MB", flush=True)


async def run_size(binary_stock: Path, binary_patched: Path, model: Path, size: int, a: Any,
                   work: Path, fixture: Path) -> dict:
    # two slots of the size plus room: the growth overshoots by up to one piece, and the turns after
    # it add ~10 small ones (a 126k run with 131,072 per slot failed when B grew to 131,328)
    ctx = 2 * (size + 16384)
    work.mkdir(parents=True, exist_ok=True)
    sides = [Side("direct", binary_stock, model, ctx, work, a.threads or 1, proxy=False),
             Side("ocache", binary_patched, model, ctx, work, a.threads or 1, proxy=True)]
    for sd in sides:
        sd.start()
    base = json.loads(fixture.read_text())
    rows: list[dict] = []
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            srv_url = sides[0].srv.url
            A = Conversation(base, 0, a.long_max_tokens)
            B = Conversation(base, 5, a.long_max_tokens)
            steps = Steps(s, sides, size)
            step, rows = steps.step, steps.rows
            await grow(s, srv_url, A, size)
            await step("growth: A grown", A, False)
            for k in range(a.long_turns):
                A.add_small()
                await step(f"growth: A turn {k + 1}", A, True)
            await grow(s, srv_url, B, size)
            await step("two sessions: B grown", B, False)
            for label, conv in (("A/B/A: A", A), ("A/B/A: B", B), ("A/B/A: A again", A)):
                conv.add_small()
                await step(label, conv, True)
            # restart: every slot empty, the slot files cold
            for sd in sides:
                if sd.proxy:
                    await asyncio.to_thread(sd.srv.restart, 600)
                    for f in sd.slots.glob("*"):
                        await asyncio.to_thread(drop_cache, f)
                else:
                    await asyncio.to_thread(sd.srv.restart, 600)
            srv_url = steps.srv_url = sides[0].srv.url
            A.add_small()
            log_mark = sides[1].log.stat().st_size
            await step("restart: A", A, False)
            restored = _restored_file(sides[1], log_mark)
            A.add_small()
            await step("restart: A turn", A, True)
            restore = None
            if restored is not None:
                nbytes = restored.stat().st_size
                ms = float(rows[-2]["ocache"]["headers"].get("X-OCache-Restore-Ms") or 0)
                disk = await asyncio.to_thread(seq_read_cold_bps, sides[1].slots, nbytes)
                restore = {"file": restored.name, "bytes": nbytes, "ms": ms, "disk_cold_bps": disk,
                           "bps": nbytes / (ms / 1000) if ms else None}
    finally:
        for sd in sides:
            sd.stop()
    return summarize(size, rows, restore)


def _restored_file(side: Side, offset: int) -> Path | None:
    """The slot file llama-server logged restoring after ``offset`` bytes of its log, or None."""
    try:
        with open(side.log, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    hits = RESTORED.findall(text)
    if not hits:
        return None
    p = side.slots / hits[-1][1]
    return p if p.exists() else None


def summarize(size: int, rows: list[dict], restore: dict | None) -> dict:
    warm = [r for r in rows if r["warm"]]
    # the proxy's own cost: warm turns where both servers prefilled the same tokens (elsewhere the
    # difference is what the cache saved, e.g. direct re-prefilling A after B took its slot)
    same = [r for r in warm if r["direct"]["prefilled"] == r["ocache"]["prefilled"]]
    added = [r["ocache"]["ttft_s"] - r["direct"]["ttft_s"] for r in same]
    dec = [r["ocache"]["decode_tps"] / r["direct"]["decode_tps"] for r in warm
           if r["ocache"]["decode_tps"] and r["direct"]["decode_tps"]]
    sdec = [r["ocache"]["server_decode_tps"] / r["direct"]["server_decode_tps"] for r in warm
            if r["ocache"].get("server_decode_tps") and r["direct"].get("server_decode_tps")]
    oracle = sum(r["oracle"] for r in rows)
    rss = [r["ocache"].get("rss_mib") for r in rows if r["ocache"].get("rss_mib") == r["ocache"].get("rss_mib")]
    return {
        "size": size, "tokens": rows[0]["tokens"], "rows": rows,
        "added_ttft_ms": statistics.median(added) * 1e3 if added else None,
        "same_prefill_pairs": len(same),
        "ttft_ratio": (statistics.median(r["ocache"]["ttft_s"] for r in same)
                       / statistics.median(r["direct"]["ttft_s"] for r in same)) if same else None,
        "decode_ratio": statistics.median(dec) if dec else None,
        "server_decode_ratio": statistics.median(sdec) if sdec else None,
        "oracle": oracle,
        "prefilled_direct": sum(r["direct"]["prefilled"] for r in rows),
        "prefilled_ocache": sum(r["ocache"]["prefilled"] for r in rows),
        "efficiency_direct": oracle / max(1.0, sum(r["direct"]["prefilled"] for r in rows)),
        "efficiency_ocache": oracle / max(1.0, sum(r["ocache"]["prefilled"] for r in rows)),
        "rss_min_mib": min(rss) if rss else None, "rss_max_mib": max(rss) if rss else None,
        "written_per_turn_mb": statistics.mean(r["ocache"]["written"] for r in rows) / 1e6,
        "restore": restore,
    }


def markdown(model: str, results: list[dict], wall_s: float, command: str) -> str:
    def f(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    out = [f"# ocache bench (long), {model} model\n", f"`{command}`: {wall_s / 60:.1f} min\n",
           "| size | prompt tokens | added TTFT (ms, median of warm pairs with equal prefill) | TTFT ratio o/d | decode tok/s o/d, client (server) "
           "| restore after restart: bytes/s vs disk seq. read (cold) | prefill efficiency vs oracle o (d) "
           "| ocache RSS MiB | written per turn (MB) |",
           "|---:|---:|---:|---:|---:|---|---|---|---:|"]
    for r in results:
        rs = r["restore"]
        rtxt = (f"{rs['bytes'] / 1e6:.1f} MB in {rs['ms']:.0f} ms: {rs['bps'] / 1e9:.2f} GB/s = "
                f"{rs['bps'] / rs['disk_cold_bps']:.2f} x {rs['disk_cold_bps'] / 1e9:.2f} GB/s"
                if rs and rs.get("bps") else "no restore")
        out.append(f"| {r['size']:,} | {r['tokens']:,} | {f(r['added_ttft_ms'], '+.1f')} | {f(r['ttft_ratio'], '.2f')} "
                   f"| {f(r['decode_ratio'], '.2f')} ({f(r.get('server_decode_ratio'), '.2f')}) | {rtxt} | {r['efficiency_ocache']:.3f} ({r['efficiency_direct']:.3f}) "
                   f"| {f(r['rss_min_mib'], '.0f')}–{f(r['rss_max_mib'], '.0f')} | {r['written_per_turn_mb']:.1f} |")
    out.append("\nPer request (prefilled: the server's `llamacpp:prompt_tokens_total` delta):\n")
    out.append("| size | step | tokens | oracle | prefilled d / o | TTFT d / o ms | tier |")
    out.append("|---:|---|---:|---:|---|---|---|")
    for r in results:
        for q in r["rows"]:
            out.append(f"| {r['size']:,} | {q['label']} | {q['tokens']:,} | {q['oracle']:,} | "
                       f"{q['direct']['prefilled']:,.0f} / {q['ocache']['prefilled']:,.0f} | "
                       f"{q['direct']['ttft_s'] * 1e3:.0f} / {q['ocache']['ttft_s'] * 1e3:.0f} | "
                       f"{q['ocache']['headers'].get('X-OCache-Tier', '-')} |")
    return "\n".join(out) + "\n"


def plot(model: str, results: list[dict], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(2, len(results), figsize=(5 * len(results), 7), squeeze=False)
    for i, r in enumerate(results):
        labels = [q["label"] for q in r["rows"]]
        x = range(len(labels))
        ax = axes[0][i]
        ax.plot(x, [q["direct"]["prefilled"] for q in r["rows"]], "o-", label="direct")
        ax.plot(x, [q["ocache"]["prefilled"] for q in r["rows"]], "s-", label="ocache")
        ax.plot(x, [q["oracle"] for q in r["rows"]], "k:", label="oracle")
        ax.set_title(f"{r['size']:,} tokens: prefilled per request")
        ax.set_xticks(list(x), labels, rotation=60, fontsize=7)
        ax.legend(fontsize=7)
        ax = axes[1][i]
        ax.plot(x, [q["direct"]["ttft_s"] for q in r["rows"]], "o-", label="direct")
        ax.plot(x, [q["ocache"]["ttft_s"] for q in r["rows"]], "s-", label="ocache")
        ax.set_yscale("log")
        ax.set_title("time to first token (s)")
        ax.set_xticks(list(x), labels, rotation=60, fontsize=7)
        ax.legend(fontsize=7)
    fig.suptitle(f"ocache bench long, {model} model (lower is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def run_long(a: Any, fixtures: Path) -> int:
    """``ocache bench --preset long``; writes ``bench-long-<model>.md``/``.json`` and ``long-<model>.png``."""
    import sys

    from ocache.toolchain import engine, models

    fixture = fixtures / "opencode_agent_turn1.json"
    if not fixture.exists():
        print(f"ocache bench: {fixture} not found", file=sys.stderr)
        return 2
    stock = engine.find(stock=True) or engine.build(stock=True)
    patched = engine.find() or engine.build()
    ms = models.make("tiny")
    sizes = [int(x) for x in (a.long_sizes or ",".join(map(str, SIZES))).split(",")]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "ocache bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else [])
    for model in (a.models or "dense").split(","):
        t0 = time.monotonic()
        results = []
        for size in sizes:
            print(f"== {model}, {size} tokens", flush=True)
            results.append(asyncio.run(run_size(stock.binary, patched.binary, ms[model], size, a,
                                                out / "work-long" / f"{model}-{size}", fixture)))
        wall = time.monotonic() - t0
        md = markdown(model, results, wall, command.strip())
        (out / f"bench-long-{model}.md").write_text(md)
        (out / f"bench-long-{model}.json").write_text(json.dumps(results, indent=1))
        png = plot(model, results, out / f"long-{model}.png")
        print(md)
        print(f"wrote {out / f'bench-long-{model}.md'}" + (f", {png}" if png else ""))
    return 0
