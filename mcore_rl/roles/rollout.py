"""The rollout replicas (one vLLM engine actor each, ``tensor_parallel_size`` devices), and the reward actors and
other user code bounded in time."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import threading
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


class EngineLostError(RuntimeError):
    """A rollout engine died after the run had replaced ``runtime_args.max_engine_replacements`` of them."""


class RolloutGroup:
    """Engines on consecutive blocks of ``tp`` of the placement's ``devices`` (colocated: the trainer ranks on a
    block feed its engine).

    An engine whose process dies is replaced, up to ``max_replacements`` times in a run (then
    :class:`EngineLostError`): a new actor starts in its place (same devices and settings), and what it was
    generating is generated again by the engines that serve, none of it returned twice. A replacement serves
    once it holds the current weights: at once where the weights never change (``synced=False``: a judge's), else
    when the System loads them into it (:meth:`joining` / :meth:`joined`): at the next weight sync, or at once
    through ``revive`` when no engine is left to serve (set by the System; it calls those two).
    """

    def __init__(self, engines: list, tp: int, relaunch=None, max_replacements: int = 0, synced: bool = True):
        """``relaunch(i, generation)``: a new engine actor in engine ``i``'s place, not waited for."""
        self.engines, self.tp = engines, tp
        self._relaunch, self.max_replacements, self.synced = relaunch, max_replacements, synced
        self.revive = None  # loads the current weights into the joining engines when none serves
        self._speculative: dict[str, float] = {}  # the engines' draft counters at the last take_speculative_stats
        self._lock = threading.RLock()
        self._joining: set[int] = set()  # replacements without the current weights yet
        # per engine: its submitted, uncollected requests, key -> (prompt, sampling)
        self._requests: list[dict] = [{} for _ in engines]
        self._orphans: list[tuple] = []  # (key, prompt, sampling) of dead engines, for the next that serves
        self._replaced: list[dict] = []  # since take_replacements
        self.replacements = 0

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
        max_replacements: int = 0,
        synced: bool = True,
    ) -> RolloutGroup:
        """``colocated``: the engines take turns with the trainer on ``devices`` (and sleep while it trains).
        ``cores``: each device's CPU cores, where the engines keep to their own (CPU: engines on different devices
        roll out at the same time).
        ``wait``: until the engines are up (else :meth:`wait_ready` does). ``max_replacements``, ``synced``: see
        the class."""
        tp = config.tensor_parallel_size
        firsts = range(devices.start, devices.stop, tp)
        configs = [config] * len(firsts)
        if cores and config.cpu_threads_bind == "auto":  # each worker on its own device's cores
            configs = [
                dataclasses.replace(config, cpu_threads_bind=thread_binding(cores[first : first + tp]))
                for first in firsts
            ]
        launches = [(f"{name}-{i}", placement.engine_options(first, tp)) for i, first in enumerate(firsts)]

        def relaunch(i: int, generation: int):
            again = [(f"{launches[i][0]}.{generation}", launches[i][1])]
            return launch_engines(model_dir, [configs[i]], again, colocated, wait=False)[0]

        engines = launch_engines(model_dir, configs, launches, colocated, wait)
        return cls(engines, tp, relaunch, max_replacements, synced)

    def wait_ready(self) -> None:
        wait_engines(self.engines)

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[list[Completion]]:
        """Prompts spread evenly over the replicas, generated concurrently; results in prompt order."""
        return self._generate(prompts, sampling, None)

    def generate_within(
        self, prompts: list[list[int]], sampling: SamplingConfig, timeout_s: float
    ) -> list[list[Completion]] | None:
        """:meth:`generate` with a deadline: None when the replicas have not finished within ``timeout_s`` (their
        requests then finish unread)."""
        return self._generate(prompts, sampling, time.monotonic() + timeout_s)

    def _generate(self, prompts, sampling, deadline: float | None):
        parts = [p for p in _split(prompts, len(self._serving())) if p]
        results: list = [None] * len(parts)
        todo = list(range(len(parts)))
        while todo:  # the parts of engines that died go to those that serve
            serving = self._serving()
            calls = [(k, self.engines[i]) for k, i in zip(todo, itertools.cycle(serving))]
            refs = [engine.generate.remote(parts[k], sampling) for k, engine in calls]
            todo = []
            for (k, engine), ref in zip(calls, refs, strict=True):
                try:
                    results[k] = ray.get(ref, timeout=None if deadline is None else max(deadline - time.monotonic(), 0))
                except ray.exceptions.GetTimeoutError:
                    return None
                except ray.exceptions.RayActorError as err:
                    self._lost(engine, err)
                    todo.append(k)
        return [c for part in results for c in part]

    def submit(self, requests: list[tuple[str, list[int]]], sampling: SamplingConfig, replica: int | None = None):
        """Start ``(key, prompt)`` requests, spread over the replicas or all on ``replica`` (a multi-turn
        trajectory's turns, so each finds the last one's context in its prefix cache; another replica's where that
        one does not serve); :meth:`collect` hands them out when done."""
        serving = self._serving()
        if replica is None:
            parts = dict(zip(serving, _split(requests, len(serving)), strict=False))
        else:
            n = len(self.engines)
            parts = {replica % n if replica % n in serving else serving[replica % len(serving)]: requests}
        for i, part in parts.items():
            self._submit_to(i, part, sampling)

    def _submit_to(self, i: int, requests: list[tuple[str, list[int]]], sampling: SamplingConfig) -> None:
        if not requests:
            return
        engine = self.engines[i]
        with self._lock:
            self._requests[i].update((key, (prompt, sampling)) for key, prompt in requests)
        try:
            ray.get(engine.submit.remote(requests, sampling))
        except ray.exceptions.RayActorError as err:
            self._lost(engine, err)

    def collect(self, seconds: float = 0.5) -> list[tuple[str, list[Completion]]]:
        """Let the replicas generate for up to ``seconds``; the submitted requests that finished."""
        self._adopt_orphans()
        done = []
        for i, result in self._each("collect", seconds):
            with self._lock:
                for key, _ in result:
                    self._requests[i].pop(key, None)
            done += result
        return done

    def sleep(self, only: list[int] | None = None) -> int:
        """Bytes freed by the engines asleep: those that serve, or the engines ``only``."""
        if only is not None:
            return sum(ray.get([self.engines[i].sleep.remote() for i in only]))
        return sum(result for _, result in self._each("sleep"))

    def wake_up(self) -> None:
        self._each("wake_up")

    def process_stats(self) -> list[dict[str, float]]:
        return [result for _, result in self._each("process_stats")]

    def take_speculative_stats(self) -> dict[str, float]:
        """Draft tokens proposed and accepted by all engines since the last call (speculative decoding; a
        replacement's count from its start)."""
        stats = [result for _, result in self._each("speculative_stats")]
        totals = {key: sum(s[key] for s in stats) for key in ("draft_tokens", "accepted_tokens")}
        since = {key: max(value - self._speculative.get(key, 0.0), 0.0) for key, value in totals.items()}
        self._speculative = totals
        return since

    # ---- engines that die --------------------------------------------------------------------------------
    def check(self) -> None:
        """Replace the engines that died (each answers a ping, or is found dead)."""
        self._each("__ray_ready__")

    def joining(self) -> list[int]:
        """The replacements that need the current weights, once they are up (a replacement that fails to start
        is replaced in turn)."""
        while True:
            with self._lock:
                joining = sorted(self._joining)
            engines = [self.engines[i] for i in joining]
            refs = [engine.__ray_ready__.remote() for engine in engines]
            for engine, ref in zip(engines, refs, strict=True):
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as err:
                    self._lost(engine, err)
                    break
            else:
                return joining

    def joined(self, indices: list[int]) -> None:
        """The replacements ``indices`` hold the current weights: they serve, the dead engines' requests first."""
        with self._lock:
            self._joining -= set(indices)
        self._adopt_orphans()

    def take_replacements(self) -> list[dict]:
        """What was replaced since the last call: per replacement, the engine, its requests generated again, and
        why."""
        with self._lock:
            taken, self._replaced = self._replaced, []
        return taken

    def _serving(self) -> list[int]:
        """The engines that hold the current weights; where none does, the replacements are made to first."""
        while True:
            with self._lock:
                serving = [i for i in range(len(self.engines)) if i not in self._joining]
                joining = bool(self._joining)
            if serving or not joining:
                return serving
            if self.synced:
                self.revive()
            else:
                self.joined(self.joining())

    def _each(self, method: str, *args) -> list[tuple[int, object]]:
        """``method`` on every engine that serves: ``(index, result)`` of those that answered; the ones that died
        are replaced."""
        with self._lock:
            engines = [(i, e) for i, e in enumerate(self.engines) if i not in self._joining]
        refs = [getattr(engine, method).remote(*args) for _, engine in engines]
        results = []
        for (i, engine), ref in zip(engines, refs, strict=True):
            try:
                results.append((i, ray.get(ref)))
            except ray.exceptions.RayActorError as err:
                self._lost(engine, err)
        return results

    def _lost(self, engine, err: BaseException) -> None:
        """``engine`` died: a replacement starts in its place and its requests wait for an engine that serves."""
        with self._lock:
            if engine not in self.engines:  # replaced already (another call found it dead first)
                return
            i = self.engines.index(engine)
            reason = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
            if self.replacements >= self.max_replacements:
                raise EngineLostError(
                    f"rollout engine {i} died ({reason}) after {self.replacements} replacement(s): "
                    f"runtime_args.max_engine_replacements={self.max_replacements} allows no more"
                ) from err
            self.replacements += 1
            moved, self._requests[i] = self._requests[i], {}
            self._orphans += [(key, prompt, sampling) for key, (prompt, sampling) in moved.items()]
            with contextlib.suppress(Exception):
                ray.kill(engine)  # where it only hangs: gone for good
            self.engines[i] = self._relaunch(i, self.replacements)
            self._joining.add(i)
            self._replaced.append({"engine": i, "requests": len(moved), "reason": reason})
        log.warning(
            "rollout engine %d died (%s): replacing it (%d of at most %d), its %d request(s) generated again",
            i, reason, self.replacements, self.max_replacements, len(moved),
        )  # fmt: skip

    def _adopt_orphans(self) -> None:
        """The dead engines' requests, to the engines that serve (the replacements where none other does)."""
        with self._lock:
            orphans, self._orphans = self._orphans, []
        by_sampling: dict[int, tuple] = {}
        for key, prompt, sampling in orphans:
            by_sampling.setdefault(id(sampling), (sampling, []))[1].append((key, prompt))
        for sampling, requests in by_sampling.values():
            self.submit(requests, sampling)

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
