"""Moving a bucket of named tensors from trainer processes to rollout engine workers.

Colocated engines take buckets zero-copy: each trainer rank that feeds an engine packs the bucket into a buffer the engine's workers can map (POSIX shared
memory on CPU, a CUDA IPC handle on GPU) and sends only a small picklable :class:`BucketHandle`; an engine with
several workers gets one buffer per worker's device (the trainer rank colocated on it), so no worker maps memory
on another GPU or node. Each worker maps its buffer and hands views to vLLM's weight loader, which copies what
its own shard needs. A sender keeps one buffer and reuses it for every bucket, so the extra memory of a sync is
one bucket, allocated on the first sync only.

Engines on other devices (a disaggregated placement) receive the same packed bucket by a broadcast over the
weight-transfer group (:class:`parallel.transfer.TransferGroup`); the handle then names no buffer (kind
``broadcast``) and each worker receives into a buffer of its own.
"""

from __future__ import annotations

import fcntl
import os
import pickle
import shutil
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from compat.torch import rebuild_cuda_tensor
from parallel.device import Device

ALIGN = 64  # byte alignment of each tensor inside a bucket (vectorised copies, any dtype)
SHM_DIR = Path("/dev/shm")


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str  # torch dtype name without the "torch." prefix: msgpack- and pickle-friendly
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the buffer


@dataclass(frozen=True)
class BufferRef:
    device: str  # UUID of the GPU holding a CUDA buffer; "" for shared memory, which any local process maps
    location: str | bytes  # shm file name, or the pickled CUDA IPC reduction of the buffer


@dataclass(frozen=True)
class BucketHandle:
    """What crosses the process boundary per bucket: the tensors, and the buffers holding them (identical copies,
    one per feeding trainer rank)."""

    kind: str  # "shm", "cuda_ipc" or "broadcast"
    buffers: tuple[BufferRef, ...]
    nbytes: int
    tensors: tuple[TensorMeta, ...]


def device_id(device: torch.device) -> str:
    """What names a GPU across processes whatever devices each one sees: its UUID ("" on CPU)."""
    return str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else ""


def _layout(tensors: Sequence[tuple[str, torch.Tensor]]) -> tuple[list[TensorMeta], int]:
    metas, offset = [], 0
    for name, t in tensors:
        metas.append(TensorMeta(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset))
        offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return metas, offset


def _views(buffer: torch.Tensor, metas: Sequence[TensorMeta]) -> Iterator[tuple[str, torch.Tensor]]:
    for m in metas:
        dtype = getattr(torch, m.dtype)
        n = torch.Size(m.shape).numel() * dtype.itemsize
        yield m.name, buffer[m.offset : m.offset + n].view(dtype).view(m.shape)


class SharedMemoryError(RuntimeError):
    """/dev/shm cannot hold a bucket: said before the bucket is written (a full tmpfs would kill the writer with
    SIGBUS mid-sync instead)."""


def _remove_stale_segments() -> None:
    """Delete shm buckets whose sender died without closing them. A live sender holds a shared lock on its segment
    (released by the kernel when it dies), so one in another container sharing /dev/shm, whose process ids this
    one cannot see, is never taken for dead."""
    for path in SHM_DIR.glob("mcore_rl_*_*"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            path.unlink(missing_ok=True)
        except BlockingIOError:
            pass  # its sender is alive
        finally:
            os.close(fd)


class BucketSender:
    """Trainer side: owns the buffer (grown when a bucket needs more) and packs buckets into it. ``kind``: the
    device's zero-copy transport to a colocated engine (default), or ``broadcast`` (a plain device buffer)."""

    def __init__(self, device: torch.device, reserve_bytes: int = 0, kind: str | None = None):
        self.device = device
        self.machine = Device(device.type)
        self.kind = kind or self.machine.bucket_transport
        if self.kind == "shm":
            _remove_stale_segments()
        self._buffer: torch.Tensor | None = None
        self._ref: BufferRef | None = None
        self._path: Path | None = None
        self._lock: int | None = None  # the shm segment's descriptor, holding its shared lock
        if reserve_bytes:
            self._ensure(reserve_bytes)
            self._buffer.zero_()  # fault the pages in now, so the first sync costs what later ones do

    def _ensure(self, nbytes: int) -> None:
        if self._buffer is not None and self._buffer.numel() >= nbytes:
            return
        self.close()
        if self.kind == "cuda_ipc":
            from torch.multiprocessing.reductions import reduce_tensor

            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._ref = BufferRef(device_id(self.device), pickle.dumps(reduce_tensor(self._buffer)))
        elif self.kind == "broadcast":
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        else:
            free = shutil.disk_usage(SHM_DIR).free
            if free < nbytes:
                raise SharedMemoryError(
                    f"{SHM_DIR} has {free / 2**20:.1f} MiB free and a weight-sync bucket needs {nbytes / 2**20:.1f} "
                    f"MiB: enlarge it (docker run --shm-size=2g, or a larger tmpfs) or lower "
                    f"models.policy.sync.bucket_bytes (a bucket also holds the largest single tensor)"
                )
            self._path = SHM_DIR / f"mcore_rl_{os.getpid()}_{uuid.uuid4().hex[:8]}"
            self._lock = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(self._lock, fcntl.LOCK_SH)
            self._buffer = torch.from_file(str(self._path), shared=True, size=nbytes, dtype=torch.uint8)
            self._ref = BufferRef("", self._path.name)

    def pack(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> BucketHandle:
        """Copy ``tensors`` into the shared buffer; valid until the next ``pack`` or ``close``."""
        metas, nbytes = _layout(tensors)
        self._ensure(nbytes)
        for (_, src), (_, dst) in zip(tensors, _views(self._buffer, metas), strict=True):
            dst.copy_(src)
        if (stream := self.machine.stream(self.device)) is not None:
            stream.synchronize()  # the receiver reads on its own stream
        refs = () if self._ref is None else (self._ref,)
        return BucketHandle(self.kind, refs, nbytes, tuple(metas))

    def packed(self, handle: BucketHandle) -> torch.Tensor:
        """The bytes of the last packed bucket (``handle``'s): what a ``broadcast`` handle's receivers get."""
        return self._buffer[: handle.nbytes]

    @property
    def capacity(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    def close(self) -> None:
        """Free the buffer. Receivers that still map a shm segment keep their pages until they drop them."""
        self._buffer = self._ref = None
        if self._path is not None:
            self._path.unlink(missing_ok=True)
            self._path = None
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None


def buffer_for(handle: BucketHandle, own_device: str, rank: int) -> BufferRef:
    """The copy worker ``rank`` maps: on GPU the one on its own device; in shared memory, its rank's feeder's."""
    if handle.kind != "cuda_ipc":
        return handle.buffers[rank % len(handle.buffers)]
    for ref in handle.buffers:
        if ref.device == own_device:
            return ref
    raise RuntimeError(
        f"no copy of the bucket on this worker's GPU {own_device} (copies on {[r.device for r in handle.buffers]}): "
        "each rollout worker must share its device with a trainer rank that feeds its engine"
    )


def open_bucket(
    handle: BucketHandle, device: torch.device, rank: int = 0, receive: Callable[[int], torch.Tensor] | None = None
) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]:
    """Receiver side (worker ``rank`` of its engine): a sender's buffer, mapped, and views of the bucket's tensors
    in it (no copy). ``receive(nbytes)`` takes a ``broadcast`` bucket from the transfer group."""
    if handle.kind not in ("shm", "cuda_ipc", "broadcast"):
        raise ValueError(f"unknown bucket handle kind {handle.kind!r}; expected 'shm', 'cuda_ipc' or 'broadcast'")
    if handle.kind == "broadcast":
        if receive is None:
            raise RuntimeError("a broadcast bucket, but this worker joined no transfer group")
        buffer = receive(handle.nbytes)
        return buffer, list(_views(buffer, handle.tensors))
    ref = buffer_for(handle, device_id(device), rank)
    if handle.kind == "cuda_ipc":
        # A handle from our own trainer process; rebuilt on this process's ordinal of the same GPU (see buffer_for).
        buffer = rebuild_cuda_tensor(pickle.loads(ref.location), device.index)  # noqa: S301
    else:
        path = SHM_DIR / ref.location
        # torch.from_file would create a missing file and hand back zeros: check first.
        if not path.is_file() or path.stat().st_size < handle.nbytes:
            raise FileNotFoundError(f"{path}: the shared bucket is gone or short (its sender closed or died)")
        buffer = torch.from_file(str(path), shared=True, size=handle.nbytes, dtype=torch.uint8)
    return buffer, list(_views(buffer, handle.tensors))
