"""The ``rewards`` suite: a reward model served as a model, weighted into the reward. The main job (SmolLM2-135M-
Instruct on the built-in arithmetic set, one device) with its reward the math checker plus 0.2 x a SmolLM2 reward
model that ``mcore_rl.rewards.preference`` fits first (a score head on SmolLM2's hidden states preferring the
instruction's format, the number alone, to the same number in a sentence), against the same run with the math
checker alone.

Reported per run: each reward's mean per episode (curves), greedy eval accuracy (the math checker's) before and
after, and the reward model's score of the eval answers.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.algorithms import COMMON, _fmt, _mean, run
from benchmarks.hardware import Hardware
from benchmarks.report import Report, pyplot, table
from benchmarks.rl import Variant

RM_WEIGHT = 0.2
RUNS = (
    Variant("math", "the math checker alone", overrides=COMMON),
    Variant("math+rm", f"the math checker + {RM_WEIGHT} x the reward model", overrides=COMMON),
)


def reward_model(out: Path) -> tuple[Path, dict]:
    """The SmolLM2 reward model (built once under ``out``) and its preference accuracy."""
    import json

    from converters.gguf2hf import default_model_dir
    from mcore_rl.rewards.preference import arithmetic_pairs, build_reward_model

    directory, record = out / "runs" / "rewards-reward-model", out / "runs" / "rewards-reward-model.json"
    if not record.exists():
        accuracy = build_reward_model(str(default_model_dir()), directory, arithmetic_pairs(256, 1), held_out=64)
        record.write_text(json.dumps(accuracy))
    return directory, json.loads(record.read_text())


def suite(out: Path, hardware: Hardware, report: Report, episodes: int) -> None:
    del hardware  # the rl suite reports the machine; this one compares rewards
    model, accuracy = reward_model(out)
    extra = (
        f"models.reward_model.load={model}",
        f"models.reward_model.weight={RM_WEIGHT}",
        "models.reward_model.micro_batch_size=8",
    )
    results = [run(v, out, episodes, extra if "rm" in v.name else (), "rewards") for v in RUNS]
    quarter = max(1, episodes // 4)
    rows = []
    for r in results:
        eps = r["episodes"]
        for key in ("reward/mean", "reward/math/mean", "reward/rm/mean", "response/length_mean"):
            if _mean(eps, key) is not None:
                rows.append([r["name"], key, _fmt(_mean(eps[:quarter], key)), _fmt(_mean(eps[-quarter:], key))])
        rows.append([r["name"], "eval/accuracy (math), before -> after", _fmt(r["evals"][0]), _fmt(r["evals"][-1])])
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3))
    for r in results:
        for ax, key in zip(axes, ("reward/math/mean", "reward/rm/mean"), strict=True):
            points = [(e["episode"], e[key]) for e in r["episodes"] if key in e]
            if points:
                ax.plot(*zip(*points, strict=True), label=r["name"])
                ax.set_ylabel(key)
    for ax in axes:
        ax.set_xlabel("episode")
        ax.legend(fontsize=7)
    fig.tight_layout()
    report.add(
        "rewards: a reward model weighted into the reward",
        f"SmolLM2-135M-Instruct, the main job's settings on one device, {episodes} episodes of 32 samples on "
        f"`builtin:arithmetic`. The reward model: SmolLM2 with a Bradley-Terry score head fitted on 192 format "
        f"preference pairs (held-out preference accuracy {accuracy['held_out_accuracy']:.2f} on 64), served by "
        "`models.reward_model` (its own Megatron role, conversations rendered with its chat template).",
        table(["run", "metric", "first quarter", "last quarter"], rows),
        report.figure(fig, "rewards", "each reward's mean per episode"),
    )
