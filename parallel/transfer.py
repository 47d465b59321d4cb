"""The weight-transfer group: a trainer rank and the rollout engines' workers on other devices, possibly other nodes.

Neither side can join the other's torch.distributed world (each has its own: Megatron's ranks, vLLM's workers),
so the group is built directly on a TCP store that the trainer rank hosts, outside both worlds: NCCL between GPUs,
gloo between CPU processes (:attr:`parallel.device.Device.dist_backend` decides). Rank 0 is the trainer, which
broadcasts each bucket once to every worker of every engine. Nothing here imports Megatron or vLLM: both sides
use it. (:func:`free_addresses` also gives the roles' own worlds their rendezvous.)
"""

from __future__ import annotations

import contextlib
import random
import socket
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from compat import environment
from parallel.device import Device

SOURCE = 0  # the trainer's rank in the group
# torch's switch (2.13, read each time a gloo group is built): "1" makes a gloo group connect to its peers at its
# first collective instead of in its constructor (:func:`parallel.groups.gloo_connects_on_first_use`).
LAZY_GLOO = ("TORCH_GLOO_LAZY_INIT", "1")


# Rendezvous ports come from below the kernel's ephemeral range: between the choice and the master's bind (after
# its actor has started) no process is handed one by accident, as gloo's and vLLM's own connections are handed
# ephemeral ports (a run with five roles lost its teacher's port to one).
RENDEZVOUS_PORTS = (20000, 32768)


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return RENDEZVOUS_PORTS[1]


def free_addresses(count: int, loopback: bool) -> list[tuple[str, int]]:
    """This node's IP (``loopback``: 127.0.0.1, for a single-node cluster) with ``count`` distinct free TCP ports
    below the ephemeral range (:data:`RENDEZVOUS_PORTS`): the rendezvous of roles' torch.distributed worlds (on
    their rank 0's node). Chosen while all are held, so roles that start side by side cannot share one."""
    host = "127.0.0.1" if loopback else socket.gethostbyname(socket.gethostname())
    low, high = RENDEZVOUS_PORTS[0], min(RENDEZVOUS_PORTS[1], _ephemeral_start())
    candidates = random.Random().sample(range(low, high), high - low) if high > low else []
    with contextlib.ExitStack() as held:
        ports = []
        for port in candidates:
            if len(ports) == count:
                break
            s = held.enter_context(socket.socket())
            try:
                s.bind((host, port))
            except OSError:  # in use
                continue
            ports.append(port)
        for _ in range(count - len(ports)):  # no range below the ephemeral one: the kernel's choice
            s = held.enter_context(socket.socket())
            s.bind((host, 0))
            ports.append(s.getsockname()[1])
    return [(host, port) for port in ports]


def tcp_store(address: tuple[str, int], world: int, is_master: bool, timeout: timedelta) -> dist.TCPStore:
    """A rendezvous store whose master listens on ``address``'s host alone (torch's own listens on every
    interface, even when given 127.0.0.1): a single-node run's stores are not reachable from the network. A master
    given port 0 listens on the kernel's choice (``store.port``), held from the bind on: no other process can take
    it before the workers connect."""
    if not is_master:
        return dist.TCPStore(address[0], address[1], world, False, timeout, wait_for_workers=False)
    listener = socket.create_server(address, backlog=max(world, 128))
    port = listener.getsockname()[1]
    return dist.TCPStore(
        address[0], port, world, True, timeout, wait_for_workers=False, master_listen_fd=listener.detach()
    )


class TransferGroup:
    """Rank ``rank`` of ``world`` in the group whose store listens at ``address`` (hosted by rank 0).

    Collective: every member constructs its own at the same time (the constructor connects to all the others).
    """

    def __init__(self, address: tuple[str, int], rank: int, world: int, device: torch.device, timeout_s: int = 1800):
        if not 0 <= rank < world:
            raise ValueError(f"transfer group rank {rank} outside a world of {world}")
        timeout = timedelta(seconds=timeout_s)
        self.device, self.rank, self.world = device, rank, world
        self.store = tcp_store(address, world, rank == SOURCE, timeout)
        store = dist.PrefixStore("mcore_rl_transfer", self.store)
        if Device(device.type).dist_backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(store, rank, world, options)
        else:
            with connecting_now():
                self.group = dist.ProcessGroupGloo(store, rank, world, timeout)
        self._buffer: torch.Tensor | None = None  # receivers: one buffer, grown to the largest bucket

    def send(self, buffer: torch.Tensor) -> None:
        """Rank 0: broadcast a packed bucket (a flat uint8 tensor on this rank's device) to every other member."""
        self._broadcast(buffer)

    def receive(self, nbytes: int) -> torch.Tensor:
        """Other ranks: the next bucket of ``nbytes`` bytes, in a buffer that the next ``receive`` overwrites."""
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        buffer = self._buffer[:nbytes]
        self._broadcast(buffer)
        return buffer

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = SOURCE
        self.group.broadcast([tensor], options).wait()

    def close(self) -> None:
        self._buffer = None
        self.group.shutdown()
        self.group = self.store = None


@contextlib.contextmanager
def connecting_now():
    """Gloo groups built in the block connect in their constructor, whatever this process otherwise chose (the
    weight-transfer group: its engines' side builds its member eagerly, and a lazy member would leave it waiting in
    its constructor)."""
    with environment({LAZY_GLOO[0]: "0"}):
        yield
