"""Starting a local Ray cluster survives Ray's start-up timeout once (ray-project/ray#65983), and nothing else."""

import pytest
import ray

from mcore_rl.roles import cluster

TIMEOUT = "The current node timed out during startup. This could happen because some of the raylet failed"


def _init_failing(errors: list[Exception], calls: list[dict]):
    def init(**kwargs):
        calls.append(kwargs)
        if errors:
            raise errors.pop(0)

    return init


def test_a_start_up_timeout_is_retried_once(monkeypatch):
    calls = []
    monkeypatch.setattr(ray, "init", _init_failing([Exception(TIMEOUT)], calls))
    cluster.start_local_ray(num_cpus=2)
    assert calls == [{"num_cpus": 2}, {"num_cpus": 2}]


def test_a_second_timeout_and_other_errors_are_raised(monkeypatch):
    calls = []
    monkeypatch.setattr(ray, "init", _init_failing([Exception(TIMEOUT)] * cluster.START_ATTEMPTS, calls))
    with pytest.raises(Exception, match="timed out during startup"):
        cluster.start_local_ray()
    assert len(calls) == cluster.START_ATTEMPTS
    calls.clear()
    monkeypatch.setattr(ray, "init", _init_failing([ValueError("bad resources")], calls))
    with pytest.raises(ValueError, match="bad resources"):
        cluster.start_local_ray()
    assert len(calls) == 1
