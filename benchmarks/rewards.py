"""The ``rewards`` suite: rewards beyond one function. The main job (SmolLM2-135M-Instruct on the built-in
arithmetic set, one device) with its reward the math checker alone; plus 0.02 x a SmolLM2 reward model that
``mcore_rl.rewards.preference`` fits first (a score head on SmolLM2's hidden states preferring the instruction's
format, the number alone, to the same number in a sentence; its scores span about -20..20, so 0.02 keeps it beside
the checker's 0/1 rather than above it), with the rewards scored beside the rollout and after it; and plus 0.5 x
SmolLM2 judging the answers (yes/no): the policy itself on its own engines, and the initial SmolLM2 on a judge
engine of its own.

Reported per run: each reward's mean over the first and last quarter of the episodes (curves), greedy eval accuracy
(the math checker's) before and after, the judge's unreadable verdicts, and the reward phase's time: what is left
to wait for once the rollout has finished (``time/reward_wait``) and the rollout with its rewards.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.algorithms import COMMON, _fmt, _mean, run
from benchmarks.hardware import Hardware
from benchmarks.report import Report, pyplot, table
from benchmarks.rl import Variant

RM_WEIGHT = 0.02
JUDGE = (
    "models.judge.template='Question: {question}\nProposed answer: {response}\nIs the proposed answer correct? "
    "Answer yes or no.'",
    "models.judge.parser=yes_no",
    "models.judge.weight=0.5",
    "models.judge.max_new_tokens=8",
)
RUNS = (
    Variant("math", "the math checker alone", overrides=COMMON),
    Variant("math+rm", f"the math checker + {RM_WEIGHT} x the reward model", overrides=COMMON),
    Variant(
        "math+rm-after",
        "the same, each batch scored after its rollout",
        overrides=(*COMMON, "models.reward.overlap_rollout=false"),
    ),
    Variant(
        "math+judge",
        "the math checker + 0.5 x the policy judging itself (yes/no) on its engines",
        overrides=(*COMMON, *JUDGE, "models.judge.load=policy"),
    ),
    Variant(
        "math+judge-own",
        "the same judged by the initial SmolLM2 on a judge engine of its own",
        overrides=(*COMMON, *JUDGE, "models.judge.max_model_len=1024"),  # load: the model dir, given at run time
    ),
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
    from converters.gguf2hf import default_model_dir

    del hardware  # the rl suite reports the machine; this one compares rewards
    model, accuracy = reward_model(out)
    extra = (
        f"models.reward_model.load={model}",
        f"models.reward_model.weight={RM_WEIGHT}",
        "models.reward_model.micro_batch_size=8",
    )
    own_judge = (f"models.judge.load={default_model_dir()}",)
    results = [
        run(v, out, episodes, extra if "+rm" in v.name else own_judge if "own" in v.name else (), "rewards")
        for v in RUNS
    ]
    quarter = max(1, episodes // 4)
    rows = []
    for r in results:
        eps = r["episodes"]
        keys = ("reward/mean", "reward/math/mean", "reward/rm/mean", "reward/judge/mean", "reward/judge_failures")
        for key in (*keys, "response/length_mean", "time/reward_wait", "time/rollout_and_reward"):
            if _mean(eps, key) is not None:
                rows.append([r["name"], key, _fmt(_mean(eps[:quarter], key)), _fmt(_mean(eps[-quarter:], key))])
        rows.append([r["name"], "eval/accuracy (math), before -> after", _fmt(r["evals"][0]), _fmt(r["evals"][-1])])
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(12, 3))
    for r in results:
        for ax, key in zip(axes, ("reward/math/mean", "reward/rm/mean", "reward/judge/mean"), strict=True):
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
        f"`models.reward_model` (its own Megatron role, conversations rendered with its chat template), weight "
        f"{RM_WEIGHT}. The judge: greedy, 8 tokens, parsed yes/no; `math+judge` asks the policy on its own engines, "
        "`math+judge-own` the initial SmolLM2 on a second vLLM engine beside them (colocated: it sleeps while the "
        "trainer works, its weights kept in host memory).",
        table(["run", "metric", "first quarter", "last quarter"], rows),
        report.figure(fig, "rewards", "each reward's mean per episode"),
    )
