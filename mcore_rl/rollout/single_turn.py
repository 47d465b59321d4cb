"""Single-turn sampling (:class:`SingleTurn`): one completion per sample, scored by the reward actors, the reward
model and the judge; the multi-turn counterpart is :class:`~mcore_rl.agent.loop.AgentLoop`."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import time
from typing import TYPE_CHECKING

from mcore_rl.batch import samples_of
from mcore_rl.rewards.judge import Judge
from mcore_rl.rewards.model import ModelReward

if TYPE_CHECKING:
    from mcore_rl.roles.system import System


class SingleTurn:
    """Samples of one completion each, scored by the reward actors and the reward model (the multi-turn counterpart
    is :class:`~mcore_rl.agent.loop.AgentLoop`): ``generate`` a batch of prompt groups, or ``submit`` groups and
    ``collect`` those that finished and were scored. With ``models.reward.overlap_rollout`` each group is scored in
    a thread of its own as soon as its completions are done, while the engines generate the rest; else after the
    whole batch."""

    def __init__(self, system: System, tokenizer):
        self.rollout, self.rewards, self.tokenizer = system.rollout, system.rewards, tokenizer
        m = system.config.models
        # eval accuracy: the task's own check (models.reward.fn, the first weighted term), else the weighted sum
        self.task = m.reward.weighted_terms[0][1].name if m.reward.fn else None
        self.model = self.judge = None  # the reward model's and the judge's terms, when there are
        if system.reward_model is not None:
            self.model = ModelReward(m.reward_model, system.reward_model, system.on_device)
        parse = system.verdicts.score if system.verdicts else None  # a user's parser, else the built-in one
        if m.judge.own_engines:  # its engines, with its own tokenizer
            from converters.hf_io import load_tokenizer

            tokenizer = load_tokenizer(m.judge.load)
            self.judge = Judge(m.judge, system.judge_engines, tokenizer, m.judge.max_model_len, parse)
        elif m.judge.load:  # on the policy's engines, with the policy's tokenizer
            self.judge = Judge(m.judge, system.rollout, tokenizer, m.policy.rollout.max_model_len, parse)
        self.overlap = system.config.models.reward.overlap_rollout
        self._scorer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="reward")
        self._prompts: dict = {}  # submitted keys -> prompts
        self._scoring: dict = {}  # collected keys -> their scoring (a future)
        self._keys = itertools.count()
        self._reward_wait = 0.0

    def generate(self, prompts, sampling) -> tuple[list, list[float]]:
        if not self.overlap:
            completions = self.rollout.generate([p.token_ids for p in prompts], sampling)
            start = time.perf_counter()
            scored = self._score(prompts, completions)
            self._reward_wait += time.perf_counter() - start
            return scored
        keys = [f"batch-{next(self._keys)}" for _ in prompts]
        self.rollout.submit([(key, p.token_ids) for key, p in zip(keys, prompts, strict=True)], sampling)
        by_key, scoring = dict(zip(keys, prompts, strict=True)), {}
        while len(scoring) < len(keys):
            for key, completions in self.rollout.collect(0.5):
                scoring[key] = self._scorer.submit(self._score, [by_key[key]], [completions])
        start = time.perf_counter()
        results = [scoring[key].result() for key in keys]
        self._reward_wait += time.perf_counter() - start
        return [s for samples, _ in results for s in samples], [r for _, rewards in results for r in rewards]

    def submit(self, requests, sampling) -> None:
        self._prompts.update(requests)
        self.rollout.submit([(key, prompt.token_ids) for key, prompt in requests], sampling)

    def collect(self, seconds: float = 0.5) -> list[tuple[str, list, list[float]]]:
        """The submitted groups that finished and were scored (their scoring overlaps the next collect's rollout)."""
        finished = self.rollout.collect(seconds)
        if not self.overlap:
            return [(key, *self._score([self._prompts.pop(key)], [c])) for key, c in finished]
        for key, completions in finished:
            self._scoring[key] = self._scorer.submit(self._score, [self._prompts.pop(key)], [completions])
        done = [key for key, future in self._scoring.items() if future.done()]
        return [(key, *self._scoring.pop(key).result()) for key in done]

    def solved(self, samples, rewards: list[float]) -> list[bool]:
        if self.task is None:
            return [r > 0 for r in rewards]
        return [s.reward_parts.get(self.task, 0.0) > 0 for s in samples]

    def take_metrics(self, samples) -> dict[str, float]:
        """Reward calls past their deadline (a multi-turn one is its environment step's: agent/env_errors), the
        seconds spent waiting for rewards after the rollout of ``generate`` batches, the judge's failures."""
        metrics = {"reward/errors": float(self.rewards.take_timeouts()), "time/reward_wait": self._reward_wait}
        self._reward_wait = 0.0
        if self.judge is not None:
            metrics[f"reward/{self.judge.name}_failures"] = float(self.judge.take_failures())
        return metrics

    def close(self) -> None:
        """Scoring not started is cancelled; one in progress ends when the actors it waits on are stopped (teardown
        goes on to stop them rather than wait here)."""
        self._scorer.shutdown(wait=False, cancel_futures=True)

    def _score(self, prompts, completions) -> tuple[list, list[float]]:
        texts = self.tokenizer.batch_decode([c.token_ids for group in completions for c in group],
                                            skip_special_tokens=True)  # fmt: skip
        samples = samples_of(prompts, completions, texts)
        inputs = [_reward_input(s) for s in samples]
        scored = self.rewards.score(inputs) if self.rewards.terms else [(0.0, {})] * len(inputs)
        for term in (self.model, self.judge):
            if term is not None:
                scores = term.score(inputs)
                weight, name = term.weight, term.name
                scored = [(t + weight * x, parts | {name: x}) for (t, parts), x in zip(scored, scores, strict=True)]
        samples = [dataclasses.replace(s, reward_parts=parts) for s, (_, parts) in zip(samples, scored, strict=True)]
        return samples, [total for total, _ in scored]


def _reward_input(sample) -> tuple[str, list[dict], str]:
    messages = sample.prompt.row.messages + [{"role": "assistant", "content": sample.text}]
    return sample.id, messages, sample.prompt.row.answer
