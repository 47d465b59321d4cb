"""A reward model's term of the reward: each conversation rendered with the reward model's own chat template and
scored whole by its role (:meth:`mcore_rl.trainer.value.ValueModel.sequence_scores`); the policy's template and
tokenizer may differ from it."""

from __future__ import annotations

import torch


def conversation_tokens(tokenizer, conversations: list[list[dict]]) -> dict[str, torch.Tensor]:
    """Right-padded ``tokens`` [N, L] and ``lengths`` [N] of each conversation in ``tokenizer``'s chat template."""
    ids = [
        list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
        for messages in conversations
    ]
    tokens = torch.zeros(len(ids), max(map(len, ids)), dtype=torch.long)
    for i, row in enumerate(ids):
        tokens[i, : len(row)] = torch.tensor(row)
    return {"tokens": tokens, "lengths": torch.tensor([len(row) for row in ids])}


class ModelReward:
    """The ``models.reward_model`` term: ``score`` gives each conversation's score from the role ``group``
    (:class:`mcore_rl.roles.trainer.RewardModelGroup`), with ``on_device`` bringing the role onto its devices for
    the call."""

    def __init__(self, config, group, on_device):
        from converters.hf_io import load_tokenizer

        self.name, self.weight, self.micro_batch_size = config.name, config.weight, config.micro_batch_size
        self.tokenizer = load_tokenizer(config.load)
        self.group, self.on_device = group, on_device

    def score(self, samples: list[tuple[str, list[dict], str]]) -> list[float]:
        """The score of each ``(sample id, messages, answer)`` sample's conversation."""
        batch = conversation_tokens(self.tokenizer, [messages for _, messages, _ in samples])
        with self.on_device(self.group):
            return self.group.scores(batch, self.micro_batch_size).tolist()
