"""The pure parts of asynchronous rollout: data progress with out-of-order consumption, the staleness-bounded
buffer, and the staleness statistics."""

from __future__ import annotations

import threading

import pytest

from mcore_rl.batch import Sample, staleness_stats
from mcore_rl.data.progress import DataProgress
from mcore_rl.rollout.engine import Completion
from mcore_rl.rollout.producer import Group, SampleBuffer, partition_stale


def _group(position: int, versions: list[list[int]], rewards: list[float] | None = None) -> Group:
    samples = [Sample(f"p{position}/{k}", None, Completion([1] * len(v), [0.0] * len(v), "stop", v), "") for k, v in
               enumerate(versions)]  # fmt: skip
    return Group(position, samples, rewards or [float(k) for k in range(len(versions))])


def test_progress_hands_out_unconsumed_positions_in_order_across_a_resume():
    progress = DataProgress()
    assert progress.issue(4) == [0, 1, 2, 3] and progress.issue(2) == [4, 5]
    progress.consume([0, 2, 5])  # groups finish out of order
    assert progress.meta() == {"data_position": 1, "data_consumed_after": [2, 5]}
    resumed = DataProgress.from_meta(progress.meta())  # what was in flight is handed out again, in order
    assert resumed.issue(4) == [1, 3, 4, 6]
    resumed.consume([1, 3, 4])
    assert resumed.meta() == {"data_position": 6, "data_consumed_after": []}


def test_a_group_is_as_old_as_its_oldest_token_and_stale_groups_are_dropped():
    groups = [_group(0, [[3, 3], [2, 3]]), _group(1, [[3], [3]]), _group(2, [[1, 3], [3]])]
    assert [g.version for g in groups] == [2, 3, 1]
    fresh, stale = partition_stale(groups, version=3, max_staleness=1)
    assert [g.position for g in fresh] == [0, 1] and [g.position for g in stale] == [2]


def test_the_buffer_waits_for_enough_fresh_groups_and_counts_the_dropped():
    buffer = SampleBuffer(max_staleness=1, group_size=2, dynamic_sampling=False, refill_rounds=3)
    buffer.put(_group(0, [[0], [0]]))
    buffer.put(_group(1, [[1], [1]]))
    taken = {}
    thread = threading.Thread(
        target=lambda: taken.update(zip(("taken", "stale", "spares"), buffer.take(2, version=2), strict=True))
    )
    thread.start()
    thread.join(0.2)
    assert thread.is_alive()  # group 0 is two versions old: one fresh group is not enough
    buffer.put(_group(2, [[2], [1, 2]]))
    thread.join(5)
    assert [g.position for g in taken["taken"]] == [1, 2] and [g.position for g in taken["stale"]] == [0]
    assert taken["spares"] == []
    assert len(buffer) == 0


def test_dynamic_sampling_sets_constant_groups_apart_until_refill_rounds_of_them_arrived():
    buffer = SampleBuffer(max_staleness=1, group_size=2, dynamic_sampling=True, refill_rounds=2)
    buffer.put(_group(0, [[0], [0]]))  # rewards 0, 1: a learning signal
    for position in range(1, 5):
        buffer.put(_group(position, [[0], [0]], rewards=[1.0, 1.0]))
    assert len(buffer) == 1  # the spares do not count as waiting groups (the producer keeps generating)
    taken, stale, spares = buffer.take(2, version=0)  # 4 constant groups = 2 rounds x 2: one fills, the rest drop
    assert [g.position for g in taken] == [0, 1] and [g.position for g in spares] == [2, 3, 4] and stale == []


def test_a_producer_failure_reaches_the_trainer():
    buffer = SampleBuffer(max_staleness=1, group_size=2, dynamic_sampling=False, refill_rounds=3)
    buffer.fail(ValueError("reward failed"))
    with pytest.raises(ValueError, match="reward failed"):
        buffer.take(1, version=0)


def test_staleness_stats_count_each_lag():
    samples = [g for p, v in enumerate([[[4]], [[3, 4]], [[4]], [[2]]]) for g in _group(p, v).samples]
    stats = staleness_stats(samples, version=4)
    assert stats == {
        "staleness/mean": 0.75,
        "staleness/max": 2.0,
        "staleness/lag_0_fraction": 0.5,
        "staleness/lag_1_fraction": 0.25,
        "staleness/lag_2_fraction": 0.25,
    }
