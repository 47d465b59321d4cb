"""Run untrusted Python (a policy's code) in a child interpreter with time, memory and output limits, no network,
and no file access outside a fresh temporary directory.

Two layers, so the guarantees hold where the kernel layer is not allowed: the child leaves the host's network
namespace when the kernel lets it (``unshare``; as root, or with unprivileged user namespaces), and always
installs an audit hook (PEP 578, which Python code cannot remove) that refuses sockets, subprocesses, ``ctypes``,
reads outside its directory and the Python installation, and any write or file-system change outside its
directory. Limits are rlimits of the child: address space, CPU seconds, file size; the parent kills it at the
wall-clock limit.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

# Runs in the child before the policy's code (read from stdin before the hook closes the door).
_BOOTSTRAP = r"""
import ctypes, os, resource, sys
workdir, memory, seconds, file_bytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
code = sys.stdin.read()
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds))
resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNET, CLONE_NEWUSER = 0x40000000, 0x10000000
if libc.unshare(CLONE_NEWNET) != 0:
    libc.unshare(CLONE_NEWUSER | CLONE_NEWNET)
os.chdir(workdir)
home = os.path.realpath(workdir) + os.sep
readable = tuple({os.path.realpath(p) + os.sep for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}) + (home,)
REFUSED = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.fork", "os.forkpty", "os.kill",
           "ctypes.", "os.putenv", "os.unsetenv", "sys.addaudithook", "os.chroot", "pty.")
CHANGES = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.link", "os.symlink",
           "os.truncate", "os.utime", "shutil.")
LOOKS = ("os.listdir", "os.scandir", "os.chdir")

def inside(path, roots):
    if path is None or isinstance(path, int):
        return True  # the working directory, or an already open descriptor
    return (os.path.realpath(os.fsdecode(path)) + os.sep).startswith(roots)

def hook(event, args):
    if event.startswith(REFUSED):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open":
        path, mode, flags = args
        writes = (mode and any(c in mode for c in "wax+")) or (flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
        if path is not None and not inside(path, (home,) if writes else readable):
            raise PermissionError(f"sandbox: no access to {path!r} outside the working directory")
    elif event.startswith(CHANGES) and args and not inside(args[0], (home,)):
        raise PermissionError(f"sandbox: {event} outside the working directory")
    elif event.startswith(LOOKS) and args and not inside(args[0], readable):
        raise PermissionError(f"sandbox: {event} outside the working directory")

sys.addaudithook(hook)
del ctypes, libc
exec(compile(code, "<code>", "exec"), {"__name__": "__main__"})
"""


@dataclass
class SandboxConfig:
    """The child's limits (``models.reward.sandbox``)."""

    timeout_s: float = 5.0  # wall clock; the CPU limit is the same number of seconds, rounded up
    memory_mb: int = 512  # address space
    max_output_chars: int = 2000  # of stdout + stderr, from the end (a traceback's last line is its message)
    max_file_mb: int = 16  # the largest file the code may write in its directory

    def validate(self, prefix: str) -> None:
        for name, lowest in (("timeout_s", 0.1), ("memory_mb", 64), ("max_output_chars", 1), ("max_file_mb", 1)):
            if getattr(self, name) < lowest:
                raise ValueError(f"{prefix}.{name}={getattr(self, name)}: expected at least {lowest}")


def run_python(code: str, config: SandboxConfig) -> str:
    """The code's output (stdout then stderr, the end kept when too long), or what stopped it. Never raises for
    the code's own failures: they are the result."""
    workdir = tempfile.mkdtemp(prefix="mcore_rl_sandbox_")
    args = [
        sys.executable, "-I", "-S", "-c", _BOOTSTRAP, workdir,
        str(config.memory_mb << 20), str(int(config.timeout_s) + 1), str(config.max_file_mb << 20),
    ]  # fmt: skip
    try:
        done = subprocess.run(
            args, input=code, capture_output=True, text=True, timeout=config.timeout_s, cwd=workdir, env={}
        )
    except subprocess.TimeoutExpired:
        return f"error: timed out after {config.timeout_s:g} s"
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    output = done.stdout + done.stderr
    if len(output) > config.max_output_chars:
        output = "[...]" + output[-config.max_output_chars :]
    if done.returncode < 0:
        output += f"\nerror: killed by signal {-done.returncode} (time or memory limit)"
    return output
