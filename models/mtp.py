"""Multi-token prediction (DeepSeek-V3's MTP layers): Megatron-Core's MTP block, kept, trained and scored by mcore-rl.

Megatron's ``GPTModel`` runs its MTP block only to add its own LM loss when given ``labels``; mcore-rl scores and
trains from logits. :class:`MTPModel` runs the block only while :func:`mtp_active` (a policy step with
``mtp_loss_coef``; its loss: :mod:`mcore_rl.algorithms.mtp`) and then returns each depth's logits beside the
model's (:class:`MTPOutput`); otherwise it is the plain model, whose MTP weights still load and save.

Depth k (1..D) at position i combines the main model's final (normed) hidden state of token i with the embedding
of token i + k and predicts token i + k + 1 (DeepSeek-V3 technical report, section 2.2). The released checkpoints'
projection ``eh_proj`` takes [embedding; hidden] (the report writes the other order), as Megatron's does.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
from megatron.core.models.gpt import GPTModel

from converters.plan import MTP


class MTPOutput(NamedTuple):
    logits: torch.Tensor  # the model's [b, s, V/tp]
    depths: tuple[torch.Tensor, ...]  # depth k's [b, s, V/tp], k = 1..D


class MTPModel(GPTModel):
    """``GPTModel`` whose MTP block runs only while ``mtp_active`` (see module docstring)."""

    mtp_active = False

    def _postprocess(
        self,
        hidden_states,
        input_ids,
        position_ids,
        labels,
        rotary_pos_emb,
        rotary_pos_cos,
        rotary_pos_sin,
        mtp_in_postprocess=None,
        loss_mask=None,
        decoder_input=None,
        attention_mask=None,
        inference_params=None,
        packed_seq_params=None,
        sequence_len_offset=None,
        runtime_gather_output=None,
        extra_block_kwargs=None,
        inference_context=None,
    ):
        if labels is not None or inference_context is not None:
            raise ValueError("MTPModel returns logits: Megatron's labels loss and inference contexts are not its paths")
        active = bool(mtp_in_postprocess and self.mtp_active)
        if active:
            hidden_states = self.mtp(
                input_ids=input_ids,
                position_ids=position_ids,
                hidden_states=hidden_states,
                attention_mask=attention_mask,
                rotary_pos_emb=rotary_pos_emb,
                rotary_pos_cos=rotary_pos_cos,
                rotary_pos_sin=rotary_pos_sin,
                packed_seq_params=packed_seq_params,
                sequence_len_offset=sequence_len_offset,
                embedding=self.embedding,
                **(extra_block_kwargs or {}),
            )
        if not self.post_process:
            return hidden_states
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        parts = torch.chunk(hidden_states, 1 + self.config.mtp_num_layers, dim=0) if active else (hidden_states,)
        logits = [
            self.output_layer(h, weight=weight, runtime_gather_output=runtime_gather_output)[0].transpose(0, 1)
            for h in parts
        ]
        logits = [x.contiguous() for x in logits]
        return MTPOutput(logits[0], tuple(logits[1:])) if active else logits[0]


@contextlib.contextmanager
def mtp_active(chunks: list[torch.nn.Module]):
    """Run the chunks' MTP blocks (their forwards return :class:`MTPOutput` on the last stage) inside."""
    models = [m for chunk in chunks for m in chunk.modules() if isinstance(m, MTPModel)]
    for model in models:
        model.mtp_active = True
    try:
        yield
    finally:
        for model in models:
            model.mtp_active = False


def freeze_mtp(chunks: list[torch.nn.Module]) -> int:
    """Freeze the MTP block (a run without an MTP loss keeps the checkpoint's drafter: no gradient would reach it,
    and weight decay alone would shrink it); returns the parameters frozen."""
    frozen = 0
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if name.startswith(MTP):
                param.requires_grad_(False)
                frozen += 1
    return frozen
