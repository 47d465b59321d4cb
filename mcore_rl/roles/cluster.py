"""Ray placement of the roles: one bundle per device; colocated roles share bundles and take turns, and a
disaggregated run gives the rollout engines bundles of their own (and a reward model or judge may have theirs).

On GPU clusters a device is a Ray ``GPU``. On a CPU machine it is a logical resource (``DEVICE``) that the
driver declares when it starts a local cluster (``ray start --resources='{"mcore_rl_device": N}'`` on an existing
one), so scheduling takes the same path everywhere.
"""

from __future__ import annotations

import threading

import ray
import torch
from ray.util import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

DEVICE = "mcore_rl_device"


def device_resource(num_devices: int) -> str:
    """ "GPU" if the cluster has enough GPUs for the run, else the logical CPU device."""
    resources = ray.cluster_resources()
    if resources.get("GPU", 0) >= num_devices:
        return "GPU"
    if resources.get(DEVICE, 0) >= num_devices:
        return DEVICE
    raise RuntimeError(
        f"the Ray cluster has {resources.get('GPU', 0):g} GPUs and {resources.get(DEVICE, 0):g} logical devices; "
        f"the run needs runtime_args.num_devices={num_devices} (on CPU nodes start Ray with "
        f"--resources='{{\"{DEVICE}\": {num_devices}}}')"
    )


class Placement:
    """A placement group of one bundle per device; bundle ``b`` is shared by ``shares[b]`` colocated roles."""

    def __init__(self, shares: list[int], timeout_s: float = 120):
        num_devices = len(shares)
        self.resource = device_resource(num_devices)
        self.shares = shares
        self.group = placement_group([{self.resource: 1}] * num_devices, strategy="PACK")
        if not self.group.wait(timeout_s):
            remove_placement_group(self.group)
            raise RuntimeError(f"could not reserve {num_devices} x {self.resource} within {timeout_s:.0f} s")

    @classmethod
    def pools(
        cls, trainer_devices: int, rollout_devices: int, trainer_roles: int, engine_groups: int = 1, own: int = 0
    ) -> Placement:
        """Colocated (``rollout_devices`` 0): each of the trainer's devices shared by its ``trainer_roles`` Megatron
        roles and the ``engine_groups`` (the policy's engines, and a judge's without devices of its own). Otherwise
        the trainer's devices, shared by its roles, then the engines', shared by the engine groups. Then ``own``
        devices of roles with devices of their own (a reward model, a judge), one role each."""
        if not rollout_devices:
            return cls([trainer_roles + engine_groups] * trainer_devices + [1] * own)
        return cls([trainer_roles] * trainer_devices + [engine_groups] * rollout_devices + [1] * own)

    def options(self, bundle: int) -> dict:
        """Ray actor options for an actor that takes one role's share of device ``bundle``."""
        share = 1 / self.shares[bundle]
        return {
            "num_cpus": 0,  # colocated roles take turns on their device's cores
            "resources": {self.resource: share} if self.resource != "GPU" else {},
            "num_gpus": share if self.resource == "GPU" else 0,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=bundle),
        }

    def engine_options(self, first: int, tp: int) -> dict:
        """Ray actor options for a rollout engine over bundles ``first .. first + tp - 1``.

        On GPUs with ``tp > 1`` the actor holds no device: vLLM's Ray executor starts one worker per bundle, each
        taking the engine's share of that GPU. Otherwise the actor (and its workers, on CPU) takes bundle ``first``.
        """
        if tp == 1 or self.resource != "GPU":
            return self.options(first)
        bundles = ",".join(str(b) for b in range(first, first + tp))
        env = {"VLLM_RAY_BUNDLE_INDICES": bundles, "VLLM_RAY_PER_WORKER_GPUS": str(1 / self.shares[first])}
        return {
            "num_cpus": 0,
            "num_gpus": 0,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=first),
            "runtime_env": {"env_vars": env},
        }

    def remove(self) -> None:
        remove_placement_group(self.group)


class ActorGroup:
    """The ranks of one Megatron role, one actor per bundle; ``call`` runs a method on all and gathers results.

    Constructing a group starts its ranks, with ``master`` (from :func:`rendezvous`) as their torch.distributed
    rendezvous; :func:`wait_ready` waits for them, so several roles start side by side. Rank ``r`` takes bundle
    ``first + r``. ``cores``: each device's CPU cores, where a rank must keep to its own (CPU, disaggregated).
    """

    def __init__(
        self,
        cls,
        placement: Placement,
        world: int,
        name: str,
        master: tuple[str, int],
        cores: list[list[int]] | None = None,
        first: int = 0,
        **kwargs,
    ):
        remote = ray.remote(cls)
        self._order = threading.Lock()  # calls from several threads reach every rank in one order
        self.actors = [
            remote.options(name=f"{name}-{rank}", **placement.options(first + rank)).remote(
                rank, world, master, cores=cores[first + rank] if cores else None, **kwargs
            )
            for rank in range(world)
        ]

    def call(self, method: str, *args, **kwargs) -> list:
        """``method`` on every rank; the ranks' results in rank order (calls from several threads queue on every
        rank in the same order). A rank's error is raised as soon as it happens: its peers may be waiting for it
        in a collective, which would never return. Batches (dicts and
        tensors) go into the object store once and every rank reads that copy: passed by value, Ray would store
        one per rank."""
        if len(self.actors) > 1:
            args = tuple(_shared(value) for value in args)
            kwargs = {key: _shared(value) for key, value in kwargs.items()}
        with self._order:
            refs = [getattr(a, method).remote(*args, **kwargs) for a in self.actors]
        pending = refs
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            ray.get(done)  # raises a failed rank's error
        return ray.get(refs)

    def ask(self, method: str, *args, **kwargs):
        """``method`` on every rank (:meth:`call`); rank 0's result, which every rank computes (the others keep
        theirs: a rank's ``answer``)."""
        return self.call("answer", method, *args, **kwargs)[0]

    def kill(self) -> None:
        for actor in self.actors:
            ray.kill(actor)


def _shared(value):
    """``value`` in the object store (a reference every rank resolves to it) if it is a batch, else itself."""
    return ray.put(value) if isinstance(value, dict | torch.Tensor) else value


def rendezvous(placement: Placement, count: int, bundle: int = 0) -> list[tuple[str, int]]:
    """``count`` distinct addresses on the node of ``bundle``, where the rank 0 of the roles that use them runs;
    loopback ones when the cluster is that one node. Chosen here when this process runs on that node (a task
    elsewhere costs a worker's start: seconds)."""
    from parallel.transfer import free_addresses

    alive = [node["NodeID"] for node in ray.nodes() if node["Alive"]]
    if alive == [ray.get_runtime_context().get_node_id()]:
        return free_addresses(count, loopback=True)
    return ray.get(ray.remote(free_addresses).options(**placement.options(bundle)).remote(count, len(alive) == 1))


def single_node() -> bool:
    """Whether the Ray cluster is one node: its rendezvous stay on loopback, out of the network's reach."""
    return sum(node["Alive"] for node in ray.nodes()) == 1


def wait_ready(*groups: ActorGroup) -> None:
    """Wait until every rank of ``groups`` has started; if one failed, all are killed (the peers of a failed rank
    would wait in its collectives forever) and its error raised."""
    try:
        ray.get([actor.__ray_ready__.remote() for group in groups for actor in group.actors])
    except BaseException:
        for group in groups:
            group.kill()
        raise
