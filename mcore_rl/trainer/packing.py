"""Sequence packing: which samples go to which data-parallel rank and micro-batch, and THD micro-batches.

Two constraints shape it. Every rank must run the same number of micro-batches (Megatron's schedule steps all
ranks together), and pipeline stages and ranks advance micro-batch by micro-batch, so the longest one paces
all. The plan therefore balances tokens twice: across ranks (longest-processing-time first, which
bounds the spread by the longest sample) and across each rank's micro-batches (worst-fit decreasing under the
token budget), and uses as few micro-batches as the budget allows.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams


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


def plan_packing(lengths: list[int], max_tokens: int, dp: int, align: int = 1, multiple: int = 1) -> PackingPlan:
    """Assign samples of ``lengths`` tokens to ``dp`` ranks x the fewest equal-count micro-batches of at most
    ``max_tokens`` tokens. ``align``: each sample is padded to a multiple of it (2 x TP x CP for sequence and
    context parallelism). ``multiple``: the micro-batch count is a multiple of it (the interleaved pipeline
    schedule runs micro-batches in groups of PP)."""
    if dp < 1 or align < 1 or multiple < 1:
        raise ValueError(f"dp={dp}, align={align} and multiple={multiple} must be at least 1")
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
    count = math.ceil(count / multiple) * multiple
    while True:  # terminates: with one micro-batch per sample everything fits
        if count > min(len(rank) for rank in per_rank):
            raise ValueError(
                f"{len(lengths)} samples over {dp} data-parallel ranks fill fewer than the {count} micro-batches "
                f"each rank needs (a multiple of {multiple}); give each rank more samples"
            )
        filled = [_fill(rank, count, max_tokens) for rank in per_rank]
        if all(f is not None for f in filled):
            return PackingPlan(filled, aligned, sum(lengths))
        count += multiple


def to_width(value: torch.Tensor, width: int) -> torch.Tensor:
    """A per-position tensor ([N, positions, ...]) right-padded with zeros or cut to ``width`` positions."""
    pad = width - value.shape[1]
    if pad <= 0:
        return value[:, :width]
    return torch.nn.functional.pad(value, (0, 0) * (value.dim() - 2) + (0, pad))


@dataclass(frozen=True)
class Unpack:
    """Where each position of a packed [1, T] tensor sits in the micro-batch's rows [n, width]."""

    rows: torch.Tensor
    cols: torch.Tensor
    shape: tuple[int, int]

    def __call__(self, packed: torch.Tensor) -> torch.Tensor:
        out = packed.new_zeros(self.shape)
        out[self.rows, self.cols] = packed[0]
        return out


def pack_rows(tokens: torch.Tensor, lengths: list[int], indices: list[int], align: int, **extra) -> dict:
    """A THD micro-batch of samples ``indices``: their next-token inputs/labels back to back, [1, T].

    Each sample (``lengths[i]`` real tokens of ``tokens`` [N, S]) contributes ``lengths[i] - 1`` next-token
    positions, padded to a multiple of ``align`` (a kernel's alignment, e.g. TP for sequence parallelism; the
    padding follows the sample, so causal attention keeps it out of the sample's scores). ``cu_seqlens`` keep
    samples from attending to each other. ``extra`` tensors stay per sample: per-position ones ([N, S-1, ...]) cut
    or padded to the longest sample's width, and ``batch["unpack"]`` maps packed model outputs to those rows.
    Everything is built on ``tokens``' device (the model's): TransformerEngine's attention kernels take
    ``cu_seqlens`` only as int32 tensors on the GPU.
    """
    device = tokens.device
    spans = [math.ceil((lengths[i] - 1) / align) * align for i in indices]
    width = max(spans)
    ids, labels, rows, cols = [], [], [], []
    for row, (i, span) in enumerate(zip(indices, spans, strict=True)):
        seq = torch.nn.functional.pad(tokens[i, : lengths[i]], (0, span + 1 - lengths[i]))
        ids.append(seq[:-1])
        labels.append(seq[1:])
        rows.append(torch.full((span,), row, device=device))
        cols.append(torch.arange(span, device=device))
    offsets = torch.tensor([0, *itertools.accumulate(spans)], dtype=torch.int32, device=device)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=offsets, cu_seqlens_kv=offsets, max_seqlen_q=width, max_seqlen_kv=width
    )
    positions = torch.cat(cols)
    batch = {
        "input_ids": torch.cat(ids)[None],
        "labels": torch.cat(labels)[None],
        "position_ids": positions[None],
        "packed_seq_params": params,
        "unpack": Unpack(torch.cat(rows), positions, (len(indices), width)),
    }
    for name, value in extra.items():
        value = value[indices]
        batch[name] = to_width(value, width) if value.dim() >= 2 else value
    return batch


def rows_of(batch: dict, values: torch.Tensor) -> torch.Tensor:
    """Per-token model outputs in the micro-batch's row layout: whole sequences gathered from the context-parallel
    ranks (see :mod:`parallel.context`), THD packs unpacked to sample rows; identity for plain padded batches."""
    if "context_shard" in batch:
        values = batch["context_shard"].gather(values)
    return batch["unpack"](values) if "unpack" in batch else values


def prompt_groups(tokens: torch.Tensor, prompt_lengths: list[int]) -> list[list[int]]:
    """Runs of consecutive rows of ``tokens`` that share their prompt (its length and tokens): GRPO's samples of
    one prompt, in the order the driver lays them out."""
    groups: list[list[int]] = []
    for i, n in enumerate(prompt_lengths):
        first = groups[-1][0] if groups else None
        if first is not None and prompt_lengths[first] == n and torch.equal(tokens[first, :n], tokens[i, :n]):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def shared_prompt_tokens(lengths: list[int], prompt_lengths: list[int], group: list[int]) -> int:
    """Positions a group takes in a shared-prompt row: its prompt once, then each response but its last token."""
    prompt = prompt_lengths[group[0]]
    return prompt + sum(max(0, lengths[i] - prompt - 1) for i in group)


def _shared_prompt_layout(tokens, lengths, prompt_lengths, groups, row_of: dict[int, int]):
    """Where :func:`share_prompt_rows` puts each group's prompt and each response: their ids and positions, the
    attention spans ``(query start, end, visible prompt start, prompt length)``, the scored positions and their
    labels and places in the unpacked [n, width] grid, each group's start, and the row's used length."""
    device = tokens.device
    ids, positions, spans = [], [], []
    index, labels, rows, cols, group_starts = [], [], [], [], []
    offset = 0
    for group in groups:
        prompt = prompt_lengths[group[0]]
        group_starts.append(offset)
        ids.append(tokens[group[0], :prompt])
        positions.append(torch.arange(prompt, device=device))
        spans.append((offset, offset + prompt, offset, 0))
        prompt_start, offset = offset, offset + prompt
        for i in group:
            count = lengths[i] - prompt
            if count <= 0:
                continue
            ids.append(tokens[i, prompt : lengths[i] - 1])
            positions.append(torch.arange(prompt, lengths[i] - 1, device=device))
            spans.append((offset, offset + count - 1, prompt_start, prompt))
            index += [prompt_start + prompt - 1, *range(offset, offset + count - 1)]
            labels.append(tokens[i, prompt : lengths[i]])
            rows += [row_of[i]] * count
            cols += range(prompt - 1, prompt - 1 + count)
            offset += count - 1
    return ids, positions, spans, index, labels, rows, cols, group_starts, offset


def _shared_prompt_mask(spans, group_starts: list[int], offset: int, align: int, device):
    """The keys each position of the row sees, relative to its group's start ([T, longest group], True: seen;
    a padding position sees itself only), the groups' bounds, the longest group and the padded length T."""
    total = offset + (-offset % align)
    bounds = [*group_starts, offset] + ([total] if total > offset else [])
    segment = max(b - a for a, b in itertools.pairwise(bounds))
    visible = torch.zeros(total, segment, dtype=torch.bool, device=device)
    for a, b in itertools.pairwise(bounds):
        visible[a:b, : b - a] = torch.eye(b - a, dtype=torch.bool, device=device)
    for start, end, prompt_start, prompt in spans:
        own = torch.ones(end - start, end - start, dtype=torch.bool, device=device).tril()
        visible[start:end, start - prompt_start : end - prompt_start] = own
        visible[start:end, :prompt] = True
    return visible, bounds, segment, total


def share_prompt_rows(
    tokens: torch.Tensor,
    lengths: list[int],
    prompt_lengths: list[int],
    groups: list[list[int]],
    align: int,
    **extra: torch.Tensor,
) -> dict:
    """A micro-batch of prompt ``groups`` (sample indices sharing a prompt) in one row [1, T] that holds each
    prompt once.

    A group's prompt is followed by each response without its last token (a label only); position ids restart
    after the prompt for every response, and the ``attention_mask`` lets a response see its prompt and itself,
    causally, so every position sees exactly the context it has in its own padded row. Groups never see each
    other: ``packed_seq_params`` (format ``sbhd``, so Megatron applies no THD handling) bounds them, and the mask
    [1, 1, T, longest group] (True: masked, Megatron's convention) gives each position's keys relative to its
    group's start (:class:`models.attention.SDPAttention` attends group by group). The model scores only the
    positions that predict response tokens (``output_index``; the prompt's last position predicts every
    response's first token) against ``labels``; ``batch["unpack"]`` puts those scores at the samples' next-token
    positions [n, width] like :func:`pack_rows`.
    ``extra`` tensors are per sample (per-position ones cut or padded to ``width``). The row is padded to a multiple
    of ``align``; a padding position sees itself only.
    """
    device = tokens.device
    samples = [i for group in groups for i in group]
    layout = _shared_prompt_layout(tokens, lengths, prompt_lengths, groups, {i: row for row, i in enumerate(samples)})
    ids, positions, spans, index, labels, rows, cols, group_starts, offset = layout
    visible, bounds, segment, total = _shared_prompt_mask(spans, group_starts, offset, align, device)
    offsets = torch.tensor(bounds, dtype=torch.int32, device=device)
    width = max(lengths[i] for i in samples) - 1
    batch = {
        "input_ids": torch.nn.functional.pad(torch.cat(ids), (0, total - offset))[None],
        "position_ids": torch.nn.functional.pad(torch.cat(positions), (0, total - offset))[None],
        "attention_mask": ~visible[None, None],
        "packed_seq_params": PackedSeqParams(
            qkv_format="sbhd",
            cu_seqlens_q=offsets,
            cu_seqlens_kv=offsets,
            max_seqlen_q=segment,
            max_seqlen_kv=segment,
        ),
        "output_index": torch.tensor(index, dtype=torch.long, device=device),
        "labels": torch.cat(labels)[None],
        "unpack": Unpack(torch.tensor(rows, device=device), torch.tensor(cols, device=device), (len(samples), width)),
    }
    for name, value in extra.items():
        value = value[samples]
        batch[name] = to_width(value, width) if value.dim() >= 2 else value
    return batch


def plan_shared_prompts(
    tokens: torch.Tensor, lengths: list[int], prompt_lengths: list[int], max_tokens: int, dp: int = 1, multiple: int = 1
) -> list[list[list[list[int]]]]:
    """Whole prompt groups (:func:`prompt_groups`) for ``dp`` ranks x the same number of micro-batches of at most
    ``max_tokens`` shared-prompt positions (a larger group gets a micro-batch of its own), token-balanced like
    :func:`plan_packing`: ``plan[rank][micro_batch]`` = that micro-batch's groups of sample indices."""
    groups = prompt_groups(tokens, prompt_lengths)
    sizes = [shared_prompt_tokens(lengths, prompt_lengths, g) for g in groups]
    plan = plan_packing(sizes, max(max_tokens, *sizes), dp, multiple=multiple)
    return [[[groups[g] for g in mb] for mb in rank] for rank in plan.ranks]
