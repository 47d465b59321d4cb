"""The ``steptime`` suite: the planner's step-time model (mcore_rl/planner/steptime.py) on paper, against the
published step times and throughputs of a peer for the same models, layouts and clusters.

The peer is NeMo RL's performance summary (NVIDIA-NeMo/RL, docs/about/performance-summary.md, the v0.4 table:
GRPO on OpenMathInstruct-2, DGX-H100, bf16, Megatron-Core training, on-policy rows). Its tokens/sec/GPU are the
episode's tokens (samples x their mean length) per step second and GPU, the model's ``tokens per device-second``.
The table gives the mean sequence (prompt + response) and its limit, not the prompt's share: prompts are taken as
200 tokens (OpenMathInstruct-2's problems are short), and the longest response as the limit less the prompt.
Each prediction is mcore-rl on that layout (its trainer's measured efficiency, its sync and offload), so the ratio
says how a run of mcore-rl would compare, within the model's accuracy (the rl suite checks it on this machine).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

from benchmarks.hardware import Hardware
from benchmarks.report import Report, table

REPO = Path(__file__).resolve().parents[1]
SOURCE = "NeMo RL v0.4 performance summary (NVIDIA-NeMo/RL docs/about/performance-summary.md), DGX-H100, on-policy"
PROMPT = 200


@dataclass(frozen=True)
class Published:
    name: str
    config: str  # scripts/configs/<config>.yaml
    model: str  # models/configs/<model>
    gpus: int
    samples: int  # G-GBS
    train_batch: int  # T-GBS
    rollout_tp: int
    layout: dict  # the trainer's [TP, CP, EP, PP]
    max_seq: int
    mean_seq: float
    tokens_per_gpu_s: float
    step_s: float


PUBLISHED = (
    Published("Qwen3-30B-A3B", "qwen3_30b_a3b_gspo", "qwen3_30b_a3b", 32, 2048, 512, 4,
              dict(tp=2, cp=1, ep=8, pp=1), 4096, 3154, 925, 225),
    Published("Qwen3-235B-A22B", "qwen3_235b_a22b_grpo", "qwen3_235b_a22b", 128, 512, 512, 16,
              dict(tp=2, cp=2, ep=16, pp=8, last_stage_layers=10), 8192, 5671, 45.7, 506),
    Published("DeepSeek-V3", "deepseek_v3_671b_grpo", "deepseek_v3", 256, 512, 512, 32,
              dict(tp=1, cp=1, ep=16, pp=16, last_stage_layers=1), 1536, 745, 11, 154),
)  # fmt: skip


def predict(row: Published, device: str = "h100"):
    from mcore_rl.config.schema import load_run_config
    from mcore_rl.planner.steptime import DEVICES, Lengths, step_time

    response = row.mean_seq - PROMPT
    longest = row.max_seq - PROMPT
    overrides = [
        f"runtime_args.num_devices={row.gpus}",
        f"runtime_args.sample_per_episode={row.samples}",
        f"runtime_args.train_global_batch_size={row.train_batch}",
        "models.policy.num_inference_per_prompt=16",
        f"models.policy.max_prompt_tokens={PROMPT}",
        f"models.policy.rollout.tensor_parallel_size={row.rollout_tp}",
        f"models.policy.rollout.max_model_len={row.max_seq}",
        f"models.policy.rollout.train.max_new_tokens={longest}",
        f"models.policy.rollout.eval.max_new_tokens={longest}",
        f"models.policy_trainer.max_token_in_packing={row.max_seq}",
        "models.policy_trainer.recompute=none",
        *(f"models.policy_trainer.parallel.{k}={v}" for k, v in row.layout.items()),
        f"models.policy_trainer.parallel.sequence_parallel={'true' if row.layout['tp'] > 1 else 'false'}",
    ]
    with mock.patch.dict(os.environ, MCORE_RL_MODEL=str(REPO / "models" / "configs" / row.model)):
        config = load_run_config(REPO / "scripts" / "configs" / f"{row.config}.yaml", overrides)
    return step_time(config, DEVICES[device], Lengths(PROMPT, response, longest))


def suite(out: Path, hardware: Hardware, report: Report) -> None:
    rows = []
    for row in PUBLISHED:
        t = predict(row)
        phases = ", ".join(f"{k} {v:.3g}" for k, v in t.phases.items() if v)
        rate = t.tokens_per_device_second
        rows.append([
            row.name, str(row.gpus), f"TP {row.layout['tp']} CP {row.layout['cp']} EP {row.layout['ep']} PP {row.layout['pp']}",
            f"{t.seconds:.3g} ({phases})", f"{row.step_s:g}", f"{t.seconds / row.step_s:.2f}",
            f"{rate:.4g}", f"{row.tokens_per_gpu_s:g}", f"{rate / row.tokens_per_gpu_s:.2f}",
        ])  # fmt: skip
    report.add(
        "steptime: the step-time model on paper, against NeMo RL's published runs",
        f"Source: {SOURCE}. Predicted for H100s (their datasheet) at the published batch sizes, layouts, mean "
        f"sequence and its limit, prompts of {PROMPT} tokens, no recomputation.",
        table(
            [
                "model",
                "GPUs",
                "trainer layout",
                "predicted step s (phases)",
                "published step s",
                "ratio",
                "predicted tok/s/GPU",
                "published tok/s/GPU",
                "ratio",
            ],
            rows,
        ),  # fmt: skip
    )
