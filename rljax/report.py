"""`python -m rljax.report WORKDIR [WORKDIR ...] --out FILE.png`: training curves from metrics.jsonl.

The panels are laid out as a grid (`--cols`, default 3). Each curve panel (reward, KL, entropy, response
length, staleness, eval accuracy, MFU) overlays every run, one colour per run. A panel is left out when it
carries no signal: no run has its metrics, or every series it would draw is constant (KL at beta 0,
staleness in sync mode); a series of one point is kept. Then one "step time" panel per run shows where each
step's time goes: its `timing/<phase>_s` stacked per step, plus "other" (the rest of `timing/step_s`).
Steps that compiled the update are hatched and left out of the y range (their height is written on the
bar), so step 1's compile does not flatten the rest. A step compiled when `compile/count` grew, or when the
metrics carry no count, when its batch shape (`batch/rows` x `batch/row_length`) first appeared in the
run (jit compiles once per shape), or when it is the run's first step. Uses matplotlib's Agg backend.
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
    ("staleness", "versions", ("staleness/mean", "staleness/max")),
    ("eval accuracy", "fraction", ("eval/accuracy",)),
    ("model FLOPs utilization", "fraction of peak", ("perf/mfu",)),
)
STEP_TIME = "step time"
PHASE_ORDER = ("rollout", "batch", "update", "weight_sync", "eval", "checkpoint")

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


def has_signal(runs: Sequence[Series], patterns: Sequence[str]) -> bool:
    """False when no run has a metric of `patterns`, or every such series is constant (all its finite
    values equal, at least two of them) or has no finite value."""
    for series in runs:
        for name in panel_names(series, patterns):
            finite = [v for v in series[name][1] if math.isfinite(v)]
            if len(finite) == 1 or (finite and max(finite) > min(finite)):
                return True
    return False


def phase_times(series: Series) -> tuple[list[int], dict[str, list[float]]]:
    """(steps, {phase: seconds per step}) of every step with `timing/step_s`: each `timing/<phase>_s` (0
    where a step lacks it), in loop order, then "other", the rest of the step's wall time."""
    steps, totals = series.get("timing/step_s", ([], []))
    names = [n for n in panel_names(series, ("timing/*_s",)) if n != "timing/step_s"]
    phases = sorted((n[len("timing/") : -len("_s")] for n in names), key=_phase_rank)
    out = {p: [_value_at(series, f"timing/{p}_s", s) for s in steps] for p in phases}
    out["other"] = [max(0.0, t - sum(out[p][i] for p in phases)) for i, t in enumerate(totals)]
    return list(steps), out


def compile_steps(series: Series) -> set[int]:
    """The steps that compiled the update: `compile/count` grew, or (without it) the batch shape first
    appeared; the first timed step always."""
    steps = series.get("timing/step_s", ([], []))[0]
    out = {steps[0]} if steps else set()
    if "compile/count" in series:
        count_steps, counts = series["compile/count"]
        out |= {s for s, a, b in zip(count_steps[1:], counts, counts[1:], strict=False) if b > a}
        return out
    seen = set()
    for s in steps:
        shape = (_value_at(series, "batch/rows", s), _value_at(series, "batch/row_length", s))
        if shape not in seen:
            out.add(s)
        seen.add(shape)
    return out


def _value_at(series: Series, name: str, step: int) -> float:
    steps, values = series.get(name, ([], []))
    return values[steps.index(step)] if step in steps else 0.0


def _phase_rank(phase: str) -> tuple[int, str]:
    return (PHASE_ORDER.index(phase) if phase in PHASE_ORDER else len(PHASE_ORDER), phase)


def _phase_color(phase: str) -> str:
    """The same colour for a phase in every run's panel ("other" grey, unknown phases olive)."""
    known = {p: f"C{i}" for i, p in enumerate(PHASE_ORDER)}
    return known.get(phase, "C7" if phase == "other" else "C8")


def run_labels(workdirs: Sequence[pathlib.Path]) -> list[str]:
    """Short, distinct labels for runs: the directory name, with its parent where names repeat."""
    names = [p.resolve().name for p in workdirs]
    return [
        f"{p.resolve().parent.name}/{n}" if names.count(n) > 1 else n
        for p, n in zip(workdirs, names, strict=True)
    ]


def render_report(
    workdirs: Sequence[str | pathlib.Path], out: str | pathlib.Path, dpi: int = 100, cols: int = 3
) -> list[str]:
    """Draws the report of every run into the PNG `out` (a grid of `cols` panels per row); returns the
    titles of the panels drawn, curve panels first, then one step-time panel per run with timings
    (titled "step time", or "step time: <run>" for several runs).

    Raises ValueError if no panel has a signal in any run.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = [pathlib.Path(w) for w in workdirs]
    runs, labels = [load_series(p) for p in paths], run_labels(paths)
    curves = [p for p in PANELS if has_signal(runs, p[2])]
    timed = [(label, s) for label, s in zip(labels, runs, strict=True) if "timing/step_s" in s]
    titles = [p[0] for p in curves] + [
        STEP_TIME + (f": {label}" if len(runs) > 1 else "") for label, _ in timed
    ]
    if not titles:
        raise ValueError(f"no plottable metrics in {[str(p / METRICS_FILE) for p in paths]}")
    ncols = max(1, min(cols, len(titles)))
    nrows = math.ceil(len(titles) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.0 * ncols, 3.0 * nrows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax, (title, ylabel, patterns) in zip(flat, curves, strict=False):
        _draw_curves(ax, runs, labels, title, ylabel, patterns)
    for ax, title, (_, series) in zip(flat[len(curves) :], titles[len(curves) :], timed, strict=False):
        _draw_step_time(ax, series, title)
    for ax in flat[len(titles) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(out, dpi=dpi, format="png")
    plt.close(fig)
    return titles


def _draw_curves(ax, runs, labels, title: str, ylabel: str, patterns: Sequence[str]) -> None:
    styles = ("-", "--", ":", "-.")
    for color, (label, series) in enumerate(zip(labels, runs, strict=True)):
        for k, name in enumerate(panel_names(series, patterns)):
            steps, values = series[name]
            ax.plot(
                steps,
                values,
                color=f"C{color}",
                linestyle=styles[k % len(styles)],
                label=f"{label}: {name}" if len(runs) > 1 else name,
                linewidth=1.2,
                marker="." if len(steps) < 30 else None,
            )
    ax.legend(fontsize=7, loc="best")
    _finish(ax, title, ylabel)


def _draw_step_time(ax, series: Series, title: str) -> None:
    from matplotlib.patches import Patch

    steps, phases = phase_times(series)
    compiled = compile_steps(series)
    bottom = [0.0] * len(steps)
    for phase, seconds in phases.items():
        bars = ax.bar(steps, seconds, bottom=bottom, width=0.8, color=_phase_color(phase), linewidth=0)
        for s, bar in zip(steps, bars, strict=True):
            if s in compiled:
                bar.set_hatch("//")
        bottom = [b + v for b, v in zip(bottom, seconds, strict=True)]
    steady = [b for s, b in zip(steps, bottom, strict=True) if s not in compiled]
    top = 1.6 * max(steady) if steady and max(steady) > 0 else None  # headroom for the legend
    if top is not None:
        ax.set_ylim(0, top)
        for s, b in zip(steps, bottom, strict=True):
            if s in compiled and b > top / 1.6:
                ax.text(s, top / 1.6, f"compile {b:.1f} s", rotation=90, fontsize=6, ha="center", va="bottom",
                        bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5})  # fmt: skip
    handles = [Patch(color=_phase_color(phase), label=phase) for phase in phases]
    handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="compiled"))
    ax.legend(handles=handles, fontsize=6, loc="upper right", ncol=4)
    _finish(ax, title, "s")


def _finish(ax, title: str, ylabel: str) -> None:
    ax.set_xlabel("step", fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.set_title(title, fontsize=9, loc="left")
    ax.grid(alpha=0.3)
    ax.tick_params(labelsize=7)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rljax.report", description=__doc__.splitlines()[0])
    p.add_argument("workdirs", nargs="+", type=pathlib.Path, help="run directories holding metrics.jsonl")
    p.add_argument("--out", required=True, type=pathlib.Path, help="PNG file to write")
    p.add_argument("--dpi", type=int, default=100)
    p.add_argument("--cols", type=int, default=3, help="panels per row of the grid")
    args = p.parse_args(argv)
    missing = [str(w) for w in args.workdirs if not (w / METRICS_FILE).exists()]
    if missing:
        p.error(f"no {METRICS_FILE} in: {', '.join(missing)}")
    panels = render_report(args.workdirs, args.out, dpi=args.dpi, cols=args.cols)
    print(f"wrote {args.out} ({len(args.workdirs)} runs; panels: {', '.join(panels)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
