"""Parameter mappings as data: which HF tensors make one Megatron parameter, and along which axis TP splits it.

A model family declares a list of these (see ``models/``); the same list drives checkpoint loading, export to
HF (converter CLIs) and the in-memory sync to the rollout engine. Patterns use ``*`` for an integer index (layer,
then expert); captures are substituted into the HF names in order. Names are *global*: layer and expert indices
are model-wide, never PP- or EP-local (see :mod:`converters.plan`).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from compat.torch import cat
from converters import transforms


def wildcard_regex(pattern: str) -> re.Pattern:
    """A name pattern as a regex whose groups capture its ``*`` indices."""
    return re.compile("^" + re.escape(pattern).replace(r"\*", r"(\d+)") + "$")


def _fill(pattern: str, captures: Sequence[str]) -> str:
    parts = pattern.split("*")
    if len(parts) - 1 != len(captures):
        raise ValueError(f"pattern {pattern!r} has {len(parts) - 1} wildcards, got captures {list(captures)}")
    return "".join(p + c for p, c in zip(parts, [*captures, ""], strict=True))


@dataclass(frozen=True)
class Mapping:
    """Base kind: one HF tensor is one Megatron tensor.

    Attributes:
        megatron: Megatron parameter name pattern.
        hf: HF tensor name patterns, in the order ``to_megatron``/``to_hf`` use them.
        tp_axis: tensor dim split over the TP (or, for experts, expert-TP) group; ``None`` = replicated.
        export: whether this parameter is written on export (``False`` for a tied output layer).
    """

    megatron: str
    hf: tuple[str, ...]
    tp_axis: int | None = None
    export: bool = True

    def hf_names(self, captures: Sequence[str]) -> tuple[str, ...]:
        return tuple(_fill(p, captures) for p in self.hf)

    def to_megatron(self, hf: Sequence[torch.Tensor], tp: int, full_shape: torch.Size) -> torch.Tensor:
        """HF tensors -> full Megatron tensor (whose TP chunks are the shards)."""
        return hf[0]

    def to_hf(self, full: torch.Tensor, tp: int) -> tuple[torch.Tensor, ...]:
        """Full Megatron tensor -> HF tensors, in ``hf`` order."""
        return (full,)


def Direct(megatron: str, hf: str, tp_axis: int | None = None) -> Mapping:  # noqa: N802 - reads as a kind
    return Mapping(megatron, (hf,), tp_axis)


@dataclass(frozen=True)
class Vocab(Mapping):
    """Embedding or output layer: TP splits the vocabulary, which Megatron pads to a TP-friendly multiple.

    HF names after the first are copies of it (DeepSeek-V3's MTP layers keep their own copy of the shared embedding
    and head): loaded only when equal to the first, exported to each."""

    vocab_size: int = 0
    tp_axis: int | None = 0

    def to_megatron(self, hf, tp, full_shape):
        if not hf[0].is_meta and (
            differ := [n for n, t in zip(self.hf[1:], hf[1:], strict=True) if not torch.equal(t, hf[0])]
        ):
            raise ValueError(
                f"{differ} differ from {self.hf[0]}: the model shares one tensor where the checkpoint has copies"
            )
        return transforms.pad_vocab(hf[0], full_shape[0])

    def to_hf(self, full, tp):
        cut = full[: self.vocab_size]
        return (cut, *(cut.clone() for _ in self.hf[1:]))


@dataclass(frozen=True)
class QKV(Mapping):
    """Separate HF q/k/v projections (weight or bias) -> Megatron ``linear_qkv``, interleaved per query group."""

    num_attention_heads: int = 0
    num_query_groups: int = 0
    head_dim: int = 0
    tp_axis: int | None = 0

    def to_megatron(self, hf, tp, full_shape):
        return transforms.merge_qkv(*hf, self.num_query_groups)

    def to_hf(self, full, tp):
        return transforms.split_qkv(full, self.num_attention_heads, self.num_query_groups, self.head_dim)


@dataclass(frozen=True)
class GatedQKV(QKV):
    """``q_proj`` holding each head's queries then its output gate (Qwen3-Next), and k/v -> Megatron's
    ``linear_qkv`` with ``attention_output_gate``: per query group ``[q heads | gate heads | k | v]``."""

    def to_megatron(self, hf, tp, full_shape):
        return transforms.merge_gated_qkv(*hf, self.num_attention_heads, self.num_query_groups)

    def to_hf(self, full, tp):
        return transforms.split_gated_qkv(full, self.num_attention_heads, self.num_query_groups, self.head_dim)


@dataclass(frozen=True)
class PerRankParts(Mapping):
    """HF tensors whose rows are parts of ``sizes`` (one tuple per tensor: Gated DeltaNet's ``conv1d``, ``[q | k | v]``
    channels; Qwen3.5's ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``) -> a Megatron tensor holding on
    each TP rank its share of every part, in order."""

    sizes: tuple[tuple[int, ...], ...] = ()
    tp_axis: int | None = 0

    def to_megatron(self, hf, tp, full_shape):
        parts = [part for tensor, sizes in zip(hf, self.sizes, strict=True) for part in tensor.split(sizes)]
        return transforms.merge_per_rank(parts, tp)

    def to_hf(self, full, tp):
        parts = iter(transforms.split_per_rank(full, [n for sizes in self.sizes for n in sizes], tp))
        return tuple(cat([next(parts) for _ in sizes]) for sizes in self.sizes)


@dataclass(frozen=True)
class GatedDeltaInProj(Mapping):
    """Qwen3-Next's ``in_proj_qkvz`` and ``in_proj_ba``, each grouped by key head (``[q k v z]`` of one key head's
    value heads, then the next; ``[b a]`` likewise) -> Megatron's ``in_proj``: ``[q | k | v | z | b | a]`` of its heads
    on each TP rank."""

    key_heads: int = 0
    value_heads: int = 0
    key_dim: int = 0
    value_dim: int = 0
    tp_axis: int | None = 0

    def _sizes(self) -> tuple[list[int], list[int]]:
        """Per key head: q, k, v, z rows; b, a rows."""
        per = self.value_heads // self.key_heads
        return [self.key_dim, self.key_dim, per * self.value_dim, per * self.value_dim], [per, per]

    def to_megatron(self, hf, tp, full_shape):
        parts = []
        for tensor, sizes in zip(hf, self._sizes(), strict=True):
            grouped = tensor.reshape(self.key_heads, sum(sizes), *tensor.shape[1:])
            parts += [p.reshape(-1, *tensor.shape[1:]) for p in grouped.split(sizes, dim=1)]
        return transforms.merge_per_rank(parts, tp)

    def to_hf(self, full, tp):
        qkvz, ba = self._sizes()
        parts = transforms.split_per_rank(full, [self.key_heads * n for n in qkvz + ba], tp)
        rest = full.shape[1:]
        grouped = [p.reshape(self.key_heads, -1, *rest) for p in parts]
        return (
            cat(grouped[:4], dim=1).reshape(-1, *rest),
            cat(grouped[4:], dim=1).reshape(-1, *rest),
        )


@dataclass(frozen=True)
class GatedMLP(Mapping):
    """HF gate_proj/up_proj -> Megatron ``linear_fc1`` holding ``[gate_i; up_i]`` on TP rank i."""

    tp_axis: int | None = 0

    def to_megatron(self, hf, tp, full_shape):
        return transforms.merge_gated(hf[0], hf[1], tp)

    def to_hf(self, full, tp):
        return transforms.split_gated(full, tp)


@dataclass(frozen=True)
class Transposed(Mapping):
    """An HF tensor stored as ``x @ W`` multiplies it ([in, out], gpt-oss's experts) -> Megatron's [out, in]."""

    def to_megatron(self, hf, tp, full_shape):
        return hf[0].transpose(0, 1)

    def to_hf(self, full, tp):
        return (full.transpose(0, 1),)


@dataclass(frozen=True)
class InterleavedGatedMLP(Mapping):
    """One HF tensor whose outputs alternate gate and up (gpt-oss's ``gate_up_proj`` [in, 2 * ffn] and its bias
    [2 * ffn]: gate at even, up at odd outputs) -> Megatron's ``linear_fc1`` as :class:`GatedMLP`'s; ``transposed``:
    the weight is stored [in, out]."""

    transposed: bool = False
    tp_axis: int | None = 0

    def to_megatron(self, hf, tp, full_shape):
        rows = hf[0].transpose(0, 1) if self.transposed else hf[0]
        return transforms.merge_gated(rows[0::2], rows[1::2], tp)

    def to_hf(self, full, tp):
        rows = torch.stack(transforms.split_gated(full, tp), dim=1).flatten(0, 1)
        return (rows.transpose(0, 1) if self.transposed else rows,)


@dataclass(frozen=True)
class RopeRows(Mapping):
    """A projection whose output rows hold, every ``period`` rows, ``rope_dim`` rotary rows at ``offset``.

    Megatron's MLA reads rotary rows interleaved, ``x0 x1 x2 x3 ...`` rotating ``(x0, x1)``, as DeepSeek's
    checkpoints store them (``rope_interleave=True``), and de-interleaves them itself. Checkpoints with
    ``rope_interleave=False`` hold them in rotate-half order ``x0 x2 ... x1 x3 ...``: they are interleaved on load
    and de-interleaved on export. Periods are per head, so TP splits on head boundaries stay valid.
    """

    period: int = 0
    offset: int = 0
    rope_dim: int = 0

    def to_megatron(self, hf, tp, full_shape):
        return transforms.permute_rope_rows(hf[0], self.period, self.offset, self.rope_dim, inverse=True)

    def to_hf(self, full, tp):
        return (transforms.permute_rope_rows(full, self.period, self.offset, self.rope_dim),)


_DIGITS = re.compile(r"\d+")


def _shape(name: str) -> str:
    """A name with each run of digits as ``*``: the same for a pattern and every name it matches, where no wildcard
    touches a digit or another wildcard."""
    return _DIGITS.sub("*", name)


class MappingTable:
    """Resolves Megatron parameter names to their mapping; an unmapped or doubly-mapped name is an error.

    A name is matched against the patterns of its :func:`_shape` only (a few of the dozens a model declares): a
    sync or a dry run of DeepSeek-V3 resolves about 90,000 names."""

    def __init__(self, mappings: Sequence[Mapping]):
        self.mappings = tuple(mappings)
        self._by_shape: dict[str, list[tuple[re.Pattern, Mapping]]] = defaultdict(list)
        for m in self.mappings:
            if re.search(r"[\d*]\*|\*\d", m.megatron):
                raise ValueError(f"mapping {m.megatron!r}: a wildcard next to a digit or a wildcard is ambiguous")
            self._by_shape[_shape(m.megatron)].append((wildcard_regex(m.megatron), m))

    def resolve(self, megatron_name: str) -> tuple[Mapping, tuple[str, ...]]:
        candidates = self._by_shape.get(_shape(megatron_name), ())
        hits = [(m, match.groups()) for rx, m in candidates if (match := rx.match(megatron_name))]
        if not hits:
            raise KeyError(f"no mapping declared for Megatron parameter {megatron_name!r}")
        if len(hits) > 1:
            raise KeyError(f"Megatron parameter {megatron_name!r} matches several mappings: {[m for m, _ in hits]}")
        return hits[0]


@dataclass(frozen=True)
class Target:
    """A Megatron parameter as a checkpoint check sees it: global name, full shape, TP ranks it is split over."""

    name: str
    shape: tuple[int, ...]
    split_over: int = 1


@dataclass(frozen=True)
class TensorCheck:
    """What :func:`check_tensors` found: ``problems`` (none when the checkpoint forms the model), the HF tensors the
    targets read, and per HF tensor the targets that export it (more than one is a broken mapping)."""

    problems: list[str]
    consumed: set[str]
    exporters: dict[str, list[str]]


def check_tensors(table: MappingTable, targets: Iterable[Target], hf_shapes: dict[str, tuple[int, ...]]) -> TensorCheck:
    """Every target resolves to one mapping whose HF tensors are in ``hf_shapes`` and form the target's shape, and
    the target exports back to those shapes. Shapes only (meta tensors): the one check of a checkpoint against a
    model, before loading (trainer), converting (CLIs) or planning (dry runs)."""
    problems: list[str] = []
    consumed: set[str] = set()
    exporters: dict[str, list[str]] = defaultdict(list)
    round_trips: dict[tuple, tuple] = {}  # one per mapping and shapes: every layer and expert repeats a few
    for target in targets:
        try:
            mapping, captures = table.resolve(target.name)
        except KeyError as err:
            problems.append(err.args[0])
            continue
        names = mapping.hf_names(captures)
        missing = [n for n in names if n not in hf_shapes]
        if missing:
            problems.append(f"missing tensor(s) {missing} (needed for Megatron {target.name})")
            continue
        consumed.update(names)
        shapes = tuple(tuple(hf_shapes[n]) for n in names)
        want = tuple(target.shape)
        key = (mapping, shapes, want, target.split_over)
        if key not in round_trips:
            round_trips[key] = _round_trip(mapping, shapes, torch.Size(want), target.split_over)
        made, back = round_trips[key]
        if made != want:
            found = dict(zip(names, shapes, strict=True))
            problems.append(f"shape mismatch: {found} cannot form Megatron {target.name} of shape {want}")
        elif back != shapes:
            problems.append(
                f"Megatron {target.name} {want} exports to shapes {list(back)}, the checkpoint's {names} have "
                f"{list(shapes)}"
            )
        if mapping.export:
            for name in names:
                exporters[name].append(target.name)
    return TensorCheck(problems, consumed, dict(exporters))


def _round_trip(mapping: Mapping, shapes: tuple[tuple, ...], want: torch.Size, split_over: int) -> tuple:
    """Both directions on meta tensors: the shape the HF tensors form (``None`` if they cannot) and, where that is
    the wanted one, the shapes it exports to."""
    try:
        made = tuple(mapping.to_megatron([torch.empty(s, device="meta") for s in shapes], split_over, want).shape)
    except (RuntimeError, ValueError):
        made = None
    if made != tuple(want):
        return made, None
    return made, tuple(tuple(t.shape) for t in mapping.to_hf(torch.empty(want, device="meta"), split_over))


def unexpected_tensors(
    hf_shapes: dict[str, tuple[int, ...]], consumed: set[str], ignores: Callable[[str], bool]
) -> list[str]:
    """A problem naming the HF tensors no target reads (that the model does not ignore on purpose), if any."""
    left = sorted(n for n in hf_shapes if n not in consumed and not ignores(n))
    listed = ", ".join(f"{n} {tuple(hf_shapes[n])}" for n in left[:20]) + (" ..." if len(left) > 20 else "")
    return [f"{len(left)} unexpected tensor(s) with no Megatron parameter: {listed}"] if left else []
