"""Moving a bucket of named tensors from trainer processes to rollout engine workers.

Colocated engines take buckets zero-copy: each trainer rank that feeds an engine packs the bucket into a buffer
the engine's workers can map (POSIX shared memory on CPU, a CUDA IPC handle on GPU) and sends only a small
picklable :class:`BucketHandle`; an engine with several workers gets one buffer per worker's device (the trainer
rank colocated on it), so no worker maps memory on another GPU or node. Each worker maps its buffer and hands
views to vLLM's weight loader, which copies what its own shard needs. A sender keeps one buffer and reuses it for
every bucket, so the extra memory of a sync is one bucket, allocated on the first sync only.

CUDA IPC counts references across processes: every share of a buffer is released once, by the one mapping a
receiver makes of it, and the sender's allocator frees the buffer only when its count is back to zero. torch 2.13
keeps a dropped buffer whose count is not zero for good (the count is unsigned: released once too often, it
wraps). So a sender shares a buffer when it first packs into it in a sync, and takes a fresh, unshared buffer at
the next sync (:meth:`BucketSender.begin`: the same bytes come back from the caching allocator); a receiver maps
each buffer once per update and drops its mappings when the update ends (:class:`BucketReceiver`); and a sender
collects the buffers it outgrew once their receivers are done. (Mapping one share for every bucket released it
once per bucket, so every buffer a sender outgrew stayed allocated.)

Engines on other devices (a disaggregated placement) receive the same packed bucket by a broadcast over the
weight-transfer group (:class:`parallel.transfer.TransferGroup`); the handle then names no buffer (kind
``broadcast``) and each worker receives into a buffer of its own.
"""

from __future__ import annotations

import dataclasses
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


# Names this process as the sender of a CUDA buffer (process ids repeat across containers sharing a GPU).
PROCESS = uuid.uuid4().hex


@dataclass(frozen=True)
class BufferRef:
    device: str  # UUID of the GPU holding a CUDA buffer; "" for shared memory, which any local process maps
    location: str | bytes  # shm file name, or the pickled CUDA IPC reduction of the buffer
    sender: str = ""  # the sending process's PROCESS, for a CUDA buffer


@dataclass(frozen=True)
class BucketHandle:
    """What crosses the process boundary per bucket: the tensors, and the buffers holding them (identical copies,
    one per feeding trainer rank)."""

    kind: str  # "shm", "cuda_ipc" or "broadcast"
    buffers: tuple[BufferRef, ...]
    nbytes: int
    tensors: tuple[TensorMeta, ...]

    def to_wire(self) -> dict:
        """The handle as plain data: vLLM serialises an RPC's arguments with msgpack when its engine core runs in
        another process (``rollout.in_process: false``), which turns dataclasses into dicts and tuples into lists."""
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, wire: dict) -> BucketHandle:
        return cls(
            wire["kind"],
            tuple(BufferRef(**ref) for ref in wire["buffers"]),
            wire["nbytes"],
            tuple(TensorMeta(m["name"], m["dtype"], tuple(m["shape"]), m["offset"]) for m in wire["tensors"]),
        )


def device_id(device: torch.device) -> str:
    """What names a GPU across processes whatever devices each one sees: its UUID ("" on CPU)."""
    return str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else ""


def _share(buffer: torch.Tensor) -> bytes:
    """A CUDA buffer's IPC handle, as it crosses the process boundary (one share: released by one mapping)."""
    from torch.multiprocessing.reductions import reduce_tensor

    return pickle.dumps(reduce_tensor(buffer))


def _map(location: bytes, device_index: int) -> torch.Tensor:
    """Another process's shared CUDA buffer, on this process's ordinal of the same GPU (see :func:`buffer_for`);
    the share is released when the returned tensor's storage is freed."""
    return rebuild_cuda_tensor(pickle.loads(location), device_index)  # noqa: S301 - a handle from our own trainer


def _collect() -> None:
    """Free the dropped CUDA buffers whose receivers have released them (torch keeps them until then)."""
    torch.cuda.ipc_collect()


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
        if self.kind in ("cuda_ipc", "broadcast"):  # a CUDA buffer is shared when a sync first packs into it
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
            # Created and locked under a name the stale-segment cleanup does not match, then renamed: another
            # sender's cleanup never finds it unlocked (between its creation and the lock it took it for stale).
            staging = SHM_DIR / f".{self._path.name}"
            self._lock = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            fcntl.flock(self._lock, fcntl.LOCK_SH)
            os.rename(staging, self._path)
            self._buffer = torch.from_file(str(self._path), shared=True, size=nbytes, dtype=torch.uint8)
            self._ref = BufferRef("", self._path.name)

    def begin(self) -> None:
        """Start a sync: a CUDA buffer shared in the last one is replaced by an unshared one of the same size (its
        receivers released it when their update ended, so it is freed, and the caching allocator hands the same
        bytes back)."""
        if self.kind == "cuda_ipc" and self._ref is not None:
            capacity = self.capacity
            self.close()
            self._ensure(capacity)

    def pack(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> BucketHandle:
        """Copy ``tensors`` into the shared buffer; valid until the next ``pack`` or ``close``."""
        metas, nbytes = _layout(tensors)
        self._ensure(nbytes)
        if self.kind == "cuda_ipc" and self._ref is None:
            self._ref = BufferRef(device_id(self.device), _share(self._buffer), PROCESS)
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
        """Free the buffer. Receivers that still map it keep it until they drop it (a shm segment's pages; a CUDA
        buffer, which a later ``close`` or ``begin`` then frees)."""
        self._buffer = self._ref = None
        if self.kind == "cuda_ipc":
            _collect()
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


class BucketReceiver:
    """Receiver side, worker ``rank`` of its engine, for one weight update: maps each sender buffer once and holds
    the mapping until :meth:`close` (see the module docstring). ``receive(nbytes)`` takes a ``broadcast`` bucket
    from the transfer group."""

    def __init__(self, device: torch.device, rank: int = 0, receive: Callable[[int], torch.Tensor] | None = None):
        self.device, self.rank, self.receive = device, rank, receive
        # CUDA buffers by their share, shared-memory segments by their name: mapped once an update (a new mapping
        # faults every page in again: a 64 MiB bucket's copy-out takes 3x as long)
        self._mapped: dict[bytes | str, torch.Tensor] = {}

    def open(self, handle: BucketHandle) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]:
        """The bucket's buffer and views of its tensors in it (no copy)."""
        if handle.kind not in ("shm", "cuda_ipc", "broadcast"):
            raise ValueError(f"unknown bucket handle kind {handle.kind!r}; expected 'shm', 'cuda_ipc' or 'broadcast'")
        if handle.kind == "broadcast":
            if self.receive is None:
                raise RuntimeError("a broadcast bucket, but this worker joined no transfer group")
            buffer = self.receive(handle.nbytes)
            return buffer, list(_views(buffer, handle.tensors))
        ref = buffer_for(handle, device_id(self.device), self.rank)
        if handle.kind == "cuda_ipc":
            if ref.sender == PROCESS:
                raise RuntimeError(
                    "a CUDA IPC bucket from this very process: CUDA maps a handle only in another process than the "
                    "one that exported it; the engine must not share a process with the trainer rank that feeds it"
                )
            if ref.location not in self._mapped:
                self._mapped[ref.location] = _map(ref.location, self.device.index)
            buffer = self._mapped[ref.location]
        else:
            path = SHM_DIR / ref.location
            # torch.from_file would create a missing file and hand back zeros: check first.
            if not path.is_file() or path.stat().st_size < handle.nbytes:
                raise FileNotFoundError(f"{path}: the shared bucket is gone or short (its sender closed or died)")
            mapped = self._mapped.get(ref.location)
            if mapped is None or mapped.numel() < handle.nbytes:  # the whole segment: later buckets fit in it
                size = path.stat().st_size
                self._mapped[ref.location] = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
            buffer = self._mapped[ref.location][: handle.nbytes]
        return buffer, list(_views(buffer, handle.tensors))

    def close(self) -> None:
        """Release the mapped buffers (the update is over): their senders may free or share them again."""
        self._mapped.clear()
