"""Rendezvous stores of a single-node run listen on loopback alone (torch's own TCPStore listens on every
interface even when given 127.0.0.1)."""

from __future__ import annotations

from datetime import timedelta

from parallel.transfer import free_addresses, tcp_store


def _listeners(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp* write them) listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    found.append(local.rsplit(":", 1)[0])
    return found


def test_a_loopback_store_listens_on_loopback_alone():
    ((host, port),) = free_addresses(1, loopback=True)
    assert host == "127.0.0.1"
    master = tcp_store((host, port), 2, True, timedelta(seconds=60))
    worker = tcp_store((host, port), 2, False, timedelta(seconds=60))
    worker.set("key", "value")
    assert master.get("key") == b"value"
    assert _listeners(port) == ["0100007F"]  # 127.0.0.1, and nothing on 0.0.0.0 or ::


def test_a_master_on_port_0_listens_on_the_kernels_choice_from_its_bind():
    """The test pool's store: the port is held from the choice on, so ranks that take seconds to start cannot find
    it taken (a CI run lost one to another connection between the choice and the master's bind)."""
    master = tcp_store(("127.0.0.1", 0), 2, True, timedelta(seconds=60))
    assert master.port > 0 and _listeners(master.port) == ["0100007F"]
    worker = tcp_store(("127.0.0.1", master.port), 2, False, timedelta(seconds=60))
    worker.set("key", "value")
    assert master.get("key") == b"value"


def test_rendezvous_ports_lie_below_the_ephemeral_range():
    """Between the choice of a rendezvous port and its master's bind, other processes' connections (gloo's, vLLM's)
    are handed ephemeral ports: a port from below that range cannot be taken by one of them. Distinct, and free."""
    import socket

    from parallel.transfer import RENDEZVOUS_PORTS, _ephemeral_start

    addresses = free_addresses(8, loopback=True)
    ports = [port for _, port in addresses]
    assert len(set(ports)) == 8
    assert all(RENDEZVOUS_PORTS[0] <= port < min(RENDEZVOUS_PORTS[1], _ephemeral_start()) for port in ports)
    for host, port in addresses:
        with socket.socket() as s:
            s.bind((host, port))
