"""``python -m benchmarks [suite ...] --out DIR``: measure the machine, run the suites, write ``DIR/report.md``
and its PNG plots.

Suites: rl (end-to-end GRPO against TRL's GRPOTrainer), agent (word problems with and without the calculator
tool), algorithms (one SmolLM2 run per advantage estimator: rloo, reinforce_pp, gae, distillation), rewards (the math
checker alone, with a reward model weighted in, and with judges), lora (LoRA against full fine-tuning), experts
(grouped vs sequential experts), packing (utilisation and speed-up on long-tailed lengths), sync (trainer -> engine
weight sync), convert (hf2mcore and mcore2hf on a generated multi-GB checkpoint), checkpoint (the trainer's save and
resume, per-rank against gathered optimizer state), sandbox (the code sandbox's
start-up, per-call cost and tool calls per second), lm_head (peak memory of the loss's log-probs and entropy at
4k-32k tokens, unchunked and chunked), steptime (the planner's step-time model against a peer's published runs;
the rl suite sets it against this machine's phases). No suite: all. The same commands run on a GPU machine (bf16
peak, NCCL, CUDA IPC).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import shlex
import sys
from pathlib import Path

from benchmarks import (
    agent,
    algorithms,
    checkpoint,
    convert,
    experts,
    lm_head,
    lora,
    packing,
    rewards,
    rl,
    sandbox,
    steptime,
    sync,
)
from benchmarks.hardware import measure
from benchmarks.report import Report, table

SUITES = {
    "rl": rl, "agent": agent, "algorithms": algorithms, "rewards": rewards, "lora": lora, "experts": experts,
    "packing": packing, "sync": sync, "convert": convert, "checkpoint": checkpoint, "sandbox": sandbox,
    "lm_head": lm_head, "steptime": steptime,
}  # fmt: skip


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    parser.add_argument("suites", nargs="*", choices=[[], *SUITES], help="default: all")
    parser.add_argument("--out", required=True, type=Path, help="directory for report.md, plots and run outputs")
    parser.add_argument(
        "--episodes",
        type=int,
        default=4,
        help="rl, agent, algorithms, rewards, lora: episodes per run (rl leaves out the first)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="rl: runs of mcore-rl and of the peer, alternating")
    names = ",".join(v.name for v in rl.VARIANTS)
    parser.add_argument("--variants", default=names, help=f"rl: comma-separated variants (default {names}; '' none)")
    parser.add_argument(
        "--new-tokens", type=int, default=rl.NEW_TOKENS, help="rl: tokens per completion, every run's and TRL's"
    )
    parser.add_argument("--convert-gb", type=float, default=3.0, help="convert: size of the generated checkpoint")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    suites = args.suites or list(SUITES)
    args.out = args.out.resolve()  # the runs' commands have their own working directories
    args.out.mkdir(parents=True, exist_ok=True)
    hardware = measure(args.out)
    report = Report(args.out)
    header = "\n\n".join(
        [
            f"# Benchmarks, {datetime.date.today().isoformat()}",
            f"Command: `{shlex.join(['python', '-m', 'benchmarks', *argv])}`",
            "Measured at the start of the run:",
            table(["", ""], hardware.rows()),
        ]
    )
    for name in suites:
        logging.info("suite %s", name)
        if name == "rl":
            variants = [v for v in args.variants.split(",") if v]
            rl.suite(args.out, hardware, report, args.episodes, args.repeats, variants, args.new_tokens)
        elif name in ("agent", "algorithms", "rewards", "lora"):
            SUITES[name].suite(args.out, hardware, report, args.episodes)
        elif name == "convert":
            convert.suite(args.out, hardware, report, args.convert_gb)
        else:
            SUITES[name].suite(args.out, hardware, report)
        path = report.write(header)  # after every suite: a later failure keeps what was measured
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
