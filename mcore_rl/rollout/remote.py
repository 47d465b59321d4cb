"""The rollout engine as a Ray actor: its own process beside the colocated trainer ranks.

vLLM sets up its own torch.distributed world, so it cannot share a process with a trainer rank whose world is
already initialised; as an actor it can sit on the same (logical) device and take turns with the trainer.
"""

from __future__ import annotations

from pathlib import Path

import ray

from mcore_rl.rollout.engine import RolloutConfig, RolloutEngine

NAMESPACE = "mcore_rl"  # Ray namespace of the job's named actors, so other processes can look them up


def launch_engine(model_dir: str | Path, config: RolloutConfig, *, name: str | None = None, **options):
    """Start a ``RolloutEngine`` actor; ``options`` are Ray actor options (resources, scheduling strategy)."""
    options.setdefault("num_cpus", 0)  # the engine shares its device's CPUs with the trainer it takes turns with
    actor = ray.remote(RolloutEngine).options(name=name, **options).remote(str(model_dir), config)
    ray.get(actor.__ray_ready__.remote())  # surface start-up errors here, not at the first call
    return actor


def stop_engine(actor) -> None:
    """Shut vLLM down inside the actor before killing it; a killed engine leaks its /dev/shm segments."""
    try:
        ray.get(actor.shutdown.remote())
    finally:
        ray.kill(actor)
