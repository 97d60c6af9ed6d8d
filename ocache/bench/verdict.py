"""What ``./scripts/main`` tells its user: progress of an ``ocache bench`` run on stdout, read from the
bench's log lines, and one sentence of verdict from its ``bench-<preset>.json``.

* ``python -m ocache.bench.verdict progress LOG``: reads the bench's stderr on stdin, keeps all of it
  in ``LOG``, and prints one line per run started and ended (``ocache.bench.run.Bench.run`` logs
  ``plan: N runs``, then ``model / scenario / (c) title`` and ``  -> server prefill ...`` per run)
  with the runs done, the elapsed time and an estimate of the time left (the mean wall time of the
  runs so far times the runs left; the first estimate comes after the first run), and a heartbeat
  line (the run in progress, how long it has been going) after every minute without another line.
* ``python -m ocache.bench.verdict verdict FILE.json``: the sentence (``verdict``): (c) against
  llama-server alone, per scenario the lower of (a) stock and (b) tuned ("vs min(stock, tuned)",
  as the README's headline table and rule 2), in tokens the server prefilled
  (``Row.server_prefill``, its ``/metrics`` counter, ocache's own steps included) and in seconds the
  clients waited for their first tokens (``Row.ttft_s`` summed), over every scenario (c) and one
  of them ran without an error. (Against (b) alone the saving reads larger wherever (b)'s flags
  cost more than stock's, e.g. A/B/A with ``--cache-ram 0``.)
* ``python -m ocache.bench.verdict alone FILE.json``: ``alone_check``: the headline saving ocache
  reported (against llama-server alone) beside the bench's measured (b) - (c), per scenario; exit 1
  where they differ by more than 5 % of (b) - (c).
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any, Iterable, Mapping

_PLAN = re.compile(r"plan: (\d+) runs")
_START = re.compile(r"ocache\.bench\.run: (\S+) / (\S+) / \((\w)\) (.*)$")
_DONE = re.compile(r"ocache\.bench\.run:   -> server prefill (\d+) .*?, ([\d.]+) s(, ERROR .*)?$")


def _clock(s: float) -> str:
    s = max(0, int(round(s)))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


#: Seconds of silence after which the progress echo prints a heartbeat line (the run in progress and
#: how long it has been going): a run's replay or cold references can take many minutes.
HEARTBEAT_S = 60.0


class _Echo:
    """The progress lines, each prefixed with the elapsed time, and the heartbeat: :meth:`beat`
    prints one line when nothing was printed for ``every`` seconds (``now``: a clock in seconds).
    Thread-safe: ``progress`` calls :meth:`beat` from a ticker thread."""

    def __init__(self, out: IO[str], now: Any, every: float) -> None:
        self.out, self.now, self.every = out, now, every
        self.t0 = self.last = self.since = now()
        self.what = "the bench's start (building the plan, starting servers)"
        self.lock = threading.Lock()

    def say(self, text: str, what: str | None = None) -> None:
        with self.lock:
            t = self.now()
            print(f"[bench {_clock(t - self.t0)}] {text}", file=self.out, flush=True)
            self.last = t
            if what is not None:
                self.what, self.since = what, t

    def raw(self, text: str) -> None:
        """Print ``text`` as it is (an error line of the bench)."""
        with self.lock:
            print(text, file=self.out, flush=True)
            self.last = self.now()

    def beat(self) -> bool:
        """Print ``still on <what>: <m:ss> in`` if nothing was printed for ``every`` s; True if printed."""
        with self.lock:
            t = self.now()
            if t - self.last < self.every:
                return False
            print(f"[bench {_clock(t - self.t0)}] still on {self.what}: {_clock(t - self.since)} in",
                  file=self.out, flush=True)
            self.last = t
            return True


def progress(lines: Iterable[str], out: IO[str], log: IO[str] | None = None,
             now: Any = time.monotonic, heartbeat_s: float | None = HEARTBEAT_S) -> int:
    """Echo the bench's progress from its log ``lines`` to ``out`` (see the module docstring);
    every line also goes to ``log``. Returns the number of runs that ended. Lines that are not the
    bench's own (pip, the servers) are kept out of ``out``, but for errors and tracebacks. With
    ``heartbeat_s`` (seconds; None: off) a ticker thread prints a heartbeat line whenever nothing
    was printed for that long (``_Echo.beat``), so the user sees progress at least every minute."""
    echo = _Echo(out, now, heartbeat_s or 0.0)
    stop = threading.Event()
    if heartbeat_s:
        def tick() -> None:
            while not stop.wait(min(5.0, heartbeat_s)):
                echo.beat()

        threading.Thread(target=tick, name="bench-heartbeat", daemon=True).start()
    total = done = 0
    walls: list[float] = []
    try:
        for line in lines:
            if log is not None:
                log.write(line)
                log.flush()
            text = line.rstrip("\n")
            if m := _PLAN.search(text):
                total = int(m.group(1))
                echo.say(f"{total} runs to do (each: replay, then cold references)", what="the first run's start")
            elif m := _START.search(text):
                run = f"run {done + 1}/{total or '?'}"
                echo.say(f"{run}: {m.group(1)} model, scenario {m.group(2)}, configuration ({m.group(3)}) "
                         f"{m.group(4)}", what=f"{run} ({m.group(1)} / {m.group(2)} / ({m.group(3)}))")
            elif m := _DONE.search(text):
                done += 1
                walls.append(float(m.group(2)))
                left = (total - done) * sum(walls) / len(walls) if total else None
                echo.say(f"  done in {float(m.group(2)):.0f} s: the server prefilled {int(m.group(1)):,} tokens"
                         f"{m.group(3) or ''}"
                         + (f"; about {_clock(left)} left" if left is not None and done < total else ""),
                         what=f"the step after run {done}/{total or '?'}")
            elif " ERROR " in text or "Traceback" in text or text.startswith("ocache bench:"):
                echo.raw(text)
    finally:
        stop.set()
    return done


def _sums(run: Mapping) -> tuple[int, float, int]:
    """(server prefill tokens, client TTFT seconds, requests) of one configuration's run."""
    rows = run.get("rows") or []
    return (sum(int(r.get("server_prefill") or r.get("prompt_n") or 0) for r in rows),
            sum(float(r.get("ttft_s") or 0.0) for r in rows), len(rows))


#: how the verdict names its baseline, by the alone configurations it compared with
BASELINES = {("a", "b"): "llama-server alone, vs min(stock, tuned) per scenario",
             ("b",): "llama-server alone, vs tuned (b)", ("a",): "llama-server alone, vs stock (a)"}


def baseline(data: Mapping) -> dict[str, Any]:
    """Per model and scenario that (c) and (a) or (b) ran, none with an error: (c)'s sums and, for
    each, the lower of (a)'s and (b)'s (the fewer tokens prefilled, the fewer seconds of TTFT),
    added up: ``{"c": (tokens, seconds, requests), "alone": (tokens, seconds), "scenarios": N,
    "configs": the alone configurations seen, sorted}`` (a ``bench-<preset>.json``: model ->
    scenario -> config)."""
    pc = pa = 0
    tc = ta = 0.0
    n = k = 0
    seen: set[str] = set()
    for per in data.values():
        for runs in per.values():
            if any(r.get("error") for r in runs.values()):
                continue
            alone = {cfg: _sums(runs[cfg]) for cfg in ("a", "b") if cfg in runs}
            if "c" not in runs or not alone:
                continue
            p, t, m = _sums(runs["c"])
            pc, tc, n, k = pc + p, tc + t, n + m, k + 1
            pa += min(x[0] for x in alone.values())
            ta += min(x[1] for x in alone.values())
            seen.update(alone)
    return {"c": (pc, tc, n), "alone": (pa, ta), "scenarios": k, "configs": tuple(sorted(seen))}


def verdict(data: Mapping) -> str:
    """One sentence: ocache (c) against llama-server alone, per scenario the lower of (a) and (b)
    (``baseline``), in prefilled tokens and seconds of client TTFT."""
    b = baseline(data)
    if not b["scenarios"]:
        return "No verdict: the run has no (c) or no llama-server-alone configuration to compare it with."
    (pc, tc, n), (pb, tb) = b["c"], b["alone"]
    who = BASELINES[b["configs"]]
    dp, dt = pb - pc, tb - tc
    share = f"{dp / pb:.0%} less; " if pb and dp > 0 else ""
    tokens = (f"prefilled {dp:,} fewer tokens than {who} ({share}{pc:,} against {pb:,})" if dp >= 0 else
              f"prefilled {-dp:,} MORE tokens than {who} ({pc:,} against {pb:,})")
    secs = (f"clients waited {dt:.1f} s less for their first tokens ({tc:.1f} s against {tb:.1f} s)"
            if dt >= 0 else f"clients waited {-dt:.1f} s MORE for their first tokens ({tc:.1f} s against {tb:.1f} s)")
    scen = f"{b['scenarios']} scenario{'s' if b['scenarios'] != 1 else ''}"
    return f"Verdict: over {n} requests in {scen}, ocache (c) {tokens}, and {secs}."


def alone_check(data: Mapping) -> list[dict]:
    """Per model and scenario where (b) and (c) both ran without an error: the bench's measured
    saving of (c) against the server alone, (b) - (c) in server prefill tokens, beside the one
    ocache reported for the same stream (``/v1/cache/stats`` ``layer.alone.saved`` at the end of
    (c), ``ocache.llama.alone``), and ``off`` = |reported - measured| / |measured| (at most 5 % passes:
    ``python -m ocache.bench.verdict alone FILE.json`` exits 0; ``off_of_b``: the same miss as a share of (b)'s prefill)."""
    out = []
    for model, per in data.items():
        for sc, runs in per.items():
            b, c = runs.get("b"), runs.get("c")
            if not b or not c or b.get("error") or c.get("error"):
                continue
            alone = ((c.get("ocache_stats") or {}).get("layer") or {}).get("alone")
            if not isinstance(alone, Mapping):
                continue
            pb, pc = _sums(b)[0], _sums(c)[0]
            measured, reported = pb - pc, int(alone.get("saved") or 0)
            out.append({"model": model, "scenario": sc, "b": pb, "c": pc, "measured": measured,
                        "reported": reported, "alone_prefill": int(alone.get("prefill") or 0),
                        "ocache_prefill": int(alone.get("ocache_prefill") or 0),
                        "off": abs(reported - measured) / abs(measured) if measured else float(reported != 0),
                        "off_of_b": abs(reported - measured) / pb if pb else 0.0})
    return out


def _main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "progress":
        with open(argv[1], "a", encoding="utf-8") as log:
            progress(sys.stdin, sys.stdout, log)
        return 0
    if len(argv) == 2 and argv[0] == "verdict":
        print(verdict(json.loads(Path(argv[1]).read_text())))
        return 0
    if len(argv) == 2 and argv[0] == "alone":
        rows = alone_check(json.loads(Path(argv[1]).read_text()))
        for r in rows:
            print(f"{r['model']} / {r['scenario']}: (b) - (c) = {r['b']:,} - {r['c']:,} = {r['measured']:,} "
                  f"tokens measured; ocache reported {r['reported']:,} (server alone {r['alone_prefill']:,} - "
                  f"through ocache {r['ocache_prefill']:,}): off by {r['off']:.1%} of (b) - (c), "
                  f"{r['off_of_b']:.1%} of (b)")
        if not rows:
            print("no scenario with both (b) and (c) and ocache's alone figures", file=sys.stderr)
            return 2
        return 0 if all(r["off"] <= 0.05 for r in rows) else 1
    print("usage: python -m ocache.bench.verdict progress LOG | verdict FILE.json | alone FILE.json",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
