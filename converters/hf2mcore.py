"""HF directory -> Megatron distributed checkpoint (torch_dist), streamed one parameter at a time.

    mcore-rl-hf2mcore HF_DIR OUTPUT [--tp N --pp N --vpp N --ep N --etp N] [--dtype bfloat16] [--dry-run]

OUTPUT gets the model's config.json and tokenizer files, ``mcore_rl_convert.json`` (provenance) and ``model/``,
the checkpoint (model weights only). Point ``models.policy_trainer.load`` / ``models.ref_policy.load`` at OUTPUT
to start training from it; the rollout engine keeps loading HF weights (``models.policy.load``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from converters.convert import (
    HFSource,
    Report,
    add_common_args,
    add_layout_args,
    convert_to_megatron,
    parse_bytes,
    run_cli,
)
from converters.mapping import MappingTable
from models.registry import get_bridge


def convert(args: argparse.Namespace) -> Report | None:
    bridge = get_bridge(args.hf_dir)
    source = HFSource(args.hf_dir, bridge, MappingTable(bridge.mappings()))
    return convert_to_megatron(args, bridge, source, args.hf_dir, {})


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mcore-rl-hf2mcore", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("hf_dir", type=Path, help="HF model directory (config.json + safetensors, sharded or not)")
    p.add_argument("output", type=Path, help="output directory (created; must be empty unless --force)")
    add_layout_args(p)
    p.add_argument("--bucket-size", type=parse_bytes, default="1GB", help="bytes per checkpoint file (default 1GB)")
    add_common_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    return run_cli(convert, parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
