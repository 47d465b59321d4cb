"""The project's collectives. Each takes an explicit process group and moves a whole bucket in one call.

Callers batch tensors (same dtype) into a bucket; these functions flatten the bucket into one buffer, run one
collective and hand back views shaped like the inputs. Nothing here knows about models or mappings.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup


def byte_buckets(items: Iterable, nbytes: Callable, budget: int, key: Callable | None = None) -> Iterator[list]:
    """Consecutive ``items`` grouped into buckets of at most ``budget`` bytes (``nbytes(item)``; an item larger than
    the budget is a bucket of its own), a new one wherever ``key(item)`` changes."""
    bucket, size = [], 0
    for item in items:
        n = nbytes(item)
        if bucket and (size + n > budget or (key is not None and key(item) != key(bucket[0]))):
            yield bucket
            bucket, size = [], 0
        bucket.append(item)
        size += n
    if bucket:
        yield bucket


def _flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.empty(0)


def _unflatten(flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    out, offset = [], 0
    for shape in shapes:
        n = shape.numel()
        out.append(flat[offset : offset + n].view(shape))
        offset += n
    return out


def all_gather_bucket(tensors: Sequence[torch.Tensor], group: ProcessGroup) -> list[list[torch.Tensor]]:
    """Gather equally-shaped buckets from every rank of ``group``: result[rank][i] is rank's ``tensors[i]``."""
    size = dist.get_world_size(group)
    if size == 1 or not tensors:
        return [list(tensors)] * size
    flat = _flatten(tensors)
    gathered = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(gathered, flat, group=group)
    shapes = [t.shape for t in tensors]
    return [_unflatten(buf, shapes) for buf in gathered]


def in_row_shares(
    fn: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    rows: dict[str, torch.Tensor],
    group: ProcessGroup,
    min_rows: int = 1,
) -> torch.Tensor:
    """``fn`` of each rank's equal share of ``rows`` (tensors of as many rows each, at least ``min_rows`` a share),
    gathered in row order on every rank of ``group``: a row count that does not fill the shares is filled up with
    copies of the last row, computed and dropped. ``fn`` returns one tensor with a row per row of its share."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    count = next(iter(rows.values())).shape[0]
    fill = max(-(-count // size), min_rows) * size - count
    even = {k: torch.cat([v, v[-1:].expand(fill, *v.shape[1:])]) if fill else v for k, v in rows.items()}
    local = fn({k: v.chunk(size)[rank] for k, v in even.items()})
    return torch.cat([shares[0] for shares in all_gather_bucket([local], group)])[:count]


def broadcast_bucket(
    tensors: Sequence[torch.Tensor] | None,
    shapes: Sequence[torch.Size],
    dtype: torch.dtype,
    src: int,
    group: ProcessGroup,
    device: torch.device,
) -> list[torch.Tensor]:
    """Broadcast a bucket from group rank ``src``; other ranks pass ``tensors=None`` and receive ``shapes``."""
    if dist.get_world_size(group) == 1:
        return list(tensors)
    if dist.get_rank(group) == src:
        flat = _flatten(tensors).to(device)
    else:
        flat = torch.empty(sum(s.numel() for s in shapes), dtype=dtype, device=device)
    dist.broadcast(flat, group_src=src, group=group)
    return _unflatten(flat, shapes)


def all_gather_objects(obj, group: ProcessGroup | None = None) -> list:
    """Small metadata (names, shapes) from every rank of ``group``; never used for tensor payloads."""
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def all_reduce_scalar(value: float, group: ProcessGroup, op: str = "sum") -> float:
    """Reduce one Python number over ``group`` (metrics: losses, counts); ``op`` is ``sum`` or ``max``."""
    t = torch.tensor([value], dtype=torch.float64)
    if dist.get_backend(group) == "nccl":
        t = t.cuda()
    return all_reduce_(t, group, op).item()


def all_reduce_(tensor: torch.Tensor, group: ProcessGroup, op: str = "sum") -> torch.Tensor:
    """In-place reduction of one small tensor over ``group`` (per-token statistics of vocab-parallel math)."""
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
    if dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=ops[op], group=group)
    return tensor


class _AllGatherWithGrad(torch.autograd.Function):
    """Forward: all-gather along a new leading dim; backward: reduce-scatter of the gathered gradient (every
    rank's use of a shard contributes to that shard's gradient)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        flat = tensor.contiguous().view(-1)
        out = torch.empty(size * flat.numel(), dtype=tensor.dtype, device=tensor.device)
        dist.all_gather_into_tensor(out, flat, group=group)
        return out.view(size, *tensor.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = torch.empty(grad[0].numel(), dtype=grad.dtype, device=grad.device)
        dist.reduce_scatter_single(out, grad.contiguous().view(-1), group=ctx.group)
        return out.view(grad.shape[1:]), None


def all_gather_with_grad(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Differentiable all-gather: ``[size, *tensor.shape]`` holding every rank's tensor, in rank order."""
    return _AllGatherWithGrad.apply(tensor, group)
