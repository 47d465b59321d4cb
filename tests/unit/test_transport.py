"""The bucket transport round-trips tensors exactly through shared memory, across dtypes and buffer growth."""

from __future__ import annotations

import dataclasses
import fcntl
import gc
import os
import subprocess
import weakref

import pytest
import torch

from mcore_rl.rollout import transport
from mcore_rl.rollout.transport import ALIGN, BucketHandle, BucketReceiver, BucketSender, BufferRef, buffer_for

CPU = torch.device("cpu")


def _bucket(seed: int, scale: int = 1) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("a.weight", torch.randn(3 * scale, 5, generator=g)),
        ("b.bias", torch.randn(7, generator=g).to(torch.bfloat16)),  # odd byte count: next offset re-aligns
        ("c.scalar", torch.tensor(2.5, dtype=torch.float64)),
        ("d.ids", torch.randint(0, 1000, (4, 3), generator=g)),
    ]


def test_pack_open_roundtrip_is_exact_and_aligned():
    sender = BucketSender(CPU)
    try:
        for seed, scale in ((0, 1), (1, 1), (2, 50)):  # the third bucket outgrows the buffer
            bucket = _bucket(seed, scale)
            handle = sender.pack(bucket)
            assert handle.kind == "shm" and all(m.offset % ALIGN == 0 for m in handle.tensors)
            _, received = BucketReceiver(CPU).open(handle)
            assert [n for n, _ in received] == [n for n, _ in bucket]
            for (_, want), (_, got) in zip(bucket, received, strict=True):
                assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
        assert sender.capacity >= handle.nbytes
    finally:
        sender.close()


def test_buffer_is_reused_and_removed_on_close():
    sender = BucketSender(CPU)
    first = sender.pack(_bucket(0))
    second = sender.pack(_bucket(1))
    assert first.buffers == second.buffers  # same segment, no allocation per bucket
    sender.close()
    with pytest.raises(FileNotFoundError, match="the shared bucket is gone"):
        BucketReceiver(CPU).open(second)


def test_unknown_handle_kind_is_refused():
    with pytest.raises(ValueError, match="unknown bucket handle kind 'tcp'"):
        BucketReceiver(CPU).open(BucketHandle("tcp", (), 0, ()))


def test_each_worker_maps_the_copy_of_its_own_feeder():
    """An engine over several devices gets one copy per feeding trainer rank; worker k reads feeder k's."""
    senders = [BucketSender(CPU) for _ in range(2)]
    try:
        copies = [s.pack(_bucket(0)) for s in senders]
        handle = BucketHandle("shm", tuple(c.buffers[0] for c in copies), copies[0].nbytes, copies[0].tensors)
        senders[1].pack(_bucket(1))  # feeder 1's copy now holds another bucket: worker 1 must see it, worker 0 not
        for rank, seed in ((0, 0), (1, 1)):
            _, received = BucketReceiver(CPU, rank).open(handle)
            assert all(torch.equal(got, want) for (_, got), (_, want) in zip(received, _bucket(seed), strict=True))
    finally:
        for s in senders:
            s.close()


def test_a_gpu_worker_maps_the_copy_on_its_own_device_or_refuses():
    refs = (BufferRef("GPU-aaa", b"0"), BufferRef("GPU-bbb", b"1"))
    handle = BucketHandle("cuda_ipc", refs, 0, ())
    assert buffer_for(handle, "GPU-bbb", rank=0) is refs[1]  # by device, whatever vLLM's worker order
    with pytest.raises(RuntimeError, match="no copy of the bucket on this worker's GPU GPU-ccc"):
        buffer_for(handle, "GPU-ccc", rank=0)


def test_stale_segments_are_those_nobody_holds(tmp_path, monkeypatch):
    """A segment is stale when no sender holds its lock, whatever its name's process id says: one from another
    container sharing /dev/shm (a process id this one cannot see) stays while its sender lives."""
    monkeypatch.setattr(transport, "SHM_DIR", tmp_path)
    dead, foreign = tmp_path / "mcore_rl_999999999_dead", tmp_path / "mcore_rl_999999999_live"
    dead.write_bytes(b"x")
    foreign.write_bytes(b"x")
    held = os.open(foreign, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_SH)  # its sender, alive elsewhere
    try:
        sender = BucketSender(CPU)  # a shm sender clears stale segments when it starts
        handle = sender.pack(_bucket(0))
        assert not dead.exists() and foreign.exists()
        assert (tmp_path / handle.buffers[0].location).exists()
        transport._remove_stale_segments()  # a second sender's start: the first one's live segment stays
        assert (tmp_path / handle.buffers[0].location).exists()
        sender.close()
    finally:
        os.close(held)
    transport._remove_stale_segments()
    assert not foreign.exists()


def test_a_segment_is_never_stale_while_its_sender_creates_it(tmp_path, monkeypatch):
    """Another sender's cleanup running between a segment's creation and its lock (a CI run saw an engine find its
    bucket gone): the new segment is already locked when it takes its name, so it stays."""
    monkeypatch.setattr(transport, "SHM_DIR", tmp_path)
    flock = fcntl.flock

    def cleanup_first(fd, operation):
        if operation == fcntl.LOCK_SH:  # the sender locking its new segment (the cleanup asks LOCK_EX | LOCK_NB)
            transport._remove_stale_segments()  # another process's sender starting at the worst moment
        flock(fd, operation)

    monkeypatch.setattr(transport.fcntl, "flock", cleanup_first)
    sender = BucketSender(CPU, reserve_bytes=64 << 10)  # its segment created now
    monkeypatch.setattr(transport.fcntl, "flock", flock)
    try:
        handle = sender.pack(_bucket(0))
        transport._remove_stale_segments()  # and once more, after
        received = BucketReceiver(CPU).open(handle)[1]
        assert all(torch.equal(g, w) for (_, g), (_, w) in zip(received, _bucket(0), strict=True))
    finally:
        sender.close()
    assert list(tmp_path.iterdir()) == []


def test_a_too_small_dev_shm_is_an_error_before_the_bucket_is_written(tmp_path, monkeypatch):
    small = tmp_path / "shm"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], check=True)
    try:
        monkeypatch.setattr(transport, "SHM_DIR", small)
        with pytest.raises(transport.SharedMemoryError, match=r"has 1.0 MiB free and a weight-sync bucket needs 8.0 "
                                                                r"MiB: enlarge it \(docker run --shm-size"):  # fmt: skip
            BucketSender(CPU, reserve_bytes=8 << 20)
        sender = BucketSender(CPU, reserve_bytes=256 << 10)
        with pytest.raises(transport.SharedMemoryError, match="needs 4.0 MiB"):
            sender.pack([("big", torch.zeros(1 << 20))])  # a bucket that outgrows the buffer: checked again
        sender.close()
        assert list(small.iterdir()) == []
    finally:
        subprocess.run(["umount", "-l", str(small)], check=True)


class _IpcCounts:
    """torch 2.13's CUDA IPC reference counting, for a CPU run: a share sets its count to 1; a mapping releases it
    once, when the mapped storage is freed; a buffer the sender drops while its count is not 0 waits in a limbo
    that a collect clears of buffers whose count is 0 (the count is unsigned: below 0 it never is again)."""

    def __init__(self):
        self.counts: dict[bytes, int] = {}
        self.buffers: dict[bytes, torch.Tensor] = {}  # what a receiver maps: views, not the sender's tensor
        self.limbo: set[bytes] = set()
        self.mappings = 0

    def share(self, buffer: torch.Tensor) -> bytes:
        location = f"share-{len(self.counts)}".encode()
        self.counts[location] = 1
        self.buffers[location] = buffer[:]
        weakref.finalize(buffer, self._dropped, location)  # the sender lets go of its buffer
        return location

    def _dropped(self, location: bytes) -> None:
        if self.counts[location] != 0:
            self.limbo.add(location)

    def map(self, location: bytes, device_index) -> torch.Tensor:
        self.mappings += 1
        mapped = self.buffers[location][:]
        weakref.finalize(mapped, self._release, location)
        return mapped

    def _release(self, location: bytes) -> None:
        self.counts[location] -= 1
        assert self.counts[location] >= 0, f"{location} released more often than shared: kept for good"

    def collect(self) -> None:
        self.limbo = {location for location in self.limbo if self.counts[location] != 0}


def _from_another_process(handle: BucketHandle) -> BucketHandle:
    refs = tuple(dataclasses.replace(ref, sender="the trainer") for ref in handle.buffers)
    return dataclasses.replace(handle, buffers=refs)


def test_a_cuda_buffer_is_mapped_once_per_share_and_freed_when_outgrown(monkeypatch):
    """Defect 6: the receiver mapped the sender's one share of a buffer for every bucket, so torch's count wrapped
    below zero and every buffer the sender outgrew stayed allocated. Now each sync shares a buffer when it first
    packs into it, each update maps it once and releases it when it ends, and an outgrown buffer is freed after."""
    counts = _IpcCounts()
    monkeypatch.setattr(transport, "_share", counts.share)
    monkeypatch.setattr(transport, "_map", counts.map)
    monkeypatch.setattr(transport, "_collect", counts.collect)
    monkeypatch.setattr(transport, "device_id", lambda device: "GPU-0")
    sender = BucketSender(CPU, reserve_bytes=1024, kind="cuda_ipc")  # reserved, not shared: no sync used it yet
    try:
        for sync, scale in enumerate((1, 1, 50, 50, 100)):  # the buffer grows in syncs 2 and 4, mid-sync
            sender.begin()
            receiver = transport.BucketReceiver(CPU)
            for seed in range(3):
                bucket = _bucket(seed, scale if seed == 2 else 1)
                received = receiver.open(_from_another_process(sender.pack(bucket)))[1]
                assert all(torch.equal(g, w) for (_, g), (_, w) in zip(received, bucket, strict=True)), sync
                del received
            receiver.close()
            gc.collect()
            assert counts.mappings == len(counts.counts), sync  # one mapping per share
            assert set(counts.counts.values()) == {0}, (sync, counts.counts)  # every share released
        sender.begin()  # a sync that sends nothing: its buffer is never shared
    finally:
        sender.close()
    gc.collect()
    assert counts.limbo == set(), counts.limbo  # every buffer freed
    assert len(counts.counts) == 5 + 2  # a share per sync, and one per growth


def test_a_handle_crosses_vllms_msgpack_boundary():
    """Defect 3: with ``rollout.in_process: false`` vLLM's engine core runs in another process and msgpack carries
    an RPC's arguments there, as its utility calls do (vLLM's own encoder, and the untyped decoder of the engine
    core): a handle arrived at the worker as a dict. The wire form comes back as the handle it was."""
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    refs = (BufferRef("GPU-aaa", b"\x80\x04pickled"), BufferRef("", "mcore_rl_1_ab"))
    handle = BucketHandle("cuda_ipc", refs, 4096, (transport.TensorMeta("a.weight", "bfloat16", (3, 5), 64),))

    def crossed(args):
        return MsgpackDecoder().decode(MsgpackEncoder().encode(args))

    assert not isinstance(crossed((handle,))[0], BucketHandle)  # what the worker got before
    assert BucketHandle.from_wire(crossed((handle.to_wire(),))[0]) == handle


def test_a_cuda_bucket_from_the_receivers_own_process_is_refused_before_cuda_sees_it(monkeypatch):
    """Defect 2: the GPU self-check's vLLM step mapped a CUDA IPC handle in the process that exported it, which CUDA
    refuses with an opaque error. The receiver names the mistake; the step now packs in a process of its own."""
    monkeypatch.setattr(transport, "_map", lambda location, index: pytest.fail("CUDA asked to map its own export"))
    monkeypatch.setattr(transport, "device_id", lambda device: "GPU-0")
    ours = BucketHandle("cuda_ipc", (BufferRef("GPU-0", b"handle", transport.PROCESS),), 0, ())
    with pytest.raises(RuntimeError, match="CUDA maps a handle only in another process"):
        BucketReceiver(CPU).open(ours)
    monkeypatch.setattr(transport, "_map", lambda location, index: torch.zeros(0, dtype=torch.uint8))
    theirs = BucketHandle("cuda_ipc", (BufferRef("GPU-0", b"handle", "another process"),), 0, ())
    assert BucketReceiver(CPU).open(theirs)[1] == []
