"""Process groups: torch.distributed (NCCL on CUDA, gloo on CPU) plus Megatron's parallel state for a layout."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from compat.megatron_core import destroy_groups, install_fixes
from compat.megatron_core.cpu import route_bucket_collectives
from compat.torch import fake_store, release_groups
from parallel.config import ParallelConfig
from parallel.device import Device
from parallel.shm import SharedMemoryCollectives
from parallel.transfer import LAZY_GLOO, tcp_store


def gloo_connects_on_first_use() -> None:
    """Gloo groups built by this process from now on connect at their first collective: Megatron builds every group
    of a layout (expert, embedding, context-parallel combinations, ...) and a CPU role uses few of them, while each
    gloo group made eagerly is a full mesh of TCP connections set up at once (measured on the rank pool:
    test_bridges 160 -> 135 s, 229 -> 215 core-s). Every member of a group must choose alike: the roles' ranks all
    come here; the weight-transfer group, whose engine side does not, connects in its constructor
    (:class:`parallel.transfer.TransferGroup`). A variable the user set is kept."""
    os.environ.setdefault(*LAZY_GLOO)


def init_parallel(
    parallel: ParallelConfig, *, seed: int = 1234, timeout_minutes: int = 30, device: Device | None = None
) -> ProcessGroupCollection:
    """Initialise torch.distributed from the environment (if needed) and Megatron's groups for ``parallel``.

    Returns the explicit process groups (``tp``, ``pp``, ``ep``, ``expt_tp``, ``dp``, ...) that the project's
    collectives take; nothing downstream reads Megatron's global state for groups. ``device``: this machine's
    (:meth:`Device.current`) unless given.
    """
    device = device or Device.current()
    install_fixes(cpu=not device.cuda)
    if device.shared_memory_buckets:
        route_bucket_collectives(SharedMemoryCollectives)
    gloo_connects_on_first_use()
    if not dist.is_initialized():
        if device.cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        rank, world, timeout = (
            int(os.environ["RANK"]),
            int(os.environ["WORLD_SIZE"]),
            timedelta(minutes=timeout_minutes),
        )
        address = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        store = tcp_store(address, world, rank == 0, timeout)
        dist.init_process_group(device.dist_backend, store=store, rank=rank, world_size=world, timeout=timeout)
    parallel.validate_world(dist.get_world_size())
    destroy_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp if parallel.vpp > 1 else None,
        context_parallel_size=parallel.cp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.expert_tp,
        distributed_timeout_minutes=timeout_minutes,
        # Megatron's own gloo copies of the groups serve only callers without explicit groups; the optimizer takes
        # ours (see Device.optimizer_args), so they would only cost start-up and threads.
        create_gloo_process_groups=False,
    )
    model_parallel_cuda_manual_seed(seed)
    return ProcessGroupCollection.use_mpu_process_groups()


def destroy_parallel() -> None:
    """Tear down Megatron's groups; torch.distributed stays up, so a process can take another layout. The groups
    are destroyed and freed with their gloo threads (see :func:`compat.megatron_core.destroy_groups`): a process
    that changes layouts keeps the threads of one layout, not of every layout it had."""
    if destroy_groups():
        release_groups()


def block_group(size: int) -> dist.ProcessGroup | None:
    """This rank's block of ``size`` consecutive ranks, as a gloo group (small objects only); None for size 1.

    Collective: every rank creates every block, as ``new_group`` requires. The caller destroys the group.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if size < 1 or world % size:
        raise ValueError(f"blocks of {size} ranks do not tile a world of {world}")
    if size == 1:
        return None
    mine = None
    for start in range(0, world, size):
        group = dist.new_group(list(range(start, start + size)), backend="gloo")
        if start <= rank < start + size:
            mine = group  # other ranks get a placeholder: only members connect
    return mine


@contextlib.contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[None]:
    """torch.distributed as ``rank`` of ``world_size`` with no-op collectives; torn down on exit."""
    if dist.is_initialized():
        raise RuntimeError(
            "a fake world needs a process without torch.distributed (run meta builds in a process of their own)"
        )
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        # Fake groups hold no threads: no collection to free them (a full one per pipeline stage was 2 s of CPU of
        # a 671B dry run's 17)
        destroy_groups()
        dist.destroy_process_group()
