"""Data-parallel gradient reduce-scatter (summed or averaged) and parameter all-gather on CPU go through shared
memory (:mod:`parallel.shm`, installed into Megatron-Core's buckets by the CPU support): the same results as
gloo's."""

from __future__ import annotations

import shutil
import uuid

import torch

from parallel.shm import SHM_DIR
from tests.distributed import cases


def test_shared_memory_collectives_give_gloo_s_results(ranks):
    directory = SHM_DIR / f"mcore_rl_test_{uuid.uuid4().hex}"  # in /dev/shm, apart from other processes' windows
    try:
        results = ranks.run(cases.shm_collectives_match_gloo, directory=str(directory), private=False)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    for result in results:
        assert result.pop("shared") == {"world": True}
        assert result.pop("window_bytes") == 3 * 4096 * 4  # the peers' shards of the largest bucket, no more
        assert result.pop("files_left") == []  # unlinked once every rank mapped them
        assert result.pop("fallback_sizes") == []  # gloo served nothing; a rank alone is its own result
        for key, got in result.items():
            assert got["all_gather"], key
            if key.startswith(("pair", "one")):  # a sum of two (or one) is the same in any order, halving it exact
                assert got["exact"], key
            else:  # four ranks: gloo's ring adds in another order; a few roundings of the largest sum apart
                assert got["reduce_scatter"] <= 4 * torch.finfo(getattr(torch, key.split("/")[2][6:])).eps, key


def test_ranks_that_cannot_map_each_other_s_windows_use_gloo(ranks, tmp_path):
    for result in ranks.run(cases.shm_collectives_match_gloo, directory=str(tmp_path), private=True):
        assert result.pop("shared") == {"world": False} and result.pop("window_bytes") == 0
        assert result.pop("files_left") == []
        assert result.pop("fallback_sizes") == [2, 4]  # torch's collectives for the pairs and the world only
        assert all(got["exact"] and got["all_gather"] for got in result.values()), result
