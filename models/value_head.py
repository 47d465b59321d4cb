"""A value head in place of a Megatron ``GPTModel``'s LM head: the critic of PPO on the policy's architecture.

The head is one linear map from the last hidden state to a scalar per position, replicated on every tensor-parallel
rank (a [1, hidden] weight splits over nothing). It keeps the LM head's call signature and ``sequence_parallel``
flag, so the model's forward, packed (THD) rows and shared-prompt rows run through it as through the LM head, and
``GPTModel`` returns [b, s, 1].
"""

from __future__ import annotations

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region


class ValueHead(torch.nn.Module):
    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device, sequence_parallel: bool, tp_group):
        super().__init__()
        # OpenRLHF's initialisation (std 1 / (hidden + 1)), drawn from a fixed seed: every rank and every layout
        # starts from the same head.
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(1, hidden_size, generator=generator) / (hidden_size + 1)
        self.weight = torch.nn.Parameter(weight.to(device=device, dtype=dtype))
        self.sequence_parallel = sequence_parallel
        self.tp_group = tp_group

    def forward(self, hidden: torch.Tensor, weight=None, runtime_gather_output=None):
        """[s(/tp), b, h] -> ([s, b, 1], None). Under sequence parallelism the whole sequence is gathered first: every
        TP rank then computes the same values and loss, so the gather's gradient keeps this rank's part of the
        (already complete) input gradient instead of summing over ranks."""
        if self.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(
                hidden, tensor_parallel_output_grad=False, group=self.tp_group
            )
        return torch.nn.functional.linear(hidden, self.weight), None


def attach_value_heads(chunks: list[torch.nn.Module], tp_group) -> None:
    """Replace the LM head of the chunk that has one (the last pipeline stage's) by a :class:`ValueHead`. Tied
    embeddings are untied: the critic's input embedding trains on its own and no output weight is all-reduced
    with it across pipeline stages."""
    for chunk in chunks:
        gpt = next(m for m in chunk.modules() if isinstance(m, GPTModel))
        gpt.share_embeddings_and_output_weights = False
        if gpt.post_process:
            lm_head = gpt.output_layer
            weight = gpt.embedding.word_embeddings.weight if lm_head.weight is None else lm_head.weight
            gpt.output_layer = ValueHead(
                gpt.config.hidden_size, weight.dtype, weight.device, lm_head.sequence_parallel, tp_group
            )
