"""Megatron distributed checkpoint (any layout) -> HF safetensors shards with an index, one parameter at a time.

    mcore-rl-mcore2hf CHECKPOINT OUTPUT [--hf-config HF_DIR] [--dtype bfloat16] [--max-shard-size 5GB] [--dry-run]

CHECKPOINT is a converted checkpoint (hf2mcore's OUTPUT), a training checkpoint (``checkpoints/episode_<n>``; only
the model is read) or a torch_dist directory itself. config.json and tokenizer files come from beside it, or from
``--hf-config``, and are copied to OUTPUT.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from converters.convert import (
    DTYPES,
    MegatronSource,
    Report,
    add_common_args,
    finish_output,
    hf_plan,
    open_megatron,
    output_dir,
    parse_bytes,
    run_cli,
    write_hf,
)
from converters.hf_io import shard_files
from converters.mapping import MappingTable


def convert(args: argparse.Namespace) -> Report | None:
    checkpoint, files, bridge = open_megatron(args)
    table = MappingTable(bridge.mappings())
    source = MegatronSource(checkpoint, bridge, table)
    dtype = DTYPES[args.dtype]
    if args.dry_run:
        entries = hf_plan(source, source.schema, table, dtype)
        for file, shard in shard_files(entries, args.max_shard_size):
            for e in shard:
                print(f"{file} {e.name} {list(e.shape)} {str(e.dtype).removeprefix('torch.')}")
        print(f"would write {len(entries)} tensors, {sum(e.nbytes for e in entries) / 1e9:.3f} GB, to {args.output}")
        return None
    with output_dir(args.output, args.force) as out:
        report = write_hf(source, source.schema, table, out, dtype, args.max_shard_size, not args.quiet)
        finish_output(out, files, {"format": "safetensors", "checkpoint": str(checkpoint), "dtype": args.dtype}, report)
    return report


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mcore-rl-mcore2hf", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("checkpoint", type=Path, help="Megatron checkpoint directory")
    p.add_argument("output", type=Path, help="output HF directory (created; must be empty unless --force)")
    p.add_argument("--hf-config", type=Path, help="HF directory with the model's config.json and tokenizer files")
    p.add_argument("--max-shard-size", type=parse_bytes, default="5GB", help="bytes per safetensors file (default 5GB)")
    add_common_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    return run_cli(convert, parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
