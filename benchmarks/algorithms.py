"""The ``algorithms`` suite: does each advantage estimator learn? The main job (SmolLM2-135M-Instruct on the built-in
arithmetic set, the same command) once per estimator, on one device (trainer, reference, critic and engine
colocated on both cores; a 2-device run with the critic's ranks beside the trainer's does not fit 24 GiB at a
save):

- ``rloo``: the leave-one-out baseline;
- ``reinforce_pp``: REINFORCE++, batch-whitened returns with a k1 KL penalty (0.01) in the per-token reward;
- ``gae``: PPO with a critic started from the policy (value head on SmolLM2), GAE with gamma = lam = 1, one
  episode of critic warm-up;
- ``distill``: on-policy distillation alone (no task advantage, ``distill_coef`` 1): the student is SmolLM2, the
  teacher the ``rloo`` run's final policy (its checkpoint converted to HF by ``mcore-rl-mcore2hf``).

Reported per run: the training reward per episode (curve; mean over the first and last quarter), greedy eval
accuracy on 100 held-out problems before the first and after the last episode, and the estimator's own signals
(the critic's explained variance and value loss, the reverse KL to the teacher, the reward's KL penalty).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.hardware import Hardware
from benchmarks.report import Report, plot_rewards, pyplot, table
from benchmarks.rl import REPO, Variant

COMMON = ("runtime_args.num_devices=1", "models.policy_trainer.micro_batch_size=8")
RUNS = (
    Variant("rloo", "RLOO", overrides=(*COMMON, "models.policy_trainer.advantage_estimator=rloo")),
    Variant(
        "reinforce_pp",
        "REINFORCE++, KL 0.01 in the reward",
        overrides=(
            *COMMON,
            "models.policy_trainer.advantage_estimator=reinforce_pp",
            "models.policy_trainer.reward_kl_coef=0.01",
        ),
    ),
    Variant(
        "gae",
        "PPO: GAE with a critic from the policy",
        overrides=(
            *COMMON,
            "models.policy_trainer.advantage_estimator=gae",
            "models.critic.load=${models.policy_trainer.load}",
            "models.critic.micro_batch_size=8",
            "models.critic.warmup_episodes=1",
        ),
    ),
    Variant(
        "distill",
        "on-policy distillation from the rloo run's policy",
        overrides=(*COMMON, "models.policy_trainer.advantage_estimator=none", "models.policy_trainer.distill_coef=1.0"),
    ),
)
SIGNALS = ("critic/explained_variance", "critic/value_loss", "distill/reverse_kl", "batch/reward_kl")


def teacher_from(run_dir: Path, out: Path) -> Path:
    """The run's last checkpoint as an HF directory (the converter CLI a user runs)."""
    from mcore_rl import checkpoint

    _, last = checkpoint.complete(run_dir / "checkpoints")[-1]
    if not (out / "config.json").exists():
        command = [sys.executable, "-m", "mcore_rl.convert", "mcore2hf", str(last), str(out)]
        subprocess.run(command, cwd=REPO, check=True)
    return out


def run(
    variant: Variant, out: Path, episodes: int, extra: tuple[str, ...] = (), suite_name: str = "algorithms"
) -> dict:
    """The variant's episodes (metrics.jsonl records) and eval accuracies, from the user's command (a run already
    complete under ``out`` is read again, not repeated)."""
    directory = out / "runs" / f"{suite_name}-{variant.name}"
    args = [
        f"runtime_args.output_dir={directory}",
        f"runtime_args.num_episode={episodes}",
        f"runtime_args.save_episode_interval={episodes}",
        f"runtime_args.eval_episode_interval={episodes}",
        "runtime_args.keep_checkpoints=1",
        *variant.overrides,
        *extra,
    ]
    log = out / "runs" / f"{suite_name}-{variant.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    if not (directory / "metrics.jsonl").exists() or "eval/accuracy" not in (directory / "metrics.jsonl").read_text():
        with log.open("w") as f:
            subprocess.run(["bash", variant.script, *args], cwd=REPO, check=True, stdout=f, stderr=subprocess.STDOUT)
    records = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in records if "event" not in r and "reward/mean" in r]
    evals = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
    return {"name": variant.name, "what": variant.what, "episodes": rows, "evals": evals, "dir": directory}


def _mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return statistics.mean(values) if values else None


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.3g}"


def suite(out: Path, hardware: Hardware, report: Report, episodes: int) -> None:
    del hardware  # the rl suite reports the machine; this one compares learning curves
    results = []
    for variant in RUNS:
        extra = ()
        if variant.name == "distill":
            teacher = teacher_from(results[0]["dir"], out / "runs" / "algorithms-teacher")
            extra = (f"models.teacher.load={teacher}",)
        results.append(run(variant, out, episodes, extra))
    quarter = max(1, episodes // 4)
    rows, signal_rows = [], []
    for r in results:
        eps = r["episodes"]
        rows.append(
            [
                r["name"], r["what"], _fmt(_mean(eps[:quarter], "reward/mean")),
                _fmt(_mean(eps[-quarter:], "reward/mean")), _fmt(r["evals"][0]), _fmt(r["evals"][-1]),
                _fmt(_mean(eps, "time/episode")),
            ]
        )  # fmt: skip
        for key in SIGNALS:
            if _mean(eps, key) is not None:
                signal_rows.append([r["name"], key, _fmt(_mean(eps[:quarter], key)), _fmt(_mean(eps[-quarter:], key))])
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(12, 3))
    plot_rewards(axes[0], results)
    for ax, key, name in ((axes[1], "critic/explained_variance", "gae"), (axes[2], "distill/reverse_kl", "distill")):
        eps = next(r for r in results if r["name"] == name)["episodes"]
        ax.plot([e["episode"] for e in eps if key in e], [e[key] for e in eps if key in e])
        ax.set_ylabel(f"{name}: {key}")
    for ax in axes[1:]:
        ax.set_xlabel("episode")
    fig.tight_layout()
    report.add(
        "algorithms: one run per advantage estimator",
        f"SmolLM2-135M-Instruct, the main job's settings on one device, {episodes} episodes of 32 samples (8 prompts x "
        "4) on `builtin:arithmetic`; eval: greedy accuracy on 100 held-out problems before the first and after the "
        "last episode. Reward: the math reward (1 for the right number). Not asserted anywhere: a record.",
        table(
            ["run", "what", "reward, first quarter", "reward, last quarter", "eval before", "eval after", "s/episode"],
            rows,
        ),
        "Each estimator's own signals (mean over the first and the last quarter of the episodes):",
        table(["run", "metric", "first quarter", "last quarter"], signal_rows),
        report.figure(fig, "algorithms", "training reward per episode; the critic's explained variance; reverse KL"),
    )
