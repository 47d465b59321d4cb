"""Rewards as functions ``reward_fn(messages, answer) -> float``: the built-in math reward or the user's own,
loaded from a Python file (``models.reward.fn``). Every problem is a :class:`RewardError` naming the key, the file
and, for a bad result, the sample."""

from __future__ import annotations

import importlib.util
import math
import numbers
from collections.abc import Callable, Sequence
from pathlib import Path

from mcore_rl.rewards.math import math_reward

RewardFn = Callable[[list[dict], str], float]
KEY = "models.reward.fn"


class RewardError(RuntimeError):
    """The reward function cannot be loaded, raised, or returned something that is not a finite real number."""


def builtin_math(messages: list[dict], answer: str) -> float:
    """Math reward of the last (assistant) message."""
    return math_reward(messages[-1]["content"], answer)


def load_reward_fn(spec: str) -> RewardFn:
    """``"math"`` (built in), ``"path/to/file.py"`` (its ``reward_fn``) or ``"path/to/file.py:name"``."""
    if spec == "math":
        return builtin_math
    path_text, _, name = spec.partition(":")
    path, name = Path(path_text), name or "reward_fn"
    if not path.is_file():
        raise RewardError(f"{KEY}={spec!r}: file {path} not found")
    module_spec = importlib.util.spec_from_file_location(f"mcore_rl_user_reward_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:  # noqa: BLE001 - whatever the user's file raises on import is reported, by file
        raise RewardError(f"{KEY}={spec!r}: importing {path} raised {type(err).__name__}: {err}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RewardError(f"{KEY}={spec!r}: {path} has no function {name!r}; define {name}(messages, answer) -> float")
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
