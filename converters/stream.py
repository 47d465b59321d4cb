"""HF checkpoint -> sharded Megatron model (``load_hf``) and sharded Megatron model -> HF tensors (``export_hf``).

Both are driven by a bridge's mapping list. ``export_hf`` is the one path out of a trained model: the converter
CLIs write what it yields to safetensors, and the rollout sync streams it into the inference engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection

from converters.hf_io import HFCheckpoint
from converters.mapping import Mapping, MappingTable, Target, check_tensors, unexpected_tensors
from converters.plan import MTP, LocalParam, global_expert_name, local_params
from converters.torch_dist import find_megatron, load_model
from converters.transforms import full_shape, shard
from parallel.comm import all_gather_bucket, all_gather_objects, broadcast_bucket, byte_buckets

DEFAULT_BUCKET_BYTES = 512 << 20


def _size_rank(group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def _num_local_experts(chunks, ep: int) -> int:
    experts = chunks[0].config.num_moe_experts
    return experts // ep if experts else 0


def _check_axis(mapping: Mapping, name: str, megatron_axis: int | None) -> None:
    if mapping.tp_axis != megatron_axis:
        raise ValueError(
            f"{name}: mapping declares TP axis {mapping.tp_axis} but Megatron partitions it on "
            f"{megatron_axis}; fix the mapping's tp_axis in the model's bridge"
        )


def load_hf(chunks: list[torch.nn.Module], bridge, hf_dir: str | Path, groups: ProcessGroupCollection) -> None:
    """Fill this rank's shards of ``chunks`` from an HF directory, reading only the tensors they need.

    Checked first on the files' headers (:func:`converters.mapping.check_tensors`, every rank's parameters, the
    problems gathered so that all ranks raise together instead of leaving peers in a collective): a
    ``ValueError`` names every missing, mis-shaped or unexpected checkpoint tensor before anything is read.
    """
    ckpt = HFCheckpoint(hf_dir, bridge.expert_stacks())
    table = MappingTable(bridge.mappings())
    ep, ep_rank = _size_rank(groups.ep)
    num_local = _num_local_experts(chunks, ep)
    mine = []  # (parameter, its target, TP rank)
    for lp in local_params(chunks):
        name = global_expert_name(lp.slot, ep_rank, num_local) if lp.is_expert else lp.slot
        tp, tp_rank = _size_rank(groups.expt_tp if lp.is_expert else groups.tp)
        mine.append((lp, Target(name, tuple(full_shape(lp.param.shape, lp.tp_axis, tp)), tp), tp_rank))
    shapes = ckpt.shapes
    check = check_tensors(table, [target for _, target, _ in mine], shapes)
    found = (check.problems, check.consumed)
    everyone = all_gather_objects(found) if dist.is_initialized() else [found]
    problems = sorted({p for ps, _ in everyone for p in ps})
    problems += unexpected_tensors(shapes, set().union(*(c for _, c in everyone)), bridge.ignores)
    if problems:
        raise ValueError(f"{hf_dir}: checkpoint does not match {bridge.architecture}:\n  " + "\n  ".join(problems))
    for lp, target, tp_rank in mine:
        mapping, captures = table.resolve(target.name)
        _check_axis(mapping, target.name, lp.tp_axis)
        full = mapping.to_megatron([ckpt.get(n) for n in mapping.hf_names(captures)], target.split_over, target.shape)
        with torch.no_grad():
            lp.param.copy_(shard(full, lp.tp_axis, tp_rank, target.split_over))


def load_weights(chunks: list[torch.nn.Module], bridge, directory: str | Path, groups: ProcessGroupCollection) -> None:
    """This rank's shards from an HF directory or from a Megatron checkpoint (converted, or saved by training)."""
    megatron = find_megatron(directory)
    if megatron is None:
        load_hf(chunks, bridge, directory, groups)
    else:
        load_model(chunks, megatron)


@dataclass(frozen=True)
class _Task:
    slot: str
    owner: int  # pipeline rank holding the parameter
    shape: tuple[int, ...]  # local shard shape
    dtype: torch.dtype
    is_expert: bool
    tp_axis: int | None

    def nbytes(self, tp: int, ep: int) -> int:
        return full_shape(torch.Size(self.shape), self.tp_axis, tp).numel() * self.dtype.itemsize * ep


StageMeta = list[tuple[str, tuple[int, ...], torch.dtype, bool, int | None]]  # slot, shape, dtype, expert, axis


def stage_meta(mine: dict[str, LocalParam]) -> StageMeta:
    """What one pipeline rank holds, as the export plan needs it (names, local shapes, dtypes, sharding)."""
    return [(s, tuple(lp.param.shape), lp.param.dtype, lp.is_expert, lp.tp_axis) for s, lp in mine.items()]


def export_plan(stages: list[StageMeta], table: MappingTable, num_local: int, mtp: bool = True) -> list[_Task]:
    """The ordered export tasks of a model whose pipeline ranks hold ``stages`` (pure: the dry run plans
    full-size models with it, from meta tensors). A parameter that several stages hold (the embedding an MTP stage
    keeps a copy of) is exported by the first; ``mtp`` False leaves the MTP layers out."""
    tasks, seen = [], set()
    for owner, stage in enumerate(stages):
        for slot, shape, dtype, is_expert, axis in stage:
            if not mtp and slot.startswith(MTP):
                continue
            mapping, _ = table.resolve(global_expert_name(slot, 0, num_local) if is_expert else slot)
            _check_axis(mapping, slot, axis)
            if mapping.export and slot not in seen:
                seen.add(slot)
                tasks.append(_Task(slot, owner, shape, dtype, is_expert, axis))
    return sorted(tasks, key=lambda t: (t.owner, t.slot))


def buckets(tasks: list[_Task], budget: int, tp: int, etp: int, ep: int) -> Iterator[list[_Task]]:
    """Consecutive tasks of one pipeline owner and dtype, up to ``budget`` bytes of full tensors each."""

    def nbytes(task: _Task) -> int:
        return task.nbytes(etp, ep) if task.is_expert else task.nbytes(tp, 1)

    return byte_buckets(tasks, nbytes, budget, key=lambda task: (task.owner, task.dtype))


def bucket_layout(
    bucket: list[_Task], num_local: int, tp: int, etp: int, ep: int
) -> tuple[list[tuple[str, int]], list[torch.Size]]:
    """The full tensors a bucket gathers, in order: (global Megatron name, TP size it was split over) and shape.
    An expert slot stands for the same local expert on every EP rank."""
    names, shapes = [], []
    for t in bucket:
        split_over = etp if t.is_expert else tp
        slots = [global_expert_name(t.slot, r, num_local) for r in range(ep)] if t.is_expert else [t.slot]
        names += [(slot, split_over) for slot in slots]
        shapes += [full_shape(torch.Size(t.shape), t.tp_axis, split_over)] * len(slots)
    return names, shapes


def _gather_tp(tasks: list[_Task], mine: dict[str, LocalParam], group, read) -> dict[str, torch.Tensor]:
    """Full tensors of ``tasks`` from their TP (or expert-TP) shards: one all_gather for the whole bucket."""
    split = [t for t in tasks if t.tp_axis is not None]
    gathered = all_gather_bucket([read(mine[t.slot].param) for t in split], group)
    full = {t.slot: read(mine[t.slot].param) for t in tasks if t.tp_axis is None}
    for i, t in enumerate(split):
        shards = [rank_shards[i] for rank_shards in gathered]  # one: the shard is the tensor, not to be copied
        full[t.slot] = shards[0] if len(shards) == 1 else torch.cat(shards, dim=t.tp_axis)
    return full


def export_hf(
    chunks: list[torch.nn.Module],
    bridge,
    groups: ProcessGroupCollection,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    read=torch.Tensor.detach,
    mtp: bool = True,
    stack_experts: bool = True,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full tensor)`` for the whole model on every rank, in byte buckets; ``read`` gives what a
    parameter's shard exports as (a LoRA-adapted weight: merged with its adapter, :func:`models.lora.merged`);
    ``mtp`` False: without the multi-token-prediction layers (for an engine that does not draft with them);
    ``stack_experts`` False: a family's stacked expert tensors one expert at a time, under their per-expert names
    (:mod:`converters.stacks`; the rollout engines load those, never holding a layer's stack).

    Per bucket (tasks of one pipeline owner): one all_gather over TP, one over expert-TP, one over EP for the
    experts, one broadcast over PP. Peak extra memory is about one bucket (plus, for a family whose checkpoints
    stack experts, the stacked tensors begun). Yielded tensors may alias parameters or the bucket buffer: copy them
    before the model or the iterator moves on.
    """
    stacks = bridge.expert_stacks() if stack_experts else None
    exported = _export_hf(chunks, bridge, groups, bucket_bytes, read, mtp)
    return exported if stacks is None else stacks.stack(exported)


def _export_hf(chunks, bridge, groups, bucket_bytes, read, mtp) -> Iterator[tuple[str, torch.Tensor]]:
    table = MappingTable(bridge.mappings())
    tp, _ = _size_rank(groups.tp)
    etp, _ = _size_rank(groups.expt_tp)
    ep, _ = _size_rank(groups.ep)
    _, pp_rank = _size_rank(groups.pp)
    num_local = _num_local_experts(chunks, ep)
    mine = {lp.slot: lp for lp in local_params(chunks)}
    device = next(iter(mine.values())).param.device
    tasks = export_plan(all_gather_objects(stage_meta(mine), groups.pp), table, num_local, mtp)
    for bucket in buckets(tasks, bucket_bytes, tp, etp, ep):
        names, shapes = bucket_layout(bucket, num_local, tp, etp, ep)
        tensors = None
        if pp_rank == bucket[0].owner:
            dense = [t for t in bucket if not t.is_expert]
            experts = [t for t in bucket if t.is_expert]
            full = _gather_tp(dense, mine, groups.tp, read)
            expert_full = _gather_tp(experts, mine, groups.expt_tp, read)
            by_ep_rank = all_gather_bucket([expert_full[t.slot] for t in experts], groups.ep)
            expert_iter = iter(range(len(experts)))
            tensors = []
            for t in bucket:
                if t.is_expert:
                    i = next(expert_iter)
                    tensors += [by_ep_rank[r][i] for r in range(ep)]
                else:
                    tensors.append(full[t.slot])
        tensors = broadcast_bucket(tensors, shapes, bucket[0].dtype, bucket[0].owner, groups.pp, device)
        for (name, split_over), tensor in zip(names, tensors, strict=True):
            mapping, captures = table.resolve(name)
            for hf_name, hf_tensor in zip(mapping.hf_names(captures), mapping.to_hf(tensor, split_over), strict=True):
                if mtp or not bridge.is_mtp_tensor(hf_name):
                    yield hf_name, hf_tensor
