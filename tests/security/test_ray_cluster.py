"""The local Ray cluster a single-node run starts is reachable from this host alone, and only with its token; its
workers run at the starting process's priority, not below it, with the run's variables inherited (no runtime
environment).

Ray 2.60's services listen on every interface unless the node's address is loopback (see compat/ray.py). This
starts the cluster the way the driver does, with Ray's authentication mode unset as a user's shell has it, runs a
task and an actor (from a process started at niceness 3), and checks their niceness and every socket that the driver and the processes under it listen on; then calls the
GCS and the raylet with no token, a wrong one and the cluster's own, and connects another process by its address.
The head runs no autoscaler monitor or API server.
"""

import os
import subprocess
import sys

from compat.ray import LOOPBACK_ENV

SCENARIO = r"""
import os
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import psutil
import ray
from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc, node_manager_pb2, node_manager_pb2_grpc

from compat.ray import LOOPBACK_ENV, start_local_cluster

start_local_cluster(num_cpus=2, runtime_env={"env_vars": {"MCORE_RL_TEST_RUN": "mine"}})
assert not {*LOOPBACK_ENV, "MCORE_RL_TEST_RUN"} & set(os.environ)  # set while the raylet started, then restored


@ray.remote
class Actor:
    def env(self):
        return {name: os.environ.get(name) for name in LOOPBACK_ENV}, os.nice(0)

    def run_env(self):
        return os.environ.get("MCORE_RL_TEST_RUN"), ray.get_runtime_context().runtime_env


@ray.remote
def env():
    return {name: os.environ.get(name) for name in LOOPBACK_ENV}, os.nice(0)


assert os.nice(0) == 3
actor = Actor.remote()
assert ray.get(actor.env.remote(), timeout=300) == ray.get(env.remote(), timeout=300) == (LOOPBACK_ENV, 3)
# inherited from the raylet: the job has no runtime environment, whose workers start through setup_worker.py
assert ray.get(actor.run_env.remote(), timeout=300) == ("mine", {})

processes = [psutil.Process(), *psutil.Process().children(recursive=True)]
names = {p.name() for p in processes}
assert {"gcs_server", "raylet"} <= names, names
# a head without the autoscaler monitor and the API server, which a local cluster of one run has no use for
head_services = ("autoscaler/_private/monitor.py", "dashboard/dashboard.py")
assert not [p.cmdline() for p in processes if any(arg.endswith(head_services) for arg in p.cmdline())]
listening = []
for process in processes:
    for conn in process.net_connections(kind="inet"):
        if conn.status == psutil.CONN_LISTEN or (conn.type == socket.SOCK_DGRAM and not conn.raddr):
            listening.append((process.name(), conn.laddr.ip, conn.laddr.port))
assert len(listening) >= 4, listening  # GCS, raylet, driver, actor at least
outside = [sock for sock in listening if sock[1] not in ("127.0.0.1", "::ffff:127.0.0.1", "::1")]
assert not outside, f"listening beyond loopback: {outside}"

token = (Path.home() / ".ray" / "auth_token").read_text().strip()
assert len(token) >= 32, token


def code(call, request, token=None):
    metadata = [("authorization", f"Bearer {token}")] if token else None
    try:
        return call(request, metadata=metadata, timeout=60)
    except grpc.RpcError as err:
        return err.code()


gcs = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(grpc.insecure_channel(ray.get_runtime_context().gcs_address))
nodes = gcs_service_pb2.GetAllNodeInfoRequest()
assert code(gcs.GetAllNodeInfo, nodes) == grpc.StatusCode.UNAUTHENTICATED
assert code(gcs.GetAllNodeInfo, nodes, "0" * len(token)) == grpc.StatusCode.UNAUTHENTICATED
(node,) = code(gcs.GetAllNodeInfo, nodes, token).node_info_list
assert node.node_manager_address == "127.0.0.1", node.node_manager_address

raylet = node_manager_pb2_grpc.NodeManagerServiceStub(grpc.insecure_channel(f"127.0.0.1:{node.node_manager_port}"))
stats = node_manager_pb2.GetNodeStatsRequest()
assert code(raylet.GetNodeStats, stats) == grpc.StatusCode.UNAUTHENTICATED
assert not isinstance(code(raylet.GetNodeStats, stats, token), grpc.StatusCode)

# A process this one starts (a driver given the address) connects by the loopback address, with the token.
address = ray.get_runtime_context().gcs_address
connect = f"import ray; ray.init(address={address!r}); print(len(ray.nodes()))"
client = subprocess.run([sys.executable, "-c", connect], capture_output=True, text=True, timeout=300)
assert client.stdout.strip() == "1", client.stderr[-2000:]
ray.shutdown()
print(f"{len(listening)} listening sockets on loopback; calls refused without the token")
"""


def test_the_local_cluster_listens_on_loopback_and_refuses_calls_without_its_token(tmp_path):
    unset = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", *LOOPBACK_ENV)
    env = {name: value for name, value in os.environ.items() if name not in unset}
    env["HOME"] = str(tmp_path)  # a user without a token yet: the start creates one
    done = subprocess.run(
        [sys.executable, "-c", SCENARIO],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        preexec_fn=lambda: os.nice(3 - os.nice(0)),
    )
    assert done.returncode == 0 and "refused without the token" in done.stdout, done.stderr[-4000:]
    print(done.stdout)
