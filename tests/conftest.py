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


# Longest first, so the two workers finish together: end-to-end runs, then multi-rank tests, then the rest.
ORDER = ("tests/e2e/", "tests/distributed/", "tests/planner/", "tests/unit/")
RANK_POOLS = {"ranks", "ranks3"}
QUICK = "tests/unit/test_advantages.py"  # a unit test of pure functions: milliseconds


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the group into the test's id
def pytest_collection_modifyitems(items) -> None:
    """Under ``-n 2 --dist loadgroup`` (scripts/test.sh) every test of the rank pools runs in one worker, so one set
    of ranks exists, and the other worker takes the remaining tests beside it, longest first.

    xdist hands out the groups largest first (the rank pools' tests, to one worker) and queues a second unit on
    each worker at once: the one queued behind the rank pools waits for all of them, so it is a quick unit test,
    not an end-to-end run."""

    def pooled(item) -> bool:
        return bool(RANK_POOLS & set(getattr(item, "fixturenames", ())))

    items.sort(key=lambda item: next((i for i, d in enumerate(ORDER) if item.nodeid.startswith(d)), len(ORDER)))
    alone = [item for item in items if not pooled(item)]
    quick = next((item for item in alone if item.nodeid.startswith(QUICK)), None)
    if quick is not None and len(alone) > 2:  # the third unit handed out: second after the longest single test
        items.remove(quick)
        items.insert(items.index(alone[1]), quick)
    for item in filter(pooled, items):
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

    start_local_cluster(
        num_cpus=2, resources={DEVICE: WORLD_SIZE}, include_dashboard=False, log_to_driver=False, namespace=NAMESPACE
    )
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()
