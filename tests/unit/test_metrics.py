"""metrics.jsonl: a resumed run's records replace the crashed run's; the curves PNG is written."""

import json

from mcore_rl.metrics import MetricsLogger, plot_curves, read_metrics


def test_resumed_records_win_and_curves_are_plotted(tmp_path):
    first = MetricsLogger(tmp_path, tensorboard=True, total=3, start=0)
    for episode in (1, 2):
        first.log(episode, {"reward/mean": 0.1 * episode})
    first.log(2, {"eval/accuracy": 0.5}, advance=False)
    first.close()
    resumed = MetricsLogger(tmp_path, tensorboard=True, total=3, start=1)  # crashed after the episode-1 checkpoint
    resumed.event("resume", episode=1)
    resumed.log(2, {"reward/mean": 0.7})
    resumed.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["episode"] for r in records] == [1, 2]
    assert records[1]["reward/mean"] == 0.7
    assert any(json.loads(line).get("event") == "resume" for line in (tmp_path / "metrics.jsonl").open())
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    png = plot_curves(tmp_path / "metrics.jsonl", tmp_path / "curves.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
