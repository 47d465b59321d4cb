"""Ray 2.60's quirks, for the local cluster a single-node run starts (:func:`start_local_cluster`).

**Loopback.** Ray's services (GCS, raylet, core workers, agents) listen on every interface unless the node's
address is exactly 127.0.0.1 (their gRPC servers' ``listen_to_localhost_only``); binding them to the node's
address instead (ray-project/ray#59852) was reverted (#60012). ``ray.init`` never passes 127.0.0.1: it replaces a
loopback ``_node_ip_address`` by the routable one, except where ``ray_constants.ENABLE_RAY_CLUSTER`` is false
(Ray's single-machine mode for macOS and Windows, whose node address is loopback). The local cluster is started
with that flag off, then checked to be on loopback. A process that connects to it (a test's ranks, a driver given
its address) must be in that mode too, or ``ray.init`` swaps the loopback address for the routable one and waits
for a GCS that is not there: the mode's variable is set for the processes this one starts. Its actors get the
interface of their own collectives too: gloo and NCCL pick the host name's or the first non-loopback interface
unless told, and vLLM its routable address.

**Start-up.** The raylet exits when its dashboard agent takes longer than a fixed 15 s to start
(ray-project/ray#65983), which a loaded 2-core machine occasionally does (measured: a CI run's agents took 11-38 s
to start): the start is tried once more.

**Priority.** Ray starts its workers 15 steps of niceness below the raylet and GCS (``RAY_worker_niceness``, an
increment), for nodes that many tasks saturate. In the local cluster of one run the workers *are* the run, and the
driver waits on them: 15 steps down, any other busy process of the host starves them (measured on 2 cores beside two
busy processes: each worker got a few percent of a core and the tests ran 7-10x slower). Its workers start at the
raylet's niceness, which is the starting process's own, unless that process's environment sets
``RAY_worker_niceness``. A cluster the run joins keeps its own setting.

**Log monitor.** It lists the log directory every 0.1 s while it holds fewer than
``RAY_LOG_MONITOR_MANY_FILES_THRESHOLD`` files (1000), else every 0.5 s: the threshold is 0 (a new actor's output
reaches the driver's console up to 0.5 s later). Measured on an idle cluster of this 2-core machine: its CPU 0.64 ->
0.32 s a minute; it lists more files the more actors a run has started (one CI run's busiest monitor: 61 s of CPU).

**Prestarted workers.** The raylet starts a worker per CPU it counts when the first driver registers
(``prestart_worker_first_driver``), for tasks to come. A run's roles are actors of their own resources, and in the
main job one of the two workers it prestarts idles to the end while the roles start beside it: the local cluster
starts none (``RAY_prestart_worker_first_driver=0``, which the raylet reads as it reads each of its settings,
``RAY_<name>``). Measured, the main job's command from launch to its first sync, alternating 5 times on 2 cores:
median 29.3 -> 25.8 s, faster in every pair.

**Actors' environment.** The raylet starts each worker of a job that has a runtime environment through
``setup_worker.py``, a Python process that applies the environment and then execs the worker, and a worker of a job
without one directly (it strips that script, a name its binary holds, from the command). The variables the actors
need (their collectives' interface, their priority, the run's own) reach them by inheritance instead: they are in
this process's environment while the cluster starts, so the raylet and the workers it starts have them, and the job
has no runtime environment. Measured on 2 cores: three actors ready in 2.95 s with the variables as the job's
``env_vars``, 1.49 s inherited; the main job's command from launch to its first sync, alternating 4 times: median
21.1 -> 20.2 s.

**Head services.** A head node starts, beside its GCS, an autoscaler monitor (``monitor.py``) and an API server
(``dashboard.py``; without the dashboard it loads the usage-stats module alone), two Python processes that a local
cluster of one run has no use for: it never scales, reports no usage stats (no network), and reads its actors from
the GCS (see "Actors' processes"). Ray has no option for them in ``ray.init`` (``ray start`` has ``--no-monitor``):
the local cluster starts with ``Node.start_monitor`` and ``Node.start_api_server``, which only
``Node.start_head_processes`` calls, doing nothing. Measured on 2 cores, the cluster started and an actor ready,
alternating 3 times: 2.70-4.10 -> 2.11-3.24 s, Ray's processes 2.5-3.2 -> 1.7-1.9 CPU-s.

**Actors' processes.** The hang watchdog needs each actor's pid and node, which Ray's public API gives only
through the state API of the dashboard (off in mcore-rl's clusters); :func:`job_actors` reads the GCS actor table
that ``ray._private.state.actors`` returns (ray 2.60: keys ``Name``, ``Pid``, ``Address.NodeID``,
``ActorClassName``, checked).

**Object store traffic.** What a run puts into the object store per episode (:func:`object_store_created_bytes`)
is a raylet counter, ``cumulative_created_bytes`` of each node's store stats, reached only through
``ray._private.internal_api.node_stats`` (ray 2.60, checked).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import os

from compat import RAY, UpstreamChangedError, environment

log = logging.getLogger(__name__)

START_ATTEMPTS = 2
LOOPBACK = "127.0.0.1"
TOKEN_NOTICE_LOGGER = "ray._private.authentication.authentication_token_setup"
SINGLE_MACHINE = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # read by ray_constants at import
# The interface of the actors' own rendezvous and collectives in a local cluster.
LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo", "VLLM_HOST_IP": LOOPBACK}
LOG_MONITOR_LISTING = ("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")  # see "Log monitor"
NO_PRESTART = ("RAY_prestart_worker_first_driver", "0")  # see "Prestarted workers"


@contextlib.contextmanager
def _loopback_node():
    """Ray's single-machine mode while a local cluster starts: its node address is loopback."""
    from ray._private import ray_constants, services

    source = inspect.getsource(services.get_node_ip_address)
    if not hasattr(ray_constants, "ENABLE_RAY_CLUSTER") or "ENABLE_RAY_CLUSTER" not in source:
        raise UpstreamChangedError(
            f"ray {RAY}x's services.get_node_ip_address consulted ray_constants.ENABLE_RAY_CLUSTER; this Ray does "
            "not: re-read it and update the loopback start in compat/ray.py"
        )
    enabled, ray_constants.ENABLE_RAY_CLUSTER = ray_constants.ENABLE_RAY_CLUSTER, False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = enabled


@contextlib.contextmanager
def _bare_head():
    """A head node without its autoscaler monitor and API server while a local cluster starts (see "Head
    services")."""
    from ray._private.node import Node

    starts = inspect.getsource(Node.start_head_processes)
    if "self.start_monitor()" not in starts or "self.start_api_server(" not in starts:
        raise UpstreamChangedError(
            f"ray {RAY}x's Node.start_head_processes started the autoscaler monitor and the API server; this Ray's "
            "does not: re-read it and update the head services of the local cluster in compat/ray.py"
        )
    monitor, api_server = Node.start_monitor, Node.start_api_server
    Node.start_monitor = Node.start_api_server = lambda self, **kwargs: None
    try:
        yield
    finally:
        Node.start_monitor, Node.start_api_server = monitor, api_server


def start_local_cluster(**init_kwargs) -> None:
    """``ray.init`` of a new local cluster on loopback alone, its actors' collectives too unless this process's
    environment names their interfaces, its workers at this process's priority, with the variables of
    ``runtime_env["env_vars"]`` in their environment, its head without the services it has no use for (see above).

    Ray turns on token authentication for it unless ``RAY_AUTH_MODE`` says otherwise; a cluster without a token
    is open to every process of this host, and that is said. Ray 2.60's notices that it started and that it turned
    token authentication on (what mcore-rl wants) are not printed.
    """
    import ray
    from ray._private.ray_constants import RAY_WORKER_NICENESS

    init_kwargs.setdefault("logging_level", logging.WARNING)
    logging.getLogger(TOKEN_NOTICE_LOGGER).setLevel(logging.ERROR)

    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        log.warning(
            "RAY_AUTH_MODE=disabled: the local Ray cluster accepts calls without a token from any process on this host"
        )
    os.environ.setdefault(*LOG_MONITOR_LISTING)  # read by the log monitor this process starts
    os.environ.setdefault(*NO_PRESTART)  # read by the raylet this process starts
    runtime_env = dict(init_kwargs.pop("runtime_env", None) or {})
    defaults = {**LOOPBACK_ENV, RAY_WORKER_NICENESS: "0"}
    unset = {name: value for name, value in defaults.items() if name not in os.environ}
    inherited = {**unset, **runtime_env.pop("env_vars", {})}  # see "Actors' environment"
    os.environ.update(SINGLE_MACHINE)  # for the processes this one starts, which connect by the loopback address
    with _loopback_node(), _bare_head(), environment(inherited):
        init_retrying(runtime_env=runtime_env or None, **init_kwargs)
    address = ray.get_runtime_context().gcs_address
    if not address.startswith(f"{LOOPBACK}:"):
        ray.shutdown()
        raise UpstreamChangedError(
            f"the local Ray cluster started at {address}, not on {LOOPBACK}: re-read ray {RAY}x's node address "
            "and update the loopback start in compat/ray.py"
        )


def init_retrying(**init_kwargs) -> None:
    """``ray.init``, once more if Ray's own start-up timed out (see above)."""
    import ray

    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            ray.init(**init_kwargs)
            return
        except Exception as err:  # Ray raises a bare Exception for this
            if attempt == START_ATTEMPTS or "timed out during startup" not in str(err):
                raise
            log.warning(
                "starting the local Ray cluster timed out (attempt %d of %d); retrying", attempt, START_ATTEMPTS
            )


@dataclasses.dataclass
class JobActor:
    name: str  # the actor's name; unnamed ones: class name and the start of their id
    pid: int
    node_id: str
    handle: object | None  # named actors' (a handle to call them through); None for unnamed ones


def job_actors() -> list[JobActor]:
    """The live actors of this driver's job, in creation order (see above)."""
    import ray
    from ray._private import state

    job = ray.JobID.from_hex(ray.get_runtime_context().get_job_id())
    table = state.actors(job_id=job, actor_state_name="ALIVE")
    actors = []
    for actor_id, info in table.items():
        if missing := {"Name", "Pid", "Address", "ActorClassName", "StartTime"} - set(info):
            raise UpstreamChangedError(
                f"ray {RAY}x's actor table had {sorted(missing)}; this Ray's has not: re-read "
                "ray._private.state.actors and update job_actors in compat/ray.py"
            )
        name = info["Name"] or f"{info['ActorClassName']}-{actor_id[:8]}"
        handle = None
        if info["Name"]:
            with contextlib.suppress(ValueError):  # it ended since the table was read
                handle = ray.get_actor(info["Name"])
        actors.append((info["StartTime"], JobActor(name, info["Pid"], info["Address"]["NodeID"], handle)))
    return [actor for _, actor in sorted(actors, key=lambda item: item[0])]


def object_store_created_bytes() -> int:
    """Bytes created in the object stores of the cluster's live nodes since they started (see above)."""
    import ray
    from ray._private import internal_api

    total = 0
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        stats = internal_api.node_stats(node["NodeManagerAddress"], node["NodeManagerPort"], False).store_stats
        if not hasattr(stats, "cumulative_created_bytes"):
            raise UpstreamChangedError(
                f"ray {RAY}x's object store stats counted cumulative_created_bytes; this Ray's do not: update "
                "object_store_created_bytes in compat/ray.py"
            )
        total += stats.cumulative_created_bytes
    return total
