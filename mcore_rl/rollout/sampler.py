"""The one interface the driver samples through (:class:`Sampler`), and the factory that picks its kind: single-turn
completions scored by the reward actors (:class:`~mcore_rl.rollout.single_turn.SingleTurn`) or multi-turn
trajectories with tools and environments (:class:`~mcore_rl.agent.loop.AgentLoop`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from mcore_rl.batch import Sample
    from mcore_rl.data.prompts import Prompt
    from mcore_rl.rollout.engine import SamplingConfig


class Sampler(Protocol):
    """Samples with their rewards: a whole batch at once (:meth:`generate`, the sync loops and evals) or prompt
    groups started and collected as they finish (:meth:`submit` / :meth:`collect`, the async producer)."""

    def generate(self, prompts: list[Prompt], sampling: SamplingConfig) -> tuple[list[Sample], list[float]]:
        """``sampling.n`` samples of each prompt and their rewards, in prompt order."""

    def submit(self, requests: list[tuple[str, Prompt]], sampling: SamplingConfig) -> None:
        """Start ``(key, prompt)`` groups."""

    def collect(self, seconds: float = 0.5) -> list[tuple[str, list[Sample], list[float]]]:
        """The submitted groups that finished within about ``seconds``, as ``(key, samples, rewards)``."""

    def solved(self, samples: list[Sample], rewards: list[float]) -> list[bool]:
        """Whether each sample solved its task (eval accuracy): its task's own check where it has one."""

    def take_metrics(self, samples: list[Sample]) -> dict[str, float]:
        """The sampler's own numbers of the samples since the last call (reward errors and waits, trajectory
        statistics)."""

    def close(self) -> None:
        """Stop what runs in the background; called once at teardown."""


def make_sampler(system, tokenizer) -> Sampler:
    """The run's sampler over ``system``'s roles (closed with it)."""
    if system.config.models.reward.multi_turn:
        return system.agent_loop(tokenizer)
    from mcore_rl.rollout.single_turn import SingleTurn

    sampler = SingleTurn(system, tokenizer)
    system.on_close(sampler.close)
    return sampler
