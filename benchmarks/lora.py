"""The ``lora`` suite: LoRA against full fine-tuning. The main job (SmolLM2-135M-Instruct on the built-in arithmetic
set, one device) trained whole (lr 1e-5) and with rank-16 adapters on every attention and MLP projection (alpha 32,
lr 1e-4: LoRA's usual ten times full fine-tuning's), whose weights reach the engine merged or as the adapters alone
(vLLM's LoRA). Reported: the training reward per episode (curves), greedy eval accuracy before and after, the
trainer's step time and resident memory, the trained parameters, and each episode's weight sync (time, bytes).
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.algorithms import COMMON, _fmt, _mean, run
from benchmarks.hardware import Hardware
from benchmarks.report import Report, plot_rewards, pyplot, table
from benchmarks.rl import Variant

RANK = 16
LORA = (*COMMON, f"models.policy_trainer.lora.rank={RANK}", "models.policy_trainer.optimizer.lr=1e-4")
RUNS = (
    Variant("full", "full fine-tuning, lr 1e-5", overrides=COMMON),
    Variant("lora", f"LoRA rank {RANK}, alpha 32, lr 1e-4; merged weights synced", overrides=LORA),
    Variant(
        "lora_adapter",
        "the same; the adapters alone synced (vLLM's LoRA)",
        overrides=(*LORA, "models.policy.sync.lora=adapter", "models.policy.rollout.sleep_level=1"),
    ),
)


def trained_parameters() -> dict[str, int]:
    """SmolLM2's parameters, and its rank-16 adapters' (the planner's count, equal to the built model's)."""
    from converters.gguf2hf import default_model_dir
    from mcore_rl.planner.params import Architecture, lora_params
    from models.lora import LoRAConfig
    from models.registry import get_bridge
    from parallel.config import ParallelConfig

    a = Architecture.from_bridge(get_bridge(str(default_model_dir())))
    adapters = sum(lora_params(a, False, ParallelConfig(), LoRAConfig(rank=RANK))[0] for _ in range(a.layers))
    return {"full": a.hf_params(), "lora": adapters, "lora_adapter": adapters}


def suite(out: Path, hardware: Hardware, report: Report, episodes: int) -> None:
    del hardware  # the rl suite reports the machine; this one compares two ways of training
    results = [run(v, out, episodes, (), "lora") for v in RUNS]
    trained = trained_parameters()
    quarter = max(1, episodes // 4)
    rows = []
    for r in results:
        eps = r["episodes"]
        rows.append(
            [
                r["name"], r["what"], f"{trained[r['name']] / 1e6:.2f} M", _fmt(_mean(eps[:quarter], "reward/mean")),
                _fmt(_mean(eps[-quarter:], "reward/mean")), _fmt(r["evals"][0]), _fmt(r["evals"][-1]),
                _fmt(_mean(eps[1:], "time/train")), _fmt(_mean(eps[1:], "memory/trainer_bytes") / 2**30),
                _fmt(_mean(eps[1:], "time/sync")), _fmt(_mean(eps[1:], "sync/sync_bytes") / 1e6),
            ]
        )  # fmt: skip
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3))
    plot_rewards(ax, results)
    fig.tight_layout()
    report.add(
        "lora: adapters against full fine-tuning",
        f"SmolLM2-135M-Instruct, the main job's settings on one device, {episodes} episodes of 32 samples on "
        "`builtin:arithmetic`; eval: greedy accuracy on 100 held-out problems before the first and after the last "
        "episode. LoRA trains adapters on linear_qkv, linear_proj, linear_fc1 and linear_fc2 of the frozen model; "
        "the engine gets the merged weights each episode, or the adapters alone (`models.policy.sync.lora: "
        "adapter`). Step time: `time/train` (the optimizer steps of an episode); memory: the trainer process's "
        "resident set on this CPU machine (`memory/trainer_bytes`); sync: `time/sync` (push and probe) and the bytes "
        "sent; all over the episodes after the first. Not asserted anywhere: a record.",
        table(
            [
                "run",
                "what",
                "trained params",
                "reward, first quarter",
                "reward, last quarter",
                "eval before",
                "eval after",
                "train s/episode",
                "trainer GiB",
                "sync s/episode",
                "sync MB",
            ],
            rows,
        ),  # fmt: skip
        report.figure(fig, "lora", "training reward per episode"),
    )
