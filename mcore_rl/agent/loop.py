"""Multi-turn rollouts: many trajectories at once over the rollout engines, environments and tools.

A trajectory alternates assistant turns (sampled by an engine) and observations (tool results, or an
environment's answer), all one growing token sequence: the sampled ids exactly as the engine returned them with
their log-probs and policy versions (trained), the observations' ids between them (masked from the loss, kept in
context). It stops when the environment says done, or at ``max_turns``, ``max_total_tokens``, a turn cut at
``max_new_tokens``, or an environment error; the reason is recorded.

One thread (the pump) drives every trajectory in flight: it submits turns to the engines, hands tool calls and
environment steps to their actors, and takes whatever finished, so the engines keep batching the trajectories
that are generating while others wait on a tool. Callers in other threads start prompt groups and wait on futures.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field

import ray

from mcore_rl.agent.actors import EnvPool, ToolPool, ToolResult
from mcore_rl.agent.chat import ChatFormat, clip
from mcore_rl.agent.envs import EnvError
from mcore_rl.agent.tool_calls import KEY, call_ids, openai_tool_calls, parse_tool_calls, resolve_format
from mcore_rl.agent.trajectory import TrajectoryBuilder, trajectory_stats
from mcore_rl.batch import Sample
from mcore_rl.data.prompts import Prompt
from mcore_rl.rewards.user import RewardError
from mcore_rl.rollout.engine import Completion, MultiTurnConfig, SamplingConfig
from mcore_rl.rollout.sampler import GroupSampler

# An environment actor's start-up (a process, the environment's file imported) is not charged to the deadline of
# the step waiting for it, up to this long; a start-up that takes longer is charged from then on.
ENV_START_S = 120.0

log = logging.getLogger(__name__)


@dataclass
class _Live:
    """A trajectory in flight."""

    index: int  # the trajectory's number: its key and seed
    group: _Group
    slot: int  # its place in the group
    env: object = None  # its environment actor, from the reset on
    resets: int = 0  # resets sent (one more when its actor died during the first)
    traj: TrajectoryBuilder = field(default_factory=TrajectoryBuilder)
    # the conversation as the template reads it (rewritten_history: new_sample): the sampled turns as written
    conversation: list[dict] = field(default_factory=list)
    results: dict[int, ToolResult] = field(default_factory=dict)  # this turn's tool results by call index
    call_ids: list[str] = field(default_factory=list)  # this turn's tool calls, by the ids their results name

    @property
    def name(self) -> str:
        return f"t{self.index}"


@dataclass(eq=False)
class _Group:
    prompt: Prompt
    sampling: SamplingConfig
    future: concurrent.futures.Future
    replica: int  # the engine replica of all its turns: trajectories of one engine sample apart, and share its
    # prefix cache (replicas of one seed would sample alike)
    done: list  # its trajectories by place, None until finished


class AgentLoop(GroupSampler):
    """Start prompt groups (``sampling.n`` trajectories each) and get back their samples and rewards."""

    def __init__(self, rollout, envs: EnvPool, tools: ToolPool | None, tokenizer, limits: MultiTurnConfig,
                 max_model_len: int, env_timeout_s: float):  # fmt: skip
        super().__init__()
        self.rollout, self.envs, self.tools, self.tokenizer = rollout, envs, tools, tokenizer
        self.tool_format = resolve_format(KEY, limits.tool_format, tokenizer.chat_template)
        new_samples = limits.rewritten_history == "new_sample"
        self.chat = ChatFormat(tokenizer, tools.schemas if tools else [], self.tool_format, new_samples)
        self.max_turns, self.max_tokens = limits.max_turns, limits.total_tokens(max_model_len)
        self.max_calls, self.max_chars = limits.max_tool_calls_per_turn, limits.max_observation_chars
        self.env_timeout_s = env_timeout_s
        self._open: set[_Group] = set()  # groups with trajectories in flight
        self._lock = threading.Condition()
        self._new: list[_Live] = []  # started, waiting for the pump
        self._generating: dict[str, _Live] = {}  # engine request key -> trajectory
        self._env_steps: dict = {}  # object ref -> (trajectory, kind, start time)
        self._count = self._groups_started = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- callers ------------------------------------------------------------------------------------------
    def start(self, prompt: Prompt, sampling: SamplingConfig) -> concurrent.futures.Future:
        """``sampling.n`` trajectories of ``prompt``; the future's result is ``(samples, rewards)``."""
        if self._stop.is_set():
            raise RuntimeError("the multi-turn rollout has stopped (see the error logged before)")
        one = dataclasses.replace(sampling, n=1)
        group = _Group(prompt, one, concurrent.futures.Future(), self._groups_started, [None] * sampling.n)
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._pump, name="agent-loop", daemon=True)
                self._thread.start()
            self._open.add(group)
            self._groups_started += 1
            for slot in range(sampling.n):
                self._new.append(_Live(self._count, group, slot))
                self._count += 1
            self._lock.notify_all()
        return group.future

    def solved(self, samples: list[Sample], rewards: list[float]) -> list[bool]:
        """The environment's reward is the task's check."""
        return [r > 0 for r in rewards]

    def take_metrics(self, samples: list[Sample]) -> dict[str, float]:
        """The trajectories' statistics (turns, tool calls and errors, stop reasons, ...)."""
        return trajectory_stats([s.completion for s in samples])

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()

    # ---- the pump -----------------------------------------------------------------------------------------
    def _pump(self) -> None:
        try:
            while not self._stop.is_set():
                with self._lock:
                    if not (self._new or self._generating or self._env_steps or (self.tools and self.tools.busy)):
                        self._lock.wait(0.5)
                    new, self._new = self._new, []
                for live in new:
                    self._reset(live)
                waiting = bool(self._env_steps) or (self.tools is not None and self.tools.busy)
                if self._generating:
                    for key, completions in self.rollout.collect(0.05 if waiting else 0.5):
                        self._turn(self._generating.pop(key), completions[0])
                if self.tools is not None:
                    for (live, i), result in self.tools.poll(0 if self._generating else 0.05):
                        self._tool_result(live, i, result)
                self._poll_envs(0 if (self._generating or not self._env_steps) else 0.05)
        except BaseException as err:  # noqa: BLE001 - every waiting caller gets it, nobody hangs
            log.error("multi-turn rollout stopped: %s", err)
            with self._lock:
                self._stop.set()
                for group in self._open:
                    group.future.set_exception(err)

    def _poll_envs(self, timeout: float) -> None:
        if not self._env_steps:
            return
        ready, _ = ray.wait(list(self._env_steps), num_returns=len(self._env_steps), timeout=timeout)
        now = time.monotonic()
        for ref in ready:
            live, kind, _ = self._env_steps.pop(ref)
            try:
                result = ray.get(ref)
            except ray.exceptions.RayActorError as err:  # its process died: every trajectory it hosts ends
                self.envs.retire(live.env)
                if kind == "reset" and live.resets == 1:  # another trajectory's step may have killed it: again
                    self.envs.close(live.env, live.name)
                    self._reset(live)
                elif kind == "reset":
                    raise EnvError(
                        f"the environment's actor died twice while resetting row {live.group.prompt.row.id!r}: {err}"
                    ) from None
                else:
                    self._env_error(live, f"the environment's actor died: {err}")
                continue
            except ray.exceptions.RayTaskError as err:
                if isinstance(err.cause, RewardError):  # a broken reward function stops the run, as single-turn
                    raise err.cause from None
                if kind == "reset":  # no trajectory without its opening: the environment or its data is broken
                    raise EnvError(
                        f"resetting the environment for row {live.group.prompt.row.id!r} failed: {err.cause}"
                    ) from None
                self._env_error(live, f"{type(err.cause).__name__}: {err.cause}")
                continue
            self._opened(live, result) if kind == "reset" else self._stepped(live, *result)
        for ref, (live, kind, start) in list(self._env_steps.items()):
            up = self.envs.up_since(live.env)
            if up is None and now - start < ENV_START_S:  # its actor is still starting: not the step's time yet
                continue
            if self.env_timeout_s and now - max(start, up or start) > self.env_timeout_s:
                del self._env_steps[ref]
                if kind == "reset":
                    raise EnvError(f"resetting the environment for row {live.group.prompt.row.id!r} timed out")
                self.envs.retire(live.env)
                self._env_error(live, f"step timed out after {self.env_timeout_s:g} s")

    def _reset(self, live: _Live) -> None:
        live.env, live.resets = self.envs.open(), live.resets + 1
        ref = live.env.reset.remote(live.name, live.group.prompt.row.as_dict())
        self._env_steps[ref] = (live, "reset", time.monotonic())

    def _opened(self, live: _Live, messages: list[dict]) -> None:
        traj = live.traj
        traj.messages, traj.prompt_ids = self.chat.with_tools(messages), self.chat.prompt(messages)
        live.conversation = list(traj.messages)
        if len(traj.context) >= self.max_tokens:
            raise EnvError(
                f"row {live.group.prompt.row.id!r}: the opening messages are {len(traj.context)} tokens, leaving no room "
                f"in models.policy.rollout.multi_turn.max_total_tokens={self.max_tokens}"
            )
        self._generate(live)

    def _generate(self, live: _Live) -> None:
        sampling = live.group.sampling
        context, turns = live.traj.context, live.traj.stats["turns"]
        room = min(sampling.max_new_tokens, self.max_tokens - len(context))
        seed = None if sampling.seed is None else sampling.seed + 1000 * live.index + turns
        key = f"{live.name}/{turns}"
        self._generating[key] = live
        turn = dataclasses.replace(sampling, max_new_tokens=room, seed=seed)
        self.rollout.submit([(key, context)], turn, live.group.replica)

    def _turn(self, live: _Live, completion: Completion) -> None:
        text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        message = {"role": "assistant", "content": text}
        live.traj.add_turn(completion, message)
        if self.chat.new_samples:  # only a rewritten history reads it (a pass over the turn's ids)
            live.conversation.append(self.chat.sampled(completion.token_ids))
        if completion.finish_reason == "length":
            return self._finish(live, "max_tokens" if len(live.traj.context) >= self.max_tokens else "length")
        calls = []
        if self.tools is not None:  # read with the special tokens: several formats' markers are special tokens
            raw = self.tokenizer.decode(completion.token_ids, skip_special_tokens=False)
            calls = parse_tool_calls(raw, self.max_calls, self.tool_format, self.tools.schemas)
        if not calls:
            ref = live.env.step.remote(live.name, message)
            self._env_steps[ref] = (live, "step", time.monotonic())
        elif live.traj.stats["turns"] >= self.max_turns:
            self._finish(live, "max_turns")  # no turn left to read the results in
        else:
            live.call_ids, live.results = call_ids(calls, f"call_{live.index}_{live.traj.stats['turns'] - 1}"), {}
            message["tool_calls"] = openai_tool_calls(calls, live.call_ids)  # in the record, as the results name them
            for i, call in enumerate(calls):
                self.tools.submit((live, i), call)

    def _tool_result(self, live: _Live, i: int, result: ToolResult) -> None:
        live.results[i] = result
        live.traj.add_tool_call(result.error, result.seconds)
        if len(live.results) == len(live.call_ids):
            self._observe(live, [
                {"role": "tool", "tool_call_id": call_id, "name": live.results[j].name, "content": live.results[j].text}
                for j, call_id in enumerate(live.call_ids)
            ])  # fmt: skip

    def _stepped(self, live: _Live, observation: list[dict], reward: float, done: bool) -> None:
        live.traj.reward += reward
        if done:
            return self._finish(live, "done")
        if live.traj.stats["turns"] >= self.max_turns:
            return self._finish(live, "max_turns")
        self._observe(live, [{**m, "content": clip(m["content"], self.max_chars)} for m in observation])

    def _observe(self, live: _Live, messages: list[dict]) -> None:
        """Append tool results (cut to max_observation_chars in their actor) or environment messages (cut here),
        made inert, and take the next turn."""
        messages, traj = self.chat.inert_messages(messages), live.traj
        ids, rewritten = self.chat.follow(live.conversation, traj.context, messages, traj.last_turn)
        if len(ids) + (0 if rewritten else len(traj.context)) >= self.max_tokens:  # no room left for a turn
            return self._finish(live, "max_tokens")
        traj.new_segment(ids, messages) if rewritten else traj.add_observation(ids, messages)
        live.conversation += messages
        self._generate(live)

    def _env_error(self, live: _Live, error: str) -> None:
        log.warning("trajectory %s of row %s: environment error: %s", live.name, live.group.prompt.row.id, error[:500])
        live.traj.stats["env_errors"] += 1
        self._finish(live, "env_error")

    def _finish(self, live: _Live, stop: str) -> None:
        self.envs.close(live.env, live.name)
        trajectory = live.traj.build(stop)
        group = live.group
        group.done[live.slot] = trajectory
        if all(t is not None for t in group.done):
            with self._lock:
                self._open.discard(group)
            prompt, texts = group.prompt, [self.tokenizer.decode(t.response_ids) for t in group.done]
            samples = [
                Sample(f"{prompt.row.id}/{k}", Prompt(prompt.row, t.prompt_ids), t, text)
                for k, (t, text) in enumerate(zip(group.done, texts, strict=True))
            ]
            group.future.set_result((samples, [t.reward for t in group.done]))
