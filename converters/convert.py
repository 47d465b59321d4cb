"""Offline conversions between HF directories and Megatron distributed checkpoints, one parameter at a time.

Each conversion walks the model's :class:`~converters.torch_dist.Schema` slot by slot: the full Megatron tensor of
one parameter is made (from its HF tensors through the bridge's mapping, or read from a checkpoint) and written
(as checkpoint chunks, or as HF tensors through the same mapping). Memory holds about one parameter plus one write
bucket, whatever the model's size. Everything a conversion needs is checked on metadata before it writes a byte.
The CLIs (``hf2mcore``, ``mcore2hf``, ``mcore2mcore``) share the output handling below.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from converters.hf_io import HFCheckpoint, SafetensorsWriter, TensorEntry, copy_model_files
from converters.mapping import MappingTable
from converters.torch_dist import MODEL_SUBDIR, Reader, Schema, Slot, Writer, find_megatron, model_schema
from models.registry import get_bridge
from parallel.config import ParallelConfig

log = logging.getLogger(__name__)

INFO_FILE = "mcore_rl_convert.json"
DTYPES = {"keep": None, "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class ConversionError(ValueError):
    """Input that cannot be converted; the message lists every problem found (nothing was written)."""


def _fail(source, problems: list[str]) -> None:
    if problems:
        shown = problems[:40] + ([f"... and {len(problems) - 40} more"] if len(problems) > 40 else [])
        raise ConversionError(f"{source}:\n  " + "\n  ".join(shown))


# ---- the two sides of a slot ----------------------------------------------------------------------------------
class HFSource:
    """Full Megatron tensors made from an HF directory's tensors through the bridge's mappings."""

    def __init__(self, hf_dir: Path, bridge, table: MappingTable):
        try:
            self.ckpt = HFCheckpoint(hf_dir)
        except ValueError as err:  # a quantization it cannot read
            raise ConversionError(str(err)) from None
        self.bridge, self.table = bridge, table

    def check(self, schema: Schema) -> None:
        """Every tensor present with shapes that form the model's, and none left over (on metadata only)."""
        problems, consumed = [], set()
        for slot in schema.slots:
            mapping, captures = self.table.resolve(slot.name)
            names = mapping.hf_names(captures)
            missing = [n for n in names if n not in self.ckpt.weight_map]
            if missing:
                problems.append(f"missing tensor(s) {missing} (needed for Megatron {slot.name})")
                continue
            consumed.update(names)
            shapes = [self.ckpt.shape(n) for n in names]
            try:
                made = mapping.to_megatron([torch.empty(s, device="meta") for s in shapes], 1, torch.Size(slot.shape))
                ok = tuple(made.shape) == slot.shape
            except (RuntimeError, ValueError):
                ok = False
            if not ok:
                problems.append(
                    f"shape mismatch: {dict(zip(names, shapes, strict=True))} cannot form Megatron "
                    f"{slot.name} of shape {slot.shape}"
                )
        unexpected = sorted(n for n in self.ckpt.names() - consumed if not self.bridge.ignores(n))
        if unexpected:
            problems.append(f"{len(unexpected)} unexpected tensor(s) with no Megatron parameter: {unexpected[:20]}")
        _fail(self.ckpt.dir, problems)

    def dtype(self, slot: Slot) -> torch.dtype:
        mapping, captures = self.table.resolve(slot.name)
        return self.ckpt.dtype(mapping.hf_names(captures)[0])

    def full(self, slot: Slot, dtype: torch.dtype | None) -> torch.Tensor:
        mapping, captures = self.table.resolve(slot.name)
        hf = [self.ckpt.get(n) for n in mapping.hf_names(captures)]
        full = mapping.to_megatron(hf, 1, torch.Size(slot.shape)).contiguous()
        return full if dtype is None else full.to(dtype)


class MegatronSource:
    """Full Megatron tensors read from a torch_dist checkpoint saved under any layout. A slot asked for at
    another shape (the vocabulary padded for another TP size) is re-made through the HF layout of its mapping."""

    def __init__(self, directory: Path, bridge, table: MappingTable):
        self.reader, self.table = Reader(directory), table
        self.schema = model_schema(bridge, self.reader.padded_vocab_size())
        self.slots = {s.name: s for s in self.schema.slots}
        _fail(directory, self.reader.problems(self.schema))

    def check(self, schema: Schema) -> None:
        missing = [s.name for s in schema.slots if s.name not in self.slots]
        _fail(self.reader.dir, [f"no parameter {name}" for name in missing])

    def dtype(self, slot: Slot) -> torch.dtype:
        return self.reader.dtype(self.slots[slot.name])

    def full(self, slot: Slot, dtype: torch.dtype | None) -> torch.Tensor:
        stored = self.slots[slot.name]
        full = self.reader.read(stored, dtype)
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


def hf_plan(source, schema: Schema, table: MappingTable, dtype: torch.dtype | None) -> list[TensorEntry]:
    """The HF tensors a model's slots export to, in write order (shapes from the mappings on meta tensors)."""
    entries = []
    for slot in schema.slots:
        meta = torch.empty(slot.shape, dtype=dtype or source.dtype(slot), device="meta")
        entries += [TensorEntry(name, t.dtype, tuple(t.shape)) for name, t in hf_tensors_of(table, slot, meta)]
    return entries


def write_hf(
    source, schema: Schema, table: MappingTable, out: Path, dtype: torch.dtype | None, shard_bytes: int, progress
) -> Report:
    entries = hf_plan(source, schema, table, dtype)
    writer = SafetensorsWriter(out, entries, shard_bytes)
    with tqdm(
        total=sum(e.nbytes for e in entries), unit="B", unit_scale=True, desc="writing", disable=not progress
    ) as bar:
        for slot in schema.slots:
            for name, tensor in hf_tensors_of(table, slot, source.full(slot, dtype)):
                writer.write(name, tensor)
                bar.update(tensor.numel() * tensor.element_size())
        writer.close()
    return Report(len(entries), sum(e.nbytes for e in entries), len(writer.shards))


# ---- CLI plumbing ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def output_dir(path: Path, force: bool) -> Iterator[Path]:
    """A sibling ``.<name>.partial`` directory, renamed to ``path`` only once the body has finished, so an
    interrupted conversion never leaves anything at ``path``. A non-empty ``path`` is replaced only with
    ``force``, and only after the new output is complete."""
    if path.exists() and any(path.iterdir()) and not force:
        raise ConversionError(f"{path}: exists and is not empty (pass --force to replace it)")
    partial = path.with_name(f".{path.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)  # an interrupted earlier attempt
    partial.mkdir(parents=True)
    yield partial
    if path.exists():
        shutil.rmtree(path)
    partial.rename(path)


def parse_bytes(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)B?\s*", text.upper())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size such as 512MB, 5GB or 1000000")
    return int(float(match.group(1)) * 1024 ** "_KMGT".index(match.group(2) or "_"))


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", choices=list(DTYPES), default="keep", help="cast the weights (default: keep)")
    parser.add_argument("--force", action="store_true", help="replace a non-empty OUTPUT (once the new one is done)")
    parser.add_argument("--dry-run", action="store_true", help="check everything and list what would be written")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def add_layout_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "target layout",
        "The checkpoint loads under any layout whose TP size pads the vocabulary alike (Megatron reshards on "
        "load); the layout given here is checked against the model and fixes that padding.",
    )
    for flag, help_ in (("tp", "tensor"), ("pp", "pipeline"), ("vpp", "virtual pipeline"), ("ep", "expert")):
        group.add_argument(f"--{flag}", type=int, default=1, help=f"{help_} parallel size (default 1)")
    group.add_argument("--etp", type=int, default=None, help="expert tensor parallel size (default: --tp)")


def layout_of(args, bridge) -> ParallelConfig:
    """The target layout from ``--tp/--pp/--vpp/--ep/--etp``, checked against the model."""
    sizes = dict(tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep, etp=args.etp)
    try:
        parallel = ParallelConfig(**sizes, sequence_parallel=args.tp > 1)
        bridge.validate_layout(parallel)
    except ValueError as err:
        raise ConversionError(f"layout {sizes}: {err}") from err
    return parallel


def run_cli(main: Callable[[argparse.Namespace], Report | None], parser: argparse.ArgumentParser, argv) -> int:
    """Parse, run, report; a ConversionError or missing input is one readable message and exit status 2."""
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.perf_counter()
    try:
        report = main(args)
    except (ConversionError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if report is not None:
        report.seconds = round(time.perf_counter() - start, 1)
        log.info(
            "done: %d tensors, %.3f GB in %d files, %.1f s",
            report.tensors,
            report.bytes / 1e9,
            report.files,
            report.seconds,
        )
    return 0


def finish_output(out: Path, source: Path, info: dict, report: Report) -> None:
    """Copy the model's config/tokenizer files and record where the output came from."""
    copy_model_files(source, out)
    record = {"source": str(source.resolve()), **info, **asdict(report), "command": sys.argv}
    (out / INFO_FILE).write_text(json.dumps(record, indent=1, default=str) + "\n")


def open_megatron(args) -> tuple[Path, Path, object]:
    """A Megatron checkpoint CLI's input: its torch_dist directory, the directory of its config.json and
    tokenizer files (beside it, or ``--hf-config``), and the model's bridge."""
    checkpoint = find_megatron(args.checkpoint)
    if checkpoint is None:
        raise ConversionError(f"{args.checkpoint}: no Megatron distributed checkpoint here (nor in model/, policy/)")
    for files in (args.hf_config, args.checkpoint, args.checkpoint.parent):
        if files is not None and (files / "config.json").is_file():
            return checkpoint, files, get_bridge(files)
    raise ConversionError(f"{args.checkpoint}: no config.json beside the checkpoint; pass --hf-config HF_DIR")


def convert_to_megatron(args, bridge, source, files: Path, info: dict) -> Report | None:
    """The Megatron-writing CLIs' common part: the target layout checked against the model, ``source`` checked
    against its schema, then ``--dry-run``'s listing or the checkpoint written to ``args.output``."""
    parallel = layout_of(args, bridge)
    vocab = bridge.padded_vocab_size(parallel.tp)
    schema = model_schema(bridge, vocab)
    source.check(schema)
    dtype = DTYPES[args.dtype]
    if args.dry_run:
        for key, shape in schema.keys().items():
            print(f"{key} {list(shape)}")
        total = sum(s.numel * (dtype or source.dtype(s)).itemsize for s in schema.slots)
        print(
            f"would write {len(schema.keys())} tensors ({len(schema.slots)} parameters, vocabulary padded to "
            f"{vocab} for TP={parallel.tp}), {total / 1e9:.3f} GB, to {args.output / MODEL_SUBDIR}"
        )
        return None
    with output_dir(args.output, args.force) as out:
        report = write_megatron(source, schema, out / MODEL_SUBDIR, dtype, args.bucket_size, not args.quiet)
        layout = {"layout": vars(parallel), "padded_vocab_size": vocab}
        finish_output(out, files, {"format": "torch_dist", **layout, "dtype": args.dtype, **info}, report)
    return report
