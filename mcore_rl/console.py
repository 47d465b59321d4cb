"""What a run prints, and where the rest goes: each role's whole output (its prints, its libraries' C++ output,
every log record) in ``OUTPUT_DIR/logs/<role>-<rank>.log``, and only its warnings and errors on the console,
where the driver's progress bar and its line per episode stay readable. ``runtime_args.log.verbose`` keeps
everything on the console instead, as Ray forwards it.

The driver tells its actors the logs directory through the job's environment (:data:`LOGS_ENV`); a role's actor
calls :func:`setup_actor` first thing. Unnamed actors (reward functions, tools, environments: user code bounded
by its own deadlines) keep Ray's forwarding. vLLM's own log records (its engine's configuration notices) go to its
handler on stdout, so to the engine's file only; its errors reach the driver as the engine's exceptions.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from mcore_rl.watchdog import install_stack_dump

LOGS_ENV = "MCORE_RL_LOGS"
FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"  # of every log line: console, driver.log, role logs


def setup_actor() -> None:
    """A role's actor process: no upstream notices, its stacks for the hang watchdog, its output to its log file."""
    import compat

    compat.quiet_upstream_notices()
    install_stack_dump()
    logs = os.environ.get(LOGS_ENV)
    if not logs:
        return
    import ray

    name = ray.get_runtime_context().get_actor_name()
    if name:
        route_output(Path(logs) / f"{name.rsplit('/', 1)[-1]}.log")


def route_output(path: Path) -> None:
    """Everything this process writes to its stdout and stderr (file descriptors 1 and 2, so C++ output too) goes
    to ``path``; log records of WARNING and above also go to the stream stderr was, which Ray forwards to the
    driver's console."""
    path.parent.mkdir(parents=True, exist_ok=True)
    console = os.fdopen(os.dup(2), "w", buffering=1)
    sys.stdout.flush()
    sys.stderr.flush()
    with path.open("a") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    warnings_to = logging.StreamHandler(console)
    warnings_to.setLevel(logging.WARNING)
    warnings_to.setFormatter(logging.Formatter(FORMAT))
    everything = logging.StreamHandler(sys.stderr)  # now the file
    everything.setFormatter(logging.Formatter(FORMAT))
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    root.addHandler(everything)
    root.addHandler(warnings_to)
    logging.captureWarnings(True)  # Python warnings as log records: in the file, and on the console


def setup_driver(logs: Path) -> logging.Handler:
    """The driver's log records also in ``logs/driver.log`` (its console keeps its few INFO events); the handler,
    to remove when the run ends."""
    logs.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(logs / "driver.log")
    handler.setFormatter(logging.Formatter(FORMAT))
    logging.getLogger().addHandler(handler)
    return handler
