"""Free a role's device memory between its turns, without touching the tensors other objects hold.

Megatron's parameters and gradients are views into DDP's flat buffers and the optimizer keeps its own state;
resizing the *storages* to zero frees the memory while every view, optimizer reference and hook stays valid, so
nothing has to be rebuilt. Storages are copied to host memory first (gradients need no copy: they are zeroed
before every step) and copied back into the same storages on ``onload``.
"""

from __future__ import annotations

import torch


def _storages(tensors) -> dict[int, torch.UntypedStorage]:
    found = {}
    for t in tensors:
        storage = t.untyped_storage()
        found.setdefault(storage.data_ptr(), storage)
    return found


class StorageOffloader:
    """Moves the storages behind ``keep`` (copied) and ``discard`` (dropped) tensors to ``host`` and back;
    ``pin``: host copies in pinned memory, copied asynchronously (:attr:`parallel.device.Device.pin_host_copies`)."""

    def __init__(
        self, keep: list[torch.Tensor], discard: list[torch.Tensor], host: str | torch.device = "cpu", pin=False
    ):
        self.keep = list(_storages(keep).values())
        kept = {s.data_ptr() for s in self.keep}
        self.discard = [s for ptr, s in _storages(discard).items() if ptr not in kept]
        self.host = torch.device(host)
        self.pin = pin and self.host.type == "cpu"
        self.sizes = [s.nbytes() for s in self.keep + self.discard]
        self.copies: list[torch.UntypedStorage] | None = None

    @property
    def offloaded(self) -> bool:
        return self.copies is not None

    def offload(self) -> int:
        """Free the storages (after copying the kept ones to ``host``); returns the bytes freed."""
        if self.offloaded:
            return 0
        self.copies = []
        for storage in self.keep:
            copy = torch.empty(storage.nbytes(), dtype=torch.uint8, device=self.host, pin_memory=self.pin)
            copy.untyped_storage().copy_(storage, non_blocking=self.pin)
            self.copies.append(copy.untyped_storage())
        if self.pin:
            torch.cuda.synchronize()  # the asynchronous copies must land before the storages are freed
        for storage in self.keep + self.discard:
            storage.resize_(0)
        return sum(self.sizes)

    def onload(self) -> int:
        """Re-allocate every storage in place and restore the kept contents; returns the bytes re-allocated."""
        if not self.offloaded:
            return 0
        for storage, size in zip(self.keep + self.discard, self.sizes, strict=True):
            storage.resize_(size)
        for storage, copy in zip(self.keep, self.copies, strict=True):
            storage.copy_(copy)
        self.copies = None
        return sum(self.sizes)
