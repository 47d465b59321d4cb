"""Environments of multi-turn rollouts. An environment is a class with

- ``reset(row) -> messages``: the opening conversation of one trajectory (``row``: the dataset row as a dict, its
  ``id``, ``messages``, ``answer`` and any other fields);
- ``step(message) -> (observation messages, reward, done)``: its answer to an assistant message that called no
  tool (tool calls are answered by the tools). The trajectory's reward is the sum of its steps' rewards.

One instance serves one trajectory. Built in: ``answer`` (the reward function scores the final answer; the
default) and ``python`` (the policy runs ```` ```python ```` blocks in the sandbox until it answers without one).
A user's environment is a class in a Python file (``models.reward.env: path/to/file.py:Name``).
"""

from __future__ import annotations

import math
import numbers
import re

from mcore_rl.agent.sandbox import Sandbox, SandboxConfig
from mcore_rl.rewards.user import Reward
from mcore_rl.userfile import UserCodeError, load_attribute

KEY = "models.reward.env"


class EnvError(UserCodeError):
    """An environment that cannot be loaded, or a step that failed or returned something else than expected."""


class AnswerEnv:
    """One question, one final answer: the reward function (``models.reward.fn``) scores the conversation once the
    policy answers without calling a tool."""

    def __init__(self, reward: Reward):
        self.reward = reward

    def reset(self, row: dict) -> list[dict]:
        self.messages, self.answer, self.id = list(row["messages"]), row["answer"], row["id"]
        return self.messages

    def step(self, message: dict) -> tuple[list[dict], float, bool]:
        self.messages.append(message)
        return [], self.reward.score([(self.id, self.messages, self.answer)])[0], True


class PythonEnv(AnswerEnv):
    """A code interpreter: each ```` ```python ```` block of an assistant message runs in the sandbox and its output
    comes back as a user message; a message without one is the final answer, scored by the reward function."""

    INSTRUCTIONS = (
        "You can run Python: write a ```python code block and its printed output comes back. "
        "When you know the answer, reply without a code block."
    )
    _BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)
    MAX_BLOCKS = 4  # run per message: a message of a thousand blocks must not take a thousand sandbox runs

    def __init__(self, reward: Reward, sandbox: Sandbox):
        super().__init__(reward)
        self.sandbox = sandbox

    def reset(self, row: dict) -> list[dict]:
        return [{"role": "system", "content": self.INSTRUCTIONS}, *super().reset(row)]

    def step(self, message: dict) -> tuple[list[dict], float, bool]:
        blocks = self._BLOCK.findall(message["content"])
        if not blocks:
            return super().step(message)
        self.messages.append(message)
        output = "\n".join(self.sandbox.run(code) for code in blocks[: self.MAX_BLOCKS])
        if len(blocks) > self.MAX_BLOCKS:
            output += f"\nerror: only the first {self.MAX_BLOCKS} code blocks of a message run"
        observation = {"role": "user", "content": f"Output:\n{output}"}
        self.messages.append(observation)
        return [observation], 0.0, False


BUILTIN_ENVS = ("answer", "python")


def environment_factory(spec: str, reward_spec: str, sandbox: SandboxConfig):
    """A callable making one environment per trajectory: ``spec`` ``answer``, ``python`` or a user's class."""
    if spec == "answer":
        reward = Reward(reward_spec)
        return lambda: AnswerEnv(reward)
    if spec == "python":
        reward, started = Reward(reward_spec), Sandbox.start(sandbox)
        return lambda: PythonEnv(reward, started)
    cls = load_attribute(KEY, spec, "Environment", "a class {name} with reset(row) and step(message)", EnvError)
    if not isinstance(cls, type) or not all(callable(getattr(cls, m, None)) for m in ("reset", "step")):
        raise EnvError(f"{KEY}={spec!r}: {cls!r} is not a class with reset(row) and step(message) methods")
    return cls


def check_messages(messages, what: str) -> list[dict]:
    """``messages`` if they are a list of ``{"role": str, "content": str}``; else an error saying what is wrong."""
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        raise EnvError(f"{what} returned {messages!r:.200}; expected a list of {{'role', 'content'}} dicts")
    return messages


def check_step(result) -> tuple[list[dict], float, bool]:
    """A step's ``(observation messages, reward, done)``, checked."""
    if not (isinstance(result, tuple | list) and len(result) == 3):
        raise EnvError(f"step returned {result!r:.200}; expected (messages, reward, done)")
    messages, reward, done = result
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
        raise EnvError(f"step returned the reward {reward!r}; expected a finite real number")
    return check_messages(messages, "step"), float(reward), bool(done)
