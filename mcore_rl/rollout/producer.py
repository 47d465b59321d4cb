"""Asynchronous rollout: engines generate prompt groups continuously into a versioned buffer the trainer takes from.

Every token carries the policy version that sampled it (:attr:`Completion.versions`); a group is as old as its
oldest token. The trainer at version ``v`` takes the oldest ready groups and drops (and counts) those that lag
more than ``max_staleness`` versions. The producer starts a group only within its allowance, which grows by one
episode's groups at each weight sync (as AReaL bounds its rollouts): starting with ``max_staleness + 1`` episodes'
worth, a group starts at most ``max_staleness`` versions before the one that trains on it, instead of generating
samples that would only be dropped.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mcore_rl.algorithms.grpo import constant_groups
from mcore_rl.batch import Sample, fill_with_spares

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Group:
    """One prompt's samples and rewards; ``position``: the prompt's place in the data order."""

    position: int
    samples: list[Sample]
    rewards: list[float]

    @property
    def version(self) -> int:
        """The oldest policy version among its tokens."""
        return min(min(s.completion.versions) for s in self.samples)


def partition_stale(groups: list[Group], version: int, max_staleness: int) -> tuple[list[Group], list[Group]]:
    """(fresh, stale) for a trainer at ``version``: stale groups lag it by more than ``max_staleness`` versions."""
    fresh = [g for g in groups if version - g.version <= max_staleness]
    return fresh, [g for g in groups if version - g.version > max_staleness]


class SampleBuffer:
    """Finished groups between the producer (``put``) and the trainer (``take``); thread-safe.

    Under dynamic sampling, groups whose rewards are all equal have no learning signal: they wait apart as spares,
    used only when ``refill_rounds`` batches' worth of them arrived since the last take (as the sync loop's
    refill rounds do), so a task the policy cannot yet tell apart still trains.
    """

    def __init__(self, max_staleness: int, group_size: int, dynamic_sampling: bool, refill_rounds: int):
        self.max_staleness, self.group_size = max_staleness, group_size
        self.dynamic_sampling, self.refill_rounds = dynamic_sampling, refill_rounds
        self._ready = threading.Condition()
        self._groups: list[Group] = []
        self._constant: list[Group] = []
        self._error: BaseException | None = None

    def put(self, group: Group) -> bool:
        """Add a finished group; False when it was set apart as a constant-reward spare."""
        constant = self.dynamic_sampling and constant_groups(torch.tensor(group.rewards), self.group_size).all()
        with self._ready:
            (self._constant if constant else self._groups).append(group)
            self._ready.notify_all()
        return not constant

    def fail(self, error: BaseException) -> None:
        """The producer stopped with ``error``: ``take`` raises it."""
        with self._ready:
            self._error = error
            self._ready.notify_all()

    def __len__(self) -> int:
        """Groups waiting to be trained on; constant spares aside (they must not stop the producer: enough of
        them arriving is what lets a take go ahead)."""
        with self._ready:
            return len(self._groups)

    def take(self, need: int, version: int) -> tuple[list[Group], list[Group], list[Group]]:
        """Wait for ``need`` groups fresh enough for a trainer at ``version``, oldest first: (taken, stale, spares),
        the dropped ones apart: stale groups, and constant spares this batch did not need."""
        stale: list[Group] = []
        with self._ready:
            while True:
                if self._error is not None:
                    raise self._error
                self._groups, old = partition_stale(self._groups, version, self.max_staleness)
                self._constant, old_constant = partition_stale(self._constant, version, self.max_staleness)
                stale += old + old_constant
                if len(self._groups) >= need:
                    taken, self._groups = self._groups[:need], self._groups[need:]
                    break
                if self._constant and len(self._constant) >= self.refill_rounds * need:
                    taken, self._constant = fill_with_spares(self._groups, self._constant, need)
                    self._groups = []
                    break
                self._ready.wait()
            spares, self._constant = self._constant, []  # they would only grow older
        return taken, stale, spares


class Producer:
    """A thread that keeps the rollout engines generating prompt groups into a :class:`SampleBuffer`.

    ``issue(count)`` hands out ``count`` (position, prompt) pairs; ``sampler`` generates and scores prompt groups
    (``submit`` / ``collect``: single-turn completions or multi-turn trajectories). ``allowance``: the groups it may start
    before the first :meth:`resume`; a constant-reward group set apart (dynamic sampling) lets one more start.
    ``drain`` pauses new work and waits until nothing is in flight (weights then change between whole
    generations); ``resume`` continues with more allowance. An error in the thread (a failing reward function, a
    dead engine) reaches the trainer through the buffer, which raises it.
    """

    def __init__(self, sampler, issue: Callable, sampling, buffer: SampleBuffer, allowance: int):
        self.sampler, self.issue = sampler, issue
        self.sampling, self.buffer, self._allowance = sampling, buffer, allowance
        self._in_flight: dict[str, tuple] = {}  # request key -> (position, prompt)
        self._paused = False
        self._stop = threading.Event()
        self._idle = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)

    def start(self) -> Producer:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                with self._idle:
                    room = 0 if self._paused else self._allowance
                if room > 0:
                    pairs = self.issue(room)
                    requests = {f"p{position}": (position, prompt) for position, prompt in pairs}
                    with self._idle:
                        self._in_flight.update(requests)
                        self._allowance -= len(requests)
                    self.sampler.submit([(k, p) for k, (_, p) in requests.items()], self.sampling)
                if not self._in_flight:
                    self._stop.wait(0.05)
                    continue
                for key, samples, rewards in self.sampler.collect():
                    with self._idle:
                        position, _ = self._in_flight.pop(key)
                    if not self.buffer.put(Group(position, samples, rewards)):
                        with self._idle:
                            self._allowance += 1  # a spare: a replacement may start
                with self._idle:
                    self._idle.notify_all()
        except BaseException as err:  # noqa: BLE001 - reported to the trainer, which raises it
            log.error("rollout producer stopped: %s", err)
            self.buffer.fail(err)
            with self._idle:
                self._idle.notify_all()

    def drain(self) -> None:
        """Stop starting generations and wait until those in flight finished (or the producer failed)."""
        with self._idle:
            self._paused = True
            self._idle.wait_for(lambda: not self._in_flight or not self._thread.is_alive())

    def resume(self, allow: int) -> None:
        """Start generations again, ``allow`` more groups of them (at a weight sync: one episode's, and as many
        as were dropped stale)."""
        with self._idle:
            self._paused = False
            self._allowance += allow

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
