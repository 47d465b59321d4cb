"""Context parallelism: which tokens of a micro-batch each CP rank computes, and the way back to whole sequences.

Megatron splits every sequence into ``2*CP`` equal chunks; CP rank ``r`` holds chunks ``r`` and ``2*CP-1-r``, so
causal attention costs every rank the same (its RoPE and our core attention assume this split). A padded
micro-batch [b, s] is one sequence per row; a THD pack [1, t] holds sequences back to back at ``cu_seqlens``.
Every sequence's length must be a multiple of ``2*CP`` (the micro-batch builders align them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup

from parallel.comm import all_gather_with_grad


def load_balanced_positions(length: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions of CP ``rank``'s tokens of a ``length``-token sequence: chunks ``rank`` and ``2cp-1-rank``."""
    chunk = length // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([first, second])


def rank_positions(bounds: list[int], cp: int, rank: int) -> torch.Tensor:
    """Positions along the sequence dimension held by CP ``rank``, for sequences at ``bounds`` (offsets)."""
    spans = list(zip(bounds[:-1], bounds[1:], strict=True))
    for start, end in spans:
        if (end - start) % (2 * cp):
            raise ValueError(f"a sequence of {end - start} tokens does not split into 2 x CP={cp} chunks")
    return torch.cat([start + load_balanced_positions(end - start, cp, rank) for start, end in spans])


@dataclass(frozen=True)
class ContextShard:
    """This CP rank's share of a micro-batch's sequence dimension and how to reassemble per-token outputs."""

    group: ProcessGroup
    mine: torch.Tensor  # positions this rank computes
    order: torch.Tensor  # whole-sequence position -> index into the ranks' outputs concatenated in rank order

    @classmethod
    def of(cls, bounds: list[int], group: ProcessGroup) -> ContextShard:
        cp, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
        every = torch.cat([rank_positions(bounds, cp, r) for r in range(cp)])
        return cls(group, rank_positions(bounds, cp, rank), torch.argsort(every))

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """[..., local positions] from every CP rank -> [..., all positions] in sequence order, differentiably.

        Every CP rank then computes the same loss on whole sequences; the gather's backward sums their gradients,
        which Megatron's CP loss scaling and DP x CP gradient averaging expect (see ``MegatronModel``).
        """
        parts = all_gather_with_grad(local.contiguous(), self.group)
        return torch.cat(parts.unbind(0), dim=-1).index_select(-1, self.order.to(local.device))


def shard_micro_batch(batch: dict, group: ProcessGroup) -> dict:
    """This CP rank's micro-batch: the model inputs and labels cut to its positions, plus the ``ContextShard``
    that :func:`mcore_rl.trainer.packing.rows_of` uses to reassemble outputs. Other entries stay whole."""
    params = batch.get("packed_seq_params")
    length = batch["input_ids"].shape[1]
    bounds = params.cu_seqlens_q.tolist() if params is not None else [0, length]
    shard = ContextShard.of(bounds, group)
    mine = shard.mine.to(batch["input_ids"].device)
    cut = {k: batch[k].index_select(1, mine) for k in ("input_ids", "labels", "position_ids")}
    return batch | cut | {"context_shard": shard}
