"""Checkpoint tensors that stack one tensor per expert (gpt-oss's ``mlp.experts.gate_up_proj`` [E, hidden, 2 * ffn]).

Mappings speak of one expert at a time, as Megatron holds them (each expert's ``linear_fc1`` is one parameter, and
EP ranks hold different experts). A family whose checkpoints stack its experts declares :class:`ExpertStack` data;
:class:`ExpertStacks` then shows a stacked tensor to the mappings as per-expert tensors (``mlp.experts.3.gate_up_proj``,
read as a slice of the stored tensor: a rank reads only its experts) and stacks per-expert tensors again on
export (:meth:`ExpertStacks.stack`), so converters, the rollout sync and dry runs write the checkpoint's layout.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from converters.mapping import _fill, wildcard_regex


@dataclass(frozen=True)
class ExpertStack:
    """``stacked``: the checkpoint's name pattern (``*`` for the layer); ``per_expert``: the name each expert's
    slice goes by, with one more ``*``, the expert's, at wildcard index ``expert_wildcard``."""

    stacked: str
    per_expert: str
    expert_wildcard: int = 1


class ExpertStacks:
    """The per-expert view of a checkpoint's stacked tensors, ``num_experts`` each (see the module docstring)."""

    def __init__(self, stacks: Sequence[ExpertStack], num_experts: int):
        self.num_experts = num_experts
        self._stacks = [(s, wildcard_regex(s.stacked), wildcard_regex(s.per_expert)) for s in stacks]
        for s in stacks:
            if s.per_expert.count("*") != s.stacked.count("*") + 1:
                raise ValueError(f"{s}: per_expert needs exactly one more wildcard (the expert's) than stacked")

    def split(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """``shapes`` (name -> shape, tuple or ``torch.Size``, kept so) with each stacked tensor as its experts'."""
        out = {}
        for name, shape in shapes.items():
            found = next(((s, m) for s, rx, _ in self._stacks if (m := rx.match(name))), None)
            if found is None:
                out[name] = shape
                continue
            stack, match = found
            if not shape or shape[0] != self.num_experts:
                raise ValueError(f"{name} {tuple(shape)}: expected {self.num_experts} experts stacked on dim 0")
            for expert in range(self.num_experts):
                out[self._per_expert(stack, match.groups(), expert)] = shape[1:]
        return out

    @staticmethod
    def _per_expert(stack: ExpertStack, captures: Sequence[str], expert: int) -> str:
        captures = list(captures)
        captures.insert(stack.expert_wildcard, str(expert))
        return _fill(stack.per_expert, captures)

    def source(self, name: str) -> tuple[str, int] | None:
        """The stacked tensor a per-expert ``name`` is a slice of, and its index there; None for other names."""
        for stack, _, rx in self._stacks:
            if match := rx.match(name):
                captures = list(match.groups())
                expert = int(captures.pop(stack.expert_wildcard))
                return _fill(stack.stacked, captures), expert
        return None

    def stack(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``tensors`` with each stacked tensor's experts gathered into it, yielded when its last expert arrives
        (others pass through in order). Per-expert tensors are copied into the stacked one as they come (they may
        alias a bucket the producer reuses); the held memory is the stacked tensors begun and not yet complete."""
        begun: dict[str, tuple[torch.Tensor, set[int]]] = {}
        for name, tensor in tensors:
            found = self.source(name)
            if found is None:
                yield name, tensor
                continue
            stacked, expert = found
            if stacked not in begun:
                begun[stacked] = (tensor.new_empty(self.num_experts, *tensor.shape), set())
            out, have = begun[stacked]
            if expert in have:
                raise ValueError(f"{name}: exported twice")
            out[expert].copy_(tensor)
            have.add(expert)
            if len(have) == self.num_experts:
                del begun[stacked]
                yield stacked, out
        if begun:
            incomplete = {name: self.num_experts - len(have) for name, (_, have) in begun.items()}
            raise ValueError(f"stacked expert tensors missing experts at the end of the export: {incomplete}")
