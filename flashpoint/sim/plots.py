"""PNG figures of a grid's results (issue 7): the thesis's Fig 8.9/8.11-style bars and CDFs.

* ``<stem>_<trace>_<model>_bars.png``: average cold start, average and p99 end-to-end
  latency, one group of bars per autoscaler, one bar per technique (log scale: BL's
  registry-bound numbers are orders of magnitude above the rest);
* ``<stem>_<trace>_<model>_cdf.png``: the end-to-end latency CDF of every technique, one
  panel per autoscaler.

matplotlib is optional (the ``sim`` extra): without it :func:`write_plots` writes nothing and
returns ``[]``, and the markdown report is written as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flashpoint.sim.results import RunResult

__all__ = ["write_plots", "plots_markdown"]

_METRICS = (("avg_cold_start_s", "average cold start (s)"),
            ("avg_latency_s", "average end-to-end (s)"),
            ("p99_latency_s", "p99 end-to-end (s)"))
_FLOOR = 1e-3  # log axes: a zero (no cold start) is drawn at this height


def write_plots(results: Sequence[RunResult], out_dir: Path, stem: str) -> list[Path]:
    """Write the figures for ``results`` into ``out_dir``; the paths written, [] without
    matplotlib."""
    try:
        import matplotlib  # noqa: PLC0415 - optional, heavy
    except ImportError:
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    groups: dict[tuple[str, str], list[RunResult]] = {}
    for r in results:
        groups.setdefault((r.trace, r.model), []).append(r)
    for (trace, model), rows in groups.items():
        scalers = list(dict.fromkeys(r.autoscaler for r in rows))
        techs = list(dict.fromkeys(r.technique for r in rows))
        by = {(r.autoscaler, r.technique): r for r in rows}
        width = 0.8 / max(1, len(techs))

        fig, axes = plt.subplots(1, len(_METRICS), figsize=(5 * len(_METRICS), 4))
        for ax, (attr, label) in zip(axes, _METRICS, strict=True):
            for i, tech in enumerate(techs):
                xs, ys = [], []
                for j, scaler in enumerate(scalers):
                    r = by.get((scaler, tech))
                    if r is not None:
                        xs.append(j + (i - (len(techs) - 1) / 2) * width)
                        ys.append(max(_FLOOR, getattr(r.metrics, attr)))
                ax.bar(xs, ys, width, label=tech.value)
            ax.set_xticks(range(len(scalers)), [s.upper() for s in scalers])
            ax.set_yscale("log")
            ax.set_ylabel(label)
            ax.grid(axis="y", alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.suptitle(f"{model}, {trace} trace: per technique and autoscaler")
        fig.tight_layout()
        path = out_dir / f"{stem}_{trace}_{model}_bars.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

        fig, axes = plt.subplots(1, len(scalers), figsize=(4.5 * len(scalers), 4), squeeze=False)
        for ax, scaler in zip(axes[0], scalers, strict=True):
            for tech in techs:
                r = by.get((scaler, tech))
                if r is None or not r.metrics.latencies_s:
                    continue
                xs = sorted(r.metrics.latencies_s)
                n = len(xs)
                step = max(1, n // 2000)  # at most ~2,000 points per curve
                pts = list(range(0, n, step)) + ([n - 1] if (n - 1) % step else [])
                ax.plot([max(_FLOOR, xs[k]) for k in pts], [(k + 1) / n for k in pts],
                        label=tech.value)
            ax.set_xscale("log")
            ax.set_xlabel("end-to-end latency (s)")
            ax.set_title(scaler.upper())
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("fraction of requests")
        axes[0][0].legend(fontsize=8)
        fig.suptitle(f"{model}, {trace} trace: end-to-end latency CDF")
        fig.tight_layout()
        path = out_dir / f"{stem}_{trace}_{model}_cdf.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def plots_markdown(paths: Sequence[Path], report: Path) -> str:
    """A report section linking the figures (relative to the report's directory)."""
    if not paths:
        return ("\n## Plots\n\nNot drawn: matplotlib is not installed "
                "(`pip install flashpoint[sim]`).\n")
    lines = ["", "## Plots", "",
             "Log axes; a bar at 10⁻³ s means the run had no cold start (or a zero latency).",
             ""]
    for p in paths:
        lines.append(f"![{p.stem}]({p.relative_to(report.parent).as_posix()})")
        lines.append("")
    return "\n".join(lines)
