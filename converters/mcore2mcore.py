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
    MegatronSource,
    Report,
    add_common_args,
    add_layout_args,
    convert_to_megatron,
    open_megatron,
    parse_bytes,
    run_cli,
)
from converters.mapping import MappingTable


def convert(args: argparse.Namespace) -> Report | None:
    checkpoint, files, bridge = open_megatron(args)
    source = MegatronSource(checkpoint, bridge, MappingTable(bridge.mappings()))
    return convert_to_megatron(args, bridge, source, files, {"checkpoint": str(checkpoint)})


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
