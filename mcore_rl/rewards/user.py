"""Rewards as functions ``reward_fn(messages, answer) -> float``: the built-in math reward or the user's own,
loaded from a Python file (``models.reward.fn``). Every problem is a :class:`RewardError` naming the key, the file
and, for a bad result, the sample."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence

from mcore_rl.rewards.math import math_reward
from mcore_rl.userfile import UserCodeError, load_attribute

RewardFn = Callable[[list[dict], str], float]
KEY = "models.reward.fn"


class RewardError(UserCodeError):
    """The reward function cannot be loaded, raised, or returned something that is not a finite real number."""


def builtin_math(messages: list[dict], answer: str) -> float:
    """Math reward of the last (assistant) message."""
    return math_reward(messages[-1]["content"], answer)


def load_reward_fn(spec: str) -> RewardFn:
    """``"math"`` (built in), ``"path/to/file.py"`` (its ``reward_fn``) or ``"path/to/file.py:name"``."""
    if spec == "math":
        return builtin_math
    fn = load_attribute(KEY, spec, "reward_fn", "a function {name}(messages, answer) -> float", RewardError)
    if not callable(fn):
        raise RewardError(f"{KEY}={spec!r}: {fn!r} is not a function; define it as (messages, answer) -> float")
    return fn


class Reward:
    """The configured reward function; each result is checked to be a real, finite number. Strings, booleans and
    None are refused rather than converted: they stand for a bug in the function, not a score."""

    def __init__(self, spec: str):
        self.spec = spec
        self.fn = load_reward_fn(spec)

    def score(self, samples: Sequence[tuple[str, list[dict], str]]) -> list[float]:
        """Rewards of ``(sample_id, messages, answer)`` samples; a failure names the sample and the cause."""
        return [self._one(sample_id, messages, answer) for sample_id, messages, answer in samples]

    def _one(self, sample_id: str, messages: list[dict], answer: str) -> float:
        try:
            value = self.fn(messages, answer)
        except Exception as err:  # noqa: BLE001 - reported with the sample it failed on
            raise RewardError(
                f"{KEY}={self.spec!r} failed on sample {sample_id}: {type(err).__name__}: {err}"
            ) from None
        if value is None:
            problem = "returned None"
        elif isinstance(value, bool) or not isinstance(value, numbers.Real):
            problem = f"returned {value!r} ({type(value).__name__})"
        elif not math.isfinite(value):
            problem = f"returned {value}"
        else:
            return float(value)
        raise RewardError(f"{KEY}={self.spec!r} {problem} on sample {sample_id}; expected a finite real number")

    def check(self, messages: list[dict], answer: str) -> None:
        """One call before the run starts, on a prompt answered with its own reference answer: a function that
        cannot return a number at all fails in seconds, not after the actors have started."""
        self._one("start-up check (the first training prompt, answered with its reference answer)", messages, answer)
