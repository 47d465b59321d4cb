"""The rollout engine as a Ray actor: its own process beside the colocated trainer ranks.

vLLM sets up its own torch.distributed world, so it cannot share a process with a trainer rank whose world is
already initialised; as an actor it can sit on the same (logical) device and take turns with the trainer.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import ray

from mcore_rl.rollout.engine import RolloutConfig, RolloutEngine

NAMESPACE = "mcore_rl"  # Ray namespace of the job's named actors, so other processes can look them up


def launch_engines(
    model_dir: str | Path,
    config: RolloutConfig | list[RolloutConfig],
    launches: list[tuple[str | None, dict]],
    colocated: bool = True,
    wait: bool = True,
) -> list:
    """Start one ``RolloutEngine`` actor per ``(name, Ray actor options)`` (with ``config``, or its own of a list;
    ``colocated`` with the trainer, or on devices of their own): they import vLLM and load the model side by side,
    not in turn. ``wait``: until all are up (else :func:`wait_engines` does, so they start beside other roles)."""
    engine = ray.remote(RolloutEngine)
    configs = config if isinstance(config, list) else [config] * len(launches)
    # An engine shares its device's CPUs with the trainer it takes turns with, or has its own: it reserves none.
    actors = [
        engine.options(name=name, **{"num_cpus": 0} | options).remote(str(model_dir), c, colocated)
        for (name, options), c in zip(launches, configs, strict=True)
    ]
    if wait:
        wait_engines(actors)
    return actors


def wait_engines(actors: list) -> None:
    """Wait until the engines are up: start-up errors surface here, not at the first call; the engines of a launch
    that failed are stopped."""
    try:
        ray.get([actor.__ray_ready__.remote() for actor in actors])
    except BaseException:
        for actor in actors:
            with contextlib.suppress(Exception):  # the failed one answers nothing
                stop_engine(actor)
        raise


def launch_engine(model_dir: str | Path, config: RolloutConfig, *, name: str | None = None, **options):
    """One engine (see :func:`launch_engines`); ``options`` are Ray actor options (resources, scheduling)."""
    return launch_engines(model_dir, config, [(name, options)])[0]


def stop_engine(actor) -> None:
    """Shut vLLM down inside the actor before killing it; a killed engine leaks its /dev/shm segments."""
    try:
        ray.get(actor.shutdown.remote())
    finally:
        ray.kill(actor)
