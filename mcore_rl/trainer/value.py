"""Value models' ranks: a reward model's (scores only) and PPO's critic (trained with the clipped value loss)."""

from __future__ import annotations

import torch

from mcore_rl.algorithms.ppo import value_loss
from mcore_rl.trainer.packing import rows_of
from mcore_rl.trainer.ranks import MegatronRank, TrainableRank
from models.value_head import attach_value_heads


class ValueModel(MegatronRank):
    """One rank of a model with a :class:`models.value_head.ValueHead` for its LM head, loaded from ``hf_dir``: a
    reward model of a supported family (its score head is the value head), or a causal LM (the policy's own, for a
    critic that starts from it: its LM head is dropped and the value head starts fresh). Scores values per position
    (PPO's critic) or one per sequence (a reward model)."""

    def _build(self, hf_dir: str) -> list[torch.nn.Module]:
        chunks = super()._build(hf_dir)
        if not self.bridge.value_model:
            attach_value_heads(chunks, self.groups.tp)
        return chunks

    def values(self, batch: dict, micro_batch_size: int) -> torch.Tensor:
        """The value [N, L-1] of every input position of ``batch["tokens"]`` (the state before the token at the
        next position, aligned with log-probs); every rank gets all rows."""
        return self._score(batch, micro_batch_size, lambda mb, output: output.squeeze(-1))

    def sequence_scores(self, batch: dict, micro_batch_size: int) -> torch.Tensor:
        """The value [N] at each sequence's last token (``batch["lengths"]`` tokens each), as HF's sequence
        classifiers pool it: a reward model's score of the whole conversation. Any number of rows: the data-parallel
        ranks share them after copies of the last fill the batch to a multiple of their number."""
        n, extra = len(batch["lengths"]), -len(batch["lengths"]) % self.dp[0]
        lengths = torch.cat([batch["lengths"], batch["lengths"][-1:].expand(extra)])
        tokens = torch.cat([batch["tokens"], batch["tokens"][-1:].expand(extra, -1)])
        tokens = torch.nn.functional.pad(tokens, (0, 1))  # every real token becomes an input position
        values = self.values({"tokens": tokens, "lengths": lengths + 1}, micro_batch_size)
        return values[torch.arange(n), lengths[:n] - 1]


class ValueTrainer(TrainableRank, ValueModel):
    """One rank of PPO's critic: a :class:`ValueModel` trained with the clipped value loss."""

    checkpoint_dir = "critic"

    def _loss_fn(self, batch: dict, output: torch.Tensor):
        values = rows_of(batch, output.squeeze(-1).float())
        loss, metrics = value_loss(
            values, batch["values"], batch["returns"], batch["mask"], self.section.value_clip, batch["share"]
        )
        return loss, metrics | {"loss": loss.detach()}

    def train(self, batch: dict, global_batch_size: int, micro_batch_size: int) -> list[dict]:
        """Optimizer steps towards ``batch["returns"]`` from ``batch["values"]`` (the values the returns were
        estimated with: the clip's centre), in global batches of ``global_batch_size`` rows; metrics per step."""
        steps = [
            {k: v[start : start + global_batch_size] for k, v in batch.items()}
            for start in range(0, batch["tokens"].shape[0], global_batch_size)
        ]
        return self._optimize(steps, ["mask", "values", "returns"], micro_batch_size, self._loss_fn)
