"""The rollout replicas (one vLLM engine actor each, ``tensor_parallel_size`` devices), and the reward actors and
other user code bounded in time."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time

import ray

from mcore_rl.rewards.user import Rewards, RewardTerm
from mcore_rl.roles.cluster import Placement
from mcore_rl.rollout.engine import Completion, RolloutConfig, SamplingConfig, thread_binding
from mcore_rl.rollout.remote import launch_engines, stop_engine, wait_engines
from mcore_rl.userfile import UserCodeError

log = logging.getLogger(__name__)

STARTUP_S = 300  # the longest a user-code actor may take to start: its process, the user's file imported


def _split(items: list, parts: int) -> list[list]:
    size = -(-len(items) // parts)
    return [items[i * size : (i + 1) * size] for i in range(parts)]


class RolloutGroup:
    """Engines on consecutive blocks of ``tp`` of the placement's ``devices`` (colocated: the trainer ranks on a
    block feed its engine)."""

    def __init__(self, engines: list, tp: int):
        self.engines, self.tp = engines, tp
        self._speculative: dict[str, float] = {}  # the engines' draft counters at the last take_speculative_stats

    @classmethod
    def launch(
        cls,
        model_dir: str,
        config: RolloutConfig,
        placement: Placement,
        devices: range,
        name: str,
        colocated: bool,
        cores: list[list[int]] | None = None,
        wait: bool = True,
    ) -> RolloutGroup:
        """``colocated``: the engines take turns with the trainer on ``devices`` (and sleep while it trains).
        ``cores``: each device's CPU cores, where the engines must keep to their own (CPU, disaggregated).
        ``wait``: until the engines are up (else :meth:`wait_ready` does)."""
        tp = config.tensor_parallel_size
        firsts = range(devices.start, devices.stop, tp)
        configs = [config] * len(firsts)
        if cores and config.cpu_threads_bind == "auto":  # each worker on its own device's cores
            configs = [
                dataclasses.replace(config, cpu_threads_bind=thread_binding(cores[first : first + tp]))
                for first in firsts
            ]
        launches = [(f"{name}-{i}", placement.engine_options(first, tp)) for i, first in enumerate(firsts)]
        return cls(launch_engines(model_dir, configs, launches, colocated, wait), tp)

    def wait_ready(self) -> None:
        wait_engines(self.engines)

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[list[Completion]]:
        """Prompts spread evenly over the replicas, generated concurrently; results in prompt order."""
        parts = [p for p in _split(prompts, len(self.engines)) if p]
        results = ray.get([e.generate.remote(p, sampling) for e, p in zip(self.engines, parts, strict=False)])
        return [c for part in results for c in part]

    def generate_within(
        self, prompts: list[list[int]], sampling: SamplingConfig, timeout_s: float
    ) -> list[list[Completion]] | None:
        """:meth:`generate` with a deadline: None when the replicas have not finished within ``timeout_s`` (their
        requests then finish unread)."""
        parts = [p for p in _split(prompts, len(self.engines)) if p]
        refs = [e.generate.remote(p, sampling) for e, p in zip(self.engines, parts, strict=False)]
        try:
            return [c for part in ray.get(refs, timeout=timeout_s) for c in part]
        except ray.exceptions.GetTimeoutError:
            return None

    def submit(self, requests: list[tuple[str, list[int]]], sampling: SamplingConfig, replica: int | None = None):
        """Start ``(key, prompt)`` requests, spread over the replicas or all on ``replica`` (a multi-turn
        trajectory's turns, so each finds the last one's context in its prefix cache); :meth:`collect` hands them
        out when done."""
        n = len(self.engines)
        parts = _split(requests, n) if replica is None else [requests if i == replica % n else [] for i in range(n)]
        ray.get([e.submit.remote(part, sampling) for e, part in zip(self.engines, parts, strict=True) if part])

    def collect(self, seconds: float = 0.5) -> list[tuple[str, list[Completion]]]:
        """Let the replicas generate for up to ``seconds``; the submitted requests that finished."""
        return [done for part in ray.get([e.collect.remote(seconds) for e in self.engines]) for done in part]

    def sleep(self) -> int:
        return sum(ray.get([e.sleep.remote() for e in self.engines]))

    def wake_up(self) -> None:
        ray.get([e.wake_up.remote() for e in self.engines])

    def process_stats(self) -> list[dict[str, float]]:
        return ray.get([e.process_stats.remote() for e in self.engines])

    def take_speculative_stats(self) -> dict[str, float]:
        """Draft tokens proposed and accepted by all engines since the last call (speculative decoding)."""
        stats = ray.get([e.speculative_stats.remote() for e in self.engines])
        totals = {key: sum(s[key] for s in stats) for key in stats[0]}
        since = {key: value - self._speculative.get(key, 0.0) for key, value in totals.items()}
        self._speculative = totals
        return since

    def stop(self) -> None:
        for engine in self.engines:
            with contextlib.suppress(ray.exceptions.RayActorError):  # one that failed to start is gone already
                stop_engine(engine)


class BoundedPool:
    """Actors of ``cls(*args)``, each running its share of a batch through ``cls.score`` in its own CPU process. A
    call past its deadline (``timeout_s`` an item) is stopped by replacing its actor; its items run again one at a
    time, and the one that hangs again gets ``late`` and is counted (``timeouts``). A
    :class:`~mcore_rl.userfile.UserCodeError` in an actor is raised here as itself (its message names the key, file
    and sample), not inside Ray's traceback."""

    def __init__(self, cls, args: tuple, num_actors: int, num_cpus: float, timeout_s: float, late, what: str):
        """``what``: what an item's result is, for the log line of one past its deadline."""
        self._new = lambda: ray.remote(cls).options(num_cpus=num_cpus).remote(*args)
        self.timeout_s, self.late, self.what = timeout_s, late, what
        self.actors = [self._new() for _ in range(num_actors)]
        self._ready(self.actors)
        self.timeouts = 0  # items given ``late`` for a call past its deadline, since the last take_timeouts

    def score(self, items: list[tuple]) -> list:
        """The actors' results in item order (each item's first element names it)."""
        parts = [p for p in _split(items, len(self.actors)) if p]
        refs = [a.score.remote(p) for a, p in zip(self.actors, parts, strict=False)]
        deadline = time.monotonic() + self.timeout_s * max(map(len, parts), default=0)
        results = []
        for i, (ref, part) in enumerate(zip(refs, parts, strict=True)):
            try:
                results += self._get(ref, deadline - time.monotonic())
            except ray.exceptions.GetTimeoutError:
                self._replace(i)
                results += [self._one(i, item) for item in part]
        return results

    def _one(self, i: int, item):
        try:
            return self._get(self.actors[i].score.remote([item]), self.timeout_s)[0]
        except ray.exceptions.GetTimeoutError:
            log.warning("%s of sample %s: no result after %g s", self.what, item[0], self.timeout_s)
            self._replace(i)
            self.timeouts += 1
            return self.late

    def _replace(self, i: int) -> None:
        ray.kill(self.actors[i])  # the only way to stop a call that hangs
        self.actors[i] = self._new()
        self._ready([self.actors[i]])

    def _ready(self, actors: list) -> None:
        """Wait until ``actors`` have started (a process, the user's file imported): their start is not an item's
        time. One that cannot start within ``STARTUP_S`` stops the run with what failed."""
        try:
            self._get([a.__ray_ready__.remote() for a in actors], STARTUP_S)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"the {self.what} actors did not start within {STARTUP_S} s") from None

    @staticmethod
    def _get(ref, timeout: float) -> list:
        try:
            return ray.get(ref, timeout=max(timeout, 0.0))
        except ray.exceptions.RayTaskError as err:
            if isinstance(err.cause, UserCodeError):
                raise err.cause from None
            raise

    def take_timeouts(self) -> int:
        """The items given ``late`` for a timeout since the last call."""
        count, self.timeouts = self.timeouts, 0
        return count

    def stop(self) -> None:
        for actor in self.actors:
            ray.kill(actor)


class RewardPool(BoundedPool):
    """Reward actors, each scoring its share of a batch with every weighted reward function
    (:class:`~mcore_rl.rewards.user.Rewards`): ``score`` gives each sample's (reward, its parts by name); a sample
    whose call hangs twice scores 0."""

    def __init__(self, terms: list[tuple[str, RewardTerm]], num_actors: int, num_cpus: float, timeout_s: float):
        self.terms = terms  # no actor without a function to run
        super().__init__(Rewards, (terms,), num_actors if terms else 0, num_cpus, timeout_s, (0.0, {}), "reward")
