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
    DTYPES,
    HFSource,
    Report,
    add_common_args,
    add_layout_args,
    finish_output,
    layout_of,
    output_dir,
    parse_bytes,
    run_cli,
    write_megatron,
)
from converters.mapping import MappingTable
from converters.torch_dist import MODEL_SUBDIR, model_schema
from models.registry import get_bridge


def convert(args: argparse.Namespace) -> Report | None:
    bridge = get_bridge(args.hf_dir)
    parallel = layout_of(args, bridge)
    vocab = bridge.padded_vocab_size(parallel.tp)
    schema = model_schema(bridge, vocab)
    source = HFSource(args.hf_dir, bridge, MappingTable(bridge.mappings()))
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
        info = {"format": "torch_dist", "layout": vars(parallel), "padded_vocab_size": vocab, "dtype": args.dtype}
        finish_output(out, args.hf_dir, info, report)
    return report


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
