"""The benchmark suite (``python -m benchmarks``); see README.md."""

import os


def single_process_world() -> None:
    """torch.distributed's environment for the suites that build one Megatron rank in this process (the first
    suite's settings stay for the rest of the run)."""
    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0", WORLD_SIZE="1").items():
        os.environ.setdefault(key, value)
