"""Checkpoint directories are committed atomically; resume finds the newest complete one."""

from __future__ import annotations

import pytest

from mcore_rl.checkpoint import commit, complete, latest_complete, partial_dir, prune, read_meta


def test_commit_and_latest_complete(tmp_path):
    assert latest_complete(tmp_path / "none") is None
    for episode in (2, 4):
        (partial_dir(tmp_path, episode) / "weights.bin").write_bytes(b"x" * episode)
        commit(tmp_path, episode, {"data_position": 10 * episode})
    # a crash while saving episode 6: its partial directory must not count
    (partial_dir(tmp_path, 6) / "weights.bin").write_bytes(b"half")
    episode, path = latest_complete(tmp_path)
    assert episode == 4 and (path / "weights.bin").read_bytes() == b"xxxx"
    assert read_meta(path)["data_position"] == 40
    # the next attempt at episode 6 starts from an empty partial directory
    assert list(partial_dir(tmp_path, 6).iterdir()) == []


def test_an_existing_checkpoint_is_never_overwritten(tmp_path):
    partial_dir(tmp_path, 1)
    commit(tmp_path, 1, {})
    with pytest.raises(FileExistsError, match="a checkpoint of episode 1 exists already"):
        partial_dir(tmp_path, 1)
    assert latest_complete(tmp_path)[0] == 1


def test_prune_keeps_the_newest(tmp_path):
    for episode in (1, 2, 3):
        partial_dir(tmp_path, episode)
        commit(tmp_path, episode, {})
    partial_dir(tmp_path, 4)  # an unfinished save is not a checkpoint: neither kept nor counted
    assert prune(tmp_path, keep=0) == []
    assert [p.name for p in prune(tmp_path, keep=2)] == ["episode_1"]
    assert [e for e, _ in complete(tmp_path)] == [2, 3]


def test_the_marker_lists_what_it_covers_and_is_checked(tmp_path, caplog):
    for episode in (1, 2, 3):
        part = partial_dir(tmp_path, episode)
        (part / "policy").mkdir()
        (part / "policy" / "shard.distcp").write_bytes(b"w" * 100)
        (part / "rng_rank0.pt").write_bytes(b"r" * 10)
        commit(tmp_path, episode, {})
    assert read_meta(tmp_path / "episode_3")["files"] == {"policy/shard.distcp": 100, "rng_rank0.pt": 10}
    (tmp_path / "episode_3" / "policy" / "shard.distcp").write_bytes(b"w" * 50)  # truncated after the commit
    (tmp_path / "episode_2" / "rng_rank0.pt").unlink()
    assert [e for e, _ in complete(tmp_path)] == [1]
    assert "episode_3 is not complete: policy/shard.distcp is 50 bytes, the marker says 100" in caplog.text
    assert "rng_rank0.pt is missing" in caplog.text
    caplog.clear()  # the preflight's look and each save's prune leave the report to the resume's, once a run
    assert [e for e, _ in complete(tmp_path, report=False)] == [1] and prune(tmp_path, keep=1) == []
    assert caplog.text == ""
    (tmp_path / "episode_1" / "COMPLETE").write_text("{not json")
    assert complete(tmp_path) == []
