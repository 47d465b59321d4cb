"""metrics.jsonl: a resumed run's records replace the crashed run's; the curves PNG is written. Each logger's
metrics (and the run's parameters) read back through that library's own API, a resumed run in the same run."""

import json

import pytest

from mcore_rl.config.loader import ConfigError, build
from mcore_rl.loggers import LogConfig, MlflowConfig, WandbConfig
from mcore_rl.metrics import MetricsLogger, plot_curves, read_metrics

EVERY = LogConfig(
    loggers=["tensorboard", "wandb", "mlflow"], wandb=WandbConfig(mode="offline"), mlflow=MlflowConfig(experiment="e")
)


def _crash_and_resume(out, config: LogConfig) -> None:
    """Episodes 1 and 2 (an eval at 2), a crash after the episode-1 checkpoint, the resumed run's 2 and 3."""
    params = {"models.policy_trainer.optimizer.lr": "1e-05", "runtime_args.log.loggers": str(config.loggers)}
    first = MetricsLogger(out, config, total=3, start=0, name="run", params=params)
    for episode in (1, 2):
        first.log(episode, {"reward/mean": 0.1 * episode, "router/tokens": [1.0, 3.0]})
    first.log(2, {"eval/accuracy": 0.5}, advance=False)
    first.close()
    resumed = MetricsLogger(out, config, total=3, start=1, name="run", params=params)
    resumed.event("resume", episode=1)
    for episode in (2, 3):
        resumed.log(episode, {"reward/mean": 0.5 + 0.1 * episode})
    resumed.close()


def test_resumed_records_win_and_curves_are_plotted(tmp_path):
    _crash_and_resume(tmp_path, LogConfig(loggers=[]))
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["episode"] for r in records] == [1, 2, 3]
    assert records[1]["reward/mean"] == 0.7 and records[1]["eval/accuracy"] == 0.5
    assert any(json.loads(line).get("event") == "resume" for line in (tmp_path / "metrics.jsonl").open())
    assert not (tmp_path / "tensorboard").exists()  # no logger but metrics.jsonl
    png = plot_curves(tmp_path / "metrics.jsonl", tmp_path / "curves.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_logger_reads_back_its_metrics_and_a_resumed_run_continues_its_run(tmp_path):
    _crash_and_resume(tmp_path, EVERY)
    want = {1: 0.1, 2: 0.7, 3: 0.8}  # episode 2 as the resumed run logged it
    # TensorBoard: the crashed run's events past its checkpoint are purged
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0}).Reload()
    assert {e.step: e.value for e in events.Scalars("reward/mean")} == pytest.approx(want)
    assert "router/tokens" in events.Tags()["histograms"]
    # MLflow: one run, its parameters, every logged value (a step logged twice keeps both, the resumed run's last)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("e").experiment_id])
    assert run.data.params["models.policy_trainer.optimizer.lr"] == "1e-05" and run.info.status == "FINISHED"
    history = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "reward/mean")]
    assert {step: value for step, value in history} == pytest.approx(want) and len(history) == 4
    assert run.data.metrics["eval/accuracy"] == 0.5 and "router/tokens" not in run.data.metrics
    # wandb: two offline run directories of one run id, ready for `wandb sync`; its history and parameters
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    run_id = (tmp_path / "wandb_run_id").read_text().strip()
    assert len(runs) == 2 and all(r.name.endswith(run_id) for r in runs)
    history, config = _wandb_records(runs[0])
    assert [(h["_step"], h["reward/mean"]) for h in history] == [(1, 0.1), (2, pytest.approx(0.2))]
    assert history[0]["router/tokens"]["_type"] == "histogram"
    assert config["models.policy_trainer.optimizer.lr"] == "1e-05"
    assert [(h["_step"], h["reward/mean"]) for h in _wandb_records(runs[1])[0]] == [
        (2, pytest.approx(0.7)),
        (3, pytest.approx(0.8)),
    ]


def _wandb_records(run_dir) -> tuple[list[dict], dict]:
    """(history rows, config) of a wandb offline run, read with wandb's own reader of its run files."""
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal import datastore

    store = datastore.DataStore()
    store.open_for_scan(str(next(run_dir.glob("run-*.wandb"))))
    history, config = [], {}
    while (data := store.scan_data()) is not None:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {}
            for item in record.history.item:
                value, path = json.loads(item.value_json), [item.key] if item.key else list(item.nested_key)
                if len(path) == 2:  # a histogram's fields
                    row.setdefault(path[0], {})[path[1]] = value
                else:
                    row[path[0]] = value
            history.append(row)
        elif kind == "run":
            config |= {u.key: json.loads(u.value_json) for u in record.run.config.update if u.key != "_wandb"}
    return history, config


def test_logger_settings_are_checked():
    for config, message in (
        (LogConfig(loggers=["neptune"]), r"loggers: \['neptune'\] are no loggers; expected some of"),
        (LogConfig(loggers=["wandb", "wandb"]), r"names one twice"),
        (LogConfig(loggers=["mlflow"], mlflow=MlflowConfig(experiment="")), r"mlflow.experiment: empty"),
    ):
        with pytest.raises(ValueError, match=message):
            config.validate()
    with pytest.raises(ConfigError, match=r"runtime_args.log.wandb.mode='cloud': expected one of \['auto', 'online'"):
        build(LogConfig, {"wandb": {"mode": "cloud"}}, "runtime_args.log")


def test_the_console_gets_one_line_per_episode(tmp_path, caplog):
    logger = MetricsLogger(tmp_path, LogConfig(loggers=[]), total=40, start=0)
    metrics = {
        "reward/mean": 0.25, "response/length_mean": 45.2, "train/kl": 0.00123, "throughput/response_tokens_per_s": 180.4,
        "time/episode": 16.24, "time/rollout_and_reward": 4.31, "time/train": 9.2, "router/tokens": [1.0, 2.0],
    }  # fmt: skip
    with caplog.at_level("INFO", logger="mcore_rl.metrics"):
        logger.log(3, metrics)
        logger.log(3, {"eval/accuracy": 0.31}, advance=False)  # the driver logs an eval's table
        logger.event("checkpoint", path="/out/episode_3", optimizer={"step": 3.0, "exp_avg": -0.08716350191995804})
    logger.close()
    assert caplog.messages == [
        "episode 3/40: reward 0.250, length 45, kl 1.23e-03, tokens/s 180, s 16.2 (rollout_and_reward 4.3, train 9.2)",
        "checkpoint: path=/out/episode_3, optimizer={step=3, exp_avg=-0.08716}",
    ]
