"""One configuration's result on one scenario (``ConfigRun``): what ``ocache bench`` measured, read
by its report (``ocache.bench.run.Bench``) and by rule 2 (``ocache.bench.rule2``)."""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from dataclasses import dataclass

from ocache.bench.replay import Row


def scenario_runs(results: dict[str, dict[str, dict[str, ConfigRun]]]
                  ) -> Iterator[tuple[str, str, dict[str, ConfigRun]]]:
    """(model, scenario, its runs by configuration) of a bench's ``results`` (model -> scenario ->
    configuration), in their order."""
    for model, per in results.items():
        for sc, runs in per.items():
            yield model, sc, runs


def fixed(value: float | None, digits: int) -> str:
    """``value`` with ``digits`` decimals for a report, ``-`` where there is none."""
    return "-" if value is None else f"{value:.{digits}f}"


def table_row(*cells: object) -> str:
    """One row of a Markdown table."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


@dataclass
class ConfigRun:
    """One configuration on one scenario."""

    config: str
    rows: list[Row]
    wall_s: float
    layer: str | None = None          # (c): the cache layer ocache served with
    ocache_stats: dict | None = None  # (c): GET /v1/cache/stats after the scenario
    error: str | None = None

    def total(self, attr: str) -> int:
        return sum(int(getattr(r, attr) or 0) for r in self.rows)

    @property
    def oracle_total(self) -> int:
        return sum(r.oracle.prefill for r in self.rows)

    @property
    def oracle_exact_total(self) -> int:
        return sum((r.oracle_exact or r.oracle).prefill for r in self.rows)

    @property
    def observed(self) -> int:
        """Tokens the server prefilled over the scenario (its own counter, so a proxy's warm-ups
        count too); the clients' ``prompt_n`` sum when the server was not metered."""
        if self.rows and all(r.server_prefill is not None for r in self.rows):
            return self.total("server_prefill")
        return self.total("prompt_n")

    @property
    def efficiency(self) -> float | None:
        obs = self.observed
        return self.oracle_total / obs if obs else None

    @property
    def ttft_ratio(self) -> float | None:
        vals = [r.ttft_ratio for r in self.rows if r.ttft_ratio is not None]
        return statistics.median(vals) if vals else None

    @property
    def exact(self) -> tuple[int, int]:
        judged = [r.exact for r in self.rows if r.exact is not None]
        return sum(judged), len(judged)
