"""The ``packing`` suite: utilisation and training speed-up of THD packing and of shared-prompt rows on
long-tailed response lengths, as RL produces them (log-normal, median 48 tokens, capped at 512), against padded
micro-batches. One optimizer step of the policy-trainer role over the same 64 samples (8 prompts of 64 tokens x 8
responses) on one rank; a small Llama (hidden 256, 4 layers) keeps it to seconds on a CPU.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from benchmarks import grpo_batch, single_process_world
from benchmarks.report import Report, pyplot, table

PROMPTS, GROUP, PROMPT_TOKENS, CAP = 8, 8, 64, 512
LAYOUTS = {  # name -> the trainer section's fields
    "padded (micro-batch 8)": {},
    "packed (4096 tokens)": {"max_token_in_packing": 4096},
    "shared prompts (4096 positions)": {"max_token_in_packing": 4096, "share_prompts": True},
}


def long_tailed_batch(generator: torch.Generator, vocab: int) -> dict:
    responses = (48 * torch.exp(1.0 * torch.randn(PROMPTS * GROUP, generator=generator))).clamp(1, CAP).long()
    return grpo_batch(generator, vocab, PROMPT_TOKENS, PROMPT_TOKENS + responses, GROUP)


def _step_seconds(hf_dir: Path, batch: dict, layout: dict, repeats: int = 2) -> tuple[float, dict]:
    from mcore_rl.config.schema import TrainerConfig
    from mcore_rl.trainer.policy import PolicyTrainer

    trainer = PolicyTrainer(0, 1, ("127.0.0.1", 29535), TrainerConfig(load=str(hf_dir), **layout), 0, repeats + 1)
    n = batch["tokens"].shape[0]
    best, metrics = float("inf"), {}
    for _ in range(repeats + 1):  # the first is a warm-up
        start = time.perf_counter()
        (metrics,) = trainer.train(batch, global_batch_size=n, micro_batch_size=GROUP)
        best = min(best, time.perf_counter() - start)
    return best, metrics


def padded_utilization(lengths: list[int], micro_batch_size: int) -> float:
    """Real tokens / tokens computed by padded micro-batches of consecutive samples."""
    computed = sum(
        max(lengths[i : i + micro_batch_size]) * len(lengths[i : i + micro_batch_size])
        for i in range(0, len(lengths), micro_batch_size)
    )
    return sum(lengths) / computed


def suite(out: Path, hardware, report: Report) -> None:
    from tests.tiny import make_tiny

    single_process_world()
    generator = torch.Generator().manual_seed(0)
    vocab = 8192
    batch = long_tailed_batch(generator, vocab)
    lengths = batch["lengths"].tolist()
    real = sum(n - 1 for n in lengths)
    rows, speeds = [], {}
    with tempfile.TemporaryDirectory() as scratch:
        hf_dir = make_tiny("LlamaForCausalLM", Path(scratch) / "llama", hidden_size=256, intermediate_size=1024,
                           num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, vocab_size=vocab,
                           max_position_embeddings=1024)  # fmt: skip
        for name, layout in LAYOUTS.items():
            seconds, metrics = _step_seconds(hf_dir, batch, layout)
            if "share_prompts" in layout:
                positions = metrics["packing/shared_prompt_positions"] * real
                utilization = f"{real / positions:.2f} sample positions per computed"
            elif layout:
                utilization = f"{metrics['packing/utilization']:.2f}"
            else:
                utilization = f"{padded_utilization([n - 1 for n in lengths], GROUP):.2f}"
            speeds[name] = real / seconds
            rows.append([name, utilization, seconds, real / seconds])
    base = speeds[next(iter(LAYOUTS))]
    rows = [[*row, f"{speeds[row[0]] / base:.2f}x"] for row in rows]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.hist([n - PROMPT_TOKENS for n in lengths], bins=30)
    ax.set_xlabel("response tokens")
    ax.set_ylabel("samples")
    report.add(
        "packing: padded vs packed vs shared prompts",
        f"{PROMPTS} prompts of {PROMPT_TOKENS} tokens x {GROUP} responses, log-normal lengths (median 48, max "
        f"{max(lengths) - PROMPT_TOKENS}); one optimizer step of all {len(lengths)} samples on one rank, best of 2; "
        "sample positions/s counts each sample's own next-token positions.",
        table(["layout", "utilisation", "step seconds", "sample positions/s", "speed-up"], rows),
        report.figure(fig, "packing_lengths", "response lengths"),
    )
