"""The dry run behind ``python -m mcore_rl.planner`` (:mod:`mcore_rl.planner.__main__`): mapping check, sync
plan and memory plan of a run config at full size, printed (and written as JSON)."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch

from mcore_rl.config.schema import SCORING_ROLES
from mcore_rl.planner.check import check_mappings, sync_plan
from mcore_rl.planner.memory import describe, device_bytes, layout_text, plan_memory, remedies
from mcore_rl.planner.meta import hf_tensors, pipeline_stages
from mcore_rl.planner.params import Architecture, stage_params
from mcore_rl.planner.steptime import DEVICES, DeviceSpec, Lengths, step_time
from mcore_rl.planner.steptime import describe as describe_time
from models.registry import get_bridge
from parallel.config import ParallelConfig

GB = 1e9


def plan_role(bridge, parallel, world: int, bucket_bytes: int, hf: dict[str, torch.Size], drafts: bool = False) -> dict:
    """Mapping check and sync plan of one Megatron role's layout (bf16 weights, as trained on GPUs), and the memory
    planner's parameter counts checked against the built stages; ``drafts``: the engines draft with the MTP
    layers, which the sync sends too."""
    start = time.perf_counter()
    stages = pipeline_stages(bridge, parallel, world)
    report = check_mappings(bridge, parallel, stages, hf)
    sync = sync_plan(bridge, parallel, stages, bucket_bytes, mtp=drafts)
    built = list(zip(report.stage_params, report.stage_expert_params, strict=True))
    counted = stage_params(Architecture.from_bridge(bridge), parallel)
    for i, (params, (megatron, megatron_experts)) in enumerate(zip(counted, built, strict=True)):
        if params != (megatron, megatron_experts):
            report.errors.append(
                f"stage {i}: the memory planner counts {params} (parameters, expert parameters) per device, the "
                f"built model holds {(megatron, megatron_experts)}"
            )
    return {
        "layout": dataclasses.asdict(parallel),
        "data_parallel": parallel.dp(world),
        "stage_layers": parallel.stage_layers(bridge.hf["num_hidden_layers"]),
        "mtp_layers": bridge.num_mtp_layers,  # on the last stage
        "stage_params": report.stage_params,
        "stage_expert_params": report.stage_expert_params,
        "hf_params": report.hf_params,
        "engine_params": report.hf_params if drafts else report.engine_params,
        "exported_params": report.exported_params,
        "errors": report.errors,
        "sync": dataclasses.asdict(sync),
        "seconds": round(time.perf_counter() - start, 1),
    }


def _print(name: str, role: dict) -> None:
    layout = layout_text(ParallelConfig(**role["layout"]))
    print(f"{name}: {layout}, data parallel {role['data_parallel']} ({role['seconds']} s)")
    stages = len(role["stage_layers"])
    for i, (layers, params, experts) in enumerate(
        zip(role["stage_layers"], role["stage_params"], role["stage_expert_params"], strict=True)
    ):
        mtp = f" + {role['mtp_layers']} MTP" if role["mtp_layers"] and i == stages - 1 else ""
        print(
            f"  stage {i}: {layers}{mtp} layers, {params / GB:.3f} B params per device "
            f"({experts / GB:.3f} B expert), {2 * params / GB:.2f} GB bf16 weights"
        )
    sync = role["sync"]
    print(
        f"  rollout sync: {sync['total_bytes'] / GB:.1f} GB per engine in {sync['send_buckets']} loads "
        f"(tensors per load min/median/max {sync['tensors_per_send_bucket']}, largest "
        f"{sync['largest_send_bytes'] / GB:.2f} GB), {sync['gather_buckets']} gather rounds"
    )
    for error in role["errors"]:
        print(f"  error: {error}")


def dry_run(
    config,
    device_memory_gb: float | None,
    json_path: Path | None,
    device: DeviceSpec = DEVICES["h100"],
    lengths: tuple[float, float, float] | None = None,
) -> int:
    """Print the report of ``config`` (a validated RunConfig), with its step time on ``device``s at ``lengths``
    (mean prompt, mean response, longest response; default: from the config's limits); 1 if the mapping check
    failed or it does not fit."""
    m, world = config.models, config.runtime_args.trainer_devices
    bridge = get_bridge(m.policy_trainer.load)
    hf = hf_tensors(bridge.hf)
    print(
        f"{bridge.architecture} ({bridge.model_type}) from {m.policy_trainer.load}: "
        f"{sum(s.numel() for s in hf.values()) / GB:.2f} B params"
    )
    rt = config.runtime_args
    shown = ("trainer", "reward_model", "judge") if rt.colocated else ("trainer", "rollout", "reward_model", "judge")
    pools = ", ".join(f"{pool} {len(rt.devices(pool))}" for pool in shown if rt.devices(pool))
    pools = ("colocated: the engines on the trainer's; " if rt.colocated else "") + pools
    print(f"{rt.num_devices} devices ({pools}), rollout tensor parallel {m.policy.rollout.tensor_parallel_size}")
    report = {"model": m.policy_trainer.load, "devices": world, "hf_tensors": len(hf), "roles": {}}
    bucket = m.policy.sync.bucket_bytes
    drafts = bool(m.policy.rollout.speculative_tokens)
    report["roles"]["policy_trainer"] = plan_role(bridge, m.policy_trainer.parallel, world, bucket, hf, drafts)
    for role in SCORING_ROLES:  # the other Megatron roles, where their model or layout differs from the trainer's
        section, same_model = getattr(m, role), getattr(m, role).load == m.policy_trainer.load
        same_layout = section.parallel == m.policy_trainer.parallel and rt.world(role) == world
        if m.uses(role) and not (same_model and same_layout):
            other = get_bridge(section.load)
            tensors = hf if same_model else hf_tensors(other.hf)
            report["roles"][role] = plan_role(other, section.parallel, rt.world(role), bucket, tensors)
    for name, role in report["roles"].items():
        _print(name, role)
    if device_memory_gb:
        config.runtime_device_memory_gb = device_memory_gb
    memory, fits = device_bytes(config), True
    if memory:
        plan = plan_memory(config, memory)
        fits = plan.fits
        print("\n".join(describe(plan, m.policy.rollout.max_model_len) + ([] if fits else remedies(config, memory))))
        report["memory"] = dataclasses.asdict(plan) | {"fits": fits}
    else:
        print("memory: not planned (no GPU here; give runtime_device_memory_gb or --device-memory-gb)")
    policy = m.policy
    shape = Lengths(*lengths) if lengths else Lengths(
        policy.max_prompt_tokens / 2, policy.rollout.train.max_new_tokens / 2, policy.rollout.train.max_new_tokens
    )  # fmt: skip
    timed = step_time(config, device, shape, Architecture.from_bridge(bridge))
    print(f"lengths: prompt {shape.prompt:g}, response {shape.response:g} (longest {shape.longest:g}) tokens")
    print("\n".join(describe_time(timed, device)))
    report["step_time"] = dataclasses.asdict(timed) | {"device": device.name, "lengths": dataclasses.asdict(shape)}
    if json_path:
        json_path.write_text(json.dumps(report, indent=1) + "\n")
    return 1 if not fits or any(role["errors"] for role in report["roles"].values()) else 0
