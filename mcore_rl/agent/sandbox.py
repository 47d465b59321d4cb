"""Run untrusted Python (a policy's code) in a child interpreter confined by the kernel
(:mod:`mcore_rl.agent.jail`: namespaces, no capabilities, rlimits, Landlock, seccomp).

What the code sees: the standard library and system shared libraries read-only, a private work directory (a
tmpfs of ``max_file_mb``, gone with the process) read-write, no network, no other process (it can start none,
signal none, trace none), and limits it cannot raise: address space, CPU seconds, file size, open files. The
parent kills it at the wall-clock limit; it dies with its parent. Its output goes to an unnamed file capped by the
same file-size limit, and only the end is read back, so printing gigabytes costs the host nothing.

:meth:`Sandbox.start` probes once per process which layers the kernel allows and logs them; every run then
requires the same layers (the child refuses to run the code when one fails). Without Landlock and seccomp there
is no sandbox, and the start is refused unless ``unsafe_without_kernel_isolation`` says otherwise.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

from mcore_rl.agent import jail

log = logging.getLogger(__name__)

KERNEL_LAYERS = ("landlock", "seccomp")  # without both there is no boundary (files; processes and sockets)
_WORKDIR_PREFIX = "mcore_rl_sandbox."


class SandboxUnavailableError(RuntimeError):
    """The kernel allows no isolation layer the sandbox needs."""


@dataclass
class SandboxConfig:
    """The child's limits (``models.reward.sandbox``)."""

    timeout_s: float = 5.0  # wall clock; the CPU limit is the same number of seconds, rounded up
    memory_mb: int = 512  # address space
    max_output_chars: int = 2000  # of stdout + stderr, from the end (a traceback's last line is its message)
    max_file_mb: int = 16  # its work directory's size, and the largest file or output it may write
    # Run the python tool and environment even where the kernel allows neither Landlock nor seccomp: the code then
    # reads and writes what the run's user can, starts processes and opens sockets. Never for a policy under RL.
    unsafe_without_kernel_isolation: bool = False

    def validate(self, prefix: str) -> None:
        for name, lowest in (("timeout_s", 0.1), ("memory_mb", 64), ("max_output_chars", 1), ("max_file_mb", 1)):
            if getattr(self, name) < lowest:
                raise ValueError(f"{prefix}.{name}={getattr(self, name)}: expected at least {lowest}")


@dataclass(frozen=True)
class Isolation:
    """The layers a probe child got (name -> detail), and why it did not get the others."""

    layers: dict[str, str] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)

    @property
    def kernel_enforced(self) -> bool:
        return all(layer in self.layers for layer in KERNEL_LAYERS)

    def describe(self) -> str:
        got = ", ".join(f"{name} ({detail})" for name, detail in self.layers.items()) or "none"
        missing = "; ".join(f"{name}: {error}" for name, error in self.errors.items())
        return f"kernel layers: {got}" + (f"; unavailable: {missing}" if missing else "")


def probe(config: SandboxConfig) -> Isolation:
    """Which layers the kernel allows here, found by confining a child as a run does (and loading the standard
    library in it)."""
    with _Workdir() as workdir:
        done = subprocess.run(
            _command(workdir, config, "--probe"), capture_output=True, text=True, timeout=60, cwd=workdir, env={}
        )
    if done.returncode != 0:
        return Isolation(
            errors={"probe": f"the confined child failed (status {done.returncode}): {done.stderr[-500:]}"}
        )
    report = json.loads(done.stdout)
    return Isolation(report["layers"], report["errors"])


class Sandbox:
    """The configured limits and the layers every run must get. Picklable: actors run it as it was started."""

    def __init__(self, config: SandboxConfig, required: tuple[str, ...]):
        self.config, self.required = config, required

    @classmethod
    def start(cls, config: SandboxConfig, key: str = "models.reward.sandbox") -> Sandbox:
        """Probe the kernel, log what isolates the code, and refuse when nothing does (unless opted out)."""
        _remove_orphans()
        isolation = probe(config)
        if not isolation.kernel_enforced:
            if not config.unsafe_without_kernel_isolation:
                raise SandboxUnavailableError(
                    f"the python sandbox needs the kernel's Landlock and seccomp, and this machine does not allow "
                    f"them ({isolation.describe()}); run on a kernel with Landlock (Linux >= 5.13, 'landlock' in "
                    f"the lsm= boot list) outside a container profile that blocks it, or drop the python tool and "
                    f"environment; {key}.unsafe_without_kernel_isolation: true runs the code unconfined"
                )
            log.warning("python sandbox WITHOUT kernel isolation (%s=true): %s", key, isolation.describe())
        else:
            log.info("python sandbox: %s", isolation.describe())
        return cls(config, tuple(isolation.layers))

    def run(self, code: str) -> str:
        """The code's output (stdout and stderr as written, the end kept when too long), or what stopped it.
        Never raises for anything the code does: that is the result."""
        config = self.config
        with _Workdir() as workdir, tempfile.TemporaryFile() as out:
            command = _command(workdir, config, ",".join(self.required) or "-")
            child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=out, stderr=out, cwd=workdir, env={})
            with contextlib.suppress(BrokenPipeError):  # a child that refused to start reads nothing
                child.stdin.write(code.encode("utf-8", "replace"))  # it reads all of it before anything else
            child.stdin.close()
            if not _exits_within(child, config.timeout_s):
                child.kill()  # it has no children to leave behind
                child.wait()
                return f"error: timed out after {config.timeout_s:g} s"
            output = _tail(out, config.max_output_chars)
            if out.tell() >= config.max_file_mb << 20:
                output += f"\nerror: the output reached the {config.max_file_mb} MB limit"
        if child.returncode == jail.REFUSED:
            return f"error: the sandbox could not start: {output.strip()[-300:]}"
        if child.returncode < 0:
            output += f"\nerror: killed by signal {-child.returncode} (time or memory limit)"
        return output


# The jail imported as a module, so its cached bytecode is used (compiling it as a script took a third of a short
# run); its directory leaves sys.path before the policy's code runs.
_BOOT = f"import sys; sys.path.insert(0, {os.path.dirname(jail.__file__)!r}); import jail; del sys.path[0]; jail.main()"


def _command(workdir: str, config: SandboxConfig, required: str) -> list[str]:
    limits = (config.memory_mb << 20, int(config.timeout_s) + 1, config.max_file_mb << 20)
    return [sys.executable, "-I", "-S", "-c", _BOOT, workdir, *map(str, limits), required, str(os.getpid())]


def _exits_within(child: subprocess.Popen, seconds: float) -> bool:
    """Wait for ``child`` to exit, at most ``seconds``: on a pidfd, which wakes at the exit itself (``Popen.wait``
    with a timeout polls with growing sleeps, which doubled the latency of a short run)."""
    fd = os.pidfd_open(child.pid)
    try:
        exited = bool(select.select([fd], [], [], seconds)[0])
    finally:
        os.close(fd)
    if exited:
        child.wait()
    return exited


def _tail(out, max_chars: int) -> str:
    """The last ``max_chars`` characters of the output file (undecodable bytes replaced)."""
    start = max(0, out.seek(0, os.SEEK_END) - 4 * max_chars)  # a character is at most 4 bytes
    out.seek(start)
    text = out.read().decode("utf-8", "replace")
    return "[...]" + text[-max_chars:] if start or len(text) > max_chars else text


class _Workdir:
    """A temporary directory named after this process (so another can tell it is orphaned), removed on exit."""

    def __enter__(self) -> str:
        self.path = tempfile.mkdtemp(prefix=f"{_WORKDIR_PREFIX}{os.getpid()}.")
        return self.path

    def __exit__(self, *exc) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def _remove_orphans() -> None:
    """Work directories of processes that died mid-run (a tool actor killed at its timeout)."""
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        match = re.fullmatch(re.escape(_WORKDIR_PREFIX) + r"(\d+)\..*", name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
