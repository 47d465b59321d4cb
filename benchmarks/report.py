"""A benchmark run's report: markdown sections (tables and the PNG plots beside them) in ``<out>/report.md``."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path


def table(header: list[str], rows: list[list]) -> str:
    def cell(value) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
        return str(value)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def min_median(values: list[float]) -> tuple[float, float]:
    return min(values), statistics.median(values)


@dataclass
class Report:
    out: Path
    sections: list[str] = field(default_factory=list)

    def add(self, title: str, *parts: str) -> None:
        self.sections.append("\n\n".join([f"## {title}", *[p for p in parts if p]]))

    def figure(self, fig, name: str, caption: str) -> str:
        """Save a matplotlib figure as ``<out>/<name>.png``; returns its markdown."""
        import matplotlib.pyplot as plt

        path = self.out / f"{name}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return f"![{caption}]({path.name})"

    def write(self, header: str) -> Path:
        path = self.out / "report.md"
        path.write_text(header + "\n\n" + "\n\n".join(self.sections) + "\n")
        return path


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_rewards(ax, results: list[dict]) -> None:
    """Each run's training reward per episode on ``ax`` (``results``: runs with a name and their episodes)."""
    for r in results:
        ax.plot([e["episode"] for e in r["episodes"]], [e["reward/mean"] for e in r["episodes"]], label=r["name"])
    ax.set_xlabel("episode")
    ax.set_ylabel("training reward (accuracy)")
    ax.legend(fontsize=7)
