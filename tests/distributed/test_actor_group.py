"""A role's ranks called together (:meth:`mcore_rl.roles.cluster.ActorGroup.call`): one rank's error is raised at
once, although its peers never return (they would wait for it in a collective); a batch goes into the object store
once for all of them, and a result every rank computes comes back once."""

import time

import pytest
import torch

from compat.ray import object_store_created_bytes
from mcore_rl.roles.cluster import ActorGroup, Placement
from mcore_rl.trainer.ranks import MegatronRank


class _Rank:
    """Rank 1 fails; the others wait as a rank waits for a peer in a collective."""

    def __init__(self, rank: int, world: int, master, cores=None):
        self.rank = rank

    def step(self) -> int:
        if self.rank == 1:
            raise ValueError("rank 1 cannot")
        time.sleep(3600)
        return self.rank

    def ok(self) -> int:
        return self.rank

    def total(self, batch: dict, scale: float) -> float:
        return float(batch["tokens"].sum()) * scale + self.rank

    def scaled(self, batch: dict, scale: float) -> torch.Tensor:
        return batch["tokens"] * scale

    answer = MegatronRank.answer  # what a Megatron role's ranks answer ``ActorGroup.ask`` with


def test_a_failing_rank_is_raised_while_its_peers_wait(ray_address):
    placement = Placement([1, 1])
    group = ActorGroup(_Rank, placement, 2, "test/actor_group", ("127.0.0.1", 0))
    try:
        assert group.call("ok") == [0, 1]
        start = time.monotonic()
        with pytest.raises(ValueError, match="rank 1 cannot"):
            group.call("step")
        assert time.monotonic() - start < 600  # rank 0 sleeps for an hour
    finally:
        group.kill()
        placement.remove()


def test_a_batch_is_stored_once_for_every_rank(ray_address):
    placement = Placement([1, 1, 1])
    group = ActorGroup(_Rank, placement, 3, "test/actor_group_batch", ("127.0.0.1", 0))
    batch = {"tokens": torch.ones(4 << 20)}  # 16 MiB: passed by value, Ray would store one copy per rank
    try:
        group.call("ok")
        before = object_store_created_bytes()
        assert group.call("total", batch, 0.5) == [float(2 << 20) + rank for rank in range(3)]
        created = object_store_created_bytes() - before
        assert 16 << 20 <= created < 2 * (16 << 20), created  # one copy (and small results), not three
    finally:
        group.kill()
        placement.remove()


def test_a_result_every_rank_computes_comes_back_from_rank_0_alone(ray_address):
    placement = Placement([1, 1, 1])
    group = ActorGroup(_Rank, placement, 3, "test/actor_group_ask", ("127.0.0.1", 0))
    batch = {"tokens": torch.ones(4 << 20)}
    try:
        group.call("ok")
        before = object_store_created_bytes()
        assert torch.equal(group.ask("scaled", batch, 0.5), batch["tokens"] * 0.5)
        created = object_store_created_bytes() - before
        assert 2 * (16 << 20) <= created < 3 * (16 << 20), created  # the batch and rank 0's result, not four
    finally:
        group.kill()
        placement.remove()
