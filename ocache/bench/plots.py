"""The bench's pictures: tokens llama-server prefilled per request, one panel per scenario, each
configuration beside the oracle (``ocache/bench/oracle.py``: a cache that reuses every prefix any
earlier request shared; a real cache can do better across a restart it survives, or worse), with a
dotted line where the server restarted. ``plot`` writes the PNGs ``Bench.write`` lists."""

from __future__ import annotations

from pathlib import Path
from typing import Any

PLOT_LABELS = {"a": "(a) stock llama-server", "b": "(b) tuned flags", "c": "(c) ocache on (b)"}

def panel(ax: Any, sc: str, runs: dict) -> None:
    """One scenario: prefilled tokens per request (log scale) of each configuration and the
    oracle; a dotted vertical line before a request that followed a server restart."""
    import matplotlib.ticker

    styles = {"a": ("tab:red", "o"), "b": ("tab:orange", "s"), "c": ("tab:blue", "^")}
    offsets = {"a": -0.08, "b": 0.0, "c": 0.08}  # a and b often coincide
    for cfg, run in runs.items():
        xs = [r.index + offsets.get(cfg, 0.0) for r in run.rows]
        ys = [max(int(r.server_prefill if r.server_prefill is not None
                      else r.prompt_n or 0), 1) for r in run.rows]
        color, marker = styles.get(cfg, ("gray", "x"))
        ax.plot(xs, ys, marker=marker, color=color, label=PLOT_LABELS.get(cfg, f"({cfg})"),
                linewidth=1.2, markersize=5)
    base = runs.get("c") or next(iter(runs.values()))
    if base.rows:
        ax.plot([r.index for r in base.rows], [max(r.oracle.prefill, 1) for r in base.rows],
                "k--", marker=".", label="oracle (reuses every prefix any earlier request shared)", linewidth=1.0)
        for r in base.rows:
            if r.restart_before:
                ax.axvline(r.index - 0.5, color="gray", linestyle=":", linewidth=1)
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_title(sc, fontsize=10)
    ax.set_xlabel("request (in the order sent)")
    ax.set_ylabel("tokens prefilled (log scale)")
    ax.grid(True, which="both", alpha=0.3)

def title(preset: str, model: str, what: str) -> str:
    return (f"Tokens llama-server prefilled per request: {what}, {model} model, "
            f"{preset} preset (dotted line: server restart; lower is better)")

def figure(preset: str, model: str, per: dict) -> Any:
    """All scenarios of one model, one panel each (title wrapped inside the figure)."""
    import textwrap

    import matplotlib.pyplot as plt

    n = len(per)
    cols = 2 if n > 1 else 1
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 3.4 * rows + 1.0), squeeze=False,
                             layout="constrained")
    for ax, (sc, runs) in zip(axes.flat, per.items()):
        panel(ax, sc, runs)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=4, fontsize=9)
    fig.suptitle(textwrap.fill(title(preset, model, "every scenario"), 60 * cols), fontsize=11)
    return fig

def scenario_figure(preset: str, model: str, sc: str, runs: dict) -> Any:
    """One scenario of one model, alone (what a user looks at for that scenario)."""
    import textwrap

    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8), layout="constrained")
    panel(ax, sc, runs)
    ax.legend(fontsize=8, loc="best")
    fig.suptitle(textwrap.fill(title(preset, model, sc), 70), fontsize=10)
    return fig

def plot(results: dict, preset: str, out: Path) -> list[Path]:
    """PNGs per model: ``prefill-<preset>-<model>.png`` (every scenario, one panel each), then
    ``prefill-<preset>-<model>-<scenario>.png`` per scenario."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for model, per in results.items():
        figs = [(figure(preset, model, per), f"prefill-{preset}-{model}.png")]
        figs += [(scenario_figure(preset, model, sc, runs),
                  f"prefill-{preset}-{model}-{sc.replace('/', '_')}.png")
                 for sc, runs in per.items()]
        for fig, name in figs:
            path = out / name
            fig.savefig(path, dpi=110)
            plt.close(fig)
            paths.append(path)
    return paths

