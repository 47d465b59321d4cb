"""Where a run's numbers go: an append-only ``metrics.jsonl``, the configured loggers (:mod:`mcore_rl.loggers`:
TensorBoard, wandb, MLflow), a console progress bar, and a PNG of the reward and accuracy curves at the end."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path

from mcore_rl.loggers import LogConfig, open_sinks

log = logging.getLogger(__name__)

BAR_KEYS = {"reward/mean": "reward", "eval/accuracy": "eval_acc", "train/kl": "kl", "time/episode": "s/ep"}
# The console's line per episode: (metric, label, format), those the run has; then its phase times.
LINE_KEYS = (
    ("reward/mean", "reward", ".3f"),
    ("response/length_mean", "length", ".0f"),
    ("response/truncated_fraction", "truncated", ".2f"),
    ("train/kl", "kl", ".2e"),
    ("train/entropy", "entropy", ".3f"),
    ("train/grad_norm", "grad_norm", ".3g"),
    ("throughput/response_tokens_per_s", "tokens/s", ".0f"),
    ("time/episode", "s", ".1f"),
)


class MetricsLogger:
    def __init__(
        self, output_dir: str | Path, config: LogConfig, total: int, start: int, name: str = "run", params=None
    ):
        """The run in ``output_dir`` named ``name``, of ``total`` episodes, resumed after episode ``start`` (0: new);
        ``params``: its resolved config, flat, for the loggers that keep parameters."""
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        self.dir = Path(output_dir)
        self.jsonl = self.dir / "metrics.jsonl"
        self.sinks = open_sinks(config, self.dir, name, start, params or {})
        self._console = contextlib.ExitStack()  # log lines on the console go above the bar, which stays whole
        self._console.enter_context(logging_redirect_tqdm())
        # no bar where the console is a file (a cluster job's log): the episode lines say it all there
        self.bar = tqdm(total=total, initial=start, desc="episodes", dynamic_ncols=True, disable=None)
        self.last: dict[str, float] = {}
        self.total = total

    def log(self, episode: int, metrics: dict[str, float | list[float]], advance: bool = True) -> None:
        """Scalars, and lists (e.g. tokens per expert) that TensorBoard and wandb show as histograms."""
        metrics = {
            k: [float(x) for x in v] if isinstance(v, list) else float(v) for k, v in metrics.items() if v is not None
        }
        with self.jsonl.open("a") as f:
            f.write(json.dumps({"episode": episode, **metrics}) + "\n")
        for sink in self.sinks:
            sink.log(episode, metrics)
        self.last.update(metrics)
        self.bar.set_postfix({short: f"{self.last[k]:.3g}" for k, short in BAR_KEYS.items() if k in self.last})
        if advance:
            log.info("%s", episode_line(episode, metrics, self.total))
            self.bar.update(1)

    def event(self, name: str, **fields) -> None:
        """A one-off record (start, resume, checkpoint) in metrics.jsonl and the log."""
        with self.jsonl.open("a") as f:
            f.write(json.dumps({"event": name, "time": time.time(), **fields}) + "\n")
        log.info("%s: %s", name, _fields(fields))

    def close(self) -> None:
        self.bar.close()
        self._console.close()
        for sink in self.sinks:
            sink.close()


def _fields(fields: dict) -> str:
    """``key=value, ...`` with numbers to four significant digits, nested records too."""

    def show(value) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        if isinstance(value, dict):
            return "{" + _fields(value) + "}"
        return str(value)

    return ", ".join(f"{key}={show(value)}" for key, value in fields.items())


def episode_line(episode: int, metrics: dict, total: int) -> str:
    """One line of an episode's main numbers and phase times, kept in the console's scrollback."""
    parts = [f"{label} {metrics[key]:{fmt}}" for key, label, fmt in LINE_KEYS if key in metrics]
    phases = [
        f"{key[5:]} {v:.1f}"
        for key, v in metrics.items()
        if key.startswith("time/") and key != "time/episode" and v >= 0.05
    ]
    return f"episode {episode}/{total}: " + ", ".join(parts) + (f" ({', '.join(phases)})" if phases else "")


def process_stats() -> dict[str, float]:
    """This process's thread count and resident memory: both stay flat over a healthy run (a leaked process group
    shows as threads, a leaked buffer as memory)."""
    import psutil

    process = psutil.Process()
    return {"threads": float(process.num_threads()), "rss_bytes": float(process.memory_info().rss)}


def read_metrics(path: str | Path) -> list[dict]:
    """Episode records of a metrics.jsonl; after a resume the latest record of each episode wins."""
    latest: dict[int, dict] = {}
    for line in Path(path).read_text().splitlines():
        record = json.loads(line)
        if "episode" in record and "event" not in record:
            latest.setdefault(record["episode"], {}).update(record)
    return [latest[e] for e in sorted(latest)]


def plot_curves(metrics_path: str | Path, png_path: str | Path) -> Path:
    """Mean training reward and eval accuracy per episode, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (("reward/mean", "train reward (mean)"), ("eval/accuracy", "eval accuracy")):
        points = [(r["episode"], r[key]) for r in records if key in r]
        if points:
            ax.plot(*zip(*points, strict=True), marker="o" if key.startswith("eval") else None, label=label)
    ax.set_xlabel("episode")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return Path(png_path)
