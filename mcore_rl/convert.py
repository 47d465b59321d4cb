"""The checkpoint converter CLIs: ``mcore-rl-hf2mcore``, ``mcore-rl-mcore2hf``, ``mcore-rl-mcore2mcore`` (also
``python -m mcore_rl.convert NAME ...``).

They sit above ``converters/`` (the streaming conversions) and ``models/`` (the bridges). Nothing heavy is imported
before the arguments are parsed, so ``--help`` answers at once; every bad input is one ``error:`` line and exit
status 2, with nothing left at the output (a failed conversion removes its partial directory).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

INFO_FILE = "mcore_rl_convert.json"
DTYPES = ("keep", "bfloat16", "float16", "float32")

HF2MCORE = """HF directory -> Megatron distributed checkpoint (torch_dist), streamed one parameter at a time.

    mcore-rl-hf2mcore HF_DIR OUTPUT [--tp N --pp N --vpp N --ep N --etp N] [--peft ADAPTER_DIR] [--dtype bfloat16]
                      [--dry-run]

OUTPUT gets the model's config.json and tokenizer files, ``mcore_rl_convert.json`` (provenance) and ``model/``,
the checkpoint (model weights only). Point ``models.policy_trainer.load`` / ``models.ref_policy.load`` at OUTPUT
to start training from it; the rollout engine keeps loading HF weights (``models.policy.load``). ``--peft`` adds a
PEFT LoRA adapter over HF_DIR (plain LoRA on the attention and MLP projections, q/k/v and gate/up sharing their
A, as ``mcore-rl-mcore2hf`` writes them) for a LoRA run to continue from: its rank, alpha and targets are written
to ``model/lora.json``, and the run's ``models.policy_trainer.lora`` must give the same.
"""

MCORE2HF = """Megatron distributed checkpoint (any layout) -> HF safetensors shards with an index, one parameter at a time.

    mcore-rl-mcore2hf CHECKPOINT OUTPUT [--hf-config HF_DIR] [--dtype bfloat16] [--max-shard-size 5GB] [--merge]
                      [--dry-run]

CHECKPOINT is a converted checkpoint (hf2mcore's OUTPUT), a training checkpoint (``checkpoints/episode_<n>``; only
the model is read) or a torch_dist directory itself. config.json and tokenizer files come from beside it, or from
``--hf-config``, and are copied to OUTPUT. A LoRA run's checkpoint (its frozen model and adapters) gives a PEFT
adapter directory (adapter_config.json, adapter_model.safetensors) whose base is ``--hf-config`` (give the HF model
the run started from), or with ``--merge`` the model with the adapters merged into its weights.
"""

MCORE2MCORE = """Megatron distributed checkpoint -> Megatron distributed checkpoint for another layout (model weights only).

    mcore-rl-mcore2mcore CHECKPOINT OUTPUT --tp N [--pp N --vpp N --ep N --etp N] [--hf-config HF_DIR] [--dry-run]

Megatron reshards a checkpoint on load, so most layout changes need no conversion at all: a checkpoint loads
under any TP/PP/VPP/EP/ETP whose TP size pads the vocabulary to the same size. This converter writes the weights
again for a TP size that pads it differently (the vocabulary rows are re-padded through the model's mapping),
or in another dtype. Optimizer state is not carried over.
"""


@dataclass(frozen=True)
class Command:
    """One converter: what it reads, whether it takes a target layout, and its output's size flag."""

    doc: str
    source: str  # "hf" (an HF directory) or "megatron" (a checkpoint of any layout)
    target: str  # "megatron" or "hf"

    def parser(self, name: str) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(
            prog=f"mcore-rl-{name}", description=self.doc, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        if self.source == "hf":
            p.add_argument("hf_dir", type=Path, help="HF model directory (config.json + safetensors, sharded or not)")
        else:
            p.add_argument("checkpoint", type=Path, help="Megatron checkpoint directory (converted or from training)")
        p.add_argument("output", type=Path, help="output directory (created; must be empty unless --force)")
        if self.source == "megatron":
            p.add_argument("--hf-config", type=Path, help="HF directory with the model's config.json and tokenizer")
        if self.source == "hf":
            p.add_argument("--peft", type=Path, help="a PEFT LoRA adapter over HF_DIR, converted with the model")
        if self.target == "megatron":
            _add_layout_args(p)
            p.add_argument("--bucket-size", type=parse_bytes, default="1GB", help="bytes per checkpoint file")
        else:
            p.add_argument("--max-shard-size", type=parse_bytes, default="5GB", help="bytes per safetensors file")
            p.add_argument("--merge", action="store_true", help="LoRA checkpoint: the merged model, not the adapter")
        p.add_argument("--dtype", choices=DTYPES, default="keep", help="cast the weights (default: keep)")
        p.add_argument("--force", action="store_true", help="replace a non-empty OUTPUT (once the new one is done)")
        p.add_argument("--dry-run", action="store_true", help="check everything and list what would be written")
        p.add_argument("--quiet", action="store_true", help="no progress bar")
        return p


COMMANDS = {
    "hf2mcore": Command(HF2MCORE, "hf", "megatron"),
    "mcore2hf": Command(MCORE2HF, "megatron", "hf"),
    "mcore2mcore": Command(MCORE2MCORE, "megatron", "megatron"),
}


def parse_bytes(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)B?\s*", text.upper())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size such as 512MB, 5GB or 1000000")
    return int(float(match.group(1)) * 1024 ** "_KMGT".index(match.group(2) or "_"))


def _add_layout_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "target layout",
        "The checkpoint loads under any layout whose TP size pads the vocabulary alike (Megatron reshards on "
        "load); the layout given here is checked against the model and fixes that padding.",
    )
    for flag, help_ in (("tp", "tensor"), ("pp", "pipeline"), ("vpp", "virtual pipeline"), ("ep", "expert")):
        group.add_argument(f"--{flag}", type=int, default=1, help=f"{help_} parallel size (default 1)")
    group.add_argument("--etp", type=int, default=None, help="expert tensor parallel size (default: --tp)")


def _layout(args, bridge):
    """The target layout from ``--tp/--pp/--vpp/--ep/--etp``, checked against the model."""
    from converters.convert import ConversionError
    from parallel.config import ParallelConfig

    sizes = dict(tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep, etp=args.etp)
    try:
        parallel = ParallelConfig(**sizes, sequence_parallel=args.tp > 1)
        bridge.validate_layout(parallel)
    except ValueError as err:
        raise ConversionError(f"layout {sizes}: {err}") from None
    return parallel


def _source(command: Command, args: argparse.Namespace):
    """(the input as a source of full Megatron tensors, the model's bridge, the directory of its config.json and
    tokenizer files, provenance); a model this project cannot build is a ConversionError naming the directory."""
    from converters.convert import ConversionError, HFSource, MegatronSource
    from converters.mapping import MappingTable
    from converters.torch_dist import find_megatron
    from models.registry import get_bridge

    if command.source == "hf":
        files, checkpoint, info = args.hf_dir, None, {}
    else:
        checkpoint = find_megatron(args.checkpoint)
        if checkpoint is None:
            raise ConversionError(
                f"{args.checkpoint}: no Megatron distributed checkpoint here (nor in model/, policy/)"
            )
        candidates = (args.hf_config, args.checkpoint, args.checkpoint.parent)
        files = next((d for d in candidates if d is not None and (d / "config.json").is_file()), None)
        if files is None:
            raise ConversionError(f"{args.checkpoint}: no config.json beside the checkpoint; pass --hf-config HF_DIR")
        info = {"checkpoint": str(checkpoint)}
    try:
        bridge = get_bridge(files)
    except ValueError as err:  # unsupported architecture or feature, unreadable config.json
        raise ConversionError(f"{files}: {err}") from None
    table = MappingTable(bridge.mappings())
    if checkpoint is None:
        return HFSource(files, bridge, table), bridge, files, info
    source = MegatronSource(checkpoint, bridge, table, merge=getattr(args, "merge", False))
    if source.adapters and command.target == "megatron":
        raise ConversionError(
            f"{checkpoint}: holds LoRA adapters; export them with mcore-rl-mcore2hf (PEFT or --merge)"
        )
    if getattr(args, "merge", False) and not source.adapters:
        raise ConversionError(f"{checkpoint}: --merge merges LoRA adapters, and this checkpoint holds none")
    experts = [k for k in (source.adapters.keys if source.adapters else ()) if ".local_experts." in k]
    if experts and command.target == "hf" and not getattr(args, "merge", False):
        raise ConversionError(
            f"{checkpoint}: holds adapters on routed experts (e.g. {experts[0]}), which PEFT cannot place on "
            "transformers' fused experts; export the merged model with --merge"
        )
    routers = source.adapters.routers if source.adapters else ()
    if routers and command.target == "hf" and not getattr(args, "merge", False):
        raise ConversionError(
            f"{checkpoint}: its routers trained beside the adapters (e.g. {routers[0]}), which a PEFT adapter "
            "cannot carry to vLLM; export the merged model with --merge"
        )
    return source, bridge, files, info


@dataclass(frozen=True)
class Plan:
    """A checked conversion: what ``--dry-run`` prints, how to write the output, and the output's provenance."""

    listing: list[str]
    write: Callable[[Path], object]  # output directory -> converters.convert.Report
    info: dict


def _to_megatron(args, source, bridge, dtype) -> Plan:
    """hf2mcore, mcore2mcore: the layout checked against the model and the source against its schema; the output is
    a torch_dist checkpoint under ``OUTPUT/model``."""
    from converters.convert import write_megatron
    from converters.torch_dist import LORA_FILE, MODEL_SUBDIR, model_schema

    parallel = _layout(args, bridge)
    vocab = bridge.padded_vocab_size(parallel.tp)
    schema = model_schema(bridge, vocab)
    lora = None
    if getattr(args, "peft", None):
        lora, schema = _with_peft(args.peft, source, bridge, schema, vocab)
    source.check(schema)
    total = sum(s.numel * (dtype or source.dtype(s)).itemsize for s in schema.slots)
    listing = [f"{key} {list(shape)}" for key, shape in schema.keys().items()]
    listing.append(
        f"would write {len(schema.keys())} tensors ({len(schema.slots)} parameters, vocabulary padded to {vocab} "
        f"for TP={parallel.tp}), {total / 1e9:.3f} GB, to {args.output / MODEL_SUBDIR}"
    )

    def write(out: Path):
        report = write_megatron(source, schema, out / MODEL_SUBDIR, dtype, args.bucket_size, not args.quiet)
        if lora is not None:  # what a run needs to continue from the adapters (the checkpoints of LoRA runs have it)
            (out / MODEL_SUBDIR / LORA_FILE).write_text(json.dumps({"rank": lora.rank, "alpha": lora.alpha}) + "\n")
        return report

    info = {"format": "torch_dist", "layout": vars(parallel), "padded_vocab_size": vocab}
    return Plan(listing, write, info | ({"lora": asdict(lora)} if lora else {}))


def _with_peft(directory: Path, source, bridge, schema, vocab: int):
    """(the LoRA settings of the PEFT adapter at ``directory``, the model's schema with those adapters), the
    adapter read into ``source``."""
    from megatron.core import parallel_state

    from converters.convert import ConversionError
    from converters.peft import PeftAdapter
    from converters.plan import MTP
    from converters.torch_dist import model_schema
    from models.lora import LINEARS, MLA, LoRAConfig, attach_lora

    # the weights mcore-rl adapts: the attention (MLA's too) and MLP linears (a dense MLP's or shared experts'), no
    # MTP layer's
    weights = [
        s.name for s in schema.slots
        if s.name.rsplit(".", 2)[-2] in (*LINEARS, *MLA) and ".experts." not in s.name and not s.name.startswith(MTP)
    ]  # fmt: skip
    try:
        source.peft = PeftAdapter(directory, source.table, weights)
    except ValueError as err:
        raise ConversionError(str(err)) from None
    peft = source.peft
    lora = LoRAConfig(rank=peft.rank, alpha=peft.alpha, targets=sorted({w.rsplit(".", 2)[-2] for w in peft.adapted}))

    def adapt(chunks):
        attach_lora(chunks, lora, 0, parallel_state.get_tensor_model_parallel_group())

    return lora, model_schema(bridge, vocab, adapt)


def _to_hf(args, source, bridge, dtype, files) -> Plan:
    """mcore2hf: safetensors shards of at most ``--max-shard-size`` bytes, with an index when there are several; or
    a LoRA checkpoint's PEFT adapter."""
    from converters.convert import hf_plan, write_hf, write_peft
    from converters.hf_io import shard_files

    if source.adapters and not args.merge:
        base = str(args.hf_config or files)
        adapters = source.adapters
        listing = [f"{name}: LoRA rank {adapters.rank}" for name in adapters.keys]
        listing.append(
            f"would write a PEFT adapter ({len(adapters.keys)} adapted weights) over {base} to {args.output}"
        )
        return Plan(listing, lambda out: write_peft(source, out, base, dtype), {"format": "peft"})

    entries = hf_plan(source, source.schema, source.table, dtype)
    listing = [
        f"{file} {e.name} {list(e.shape)} {str(e.dtype).removeprefix('torch.')}"
        for file, shard in shard_files(entries, args.max_shard_size)
        for e in shard
    ]
    listing.append(
        f"would write {len(entries)} tensors, {sum(e.nbytes for e in entries) / 1e9:.3f} GB, to {args.output}"
    )
    return Plan(
        listing,
        lambda out: write_hf(source, source.schema, source.table, out, dtype, args.max_shard_size, not args.quiet),
        {"format": "safetensors"},
    )


def convert(command: Command, args: argparse.Namespace):
    """Check everything on metadata, then list (``--dry-run``: returns None) or write the output (its Report)."""
    import torch

    from converters.convert import output_dir
    from converters.hf_io import copy_model_files
    from mcore_rl.checkpoint import MARKER

    source, bridge, files, provenance = _source(command, args)
    dtype = None if args.dtype == "keep" else getattr(torch, args.dtype)
    if command.target == "megatron":
        plan = _to_megatron(args, source, bridge, dtype)
    else:
        plan = _to_hf(args, source, bridge, dtype, files)
    if args.dry_run:
        print("\n".join(plan.listing))
        return None
    given = (getattr(args, "hf_dir", None), getattr(args, "checkpoint", None), getattr(args, "peft", None), files)
    inputs = tuple(p for p in given if p)
    with output_dir(args.output, args.force, inputs) as out:
        report = plan.write(out)
        if plan.info["format"] != "peft":  # an adapter directory holds the adapter alone
            copy_model_files(files, out, skip=(MARKER,))  # a training checkpoint's marker is not the output's
        record = {"source": str(files.resolve()), **provenance, **plan.info, "dtype": args.dtype, **asdict(report)}
        (out / INFO_FILE).write_text(json.dumps(record | {"command": sys.argv}, indent=1, default=str) + "\n")
    return report


def main(name: str, argv: list[str] | None = None) -> int:
    """Run converter ``name``; a ConversionError, missing input or unusable checkpoint is one readable message and
    exit status 2."""
    command = COMMANDS[name]
    args = command.parser(name).parse_args(argv)
    import compat

    if not compat.start_cli("%(message)s"):
        return 2
    from converters.convert import ConversionError

    start = time.perf_counter()
    try:
        report = convert(command, args)
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


def hf2mcore(argv: list[str] | None = None) -> int:
    return main("hf2mcore", argv)


def mcore2hf(argv: list[str] | None = None) -> int:
    return main("mcore2hf", argv)


def mcore2mcore(argv: list[str] | None = None) -> int:
    return main("mcore2mcore", argv)


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        sys.exit(f"usage: python -m mcore_rl.convert {{{','.join(COMMANDS)}}} ARGS... (--help after the name)")
    sys.exit(main(sys.argv[1], sys.argv[2:]))
