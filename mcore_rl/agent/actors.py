"""Environments, tools and agent programs in CPU actors, outside the driver: a user's code that crashes, hangs or
leaks stays in its actor. This module is what those actors' processes import: nothing here may import torch.
Environments are stateful (one instance per trajectory, hosted by an actor that serves many at once); tool calls are
stateless and run one per actor, so the number of tool actors bounds the calls running at once and a call past its
timeout is stopped by replacing its actor (a Python thread cannot be stopped)."""

from __future__ import annotations

import collections
import math
import numbers
import time
from dataclasses import dataclass

import ray

from mcore_rl.agent.chat import clip
from mcore_rl.agent.envs import check_messages, check_step, environment_factory
from mcore_rl.agent.sandbox import SandboxConfig
from mcore_rl.agent.tool_calls import ToolCall
from mcore_rl.agent.tools import ToolError, invoke, load_tools, schema
from mcore_rl.userfile import load_attribute

# An environment actor's threads: trajectories whose steps run at once (most wait on the policy, not on it).
ENV_THREADS = 64


class EnvHost:
    """Environment instances by trajectory key."""

    def __init__(self, spec: str, reward_spec: str, sandbox: SandboxConfig):
        self.factory = environment_factory(spec, reward_spec, sandbox)
        self.envs: dict[str, object] = {}

    def reset(self, key: str, row: dict) -> list[dict]:
        env = self.envs[key] = self.factory()
        return check_messages(env.reset(row), "reset")

    def step(self, key: str, message: dict) -> tuple[list[dict], float, bool]:
        return check_step(self.envs[key].step(message))

    def close(self, key: str) -> None:
        env = self.envs.pop(key, None)
        if callable(getattr(env, "close", None)):
            env.close()


class EnvPool:
    """Environment actors, each serving many trajectories. An actor whose process died, or that runs a step past
    its timeout (a thread nothing but the actor's end stops), is retired: it takes no new trajectories (a fresh one
    takes its place) and is killed when its last open trajectory closes. Called from one thread (the agent loop's
    pump)."""

    def __init__(self, spec: str, reward_spec: str, sandbox: SandboxConfig, num_actors: int):
        remote = ray.remote(EnvHost).options(num_cpus=0, max_concurrency=ENV_THREADS)  # they mostly wait
        self._remote = lambda: remote.remote(spec, reward_spec, sandbox)
        self._starting: dict = {}  # actor -> the ref that resolves once its process is up
        self._up: dict = {}  # actor -> when it was first seen up
        self.actors = [self._new() for _ in range(num_actors)]  # the ones taking new trajectories
        self._open: collections.Counter = collections.Counter()  # actor -> its trajectories not closed yet
        self._draining: set = set()  # actors with a hung step, waiting for their other trajectories to close
        self._opened = 0

    def _new(self):
        actor = self._remote()
        self._starting[actor] = actor.__ray_ready__.remote()
        return actor

    def up_since(self, actor) -> float | None:
        """When ``actor`` was first seen up (its process started, the environment's file imported): a step's
        deadline counts from then, not from the start-up of a fresh actor on a busy machine; None before."""
        if actor not in self._up:
            ready, _ = ray.wait([self._starting[actor]], timeout=0)
            if not ready:
                return None
            self._up[actor] = time.monotonic()
            del self._starting[actor]
        return self._up[actor]

    def open(self):
        """The actor of a new trajectory (its reset, steps and close all go there)."""
        actor = self.actors[self._opened % len(self.actors)]
        self._opened += 1
        self._open[actor] += 1
        return actor

    def close(self, actor, key: str) -> None:
        self._open[actor] -= 1
        if actor in self._draining and not self._open[actor]:
            self._draining.discard(actor)
            del self._open[actor]
            self._up.pop(actor, None)
            self._starting.pop(actor, None)
            ray.kill(actor)  # its hung thread with it
        else:
            actor.close.remote(key)

    def retire(self, actor) -> None:
        """``actor`` died or has a step that will not return: replace it for new trajectories."""
        if actor not in self._draining:
            self.actors[self.actors.index(actor)] = self._new()
            self._draining.add(actor)

    def stop(self) -> None:
        for actor in self.actors + list(self._draining):
            ray.kill(actor)


class ToolHost:
    def __init__(self, specs: list[str], sandbox: SandboxConfig, max_chars: int):
        self.tools, self.max_chars = load_tools(specs, sandbox), max_chars

    def call(self, name: str, arguments: dict) -> tuple[str, str, float]:
        """(output or error, the error's kind or "", seconds the call took here); the output cut to ``max_chars``
        here, so a tool that returns gigabytes does not send them."""
        start = time.perf_counter()
        try:
            text, kind = clip(invoke(self.tools[name], arguments), self.max_chars), ""
        except ToolError as err:
            text, kind = clip(f"error: {err}", self.max_chars), err.kind
        return text, kind, time.perf_counter() - start


AGENT_KEY = "models.reward.agent"


class AgentError(RuntimeError):
    """A user's agent program that cannot load, or returned something other than a reward."""


def load_program(spec: str):
    signature = "a function {name}(base_url, api_key, row) returning the reward or None"
    return load_attribute(AGENT_KEY, spec, "run", signature, AgentError)


class ProgramHost:
    """Runs one agent program (:mod:`mcore_rl.agent.programs`) at a time in its own process."""

    def __init__(self, spec: str):
        self.spec, self.run_program = spec, load_program(spec)

    def run(self, base_url: str, api_key: str, row: dict) -> float | None:
        value = self.run_program(base_url, api_key, row)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise AgentError(f"{AGENT_KEY}={self.spec!r} returned {value!r:.100}; expected a finite number or None")
        return float(value)


@dataclass(frozen=True)
class ToolResult:
    name: str
    text: str  # the tool's output, or the error the policy reads
    error: str  # the error's kind (parse, too_many_calls, unknown_tool, arguments, raised, bad_output, timeout,
    # crashed), "" for none
    seconds: float  # the call's time in its actor (its timeout for one that hung; 0 for one never made)


@dataclass(frozen=True)
class CallOutcome:
    value: object = None  # what the call returned
    error: str = ""  # "" for none; "raised" (its message in ``message``), "timeout" or "crashed" (its process died)
    message: str = ""
    seconds: float = 0.0  # from its start on a started actor to its result (its timeout for one that hung)


class CallPool:
    """Calls of ``method`` on actors of ``cls(*args)``: queued, one per actor at a time (at most ``num_actors`` at
    once), each stopped after ``timeout_s`` by replacing its actor (nothing else stops a call that hangs). Calls go
    to started actors only, so an actor's start-up (a replaced one's on a loaded machine) never counts against a
    call's timeout. Called from one thread."""

    def __init__(self, cls, args: tuple, method: str, num_actors: int, timeout_s: float):
        self.method, self.timeout_s = method, timeout_s
        self._new = lambda: ray.remote(cls).options(num_cpus=0).remote(*args)
        self._starting: dict = {}  # ready ref -> actor not started yet
        self._free: list = []
        for _ in range(num_actors):
            self._spawn()
        self._queue: collections.deque = collections.deque()  # (ticket, args)
        self._running: dict = {}  # object ref -> (ticket, actor, start time)

    def submit(self, ticket, *args) -> None:
        """Queue a call; its outcome comes back from :meth:`poll` with ``ticket``."""
        self._queue.append((ticket, args))

    @property
    def busy(self) -> bool:
        return bool(self._queue or self._running)

    def _spawn(self) -> None:
        actor = self._new()
        self._starting[actor.__ray_ready__.remote()] = actor

    def poll(self, timeout: float) -> list[tuple[object, CallOutcome]]:
        """Start queued calls on free actors, wait up to ``timeout`` seconds, and hand out the finished ones."""
        if self._starting:  # waited on only when queued calls have no actor otherwise
            idle = self._queue and not self._free and not self._running
            started, _ = ray.wait(list(self._starting), num_returns=len(self._starting), timeout=timeout if idle else 0)
            for ref in started:
                ray.get(ref)  # an actor that cannot start at all (its code no longer loads) stops the caller
                self._free.append(self._starting.pop(ref))
        while self._queue and self._free:
            ticket, args = self._queue.popleft()
            actor = self._free.pop()
            self._running[getattr(actor, self.method).remote(*args)] = (ticket, actor, time.monotonic())
        done = []
        if self._running:
            ready, _ = ray.wait(list(self._running), num_returns=len(self._running), timeout=timeout)
            now = time.monotonic()
            for ref in ready:
                ticket, actor, start = self._running.pop(ref)
                done.append((ticket, self._outcome(ref, actor, now - start)))
            for ref, (ticket, actor, start) in list(self._running.items()):
                if now - start > self.timeout_s:
                    del self._running[ref]
                    ray.kill(actor)
                    self._spawn()
                    done.append(
                        (ticket, CallOutcome(None, "timeout", f"timed out after {self.timeout_s:g} s", now - start))
                    )
        return done

    def _outcome(self, ref, actor, seconds: float) -> CallOutcome:
        try:
            value = ray.get(ref)
        except ray.exceptions.RayActorError:  # the call took its actor down (a crash, not an exception)
            self._spawn()
            return CallOutcome(None, "crashed", "crashed its process", seconds)
        except ray.exceptions.RayTaskError as err:
            self._free.append(actor)
            return CallOutcome(None, "raised", f"{type(err.cause).__name__}: {err.cause}", seconds)
        except ray.exceptions.UnserializableException as err:  # raised, but not unpicklable here (openai's errors)
            self._free.append(actor)
            lines = str(err).strip().splitlines()
            return CallOutcome(None, "raised", lines[-1][:500] if lines else type(err).__name__, seconds)
        self._free.append(actor)
        return CallOutcome(value, "", "", seconds)

    def stop(self) -> None:
        for actor in self._free + list(self._starting.values()) + [a for _, a, _ in self._running.values()]:
            ray.kill(actor)


class ToolPool:
    """Tool calls in a :class:`CallPool` of tool actors. Every call gets a result: its output, or an error (unknown
    tool, invalid arguments, raised, returned something else than text, timed out, crashed)."""

    def __init__(self, specs: list[str], sandbox: SandboxConfig, num_actors: int, timeout_s: float,
                 max_chars: int):  # fmt: skip
        tools = load_tools(specs, sandbox)  # loading errors here, in the driver, before any actor starts
        self.names, self.schemas = set(tools), [schema(t) for t in tools.values()]
        self.calls = CallPool(ToolHost, (specs, sandbox, max_chars), "call", num_actors, timeout_s)
        self.done: list[tuple[object, ToolResult]] = []  # calls never made, until the caller takes them

    def submit(self, ticket, call: ToolCall) -> None:
        """Queue a call; its result comes back from :meth:`poll` with ``ticket``."""
        if call.error or call.name not in self.names:
            error = call.error or f"unknown tool {call.name[:100]!r}; the tools are {sorted(self.names)}"
            self.done.append((ticket, ToolResult(call.name, f"error: {error}", call.kind or "unknown_tool", 0.0)))
        else:
            self.calls.submit((ticket, call.name), call.name, call.arguments)

    @property
    def busy(self) -> bool:
        return bool(self.done) or self.calls.busy

    def poll(self, timeout: float) -> list[tuple[object, ToolResult]]:
        """Start queued calls, wait up to ``timeout`` seconds, and hand out the finished ones."""
        done, self.done = self.done, []
        for (ticket, name), outcome in self.calls.poll(timeout):
            if outcome.error:
                error = f"error: {name} {outcome.message}" if outcome.error != "raised" else f"error: {outcome.message}"
                done.append((ticket, ToolResult(name, error, outcome.error, outcome.seconds)))
            else:
                text, error, seconds = outcome.value
                done.append((ticket, ToolResult(name, text, error, seconds)))
        return done

    def stop(self) -> None:
        self.calls.stop()
