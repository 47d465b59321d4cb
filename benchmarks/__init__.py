"""The benchmark suite (``python -m benchmarks``); see README.md."""

import os
import socket


def single_process_world() -> None:
    """torch.distributed's environment for the suites that build one Megatron rank in this process (the first
    suite's settings stay for the rest of the run)."""
    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0", WORLD_SIZE="1").items():
        os.environ.setdefault(key, value)


def free_port() -> int:
    """A loopback port free now, for the rendezvous of the processes a suite spawns."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def grpo_batch(generator, vocab: int, prompt_tokens: int, lengths, group: int) -> dict:
    """A policy trainer's batch of prompt groups (``PolicyTrainer.train``'s input): each run of ``group`` samples
    shares a prompt of ``prompt_tokens`` random tokens, sample ``i`` holds ``lengths[i]`` tokens (zeros after them)
    and is trained on its response, its log-probs zero and its advantage random."""
    import torch

    n = len(lengths)
    tokens = torch.randint(4, vocab, (n, int(lengths.max())), generator=generator)
    leaders = torch.arange(n) - torch.arange(n) % group
    tokens[:, :prompt_tokens] = tokens[leaders, :prompt_tokens]
    mask = torch.zeros(n, tokens.shape[1] - 1)
    for i, length in enumerate(lengths.tolist()):
        tokens[i, length:] = 0
        mask[i, prompt_tokens - 1 : length - 1] = 1
    return {
        "tokens": tokens,
        "lengths": lengths,
        "prompt_lengths": torch.full_like(lengths, prompt_tokens),
        "mask": mask,
        "rollout_logp": torch.zeros_like(mask),
        "old_logp": torch.zeros_like(mask),
        "advantages": torch.randn(n, generator=generator),
    }
