"""Where a run's metrics go besides ``metrics.jsonl`` (the run's own record, always written: resumes and the curves
read it): TensorBoard, Weights & Biases and MLflow, chosen by ``runtime_args.log.loggers``. Each gets the same
metric names at the same step (the episode), the wandb and MLflow runs the resolved config as their parameters, and
a resumed run continues the same wandb and MLflow run (their ids are kept in the output directory)."""

from __future__ import annotations

import importlib.util
import netrc
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

LOGGERS = ("tensorboard", "wandb", "mlflow")
PACKAGES = ("wandb", "mlflow")  # the loggers that need a package of their own (setup.py's extras)


@dataclass
class WandbConfig:
    project: str = "mcore-rl"
    entity: str = ""  # "": the API key's default entity
    # offline: a run directory under OUTPUT_DIR/wandb that `wandb sync` uploads later; online: needs an API key
    # (WANDB_API_KEY or `wandb login`); auto: online where a key is configured, else offline
    mode: Literal["auto", "online", "offline"] = "auto"


@dataclass
class MlflowConfig:
    tracking_uri: str = ""  # "": a SQLite store at OUTPUT_DIR/mlflow.db; else a tracking server or database URI
    experiment: str = "${runtime_args.exp_name}"


@dataclass
class LogConfig:
    loggers: list[str] = field(default_factory=lambda: ["tensorboard"])  # of LOGGERS; metrics.jsonl is always written
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    # false: each role's whole output in OUTPUT_DIR/logs/<role>-<rank>.log and only its warnings and errors on the
    # console; true: everything on the console (mcore_rl.console)
    verbose: bool = False

    def validate(self, prefix: str = "runtime_args.log") -> None:
        if unknown := [name for name in self.loggers if name not in LOGGERS]:
            raise ValueError(f"{prefix}.loggers: {unknown} are no loggers; expected some of {list(LOGGERS)}")
        if len(set(self.loggers)) != len(self.loggers):
            raise ValueError(f"{prefix}.loggers: {self.loggers} names one twice")
        for name in set(self.loggers) & set(PACKAGES):
            if importlib.util.find_spec(name) is None:
                raise ValueError(f"{prefix}.loggers: {name} needs its package; pip install 'mcore-rl[{name}]'")
        if "mlflow" in self.loggers and not self.mlflow.experiment:
            raise ValueError(f"{prefix}.mlflow.experiment: empty; name the MLflow experiment")


Metrics = dict[str, float | list[float]]


class Sink(Protocol):
    def log(self, step: int, metrics: Metrics) -> None: ...

    def close(self) -> None: ...


def open_sinks(config: LogConfig, out: Path, name: str, start: int, params: dict[str, str]) -> list[Sink]:
    """The configured loggers of the run in ``out`` named ``name``, resumed after episode ``start`` (0: a new run);
    ``params``: the resolved config, flat."""
    makers = {
        "tensorboard": lambda: TensorBoard(out, start),
        "wandb": lambda: Wandb(config.wandb, out, name, params),
        "mlflow": lambda: Mlflow(config.mlflow, out, name, params),
    }
    return [makers[logger]() for logger in config.loggers]


def flat_params(tree: dict, prefix: str = "") -> dict[str, str]:
    """Nested config sections as dotted keys (``models.policy_trainer.optimizer.lr``) with printed values."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= flat_params(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = str(value)
    return out


def _run_id(path: Path, new) -> str:
    """The id kept at ``path`` by an earlier start of this run, or ``new()`` kept there."""
    if path.is_file():
        return path.read_text().strip()
    run_id = new()
    path.write_text(run_id + "\n")
    return run_id


class TensorBoard:
    """Scalars, and lists (tokens per expert) as histograms, under ``OUTPUT_DIR/tensorboard``."""

    def __init__(self, out: Path, start: int):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: after a resume, events past the checkpoint (from the crashed run) are dropped
        self.writer = SummaryWriter(str(out / "tensorboard"), purge_step=start + 1 if start else None)

    def log(self, step: int, metrics: Metrics) -> None:
        import torch

        for key, value in metrics.items():
            if isinstance(value, list):
                self.writer.add_histogram(key, torch.tensor(value), step)
            else:
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _wandb_key() -> bool:
    """Whether an API key is configured (the environment, or `wandb login`'s netrc entry)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


class Wandb:
    """A wandb run (its files under ``OUTPUT_DIR/wandb``); lists as histograms. Steps a resumed run logs again
    (episodes past its checkpoint) are ignored by wandb, which keeps the crashed run's."""

    def __init__(self, config: WandbConfig, out: Path, name: str, params: dict[str, str]):
        import wandb

        mode = config.mode if config.mode != "auto" else "online" if _wandb_key() else "offline"
        self.wandb = wandb
        self.run = wandb.init(
            project=config.project, entity=config.entity or None, name=name, config=params, mode=mode,
            id=_run_id(out / "wandb_run_id", wandb.util.generate_id), dir=str(out),
            resume="allow" if mode == "online" else None,  # offline, each start is a directory of that run's
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
        )  # fmt: skip

    def log(self, step: int, metrics: Metrics) -> None:
        self.run.log({k: self.wandb.Histogram(v) if isinstance(v, list) else v for k, v in metrics.items()}, step=step)

    def close(self) -> None:
        self.run.finish()


class Mlflow:
    """An MLflow run in ``config.experiment``: scalars (MLflow has no histograms); the parameters logged once."""

    MAX_PARAM = 6000  # MLflow's longest parameter value

    def __init__(self, config: MlflowConfig, out: Path, name: str, params: dict[str, str]):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = config.tracking_uri or f"sqlite:///{(out / 'mlflow.db').resolve()}"
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(config.experiment)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(config.experiment)
        resumed = (out / "mlflow_run_id").is_file()
        self.run_id = _run_id(
            out / "mlflow_run_id", lambda: self.client.create_run(experiment_id, run_name=name).info.run_id
        )
        if resumed:
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            items = [Param(k, v[: self.MAX_PARAM]) for k, v in params.items()]
            for i in range(0, len(items), 100):  # MLflow takes 100 parameters per batch
                self.client.log_batch(self.run_id, params=items[i : i + 100])

    def log(self, step: int, metrics: Metrics) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        scalars = [Metric(k, v, now, step) for k, v in metrics.items() if not isinstance(v, list)]
        for i in range(0, len(scalars), 1000):  # MLflow takes 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=scalars[i : i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
