"""Starting a local Ray cluster survives Ray's start-up timeout once (ray-project/ray#65983), and nothing else; a Ray
whose node address no longer follows its single-machine mode is refused before a cluster starts off loopback; the
cluster keeps no idle workers and lists its log directory less often."""

import os

import pytest
import ray

import compat
from compat import ray as compat_ray

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
    compat_ray.init_retrying(num_cpus=2)
    assert calls == [{"num_cpus": 2}, {"num_cpus": 2}]


def test_a_second_timeout_and_other_errors_are_raised(monkeypatch):
    calls = []
    monkeypatch.setattr(ray, "init", _init_failing([Exception(TIMEOUT)] * compat_ray.START_ATTEMPTS, calls))
    with pytest.raises(Exception, match="timed out during startup"):
        compat_ray.init_retrying()
    assert len(calls) == compat_ray.START_ATTEMPTS
    calls.clear()
    monkeypatch.setattr(ray, "init", _init_failing([ValueError("bad resources")], calls))
    with pytest.raises(ValueError, match="bad resources"):
        compat_ray.init_retrying()
    assert len(calls) == 1


def test_a_ray_whose_node_address_ignores_single_machine_mode_is_refused(monkeypatch):
    from ray._private import services

    monkeypatch.setattr(services, "get_node_ip_address", lambda address=None: "192.0.2.2")
    monkeypatch.setattr(ray, "init", lambda **kwargs: pytest.fail("started a cluster that would not be on loopback"))
    with pytest.raises(compat.UpstreamChangedError, match="ENABLE_RAY_CLUSTER"):
        compat_ray.start_local_cluster(num_cpus=1)


def test_a_local_cluster_keeps_no_idle_workers_and_its_log_monitor_lists_less_often(monkeypatch):
    """The settings of compat/ray.py's "Idle cost": a Ray system config key (the GCS of a Ray that does not know it
    fails to start, which every run would show) and the log monitor's variable, read from its source here."""
    import inspect

    from ray._private import log_monitor

    name, value = compat_ray.LOG_MONITOR_LISTING
    assert f'os.getenv("{name}"' in inspect.getsource(log_monitor)
    calls = []
    monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(ray, "init", _init_failing([], calls))
    monkeypatch.setattr(ray, "get_runtime_context", lambda: type("Context", (), {"gcs_address": "127.0.0.1:1"}))
    compat_ray.start_local_cluster(num_cpus=1, _system_config={"object_spilling_threshold": 0.9})
    (call,) = calls
    assert call["_system_config"] == {"num_workers_soft_limit": 0, "object_spilling_threshold": 0.9}
    assert call["num_cpus"] == 1 and os.environ[name] == value
