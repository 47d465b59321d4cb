"""The one interface the driver samples through (:class:`Sampler`), and the factory that picks its kind: single-turn
completions scored by the reward actors (:class:`~mcore_rl.rollout.single_turn.SingleTurn`), multi-turn
trajectories with tools and environments (:class:`~mcore_rl.agent.loop.AgentLoop`), or trajectories that a user's
agent program drives through the run's OpenAI-compatible endpoint (:class:`~mcore_rl.agent.programs.AgentPrograms`)."""

from __future__ import annotations

import concurrent.futures
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


class GroupSampler:
    """:meth:`generate`, :meth:`submit` and :meth:`collect` over :meth:`start`, which begins one prompt group and
    returns its future (the multi-turn samplers, whose groups finish one by one in the background)."""

    def __init__(self):
        self._submitted: dict[str, concurrent.futures.Future] = {}  # submit's keys -> futures, for collect

    def start(self, prompt: Prompt, sampling: SamplingConfig) -> concurrent.futures.Future:
        """``sampling.n`` samples of ``prompt``; the future's result is ``(samples, rewards)``."""
        raise NotImplementedError

    def generate(self, prompts: list[Prompt], sampling: SamplingConfig) -> tuple[list[Sample], list[float]]:
        """The prompts' groups, run concurrently; samples and rewards in prompt order."""
        futures = [self.start(p, sampling) for p in prompts]
        samples, rewards = [], []
        for future in futures:
            s, r = future.result()
            samples, rewards = samples + s, rewards + r
        return samples, rewards

    def submit(self, requests: list[tuple[str, Prompt]], sampling: SamplingConfig) -> None:
        for key, prompt in requests:
            self._submitted[key] = self.start(prompt, sampling)

    def collect(self, seconds: float = 0.5) -> list[tuple[str, list[Sample], list[float]]]:
        if not self._submitted:
            return []
        concurrent.futures.wait(self._submitted.values(), seconds, concurrent.futures.FIRST_COMPLETED)
        done = [key for key, future in self._submitted.items() if future.done()]
        return [(key, *self._submitted.pop(key).result()) for key in done]


def make_sampler(system, tokenizer) -> Sampler:
    """The run's sampler over ``system``'s roles (closed with it)."""
    if system.config.models.reward.agent:
        return system.agent_programs(tokenizer)
    if system.config.models.reward.multi_turn:
        return system.agent_loop(tokenizer)
    from mcore_rl.rollout.single_turn import SingleTurn

    sampler = SingleTurn(system, tokenizer)
    system.on_close(sampler.close)
    return sampler
