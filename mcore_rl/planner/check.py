"""The full mapping of a model at a layout, checked on meta tensors: every Megatron shard of every rank resolves
to exactly one mapping, its HF tensors exist in transformers' model with the shapes the mapping produces, and
every HF tensor comes from exactly one Megatron parameter. Then the rollout sync's plan for the same layout:
the gather buckets of :func:`converters.stream.export_hf` and the send buckets of :mod:`mcore_rl.trainer.sync`, by
the same functions the real sync runs."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from converters.mapping import MappingTable, Target, check_tensors, unexpected_tensors
from converters.plan import LocalParam, global_expert_name
from converters.stream import bucket_layout, buckets, export_plan, stage_meta
from converters.transforms import full_shape
from mcore_rl.trainer.sync import send_buckets
from parallel.config import ParallelConfig


@dataclass(frozen=True)
class MappingReport:
    hf_params: int  # elements of every HF tensor (tied copies once)
    engine_params: int  # of which the rollout engines receive without drafting (not the MTP layers')
    exported_params: int  # elements of the HF tensors the Megatron model exports (equals hf_params when complete)
    stage_params: list[int]  # elements one device of each pipeline stage holds (its shards, tied copies included)
    stage_expert_params: list[int]  # of which expert weights (sharded over EP x expert-TP)
    errors: list[str]


@dataclass(frozen=True)
class SyncPlan:
    gather_buckets: int  # collective rounds of the export (per pipeline owner and dtype)
    send_buckets: int  # loads into the engine
    tensors_per_send_bucket: tuple[int, int, int]  # min, median, max
    largest_send_bytes: int
    total_bytes: int  # what each engine receives per sync (HF tensors, full size)


def _split_over(parallel: ParallelConfig, lp: LocalParam) -> int:
    return parallel.expert_tp if lp.is_expert else parallel.tp


def _num_local(bridge, parallel: ParallelConfig) -> int:
    return (bridge.num_experts or 0) // parallel.ep


def check_mappings(
    bridge, parallel: ParallelConfig, stages: list[list[LocalParam]], hf: dict[str, torch.Size]
) -> MappingReport:
    """Resolve every Megatron parameter of every rank against ``hf`` (:func:`mcore_rl.planner.meta.hf_tensors`)
    with the check the trainer and the converters run on checkpoints, plus what only a whole model shows: TP axes
    as Megatron partitions them, and HF tensors exported by more than one parameter."""
    table = MappingTable(bridge.mappings())
    num_local = _num_local(bridge, parallel)
    errors: list[str] = []
    targets, seen = [], set()
    for lp in (lp for stage in stages for lp in stage):
        if lp.slot in seen:  # held by several stages (the embedding an MTP stage keeps a copy of): one target
            continue
        seen.add(lp.slot)
        split_over = _split_over(parallel, lp)
        want = tuple(full_shape(lp.param.shape, lp.tp_axis, split_over))
        names = [global_expert_name(lp.slot, r, num_local) for r in range(parallel.ep)] if lp.is_expert else [lp.slot]
        for name in names:
            targets.append(Target(name, want, split_over))
            with contextlib.suppress(KeyError):  # an unmapped name is check_tensors' to report
                if (axis := table.resolve(name)[0].tp_axis) != lp.tp_axis:
                    errors.append(f"{name}: mapping TP axis {axis}, Megatron partitions dim {lp.tp_axis}")
    shapes = {name: tuple(shape) for name, shape in hf.items()}
    check = check_tensors(table, targets, shapes)
    errors += check.problems + unexpected_tensors(shapes, check.consumed, bridge.ignores)
    errors += [
        f"HF tensor {n} is exported by several parameters: {s}"
        for n, s in sorted(check.exporters.items())
        if len(s) > 1
    ]
    return MappingReport(
        hf_params=sum(shape.numel() for n, shape in hf.items() if not bridge.ignores(n)),
        engine_params=sum(s.numel() for n, s in hf.items() if not bridge.ignores(n) and not bridge.is_mtp_tensor(n)),
        exported_params=sum(hf[n].numel() * len(s) for n, s in check.exporters.items()),
        stage_params=[sum(lp.param.numel() for lp in stage if _is_param(lp)) for stage in stages],
        stage_expert_params=[sum(lp.param.numel() for lp in stage if lp.is_expert) for stage in stages],
        errors=errors,
    )


def _is_param(lp: LocalParam) -> bool:
    return isinstance(lp.param, torch.nn.Parameter)


def sync_plan(
    bridge, parallel: ParallelConfig, stages: list[list[LocalParam]], bucket_bytes: int, mtp: bool = False
) -> SyncPlan:
    """How the rollout sync moves this model: the export's buckets and the engine loads, on meta tensors; ``mtp``:
    the MTP layers too (engines that draft with them), as :func:`converters.stream.export_hf` sends them."""
    table = MappingTable(bridge.mappings())
    num_local = _num_local(bridge, parallel)
    stage_metas = [stage_meta({lp.slot: lp for lp in stage}) for stage in stages]
    tasks = export_plan(stage_metas, table, num_local, mtp)
    gathers = list(buckets(tasks, bucket_bytes, parallel.tp, parallel.expert_tp, parallel.ep))

    exports: dict[tuple, list[torch.Tensor]] = {}  # one export per mapping and shape: layers and experts repeat

    def exported():
        for bucket in gathers:
            names, shapes = bucket_layout(bucket, num_local, parallel.tp, parallel.expert_tp, parallel.ep)
            for (name, split_over), shape in zip(names, shapes, strict=True):
                mapping, captures = table.resolve(name)
                key = (mapping, tuple(shape), split_over, bucket[0].dtype)
                if key not in exports:
                    exports[key] = mapping.to_hf(torch.empty(shape, dtype=bucket[0].dtype, device="meta"), split_over)
                for hf_name, tensor in zip(mapping.hf_names(captures), exports[key], strict=True):
                    if mtp or not bridge.is_mtp_tensor(hf_name):
                        yield hf_name, tensor

    sends = [[t.numel() * t.element_size() for _, t in b] for b in send_buckets(exported(), bucket_bytes)]
    counts = sorted(len(b) for b in sends)
    return SyncPlan(
        gather_buckets=len(gathers),
        send_buckets=len(sends),
        tensors_per_send_bucket=(counts[0], counts[len(counts) // 2], counts[-1]),
        largest_send_bytes=max(sum(b) for b in sends),
        total_bytes=sum(sum(b) for b in sends),
    )
