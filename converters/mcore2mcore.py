"""Megatron distributed checkpoint -> Megatron distributed checkpoint for another layout (model weights only).

    mcore-rl-mcore2mcore CHECKPOINT OUTPUT --tp N [--pp N --vpp N --ep N --etp N] [--hf-config HF_DIR] [--dry-run]

Megatron reshards a checkpoint on load, so most layout changes need no conversion at all: a checkpoint loads
under any TP/PP/VPP/EP/ETP whose TP size pads the vocabulary to the same size. This converter writes the weights
again for a TP size that pads it differently (the vocabulary rows are re-padded through the model's mapping),
or in another dtype. Optimizer state is not carried over.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from converters.convert import (
    DTYPES,
    ConversionError,
    MegatronSource,
    Report,
    add_common_args,
    add_layout_args,
    finish_output,
    layout_of,
    model_files_dir,
    output_dir,
    parse_bytes,
    run_cli,
    write_megatron,
)
from converters.mapping import MappingTable
from converters.torch_dist import MODEL_SUBDIR, find_megatron, model_schema
from models.registry import get_bridge


class Repadded:
    """A source's full tensors re-made for another schema through the HF layout (exact for every mapping)."""

    def __init__(self, source: MegatronSource, table: MappingTable):
        self.source, self.table = source, table

    def dtype(self, slot):
        return self.source.dtype(slot)

    def full(self, slot, dtype):
        mapping, captures = self.table.resolve(slot.name)
        hf = mapping.to_hf(self.source.full(slot, dtype), 1)
        return mapping.to_megatron(hf, 1, slot.shape).contiguous()


def convert(args: argparse.Namespace) -> Report | None:
    checkpoint = find_megatron(args.checkpoint)
    if checkpoint is None:
        raise ConversionError(f"{args.checkpoint}: no Megatron distributed checkpoint here (nor in model/, policy/)")
    files = model_files_dir(args.checkpoint, args.hf_config)
    bridge = get_bridge(files)
    parallel = layout_of(args, bridge)
    vocab = bridge.padded_vocab_size(parallel.tp)
    source = MegatronSource(checkpoint, bridge)
    schema = model_schema(bridge, vocab)
    source.check(schema)
    if args.dry_run:
        print(
            f"would write {len(schema.keys())} tensors ({len(schema.slots)} parameters), vocabulary padded from "
            f"{source.reader.padded_vocab_size()} to {vocab} for TP={parallel.tp}, to {args.output / MODEL_SUBDIR}"
        )
        return None
    repadded = Repadded(source, MappingTable(bridge.mappings()))
    with output_dir(args.output, args.force) as out:
        report = write_megatron(
            repadded, schema, out / MODEL_SUBDIR, DTYPES[args.dtype], args.bucket_size, not args.quiet
        )
        info = {"format": "torch_dist", "layout": vars(parallel), "padded_vocab_size": vocab, "dtype": args.dtype}
        finish_output(out, files, {**info, "checkpoint": str(checkpoint)}, report)
    return report


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mcore-rl-mcore2mcore", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("checkpoint", type=Path, help="Megatron checkpoint directory (converted or from training)")
    p.add_argument("output", type=Path, help="output directory (created; must be empty unless --force)")
    p.add_argument("--hf-config", type=Path, help="HF directory with the model's config.json and tokenizer files")
    add_layout_args(p)
    p.add_argument("--bucket-size", type=parse_bytes, default="1GB", help="bytes per checkpoint file (default 1GB)")
    add_common_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    return run_cli(convert, parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
