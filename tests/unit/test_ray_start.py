"""Starting a local Ray cluster survives Ray's start-up timeout once (ray-project/ray#65983), and nothing else; a Ray
whose node address no longer follows its single-machine mode is refused before a cluster starts off loopback; its
log monitor lists the log directory less often, and its raylet prestarts no worker."""

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


def test_a_local_cluster_lists_its_logs_less_often_and_prestarts_no_worker(monkeypatch):
    """compat/ray.py's "Log monitor", "Prestarted workers" and "Actors' environment": the variables are the ones
    Ray's log monitor reads (from its source) and the raylet reads (a setting its binary names), and the start sets
    them for the processes it starts; the actors' variables are in the environment while the cluster starts, not in
    a runtime environment (the raylet names setup_worker.py, which it runs only for those)."""
    import inspect
    from pathlib import Path

    from ray._private import log_monitor

    listing, prestart = compat_ray.LOG_MONITOR_LISTING, compat_ray.NO_PRESTART
    assert f'os.getenv("{listing[0]}"' in inspect.getsource(log_monitor)
    raylet = Path(ray.__file__).parent / "core/src/ray/raylet/raylet"
    assert prestart[0].encode() in raylet.read_bytes() and b"setup_worker.py" in raylet.read_bytes()
    calls, environments = [], []
    for name, _ in (listing, prestart):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("MCORE_RL_TEST_RUN", raising=False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: (calls.append(kwargs), environments.append(dict(os.environ))))
    monkeypatch.setattr(ray, "get_runtime_context", lambda: type("Context", (), {"gcs_address": "127.0.0.1:1"}))
    compat_ray.start_local_cluster(num_cpus=1, runtime_env={"env_vars": {"MCORE_RL_TEST_RUN": "mine"}})
    assert [(call["num_cpus"], call["runtime_env"]) for call in calls] == [(1, None)]
    assert environments[0]["MCORE_RL_TEST_RUN"] == "mine" and "MCORE_RL_TEST_RUN" not in os.environ
    assert [os.environ[name] for name, _ in (listing, prestart)] == [listing[1], prestart[1]]


def test_a_local_cluster_s_head_starts_no_monitor_or_api_server_and_a_changed_head_is_refused(monkeypatch):
    """compat/ray.py's "Head services": while the cluster starts, the head's calls that start the autoscaler
    monitor and the API server do nothing, and are Ray's own again after; a head whose start no longer makes those
    calls is refused before a cluster starts."""
    from ray._private.node import Node

    monitor, api_server, during = Node.start_monitor, Node.start_api_server, []
    monkeypatch.setattr(ray, "get_runtime_context", lambda: type("Context", (), {"gcs_address": "127.0.0.1:1"}))
    monkeypatch.setattr(
        ray, "init", lambda **kwargs: during.append((Node.start_monitor(None), Node.start_api_server(None, x=1)))
    )
    compat_ray.start_local_cluster(num_cpus=1)
    assert during == [(None, None)]
    assert (Node.start_monitor, Node.start_api_server) == (monitor, api_server)
    monkeypatch.setattr(Node, "start_head_processes", lambda self: self.start_gcs_server())
    monkeypatch.setattr(ray, "init", lambda **kwargs: pytest.fail("started a head that would start other services"))
    with pytest.raises(compat.UpstreamChangedError, match="start_head_processes"):
        compat_ray.start_local_cluster(num_cpus=1)
