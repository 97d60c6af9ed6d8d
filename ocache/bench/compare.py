"""Two runs of ``ocache bench`` compared step by step (``scripts/bench-compare``).

A step of a scenario (``ocache.bench.replay.Step``) sends one request, or a ``parallel`` group of
them (opencode's title request beside its first agent turn). Within a group the requests race:
which one the server takes first, and so which one reuses what, differs from run to run on the
same code and on the same stock llama-server (measured: the stock configurations (a) and (b) of
two runs differ only in such groups and the step right after one). So a group is compared by its
sum, and every step by two figures: the tokens the server prefilled for it (``Row.server_prefill``:
``llamacpp:prompt_tokens_total`` deltas) and the prompt tokens it sent (``Row.n_tokens``: a turn
built from the run's own answers sends another prompt when an answer differed).

Input: the ``bench-<preset>.json`` an ``ocache bench --out DIR`` writes, ``{model: {scenario:
{config: {"rows": [row, ...], ...}}}}``; the scenarios whose files are found give the steps, any
other one (a recorded day) counts a step per row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from ocache.bench.replay import Scenario, ScenarioError, load_scenario


def step_of_rows(scenario: Scenario) -> list[int]:
    """The scenario step of each row, in the order the rows are written: a ``send`` or ``turn``
    step is one row, a ``parallel`` step one row per child, the other kinds (restart, host_down)
    none."""
    out: list[int] = []
    for i, step in enumerate(scenario.steps):
        if step.kind == "parallel":
            out += [i] * len(step.children)
        elif step.kind in ("send", "turn"):
            out.append(i)
    return out


@dataclass
class StepPair:
    """One step of one (model, scenario, config) in both runs: prefill and prompt tokens, summed
    over the step's rows."""

    where: str
    step: int
    labels: list[str]
    prefill: tuple[int, int]
    tokens: tuple[int, int]
    parallel: bool
    after_parallel: bool = False    # the row before this step's first row is of a parallel group

    @property
    def equal(self) -> bool:
        return self.prefill[0] == self.prefill[1] and self.tokens[0] == self.tokens[1]


@dataclass
class Comparison:
    """Every step pair, and the cells one run has and the other lacks (``missing``)."""

    steps: list[StepPair] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    @property
    def differing(self) -> list[StepPair]:
        return [s for s in self.steps if not s.equal]

    def explained_by_races(self) -> bool:
        """Whether every differing step is a parallel group or the step right after one (whose
        prefill depends on which slot the race left the conversation on)."""
        return all(s.parallel or s.after_parallel for s in self.differing)


def compare(a: Mapping[str, Any], b: Mapping[str, Any], scenarios: Mapping[str, Scenario]) -> Comparison:
    """``a`` and ``b``: two bench JSONs (module docstring); ``scenarios``: by name."""
    out = Comparison()
    for model, by_scenario in a.items():
        for name, by_config in by_scenario.items():
            for config, run_a in sorted(by_config.items()):
                where = f"{model}/{name}/({config})"
                run_b = ((b.get(model) or {}).get(name) or {}).get(config)
                rows_a, rows_b = list(run_a.get("rows") or []), list((run_b or {}).get("rows") or [])
                if run_b is None or len(rows_a) != len(rows_b):
                    out.missing.append(f"{where}: {len(rows_a)} rows against {len(rows_b)}")
                    continue
                sc = scenarios.get(name)
                steps = step_of_rows(sc) if sc is not None else []
                if len(steps) != len(rows_a):
                    steps = list(range(len(rows_a)))
                out.steps += _pairs(where, steps, rows_a, rows_b)
    return out


def _pairs(where: str, steps: Sequence[int], rows_a: Sequence[Mapping], rows_b: Sequence[Mapping]) -> list[StepPair]:
    by_step: dict[int, StepPair] = {}
    for k, (x, y) in enumerate(zip(rows_a, rows_b)):
        p = by_step.get(steps[k])
        if p is None:
            p = by_step[steps[k]] = StepPair(where, steps[k], [], (0, 0), (0, 0), False)
        else:
            p.parallel = True
        p.labels.append(str(x.get("label")))
        p.prefill = (p.prefill[0] + int(x.get("server_prefill") or 0), p.prefill[1] + int(y.get("server_prefill") or 0))
        p.tokens = (p.tokens[0] + int(x.get("n_tokens") or 0), p.tokens[1] + int(y.get("n_tokens") or 0))
    pairs = list(by_step.values())
    for before, p in zip(pairs, pairs[1:]):
        p.after_parallel = before.parallel
    return pairs


def load_named(directory: Path, fixtures: Path) -> dict[str, Scenario]:
    """Every scenario file of ``directory`` by its name; a file that does not load is left out
    (its rows then count a step each)."""
    out: dict[str, Scenario] = {}
    for path in sorted(directory.glob("*.yaml")):
        try:
            sc = load_scenario(path, fixtures)
        except ScenarioError:
            continue
        out[sc.name] = sc
    return out


def report(c: Comparison) -> list[str]:
    """The lines ``scripts/bench-compare`` prints: the count, then each differing step."""
    n_par = sum(1 for s in c.steps if s.parallel)
    lines = [f"steps equal: {len(c.steps) - len(c.differing)} of {len(c.steps)} "
             f"({n_par} of them parallel groups); cells missing in one run: {len(c.missing)}"]
    for s in c.differing:
        kind = "parallel group" if s.parallel else "step"
        lines.append(f"  {s.where} {kind} {s.step} {s.labels}: prefill {s.prefill[0]} -> {s.prefill[1]}, "
                     f"prompt tokens {s.tokens[0]} -> {s.tokens[1]}")
    lines += [f"  missing: {m}" for m in c.missing]
    if c.differing:
        lines.append("every differing step is a parallel group or the step after one: "
                     + ("yes" if c.explained_by_races() else "no"))
    return lines
