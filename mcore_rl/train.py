"""Train with RL: ``python -m mcore_rl.train RUN.yaml [dotted.key=value ...]``.

Validates the whole config (keys, types, layouts against devices and the model, data files, the reward function,
whether each phase fits the devices' memory) before anything is written, then runs :func:`mcore_rl.driver.run`.
Re-running the same command resumes from the newest complete checkpoint. Exit status 2: bad input, with one
``error:`` line naming the key or file and what was expected.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="run YAML (runtime_args + models.*)")
    parser.add_argument(
        "overrides", nargs="*", help="dotted.key=value overrides, e.g. models.policy.num_inference_per_prompt=4"
    )
    args = parser.parse_args(argv)  # before the imports below: --help answers at once
    import compat
    from mcore_rl.console import FORMAT

    if not compat.start_cli(FORMAT):  # the console's lines as the role logs' and driver.log's
        return 2
    with compat.importing():  # torch, Megatron-Core and Ray
        from mcore_rl.checkpoint import CheckpointError
        from mcore_rl.config.loader import ConfigError
        from mcore_rl.config.schema import load_run_config
        from mcore_rl.driver import run
        from mcore_rl.planner.memory import check_fits
        from mcore_rl.rollout.transport import SharedMemoryError
        from mcore_rl.userfile import UserCodeError
        from mcore_rl.watchdog import HangError

    try:
        config = load_run_config(args.config, args.overrides)
        unfit = check_fits(config)  # hours of queueing are not spent to find this out at the first step
        if unfit:
            raise ConfigError("the run does not fit its devices' memory\n" + "\n".join(unfit))
        run(config)
    # Bad input: found before anything is written (config, data, reward/environment/tool files), when the cluster
    # is known (which devices it has), or in the user's reward function (named with the sample) during the run.
    except (ConfigError, UserCodeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except (CheckpointError, HangError) as err:  # a full disk, a hung phase: what was written before stays valid
        print(f"error: {err}", file=sys.stderr)
        return 1
    except Exception as err:  # a machine that cannot run the job, found in a rank: one line, as bad input
        if not isinstance(getattr(err, "cause", None), SharedMemoryError):
            raise
        print(f"error: {err.cause}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
