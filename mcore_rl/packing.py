"""Sequence-packing plan: which samples go to which data-parallel rank and micro-batch.

Two constraints shape it. Every rank must run the same number of micro-batches (Megatron's schedule steps all
ranks together), and micro-batches share one shape across pipeline stages, so the longest micro-batch sets the
compute of all. The plan therefore balances tokens twice: across ranks (longest-processing-time first, which
bounds the spread by the longest sample) and across each rank's micro-batches (worst-fit decreasing under the
token budget), and uses as few micro-batches as the budget allows.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class PackingPlan:
    ranks: list[list[list[int]]]  # ranks[r][m] = sample indices of rank r's micro-batch m
    lengths: list[int]  # aligned token count of each sample
    num_tokens: int  # real tokens, before alignment

    def micro_batch_tokens(self) -> list[list[int]]:
        return [[sum(self.lengths[i] for i in mb) for mb in rank] for rank in self.ranks]

    @property
    def utilization(self) -> float:
        """Real tokens / tokens computed when every micro-batch is padded to the longest one."""
        tokens = self.micro_batch_tokens()
        longest = max(max(rank) for rank in tokens)
        return self.num_tokens / (longest * sum(len(rank) for rank in tokens))


def _lpt(items: list[tuple[int, int]], bins: int) -> list[list[int]]:
    """Longest first, each into the lightest bin: loads differ by at most the largest item."""
    heap = [(0, b) for b in range(bins)]
    out: list[list[int]] = [[] for _ in range(bins)]
    for length, index in items:
        load, b = heapq.heappop(heap)
        out[b].append(index)
        heapq.heappush(heap, (load + length, b))
    return out


def _fill(items: list[tuple[int, int]], bins: int, budget: int) -> list[list[int]] | None:
    """Worst-fit decreasing into ``bins`` micro-batches of at most ``budget`` tokens; None if it does not fit."""
    loads = [0] * bins
    out: list[list[int]] = [[] for _ in range(bins)]
    for length, index in items:
        b = min(range(bins), key=loads.__getitem__)
        if loads[b] + length > budget:
            return None
        loads[b] += length
        out[b].append(index)
    return out


def plan_packing(lengths: list[int], max_tokens: int, dp: int, align: int = 1) -> PackingPlan:
    """Assign samples of ``lengths`` tokens to ``dp`` ranks x the fewest equal-count micro-batches of at most
    ``max_tokens`` tokens. ``align``: each sample is padded to a multiple of it (2 x TP x CP for sequence and
    context parallelism)."""
    if dp < 1 or align < 1:
        raise ValueError(f"dp={dp} and align={align} must be at least 1")
    aligned = [math.ceil(n / align) * align for n in lengths]
    for i, n in enumerate(aligned):
        if n > max_tokens:
            raise ValueError(
                f"sample {i} has {lengths[i]} tokens ({n} aligned), more than max_tokens={max_tokens}: "
                "raise the packing budget or shorten the prompt/response limits"
            )
    items = sorted(((n, i) for i, n in enumerate(aligned)), reverse=True)
    ranks = _lpt(items, dp)
    per_rank = [sorted(((aligned[i], i) for i in rank), reverse=True) for rank in ranks]
    count = max(1, max(math.ceil(sum(n for n, _ in rank) / max_tokens) for rank in per_rank))
    while True:  # terminates: with one micro-batch per sample everything fits
        filled = [_fill(rank, count, max_tokens) for rank in per_rank]
        if all(f is not None for f in filled):
            return PackingPlan(filled, aligned, sum(lengths))
        count += 1
