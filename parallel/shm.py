"""Reduce-scatter and all-gather through shared memory, for CPU process groups whose ranks share a host.

gloo moves a data-parallel step's gradients and parameters over loopback TCP, and its reduce-scatter of a flat
tensor is slower than its all-reduce of the same tensor: on the 2-core machine, for SmolLM2's 540 MB of fp32 grads
at data parallel 2, 0.63 s to reduce-scatter and 0.53 s to all-gather them (two processes of one thread each), about
a third of a training step. Through a shared window per rank the same collectives cost about a memcpy of the data
each (0.14 and 0.13 s).

Each rank of a group maps a window of its own that its peers map too (files in ``/dev/shm``, unlinked once every
rank has mapped them: nothing is left there, whatever happens next), as large as what its peers read from it: the
other ranks' shards of the largest bucket (half of it at data parallel 2). A collective writes what the peers need
into the window, waits for all (the group's own gloo barrier), reads what it needs from the peers' windows, and waits
again before the windows can be written anew. Sums run in a fixed order (this rank's part, then the peers' in rank
order), so a result does not depend on timing. A group whose ranks cannot map each other's windows (other hosts,
no ``/dev/shm``) falls back to torch's collectives, decided once per group by all its ranks together.

A group of one rank (data parallel 1, or expert data parallel 1 where EP spans the world) is its own result: at most
a copy where the output is not the input, and none where Megatron's shard is the whole bucket, as it is there. gloo
runs its collectives on such a group as on any other: 0.42-0.47 s for each of SmolLM2's 538 MB buffers, where one
pass over it takes 0.03 s, so that a ``dp1`` run's optimizer step paid for two of them.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

SHM_DIR = Path("/dev/shm")
ALIGN = 64  # window sizes are multiples of this many bytes


class SharedMemoryCollectives:
    """Drop-in ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` (torch's signatures) for flat (1-D)
    contiguous CPU tensors, a group of one by itself; anything else (CUDA tensors, other ops than SUM and AVG, empty
    tensors, groups without shared windows) goes to ``reduce_scatter`` and ``all_gather`` (torch's by default).
    One instance holds each group's windows for as long as the group lives."""

    def __init__(self, reduce_scatter=dist.reduce_scatter_tensor, all_gather=dist.all_gather_into_tensor,
                 directory: Path = SHM_DIR):  # fmt: skip
        self._reduce_scatter, self._all_gather, self.directory = reduce_scatter, all_gather, directory
        # group -> its ranks' windows (uint8, this rank's at group.rank()), or None: torch's collectives
        self._windows: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def reduce_scatter_tensor(self, output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        """``output`` (may be a view of ``input``: Megatron's shard of its bucket) gets this rank's shard of the
        sum (``op`` SUM) or the mean (AVG) of every rank's ``input``. Synchronous; returns None.

        The mean costs no pass of its own: each rank scales what it writes for its peers and its own shard as it
        adds the first of theirs (Megatron's ``average_in_collective``, instead of scaling its whole bucket by
        1/size before a sum)."""
        group = group or dist.group.WORLD
        peers_bytes = input.nbytes - output.nbytes
        reducible = op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG)
        if reducible and _alone(group, output):  # the sum and the mean of one input are that input
            return _own_result(output, input)
        windows = self._usable(group, (output, input), peers_bytes) if reducible else None
        if windows is None:
            return self._reduce_scatter(output, input, op=op, group=group, async_op=async_op)
        rank, size, count = group.rank(), group.size(), output.numel()
        scale = 1.0 / size if op == dist.ReduceOp.AVG else 1.0
        own = slice(rank * count, (rank + 1) * count)
        mine = windows[rank].view(input.dtype)  # the peers' shards in rank order: each reads its own from here
        torch.mul(input[: own.start], scale, out=mine[: own.start])
        torch.mul(input[own.stop :], scale, out=mine[own.start : input.numel() - count])
        _barrier(group)
        if output.data_ptr() != input[own].data_ptr():
            output.copy_(input[own])
        alpha = scale  # this rank's part, scaled as the first peer's is added to it
        for peer in range(size):
            if peer != rank:
                slot = rank if rank < peer else rank - 1  # where the peer's window keeps this rank's shard
                torch.add(windows[peer].view(input.dtype)[slot * count : (slot + 1) * count], output, alpha=alpha,
                          out=output)  # fmt: skip
                alpha = 1.0
        _barrier(group)  # every peer has read this rank's window before the next collective writes it
        return None

    def all_gather_into_tensor(self, output, input, group=None, async_op=False):
        """``output`` gets every rank's ``input`` in rank order (``input`` may be a view of it). Synchronous;
        returns None."""
        group = group or dist.group.WORLD
        if _alone(group, output):
            return _own_result(output, input)
        windows = self._usable(group, (output, input), input.nbytes)
        if windows is None:
            return self._all_gather(output, input, group=group, async_op=async_op)
        rank, size, count = group.rank(), group.size(), input.numel()
        windows[rank].view(input.dtype)[:count].copy_(input)
        _barrier(group)
        for peer in range(size):
            part = output[peer * count : (peer + 1) * count]
            if peer != rank:
                part.copy_(windows[peer].view(input.dtype)[:count])
            elif part.data_ptr() != input.data_ptr():
                part.copy_(input)
        _barrier(group)
        return None

    def _usable(self, group, tensors, nbytes: int) -> list[torch.Tensor] | None:
        """The group's windows, each at least ``nbytes`` (grown together: every rank asks for the same size at the
        same collective), or None where torch's collective serves."""
        if not nbytes:
            return None
        if any(t.device.type != "cpu" or t.dim() != 1 or not t.is_contiguous() for t in tensors):
            return None
        windows = self._windows.get(group, [])
        if windows is not None and (not windows or windows[0].numel() < nbytes):
            windows = self._windows[group] = self._map(group, nbytes)
        return windows

    def _map(self, group, nbytes: int) -> list[torch.Tensor] | None:
        """Collective over ``group``: each rank creates its window, maps every peer's, and all agree whether every
        rank mapped every window (None: they did not)."""
        token = torch.tensor([secrets.randbits(62)])
        options = dist.BroadcastOptions()
        options.rootRank = 0
        group.broadcast([token], options).wait()
        paths = [self.directory / f"mcore_rl_shm_{os.getuid()}_{token.item()}_{r}" for r in range(group.size())]
        nbytes = -(-nbytes // ALIGN) * ALIGN  # any dtype's view of a window fits
        windows = None
        with contextlib.suppress(OSError, RuntimeError):
            _map_file(paths[group.rank()], nbytes, create=True)
        _barrier(group)
        with contextlib.suppress(OSError, RuntimeError):
            windows = [_map_file(path, nbytes, create=False) for path in paths]
        mapped = torch.tensor([windows is not None], dtype=torch.int32)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        group.allreduce([mapped], options).wait()  # every rank has tried every window: the files can go
        paths[group.rank()].unlink(missing_ok=True)
        return windows if mapped.item() else None


def _map_file(path: Path, nbytes: int, create: bool) -> torch.Tensor:
    """``nbytes`` of ``path`` mapped shared. ``create``: a new file that only this user reads, its pages allocated
    now (a full ``/dev/shm``, as containers' default 64 MB, is an error here, not a SIGBUS at a later write). A
    peer's must exist: torch would create an empty one on a host that does not share it."""
    if create:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError:
            path.unlink()
            raise
        finally:
            os.close(fd)
    elif not path.exists():
        raise FileNotFoundError(path)
    return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)


def _barrier(group) -> None:
    """The group's barrier, called on the group itself: inside Megatron's ``_coalescing_manager`` (which captures
    ``torch.distributed``'s collectives to run them at its exit) it runs now."""
    group.barrier(dist.BarrierOptions()).wait()


def _alone(group, output: torch.Tensor) -> bool:
    """Whether ``group`` is this rank alone (on CPU), whose collective's result is its own input."""
    return group.size() == 1 and output.device.type == "cpu"


def _own_result(output: torch.Tensor, input: torch.Tensor) -> None:
    """A collective of one rank: its ``input`` in ``output``, copied only where ``output`` is not ``input``."""
    if output.data_ptr() != input.data_ptr():
        output.copy_(input.reshape(output.shape))
