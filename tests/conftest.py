"""Session fixtures: tiny HF models per family and one pool of gloo ranks shared by all distributed tests."""

from __future__ import annotations

import os

import pytest
from filelock import FileLock

from compat.ray import SINGLE_MACHINE
from tests.tiny import FAMILIES, make_tiny, make_tool_caller

WORLD_SIZE = 4

# A throw-away local Ray cluster: no token file in ~/.ray; on loopback, which the ranks reach only in Ray's
# single-machine mode (compat/ray.py). Set before the rank pool spawns, so ranks inherit both.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.update(SINGLE_MACHINE)


# Longest first, so the two workers finish together: end-to-end runs (the longest of them first), then multi-rank
# tests, then the rest.
ORDER = ("tests/e2e/", "tests/distributed/", "tests/planner/", "tests/unit/")
LONGEST = (  # each several minutes in a loaded CI run
    "tests/e2e/test_rl_run.py::test_a_run_killed_between_checkpoints",
    "tests/e2e/test_async_rl.py::test_async_learns_within_its_staleness_bound",
)
RANK_POOLS = {"ranks", "ranks3"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the group into the test's id
def pytest_collection_modifyitems(items) -> None:
    """Under ``--dist loadgroup`` (scripts/test.sh) every test of the rank pools runs in one worker, so one set of
    ranks exists, and the other worker takes the remaining tests beside it, longest first. (xdist hands out the
    rank pools' group first, and no second unit to that worker until its group is nearly done.)"""

    def rank(item) -> tuple[int, bool]:
        where = next((i for i, d in enumerate(ORDER) if item.nodeid.startswith(d)), len(ORDER))
        return where, not item.nodeid.startswith(LONGEST)

    items.sort(key=rank)
    for item in items:
        if RANK_POOLS & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.xdist_group("ranks"))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: str(make_tiny(arch, root / arch)) for arch in FAMILIES}


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory) -> str:
    """The tiny Llama that calls the calculator, then answers (tests/tiny.py): a 25 s fine-tune, so the xdist
    workers of one session share one (the first builds it under a lock in their common temporary directory)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return str(make_tool_caller(tmp_path_factory.mktemp("tool_caller")))
    root = tmp_path_factory.getbasetemp().parent  # this session's, shared by its workers
    path = root / "tool_caller"
    with FileLock(root / "tool_caller.lock"):
        if not path.is_dir():
            make_tool_caller(root / "tool_caller.partial").rename(path)
    return str(path)


def _pool(world_size: int):
    from tests.distributed.pool import RankPool

    pool = RankPool(world_size)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def ranks():
    yield from _pool(WORLD_SIZE)


@pytest.fixture(scope="module")
def ranks3():
    """Three ranks, for layouts of models whose head counts are multiples of 3 (SmolLM2: 9 heads, 3 KV); they
    hold the real model's state, so they end with the module that uses them."""
    yield from _pool(3)


@pytest.fixture(scope="session")
def ray_address(tmp_path_factory):
    """A local Ray cluster for the session (logical CPUs and devices); yields its address for other processes."""
    import ray

    from compat.ray import start_local_cluster
    from mcore_rl.roles.cluster import DEVICE
    from mcore_rl.rollout.remote import NAMESPACE

    start_local_cluster(num_cpus=2, resources={DEVICE: WORLD_SIZE}, log_to_driver=False, namespace=NAMESPACE)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()
