"""The benchmark suite (``python -m benchmarks``); see README.md."""

import os
import socket


def single_process_world() -> None:
    """torch.distributed's environment for the suites that build one Megatron rank in this process (the first
    suite's settings stay for the rest of the run)."""
    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0", WORLD_SIZE="1").items():
        os.environ.setdefault(key, value)


def free_port() -> int:
    """A loopback port free now, for the rendezvous of the processes a suite spawns."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
