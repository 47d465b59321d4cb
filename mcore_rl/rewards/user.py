"""Rewards as functions ``reward_fn(messages, answer) -> float``: the built-in math reward or the user's own,
loaded from a Python file (``models.reward.fn``, and each of ``models.reward.terms``). A function may also return a
dictionary: its ``"score"`` is the reward, its other entries are named components that are logged beside it.
:class:`Rewards` weighs several and sums them. Every problem is a :class:`RewardError` naming the key, the file and,
for a bad result, the sample."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from mcore_rl.rewards.math import math_reward
from mcore_rl.userfile import UserCodeError, load_attribute

RewardFn = Callable[[list[dict], str], float | dict]
KEY = "models.reward.fn"
Sample = tuple[str, list[dict], str]  # (sample id, messages, reference answer)


class RewardError(UserCodeError):
    """The reward function cannot be loaded, raised, or returned something that is not a finite real number."""


def builtin_math(messages: list[dict], answer: str) -> float:
    """Math reward of the last (assistant) message."""
    return math_reward(messages[-1]["content"], answer)


def load_reward_fn(spec: str, key: str = KEY) -> RewardFn:
    """``"math"`` (built in), ``"path/to/file.py"`` (its ``reward_fn``) or ``"path/to/file.py:name"``."""
    if spec == "math":
        return builtin_math
    fn = load_attribute(key, spec, "reward_fn", "a function {name}(messages, answer) -> float", RewardError)
    if not callable(fn):
        raise RewardError(f"{key}={spec!r}: {fn!r} is not a function; define it as (messages, answer) -> float")
    return fn


class Reward:
    """One reward function; each result is checked to be a real, finite number (or a dictionary of them with a
    ``"score"``). Strings, booleans and None are refused rather than converted: they stand for a bug in the function,
    not a score."""

    def __init__(self, spec: str, key: str = KEY):
        self.spec, self.key = spec, key
        self.fn = load_reward_fn(spec, key)

    def score(self, samples: Sequence[Sample]) -> list[float]:
        """Rewards of ``(sample_id, messages, answer)`` samples; a failure names the sample and the cause."""
        return [self.score_parts([sample])[0][0] for sample in samples]

    def score_parts(self, samples: Sequence[Sample]) -> list[tuple[float, dict[str, float]]]:
        """(reward, named components) of each sample; the components are empty for a function returning a number."""
        return [self._one(sample_id, messages, answer) for sample_id, messages, answer in samples]

    def _one(self, sample_id: str, messages: list[dict], answer: str) -> tuple[float, dict[str, float]]:
        try:
            value = self.fn(messages, answer)
        except Exception as err:  # noqa: BLE001 - reported with the sample it failed on
            raise RewardError(
                f"{self.key}={self.spec!r} failed on sample {sample_id}: {type(err).__name__}: {err}"
            ) from None
        if isinstance(value, dict):
            if "score" not in value:
                raise RewardError(
                    f"{self.key}={self.spec!r} returned a dictionary without 'score' on sample {sample_id} (keys "
                    f"{sorted(value)[:5]}); return {{'score': reward, <component>: value, ...}}"
                )
            parts = {str(k): self._number(v, sample_id, f"[{k!r}]") for k, v in value.items()}
            return parts.pop("score"), parts
        return self._number(value, sample_id), {}

    def _number(self, value, sample_id: str, where: str = "") -> float:
        if value is None:
            problem = "returned None"
        elif isinstance(value, bool) or not isinstance(value, numbers.Real):
            problem = f"returned {value!r} ({type(value).__name__})"
        elif not math.isfinite(value):
            problem = f"returned {value}"
        else:
            return float(value)
        if where:
            problem = problem.replace("returned", f"returned{where}", 1)
        raise RewardError(f"{self.key}={self.spec!r} {problem} on sample {sample_id}; expected a finite real number")

    def check(self, messages: list[dict], answer: str) -> None:
        """One call before the run starts, on a prompt answered with its reference answer: a function that
        cannot return a number at all fails in seconds, not after the actors have started."""
        self._one("start-up check (the first training prompt, answered with its reference answer)", messages, answer)


@dataclass
class RewardTerm:
    """One of several weighted rewards (``models.reward.terms``)."""

    name: str = ""  # its metrics: reward/<name>/mean (and reward/<name>/<component>_mean)
    fn: str = ""  # "math", "path/to/file.py" or "path/to/file.py:function", as models.reward.fn
    weight: float = 1.0


def default_name(spec: str) -> str:
    """A reward function's name in metrics: ``math``, the function's after ``:``, else the file's stem."""
    return spec.rpartition(":")[2] if ":" in spec else Path(spec).stem


class Rewards:
    """Several reward functions, each with a name and a weight: a sample's reward is the weighted sum, and each
    function's value (and its components) is kept by name."""

    def __init__(self, terms: Sequence[tuple[str, RewardTerm]]):
        """``terms``: (config key, term) pairs; the key names the term in errors."""
        self.terms = [(term.name, term.weight, Reward(term.fn, key)) for key, term in terms]

    def score(self, samples: Sequence[Sample]) -> list[tuple[float, dict[str, float]]]:
        """(weighted sum, {name: value, name/component: value}) of each sample."""
        out = []
        for sample in samples:
            total, parts = 0.0, {}
            for name, weight, reward in self.terms:
                ((value, components),) = reward.score_parts([sample])
                total += weight * value
                parts[name] = value
                parts |= {f"{name}/{k}": v for k, v in components.items()}
            out.append((total, parts))
        return out

    def check(self, messages: list[dict], answer: str) -> None:
        for _, _, reward in self.terms:
            reward.check(messages, answer)
