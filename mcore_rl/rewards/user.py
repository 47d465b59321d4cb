"""Rewards as functions ``reward_fn(messages, answer) -> float``: the built-in math reward or the user's own,
loaded from a Python file. Failures are reported with the sample they happened on."""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable, Sequence
from pathlib import Path

from mcore_rl.rewards.math import math_reward

RewardFn = Callable[[list[dict], str], float]


class RewardError(RuntimeError):
    """A reward function raised, or returned something that is not a finite number, on a named sample."""


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
        raise FileNotFoundError(f"reward function file {path} not found (reward spec {spec!r})")
    module_spec = importlib.util.spec_from_file_location(f"mcore_rl_user_reward_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise AttributeError(f"{path}: no function {name!r}; define {name}(messages, answer) -> float")
    return fn


def score(fn: RewardFn, samples: Sequence[tuple[str, list[dict], str]]) -> list[float]:
    """Rewards of ``(sample_id, messages, answer)`` samples; a failure names the sample and the cause."""
    rewards = []
    for sample_id, messages, answer in samples:
        try:
            value = float(fn(messages, answer))
        except Exception as err:
            raise RewardError(f"reward function failed on sample {sample_id}: {type(err).__name__}: {err}") from err
        if not math.isfinite(value):
            raise RewardError(f"reward function returned {value} on sample {sample_id}; expected a finite number")
        rewards.append(value)
    return rewards
