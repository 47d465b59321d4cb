"""The hang watchdog: a phase of the run (an episode's rollout, training, sync, an eval, a save) that runs far past
its recent times, or past a configured limit, is reported while it still hangs, with what the user needs to act.

When a phase is overdue the watchdog asks every named actor of the run (the Megatron ranks, the rollout engines)
to answer a no-op: an actor is sequential, so one still inside a call does not answer. It writes every actor's
Python stacks (each thread's) to ``OUTPUT_DIR/logs/hang-<episode>-<phase>.txt``, names the phase and the actors
that did not answer in one log line, and then waits (``runtime_args.watchdog.action: wait``) or stops the run by
killing those actors, so the driver's wait ends with :class:`HangError`.

The stacks come from :mod:`faulthandler`, installed in each actor's process (:func:`install_stack_dump`): it
answers a signal in C, so it works while the process is stuck inside a collective or a C call, when the actor
could not run Python code for us. A zero-CPU task on the actor's node sends the signal and reads the file back,
so actors on other nodes are dumped too. Processes the actors start themselves (vLLM's engine core where it runs
out of process) have no handler: their parent's stacks show where it waits for them.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import tempfile
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)

STACKS_DIR = Path(tempfile.gettempdir()) / "mcore_rl_stacks"  # per node: <pid>.txt of each actor's process
RECENT = 5  # the phase's times a deadline is taken from
POLL_S = 1.0  # how often the watchdog looks


@dataclass
class WatchdogConfig:
    # A phase is overdue after factor x the longest of its last five times, and never before min_s seconds (an
    # unseen phase: min_s; the first episodes' phases include start-up work such as compiling)
    factor: float = 10.0
    min_s: float = 1800.0
    limit_s: float = 0.0  # overdue past this many seconds whatever its history (0: no limit)
    action: Literal["wait", "stop"] = (
        "wait"  # when overdue: "wait" (report and keep waiting) or "stop" (kill the silent actors)
    )
    ping_s: float = 60.0  # how long an actor has to answer the watchdog's no-op before it counts as not answering

    def validate(self, prefix: str = "runtime_args.watchdog") -> None:
        from mcore_rl.config.loader import check_bounds

        check_bounds(prefix, self, ("factor", "min_s", "ping_s"), 0, "a positive number", strict=True)
        check_bounds(prefix, self, ("limit_s",), 0, "seconds >= 0 (0: no limit)")


class HangError(RuntimeError):
    """The watchdog stopped a phase that hung (``action: stop``); the message names it and where the stacks are."""


def deadline(config: WatchdogConfig, recent: list[float]) -> float:
    """Seconds after which a phase with these recent times is overdue."""
    seconds = max(config.min_s, config.factor * max(recent, default=0.0))
    return min(seconds, config.limit_s) if config.limit_s else seconds


@dataclass
class Overdue:
    """What the watchdog found: the phase, how long it had run, the actors that did not answer, the stacks file."""

    phase: str
    episode: int
    seconds: float
    deadline: float
    silent: list[str]
    stacks: Path

    def __str__(self) -> str:
        silent = ", ".join(self.silent) or "none (the driver itself is slow)"
        return (
            f"phase {self.phase!r} of episode {self.episode} has run {self.seconds:.0f} s (overdue after "
            f"{self.deadline:.0f} s); actors not answering: {silent}; every actor's stacks: {self.stacks}"
        )


def install_stack_dump() -> None:
    """In an actor's process (its ``__init__``): SIGUSR1 writes every thread's Python stack to
    ``STACKS_DIR/<pid>.txt``, for the watchdog."""
    STACKS_DIR.mkdir(parents=True, exist_ok=True)
    # faulthandler keeps the file object; it stays open for the process's life
    faulthandler.register(signal.SIGUSR1, file=open(STACKS_DIR / f"{os.getpid()}.txt", "w"), all_threads=True)  # noqa: SIM115


def dump_stacks(pid: int, wait_s: float = 30.0) -> str:
    """(On the process's node.) Signal ``pid`` and return the stacks its handler wrote."""
    path = STACKS_DIR / f"{pid}.txt"
    if not path.exists():
        return "(no stack handler in this process)\n"
    before = path.stat().st_size
    os.kill(pid, signal.SIGUSR1)
    deadline_at, size, still = time.monotonic() + wait_s, before, 0
    while time.monotonic() < deadline_at and still < 3:  # written at once; done once it stops growing
        time.sleep(0.1)
        now = path.stat().st_size
        still = still + 1 if now == size and now > before else 0
        size = now
    with path.open() as f:
        f.seek(before)
        return f.read() or f"(pid {pid} wrote nothing within {wait_s:g} s)\n"


class Watchdog:
    """Watches the phases the driver enters (:meth:`phase`) from a thread of its own; ``overdue`` is its last
    report. ``logs``: where the stacks go."""

    def __init__(self, config: WatchdogConfig, logs: Path):
        self.config, self.logs = config, logs
        self.overdue: Overdue | None = None
        self._recent: dict[str, deque] = defaultdict(lambda: deque(maxlen=RECENT))
        self._current: tuple[str, int, float] | None = None  # (phase, episode, start)
        self._reported = False
        self._lock, self._closed = threading.Lock(), threading.Event()
        self._thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def phase(self, name: str, episode: int):
        start = time.monotonic()
        with self._lock:
            self._current, self._reported = (name, episode, start), False
        try:
            yield
        finally:
            with self._lock:
                self._recent[name].append(time.monotonic() - start)
                self._current = None

    def close(self) -> None:
        self._closed.set()
        self._thread.join()

    def raise_if_stopped(self, err: BaseException) -> None:
        """Where the run failed because the watchdog stopped a hung phase: :class:`HangError` instead of ``err``."""
        if self.overdue is not None and self.config.action == "stop":
            raise HangError(f"the watchdog stopped the run: {self.overdue}") from err

    def _watch(self) -> None:
        while not self._closed.wait(POLL_S):
            with self._lock:
                if self._current is None or self._reported:
                    continue
                name, episode, start = self._current
                limit = deadline(self.config, list(self._recent[name]))
                seconds = time.monotonic() - start
                if seconds <= limit:
                    continue
                self._reported = True
            try:
                self._report(name, episode, seconds, limit)
            except Exception:  # noqa: BLE001 - the watchdog must not take the run down
                log.exception("watchdog: reporting phase %r failed", name)

    def _report(self, name: str, episode: int, seconds: float, limit: float) -> None:
        from compat.ray import job_actors

        actors = job_actors()
        silent = _silent(actors, self.config.ping_s)
        self.logs.mkdir(parents=True, exist_ok=True)
        path = self.logs / f"hang-{episode}-{name}.txt"
        found = Overdue(name, episode, seconds, limit, sorted(silent), path)
        stacks = _stacks(actors)
        with path.open("w") as f:
            f.write(f"{found}\n\n")
            for actor in actors:
                state = "NOT ANSWERING" if actor.name in silent else "answering"
                f.write(f"=== {actor.name} (pid {actor.pid}, {state}) ===\n{stacks[actor.name]}\n")
        self.overdue = found  # before any kill: the killed call's caller reads it (raise_if_stopped)
        if self.config.action == "stop":
            import ray

            for actor in actors:
                if actor.name in silent:
                    ray.kill(actor.handle)
            log.error("watchdog: %s; stopping the run (runtime_args.watchdog.action=stop)", found)
        else:
            log.error("watchdog: %s; waiting (runtime_args.watchdog.action=wait)", found)


def _silent(actors, seconds: float) -> set[str]:
    """The named actors that do not answer a no-op within ``seconds``."""
    import ray

    pings = {actor.handle.__ray_ready__.remote(): actor.name for actor in actors if actor.handle is not None}
    answered, _ = ray.wait(list(pings), num_returns=len(pings), timeout=seconds)
    return set(pings.values()) - {pings[ref] for ref in answered}


def _stacks(actors) -> dict[str, str]:
    """Each actor's stacks, read on its node by a zero-CPU task (a dead or unreachable node's: the error)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    dump = ray.remote(dump_stacks)
    refs = {
        actor.name: dump.options(
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(actor.node_id, soft=False)
        ).remote(actor.pid)
        for actor in actors
    }
    out = {}
    for name, ref in refs.items():
        try:
            out[name] = ray.get(ref, timeout=120)
        except Exception as err:  # noqa: BLE001 - one node's failure leaves the others' stacks
            out[name] = f"(no stacks: {type(err).__name__}: {err})\n"
    return out
