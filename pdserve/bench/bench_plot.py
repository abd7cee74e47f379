"""Pictures of ``pdserve bench serve`` (``--plot PATH.png``): one PNG, three panels.

1. TTFT: the empirical CDF of every successful request's time to first token, one line per run
   and concurrency level (x in ms, log scale).
2. ITL: the same for the gaps between content deltas, all requests of a level pooled.
   Both axes start at the lowest 1st percentile of a line (:func:`x_range_ms`); the x label
   counts the samples left of it.
3. Output tokens/s against concurrency: one line per run (system), one point per level.

The data are :class:`RunSamples`: a run's label and, per concurrency level, the raw TTFT and ITL
samples in seconds and the level's output tokens/s (:func:`pdserve.bench.serving.bench_serve.summarize`).
``bench serve --json`` keeps the samples (:func:`level_samples_json`), so a later ``--plot-with
FILE.json`` can draw an earlier run (another server's, say) beside this one's
(:func:`runs_from_report`).

matplotlib is optional (``pip install 'pdserve[plot]'``) and is imported only here, inside the
functions that draw, with the Agg backend; :func:`require_matplotlib` says early when it is
missing. Benchmark code only: nothing in the serving stack imports it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from pdserve.bench.serving.bench_serve import RequestResult

INSTALL_HINT = "pip install 'pdserve[plot]'"
DPI = 90
"""Dots per inch of the PNG: a 15 x 4.6 inch figure is 1350 x 414 pixels, about 120 KB."""
LEVEL_STYLES = ("-", "--", ":", "-.")
"""Line styles of the concurrency levels when several runs share a panel (colour = run)."""


class PlotError(RuntimeError):
    """A picture cannot be drawn: matplotlib is missing, or a report holds no samples."""


@dataclass(frozen=True)
class LevelSamples:
    """One concurrency level of one run: ``ttft_s`` one value per successful request and
    ``itl_s`` every gap between content deltas of those requests, both in seconds (any order);
    ``output_tokens_per_s`` the level's output tokens per second of wall time, None when
    unknown."""

    concurrency: int
    ttft_s: tuple[float, ...]
    itl_s: tuple[float, ...]
    output_tokens_per_s: float | None


@dataclass(frozen=True)
class RunSamples:
    """One system's run: its label (the legend's name) and its levels, in the order run."""

    label: str
    levels: tuple[LevelSamples, ...]


def require_matplotlib() -> None:
    """Raise :class:`PlotError` naming ``pip install 'pdserve[plot]'`` when matplotlib cannot be
    imported. Call it before a long benchmark, so that a missing picture costs no run."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise PlotError(f"--plot needs matplotlib, which is not installed: {INSTALL_HINT}") from exc


def level_samples_json(results: Sequence[RequestResult], concurrency: int) -> dict[str, Any]:
    """The raw samples of one level, JSON-ready: ``{"concurrency", "ttft_s", "itl_s"}``, seconds
    rounded to the microsecond, successful requests only (the input of :func:`runs_from_report`)."""
    ok = [r for r in results if r.ok]
    return {
        "concurrency": concurrency,
        "ttft_s": [round(r.ttft_s, 6) for r in ok if r.ttft_s is not None],
        "itl_s": [round(g, 6) for r in ok for g in r.itl_s],
    }


def runs_from_report(report: Mapping[str, Any], source: str = "the report") -> list[RunSamples]:
    """The runs of a ``bench serve`` report (the ``--json`` file's object): each run's
    ``levels`` (summaries: ``concurrency``, ``output_tokens_per_s``) joined by concurrency with
    its ``samples`` (:func:`level_samples_json`). Raises :class:`PlotError` naming ``source``
    when a run has no samples (a report written before ``bench serve`` kept them)."""
    out = []
    for i, run in enumerate(report.get("runs") or []):
        label = str(run.get("label") or run.get("model") or f"run {i + 1}")
        if "samples" not in run:
            raise PlotError(
                f"{source}: run {label!r} holds no samples (write it with a "
                "pdserve bench serve --json of this version)"
            )
        by_c = {int(s["concurrency"]): s for s in run["samples"]}
        levels = []
        for lv in run.get("levels") or []:
            s = by_c.get(int(lv["concurrency"]), {})
            levels.append(
                LevelSamples(
                    int(lv["concurrency"]),
                    tuple(float(v) for v in s.get("ttft_s", ())),
                    tuple(float(v) for v in s.get("itl_s", ())),
                    lv.get("output_tokens_per_s"),
                )
            )
        out.append(RunSamples(label, tuple(levels)))
    if not out:
        raise PlotError(f"{source}: no runs")
    return out


def ecdf_ms(values_s: Sequence[float]) -> tuple[list[float], list[float]]:
    """The empirical CDF of seconds: (sorted values in ms, fraction of values <= each)."""
    xs = sorted(v * 1e3 for v in values_s)
    n = len(xs)
    return xs, [(i + 1) / n for i in range(n)]


def _style(runs: Sequence[RunSamples], r: int, k: int) -> dict[str, Any]:
    """One run: a colour per level; several: a colour per run, a line style per level."""
    if len(runs) == 1:
        return {"color": f"C{k % 10}", "linestyle": "-"}
    return {"color": f"C{r % 10}", "linestyle": LEVEL_STYLES[k % len(LEVEL_STYLES)]}


def x_range_ms(lines: Sequence[Sequence[float]]) -> tuple[float, float]:
    """The x range (ms) of ECDF panels over ``lines`` (each a sorted list of ms, none empty):
    from the lowest 1st percentile of a line / 1.25 to the highest value x 1.25. A rare near-zero
    gap (two deltas that left the server together) would otherwise stretch a log axis over
    decades where nothing else lies."""
    low = min(xs[int(0.01 * (len(xs) - 1))] for xs in lines)
    high = max(xs[-1] for xs in lines)
    return max(low, 1e-3) / 1.25, max(high, low) * 1.25


def _log_ms_axis(ax: Axes, low: float, high: float) -> None:
    from matplotlib.ticker import FuncFormatter, LogLocator

    ax.set_xscale("log")
    ax.set_xlim(low, high)
    # Plain numbers (a reader compares 40 ms with 80, not 10^1.6 with 10^1.9), at 1-2-5 or
    # 1-3 steps when the range is short enough for them to fit.
    decades = math.log10(high / low)
    subs = (1.0, 2.0, 5.0) if decades <= 2.5 else (1.0, 3.0) if decades <= 4 else (1.0,)
    ax.xaxis.set_major_locator(LogLocator(subs=subs))
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))


def _ecdf_panel(ax: Axes, runs: Sequence[RunSamples], metric: str, title: str) -> None:
    lines = []
    for r, run in enumerate(runs):
        for k, lv in enumerate(run.levels):
            values = lv.ttft_s if metric == "ttft" else lv.itl_s
            if not values:
                continue
            xs, ys = ecdf_ms(values)
            lines.append(xs)
            ax.step(
                xs,
                ys,
                where="post",
                label=f"{run.label}, c={lv.concurrency}",
                linewidth=1.4,
                **_style(runs, r, k),
            )
    note = ""
    if lines:
        low, high = x_range_ms(lines)
        _log_ms_axis(ax, low, high)
        hidden = sum(v < low for xs in lines for v in xs)
        note = f"; {hidden} samples under {low:.3g} ms not shown" if hidden else ""
    ax.set_xlabel(f"{title} (ms, log scale{note})")
    ax.set_ylabel("fraction of samples <= x")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"{title} distribution (ECDF)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small", loc="lower right")


def _throughput_panel(ax: Axes, runs: Sequence[RunSamples]) -> None:
    levels = sorted({lv.concurrency for run in runs for lv in run.levels})
    top: dict[int, float] = {}  # the highest tokens/s at each level: its label goes above
    for run in runs:
        for lv in run.levels:
            if lv.output_tokens_per_s is not None:
                top[lv.concurrency] = max(top.get(lv.concurrency, 0.0), lv.output_tokens_per_s)
    for r, run in enumerate(runs):
        points = [
            (lv.concurrency, lv.output_tokens_per_s)
            for lv in run.levels
            if lv.output_tokens_per_s is not None
        ]
        if not points:
            continue
        xs, ys = [p[0] for p in points], [float(p[1]) for p in points]
        ax.plot(xs, ys, marker="o", color=f"C{r % 10}", label=run.label)
        for x, y in zip(xs, ys, strict=True):  # the top value's label above, others below
            ax.annotate(
                f"{y:.0f}",
                (x, y),
                textcoords="offset points",
                ha="center",
                xytext=(0, 6 if y >= top[x] else -13),
                fontsize="small",
                color=f"C{r % 10}",
            )
    if levels and levels[-1] > 2 * max(levels[0], 1):
        ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.1)
    ax.set_title("output throughput vs concurrency")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small", loc="lower right")


def build_figure(runs: Sequence[RunSamples], title: str | None = None) -> Figure:
    """The figure (matplotlib, Agg): axes 0 the TTFT ECDFs, 1 the ITL ECDFs (one step line per
    run and level with samples, x in ms: the samples x 1000, sorted), 2 output tokens/s against
    concurrency (one line per run with a known throughput, one point per level). ``title``
    goes above the panels. Raises :class:`PlotError` when matplotlib is missing."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 4.6), layout="constrained")
    ax_ttft, ax_itl, ax_tput = fig.subplots(1, 3)
    _ecdf_panel(ax_ttft, runs, "ttft", "TTFT")
    _ecdf_panel(ax_itl, runs, "itl", "ITL")
    _throughput_panel(ax_tput, runs)
    if title:
        fig.suptitle(title)
    return fig


def write_plot(
    runs: Sequence[RunSamples], path: Path, title: str | None = None, dpi: int = DPI
) -> Path:
    """Draw :func:`build_figure` into the PNG ``path`` (folders made as needed) and return it."""
    fig = build_figure(runs, title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=dpi)
    return path
