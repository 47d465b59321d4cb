"""Agent programs: a user's own agent drives each trajectory through the run's OpenAI-compatible endpoint
(:mod:`mcore_rl.agent.server`), with its own loop, tools and prompts, and trains the policy it talks to.

A program is a function in a Python file, ``run(base_url, api_key, row)``: any OpenAI client pointed at
``base_url`` with ``api_key`` talks to the policy (its current weights, the run's sampling) in a session that
records every turn token-exactly (:mod:`mcore_rl.agent.sessions`); ``row`` is the prompt row (its ``messages``,
``answer`` and other fields). It returns the trajectory's reward, or None when it set one through the endpoint
(``POST <base_url minus /v1>/reward``) or has none (0, counted). Each runs in a CPU actor of its own, at most
``num_actors`` at once; one that raises, crashes its process or runs past ``timeout_s`` ends its own trajectory
with the reason counted (``agent_error``, ``agent_timeout``) and reward 0, never the run.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import threading

from mcore_rl.agent.actors import CallPool, ProgramHost, load_program
from mcore_rl.agent.server import AgentServer
from mcore_rl.agent.sessions import EngineCalls, Sessions
from mcore_rl.agent.trajectory import trajectory_stats
from mcore_rl.batch import Sample
from mcore_rl.data.prompts import Prompt
from mcore_rl.rollout.engine import MultiTurnConfig, SamplingConfig
from mcore_rl.rollout.sampler import GroupSampler
from mcore_rl.userfile import absolute_spec

log = logging.getLogger(__name__)

MODEL = "policy"  # the model name the endpoint serves


@dataclasses.dataclass(eq=False)
class _Group:
    prompt: Prompt
    future: concurrent.futures.Future
    done: list  # its samples' (trajectory, reward) by place, None until finished


class AgentPrograms(GroupSampler):
    """Prompt groups whose trajectories a user's agent program drives (``sampling.n`` sessions each); the
    :class:`~mcore_rl.rollout.sampler.Sampler` of runs with ``models.reward.agent``."""

    def __init__(self, rollout, tokenizer, spec: str, limits: MultiTurnConfig, max_model_len: int, num_actors: int,
                 timeout_s: float, host: str = "127.0.0.1"):  # fmt: skip
        super().__init__()
        spec = absolute_spec(spec)  # the actors' working directory may be another
        load_program(spec)  # its errors here, in the driver, before any actor starts
        self.tokenizer = tokenizer
        self.engine = EngineCalls(rollout)
        self.sessions = Sessions(self.engine, tokenizer, limits, max_model_len, MODEL)
        self.server = AgentServer(self.sessions, host)
        self.programs = CallPool(ProgramHost, (spec,), "run", num_actors, timeout_s)
        self._lock = threading.Lock()
        self._new: list[tuple[str, _Group, int]] = []  # sessions opened, their programs not queued yet
        self._open: set[_Group] = set()
        self._ids = itertools.count()
        self._groups_started = 0
        self._counts: collections.Counter = collections.Counter()  # agent/* metrics since the last take
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._pump, name="agent-programs", daemon=True)
        self._thread.start()

    # ---- the Sampler interface ------------------------------------------------------------------------------
    def start(self, prompt: Prompt, sampling: SamplingConfig) -> concurrent.futures.Future:
        """``sampling.n`` sessions of ``prompt``, each driven by a program; the future's result is ``(samples,
        rewards)``."""
        if self._stop.is_set():
            raise RuntimeError("the agent programs have stopped (see the error logged before)")
        group = _Group(prompt, concurrent.futures.Future(), [None] * sampling.n)
        with self._lock:
            replica = self._groups_started  # a group's sessions on one engine replica, as the built-in loop's
            self._groups_started += 1
            self._open.add(group)
            for slot in range(sampling.n):
                sid = f"s{next(self._ids)}"
                self.sessions.open(sid, prompt.row.as_dict(), sampling, replica)
                self._new.append((sid, group, slot))
        return group.future

    def solved(self, samples: list[Sample], rewards: list[float]) -> list[bool]:
        return [r > 0 for r in rewards]

    def take_metrics(self, samples: list[Sample]) -> dict[str, float]:
        """The trajectories' statistics, and the programs' failures and missing rewards since the last call."""
        with self._lock:
            counts, self._counts = self._counts, collections.Counter()
        keys = ("agent/program_errors", "agent/program_timeouts", "agent/no_reward", "agent/no_turn")
        return trajectory_stats([s.completion for s in samples]) | {k: float(counts[k]) for k in keys}

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.server.close()
        self.engine.close()
        self.programs.stop()

    # ---- the pump -------------------------------------------------------------------------------------------
    def _pump(self) -> None:
        try:
            while not self._stop.is_set():
                with self._lock:
                    new, self._new = self._new, []
                for sid, group, slot in new:
                    self.programs.submit((sid, group, slot), self.server.base_url(sid), self.server.token,
                                         group.prompt.row.as_dict())  # fmt: skip
                if not self.programs.busy:
                    self._stop.wait(0.2)
                    continue
                for (sid, group, slot), outcome in self.programs.poll(0.5):
                    self._finished(sid, group, slot, outcome)
        except BaseException as err:  # noqa: BLE001 - every waiting caller gets it, nobody hangs
            log.error("agent programs stopped: %s", err)
            with self._lock:
                self._stop.set()
                for group in self._open:
                    group.future.set_exception(err)

    def _finished(self, sid: str, group: _Group, slot: int, outcome) -> None:
        row = group.prompt.row
        timeout = outcome.error == "timeout"
        if outcome.error:
            log.warning("agent program of row %s (session %s): %s", row.id, sid, outcome.message[:500])
        trajectory, session = self.sessions.finish(
            sid, ("agent_timeout" if timeout else "agent_error") if outcome.error else "done"
        )
        reward = outcome.value if outcome.value is not None else session.reward
        with self._lock:
            self._counts["agent/program_timeouts"] += timeout
            self._counts["agent/program_errors"] += bool(outcome.error) and not timeout
            self._counts["agent/no_reward"] += reward is None and not outcome.error
            self._counts["agent/no_turn"] += not trajectory.turns
        if not trajectory.turns:  # no request made: the row's prompt with nothing sampled (trained on nothing)
            trajectory = dataclasses.replace(trajectory, prompt_ids=list(group.prompt.token_ids))
        group.done[slot] = (trajectory, 0.0 if reward is None or outcome.error else reward)
        if all(d is not None for d in group.done):
            with self._lock:
                self._open.discard(group)
            samples = [
                Sample(f"{row.id}/{k}", Prompt(row, t.prompt_ids), t, self.tokenizer.decode(t.response_ids))
                for k, (t, _) in enumerate(group.done)
            ]
            group.future.set_result((samples, [r for _, r in group.done]))
