"""Offline conversions between HF directories and Megatron distributed checkpoints, one parameter at a time.

Each conversion walks the model's :class:`~converters.torch_dist.Schema` slot by slot: the full Megatron tensor of
one parameter is made (from its HF tensors through the bridge's mapping, or read from a checkpoint) and written
(as checkpoint chunks, or as HF tensors through the same mapping). Memory holds about one parameter plus one write
bucket, whatever the model's size. Everything a conversion needs is checked on metadata before it writes a byte.
The CLIs (:mod:`mcore_rl.convert`) drive it; sources take the model's bridge as an argument, so this layer
knows no model family.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from converters import peft
from converters.hf_io import HFCheckpoint, SafetensorsWriter, TensorEntry
from converters.mapping import MappingTable, Target, check_tensors, unexpected_tensors
from converters.peft import PeftAdapter, peft_config, peft_tensors, target_modules
from converters.plan import ADAPTERS, adapted_slot, router_copy
from converters.torch_dist import LORA_FILE, Reader, Schema, Slot, Writer, model_schema


class ConversionError(ValueError):
    """Input that cannot be converted; the message lists every problem found (nothing was written)."""


def _fail(source, problems: list[str]) -> None:
    if problems:
        shown = problems[:40] + ([f"... and {len(problems) - 40} more"] if len(problems) > 40 else [])
        raise ConversionError(f"{source}:\n  " + "\n  ".join(shown))


# ---- the two sides of a slot ----------------------------------------------------------------------------------
class HFSource:
    """Full Megatron tensors made from an HF directory's tensors through the bridge's mappings; with ``peft``, a
    PEFT adapter over them gives the slots of the LoRA adapters (``lora.<key>.a``/``.b``)."""

    def __init__(self, hf_dir: Path, bridge, table: MappingTable, peft: PeftAdapter | None = None):
        try:
            self.ckpt = HFCheckpoint(hf_dir, bridge.expert_stacks())
        except ValueError as err:  # a quantization it cannot read
            raise ConversionError(str(err)) from None
        self.bridge, self.table, self.peft = bridge, table, peft

    @staticmethod
    def _adapter(slot: Slot) -> tuple[str, str] | None:
        """(the adapted weight, "a" or "b") of an adapter's slot; None for the model's own."""
        if not slot.name.startswith(ADAPTERS):
            return None
        key, factor = slot.name.removeprefix(ADAPTERS).rsplit(".", 1)
        return adapted_slot(key) + ".weight", factor

    def check(self, schema: Schema) -> None:
        """Every tensor present with shapes that form the model's, and none left over (on metadata only); every
        adapter of the schema in the PEFT adapter."""
        shapes = self.ckpt.shapes
        own = [Target(slot.name, slot.shape) for slot in schema.slots if self._adapter(slot) is None]
        check = check_tensors(self.table, own, shapes)
        problems = check.problems + unexpected_tensors(shapes, check.consumed, self.bridge.ignores)
        adapted = self.peft.adapted if self.peft else {}
        wanted = {w for w, _ in filter(None, map(self._adapter, schema.slots))}
        problems += [
            f"{w}: not adapted by {self.peft.dir}, while others of its kind are" for w in sorted(wanted - set(adapted))
        ]
        _fail(self.ckpt.dir, problems)

    def dtype(self, slot: Slot) -> torch.dtype:
        if adapter := self._adapter(slot):
            return self.peft.dtype(adapter[0])
        mapping, captures = self.table.resolve(slot.name)
        return self.ckpt.dtype(mapping.hf_names(captures)[0])

    def full(self, slot: Slot, dtype: torch.dtype | None) -> torch.Tensor:
        if adapter := self._adapter(slot):
            full = self.peft.factor(*adapter, torch.Size(slot.shape))
            return full if dtype is None else full.to(dtype)
        mapping, captures = self.table.resolve(slot.name)
        hf = [self.ckpt.get(n) for n in mapping.hf_names(captures)]
        try:
            full = mapping.to_megatron(hf, 1, torch.Size(slot.shape)).contiguous()
        except ValueError as err:  # tensors that cannot form the parameter (copies that differ)
            raise ConversionError(f"{self.ckpt.dir}: {err}") from None
        return full if dtype is None else full.to(dtype)


@dataclass(frozen=True)
class Adapters:
    """The LoRA adapters of a checkpoint (:mod:`models.lora`): ``keys`` maps each adapted weight's slot to its
    adapter's checkpoint key prefix, whose ``a`` [r, in] and ``b`` [out, r] are stored whole in the full Megatron
    layout of the weight's rows (a gated MLP's B gate and up apart, as its weight). ``routers``: the routers the run
    trained beside them (their copies as loaded are checkpointed with the adapters; the model holds them trained)."""

    rank: int
    alpha: float
    keys: dict[str, str]
    routers: tuple[str, ...] = ()

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def of(cls, reader: Reader) -> Adapters | None:
        prefixes = sorted(
            {k.rsplit(".", 1)[0] for k in reader.tensors if k.startswith(ADAPTERS) and not router_copy(k)}
        )
        routers = sorted(
            {adapted_slot(k.rsplit(".", 1)[0].removeprefix(ADAPTERS)) for k in reader.tensors if router_copy(k)}
        )
        if not prefixes:
            return None
        settings = reader.dir / LORA_FILE
        if not settings.is_file():
            raise ConversionError(f"{reader.dir}: holds LoRA adapters but no {LORA_FILE} (their rank and alpha)")
        lora = json.loads(settings.read_text())
        keys = {adapted_slot(p.removeprefix(ADAPTERS)) + ".weight": p for p in prefixes}
        return cls(int(lora["rank"]), float(lora["alpha"]), keys, tuple(routers))


class MegatronSource:
    """Full Megatron tensors read from a torch_dist checkpoint saved under any layout. A slot asked for at
    another shape (the vocabulary padded for another TP size) is re-made through the HF layout of its mapping.
    A checkpoint with LoRA adapters (``adapters``) gives its weights merged with them when ``merge``, else the frozen
    model's (the adapters then export apart, :func:`write_peft`)."""

    def __init__(self, directory: Path, bridge, table: MappingTable, merge: bool = False):
        self.reader, self.bridge, self.table, self.merge = Reader(directory), bridge, table, merge
        self.adapters = Adapters.of(self.reader)
        self.schema = model_schema(bridge, self.reader.padded_vocab_size())
        self.slots = {s.name: s for s in self.schema.slots}
        problems = self.reader.problems(self.schema)
        if self.adapters:
            problems += [
                f"LoRA adapter of {name}: no such parameter" for name in self.adapters.keys if name not in self.slots
            ]
        _fail(directory, problems)

    def adapter(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(A, B) of the adapter of the weight ``name`` in fp32, or None."""
        prefix = self.adapters.keys.get(name) if self.adapters else None
        if prefix is None:
            return None
        return self.reader.whole(f"{prefix}.a", torch.float32), self.reader.whole(f"{prefix}.b", torch.float32)

    def check(self, schema: Schema) -> None:
        missing = [s.name for s in schema.slots if s.name not in self.slots]
        _fail(self.reader.dir, [f"no parameter {name}" for name in missing])

    def dtype(self, slot: Slot) -> torch.dtype:
        return self.reader.dtype(self.slots[slot.name])

    def full(self, slot: Slot, dtype: torch.dtype | None) -> torch.Tensor:
        stored = self.slots[slot.name]
        try:
            full = self.reader.read(stored, dtype)
        except ValueError as err:  # a data file that does not decode
            raise ConversionError(str(err)) from None
        adapter = self.adapter(slot.name) if self.merge else None
        if adapter is not None:
            a, b = adapter
            full = (full.float() + self.adapters.scale * b @ a).to(full.dtype)
        if stored.shape == slot.shape:
            return full
        mapping, _ = self.table.resolve(slot.name)
        return mapping.to_megatron(mapping.to_hf(full, 1), 1, torch.Size(slot.shape)).contiguous()


def hf_tensors_of(table: MappingTable, slot: Slot, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    mapping, captures = table.resolve(slot.name)
    if not mapping.export:
        return []
    return list(zip(mapping.hf_names(captures), mapping.to_hf(full, 1), strict=True))


# ---- the conversions ------------------------------------------------------------------------------------------
@dataclass
class Report:
    tensors: int = 0
    bytes: int = 0
    files: int = 0
    seconds: float = 0.0


def write_megatron(
    source, schema: Schema, out: Path, dtype: torch.dtype | None, bucket_bytes: int, progress: bool
) -> Report:
    writer = Writer(out, bucket_bytes)
    total = sum(s.numel * (dtype or source.dtype(s)).itemsize for s in schema.slots)
    with tqdm(total=total, unit="B", unit_scale=True, desc="writing", disable=not progress) as bar:
        for slot in schema.slots:
            full = source.full(slot, dtype)
            for piece in slot.pieces:
                writer.tensor(piece, piece.of(full))
            bar.update(full.numel() * full.element_size())
        for key, data in schema.objects.items():
            writer.object(key, data)
        writer.close(schema.common)
    return Report(len(writer.metadata), writer.bytes_written, writer.files)


def _hf_tensors(source, schema: Schema, table: MappingTable, full) -> Iterator[tuple[str, torch.Tensor]]:
    """Every slot's HF tensors in write order, from ``full(slot)`` (its full Megatron tensor); a family's stacked
    expert tensors stacked (:mod:`converters.stacks`)."""
    tensors = (pair for slot in schema.slots for pair in hf_tensors_of(table, slot, full(slot)))
    stacks = source.bridge.expert_stacks()
    return tensors if stacks is None else stacks.stack(tensors)


def hf_plan(source, schema: Schema, table: MappingTable, dtype: torch.dtype | None) -> list[TensorEntry]:
    """The HF tensors a model's slots export to, in write order (shapes from the mappings on meta tensors)."""

    def meta(slot: Slot) -> torch.Tensor:
        return torch.empty(slot.shape, dtype=dtype or source.dtype(slot), device="meta")

    return [TensorEntry(name, t.dtype, tuple(t.shape)) for name, t in _hf_tensors(source, schema, table, meta)]


def write_hf(
    source, schema: Schema, table: MappingTable, out: Path, dtype: torch.dtype | None, shard_bytes: int, progress
) -> Report:
    entries = hf_plan(source, schema, table, dtype)
    writer = SafetensorsWriter(out, entries, shard_bytes)
    with tqdm(
        total=sum(e.nbytes for e in entries), unit="B", unit_scale=True, desc="writing", disable=not progress
    ) as bar:
        for name, tensor in _hf_tensors(source, schema, table, lambda slot: source.full(slot, dtype)):
            writer.write(name, tensor)
            bar.update(tensor.numel() * tensor.element_size())
        writer.close()
    return Report(len(entries), sum(e.nbytes for e in entries), len(writer.shards))


def write_peft(source: MegatronSource, out: Path, base: str, dtype: torch.dtype | None) -> Report:
    """The checkpoint's LoRA adapters as a PEFT adapter directory over the HF model ``base``
    (:mod:`converters.peft`)."""
    tensors = {}
    for name in source.adapters.keys:
        a, b = source.adapter(name)
        mapping, captures = source.table.resolve(name)
        for peft_name, tensor in peft_tensors(mapping, captures, a, b, 1):
            tensors[peft_name] = tensor.to(dtype or torch.float32).clone()
    save_file(tensors, out / peft.WEIGHTS)  # adapters are small: one file
    lora = source.adapters
    config = peft_config(lora.rank, lora.alpha, target_modules(tensors), base)
    (out / peft.CONFIG).write_text(json.dumps(config, indent=1) + "\n")
    return Report(len(tensors), sum(t.numel() * t.element_size() for t in tensors.values()), 1)


@contextlib.contextmanager
def output_dir(path: Path, force: bool, inputs: tuple[Path, ...] = ()) -> Iterator[Path]:
    """A sibling ``.<name>.partial`` directory, renamed to ``path`` only once the body has finished, so an
    interrupted conversion never leaves anything at ``path`` (and a failed one is removed). A non-empty ``path`` is
    replaced only with ``force``, only after the new output is complete (the old one moved aside first, removed
    last), and never when it holds one of the ``inputs``."""
    if path.exists() and any(path.iterdir()) and not force:
        raise ConversionError(f"{path}: exists and is not empty (pass --force to replace it)")
    for source in inputs:
        if source.resolve().is_relative_to(path.resolve()):
            raise ConversionError(f"{path}: holds the input {source}; write the output somewhere else")
    partial = path.with_name(f".{path.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)  # an interrupted earlier attempt
    partial.mkdir(parents=True)
    try:
        yield partial
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)  # a failed conversion leaves nothing behind
        raise
    if not path.exists():
        partial.rename(path)
        return
    old = path.with_name(f".{path.name}.replaced")
    shutil.rmtree(old, ignore_errors=True)
    path.rename(old)  # a crash from here on leaves the old output beside, never neither
    partial.rename(path)
    shutil.rmtree(old)
