"""torch 2.13's quirks: CUDA IPC handles carry the sender's device ordinal, destroyed gloo groups keep their
threads while anything refers to them, the fake process group's store is private API, and concatenating meta
tensors imports the compiler."""

from __future__ import annotations

import gc
from collections.abc import Sequence

import torch

from compat import expect_parameters

# torch.multiprocessing.reductions.rebuild_cuda_tensor's parameters (2.13); ``storage_device`` is the ordinal the
# sending process gave the GPU.
_REBUILD_CUDA_TENSOR = (
    "tensor_cls",
    "tensor_size",
    "tensor_stride",
    "tensor_offset",
    "storage_cls",
    "dtype",
    "storage_device",
    "storage_handle",
    "storage_size_bytes",
    "storage_offset_bytes",
    "requires_grad",
    "ref_counter_handle",
    "ref_counter_offset",
    "event_handle",
    "event_sync_required",
)


def rebuild_cuda_tensor(reduction: tuple, device_index: int):
    """The CUDA tensor of ``reduce_tensor``'s ``(rebuild, args)`` from another process, on the GPU this process
    numbers ``device_index``: the reduction records the sender's ordinal, which differs where the two processes see
    different ``CUDA_VISIBLE_DEVICES`` (a Ray actor beside a trainer rank)."""
    rebuild, args = reduction
    expect_parameters(rebuild, _REBUILD_CUDA_TENSOR, "torch.multiprocessing.reductions.rebuild_cuda_tensor")
    args = list(args)
    args[_REBUILD_CUDA_TENSOR.index("storage_device")] = device_index
    return rebuild(*args)


def release_groups() -> None:
    """Free destroyed process groups that old objects still refer to. ``destroy_process_group`` shuts a gloo group
    down but its runloop and TCP threads stop only when the group object is freed; Megatron models and optimizers of
    an old layout hold their groups in reference cycles, which only the cycle collector frees (measured: 1,600
    threads per rank after a test session's layout changes, against 12 after collecting)."""
    gc.collect()


def fake_store():
    """The store of torch's fake process group (``torch.testing._internal``: private, present in 2.13)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def cat(parts: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """``torch.cat``, without the compiler for meta tensors. torch 2.13's meta ``cat`` is a Python kernel whose
    ``out_wrapper`` imports ``torch._dynamo`` on first use: 1.5 s of CPU in every process that checks a checkpoint's
    shapes on meta tensors (:func:`converters.mapping.check_tensors`: each role's load, each converter, each dry
    run). Meta tensors get the shape ``torch.cat`` would give, or its error; others go to ``torch.cat``."""
    if not parts[0].is_meta:
        return torch.cat(list(parts), dim)
    first = parts[0].shape
    dim = dim % len(first)
    for part in parts[1:]:
        if part.dim() != len(first) or any(
            a != b for i, (a, b) in enumerate(zip(part.shape, first, strict=True)) if i != dim
        ):
            raise RuntimeError(
                f"Sizes of tensors must match except in dimension {dim}: {list(first)}, {list(part.shape)}"
            )
    shape = [*first[:dim], sum(p.shape[dim] for p in parts), *first[dim + 1 :]]
    return parts[0].new_empty(shape)
