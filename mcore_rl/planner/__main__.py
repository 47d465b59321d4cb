"""Dry run of a training config at full size, on any machine: ``python -m mcore_rl.planner RUN.yaml [overrides]``.

Validates the config as a run would, builds every pipeline stage of the trainer (and of the reference, when its
layout differs) on the meta device at ``runtime_args.num_devices``, checks the whole HF <-> Megatron mapping
against transformers' model, plans the rollout sync, and plans each phase's memory per device
(:mod:`mcore_rl.planner.memory`, with layouts that fit when the configured one does not), and predicts each
phase's time on a GPU of the device table (:mod:`mcore_rl.planner.steptime`). Exit status 2: bad
config; 1: the mapping check found errors or the run does not fit (each printed); 0: the report (also written as
JSON with ``--json``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="run YAML (as for python -m mcore_rl.train)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    parser.add_argument("--json", type=Path, help="also write the report here")
    parser.add_argument(
        "--device-memory-gb", type=float, help="GiB per device to plan memory for (default: runtime_args')"
    )
    parser.add_argument(
        "--device", default="h100", help="the GPU whose datasheet the step time is predicted for: h100, h200 or b200"
    )
    parser.add_argument(
        "--lengths", type=float, nargs=3, metavar=("PROMPT", "RESPONSE", "LONGEST"),
        help="mean prompt and response tokens and the longest response, for the step time (default: half the "
        "config's max_prompt_tokens, half its max_new_tokens, and max_new_tokens)",
    )  # fmt: skip
    # options and overrides in any order (the train scripts put theirs first); before the imports: --help answers
    args = parser.parse_intermixed_args(argv)
    import compat

    if not compat.start_cli(None):
        return 2
    from mcore_rl.config.loader import ConfigError
    from mcore_rl.config.schema import load_run_config
    from mcore_rl.planner.dry_run import dry_run
    from mcore_rl.planner.steptime import DEVICES

    if args.device not in DEVICES:
        parser.error(f"--device {args.device}: expected one of {', '.join(sorted(DEVICES))}")

    try:
        config = load_run_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return dry_run(config, args.device_memory_gb, args.json, DEVICES[args.device], args.lengths)


if __name__ == "__main__":
    sys.exit(main())
