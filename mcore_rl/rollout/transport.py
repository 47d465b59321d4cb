"""Moving a bucket of named tensors from a trainer process to the colocated rollout engine's workers, zero-copy.

The trainer packs a bucket into a buffer the engine's workers can map (POSIX shared memory on CPU, a CUDA IPC
handle on GPU) and sends only a small picklable :class:`BucketHandle`; each worker maps the same buffer and hands
views to vLLM's weight loader, which copies what its own shard needs. The sender keeps one buffer and reuses it
for every bucket, so the extra memory of a sync is one bucket, allocated on the first sync only.
"""

from __future__ import annotations

import os
import pickle
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

ALIGN = 64  # byte alignment of each tensor inside a bucket (vectorised copies, any dtype)
SHM_DIR = Path("/dev/shm")


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str  # torch dtype name without the "torch." prefix: msgpack- and pickle-friendly
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the buffer


@dataclass(frozen=True)
class BucketHandle:
    """What crosses the process boundary per bucket: where the buffer is, and the tensors in it."""

    kind: str  # "shm" or "cuda_ipc"
    location: str | bytes  # shm file name, or the pickled CUDA IPC reduction of the buffer
    nbytes: int
    tensors: tuple[TensorMeta, ...]


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


def _remove_stale_segments() -> None:
    """Delete shm buckets of trainer processes that died without closing them (``mcore_rl_<pid>_<id>``)."""
    for path in SHM_DIR.glob("mcore_rl_*_*"):
        pid = path.name.split("_")[2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            path.unlink(missing_ok=True)


class BucketSender:
    """Trainer side: owns the shared buffer (grown when a bucket needs more) and packs buckets into it."""

    def __init__(self, device: torch.device, reserve_bytes: int = 0):
        if device.type != "cuda":
            _remove_stale_segments()
        self.device = device
        self._buffer: torch.Tensor | None = None
        self._location: str | bytes | None = None
        self._path: Path | None = None
        if reserve_bytes:
            self._ensure(reserve_bytes)
            self._buffer.zero_()  # fault the pages in now, so the first sync costs what later ones do

    def _ensure(self, nbytes: int) -> None:
        if self._buffer is not None and self._buffer.numel() >= nbytes:
            return
        self.close()
        if self.device.type == "cuda":
            from torch.multiprocessing.reductions import reduce_tensor

            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._location = pickle.dumps(reduce_tensor(self._buffer))
        else:
            self._path = SHM_DIR / f"mcore_rl_{os.getpid()}_{uuid.uuid4().hex[:8]}"
            self._buffer = torch.from_file(str(self._path), shared=True, size=nbytes, dtype=torch.uint8)
            self._location = self._path.name

    def pack(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> BucketHandle:
        """Copy ``tensors`` into the shared buffer; valid until the next ``pack`` or ``close``."""
        metas, nbytes = _layout(tensors)
        self._ensure(nbytes)
        for (_, src), (_, dst) in zip(tensors, _views(self._buffer, metas), strict=True):
            dst.copy_(src)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the receiver reads on its own stream
        return BucketHandle("cuda_ipc" if self.device.type == "cuda" else "shm", self._location, nbytes, tuple(metas))

    @property
    def capacity(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    def close(self) -> None:
        """Free the buffer. Receivers that still map a shm segment keep their pages until they drop them."""
        self._buffer = self._location = None
        if self._path is not None:
            self._path.unlink(missing_ok=True)
            self._path = None


def open_bucket(handle: BucketHandle, device: torch.device) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]:
    """Receiver side: the sender's buffer, mapped, and views of the bucket's tensors in it (no copy)."""
    if handle.kind == "cuda_ipc":
        rebuild, args = pickle.loads(handle.location)  # noqa: S301 - a handle from our own trainer process
        args = list(args)
        args[6] = device.index  # the device ordinal as this process sees it
        buffer = rebuild(*args)
    elif handle.kind == "shm":
        path = SHM_DIR / handle.location
        # torch.from_file would create a missing file and hand back zeros: check first.
        if not path.is_file() or path.stat().st_size < handle.nbytes:
            raise FileNotFoundError(f"{path}: the shared bucket is gone or short (its sender closed or died)")
        buffer = torch.from_file(str(path), shared=True, size=handle.nbytes, dtype=torch.uint8)
    else:
        raise ValueError(f"unknown bucket handle kind {handle.kind!r}; expected 'shm' or 'cuda_ipc'")
    return buffer, list(_views(buffer, handle.tensors))
