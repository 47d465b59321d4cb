"""The bucket transport round-trips tensors exactly through shared memory, across dtypes and buffer growth."""

from __future__ import annotations

import fcntl
import os
import subprocess

import pytest
import torch

from mcore_rl.rollout import transport
from mcore_rl.rollout.transport import ALIGN, BucketHandle, BucketSender, BufferRef, buffer_for, open_bucket

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
            _, received = open_bucket(handle, CPU)
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
        open_bucket(second, CPU)


def test_unknown_handle_kind_is_refused():
    with pytest.raises(ValueError, match="unknown bucket handle kind 'tcp'"):
        open_bucket(BucketHandle("tcp", (), 0, ()), CPU)


def test_each_worker_maps_the_copy_of_its_own_feeder():
    """An engine over several devices gets one copy per feeding trainer rank; worker k reads feeder k's."""
    senders = [BucketSender(CPU) for _ in range(2)]
    try:
        copies = [s.pack(_bucket(0)) for s in senders]
        handle = BucketHandle("shm", tuple(c.buffers[0] for c in copies), copies[0].nbytes, copies[0].tensors)
        senders[1].pack(_bucket(1))  # feeder 1's copy now holds another bucket: worker 1 must see it, worker 0 not
        for rank, seed in ((0, 0), (1, 1)):
            _, received = open_bucket(handle, CPU, rank)
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
