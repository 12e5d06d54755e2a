"""`python -m rljax.report WORKDIR [WORKDIR ...] --out FILE.png`: training curves from metrics.jsonl.

One column per run, one row per panel (reward, KL, entropy, response length, timings, staleness, eval
accuracy), y axes shared along a row so runs compare at a glance. Panels with no data in any run are left
out; a run without a panel's metrics shows "no data" there. Uses matplotlib's Agg backend (no display).
"""

from __future__ import annotations

import argparse
import fnmatch
import math
import pathlib
from collections.abc import Sequence

from rljax.metrics.logger import METRICS_FILE
from rljax.metrics.writers import read_jsonl

# (panel title, y label, glob patterns of the metric names it plots)
PANELS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("reward", "reward", ("reward/mean", "reward/*/mean")),
    ("KL to reference", "nats/token", ("kl/mean",)),
    ("entropy", "nats/token", ("entropy/mean",)),
    ("response length", "tokens", ("response/length_mean", "response/length_max")),
    ("timings", "s", ("timing/*_s",)),
    ("staleness", "versions", ("staleness/mean", "staleness/max")),
    ("eval accuracy", "fraction", ("eval/accuracy",)),
)

Series = dict[str, tuple[list[int], list[float]]]  # metric name -> (steps, values)


def load_series(workdir: str | pathlib.Path) -> Series:
    """Every scalar metric of `workdir/metrics.jsonl` as (steps, values); null values become NaN.

    Duplicated steps (a file written by an older, non-truncating run) keep their last line.
    """
    by_step = {r["step"]: r for r in read_jsonl(pathlib.Path(workdir) / METRICS_FILE)}
    series: Series = {}
    for step in sorted(by_step):
        for name, value in by_step[step].items():
            if name in ("step", "time") or isinstance(value, (list, dict, str, bool)):
                continue
            steps, values = series.setdefault(name, ([], []))
            steps.append(step)
            values.append(math.nan if value is None else float(value))
    return series


def panel_names(series: Series, patterns: Sequence[str]) -> list[str]:
    """The metric names in `series` matched by `patterns`, in pattern order then by name."""
    names: list[str] = []
    for pattern in patterns:
        names += [n for n in sorted(series) if fnmatch.fnmatchcase(n, pattern) and n not in names]
    return names


def run_labels(workdirs: Sequence[pathlib.Path]) -> list[str]:
    """Short, distinct labels for runs: the directory name, with its parent where names repeat."""
    names = [p.resolve().name for p in workdirs]
    return [
        f"{p.resolve().parent.name}/{n}" if names.count(n) > 1 else n
        for p, n in zip(workdirs, names, strict=True)
    ]


def render_report(
    workdirs: Sequence[str | pathlib.Path], out: str | pathlib.Path, dpi: int = 100
) -> list[str]:
    """Draws the panels of every run into the PNG `out`; returns the titles of the panels drawn.

    Raises ValueError if no run has any metric a panel plots.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = [pathlib.Path(w) for w in workdirs]
    runs = [load_series(p) for p in paths]
    panels = [p for p in PANELS if any(panel_names(s, p[2]) for s in runs)]
    if not panels:
        raise ValueError(f"no plottable metrics in {[str(p / METRICS_FILE) for p in paths]}")
    fig, axes = plt.subplots(
        len(panels), len(runs), figsize=(5.0 * len(runs), 2.6 * len(panels)), sharey="row", squeeze=False
    )
    for col, (label, series) in enumerate(zip(run_labels(paths), runs, strict=True)):
        axes[0][col].set_title(label, fontsize=11, fontweight="bold")
        for row, (title, ylabel, patterns) in enumerate(panels):
            _draw_panel(axes[row][col], series, title, ylabel, patterns, first_col=col == 0)
    fig.tight_layout()
    fig.savefig(out, dpi=dpi, format="png")
    plt.close(fig)
    return [p[0] for p in panels]


def _draw_panel(
    ax, series: Series, title: str, ylabel: str, patterns: Sequence[str], first_col: bool
) -> None:
    names = panel_names(series, patterns)
    for name in names:
        steps, values = series[name]
        ax.plot(steps, values, label=name, linewidth=1.2, marker="." if len(steps) < 30 else None)
    if names:
        ax.legend(fontsize=7, loc="best")
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
    ax.set_xlabel("step", fontsize=8)
    ax.set_title(title, fontsize=9, loc="left")
    if first_col:
        ax.set_ylabel(ylabel, fontsize=8)
    ax.grid(alpha=0.3)
    ax.tick_params(labelsize=7)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rljax.report", description=__doc__.splitlines()[0])
    p.add_argument("workdirs", nargs="+", type=pathlib.Path, help="run directories holding metrics.jsonl")
    p.add_argument("--out", required=True, type=pathlib.Path, help="PNG file to write")
    p.add_argument("--dpi", type=int, default=100)
    args = p.parse_args(argv)
    missing = [str(w) for w in args.workdirs if not (w / METRICS_FILE).exists()]
    if missing:
        p.error(f"no {METRICS_FILE} in: {', '.join(missing)}")
    panels = render_report(args.workdirs, args.out, dpi=args.dpi)
    print(f"wrote {args.out} ({len(args.workdirs)} runs; panels: {', '.join(panels)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
