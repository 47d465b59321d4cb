"""Typed handles of the Megatron roles for the driver: one verb per method, the fan-out to every rank and the
rank-0 answer hidden (every rank returns the same, or rank 0 speaks for the role)."""

from __future__ import annotations

import torch

from mcore_rl.roles.cluster import ActorGroup
from mcore_rl.trainer.sync import SyncConfig


class ReferenceGroup(ActorGroup):
    """The reference policy's ranks (:class:`mcore_rl.trainer.ranks.MegatronRank`)."""

    def logprobs(self, batch: dict, micro_batch_size: int) -> torch.Tensor:
        return self.ask("logprobs", batch, micro_batch_size)

    def offload(self, parts: list[str] | None = None) -> int:
        """Bytes freed on the devices, summed over ranks (0 on CPU)."""
        return sum(self.call("offload", parts))

    def onload(self, parts: list[str] | None = None) -> None:
        self.call("onload", parts)

    def process_stats(self) -> list[dict[str, float]]:
        return self.call("process_stats")


class RewardModelGroup(ReferenceGroup):
    """A reward model's ranks (:class:`mcore_rl.trainer.value.ValueModel`)."""

    def scores(self, batch: dict, micro_batch_size: int) -> torch.Tensor:
        """The score [N] of each row of ``batch`` (``tokens``, ``lengths``): its value at its last token."""
        return self.ask("sequence_scores", batch, micro_batch_size)


class TrainedGroup(ReferenceGroup):
    """A trained role's ranks (:class:`mcore_rl.trainer.ranks.TrainableRank`)."""

    def train(self, batch: dict, global_batch_size: int, micro_batch_size: int) -> list[dict]:
        """Optimizer steps over ``batch``; metrics per step."""
        return self.call("train", batch, global_batch_size, micro_batch_size)[0]

    def memory_bytes(self) -> int:
        return self.call("memory_bytes")[0]

    def save(self, directory: str, reshardable: bool) -> None:
        self.call("save", directory, reshardable)

    def load(self, directory: str) -> None:
        self.call("load", directory)

    def optimizer_digest(self) -> dict:
        return self.call("optimizer_digest")[0]


class CriticGroup(TrainedGroup):
    """PPO's critic's ranks (:class:`mcore_rl.trainer.value.ValueTrainer`)."""

    def values(self, batch: dict, micro_batch_size: int) -> torch.Tensor:
        return self.ask("values", batch, micro_batch_size)


class TrainerGroup(TrainedGroup):
    """The policy trainer's ranks (:class:`mcore_rl.trainer.policy.PolicyTrainer`)."""

    def connect_engines(
        self, engines: list, colocated: bool, engine_tp: int, sync: SyncConfig, dtype: str, drafts: bool = False
    ) -> None:
        self.call("connect_engines", engines, colocated, engine_tp, sync, dtype, drafts)

    def score_old(self, batch: dict, micro_batch_size: int, fetch: bool) -> torch.Tensor | None:
        """The policy's log-probs of ``batch`` (the last rows of the next :meth:`train`'s) before its steps, kept on
        the ranks for it; returned only where the driver reads them (``fetch``)."""
        return self.ask("score_old", batch, micro_batch_size, fetch)

    def push_weights(self, version: int, send: bool = True) -> None:
        """Stream the weights into the engines as policy ``version`` (``send=False``: they hold them already);
        :meth:`verify_sync` completes the sync."""
        self.call("push_weights", version, send)

    def verify_sync(self) -> dict:
        """Wake the engines and check them with the probe: the sync's report."""
        return self.call("verify_sync")[0]

    def base_logprobs(self, batch: dict, micro_batch_size: int) -> torch.Tensor:
        """Log-probs of the model with its LoRA adapters off: a LoRA run's reference policy."""
        return self.ask("base_logprobs", batch, micro_batch_size)

    def router_metrics(self) -> dict:
        return self.call("router_metrics")[0]
