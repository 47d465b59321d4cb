"""Parallel layout of one Megatron role (trainer or reference model) and its up-front validation.

Validation runs before any process group or model is built, so a wrong layout costs a second, not a job
start-up. Every error names the field and what would fix it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Megatron parallel sizes; ``dp`` is derived from the world size.

    Attributes:
        tp: tensor-parallel size (attention heads, MLP and vocabulary are split over it).
        pp: pipeline-parallel size (layers are split over it).
        vpp: virtual pipeline stages per pipeline rank (interleaved schedule); 1 disables it.
        ep: expert-parallel size (MoE experts are split over it).
        etp: expert tensor-parallel size; ``None`` means the same as ``tp``.
        cp: context-parallel size (the sequence is split over it).
        sequence_parallel: shard activations of norms/dropout along the sequence over the TP group.
        first_stage_layers / last_stage_layers: layers on the first / last pipeline stage when the layer count
            does not split evenly (DeepSeek-V3's 61 over PP=8: ``last_stage_layers=5``, 8 on each other stage);
            ``None``: an even share. The remaining layers split evenly over the other stages.
    """

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: int | None = None
    cp: int = 1
    sequence_parallel: bool = False
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "vpp", "ep", "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"parallel.{name}={value!r}: expected a positive integer")
        if self.etp is not None and (not isinstance(self.etp, int) or self.etp < 1):
            raise ValueError(f"parallel.etp={self.etp!r}: expected a positive integer or None (same as tp)")
        if self.vpp > 1 and self.pp == 1:
            raise ValueError(f"parallel.vpp={self.vpp} needs parallel.pp > 1; set vpp=1 or raise pp")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("parallel.sequence_parallel=True needs parallel.tp > 1; set it to False")
        for name in ("first_stage_layers", "last_stage_layers"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"parallel.{name}={value!r}: expected a positive integer or None (an even share)")
            if self.pp == 1 or self.vpp > 1:
                raise ValueError(f"parallel.{name} needs pp > 1 and vpp = 1 (uneven stages are not interleaved)")

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def model_parallel_size(self) -> int:
        """Ranks holding one full copy of the dense model."""
        return self.tp * self.pp * self.cp

    def dp(self, world_size: int) -> int:
        """Data-parallel size for ``world_size`` ranks (checks divisibility)."""
        self.validate_world(world_size)
        return world_size // self.model_parallel_size

    def validate_world(self, world_size: int) -> None:
        mp = self.model_parallel_size
        if world_size % mp:
            raise ValueError(
                f"world size {world_size} is not divisible by tp*pp*cp = {self.tp}*{self.pp}*{self.cp} = {mp}; "
                f"use a device count that is a multiple of {mp} or shrink the layout"
            )
        expert_mp = self.expert_tp * self.ep * self.pp
        if world_size % expert_mp:
            raise ValueError(
                f"world size {world_size} is not divisible by etp*ep*pp = "
                f"{self.expert_tp}*{self.ep}*{self.pp} = {expert_mp}; lower parallel.ep or parallel.etp"
            )

    def validate_model(
        self,
        *,
        num_layers: int,
        num_attention_heads: int,
        num_query_groups: int,
        vocab_size: int,
        num_experts: int | None = None,
    ) -> None:
        """Check that the model's shapes split evenly over this layout."""
        self.stage_layers(num_layers)
        heads = {"num_attention_heads": num_attention_heads, "num_key_value_heads": num_query_groups}
        for name, count in heads.items():
            if count % self.tp:  # the TP sizes offered split both head counts
                raise ValueError(
                    f"{name}={count} is not divisible by tp={self.tp}; choose tp among "
                    f"{divisors(math.gcd(*heads.values()))}"
                )
        if vocab_size < self.tp:
            raise ValueError(f"vocab_size={vocab_size} is smaller than tp={self.tp}")
        if num_experts is None:
            if self.ep > 1:
                raise ValueError(f"parallel.ep={self.ep} but the model has no experts; set ep=1")
        elif num_experts % self.ep:
            raise ValueError(
                f"num_experts={num_experts} is not divisible by ep={self.ep}; choose ep among {divisors(num_experts)}"
            )
        if num_experts is not None and self.tp > 1 and not self.sequence_parallel:
            raise ValueError("MoE models with tp > 1 need parallel.sequence_parallel=True (Megatron requirement)")

    def stage_layers(self, num_layers: int) -> list[int]:
        """Layers on each pipeline stage (all virtual stages of a rank together); raises if they do not split."""
        fixed = {
            i: n for i, n in ((0, self.first_stage_layers), (self.pp - 1, self.last_stage_layers)) if n is not None
        }
        rest, stages = num_layers - sum(fixed.values()), (self.pp - len(fixed)) * self.vpp
        if not fixed and rest % stages:
            raise ValueError(
                f"num_layers={num_layers} is not divisible by pp*vpp = {self.pp}*{self.vpp} = {stages}; "
                f"choose pp/vpp whose product divides {num_layers}, or set parallel.first_stage_layers/"
                "last_stage_layers"
            )
        if fixed and not (rest >= stages and (rest % stages == 0 if stages else rest == 0)):
            raise ValueError(
                f"num_layers={num_layers}: first_stage_layers={self.first_stage_layers}, last_stage_layers="
                f"{self.last_stage_layers} leave {rest} layers for the other {stages} stage(s), which must split "
                "them evenly (at least one each)"
            )
        per_rank = rest // stages * self.vpp if stages else 0
        return [fixed.get(i, per_rank) for i in range(self.pp)]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
