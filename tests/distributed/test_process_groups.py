"""Layout changes free what they replace: a process that re-initialises Megatron's groups keeps the gloo threads
of one layout, not of every layout it had (the session's rank pool changes layout for every case). A layout's
groups connect at their first collective: those a role never uses cost no connections."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import cases

LAYOUTS = [
    dict(tp=2),
    dict(pp=2),
    dict(tp=2, pp=2),
    dict(cp=2),
    dict(pp=2, cp=2),
    dict(pp=4),
    dict(pp=2, vpp=2),
    dict(tp=2, sequence_parallel=True),
    dict(cp=2, tp=2),
    dict(),
]


def test_twenty_layout_changes_leave_the_thread_count_at_its_baseline(ranks, tiny_models):
    tokens = torch.randint(0, 100, (8, 9), generator=torch.Generator().manual_seed(0))
    for counts in ranks.run(
        cases.layout_changes_release_threads, hf_dir=tiny_models["LlamaForCausalLM"], layouts=LAYOUTS * 2, tokens=tokens
    ):
        assert counts["peak"] > counts["baseline"].total(), counts  # each layout's groups had threads while it lived
        assert counts["after"] <= counts["baseline"], counts  # by thread name: no gloo loop is left over


def test_a_layout_s_groups_connect_at_their_first_collective(ranks):
    opened = ranks.run(cases.sockets_opened_by_a_layout, layout=dict(tp=2, pp=2))
    assert all(rank["total"] == 2 for rank in opened), opened  # the tensor-parallel group's sum
    # groups the build does not use stay unconnected: a lazy build opens about half the sockets of an eager one (a
    # listener per group against a listener and a connection per peer), on every rank but at most one, whose eager
    # window once (CI, a loaded host, the session's pool after many cases) saw no more than its lazy one while its
    # three peers saw twice as many (each rank counts in its own windows, which need not line up with its peers')
    lazier = [rank["lazy"] < rank["eager"] for rank in opened]
    assert sum(lazier) >= len(opened) - 1, opened
    # ... and the tensor-parallel groups (two pairs) connect at their all-reduce: a new socket for each pair, on one
    # of its ends at least (counted per rank, 4 ranks, the lazy pair's other end was seen opening none then)
    assert sum(rank["collective"] for rank in opened) >= 2, opened


def test_a_case_that_fails_on_one_rank_leaves_the_same_ranks_in_a_fresh_default_group(ranks):
    """The pool's own recovery: every rank answered, so they join a new default group under a new prefix of the
    pool's store (no restart; a rendezvous key of the old group cannot meet the new one's)."""
    pids = [p.pid for p in ranks.procs]
    with pytest.raises(RuntimeError, match="rank 1 fails on purpose"):
        ranks.run(cases.fails_on_rank, rank=1)
    assert ranks.run(cases.default_group_sum) == [float(ranks.world_size)] * ranks.world_size
    assert [p.pid for p in ranks.procs] == pids
